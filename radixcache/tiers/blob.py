"""The shared tier's blob format: what a published snapshot looks like in a store.

``magic | header length (u32 LE) | JSON header | state bytes | KV bytes | digest``: the header names
the layout, depth, publisher and fingerprint (and ``state_bytes``, ``kv_bytes``); the state is the
slot's conv rows then its recurrent rows, raw; the digest is :func:`blob_digest` (blake2b, keyed
with the deployment's secret when it has one) over the store key and every byte before it, so a
blob verifies only under the address it was published for.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BLOB_MAGIC", "DIGEST_BYTES", "blob_digest", "bytes_tensor", "encode_blob", "parse_blob"]

BLOB_MAGIC = b"RCSHARE2"  # 2: a trailing digest over the address and every byte before it
DIGEST_BYTES = 32
_PERSON = b"radixcache-blob"  # blake2b personalisation: these digests mean nothing elsewhere
_LEN = struct.Struct("<I")


def blob_digest(key: str, signed: bytes | memoryview, secret: bytes | None = None) -> bytes:
    """The digest a blob ends with: blake2b (32 bytes, keyed with ``secret`` when given) over the
    store ``key`` the blob is published under and ``signed``, every byte of the blob before the
    digest (magic, header length, header, state, KV). O(len(signed)).

    :raises TypeError: ``key`` not a string, ``signed`` or ``secret`` not bytes.
    :raises ValueError: a ``secret`` longer than 64 bytes."""
    if not isinstance(key, str):
        raise TypeError(f"key must be the store key (a string), got {type(key).__name__}")
    if not isinstance(signed, (bytes, bytearray, memoryview)) or not isinstance(secret, (bytes, bytearray, type(None))):
        raise TypeError(f"signed and secret must be bytes, got {type(signed).__name__} and {type(secret).__name__}")
    if secret is not None and len(secret) > 64:
        raise ValueError(f"secret must hold at most 64 bytes (blake2b's key), got {len(secret)}")
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, key=secret or b"", person=_PERSON)
    h.update(key.encode() + b"\0")
    h.update(signed)
    return h.digest()


def encode_blob(
    header: dict[str, object],
    state: bytes | memoryview | Sequence[torch.Tensor],
    kv: bytes | memoryview,
    *,
    key: str,
    secret: bytes | None = None,
) -> memoryview:
    """A blob: magic, header length, JSON header (which must give ``state_bytes`` and
    ``kv_bytes``), the state's raw bytes (conv rows, then recurrent rows: given as bytes, or as the
    CPU tensors whose bytes they are, in order), the KV bytes, then :func:`blob_digest` of all that
    under ``key`` (keyed with ``secret``): a blob verifies only under the key it was encoded for.

    Returned as a read-only view of a buffer of its own, which nothing else writes: the caller may
    keep it. Each byte is copied once, and the copies of more than a few bytes and the digest run
    without the interpreter lock: a writer thread encoding a 100 MB snapshot leaves the scheduler's
    thread to run (``benchmarks/bench_shared_threads.py``). O(blob bytes).

    :raises TypeError: a state tensor not on the CPU.
    """
    h = json.dumps(header, sort_keys=True).encode()
    head = BLOB_MAGIC + _LEN.pack(len(h)) + h
    parts: list[np.ndarray] = [np.frombuffer(head, dtype=np.uint8)]
    for part in (state,) if isinstance(state, (bytes, bytearray, memoryview)) else state:
        parts.append(_raw(part))
    parts.append(_raw(kv))
    signed = sum(int(p.size) for p in parts)
    out = np.empty(signed + DIGEST_BYTES, dtype=np.uint8)  # not zeroed: every byte is written below
    at = 0
    for p in parts:
        out[at : at + p.size] = p  # numpy copies without the interpreter lock
        at += p.size
    view = out.data
    out[signed:] = np.frombuffer(blob_digest(key, view[:signed], secret), dtype=np.uint8)
    return view.toreadonly()


def _raw(part: bytes | bytearray | memoryview | torch.Tensor) -> np.ndarray:
    """``part``'s bytes as a flat uint8 array (a view where it can be: no copy of a contiguous
    tensor or a buffer)."""
    if isinstance(part, torch.Tensor):
        if part.device.type != "cpu":
            raise TypeError(f"a blob's state tensors must be on the CPU, got one on {part.device}")
        return part.contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.frombuffer(part, dtype=np.uint8) if memoryview(part).nbytes else np.empty(0, dtype=np.uint8)


def parse_blob(blob: bytes | memoryview) -> tuple[dict[str, object], memoryview] | None:
    """Header and body (state, KV and digest; a view of ``blob``, not a copy) of a blob, or None
    when it is not one (or was cut inside its header)."""
    n = len(BLOB_MAGIC)
    if len(blob) < n + _LEN.size or blob[:n] != BLOB_MAGIC:
        return None
    (hl,) = _LEN.unpack_from(blob, n)
    start = n + _LEN.size
    if len(blob) < start + hl:
        return None
    try:
        header = json.loads(bytes(blob[start : start + hl]))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    return header, memoryview(blob)[start + hl :]


def bytes_tensor(data: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes as a tensor of ``dtype`` and ``shape``: a copy (the blob may go), made without the
    interpreter lock (a fetcher thread copying a 77 MB state leaves the scheduler's thread to run)."""
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out
