"""The checks that need a GPU, as one script printing JSON: run it where a CUDA device is lent
(never needed by CI).

- ``fences``: a producer long enough (tens of ms of matmuls before its write) that a clone NOT
  ordered after its event reads the stale state, while the clone ordered after it reads the new
  one (``ordered_ok`` must be true; ``unordered_stale`` true shows the check can tell);
- ``clone``: a Qwen3-Next-80B-like slot (36 GDN layers, 77 MB) cloned through the pool against a
  raw device copy of the same bytes, medians, and the ratio (target >= 0.8x the raw bandwidth);
- ``fingerprint``: the slot's fingerprint on the device against its clone (target <= 1.0x);
- ``device``: what the numbers were measured on;
- ``hammer``: the ground-truth hammer on ``cuda`` when the reference engine can run there; it
  runs on the CPU only today, so the entry says so.

    python benchmarks/gpu_check.py [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from linear_state import CudaStream, LinearStatePool, NodeOwner, RequestOwner, StateLayout


def device_info() -> dict[str, Any]:
    """The device, the driver's view of it, and the software versions."""
    p = torch.cuda.get_device_properties(0)
    return {
        "name": p.name,
        "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "multiprocessors": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def fences() -> dict[str, Any]:
    """Ordered clone correct, unordered clone stale, with a long producer."""
    layout = StateLayout(2, (64, 3), (8, 64, 64))
    pool = LinearStatePool(layout, 4, "cuda")
    fwd, copies = CudaStream(), CudaStream()
    req = RequestOwner("r")
    live = pool.alloc(req)
    pool.zero(live, owner=req).wait()
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()

    def produce() -> None:
        x = big
        for _ in range(24):
            x = torch.tanh(x @ big)
        pool.recurrent[:, live].copy_(torch.full_like(pool.recurrent[:, live], 2.0) + 0.0 * x.mean())

    t0 = time.perf_counter()
    produced = fwd.submit(produce)
    unordered = pool.clone(live, NodeOwner(1), stream=copies)
    ordered = pool.clone(live, NodeOwner(2), stream=copies, after=[produced])
    ordered.fence.wait()
    unordered.fence.wait()
    produced.wait()
    producer_ms = 1e3 * (time.perf_counter() - t0)
    ordered_ok = bool(torch.all(pool.read(ordered.slot)[1] == 2))
    unordered_stale = bool(torch.all(pool.read(unordered.slot)[1] == 0))
    return {"ordered_ok": ordered_ok, "unordered_stale": unordered_stale, "producer_ms": round(producer_ms, 1)}


def _median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def clone_and_fingerprint(reps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Clone against a raw copy of the same bytes; fingerprint against clone. Alternating rounds."""
    layout = StateLayout.for_gdn(36, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    pool = LinearStatePool(layout, 3, "cuda")
    req = RequestOwner("r")
    src = pool.alloc(req)
    pool.recurrent[:, src].normal_()
    nbytes = layout.slot_bytes
    raw_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    raw_dst = torch.empty_like(raw_src)
    clone_ms, raw_ms, fp_ms = [], [], []

    def clone() -> None:
        w = pool.clone(src, NodeOwner(9))
        w.fence.wait()
        pool.free(w.slot, NodeOwner(9))

    for _ in range(reps):
        clone_ms.append(_median_ms(clone, 1))
        raw_ms.append(_median_ms(lambda: raw_dst.copy_(raw_src), 1))
        fp_ms.append(_median_ms(lambda: pool.fingerprint(src), 1))
    c, r, f = statistics.median(clone_ms), statistics.median(raw_ms), statistics.median(fp_ms)
    clone_row = {
        "slot_bytes": nbytes,
        "clone_ms": round(c, 3),
        "raw_copy_ms": round(r, 3),
        "clone_gib_s": round(nbytes / 2**30 / (c / 1e3), 1),
        "raw_gib_s": round(nbytes / 2**30 / (r / 1e3), 1),
        "clone_over_raw_throughput": round(r / c, 3),
    }
    fingerprint: dict[str, Any] = {
        "fingerprint_ms": round(f, 3),
        "clone_ms": round(c, 3),
        "fingerprint_over_clone": round(f / c, 3),
    }
    return clone_row, fingerprint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device: this script is for a machine with a GPU"}))
        raise SystemExit(2)
    out: dict[str, Any] = {"bench": "gpu_check", "device": device_info()}
    out["fences"] = fences()
    out["clone"], out["fingerprint"] = clone_and_fingerprint(args.reps)
    out["hammer"] = {"ran": False, "why": "the reference engine (radixcache.testing.engine) runs on the CPU only"}
    out["ok"] = out["fences"]["ordered_ok"] and out["fences"]["unordered_stale"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
