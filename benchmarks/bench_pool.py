"""Clone throughput of a Qwen3-Next-80B-like slot against a raw torch copy_ of the same bytes.

Both are timed side by side in one run, interleaved, and reported as medians; the fingerprint of
the same slot is timed alongside. Also the time to build a pool over a host's state tensors
(``HostedStatePool``, as the SGLang backend does) at 10,000 and 374,391 slots (the pool SGLang
sized on this machine), which should not grow with the slots, and what such a pool retains per
slot after a first-in-first-out allocator (SGLang's) passed each of 50,000 slots through it once
(lent, restored into, reclaimed): host memory and garbage-collector-tracked objects, which should
not grow with the slots either. Prints one JSON object.

    python benchmarks/bench_pool.py [--reps 30] [--device cpu] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from linear_state import HostedStatePool, LinearStatePool, NodeOwner, RequestOwner, StateLayout


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


class _Lender:
    """A host's slot allocator (the SGLang backend's is SGLang's free list); ``fifo``: slots are
    handed out in the order they came back, as SGLang's are (else the last one back first)."""

    def __init__(self, n: int, *, fifo: bool = False) -> None:
        self.free = list(range(1, n))
        self.fifo = fifo

    def take(self, k: int) -> list[int] | None:
        if len(self.free) < k:
            return None
        if self.fifo:
            out, self.free = self.free[:k], self.free[k:]
            return out
        return [self.free.pop() for _ in range(k)]

    def give(self, slots: Sequence[int]) -> None:
        self.free.extend(slots)

    def available(self) -> int:
        return len(self.free)


def build_ms(slots: int, reps: int = 3) -> float:
    """Median milliseconds to build a HostedStatePool of ``slots`` over existing tensors."""
    layout = StateLayout(1, (2, 2), (1, 2, 2))
    conv = torch.zeros((1, slots, 2, 2), dtype=layout.conv_dtype)
    rec = torch.zeros((1, slots, 1, 2, 2), dtype=layout.recurrent_dtype)
    times = []
    for _ in range(reps):
        lender = _Lender(slots)
        t0 = time.perf_counter()
        HostedStatePool(layout, conv, rec, lender, reserved=(0,))
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: no figure
        return None


def retained_per_slot(slots: int) -> dict[str, float | int | None]:
    """Host bytes (resident set, Linux only) and tracked objects a HostedStatePool retains per
    slot after each of ``slots`` slots went through it once: handed out first in, first out,
    lent, restored into (a copy from a snapshot the pool holds) and reclaimed."""
    layout = StateLayout(4, (8, 3), (4, 8, 8))
    conv = torch.zeros((4, slots + 2, 8, 3), dtype=layout.conv_dtype)
    rec = torch.zeros((4, slots + 2, 4, 8, 8), dtype=layout.recurrent_dtype)
    lender = _Lender(slots + 2, fifo=True)
    pool = HostedStatePool(layout, conv, rec, lender, reserved=(0,))
    snap = pool.alloc(NodeOwner(0))
    gc.collect()
    rss0, objs0 = _rss_bytes(), len(gc.get_objects())
    for i in range(slots):
        got = lender.take(1)
        assert got is not None
        owner = RequestOwner(i)
        s = pool.lend(got[0], owner)
        pool.copy(snap, s, dst_owner=owner)
        pool.reclaim(s, owner)
        lender.give(got)
    gc.collect()
    rss1, objs1 = _rss_bytes(), len(gc.get_objects())
    pool.check_invariants()
    return {
        "slots": slots,
        "bytes_per_slot": None if rss0 is None or rss1 is None else round((rss1 - rss0) / slots),
        "tracked_objects_per_slot": round((objs1 - objs0) / slots, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="smoke size: 4 layers, 3 reps (CI)")
    args = ap.parse_args()
    device = torch.device(args.device)
    layers, reps = (4, 3) if args.quick else (36, args.reps)
    layout = StateLayout.for_gdn(layers, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    pool = LinearStatePool(layout, 3, device)
    req, node = RequestOwner("bench"), NodeOwner(0)
    src = pool.alloc(req)
    pool.conv[:, src].normal_()
    pool.recurrent[:, src].normal_()
    raw_src = torch.randint(0, 255, (layout.slot_bytes,), dtype=torch.uint8, device=device)
    raw_dst = torch.empty_like(raw_src)

    def clone() -> None:
        pool.clone(src, node)

    def release() -> None:
        for s in pool.slots_of(node):
            pool.free(s, node)

    clone_s, raw_s, fp_s = [], [], []
    for _ in range(2):  # warm-up: first touch of pages
        clone()
        release()
        raw_dst.copy_(raw_src)
    for _ in range(reps):
        clone_s.append(_time(clone, device))
        release()
        raw_s.append(_time(lambda: raw_dst.copy_(raw_src), device))
        fp_s.append(_time(lambda: pool.fingerprint(src), device))
    pool.check_invariants()
    sizes = (1_000, 100_000) if args.quick else (10_000, 374_391)
    built = {str(n): build_ms(n) for n in sizes}
    retained = retained_per_slot(20_000 if args.quick else 50_000)
    clone_med, raw_med, fp_med = (statistics.median(x) for x in (clone_s, raw_s, fp_s))
    gib = layout.slot_bytes / 2**30
    print(
        json.dumps(
            {
                "bench": "pool_clone",
                "device": str(device),
                "slot_bytes": layout.slot_bytes,
                "num_layers": layers,
                "reps": reps,
                "clone_ms_median": round(clone_med * 1e3, 3),
                "raw_copy_ms_median": round(raw_med * 1e3, 3),
                "fingerprint_ms_median": round(fp_med * 1e3, 3),
                "clone_gib_s": round(gib / clone_med, 2),
                "raw_copy_gib_s": round(gib / raw_med, 2),
                "clone_vs_raw_throughput": round(raw_med / clone_med, 3),
                "fingerprint_vs_clone_cost": round(fp_med / clone_med, 3),
                "hosted_pool_build_ms": built,
                "hosted_pool_retained": retained,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
