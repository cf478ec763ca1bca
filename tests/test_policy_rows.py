"""The policies' one row table, and what they learn from the tree's events: a snapshot the tree
lets go without the policy choosing it leaves the rows at once, and the costs it moved are
refreshed at the next choice (no sweep of every row)."""

from __future__ import annotations

import pytest
import torch

from linear_state import LinearStatePool, RequestOwner
from radixcache import CacheManager, HybridRadixCache, TreeEvent, TreeEventKind
from radixcache.core.policy import RequestInfo
from radixcache.core.tree import TreeNode
from radixcache.policies import DonationReason, FixedPoints, FlopEfficiency, HitDensity, Policy
from radixcache.policies.rows import RowTable

from .tree_helpers import LAYOUT, state_for

K = TreeEventKind


def donate(cache: HybridRadixCache, key: list[int], kv0: int) -> TreeNode:
    owner = RequestOwner(("d", kv0))
    slot = state_for(cache, owner, key)
    node = cache.insert(key, torch.arange(kv0, kv0 + len(key)), state_slot=slot).node
    cache.pool.free(slot, owner)
    return node


def req(ts: float) -> RequestInfo:
    return RequestInfo(8, 0, 0, f"s{ts}", ts)


def test_row_table_adds_and_removes_in_constant_time_keeping_rows_in_step() -> None:
    cache = HybridRadixCache(LinearStatePool(LAYOUT, 8))
    nodes = [donate(cache, [i, i + 1], 10 * i) for i in range(1, 4)]
    t = RowTable(2)
    for i, n in enumerate(nodes):
        pos = t.add(n)
        t.rows[pos] = (i, 10 * i)
    assert t.add(nodes[1]) == 1 and len(t) == 3 and nodes[2].id in t
    assert t.remove(nodes[0].id) and not t.remove(nodes[0].id)
    assert [n.id for n in t.nodes] == [nodes[2].id, nodes[1].id], "the last row takes the removed one's place"
    assert t.rows[:2].tolist() == [[2.0, 20.0], [1.0, 10.0]] and not t.rows[2:].any()
    t.check_invariants()
    with pytest.raises(ValueError, match="at least one column"):
        RowTable(0)


def test_row_table_grows_past_its_first_capacity() -> None:
    cache = HybridRadixCache(LinearStatePool(LAYOUT, 80))
    t = RowTable(1)
    nodes = [donate(cache, [i], i) for i in range(1, 71)]
    for n in nodes:
        pos = t.add(n)  # may grow the table: index it after
        t.rows[pos] = n.id
    assert len(t.rows) == 128 and t.rows[:70, 0].tolist() == [float(n.id) for n in nodes]
    t.check_invariants()


def test_row_table_invariants_name_the_corruption() -> None:
    cache = HybridRadixCache(LinearStatePool(LAYOUT, 8))
    a, b = donate(cache, [1], 0), donate(cache, [2], 1)
    t = RowTable(1)
    t.add(a)
    t.add(b)
    t.pos[a.id] = 1
    with pytest.raises(AssertionError, match="its position says 1"):
        t.check_invariants()
    t.pos[a.id] = 0
    t.rows[5, 0] = 1.0
    with pytest.raises(AssertionError, match="past the tracked ones"):
        t.check_invariants()


def test_row_table_hears_what_the_tree_let_go() -> None:
    """A tracked leaf the tree evicts is untracked, and the node its cascade stopped at is due; an
    untracked tombstone's removal only makes its parent due; a demotion untracks too."""
    hp = LinearStatePool(LAYOUT, 1)
    t = RowTable(1)

    def hear(event: TreeEvent) -> None:
        t.hear(event)

    cache = HybridRadixCache(LinearStatePool(LAYOUT, 8), on_event=hear, host_pool=hp)
    stop = donate(cache, [1, 2], 0)
    donate(cache, [1, 2, 3, 4, 5], 10)
    leaf = donate(cache, [1, 2, 3, 4, 5, 6], 20)
    mid = leaf.parent
    assert mid is not None and mid.snapshot is not None
    cache.evict_snapshot(mid, demote=False)  # mid stays, a tombstone: it is due
    t.add(leaf)
    t.add(stop)
    assert t.due() == [mid]
    cache.evict_snapshot(leaf, demote=False)  # leaf, then tombstone mid, then stops at `stop`
    assert leaf.id not in t and stop.id in t
    assert t.due() == [leaf, mid, stop], "the node itself, then each removed one's parent"
    assert t.due() == [], "due() hands each node out once"
    cache.evict_snapshot(stop)  # the host tier takes it
    assert stop.host is not None and len(t) == 0 and t.due(mid) == [mid, stop]
    t.check_invariants()


@pytest.mark.parametrize("make", [HitDensity, FlopEfficiency], ids=["hit-density", "flop-efficiency"])
def test_a_snapshot_the_tree_evicts_unchosen_leaves_the_policy_at_once(make: type[Policy]) -> None:
    """Behind the manager: the policy answers, the tree evicts a tracked snapshot by its own LRU
    (the policy answered None: every other was locked), and the policy no longer tracks it, nor
    ever offers it, its rows in step with the tree (check_invariants)."""
    pol = make()
    cache = HybridRadixCache(LinearStatePool(LAYOUT, 8))
    mgr = CacheManager(cache, pol, host_tier=None)
    nodes = [donate(cache, [i, i + 1, i + 2], 10 * i) for i in range(1, 4)]
    for i, n in enumerate(nodes):
        pol.donated(n, req(float(i)), DonationReason.CAPTURE, float(i))
    tracked = {n.id for n in nodes}
    assert set(pol._t.pos) == tracked  # type: ignore[attr-defined]
    gone = nodes[0]
    cache.evict_snapshot(gone, demote=False)  # not the policy's choice: as the tree's LRU would
    assert set(pol._t.pos) == tracked - {gone.id}  # type: ignore[attr-defined]
    pol.check_invariants()
    for _ in range(2):
        victim = pol.victim(10.0)
        assert victim is not None and victim is not gone and cache.is_evictable(victim)
        cache.evict_snapshot(victim, demote=False)
    assert pol.victim(11.0) is None and cache.num_snapshots == 0
    pol.check_invariants()
    mgr.check_invariants()


def test_the_manager_hands_the_policy_every_tree_event_in_order() -> None:
    heard: list[TreeEvent] = []

    class Listening(FixedPoints):
        def tree_event(self, event: TreeEvent) -> None:
            heard.append(event)

    cache = HybridRadixCache(LinearStatePool(LAYOUT, 8))
    mgr = CacheManager(cache, Listening(4), host_tier=None)
    a = donate(cache, [1, 2, 3, 4], 0)
    mgr.evict(kv_tokens=4)
    want = [(K.SNAPSHOT_FREED, a.id), (K.KV_FREED, a.id), (K.NODE_REMOVED, a.id)]
    assert [(e.kind, e.node.id) for e in heard] == want
    assert heard[-1].parent is not None and heard[-1].parent.depth == 0, "the removed node hung from the root"


def test_what_left_the_tree_is_not_kept_due_forever() -> None:
    """A host that resets and refills without the policy ever choosing (no memory pressure): the
    nodes heard as gone are let go, not kept for a refresh that never comes."""
    t = RowTable(1)

    def hear(event: TreeEvent) -> None:
        t.hear(event)

    cache = HybridRadixCache(LinearStatePool(LAYOUT, 8), on_event=hear)
    for round_ in range(60):
        for i in range(4):
            donate(cache, [1, 2, 3 + i, 100 + round_], 10 * i)
        cache.reset()
    assert len(t._due) <= 64 + 4, f"{len(t._due)} removed nodes still kept due"
