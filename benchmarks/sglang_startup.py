"""Issue 33's start-up point, as JSON: what building the prefix cache costs SGLang's scheduler at a
given number of mamba state slots (374,391 by default: what SGLang sized on a CI-like machine for a
tiny hybrid model), SGLang 0.5.23's built-in ``UnifiedRadixCache`` against the radixcache backend.

Runs where SGLang is importable (``make test-sglang`` builds ``.venv-sglang``)::

    .venv-sglang/bin/python benchmarks/sglang_startup.py [--slots 374391] [--repeat 3]

SGLang's pools (``HybridReqToTokenPool``, ``TokenToKVPoolAllocator``) are built once per measured
construction (outside the timing, as in SGLang, where they exist before the cache); the two caches'
constructors are timed alternately, ``--repeat`` times each, and the medians compared. Exits 1
unless ours costs no more than the built-in's (``ok``)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tests.sglang.conftest  # noqa: E402,F401  (inert stand-ins for SGLang's GPU-only imports)
from tests.sglang import harness as H  # noqa: E402,N812


def _build_seconds(kind: str, slots: int) -> float:
    """Seconds ``kind``'s cache constructor takes over pools of ``slots`` state slots."""
    env = H.make_env(kind, mamba_size=slots, max_reqs=64)  # builds the pools and the cache
    init = env.cache_params
    if kind == "builtin":
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        t = time.perf_counter()
        UnifiedRadixCache(init)
        return time.perf_counter() - t
    from radixcache.sglang.backend import RadixcacheHybridCache

    t = time.perf_counter()
    RadixcacheHybridCache(init, clock=H.StepClock())
    return time.perf_counter() - t


def main() -> None:
    """Measure, print the JSON, exit 1 unless ``ok``."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slots", type=int, default=374_391)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    times: dict[str, list[float]] = {"builtin": [], "radixcache": []}
    for _ in range(a.repeat):
        for kind in times:  # alternated: the machine's noise falls on both
            times[kind].append(_build_seconds(kind, a.slots))
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict[str, Any] = {
        "state_slots": a.slots,
        "builtin_ms": [round(x * 1e3, 2) for x in times["builtin"]],
        "radixcache_ms": [round(x * 1e3, 2) for x in times["radixcache"]],
        "median_ratio": round(med["radixcache"] / med["builtin"], 3),
    }
    out["ok"] = med["radixcache"] <= med["builtin"]
    print(json.dumps(out, indent=2))
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
