"""RadixcacheConnector in vLLM's CPU build, measured side by side in one engine (run in .venv-vllm).

1. Time to first token of a long prompt served by the connector (re-sent after vLLM's own prefix
   cache was reset, so the hit comes from radixcache's host store) against the same length
   recomputed (a fresh prompt: a miss everywhere), alternating, ``--reps`` each.
2. The connector's scheduler-side time per engine step (its calls on vLLM's scheduler thread:
   ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
   ``request_finished_all_groups``) over a 48-request workload, and its worker-side copy time.

    .venv-vllm/bin/python benchmarks/vllm_connector.py [--reps 5] [--prompt 3300] [--quick]

Prints one JSON object. The model is the tests' tiny Qwen3-Next (seeded random weights, built
here; no download)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEDULER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",  # where a step's saves are filed and its loads released
    "request_finished_all_groups",
)
WORKER_CALLS = ("start_load_kv", "wait_for_save", "build_connector_worker_meta")


def _timed(obj: Any, names: tuple[str, ...], into: dict[str, list[float]]) -> None:
    for name in names:
        fn: Callable[..., Any] = getattr(obj, name)

        def wrapper(*a: Any, _fn: Callable[..., Any] = fn, _name: str = name, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                into[_name].append(time.perf_counter() - t)

        setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=3300, help="tokens of the long prompt")
    ap.add_argument("--quick", action="store_true", help="2 reps (a smoke run)")
    args = ap.parse_args()
    reps = 2 if args.quick else args.reps

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON only
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from tests.vllm.harness import (
        VOCAB,
        Workload,
        build_tiny_qwen3_next,
        close,
        fill_free_blocks_with_noise,
        make_llm,
        serve,
    )

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen3_next(Path(tmp) / "model")
        kvt = KVTransferConfig(
            kv_connector="RadixcacheConnector", kv_connector_module_path="radixcache.vllm", kv_role="kv_both"
        )
        llm = make_llm(model, prefix_caching=True, kv_transfer_config=kvt)
        try:
            sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
            worker = get_kv_transfer_group()
            calls: dict[str, list[float]] = defaultdict(list)
            _timed(sched, SCHEDULER_CALLS, calls)
            _timed(worker, WORKER_CALLS, calls)
            one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
            rng = random.Random(0)

            def prompt() -> list[int]:
                return [rng.randrange(3, VOCAB) for _ in range(args.prompt)]

            def ttft(p: list[int]) -> tuple[float, int]:
                assert llm.reset_prefix_cache()
                fill_free_blocks_with_noise(llm, seed=len(p))
                t = time.perf_counter()
                out = llm.generate([TokensPrompt(prompt_token_ids=p)], one, use_tqdm=False)
                return time.perf_counter() - t, int(out[0].num_cached_tokens or 0)

            long = prompt()
            ttft(long)  # filed in the connector's store; also warms the engine up
            ttft(prompt())
            hit_s: list[float] = []
            cold_s: list[float] = []
            hit_tokens = []
            for _ in range(reps):
                s, cached = ttft(long)
                hit_s.append(s)
                hit_tokens.append(cached)
                s, cached = ttft(prompt())
                assert cached == 0, cached
                cold_s.append(s)
            calls.clear()
            steps_before = len(calls["build_connector_meta"])
            served = serve(llm, Workload(seed=0), between=lambda e, r: e.reset_prefix_cache())
            steps = len(calls["build_connector_meta"]) - steps_before
            sched_total = sum(sum(calls[n]) for n in SCHEDULER_CALLS)
            per_call = {
                n: {"calls": len(calls[n]), "mean_us": round(1e6 * statistics.fmean(calls[n]), 1) if calls[n] else 0.0}
                for n in (*SCHEDULER_CALLS, *WORKER_CALLS)
            }
            store = sched.store.describe()
        finally:
            close(llm)

    out = {
        "bench": "vllm_connector",
        "prompt_tokens": args.prompt,
        "reps": reps,
        "ttft_connector_hit_s": round(statistics.median(hit_s), 4),
        "ttft_recompute_s": round(statistics.median(cold_s), 4),
        "ttft_ratio_hit_over_recompute": round(statistics.median(hit_s) / statistics.median(cold_s), 3),
        "hit_tokens": hit_tokens,
        "workload": {
            "requests": len(served.prompts),
            "engine_steps": steps,
            "scheduler_us_per_step": round(1e6 * sched_total / max(1, steps), 1),
            "scheduler_us_per_request": round(1e6 * sched_total / len(served.prompts), 1),
            "calls": per_call,
        },
        "store": store,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
