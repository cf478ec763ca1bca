"""A host on a real transformers hybrid model (a tiny seeded Qwen3-Next) through CacheManager.

Each request: admit; on a hit, load the restored slot into a fresh transformers cache and append
the tree's KV of the prefix; per prefill window, forward split at each planned capture (the bridge
stores the state there) and commit the window's KV indices; decode token by token; store the final
state into the live slot and finish. Every answer's first-token logits are compared with a cold run.
Run: python examples/hf_host.py   (needs the hf extra)
"""

from __future__ import annotations

import random
import warnings

import torch

from linear_state import LinearStatePool, RequestOwner
from radixcache import Admission, CacheManager, HybridRadixCache, WindowPlan
from radixcache.hf import HFStateBridge, tiny_model
from radixcache.policies import HitDensity

warnings.filterwarnings("ignore", message=".*falling back.*")
config, model = tiny_model("qwen3_next")
bridge = HFStateBridge(config)  # layout from the config: conv in the model's dtype (fp32 here)
pool = LinearStatePool(bridge.layout, num_slots=3 + 32)  # (1 + track_slots) per request + snapshots
free_kv = list(range(8192))
cache = HybridRadixCache(pool, on_free_kv=lambda idx: free_kv.extend(idx.tolist()))
manager = CacheManager(cache, HitDensity(block=16), track_slots=2)

# KV by index, for every attention layer: the tree's kv_indices are rows of these.
probe = bridge.new_cache()
with torch.no_grad():
    model(input_ids=torch.ones(1, 1, dtype=torch.long), cache=probe, use_cache=True)
ATTN = bridge.attention_layers(probe)
K = {i: torch.zeros(8192, *probe.layers[i].keys.shape[1::2]) for i in ATTN}  # [token, heads, dim]
V = {i: torch.zeros(8192, *probe.layers[i].values.shape[1::2]) for i in ATTN}


def forward(hf_cache: object, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=torch.tensor([ids]), cache=hf_cache, use_cache=True).logits[0, -1]
    return logits


def serve(rid: int, prompt: list[int], new_tokens: int) -> tuple[int, torch.Tensor]:
    adm = manager.admit(rid, prompt)
    assert isinstance(adm, Admission), adm
    owner = RequestOwner(rid)
    hf_cache = bridge.new_cache()
    if adm.cached_length:  # the hit: state from the slot, KV of the prefix from the tree's indices
        adm.ready.wait()
        bridge.load(pool, adm.live_slot, hf_cache)
        for i in ATTN:
            hf_cache.layers[i].update(
                K[i][adm.kv_indices].transpose(0, 1)[None], V[i][adm.kv_indices].transpose(0, 1)[None]
            )
    n = len(prompt) + new_tokens - adm.cached_length
    kv = torch.cat([adm.kv_indices, torch.tensor(free_kv[:n], dtype=torch.int64)])
    del free_kv[:n]
    ids, first, done = list(prompt), None, adm.cached_length

    def window(plan: WindowPlan, tokens: list[int]) -> torch.Tensor:
        nonlocal kv, done
        pos, logits = plan.start, None
        for cap in plan.captures:
            logits = forward(hf_cache, tokens[pos - plan.start : cap.depth - plan.start])
            pos = cap.depth
            bridge.store(hf_cache, pool, cap.slot, owner=owner, after=plan.after)
        if plan.end > pos:
            logits = forward(hf_cache, tokens[pos - plan.start :])
        s, e = plan.start, plan.end
        for i in ATTN:  # this window's KV into its rows
            K[i][kv[s:e]] = hf_cache.layers[i].keys[0, :, s:e].transpose(0, 1)
            V[i][kv[s:e]] = hf_cache.layers[i].values[0, :, s:e].transpose(0, 1)
        res = manager.commit(plan, None, kv_indices=kv[s:e])
        if res.spliced:  # the tree holds these tokens: use its pages from now on
            kv = torch.cat([manager.kv_indices(rid), kv[e:]])
        free_kv.extend(res.free_kv.tolist())
        done = e
        assert logits is not None
        return logits

    while done < len(prompt):  # prefill in windows of 128
        logits = window(manager.plan_prefill(rid, min(len(prompt), done + 128)), prompt[done:])
    first = logits.clone()
    for _ in range(new_tokens - 1):
        tok = int(logits.argmax())
        ids.append(tok)
        logits = window(manager.plan_decode(rid, [tok]), [tok])
    ready = bridge.store(hf_cache, pool, adm.live_slot, owner=owner)  # the final state, donated
    res = manager.finish(rid, ready)
    free_kv.extend(res.free_kv.tolist() + kv[done:].tolist())
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
    assert worst < 1e-5, worst
    print(f"{len(turns)} requests, {int(hits)} hits, max |hit - cold| first-token logit {worst:.1e}")


if __name__ == "__main__":
    main()
