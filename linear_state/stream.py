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
ThreadStream        work runs on a worker thread of the stream's own, in submission order:
                    host copies (a CPU pool's clones) leave the calling thread, which torch's
                    copy kernels let run on (they release the GIL).
==================  ========================================================================

NOTE: a full-device synchronize is available (:func:`device_synchronize`) as defence in depth;
correctness never rests on it, only on fences.
"""

from __future__ import annotations

import atexit
import threading
import weakref
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
    "ThreadStream",
    "StreamFailed",
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


class StreamFailed(RuntimeError):
    """Work on a :class:`ThreadStream` raised: every fence at or behind it raises this, chained to
    the work's own error (``__cause__``), and the stream runs nothing more.

    :ivar stream: the stream's name; :ivar label: the failed work's label; :ivar seq: its number.
    """

    def __init__(self, stream: str, label: str, seq: int, error: BaseException) -> None:
        self.stream, self.label, self.seq = stream, label, seq
        super().__init__(
            f"work #{seq} {label!r} on stream {stream!r} raised {type(error).__name__}: {error}; "
            "the stream ran nothing after it"
        )


@dataclass(eq=False)
class _ThreadFence(Fence):
    stream: ThreadStream
    seq: int

    def is_complete(self) -> bool:
        return self.stream.completed_seq >= self.seq

    def wait(self) -> None:
        self.stream.wait_seq(self.seq)

    def __repr__(self) -> str:
        state = "done" if self.is_complete() else "pending"
        return f"<fence {self.stream.name}#{self.seq} {state}>"


class ThreadStream(Stream):
    """Runs work on one worker thread of its own, in submission order; fences complete as the
    thread runs the work. The worker waits an item's ``after`` fences (of any stream but a
    :class:`DeferredStream`, whose work runs on the thread that waits it) before running it.

    Work that raises fails the stream, as a device error does: every fence at or behind it raises
    :class:`StreamFailed` when waited, and later work is not run (a copy queued behind a failed
    copy would read what the failed one left).

    The thread starts at a submission and ends once it has found nothing to run for ``idle_s``
    seconds (or at :meth:`close`); the next submission starts another. At interpreter exit, every
    stream's queued work runs and its thread ends before Python finalizes (a thread still inside
    a torch kernel then aborts the process).

    One thread submits (the pool's owner, a scheduler): the worker runs the work's tensor
    operations and nothing else, so work captures what it touches when it is submitted.

    :param name: the thread's and the fences' name.
    :param idle_s: how long the idle thread waits for work before it ends.
    :raises ValueError: ``idle_s`` not a positive number.
    """

    def __init__(self, name: str = "thread", *, idle_s: float = 5.0) -> None:
        if isinstance(idle_s, bool) or not isinstance(idle_s, (int, float)) or not idle_s > 0:
            raise ValueError(f"idle_s must be a positive number of seconds, got {idle_s!r}")
        self.name = str(name)
        self.idle_s = float(idle_s)
        self.completed_seq = 0
        """The number of the last item run (items are numbered from 1)."""
        self._cv = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._next_seq = 1
        self._failed: StreamFailed | None = None
        self._thread: threading.Thread | None = None
        self._stop = False

    def submit(self, work: Work, *, after: Iterable[Fence] = (), label: str = "") -> Fence:
        """Queue ``work`` for the worker thread behind everything submitted before and behind
        ``after`` (complete fences and this stream's own are dropped: its order covers them).

        :raises TypeError: a fence of a :class:`DeferredStream` in ``after`` (its work would run on
            the worker thread). Nothing was queued.
        """
        waits = []
        for fence in after:
            if isinstance(fence, _DeferredFence):
                raise TypeError(f"a ThreadStream cannot wait {fence!r}: deferred work runs where it is waited")
            if not (isinstance(fence, _ThreadFence) and fence.stream is self) and not fence.is_complete():
                waits.append(fence)
        with self._cv:
            item = _Pending(self._next_seq, work, tuple(waits), label)
            self._next_seq += 1
            self._queue.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"linear-state-{self.name}", daemon=True)
                self._thread.start()
                _RUNNING.add(self)
            self._cv.notify_all()
        return _ThreadFence(self, item.seq)

    def record(self) -> Fence:
        seq = self._next_seq - 1
        return COMPLETE if self.completed_seq >= seq and self._failed is None else _ThreadFence(self, seq)

    @property
    def pending(self) -> int:
        """How many submitted items have not run yet."""
        return self._next_seq - 1 - self.completed_seq

    @property
    def running(self) -> bool:
        """Whether the worker thread is alive now (it ends when idle)."""
        return self._thread is not None

    def wait_seq(self, seq: int) -> None:
        """Block until item ``seq`` has run. :raises StreamFailed: it or an item before it raised."""
        if self.completed_seq < seq:
            with self._cv:
                self._cv.wait_for(lambda: self.completed_seq >= seq)
        failed = self._failed
        if failed is not None and failed.seq <= seq:
            raise failed

    def synchronize(self) -> None:
        """Block until every submitted item has run. :raises StreamFailed: one raised."""
        self.wait_seq(self._next_seq - 1)

    def close(self) -> None:
        """Run what is queued, then end the worker thread now rather than when idle (a later
        submission starts another). Does not raise for failed work: its fences do."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cv:
            self._stop = False

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    self._cv.wait_for(lambda: bool(self._queue) or self._stop, timeout=self.idle_s)
                if not self._queue:  # idle for idle_s, or closed: a submission starts another thread
                    self._thread = None
                    return
                item = self._queue[0]
            if self._failed is None:
                try:
                    for fence in item.after:
                        fence.wait()
                    item.work()
                except BaseException as e:  # reaches every waiter of this fence and of those behind it
                    self._failed = StreamFailed(self.name, item.label, item.seq, e)
                    self._failed.__cause__ = e
            with self._cv:
                self._queue.popleft()
                self.completed_seq = item.seq
                self._cv.notify_all()

    def __repr__(self) -> str:
        return f"<ThreadStream {self.name!r} run {self.completed_seq} of {self._next_seq - 1}>"


_RUNNING: weakref.WeakSet[ThreadStream] = weakref.WeakSet()  # streams whose thread was started


@atexit.register
def _close_streams_at_exit() -> None:
    """Run every stream's queued work and end its thread before the interpreter finalizes."""
    for stream in list(_RUNNING):
        stream.close()


def device_synchronize(device: torch.device) -> None:
    """Full-device barrier: waits all work on ``device``. A no-op on the CPU.

    Defence in depth only: it shrinks a race window but the proof of ordering rests on fences.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
