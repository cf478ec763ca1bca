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

``write_checks``: what the always-on checks of ``CacheManager(write_checks=True)`` cost (issue 31,
item 7): requests served whole (admit, one prefill window with four captures, commit, finish) by
two managers side by side, checks on and off, alternating; the manager's call time only (the
host's writes are not timed), per request and per donation, and the difference per donation.

    python benchmarks/bench_manager.py [--batch 64] [--rounds 30] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from linear_state import LinearStatePool, RequestOwner
from radixcache import CacheManager, HybridRadixCache, KVFreeList
from radixcache.policies import FixedPoints
from radixcache.testing.model import HybridConfig, HybridModel, KVPool


def write_check_cost(layout: object, requests: int, rounds: int) -> dict[str, float]:
    """Manager seconds per request with write checks on and off, alternating (see the docstring)."""
    mgrs = {}
    for on in (True, False):
        pool = LinearStatePool(layout, 5 + 4 * requests + 8)  # type: ignore[arg-type]
        mgrs[on] = CacheManager(
            HybridRadixCache(pool),
            FixedPoints(align=64),
            track_slots=4,
            kv=KVFreeList(1 << 20),
            host_tier=None,
            write_checks=on,
        )
    made = [0]

    def serve(mgr: CacheManager) -> tuple[float, int]:
        """``requests`` fresh prompts of 256 tokens; returns (manager seconds, donations)."""
        spent, before = 0.0, sum(mgr.metrics().donations.values())
        pool = mgr.pool
        for _ in range(requests):
            made[0] += 1
            ids = [made[0] % 50000 + 1, *torch.randint(0, 50000, (255,)).tolist()]
            t0 = time.perf_counter()
            adm = mgr.admit(made[0], ids)
            plan = mgr.plan_prefill(made[0], 256)
            t1 = time.perf_counter()
            for c in plan.captures:  # the host's forward: every planned state written (not timed)
                pool.conv[:, c.slot].normal_()
                pool.recurrent[:, c.slot].normal_()
            pool.conv[:, adm.live_slot].normal_()  # type: ignore[union-attr]
            t2 = time.perf_counter()
            mgr.commit(plan, None)
            mgr.finish(made[0])
            spent += (t1 - t0) + (time.perf_counter() - t2)
        mgr.evict(snapshots=mgr.cache.num_snapshots)  # the next round starts from an empty tree
        return spent, sum(mgr.metrics().donations.values()) - before

    serve(mgrs[True])
    serve(mgrs[False])
    on_s: list[float] = []
    off_s: list[float] = []
    donations = 0
    for _ in range(rounds):
        t, d = serve(mgrs[True])
        on_s.append(t)
        donations += d
        off_s.append(serve(mgrs[False])[0])
    per_don = donations / (rounds * requests)
    t_on, t_off = statistics.median(on_s) / requests, statistics.median(off_s) / requests
    return {
        "donations_per_request": round(per_don, 2),
        "on_us_per_request": round(1e6 * t_on, 2),
        "off_us_per_request": round(1e6 * t_off, 2),
        "cost_us_per_donation": round(1e6 * (t_on - t_off) / per_don, 2),
        "ratio_on_off": round(t_on / t_off, 4),
    }


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
                "write_checks": write_check_cost(cfg.state_layout(), 4 if args.quick else 32, args.rounds),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
