"""LazyHeap: a binary min-heap with lazy deletion, the one copy of that mechanism in radixcache.

The tree ranks its KV leaves and its snapshots by recency with two of them; heap-based policies
rank snapshots by their own utility with a third. An item is never removed from the middle:
re-ranking pushes a fresh entry, and entries that no longer hold (the item changed, left the
tree, was re-pushed) are skipped when they surface and dropped when the heap is compacted.
Whether an entry still holds is the owner's question, asked through a ``valid`` predicate.

Entries are ``(priority, seq, item)``: ``seq`` is unique per push, so equal priorities pop in
push order and items are never compared.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["LazyHeap"]

T = TypeVar("T")
Entry = tuple[float, int, T]


class LazyHeap(Generic[T]):
    """A min-heap of ``(priority, seq, item)`` entries with lazy deletion.

    >>> h: LazyHeap[str] = LazyHeap()
    >>> _ = h.push(2.0, "b"); _ = h.push(1.0, "a")
    >>> h.pop_valid(lambda e: e[2] != "a")
    'b'
    """

    __slots__ = ("_entries", "_seq")

    def __init__(self) -> None:
        self._entries: list[Entry[T]] = []
        self._seq = 0

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry[T]]:
        """Every entry, stale ones included, in no particular order."""
        return iter(self._entries)

    def push(self, priority: float, item: T) -> int:
        """Add an entry; return its ``seq`` (unique, increasing). O(log n)."""
        self._seq += 1
        heapq.heappush(self._entries, (priority, self._seq, item))
        return self._seq

    def pop_valid(
        self, valid: Callable[[Entry[T]], bool], *, skip: Callable[[Entry[T]], bool] | None = None
    ) -> T | None:
        """Remove and return the item of the lowest valid entry, or None when none is left.

        Invalid entries on the way are dropped for good. Entries for which ``skip`` is true are
        valid but not wanted now (a locked node): they are set aside and pushed back, still ranked.
        O(log n) per entry looked at.
        """
        kept: list[Entry[T]] = []
        found: T | None = None
        entries = self._entries
        while entries:
            e = heapq.heappop(entries)
            if not valid(e):
                continue
            if skip is not None and skip(e):
                kept.append(e)
                continue
            found = e[2]
            break
        for e in kept:
            heapq.heappush(entries, e)
        return found

    def compact(self, valid: Callable[[Entry[T]], bool]) -> None:
        """Drop every invalid entry. O(n)."""
        self._entries = [e for e in self._entries if valid(e)]
        heapq.heapify(self._entries)

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
