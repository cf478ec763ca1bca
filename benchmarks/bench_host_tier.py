"""The host tier's copies against a raw copy of the same bytes, and where restoring a snapshot
from host memory beats recomputing the prefix.

Per replay preset (Qwen3-Next-80B: 36 GDN layers, 77 MB; Nemotron-H-8B: 24 Mamba2 layers): a
device pool (``--device``) and a host pool (the CPU; pinned when the device is CUDA), timed side by
side, interleaved, medians:

- ``demote``: ``host.clone_from(device, slot, owner)`` (what the tree does when it evicts a
  snapshot into the host tier), waited;
- ``promote``: ``device.copy_from(host, slot, dst)`` (a hit restored from the host tier), waited;
- ``raw``: one contiguous copy of the same number of bytes from device memory to host memory.

Then the crossover: the prefix depth below which recomputing costs less than restoring,
``prefill_flops(n) / flops_rate = snapshot_bytes / bandwidth``, for the promote bandwidth measured
here and for a nominal accelerator (``--link-gbs`` GB/s host link, ``--tflops`` effective
TFLOP/s of prefill). Prints one JSON object.

    python benchmarks/bench_host_tier.py [--reps 20] [--device cpu] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from linear_state import LinearStatePool, NodeOwner, RequestOwner, StateLayout
from radixcache.simulator.replay import PRESETS, ModelPreset


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def crossover_tokens(preset: ModelPreset, bytes_per_s: float, flops_per_s: float) -> int:
    """The smallest prefix depth ``n`` whose prefill takes longer than restoring one snapshot."""
    restore_s = preset.snapshot_bytes / bytes_per_s
    lo, hi = 0, 1
    while preset.prefill_flops(hi) / flops_per_s <= restore_s:
        hi *= 2
    while lo < hi:  # prefill_flops grows with n
        mid = (lo + hi) // 2
        if preset.prefill_flops(mid) / flops_per_s > restore_s:
            hi = mid
        else:
            lo = mid + 1
    return lo


def measure(layout: StateLayout, device: torch.device, reps: int) -> dict[str, float]:
    """Median seconds of demote, promote and the raw copy of the same bytes."""
    dev = LinearStatePool(layout, 3, device)
    host = LinearStatePool(layout, 3, pin_memory=device.type == "cuda")
    req, node = RequestOwner("bench"), NodeOwner(0)
    src, dst = dev.alloc(req), dev.alloc(req)
    dev.conv[:, src].normal_()
    dev.recurrent[:, src].normal_()
    raw_src = torch.randint(0, 255, (layout.slot_bytes,), dtype=torch.uint8, device=device)
    raw_dst = torch.empty(layout.slot_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    held = host.clone_from(dev, src, node)
    held.fence.wait()

    def demote() -> None:
        w = host.clone_from(dev, src, NodeOwner(1))
        w.fence.wait()
        host.free(w.slot, NodeOwner(1))

    def promote() -> None:
        dev.copy_from(host, held.slot, dst, dst_owner=req).wait()

    def raw() -> None:
        raw_dst.copy_(raw_src)

    fns = {"demote": demote, "promote": promote, "raw": raw}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: first touch of pages
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            times[k].append(_timed(fn, device))
    assert torch.equal(dev.read(dst)[1], dev.read(src)[1]), "promote did not restore the demoted bytes"
    dev.check_invariants()
    host.check_invariants()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--link-gbs", type=float, default=25.0, help="nominal host link, GB/s (PCIe 4 x16 ~ 25)")
    ap.add_argument("--tflops", type=float, default=400.0, help="nominal effective prefill TFLOP/s")
    ap.add_argument("--quick", action="store_true", help="smoke size: 4 layers, 3 reps (CI)")
    args = ap.parse_args()
    device = torch.device(args.device)
    out: dict[str, Any] = {"bench": "host_tier", "device": str(device), "presets": {}}
    for name, preset in PRESETS.items():
        layout = preset.layout
        if args.quick:
            layout = StateLayout(
                4, layout.conv_shape, layout.recurrent_shape, layout.conv_dtype, layout.recurrent_dtype
            )
        med = measure(layout, device, 3 if args.quick else args.reps)
        nbytes = layout.slot_bytes
        promote_bps = nbytes / med["promote"]
        out["presets"][name] = {
            "slot_bytes": nbytes,
            "demote_ms": round(1e3 * med["demote"], 3),
            "promote_ms": round(1e3 * med["promote"], 3),
            "raw_copy_ms": round(1e3 * med["raw"], 3),
            "demote_over_raw_throughput": round(med["raw"] / med["demote"], 3),
            "promote_over_raw_throughput": round(med["raw"] / med["promote"], 3),
            "promote_gb_s": round(promote_bps / 1e9, 2),
            # crossovers for the full-size snapshot of the preset
            "crossover_tokens_measured_link": crossover_tokens(preset, promote_bps, args.tflops * 1e12),
            "crossover_tokens_nominal": crossover_tokens(preset, args.link_gbs * 1e9, args.tflops * 1e12),
        }
    out["nominal"] = {"link_gb_s": args.link_gbs, "prefill_tflops": args.tflops}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
