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

import torch

__all__ = ["BLOB_MAGIC", "DIGEST_BYTES", "blob_digest", "bytes_tensor", "encode_blob", "parse_blob", "tensor_bytes"]

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
    header: dict[str, object], state: bytes, kv: bytes | memoryview, *, key: str, secret: bytes | None = None
) -> bytes:
    """A blob: magic, header length, JSON header (which must give ``state_bytes`` and
    ``kv_bytes``), the state's raw bytes (conv rows, then recurrent rows), the KV bytes, then
    :func:`blob_digest` of all that under ``key`` (keyed with ``secret``): a blob verifies only
    under the key it was encoded for."""
    h = json.dumps(header, sort_keys=True).encode()
    signed = BLOB_MAGIC + _LEN.pack(len(h)) + h + state + kv
    return signed + blob_digest(key, signed, secret)


def parse_blob(blob: bytes) -> tuple[dict[str, object], memoryview] | None:
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
        header = json.loads(blob[start : start + hl])
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    return header, memoryview(blob)[start + hl :]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's raw bytes (any dtype, bf16 included)."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def bytes_tensor(data: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes as a tensor of ``dtype`` and ``shape`` (a copy: the blob may go)."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
