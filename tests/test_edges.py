"""The contract at the public edges: a wrong argument raises a typed error naming it, before
anything changes (the digest of pool, tree, manager and policy is the same after), and objects of
another cache are refused."""

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch

from linear_state import (
    COMPLETE,
    ForeignSlot,
    LinearStatePool,
    NodeOwner,
    PoolError,
    RequestOwner,
    SlotId,
    SlotMisuse,
    StateLayout,
)
from radixcache import CacheManager, ForeignObjectError, HybridRadixCache, RadixCacheError, TreeNode
from radixcache.policies import FixedPoints
from radixcache.testing.digest import state_digest

from .tree_helpers import scribble

LAYOUT = StateLayout(1, (2, 3), (2, 2), recurrent_dtype=torch.float64)
R = RequestOwner("r")


def stack(slots: int = 12) -> tuple[LinearStatePool, HybridRadixCache, CacheManager]:
    pool = LinearStatePool(LAYOUT, slots)
    cache = HybridRadixCache(pool)
    return pool, cache, CacheManager(cache, FixedPoints(4))


_KV = itertools.count()


def served(mgr: CacheManager, rid: object, ids: list[int]) -> None:
    """Admit, prefill in one window, finish: the tree keeps snapshots of ``ids``."""
    adm = mgr.admit(rid, ids)
    assert adm.admitted
    plan = mgr.plan_prefill(rid, len(ids))
    scribble(mgr.pool, plan)
    mgr.commit(plan, None, kv_indices=[next(_KV) for _ in ids])
    mgr.finish(rid)


def test_a_fence_that_is_not_a_fence_leaves_no_orphan_snapshot_slot() -> None:
    pool, cache, _ = stack()
    donor = pool.alloc(R)
    before = pool.num_free
    for bad in ("fence", 1, object()):
        with pytest.raises(TypeError, match="Fence"):
            cache.insert([1, 2, 3], torch.arange(3), state_slot=donor, ready=bad)  # type: ignore[arg-type]
    assert pool.num_free == before and cache.num_nodes == 0
    assert pool.num_owned_by(NodeOwner) == 0, "a node-owned slot without a node"
    cache.check_invariants()


def test_a_tree_snapshot_is_never_a_donor() -> None:
    _, cache, mgr = stack()
    served(mgr, "a", list(range(8)))
    snap = next(n.snapshot for n in cache.iter_nodes() if n.snapshot is not None)
    assert snap is not None
    before = state_digest(mgr)
    with pytest.raises(SlotMisuse, match="tree snapshot cannot be a donor"):
        cache.insert([50, 51, 52], torch.arange(3), state_slot=snap)
    assert state_digest(mgr) == before
    mgr.check_invariants()


def test_nodes_of_another_cache_are_refused_everywhere() -> None:
    _, cache_a, mgr_a = stack()
    pool_b, cache_b, mgr_b = stack()
    served(mgr_a, "a", list(range(8)))
    served(mgr_b, "b", list(range(100, 108)))
    foreign = cache_a.match(list(range(9))).node
    assert foreign.snapshot is not None and foreign.cache is cache_a
    dst = pool_b.alloc(R)
    before = state_digest(mgr_b)
    calls: list[Callable[[], object]] = [
        lambda: cache_b.restore(foreign, dst, dst_owner=R),  # would copy pool A's slot id from pool B
        lambda: cache_b.lock(foreign),
        lambda: cache_b.unlock(foreign),
        lambda: cache_b.evict_snapshot(foreign),
        lambda: cache_b.kv_indices(foreign),
        lambda: cache_b.touch(foreign),
        lambda: cache_b.eviction_cost(foreign),
    ]
    for call in calls:
        with pytest.raises(ForeignObjectError, match="belongs to another cache"):
            call()
    assert state_digest(mgr_b) == before, "a foreign node changed this cache"
    with pytest.raises(TypeError, match="TreeNode"):
        cache_b.lock("node")  # type: ignore[arg-type]
    assert isinstance(ForeignObjectError("x"), RadixCacheError) and isinstance(ForeignObjectError("x"), ValueError)
    pool_b.free(dst, R)
    mgr_a.check_invariants()
    mgr_b.check_invariants()


def test_slots_of_another_pool_are_refused_everywhere() -> None:
    pool_a, _, _ = stack()
    pool_b, cache_b, mgr_b = stack()
    served(mgr_b, "b", list(range(8)))
    node = cache_b.match(list(range(9))).node
    own = pool_b.alloc(R)
    taken = pool_a.alloc_many(R, int(own) + 1)
    foreign = taken[-1]  # same index as ``own``, another pool
    assert foreign == own and foreign.pool_id == pool_a.pool_id != own.pool_id == pool_b.pool_id
    pool_b.write(own, torch.ones(1, 2, 3), torch.ones(1, 2, 2, dtype=torch.float64), owner=R)
    before = state_digest(mgr_b)
    calls: list[Callable[[], object]] = [
        lambda: cache_b.insert([70, 71, 72], torch.arange(3), state_slot=foreign),  # would clone B's slot 0
        lambda: cache_b.restore(node, foreign, dst_owner=R),  # would overwrite B's slot 0
        lambda: pool_b.free(foreign, R),
        lambda: pool_b.owner_of(foreign),
        lambda: pool_b.clone(foreign, NodeOwner(-1)),
        lambda: pool_b.copy(own, foreign),
        lambda: pool_b.copy(foreign, own),
        lambda: pool_b.zero(foreign),
        lambda: pool_b.transfer(foreign, R, RequestOwner("x")),
        lambda: pool_b.check_writable(foreign),
        lambda: pool_b.read(foreign),
        lambda: pool_b.fingerprint(foreign),
        lambda: pool_b.last_use(foreign),
    ]
    for call in calls:
        with pytest.raises(ForeignSlot, match=f"handed out by pool #{pool_a.pool_id}, not by this pool"):
            call()
    assert state_digest(mgr_b) == before, "a slot of another pool changed this one"
    assert isinstance(ForeignSlot(0, slot_pool=1, pool=2), PoolError)
    # A hand-made id carries no pool: it is an index into whichever pool it is given to.
    assert pool_b.owner_of(SlotId(int(own))) == R
    pool_b.free(own, R)
    for s in taken:
        pool_a.free(s, R)
    pool_a.check_invariants()
    mgr_b.check_invariants()


def test_node_ids_do_not_collide_across_caches() -> None:
    _, cache_a, mgr_a = stack()
    _, cache_b, mgr_b = stack()
    served(mgr_a, "a", list(range(8)))
    served(mgr_b, "b", list(range(8)))
    ids_a = {n.id for n in cache_a.iter_nodes()}
    ids_b = {n.id for n in cache_b.iter_nodes()}
    assert ids_a and ids_b and not ids_a & ids_b


def test_node_ids_keep_growing_across_reset() -> None:
    _, cache, mgr = stack()
    served(mgr, "a", list(range(8)))
    old = {n.id for n in cache.iter_nodes()}
    cache.reset()
    served(mgr, "b", list(range(8)))
    assert not old & {n.id for n in cache.iter_nodes()}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"page_size": 1.5}, TypeError, "page_size must be an int"),
        ({"page_size": True}, TypeError, "page_size must be an int"),
        ({"page_size": 0}, ValueError, "positive"),
        ({"on_event": 5}, TypeError, "callable"),
        ({"stream": "cuda"}, TypeError, "Stream"),
    ],
)
def test_bad_tree_options(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        HybridRadixCache(LinearStatePool(LAYOUT, 2), **kwargs)  # type: ignore[arg-type]


def test_bad_namespaces_and_amounts_are_type_errors() -> None:
    _, cache, mgr = stack()
    served(mgr, "a", list(range(8)))
    before = state_digest(mgr)
    with pytest.raises(TypeError, match="namespace must be hashable"):
        cache.match([1, 2], namespace=["adapter"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="namespace must be hashable"):
        mgr.admit("x", [1, 2], namespace={"a": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="evict kv_tokens must be an int"):
        cache.evict(kv_tokens=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="evict snapshots must be an int >= 0"):
        mgr.evict(snapshots=True)
    assert state_digest(mgr) == before


def test_the_same_kv_argument_works_in_every_call() -> None:
    """A list, a numpy array or a tensor of KV indices: accepted alike by insert and commit."""
    for make in (list, np.array, torch.tensor):
        pool, cache, mgr = stack()
        donor = pool.alloc(R)
        cache.insert([1, 2, 3, 4], make([0, 1, 2, 3]), state_slot=donor)
        assert mgr.admit("x", [9, 8, 7, 6, 5]).admitted
        plan = mgr.plan_prefill("x", 5)
        scribble(pool, plan)
        res = mgr.commit(plan, COMPLETE, kv_indices=make([10, 11, 12, 13, 14]))
        assert res.kv_held == 4 and mgr.kv_indices("x").tolist() == [10, 11, 12, 13, 14]
        fin = mgr.finish("x")
        assert fin.free_kv.tolist() == [] and fin.donated_depth == 5
        pool.free(donor, R)
        mgr.check_invariants()


def test_a_policy_from_another_cache_cannot_evict_here() -> None:
    _, cache_a, mgr_a = stack()
    _, _, mgr_b = stack()
    served(mgr_a, "a", list(range(8)))
    served(mgr_b, "b", list(range(8)))
    foreign = next(n for n in cache_a.iter_nodes() if n.snapshot is not None)

    def victim(now: float, *, kv: bool = False) -> TreeNode:
        return foreign

    mgr_b.policy.victim = victim  # type: ignore[method-assign]
    before = state_digest(mgr_b, policy=False)
    with pytest.raises(ForeignObjectError):
        mgr_b.evict(snapshots=1)
    assert state_digest(mgr_b, policy=False) == before
