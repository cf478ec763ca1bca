"""A toy scheduler as its own HostAdapter, fuzzed (longer runs: ``radixcache fuzz``). It runs its
"model" synchronously; its forward writes the ground-truth state (``advance``), checked exactly.
Each window follows the manager's host protocol: plan, forward with the planned captures, commit."""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from linear_state import LinearStatePool
from radixcache import Admission, CacheManager, HybridRadixCache, WindowPlan, image_cache_ids
from radixcache.policies import FixedPoints
from radixcache.testing.adapter import FUZZ_LAYOUT, PLACEHOLDER, advance, model_inputs, ns_salt
from radixcache.testing.fuzz import run_fuzz


@dataclass
class Req:  # prompt length n; the live state covers ids[:computed] (the model's inputs)
    ids: list[int]
    salt: int  # the namespace's effect on the model (a LoRA adapter, a tenant)
    n: int
    adm: Admission
    computed: int


class ToyAdapter:
    run_pending = staticmethod(lambda: False)  # nothing is ever pending: this host runs synchronously

    def __init__(self) -> None:
        self.pool = LinearStatePool(FUZZ_LAYOUT, 12)
        self.manager = CacheManager(HybridRadixCache(self.pool), FixedPoints(align=4), track_slots=2)
        self.reqs: dict[int, Req] = {}  # request rid's KV index for token i is rid * 10_000 + i

    def admit(
        self, rid: int, ids: list[int], *, namespace: Hashable = None, images: Sequence[bytes] = ()
    ) -> int | None:
        key = image_cache_ids(ids, PLACEHOLDER, images) if images else ids  # what the cache is keyed by
        adm = self.manager.admit(rid, key, namespace=namespace)
        if not isinstance(adm, Admission):
            return None
        inputs = model_inputs(ids, PLACEHOLDER, images)  # what the model consumes
        self.reqs[rid] = Req(inputs, ns_salt(namespace), len(ids), adm, adm.cached_length)
        return adm.cached_length

    def _forward(self, rid: int, plan: WindowPlan, tokens: list[int]) -> None:
        r, pool, live = self.reqs[rid], self.pool, self.reqs[rid].adm.live_slot
        slots = {c.depth: c.slot for c in plan.captures}
        for i, tok in enumerate(tokens, plan.start + 1):
            advance(pool.conv[:, live], pool.recurrent[:, live], tok, r.salt)
            if i in slots:  # capture the state after exactly i tokens
                pool.conv[:, slots[i]], pool.recurrent[:, slots[i]] = pool.conv[:, live], pool.recurrent[:, live]
        r.computed = plan.end
        self.manager.commit(plan, None, kv_indices=torch.arange(plan.start, plan.end) + rid * 10_000)

    def extend(self, rid: int) -> bool:
        r = self.reqs[rid]
        tokens = r.ids[r.computed : r.n][:8]
        if tokens:
            self._forward(rid, self.manager.plan_prefill(rid, r.computed + len(tokens)), tokens)
        return bool(tokens)

    def decode(self, rid: int, token: int) -> None:
        self.reqs[rid].ids.append(token)
        self._forward(rid, self.manager.plan_decode(rid, [token]), [token])

    def finish(self, rid: int) -> None:
        del self.reqs[rid]
        self.manager.finish(rid)  # this toy never reuses KV indices: nothing to free

    def abort(self, rid: int) -> None:
        del self.reqs[rid]
        self.manager.abort(rid)

    def state(self, rid: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        live, r = self.reqs[rid].adm.live_slot, self.reqs[rid]
        return self.pool.conv[:, live].clone(), self.pool.recurrent[:, live].clone(), r.ids[: r.computed]


if __name__ == "__main__":
    run_fuzz(300, seed=0, factory=ToyAdapter)  # raises, printing the shrunk program, on any failure
    print("300 examples, seed 0: nothing found")
