"""LazyHeap: a min-priority queue with lazy deletion, the one copy of that mechanism in radixcache.

The tree ranks its KV leaves, its snapshots and its host copies by recency with three of them. An
item is never removed from the middle: re-ranking pushes a fresh entry, and entries that no longer
hold are skipped when they surface and dropped when the queue is compacted. An entry superseded by a
later push of its item is told by its ``seq``; whether a current entry still holds (the item
changed, left the tree) is the owner's question, asked through a ``valid`` predicate.

Entries are ``(priority, seq, item)``: ``seq`` is unique per push, so equal priorities pop in
push order and items are never compared. An item holds one entry at a time: a push supersedes the
item's earlier entry (the queue keeps the latest ``seq`` of each item, and an entry that is not its
item's latest is dropped when it surfaces, without asking ``valid``). The tree re-pushes a node
whenever its recency changes, so every earlier entry of a re-pushed node is stale anyway; telling
them apart by ``seq`` costs a dict lookup instead of a call of the validity predicate.

Recency priorities mostly arrive in order (a touch stamps the next tick), so the entries live in
two parts: a *run*, a FIFO of entries pushed in non-decreasing priority order (an append and a
pop from its front are O(1)), and a binary heap for the entries pushed below the run's last
priority (a node unlocked or left a leaf again at an older tick). A pop takes the smaller of the
two fronts: the order is exactly a single heap's of the current entries, ``(priority, seq)``
ascending.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain, pairwise
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

    __slots__ = ("_heap", "_latest", "_run", "_seq")

    def __init__(self) -> None:
        self._run: deque[Entry[T]] = deque()  # (priority, seq) ascending: pushed in order
        self._heap: list[Entry[T]] = []  # pushed out of order
        self._latest: dict[T, int] = {}  # item -> seq of its one current entry
        self._seq = 0

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._run) + len(self._heap)

    def __iter__(self) -> Iterator[Entry[T]]:
        """Every entry, stale ones included, in no particular order."""
        return chain(self._run, self._heap)

    def current(self) -> Iterator[Entry[T]]:
        """The entries not superseded (each queued item's latest), in no particular order: what a
        pop can still return, validity aside. O(n)."""
        latest = self._latest
        return (e for e in chain(self._run, self._heap) if latest.get(e[2]) == e[1])

    def push(self, priority: float, item: T) -> int:
        """Add an entry for ``item`` (hashable), superseding its earlier one; return its ``seq``
        (unique, increasing). O(1) when ``priority`` is at least the last in-order push's, else
        O(log n)."""
        self._seq = seq = self._seq + 1
        self._latest[item] = seq
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

        Superseded and invalid entries on the way are dropped for good (``valid`` is asked of current
        entries only). Entries for which ``skip`` is true are valid but not wanted now (a locked
        node): they are set aside and pushed back, still ranked. O(1) per in-order entry looked at,
        O(log n) per other.
        """
        kept: list[Entry[T]] = []
        found: T | None = None
        run, heap, latest = self._run, self._heap, self._latest
        while run or heap:
            # The lower front; seq breaks ties, so items are never compared.
            e = heapq.heappop(heap) if heap and (not run or heap[0] < run[0]) else run.popleft()
            if latest.get(e[2]) != e[1]:
                continue  # superseded by a later push of its item
            if not valid(e):
                del latest[e[2]]
                continue
            if skip is not None and skip(e):
                kept.append(e)
                continue
            del latest[e[2]]
            found = e[2]
            break
        for e in kept:  # each still ranks below everything left in the run: back to the heap
            heapq.heappush(heap, e)
        return found

    def compact(self, valid: Callable[[Entry[T]], bool]) -> None:
        """Drop every superseded or invalid entry. O(n)."""
        latest = self._latest
        self._run = deque(e for e in self._run if latest.get(e[2]) == e[1] and valid(e))
        self._heap = [e for e in self._heap if latest.get(e[2]) == e[1] and valid(e)]
        heapq.heapify(self._heap)
        self._latest = {e[2]: e[1] for e in chain(self._run, self._heap)}

    def clear(self) -> None:
        """Drop every entry."""
        self._run.clear()
        self._heap.clear()
        self._latest.clear()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless the run is in ``(priority, seq)`` order, the heap is a
        heap, every seq is unique and at most the last one handed out, and each queued item's
        latest seq is that of one of its entries. O(n)."""
        run = list(self._run)
        assert all(a[:2] < b[:2] for a, b in pairwise(run)), "run out of (priority, seq) order"
        heap = self._heap
        for i in range(1, len(heap)):
            assert heap[(i - 1) // 2][:2] <= heap[i][:2], f"heap order broken at {i}"
        seqs = [e[1] for e in chain(run, heap)]
        assert len(set(seqs)) == len(seqs), "a seq held twice"
        assert not seqs or max(seqs) <= self._seq, f"seq {max(seqs)} past the last handed out ({self._seq})"
        present = {(e[2], e[1]) for e in chain(run, heap) if self._latest.get(e[2]) == e[1]}
        assert len(present) == len(self._latest), (
            f"{len(self._latest)} items queued, {len(present)} with their latest entry held"
        )
