import warnings
from array import array
from collections.abc import Callable

import numpy as np
import pytest
import torch

from linear_state import COMPLETE, DeferredStream, NodeOwner, PoolExhausted, RequestOwner, SlotMisuse
from radixcache import CacheKey, ForeignObjectError, HybridRadixCache, TreeNode, key_bytes

from .tree_helpers import make_cache, prefix_value, restored_value, state_for

R = RequestOwner("r")


def kv(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def insert_with_state(cache: HybridRadixCache, key: list[int], kv_start: int = 0, **kw: object):  # type: ignore[no-untyped-def]
    slot = state_for(cache, R, key[: len(key) - len(key) % cache.page_size])
    res = cache.insert(key, kv(kv_start, len(key)), state_slot=slot, **kw)  # type: ignore[arg-type]
    cache.pool.free(slot, R)
    cache.check_invariants()
    return res


def test_empty_tree_matches_nothing() -> None:
    cache, _ = make_cache()
    m = cache.match([1, 2, 3])
    assert (m.cached_length, m.token_length, m.snapshot_slot) == (0, 0, None) and m.kv_indices.numel() == 0
    cache.check_invariants()


def test_insert_then_match_full_and_longer() -> None:
    cache, _ = make_cache()
    res = insert_with_state(cache, [5, 6, 7, 8])
    assert (res.prefix_length, res.length, res.snapshot_created, res.duplicates) == (0, 4, True, 0)
    m = cache.match([5, 6, 7, 8, 9, 10])
    assert (m.cached_length, m.token_length) == (4, 4) and m.kv_indices.tolist() == [0, 1, 2, 3]
    assert m.node is res.node and m.snapshot_slot == res.node.snapshot
    assert restored_value(cache, m.node, R) == prefix_value([5, 6, 7, 8])


def test_match_partial_edge_reports_token_length_but_no_hit() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2, 3, 4, 5])
    m = cache.match([1, 2, 3, 9])
    assert m.cached_length == 0 and m.token_length == 3
    assert cache.num_nodes == 1, "a lookup must not split"
    cache.check_invariants()


def test_split_keeps_snapshot_on_the_deep_side() -> None:
    cache, _ = make_cache()
    first = insert_with_state(cache, [1, 2, 3, 4])
    second = insert_with_state(cache, [1, 2, 9], kv_start=100)
    assert second.prefix_length == 2 and cache.num_nodes == 3
    upper = first.node.parent
    assert isinstance(upper, TreeNode) and upper.depth == 2 and upper.snapshot is None
    assert first.node.depth == 4 and first.node.snapshot is not None
    assert restored_value(cache, cache.match([1, 2, 3, 4]).node, R) == prefix_value([1, 2, 3, 4])
    assert restored_value(cache, cache.match([1, 2, 9]).node, R) == prefix_value([1, 2, 9])


def test_deepest_snapshot_wins() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2])
    insert_with_state(cache, [1, 2, 3, 4])
    insert_with_state(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 4, 5, 7])
    assert (m.cached_length, m.token_length) == (4, 5)
    assert restored_value(cache, m.node, R) == prefix_value([1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4, 5, 6, 7]).cached_length == 6


def test_identical_keys_dedup_the_second_donation() -> None:
    cache, freed = make_cache()
    insert_with_state(cache, [1, 2, 3])
    free_before = cache.pool.num_free
    res = insert_with_state(cache, [1, 2, 3], kv_start=50)
    assert (res.prefix_length, res.length, res.snapshot_created, res.duplicates) == (3, 3, False, 3)
    assert freed == [50, 51, 52], "the second copy's KV is released as duplicates"
    assert cache.pool.num_free == free_before and cache.num_snapshots == 1
    assert cache.match([1, 2, 3]).kv_indices.tolist() == [0, 1, 2]


def test_reinserting_the_trees_own_kv_frees_nothing() -> None:
    cache, freed = make_cache()
    insert_with_state(cache, [1, 2, 3])
    m = cache.match([1, 2, 3])
    key = [1, 2, 3, 4, 5]
    slot = state_for(cache, R, key)
    res = cache.insert(key, torch.cat([m.kv_indices, kv(10, 2)]), state_slot=slot)
    assert res.duplicates == 0 and freed == []
    cache.pool.free(slot, R)
    cache.check_invariants()


def test_page_cutting() -> None:
    cache, freed = make_cache(page_size=4)
    res = insert_with_state(cache, list(range(1, 11)))  # 10 tokens -> 8
    assert res.length == 8 and cache.total_kv_tokens == 8
    assert cache.match(list(range(1, 11))).cached_length == 8
    assert cache.match(list(range(1, 8))).cached_length == 0  # 7 tokens -> 4, no snapshot at 4
    m = cache.match([1, 2, 3, 4, 5, 6, 0, 0, 9])  # diverges inside page 2
    assert (m.cached_length, m.token_length) == (0, 4)
    short = cache.insert([1, 2, 3], kv(0, 3), state_slot=state_for(cache, R, []))
    assert short.length == 0 and not short.snapshot_created
    assert freed == []


def test_paged_split_lands_on_a_page_boundary() -> None:
    cache, _ = make_cache(page_size=2)
    insert_with_state(cache, [1, 2, 3, 4, 5, 6])
    res = insert_with_state(cache, [1, 2, 3, 9, 7, 7])  # diverges at token 3, inside page 2
    assert res.prefix_length == 2
    depths = sorted(n.depth for n in cache.iter_nodes())
    assert depths == [2, 6, 6]


def test_tombstone_creation_and_refill() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2])
    insert_with_state(cache, [1, 2, 3, 4])
    res = cache.evict(snapshots=1)  # LRU: the shallow one (touched first)
    assert (res.snapshots, res.kv_tokens, res.nodes_removed) == (1, 0, 0)
    inner = cache.match([1, 2, 3, 4]).node.parent
    assert isinstance(inner, TreeNode) and inner.snapshot is None and inner.value.numel() == 2
    assert cache.match([1, 2, 9]).cached_length == 0
    refill = insert_with_state(cache, [1, 2])
    assert refill.snapshot_created and refill.node is inner
    assert restored_value(cache, cache.match([1, 2, 9]).node, R) == prefix_value([1, 2])


def test_snapshot_eviction_of_a_leaf_removes_it_and_cascades() -> None:
    cache, freed = make_cache()
    insert_with_state(cache, [1, 2, 3, 4])
    insert_with_state(cache, [1, 2, 7], kv_start=10)  # splits: tombstone inner [1,2]
    assert freed == [10, 11], "the caller's copy of [1,2] is a duplicate"
    freed.clear()
    cache.match([1, 2, 7])  # [1,2,3,4] is now least recent
    res = cache.evict(snapshots=1)
    assert (res.snapshots, res.kv_tokens, res.nodes_removed) == (1, 2, 1)
    assert freed == [2, 3]
    res = cache.evict(snapshots=1)  # the last leaf goes, and its tombstone parent with it
    assert (res.snapshots, res.kv_tokens, res.nodes_removed) == (1, 3, 2)
    assert cache.num_nodes == 0 and cache.pool.num_free == cache.pool.capacity
    cache.check_invariants()


def test_kv_eviction_lru_leaf_cascade() -> None:
    cache, freed = make_cache()
    insert_with_state(cache, [1, 2, 3])
    insert_with_state(cache, [1, 2, 4], kv_start=10)
    insert_with_state(cache, [5, 6], kv_start=20)
    freed.clear()  # duplicates 10, 11
    cache.match([5, 6])
    cache.match([1, 2, 4])
    res = cache.evict(kv_tokens=1)  # [1,2,3]'s leaf is least recent
    assert (res.kv_tokens, res.nodes_removed) == (1, 1) and freed == [2]
    res = cache.evict(kv_tokens=1)  # then [5,6]
    assert res.kv_tokens == 2 and freed[-2:] == [20, 21]
    res = cache.evict(kv_tokens=1)  # then leaf [4]: parent [1,2] becomes a tombstone leaf and goes too
    assert (res.kv_tokens, res.nodes_removed) == (3, 2)
    assert cache.num_nodes == 0 and cache.total_kv_tokens == 0
    assert sorted(freed) == [0, 1, 2, 12, 20, 21]
    cache.check_invariants()


def test_locks_pin_path_and_snapshot() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2])
    insert_with_state(cache, [1, 2, 3, 4])
    insert_with_state(cache, [9, 9])
    m = cache.match([1, 2, 3, 4])
    cache.lock(m.node)
    assert cache.protected_kv_tokens == 4 and cache.protected_snapshots == 1
    assert cache.evictable_kv_tokens == 2 and cache.evictable_snapshots == 2
    res = cache.evict(kv_tokens=100, snapshots=100)
    assert res.snapshots == 2 and res.kv_tokens == 2  # [9,9] and the snapshot of [1,2]
    assert cache.match([1, 2, 3, 4]).cached_length == 4, "the locked snapshot survives"
    assert cache.total_kv_tokens == 4
    cache.check_invariants()
    cache.unlock(m.node)
    assert cache.evict(kv_tokens=100).kv_tokens == 4
    cache.check_invariants()


def test_nested_locks_and_unlock_misuse() -> None:
    cache, _ = make_cache()
    res = insert_with_state(cache, [1, 2])
    cache.lock(res.node)
    cache.lock(res.node)
    cache.unlock(res.node)
    assert cache.evict(snapshots=1).snapshots == 0
    cache.unlock(res.node)
    with pytest.raises(RuntimeError, match="holds no lock"):
        cache.unlock(res.node)
    cache.check_invariants()
    assert cache.evict(snapshots=1).snapshots == 1
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(res.node)


def _lock_state(cache: HybridRadixCache) -> tuple[object, ...]:
    """Every count a lock moves: the cache's totals and each node's lock counters."""
    nodes: list[tuple[object, int, bytes, int, int]] = []
    for ns in (None, "b"):
        stack = [cache.match([], namespace=ns).node]
        while stack:
            n = stack.pop()
            nodes.append((ns, n.depth, n.key, n.kv_lock, n.snap_lock))
            stack.extend(n.children.values())
    totals = (cache.protected_kv_tokens, cache.evictable_kv_tokens, cache.protected_snapshots)
    return totals, sorted(nodes, key=repr)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ([1, 2], [1, 2, 3, 4]),  # down the path: a checkpoint's hold moving to its new snapshot
        ([1, 2, 3, 4], [1, 2]),  # up the path
        ([1, 2, 3, 4], [1, 2, 5, 6]),  # across a branch
        ([1, 2], [1, 2]),  # onto itself
        ([1, 2, 3, 4], [9, 9]),  # no common node but the root
        ([1, 2, 3, 4], None),  # into another namespace's tree: no common node at all
    ],
)
@pytest.mark.parametrize("holders", [1, 2])  # a second holder keeps ``old``'s path locked
def test_relock_leaves_what_lock_then_unlock_leaves(old: list[int], new: list[int] | None, holders: int) -> None:
    states = []
    for moved in (False, True):
        cache, _ = make_cache()
        for key in ([1, 2], [1, 2, 3, 4], [1, 2, 5, 6], [9, 9]):
            insert_with_state(cache, key)
        insert_with_state(cache, [7, 7], namespace="b")
        a = cache.match(old).node
        b = cache.match([7, 7], namespace="b").node if new is None else cache.match(new).node
        for _ in range(holders):
            cache.lock(a)
        cache.match(old)  # touched while locked: only the release queues it for eviction again
        if moved:
            cache.relock(a, b)
        else:
            cache.lock(b)
            cache.unlock(a)
        cache.check_invariants()
        states.append(_lock_state(cache))
        if holders == 1:  # what the move let go is evictable now, and found by eviction
            assert cache.evict(kv_tokens=100, snapshots=100).snapshots >= 1 or a is b
            cache.check_invariants()
            states.append(_lock_state(cache))
        else:
            cache.unlock(a)
        cache.unlock(b)
        cache.check_invariants()
        assert cache.protected_kv_tokens == 0
        cache.evict(kv_tokens=100, snapshots=100)
        assert cache.num_snapshots == cache.total_kv_tokens == 0
    half = len(states) // 2
    assert states[:half] == states[half:]


def test_relock_refuses_what_lock_and_unlock_refuse_and_changes_nothing() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2, 3])
    insert_with_state(cache, [1, 2, 4])
    held = cache.match([1, 2, 3]).node
    inner = held.parent
    assert isinstance(inner, TreeNode)
    other, _ = make_cache()
    foreign = insert_with_state(other, [1, 2]).node
    cache.lock(held)
    before = _lock_state(cache)
    with pytest.raises(ValueError, match="no snapshot"):
        cache.relock(held, inner)
    with pytest.raises(RuntimeError, match="holds no lock"):
        cache.relock(cache.match([1, 2, 4]).node, held)
    with pytest.raises(RuntimeError, match="holds no lock"):  # onto itself: still a lock it must hold
        cache.relock(cache.match([1, 2, 4]).node, cache.match([1, 2, 4]).node)
    with pytest.raises(ForeignObjectError):
        cache.relock(held, foreign)
    with pytest.raises(TypeError):
        cache.relock(held, "node")  # type: ignore[arg-type]
    assert _lock_state(cache) == before
    cache.check_invariants()
    keep = cache.match([1, 2, 4]).node
    cache.relock(held, keep)
    assert cache.evict(kv_tokens=100, snapshots=100).snapshots == 1  # held's leaf goes whole
    before = _lock_state(cache)
    with pytest.raises(ValueError, match="evicted"):
        cache.relock(keep, held)
    assert _lock_state(cache) == before
    cache.check_invariants()


def test_lock_requires_a_snapshot_node() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2, 3])
    insert_with_state(cache, [1, 2, 4])
    inner = cache.match([1, 2, 3]).node.parent
    assert isinstance(inner, TreeNode)
    with pytest.raises(ValueError, match="no snapshot"):
        cache.lock(inner)
    cache.check_invariants()
    root = cache.match([7]).node
    cache.lock(root)  # a miss locks the root: allowed, protects nothing
    cache.unlock(root)
    cache.check_invariants()


def test_namespace_isolation() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2, 3], namespace="lora-a")
    assert cache.match([1, 2, 3]).cached_length == 0
    assert cache.match([1, 2, 3], namespace="lora-b").cached_length == 0
    assert cache.match([1, 2, 3], namespace="lora-a").cached_length == 3
    insert_with_state(cache, [1, 2, 3], namespace="lora-b", kv_start=10)
    assert cache.match([1, 2, 3], namespace="lora-b").kv_indices.tolist() == [10, 11, 12]
    assert cache.num_nodes == 2


def test_insert_without_state_stores_nothing_new() -> None:
    cache, freed = make_cache()
    insert_with_state(cache, [1, 2, 3])
    res = cache.insert([1, 2, 3, 4, 5], kv(40, 5))
    assert (res.prefix_length, res.length, res.snapshot_created) == (3, 3, False)
    assert freed == [40, 41, 42] and cache.total_kv_tokens == 3 and cache.num_nodes == 1
    res = cache.insert([1, 2], kv(0, 2))  # ends mid-edge: no split
    assert cache.num_nodes == 1 and res.length == 2
    cache.check_invariants()


def test_key_types_are_equivalent() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [3, 1, 4, 1, 5])
    for key in (
        [3, 1, 4, 1, 5],
        (3, 1, 4, 1, 5),
        np.array([3, 1, 4, 1, 5], dtype=np.int32),
        np.array([3, 1, 4, 1, 5]),
        torch.tensor([3, 1, 4, 1, 5]),
        CacheKey([3, 1, 4, 1, 5]),
        CacheKey(np.array([3, 1, 4, 1, 5, 9])).prefix(5),
    ):
        assert cache.match(key).cached_length == 5


def test_image_ids_are_valid_keys() -> None:
    cache, _ = make_cache()
    key = [1, 2**30, 2**30 + 5, 2**31 - 1]
    insert_with_state(cache, key)
    assert cache.match(key).cached_length == 4


@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        ([1, -1, 2], ValueError, "-1 at position 1"),
        ([1, 2, 2**31], ValueError, "position 2"),
        ([0, 1.5], TypeError, "1.5 at position 1 is not an integer"),
        (np.array([[1, 2]]), ValueError, "1-D"),
        (np.array([1.0, 2.0]), TypeError, "integers"),
        (np.array([3, -7]), ValueError, "-7 at position 1"),
        (np.array([5, 2**64 - 1], dtype=np.uint64), ValueError, "18446744073709551615 at position 1"),
        (np.array([5, 2**32 + 1]), ValueError, "4294967297 at position 1"),  # a high word, the low in range
        (array("q", [4, 5, -3]), ValueError, "-3 at position 2"),
        (array("q", [2**31]), ValueError, "2147483648 at position 0"),
        (array("Q", [1, 2**64 - 1]), ValueError, "18446744073709551615 at position 1"),
        (torch.tensor([1.0]), TypeError, "integers"),
        (torch.tensor([True]), TypeError, "integers"),
        (torch.tensor([5, 2**31]), ValueError, "position 1"),
        (np.array([True, False]), TypeError, "integers"),
        ([True, False, True], TypeError, "bool"),
        ([1, 2, False], TypeError, "position 2 is a bool"),
        ({1, 2, 3}, TypeError, "ordered sequence"),
        ({1: 2}, TypeError, "ordered sequence"),
        (5, TypeError, "ordered sequence"),
        (None, TypeError, "ordered sequence"),
        ("abc", TypeError, "ordered sequence"),
        (b"abc", TypeError, "ordered sequence"),
    ],
)
def test_bad_keys_raise_and_change_nothing(key: object, error: type[Exception], message: str) -> None:
    """One key contract for match and insert (and, through them, the manager)."""
    cache, freed = make_cache()
    insert_with_state(cache, [1, 2, 3])
    slot = state_for(cache, R, [1])
    before = (cache.num_nodes, cache.total_kv_tokens, cache.pool.num_free)
    with pytest.raises(error, match=message):
        cache.match(key)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        cache.insert(key, kv(0, 3), state_slot=slot)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        CacheKey(key)  # type: ignore[arg-type]
    assert (cache.num_nodes, cache.total_kv_tokens, cache.pool.num_free) == before and freed == []
    cache.check_invariants()


@pytest.mark.parametrize("known", [0, 2, 3, 4, 5, 6])
def test_a_known_prefix_is_not_compared_and_everything_past_it_is(known: int) -> None:
    # The tree holds [1, 2, 3] (KV 0-2) and [1, 2, 3, 4, 5] (KV 6-7 past it): two nodes on the
    # path. The caller sends other indices (50-54) for all five tokens: past `known`, each is a
    # duplicate; before it, the caller says they are the tree's own (SGLang's prev_prefix_len).
    cache, freed = make_cache()
    insert_with_state(cache, [1, 2, 3])
    insert_with_state(cache, [1, 2, 3, 4, 5], kv_start=3)
    assert cache.match([1, 2, 3, 4, 5]).kv_indices.tolist() == [0, 1, 2, 6, 7]
    freed.clear()  # the second insert's duplicates (3-5)
    key = [1, 2, 3, 4, 5, 6, 7]
    slot = state_for(cache, R, key)
    res = cache.insert(key, kv(50, 7), state_slot=slot, known_prefix=known, release_duplicates=False)
    assert res.prefix_length == 5 and res.snapshot_created
    assert res.released.tolist() == list(range(50 + min(known, 5), 55)), "exactly the duplicates past known"
    assert res.duplicates == max(0, 5 - known) and freed == []
    assert cache.match(key).kv_indices.tolist() == [0, 1, 2, 6, 7, 55, 56]
    cache.pool.free(slot, R)
    cache.check_invariants()


def test_a_known_prefix_cut_inside_a_split_edge_compares_from_there() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2, 3, 4, 5, 6])  # one edge; the new key leaves it after 4 tokens
    key = [1, 2, 3, 4, 9]
    slot = state_for(cache, R, key)
    res = cache.insert(key, kv(50, 5), state_slot=slot, known_prefix=3, release_duplicates=False)
    assert res.prefix_length == 4 and res.released.tolist() == [53]
    cache.pool.free(slot, R)
    cache.check_invariants()


@pytest.mark.parametrize(
    ("known", "error", "message"),
    [
        (-1, ValueError, r"known_prefix -1 is outside \[0, 4\]"),
        (5, ValueError, r"known_prefix 5 is outside \[0, 4\]"),
        (1.5, TypeError, "known_prefix must be an int, got 1.5"),
        (True, TypeError, "known_prefix must be an int, got True"),
    ],
)
def test_a_bad_known_prefix_raises_and_changes_nothing(known: object, error: type[Exception], message: str) -> None:
    cache, freed = make_cache()
    insert_with_state(cache, [1, 2, 3])
    before = (cache.num_nodes, cache.total_kv_tokens, cache.pool.num_free)
    slot = state_for(cache, R, [1, 2, 3, 4])
    with pytest.raises(error, match=message):
        cache.insert([1, 2, 3, 4], kv(50, 4), state_slot=slot, known_prefix=known)  # type: ignore[arg-type]
    cache.pool.free(slot, R)
    assert (cache.num_nodes, cache.total_kv_tokens, cache.pool.num_free) == before and freed == []
    cache.check_invariants()


def test_bad_insert_arguments_change_nothing() -> None:
    cache, freed = make_cache(slots=3)
    insert_with_state(cache, [1, 2, 3])
    before = (cache.num_nodes, cache.total_kv_tokens, cache.pool.num_free)
    with pytest.raises(ValueError, match="3 entries for a key of 4"):
        cache.insert([1, 2, 3, 4], kv(0, 3))
    with pytest.raises(ValueError, match="1-D integer"):
        cache.insert([1, 2], torch.zeros(2))
    with pytest.raises(ValueError, match="ready was given"):
        cache.insert([1, 2], kv(0, 2), ready=COMPLETE)
    with pytest.raises(SlotMisuse, match="donation of a free slot"):
        cache.insert([1, 2, 5], kv(0, 3), state_slot=2)
    with pytest.raises(ValueError, match="evict amounts"):
        cache.evict(kv_tokens=-1)
    assert (cache.num_nodes, cache.total_kv_tokens, cache.pool.num_free) == before and freed == []
    cache.check_invariants()
    slot = cache.pool.alloc(R)
    cache.pool.alloc(R)
    with pytest.raises(PoolExhausted):
        cache.insert([1, 2, 5, 6], kv(0, 4), state_slot=slot, namespace="new")
    assert (cache.num_nodes, cache.total_kv_tokens) == before[:2] and freed == []
    assert cache.match([1, 2, 5, 6], namespace="new").cached_length == 0
    cache.check_invariants()


def test_restore_misuse() -> None:
    cache, _ = make_cache()
    res = insert_with_state(cache, [1, 2])
    other = cache.pool.alloc(RequestOwner("other"))
    with pytest.raises(SlotMisuse, match="someone else"):
        cache.restore(res.node, other, dst_owner=R)
    with pytest.raises(SlotMisuse, match="frozen"):
        cache.restore(res.node, res.node.snapshot)
    with pytest.raises(ValueError, match="no snapshot"):
        cache.restore(cache.match([9]).node, other)
    cache.check_invariants()


def test_donation_waits_the_producers_fence() -> None:
    """The clone is ordered behind ``ready``: a late write of the producer is captured, and a
    write the producer makes after the clone ran is not."""
    cache, _ = make_cache()
    forward = DeferredStream("forward")
    slot = cache.pool.alloc(R)
    done = forward.submit(lambda: cache.pool.recurrent[:, slot].fill_(42.0))
    cache.pool.conv[:, slot].fill_(42.0)
    res = cache.insert([1, 2, 3], kv(0, 3), state_slot=slot, ready=done)
    cache.pool.recurrent[:, slot].fill_(-1.0)  # the request keeps writing its own slot
    assert restored_value(cache, res.node, R) == 42.0
    cache.pool.free(slot, R)
    cache.check_invariants()


def test_restore_is_ordered_after_the_clone() -> None:
    cache, _ = make_cache()
    copies = DeferredStream("copies")
    cache.stream = copies
    slot = state_for(cache, R, [1, 2])
    res = cache.insert([1, 2], kv(0, 2), state_slot=slot)
    assert copies.pending == 1  # the clone has not run
    dst = cache.pool.alloc(RequestOwner("hit"))
    fence = cache.restore(res.node, dst, dst_owner=RequestOwner("hit"))
    fence.wait()
    assert float(cache.pool.read(dst)[1].flatten()[0]) == prefix_value([1, 2])


def test_reset_releases_everything() -> None:
    cache, freed = make_cache()
    insert_with_state(cache, [1, 2, 3])
    r = insert_with_state(cache, [1, 2, 4], kv_start=10)
    cache.lock(r.node)
    with pytest.raises(RuntimeError, match="reset while locked"):
        cache.reset()
    cache.unlock(r.node)
    freed.clear()  # duplicates 10, 11
    cache.reset()
    assert cache.num_nodes == 0 and cache.pool.num_free == cache.pool.capacity
    assert sorted(freed) == [0, 1, 2, 12]
    cache.check_invariants()


def test_heaps_stay_bounded_under_many_touches() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2, 3])
    for _ in range(5000):
        cache.match([1, 2, 3])
    assert len(cache._kv_heap) + len(cache._snap_heap) < 5000
    cache.check_invariants()


# ---------------------------------------------------------------- corruption
def _corrupt_tree() -> tuple[HybridRadixCache, TreeNode, TreeNode]:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2, 3, 4])
    leaf = insert_with_state(cache, [1, 2, 5]).node
    inner = leaf.parent
    assert isinstance(inner, TreeNode)
    return cache, inner, leaf


def _lock_tombstone(cache: HybridRadixCache, inner: TreeNode) -> None:
    inner.snap_lock = inner.kv_lock = 1
    cache._roots[None].kv_lock = 1


CORRUPTIONS: dict[str, Callable[[HybridRadixCache, TreeNode, TreeNode], object]] = {
    "parent link": lambda c, i, leaf: setattr(leaf, "parent", None),
    "page aligned": lambda c, i, leaf: setattr(leaf, "key", leaf.key[:3]),
    "wrong first page": lambda c, i, leaf: setattr(leaf, "key", (9).to_bytes(4, "little")),
    "KV indices": lambda c, i, leaf: setattr(leaf, "value", leaf.value[:0]),
    "numpy view": lambda c, i, leaf: setattr(leaf, "value_np", leaf.value.numpy() + 1),
    "depth": lambda c, i, leaf: setattr(leaf, "depth", 7),
    "kv_lock": lambda c, i, leaf: setattr(i, "kv_lock", 1),
    "tombstone leaf": lambda c, i, leaf: c._free_snapshot(leaf),
    "owned by": lambda c, i, leaf: setattr(leaf, "snapshot", c.pool.alloc(R)),
    "held by nodes|is owned by": lambda c, i, leaf: setattr(i, "snapshot", leaf.snapshot),
    "num_nodes": lambda c, i, leaf: setattr(c, "_num_nodes", 5),
    "evictable_kv": lambda c, i, leaf: setattr(c, "_evictable_kv", 1),
    "missing from the KV heap": lambda c, i, leaf: c._kv_heap.clear(),
    "missing from the snapshot heap": lambda c, i, leaf: c._snap_heap.clear(),
    "node-owned slots": lambda c, i, leaf: c.pool.alloc(NodeOwner(99)),
    "locked without a snapshot": lambda c, i, leaf: _lock_tombstone(c, i),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_check_invariants_detects(kind: str) -> None:
    cache, inner, leaf = _corrupt_tree()
    cache.check_invariants()
    CORRUPTIONS[kind](cache, inner, leaf)
    with pytest.raises(AssertionError, match=kind):
        cache.check_invariants()


def test_key_bytes_of_strided_and_narrow_arrays() -> None:
    want = key_bytes([0, 2, 4, 6, 8])
    assert key_bytes(np.arange(10, dtype=np.int32)[::2]) == want
    assert key_bytes(np.arange(10, dtype=np.int64)[::2]) == want
    assert key_bytes(np.arange(10, dtype=np.uint8)[::2]) == want
    assert key_bytes(np.arange(10, dtype=np.uint32)[::2]) == want
    # byte-swapped arrays are the same keys (the canonical bytes are native uint32)
    assert key_bytes(np.arange(10, dtype=">i4")[::2]) == want
    assert key_bytes(np.arange(10, dtype=">u4")[::2]) == want
    with pytest.raises(ValueError, match="position 1"):
        key_bytes(np.array([1, 2**31], dtype=np.uint32))
    # 4-byte ids are range-checked on their bytes: every position, both signs, both byte orders
    with pytest.raises(ValueError, match="-7 at position 1"):
        key_bytes(np.array([3, -7, 4], dtype=np.int32))
    with pytest.raises(ValueError, match="-2147483648 at position 2"):
        key_bytes(np.array([0, 2**31 - 1, -(2**31)], dtype=np.int32))
    with pytest.raises(ValueError, match="4294967295 at position 0"):
        key_bytes(np.array([2**32 - 1, 5], dtype=">u4"))
    with pytest.raises(ValueError, match="4294967295 at position 1"):
        key_bytes([7, 2**32 - 1])
    assert key_bytes(np.array([2**31 - 1], dtype=np.int32)) == key_bytes([2**31 - 1])
    with pytest.raises(TypeError, match="integers"):
        key_bytes(np.array([True, False]))


def test_evict_snapshot_of_a_chosen_node() -> None:
    cache, freed = make_cache()
    inner = insert_with_state(cache, [1, 2]).node
    leaf = insert_with_state(cache, [1, 2, 3, 4]).node
    assert cache.evict_snapshot(inner) == (0, 1, 0)
    assert inner.snapshot is None and cache.num_nodes == 2, "an inner node stays as a tombstone"
    cache.lock(leaf)
    with pytest.raises(RuntimeError, match="locked"):
        cache.evict_snapshot(leaf)
    cache.unlock(leaf)
    res = cache.evict_snapshot(leaf)
    assert (res.snapshots, res.kv_tokens, res.nodes_removed) == (1, 4, 2), "a leaf goes whole, cascading"
    with pytest.raises(ValueError, match="no snapshot"):
        cache.evict_snapshot(leaf)
    assert sorted(freed) == [0, 1, 2, 3]
    cache.check_invariants()


def test_the_tree_keeps_its_own_copy_of_kv_indices() -> None:
    cache, _ = make_cache()
    page_table = torch.arange(100, 110)
    slot = state_for(cache, R, [1, 2, 3, 4])
    cache.insert([1, 2, 3, 4], page_table[:4], state_slot=slot)
    page_table[:4] = -1  # the host reuses its page-table row for another request
    assert cache.match([1, 2, 3, 4]).kv_indices.tolist() == [100, 101, 102, 103]
    cache.pool.free(slot, R)
    cache.check_invariants()


def test_kv_indices_from_a_start_depth_reads_only_the_edges_below_it() -> None:
    """``kv_indices(node, start=d)`` is ``kv_indices(node)[d:]`` for every depth on the path (an
    edge cut part-way included); a start outside ``[0, depth]`` or not an int is refused."""
    cache, _ = make_cache()
    slot = state_for(cache, R, [1])
    cache.insert([1, 2, 3], torch.arange(100, 103), state_slot=slot)
    cache.insert([1, 2, 3, 4, 5], torch.arange(100, 105), state_slot=slot)
    node = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], torch.arange(100, 108), state_slot=slot).node
    whole = cache.kv_indices(node)
    assert whole.tolist() == list(range(100, 108))
    for d in range(9):
        assert torch.equal(cache.kv_indices(node, start=d), whole[d:]), d
    for bad, err in ((9, ValueError), (-1, ValueError), (1.5, TypeError), (0.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="start"):
            cache.kv_indices(node, start=bad)  # type: ignore[arg-type]
    cache.pool.free(slot, R)
    cache.check_invariants()


def test_what_policies_read_about_eviction_costs_follows_the_shape() -> None:
    """cascade_stop, cost_dependent and cost_dependents name the snapshots whose eviction_cost a
    shape change moved: checked against eviction_cost itself before and after each change."""
    cache, _ = make_cache(slots=16)
    owner = RequestOwner("r")
    slot = state_for(cache, owner, [1])

    def put(key: list[int], snap: bool = True) -> TreeNode:
        return cache.insert(np.array(key), torch.arange(len(key)), state_slot=slot if snap else None).node

    top = put([1, 2, 3, 4])  # a snapshot at depth 4
    leaf = put([1, 2, 3, 4, 5, 6, 7, 8])  # a leaf below it: top is a leaf no more
    assert cache.cost_dependents(leaf) == [top]
    assert cache.eviction_cost(top).kv_tokens == 0 and cache.eviction_cost(leaf).kv_tokens == 4
    assert cache.cascade_stop(leaf) is top
    before = cache.eviction_cost(leaf).kv_tokens
    other = put([1, 2, 3, 4, 5, 6, 9])  # splits leaf's edge at depth 6: a tombstone with two children
    assert cache.eviction_cost(leaf).kv_tokens < before, "leaf now cascades only to the split"
    assert leaf in cache.cost_dependents(other) and other not in cache.cost_dependents(other)
    split = cache.cascade_stop(leaf)
    assert split.depth == 6 and split.snapshot is None
    assert cache.cost_dependent(split) is None, "a branching tombstone: nobody's cascade reaches past it"
    cache.evict_snapshot(other, demote=False)  # the split has one child again: leaf cascades to top
    assert cache.cost_dependent(split) is leaf and cache.eviction_cost(leaf).kv_tokens == before
    assert cache.cost_dependent(top) is top
    cache.evict_snapshot(leaf, demote=False)
    assert cache.cost_dependent(top) is top and cache.eviction_cost(top).kv_tokens == 4, "a leaf again"
    assert not cache.demotes, "no host tier"
    with pytest.raises(ValueError, match="removed"):
        cache.cascade_stop(leaf)
    cache.pool.free(slot, owner)
    cache.check_invariants()


def test_kv_prefix_reads_the_trees_kv_past_the_deepest_snapshot_without_touching() -> None:
    cache, _ = make_cache(page_size=2)
    insert_with_state(cache, [1, 2, 3, 4])
    insert_with_state(cache, [1, 2, 3, 4, 5, 6, 7, 8], kv_start=100)
    stamps = {n.id: n.last_access for n in cache.iter_nodes()}
    # the key leaves the tree inside the second edge, after a page that agrees: 6 tokens held
    assert cache.kv_prefix([1, 2, 3, 4, 5, 6, 9, 9]).tolist() == [0, 1, 2, 3, 104, 105]
    assert cache.match([1, 2, 3, 4, 5, 6, 9, 9], touch=False).token_length == 6
    assert cache.kv_prefix([1, 2, 3, 4, 5]).tolist() == [0, 1, 2, 3]  # cut to whole pages
    assert cache.kv_prefix([1, 2, 3, 4, 5, 6, 7, 8]).tolist() == [0, 1, 2, 3, 104, 105, 106, 107]
    assert cache.kv_prefix([9, 9]).numel() == 0 and cache.kv_prefix([1, 2], namespace="x").numel() == 0
    assert {n.id: n.last_access for n in cache.iter_nodes()} == stamps
    cache.check_invariants()


def test_kv_prefix_refuses_a_bad_key_and_changes_nothing() -> None:
    cache, _ = make_cache()
    insert_with_state(cache, [1, 2, 3])
    before = cache.describe()
    with pytest.raises(TypeError):
        cache.kv_prefix("123")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cache.kv_prefix([1, -2])
    assert cache.describe() == before
    cache.check_invariants()


@pytest.mark.parametrize(
    "ids",
    [
        [7, 0, 2**31 - 1],
        array("q", [7, 0, 2**31 - 1]),
        np.array([7, 0, 2**31 - 1], dtype=np.int64),
        np.array([7, 1, 0, 1, 2**31 - 1, 1], dtype=np.int64)[::2],  # strided
        np.array([7, 0, 2**31 - 1], dtype=np.uint32),
        np.array([7, 0, 2**31 - 1], dtype=">i4"),
        torch.tensor([7, 0, 2**31 - 1]),
    ],
)
def test_a_cache_key_holds_the_canonical_bytes_and_is_taken_as_is(ids: object) -> None:
    key = CacheKey(ids)  # type: ignore[arg-type]
    assert key.data == key_bytes(ids) and len(key) == 3  # type: ignore[arg-type]
    assert key_bytes(key) is key.data  # not converted again
    assert CacheKey(key) == key and hash(CacheKey(key)) == hash(key)
    assert key.ids.tolist() == [7, 0, 2**31 - 1] and not key.ids.flags.writeable
    assert key.has_images and not key.prefix(2).has_images
    assert key.prefix(5) is key and key.prefix(0) == CacheKey([]) and key != key.data
    assert CacheKey.frombytes(key.data) == key and "len=3" in repr(key)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32, np.int16])
def test_a_cache_key_says_whether_it_holds_image_ids(dtype: type) -> None:
    """``has_images`` from the construction's reduction (8-byte ids) or one of its own, and a
    prefix's from its own ids: a text prefix of a key that ends in image ids has none."""
    top = 2**30 + 3 if np.dtype(dtype).itemsize >= 4 else 2**15 - 1
    ids: np.ndarray = np.array([5, 6, top, 9], dtype=dtype)
    key = CacheKey(ids)
    assert key.has_images == (top >= 2**30)
    assert not key.prefix(2).has_images and key.prefix(3).has_images == (top >= 2**30)
    text = CacheKey(np.array([5, 6, 7], dtype=dtype))
    assert not text.has_images and not text.prefix(2).has_images


def test_a_cache_key_from_bytes_is_checked() -> None:
    with pytest.raises(TypeError, match="must be bytes"):
        CacheKey.frombytes(bytearray(8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="6 bytes are not a whole number"):
        CacheKey.frombytes(bytes(6))
    with pytest.raises(ValueError, match="position 1"):
        CacheKey.frombytes(np.array([1, 2**31], dtype=np.uint32).tobytes())
    with pytest.raises(ValueError, match=">= 0"):
        CacheKey([1]).prefix(-1)


@pytest.mark.parametrize(
    "as_given",
    [
        lambda a: a,  # writable int64: taken as it is
        lambda a: a.astype(np.int32),  # an engine's int32 page-table row: also taken as it is
        lambda a: np.repeat(a, 2)[::2],  # strided
        lambda a: np.frombuffer(a.tobytes(), dtype=np.int64),  # read-only
        lambda a: a.astype(">i8"),  # big-endian: an int64 dtype, not numpy's native one
    ],
)
def test_numpy_kv_is_filed_as_a_tensor_would_be(as_given: Callable[[np.ndarray], np.ndarray]) -> None:
    """KV indices as a numpy array (the SGLang backend hands its CPU rows over so) file the same
    nodes, values and duplicates as the same indices in a tensor; the tree keeps its own copy of
    what it stores, so the caller may rewrite its array after."""
    runs = []
    for numpy_kv in (False, True):
        cache, freed = make_cache(slots=8)
        owner = RequestOwner("r")
        slot = state_for(cache, owner, [1, 2, 3, 4])
        cache.insert([1, 2], torch.tensor([10, 11]), state_slot=slot)
        given = np.array([10, 50, 52, 53], dtype=np.int64)
        kv = as_given(given) if numpy_kv else torch.from_numpy(given.copy())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a read-only array is copied, not shared with a warning
            res = cache.insert([1, 2, 3, 4], kv, state_slot=slot, release_duplicates=False)
        if isinstance(kv, np.ndarray) and kv.flags.writeable:
            kv[:] = -1  # the caller's buffer, rewritten: the tree's values are its own
        cache.check_invariants()  # every node's KV int64, whatever the caller's dtype
        assert res.released.dtype == res.node.value.dtype == cache.kv_indices(res.node).dtype == torch.int64
        runs.append(
            (res.prefix_length, res.node.depth, res.released.tolist(), cache.kv_indices(res.node).tolist(), freed)
        )
        cache.pool.free(slot, owner)
    assert runs[0] == runs[1] == (2, 4, [50], [10, 11, 52, 53], [])


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_numpy_kv_of_the_wrong_length_is_refused_with_nothing_changed(dtype: type) -> None:
    cache, _ = make_cache(slots=8)
    owner = RequestOwner("r")
    slot = state_for(cache, owner, [1, 2, 3])
    with pytest.raises(ValueError, match="kv_indices has 2 entries for a key of 3 tokens"):
        cache.insert([1, 2, 3], np.array([5, 6], dtype=dtype), state_slot=slot)
    assert cache.num_nodes == 0 and cache.num_snapshots == 0
    cache.check_invariants()


def test_root_is_what_a_miss_returns_per_namespace() -> None:
    cache, _ = make_cache(page_size=1)
    nobody = cache.root("never")
    assert cache.root(None) is nobody is cache.match([5, 6], namespace="never").node  # a placeholder
    owner = RequestOwner("a")
    slot = state_for(cache, owner, [1, 2, 3])
    cache.insert([1, 2, 3], torch.arange(3), state_slot=slot, namespace="t")
    cache.pool.free(slot, owner)
    root = cache.root("t")
    assert root is not nobody and root.parent is None and root.depth == 0
    assert cache.match([9], namespace="t").node is root
    assert cache.match([], namespace="t").node is root
    assert cache.root(None) is nobody  # another namespace's insert leaves it a placeholder
    assert cache.match([1, 2, 3], namespace="t").node.parent is root
    with pytest.raises(TypeError, match="hashable"):
        cache.root(["t"])  # type: ignore[arg-type]
    cache.check_invariants()


def test_match_without_kv_finds_the_same_hit_and_gathers_nothing() -> None:
    cache, _ = make_cache(page_size=1)
    owner = RequestOwner("a")
    for key in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6]):  # two edges: the KV would be gathered
        slot = state_for(cache, owner, key)
        cache.insert(key, torch.arange(10, 10 + len(key)), state_slot=slot)
        cache.pool.free(slot, owner)
    full = cache.match([1, 2, 3, 4, 5, 6, 7], touch=False)
    bare = cache.match([1, 2, 3, 4, 5, 6, 7], touch=False, kv=False)
    assert full.kv_indices.tolist() == [10, 11, 12, 13, 14, 15]
    assert bare.kv_indices.numel() == 0 and bare.kv_indices.dtype == torch.int64
    assert (bare.cached_length, bare.token_length, bare.node, bare.snapshot_slot) == (
        full.cached_length,
        full.token_length,
        full.node,
        full.snapshot_slot,
    )
    assert cache.kv_indices(bare.node).tolist() == full.kv_indices.tolist()  # read later, as a host does
    before = bare.node.last_access
    cache.match([1, 2, 3, 4, 5, 6], kv=False)
    assert bare.node.last_access > before  # still touched
    cache.check_invariants()


def test_a_cpu_edge_is_a_tensor_only_once_read_and_then_a_view_of_its_numpy_indices() -> None:
    """A new CPU edge keeps its numpy copy of the indices alone; its tensor (``TreeNode.value``) is
    made when first read, shares that memory and stays; a split cuts both sides from the numpy
    indices, each made a tensor when read."""
    cache, _ = make_cache(slots=8)
    owner = RequestOwner("r")
    slot = state_for(cache, owner, [1, 2, 3, 4])
    leaf = cache.insert([1, 2, 3, 4], np.array([10, 11, 12, 13], dtype=np.int32), state_slot=slot).node
    assert leaf._value is None and leaf.value_np is not None and leaf.value_np.dtype == np.int64
    t = leaf.value
    assert t.tolist() == [10, 11, 12, 13] and t.dtype == torch.int64 and leaf.value is t
    assert t.data_ptr() == leaf.value_np.ctypes.data  # a view: one copy of the indices
    res = cache.insert([1, 2, 9, 9], np.array([10, 11, 20, 21], dtype=np.int64), state_slot=slot)
    upper = res.node.parent
    assert upper is not None and upper.depth == 2 and upper._value is None and leaf._value is None
    assert upper.value.tolist() == [10, 11] and leaf.value.tolist() == [12, 13] and res.node.value.tolist() == [20, 21]
    assert cache.kv_indices(leaf).tolist() == [10, 11, 12, 13]
    cache.check_invariants()
    cache.pool.free(slot, owner)
