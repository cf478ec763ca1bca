"""Fingerprints of slot contents: a 64-bit digest that changes when any element changes.

The digest is a random linear form over the slot's raw 64-bit words, modulo 2**64. Each row (one
layer of one tensor) is cut into blocks of ``BLOCK`` words (the last one may be short); block ``b``
of row ``l`` has a fixed odd 64-bit weight ``M[l, b]`` (seeded, so the same layout fingerprints the
same on every run and device)::

    fp = sum_l sum_b M[l, b] * (sum_j words[l, b, j])      (mod 2**64)

Exact detection: every weight is odd, hence invertible modulo 2**64, so changing any *one* word (so
any one element) always changes the fingerprint. Several changed words go unnoticed only if the
changes inside every block sum to zero modulo 2**64 (a permutation of words inside one 512-byte
block, for instance) or, when some block's sum changed, if the random form vanishes on the changed
block sums (probability at most 2**-32 for changes of 32-bit or wider words). A snapshot overwritten
by another state, partly written or never written changes the sums of its blocks.

Cost: one read pass over the slot, on its device, as ``torch.sum`` over the innermost dimension:
memory-bound and parallel on torch's own intra-op threads (the threads that just ran the clone), then
a weighted sum of the ``rows x blocks`` partial sums (1/64 of the slot) and one 8-byte transfer to the
host. On CUDA, with Triton importable, the same value comes from one fused kernel
(:mod:`linear_state.fingerprint_triton`: read, block sums and weighted sum in one pass); the torch
path stays the reference it is tested against. ``benchmarks/bench_forensics.py`` and
``benchmarks/bench_pool.py`` measure it against a clone.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .fingerprint_triton import DEFAULT_CHUNK, TritonFingerprint, alignment_cover, available, word_dtype, word_rows
from .native import MODULE as _NATIVE

__all__ = ["BLOCK", "NATIVE_MAX_SLOT_BYTES", "NUMPY_MAX_SLOT_BYTES", "Fingerprint", "SlotHasher", "WORD_WEIGHT_SEED"]

Fingerprint = int
"""A 64-bit fingerprint, as a non-negative Python int."""

WORD_WEIGHT_SEED = 0x5EED_F1A9
BLOCK = 64  # words per block: 512 bytes, an inner reduction that runs at memory speed
_MASK = (1 << 64) - 1
NUMPY_MAX_SLOT_BYTES = 1 << 18
"""Where linear_state's C extension is not built, CPU slots up to this size (256 KiB) are summed
through numpy views made once (the ``"numpy"`` path): no torch dispatch per tensor, and no wait for
torch's intra-op threads, which a busy host keeps from running (see :class:`SlotHasher`). Larger
slots take torch's parallel sums, faster from about 1 MiB on (``benchmarks/bench_forensics.py``:
numpy 0.36x torch's time at 576 bytes, 0.75x at 256 KiB, 1.5x at 1 MiB on an idle 2-core CPU)."""

NATIVE_MAX_SLOT_BYTES = 1 << 22
"""Where it is built, CPU slots up to this size (4 MiB) are summed natively (the ``"native"`` path,
``linear_state/_native.c``: the same views, one C pass on the calling thread). Measured on an idle
2-core CPU (``benchmarks/bench_forensics.py``): 0.5 us at 576 bytes (torch 21, numpy 7.6), 0.22x
torch's time at 256 KiB, 0.57x at 1 MiB, 0.9x at 4 MiB, 1.15x at 16 MiB, where torch's two
threads read faster than one."""

# NOTE: a weight per word (sum_j r[j] * words[j], as an earlier version did) needs a 64-bit
# multiply per word. On a CPU that ran single-core bound (numpy einsum, ~24 GB/s per core) and its
# second thread fought torch's OpenMP worker, which spins for a while after the clone: 1.0x to 1.7x
# the clone. Block sums without a multiply run on torch's threads at memory speed: ~0.5x.


def _odd_weights(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    lo = torch.randint(-(2**62), 2**62, shape, dtype=torch.int64, generator=generator)
    return lo * 2 + 1  # odd, hence invertible mod 2**64


def _words(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor as int64 words (narrower words widened: still exact)."""
    flat = t.reshape(-1)
    dtype = word_dtype(flat.numel() * flat.element_size())
    words = flat.view(dtype)
    return words if dtype == torch.int64 else words.to(torch.int64)


class SlotHasher:
    """Fingerprints rows of layer-major state tensors ``[L, S, ...]`` (one slot = a row per layer).

    Build one per pool; :meth:`fingerprint` is called per slot. Not thread-safe (it reuses one
    buffer of partial sums), like the pool that owns it.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        seed: int = WORD_WEIGHT_SEED,
        *,
        kernel: str = "auto",
        triton_chunk: int = DEFAULT_CHUNK,
    ) -> None:
        """:param kernel: ``"torch"`` (the reference: ``torch.sum`` per tensor, then the weighted
            sum), ``"triton"`` (:mod:`linear_state.fingerprint_triton`'s fused kernel: the same
            value bit for bit), ``"numpy"`` (CPU tensors: the same sums through numpy views of the
            tensors made here, the same value bit for bit), ``"native"`` (the same views summed in
            one C pass, :mod:`linear_state.native`: the same value bit for bit) or ``"auto"``
            (Triton on CUDA when it imports and every tensor's slot rows are contiguous; on the CPU,
            for contiguous tensors, native for slots of at most :data:`NATIVE_MAX_SLOT_BYTES`
            where it is built, else numpy for slots of at most :data:`NUMPY_MAX_SLOT_BYTES`; the
            torch path otherwise).
        :param triton_chunk: blocks each program of the fused kernel reads (a power of two).
        :raises ValueError: no tensors; an unknown ``kernel``; a ``triton_chunk`` that is not a power
            of two; ``"triton"`` where Triton does not
            import or a tensor's slot rows are not contiguous (a transposed layout); ``"numpy"``
            or ``"native"`` for a tensor that is not a contiguous CPU tensor; ``"native"`` where
            the extension is not built (or ``RADIXCACHE_NATIVE=0``).
        """
        if not tensors:
            raise ValueError("SlotHasher needs at least one tensor")
        if kernel not in ("auto", "torch", "triton", "numpy", "native"):
            raise ValueError(f"kernel must be 'auto', 'torch', 'triton', 'numpy' or 'native', got {kernel!r}")
        if kernel == "native" and _NATIVE is None:
            raise ValueError(
                "kernel='native' needs linear_state's C extension (not built here, or RADIXCACHE_NATIVE=0)"
            )
        chunk_ok = type(triton_chunk) is int and triton_chunk >= 1 and not triton_chunk & (triton_chunk - 1)
        if not chunk_ok:
            raise ValueError(f"triton_chunk must be a power of two >= 1, got {triton_chunk!r}")
        gen = torch.Generator().manual_seed(seed)
        self._tensors = tensors
        self.device = tensors[0].device
        widest = max(_words(t[0, 0]).numel() for t in tensors)
        blocks = -(-widest // BLOCK)  # blocks of the widest row
        rows = sum(t.shape[0] for t in tensors)
        self._m = _odd_weights((rows, blocks), gen).to(self.device)
        # Partial sums per (row, block); entries past a shorter row's last block stay zero.
        self._sums = torch.zeros(rows, blocks, dtype=torch.int64, device=self.device)
        on_cpu = self.device.type == "cpu"
        self._m_np = self._m.numpy() if on_cpu else None
        self._sums_np = self._sums.numpy() if on_cpu else None
        self._fused: TritonFingerprint | None = None
        if kernel == "triton" or (kernel == "auto" and self.device.type == "cuda"):
            why = None
            if not available():
                why = "Triton does not import"
            elif any(word_rows(t, 0) is None for t in tensors if t.shape[1]):
                why = "a tensor's slot rows are not contiguous"
            if why is None:
                self._fused = TritonFingerprint(tensors, self._m, BLOCK, triton_chunk)
            elif kernel == "triton":
                raise ValueError(f"kernel='triton' cannot serve these tensors: {why}")
        # NOTE: numpy for small CPU slots: a torch.sum per tensor costs ~5 us of dispatch, and on a
        # host whose cores are busy its intra-op threads were measured waiting milliseconds for a
        # core (benchmarks/bench_forensics.py); numpy sums on the calling thread.
        self._np_words: list[np.ndarray] | None = None
        self._native = False  # the numpy views summed by linear_state._native
        if kernel in ("numpy", "native") or (kernel == "auto" and on_cpu):
            views = [_numpy_words(t) for t in tensors]
            slot_bytes = sum(t[:, 0].numel() * t.element_size() for t in tensors if t.shape[1])
            forced = kernel in ("numpy", "native")
            limit = NUMPY_MAX_SLOT_BYTES if _NATIVE is None else NATIVE_MAX_SLOT_BYTES
            if all(v is not None for v in views) and (forced or slot_bytes <= limit):
                self._np_words = [v for v in views if v is not None]
                self._native = _NATIVE is not None and kernel != "numpy"
            elif forced:
                raise ValueError(f"kernel={kernel!r} needs contiguous CPU tensors of at least one slot")

    @property
    def kernel(self) -> str:
        """The path :meth:`fingerprint` takes: ``"triton"``, ``"native"``, ``"numpy"`` or ``"torch"``."""
        if self._fused is not None:
            return "triton"
        if self._np_words is None:
            return "torch"
        return "native" if self._native else "numpy"

    def warm_up(self, *, fallback: bool = True) -> tuple[int, ...]:
        """Build now what a first fingerprint would build inside the caller's hot path (a
        scheduler step): on the fused Triton path, every variant of the kernel this hasher's slots
        launch (Triton compiles one per tensor and per alignment of a slot's first word: seconds
        each without its disk cache), by fingerprinting the slots of
        :func:`~linear_state.fingerprint_triton.alignment_cover`. The other paths compile nothing
        and read nothing. Returns the slots read; their values are discarded (slots being written
        meanwhile are harmless). O(slots read x slot bytes).

        Where the fused kernel cannot be built or run (a Triton that does not work with this
        device or driver), ``fallback`` keeps the torch path from then on (the same values) and
        warns once (``RuntimeWarning`` naming the error), so that a broken Triton costs speed, not
        the first donation; without ``fallback`` the error is raised."""
        fused = self._fused
        if fused is None:
            return ()
        slots = alignment_cover(self._tensors)
        try:
            for s in slots:
                fused.fingerprint(s)
        except Exception as e:
            if not fallback:
                raise
            self._fused = None
            warnings.warn(
                f"the fused Triton fingerprint failed ({type(e).__name__}: {e}); fingerprints take the torch path",
                RuntimeWarning,
                stacklevel=2,
            )
            return ()
        return slots

    def fingerprint(self, slot: int) -> Fingerprint:
        """Fingerprint of ``slot`` across all tensors and layers.

        One read pass on the tensors' device and one host transfer; O(slot bytes). Only
        meaningful once every write into the slot has landed (wait its fence first).
        """
        if self._fused is not None:
            return self._fused.fingerprint(slot)
        if self._native and _NATIVE is not None and self._np_words is not None and self._m_np is not None:
            return _NATIVE.fingerprint(self._np_words, slot, self._m_np, BLOCK)
        if self._np_words is not None:
            self._block_sums_numpy(slot)
        else:
            self._block_sums(slot)
        if self._m_np is not None and self._sums_np is not None:
            # numpy wraps int64 products and sums modulo 2**64 by definition
            return int(np.einsum("lb,lb->", self._sums_np, self._m_np)) & _MASK
        return self._combine_torch()

    def _block_sums(self, slot: int) -> None:
        """Fill the partial-sum buffer with the block sums of ``slot``: one ``torch.sum`` per tensor."""
        row = 0
        for t in self._tensors:
            layers = t.shape[0]
            rows = t[:, slot].reshape(layers, -1)
            if rows.shape[1] * rows.element_size() % 8 == 0:
                words = rows.view(torch.int64)
            else:  # odd-sized rows: widen each layer's words (small rows only)
                words = torch.stack([_words(t[i, slot]) for i in range(layers)])
            n = words.shape[1]
            full = n // BLOCK
            out = self._sums[row : row + layers]
            if full:
                torch.sum(words[:, : full * BLOCK].view(layers, full, BLOCK), dim=2, out=out[:, :full])
            if full * BLOCK < n:
                torch.sum(words[:, full * BLOCK :], dim=1, out=out[:, full])
            row += layers

    def _block_sums_numpy(self, slot: int) -> None:
        """:meth:`_block_sums` through the numpy views: the same words, the same sums (int64
        addition wraps modulo 2**64 in numpy as in torch)."""
        assert self._np_words is not None and self._sums_np is not None
        row = 0
        for w in self._np_words:
            words = w[:, slot]
            layers, n = words.shape
            full = n // BLOCK
            out = self._sums_np[row : row + layers]
            # dtype=int64: narrower words are widened as _words widens them (int16 and int32 keep
            # their sign, bytes do not), without a copy
            if full:
                blocks = words[:, : full * BLOCK].reshape(layers, full, BLOCK)
                np.sum(blocks, axis=2, dtype=np.int64, out=out[:, :full])
            if full * BLOCK < n:
                np.sum(words[:, full * BLOCK :], axis=1, dtype=np.int64, out=out[:, full])
            row += layers

    def _combine_torch(self) -> Fingerprint:
        """The weighted sum of the partial sums on the device (int64 arithmetic wraps), to the host."""
        return int(torch.sum(self._sums * self._m).item()) & _MASK


def _numpy_words(t: torch.Tensor) -> np.ndarray | None:
    """A contiguous CPU tensor ``[L, S, ...]`` as a numpy view ``[L, S, words]`` in the words of
    :func:`~linear_state.fingerprint_triton.word_dtype` (the rule every path cuts rows by); ``None``
    when it is not one (another device, a strided layout, no slot)."""
    if t.device.type != "cpu" or t.dim() < 2 or not t.is_contiguous() or t.shape[0] == 0 or t.shape[1] == 0:
        return None
    rows = t.reshape(t.shape[0], t.shape[1], -1)
    try:
        return rows.view(word_dtype(rows.shape[2] * rows.element_size())).numpy()
    except (RuntimeError, TypeError):
        return None
