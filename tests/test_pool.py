from collections.abc import Callable

import pytest
import torch

from linear_state import (
    COMPLETE,
    LinearStatePool,
    NodeOwner,
    PoolExhausted,
    RequestOwner,
    SlotMisuse,
    StateLayout,
)
from linear_state.fingerprint import BLOCK, SlotHasher

A, B, N = RequestOwner("A"), RequestOwner("B"), NodeOwner(7)


@pytest.fixture
def pool() -> LinearStatePool:
    return LinearStatePool(StateLayout(3, (6, 3), (2, 4, 4)), 4)


def test_tensors_are_layer_major(pool: LinearStatePool) -> None:
    assert pool.conv.shape == (3, 4, 6, 3) and pool.conv.dtype == torch.bfloat16
    assert pool.recurrent.shape == (3, 4, 2, 4, 4) and pool.recurrent.dtype == torch.float32


def test_alloc_free_conserves(pool: LinearStatePool) -> None:
    slots = [pool.alloc(A), pool.alloc(B), pool.alloc(A)]
    assert len(set(slots)) == 3 and pool.num_free == 1
    assert pool.owner_of(slots[0]) == A and pool.slots_of(A) == {slots[0], slots[2]}
    assert pool.num_owned_by(RequestOwner) == 3
    pool.free(slots[1], B)
    assert pool.owner_of(slots[1]) is None and pool.num_free == 2
    pool.check_invariants()


def test_freeing_one_of_an_owners_slots_keeps_the_others_indexed(pool: LinearStatePool) -> None:
    slots = pool.alloc_many(A, 3)
    pool.free(slots[1], A)
    assert pool.slots_of(A) == {slots[0], slots[2]} and pool.num_owned_by(RequestOwner) == 2
    pool.check_invariants()
    pool.free(slots[0], A)
    pool.free(slots[2], A)
    assert not pool.slots_of(A) and pool.num_free == 4
    pool.check_invariants()


def test_exhaustion_is_typed_and_changes_nothing(pool: LinearStatePool) -> None:
    pool.alloc_many(A, 3)
    with pytest.raises(PoolExhausted) as exc:
        pool.alloc_many(B, 2)
    assert exc.value.capacity == 4 and exc.value.requested == 2 and exc.value.owner == B
    assert "4" in str(exc.value) and "'B'" in str(exc.value)
    assert pool.num_free == 1 and not pool.slots_of(B)
    assert not pool.can_alloc(2) and pool.can_alloc(1)
    pool.check_invariants()


def test_clone_when_full_raises_exhausted(pool: LinearStatePool) -> None:
    s = pool.alloc_many(A, 4)
    with pytest.raises(PoolExhausted):
        pool.clone(s[0], N)
    pool.check_invariants()


def _misuses(pool: LinearStatePool) -> list[tuple[str, Callable[[], object], int]]:
    a = pool.alloc(A)
    b = pool.alloc(B)
    snap = pool.clone(a, N).slot
    free_slot = next(s for s in range(pool.capacity) if pool.owner_of(s) is None)
    return [
        ("double free", lambda: pool.free(free_slot, A), free_slot),
        ("free by a non-owner", lambda: pool.free(b, A), b),
        ("frozen", lambda: pool.zero(snap), snap),
        ("frozen", lambda: pool.copy(a, snap), snap),
        ("frozen", lambda: pool.write(snap, *pool.read(a)), snap),
        ("frozen", lambda: pool.check_writable(snap, N), snap),
        ("read of a free slot", lambda: pool.copy(free_slot, a), free_slot),
        ("read of a free slot", lambda: pool.clone(free_slot, N), free_slot),
        ("write into a free slot", lambda: pool.copy(a, free_slot), free_slot),
        ("owned by someone else", lambda: pool.copy(snap, b, dst_owner=A), b),
        ("onto itself", lambda: pool.copy(a, a), a),
        ("transfer by a non-owner", lambda: pool.transfer(a, B, RequestOwner("C")), a),
        ("cannot change owner", lambda: pool.transfer(snap, N, RequestOwner("C")), snap),
    ]


@pytest.mark.parametrize("case", range(13))
def test_every_misuse_raises_typed_and_leaves_pool_intact(pool: LinearStatePool, case: int) -> None:
    message, action, slot = _misuses(pool)[case]
    owners_before = [pool.owner_of(s) for s in range(pool.capacity)]
    fps_before = [pool.fingerprint(s) for s in range(pool.capacity)]
    with pytest.raises(SlotMisuse, match=message) as exc:
        action()
    assert exc.value.slot == slot and f"slot {slot}" in str(exc.value)
    assert [pool.owner_of(s) for s in range(pool.capacity)] == owners_before
    assert [pool.fingerprint(s) for s in range(pool.capacity)] == fps_before
    pool.check_invariants()


def test_misuse_message_names_both_owners(pool: LinearStatePool) -> None:
    b = pool.alloc(B)
    with pytest.raises(SlotMisuse) as exc:
        pool.free(b, A)
    assert exc.value.owner == B and exc.value.actor == A
    assert "request 'B'" in str(exc.value) and "request 'A'" in str(exc.value)


@pytest.mark.parametrize("bad", [-1, 4])
def test_out_of_range_slot(pool: LinearStatePool, bad: int) -> None:
    with pytest.raises(IndexError, match="outside"):
        pool.owner_of(bad)


@pytest.mark.parametrize("bad", [1.5, 1.0, True, "1", None])
def test_a_slot_id_that_is_not_an_int_is_a_type_error(pool: LinearStatePool, bad: object) -> None:
    with pytest.raises(TypeError, match="a slot id is an int"):
        pool.owner_of(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a slot id is an int"):
        pool.free(bad, A)  # type: ignore[arg-type]
    pool.check_invariants()


def test_a_bad_fence_leaves_no_orphan_slot(pool: LinearStatePool) -> None:
    a = pool.alloc(A)
    free_before = pool.num_free
    for bad in (["not a fence"], [None], 5, "abc"):
        with pytest.raises(TypeError, match=r"(?i)fence"):
            pool.clone(a, NodeOwner(1), after=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"(?i)fence"):
            pool.zero(a, owner=A, after=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"(?i)fence"):
            pool.free(a, A, after=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single fence"):
        pool.clone(a, NodeOwner(1), after=COMPLETE)  # type: ignore[arg-type]
    assert pool.num_free == free_before and pool.owner_of(a) == A
    assert not pool.slots_of(NodeOwner(1)), "a clone left a slot owned by a node that never got it"
    pool.check_invariants()


def test_bad_owners_counts_and_streams_are_type_errors(pool: LinearStatePool) -> None:
    with pytest.raises(TypeError, match="RequestOwner or a NodeOwner"):
        pool.alloc("A")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int count"):
        pool.alloc_many(A, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int count"):
        pool.alloc_many(A, True)
    a = pool.alloc(A)
    with pytest.raises(TypeError, match="Stream"):
        pool.zero(a, owner=A, stream="cuda")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int"):
        LinearStatePool(pool.layout, 2.5)  # type: ignore[arg-type]
    pool.free(a, A)
    assert pool.num_free == pool.capacity
    pool.check_invariants()


def test_write_shape_mismatch_raises(pool: LinearStatePool) -> None:
    a = pool.alloc(A)
    with pytest.raises(ValueError, match="do not match"):
        pool.write(a, torch.zeros(3, 6, 2), torch.zeros(3, 2, 4, 4))


def test_clone_is_private_and_donor_keeps_slot(pool: LinearStatePool) -> None:
    a = pool.alloc(A)
    pool.write(a, torch.full((3, 6, 3), 2.0), torch.full((3, 2, 4, 4), 3.0), owner=A)
    snap = pool.clone(a, N).slot
    assert snap != a and pool.owner_of(a) == A and pool.owner_of(snap) == N and pool.is_frozen(snap)
    fp = pool.fingerprint(snap)
    pool.zero(a, owner=A)  # the donor keeps writing its own slot
    assert pool.fingerprint(snap) == fp
    assert torch.all(pool.read(snap)[1] == 3.0)


def test_restore_copy(pool: LinearStatePool) -> None:
    a = pool.alloc(A)
    pool.write(a, torch.full((3, 6, 3), 1.5), torch.full((3, 2, 4, 4), -2.0))
    snap = pool.clone(a, N).slot
    b = pool.alloc(B)
    pool.copy(snap, b, dst_owner=B)
    assert pool.fingerprint(b) == pool.fingerprint(snap) == pool.fingerprint(a)


def test_transfer_between_requests(pool: LinearStatePool) -> None:
    a = pool.alloc(A)
    pool.transfer(a, A, B)
    assert pool.owner_of(a) == B and not pool.slots_of(A)
    pool.check_invariants()


def test_fingerprint_detects_every_single_element_change() -> None:
    layout = StateLayout(2, (5, 3), (2, 3, 3), conv_dtype=torch.bfloat16, recurrent_dtype=torch.float32)
    pool = LinearStatePool(layout, 2)
    a = pool.alloc(A)
    gen = torch.Generator().manual_seed(0)
    pool.write(a, torch.randn(2, 5, 3, generator=gen), torch.randn(2, 2, 3, 3, generator=gen))
    base = pool.fingerprint(a)
    seen = {base}
    for tensor in (pool.conv, pool.recurrent):
        for layer in range(2):
            view = tensor[layer, a].view(-1)  # contiguous: writes land in the pool
            for i in range(view.numel()):
                old = view[i].item()
                view[i] = old + 1.0
                fp = pool.fingerprint(a)
                assert fp != base, f"change at layer {layer} element {i} of {tuple(tensor.shape)} not detected"
                seen.add(fp)
                view[i] = old
    assert pool.fingerprint(a) == base
    assert len(seen) == 1 + 2 * 5 * 3 + 2 * 2 * 3 * 3, "every distinct change gives a distinct fingerprint"


def test_fingerprint_tells_slots_and_layers_apart() -> None:
    pool = LinearStatePool(StateLayout(2, (4, 3), (2, 2, 2)), 3)
    s = pool.alloc_many(A, 3)
    pool.recurrent[0, s[1], 0, 0, 0] = 1.0
    pool.recurrent[1, s[2], 0, 0, 0] = 1.0  # same element, other layer
    fps = [pool.fingerprint(x) for x in s]
    assert len(set(fps)) == 3
    assert 0 <= fps[0] < 2**64


def test_fingerprint_odd_sized_rows() -> None:
    pool = LinearStatePool(StateLayout(1, (3,), (1,), conv_dtype=torch.bfloat16), 2)  # 6 bytes, 4 bytes
    a = pool.alloc(A)
    base = pool.fingerprint(a)
    pool.conv[0, a, 2] = 1.0
    assert pool.fingerprint(a) != base


def test_check_invariants_detects_corruption(pool: LinearStatePool) -> None:
    a = pool.alloc(A)
    pool._free.append(a)  # a slot both owned and free
    with pytest.raises(AssertionError, match="owned by"):
        pool.check_invariants()
    pool._free.pop()
    pool._owner[a] = None  # leaked: nobody owns it, not on the free list
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool._owner[a] = A
    pool._free.append(pool._free[0])  # duplicate on the free list
    with pytest.raises(AssertionError, match="duplicates"):
        pool.check_invariants()
    pool._free.pop()
    pool._owned_by[A].discard(a)  # owner index disagrees
    with pytest.raises(AssertionError):
        pool.check_invariants()


def _reference_fingerprint(pool: LinearStatePool, slot: int) -> int:
    """The documented formula in Python ints: sum over rows and blocks of M[row, b] * block sum."""
    m = pool._hasher._m.tolist()
    total, row = 0, 0
    for t in (pool.conv, pool.recurrent):
        for layer in range(t.shape[0]):
            raw = t[layer, slot].contiguous().view(torch.uint8).numpy().tobytes()
            width = 8 if len(raw) % 8 == 0 else 4 if len(raw) % 4 == 0 else 2 if len(raw) % 2 == 0 else 1
            words = [int.from_bytes(raw[i : i + width], "little", signed=True) for i in range(0, len(raw), width)]
            for b in range(0, len(words), BLOCK):
                total += m[row][b // BLOCK] * sum(words[b : b + BLOCK])
            row += 1
    return total % 2**64


@pytest.mark.parametrize(
    "layout",
    [
        StateLayout(3, (6, 3), (2, 4, 4)),  # small rows: one short block each
        StateLayout(2, (64 + 7, 3), (3, 8, 8)),  # rows of several blocks plus a tail
        StateLayout(2, (5, 3), (3,), conv_dtype=torch.bfloat16),  # odd-sized rows (30 and 12 bytes)
    ],
)
def test_fingerprint_matches_its_formula_and_device_combination(layout: StateLayout) -> None:
    pool = LinearStatePool(layout, 2)
    pool.conv.normal_(std=1e6)  # large words: products and sums wrap modulo 2**64
    pool.recurrent.normal_(std=1e6)
    sums = SlotHasher([pool.conv, pool.recurrent], kernel="numpy")  # keeps its partial sums
    for s in range(2):
        fp = pool.fingerprint(s)
        assert fp == _reference_fingerprint(pool, s)
        assert sums.fingerprint(s) == fp
        assert fp == sums._combine_torch()  # the CUDA combination of the same partial sums


def test_large_slot_fingerprint_detects_first_and_last_elements() -> None:
    layout = StateLayout.for_gdn(4, 4, 16, 128, 128)  # 4 MiB rows
    pool = LinearStatePool(layout, 2)
    s, other = pool.alloc_many(A, 2)
    pool.recurrent.normal_()
    fp = pool.fingerprint(s)
    assert fp != pool.fingerprint(other)
    pool.recurrent[3, s, 15, 127, 127] += 1.0  # the very last element of the last layer
    fp2 = pool.fingerprint(s)
    assert fp2 != fp
    pool.recurrent[0, s, 0, 0, 0] += 1.0  # the first element of the first layer
    assert pool.fingerprint(s) not in (fp, fp2)


def test_fingerprint_detects_swapped_blocks_and_layers() -> None:
    pool = LinearStatePool(StateLayout(2, (4, 3), (2, 16, 16)), 1)
    s = pool.alloc(A)
    pool.recurrent.normal_()
    base = pool.fingerprint(s)
    rec = pool.recurrent[:, s]
    rec[0, [0, 1]] = rec[0, [1, 0]].clone()  # two heads (2 blocks each) exchanged
    assert pool.fingerprint(s) != base
    rec[0, [0, 1]] = rec[0, [1, 0]].clone()
    assert pool.fingerprint(s) == base
    rec[[0, 1]] = rec[[1, 0]].clone()  # two layers exchanged
    assert pool.fingerprint(s) != base


@pytest.mark.parametrize(
    ("owner", "after", "message"),
    [
        ("A", (), "an owner is a RequestOwner or a NodeOwner"),
        (7, (), "an owner is a RequestOwner or a NodeOwner"),
        (A, (object(),), "not a Fence"),
        (A, COMPLETE, "wrap a single fence"),
        (B, (object(),), "not a Fence"),  # checked before the non-owner is named
    ],
)
def test_free_with_a_bad_owner_or_fence_is_a_type_error_and_changes_nothing(
    pool: LinearStatePool, owner: object, after: object, message: str
) -> None:
    s = pool.alloc(A)
    free_before = pool.num_free
    with pytest.raises(TypeError, match=message):
        pool.free(s, owner, after=after)  # type: ignore[arg-type]
    assert pool.owner_of(s) == A and pool.num_free == free_before
    pool.check_invariants()
    # and on a free slot: the bad argument is named, not the double free
    pool.free(s, A)
    with pytest.raises(TypeError, match=message):
        pool.free(s, owner, after=after)  # type: ignore[arg-type]
    pool.check_invariants()


def test_a_pool_keeps_its_slots_in_the_storage_it_is_given() -> None:
    layout = StateLayout(3, (6, 3), (2, 4, 4))
    conv = torch.zeros(3, 4, 6, 3, dtype=torch.bfloat16)
    rec = torch.zeros(3, 4, 2, 4, 4)
    pool = LinearStatePool(layout, 4, storage=(conv, rec))
    assert pool.conv.data_ptr() == conv.data_ptr() and pool.recurrent.data_ptr() == rec.data_ptr()
    s = pool.alloc(A)
    pool.write(s, torch.ones(3, 6, 3), torch.full((3, 2, 4, 4), 2.0), owner=A).wait()
    assert bool((conv[:, s] == 1).all()) and bool((rec[:, s] == 2).all())  # written where it was given
    c = pool.clone(s, B).slot
    assert torch.equal(rec[:, c], rec[:, s]) and pool.fingerprint(c) == pool.fingerprint(s)
    pool.check_invariants()


@pytest.mark.parametrize(
    ("conv", "rec", "message"),
    [
        (
            torch.zeros(3, 5, 6, 3, dtype=torch.bfloat16),
            torch.zeros(3, 4, 2, 4, 4),
            r"storage conv must be \[3, 4, 6, 3\]",
        ),
        (torch.zeros(3, 4, 6, 3), torch.zeros(3, 4, 2, 4, 4), "of torch.bfloat16 on cpu, got .* of torch.float32"),
        (
            torch.zeros(3, 4, 6, 3, dtype=torch.bfloat16),
            torch.zeros(3, 4, 2, 4, 8)[..., ::2],
            "each slot's rows must be contiguous",
        ),
    ],
    ids=["slots", "dtype", "strided"],
)
def test_storage_of_another_shape_dtype_or_layout_is_refused(
    conv: torch.Tensor, rec: torch.Tensor, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LinearStatePool(StateLayout(3, (6, 3), (2, 4, 4)), 4, storage=(conv, rec))


def test_storage_and_pinned_memory_are_one_or_the_other() -> None:
    layout = StateLayout(1, (2, 2), (2, 2))
    storage = (torch.zeros(1, 2, 2, 2, dtype=torch.bfloat16), torch.zeros(1, 2, 2, 2))
    with pytest.raises(ValueError, match="pass one of them"):
        LinearStatePool(layout, 2, pin_memory=True, storage=storage)
    with pytest.raises(TypeError, match="storage must be a"):
        LinearStatePool(layout, 2, storage=[storage[0], storage[1]])  # type: ignore[arg-type]


def test_read_into_given_tensors_copies_the_slot_and_refuses_a_pair_that_does_not_fit(pool: LinearStatePool) -> None:
    s = pool.alloc(A)
    conv = torch.randn(3, 6, 3).to(torch.bfloat16)
    rec = torch.randn(3, 2, 4, 4)
    pool.write(s, conv, rec, owner=A).wait()
    out = (torch.zeros(3, 6, 3, dtype=torch.bfloat16), torch.zeros(3, 2, 4, 4))
    got = pool.read(s, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0], conv) and torch.equal(out[1], rec)
    fresh = pool.read(s)
    assert torch.equal(fresh[0], conv) and fresh[0].data_ptr() != out[0].data_ptr()
    kept = torch.zeros(3, 6, 3, dtype=torch.bfloat16)  # a conv tensor that fits, beside one that does not
    bad: list[tuple[object, type[Exception], str]] = [
        ((kept,), TypeError, "pair"),
        ([kept, out[1]], TypeError, "pair"),
        ((kept, torch.zeros(3, 2, 4, 5)), ValueError, "recurrent"),
        ((kept, torch.zeros(2, 2, 4, 4)), ValueError, "recurrent"),
        ((kept, torch.zeros(3, 2, 4, 4, dtype=torch.float64)), ValueError, "recurrent"),
        ((kept.float(), out[1]), ValueError, "conv"),
        ((kept, torch.zeros(3, 2, 4, 4, device="meta")), TypeError, "CPU"),
    ]
    for arg, err, word in bad:
        with pytest.raises(err, match=word):
            pool.read(s, out=arg)  # type: ignore[arg-type]
    assert not kept.any(), "nothing copied when it raises"
    free = next(i for i in range(pool.capacity) if pool.owner_of(i) is None)
    with pytest.raises(SlotMisuse):
        pool.read(free, out=out)
    pool.check_invariants()


def test_read_refuses_tensors_in_the_pools_own_memory(pool: LinearStatePool) -> None:
    """``out`` must not be the pool's own rows: reading slot ``s`` into another slot's rows would
    write that slot (a node's frozen snapshot, say) without its owner."""
    s, t = pool.alloc(A), pool.alloc(B)
    pool.write(s, torch.ones(3, 6, 3), torch.ones(3, 2, 4, 4), owner=A).wait()
    before = pool.fingerprint(t)
    rows = (pool.conv[:, t], pool.recurrent[:, t])
    for arg, word in [
        (rows, "conv"),
        ((torch.zeros(3, 6, 3, dtype=torch.bfloat16), rows[1]), "recurrent"),
        ((pool.conv[:, s], pool.recurrent[:, s]), "conv"),  # a slot into itself: still the pool's memory
    ]:
        with pytest.raises(ValueError, match=f"out's {word} tensor lies in the pool's own memory"):
            pool.read(s, out=arg)
    assert pool.fingerprint(t) == before
    pool.check_invariants()
    # beside a pool's memory, not in it: tensors of the same buffer right after its rows are taken
    lay = pool.layout
    n_conv, n_rec = lay.num_layers * 2 * 6 * 3, lay.num_layers * 2 * 2 * 4 * 4
    conv_buf, rec_buf = torch.zeros(2 * n_conv, dtype=torch.bfloat16), torch.zeros(2 * n_rec)
    given = LinearStatePool(lay, 2, storage=(conv_buf[:n_conv].view(3, 2, 6, 3), rec_buf[:n_rec].view(3, 2, 2, 4, 4)))
    g = given.alloc(A)
    given.write(g, torch.ones(3, 6, 3), torch.ones(3, 2, 4, 4), owner=A).wait()
    after = (conv_buf[n_conv : n_conv + 3 * 6 * 3].view(3, 6, 3), rec_buf[n_rec : n_rec + 3 * 32].view(3, 2, 4, 4))
    got = given.read(g, out=after)
    assert got[0].eq(1).all() and got[1].eq(1).all()
    last = (conv_buf[n_conv - 1 : n_conv - 1 + 3 * 6 * 3].view(3, 6, 3), after[1])  # one element inside
    with pytest.raises(ValueError, match="own memory"):
        given.read(g, out=last)
    given.check_invariants()
