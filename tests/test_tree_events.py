"""The tree reports what it did as events, to one listener, from the call that did it; the
manager is that listener and hands KV to the host, snapshots to forensics, everything on."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from linear_state import LinearStatePool, RequestOwner
from radixcache import CacheManager, HybridRadixCache, KVFreeList, TreeEvent, TreeEventKind, free_kv_to
from radixcache.policies import FixedPoints

from .tree_helpers import LAYOUT, state_for

K = TreeEventKind


def donate(cache: HybridRadixCache, key: list[int], kv0: int) -> None:
    owner = RequestOwner(("d", kv0))
    slot = state_for(cache, owner, key)
    cache.insert(key, torch.arange(kv0, kv0 + len(key)), state_slot=slot)
    cache.pool.free(slot, owner)


def recorder(slots: int = 8, host: int = 0) -> tuple[HybridRadixCache, list[TreeEvent]]:
    seen: list[TreeEvent] = []
    hp = LinearStatePool(LAYOUT, host) if host else None
    return HybridRadixCache(LinearStatePool(LAYOUT, slots), on_event=seen.append, host_pool=hp), seen


def test_an_eviction_reports_each_edge_snapshot_and_node_in_order() -> None:
    cache, seen = recorder()
    donate(cache, [1, 2, 3, 4], 0)
    donate(cache, [1, 2, 3, 4, 5, 6], 100)
    leaf = cache.match([1, 2, 3, 4, 5, 6]).node
    inner = leaf.parent
    assert inner is not None
    leaf_slot, inner_slot = leaf.snapshot, inner.snapshot
    seen.clear()
    res = cache.evict(kv_tokens=6)
    assert [(e.kind, e.node.id) for e in seen] == [
        (K.SNAPSHOT_FREED, leaf.id),
        (K.KV_FREED, leaf.id),
        (K.NODE_REMOVED, leaf.id),
        (K.SNAPSHOT_FREED, inner.id),
        (K.KV_FREED, inner.id),
        (K.NODE_REMOVED, inner.id),
    ]
    assert [e.slot for e in seen if e.kind is K.SNAPSHOT_FREED] == [leaf_slot, inner_slot]
    assert {e.tier for e in seen if e.kind is K.SNAPSHOT_FREED} == {"device"}
    freed = torch.cat([e.kv for e in seen if e.kv is not None]).tolist()
    assert sorted(freed) == [0, 1, 2, 3, 104, 105] and len(freed) == res.kv_tokens
    cache.check_invariants()


def test_a_demotion_and_a_dropped_host_copy_are_reported_with_their_slots() -> None:
    cache, seen = recorder(slots=4, host=1)
    donate(cache, [1, 2], 0)
    donate(cache, [7, 8], 10)
    a = cache.match([1, 2]).node
    b = cache.match([7, 8]).node
    seen.clear()
    cache.evict_snapshot(a)
    assert [(e.kind, e.node.id, e.slot) for e in seen] == [(K.DEMOTED, a.id, a.host)]
    seen.clear()
    cache.evict_snapshot(b)  # the host tier is full: a's copy goes (and its leaf), b moves in
    kinds = [(e.kind, e.node.id, e.tier) for e in seen]
    assert kinds[0] == (K.SNAPSHOT_FREED, a.id, "host")
    assert (K.NODE_REMOVED, a.id, None) in kinds and kinds[-1] == (K.DEMOTED, b.id, None)
    cache.check_invariants()


def test_duplicates_are_freed_as_events_unless_the_caller_keeps_them() -> None:
    cache, seen = recorder()
    donate(cache, [1, 2, 3], 0)
    seen.clear()
    res = cache.insert([1, 2, 3], torch.tensor([0, 50, 51]))
    assert res.duplicates == 2 and res.released.numel() == 0
    assert [(e.kind, e.kv.tolist()) for e in seen if e.kv is not None] == [(K.KV_FREED, [50, 51])]
    seen.clear()
    kept = cache.insert([1, 2, 3], torch.tensor([60, 1, 61]), release_duplicates=False)
    assert kept.released.tolist() == [60, 61] and seen == [], "the caller keeps them: nothing freed"


def test_listen_replaces_the_listener_and_refuses_a_non_callable() -> None:
    cache, seen = recorder()
    other: list[TreeEvent] = []
    assert cache.listen(other.append) == seen.append
    with pytest.raises(TypeError, match="listener must be callable"):
        cache.listen(5)  # type: ignore[arg-type]
    assert cache.on_event == other.append, "a refused listen changes nothing"
    donate(cache, [1], 0)
    cache.evict(kv_tokens=1)
    assert seen == [] and [e.kind for e in other] == [K.SNAPSHOT_FREED, K.KV_FREED, K.NODE_REMOVED]
    with pytest.raises(TypeError, match="free must be callable"):
        free_kv_to(None)  # type: ignore[arg-type]


def test_the_manager_listens_first_and_passes_every_event_on() -> None:
    cache, seen = recorder()
    mgr = CacheManager(cache, FixedPoints(4), host_tier=None)
    assert cache.on_event is not None and cache.on_event != seen.append
    donate(cache, [1, 2, 3, 4], 0)
    mgr.evict(kv_tokens=4)
    assert [e.kind for e in seen] == [K.SNAPSHOT_FREED, K.KV_FREED, K.NODE_REMOVED]
    mgr.check_invariants()
    cache.listen(seen.append)  # a host re-wiring the tree behind the manager's back
    with pytest.raises(AssertionError, match="no longer reach this manager"):
        mgr.check_invariants()


def test_with_kv_the_manager_frees_the_trees_kv_into_the_allocator() -> None:
    kv = KVFreeList(16)
    cache = HybridRadixCache(LinearStatePool(LAYOUT, 8))
    mgr = CacheManager(cache, FixedPoints(4), kv=kv, host_tier=None)
    idx = kv.alloc(4)
    assert idx is not None and kv.num_free == 12
    donate_with(cache, [1, 2, 3, 4], idx)
    mgr.evict(kv_tokens=4)
    assert kv.num_free == 16, "the evicted edge went back to the allocator"
    with pytest.raises(ValueError, match="has a listener already"):
        CacheManager(HybridRadixCache(LinearStatePool(LAYOUT, 2), on_event=print), kv=KVFreeList(2))


def donate_with(cache: HybridRadixCache, key: list[int], kv: torch.Tensor) -> None:
    owner = RequestOwner("w")
    slot = state_for(cache, owner, key)
    cache.insert(key, kv, state_slot=slot)
    cache.pool.free(slot, owner)


def test_no_module_assigns_a_callback_onto_the_tree() -> None:
    """Events are the tree's one channel: nothing wires the tree by assigning to its attributes."""
    root = pathlib.Path(__file__).resolve().parents[1]
    pattern = re.compile(r"\b(cache|tree)\.on_\w+\s*=(?!=)")
    hits = [
        f"{p.relative_to(root)}:{i}"
        for base in ("radixcache", "examples", "tests")
        for p in sorted((root / base).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []
