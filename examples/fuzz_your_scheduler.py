"""A toy scheduler as its own HostAdapter, fuzzed (longer runs: ``radixcache fuzz``). It runs its
"model" synchronously; its forward writes the ground-truth state (``advance``), checked exactly."""

from dataclasses import dataclass

import torch

from linear_state import LinearStatePool
from radixcache import Admission, CacheManager, HybridRadixCache
from radixcache.testing.adapter import FUZZ_LAYOUT, advance
from radixcache.testing.fuzz import run_fuzz


@dataclass
class Req:  # prompt length n; the live state covers ids[:done]
    ids: list[int]
    n: int
    adm: Admission
    kv: torch.Tensor
    done: int


class ToyAdapter:
    run_pending = staticmethod(lambda: False)  # nothing is ever pending: this host runs synchronously

    def __init__(self) -> None:
        self.pool = LinearStatePool(FUZZ_LAYOUT, 12)
        self.manager = CacheManager(HybridRadixCache(self.pool), track_align=4, track_slots=2)
        self.reqs: dict[int, Req] = {}  # request rid's KV index for token i is rid * 10_000 + i

    def admit(self, rid: int, ids: list[int]) -> int | None:
        adm = self.manager.admit(rid, ids)
        if not isinstance(adm, Admission):
            return None
        kv = torch.cat([adm.kv_indices, torch.arange(adm.cached_length, len(ids)) + rid * 10_000])
        self.reqs[rid] = Req(list(ids), len(ids), adm, kv, adm.cached_length)
        return adm.cached_length

    def _forward(self, rid: int, tokens: list[int]) -> None:
        r, pool, live, start = self.reqs[rid], self.pool, self.reqs[rid].adm.live_slot, self.reqs[rid].done
        points = self.manager.track_points(rid, start, start + len(tokens)) if start < r.n else []
        slots = dict(zip(points, r.adm.track_slots, strict=False))
        for i, tok in enumerate(tokens, start + 1):
            advance(pool.conv[:, live], pool.recurrent[:, live], tok)
            if i in slots:  # capture the state after exactly i tokens
                pool.conv[:, slots[i]], pool.recurrent[:, slots[i]] = pool.conv[:, live], pool.recurrent[:, live]
        r.done += len(tokens)
        for d in points:
            res = self.manager.commit(rid, d, slots[d], None, kv_indices=r.kv[:d])
            r.kv = torch.cat([res.kv_indices, r.kv[d:]]) if res.donated else r.kv

    def extend(self, rid: int) -> bool:
        tokens = self.reqs[rid].ids[self.reqs[rid].done : self.reqs[rid].n][:8]
        self._forward(rid, tokens)  # no tokens left: a no-op
        return bool(tokens)

    def decode(self, rid: int, token: int) -> None:
        r = self.reqs[rid]
        r.ids, r.kv = [*r.ids, token], torch.cat([r.kv, torch.tensor([rid * 10_000 + len(r.ids)])])
        self.manager.append(rid, [token])
        self._forward(rid, [token])

    def finish(self, rid: int) -> None:
        r = self.reqs.pop(rid)
        self.manager.finish(rid, None, kv_indices=r.kv[: r.done])

    def abort(self, rid: int) -> None:
        del self.reqs[rid]
        self.manager.abort(rid)

    def state(self, rid: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        live, r = self.reqs[rid].adm.live_slot, self.reqs[rid]
        return self.pool.conv[:, live].clone(), self.pool.recurrent[:, live].clone(), r.ids[: r.done]


if __name__ == "__main__":
    run_fuzz(300, seed=0, factory=ToyAdapter)  # raises, printing the shrunk program, on any failure
    print("300 examples, seed 0: nothing found")
