"""LazyHeap: a min-priority queue with lazy deletion, the one copy of that mechanism in radixcache.

The tree ranks its KV leaves, its snapshots and its host copies by recency with three of them. An
item is never removed from the middle: re-ranking pushes a fresh entry, and entries that no longer
hold (the item changed, left the tree, was re-pushed) are skipped when they surface and dropped
when the queue is compacted. Whether an entry still holds is the owner's question, asked through a
``valid`` predicate.

Entries are ``(priority, seq, item)``: ``seq`` is unique per push, so equal priorities pop in
push order and items are never compared.

Recency priorities mostly arrive in order (a touch stamps the next tick), so the entries live in
two parts: a *run*, a FIFO of entries pushed in non-decreasing priority order (an append and a
pop from its front are O(1)), and a binary heap for the entries pushed below the run's last
priority (a node unlocked or left a leaf again at an older tick). A pop takes the smaller of the
two fronts: the order is exactly a single heap's, ``(priority, seq)`` ascending.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Generic, TypeVar

__all__ = ["LazyHeap"]

T = TypeVar("T")
Entry = tuple[float, int, T]


class LazyHeap(Generic[T]):
    """A min-priority queue of ``(priority, seq, item)`` entries with lazy deletion.

    >>> h: LazyHeap[str] = LazyHeap()
    >>> _ = h.push(2.0, "b"); _ = h.push(1.0, "a")
    >>> h.pop_valid(lambda e: e[2] != "a")
    'b'
    """

    __slots__ = ("_heap", "_run", "_seq")

    def __init__(self) -> None:
        self._run: deque[Entry[T]] = deque()  # (priority, seq) ascending: pushed in order
        self._heap: list[Entry[T]] = []  # pushed out of order
        self._seq = 0

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._run) + len(self._heap)

    def __iter__(self) -> Iterator[Entry[T]]:
        """Every entry, stale ones included, in no particular order."""
        return chain(self._run, self._heap)

    def push(self, priority: float, item: T) -> int:
        """Add an entry; return its ``seq`` (unique, increasing). O(1) when ``priority`` is at least
        the last in-order push's, else O(log n)."""
        self._seq = seq = self._seq + 1
        run = self._run
        if not run or run[-1][0] <= priority:
            run.append((priority, seq, item))
        else:
            heapq.heappush(self._heap, (priority, seq, item))
        return seq

    def pop_valid(
        self, valid: Callable[[Entry[T]], bool], *, skip: Callable[[Entry[T]], bool] | None = None
    ) -> T | None:
        """Remove and return the item of the lowest valid entry, or None when none is left.

        Invalid entries on the way are dropped for good. Entries for which ``skip`` is true are
        valid but not wanted now (a locked node): they are set aside and pushed back, still ranked.
        O(1) per in-order entry looked at, O(log n) per other.
        """
        kept: list[Entry[T]] = []
        found: T | None = None
        run, heap = self._run, self._heap
        while run or heap:
            # The lower front; seq breaks ties, so items are never compared.
            e = heapq.heappop(heap) if heap and (not run or heap[0] < run[0]) else run.popleft()
            if not valid(e):
                continue
            if skip is not None and skip(e):
                kept.append(e)
                continue
            found = e[2]
            break
        for e in kept:  # each still ranks below everything left in the run: back to the heap
            heapq.heappush(heap, e)
        return found

    def compact(self, valid: Callable[[Entry[T]], bool]) -> None:
        """Drop every invalid entry. O(n)."""
        self._run = deque(e for e in self._run if valid(e))
        self._heap = [e for e in self._heap if valid(e)]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        """Drop every entry."""
        self._run.clear()
        self._heap.clear()
