"""A minimal host scheduler on CacheManager: every step of docs/integration.md, in order.

The "model" is radixcache.testing's ground-truth recurrence (exact in float64), the device a
deferred stream, the KV allocator a free list. Each request is served in prefill chunks, then
decoded token by token; every hit's restored state is checked against the cold computation.
Run: python examples/minimal_host.py
"""

from __future__ import annotations

import random

import torch

from linear_state import DeferredStream, Fence, LinearStatePool
from radixcache import Admission, CacheManager, HybridRadixCache, WindowPlan
from radixcache.testing.adapter import FUZZ_LAYOUT, advance, prefix_state


class KVFreeList:
    """The host's KV allocator; the tree returns evicted indices through ``free``."""

    def __init__(self, n: int) -> None:
        self.free_ids = list(range(n))

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_ids):
            return None
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, idx: torch.Tensor) -> None:
        self.free_ids += idx.tolist()


forward = DeferredStream("forward")  # stands in for the device's forward stream
pool = LinearStatePool(FUZZ_LAYOUT, num_slots=4 * 3 + 16)  # (1 + track_slots) per request + snapshots
kv = KVFreeList(4096)
cache = HybridRadixCache(pool, page_size=16, on_free_kv=kv.free, stream=DeferredStream("copies"))
manager = CacheManager(cache, track_slots=2)  # the default policy: HitDensity


def run_window(live: int, plan: WindowPlan, ids: list[int], last: Fence | None) -> Fence:
    """The host's forward over ``ids`` (tokens [plan.start, plan.end)), capturing as planned."""
    at = {c.depth: c.slot for c in plan.captures}

    def work() -> None:
        for pos, tok in enumerate(ids, plan.start + 1):
            advance(pool.conv[:, live], pool.recurrent[:, live], tok)
            if pos in at:  # the state after exactly `pos` tokens
                pool.conv[:, at[pos]].copy_(pool.conv[:, live])
                pool.recurrent[:, at[pos]].copy_(pool.recurrent[:, live])

    return forward.submit(work, after=[f for f in (last, *plan.after) if f is not None])


def serve(rid: int, prompt: list[int], answer: list[int], session: str) -> int:
    """One request through the protocol; returns its hit length."""
    # admission: a dry run, KV pressure through the manager's policy, then the admission itself
    check = manager.can_admit(prompt)
    need = len(prompt) + len(answer) - check.cached_length
    if len(kv.free_ids) < need:
        manager.evict(kv_tokens=need - len(kv.free_ids), keep=prompt)
    fresh = kv.alloc(need)
    adm = manager.admit(rid, prompt, session=session)
    assert isinstance(adm, Admission) and fresh is not None, "sized for it above"
    last: Fence | None = adm.ready  # the first forward is ordered after the restore
    done, table = adm.cached_length, adm.kv_indices  # table: KV of [0, done), what attention reads
    adm.ready.wait()  # only to check the restore here; a host orders its forward after it instead
    assert torch.equal(pool.recurrent[:, adm.live_slot], prefix_state(prompt[:done])[1]), "wrong restore"
    # prefill, one chunk per window: plan -> forward -> commit
    while done < len(prompt):
        plan = manager.plan_prefill(rid, min(len(prompt), done + 64))
        last = run_window(adm.live_slot, plan, prompt[plan.start : plan.end], last)
        res = manager.commit(plan, last, kv_indices=fresh[: plan.end - plan.start])
        table = manager.kv_indices(rid) if res.spliced else torch.cat([table, fresh[: plan.end - plan.start]])
        fresh, done = fresh[plan.end - plan.start :], plan.end
        kv.free(res.free_kv)  # reused only by forwards after res.free_after: one stream gives that
    assert len(table) == len(prompt) and torch.equal(table, manager.kv_indices(rid))
    # decode, one token per window
    for tok in answer:
        plan = manager.plan_decode(rid, [tok])
        last = run_window(adm.live_slot, plan, [tok], last)
        res = manager.commit(plan, last, kv_indices=fresh[:1])
        fresh = fresh[1:]
        kv.free(res.free_kv)
    fin = manager.finish(rid, last)  # donates the final state (or its deepest page-aligned capture)
    kv.free(fin.free_kv)  # the request's KV the tree does not hold
    kv.free(fresh)  # allocated, never handed over
    return adm.cached_length


def main() -> None:
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(150)]
    hits = 0
    for turn in range(3):  # three users, three turns each, on one system prompt
        for user in range(3):
            history = system + [rng.randrange(1000) for _ in range(20 * (turn + 1) + user)]
            hits += serve(10 * turn + user, history, [rng.randrange(1000) for _ in range(9)], f"u{user}")
    forward.synchronize()
    manager.check_invariants()
    m = manager.metrics()
    print(f"{m.admissions} requests, {m.hits} hits, {m.hit_tokens} of {m.prompt_tokens} prompt tokens from cache")
    print(f"donated {dict(m.donations)}, evicted {dict(m.evictions)}")
    assert hits == m.hit_tokens and m.hits > 0


if __name__ == "__main__":
    main()
