"""The slot pool: device tensors of linear state, and the one rule that every slot has one owner.

Slot lifecycle (see docs/linear_state.md for who may read and write in each state)::

    FREE --alloc(RequestOwner)--> request slot   (the request's forward passes write it)
    request slot --clone(after producer's fence)--> NEW slot owned by a NodeOwner (frozen)
    node slot --copy(after its fence)--> a request's slot          (restore on a hit)
    any slot --free(by its owner, after its last writer's fence)--> FREE

NOTE: ownership is checked on every pool operation; the pool cannot see raw writes a host's
kernels make into ``conv``/``recurrent``, so a host asserts them with :meth:`check_writable`
before its forward, and fingerprints catch whatever slips through.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from .device import check_device
from .errors import ForeignSlot, PoolError, PoolExhausted, PrecisionLoss, SlotMisuse
from .fingerprint import Fingerprint, SlotHasher
from .layout import StateLayout
from .native import MODULE as _NATIVE
from .owners import NodeOwner, Owner, RequestOwner, SlotId
from .stream import COMPLETE, Fence, ImmediateStream, Stream, ThreadStream

__all__ = [
    "PROBES_PER_ROW",
    "SLOT_VIEWS_KEPT",
    "FingerprintJob",
    "HostedStatePool",
    "LinearStatePool",
    "SlotLender",
    "SlotWrite",
]

_POOL_IDS = itertools.count(1)  # process-unique pool identities; 0 marks a slot id built by hand
PROBES_PER_ROW = 4
"""Probe elements per layer and state kind (:meth:`LinearStatePool.mark_unwritten`): spread over
the row so that a writer covering part of a layer's state (its conv window alone, the first heads
alone) leaves one behind."""
SLOT_VIEWS_KEPT = 4096
"""Slots whose row views a pool keeps, for each kind of view (about 1.3 KB a slot for the copy rows):
past it the views are dropped and made again at their next use (~1.3 us each), so a pool of
hundreds of thousands of slots that an engine hands out in turn holds a bounded number of them."""
_PROBE_COLS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _probe_cols(width: int, device: torch.device) -> torch.Tensor:
    """The probe columns of a row of ``width`` elements: first, last and evenly between."""
    key = (width, device)
    cols = _PROBE_COLS.get(key)
    if cols is None:
        n = min(PROBES_PER_ROW, width)
        picks = sorted({round(i * (width - 1) / max(n - 1, 1)) for i in range(n)})
        cols = _PROBE_COLS[key] = torch.tensor(picks, dtype=torch.int64, device=device)
    return cols


class SlotWrite(NamedTuple):
    """A slot that was just written and the fence after which its contents are valid."""

    slot: SlotId
    fence: Fence


class FingerprintJob:
    """A fingerprint submitted on a stream (:meth:`LinearStatePool.fingerprint_later`): of
    ``slot`` of ``pool``; ``fence`` completes when it was taken; :meth:`result` waits it and
    returns the value."""

    __slots__ = ("fence", "pool", "slot", "value")

    def __init__(self, pool: LinearStatePool, slot: SlotId, fence: Fence) -> None:
        self.pool, self.slot, self.fence = pool, slot, fence
        self.value: Fingerprint | None = None

    def result(self) -> Fingerprint:
        """The fingerprint, once its fence completed (waited here). :raises StreamFailed: the
        stream's work failed before it was taken."""
        self.fence.wait()
        assert self.value is not None
        return self.value


class LinearStatePool:
    """A fixed number of linear-state slots on one device, each FREE or owned by exactly one owner.

    Tensors are layer-major: ``conv`` is ``[L, S, *layout.conv_shape]`` and ``recurrent`` is
    ``[L, S, *layout.recurrent_shape]`` (``S`` = ``num_slots``), so a batched kernel of layer ``l``
    indexes ``conv[l, slot_ids]``.

    Every write the pool performs (``copy``, ``clone``, ``zero``, ``write``) is submitted on a
    :class:`~linear_state.Stream` (the call's ``stream``, else the pool's default) and ordered
    behind the ``after`` fences the caller passes; it returns the fence of that write. The pool
    remembers the fence of its own last write into each slot and orders later pool work on the
    slot behind it, so pool operations never race each other; ordering against a host's own kernels
    is the caller's: pass their fences.

    :param layout: what one slot holds.
    :param num_slots: capacity.
    :param device: where the tensors live.
    :param stream: default stream for pool work (an :class:`ImmediateStream` when omitted).
    :param pin_memory: a pool on the CPU in page-locked memory, so that :meth:`copy_from` a CUDA
        pool (and back) runs asynchronously on the copy's stream (a host tier).
    :param storage: ``(conv, recurrent)`` tensors to keep the slots in instead of allocating them
        (memory another process maps too, say): ``[L, num_slots, ...]`` of the layout's shapes
        and dtypes on ``device``, each slot's rows contiguous. Used as given (not zeroed: a
        fresh slot holds what the memory held, as any freshly allocated slot may).
    :raises ValueError: ``num_slots`` not positive; ``pin_memory`` for a pool not on the CPU or
        with ``storage``; ``storage`` of another shape, dtype or device, or not laid out so.
    :raises DeviceUnavailable: a device this process cannot allocate on (CUDA without CUDA).

    Slot ids the pool hands out are :class:`~linear_state.SlotId` ints carrying its ``pool_id``;
    every call given one from another pool raises :class:`~linear_state.ForeignSlot` and changes
    nothing.
    """

    def __init__(
        self,
        layout: StateLayout,
        num_slots: int,
        device: torch.device | str = "cpu",
        *,
        stream: Stream | None = None,
        pin_memory: bool = False,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(layout, StateLayout):
            raise TypeError(f"layout must be a StateLayout, got {type(layout).__name__}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)):
            raise TypeError(f"num_slots must be an int, got {num_slots!r}")
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        num_slots = int(num_slots)
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be a linear_state Stream, got {type(stream).__name__}")
        self.layout = layout
        self.device = check_device(device)
        self.stream: Stream = stream if stream is not None else ImmediateStream()
        self._immediate = isinstance(self.stream, ImmediateStream)
        self._lazy_free = True  # free(wait=False) defers the wait to the next alloc of the slot
        L = layout.num_layers
        if pin_memory and self.device.type != "cpu":
            raise ValueError(f"pin_memory is for a pool on the CPU, not on {self.device}")
        if storage is not None:
            if pin_memory:
                raise ValueError("pin_memory allocates the pool's memory; storage= gives it (pass one of them)")
            conv, recurrent = _given_storage(layout, num_slots, self.device, storage)
        else:
            conv = torch.zeros((L, num_slots, *layout.conv_shape), dtype=layout.conv_dtype, device=self.device)
            recurrent = torch.zeros(
                (L, num_slots, *layout.recurrent_shape), dtype=layout.recurrent_dtype, device=self.device
            )
            if pin_memory:
                conv, recurrent = conv.pin_memory(), recurrent.pin_memory()
        self._setup(conv, recurrent)
        # Popped from the end: the lowest ids are handed out first, which keeps demos readable.
        self._free: list[SlotId] = [self._ids[i] for i in range(num_slots - 1, -1, -1)]

    def _setup(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """The bookkeeping over ``conv`` and ``recurrent`` (``[L, S, ...]`` each): every slot
        unowned, every last use complete. The free list is the caller's."""
        num_slots = conv.shape[1]
        self.conv = conv
        self.recurrent = recurrent
        self.pool_id = next(_POOL_IDS)
        """Process-unique identity of this pool, carried by every slot id it hands out."""
        self._capacity = num_slots
        # Per-slot owners and last uses, stored for the slots that ever had one (a miss is the
        # default): building them costs the same at any size, like the ids and views below.
        self._owner: _Default[Owner | None] = _Default(None)
        # One id object per slot, made at its first use and kept: alloc hands it out without
        # building anything. Made lazily, like the views below, so that building a pool costs the
        # same at any size (SGLang sizes its state pool by memory: 374,391 slots took 17.5 s to
        # build when every slot's objects were made up front).
        # NOTE: made by a C call (int.__new__ of this pool's id class), not a Python function:
        # a fresh slot's id costs ~0.3 us instead of ~2 (SGLang scheduler benchmark).
        self._ids: _PerSlot[SlotId] = _PerSlot(functools.partial(int.__new__, type(SlotId(0, self.pool_id))))
        # The class of this pool's ids (one per pool): an id of it is in range by construction.
        self._id_type: type[SlotId] | None = type(self._ids[0]) if num_slots else None
        # NOTE: the maker itself for the hot paths (alloc and lend of a hosted pool): a hosted pool
        # forgets a slot's id when the host has the slot back, so nearly every lend and clone makes
        # one again, ~1 us through _PerSlot.__missing__ inside SGLang's scheduler (session 35)
        self._new_id = self._ids._make
        self._last_use: _Default[Fence] = _Default(COMPLETE)
        self._owned_by: dict[Owner, set[SlotId]] = {}
        self._hasher_made: SlotHasher | None = None  # made at the first fingerprint (see _hasher)
        self._thread_hashers: dict[ThreadStream, SlotHasher] = {}  # one per worker thread (scratch buffers)
        # Per-slot views ([L, ...] each), made once per slot: indexing a view per copy costs more
        # than the copy of a small slot. Hot path of clone/restore; see benchmarks/bench_tree.py.
        # NOTE: ``select`` makes a view in ~1.3 us against ~6.4 for ``t[:, i]`` (the indexing
        # machinery): a fresh slot's first copy is that much cheaper (SGLang scheduler benchmark).
        # Kept for at most SLOT_VIEWS_KEPT slots (~1.3 KB a slot): an engine that hands its slots out
        # in turn (SGLang's allocator is first in, first out) would otherwise have every slot's.
        kept = SLOT_VIEWS_KEPT
        self._conv_rows: _PerSlot[torch.Tensor] = _PerSlot(functools.partial(torch.select, conv, 1), kept)
        self._rec_rows: _PerSlot[torch.Tensor] = _PerSlot(functools.partial(torch.select, recurrent, 1), kept)
        # The same rows as the widest words their bytes allow, for copies: a slot's rows are strided
        # (one per layer), so a copy runs an element-wise kernel, and on a GPU 16-byte elements
        # move ~1.4x the bytes per second of 4-byte ones (benchmarks/gpu_check.py: 0.63x -> 0.87x
        # of a contiguous copy of the same bytes). Same speed on the CPU.
        # Widened once for the whole pool (views, O(1)): a slot's copy rows are then one index away
        # (per slot, the first copy of each of 1,062 fresh slots cost ~15 us in the SGLang scheduler
        # benchmark), and every slot has the same word, so a copy between two slots never converts.
        wide_conv, wide_rec = _widest_slots(conv), _widest_slots(recurrent)
        self._copy_rows: _PerSlot[tuple[torch.Tensor, torch.Tensor]] = _PerSlot(
            lambda i: (wide_conv.select(1, i), wide_rec.select(1, i)), kept
        )
        # A CPU pool's tensors as bytes, for the native copy of an immediate stream (None: another
        # device, a layout whose slot rows are not contiguous bytes, or no native build).
        self._byte_rows: list[np.ndarray] | None = None
        if _NATIVE is not None:
            conv_rows, rec_rows = _byte_rows(conv), _byte_rows(recurrent)
            if conv_rows is not None and rec_rows is not None:
                self._byte_rows = [conv_rows, rec_rows]

    @property
    def _hasher(self) -> SlotHasher:
        """The pool's slot hasher, made at its first use: its weights cost a tenth of a millisecond,
        which a pool that never fingerprints (forensics off) should not pay at start-up."""
        h = self._hasher_made
        if h is None:
            h = self._hasher_made = SlotHasher([self.conv, self.recurrent])
        return h

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """Total number of slots."""
        return self._capacity

    @property
    def num_free(self) -> int:
        """Slots owned by nobody. O(1)."""
        return len(self._free)

    def num_owned_by(self, kind: type[RequestOwner] | type[NodeOwner]) -> int:
        """Slots held by owners of one kind (requests or tree nodes). O(owners)."""
        return sum(len(s) for o, s in self._owned_by.items() if isinstance(o, kind))

    def slots_of(self, owner: Owner) -> frozenset[SlotId]:
        """The slots ``owner`` holds now."""
        return frozenset(self._owned_by.get(owner, ()))

    def owner_of(self, slot: int) -> Owner | None:
        """Current owner of ``slot``; ``None`` when FREE.

        :raises IndexError: ``slot`` outside ``[0, capacity)``.
        """
        return self._owner[self._index(slot)]

    def is_frozen(self, slot: int) -> bool:
        """Whether ``slot`` is a tree snapshot (owned by a :class:`NodeOwner`): never written again."""
        return isinstance(self.owner_of(slot), NodeOwner)

    def last_use(self, slot: int) -> Fence:
        """Fence of the pool's last operation reading or writing ``slot``.

        A host that writes ``slot`` with its own kernels orders them behind this fence (a clone
        may still be reading the slot it was donated from).
        """
        return self._last_use[self._index(slot)]

    # --------------------------------------------------------------- ownership
    def can_alloc(self, n: int = 1) -> bool:
        """Whether :meth:`alloc_many` of ``n`` slots would succeed now."""
        return n <= len(self._free)

    def alloc(self, owner: Owner) -> SlotId:
        """Take a FREE slot for ``owner``. O(1). Contents are whatever the last owner left.

        :raises PoolExhausted: no slot is free; nothing changed.
        :raises TypeError: ``owner`` is not a RequestOwner or NodeOwner; nothing changed.
        """
        _check_owner(owner)
        if not self._free:
            raise PoolExhausted(self.capacity, 1, owner)
        s = self._free[-1]
        if self._last_use.get(s, COMPLETE) is not COMPLETE:  # freed with wait=False: its work first
            self._settle_freed(s)
        self._free.pop()
        self._owner[s] = owner
        # NOTE: setdefault hashes the owner once (a Python-level dataclass hash); get-then-store twice.
        self._owned_by.setdefault(owner, set()).add(s)
        return s

    def alloc_many(self, owner: Owner, n: int) -> list[SlotId]:
        """Take ``n`` FREE slots for ``owner``, all or none. O(n).

        :raises PoolExhausted: fewer than ``n`` are free; nothing changed.
        :raises ValueError: ``n`` negative. :raises TypeError: ``n`` not an int, a bad owner.
        """
        _check_owner(owner)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"alloc_many takes an int count, got {n!r}")
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > len(self._free):
            raise PoolExhausted(self.capacity, n, owner)
        last = self._last_use
        for s in self._free[len(self._free) - n :]:
            if last.get(s, COMPLETE) is not COMPLETE:  # freed with wait=False: its work first
                self._settle_freed(s)
        slots = [self._free.pop() for _ in range(n)]
        held = self._owned_by.setdefault(owner, set())
        for s in slots:
            self._owner[s] = owner
            held.add(s)
        return slots

    def free(self, slot: int, owner: Owner, *, after: Iterable[Fence] = (), wait: bool = True) -> None:
        """Return ``slot`` to the pool. The host waits ``after`` (the last writer's fences) and the
        pool's own last use first, so the next owner never sees a late write land.

        ``wait=False``: the pool's own pending work on the slot (a clone on a
        :class:`~linear_state.ThreadStream` still reading it) is not waited now: the slot goes to
        the end of the free list that is handed out last, and the :meth:`alloc` that hands it out
        again waits that work first. The slot is free (counted in :attr:`num_free`) meanwhile. A
        pool whose free slots are the host's (:class:`HostedStatePool`) waits either way.

        :raises SlotMisuse: ``slot`` is already free (double free) or owned by someone else;
            nothing changed. :raises TypeError: a bad slot, owner, fence or ``wait``; nothing
            changed.
        """
        # NOTE: the common cases inline (an id of this pool, a tuple of fences): eviction frees a slot
        # per evicted snapshot in about ten Python calls, two of them here (benchmarks/bench_tree.py).
        s = slot if type(slot) is self._id_type else self._index(slot)
        if wait is not True and wait is not False:
            raise TypeError(f"wait must be a bool, got {wait!r}")
        current = self._owner[s]
        if current is not owner and (current is None or type(owner) is not type(current) or current != owner):
            _check_owner(owner)  # a bad owner is a TypeError first, as everywhere
            _fences(after)
            if current is None:
                raise SlotMisuse("double free", slot=s, owner=None, actor=owner)
            raise SlotMisuse("free by a non-owner", slot=s, owner=current, actor=owner)
        # ``owner`` is the current owner, or of its class and equal to it: a valid owner, so only
        # the fences need checking before anything changes (waiting one changes nothing).
        for fence in after if type(after) is tuple else _fences(after):
            if fence is not COMPLETE:
                if not isinstance(fence, Fence):
                    raise _not_a_fence(fence)
                fence.wait()
        last = self._last_use
        if last[s] is not COMPLETE:
            if wait or not self._lazy_free:
                last[s].wait()
                last[s] = COMPLETE
            else:
                self._release(s, current)
                self._free.insert(0, self._free.pop())  # handed out last: its work has time to run
                return
        self._release(s, current)

    def _settle_freed(self, s: int) -> None:
        """Wait the pending work of a slot freed with ``wait=False`` before it is handed out (the
        slot stays free if that work failed: the wait raises, nothing changed)."""
        self._last_use[s].wait()
        self._last_use[s] = COMPLETE

    def transfer(self, slot: int, owner: Owner, new_owner: RequestOwner) -> None:
        """Hand a request's slot to another request (for example a host re-queuing a request
        under a new id). Tree snapshots can never be transferred: they are cloned.

        :raises SlotMisuse: ``slot`` not owned by ``owner``, or owned by a tree node.
        :raises TypeError: ``new_owner`` is not a RequestOwner.
        """
        s = self._index(slot)
        if not isinstance(new_owner, RequestOwner):
            raise TypeError(f"a slot can be transferred to a RequestOwner only, got {new_owner!r}")
        current = self._owner[s]
        if current != owner or current is None:
            raise SlotMisuse("transfer by a non-owner", slot=s, owner=current, actor=owner)
        if isinstance(current, NodeOwner):
            raise SlotMisuse("a tree snapshot cannot change owner", slot=s, owner=current, actor=owner)
        self._release_owner_entry(s, current)
        self._owner[s] = new_owner
        self._owned_by.setdefault(new_owner, set()).add(self._ids[s])

    # ------------------------------------------------------------------ writes
    def check_writable(self, slot: int, owner: Owner | None = None) -> None:
        """Raise unless ``slot`` may be written now (by ``owner``, when given).

        Hosts call this for the slots of a batch before launching kernels that write them.

        :raises SlotMisuse: the slot is free, frozen (a tree snapshot), or owned by someone else.
        :raises TypeError: a bad slot or owner.
        """
        s = self._index(slot)
        if owner is not None:
            _check_owner(owner)
        current = self._owner[s]
        if current is None:
            raise SlotMisuse("write into a free slot", slot=s, owner=None, actor=owner)
        if isinstance(current, NodeOwner):
            raise SlotMisuse("write into a frozen tree snapshot", slot=s, owner=current, actor=owner)
        if owner is not None and current is not owner and current != owner:  # NOTE: `is` first: no dataclass __eq__
            raise SlotMisuse("write into a slot owned by someone else", slot=s, owner=current, actor=owner)

    def _check_readable(self, slot: int, actor: Owner | None) -> int:
        s = self._index(slot)
        if self._owner[s] is None:
            raise SlotMisuse("read of a free slot", slot=s, owner=None, actor=actor)
        return s

    def copy(
        self,
        src: int,
        dst: int,
        *,
        dst_owner: Owner | None = None,
        stream: Stream | None = None,
        after: Iterable[Fence] = (),
    ) -> Fence:
        """Copy the state of ``src`` into ``dst`` (for example a snapshot restored on a hit).

        Ordered behind ``after`` and the pool's pending writes into either slot. O(slot bytes).

        :param dst_owner: when given, ``dst`` must be owned by it (a restore into someone else's
            slot raises).
        :returns: the fence after which ``dst`` holds the copy.
        :raises SlotMisuse: ``src`` free, ``dst`` not writable (free, frozen, or not
            ``dst_owner``'s), or ``src == dst``; nothing was queued.
        """
        s = self._check_readable(src, dst_owner)
        self.check_writable(dst, dst_owner)
        d = self._index(dst)
        if s == d:
            raise SlotMisuse("copy of a slot onto itself", slot=s, owner=self._owner[s], actor=dst_owner)
        return self._submit_copy(s, d, _check_stream(stream), _fences(after), "copy")

    def copy_from(
        self,
        src_pool: LinearStatePool,
        src: int,
        dst: int,
        *,
        dst_owner: Owner | None = None,
        stream: Stream | None = None,
        after: Iterable[Fence] = (),
    ) -> Fence:
        """Copy slot ``src`` of another pool ``src_pool`` into ``dst`` of this one: a state moving
        between tiers (a device pool and a host pool of the same layout).

        Ordered behind ``after``, ``src_pool``'s pending writes into ``src`` and this pool's pending
        work on ``dst``; the returned fence becomes the last use of both slots, so neither pool
        frees, overwrites or hands out its slot before the copy is done. Asynchronous between a
        CUDA pool and a pinned CPU pool. O(slot bytes).

        :param dst_owner: when given, ``dst`` must be owned by it.
        :returns: the fence after which ``dst`` holds the copy.
        :raises ValueError: the layouts differ, or ``src_pool`` is this pool (use :meth:`copy`).
        :raises SlotMisuse: ``src`` free, or ``dst`` not writable; nothing was queued.
        :raises TypeError: ``src_pool`` is not a pool; a bad slot, owner, stream or fence.
        """
        s = self._check_source(src_pool, src, dst_owner)
        self.check_writable(dst, dst_owner)
        d = self._index(dst)
        return self._submit_copy_from(src_pool, s, d, _check_stream(stream), _fences(after))

    def clone_from(
        self,
        src_pool: LinearStatePool,
        src: int,
        owner: Owner,
        *,
        stream: Stream | None = None,
        after: Iterable[Fence] = (),
    ) -> SlotWrite:
        """Allocate a slot of this pool for ``owner`` and copy slot ``src`` of ``src_pool`` into
        it, behind ``after`` (a snapshot demoted to a host tier: the new slot may belong to a tree
        node, which :meth:`copy_from` would refuse to write). Ordered as :meth:`copy_from`.

        :returns: the new slot and the fence after which it holds the copy.
        :raises ValueError: the layouts differ, or ``src_pool`` is this pool (use :meth:`clone`).
        :raises SlotMisuse: ``src`` is free; :raises PoolExhausted: no slot is free. Nothing changed.
        :raises TypeError: a bad pool, slot, owner, stream or fence; nothing changed.
        """
        _check_owner(owner)
        s = self._check_source(src_pool, src, owner)
        after, stream = _fences(after), _check_stream(stream)
        d = self.alloc(owner)
        return SlotWrite(d, self._submit_copy_from(src_pool, s, d, stream, after))

    def _check_source(self, src_pool: LinearStatePool, src: int, actor: Owner | None) -> int:
        if not isinstance(src_pool, LinearStatePool):
            raise TypeError(f"src_pool must be a LinearStatePool, got {type(src_pool).__name__}")
        if src_pool is self:
            raise ValueError("the source pool is this pool itself; use copy() or clone()")
        if src_pool.layout != self.layout:
            raise ValueError(f"layouts differ: source {src_pool.layout}, destination {self.layout}")
        return src_pool._check_readable(src, actor)

    def _submit_copy_from(
        self, src_pool: LinearStatePool, s: int, d: int, stream: Stream | None, after: tuple[Fence, ...]
    ) -> Fence:
        fences = _behind(after, (src_pool._last_use[s], self._last_use[d]))
        outs, ins = self._copy_rows[d], src_pool._copy_rows[s]
        if any(o.dtype != i.dtype for o, i in zip(outs, ins, strict=True)):
            # the pools widened their rows differently: copy the native rows (a copy between two
            # word widths would convert values)
            outs, ins = (self._conv_rows[d], self._rec_rows[d]), (src_pool._conv_rows[s], src_pool._rec_rows[s])
        same_device = self.device == src_pool.device
        non_blocking = not same_device and any(t.is_pinned() for t in (*outs, *ins) if t.device.type == "cpu")

        def work() -> None:
            if same_device:
                torch._foreach_copy_(outs, ins)  # one dispatch for both, as a clone
            else:
                for out, inp in zip(outs, ins, strict=True):
                    out.copy_(inp, non_blocking=non_blocking)

        fence = (stream or self.stream).submit(work, after=fences, label=f"copy_from pool {src_pool.pool_id} {s}->{d}")
        self._last_use[d] = fence
        src_pool._last_use[s] = fence
        return fence

    def clone(self, src: int, owner: Owner, *, stream: Stream | None = None, after: Iterable[Fence] = ()) -> SlotWrite:
        """Allocate a new slot for ``owner`` and copy ``src`` into it, behind ``after``.

        This is copy-on-donate: the tree gets a private slot; the donor keeps ``src``. O(slot bytes).

        :returns: the new slot and the fence after which it holds the copy.
        :raises SlotMisuse: ``src`` is free; nothing changed.
        :raises PoolExhausted: no slot is free; nothing changed.
        :raises TypeError: a bad slot, owner, stream or fence; nothing changed.
        """
        _check_owner(owner)
        s = self._check_readable(src, owner)
        after = _fences(after)  # validated before the slot is taken: a bad fence leaves no orphan
        stream = _check_stream(stream)
        d = self.alloc(owner)
        return SlotWrite(d, self._submit_copy(s, d, stream, after, "clone"))

    def zero(
        self, slot: int, *, owner: Owner | None = None, stream: Stream | None = None, after: Iterable[Fence] = ()
    ) -> Fence:
        """Reset ``slot`` to the all-zero initial state (a fresh sequence).

        :raises SlotMisuse: the slot is not writable (see :meth:`check_writable`).
        :raises TypeError: a bad slot, owner, stream or fence. Nothing was queued.
        """
        self.check_writable(slot, owner)
        s = self._index(slot)
        after, stream = _fences(after), _check_stream(stream)

        def work() -> None:
            self._conv_rows[s].zero_()
            self._rec_rows[s].zero_()

        return self._submit(work, (s,), stream, after, label=f"zero {s}")

    def write(
        self,
        slot: int,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
        *,
        owner: Owner | None = None,
        stream: Stream | None = None,
        after: Iterable[Fence] = (),
    ) -> Fence:
        """Write a whole state (``conv`` ``[L, *conv_shape]``, ``recurrent`` ``[L, *recurrent_shape]``)
        into ``slot``: what a forward pass does, as one pool operation.

        A state of another dtype is converted to the slot's, except float64 and complex states,
        which the slot's dtype cannot hold (never narrowed silently).

        :raises SlotMisuse: the slot is not writable.
        :raises ValueError: a shape does not match the layout.
        :raises PrecisionLoss: a float64 state into a narrower slot, or a complex one into a
            real slot.
        :raises TypeError: not tensors, a bad slot, owner, stream or fence. Nothing was queued.
        """
        self.check_writable(slot, owner)
        s = self._index(slot)
        if not isinstance(conv, torch.Tensor) or not isinstance(recurrent, torch.Tensor):
            raise TypeError(f"write takes tensors, got {type(conv).__name__} and {type(recurrent).__name__}")
        after, stream = _fences(after), _check_stream(stream)
        want_c, want_r = self.layout.state_shapes
        if tuple(conv.shape) != want_c or tuple(recurrent.shape) != want_r:
            raise ValueError(
                f"state shapes {tuple(conv.shape)}, {tuple(recurrent.shape)} "
                f"do not match the layout's {want_c}, {want_r}"
            )
        for what, t, dtype in (
            ("conv", conv, self.layout.conv_dtype),
            ("recurrent", recurrent, self.layout.recurrent_dtype),
        ):
            # float64 and complex states are refused: no slot dtype of a layout holds them. A
            # float32 state into a bf16 or fp16 slot is the storage the layout declares.
            if t.dtype != dtype and (t.dtype.is_complex or t.dtype == torch.float64) and not dtype.is_complex:
                raise PrecisionLoss(
                    f"the {what} state is {t.dtype}; slot {s} keeps {dtype}, which cannot hold it exactly"
                )

        def work() -> None:
            self._conv_rows[s].copy_(conv)
            self._rec_rows[s].copy_(recurrent)

        return self._submit(work, (s,), stream, after, label=f"write {s}")

    # ------------------------------------------------------------------- reads
    def read(
        self, slot: int, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of ``slot``'s conv and recurrent state, after the pool's own pending work on
        it (writes by a host's kernels are seen only once their fences were waited).

        :param out: host tensors to copy into and return instead of new ones: the conv and the
            recurrent state's shapes (``[num_layers, *shape]``) and the layout's dtypes. A reused
            pair saves the fresh pages' first touch: 6 against 18 ms for a 77 MB state on a
            2-core machine.
        :raises SlotMisuse: the slot is free.
        :raises TypeError: ``out`` not a pair of CPU tensors. :raises ValueError: ``out`` of
            another shape or dtype, or in the pool's own memory (views of :attr:`conv` or
            :attr:`recurrent`: the copy would write slots without their owner). Nothing was copied
            when it raises.
        """
        s = self._check_readable(slot, None)
        if out is not None:
            self._check_read_out(out)
        self._last_use[s].wait()
        if out is None:
            # On the CPU a clone; from a device, one copy to host memory (a clone would stay there).
            return self._conv_rows[s].to("cpu", copy=True), self._rec_rows[s].to("cpu", copy=True)
        out[0].copy_(self._conv_rows[s])
        out[1].copy_(self._rec_rows[s])
        return out

    def _check_read_out(self, out: object) -> None:
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in out)
        ):
            raise TypeError(f"out must be a pair of CPU tensors (conv, recurrent), got {out!r:.200}")
        lay = self.layout
        for what, t, shape, dtype in zip(
            ("conv", "recurrent"), out, lay.state_shapes, (lay.conv_dtype, lay.recurrent_dtype), strict=True
        ):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"out's {what} tensor is {tuple(t.shape)} {t.dtype}; the slot's {what} state is {shape} {dtype}"
                )
            if self.device.type == "cpu" and any(_overlaps(t, mine) for mine in (self.conv, self.recurrent)):
                raise ValueError(
                    f"out's {what} tensor lies in the pool's own memory (pool {self.pool_id}): reading into it "
                    "would write slots without their owner"
                )

    def _probe_rows(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the probe elements' rows: each layer's conv and recurrent state, flattened."""
        return self._conv_rows[s].flatten(1), self._rec_rows[s].flatten(1)

    def mark_unwritten(
        self, slot: int, *, owner: Owner | None = None, stream: Stream | None = None, after: Iterable[Fence] = ()
    ) -> Fence:
        """Write NaN into ``slot``'s probe elements (:data:`PROBES_PER_ROW` evenly spread elements
        of each layer's conv and recurrent row), behind ``after``: a writer that then covers the
        whole state leaves no mark (:meth:`unwritten`). Integer states are not marked. O(layers).

        :raises SlotMisuse: the slot is not writable (see :meth:`check_writable`).
        :raises TypeError: a bad slot, owner, stream or fence. Nothing was queued.
        """
        self.check_writable(slot, owner)
        s = self._index(slot)
        after, stream = _fences(after), _check_stream(stream)
        rows = [(r, _probe_cols(r.shape[1], r.device)) for r in self._probe_rows(s) if r.dtype.is_floating_point]

        def work() -> None:
            for row, cols in rows:
                row.index_fill_(1, cols, float("nan"))

        return self._submit(work, (s,), stream, after, label=f"mark {s}")

    def unwritten(self, slot: int) -> bool:
        """Whether a probe element of ``slot`` still holds the NaN of :meth:`mark_unwritten`: some
        layer's state was not written since. The pool's own pending work on the slot is waited
        first; a host's kernels are seen only once their fences were waited. One small host
        transfer. :raises IndexError: ``slot`` out of range.
        """
        s = self._index(slot)
        self._last_use[s].wait()
        for row in self._probe_rows(s):
            if row.dtype.is_floating_point and bool(
                row.index_select(1, _probe_cols(row.shape[1], row.device)).isnan().any()
            ):
                return True
        return False

    def probe(self, slot: int) -> torch.Tensor:
        """``slot``'s probe elements (see :meth:`mark_unwritten`) as one float64 host tensor: equal
        probes of two slots say little, different ones prove the states differ. The pool's own
        pending work on the slot is waited first. :raises IndexError: ``slot`` out of range.
        """
        s = self._index(slot)
        self._last_use[s].wait()
        parts = [r.index_select(1, _probe_cols(r.shape[1], r.device)).reshape(-1) for r in self._probe_rows(s)]
        return torch.cat([p.to("cpu", torch.float64) for p in parts])

    def warm_fingerprint(self) -> tuple[int, ...]:
        """Make the pool's hasher now and build what its first fingerprint would otherwise build
        in a hot path (on CUDA with Triton, the fused kernel's variants:
        :meth:`~linear_state.fingerprint.SlotHasher.warm_up`); call it at start-up, before any
        writer runs. Returns the slots read (bytes only: no owner, no state changes; none on the
        CPU, nor for a pool of no slots). O(a few slots' bytes)."""
        if not self.capacity:
            return ()
        return self._hasher.warm_up()

    def fingerprint(self, slot: int) -> Fingerprint:
        """64-bit fingerprint of ``slot``'s contents as they are now.

        Exact for any single changed element, collision probability <= 2**-32 otherwise; one pass
        over the slot on its device and one 8-byte host transfer (see :mod:`linear_state.fingerprint`).
        The pool's own pending work on the slot is waited first; a host's kernels are seen only
        once their fences were waited.

        :raises IndexError: ``slot`` out of range.
        """
        s = self._index(slot)
        self._last_use[s].wait()
        return self._hasher.fingerprint(s)

    def fingerprint_later(
        self, slot: int, *, stream: Stream | None = None, after: Iterable[Fence] = ()
    ) -> FingerprintJob:
        """Submit :meth:`fingerprint` of ``slot`` on ``stream`` (default: the pool's) behind the
        pool's own work on the slot and ``after``: on a :class:`~linear_state.ThreadStream`, a
        donation's fingerprint is taken off the calling thread, as its clone is. The same value
        as :meth:`fingerprint` of the slot at that point of the stream. Becomes the slot's last
        use (it reads the slot: a free waits it).

        :raises IndexError: ``slot`` out of range. :raises TypeError: a bad stream or fence.
            Nothing was queued.
        """
        s = self._index(slot)
        after, stream = _fences(after), _check_stream(stream)
        on = stream or self.stream
        if isinstance(on, ThreadStream):  # a hasher's scratch buffers are its thread's alone
            hasher = self._thread_hashers.get(on)
            if hasher is None:
                hasher = self._thread_hashers[on] = SlotHasher([self.conv, self.recurrent])
        else:  # the work runs on a thread that waits it or submits it: the pool's own hasher
            hasher = self._hasher
        job = FingerprintJob(self, self._ids[s], COMPLETE)

        def work() -> None:
            job.value = hasher.fingerprint(s)

        job.fence = self._submit(work, (s,), stream, after, label=f"fingerprint {s}")
        return job

    # -------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Verify ownership bookkeeping; raise ``AssertionError`` naming the first broken rule.

        free + owned == capacity; no slot both free and owned; the owner index agrees with the
        per-slot owners. O(capacity).
        """
        n = self.capacity
        free = self._free
        free_set = set(free)
        assert len(free_set) == len(free), f"free list has duplicates: {sorted(free)}"
        for f in free:
            assert 0 <= f < n, f"free list holds slot {f} outside [0, {n})"
            assert self._owner[f] is None, f"slot {f} is on the free list but owned by {self._owner[f]}"
        owned = self._check_owner_index()
        # free and owned are disjoint (above), so a slot with no owner off the free list breaks this
        assert len(free) + owned == n, f"free {len(free)} + owned {owned} != capacity {n} (leaked slots)"

    def _check_owner_index(self) -> int:
        """The owner index agrees with the per-slot owners; returns how many slots are owned."""
        owned = 0
        for s, owner in self._owner.items():
            if owner is not None:
                owned += 1
                assert s in self._owned_by.get(owner, ()), f"slot {s} owned by {owner} is missing from its index"
        indexed = sum(len(v) for v in self._owned_by.values())
        assert indexed == owned, f"owner index holds {indexed} slots, per-slot owners say {owned}"
        assert all(self._owned_by.values()), "owner index keeps an empty entry"
        return owned

    # ----------------------------------------------------------------- helpers
    def _index(self, slot: int) -> int:
        if type(slot) is self._id_type:  # one of ours: the common case, one type check
            return slot
        if isinstance(slot, SlotId):
            made_by = slot.pool_id
            if made_by == self.pool_id:
                return slot  # in range by construction
            if made_by:
                raise ForeignSlot(int(slot), slot_pool=made_by, pool=self.pool_id)
        elif type(slot) is not int:
            if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
                raise TypeError(f"a slot id is an int, got {slot!r} ({type(slot).__name__})")
            slot = int(slot)
        if not 0 <= slot < self._capacity:
            raise IndexError(f"slot {slot} outside [0, {self._capacity})")
        return slot

    def _release(self, s: int, owner: Owner) -> None:
        self._release_owner_entry(s, owner)
        self._owner[s] = None
        self._free.append(self._ids[s])

    def _release_owner_entry(self, s: int, owner: Owner) -> None:
        # NOTE: pop, then put back only if the owner holds more: an owner's hash is a Python call
        # (a dataclass), and a tree node, which frees most often, holds one slot (one hash, not two).
        held = self._owned_by.pop(owner)
        held.discard(self._ids[s])
        if held:
            self._owned_by[owner] = held

    def _submit_copy(self, s: int, d: int, stream: Stream | None, after: tuple[Fence, ...], kind: str) -> Fence:
        last = self._last_use
        if (
            stream is None
            and self._immediate
            # a restore waits its snapshot's (done) clone. NOTE: count, not a generator (fences
            # compare by identity): ~0.5 us of every clone and restore in SGLang's scheduler (session 36)
            and after.count(COMPLETE) == len(after)
            and last.get(s, COMPLETE) is COMPLETE  # NOTE: get: a miss without __missing__'s frame
            and last.get(d, COMPLETE) is COMPLETE
        ):
            # NOTE: shortcut, same semantics: an immediate stream with nothing to wait runs the copy
            # now. Worth ~1 us per clone on the tree's insert path (benchmarks/bench_tree.py).
            if self._byte_rows is not None and _NATIVE is not None:
                # A CPU pool: one memmove per layer in byte views made once (linear_state/_native.c).
                # NOTE: inside SGLang's scheduler, fresh slots' two views and the copy's dispatch cost
                # ~10 us per copy: its allocator hands out every slot in turn.
                _NATIVE.copy_slot(self._byte_rows, s, d)
            else:
                torch._foreach_copy_(self._copy_rows[d], self._copy_rows[s])
            return COMPLETE
        src, dst = self._copy_rows[s], self._copy_rows[d]

        def work() -> None:
            torch._foreach_copy_(dst, src)  # one dispatch for both

        return self._submit(work, (s, d), stream, after, label=f"{kind} {s}->{d}")

    def _submit(
        self, work: Callable[[], None], slots: Sequence[int], stream: Stream | None, after: Iterable[Fence], label: str
    ) -> Fence:
        fences = _behind(after, [self._last_use[s] for s in slots])
        fence = (stream or self.stream).submit(work, after=fences, label=label)
        for s in slots:
            self._last_use[s] = fence
        return fence


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two CPU tensors (first to last element, strides included)
    overlap. Torch strides are never negative, so a tensor's span starts at its first element."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _given_storage(
    layout: StateLayout, num_slots: int, device: torch.device, storage: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """``storage`` checked as a pool's ``(conv, recurrent)``: the layout's shapes and dtypes for
    ``num_slots`` slots on ``device``, each slot's row of a layer contiguous."""
    if not isinstance(storage, tuple) or len(storage) != 2 or not all(isinstance(t, torch.Tensor) for t in storage):
        raise TypeError(f"storage must be a (conv, recurrent) pair of tensors, got {type(storage).__name__}")
    for name, t in _check_state_tensors(layout, storage[0], storage[1], num_slots, device=device):
        if not t[0, 0].is_contiguous():
            raise ValueError(f"storage {name}: each slot's rows must be contiguous, got strides {t.stride()}")
    return storage[0], storage[1]


def _check_state_tensors(
    layout: StateLayout, conv: torch.Tensor, recurrent: torch.Tensor, num_slots: int, *, device: torch.device | None
) -> tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor]]:
    """``conv`` and ``recurrent`` checked as ``[L, num_slots, ...]`` of the layout's shapes and
    dtypes (and on ``device`` if one is given: a pool's ``storage=``, whose messages say so);
    returns them named, for the caller's own checks.

    :raises ValueError: a shape, dtype or device other than the layout's."""
    L = layout.num_layers
    named = (("conv", conv), ("recurrent", recurrent))
    for (name, t), shape, dtype in zip(
        named,
        ((L, num_slots, *layout.conv_shape), (L, num_slots, *layout.recurrent_shape)),
        (layout.conv_dtype, layout.recurrent_dtype),
        strict=True,
    ):
        if tuple(t.shape) == shape and t.dtype == dtype and (device is None or t.device == device):
            continue
        if device is None:
            raise ValueError(f"{name} must be {list(shape)} of {dtype} for {layout}, got {list(t.shape)} of {t.dtype}")
        raise ValueError(
            f"storage {name} must be {list(shape)} of {dtype} on {device}, "
            f"got {list(t.shape)} of {t.dtype} on {t.device}"
        )
    return named


class SlotLender(Protocol):
    """A host's slot allocator, lent to a :class:`HostedStatePool` (for example an engine's own
    free list of state slots, so that the engine's accounting stays true)."""

    def take(self, n: int) -> Sequence[int] | None:
        """``n`` free slot indices of the host's tensors, all or none (``None``)."""
        ...

    def give(self, slots: Sequence[int]) -> None:
        """Take back slots that :meth:`take` handed out."""
        ...

    def available(self) -> int:
        """How many slots :meth:`take` can hand out now."""
        ...


class HostedStatePool(LinearStatePool):
    """A pool over a host engine's own state tensors, whose free slots stay the host's.

    The engine keeps its tensors (layer-major ``[L, S, ...]``, as its kernels index them) and its
    allocator; the pool keeps the one-owner rule for the slots it sees. A slot is in one of three
    states: *held by the host* (free in the host's allocator, or used by the host for something the
    pool never sees), *owned* by a :class:`RequestOwner` or :class:`NodeOwner` here, never both.

    - :meth:`alloc` takes slots from the host's allocator (``lender.take``); :meth:`free` hands them
      back (``lender.give``) once every pending write into them completed. So a tree snapshot costs
      the host one slot of its own accounting, as it must.
    - :meth:`lend` brings a slot the host allocated for a request under the pool's rules (the
      request's owner may donate from it, restores write into it); :meth:`reclaim` returns it to
      the host, which frees it in its own allocator as before.

    ``num_free`` is the lender's ``available()``; ``capacity`` is ``S``. ``reserved`` slot indices
    (an engine's dummy slot 0) are never taken or lent. Everything else is
    :class:`LinearStatePool`'s: copies, clones, fences, fingerprints.

    :param layout: what one slot holds; ``conv`` is ``[L, S, *layout.conv_shape]`` of
        ``layout.conv_dtype`` and ``recurrent`` is ``[L, S, *layout.recurrent_shape]`` of
        ``layout.recurrent_dtype``, on one device.
    :raises ValueError: tensors of another shape, dtype or device; a reserved index outside
        ``[0, S)``. :raises TypeError: a lender without ``take``/``give``/``available``.
    """

    def __init__(
        self,
        layout: StateLayout,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
        lender: SlotLender,
        *,
        reserved: Iterable[int] = (),
        stream: Stream | None = None,
    ) -> None:
        if not isinstance(layout, StateLayout):
            raise TypeError(f"layout must be a StateLayout, got {type(layout).__name__}")
        for name in ("take", "give", "available"):
            if not callable(getattr(lender, name, None)):
                raise TypeError(f"lender must have a callable {name}(), got {type(lender).__name__}")
        if not isinstance(conv, torch.Tensor) or not isinstance(recurrent, torch.Tensor):
            raise TypeError("conv and recurrent must be tensors")
        if conv.dim() < 2 or recurrent.dim() < 2:
            raise ValueError(f"state tensors must be [L, S, ...], got {tuple(conv.shape)} and {tuple(recurrent.shape)}")
        S = conv.shape[1]
        _check_state_tensors(layout, conv, recurrent, S, device=None)
        if conv.device != recurrent.device:
            raise ValueError(f"conv on {conv.device} and recurrent on {recurrent.device}: one device")
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be a linear_state Stream, got {type(stream).__name__}")
        res = set()
        for r in reserved:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < S:
                raise ValueError(f"reserved slot {r!r} outside [0, {S})")
            res.add(int(r))
        self.layout = layout
        self.device = conv.device
        self.stream = stream if stream is not None else ImmediateStream()
        self._immediate = isinstance(self.stream, ImmediateStream)
        self._lazy_free = False  # a freed slot is the host's at once: free waits its last use
        self.lender = lender
        self.reserved = frozenset(res)
        self._setup(conv, recurrent)
        self._free = []  # never used: the host's allocator holds the free slots
        self._lent: set[int] = set()  # slots lend() brought in: only these go back by reclaim()

    @property
    def num_free(self) -> int:
        """Slots the host's allocator can hand out now (``lender.available()``)."""
        return int(self.lender.available())

    def can_alloc(self, n: int = 1) -> bool:
        """Whether :meth:`alloc_many` of ``n`` slots would succeed now, as far as the lender says."""
        return n <= self.num_free

    def alloc(self, owner: Owner) -> SlotId:
        """Take one slot from the host's allocator for ``owner``.

        :raises PoolExhausted: the host has none; nothing changed. :raises SlotMisuse: the host
            handed out a reserved slot or one the pool sees owned (its allocator is corrupt); the
            slots were given back. :raises TypeError: a bad owner.
        """
        _check_owner(owner)
        got = self.lender.take(1)
        if got is None:
            raise PoolExhausted(self.capacity, 1, owner)
        # NOTE: the common case (one plain int the pool sees free) without alloc_many's lists: a
        # tree clone's slot costs ~3 us less (SGLang scheduler benchmark). Anything else is
        # checked, given back and refused by _adopt.
        if len(got) == 1:
            x = got[0]
            # NOTE: get, not [], for the slot's owner and id: a slot the host hands over has no
            # records here (they go when it goes back), and each miss through the dicts'
            # __missing__ is a Python frame, ~1 us inside SGLang's scheduler (session 35)
            if type(x) is int and 0 <= x < self._capacity and x not in self.reserved and self._owner.get(x) is None:
                s = self._ids.get(x)
                if s is None:
                    s = self._ids[x] = self._new_id(x)
                self._owner[s] = owner
                self._owned_by.setdefault(owner, set()).add(s)
                return s
        return self._adopt(owner, got, 1)[0]

    def alloc_many(self, owner: Owner, n: int) -> list[SlotId]:
        """Take ``n`` slots from the host's allocator for ``owner``, all or none. As :meth:`alloc`.

        :raises ValueError: ``n`` negative. :raises TypeError: ``n`` not an int.
        """
        _check_owner(owner)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"alloc_many takes an int count, got {n!r}")
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n == 0:
            return []
        got = self.lender.take(int(n))
        if got is None:
            raise PoolExhausted(self.capacity, int(n), owner)
        return self._adopt(owner, got, int(n))

    def _adopt(self, owner: Owner, got: Sequence[int], n: int) -> list[SlotId]:
        """The ``n`` slots the lender handed out, owned by ``owner`` now; a wrong answer (a
        reserved, owned, out-of-range or repeated slot, or not ``n`` of them) is given back
        and refused."""
        raw = [int(x) for x in got]
        bad = [x for x in raw if not 0 <= x < self._capacity or x in self.reserved or self._owner[x] is not None]
        if len(raw) != n or bad or len(set(raw)) != n:
            self.lender.give(raw)
            if bad:
                x = bad[0]
                cur = self._owner[x] if 0 <= x < self._capacity else None
                why = "the host's allocator handed out a reserved or owned slot"
                raise SlotMisuse(why, slot=x, owner=cur, actor=owner)
            raise PoolError(f"the host's allocator handed out {raw} when asked for {n} distinct slots; given back")
        slots = [self._ids[x] for x in raw]
        held = self._owned_by.setdefault(owner, set())
        for s in slots:
            self._owner[s] = owner
            held.add(s)
        return slots

    def lend(self, slot: int, owner: RequestOwner) -> SlotId:
        """Bring a slot the host holds (allocated by the host for a request) under the pool's rules,
        owned by ``owner``. The host must not free it in its allocator before :meth:`reclaim`.

        :returns: the pool's id of the slot.
        :raises SlotMisuse: the slot is reserved or already owned here. :raises TypeError: a bad
            owner (only a request lends). :raises IndexError: out of range. Nothing changed.
        """
        if not isinstance(owner, RequestOwner):
            raise TypeError(f"a host lends a slot to a RequestOwner, got {owner!r}")
        s = self._index(slot)
        if s in self.reserved:
            raise SlotMisuse("lend of a reserved slot", slot=s, owner=None, actor=owner)
        cur = self._owner.get(s)  # NOTE: get: a lent slot has no records here (see alloc)
        if cur is not None:
            raise SlotMisuse("lend of a slot the pool sees owned", slot=s, owner=cur, actor=owner)
        self._owner[s] = owner
        sid = self._ids.get(s)
        if sid is None:
            sid = self._ids[s] = self._new_id(s)
        self._owned_by.setdefault(owner, set()).add(sid)
        self._lent.add(s)
        return sid

    def reclaim(self, slot: int, owner: RequestOwner) -> None:
        """Return a slot :meth:`lend` took to the host, after the pool's pending work on it
        (a clone reading it) completed. The host's allocator is not told: the host frees it.

        :raises SlotMisuse: ``slot`` not owned by ``owner``, or not lent (a slot :meth:`alloc`
            took from the host's allocator goes back by :meth:`free`, which tells the allocator;
            reclaimed, it would be lost to it). Nothing changed.
        """
        s = self._index(slot)
        cur = self._owner.get(s)
        # the lender's own owner object comes back (a backend keeps it): no dataclass __eq__
        if (cur is not owner and (cur is None or cur != owner)) or not isinstance(cur, RequestOwner):
            raise SlotMisuse("reclaim by a non-owner", slot=s, owner=cur, actor=owner)
        if s not in self._lent:
            why = "reclaim of a slot the pool allocated, not lent (free it instead)"
            raise SlotMisuse(why, slot=s, owner=cur, actor=owner)
        self._lent.discard(s)
        self._last_use.get(s, COMPLETE).wait()
        self._release_owner_entry(s, cur)
        self._forget(s)

    def check_invariants(self) -> None:
        """Ownership bookkeeping as :meth:`LinearStatePool.check_invariants`, with the free slots
        the host's: no reserved slot owned, the owner index agrees with the per-slot owners,
        owned + the lender's available <= capacity, and records (owner, last use, id) are kept
        only of the slots the pool holds (slot 0's id aside: the pool's id class is read from
        it). O(capacity)."""
        assert not self._free, f"a hosted pool keeps no free list, found {self._free}"
        for r in sorted(self.reserved):
            assert self._owner[r] is None, f"reserved slot {r} is owned by {self._owner[r]}"
        held = {s for s, o in self._owner.items() if o is not None}
        stale = sorted(self._owner.keys() - held) + sorted(self._last_use.keys() - held)
        stale += sorted(self._ids.keys() - held - {0})
        assert not stale, f"slots {stale[:8]} the host holds again keep records in the pool"
        owned = self._check_owner_index()
        for s in sorted(self._lent):
            assert isinstance(self._owner[s], RequestOwner), f"lent slot {s} is owned by {self._owner[s]}"
        avail = self.num_free
        assert owned + avail <= self.capacity - len(self.reserved), (
            f"owned {owned} + host-free {avail} > capacity {self.capacity} - reserved {len(self.reserved)}"
        )

    def _release(self, s: int, owner: Owner) -> None:
        self._release_owner_entry(s, owner)
        self._forget(s)  # free() waited its last use
        self._lent.discard(s)
        self.lender.give([s])

    def _forget(self, s: int) -> None:
        """Slot ``s`` is the host's again, its last use complete: its owner, last use and id go, so
        the pool keeps records only of the slots it holds. NOTE: an engine's allocator may hand
        out every slot in turn (SGLang's is first in, first out): kept, with the slot's views (now
        bounded by SLOT_VIEWS_KEPT), they were ~1.5 KB and 4 tracked objects for every slot ever
        used (0.57 GB at SGLang's 374,391 CPU slots); made again, an id costs ~0.3 us."""
        self._owner.pop(s, None)
        self._last_use.pop(s, None)
        self._ids.pop(s, None)


def _behind(after: Iterable[Fence], last_uses: Iterable[Fence]) -> list[Fence]:
    """``after`` plus every slot's last use still pending: what a pool operation waits."""
    return [*after, *(f for f in last_uses if f is not COMPLETE and not f.is_complete())]


_T = TypeVar("_T")


class _Default(dict[int, _T]):
    """A per-slot value stored only for slots that were given one: a miss is ``default`` (not
    stored). Hits cost a dict look-up."""

    __slots__ = ("_default",)

    def __init__(self, default: _T) -> None:
        super().__init__()
        self._default = default

    def __missing__(self, slot: int) -> _T:
        return self._default


class _PerSlot(dict[int, _T]):
    """Per-slot objects made on first use and kept (``d[slot]``): a dict whose misses call
    ``make(slot)``. Hits cost a dict look-up. With ``limit``, objects of at most that many slots
    are kept: a miss with ``limit`` slots kept empties the dict first (``make`` makes an equal
    object again: only the time to remake them is lost)."""

    __slots__ = ("_limit", "_make")

    def __init__(self, make: Callable[[int], _T], limit: int = 0) -> None:
        super().__init__()
        self._make = make
        self._limit = limit

    def __missing__(self, slot: int) -> _T:
        if self._limit and len(self) >= self._limit:
            self.clear()
        value = self[slot] = self._make(slot)
        return value


def _byte_rows(t: torch.Tensor) -> np.ndarray | None:
    """A CPU tensor ``[L, S, ...]`` as a writable numpy view ``[L, S, row bytes]`` of its bytes
    (each layer's slot row contiguous), for :func:`linear_state._native.copy_slot`; ``None`` when it
    is not one (another device, a row that is not contiguous, no slot)."""
    if t.device.type != "cpu" or t.dim() < 2 or t.shape[0] == 0 or t.shape[1] == 0:
        return None
    try:
        flat = t.view(t.shape[0], t.shape[1], -1)
        if flat.shape[2] > 1 and flat.stride(2) != 1:
            return None
        out: np.ndarray = flat.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None
    return out


def _widest_slots(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[L, S, ...]``) viewed as ``[L, S, n]`` words of 16 or 8 bytes when every slot's rows
    allow it (each layer's dims contiguous; the row's bytes, the view's start and both leading
    strides multiples of the word); else ``t`` unchanged, whose slot rows copy element-wise. A
    bit-exact alias for copies: ``result[:, i]`` reads and writes the bytes of ``t[:, i]``, in one
    word for every slot of the pool."""
    try:
        flat = t.view(t.shape[0], t.shape[1], -1)
    except RuntimeError:
        # Not a view (SGLang's AMX layout stores a slot's conv window transposed): a reshape would
        # copy, and a copy into the copy would be lost. Element-wise copies of the rows are right.
        return t
    e = flat.element_size()
    row_bytes = flat.shape[2] * e
    start = flat.storage_offset() * e
    for wide, size in ((torch.complex128, 16), (torch.int64, 8)):
        w = size // e
        if (
            e < size
            and row_bytes % size == 0
            and start % size == 0
            and flat.stride(0) % w == 0
            and flat.stride(1) % w == 0
        ):
            return flat.view(wide)
    return t


def _check_owner(owner: object) -> None:
    if not isinstance(owner, (RequestOwner, NodeOwner)):
        raise TypeError(f"an owner is a RequestOwner or a NodeOwner, got {owner!r}")


def _not_a_fence(f: object) -> TypeError:
    return TypeError(f"after holds {f!r} ({type(f).__name__}), not a Fence")


def _fences(after: Iterable[Fence]) -> tuple[Fence, ...]:
    """``after`` as a tuple, every item a Fence (checked before anything is queued or taken)."""
    if type(after) is tuple:  # the common case: nothing to copy
        for f in after:
            if not isinstance(f, Fence):
                raise _not_a_fence(f)
        return after
    if isinstance(after, Fence):
        raise TypeError("after takes an iterable of fences; wrap a single fence: after=(fence,)")
    try:
        out = tuple(after)
    except TypeError:
        raise TypeError(f"after takes an iterable of fences, got {type(after).__name__}") from None
    for f in out:
        if not isinstance(f, Fence):
            raise _not_a_fence(f)
    return out


def _check_stream(stream: Stream | None) -> Stream | None:
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError(f"stream must be a linear_state Stream or None, got {type(stream).__name__}")
    return stream
