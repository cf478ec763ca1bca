"""``branch-flop``: branch points found by speculative insertion, at most two snapshots per
sequence (the branch point and the finish state), eviction by recency plus alpha times FLOPs
saved per byte (Marconi, MLSys 2025).

The branch point is where a request's prompt leaves the KV already in the tree: it exists only
from the second occurrence of a prefix on, so a shared prefix hits from its third.
"""

from __future__ import annotations

from ..core.lazy_heap import LazyHeap
from ..core.tree import HybridRadixCache, TreeNode
from .base import DonationReason, Policy, RequestInfo

__all__ = ["BranchFlop", "UtilityHeap"]


class UtilityHeap:
    """Eviction candidates ranked by a utility fixed when a node is pushed (lowest goes first),
    on a :class:`~radixcache.core.lazy_heap.LazyHeap`: an entry is stale once its node lost its
    snapshot or was pushed again. O(log n) per push and per eviction."""

    def __init__(self) -> None:
        self._heap: LazyHeap[TreeNode] = LazyHeap()
        self._stamp: dict[int, int] = {}

    def _live(self, e: tuple[float, int, TreeNode]) -> bool:
        node = e[2]
        if self._stamp.get(node.id) != e[1]:
            return False  # pushed again since
        if not HybridRadixCache.holds_snapshot(node):
            del self._stamp[node.id]  # its current entry, but the snapshot is gone
            return False
        return True

    def push(self, node: TreeNode, utility: float) -> None:
        """Rank ``node`` at ``utility`` (replacing its previous rank)."""
        self._stamp[node.id] = self._heap.push(utility, node)
        if len(self._heap) > 4 * len(self._stamp) + 1024:
            self._heap.compact(self._live)

    def pop_evictable(self, *, leaf: bool = False) -> TreeNode | None:
        """The lowest-utility evictable node (a leaf when ``leaf``), removed from the heap; None if
        none. Locked nodes (a running request restores from them) are skipped and stay ranked."""
        node = self._heap.pop_valid(
            self._live, skip=lambda e: not HybridRadixCache.is_evictable(e[2]) or (leaf and not e[2].is_leaf)
        )
        if node is not None:
            del self._stamp[node.id]
        return node

    def check_invariants(self) -> None:
        """Raise AssertionError unless every live stamp has exactly one heap entry."""
        entries = [(e[2].id, e[1]) for e in self._heap if self._stamp.get(e[2].id) == e[1]]
        assert len(entries) == len(self._stamp), f"{len(self._stamp)} stamped nodes, {len(entries)} live heap entries"
        assert len({nid for nid, _ in entries}) == len(entries), "a node stamped twice"


class BranchFlop(Policy):
    """:param alpha: weight of FLOPs saved per byte against recency (seconds)."""

    name = "branch-flop"
    decode_captures = False

    def __init__(self, alpha: float = 2.0, flops_per_byte: float = 1.0) -> None:
        self.alpha = alpha
        self.heap = UtilityHeap()

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        if decode:
            return []
        b = req.branch
        return [b] if b > req.hit and start < b <= end else []

    def donate_finish(self, req: RequestInfo) -> bool:
        return True

    def _utility(self, node: TreeNode, now: float) -> float:
        # FLOPs saved per byte grows with depth (each hit skips depth tokens of prefill for one
        # fixed-size snapshot); recency is the time of last use.
        return now + self.alpha * node.depth / 1000.0

    def donated(self, node: TreeNode, req: RequestInfo, reason: DonationReason, now: float) -> None:
        self.heap.push(node, self._utility(node, now))

    def touched(self, node: TreeNode, req: RequestInfo, now: float) -> None:
        self.heap.push(node, self._utility(node, now))

    def check_invariants(self) -> None:
        self.heap.check_invariants()

    def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
        return self.heap.pop_evictable(leaf=kv)
