"""The host tier: snapshots evicted from the device pool are demoted to a host pool instead of
dropped, and restored from there, ordered by fences like every other copy."""

from collections.abc import Sequence

import pytest
import torch

from linear_state import (
    DeferredStream,
    LinearStatePool,
    NodeOwner,
    PoolExhausted,
    RequestOwner,
    SlotMisuse,
    StateLayout,
)
from radixcache import Admission, CacheManager, EvictResult, HybridRadixCache, LockError, free_kv_to
from radixcache.forensics import Forensics
from radixcache.policies import FixedPoints, HitDensity
from radixcache.simulator import generate, host_tier_table, load_trace, report_markdown, run_grid
from radixcache.simulator.replay import PRESETS, replay
from radixcache.testing.hammer import HammerConfig, format_report, run_hammer

from .tree_helpers import LAYOUT, prefix_value, restored_value, scribble, state_for

GIB = 1 << 30


def tiered(
    slots: int = 8, host: int = 2, stream: DeferredStream | None = None
) -> tuple[HybridRadixCache, LinearStatePool, list[int]]:
    freed: list[int] = []
    pool = LinearStatePool(LAYOUT, slots)
    hp = LinearStatePool(LAYOUT, host)
    cache = HybridRadixCache(
        pool, on_event=free_kv_to(lambda t: freed.extend(int(x) for x in t)), stream=stream, host_pool=hp
    )
    return cache, hp, freed


def donate(cache: HybridRadixCache, key: Sequence[int], kv0: int, owner: RequestOwner) -> None:
    slot = state_for(cache, owner, key)
    cache.insert(list(key), torch.arange(kv0, kv0 + len(key)), state_slot=slot)
    cache.pool.free(slot, owner)


# ------------------------------------------------------------------ pool copies between tiers
def test_copy_from_and_clone_from_copy_between_pools_and_refuse_bad_arguments() -> None:
    dev, host = LinearStatePool(LAYOUT, 4), LinearStatePool(LAYOUT, 4)
    r = RequestOwner("r")
    src = dev.alloc(r)
    dev.recurrent[:, src].fill_(7.0)
    dev.conv[:, src].fill_(3.0)
    h, fence = host.clone_from(dev, src, NodeOwner(1))
    fence.wait()
    assert torch.all(host.read(h)[1] == 7.0) and torch.all(host.read(h)[0] == 3.0)
    back = dev.alloc(r)
    dev.copy_from(host, h, back, dst_owner=r).wait()
    assert torch.equal(dev.read(back)[1], dev.read(src)[1])
    other = LinearStatePool(StateLayout(2, (3, 3), (2, 2, 3)), 2)
    with pytest.raises(ValueError, match="layouts differ"):
        other.clone_from(dev, src, NodeOwner(2))
    with pytest.raises(ValueError, match="this pool itself"):
        dev.copy_from(dev, src, back)
    with pytest.raises(SlotMisuse, match="frozen"):
        host.copy_from(dev, src, h)  # a tree node's slot is never written in place
    with pytest.raises(SlotMisuse, match="free"):
        host.clone_from(dev, dev.num_free and 3, NodeOwner(3))  # slot 3 of dev is free
    dev.check_invariants()
    host.check_invariants()
    assert host.num_free == 3 and dev.num_free == 2


def test_clone_from_waits_the_pending_write_of_its_source() -> None:
    """The demotion copy is ordered after the clone that fills the device snapshot: with the
    fences deferred, the host copy still holds the donated bytes, never the slot's zeros."""
    dev = LinearStatePool(LAYOUT, 4, stream=DeferredStream("device copies"))
    host = LinearStatePool(LAYOUT, 2, stream=DeferredStream("host copies"))  # not FIFO behind the clone
    r = RequestOwner("r")
    live = dev.alloc(r)
    dev.recurrent[:, live].fill_(5.0)
    snap = dev.clone(live, NodeOwner(1))  # queued, not run
    assert not snap.fence.is_complete()
    h, fence = host.clone_from(dev, snap.slot, NodeOwner(1))
    fence.wait()
    assert torch.all(host.read(h)[1] == 5.0)


# ------------------------------------------------------------------ the tree's host tier
def test_an_evicted_snapshot_is_demoted_keeps_its_kv_and_still_serves_a_hit() -> None:
    cache, hp, freed = tiered()
    r = RequestOwner("r")
    donate(cache, [1, 2, 3, 4], 0, r)
    node = cache.match([1, 2, 3, 4]).node
    res = cache.evict_snapshot(node)
    assert res == (0, 1, 0) and freed == []  # the slot went, the KV stayed
    assert cache.tier(node) == "host" and node.snapshot is None and cache.num_host_snapshots == 1
    assert cache.num_snapshots == 0 and cache.demotions == 1
    m = cache.match([1, 2, 3, 4, 5])
    assert m.cached_length == 4 and m.node is node and m.snapshot_slot is None
    assert restored_value(cache, node, r) == prefix_value([1, 2, 3, 4])
    cache.lock(node)
    with pytest.raises(ValueError, match="holds no snapshot"):
        cache.evict_snapshot(node)  # nothing on the device to evict
    with pytest.raises(ValueError, match="on the host tier"):
        cache.snapshot_slot(node)  # a host reading in place gets a device slot or nothing
    cache.unlock(node)
    cache.check_invariants()
    assert hp.num_owned_by(NodeOwner) == 1


def test_a_full_host_tier_drops_its_least_recent_copy_and_the_leaf_goes_with_it() -> None:
    cache, _hp, freed = tiered(host=2)
    r = RequestOwner("r")
    for i, key in enumerate(([1, 2], [3, 4], [5, 6])):
        donate(cache, key, 10 * i, r)
    nodes = [cache.match(k).node for k in ([1, 2], [3, 4], [5, 6])]
    cache.evict(snapshots=3)  # LRU order: [1,2] then [3,4] then [5,6]
    assert [cache.tier(n) for n in nodes] == [None, "host", "host"]
    assert nodes[0].parent is None and sorted(freed) == [0, 1]  # its leaf and KV went
    assert cache.match([3, 4]).node is nodes[1]
    cache.check_invariants()


def test_a_new_donation_brings_a_demoted_snapshot_back_to_the_device() -> None:
    cache, hp, _ = tiered()
    r = RequestOwner("r")
    donate(cache, [1, 2, 3], 0, r)
    node = cache.match([1, 2, 3]).node
    cache.evict_snapshot(node)
    donate(cache, [1, 2, 3], 0, r)
    assert cache.tier(node) == "device" and cache.num_host_snapshots == 0 and hp.num_free == hp.capacity
    cache.check_invariants()


def test_without_room_in_the_host_tier_eviction_drops_as_before() -> None:
    cache, _hp, freed = tiered(host=1)
    r = RequestOwner("r")
    donate(cache, [1, 2], 0, r)
    donate(cache, [3, 4], 10, r)
    a, b = cache.match([1, 2]).node, cache.match([3, 4]).node
    cache.evict_snapshot(a)
    cache.lock(a)  # the only host copy is in use: it cannot make room
    assert cache.eviction_cost(b) == (2, 1, 1)
    assert cache.evict_snapshot(b) == (2, 1, 1) and sorted(freed) == [10, 11]
    cache.unlock(a)
    cache.check_invariants()


def test_restore_from_the_host_waits_the_demotion_copy() -> None:
    """Deferred copies: the donation's clone is still queued when the snapshot is demoted; the
    demotion copies it only after the clone ran (the device slot is freed once the copy is done),
    and the restore from the host, on a stream of its own, hands the request the donated state."""
    stream = DeferredStream("copies")
    cache, _, _ = tiered(stream=stream)
    r = RequestOwner("r")
    slot = state_for(cache, r, [9, 9])
    cache.insert([9, 9], torch.arange(2), state_slot=slot)
    node = cache.match([9, 9]).node
    assert not node.snapshot_fence.is_complete()
    cache.evict_snapshot(node)
    dst = cache.pool.alloc(r)
    cache.restore(node, dst, dst_owner=r, stream=DeferredStream("restores")).wait()  # not FIFO behind it
    assert torch.all(cache.pool.read(dst)[1] == prefix_value([9, 9]))
    cache.pool.free(slot, r)
    cache.pool.free(dst, r)
    cache.check_invariants()


def test_reset_frees_the_host_tier_and_refuses_while_a_host_copy_is_locked() -> None:
    cache, hp, _ = tiered()
    r = RequestOwner("r")
    donate(cache, [1, 2], 0, r)
    node = cache.match([1, 2]).node
    cache.evict_snapshot(node)
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert hp.num_free == hp.capacity and cache.num_host_snapshots == 0
    cache.check_invariants()


def test_the_host_pool_must_fit_the_device_pool() -> None:
    pool = LinearStatePool(LAYOUT, 2)
    with pytest.raises(ValueError, match="layout"):
        HybridRadixCache(pool, host_pool=LinearStatePool(StateLayout(1, (3, 3), (2, 2, 2)), 2))
    with pytest.raises(ValueError, match="device pool itself"):
        HybridRadixCache(pool, host_pool=pool)
    with pytest.raises(TypeError, match="LinearStatePool"):
        HybridRadixCache(pool, host_pool="host")  # type: ignore[arg-type]


# --------------------------------------------------------------------- manager and forensics
def test_the_manager_serves_a_hit_from_the_host_tier_and_forensics_verifies_it() -> None:
    pool, hp = LinearStatePool(LAYOUT, 8), LinearStatePool(LAYOUT, 4)
    cache = HybridRadixCache(pool, host_pool=hp)
    fx = Forensics(pool, mode="record")
    mgr = CacheManager(cache, FixedPoints(align=4), track_slots=1, forensics=fx)
    prompt = list(range(1, 9))
    adm = mgr.admit("a", prompt)
    assert isinstance(adm, Admission)
    plan = mgr.plan_prefill("a", len(prompt))
    scribble(pool, plan)  # each capture's state holds its depth, the live slot 8
    mgr.commit(plan, None, kv_indices=torch.arange(len(prompt)))
    mgr.finish("a", None)
    assert mgr.evict(snapshots=cache.num_snapshots).snapshots >= 1
    assert cache.num_host_snapshots >= 1
    adm = mgr.admit("b", [*prompt, 99])
    assert isinstance(adm, Admission)
    assert adm.cached_length == 8
    adm.ready.wait()
    assert torch.all(pool.read(adm.live_slot)[1] == 8.0)
    m = mgr.metrics()
    assert m.host_hits == 1 and m.demotions >= 1 and m.host_snapshots_held >= 1
    assert fx.findings == []
    mgr.check_invariants()
    mgr.abort("b", None)
    # A host copy changed behind the tree's back: forensics finds it on the next restore.
    node = mgr.cache.match(prompt).node
    assert node.host is not None
    hp.recurrent[:, node.host].add_(1.0)
    host_held = cache.num_host_snapshots
    adm = mgr.admit("c", [*prompt, 98])
    assert [f.kind for f in fx.findings] == ["changed"]
    # not served: the next snapshot up the path is (the capture at 7), the changed copy dropped
    assert isinstance(adm, Admission) and adm.cached_length == 7
    adm.ready.wait()
    assert torch.all(pool.read(adm.live_slot)[1] == 7.0)
    assert node.host is None and node.parent is None and cache.num_host_snapshots == host_held - 1
    assert mgr.metrics().evictions["corrupt"] == 1 and mgr.metrics().refused_hits == 1
    mgr.check_invariants()


def test_discard_drops_a_host_copy_and_its_leaf_and_refuses_a_locked_or_empty_node() -> None:
    pool, hp = LinearStatePool(LAYOUT, 4), LinearStatePool(LAYOUT, 4)
    cache = HybridRadixCache(pool, host_pool=hp)
    owner = RequestOwner("r")
    donate(cache, [1, 2, 3, 4], 0, owner)
    donate(cache, [1, 2, 3, 4, 5, 6, 7, 8], 0, owner)
    deep, mid = cache.match([1, 2, 3, 4, 5, 6, 7, 8]).node, cache.match([1, 2, 3, 4]).node
    cache.evict(snapshots=2)
    assert deep.host is not None and mid.host is not None and cache.num_snapshots == 0
    cache.lock(deep)
    with pytest.raises(LockError):
        cache.discard(deep)
    cache.unlock(deep)
    free = hp.num_free
    r = cache.discard(deep)
    assert (r.snapshots, r.nodes_removed, r.kv_tokens) == (1, 1, 4) and deep.parent is None
    assert hp.num_free == free + 1 and cache.num_host_snapshots == 1
    with pytest.raises(ValueError, match="holds no snapshot"):
        cache.discard(deep)
    cache.check_invariants()


def test_the_hammer_with_a_small_device_pool_hits_from_the_host_tier_and_stays_exact() -> None:
    rep = run_hammer(HammerConfig(requests=40, snapshot_slots=12, host_slots=48, seed=1))
    assert rep.ok, format_report(rep)
    m = rep.metrics
    assert isinstance(m["demotions"], int) and isinstance(m["host_hits"], int)
    assert m["demotions"] > 0 and m["host_hits"] > 0
    assert "hits restored from host" in format_report(rep)


# --------------------------------------------------------------------------- replay and report
def test_the_replay_models_the_host_tier_and_its_restore_time() -> None:
    records = generate("chat", 0)
    preset, budget = PRESETS["qwen3-next-80b"], 4 * GIB
    base = replay(records, HitDensity(), preset, budget)
    tier = replay(records, HitDensity(), preset, budget, host_budget_bytes=8 * budget, host_gbps=20.0)
    assert tier.host_budget_bytes == 8 * budget // preset.snapshot_bytes * preset.snapshot_bytes
    assert tier.token_hit_rate > 1.1 * base.token_hit_rate and base.host_hits == 0
    assert 0 < tier.host_hits <= tier.requests_with_hit and tier.host_hit_tokens <= tier.hit_tokens
    assert tier.host_restore_s == pytest.approx(tier.host_hits * preset.snapshot_bytes / 20e9)
    assert tier.host_prefill_s_saved > tier.host_restore_s  # restoring beat recomputing those prefixes
    with pytest.raises(ValueError, match="host_budget_bytes"):
        replay(records[:5], HitDensity(), preset, budget, host_budget_bytes=-1)


def test_the_report_shows_each_policy_with_and_without_the_host_tier() -> None:
    rows = run_grid([load_trace("edge", 0)], ["hit-density", "sglang-like"], lambda t: (1,), host_factor=8)
    tiered = [r for r in rows if "host_hit_rate" in r]
    assert {r["policy"] for r in tiered} == {"hit-density", "sglang-like"}  # not the reference
    table = host_tier_table(rows)
    assert table.count("->") == 2 and "hit-density: with / without" in table
    assert "With a host tier of 8x" in report_markdown(rows)
    assert host_tier_table(run_grid([load_trace("edge", 0)], ["hit-density"], lambda t: (1,))) == ""


def test_bad_arguments_to_the_tier_calls_raise_typed_errors_and_change_nothing() -> None:
    dev, host = LinearStatePool(LAYOUT, 2), LinearStatePool(LAYOUT, 1)
    r = RequestOwner("r")
    src = dev.alloc(r)
    with pytest.raises(TypeError, match="src_pool"):
        host.clone_from("dev", src, NodeOwner(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="owner"):
        host.clone_from(dev, src, "node")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Fence"):
        host.clone_from(dev, src, NodeOwner(1), after=[object()])  # type: ignore[list-item]
    host.clone_from(dev, src, NodeOwner(1)).fence.wait()
    with pytest.raises(PoolExhausted):
        host.clone_from(dev, src, NodeOwner(2))  # the host pool is full
    with pytest.raises(ValueError, match="pin_memory"):
        LinearStatePool(LAYOUT, 2, "meta", pin_memory=True)
    with pytest.raises(ValueError, match="host_gbps"):
        replay(generate("chat", 0)[:3], HitDensity(), PRESETS["qwen3-next-80b"], 4 * GIB, host_gbps=0)
    assert dev.num_free == 1 and host.num_free == 0 and host.num_owned_by(NodeOwner) == 1
    dev.check_invariants()
    host.check_invariants()


def test_eviction_cost_says_what_each_kind_of_eviction_frees() -> None:
    """With room in the host tier an eviction for slots demotes (the slot alone); one for KV
    pressure (``demote=False``) drops the leaf and its KV: the cost, and the policies' freed bytes,
    say which."""
    cache, _, _ = tiered(host=2)
    donate(cache, list(range(1, 41)), 0, RequestOwner("a"))
    leaf = cache.match(list(range(1, 41)), touch=False).node
    assert cache.eviction_cost(leaf) == EvictResult(0, 1, 0)
    assert cache.eviction_cost(leaf, demote=False) == EvictResult(40, 1, 1)
    pol = HitDensity()
    pol.bind(cache)
    pol.costs(1000, 10)
    assert pol.freed_bytes(leaf) == 1000 and pol.freed_bytes(leaf, demote=False) == 1000 + 400
    expected = cache.eviction_cost(leaf, demote=False)
    assert cache.evict_snapshot(leaf, demote=False) == expected
    cache.check_invariants()
