"""A host on a real transformers hybrid model (a tiny seeded Qwen3-Next) through CacheManager.

Each request: admit (the manager reserves its KV from the free list it was given); on a hit, load
the restored slot into a fresh transformers cache and append the tree's KV of the prefix (KVStore);
per prefill window, forward split at each planned capture (the bridge stores the state there),
save the window's KV where the plan says and commit; decode token by token; store the final state
into the live slot and finish. Every answer's first-token logits are compared with a cold run.
Run: python examples/hf_host.py   (needs the hf extra)
"""

from __future__ import annotations

import random
import warnings

import torch

from linear_state import LinearStatePool, RequestOwner
from radixcache import Admission, CacheManager, HybridRadixCache, KVFreeList, WindowPlan
from radixcache.hf import HFStateBridge, KVStore, tiny_model
from radixcache.policies import HitDensity

warnings.filterwarnings("ignore", message=".*falling back.*")
config, model = tiny_model("qwen3_next")
bridge = HFStateBridge(config)  # layout from the config: conv in the model's dtype (fp32 here)
pool = LinearStatePool(bridge.layout, num_slots=3 + 32)  # (1 + track_slots) per request + snapshots
kv = KVFreeList(8192)  # the manager reserves from it and gives back to it
cache = HybridRadixCache(pool)
manager = CacheManager(cache, HitDensity(block=16), track_slots=2, kv=kv)
kv_store = KVStore(model, bridge, 8192)  # attention K and V rows by KV index: the tree's indices are rows


def forward(hf_cache: object, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=torch.tensor([ids]), cache=hf_cache, use_cache=True).logits[0, -1]
    return logits


def serve(rid: int, prompt: list[int], new_tokens: int) -> tuple[int, torch.Tensor]:
    adm = manager.admit(rid, prompt, max_new_tokens=new_tokens)
    assert isinstance(adm, Admission), adm
    owner = RequestOwner(rid)
    hf_cache = bridge.new_cache()
    if adm.cached_length:  # the hit: state from the slot, KV of the prefix from the tree's indices
        adm.ready.wait()
        bridge.load(pool, adm.live_slot, hf_cache)
        kv_store.load(hf_cache, adm.kv_indices)
    ids, first, done = list(prompt), None, adm.cached_length

    def window(plan: WindowPlan, tokens: list[int]) -> torch.Tensor:
        nonlocal done
        pos, logits = plan.start, None
        for cap in plan.captures:
            logits = forward(hf_cache, tokens[pos - plan.start : cap.depth - plan.start])
            pos = cap.depth
            bridge.store(hf_cache, pool, cap.slot, owner=owner, after=plan.after)
        if plan.end > pos:
            logits = forward(hf_cache, tokens[pos - plan.start :])
        assert plan.kv_indices is not None and logits is not None
        kv_store.save(hf_cache, plan.start, plan.end, plan.kv_indices)  # this window's KV into its rows
        manager.commit(plan, None)
        done = plan.end
        return logits

    while done < len(prompt):  # prefill in windows of 128
        logits = window(manager.plan_prefill(rid, min(len(prompt), done + 128)), prompt[done:])
    first = logits.clone()
    for _ in range(new_tokens - 1):
        tok = int(logits.argmax())
        ids.append(tok)
        logits = window(manager.plan_decode(rid, [tok]), [tok])
    ready = bridge.store(hf_cache, pool, adm.live_slot, owner=owner)  # the final state, donated
    manager.finish(rid, ready)  # the KV the tree does not hold goes back to kv
    return adm.cached_length, first


def main() -> None:
    rng = random.Random(0)
    system = [rng.randrange(3, 256) for _ in range(300)]
    turns = [system + [rng.randrange(3, 256) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    turns += [turns[0] + [rng.randrange(3, 256) for _ in range(30)], turns[1]]
    hits = worst = 0.0
    for rid, prompt in enumerate(turns):
        cached, first = serve(rid, prompt, 4)
        cold = forward(bridge.new_cache(), prompt)
        worst = max(worst, float((first - cold).abs().max()))
        hits += cached > 0
    manager.check_invariants()
    assert kv.num_free + cache.total_kv_tokens == kv.capacity, "every KV index is free or the tree's"
    assert worst < 1e-5, worst
    print(f"{len(turns)} requests, {int(hits)} hits, max |hit - cold| first-token logit {worst:.1e}")


if __name__ == "__main__":
    main()
