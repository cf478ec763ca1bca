"""The host tier's size: a CPU pool the tree demotes evicted snapshots into (docs/host_tier.md).

The demotion itself is the tree's (:class:`~radixcache.core.tree.HybridRadixCache` with
``host_pool=``): it moves a snapshot between two pools behind fences, like every other copy. This
module decides how big the host pool is when nobody says.
"""

from __future__ import annotations

import os

from linear_state import LinearStatePool

__all__ = ["HOST_TIER_FACTOR", "auto_host_pool", "physical_memory"]

#: The default host tier holds this many times the device pool's bytes (see :func:`auto_host_pool`).
HOST_TIER_FACTOR = 4


def physical_memory() -> int | None:
    """The machine's physical memory in bytes, or ``None`` where the platform does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def auto_host_pool(pool: LinearStatePool, budget_bytes: int | None = None) -> LinearStatePool | None:
    """The host tier :class:`~radixcache.CacheManager` gives its tree by default for ``pool``.

    A CPU pool of ``pool``'s layout with ``budget_bytes // slot_bytes`` slots, page-locked when
    ``pool`` is on CUDA. ``budget_bytes=None``: :data:`HOST_TIER_FACTOR` times ``pool``'s bytes,
    capped at a quarter of the machine's physical memory (when the platform reports it).

    :returns: the pool, or ``None`` when the budget holds less than one slot.
    :raises ValueError: a negative budget, or one above the machine's physical memory.
    """
    slot = pool.layout.slot_bytes
    if budget_bytes is None:
        budget_bytes = HOST_TIER_FACTOR * pool.capacity * slot
        phys = physical_memory()
        if phys is not None:
            budget_bytes = min(budget_bytes, phys // 4)
    if budget_bytes < 0:
        raise ValueError(f"host budget must be >= 0 bytes, got {budget_bytes}")
    phys = physical_memory()
    if phys is not None and budget_bytes > phys:
        raise ValueError(f"host budget of {budget_bytes} bytes is more than this machine's {phys} bytes of memory")
    n = int(budget_bytes) // slot
    if n < 1:
        return None
    return LinearStatePool(pool.layout, n, device="cpu", pin_memory=pool.device.type == "cuda")
