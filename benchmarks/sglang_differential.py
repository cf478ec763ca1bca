"""Issue 17's acceptance runs at their sizes, as JSON: the CPU differential harness
(tests/sglang/harness.py) with SGLang 0.5.23's built-in hybrid cache beside the radixcache backend.

Runs where SGLang is importable (``make test-sglang`` builds ``.venv-sglang``)::

    .venv-sglang/bin/python benchmarks/sglang_differential.py [--requests 1000]

Exits 1 unless ``ok``: no mismatch anywhere, our page-1 hit tokens at least the built-in's, and no
assert from our backend under slot pressure.

Per run: admissions, hit tokens, state mismatches (a forward that found its slot not holding the
exact state of its prefix), and for the backend its counters. Page 1: both caches, two seeds.
Retraction: both, each decode step retracting with probability 0.05. Page 4 with chunks of 46
(checkpoints and cuts mid-page): the backend alone (the built-in refuses a page above 1 without
the extra buffer). Slot pressure: 4 state slots for 3 requests in flight, both (the built-in's
assert is reported), and the backend with a 32-slot host tier. SGLang's idle invariants are
asserted inside every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tests.sglang.conftest  # noqa: E402,F401  (inert stand-ins for SGLang's GPU-only imports)
from tests.sglang import harness as H  # noqa: E402,N812


def _run(kind: str, seed: int, n: int, *, host_slots: int = 0, **kw: Any) -> dict[str, Any]:
    make = {k: kw.pop(k) for k in ("page_size", "mamba_size") if k in kw}
    env = H.make_env(kind, **make)
    if host_slots:
        from radixcache.sglang.backend import RadixcacheHybridCache

        slot = env.cache.state_pool.layout.slot_bytes
        env.cache = RadixcacheHybridCache(env.cache_params, host_budget_bytes=host_slots * slot, clock=H.StepClock())
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    try:
        H.run_stream(env, seed, n, **kw)
    except AssertionError as e:
        out["raised"] = str(e)[:120]
    out.update(
        admissions=env.requests,
        retractions=env.retractions,
        hit_tokens=env.hit_tokens,
        mismatches=len(env.mismatches),
        seconds=round(time.perf_counter() - t0, 2),
    )
    if kind == "radixcache":
        out["stats"] = dict(env.cache.stats)
    return out


def _grid(n: int) -> None:
    """The hit-token table over pool sizes (issue 33's acceptance), printed as JSON."""
    cells: dict[str, Any] = {}
    for slots in (10, 40, 200, 1000):
        for seed in (0, 1):
            row = {kind: _run(kind, seed, n, mamba_size=slots) for kind in ("builtin", "radixcache")}
            b, r = row["builtin"]["hit_tokens"], row["radixcache"]["hit_tokens"]
            cells[f"slots{slots}_seed{seed}"] = {
                "builtin_hit_tokens": b,
                "radixcache_hit_tokens": r,
                "ratio": round(r / max(b, 1), 3),
                "mismatches": row["builtin"]["mismatches"] + row["radixcache"]["mismatches"],
                "raised": {k: v["raised"] for k, v in row.items() if "raised" in v},
            }
    ok = all(c["radixcache_hit_tokens"] >= c["builtin_hit_tokens"] and c["mismatches"] == 0 for c in cells.values())
    print(json.dumps({"bench": "sglang_differential_grid", "requests_per_run": n, "cells": cells, "ok": ok}, indent=1))
    if not ok:
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000, help="requests per page-1 and page-4 run")
    ap.add_argument(
        "--slots-grid",
        action="store_true",
        help="instead: page 1 at 10, 40, 200 and 1,000 state slots, seeds 0 and 1, both caches; "
        "ok needs our hit tokens at least the built-in's in every cell",
    )
    args = ap.parse_args()
    n = args.requests
    if args.slots_grid:
        _grid(n)
        return
    out: dict[str, Any] = {"bench": "sglang_differential", "requests_per_run": n}
    for seed in (0, 1):
        for kind in ("builtin", "radixcache"):
            out[f"page1_seed{seed}_{kind}"] = _run(kind, seed, n)
    for kind in ("builtin", "radixcache"):
        out[f"retract_seed5_{kind}"] = _run(kind, 5, max(n // 2, 1), retract_p=0.05)
    for seed in (2, 3):
        out[f"page4_chunk46_seed{seed}_radixcache"] = _run("radixcache", seed, n, page_size=4, chunk=46)
    for kind in ("builtin", "radixcache"):
        out[f"pressure_seed3_{kind}"] = _run(kind, 3, 300, mamba_size=4)
    out["pressure_seed3_radixcache_host32"] = _run("radixcache", 3, 300, mamba_size=4, host_slots=32)
    mism = [v["mismatches"] for k, v in out.items() if isinstance(v, dict)]
    ratios = [
        out[f"page1_seed{s}_radixcache"]["hit_tokens"] / max(out[f"page1_seed{s}_builtin"]["hit_tokens"], 1)
        for s in (0, 1)
    ]
    out["hit_token_ratio_page1"] = [round(r, 3) for r in ratios]
    out["ok"] = sum(mism) == 0 and min(ratios) >= 1.0 and "raised" not in out["pressure_seed3_radixcache"]
    print(json.dumps(out, indent=1))
    if not out["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
