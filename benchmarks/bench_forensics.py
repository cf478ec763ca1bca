"""Forensics cost, measured side by side in one run.

1. Per donation: the fingerprint of a Qwen3-Next-80B-like slot (36 GDN layers, 77 MB) against
   the clone of the same slot, interleaved.
2. The hammer's serving throughput (requests per second, ground truth off) with forensics off
   and on, alternating runs.

    python benchmarks/bench_forensics.py [--reps 20] [--requests 300] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from linear_state import LinearStatePool, NodeOwner, RequestOwner, StateLayout
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
        out = {**slot_costs(2, 4), **hammer_throughput(20, 1)}
    else:
        out = {**slot_costs(args.reps, 36), **hammer_throughput(args.requests, args.rounds)}
    print(json.dumps({"bench": "forensics", **out}, indent=2))


if __name__ == "__main__":
    main()
