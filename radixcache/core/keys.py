"""Cache keys: the one contract every call that takes ids applies, and the canonical byte form the
tree compares.

The key contract (``match``, ``insert``, ``admit``, ``can_admit``, ``plan_decode``, image ids):

- a key is an **ordered** 1-D sequence of token ids: a ``list``, ``tuple`` or other
  :class:`~collections.abc.Sequence`, a numpy array or a torch tensor. Unordered containers
  (``set``, ``dict``), strings, bytes, scalars and ``None`` raise ``TypeError``;
- ids are **integers**: numpy and torch integer dtypes, Python ``int`` and numpy integer
  elements. Floats, bools (a numpy or torch bool dtype, or a list with a bool at either end; a
  bool inside a list of ints is not looked for, to keep the check O(1)) and other element types
  raise ``TypeError``;
- ids are in ``[0, 2**31)``: text ids below ``2**30``, image-derived cache ids in
  ``[2**30, 2**31)`` (see DESIGN.md, "Multimodal keys"). An id outside raises ``ValueError``
  naming the first bad position and the value as given;
- a key of the wrong shape (not 1-D) raises ``ValueError``.

Keys are stored as native ``uint32`` bytes, so the tree compares edges with ``memcmp`` and
indexes children by the bytes of their first page.

A :class:`CacheKey` is a key checked and converted once: every call that takes a key takes it as
it is, without checking or converting its ids again. A host that hands the same ids to several
calls (a lookup, then the policy's request info; a checkpoint that the tree files and the policy
and forensics hear of) builds one at its boundary.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import TypeAlias, final

import numpy as np
import torch

from .native import MODULE as _NATIVE

__all__ = ["CacheKey", "KeyLike", "MAX_ID", "IMAGE_ID_BASE", "key_bytes", "TOKEN_BYTES"]

KeyLike: TypeAlias = "CacheKey | Sequence[int] | np.ndarray | torch.Tensor"
"""What the tree accepts as a key: a :class:`CacheKey`, or list, tuple, numpy or torch 1-D integer ids."""

MAX_ID = 2**31
"""Ids must be below this."""
IMAGE_ID_BASE = 2**30
"""Image-derived cache ids start here; text ids stay below."""
TOKEN_BYTES = 4


def _bad_position(values: np.ndarray) -> ValueError:
    """The first id outside the range, in ``values``' own dtype (a huge unsigned id stays itself)."""
    low = values < 0 if values.dtype.kind == "i" else np.zeros(values.shape, dtype=bool)
    bad = np.flatnonzero(low | (values >= MAX_ID))
    i = int(bad[0])
    return ValueError(f"key id {values[i].item()} at position {i} is outside [0, 2**31)")


_LITTLE = sys.byteorder == "little"


def _in_range(b: bytes) -> bool:
    """Native uint32 ids in ``b`` are all below ``2**31`` (int32 ones all >= 0): the top bit of
    every id's most significant byte is clear. NOTE: one strided copy and one ``isascii`` (a
    word-at-a-time C loop) instead of a numpy ``min``: the key's validation inside a W1 insert
    went from 5.3 to 2.5 us, the harness's full match from 8.7 to 7.1 us (docs/benchmarks.md)."""
    return b[3::4].isascii() if _LITTLE else b[0::4].isascii()


# Most significant bytes below 0x40 stay themselves, the others become 0x80: the translation is
# ASCII exactly when every id is below IMAGE_ID_BASE (2**30: bits 30 and 31 clear).
_TEXT_ONLY = bytes(range(0x40)) + b"\x80" * 0xC0


def _has_images(b: bytes) -> bool:
    """Some native uint32 id in ``b`` is at least ``IMAGE_ID_BASE`` (bytes read as in :func:`_in_range`)."""
    top = b[3::4] if _LITTLE else b[0::4]
    return not top.translate(_TEXT_ONLY).isascii()


def _from_array(arr: np.ndarray) -> bytes:
    kind = arr.dtype.kind
    if kind not in "iu":
        raise TypeError(f"key ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"a key must be 1-D, got shape {tuple(arr.shape)}")
    if arr.itemsize == TOKEN_BYTES or arr.itemsize == 8:
        if not arr.dtype.isnative:  # the canonical bytes are native: a byte-swapped key is the same key
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if arr.itemsize == TOKEN_BYTES:
            b = arr.tobytes()  # int32 or uint32 in range: these are the canonical bytes
            if not _in_range(b):
                raise _bad_position(arr)
            return b
        return _from_words64(np.ascontiguousarray(arr), arr)[0]
    # 1- and 2-byte ids cannot reach the bound: only a signed one can be out of range (negative)
    if arr.size and kind == "i" and arr.min() < 0:
        raise _bad_position(arr)
    return arr.astype(np.uint32).tobytes()


def _from_words64(buf: np.ndarray | array[int], given: np.ndarray | array[int]) -> tuple[bytes, int]:
    """:func:`_from_words64_py`, natively where the extension is built
    (:data:`radixcache.core.native.NATIVE`; one C pass: inside SGLang's scheduler the reference's
    ten buffer calls cost ~5 us per key); the reference raises for an id out of range. With the
    bytes, whether an id is an image id: 1 or 0 when the native pass read it, -1 (not known: the
    key finds out when asked) from the reference."""
    if _NATIVE is not None:
        got = _NATIVE.words_to_key(buf)
        if got is not None:
            return got[0], int(got[1])
    return _from_words64_py(buf, given), -1


def _from_words64_py(buf: np.ndarray | array[int], given: np.ndarray | array[int]) -> bytes:
    """The canonical bytes of the native 8-byte ids in the contiguous buffer ``buf``: in range when
    the high 32-bit word of each is zero and the low one is in range; the low words are then the
    canonical bytes. NOTE: memoryview and bytes operations, no numpy: inside SGLang's scheduler,
    between forward passes, a numpy max() over a request's 200 ids cost ~6 us and each numpy call
    about 1 us; this whole conversion costs about what that max did alone."""
    words = memoryview(buf).cast("B").cast("I")  # type: ignore[arg-type]  # numpy arrays are buffers
    low, high = (words[0::2], words[1::2]) if _LITTLE else (words[1::2], words[0::2])
    b, h = low.tobytes(), high.tobytes()
    if h.count(0) != len(h) or not _in_range(b):
        if not isinstance(given, np.ndarray):  # an array.array: its ids as numpy, for the message
            given = np.frombuffer(given, dtype=np.int64 if given.typecode in "ql" else np.uint64)
        raise _bad_position(given)
    return b


def key_bytes(key: KeyLike) -> bytes:
    """Validate ``key`` and return its canonical bytes (native uint32 per token). O(len(key));
    O(1) for a :class:`CacheKey` (checked when it was built).

    >>> len(key_bytes([1, 2, 3]))
    12

    :raises TypeError: not an ordered sequence, or ids that are not integers (see the module
        docstring). :raises ValueError: not 1-D, or an id outside ``[0, 2**31)`` (the message names
        the first bad position and the value as given).
    """
    if type(key) is CacheKey:
        return key.data
    if isinstance(key, np.ndarray):
        return _from_array(key)
    if type(key) is array and key.itemsize == 8 and key.typecode in "qQlL":  # SGLang's array("q")
        return _from_words64(key, key)[0]
    if isinstance(key, torch.Tensor):
        if key.dtype.is_floating_point or key.dtype.is_complex or key.dtype == torch.bool:
            raise TypeError(f"key ids must be integers, got dtype {key.dtype}")
        return _from_array(key.detach().cpu().numpy())
    return _from_sequence(key)


def _from_sequence(key: object) -> bytes:
    if not isinstance(key, Sequence) or isinstance(key, (str, bytes, bytearray)):
        raise TypeError(
            f"a key is an ordered sequence of token ids (list, tuple, numpy array or torch tensor), "
            f"got {type(key).__name__}"
        )
    if key and (type(key[0]) is bool or type(key[-1]) is bool):
        i = 0 if type(key[0]) is bool else len(key) - 1
        raise TypeError(f"key id {key[i]!r} at position {i} is a bool, not a token id")
    try:
        raw = array("I", key)
    except (OverflowError, TypeError):
        # Slow path only to build a precise message.
        for i, v in enumerate(key):
            if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
                raise TypeError(f"key id {v!r} at position {i} is not an integer") from None
            if not 0 <= v < MAX_ID:
                raise ValueError(f"key id {v} at position {i} is outside [0, 2**31)") from None
        raise
    b = raw.tobytes()
    if raw.itemsize != TOKEN_BYTES:  # pragma: no cover - platforms where unsigned int is not 32-bit
        return _from_array(np.asarray(raw, dtype=np.int64))
    if not _in_range(b):
        raise _bad_position(np.frombuffer(b, dtype=np.uint32))
    return b


@final
class CacheKey:
    """A key checked and converted once (see the module docstring): its canonical bytes, the
    same ids every call that takes a key would compute. Immutable; equal keys (same ids) are
    equal and hash alike.

    >>> k = CacheKey([1, 2, 3])
    >>> len(k), k.prefix(2) == CacheKey([1, 2]), k.has_images
    (3, True, False)

    :param ids: any key (:data:`KeyLike`); a ``CacheKey`` is taken as it is.
    :raises TypeError, ValueError: as :func:`key_bytes`.
    """

    # _images: -1 not known yet, 0 no image ids, 1 some
    __slots__ = ("_images", "data")

    data: bytes
    """The canonical bytes (native uint32 per token), what :func:`key_bytes` returns."""
    _images: int

    def __init__(self, ids: KeyLike) -> None:
        if type(ids) is CacheKey:
            self.data, self._images = ids.data, ids._images
        elif type(ids) is array and ids.itemsize == 8 and ids.typecode in "qQlL":
            # NOTE: SGLang's array("q"): whether an id is an image id comes with the conversion's
            # one native pass; asked later (every admission's and checkpoint's request info), it
            # was a second pass over the bytes, ~2 us each inside SGLang's scheduler (session 35)
            self.data, self._images = _from_words64(ids, ids)
        else:
            self.data, self._images = key_bytes(ids), -1

    @classmethod
    def frombytes(cls, data: bytes) -> CacheKey:
        """The key whose canonical bytes are ``data`` (as :attr:`data` or :func:`key_bytes` gave
        them; not copied). One pass over the bytes checks the ids' range.

        :raises TypeError: ``data`` is not ``bytes``. :raises ValueError: its length is not a
            whole number of ids, or an id is outside ``[0, 2**31)``."""
        if type(data) is not bytes:
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        if len(data) % TOKEN_BYTES:
            raise ValueError(f"{len(data)} bytes are not a whole number of {TOKEN_BYTES}-byte ids")
        if not _in_range(data):
            raise _bad_position(np.frombuffer(data, dtype=np.uint32))
        key = cls.__new__(cls)
        key.data, key._images = data, -1
        return key

    def __len__(self) -> int:
        return len(self.data) // TOKEN_BYTES

    @property
    def ids(self) -> np.ndarray:
        """The ids, a read-only ``uint32`` view of :attr:`data` (no copy)."""
        return np.frombuffer(self.data, dtype=np.uint32)

    def prefix(self, n: int) -> CacheKey:
        """The key of the first ``n`` ids (all of them when ``n`` is past the end). O(n), nothing
        checked again.

        :raises ValueError: ``n`` is negative."""
        if n < 0:
            raise ValueError(f"a prefix length must be >= 0, got {n}")
        if n >= len(self.data) // TOKEN_BYTES:
            return self
        key = CacheKey.__new__(CacheKey)
        key.data = self.data[: n * TOKEN_BYTES]
        key._images = 0 if self._images == 0 else -1  # a text key's prefix is text; else look again
        return key

    @property
    def has_images(self) -> bool:
        """Whether an id is an image-derived cache id (``>= IMAGE_ID_BASE``). One pass over the
        bytes at the first ask (no numpy reduction), remembered."""
        if self._images < 0:
            self._images = int(_has_images(self.data))
        return self._images == 1

    def __eq__(self, other: object) -> bool:
        return type(other) is CacheKey and other.data == self.data

    def __hash__(self) -> int:
        return hash(self.data)

    def __repr__(self) -> str:
        ids = self.ids
        shown = ", ".join(str(int(i)) for i in ids[:8])
        return f"CacheKey([{shown}{', ...' if ids.size > 8 else ''}], len={ids.size})"
