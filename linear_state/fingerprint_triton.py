"""The slot fingerprint as one fused Triton kernel (read, block sums, weighted sum in one pass).

Computes exactly :class:`~linear_state.fingerprint.SlotHasher`'s value (the torch path stays the
reference): for each row (one layer of one state tensor) the 64-bit words are cut into blocks of
``BLOCK`` words, each block is summed, multiplied by its odd weight, and the products are added
into one int64 accumulator with an atomic add. All of it is arithmetic modulo 2**64 (int64 wraps
on every device), and addition modulo 2**64 is associative and commutative, so the order in which
programs add their parts does not change a bit of the result.

Each program reads ``chunk`` blocks of one row (``chunk * BLOCK * 8`` bytes); the grid is
``rows x ceil(blocks / chunk)``. One launch per state tensor (conv, recurrent), all adding into the
same accumulator, then one 8-byte transfer to the host.

Triton is optional (``pip install triton``; CUDA builds of torch ship it). :func:`available` says
whether it imports. The kernel runs on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module's first use), which is how the main suite checks it
against the torch path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = [
    "ALIGNMENT",
    "DEFAULT_CHUNK",
    "TritonFingerprint",
    "alignment_cover",
    "available",
    "compiled_variants",
    "word_dtype",
    "word_rows",
]

DEFAULT_CHUNK = 16  # blocks per program: 8 KiB read per program

ALIGNMENT = 16
"""Triton compiles a kernel once per set of argument properties it specializes on; the one that
changes from slot to slot here is whether the address of a slot's first word is a multiple of
``ALIGNMENT`` bytes (the other arguments are fixed per state tensor)."""


@functools.cache
def available() -> bool:
    """Whether Triton imports here."""
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fingerprint_rows(  # type: ignore[no-untyped-def]  # Triton's parameters, not Python's
        words,  # the first row of one state tensor's slot, as integer words (widened to int64 here)
        weights,  # int64 [rows, blocks] of the whole slot; this tensor's rows start at w_row0
        out,  # int64 [1] accumulator
        row_stride,  # words between one layer's row and the next
        n_words,  # words per row of this tensor
        n_blocks,  # blocks per row of this tensor
        w_row0,  # this tensor's first row in ``weights``
        w_stride,  # blocks per row of ``weights``
        BLOCK: tl.constexpr,  # Triton's compile-time constants
        CHUNK: tl.constexpr,
    ):
        row = tl.program_id(0)
        b = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        idx = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        base = words + row.to(tl.int64) * row_stride
        w = tl.load(base + idx, mask=idx < n_words, other=0).to(tl.int64)
        sums = tl.sum(w, axis=1)
        m = tl.load(weights + (w_row0 + row).to(tl.int64) * w_stride + b, mask=b < n_blocks, other=0)
        tl.atomic_add(out, tl.sum(sums * m, axis=0))

    return fingerprint_rows


def compiled_variants(device: int | None = None) -> int | None:
    """How many variants of the fused kernel Triton has compiled in this process for CUDA device
    ``device`` (default: the current one): what :meth:`~linear_state.fingerprint.SlotHasher.warm_up`
    builds and a later fingerprint must not add to. ``None`` where it cannot be told (Triton does
    not import, no CUDA device, the interpreter, a Triton without per-device caches)."""
    if not available() or not torch.cuda.is_available():
        return None
    caches = getattr(_kernel(), "device_caches", None)
    if not isinstance(caches, dict):
        return None
    entry = caches.get(torch.cuda.current_device() if device is None else device)
    return None if entry is None else len(entry[0])


def word_dtype(nbytes: int) -> torch.dtype:
    """The word a row of ``nbytes`` bytes is summed in: int64 when 8 divides it, else int32, int16,
    uint8 (narrower words are widened to int64 before summing). The one rule both fingerprint
    paths follow: they agree bit for bit only while they cut rows into the same words."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if nbytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def word_rows(t: torch.Tensor, slot: int) -> torch.Tensor | None:
    """``t[:, slot]`` as ``[L, words]`` rows of :func:`word_dtype`'s words, without a copy; ``None``
    when a row is not contiguous in memory or the rows' spacing is not a whole number of words
    (such a layout takes the torch path)."""
    rows = t[:, slot]
    layers = rows.shape[0]
    if layers == 0 or not rows[0].is_contiguous():
        return None
    flat = rows.reshape(layers, -1)
    if flat.data_ptr() != rows.data_ptr() or (flat.shape[1] > 1 and flat.stride(1) != 1):
        return None
    dtype = word_dtype(flat.shape[1] * flat.element_size())
    if (flat.stride(0) * flat.element_size()) % dtype.itemsize:
        return None
    try:
        return flat.view(dtype)
    except RuntimeError:
        return None


def alignment_cover(tensors: list[torch.Tensor], alignment: int = ALIGNMENT) -> tuple[int, ...]:
    """Leading slots (in increasing order, chosen greedily: at most two per tensor) that give every
    tensor's slot rows each alignment class they take (first word at a multiple of ``alignment``
    bytes, or not): the slots whose fingerprints build every variant of the fused kernel the
    hasher's other slots will launch. A slot's address is the tensor's plus ``slot x`` its slot stride, so the classes
    repeat with a period dividing ``alignment``: the first ``alignment`` slots show them all.
    Empty when the tensors hold no slot. O(tensors x alignment).

    :raises ValueError: ``alignment`` not a positive int."""
    if type(alignment) is not int or alignment < 1:
        raise ValueError(f"alignment must be a positive int (bytes), got {alignment!r}")
    slots = min((t.shape[1] for t in tensors), default=0)
    need: set[tuple[int, bool]] = set()
    by_slot: list[set[tuple[int, bool]]] = []
    for s in range(min(slots, alignment)):
        classes = {
            (i, (t.data_ptr() + s * t.stride(1) * t.element_size()) % alignment == 0) for i, t in enumerate(tensors)
        }
        by_slot.append(classes)
        need |= classes
    chosen: list[int] = []
    for s, classes in enumerate(by_slot):
        if classes & need:
            chosen.append(s)
            need -= classes
    return tuple(chosen)


class TritonFingerprint:
    """The fused kernel over a hasher's tensors and weights (built by
    :class:`~linear_state.fingerprint.SlotHasher` when every tensor's slot rows are contiguous).

    :param tensors: layer-major state tensors ``[L, S, ...]`` on one device.
    :param weights: the hasher's odd weights ``[rows, blocks]`` (int64, same device, contiguous).
    :param block: words per block (the hasher's ``BLOCK``).
    :param chunk: blocks per program (a power of two).
    """

    def __init__(self, tensors: list[torch.Tensor], weights: torch.Tensor, block: int, chunk: int = DEFAULT_CHUNK):
        if chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two >= 1, got {chunk!r}")
        self._tensors = tensors
        self._m = weights.contiguous()
        self._block = block
        self._chunk = chunk
        self._out = torch.zeros(1, dtype=torch.int64, device=weights.device)

    def fingerprint(self, slot: int) -> int:
        """The slot's fingerprint (a non-negative int < 2**64); one launch per tensor.

        :raises ValueError: a tensor's rows of ``slot`` are not contiguous (see :func:`word_rows`).
        """
        kernel = _kernel()
        out = self._out
        out.zero_()
        row0 = 0
        for t in self._tensors:
            words = word_rows(t, slot)
            if words is None:
                shape = tuple(t.shape)
                raise ValueError(f"slot {slot} of a {shape} {t.dtype} tensor has rows not contiguous in memory")
            layers, n = words.shape
            blocks = -(-n // self._block)
            grid = (layers, -(-blocks // self._chunk))
            kernel[grid](
                words,
                self._m,
                out,
                words.stride(0),
                n,
                blocks,
                row0,
                self._m.shape[1],
                BLOCK=self._block,
                CHUNK=self._chunk,
            )
            row0 += layers
        return int(out.item()) & ((1 << 64) - 1)
