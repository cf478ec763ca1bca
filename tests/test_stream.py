import threading
import time
from typing import TypeVar

import pytest
import torch

from linear_state import (
    COMPLETE,
    CudaStream,
    DeferredStream,
    Fence,
    ImmediateStream,
    LinearStatePool,
    NodeOwner,
    PoolExhausted,
    RequestOwner,
    StateLayout,
    Stream,
    StreamFailed,
    ThreadStream,
    cuda_fence_check,
)

from .exit_check import run_exiting


def test_immediate_runs_at_submit() -> None:
    ran: list[int] = []
    fence = ImmediateStream().submit(lambda: ran.append(1))
    assert ran == [1] and fence.is_complete()


def test_deferred_queues_until_waited() -> None:
    s = DeferredStream()
    ran: list[int] = []
    f1 = s.submit(lambda: ran.append(1), label="one")
    f2 = s.submit(lambda: ran.append(2), label="two")
    assert ran == [] and s.pending == 2 and s.pending_labels() == ["one", "two"]
    assert not f1.is_complete()
    f1.wait()
    assert ran == [1] and f1.is_complete() and not f2.is_complete()
    s.synchronize()
    assert ran == [1, 2] and f2.is_complete() and s.pending == 0
    assert not s.run_next()


def test_deferred_record_covers_everything_submitted() -> None:
    s = DeferredStream()
    ran: list[int] = []
    s.submit(lambda: ran.append(1))
    s.submit(lambda: ran.append(2))
    s.record().wait()
    assert ran == [1, 2]
    assert s.record().is_complete()


def test_cross_stream_after_orders_work() -> None:
    producer, consumer = DeferredStream("p"), DeferredStream("c")
    log: list[str] = []
    pf = producer.submit(lambda: log.append("write"))
    consumer.submit(lambda: log.append("read"), after=[pf])
    consumer.run_next()  # must first drain the producer up to its fence
    assert log == ["write", "read"]


def test_immediate_waits_deferred_fences() -> None:
    producer = DeferredStream()
    log: list[str] = []
    pf = producer.submit(lambda: log.append("write"))
    ImmediateStream().submit(lambda: log.append("read"), after=[pf])
    assert log == ["write", "read"]


def test_complete_fence() -> None:
    COMPLETE.wait()
    assert COMPLETE.is_complete()


def _tiny_pool(stream_device: str = "cpu") -> LinearStatePool:
    return LinearStatePool(StateLayout(2, (4, 3), (2, 4, 4)), 4, stream_device)


def _pool_on(stream: Stream, slots: int) -> LinearStatePool:
    """A small CPU pool whose work runs on ``stream``."""
    return LinearStatePool(StateLayout(2, (4, 3), (2, 4, 4)), slots, "cpu", stream=stream)


S = TypeVar("S", bound=Stream)


def _staged(stream: S) -> tuple[S, LinearStatePool, RequestOwner, int]:
    """``stream``, a two-slot pool on it, and a request (a plan) holding one slot: its staging."""
    pool = _pool_on(stream, 2)
    plan = RequestOwner("plan")
    return stream, pool, plan, pool.alloc(plan)


def test_clone_before_the_producers_fence_is_stale_after_is_fresh() -> None:
    """Hazard 2 of DESIGN.md, reproduced deterministically: a clone not ordered after the
    producer's fence captures the state from before the producing kernel ran."""
    pool = _tiny_pool()
    forward = DeferredStream("forward")
    req = RequestOwner("r")
    live = pool.alloc(req)

    def kernel() -> None:
        pool.recurrent[:, live].fill_(7.0)
        pool.conv[:, live].fill_(7.0)

    produced = forward.submit(kernel)
    early = pool.clone(live, NodeOwner(1))  # no fence: runs now, before the kernel
    late = pool.clone(live, NodeOwner(2), after=[produced])
    _, early_rec = pool.read(early.slot)
    _, late_rec = pool.read(late.slot)
    assert torch.all(early_rec == 0), "a clone taken before the fence must hold the stale state"
    assert torch.all(late_rec == 7), "a clone taken after the fence must hold the new state"
    pool.check_invariants()


def test_clone_on_deferred_stream_orders_behind_fence_lazily() -> None:
    pool = _tiny_pool()
    forward, copies = DeferredStream("forward"), DeferredStream("copies")
    req = RequestOwner("r")
    live = pool.alloc(req)
    produced = forward.submit(lambda: pool.recurrent[:, live].fill_(3.0))
    snap = pool.clone(live, NodeOwner(1), stream=copies, after=[produced])
    assert forward.pending == 1 and copies.pending == 1
    snap.fence.wait()
    assert forward.pending == 0
    assert torch.all(pool.read(snap.slot)[1] == 3)


def test_free_waits_last_writer() -> None:
    pool = _tiny_pool()
    forward = DeferredStream()
    req = RequestOwner("r")
    live = pool.alloc(req)
    late = forward.submit(lambda: pool.recurrent[:, live].fill_(5.0))
    pool.free(live, req, after=[late])
    assert late.is_complete()
    nxt = pool.alloc(RequestOwner("s"))
    assert nxt == live
    pool.zero(nxt)
    forward.synchronize()
    assert torch.all(pool.read(nxt)[1] == 0), "the freed slot's late write must not land on its next owner"


def test_cuda_stream_requires_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the GPU tests cover CudaStream")
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaStream()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_stream_orders_clone_after_event() -> None:  # pragma: no cover - GPU only
    """A producer long enough (a warmed chain of matrix products before its write) that a clone NOT
    ordered after its event observably reads the stale state; the ordered clone reads the new one.
    If the fence were ignored, the ordered clone would read stale too and the test would fail."""
    check = cuda_fence_check()
    assert check.unordered_stale, f"the producer was too short to tell ordered from not: {check}"
    assert check.ordered_ok, f"the clone ordered after the event read a stale state: {check}"


def test_cuda_fence_check_needs_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the GPU test runs the check")
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_fence_check()


def test_run_ready_stops_at_the_first_blocked_item() -> None:
    producer, copies = DeferredStream("p"), DeferredStream("c")
    log: list[str] = []
    copies.submit(lambda: log.append("free-standing"))
    pf = producer.submit(lambda: log.append("write"))
    copies.submit(lambda: log.append("fenced"), after=[pf])
    copies.submit(lambda: log.append("behind"))
    assert copies.run_ready() == 1 and log == ["free-standing"], "in order: the fenced item blocks the rest"
    producer.synchronize()
    assert copies.run_ready() == 2 and log == ["free-standing", "write", "fenced", "behind"]


def test_work_that_raises_reaches_its_waiter_once_and_the_stream_goes_on() -> None:
    """Before, the failed item stayed incomplete and out of the queue: the next wait recursed
    until a RecursionError, which the fuzz machine's teardown reported instead of the error."""
    s, other = DeferredStream("s"), DeferredStream("o")
    ran: list[str] = []

    def fail() -> None:
        raise ValueError("kernel fault")

    bad = s.submit(fail, label="bad")
    after_bad = s.submit(lambda: ran.append("next"), after=[bad])
    behind = other.submit(lambda: ran.append("other"), after=[after_bad])
    with pytest.raises(ValueError, match="kernel fault"):
        behind.wait()
    assert bad.is_complete() and ran == []
    behind.wait()  # the failed item is not run again, nor waited for ever
    assert ran == ["next", "other"] and s.pending == other.pending == 0


# ------------------------------------------------------------------ ThreadStream
def _gate(stream: ThreadStream, log: list[str], name: str) -> tuple[threading.Event, Fence]:
    """Work that waits for the test to open its gate: what runs when is the test's choice."""
    gate = threading.Event()

    def work() -> None:
        assert gate.wait(10), f"{name}: the test never opened the gate"
        log.append(name)

    return gate, stream.submit(work, label=name)


def test_thread_stream_runs_work_off_the_calling_thread_in_order() -> None:
    s = ThreadStream("copies")
    log: list[str] = []
    threads: list[str] = []
    gate, first = _gate(s, log, "first")

    def second_work() -> None:
        log.append("second")
        threads.append(threading.current_thread().name)

    second = s.submit(second_work)
    assert not first.is_complete() and not second.is_complete() and s.pending == 2
    assert log == []  # submit never runs the work: the calling thread went on
    gate.set()
    second.wait()
    assert log == ["first", "second"] and first.is_complete()
    assert threads == ["linear-state-copies"] and s.pending == 0
    assert s.record() is COMPLETE
    s.close()


def test_thread_stream_waits_other_streams_fences_before_running() -> None:
    producer, copies = ThreadStream("producer"), ThreadStream("copies")
    log: list[str] = []
    gate, produced = _gate(producer, log, "produce")
    copied = copies.submit(lambda: log.append("copy"), after=[produced])
    free_standing = copies.submit(lambda: log.append("later"))
    time.sleep(0.05)  # the copy stream has had time to run: it must still be waiting
    assert not copied.is_complete() and not free_standing.is_complete() and log == []
    gate.set()
    free_standing.wait()
    assert log == ["produce", "copy", "later"]
    producer.close()
    copies.close()


def test_thread_stream_orders_a_pool_clone_behind_its_producer() -> None:
    """A clone on a thread stream reads the producer's write, not what the slot held before."""
    pool = _tiny_pool()
    forward, copies = ThreadStream("forward"), ThreadStream("copies")
    live = pool.alloc(RequestOwner("r"))
    gate = threading.Event()

    def produce() -> None:
        assert gate.wait(10)
        pool.recurrent[:, live].fill_(3.0)

    produced = forward.submit(produce)
    snap = pool.clone(live, NodeOwner(1), stream=copies, after=[produced])
    time.sleep(0.05)  # the copy thread has had time to run the clone: it must still be waiting
    assert not snap.fence.is_complete()
    gate.set()
    snap.fence.wait()
    assert torch.all(pool.read(snap.slot)[1] == 3)
    forward.close()
    copies.close()


def test_thread_stream_failure_reaches_every_later_waiter_and_stops_the_stream() -> None:
    s = ThreadStream("s")
    ran: list[str] = []
    before = s.submit(lambda: ran.append("before"))

    def fail() -> None:
        raise ValueError("copy fault")

    bad = s.submit(fail, label="bad copy")
    behind = s.submit(lambda: ran.append("behind"))
    before.wait()  # ahead of the failure: fine
    for fence in (bad, behind, bad):  # each waiter hears of it, every time
        with pytest.raises(StreamFailed, match="bad copy") as info:
            fence.wait()
        assert isinstance(info.value.__cause__, ValueError) and info.value.seq == 2
    assert ran == ["before"], "work behind a failed item must not run"
    with pytest.raises(StreamFailed):
        s.synchronize()
    with pytest.raises(StreamFailed):
        s.record().wait()
    s.close()


def test_thread_stream_refuses_deferred_fences() -> None:
    s, deferred = ThreadStream("s"), DeferredStream("d")
    pending = deferred.submit(lambda: None)
    with pytest.raises(TypeError, match="deferred"):
        s.submit(lambda: None, after=[pending])
    assert s.pending == 0 and deferred.pending == 1 and not s.running  # nothing queued, nothing run
    with pytest.raises(ValueError, match="idle_s"):
        ThreadStream(idle_s=0)


def test_thread_stream_thread_ends_when_idle_and_starts_again_at_a_submission() -> None:
    s = ThreadStream("s", idle_s=0.05)
    s.submit(lambda: None).wait()
    assert s.running
    deadline = time.monotonic() + 5
    while s.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not s.running, "an idle worker thread must end"
    ran: list[int] = []
    s.submit(lambda: ran.append(1)).wait()
    assert ran == [1]
    s.close()
    assert not s.running
    s.close()  # idempotent
    s.submit(lambda: ran.append(2)).wait()  # work after close starts a thread again
    assert ran == [1, 2]
    s.close()


def test_thread_stream_close_runs_what_was_queued() -> None:
    s = ThreadStream("s")
    log: list[str] = []
    gate, fence = _gate(s, log, "queued")
    threading.Timer(0.05, gate.set).start()
    s.close()
    assert fence.is_complete() and log == ["queued"] and not s.running


# --------------------------------------------------- free(wait=False): the wait moves to the alloc
def test_free_without_wait_leaves_a_reading_clone_running_and_the_slot_is_handed_out_last() -> None:
    """A save's staging slot freed while the tree's clone of it still runs on a thread stream:
    the free returns at once, the slot is free, and only the alloc that hands it out again waits
    the clone, which copied what the staging slot held before its next owner wrote it."""
    pool = _pool_on(ThreadStream("copies"), 3)
    stream = pool.stream
    assert isinstance(stream, ThreadStream)
    plan = RequestOwner("plan")
    staging = pool.alloc(plan)
    pool.write(staging, torch.full((2, 4, 3), 7.0), torch.full((2, 2, 4, 4), 7.0), owner=plan).wait()
    gate = threading.Event()
    stream.submit(lambda: gate.wait(10), label="busy")  # the clone queues behind this
    snap = pool.clone(staging, NodeOwner(1))
    pool.free(staging, plan, wait=False)
    assert not snap.fence.is_complete(), "free(wait=False) must not wait the clone"
    assert pool.owner_of(staging) is None and pool.num_free == 2
    pool.check_invariants()
    other = pool.alloc(RequestOwner("b"))  # another free slot first: no wait
    assert other != staging and not snap.fence.is_complete()
    threading.Timer(0.05, gate.set).start()
    again = pool.alloc(RequestOwner("c"))  # the last free slot: waits the clone that reads it
    assert again == staging and snap.fence.is_complete()
    pool.recurrent[:, again].fill_(-1.0)  # its new owner's write (a host kernel)
    assert torch.all(pool.read(snap.slot)[1] == 7.0)
    pool.check_invariants()
    stream.close()


def test_free_without_wait_on_a_deferred_stream_runs_the_work_at_the_alloc() -> None:
    stream, pool, plan, staging = _staged(DeferredStream("copies"))
    stream.submit(lambda: pool.recurrent[:, staging].fill_(4.0))  # the host's write into it
    pool.recurrent[:, staging].fill_(4.0)
    snap = pool.clone(staging, NodeOwner(1))
    pool.free(staging, plan, wait=False)
    assert stream.pending == 2 and pool.num_free == 1
    with pytest.raises(PoolExhausted):
        pool.alloc_many(RequestOwner("b"), 2)
    assert stream.pending == 2  # a refused alloc waits nothing
    (again,) = pool.alloc_many(RequestOwner("b"), 1)
    assert again == staging and stream.pending == 0 and snap.fence.is_complete()
    assert torch.all(pool.read(snap.slot)[1] == 4.0)
    pool.check_invariants()


def test_free_refuses_a_wait_that_is_not_a_bool_and_changes_nothing() -> None:
    stream, pool, plan, staging = _staged(DeferredStream("copies"))
    snap = pool.clone(staging, NodeOwner(1))
    with pytest.raises(TypeError, match="wait must be a bool, got 'no'"):
        pool.free(staging, plan, wait="no")  # type: ignore[arg-type]
    assert pool.owner_of(staging) == plan and stream.pending == 1 and not snap.fence.is_complete()
    pool.check_invariants()


def test_free_with_wait_still_waits_the_pools_own_work() -> None:
    stream, pool, plan, staging = _staged(DeferredStream("copies"))
    snap = pool.clone(staging, NodeOwner(1))
    pool.free(staging, plan)
    assert snap.fence.is_complete() and stream.pending == 0


def test_an_alloc_behind_a_failed_stream_raises_and_keeps_the_slot_free() -> None:
    stream, pool, plan, staging = _staged(ThreadStream("copies"))

    def fail() -> None:
        raise ValueError("copy fault")

    stream.submit(fail, label="fault")
    pool.clone(staging, NodeOwner(1))  # queued behind the fault: never runs
    pool.free(staging, plan, wait=False)
    with pytest.raises(StreamFailed, match="fault"):
        pool.alloc(RequestOwner("b"))
    assert pool.owner_of(staging) is None and pool.num_free == 1
    pool.check_invariants()
    stream.close()


def test_fingerprint_later_on_a_thread_stream_equals_the_fingerprint_and_follows_the_clone() -> None:
    stream = ThreadStream("copies")
    pool = _pool_on(stream, 3)
    owner = RequestOwner("r")
    live = pool.alloc(owner)
    pool.recurrent[:, live].normal_()
    pool.conv[:, live].normal_()
    gate = threading.Event()
    stream.submit(lambda: gate.wait(10), label="busy")
    snap = pool.clone(live, NodeOwner(1))
    job = pool.fingerprint_later(snap.slot)
    assert not job.fence.is_complete() and pool.last_use(snap.slot) is job.fence
    gate.set()
    assert job.result() == pool.fingerprint(snap.slot) == pool.fingerprint(live)
    stream.close()


def test_fingerprint_later_on_the_calling_threads_streams_too() -> None:
    deferred = DeferredStream("d")
    pool = _pool_on(deferred, 2)
    slot = pool.alloc(RequestOwner("r"))
    deferred.submit(lambda: pool.recurrent[:, slot].fill_(2.0))
    pool.recurrent[:, slot].fill_(2.0)
    job = pool.fingerprint_later(slot, after=[deferred.record()])
    assert deferred.pending == 2 and job.value is None
    assert job.result() == pool.fingerprint(slot) and deferred.pending == 0
    with pytest.raises(TypeError):
        pool.fingerprint_later(slot, after=[object()])  # type: ignore[list-item]
    assert deferred.pending == 0
    now = LinearStatePool(StateLayout(2, (4, 3), (2, 4, 4)), 1, "cpu").fingerprint_later(0)
    assert now.fence.is_complete() and now.value is not None


def test_a_process_that_exits_with_copies_queued_runs_them_and_exits_cleanly() -> None:
    """Python finalizing while the worker thread is inside a torch copy aborts the process
    (``terminate called without an active exception``, exit status 134): the streams are closed
    at exit first, so the queued copies run and the process exits normally."""
    script = (
        "import torch\n"
        "from linear_state import ThreadStream\n"
        "s = ThreadStream('x')\n"
        "dst, src = torch.zeros(20_000_000), torch.ones(20_000_000)\n"
        "def copies():\n"
        "    for _ in range(100):\n"
        "        dst.copy_(src)\n"
        "s.submit(copies)\n"
        "print('queued', s.pending > 0)\n"
    )
    done = run_exiting(script)  # the stream's thread ended by the library's exit hook
    assert "queued True" in done.stdout
