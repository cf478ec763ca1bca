"""The manager's bookkeeping per scheduler step against the reference engine's forward time for
the same step, side by side.

Step: a decode window for each of 64 running requests (prompts of 200 tokens already prefilled
through the host protocol), in the order a scheduler runs it: plan, forward, commit. Bookkeeping
is what a host pays radixcache per step with the default policy (HitDensity):
``plan_decode_batch`` before the forward and ``commit_batch`` after it (``ratio``), and, for
comparison, one ``plan_decode`` and one ``commit`` per request (``single_calls_ratio``). The forward
is the reference hybrid model's batched decode over the same 64 requests. The two are timed in
alternating rounds (this machine is shared and noisy); the JSON gives the medians and their
ratio (target: bookkeeping <= 1% of the forward).

    python benchmarks/bench_manager.py [--batch 64] [--rounds 30] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from linear_state import LinearStatePool, RequestOwner
from radixcache import CacheManager, HybridRadixCache
from radixcache.testing.model import HybridConfig, HybridModel, KVPool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="smoke size for CI")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.rounds = 8, 3
    torch.manual_seed(0)
    model = HybridModel(HybridConfig())
    cfg = model.cfg
    n, batch = args.prompt, args.batch
    tokens_per_req = n + args.rounds * 2 + 8

    # The forward: the reference model's batched decode over `batch` live slots.
    fpool = LinearStatePool(cfg.state_layout(), batch)
    fslots = torch.tensor([fpool.alloc(RequestOwner(i)) for i in range(batch)])
    kvp = KVPool(cfg, batch * tokens_per_req)
    kv_rows = [torch.arange(i * tokens_per_req, (i + 1) * tokens_per_req) for i in range(batch)]
    pos = [n] * batch

    def forward() -> None:
        ids = torch.randint(0, cfg.vocab_size, (batch,))
        model.decode(ids, pos, fpool, fslots, kvp, [kv_rows[i][: pos[i] + 1] for i in range(batch)])
        for i in range(batch):
            pos[i] += 1

    # The bookkeeping: a manager over the same layout, `batch` requests admitted and prefilled.
    mpool = LinearStatePool(cfg.state_layout(), batch * 3 + 64)
    mgr = CacheManager(HybridRadixCache(mpool), host_tier=None)  # the manager alone, no demotion copies
    kv_next = 0
    for rid in range(batch):
        mgr.admit(rid, torch.randint(0, cfg.vocab_size, (n,)).tolist())
        plan = mgr.plan_prefill(rid, n)
        mgr.commit(plan, None, kv_indices=torch.arange(kv_next, kv_next + n))
        kv_next += n
    one = [torch.tensor([kv_next + i]) for i in range(batch)]
    rids, toks, kv_batch = list(range(batch)), [7] * batch, torch.arange(kv_next, kv_next + batch)
    assert mgr.metrics().captures_planned["decode"] == 0

    def single_step() -> tuple[float, float]:
        """A step as a scheduler runs it, one request at a time: plan each, forward, commit each.
        Returns (bookkeeping, forward) seconds."""
        t0 = time.perf_counter()
        plans = [mgr.plan_decode(rid, [7]) for rid in rids]
        t1 = time.perf_counter()
        forward()
        t2 = time.perf_counter()
        for rid, plan in zip(rids, plans, strict=True):
            mgr.commit(plan, None, kv_indices=one[rid])
        t3 = time.perf_counter()
        return (t1 - t0) + (t3 - t2), t2 - t1

    def batch_step() -> tuple[float, float]:
        """The same step with the batch calls: plan_decode_batch, forward, commit_batch."""
        t0 = time.perf_counter()
        plan = mgr.plan_decode_batch(rids, toks)
        t1 = time.perf_counter()
        forward()
        t2 = time.perf_counter()
        mgr.commit_batch(plan, None, kv_indices=kv_batch)
        t3 = time.perf_counter()
        return (t1 - t0) + (t3 - t2), t2 - t1

    fwd: list[float] = []
    book: list[float] = []
    single: list[float] = []
    batch_step()  # warm both
    single_step()
    for _ in range(args.rounds):
        b_, f_ = batch_step()
        s_, g_ = single_step()
        fwd += [f_, g_]
        book.append(b_)
        single.append(s_)
    mgr.check_invariants()
    f, b, b1 = statistics.median(fwd), statistics.median(book), statistics.median(single)
    print(
        json.dumps(
            {
                "bench": "manager_bookkeeping_per_decode_step",
                "batch": batch,
                "rounds": args.rounds,
                "forward_ms": round(1e3 * f, 3),
                "bookkeeping_ms": round(1e3 * b, 4),
                "bookkeeping_us_per_request": round(1e6 * b / batch, 3),
                "ratio": round(b / f, 5),
                "target_ratio": 0.01,
                "single_calls_bookkeeping_ms": round(1e3 * b1, 4),
                "single_calls_us_per_request": round(1e6 * b1 / batch, 3),
                "single_calls_ratio": round(b1 / f, 5),
                "ratios_per_round": [round(y / x, 5) for x, y in zip(fwd[::2], book, strict=True)],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
