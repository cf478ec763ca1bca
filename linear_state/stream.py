"""Streams and fences: how device work is ordered, made explicit.

A :class:`Stream` runs submitted work in submission order. ``submit`` returns a :class:`Fence`
that completes when that work has run; work may be submitted ``after`` fences of other streams,
and then runs only once they completed. A host thread that needs a result waits its fence.

Three implementations share this contract:

==================  ========================================================================
ImmediateStream     CPU default: work runs inside ``submit`` (after its fences), fences are
                    complete on return.
DeferredStream      work is queued until a fence it guards is waited, ``synchronize()`` runs,
                    or a test calls ``run_next()``. Deterministic: a test decides exactly which
                    pending writes have landed, so late-write and stale-read hazards reproduce
                    on a CPU.
CudaStream          a ``torch.cuda.Stream``; fences are CUDA events, ``after`` becomes
                    ``wait_event`` on the device (no host stall). Importable without CUDA.
==================  ========================================================================

NOTE: a full-device synchronize is available (:func:`device_synchronize`) as defence in depth;
correctness never rests on it, only on fences.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

__all__ = [
    "Fence",
    "Stream",
    "ImmediateStream",
    "DeferredStream",
    "CudaStream",
    "COMPLETE",
    "device_synchronize",
]

Work = Callable[[], object]


class Fence(ABC):
    """A point in a stream's work. Complete once all work submitted before it has run."""

    @abstractmethod
    def is_complete(self) -> bool:
        """Whether the guarded work has run. Never blocks, never runs work."""

    @abstractmethod
    def wait(self) -> None:
        """Block the host until the guarded work has run (a deferred stream runs it now)."""


class _CompleteFence(Fence):
    def is_complete(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def __repr__(self) -> str:
        return "COMPLETE"


COMPLETE: Fence = _CompleteFence()
"""A fence that is always complete: for state no pending work writes."""


class Stream(ABC):
    """An ordered queue of device work. See the module docstring for the three kinds."""

    @abstractmethod
    def submit(self, work: Work, *, after: Iterable[Fence] = (), label: str = "") -> Fence:
        """Queue ``work`` behind everything submitted before, and behind every fence in ``after``.

        :param label: shown in ``repr`` of pending work (debugging, shrunk hypothesis programs).
        :returns: a fence that completes when ``work`` has run.
        """

    @abstractmethod
    def record(self) -> Fence:
        """A fence behind everything submitted so far."""

    def wait(self, fence: Fence) -> None:
        """Block the host until ``fence`` is complete."""
        fence.wait()

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until every submitted work item has run."""


class ImmediateStream(Stream):
    """Runs work inside :meth:`submit`, after waiting its ``after`` fences on the host."""

    def submit(self, work: Work, *, after: Iterable[Fence] = (), label: str = "") -> Fence:
        for fence in after:
            fence.wait()
        work()
        return COMPLETE

    def record(self) -> Fence:
        return COMPLETE

    def synchronize(self) -> None:
        return None


@dataclass(eq=False)
class _DeferredFence(Fence):
    stream: DeferredStream
    seq: int

    def is_complete(self) -> bool:
        return self.stream.completed_seq >= self.seq

    def wait(self) -> None:
        self.stream.run_until(self.seq)

    def __repr__(self) -> str:
        state = "done" if self.is_complete() else "pending"
        return f"<fence {self.stream.name}#{self.seq} {state}>"


@dataclass(eq=False)
class _Pending:
    seq: int
    work: Work
    after: tuple[Fence, ...]
    label: str


@dataclass(eq=False)
class DeferredStream(Stream):
    """Queues work until asked to run it: the deterministic stand-in for an asynchronous device.

    Work item ``n`` (1-based) runs only when a fence at or behind it is waited, on
    :meth:`synchronize`, or when a test calls :meth:`run_next`. Before an item runs, the fences it
    was submitted ``after`` are waited (which may run work of other deferred streams), exactly as a
    device stream waits an event.
    """

    name: str = "deferred"
    completed_seq: int = 0
    _queue: deque[_Pending] = field(default_factory=deque, repr=False)
    _next_seq: int = 1

    def submit(self, work: Work, *, after: Iterable[Fence] = (), label: str = "") -> Fence:
        item = _Pending(self._next_seq, work, tuple(after), label)
        self._next_seq += 1
        self._queue.append(item)
        return _DeferredFence(self, item.seq)

    def record(self) -> Fence:
        return _DeferredFence(self, self._next_seq - 1)

    @property
    def pending(self) -> int:
        """How many submitted items have not run yet."""
        return len(self._queue)

    def pending_labels(self) -> list[str]:
        """Labels of the items not run yet, oldest first."""
        return [item.label for item in self._queue]

    def run_next(self) -> bool:
        """Run the oldest pending item (after its fences). Returns False when nothing was pending."""
        if not self._queue:
            return False
        item = self._queue[0]
        for fence in item.after:
            fence.wait()
        # The fences above may not touch this queue (a stream cannot wait on its own future), so
        # the head is still ``item``.
        self._queue.popleft()
        try:
            item.work()
        finally:
            # Work that raised has run too: its error reaches the one waiter, and later waits on
            # this stream go on past it (left incomplete, the next item behind it waited for it,
            # found it gone from the queue and recursed until Python's stack overflowed, a
            # RecursionError that hid the error the work had raised).
            self.completed_seq = item.seq
        return True

    def run_ready(self) -> int:
        """Run pending items from the oldest while their fences are already complete, as a device
        runs whatever its dependencies allow; stop at the first item that would have to wait.
        Returns how many ran."""
        n = 0
        while self._queue and all(f.is_complete() for f in self._queue[0].after):
            self.run_next()
            n += 1
        return n

    def run_until(self, seq: int) -> None:
        """Run pending items in order until item ``seq`` has run."""
        while self.completed_seq < seq and self.run_next():
            pass

    def synchronize(self) -> None:
        while self.run_next():
            pass


@dataclass(eq=False)
class _CudaFence(Fence):
    event: torch.cuda.Event

    def is_complete(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class CudaStream(Stream):
    """A ``torch.cuda.Stream``. ``after`` fences from other CUDA streams become device-side waits;
    fences of other stream kinds are waited on the host first.

    :param stream: an existing stream to submit on (an engine's forward stream, so pool work is
        ordered with the engine's kernels by stream order); default: a new stream on ``device``.
    :raises RuntimeError: constructed where CUDA is not available.
    """

    def __init__(
        self, device: torch.device | str | int | None = None, *, stream: torch.cuda.Stream | None = None
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaStream needs a CUDA device; torch.cuda.is_available() is False")
        if stream is not None:
            self.device = stream.device
            self.stream = stream
            return
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def submit(self, work: Work, *, after: Iterable[Fence] = (), label: str = "") -> Fence:
        with torch.cuda.stream(self.stream):
            for fence in after:
                if isinstance(fence, _CudaFence):
                    self.stream.wait_event(fence.event)
                else:
                    fence.wait()
            work()
            return self.record()

    def record(self) -> Fence:
        event = torch.cuda.Event()
        event.record(self.stream)
        return _CudaFence(event)

    def synchronize(self) -> None:
        self.stream.synchronize()


def device_synchronize(device: torch.device) -> None:
    """Full-device barrier: waits all work on ``device``. A no-op on the CPU.

    Defence in depth only: it shrinks a race window but the proof of ordering rests on fences.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
