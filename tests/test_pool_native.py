"""A CPU pool's native slot copy (linear_state/_native.c's copy_slot) against the torch copy, the
reference: the same bytes after clones and restores, in every kind of layout a pool holds, and the
native call's refusals."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from linear_state import HostedStatePool, LinearStatePool, RequestOwner, StateLayout
from linear_state import pool as pool_mod
from linear_state.native import MODULE, NATIVE

from .random_slots import random_pool

needs_native = pytest.mark.skipif(not NATIVE, reason="linear_state's C extension is not built here")
A, T = RequestOwner("a"), RequestOwner("t")

LAYOUTS = [
    StateLayout(2, (3, 3), (2, 2, 2), conv_dtype=torch.bfloat16),  # rows narrower than a word
    StateLayout(3, (5,), (3,), conv_dtype=torch.bfloat16),  # 10- and 12-byte rows
    StateLayout(2, (24, 3), (2, 8, 4)),  # the SGLang harness's Mamba2 state
    StateLayout(1, (3,), (5, 2), conv_dtype=torch.float8_e4m3fn),  # 3-byte rows
]


def _run(layout: StateLayout, native: bool, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Random slots, then clones and copies in an order that reuses slots; the tensors after."""
    with monkeypatch.context() as m:
        if not native:
            m.setattr(pool_mod, "_NATIVE", None)
        pool = LinearStatePool(layout, 6)
        assert (pool._byte_rows is not None) is native
        conv, rec = random_pool(layout, 6, 11)
        pool.conv.copy_(conv)
        pool.recurrent.copy_(rec)
        a, b = pool.alloc_many(A, 2)
        snap = pool.clone(a, T)  # slot 2
        pool.copy(snap.slot, b).wait()  # a restore
        c = pool.alloc(A)
        pool.copy(b, c).wait()
        pool.free(a, A)
        again = pool.clone(c, T)  # slot a again
        assert again.slot == a
        pool.check_invariants()
        return [pool.conv.clone(), pool.recurrent.clone()]


@needs_native
@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_copies_equal_torch_copies(layout: StateLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _run(layout, False, monkeypatch)
    got = _run(layout, True, monkeypatch)
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r.view(torch.uint8), g.view(torch.uint8))


class _Lender:
    """A host allocator: a free list of slot indices (slot 0 reserved, as SGLang's dummy)."""

    def __init__(self, slots: int) -> None:
        self.free = list(range(slots - 1, 0, -1))

    def take(self, n: int) -> list[int] | None:
        return [self.free.pop() for _ in range(n)] if len(self.free) >= n else None

    def give(self, slots: Sequence[int]) -> None:
        self.free.extend(slots)

    def available(self) -> int:
        return len(self.free)


@needs_native
def test_a_hosted_pool_over_views_of_a_larger_buffer_copies_natively() -> None:
    """SGLang's tensors: the pool's slot axis a view of a larger buffer, slot 0 reserved."""
    layout = StateLayout(2, (24, 3), (2, 8, 4))
    base = random_pool(layout, 10, 5)
    conv, rec = (t[:, 1:] for t in base)  # not contiguous as a whole
    before = [t.clone() for t in base]
    pool = HostedStatePool(layout, conv, rec, _Lender(9), reserved=(0,))
    assert pool._byte_rows is not None
    a = pool.alloc(A)
    snap = pool.clone(a, T)
    for t, old in zip(base, before, strict=True):
        assert torch.equal(t[:, 1 + snap.slot].view(torch.uint8), old[:, 1 + a].view(torch.uint8))
        changed = [i for i in range(10) if not torch.equal(t[:, i].view(torch.uint8), old[:, i].view(torch.uint8))]
        assert changed == [1 + snap.slot], "only the clone's slot was written"
    pool.check_invariants()


@needs_native
def test_copy_slot_checks_every_view_before_moving_a_byte() -> None:
    assert MODULE is not None
    one = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    two = np.arange(2 * 2 * 4, dtype=np.uint8).reshape(2, 2, 4)  # only two slots
    saved = one.copy()
    with pytest.raises(IndexError, match=r"slots 0 -> 2 outside \[0, 2\)"):
        MODULE.copy_slot([one, two], 0, 2)
    assert np.array_equal(one, saved), "the first view was not written"
    MODULE.copy_slot([one], 0, 2)
    assert np.array_equal(one[:, 2], saved[:, 0]) and np.array_equal(one[:, :2], saved[:, :2])
    ro = np.zeros((2, 3, 4), dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):  # numpy's refusal of a writable buffer
        MODULE.copy_slot([ro], 0, 1)
    with pytest.raises(ValueError, match="contiguous bytes"):
        MODULE.copy_slot([np.zeros((2, 3, 4), dtype=np.int32)], 0, 1)
    with pytest.raises(ValueError, match="contiguous bytes"):
        MODULE.copy_slot([np.zeros((2, 3, 8), dtype=np.uint8)[:, :, ::2]], 0, 1)
    with pytest.raises(TypeError, match="a list of at most 8 views"):
        MODULE.copy_slot((one,), 0, 1)  # type: ignore[arg-type]


def test_a_pool_on_the_reference_path_has_no_byte_views(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "_NATIVE", None)
    pool = LinearStatePool(StateLayout(2, (3, 3), (2, 2, 2)), 4)
    assert pool._byte_rows is None
    a = pool.alloc(A)
    pool.recurrent[:, a].fill_(3.0)
    snap = pool.clone(a, T)
    assert bool((pool.recurrent[:, snap.slot] == 3.0).all())
