"""Clone throughput of a Qwen3-Next-80B-like slot against a raw torch copy_ of the same bytes.

Both are timed side by side in one run, interleaved, and reported as medians; the fingerprint of
the same slot is timed alongside. Also the time to build a pool over a host's state tensors
(``HostedStatePool``, as the SGLang backend does) at 10,000 and 374,391 slots (the pool SGLang
sized on this machine), which should not grow with the slots. Prints one JSON object.

    python benchmarks/bench_pool.py [--reps 30] [--device cpu] [--quick]
"""

from __future__ import annotations

import argparse
import json
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
    """A host's slot allocator (the SGLang backend's is SGLang's free list)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(1, n))

    def take(self, k: int) -> list[int] | None:
        return [self.free.pop() for _ in range(k)] if len(self.free) >= k else None

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
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
