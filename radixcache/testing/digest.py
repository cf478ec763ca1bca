"""A digest of everything a :class:`~radixcache.CacheManager` holds: pool, tree, manager and
policy state, for tests that assert a call changed nothing (a refused admission, a dry run, a
call that raised).

What it covers: every slot's owner, last-use fence state and fingerprint; the free list; every
tree node (id, depth, key, KV indices, snapshot slot, locks, recency) and the tree's counters
and eviction heaps; the manager's requests (slots, lock, ids, KV table, open plan, fences) and
counters; and the policy's own fields, walked recursively (tree nodes by id, tensors by value).
Two digests are equal exactly when none of that differs. O(pool bytes + tree + policy state).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from linear_state import Fence, NodeOwner

from ..core.lazy_heap import LazyHeap
from ..core.tree import HybridRadixCache, TreeNode
from ..manager.cache_manager import CacheManager

__all__ = ["canonical", "state_digest"]


def canonical(obj: Any, _seen: set[int] | None = None) -> Any:
    """A plain, comparable picture of ``obj``: containers become tuples (sets and dicts sorted by
    their items' repr), objects their fields, tree nodes their id, tensors their values, fences
    whether they completed. Cycles are cut."""
    seen = set() if _seen is None else _seen
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, enum.Enum):
        return ("enum", obj.value)
    if isinstance(obj, TreeNode):  # ids relative to the cache's base: two caches compare alike
        return ("node", obj.id - (obj.cache.id_base if obj.cache is not None else 0))
    if isinstance(obj, Fence):
        return ("fence", obj.is_complete())
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), tuple(obj.detach().cpu().reshape(-1).tolist()))
    if isinstance(obj, np.ndarray):
        return ("array", str(obj.dtype), obj.shape, obj.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, random.Random):
        return ("rng", obj.getstate())
    if isinstance(obj, HybridRadixCache):
        return ("cache", id(obj))
    if id(obj) in seen:
        return ("cycle", type(obj).__name__)
    seen.add(id(obj))
    try:
        if isinstance(obj, LazyHeap):
            return ("heap", tuple(sorted((repr(canonical(e, seen)) for e in obj), key=str)))
        if isinstance(obj, Mapping):
            return (
                "map",
                tuple(sorted(((repr(canonical(k, seen)), canonical(v, seen)) for k, v in obj.items()), key=repr)),
            )
        if isinstance(obj, (set, frozenset)):
            return ("set", tuple(sorted(repr(canonical(x, seen)) for x in obj)))
        if isinstance(obj, (list, tuple)) or type(obj).__name__ == "deque":
            return ("seq", tuple(canonical(x, seen) for x in obj))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return (
                type(obj).__name__,
                tuple((f.name, canonical(getattr(obj, f.name), seen)) for f in dataclasses.fields(obj)),
            )
        fields: dict[str, Any] = {}
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if hasattr(obj, name):
                    fields[name] = getattr(obj, name)
        fields.update(getattr(obj, "__dict__", {}))
        return (type(obj).__name__, tuple((k, canonical(v, seen)) for k, v in sorted(fields.items())))
    finally:
        seen.discard(id(obj))


def _tree(cache: HybridRadixCache) -> Any:
    base = cache.id_base
    nodes = sorted(cache.iter_nodes(), key=lambda n: n.id)
    rows = tuple(
        (
            n.id - base,
            n.depth,
            n.key,
            tuple(n.value.tolist()),
            n.snapshot,
            n.kv_lock,
            n.snap_lock,
            n.last_access,
            None if n.parent is None else n.parent.id - base,
            n.snapshot_fence.is_complete(),
        )
        for n in nodes
    )
    counters = (
        cache.num_nodes,
        cache.num_snapshots,
        cache.evictable_kv_tokens,
        cache.protected_kv_tokens,
        cache.protected_snapshots,
    )
    return rows, counters, canonical(cache.describe())


def state_digest(manager: CacheManager, *, metrics: bool = True, policy: bool = True) -> str:
    """A hex digest of the manager's whole state (see the module docstring); ``metrics=False``
    leaves its counters out (a refused admission counts a refusal and changes nothing else);
    ``policy=False`` leaves the policy out (to compare two caches: node ids differ between caches,
    and a policy may key its state by them; the tree's and manager's parts are taken relative to
    the cache's id base).
    The pool's own pending work is waited first (queued clones and restores run, with the forwards
    they are ordered after), so a digest taken right before a call and one right after it agree
    unless the call changed something."""
    pool, base = manager.pool, manager.cache.id_base

    def owner(s: int) -> object:
        o = pool.owner_of(s)
        return ("node", o.node_id - base) if isinstance(o, NodeOwner) else str(o)

    # Settle first: waiting one slot's pending clone can run a forward that writes another slot, so
    # every fence is waited before any slot is read (two digests in a row then agree).
    for s in range(pool.capacity):
        pool.last_use(s).wait()
    slots = tuple((s, owner(s), pool.last_use(s).is_complete(), int(pool.fingerprint(s))) for s in range(pool.capacity))
    parts = (
        slots,
        pool.num_free,
        _tree(manager.cache),
        canonical({k: v for k, v in manager.describe().items() if metrics or k != "counters"}),
        canonical(manager.policy.describe()) if policy else None,
    )
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()
