"""HostedStatePool: the one-owner rule over a host engine's own state tensors and allocator."""

import gc
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from linear_state import (
    SLOT_VIEWS_KEPT,
    DeferredStream,
    HostedStatePool,
    NodeOwner,
    PoolError,
    PoolExhausted,
    RequestOwner,
    SlotId,
    SlotMisuse,
    StateLayout,
)
from radixcache import HybridRadixCache, free_kv_to

LAYOUT = StateLayout(2, (3, 2), (2, 2))
S = 6  # slot 0 reserved, as an engine's dummy slot
A = RequestOwner("A")


class ListLender:
    """A host free list like an engine's: slots 1..S-1, handed out lowest first."""

    def __init__(self, n: int = S) -> None:
        self.free = list(range(1, n))
        self.given: list[int] = []

    def take(self, n: int) -> Sequence[int] | None:
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def give(self, slots: Sequence[int]) -> None:
        self.given.extend(slots)
        self.free.extend(slots)

    def available(self) -> int:
        return len(self.free)


def host_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    conv = torch.zeros((2, S, 3, 2), dtype=LAYOUT.conv_dtype)
    rec = torch.zeros((2, S, 2, 2), dtype=LAYOUT.recurrent_dtype)
    return conv, rec


def make(lender: ListLender | None = None, **kw: object) -> tuple[HostedStatePool, ListLender]:
    lender = lender or ListLender()
    conv, rec = host_tensors()
    return HostedStatePool(LAYOUT, conv, rec, lender, reserved=(0,), **kw), lender  # type: ignore[arg-type]


def test_pool_works_on_the_hosts_tensors_in_place() -> None:
    conv, rec = host_tensors()
    pool = HostedStatePool(LAYOUT, conv, rec, ListLender(), reserved=(0,))
    assert pool.conv is conv and pool.recurrent is rec and pool.capacity == S
    host_slot = pool.lender.take(1)[0]  # type: ignore[index]  # the host's slot for request A
    conv[:, host_slot].fill_(2.0)
    rec[:, host_slot].fill_(5.0)
    s = pool.lend(host_slot, A)
    snap = pool.clone(s, NodeOwner(1)).slot
    assert torch.equal(conv[:, snap], conv[:, host_slot]) and torch.equal(rec[:, snap], rec[:, host_slot])


def test_alloc_and_free_go_through_the_hosts_allocator() -> None:
    pool, lender = make()
    assert pool.num_free == S - 1
    a, b = pool.alloc(NodeOwner(1)), pool.alloc(NodeOwner(2))
    assert (a, b) == (1, 2) and lender.available() == S - 3 and pool.num_free == S - 3
    pool.free(a, NodeOwner(1))
    assert lender.given == [1] and pool.owner_of(a) is None and pool.num_free == S - 2
    pool.check_invariants()


def test_exhaustion_is_the_hosts_and_changes_nothing() -> None:
    pool, lender = make(ListLender(3))  # two usable slots
    pool.alloc_many(NodeOwner(1), 2)
    with pytest.raises(PoolExhausted):
        pool.alloc(NodeOwner(2))
    assert lender.given == [] and pool.num_owned_by(NodeOwner) == 2
    pool.check_invariants()


class BadLender(ListLender):
    def __init__(self, hand: list[int]) -> None:
        super().__init__()
        self.hand = hand

    def take(self, n: int) -> Sequence[int] | None:
        return list(self.hand)

    def give(self, slots: Sequence[int]) -> None:
        self.given.extend(slots)  # what it never handed out stays off its free list


@pytest.mark.parametrize(
    ("hand", "n", "err", "match"),
    [
        ([0], 1, SlotMisuse, "reserved or owned slot: slot 0"),
        ([S], 1, SlotMisuse, f"reserved or owned slot: slot {S}"),
        ([-1], 1, SlotMisuse, "reserved or owned slot: slot -1"),
        ([2, 3], 1, PoolError, r"\[2, 3\] when asked for 1"),
        ([4, 4], 2, PoolError, r"\[4, 4\]"),
        ([], 1, PoolError, "1 distinct"),
    ],
)
@pytest.mark.parametrize("one", [True, False], ids=["alloc", "alloc_many"])
def test_a_corrupt_host_allocator_is_refused_and_its_slots_given_back(
    hand: list[int], n: int, err: type, match: str, one: bool
) -> None:
    lender = BadLender(hand)
    conv, rec = host_tensors()
    pool = HostedStatePool(LAYOUT, conv, rec, lender, reserved=(0,))
    with pytest.raises(err, match=match):
        if one and n == 1:  # alloc's own path for one slot
            pool.alloc(NodeOwner(1))
        else:
            pool.alloc_many(NodeOwner(1), n)
    assert lender.given == hand and pool.num_owned_by(NodeOwner) == 0
    pool.check_invariants()


def test_alloc_of_one_slot_takes_a_numpy_index_as_its_int() -> None:
    class NumpyLender(ListLender):  # an engine's allocator answering with an array
        def take(self, n: int) -> Sequence[int] | None:
            got = super().take(n)
            return None if got is None else np.asarray(got, dtype=np.int64)  # type: ignore[return-value]

    pool, _ = make(NumpyLender())
    s = pool.alloc(NodeOwner(1))
    assert s == 1 and isinstance(s, SlotId) and s.pool_id == pool.pool_id and pool.owner_of(1) == NodeOwner(1)
    pool.check_invariants()


def test_an_owned_slot_handed_out_again_is_refused() -> None:
    pool, _ = make()
    pool.lend(1, A)
    lender = BadLender([1])
    pool.lender = lender
    with pytest.raises(SlotMisuse, match="slot 1 is owned by request 'A'"):
        pool.alloc(NodeOwner(9))
    assert pool.owner_of(1) == A and lender.given == [1]


def test_lend_and_reclaim_keep_one_owner() -> None:
    pool, lender = make()
    s = pool.lend(lender.take(1)[0], A)  # type: ignore[index]
    with pytest.raises(SlotMisuse, match="lend of a slot the pool sees owned"):
        pool.lend(s, RequestOwner("B"))
    with pytest.raises(SlotMisuse, match="lend of a reserved slot"):
        pool.lend(0, A)
    with pytest.raises(TypeError, match="RequestOwner"):
        pool.lend(3, NodeOwner(1))  # type: ignore[arg-type]
    with pytest.raises(SlotMisuse, match="reclaim by a non-owner"):
        pool.reclaim(s, RequestOwner("B"))
    pool.reclaim(s, RequestOwner(A.rid))  # an equal owner, not the lender's object: the same request
    assert pool.owner_of(s) is None and lender.given == []  # the host frees its own slot
    with pytest.raises(SlotMisuse, match="reclaim by a non-owner"):
        pool.reclaim(s, A)
    node = NodeOwner(7)
    snap = pool.alloc(node)
    with pytest.raises(SlotMisuse, match="reclaim by a non-owner"):
        pool.reclaim(snap, node)  # type: ignore[arg-type]  # its own owner object: still not lent
    assert pool.owner_of(snap) is node
    pool.free(snap, node)
    pool.check_invariants()


def test_reclaim_and_free_wait_the_pending_clone_first() -> None:
    stream = DeferredStream()
    pool, lender = make(stream=stream)
    h = lender.take(1)[0]  # type: ignore[index]
    pool.conv[:, h].fill_(7.0)
    s = pool.lend(h, A)
    w = pool.clone(s, NodeOwner(1))
    assert stream.pending == 1
    pool.reclaim(s, A)  # the host may overwrite slot 2 now: the clone must have read it
    assert stream.pending == 0 and bool((pool.conv[:, w.slot] == 7.0).all())
    s2 = pool.lend(h, A)
    pool.copy(w.slot, s2)
    assert stream.pending == 1
    pool.free(w.slot, NodeOwner(1), wait=False)  # the host's at once: waited even so
    assert stream.pending == 0 and lender.given == [w.slot]


def test_constructor_refuses_tensors_that_do_not_match_the_layout() -> None:
    conv, rec = host_tensors()
    wrong = r"conv must be \[2, 6, 3, 2\] of torch.bfloat16.*got \[2, 6, 3, 2\] of torch.float32"
    with pytest.raises(ValueError, match=wrong):
        HostedStatePool(LAYOUT, conv.float(), rec, ListLender())
    with pytest.raises(ValueError, match=r"recurrent must be \[2, 6, 2, 2\]"):
        HostedStatePool(LAYOUT, conv, rec[:, :5], ListLender())
    with pytest.raises(ValueError, match="reserved slot 6 outside"):
        HostedStatePool(LAYOUT, conv, rec, ListLender(), reserved=(6,))
    with pytest.raises(TypeError, match="callable take"):
        HostedStatePool(LAYOUT, conv, rec, object())  # type: ignore[arg-type]


def test_invariants_name_an_owned_reserved_slot_and_a_lying_lender() -> None:
    pool, _ = make()
    pool._owner[0] = A  # corrupt: the engine's dummy slot owned
    pool._owned_by[A] = {pool._ids[0]}
    with pytest.raises(AssertionError, match="reserved slot 0 is owned"):
        pool.check_invariants()
    pool, _ = make()
    pool.lend(1, A)  # the host still lists slot 1 as free: it would hand it out twice
    with pytest.raises(AssertionError, match=r"owned 1 \+ host-free 5 > capacity 6 - reserved 1"):
        pool.check_invariants()


def test_a_tree_on_a_hosted_pool_donates_restores_and_evicts_through_the_host() -> None:
    pool, lender = make()
    freed: list[int] = []
    tree = HybridRadixCache(pool, on_event=free_kv_to(lambda kv: freed.extend(kv.tolist())))
    h = lender.take(1)[0]  # type: ignore[index]
    pool.conv[:, h].fill_(3.0)
    donor = pool.lend(h, A)
    res = tree.insert([5, 6, 7], [10, 11, 12], state_slot=donor)
    snap = res.node.snapshot
    assert snap is not None and pool.owner_of(snap) == NodeOwner(res.node.id) and lender.available() == S - 3
    pool.reclaim(donor, A)
    B = RequestOwner("B")
    dst = pool.lend(h, B)  # the host reused its slot for the next request
    pool.zero(dst, owner=B)
    m = tree.match([5, 6, 7, 8])
    tree.restore(m.node, dst, dst_owner=B)
    assert bool((pool.conv[:, h] == 3.0).all())
    pool.reclaim(dst, B)
    tree.evict(snapshots=1)
    assert lender.given == [int(snap)] and freed == [10, 11, 12]
    tree.check_invariants()
    pool.check_invariants()


def test_only_lent_slots_are_reclaimed() -> None:
    """A slot alloc() took from the host's allocator goes back by free(), which tells the
    allocator; reclaimed, it would be lost to it, so reclaim refuses it and changes nothing."""
    pool, lender = make()
    s = pool.alloc(A)
    with pytest.raises(SlotMisuse, match="not lent"):
        pool.reclaim(s, A)
    assert pool.owner_of(s) == A
    pool.free(s, A)
    assert lender.free.count(int(s)) == 1  # back in the host's allocator, not lost
    taken = lender.take(1)
    assert taken is not None
    pool.reclaim(pool.lend(taken[0], A), A)
    pool.check_invariants()


def test_a_pool_of_any_size_is_built_without_per_slot_work_and_serves_its_last_slot() -> None:
    """Issue 33 item 4: SGLang sizes its state pool by memory (374,391 slots on a CI-like machine);
    the pool makes a slot's id and views at the slot's first use, so building it does nothing per
    slot (bench_pool.py times it), and a slot far out serves exactly like the first."""
    n = 1_000_000
    layout = StateLayout(1, (2, 2), (1, 2, 2))
    conv = torch.zeros((1, n, 2, 2), dtype=layout.conv_dtype)
    rec = torch.zeros((1, n, 1, 2, 2), dtype=layout.recurrent_dtype)
    lender = ListLender(n)
    lender.free = [n - 1, n - 2]  # the host hands out its last slots first
    pool = HostedStatePool(layout, conv, rec, lender, reserved=(0,))
    assert len(pool._ids) <= 1 and not pool._conv_rows and not pool._copy_rows  # nothing made per slot
    a = pool.alloc(A)
    assert a == n - 1
    c, r = torch.randn(1, 2, 2).to(layout.conv_dtype), torch.randn(1, 1, 2, 2)
    pool.write(a, c, r, owner=A).wait()
    assert torch.equal(conv[:, n - 1], c) and torch.equal(rec[:, n - 1], r)  # the host's own rows
    node = NodeOwner(1)
    b = pool.clone(a, node).slot
    assert b == n - 2 and torch.equal(conv[:, n - 2], c) and torch.equal(rec[:, n - 2], r)
    assert pool.fingerprint(a) == pool.fingerprint(b)
    pool.free(b, node)
    pool.free(a, A)
    pool.check_invariants()


def test_a_pool_keeps_records_of_the_slots_it_holds_not_of_every_slot_it_ever_used() -> None:
    """SGLang's allocator hands its slots out first in, first out, so over a server's life every
    slot of its pool passes through ours. A slot the host holds again leaves no record here (owner,
    last use, id), and row views are kept for at most SLOT_VIEWS_KEPT slots: three times that many
    requests, each restored into, cloned and reclaimed, grow neither the records nor the tracked
    objects in proportion (before: 4 objects, ~1.5 KB, per slot ever used), and copies stay exact
    after the views were dropped and made again."""
    rounds = 3 * SLOT_VIEWS_KEPT
    n = 2 * rounds + 4
    layout = StateLayout(1, (2, 2), (1, 2, 2))
    conv = torch.zeros((1, n, 2, 2), dtype=layout.conv_dtype)
    rec = torch.zeros((1, n, 1, 2, 2), dtype=layout.recurrent_dtype)
    lender = ListLender(n)
    pool = HostedStatePool(layout, conv, rec, lender, reserved=(0,))
    src = pool.alloc(A)
    c, r = torch.randn(1, 2, 2).to(layout.conv_dtype), torch.randn(1, 1, 2, 2)
    pool.write(src, c, r, owner=A).wait()
    snap_owner = NodeOwner(0)
    snap = pool.clone(src, snap_owner).slot  # the tree's snapshot, held throughout
    gc.collect()
    before = len(gc.get_objects())

    def engine_alloc() -> int:
        got = lender.take(1)
        assert got is not None
        return got[0]

    for i in range(rounds):
        host_slot = engine_alloc()  # the engine allocates a request's slot ...
        req, node = RequestOwner(i), NodeOwner(i + 1)
        s = pool.lend(host_slot, req)  # ... and lends it: a hit restored into it,
        pool.copy(snap, s, dst_owner=req)
        donated = pool.clone(s, node).slot  # its state donated (the clone evicted later),
        pool.free(donated, node)
        pool.reclaim(s, req)  # and the engine frees it when the request ends
        lender.give([host_slot])
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert grown < SLOT_VIEWS_KEPT * 3 + 1000, grown  # a tuple and two views per slot at most
    assert len(pool._copy_rows) <= SLOT_VIEWS_KEPT and len(pool._conv_rows) <= SLOT_VIEWS_KEPT
    assert len(pool._owner) == 2 and len(pool._last_use) <= 2 and len(pool._ids) <= 3  # src, snap (slot 0)
    last = RequestOwner("last")
    s = pool.lend(engine_alloc(), last)
    pool.copy(snap, s, dst_owner=last).wait()
    assert torch.equal(conv[:, s], c) and torch.equal(rec[:, s], r)
    assert pool.fingerprint(s) == pool.fingerprint(src)
    pool.reclaim(s, last)
    pool.free(snap, snap_owner)
    pool.free(src, A)
    pool.check_invariants()
    assert not pool._owner and len(pool._ids) <= 1


AMX_LAYOUT = StateLayout(2, (8, 3), (2, 2))  # 48 bytes of conv window per layer: copied as wide words


def amx_strided_conv() -> torch.Tensor:
    """Conv state tensors as SGLang's CPU engine lays them out for its AMX kernels
    (``_init_amx_conv_state``): each slot's window stored transposed, so ``conv[:, slot]`` is not a
    view that flattens."""
    conv = torch.zeros((2, S, 8, 3), dtype=AMX_LAYOUT.conv_dtype)
    return conv.as_strided_(conv.size(), (conv.stride(0), conv.stride(1), 1, conv.size(2)))


def test_clone_restore_and_host_copies_of_a_transposed_conv_layout_keep_every_value() -> None:
    conv = amx_strided_conv()
    rec = torch.zeros((2, S, 2, 2), dtype=LAYOUT.recurrent_dtype)
    pool = HostedStatePool(AMX_LAYOUT, conv, rec, ListLender(), reserved=(0,))
    h = pool.lender.take(1)[0]  # type: ignore[index]
    want_conv = torch.arange(48, dtype=conv.dtype).view(2, 8, 3) + 1
    conv[:, h] = want_conv
    rec[:, h] = 3.0
    s = pool.lend(h, A)
    snap = pool.clone(s, NodeOwner(1)).slot
    assert torch.equal(conv[:, snap], want_conv)  # a copy into a reshaped copy would leave zeros
    pool.reclaim(s, A)
    h2 = pool.lender.take(1)[0]  # type: ignore[index]
    s2 = pool.lend(h2, RequestOwner("B"))
    pool.copy(snap, s2)
    assert torch.equal(conv[:, h2], want_conv) and bool((rec[:, h2] == 3.0).all())
    # to a contiguous host-memory pool and back (demote, promote)
    from linear_state import LinearStatePool

    host = LinearStatePool(AMX_LAYOUT, 3)
    parked = host.clone_from(pool, snap, NodeOwner(2)).slot
    assert torch.equal(host.conv[:, parked], want_conv)
    conv[:, h2] = 0.0
    pool.copy_from(host, parked, s2)
    assert torch.equal(conv[:, h2], want_conv)


PADDED_LAYOUT = StateLayout(2, (2, 4), (2, 2))  # 16 bytes of conv window per layer and slot


def test_slots_of_a_padded_layout_copy_in_one_word_and_keep_every_value() -> None:
    # An engine whose slots are padded to 24 bytes: slot 0's rows start 16-byte aligned, slot 1's
    # 8 past it. Every slot must be copied in the same word (a copy between a 16-byte and an
    # 8-byte view of the same bytes would convert values, or fail on the shapes).
    assert PADDED_LAYOUT.conv_dtype.itemsize == 2
    base = torch.zeros((2, S, 12), dtype=PADDED_LAYOUT.conv_dtype)
    conv = base.as_strided((2, S, 2, 4), (S * 12, 12, 4, 1))  # each slot's first 16 bytes, as [2, 4]
    rec = torch.zeros((2, S, 2, 2), dtype=PADDED_LAYOUT.recurrent_dtype)
    pool = HostedStatePool(PADDED_LAYOUT, conv, rec, ListLender(), reserved=(0,))
    words = {pool._copy_rows[i][0].dtype for i in range(S)}  # the copy views themselves
    assert len(words) == 1, f"slots copied in different words: {words}"
    for k in range(2):  # an odd and an even slot: their rows start at other alignments
        h = pool.lender.take(1)[0]  # type: ignore[index]
        want = torch.arange(16, dtype=conv.dtype).view(2, 2, 4) + 20 * k
        conv[:, h] = want
        s = pool.lend(h, A)
        snap = pool.clone(s, NodeOwner(h)).slot
        assert torch.equal(conv[:, snap], want)
        pool.reclaim(s, A)
        h2 = pool.lender.take(1)[0]  # type: ignore[index]
        s2 = pool.lend(h2, RequestOwner("B"))
        pool.copy(snap, s2)
        assert torch.equal(conv[:, h2], want)
        pool.reclaim(s2, RequestOwner("B"))
        pool.free(snap, NodeOwner(h))
    assert base[:, :, 8:].eq(0).all(), "the padding between slots was written"
    pool.check_invariants()
