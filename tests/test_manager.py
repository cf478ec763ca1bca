from collections.abc import Hashable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linear_state import RequestOwner
from radixcache import (
    Admission,
    EvictionReason,
    ProtocolError,
    Refusal,
    RefusalCause,
    RejectReason,
    SkipReason,
    UnknownRequest,
    image_cache_ids,
)
from radixcache.testing.digest import state_digest

from .host_sim import Host

RNG = np.random.default_rng(1234)


def tokens(n: int) -> list[int]:
    return [int(x) for x in RNG.integers(0, 5000, n)]


def settle(h: Host) -> None:
    h.forward.synchronize()
    h.copies.synchronize()
    h.check_kv()
    h.mgr.check_invariants()


def run_one(h: Host, rid: Hashable, ids: list[int]) -> int:
    r = h.admit(rid, ids)
    assert r is not None and r.restored_ok
    h.prefill(rid)
    assert h.final_state_ok(rid)
    h.finish(rid)
    settle(h)
    return r.adm.cached_length


def test_identical_resend_of_1000_tokens_hits() -> None:
    h = Host()
    p = tokens(1000)
    assert run_one(h, "first", p) == 0
    assert run_one(h, "again", p) >= 960


def test_shared_prefix_ending_mid_block() -> None:
    h = Host()
    shared = tokens(1500)
    hits = [run_one(h, i, shared + tokens(700)) for i in range(3)]
    assert hits[0] == 0
    assert hits[1] >= 1024
    assert hits[2] >= 1472, "the third request hits the branch point the second one captured"


def test_multi_turn_continuation_hits_the_finish_state() -> None:
    h = Host()
    turn1 = tokens(300)
    run_one(h, "t1", turn1)
    assert run_one(h, "t2", turn1 + tokens(120)) == 300


def test_device_barrier_mode_is_equivalent_on_cpu() -> None:
    h = Host(barrier="device")
    p = tokens(500)
    run_one(h, 1, p)
    assert run_one(h, 2, p) == 499


def test_plan_prefill_priorities_and_budget() -> None:
    h = Host(track_slots=2)
    shared = tokens(300)
    run_one(h, "donor", shared + tokens(100))
    r = h.admit("x", shared + tokens(200))
    assert r is not None and r.adm.cached_length == 256 and r.adm.token_length == 300
    # the fixed rules: branch point 300 first, then the re-send point 499, then aligned boundaries,
    # deepest first; at most track_slots (2) of them, beyond the committed depth (256), ascending
    plan = h.mgr.plan_prefill("x", 500)
    assert [c.depth for c in plan.captures] == [300, 499]
    assert [c.slot for c in plan.captures] == list(r.adm.track_slots)
    assert (plan.start, plan.end, plan.live_slot, plan.decode) == (256, 500, r.adm.live_slot, False)
    assert len(plan.after) == 2
    with pytest.raises(ProtocolError, match="planned and not committed"):
        h.mgr.plan_prefill("x", 400)
    h.abort("x")
    r = h.admit("x", shared + tokens(200))
    assert r is not None
    assert [c.depth for c in h.mgr.plan_prefill("x", 400).captures] == [300, 384]
    h.abort("x")
    with pytest.raises(UnknownRequest, match="not admitted"):
        h.mgr.plan_prefill("nobody", 10)
    settle(h)


def test_plan_prefill_window_bounds() -> None:
    h = Host()
    r = h.admit("x", tokens(100))
    assert r is not None
    for bad in (0, 101, 5.5, True, "50"):
        with pytest.raises(ValueError, match=r"must be an int in \(0, 100\]"):
            h.mgr.plan_prefill("x", bad)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="decode planned with 0 of 100"):
        h.mgr.plan_decode("x", [1])
    settle(h)


def test_refusal_when_the_pool_is_exhausted_changes_nothing() -> None:
    h = Host(slots=7, track_slots=2)
    a = h.admit("a", tokens(50))
    b = h.admit("b", tokens(50))
    assert a is not None and b is not None
    before = (h.pool.num_free, h.cache.protected_snapshots, h.cache.protected_kv_tokens)
    res = h.mgr.admit("c", np.array(tokens(50)))
    assert isinstance(res, Refusal) and not res.admitted
    assert res.slots_needed == 3 and "3 state slots needed" in res.reason
    assert res.cause is RefusalCause.SLOTS
    assert (h.pool.num_free, h.cache.protected_snapshots, h.cache.protected_kv_tokens) == before
    assert "c" not in h.mgr and not h.pool.slots_of(RequestOwner("c"))
    settle(h)


def test_admission_evicts_unlocked_snapshots_to_find_slots() -> None:
    h = Host(slots=6, track_slots=2)
    run_one(h, "a", tokens(300))
    assert h.cache.num_snapshots >= 3
    r = h.admit("b", tokens(10))
    assert r is not None and isinstance(r.adm, Admission)
    settle(h)


def _abort_at(point: str) -> None:
    h = Host()
    shared = tokens(400)
    run_one(h, "donor", shared + tokens(50))
    ids = shared + tokens(300)
    h.admit("x", ids, verify=False)  # restore left pending on the deferred stream
    if point in ("extend", "commit", "prefill", "finish"):
        h.extend("x")  # queued forward + clones, not run
    if point in ("commit", "prefill", "finish"):
        h.copies.run_next()
    if point in ("prefill", "finish"):
        h.prefill("x")
    if point == "finish":
        h.finish("x")
    else:
        h.abort("x")
    for call in (h.mgr.finish, h.mgr.abort):  # a second finish or abort is a host bug
        with pytest.raises(UnknownRequest, match="not admitted"):
            call("x")
    settle(h)
    snaps = h.cache.num_snapshots
    assert h.pool.num_free + snaps == h.pool.capacity, "a slot leaked"
    assert h.cache.protected_kv_tokens == 0 and h.cache.protected_snapshots == 0, "a lock leaked"
    h.cache.evict(kv_tokens=10**9, snapshots=10**9)
    assert h.pool.num_free == h.pool.capacity
    assert h.kv_free == set(range(h.kv_next)), "KV leaked"


@pytest.mark.parametrize("point", ["admit", "extend", "commit", "prefill", "finish"])
def test_abort_at_every_lifecycle_point_leaks_nothing(point: str) -> None:
    _abort_at(point)


def test_misuse_raises_and_changes_nothing() -> None:
    h = Host()
    r = h.admit("x", tokens(200))
    assert r is not None
    before = state_digest(h.mgr)
    with pytest.raises(ValueError, match="already admitted"):
        h.mgr.admit("x", np.array(tokens(5)))
    with pytest.raises(ValueError, match="no ids"):
        h.mgr.admit("y", [])
    with pytest.raises(ValueError, match="position 1"):
        h.mgr.admit("y", [1, -2])
    with pytest.raises(TypeError, match="hashable"):
        h.mgr.admit(["unhashable"], [1, 2])  # type: ignore[arg-type]
    plan = h.mgr.plan_prefill("x", 64)
    planned = state_digest(h.mgr)
    with pytest.raises(ValueError, match="entries for a window of 64 tokens"):
        h.mgr.commit(plan, None, kv_indices=h.alloc_kv(10))
    with pytest.raises(ValueError, match="1-D integers"):
        h.mgr.commit(plan, None, kv_indices=torch.zeros(64))
    with pytest.raises(TypeError, match="Fence"):
        h.mgr.commit(plan, "done", kv_indices=h.alloc_kv(64))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WindowPlan"):
        h.mgr.commit((0, 64), None, kv_indices=h.alloc_kv(64))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="planned and not committed"):
        h.mgr.finish("x")
    assert state_digest(h.mgr) == planned
    h.kv_next -= 10 + 64 + 64  # the rejected allocations never reached the manager
    h.run_window(r, plan, r.ids[:64].tolist())
    h.commit(r, plan)
    with pytest.raises(ProtocolError, match="not open"):
        h.mgr.commit(plan, None, kv_indices=h.alloc_kv(64))
    h.kv_next -= 64
    with pytest.raises(UnknownRequest):
        h.mgr.finish("nobody")
    with pytest.raises(UnknownRequest):
        h.mgr.abort("nobody")
    assert "y" not in h.mgr and h.mgr.num_requests == 1
    assert before != state_digest(h.mgr)  # the committed window did change it
    h.prefill("x")
    h.finish("x")
    settle(h)


def test_a_plan_is_good_only_on_its_own_manager() -> None:
    a, b = Host(), Host()
    ra, rb = a.admit("x", tokens(100)), b.admit("x", tokens(100))
    assert ra is not None and rb is not None
    plan = a.mgr.plan_prefill("x", 64)
    b.mgr.plan_prefill("x", 64)
    before = state_digest(b.mgr)
    with pytest.raises(ProtocolError, match="another manager"):
        b.mgr.commit(plan, None, kv_indices=torch.arange(64))
    assert state_digest(b.mgr) == before


def test_paged_captures_are_cut_to_the_page() -> None:
    h = Host(page_size=16, track_align=40)
    r = h.admit("x", tokens(100))
    assert r is not None
    plan = h.mgr.plan_prefill("x", 100)
    # fixed rules on a 40 grid: re-send 99 -> 96, boundaries 80, 40 -> 80, 32: page aligned only
    assert [c.depth for c in plan.captures] == [80, 96]
    h.run_window(r, plan, r.ids.tolist())
    assert h.commit(r, plan).donated == (80, 96)
    assert h.final_state_ok("x")
    h.finish("x")  # 100 ids: not page aligned, and no decode capture: nothing more donated
    settle(h)
    assert h.mgr.metrics().donations_skipped["unaligned"] == 1


def test_bad_manager_options() -> None:
    h = Host(page_size=16)
    from radixcache import CacheManager

    with pytest.raises(ValueError, match="track_slots"):
        CacheManager(h.cache, track_slots=0)
    with pytest.raises(ValueError, match="barrier"):
        CacheManager(h.cache, barrier="sometimes")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="another cache"):
        CacheManager(Host().cache, h.mgr.policy)
    fresh = Host(page_size=16)
    with pytest.raises(TypeError, match=r"policy must be a Policy, got str \(make_policy\(name\) builds one"):
        CacheManager(fresh.cache, "hit-density")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy must be a Policy, got object"):
        CacheManager(fresh.cache, object())  # type: ignore[arg-type]
    fresh.cache.check_invariants()
    assert fresh.cache.client is fresh.mgr  # the refused calls bound nothing
    with pytest.raises(RuntimeError, match="one manager per tree"):
        CacheManager(fresh.cache)  # its own manager serves it: a second one is refused


def test_check_invariants_detects_a_slot_shared_by_tree_and_request() -> None:
    h = Host()
    run_one(h, "a", tokens(100))
    r = h.admit("b", tokens(100))
    assert r is not None
    node = next(n for n in h.cache.iter_nodes() if n.snapshot is not None)
    rec = h.mgr._requests["b"]  # white box: break the record on purpose
    assert node.snapshot is not None
    rec.tracks = (node.snapshot, *rec.tracks[1:])
    with pytest.raises(AssertionError, match="held by the tree and by request"):
        h.mgr.check_invariants()


# ------------------------------------------------------------------ images
PH = 7


def image_prompt(img: bytes, text_before: list[int], text_after: list[int]) -> tuple[list[int], np.ndarray]:
    ids = text_before + [PH] * 40 + text_after
    return ids, image_cache_ids(ids, PH, [img])


def test_same_image_hits_the_whole_prompt_different_image_stops_at_its_span() -> None:
    h = Host()
    before, after = [100 + (i % 50) for i in range(130)], [200 + (i % 40) for i in range(60)]
    _, key_a = image_prompt(b"image A pixels", before, after)
    _, key_b = image_prompt(b"image B pixels", before, after)
    assert run_one(h, "a1", key_a.tolist()) == 0
    assert run_one(h, "a2", key_a.tolist()) == len(key_a) - 1, "the same image hits the whole prompt"
    assert run_one(h, "b1", key_b.tolist()) == 130, "a different image stops the hit at its first placeholder"


def test_placeholder_prompt_without_image_bytes_raises() -> None:
    with pytest.raises(ValueError, match="no image bytes"):
        image_cache_ids([1, PH, PH, 2], PH, [])


# ------------------------------------------------------ randomized interleaving
@settings(max_examples=40)
@given(data=st.data())
def test_restored_state_equals_donor_state_under_random_interleavings(data: st.DataObject) -> None:
    """Several requests over shared prefixes, with device work run in a random order: every hit
    restores exactly the state the donor computed at that depth, every final state equals the
    cold computation, and nothing leaks."""
    h = Host(slots=24, chunk=data.draw(st.sampled_from([64, 96, 160])), track_slots=2, track_align=32)
    bases = [tokens(data.draw(st.integers(40, 200))) for _ in range(2)]
    active: list[Hashable] = []
    n = 0
    for _ in range(data.draw(st.integers(5, 25))):
        op = data.draw(st.sampled_from(["admit", "extend", "run", "finish", "abort"]))
        if op == "admit" or not active:
            base = data.draw(st.sampled_from(bases))
            cut = data.draw(st.integers(0, len(base)))
            ids = base[:cut] + tokens(data.draw(st.integers(1, 80)))
            r = h.admit(n, ids)
            if r is not None:
                assert r.restored_ok, f"request {n}: restored state differs from the donor's at {r.adm.cached_length}"
                active.append(n)
            n += 1
        elif op == "extend":
            rid = data.draw(st.sampled_from(active))
            if h.reqs[rid].computed < len(h.reqs[rid].ids):
                h.extend(rid)
        elif op == "run":
            for _ in range(data.draw(st.integers(1, 4))):
                stream = data.draw(st.sampled_from([h.forward, h.copies]))
                stream.run_next()
        else:
            rid = data.draw(st.sampled_from(active))
            active.remove(rid)
            if op == "finish":
                h.prefill(rid)
                assert h.final_state_ok(rid)
                h.finish(rid)
            else:
                h.abort(rid)
        h.mgr.check_invariants()
        h.check_kv()
    for rid in active:
        h.prefill(rid)
        assert h.final_state_ok(rid)
        h.finish(rid)
    settle(h)
    assert torch.is_tensor(h.pool.recurrent)


def test_reasons_are_enums_whose_values_key_the_metrics() -> None:
    """Every eviction and skipped-donation counter is named by its enum's value, and only those."""
    m = Host(slots=7, track_slots=2).mgr.metrics()
    assert set(m.evictions) == {r.value for r in EvictionReason}
    assert set(m.donations_skipped) == {r.value for r in SkipReason}
    assert EvictionReason("kv-pressure") is EvictionReason.KV_PRESSURE and SkipReason("no-slot") is SkipReason.NO_SLOT
    assert {c.value for c in RefusalCause} == {"slots", "kv"}
    assert {r.value for r in RejectReason} == {"format", "layout", "length", "digest", "fingerprint"}
