"""Image-aware cache ids, and which image-embedding rows a forward window must scatter.

Every image expands to the same placeholder id, so keying the tree on raw ids would let one
image's KV serve another. :func:`image_cache_ids` replaces the i-th contiguous run of placeholders
with ids derived from a digest of image i's bytes (and the position inside the run), all in
``[2**30, 2**31)``: above every text vocabulary, inside the tree's key range. When runs and images
cannot be paired one to one, a single digest of all images keys every placeholder: coarser (no
sharing between prompts that share only some images), never wrong.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

import numpy as np
import torch

from .keys import IMAGE_ID_BASE

__all__ = ["ImageBytes", "MMWindow", "image_cache_ids", "image_runs", "mm_window"]

ImageBytes: TypeAlias = "bytes | bytearray | memoryview | np.ndarray | torch.Tensor"
"""The raw content of one image: anything that exposes its bytes (pixels, or the encoded file)."""

_IDS: TypeAlias = "Sequence[int] | np.ndarray | torch.Tensor"


def _as_ids(input_ids: _IDS) -> np.ndarray:
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.detach().cpu().numpy()
    arr = np.asarray(input_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"input_ids must be 1-D integers, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= IMAGE_ID_BASE))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"input id {int(arr[i])} at position {i} is outside the text range [0, 2**30)")
    return arr


def _bytes_of(image: ImageBytes, index: int) -> memoryview:
    """The image's raw bytes as a flat byte view (no copy of a contiguous array, tensor or
    buffer), for any dtype: a bfloat16 tensor of pixel values included, which numpy cannot hold."""
    if isinstance(image, torch.Tensor):
        t = image.detach().cpu().contiguous().reshape(-1)
        return t.view(torch.uint8).numpy().data
    if isinstance(image, np.ndarray):
        if image.dtype.hasobject:
            raise TypeError(f"image {index} is a numpy array of {image.dtype}: its bytes are pointers, not pixels")
        return np.ascontiguousarray(image).reshape(-1).view(np.uint8).data
    if isinstance(image, (bytes, bytearray, memoryview)):
        view = memoryview(image)
        return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    raise TypeError(f"image {index} is a {type(image).__name__}; pass its bytes, a numpy array or a tensor")


def _digest(*parts: memoryview) -> int:
    h = hashlib.blake2b(digest_size=8, person=b"radixcache-img")
    for p in parts:
        h.update(p.nbytes.to_bytes(8, "little"))  # length-prefixed: no two image lists hash alike
        h.update(p)
    return int.from_bytes(h.digest(), "little") % IMAGE_ID_BASE


def image_runs(input_ids: _IDS, placeholder_id: int) -> list[tuple[int, int]]:
    """The contiguous runs of ``placeholder_id``, as ``(start, end)`` half-open, in order. O(n)."""
    arr = np.asarray(input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids)
    is_ph = np.concatenate([[False], arr == placeholder_id, [False]])
    edges = np.flatnonzero(is_ph[1:] != is_ph[:-1])
    return [(int(edges[i]), int(edges[i + 1])) for i in range(0, len(edges), 2)]


def image_cache_ids(input_ids: _IDS, placeholder_id: int, images: Sequence[ImageBytes]) -> np.ndarray:
    """Cache ids for a prompt with images: placeholders replaced by image-derived ids.

    Run i (the i-th contiguous run of ``placeholder_id``) is paired with ``images[i]``; its ids
    become ``2**30 + ((position_in_run + h_i) mod 2**30)`` with ``h_i`` from a blake2b digest of
    the image's bytes. When the number of runs differs from the number of images, one digest of
    all images keys every placeholder, by its index among all placeholders. Text ids are unchanged.

    >>> image_cache_ids([5, 9, 9, 6], placeholder_id=9, images=[])
    Traceback (most recent call last):
    ...
    ValueError: the prompt has 2 placeholder id(s) (9) but no image bytes: its cache key would be ambiguous

    :returns: int64 ids of the same length (a copy; unchanged ids when there are no images).
    :raises ValueError: ids not 1-D integers in ``[0, 2**30)``; ``placeholder_id`` outside that
        range; placeholders present but no image bytes.
    :raises TypeError: an image that is not bytes-like, a numpy array or a tensor.
    """
    if not 0 <= placeholder_id < IMAGE_ID_BASE:
        raise ValueError(f"placeholder_id {placeholder_id} is outside the text range [0, 2**30)")
    ids = _as_ids(input_ids)
    runs = image_runs(ids, placeholder_id)
    if not images:
        if runs:
            n = sum(e - s for s, e in runs)
            raise ValueError(
                f"the prompt has {n} placeholder id(s) ({placeholder_id}) but no image bytes: "
                "its cache key would be ambiguous"
            )
        return ids.copy()
    blobs = [_bytes_of(img, i) for i, img in enumerate(images)]
    out = ids.copy()
    if len(runs) == len(blobs):
        for (start, end), blob in zip(runs, blobs, strict=True):
            h = _digest(blob)
            out[start:end] = IMAGE_ID_BASE + (np.arange(end - start, dtype=np.int64) + h) % IMAGE_ID_BASE
    else:
        h = _digest(*blobs)
        where = np.flatnonzero(ids == placeholder_id)
        out[where] = IMAGE_ID_BASE + (np.arange(where.size, dtype=np.int64) + h) % IMAGE_ID_BASE
    return out


class MMWindow(NamedTuple):
    """What a forward over token window ``[start, end)`` scatters of the image embeddings.

    :ivar rows: indices into the concatenation of all images' embedding rows (placeholder order).
    :ivar positions: where each of those rows goes, relative to ``start``.
    """

    rows: range
    positions: np.ndarray


def mm_window(ids: _IDS, placeholder_id: int, start: int, end: int) -> MMWindow:
    """Which image-embedding rows a forward over ``[start, end)`` must scatter, and where.

    Embedding row k belongs to the k-th placeholder of ``ids`` (the prompt's input ids). A
    forward that starts after a prefix-cache hit, or in a later chunk, scatters only the rows of
    the placeholders inside its own window, even when the hit ended inside an image span. O(n).

    :raises ValueError: ``not 0 <= start <= end <= len(ids)``.
    """
    arr = np.asarray(ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else ids)
    if not 0 <= start <= end <= arr.size:
        raise ValueError(f"window [{start}, {end}) is outside the {arr.size} ids")
    is_ph = arr == placeholder_id
    before = int(np.count_nonzero(is_ph[:start]))
    inside = np.flatnonzero(is_ph[start:end])
    return MMWindow(range(before, before + inside.size), inside)
