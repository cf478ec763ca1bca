"""Issue 31 item 7: two silent host mistakes become loud without forensics. A capture slot the host
committed but never wrote, and a live slot finished without the final state stored into it, give
the tree a wrong snapshot; the manager finds each when the request ends, evicts it and warns."""

from __future__ import annotations

import warnings

import pytest
import torch

from linear_state import ImmediateStream, LinearStatePool, RequestOwner
from radixcache import Admission, CacheManager, HybridRadixCache, KVFreeList, UnwrittenSlotWarning
from radixcache.policies import FixedPoints
from radixcache.testing.adapter import FUZZ_LAYOUT, advance

from .test_kv_owned import forward, make

PROMPT = list(range(1, 41))  # FixedPoints(align=8): captures at 8, 16, 24, 32 (two per window)


def prefill(mgr: CacheManager, rid: str, ids: list[int], *, skip: int | None = None, conv_only: bool = False) -> None:
    """Serve ``ids`` in windows of 16; the capture at depth ``skip`` is not written (or, with
    ``conv_only``, only its conv window is)."""
    adm = mgr.admit(rid, ids)
    assert isinstance(adm, Admission)
    done = adm.cached_length
    while done < len(ids):
        plan = mgr.plan_prefill(rid, min(len(ids), done + 16))
        saved = {
            c.slot: (mgr.pool.conv[:, c.slot].clone(), mgr.pool.recurrent[:, c.slot].clone())
            for c in plan.captures
            if c.depth == skip
        }
        forward(mgr, plan, ids)
        for slot, (conv, rec) in saved.items():  # the host's mistake: this capture was never copied
            if not conv_only:
                mgr.pool.conv[:, slot].copy_(conv)
            mgr.pool.recurrent[:, slot].copy_(rec)
        mgr.commit(plan, None)
        done = plan.end


def test_a_correct_host_raises_no_warning_and_keeps_every_snapshot() -> None:
    mgr, _ = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnwrittenSlotWarning)
        prefill(mgr, "a", PROMPT)
        fin = mgr.finish("a")
    assert fin.donated_depth == 40 and mgr.metrics().unwritten_snapshots == 0
    assert mgr.cache.match(PROMPT[:24], touch=False).cached_length == 24
    mgr.check_invariants()


@pytest.mark.parametrize("conv_only", [False, True], ids=["never-written", "conv-only"])
def test_a_capture_never_written_is_evicted_with_a_warning_at_finish(conv_only: bool) -> None:
    mgr, kv = make()
    prefill(mgr, "a", PROMPT, skip=24, conv_only=conv_only)
    assert mgr.cache.match(PROMPT[:25], touch=False).cached_length == 24, "the wrong snapshot is in the tree until then"
    with pytest.warns(UnwrittenSlotWarning, match=r"request 'a' .* depth 24 from a capture slot .*; evicted"):
        mgr.finish("a")
    assert mgr.metrics().unwritten_snapshots == 1
    assert mgr.cache.match(PROMPT[:25], touch=False).cached_length == 16, "served from the written one below"
    assert mgr.cache.match(PROMPT[:33], touch=False).cached_length == 32
    mgr.check_invariants()
    assert kv.num_free + mgr.cache.total_kv_tokens == kv.capacity


def test_a_capture_never_written_is_found_at_abort_too() -> None:
    mgr, _ = make()
    prefill(mgr, "a", PROMPT, skip=8)
    with pytest.warns(UnwrittenSlotWarning, match="depth 8 from a capture slot"):
        mgr.abort("a")
    assert mgr.cache.match(PROMPT[:9], touch=False).cached_length == 0
    mgr.check_invariants()


@pytest.mark.parametrize("hit", [False, True], ids=["from-zeros", "after-a-hit"])
def test_a_live_slot_finished_unwritten_is_not_kept(hit: bool) -> None:
    """The newcomer's host on transformers: it computed every token in its own cache and forgot
    to store the final state into the live slot before finish."""
    pool = LinearStatePool(FUZZ_LAYOUT, 16)
    cache = HybridRadixCache(pool, page_size=1, stream=ImmediateStream())
    mgr = CacheManager(cache, FixedPoints(align=64), track_slots=2, kv=KVFreeList(256), host_tier=None)
    if hit:
        prefill(mgr, "first", PROMPT[:20])
        mgr.finish("first")
    adm = mgr.admit("a", PROMPT)
    assert isinstance(adm, Admission) and adm.cached_length == (20 if hit else 0)
    plan = mgr.plan_prefill("a", 40)
    admitted = (pool.conv[:, adm.live_slot].clone(), pool.recurrent[:, adm.live_slot].clone())
    forward(mgr, plan, PROMPT)  # the captures are written...
    pool.conv[:, adm.live_slot].copy_(admitted[0])  # BUG: ...but the final state never reached the live slot
    pool.recurrent[:, adm.live_slot].copy_(admitted[1])
    mgr.commit(plan, None)
    with pytest.warns(UnwrittenSlotWarning, match="depth 40 from a live slot still holding the state it was admitted"):
        fin = mgr.finish("a")
    assert fin.donated_depth is None and fin.node is None
    depth = mgr.cache.match(PROMPT, touch=False).cached_length
    assert depth == 39, "the written re-send capture stays, not the final state"
    assert mgr.metrics().unwritten_snapshots == 1
    mgr.check_invariants()


def test_a_written_live_slot_is_kept() -> None:
    pool = LinearStatePool(FUZZ_LAYOUT, 16)
    cache = HybridRadixCache(pool, page_size=1, stream=ImmediateStream())
    mgr = CacheManager(cache, FixedPoints(align=64), track_slots=2, kv=KVFreeList(256), host_tier=None)
    assert isinstance(mgr.admit("a", PROMPT), Admission)
    plan = mgr.plan_prefill("a", 40)
    forward(mgr, plan, PROMPT)
    mgr.commit(plan, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnwrittenSlotWarning)
        assert mgr.finish("a").donated_depth == 40


def test_a_bad_snapshot_another_request_holds_is_reported_as_kept() -> None:
    mgr, _ = make()
    prefill(mgr, "a", PROMPT, skip=32)
    adm = mgr.admit("b", [*PROMPT[:32], 777])
    assert isinstance(adm, Admission) and adm.cached_length == 32  # served before "a" ended: too late
    with pytest.warns(UnwrittenSlotWarning, match="depth 32 .*kept: another request holds it"):
        mgr.finish("a")
    assert mgr.metrics().unwritten_snapshots == 1
    mgr.abort("b")
    mgr.check_invariants()


def test_without_write_checks_the_mistake_stays_silent() -> None:
    """The check is what finds it: off, the wrong snapshot stays and serves hits."""
    kv = KVFreeList(256)
    pool = LinearStatePool(FUZZ_LAYOUT, 16)
    cache = HybridRadixCache(pool, page_size=1, stream=ImmediateStream())
    mgr = CacheManager(cache, FixedPoints(align=8), track_slots=2, kv=kv, host_tier=None, write_checks=False)
    assert isinstance(mgr.admit("a", PROMPT[:16]), Admission)
    plan = mgr.plan_prefill("a", 16)
    assert plan.after == tuple(pool.last_use(c.slot) for c in plan.captures), "no marks queued"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnwrittenSlotWarning)
        mgr.commit(plan, None)  # BUG: nothing written
        mgr.finish("a")
    assert mgr.cache.match(PROMPT[:9], touch=False).cached_length == 8
    with pytest.raises(ValueError, match="write_checks must be a bool, got 1"):
        CacheManager(HybridRadixCache(LinearStatePool(FUZZ_LAYOUT, 4)), write_checks=1)  # type: ignore[arg-type]


def test_pool_marks_and_probes() -> None:
    pool = LinearStatePool(FUZZ_LAYOUT, 3)
    owner = RequestOwner("r")
    s = pool.alloc(owner)
    assert not pool.unwritten(s)
    pool.mark_unwritten(s, owner=owner).wait()
    assert pool.unwritten(s) and pool.probe(s).isnan().any()
    conv = torch.zeros(FUZZ_LAYOUT.num_layers, *FUZZ_LAYOUT.conv_shape, dtype=torch.float64)
    rec = torch.zeros(FUZZ_LAYOUT.num_layers, *FUZZ_LAYOUT.recurrent_shape, dtype=torch.float64)
    advance(conv, rec, 5)
    pool.recurrent[:, s].copy_(rec)
    assert pool.unwritten(s), "the conv window still carries its marks"
    pool.conv[:, s].copy_(conv)
    assert not pool.unwritten(s)
    assert torch.equal(pool.probe(s), pool.probe(s)) and not pool.probe(s).isnan().any()
    t = pool.alloc(owner)
    assert not torch.equal(pool.probe(s), pool.probe(t)), "different states, different probes"
