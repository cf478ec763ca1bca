import pytest
import torch

from linear_state import (
    COMPLETE,
    CudaStream,
    DeferredStream,
    ImmediateStream,
    LinearStatePool,
    NodeOwner,
    RequestOwner,
    StateLayout,
    cuda_fence_check,
)


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
