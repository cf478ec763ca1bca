"""A host on a real transformers hybrid model (a tiny seeded Qwen3-Next) through CacheManager.

Each request: admit (the manager reserves its KV from the free list it was given); an HFSequence
loads a hit (the restored slot into a fresh transformers cache, the tree's KV of the prefix from the
KVStore), runs each planned window (forward split at each capture, states stored, KV saved where
the plan says, commit) and at finish stores the final state for the manager to donate. Every
answer's first-token logits are compared with a cold run.
Run: python examples/hf_host.py   (needs the hf extra)
"""

from __future__ import annotations

import random
import warnings

import torch

from linear_state import LinearStatePool
from radixcache import Admission, CacheManager, HybridRadixCache, KVFreeList
from radixcache.hf import HFSequence, HFStateBridge, KVStore, forward_logits, tiny_model
from radixcache.policies import HitDensity

warnings.filterwarnings("ignore", message=".*falling back.*")
config, model = tiny_model("qwen3_next")
bridge = HFStateBridge(config)  # layout from the config: conv in the model's dtype (fp32 here)
pool = LinearStatePool(bridge.layout, num_slots=3 + 32)  # (1 + track_slots) per request + snapshots
kv = KVFreeList(8192)  # the manager reserves from it and gives back to it
cache = HybridRadixCache(pool)
manager = CacheManager(cache, HitDensity(block=16), track_slots=2, kv=kv)
kv_store = KVStore(model, bridge, 8192)  # attention K and V rows by KV index: the tree's indices are rows


def serve(rid: int, prompt: list[int], new_tokens: int) -> tuple[int, torch.Tensor]:
    adm = manager.admit(rid, prompt, max_new_tokens=new_tokens)
    assert isinstance(adm, Admission), adm
    seq = HFSequence(manager, model, bridge, kv_store, adm, prompt)
    while seq.computed < len(prompt):  # prefill in windows of 128
        logits = seq.prefill(min(len(prompt), seq.computed + 128))
    first = logits.clone()
    for _ in range(new_tokens - 1):
        logits = seq.decode(int(logits.argmax()))
    seq.finish()  # the final state is donated; the KV the tree does not hold goes back to kv
    return adm.cached_length, first


def main() -> None:
    rng = random.Random(0)
    system = [rng.randrange(3, 256) for _ in range(300)]
    turns = [system + [rng.randrange(3, 256) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    turns += [turns[0] + [rng.randrange(3, 256) for _ in range(30)], turns[1]]
    hits = worst = 0.0
    for rid, prompt in enumerate(turns):
        cached, first = serve(rid, prompt, 4)
        cold = forward_logits(model, bridge.new_cache(), prompt)
        worst = max(worst, float((first - cold).abs().max()))
        hits += cached > 0
    manager.check_invariants()
    assert kv.num_free + cache.total_kv_tokens == kv.capacity, "every KV index is free or the tree's"
    assert worst < 1e-5, worst
    print(f"{len(turns)} requests, {int(hits)} hits, max |hit - cold| first-token logit {worst:.1e}")


if __name__ == "__main__":
    main()
