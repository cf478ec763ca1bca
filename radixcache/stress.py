"""A seeded stress loop over the tree: random actions, ``check_invariants()`` after each.

    radixcache stress --count 100000 --seed 7

Every donated state is a value derived from its prefix, so each restore is checked exactly; KV
indices handed to the tree are accounted for (held or released, never both, never lost).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from linear_state import DeferredStream, LinearStatePool, RequestOwner, StateLayout

from .core.events import free_kv_to
from .core.tree import HybridRadixCache, TreeNode

__all__ = ["StressReport", "tree_stress"]


@dataclass(frozen=True, slots=True)
class StressReport:
    """What a stress run did."""

    actions: int
    seed: int
    inserts: int
    hits: int
    restores_checked: int
    evicted_nodes: int
    max_nodes: int


def _value(tokens: tuple[int, ...]) -> float:
    h = 0
    for t in tokens:
        h = (h * 31 + t + 1) % 1021
    return float(h + 1)


def tree_stress(
    count: int, seed: int, *, page_size: int = 1, slots: int = 64, progress: Callable[[int], None] | None = None
) -> StressReport:
    """Run ``count`` random actions with ``seed``; raise ``AssertionError`` on the first violation.

    Deterministic for a given (count, seed, page_size, slots).
    """
    rng = random.Random(seed)
    pool = LinearStatePool(StateLayout(1, (2, 3), (2, 2)), slots)
    copies = DeferredStream("copies")
    released: set[int] = set()

    def on_free(t: torch.Tensor) -> None:
        for x in t.tolist():
            assert x not in released, f"KV index {x} released twice"
            released.add(x)

    cache = HybridRadixCache(pool, page_size=page_size, on_event=free_kv_to(on_free), stream=copies)
    donor, reader = RequestOwner("donor"), RequestOwner("reader")
    handed = 0
    locked: list[TreeNode] = []
    prefixes: list[tuple[int, ...]] = [()]
    inserts = hits = checked = evicted = max_nodes = 0
    for step in range(count):
        action = rng.random()
        base = rng.choice(prefixes)
        key = base[: rng.randint(0, len(base))] + tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 6)))
        ns = rng.choice((None, None, None, "ns"))
        if action < 0.35 and pool.can_alloc(2):
            cut = key[: len(key) - len(key) % page_size]
            slot = pool.alloc(donor)
            pool.recurrent[:, slot].fill_(_value(cut))
            kv = torch.arange(handed, handed + len(key))
            handed += len(key)
            with_state = rng.random() < 0.9
            res = cache.insert(key, kv, state_slot=slot if with_state else None, namespace=ns)
            on_free(kv[res.length :])  # the caller keeps (and here frees) what the tree did not take
            pool.free(slot, donor)
            inserts += 1
            if len(prefixes) < 200:
                prefixes.append(key)
        elif action < 0.75:
            key = base + tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 3)))
            m = cache.match(key, namespace=ns)
            if m.cached_length:
                hits += 1
                if pool.can_alloc(1):
                    dst = pool.alloc(reader)
                    cache.restore(m.node, dst, dst_owner=reader).wait()
                    got = float(pool.read(dst)[1].flatten()[0])
                    want = _value(tuple(key[: m.cached_length]))
                    assert got == want, f"step {step}: restore of {key[: m.cached_length]} gave {got}, want {want}"
                    pool.free(dst, reader)
                    checked += 1
                if rng.random() < 0.3:
                    cache.lock(m.node)
                    locked.append(m.node)
        elif action < 0.85 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif action < 0.9:
            evicted += cache.evict(kv_tokens=rng.randint(0, 20), snapshots=rng.randint(0, 3)).nodes_removed
        else:
            copies.run_next()
        cache.check_invariants()
        held = cache.total_kv_tokens
        assert held + len(released) == handed, f"step {step}: {held} held + {len(released)} released != {handed}"
        max_nodes = max(max_nodes, cache.num_nodes)
        if progress is not None:
            progress(step)
    for node in locked:
        cache.unlock(node)
    cache.reset()
    assert pool.num_free == pool.capacity, f"{pool.capacity - pool.num_free} slots leaked"
    assert len(released) == handed, f"{handed - len(released)} KV indices leaked"
    return StressReport(count, seed, inserts, hits, checked, evicted, max_nodes)
