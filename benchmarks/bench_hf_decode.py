"""HFEngine on a tiny transformers model: batched decode against decode request by request.

Serves the same seeded prompts twice per round, once with ``batch_decode=True`` and once with
``False`` (the order alternating round by round), on one torch thread, and reports the wall time
of each and their ratio per round, and whether both gave the same answers. Prints one JSON object.

    python benchmarks/bench_hf_decode.py [--family qwen3_next] [--rounds 2] [--quick]

Needs the ``hf`` extra (transformers).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings
from typing import Any

import torch

from radixcache.hf import tiny_model
from radixcache.testing.engine import EngineRequest
from radixcache.testing.hf_engine import HFEngine


def serve(model: Any, cfg: Any, prompts: list[list[int]], new: int, batch: bool) -> tuple[float, list[Any]]:
    engine = HFEngine(model, cfg, batch_decode=batch, max_running=4)
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(i, p, new))
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    return wall, sorted((r.rid, tuple(r.output)) for r in engine.finished)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--family", default="qwen3_next")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke size for CI: 1 round, 6 requests")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.requests = 1, 6
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
    torch.set_num_threads(1)
    cfg, model = tiny_model(args.family)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(20, 200))] for _ in range(args.requests)]
    batched: list[float] = []
    single: list[float] = []
    same = True
    for r in range(args.rounds):
        outs = {}
        for batch in (True, False) if r % 2 == 0 else (False, True):
            wall, outs[batch] = serve(model, cfg, prompts, args.new_tokens, batch)
            (batched if batch else single).append(wall)
        same = same and outs[True] == outs[False]
    ratios = [s / b for s, b in zip(single, batched, strict=True)]
    print(
        json.dumps(
            {
                "bench": "hf_decode",
                "family": args.family,
                "requests": args.requests,
                "new_tokens": args.new_tokens,
                "batched_s": [round(x, 3) for x in batched],
                "one_by_one_s": [round(x, 3) for x in single],
                "speedup_median": round(statistics.median(ratios), 2),
                "speedup_min": round(min(ratios), 2),
                "same_answers": same,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
