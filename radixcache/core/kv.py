"""The host's KV allocator as the manager sees it, and a free list that implements it.

A host that hands its allocator to :class:`~radixcache.manager.cache_manager.CacheManager` (``kv=``) stops
keeping KV tables: the manager reserves a request's KV at admission (evicting the tree's KV
through its policy when the allocator runs short), hands each window the indices to write and
the table to read in its plan, splices the tree's pages in at each donation and gives back every
index the request no longer needs. Every index leaves the tree and the requests by one channel:
:meth:`KVAllocator.free`.

An index is owned by exactly one of: the allocator (free), a request (reserved or committed
beyond what the tree holds), the tree (a node's edge). The manager never frees an index twice
and never keeps one it freed.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from linear_state import COMPLETE, Fence

__all__ = ["KVAllocator", "KVExhausted", "KVFreeList", "KVPageList"]


class KVExhausted(MemoryError):
    """The host's KV allocator has too few free indices, even after evicting every unlocked KV
    token of the tree. Nothing was allocated.

    :ivar needed: indices asked for. :ivar free: free after the eviction.
    """

    def __init__(self, message: str, *, needed: int, free: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free


@runtime_checkable
class KVAllocator(Protocol):
    """What the manager needs of the host's KV pool (token-granular indices, ``int64``).

    - ``num_free``: indices :meth:`alloc` can hand out now.
    - ``alloc(n)``: ``n`` distinct free indices as a 1-D ``int64`` tensor, or ``None`` (nothing
      taken) when fewer than ``n`` are free. Never blocks.
    - ``free(indices, after)``: take indices back; they may be handed out again only to work
      ordered after fence ``after`` (their last reader or writer). A host whose forwards run on
      one stream in submission order may reuse them at once: every later forward is after it.
    """

    @property
    def num_free(self) -> int: ...

    def alloc(self, n: int) -> torch.Tensor | None: ...

    def free(self, indices: torch.Tensor, after: Fence = COMPLETE) -> None: ...


_FEW = 16
"""At most this many indices, :class:`KVFreeList` takes Python's scalar steps (numpy's fixed costs
are about 10 us a call); above, numpy's array operations. benchmarks/bench_kv_free_list.py, alloc
and free of n indices against the former deque of indices: 3.8 against 3.8 us for 1 (a decode
step's token), 9.4 against 7.0 for 16, 11.8 against 16.1 for 64, 25 against 376 for 2,000."""


class KVFreeList:
    """A FIFO free list of ``num_tokens`` KV indices that refuses a double free.

    For a host whose forwards run on one stream in submission order: a freed index goes back at
    once (``after`` is not waited; every forward submitted later is ordered after it). Indices are
    handed out in the order they were freed, first ``0 .. num_tokens - 1``. The list is a ring of
    indices, so :meth:`alloc` and :meth:`free` of many cost a few numpy operations, not a Python
    step per index (of a few: a Python step each).

    :raises ValueError: ``num_tokens`` not an int >= 0.
    """

    def __init__(self, num_tokens: int) -> None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        self.capacity = num_tokens
        # NOTE: a ring of the free indices (_count of them from _head on) and a flag per index, in
        # Python buffers whose items a few indices step through (a fraction of a numpy scalar's
        # cost), viewed as numpy arrays for many at once. A deque and a Python step per index
        # cost 0.36 ms to allocate and free 2,000 indices (a 2,000-token admission).
        self._ring = array("q")
        self._ring.frombytes(np.arange(num_tokens, dtype=np.int64).tobytes())
        self._head = 0
        self._count = num_tokens
        self._flags = bytearray(b"\x01") * num_tokens

    def _views(self) -> tuple[np.ndarray, np.ndarray]:
        """The ring and the free flags as numpy arrays over the same memory (writable)."""
        return np.frombuffer(self._ring, dtype=np.int64), np.frombuffer(self._flags, dtype=bool)

    @property
    def num_free(self) -> int:
        """Indices not allocated. O(1)."""
        return self._count

    def _span(self, ring: np.ndarray, start: int, n: int) -> np.ndarray:
        """``ring``'s ``n`` entries from ``start`` on (wrapping), a copy."""
        end = start + n
        if end <= self.capacity:
            return ring[start:end].copy()
        return np.concatenate((ring[start:], ring[: end - self.capacity]))

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` indices, or None (nothing taken) when fewer are free. O(n) in numpy.

        :raises ValueError: ``n`` not an int >= 0.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"alloc takes an int >= 0, got {n!r}")
        if n > self._count:
            return None
        if n == 0:
            return torch.zeros(0, dtype=torch.int64)
        h = self._head
        self._head = (h + n) % self.capacity
        self._count -= n
        if n == 1:  # a decode step's token
            i = self._ring[h]
            self._flags[i] = 0
            return torch.tensor((i,), dtype=torch.int64)
        if n <= _FEW:  # Python's scalar steps beat numpy's fixed costs
            ring, cap, flags = self._ring, self.capacity, self._flags
            few = [ring[(h + j) % cap] for j in range(n)]
            for i in few:
                flags[i] = 0
            return torch.tensor(few, dtype=torch.int64)
        ring_np, is_free = self._views()
        out = self._span(ring_np, h, n)
        is_free[out] = False
        return torch.from_numpy(out)

    def free(self, indices: torch.Tensor, after: Fence = COMPLETE) -> None:
        """Take ``indices`` back (reused by work submitted later on the one forward stream). O(n)
        in numpy (O(n log n) for the duplicate check).

        :raises TypeError: not an integer tensor. :raises ValueError: an index outside
            ``[0, capacity)``. :raises RuntimeError: an index freed twice (a KV ownership bug),
            named. Either way nothing was taken back; the first bad index in ``indices`` is named.
        """
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"indices must be an integer tensor, got {type(indices).__name__}")
        if indices.dim() != 1:
            indices = indices.reshape(-1)
        if indices.numel() <= _FEW:
            self._free_few(indices.tolist(), indices.dtype)
            return
        if indices.dtype.is_floating_point or indices.dtype.is_complex:
            raise TypeError(f"indices must be an integer tensor, got {indices.dtype}")
        ids = indices.detach().to("cpu", torch.int64).numpy()
        n = int(ids.size)
        ring, is_free = self._views()
        bad = int(ids.min()) < 0 or int(ids.max()) >= self.capacity or bool(is_free[ids].any())
        if not bad:
            s = np.sort(ids)
            bad = bool((s[1:] == s[:-1]).any())
        if bad:
            self._refuse(ids.tolist())
        is_free[ids] = True
        tail = (self._head + self._count) % self.capacity
        first = min(n, self.capacity - tail)
        ring[tail : tail + first] = ids[:first]
        ring[: n - first] = ids[first:]
        self._count += n

    def _free_few(self, ids: list[int], dtype: torch.dtype) -> None:
        """:meth:`free` of a few indices (``dtype``: the tensor's), a Python step each."""
        cap, flags, ring = self.capacity, self._flags, self._ring
        if len(ids) == 1:  # a decode step's token
            i = ids[0]
            if type(i) is not int:  # a float or complex tensor's item (a bool's is an int to Python)
                raise TypeError(f"indices must be an integer tensor, got {dtype}")
            if not 0 <= i < cap or flags[i]:
                self._refuse(ids)
            flags[i] = 1
            ring[(self._head + self._count) % cap] = i
            self._count += 1
            return
        seen: set[int] = set()
        for i in ids:
            if type(i) is not int:
                raise TypeError(f"indices must be an integer tensor, got {dtype}")
            if not 0 <= i < cap or flags[i] or i in seen:
                self._refuse(ids)
            seen.add(i)
        tail = self._head + self._count
        for i in ids:
            flags[i] = 1
            ring[tail % cap] = i
            tail += 1
        self._count += len(ids)

    def _refuse(self, ids: list[int]) -> None:
        """Raise for the first index of ``ids`` that cannot be freed (out of range, free already,
        or listed twice), as :meth:`free` documents."""
        seen: set[int] = set()
        for i in ids:
            if not 0 <= i < self.capacity:
                raise ValueError(f"KV index {i} is outside [0, {self.capacity})")
            if self._flags[i] or i in seen:
                raise RuntimeError(f"KV index {i} freed twice")
            seen.add(i)
        raise AssertionError("free() found a bad index that _refuse did not")  # pragma: no cover

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when the free list and the free flags disagree. O(capacity)."""
        ring, is_free = self._views()
        listed = self._span(ring, self._head, self._count) if self._count else np.zeros(0, dtype=np.int64)
        assert self._count == int(is_free.sum()), (self._count, int(is_free.sum()))
        assert np.unique(listed).size == listed.size, "an index is on the free list twice"
        assert bool(is_free[listed].all()), "a listed index is not marked free"


class KVPageList:
    """A :class:`KVAllocator` that hands out whole pages: index ``p * page_tokens + j`` is token
    ``j`` of page ``p``, for a host that stores KV a page at a time (a connector copying an
    engine's KV blocks) under a tree of the same ``page_size``. :meth:`alloc` and :meth:`free`
    take whole pages only: a tree with ``page_size=page_tokens`` never cuts one.

    :raises ValueError: ``num_pages`` not an int >= 0, ``page_tokens`` not an int >= 1.
    """

    def __init__(self, num_pages: int, page_tokens: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
            raise ValueError(f"page_tokens must be an int >= 1, got {page_tokens!r}")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = bytearray(b"\x01") * num_pages
        self._offsets = torch.arange(page_tokens, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        """Indices :meth:`alloc` can hand out now (free pages times ``page_tokens``). O(1)."""
        return len(self._free) * self.page_tokens

    @property
    def free_pages(self) -> int:
        """Pages not allocated. O(1)."""
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` indices (``n / page_tokens`` whole pages, each page's tokens in order), or None
        (nothing taken) when fewer are free. O(n).

        :raises ValueError: ``n`` not an int >= 0 or not a whole number of pages.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n % self.page_tokens:
            raise ValueError(f"alloc takes a whole number of {self.page_tokens}-token pages, got {n!r}")
        k = n // self.page_tokens
        if k > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(k)]
        for p in pages:
            self._is_free[p] = 0
        return self.indices(torch.tensor(pages, dtype=torch.int64))

    def indices(self, pages: torch.Tensor) -> torch.Tensor:
        """The token indices of ``pages`` (1-D int64), page by page. O(n)."""
        return (pages.reshape(-1, 1) * self.page_tokens + self._offsets).reshape(-1)

    def pages(self, indices: torch.Tensor) -> torch.Tensor:
        """The pages of ``indices`` (whole pages, each in order), 1-D int64. O(n).

        :raises ValueError: not whole pages in order, or a page outside ``[0, num_pages)``.
        """
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if idx.numel() % self.page_tokens:
            raise ValueError(f"{idx.numel()} KV indices are not whole {self.page_tokens}-token pages")
        rows = idx.view(-1, self.page_tokens)
        pages = rows[:, 0] // self.page_tokens
        if not torch.equal(rows, pages.view(-1, 1) * self.page_tokens + self._offsets):
            raise ValueError("KV indices are not whole pages in order")
        if pages.numel() and not (int(pages.min()) >= 0 and int(pages.max()) < self.num_pages):
            raise ValueError(f"a KV page is outside [0, {self.num_pages})")
        return pages

    def free(self, indices: torch.Tensor, after: Fence = COMPLETE) -> None:
        """Take whole pages back (reused by work submitted later). O(n).

        :raises ValueError: not whole pages in order, or outside the list. :raises RuntimeError:
            a page freed twice (a KV ownership bug), named. Either way nothing was taken back.
        """
        pages = self.pages(indices).tolist()
        seen: set[int] = set()
        for p in pages:
            if self._is_free[p] or p in seen:
                raise RuntimeError(f"KV page {p} freed twice")
            seen.add(p)
        for p in pages:
            self._is_free[p] = 1
        self._free.extend(pages)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when the free list and the free flags disagree. O(pages)."""
        assert len(self._free) == sum(self._is_free), (len(self._free), sum(self._is_free))
        assert len(set(self._free)) == len(self._free), "a page is on the free list twice"
        assert all(self._is_free[p] for p in self._free), "a listed page is not marked free"
