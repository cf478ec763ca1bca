"""What the tree did, as events: the one channel by which KV and snapshots leave it.

Every mutating call of :class:`~radixcache.core.tree.HybridRadixCache` (``insert``, ``evict``,
``evict_snapshot``, ``reset``) reports what it freed or moved, while it does it, to the tree's one
listener (``HybridRadixCache(on_event=)``, or :meth:`~radixcache.core.tree.HybridRadixCache.listen`).
A :class:`~radixcache.CacheManager` makes itself that listener: it hands freed KV to the host's
allocator, and every event to forensics and the policy, then to the listener the tree was built
with. A host that drives a bare tree passes ``on_event=free_kv_to(my_allocator.free)``.

Events are delivered synchronously, in the order the tree acted, before the call returns; a
listener must not call back into the tree.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .tree import TreeNode

__all__ = ["TreeEvent", "TreeEventKind", "TreeListener", "free_kv_to"]


class TreeEventKind(enum.Enum):
    """What the tree did to a node."""

    #: KV indices left the tree (``event.kv``): an evicted edge, a dropped tree's edges at
    #: ``reset``, or a caller's duplicates of KV the tree already held (``insert``). Free them.
    KV_FREED = "kv-freed"
    #: A snapshot was dropped from ``event.tier`` (``"device"`` or ``"host"``); its slot
    #: ``event.slot`` goes back to that tier's pool behind its fence.
    SNAPSHOT_FREED = "snapshot-freed"
    #: A device snapshot moved to the host tier, into host slot ``event.slot``.
    DEMOTED = "demoted"
    #: A node left the tree (an evicted leaf, or a tombstone its eviction cascaded through).
    NODE_REMOVED = "node-removed"


class TreeEvent(NamedTuple):
    """One thing the tree did.

    :ivar kind: what happened.
    :ivar node: the node it happened to (for duplicates: the node the insert's key ends at or in).
    :ivar kv: the freed KV indices (``KV_FREED`` only), 1-D int64.
    :ivar tier: ``"device"`` or ``"host"`` (``SNAPSHOT_FREED`` only).
    :ivar slot: the slot freed (``SNAPSHOT_FREED``) or the host slot taken (``DEMOTED``).
    :ivar parent: the node a removed one hung from (``NODE_REMOVED`` only): where an eviction's
        cascade goes on or stops, so a listener that keeps costs knows whose changed.
    """

    kind: TreeEventKind
    node: TreeNode
    kv: torch.Tensor | None = None
    tier: str | None = None
    slot: int | None = None
    parent: TreeNode | None = None


#: The tree's listener: called once per event, in order, from the call that acted.
TreeListener = Callable[[TreeEvent], None]


def free_kv_to(free: Callable[[torch.Tensor], None]) -> TreeListener:
    """A listener that hands every ``KV_FREED`` event's indices to ``free`` (a host allocator's
    free) and ignores the rest: what a host driving a bare tree passes as ``on_event``.

    :raises TypeError: ``free`` is not callable.
    """
    if not callable(free):
        raise TypeError(f"free must be callable, got {type(free).__name__}")

    def listener(event: TreeEvent) -> None:
        if event.kind is TreeEventKind.KV_FREED:
            assert event.kv is not None
            free(event.kv)

    return listener
