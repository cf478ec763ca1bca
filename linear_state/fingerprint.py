"""Fingerprints of slot contents: a 64-bit digest that changes when any element changes.

The digest is a random linear form over the slot's raw 64-bit words, modulo 2**64::

    fp = sum_t sum_l M[t, l] * (sum_i w[t, l, i] * r[i])      (mod 2**64)

with ``r`` and ``M`` fixed odd 64-bit weights (seeded, so the same layout fingerprints the same on
every run). Because every weight is odd, it is invertible modulo 2**64: changing any *one* word
always changes the fingerprint (exact detection). Several changed words collide only if a random
linear form vanishes on the difference vector, which happens with probability at most 2**-32 for
differences of 32-bit or wider words; bit flips anywhere are caught with the same bound.

Cost: one read pass over the slot's bytes, layer by layer, on the slot's device (on a CPU a
fused multiply-reduce with no temporary; on CUDA a product into a per-layer scratch buffer and a
reduction), then a single 8-byte transfer to the host. ``benchmarks/bench_pool.py`` measures it
against a clone of the same slot.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["Fingerprint", "SlotHasher", "WORD_WEIGHT_SEED"]

Fingerprint = int
"""A 64-bit fingerprint, as a non-negative Python int."""

WORD_WEIGHT_SEED = 0x5EED_F1A9
_MASK = (1 << 64) - 1
_PARALLEL_BYTES = 4 << 20  # below this a thread hand-off costs more than it saves


def _odd_weights(n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    lo = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, generator=generator)
    return (lo * 2 + 1).to(device)  # odd, hence invertible mod 2**64


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
    """Fingerprints rows of layer-major state tensors ``[L, S, ...]`` (one row = one slot).

    Build one per pool; :meth:`fingerprint` is called per slot.
    """

    def __init__(self, tensors: list[torch.Tensor], seed: int = WORD_WEIGHT_SEED) -> None:
        if not tensors:
            raise ValueError("SlotHasher needs at least one tensor")
        gen = torch.Generator().manual_seed(seed)
        self._tensors = tensors
        self.device = tensors[0].device
        widest = max(_words(t[0, 0]).numel() for t in tensors)
        self._r = _odd_weights(widest, gen, self.device)
        self._scratch = torch.empty(widest, dtype=torch.int64, device=self.device)
        num_rows = sum(t.shape[0] for t in tensors)
        self._m = _odd_weights(num_rows, gen, self.device)
        self._partials = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        self._r_np = self._r.cpu().numpy()
        self._slot_bytes = sum(t[:, 0].numel() * t.element_size() for t in tensors)
        self._pool: ThreadPoolExecutor | None = None
        self._m_list = [int(x) for x in self._m.cpu().tolist()]

    def fingerprint(self, slot: int) -> Fingerprint:
        """Fingerprint of ``slot`` across all tensors and layers.

        Runs on the tensors' device with one host transfer; O(slot bytes), one read pass. Only
        meaningful once every write into the slot has landed (wait its fence first).
        """
        if self.device.type == "cpu":
            return self._fingerprint_cpu(slot)
        row = 0
        for t in self._tensors:
            for layer in range(t.shape[0]):
                words = _words(t[layer, slot])
                n = words.numel()
                scratch = self._scratch[:n]
                torch.mul(words, self._r[:n], out=scratch)
                torch.sum(scratch, dim=0, out=self._partials[row])
                row += 1
        total = torch.dot(self._partials, self._m)
        return int(total.item()) & _MASK

    def _fingerprint_cpu(self, slot: int) -> Fingerprint:
        # NOTE: numpy's einsum reduces each layer's products without a temporary (one read of the
        # slot, no scratch traffic) and releases the GIL, so a large slot is split across
        # torch's intra-op thread count: a clone is a parallel copy, the fingerprint keeps pace
        # (benchmarks/bench_pool.py). Sums wrap mod 2**64 exactly as the device path's.
        r, m = self._r_np, self._m_list
        parts: list[tuple[int, np.ndarray]] = []  # (first row index, [rows, words])
        singles: list[tuple[int, np.ndarray]] = []  # odd-sized rows, one by one
        row = 0
        for t in self._tensors:
            rows = t[:, slot].reshape(t.shape[0], -1)
            if rows.shape[1] * rows.element_size() % 8:
                singles += [(row + layer, _words(t[layer, slot]).numpy()) for layer in range(t.shape[0])]
            else:
                parts.append((row, rows.view(torch.int64).numpy()))
            row += t.shape[0]
        partial: dict[int, int] = {}
        workers = self._workers()
        jobs = []
        for first, words in parts:
            step = -(-words.shape[0] // workers) if workers > 1 else words.shape[0]
            for lo in range(0, words.shape[0], step):
                jobs.append((first + lo, words[lo : lo + step]))
        if workers > 1 and len(jobs) > 1:
            jobs.sort(key=lambda j: j[1].size)  # the largest runs here, the rest on the workers
            pool = self._executor()
            futures = [(first, pool.submit(np.einsum, "lj,j->l", w, r[: w.shape[1]])) for first, w in jobs[:-1]]
            results = [(jobs[-1][0], np.einsum("lj,j->l", jobs[-1][1], r[: jobs[-1][1].shape[1]]))]
            results += [(first, f.result()) for first, f in futures]
        else:
            results = [(first, np.einsum("lj,j->l", w, r[: w.shape[1]])) for first, w in jobs]
        for first, sums in results:
            for i, x in enumerate(sums.tolist()):
                partial[first + i] = x
        for i, w in singles:
            partial[i] = int(np.einsum("i,i->", w, r[: w.size]))
        total = 0
        for i, x in partial.items():
            total += m[i] * x
        return total & _MASK

    def _workers(self) -> int:
        return max(1, torch.get_num_threads()) if self._slot_bytes >= _PARALLEL_BYTES else 1

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, torch.get_num_threads() - 1), thread_name_prefix="fingerprint")
        return self._pool
