"""A self-check of fence ordering on a CUDA device: does a pool copy ordered after a fence read what
the producer wrote, and can the check tell (does a copy *not* ordered after it read the old state)?

Run it once on a new device, driver or torch build before trusting the ordering there
(``benchmarks/gpu_check.py`` does, and the GPU tests). The producer is a chain of matrix products on
one :class:`~linear_state.CudaStream` followed by a write into a slot; two clones of that slot go on
another stream, one with no fence (the hazard) and one after the producer's fence. A first,
identical round warms everything a first use would stall on (module loading, the matrix library's
handle and workspace for each stream, the allocator's blocks), so that the host queues the
measured round without blocking and the GPU, not the host, decides what each clone reads. If the
unordered clone still saw the new state, the chain doubles and the check runs again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .layout import StateLayout
from .owners import NodeOwner, RequestOwner
from .pool import LinearStatePool
from .stream import CudaStream

__all__ = ["FenceCheck", "cuda_fence_check"]

_OLD, _NEW = 1.0, 2.0


@dataclass(frozen=True)
class FenceCheck:
    """What :func:`cuda_fence_check` saw.

    ``ordered_ok``: the clone ordered after the producer's fence read the new state (must be True).
    ``unordered_stale``: the clone with no fence read the old state, so the check can tell ordered
    from unordered on this device (if False after every attempt, the check proved nothing).
    """

    ordered_ok: bool
    unordered_stale: bool
    matmuls: int  # products in the producer's chain on the last attempt
    attempts: int
    producer_ms: float  # wall time of the last attempt, queueing to both clones waited

    @property
    def ok(self) -> bool:
        """Ordering held and the check could have seen it fail."""
        return self.ordered_ok and self.unordered_stale


def cuda_fence_check(
    device: torch.device | str | int | None = None, *, matmuls: int = 24, size: int = 4096, attempts: int = 3
) -> FenceCheck:
    """Check on ``device`` (default: the current CUDA device) that a clone ordered after a producer's
    fence reads the producer's write while an unordered clone reads the state before it.

    Allocates about ``3 * size**2 * 4`` bytes on the device and frees them on return. Each attempt
    after the first doubles ``matmuls``; it stops at the first attempt whose unordered clone read the
    old state.

    :raises RuntimeError: CUDA is not available.
    :raises ValueError: ``matmuls``, ``size`` or ``attempts`` is below 1.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_fence_check needs a CUDA device; torch.cuda.is_available() is False")
    for name, v in (("matmuls", matmuls), ("size", size), ("attempts", attempts)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    pool = LinearStatePool(StateLayout(2, (64, 3), (8, 64, 64)), 4, dev)
    fwd, copies = CudaStream(dev), CudaStream(dev)
    big = torch.randn(size, size, device=dev) / size**0.5
    torch.cuda.synchronize(dev)
    req = RequestOwner("fence-check")
    live = pool.alloc(req)
    result = FenceCheck(False, False, matmuls, 0, 0.0)
    for attempt in range(1, attempts + 1):
        n = matmuls * 2 ** (attempt - 1)

        def produce(value: float, n: int = n) -> None:
            x = big
            for _ in range(n):
                x = torch.tanh(x @ big)
            row = pool.recurrent[:, live]
            row.copy_(torch.full_like(row, value) + 0.0 * x.mean())

        # Warm-up round: the same kernels, streams and allocations; leaves the old state in place.
        fwd.submit(lambda: produce(_OLD)).wait()
        warm = pool.clone(live, NodeOwner(-1), stream=copies)
        warm.fence.wait()
        pool.free(warm.slot, NodeOwner(-1))
        torch.cuda.synchronize(dev)

        t0 = time.perf_counter()
        produced = fwd.submit(lambda: produce(_NEW))
        unordered = pool.clone(live, NodeOwner(-2), stream=copies)  # the hazard: no fence
        ordered = pool.clone(live, NodeOwner(-3), stream=copies, after=[produced])
        ordered.fence.wait()
        unordered.fence.wait()
        produced.wait()
        ms = 1e3 * (time.perf_counter() - t0)
        ordered_ok = bool(torch.all(pool.read(ordered.slot)[1] == _NEW))
        stale = bool(torch.all(pool.read(unordered.slot)[1] == _OLD))
        pool.free(ordered.slot, NodeOwner(-3))
        pool.free(unordered.slot, NodeOwner(-2))
        result = FenceCheck(ordered_ok, stale, n, attempt, round(ms, 1))
        if stale or not ordered_ok:
            break
    pool.free(live, req)
    return result
