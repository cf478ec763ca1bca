"""How exact a prefix hit is on each transformers family, at a realistic logit scale, next to
transformers' own drift between its cached step and a full forward.

For each covered family's tiny model (``tiny_model(family, gap=G)``: the top logit ``G`` above the
median, 4.0 by default; ``--gap 0`` for transformers' own init):

- ``hf_drift``: the largest difference, over three prompts and eight greedy steps each, between
  the logits of transformers' cached single-token step (``cold_generation_hf``) and a full forward
  of the prompt and the tokens so far, no cache: what transformers itself calls the same answer.
- ``hit_drift``: the largest difference between the first-token logits of a request served by
  ``HFEngine`` from a prefix hit (a restored linear state and the tree's KV) and the same prompt run
  cold in one forward, over a workload of shared system prompts, follow-up turns and re-sends.
- ``cold_drift``: the same for requests served without a hit (chunked prefill against one forward).
- ``bound``: the exactness bound the tests and the hammer use at that gap
  (``radixcache.hf.families.hit_tolerance``), and ``margin``: bound / max(hf_drift, hit_drift).

Prints one JSON object. ``python benchmarks/hf_exactness.py [--gap 4.0] [--family NAME ...]``.
Needs the ``hf`` extra.
"""

from __future__ import annotations

import argparse
import json
import random
import warnings
from typing import Any

import torch

from radixcache.hf import HFStateBridge, cold_generation_hf, generate_cold_hf
from radixcache.hf.families import TINY_CONFIGS, hit_tolerance, logit_gap, tiny_model
from radixcache.testing.engine import EngineRequest
from radixcache.testing.hf_engine import HFEngine


def hf_drift(model: Any, bridge: HFStateBridge, rng: random.Random) -> float:
    worst = 0.0
    for n in (40, 120, 200):
        prompt = [rng.randrange(3, 256) for _ in range(n)]
        gen = cold_generation_hf(model, bridge, prompt, 8)
        for k, logits in enumerate(gen.logits):
            with torch.no_grad():
                full = model(input_ids=torch.tensor([prompt + gen.tokens[:k]])).logits[0, -1].float()
            worst = max(worst, float((full - logits).abs().max()))
    return worst


def workload(rng: random.Random) -> list[list[int]]:
    systems = [[rng.randrange(3, 256) for _ in range(rng.randint(100, 220))] for _ in range(2)]
    out: list[list[int]] = []
    for i in range(12):
        p = systems[i % 2] + [rng.randrange(3, 256) for _ in range(rng.randint(5, 60))]
        out.append(p)
        if i % 3 == 0:
            out.append(p + [rng.randrange(3, 256) for _ in range(rng.randint(5, 40))])  # a follow-up
        if i % 4 == 0:
            out.append(list(p))  # a re-send
    return out


def served_drift(model: Any, cfg: Any, rng: random.Random) -> tuple[float, float, int]:
    engine = HFEngine(model, cfg, track_align=16)
    hit = cold = 0.0
    hits = 0
    for i, p in enumerate(workload(rng)):  # one at a time: each later prompt finds the earlier ones
        engine.submit(EngineRequest(f"r{i}", p, 3))
        (r,) = [x for x in engine.run() if x.rid == f"r{i}"]
        _, first = generate_cold_hf(model, engine.bridge, r.prompt, 1)
        assert r.first_logits is not None
        d = float((r.first_logits - first).abs().max())
        if r.cached_length:
            hit, hits = max(hit, d), hits + 1
        else:
            cold = max(cold, d)
    return hit, cold, hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gap", type=float, default=4.0, help="the top logit's distance above the median (0: init)")
    ap.add_argument("--family", nargs="+", default=list(TINY_CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows: dict[str, dict[str, object]] = {}
    for family in args.family:
        cfg, model = tiny_model(family, gap=args.gap or None)
        bridge = HFStateBridge(cfg)
        hfd = hf_drift(model, bridge, random.Random(args.seed))
        hit, cold, hits = served_drift(model, cfg, random.Random(args.seed + 1))
        with torch.no_grad():
            top = float(model(input_ids=torch.tensor([list(range(3, 67))])).logits.abs().max())
        gap = logit_gap(model)
        bound = hit_tolerance(gap)
        rows[family] = {
            "gap": round(gap, 3),
            "max_abs_logit": round(top, 3),
            "hf_drift": hfd,
            "hit_drift": hit,
            "cold_drift": cold,
            "hits": hits,
            "bound": bound,
            "margin": round(bound / max(hfd, hit, 1e-12), 2),
        }
    print(json.dumps({"gap": args.gap, "families": rows}, indent=1))


if __name__ == "__main__":
    main()
