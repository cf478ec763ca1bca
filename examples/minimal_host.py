"""A minimal host scheduler on CacheManager: every step of docs/integration.md, in order.

The "model" is radixcache.testing's ground-truth recurrence (exact in float64), the device a
deferred stream, the KV allocator a free list that the manager draws from and gives back to (it
keeps every request's KV table). Each request is served in prefill chunks, then
decoded token by token; every hit's restored state is checked against the cold computation.
Run: python examples/minimal_host.py
"""

from __future__ import annotations

import random

import torch

from linear_state import DeferredStream, Fence, LinearStatePool
from radixcache import Admission, CacheManager, HybridRadixCache, KVFreeList, WindowPlan
from radixcache.testing.adapter import FUZZ_LAYOUT, advance, prefix_state

forward = DeferredStream("forward")  # stands in for the device's forward stream
pool = LinearStatePool(FUZZ_LAYOUT, num_slots=4 * 3 + 16)  # (1 + track_slots) per request + snapshots
kv = KVFreeList(4096)  # one forward stream: an index freed is reused only by later forwards
cache = HybridRadixCache(pool, page_size=16, stream=DeferredStream("copies"))
manager = CacheManager(cache, track_slots=2, kv=kv)  # the default policy: HitDensity


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
    # admission reserves the request's KV (evicting the tree's through the policy when short)
    adm = manager.admit(rid, prompt, session=session, max_new_tokens=len(answer))
    assert isinstance(adm, Admission), adm  # a Refusal: a real host retries it later
    last: Fence | None = adm.ready  # the first forward is ordered after the restore
    adm.ready.wait()  # only to check the restore here; a host orders its forward after it instead
    done = adm.cached_length
    assert torch.equal(pool.recurrent[:, adm.live_slot], prefix_state(prompt[:done])[1]), "wrong restore"
    # prefill, one chunk per window: plan -> forward -> commit. A real forward writes its tokens'
    # KV at plan.kv_indices and its attention reads plan.kv_table (the tree's pages for the hit).
    while done < len(prompt):
        plan = manager.plan_prefill(rid, min(len(prompt), done + 64))
        last = run_window(adm.live_slot, plan, prompt[plan.start : plan.end], last)
        manager.commit(plan, last)  # the tree takes its captures; duplicate KV goes back to kv
        done = plan.end
    # decode, one token per window
    for tok in answer:
        plan = manager.plan_decode(rid, [tok])
        last = run_window(adm.live_slot, plan, [tok], last)
        manager.commit(plan, last)
    manager.finish(rid, last)  # donates the final state; the KV the tree does not hold goes back to kv
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
    assert kv.num_free + cache.total_kv_tokens == kv.capacity, "every KV index is free or the tree's"


if __name__ == "__main__":
    main()
