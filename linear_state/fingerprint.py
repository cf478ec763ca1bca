"""Fingerprints of slot contents: a 64-bit digest that changes when any element changes.

The digest is a random linear form over the slot's raw 64-bit words, modulo 2**64. Each row (one
layer of one tensor) is cut into blocks of ``BLOCK`` words; block ``b`` of row ``l`` contributes
``M[l, b] * sum_j w[j] * r[j]`` with fixed odd 64-bit weights ``r`` and ``M`` (seeded, so the same
layout fingerprints the same on every run and device)::

    fp = sum_l sum_b M[l, b] * (sum_j words[l, b, j] * r[j])      (mod 2**64)

Every weight is odd, hence invertible modulo 2**64: changing any *one* word (so any one element)
always changes the fingerprint (exact detection). Several changed words collide only if a random
linear form vanishes on the difference vector: probability at most 2**-32 for differences of
32-bit or wider words.

Cost: one read pass over the slot, on its device, then one 8-byte transfer to the host. The
block weights (``BLOCK`` words, 16 KiB) stay in the first-level cache. On a CPU the products are
reduced by numpy without a temporary and, for large slots, split across torch's intra-op
threads; on CUDA they go through a per-row scratch buffer. ``benchmarks/bench_pool.py`` and
``benchmarks/bench_forensics.py`` measure it against a clone of the same slot.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["BLOCK", "Fingerprint", "SlotHasher", "WORD_WEIGHT_SEED"]

Fingerprint = int
"""A 64-bit fingerprint, as a non-negative Python int."""

WORD_WEIGHT_SEED = 0x5EED_F1A9
BLOCK = 2048  # words per block: the weights of one block fit in L1
_MASK = (1 << 64) - 1
_PARALLEL_BYTES = 4 << 20  # below this a thread hand-off costs more than it saves


def _odd_weights(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    lo = torch.randint(-(2**62), 2**62, shape, dtype=torch.int64, generator=generator)
    return lo * 2 + 1  # odd, hence invertible mod 2**64


def _words(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor as int64 words (narrower words widened: still exact)."""
    flat = t.reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes % 8 == 0:
        return flat.view(torch.int64)
    if nbytes % 4 == 0:
        return flat.view(torch.int32).to(torch.int64)
    if nbytes % 2 == 0:
        return flat.view(torch.int16).to(torch.int64)
    return flat.view(torch.uint8).to(torch.int64)


class SlotHasher:
    """Fingerprints rows of layer-major state tensors ``[L, S, ...]`` (one slot = a row per layer).

    Build one per pool; :meth:`fingerprint` is called per slot.
    """

    def __init__(self, tensors: list[torch.Tensor], seed: int = WORD_WEIGHT_SEED) -> None:
        if not tensors:
            raise ValueError("SlotHasher needs at least one tensor")
        gen = torch.Generator().manual_seed(seed)
        self._tensors = tensors
        self.device = tensors[0].device
        self._r = _odd_weights((BLOCK,), gen)
        widest = max(_words(t[0, 0]).numel() for t in tensors)
        self._blocks = -(-widest // BLOCK)  # blocks of the widest row (the last one may be short)
        self._rows = sum(t.shape[0] for t in tensors)
        self._m = _odd_weights((self._rows, self._blocks), gen)
        self._r_np = self._r.numpy()
        self._m_np = self._m.numpy()
        self._r_dev = self._r.to(self.device)
        self._m_dev = self._m.to(self.device)
        self._slot_bytes = sum(t[:, 0].numel() * t.element_size() for t in tensors)
        self._pool: ThreadPoolExecutor | None = None

    def fingerprint(self, slot: int) -> Fingerprint:
        """Fingerprint of ``slot`` across all tensors and layers.

        One read pass on the tensors' device and one host transfer; O(slot bytes). Only
        meaningful once every write into the slot has landed (wait its fence first).
        """
        if self.device.type == "cpu":
            return self._fingerprint_cpu(slot)
        return self._fingerprint_torch(slot)

    def _fingerprint_torch(self, slot: int) -> Fingerprint:
        """The device path (CUDA): products through a scratch buffer, block sums, one transfer."""
        partials = torch.zeros(self._rows, self._blocks, dtype=torch.int64, device=self.device)
        row = 0
        for t in self._tensors:
            for layer in range(t.shape[0]):
                words = _words(t[layer, slot])
                full = words.numel() // BLOCK * BLOCK
                if full:
                    blocks = words[:full].view(-1, BLOCK)
                    torch.sum(blocks * self._r_dev, dim=1, out=partials[row, : full // BLOCK])
                if full < words.numel():
                    tail = words[full:]
                    partials[row, full // BLOCK] = torch.dot(tail, self._r_dev[: tail.numel()])
                row += 1
        return int(torch.sum(partials * self._m_dev).item()) & _MASK

    def _fingerprint_cpu(self, slot: int) -> Fingerprint:
        # NOTE: numpy's einsum reduces the products without a temporary and releases the GIL, so
        # a large slot is split across torch's intra-op thread count: a clone is a parallel copy,
        # the fingerprint keeps pace (benchmarks/bench_pool.py). Sums wrap mod 2**64 as on CUDA.
        r = self._r_np
        jobs: list[tuple[int, np.ndarray]] = []  # (first row, [rows, words]) with whole rows
        row = 0
        for t in self._tensors:
            rows = t[:, slot].reshape(t.shape[0], -1)
            if rows.shape[1] * rows.element_size() % 8:
                jobs += [(row + i, _words(t[i, slot]).numpy()[None, :]) for i in range(t.shape[0])]
            else:
                jobs.append((row, rows.view(torch.int64).numpy()))
            row += t.shape[0]
        workers = max(1, torch.get_num_threads()) if self._slot_bytes >= _PARALLEL_BYTES else 1
        if workers > 1:
            split: list[tuple[int, np.ndarray]] = []
            for first, words in jobs:
                step = -(-words.shape[0] // workers)
                split += [(first + lo, words[lo : lo + step]) for lo in range(0, words.shape[0], step)]
            split.sort(key=lambda j: j[1].size)  # the largest runs here, the rest on the workers
            pool = self._executor()
            futures = [pool.submit(self._rows_sum, first, w, r) for first, w in split[:-1]]
            total = self._rows_sum(*split[-1], r) + sum(f.result() for f in futures)
        else:
            total = sum(self._rows_sum(first, w, r) for first, w in jobs)
        return total & _MASK

    def _rows_sum(self, first: int, words: np.ndarray, r: np.ndarray) -> int:
        """Weighted block sums of ``words`` [rows, n] (rows ``first..``), combined with ``M``."""
        n = words.shape[1]
        full = n // BLOCK * BLOCK
        m = self._m_np[first : first + words.shape[0]]
        total = 0
        if full:
            blocks = words[:, :full].reshape(words.shape[0], full // BLOCK, BLOCK)
            partial = np.einsum("lbj,j->lb", blocks, r)
            total += int(np.einsum("lb,lb->", partial, m[:, : full // BLOCK]))
        if full < n:
            tail = np.einsum("lj,j->l", words[:, full:], r[: n - full])
            total += int(np.einsum("l,l->", tail, m[:, full // BLOCK]))
        return total

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, torch.get_num_threads() - 1), thread_name_prefix="fingerprint")
        return self._pool
