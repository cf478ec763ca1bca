"""Shared helpers for tree tests: a pool, and states derived from a prefix so restores are exact."""

from collections.abc import Sequence

import torch

from linear_state import LinearStatePool, RequestOwner, SlotId, StateLayout
from radixcache import HybridRadixCache, free_kv_to

LAYOUT = StateLayout(2, (3, 3), (2, 2, 2))


def prefix_value(tokens: Sequence[int]) -> float:
    """A value that depends on every token of the prefix and its order (exact in fp32/bf16)."""
    h = 0
    for t in tokens:
        h = (h * 31 + int(t) + 1) % 251
    return float(h + 1)


def make_cache(slots: int = 32, page_size: int = 1) -> tuple[HybridRadixCache, list[int]]:
    freed: list[int] = []
    pool = LinearStatePool(LAYOUT, slots)
    cache = HybridRadixCache(pool, page_size=page_size, on_event=free_kv_to(lambda t: freed.extend(int(x) for x in t)))
    return cache, freed


def state_for(cache: HybridRadixCache, owner: RequestOwner, tokens: Sequence[int]) -> SlotId:
    """Allocate a request slot holding the state 'after' ``tokens``."""
    slot = cache.pool.alloc(owner)
    cache.pool.recurrent[:, slot].fill_(prefix_value(tokens))
    cache.pool.conv[:, slot].fill_(prefix_value(tokens))
    return slot


def restored_value(cache: HybridRadixCache, node: object, owner: RequestOwner) -> float:
    dst = cache.pool.alloc(owner)
    cache.restore(node, dst, dst_owner=owner).wait()  # type: ignore[arg-type]
    _, rec = cache.pool.read(dst)
    cache.pool.free(dst, owner)
    assert torch.all(rec == rec.flatten()[0])
    return float(rec.flatten()[0])


def scribble(pool: LinearStatePool, plan: object) -> None:
    """A stand-in forward for tests that do not model states: every slot ``plan`` (a
    ``WindowPlan``) covers gets a value of its depth, so the manager's write checks see it written."""
    for slot, depth in [(plan.live_slot, plan.end), *((c.slot, c.depth) for c in plan.captures)]:  # type: ignore[attr-defined]
        pool.conv[:, slot].fill_(float(depth))
        pool.recurrent[:, slot].fill_(float(depth))
