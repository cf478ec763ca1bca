"""What :class:`radixcache.KVFreeList` costs a host's scheduler per allocation: ``alloc(n)`` and,
eight allocations later, ``free`` of the same indices, against a free list of the former design
(a deque of indices and a Python step per index, kept here as the baseline), alternating in each
repetition. Prints one JSON object: microseconds per alloc-and-free pair (fastest repetition) and
the ratio ours / deque for each ``n`` (1 is a decode step's token, 2,000 a long prompt).

    python benchmarks/bench_kv_free_list.py [--sizes 1 16 64 256 2000] [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque

import torch

from radixcache import KVFreeList


class DequeFreeList:
    """The baseline: the free list as it was before 2026-12-04 (session 26), FIFO, refusing a
    double free, one Python step per index."""

    def __init__(self, num_tokens: int) -> None:
        self.capacity = num_tokens
        self._free: deque[int] = deque(range(num_tokens))
        self._is_free = bytearray(b"\x01") * num_tokens

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for i in out:
            self._is_free[i] = 0
        return torch.tensor(out, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> None:
        ids = indices.tolist()
        seen: set[int] = set()
        for i in ids:
            if not 0 <= i < self.capacity:
                raise ValueError(f"KV index {i} is outside [0, {self.capacity})")
            if self._is_free[i] or i in seen:
                raise RuntimeError(f"KV index {i} freed twice")
            seen.add(i)
        for i in ids:
            self._is_free[i] = 1
        self._free.extend(ids)


def per_pair_us(make: type, n: int, pairs: int = 200, capacity: int = 65536) -> float:
    """Microseconds per ``alloc(n)`` plus its later ``free``; eight allocations held at a time."""
    kv = make(capacity)
    held: deque[torch.Tensor] = deque()
    t = 0.0
    for _ in range(pairs):
        a = time.perf_counter()
        idx = kv.alloc(n)
        t += time.perf_counter() - a
        assert idx is not None
        held.append(idx)
        if len(held) > 8:
            back = held.popleft()
            a = time.perf_counter()
            kv.free(back)
            t += time.perf_counter() - a
    return 1e6 * t / pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 256, 2000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smoke size for CI: sizes 1 and 2,000, 1 rep")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.reps = [1, 2000], 1
    out: dict[str, object] = {"bench": "kv_free_list", "reps": args.reps}
    for n in args.sizes:
        runs: dict[str, list[float]] = {"ours": [], "deque": []}
        for rep in range(args.reps):
            order = [("ours", KVFreeList), ("deque", DequeFreeList)]
            for name, make in order if rep % 2 == 0 else order[::-1]:
                runs[name].append(per_pair_us(make, n))
        best = {k: round(min(v), 2) for k, v in runs.items()}
        ratio = round(best["ours"] / best["deque"], 3)
        out[str(n)] = {"ours_us": best["ours"], "deque_us": best["deque"], "ratio": ratio}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
