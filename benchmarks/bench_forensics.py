"""Forensics cost, measured side by side in one run.

1. Per donation: the fingerprint of a Qwen3-Next-80B-like slot (36 GDN layers, 77 MB) against
   the clone of the same slot, interleaved.
2. The hammer's serving throughput (requests per second, ground truth off) with forensics off
   and on, alternating runs.
3. The CPU fingerprint's paths on the same slots, interleaved: torch's sums (the reference),
   numpy's, and the native one where linear_state's C extension is built (what ``auto`` takes up
   to ``NUMPY_MAX_SLOT_BYTES``; numpy where it is not), from a 576-byte slot (the SGLang
   harness's) to 16 MB, with the value checked equal.

    python benchmarks/bench_forensics.py [--reps 20] [--requests 300] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from linear_state import LinearStatePool, NodeOwner, RequestOwner, StateLayout
from linear_state.fingerprint import NUMPY_MAX_SLOT_BYTES, SlotHasher
from linear_state.native import NATIVE
from radixcache.testing.hammer import HammerConfig, run_hammer
from radixcache.testing.model import HybridConfig, HybridModel


def slot_costs(reps: int, layers: int) -> dict[str, float]:
    layout = StateLayout.for_gdn(layers, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    pool = LinearStatePool(layout, 3)
    src = pool.alloc(RequestOwner("bench"))
    pool.conv[:, src].normal_()
    pool.recurrent[:, src].normal_()
    node = NodeOwner(0)
    clone_s, fp_s = [], []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        snap = pool.clone(src, node).slot
        t1 = time.perf_counter()
        pool.fingerprint(snap)
        t2 = time.perf_counter()
        pool.free(snap, node)
        if i >= 2:  # warm-up
            clone_s.append(t1 - t0)
            fp_s.append(t2 - t1)
    c, f = statistics.median(clone_s), statistics.median(fp_s)
    return {
        "slot_bytes": layout.slot_bytes,
        "clone_ms_median": round(c * 1e3, 3),
        "fingerprint_ms_median": round(f * 1e3, 3),
        "fingerprint_vs_clone_cost": round(f / c, 3),
    }


def fingerprint_paths(reps: int, sizes: list[int]) -> dict[str, object]:
    """Median µs of a fingerprint by each CPU path, per slot size (bytes, float32 states over 4
    layers in two tensors), the paths interleaved on the same slot; the values must agree."""
    rows: list[dict[str, float]] = []
    kernels = ("torch", "numpy", "native") if NATIVE else ("torch", "numpy")
    for size in sizes:
        words = max(1, size // 4 // 4 // 2)  # float32 elements per layer row of each tensor
        tensors = [torch.randn(4, 3, words), torch.randn(4, 3, words)]
        paths = {k: SlotHasher(tensors, kernel=k) for k in kernels}
        took: dict[str, list[float]] = {k: [] for k in paths}
        n = max(5, min(2000, (reps * 100 * 65536) // max(size, 1)))
        ref = paths["torch"].fingerprint(1)  # the slot does not change: one reference value
        for i in range(n + 2):
            for k, h in paths.items():
                t0 = time.perf_counter()
                fp = h.fingerprint(1)
                if i >= 2:
                    took[k].append(time.perf_counter() - t0)
                assert fp == ref, f"the {k} path disagrees at {size} bytes"
        t, p = statistics.median(took["torch"]), statistics.median(took["numpy"])
        row = {
            "slot_bytes": 2 * 4 * words * 4,
            "torch_us": round(t * 1e6, 1),
            "numpy_us": round(p * 1e6, 1),
            "numpy_over_torch": round(p / t, 3),
        }
        if "native" in took:
            c = statistics.median(took["native"])
            row |= {"native_us": round(c * 1e6, 1), "native_over_torch": round(c / t, 3)}
        rows.append(row)
    return {"fingerprint_paths": rows, "numpy_max_slot_bytes": NUMPY_MAX_SLOT_BYTES, "native_built": NATIVE}


def hammer_throughput(requests: int, rounds: int) -> dict[str, float]:
    model = HybridModel(HybridConfig())
    off: list[float] = []
    on: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for fx in (None, str(Path(tmp) / f"ledger{i}.jsonl")):
                cfg = HammerConfig(requests=requests, seed=i, forensics=fx, ground_truth=False)
                rep = run_hammer(cfg, model=model)
                (on if fx else off).append(rep.requests / rep.wall_s)
    a, b = statistics.median(off), statistics.median(on)
    return {
        "hammer_requests": requests,
        "hammer_rps_forensics_off": round(a, 2),
        "hammer_rps_forensics_on": round(b, 2),
        "hammer_throughput_on_vs_off": round(b / a, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke size for CI")
    args = ap.parse_args()
    if args.quick:
        out = {**slot_costs(2, 4), **fingerprint_paths(1, [576, 1 << 16]), **hammer_throughput(20, 1)}
    else:
        sizes = [576, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]
        out = {
            **slot_costs(args.reps, 36),
            **fingerprint_paths(args.reps, sizes),
            **hammer_throughput(args.requests, args.rounds),
        }
    print(json.dumps({"bench": "forensics", **out}, indent=2))


if __name__ == "__main__":
    main()
