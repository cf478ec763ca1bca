"""``branch-flop``: branch points found by speculative insertion, at most two snapshots per
sequence (the branch point and the finish state), eviction by recency plus alpha times FLOPs
saved per byte (Marconi, MLSys 2025).

The branch point is where a request's prompt leaves the KV already in the tree: it exists only
from the second occurrence of a prefix on, so a shared prefix hits from its third.
"""

from __future__ import annotations

import heapq

from ..tree import HybridRadixCache, TreeNode
from .base import Policy, RequestInfo

__all__ = ["BranchFlop", "UtilityHeap"]


class UtilityHeap:
    """Eviction candidates ranked by a utility fixed when a node is pushed (lowest goes first);
    lazy deletion: stale entries (node gone, snapshot gone, re-pushed since) are skipped.
    O(log n) per push and per eviction."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, TreeNode]] = []
        self._stamp: dict[int, int] = {}
        self._n = 0

    def push(self, node: TreeNode, utility: float) -> None:
        self._n += 1
        self._stamp[node.id] = self._n
        heapq.heappush(self._heap, (utility, self._n, node.id, node))
        if len(self._heap) > 4 * len(self._stamp) + 1024:
            self._heap = [e for e in self._heap if self._stamp.get(e[2]) == e[1] and _alive(e[3])]
            heapq.heapify(self._heap)

    def pop_evictable(self) -> TreeNode | None:
        """The lowest-utility unlocked node with a snapshot, removed from the heap; None if none.

        Locked nodes (a running request restores from them) are skipped and stay ranked.
        """
        locked: list[tuple[float, int, int, TreeNode]] = []
        found: TreeNode | None = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            _, n, nid, node = entry
            if self._stamp.get(nid) != n or not _alive(node):
                continue
            if node.snap_lock:
                locked.append(entry)
                continue
            del self._stamp[nid]
            found = node
            break
        for entry in locked:
            heapq.heappush(self._heap, entry)
        return found

    def check_invariants(self) -> None:
        """Raise AssertionError unless every live stamp has exactly one heap entry."""
        entries = [(nid, n) for _, n, nid, _ in self._heap if self._stamp.get(nid) == n]
        assert len(entries) == len(self._stamp), f"{len(self._stamp)} stamped nodes, {len(entries)} live heap entries"
        assert all(n <= self._n for n in self._stamp.values()), "a stamp from the future"


def _alive(node: TreeNode) -> bool:
    return node.parent is not None and node.snapshot is not None


class BranchFlop(Policy):
    """:param alpha: weight of FLOPs saved per byte against recency (seconds)."""

    name = "branch-flop"

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

    def donated(self, node: TreeNode, req: RequestInfo, reason: str, now: float) -> None:
        self.heap.push(node, self._utility(node, now))

    def touched(self, node: TreeNode, req: RequestInfo, now: float) -> None:
        self.heap.push(node, self._utility(node, now))

    def check_invariants(self) -> None:
        self.heap.check_invariants()

    def evict_one(self, cache: HybridRadixCache, now: float) -> bool:
        node = self.heap.pop_evictable()
        if node is None:
            return cache.evict(snapshots=1).snapshots > 0
        cache.evict_snapshot(node)
        return True
