"""A toy host scheduler driving CacheManager, for tests: a deterministic recurrence stands in for
the model, a deferred stream for the device, a counter for the KV allocator."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from linear_state import DeferredStream, Fence, LinearStatePool, StateLayout
from radixcache import (
    Admission,
    CacheManager,
    DecodeBatchResult,
    HybridRadixCache,
    WindowPlan,
    WindowResult,
    free_kv_to,
)
from radixcache.policies import FixedPoints, Policy

LAYOUT = StateLayout(1, (2, 3), (2, 2), recurrent_dtype=torch.float64)


def token_input(tok: int) -> float:
    return float(tok % 97) / 8.0 + 1.0


def step(conv: torch.Tensor, rec: torch.Tensor, tok: int) -> None:
    """One token of the toy model: in place, order-dependent, never rolls back."""
    x = token_input(tok)
    rec.mul_(0.5).add_(x)
    conv.mul_(0.25).add_(x)


def cold_state(ids: Sequence[int] | np.ndarray) -> torch.Tensor:
    conv = torch.zeros(LAYOUT.num_layers, *LAYOUT.conv_shape, dtype=LAYOUT.conv_dtype)
    rec = torch.zeros(LAYOUT.num_layers, *LAYOUT.recurrent_shape, dtype=LAYOUT.recurrent_dtype)
    for t in ids:
        step(conv, rec, int(t))
    return rec


@dataclass
class HostReq:
    rid: Hashable
    ids: np.ndarray
    adm: Admission
    kv: torch.Tensor  # the KV table of [0, computed): the tree's pages, then the host's own
    computed: int  # tokens computed
    last: Fence | None = None
    restored_ok: bool = True


@dataclass
class Host:
    slots: int = 16
    page_size: int = 1
    track_align: int = 64
    track_slots: int = 2
    chunk: int = 256
    barrier: str = "fence"
    policy: Policy | None = None  # default: the original fixed rules on the track_align grid
    forward: DeferredStream = field(default_factory=lambda: DeferredStream("forward"))
    copies: DeferredStream = field(default_factory=lambda: DeferredStream("copies"))

    def __post_init__(self) -> None:
        self.pool = LinearStatePool(LAYOUT, self.slots)
        self.kv_free: set[int] = set()
        self.kv_next = 0
        self.cache = HybridRadixCache(
            self.pool, page_size=self.page_size, on_event=free_kv_to(self.free_kv), stream=self.copies
        )
        self.mgr = CacheManager(
            self.cache,
            self.policy if self.policy is not None else FixedPoints(self.track_align),
            track_slots=self.track_slots,
            barrier=self.barrier,  # type: ignore[arg-type]
        )
        self.reqs: dict[Hashable, HostReq] = {}

    # KV allocator -------------------------------------------------------
    def alloc_kv(self, n: int) -> torch.Tensor:
        out = torch.arange(self.kv_next, self.kv_next + n)
        self.kv_next += n
        return out

    def free_kv(self, t: torch.Tensor) -> None:
        for x in t.tolist():
            assert x not in self.kv_free, f"KV index {x} freed twice"
            assert 0 <= x < self.kv_next
            self.kv_free.add(x)

    def tree_kv(self) -> set[int]:
        out: set[int] = set()
        for n in self.cache.iter_nodes():
            out.update(n.value.tolist())
        return out

    def check_kv(self) -> None:
        tree = self.tree_kv()
        live: set[int] = set()
        for r in self.reqs.values():
            live.update(r.kv.tolist())
        assert not (tree & self.kv_free), "KV both held by the tree and free"
        assert not ((live - tree) & self.kv_free), "a live request's KV was freed"
        assert tree | self.kv_free | live == set(range(self.kv_next)), "KV leaked"

    # lifecycle ----------------------------------------------------------
    def admit(
        self,
        rid: Hashable,
        ids: Sequence[int],
        namespace: Hashable = None,
        verify: bool = True,
        session: Hashable = None,
    ) -> HostReq | None:
        arr = np.asarray(ids, dtype=np.int64)
        adm = self.mgr.admit(rid, arr, namespace=namespace, session=session)
        if not isinstance(adm, Admission):
            return None
        req = HostReq(rid, arr, adm, adm.kv_indices, adm.cached_length, adm.ready)
        if verify:
            adm.ready.wait()
            got = self.pool.read(adm.live_slot)[1]
            req.restored_ok = torch.equal(got, cold_state(arr[: adm.cached_length]))
        self.reqs[rid] = req
        return req

    def run_window(self, r: HostReq, plan: WindowPlan, ids: Sequence[int]) -> Fence:
        """Submit the window's forward: the toy model over ``ids`` (tokens [plan.start, plan.end)),
        copying the state after each planned depth into its track slot."""
        slot_for = {c.depth: c.slot for c in plan.captures}
        pool, live, start = self.pool, r.adm.live_slot, plan.start
        after = [r.last] if r.last is not None else []
        after += plan.after

        def forward_pass() -> None:
            conv, rec = pool.conv[:, live], pool.recurrent[:, live]
            for i, tok in enumerate(ids, start + 1):
                step(conv, rec, int(tok))
                if i in slot_for:
                    t = slot_for[i]
                    pool.conv[:, t].copy_(conv)
                    pool.recurrent[:, t].copy_(rec)

        r.last = self.forward.submit(forward_pass, after=after, label=f"window {r.rid} [{start},{plan.end})")
        return r.last

    def commit(self, r: HostReq, plan: WindowPlan) -> WindowResult:
        """Commit the window with freshly allocated KV for its tokens; take the tree's pages."""
        kv = self.alloc_kv(plan.end - plan.start)
        res = self.mgr.commit(plan, r.last, kv_indices=kv)
        r.computed = plan.end
        r.kv = self.mgr.kv_indices(r.rid) if res.spliced else torch.cat([r.kv, kv])
        self.free_kv(res.free_kv)
        return res

    def extend(self, rid: Hashable, end: int | None = None) -> list[int]:
        """Prefill the next chunk through the host protocol. Returns the depths donated."""
        r = self.reqs[rid]
        stop = min(len(r.ids), r.computed + self.chunk) if end is None else end
        plan = self.mgr.plan_prefill(rid, stop)
        self.run_window(r, plan, r.ids[plan.start : plan.end].tolist())
        return list(self.commit(r, plan).donated)

    def decode(self, rid: Hashable, tokens: Sequence[int]) -> WindowResult:
        """One decode window over ``tokens`` (ids fed after the prompt)."""
        r = self.reqs[rid]
        plan = self.mgr.plan_decode(rid, list(tokens))
        r.ids = np.concatenate([r.ids, np.asarray(tokens, dtype=np.int64)])
        self.run_window(r, plan, list(tokens))
        return self.commit(r, plan)

    def decode_batch(self, rids: Sequence[Hashable], tokens: Sequence[int]) -> DecodeBatchResult:
        """One decode step for a batch, through plan_decode_batch / commit_batch."""
        batch = self.mgr.plan_decode_batch(list(rids), list(tokens))
        last: Fence | None = None
        for rid, tok in zip(rids, tokens, strict=True):
            r = self.reqs[rid]
            r.ids = np.concatenate([r.ids, np.asarray([tok], dtype=np.int64)])
            plan = batch.plans.get(rid) or WindowPlan(rid, r.computed, r.computed + 1, (), (), r.adm.live_slot, True, 0)
            last = self.run_window(r, plan, [tok])
        kv = self.alloc_kv(len(rids))
        res = self.mgr.commit_batch(batch, last, kv_indices=kv)
        for i, rid in enumerate(rids):
            r = self.reqs[rid]
            r.last, r.computed = last, r.computed + 1
            one = res.results.get(rid)
            r.kv = self.mgr.kv_indices(rid) if one is not None and one.spliced else torch.cat([r.kv, kv[i : i + 1]])
        self.free_kv(res.free_kv)
        return res

    def prefill(self, rid: Hashable) -> None:
        while self.reqs[rid].computed < len(self.reqs[rid].ids):
            self.extend(rid)

    def finish(self, rid: Hashable) -> int | None:
        r = self.reqs.pop(rid)
        assert r.computed == len(r.ids)
        res = self.mgr.finish(rid, r.last)
        self.free_kv(res.free_kv)  # what the tree did not take stays the host's
        return res.donated_depth

    def abort(self, rid: Hashable) -> None:
        r = self.reqs.pop(rid)
        res = self.mgr.abort(rid, r.last)
        self.free_kv(res.free_kv)  # the host's own KV beyond what the tree took

    def final_state_ok(self, rid: Hashable) -> bool:
        r = self.reqs[rid]
        if r.last is not None:
            r.last.wait()
        return torch.equal(self.pool.read(r.adm.live_slot)[1], cold_state(r.ids[: r.computed]))
