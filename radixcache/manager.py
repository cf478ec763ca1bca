"""CacheManager: the request lifecycle a host scheduler calls.

One record per request; the host passes ids, token ids and KV indices and never hands the manager
its own objects. Where every fence sits (see docs/integration.md)::

    admit ─ match(ids[:-1]), lock the hit, alloc live + track slots ─ restore ──fence──> first forward
    extend ─ host captures states at track_points() into track slots ──ready──> commit
    commit ─ wait ready, clone the track slot into the tree (copy-on-donate), move the lock
    finish ─ wait ready, donate the final state, unlock, free every slot after its last writer
    abort  ─ at any point: unlock, free every slot after its last writer; nothing donated

Ownership: every slot the manager hands out is owned by ``RequestOwner(rid)``; tree snapshots
are owned by tree nodes. No slot id is ever held by the tree and a request at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch

from linear_state import Fence, PoolExhausted, RequestOwner, SlotId, Stream, device_synchronize
from linear_state.owners import NodeOwner

from .forensics import Forensics
from .keys import IMAGE_ID_BASE, KeyLike, key_bytes
from .tree import HybridRadixCache, TreeNode

__all__ = ["Admission", "CacheManager", "CommitResult", "FinishResult", "Refusal"]

Barrier = Literal["fence", "device"]


class Admission(NamedTuple):
    """An admitted request: what the host needs before its first forward.

    :ivar cached_length: tokens served from the cache; the host computes ``[cached_length, n)``.
    :ivar token_length: depth to which the ids agreed with the tree (diagnostic).
    :ivar kv_indices: the tree's KV indices for ``[0, cached_length)`` (locked while the request
        lives: safe to read until finish/abort).
    :ivar live_slot: the request's own state slot (restored from the hit, or zeroed).
    :ivar track_slots: slots the host captures intermediate states into.
    :ivar ready: the first forward that reads or writes ``live_slot`` must be ordered after it.
    """

    rid: Hashable
    cached_length: int
    token_length: int
    kv_indices: torch.Tensor
    live_slot: SlotId
    track_slots: tuple[SlotId, ...]
    ready: Fence

    @property
    def admitted(self) -> bool:
        """Always True (a :class:`Refusal` says False)."""
        return True


class Refusal(NamedTuple):
    """The request could not be admitted now: nothing was allocated or locked.

    :ivar slots_needed: state slots admission needs (live + track).
    :ivar slots_available: free slots plus evictable snapshots at the time.
    """

    rid: Hashable
    reason: str
    slots_needed: int
    slots_available: int

    @property
    def admitted(self) -> bool:
        """Always False."""
        return False


class CommitResult(NamedTuple):
    """What a commit did.

    :ivar depth: the depth committed.
    :ivar donated: a snapshot now exists at ``depth`` (cloned now, or already there).
    :ivar snapshot_created: a clone was taken by this commit.
    :ivar kv_indices: the KV indices the host uses for ``[0, depth)`` from now on: the tree's for
        ``[0, kv_held)`` (its own duplicates were released through the tree's ``on_free_kv``), the
        host's own beyond.
    :ivar kv_held: the tree holds (and will free) the KV of ``[0, kv_held)``; the host frees its
        own indices beyond when the request ends.
    :ivar slot_reusable: the host's next write into the committed track slot must be ordered after
        this fence (the clone may still be reading it).
    :ivar node: the tree node holding the snapshot at ``depth`` (None when nothing was donated).
    """

    depth: int
    donated: bool
    snapshot_created: bool
    kv_indices: torch.Tensor
    kv_held: int
    slot_reusable: Fence
    node: TreeNode | None = None


class FinishResult(NamedTuple):
    """What finish/abort did.

    :ivar found: False when the request was already gone (idempotent calls).
    :ivar donated_depth: depth of the final state donated (0: none).
    :ivar slots_freed: state slots returned to the pool.
    :ivar kv_held: the tree holds the KV of ``[0, kv_held)``; the host frees its own beyond.
    :ivar node: the node holding the donated final state (None when nothing was donated).
    """

    found: bool
    donated_depth: int
    slots_freed: int
    kv_held: int
    node: TreeNode | None = None


@dataclass(eq=False)
class _Request:
    rid: Hashable
    owner: RequestOwner
    ids: np.ndarray  # cache ids known so far (prompt, then appended output)
    prompt_len: int
    namespace: Hashable
    live: SlotId
    tracks: tuple[SlotId, ...]
    lock: TreeNode
    cached: int
    branch: int  # where the ids left the tree at admission (token_length)
    image_starts: tuple[int, ...]
    last_write: dict[int, Fence] = field(default_factory=dict)  # host fences per slot
    committed: int = 0


class CacheManager:
    """The request lifecycle of a hybrid prefix cache, for a host scheduler.

    :param cache: the tree (and through it the slot pool).
    :param track_align: aligned capture boundaries (64 for chunked delta-rule kernels); a multiple
        of the tree's page size.
    :param track_slots: track slots per request: at most this many captures per extend.
    :param barrier: ``"fence"`` orders donate and restore by fences only; ``"device"`` also runs a
        full device synchronize at donation and hit admission (defence in depth).
    :param stream: stream for restores and clones (default: the tree's).
    :param forensics: fingerprint every donation and verify every restore (see
        :mod:`radixcache.forensics`); ``None`` (default) costs nothing.
    :raises ValueError: bad options.
    """

    def __init__(
        self,
        cache: HybridRadixCache,
        *,
        track_align: int = 64,
        track_slots: int = 2,
        barrier: Barrier = "fence",
        stream: Stream | None = None,
        forensics: Forensics | None = None,
    ) -> None:
        if track_align <= 0 or track_align % cache.page_size:
            raise ValueError(f"track_align {track_align} must be a positive multiple of page_size {cache.page_size}")
        if track_slots < 0:
            raise ValueError(f"track_slots must be >= 0, got {track_slots}")
        if barrier not in ("fence", "device"):
            raise ValueError(f"barrier must be 'fence' or 'device', got {barrier!r}")
        self.cache = cache
        self.pool = cache.pool
        self.track_align = track_align
        self.track_slots = track_slots
        self.barrier: Barrier = barrier
        self.stream = stream
        self.forensics = forensics
        if forensics is not None:
            if forensics.pool is not cache.pool:
                raise ValueError("forensics must watch the cache's own pool")
            cache.on_free_snapshot = lambda n: forensics.snapshot_freed(n.id, int(n.snapshot or 0))
        self._requests: dict[Hashable, _Request] = {}

    # ----------------------------------------------------------------- queries
    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._requests

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet finished or aborted."""
        return len(self._requests)

    def cached_length(self, rid: Hashable) -> int:
        """The hit length of ``rid`` at admission. :raises KeyError: unknown rid."""
        return self._get(rid).cached

    def _get(self, rid: Hashable) -> _Request:
        try:
            return self._requests[rid]
        except KeyError:
            raise KeyError(f"request {rid!r} is not admitted (or already finished)") from None

    # ------------------------------------------------------------------- admit
    def admit(self, rid: Hashable, cache_ids: KeyLike, *, namespace: Hashable = None) -> Admission | Refusal:
        """Admit a request: match, lock the hit, allocate slots, order the restore.

        Matches on all ids but the last (a request computes at least one token). Allocates one live
        slot and ``track_slots`` track slots, evicting unlocked tree snapshots if the pool is short.
        The live slot receives the hit snapshot (a copy, ordered after the snapshot's fence) or the
        zero state. With ``barrier="device"`` the device is synchronized after the restore.

        :returns: an :class:`Admission`, or a :class:`Refusal` when slots cannot be found (then
            nothing is allocated or locked).
        :raises ValueError: ``rid`` already admitted, bad or empty ids. Nothing changed.
        """
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already admitted")
        ids = np.frombuffer(key_bytes(cache_ids), dtype=np.uint32).astype(np.int64)
        if ids.size == 0:
            raise ValueError(f"request {rid!r} has no ids")
        need = 1 + self.track_slots
        m = self.cache.match(ids[:-1], namespace=namespace)
        node = m.node
        self.cache.lock(node)
        short = need - self.pool.num_free
        if short > 0:
            self.cache.evict(snapshots=short)
        if self.pool.num_free < need:
            self.cache.unlock(node)
            return Refusal(
                rid,
                f"{need} state slots needed, {self.pool.num_free} free and no more evictable snapshots",
                need,
                self.pool.num_free,
            )
        owner = RequestOwner(rid)
        slots = self.pool.alloc_many(owner, need)
        live, tracks = slots[0], tuple(slots[1:])
        fx = self.forensics
        if fx is not None:
            fx.request_slots(rid, slots)
            if m.length:
                fx.before_restore(node.id, rid, live)
        if m.length:
            ready = self.cache.restore(node, live, stream=self.stream or self.cache.stream, dst_owner=owner)
            if self.barrier == "device":
                ready.wait()
                device_synchronize(self.pool.device)
        else:
            ready = self.pool.zero(live, owner=owner, stream=self.stream or self.cache.stream)
        is_img = ids >= IMAGE_ID_BASE
        starts = np.flatnonzero(is_img & ~np.concatenate([[False], is_img[:-1]]))
        rec = _Request(
            rid=rid,
            owner=owner,
            ids=ids,
            prompt_len=int(ids.size),
            namespace=namespace,
            live=live,
            tracks=tracks,
            lock=node,
            cached=m.length,
            branch=m.token_length,
            image_starts=tuple(int(s) for s in starts),
            committed=m.length,
        )
        rec.last_write[live] = ready
        self._requests[rid] = rec
        return Admission(rid, m.length, m.token_length, m.kv_indices, live, tracks, ready)

    # ------------------------------------------------------------ track points
    def track_points(self, rid: Hashable, start: int, end: int) -> list[int]:
        """Depths in ``(start, end]`` at which the host should capture the state during an extend
        over tokens ``[start, end)``, at most ``track_slots`` of them, ascending.

        Candidates, most valuable first: the branch point (where this request left the tree at
        admission: the next request sharing this prefix hits there); the start of each image span
        (a different image with the same text hits up to it); the re-send point (the deepest
        page-aligned depth below the prompt length: an identical prompt matches all but its last
        id); then multiples of ``track_align`` below the prompt length, deepest first (the state at
        the prompt's end is donated at finish, after the answer, where continuations need it).
        Only page-aligned depths beyond the request's committed depth.

        :raises KeyError: unknown rid. :raises ValueError: ``not 0 <= start < end``.
        """
        rec = self._get(rid)
        if not 0 <= start < end:
            raise ValueError(f"extend window [{start}, {end}) is empty or negative")
        page = self.cache.page_size
        resend = (rec.prompt_len - 1) // page * page
        cands: list[int] = [rec.branch]
        cands += [s for s in rec.image_starts if s % page == 0]
        cands.append(resend)
        first = (start // self.track_align + 1) * self.track_align
        last = min(end, rec.prompt_len - 1) // self.track_align * self.track_align
        cands += range(last, first - 1, -self.track_align)
        out: list[int] = []
        for d in cands:
            if start < d <= end and d > rec.committed and d % page == 0 and d not in out:
                out.append(d)
                if len(out) == self.track_slots:
                    break
        return sorted(out)

    def append(self, rid: Hashable, ids: KeyLike) -> None:
        """Record generated ids (cache ids) after the prompt, so later commits and finish can key
        decode-time states. :raises KeyError: unknown rid. :raises ValueError: bad ids."""
        rec = self._get(rid)
        more = np.frombuffer(key_bytes(ids), dtype=np.uint32).astype(np.int64)
        rec.ids = np.concatenate([rec.ids, more])

    # ------------------------------------------------------------------ commit
    def commit(
        self, rid: Hashable, depth: int, slot: int, ready: Fence | None, *, kv_indices: torch.Tensor
    ) -> CommitResult:
        """Donate the state the host captured into ``slot`` after exactly ``depth`` tokens.

        The tree clones ``slot`` behind ``ready`` (the capturing forward's fence) into a slot it
        owns (copy-on-donate; with ``barrier="device"`` the device is synchronized first), inserts
        the KV pages up to ``depth`` and the request's lock moves to the new node. Duplicate KV
        indices go to the tree's ``on_free_kv``; the host replaces its indices for ``[0, depth)``
        with ``result.kv_indices``. If the pool has no slot for the clone even after evicting an
        unlocked snapshot, nothing is donated (a lost hit, never a wrong one).

        :param kv_indices: the host's KV indices for ``[0, depth)``.
        :raises KeyError: unknown rid.
        :raises ValueError: ``slot`` not one of the request's slots; ``depth`` not a positive
            multiple of the page size within the known ids; ``kv_indices`` of the wrong length.
            Nothing changed.
        """
        rec = self._get(rid)
        s = int(slot)
        if s != rec.live and s not in rec.tracks:
            raise ValueError(f"slot {s} is not a slot of request {rid!r} (live {rec.live}, track {rec.tracks})")
        page = self.cache.page_size
        if depth % page or depth <= 0 or depth > rec.ids.size:
            raise ValueError(
                f"commit depth {depth} of request {rid!r} must be a positive multiple of page_size {page} "
                f"within its {rec.ids.size} known ids"
            )
        if int(kv_indices.numel()) != depth:
            raise ValueError(f"kv_indices has {int(kv_indices.numel())} entries for commit depth {depth}")
        if ready is not None:
            rec.last_write[s] = ready
        return self._donate(rec, depth, s, ready, kv_indices)

    def _donate(
        self, rec: _Request, depth: int, slot: int, ready: Fence | None, kv_indices: torch.Tensor
    ) -> CommitResult:
        if self.barrier == "device":
            if ready is not None:
                ready.wait()
            device_synchronize(self.pool.device)
        key = rec.ids[:depth]
        if not self.pool.can_alloc(1):
            self.cache.evict(snapshots=1)
        try:
            res = self.cache.insert(key, kv_indices, state_slot=slot, ready=ready, namespace=rec.namespace)
        except PoolExhausted:
            # NOTE: no slot for the clone: nothing is inserted at all. Inserting the KV alone would
            # hand the host tree indices beyond its lock, which an eviction could free under it.
            return CommitResult(depth, False, False, kv_indices, rec.committed, self.pool.last_use(slot), None)
        node = res.node
        if self.forensics is not None and res.snapshot_created:
            self._record_donation(rec, node, key)
        if node.depth > rec.lock.depth:
            self.cache.lock(node)
            self.cache.unlock(rec.lock)
            rec.lock = node
        rec.committed = max(rec.committed, depth)
        return CommitResult(
            depth,
            True,
            res.snapshot_created,
            self.cache.kv_indices(node),
            rec.committed,
            self.pool.last_use(slot),
            node,
        )

    def _record_donation(self, rec: _Request, node: TreeNode, key: np.ndarray) -> None:
        fx = self.forensics
        assert fx is not None and node.snapshot is not None
        anc = node.parent
        while anc is not None and anc.snapshot is None:
            anc = anc.parent
        fx.donated(
            node.id,
            node.depth,
            key_bytes(key),
            node.snapshot,
            rec.rid,
            node.snapshot_fence,
            anc.id if anc is not None else None,
            anc.depth if anc is not None else 0,
        )

    def verify_all(self) -> int:
        """Verify every snapshot's fingerprint against its donation (forensics only).

        :returns: snapshots checked. :raises radixcache.SnapshotCorruption: in ``raise`` mode.
        :raises RuntimeError: forensics is off.
        """
        if self.forensics is None:
            raise RuntimeError("verify_all needs CacheManager(..., forensics=Forensics(...))")
        return self.forensics.verify_all()

    # --------------------------------------------------------- finish / abort
    def finish(
        self, rid: Hashable, ready: Fence | None = None, *, kv_indices: torch.Tensor | None = None
    ) -> FinishResult:
        """Finish a request: donate its final state, unlock, free its slots after ``ready``.

        The final state is the live slot after all the request's known ids (prompt plus
        :meth:`append`-ed output that its forwards consumed); it is donated when ``kv_indices``
        covers exactly those ids and their count is page aligned. Idempotent: finishing a request
        that is gone returns ``found=False``.

        :param ready: fence of the last forward that wrote the request's slots.
        :raises ValueError: ``kv_indices`` of the wrong length (nothing changed).
        """
        rec = self._requests.get(rid)
        if rec is None:
            return FinishResult(False, 0, 0, 0)
        n = int(rec.ids.size)
        if kv_indices is not None and int(kv_indices.numel()) != n:
            raise ValueError(f"finish of {rid!r}: kv_indices has {int(kv_indices.numel())} entries for {n} ids")
        if ready is not None:
            rec.last_write[rec.live] = ready
        donated, node = 0, None
        if kv_indices is not None and n % self.cache.page_size == 0:
            res = self._donate(rec, n, rec.live, ready, kv_indices)
            if res.donated:
                donated, node = n, res.node
        held = rec.committed
        return FinishResult(True, donated, self._release(rec, (ready,) if ready is not None else ()), held, node)

    def abort(self, rid: Hashable, ready: Fence | None = None) -> FinishResult:
        """Abort a request at any point of its lifecycle: unlock, free every slot after its last
        writer (``ready``, and every fence the manager saw for it). Nothing is donated. Idempotent.
        """
        rec = self._requests.get(rid)
        if rec is None:
            return FinishResult(False, 0, 0, 0)
        held = rec.committed
        return FinishResult(True, 0, self._release(rec, (ready,) if ready is not None else ()), held)

    def _release(self, rec: _Request, after: Iterable[Fence]) -> int:
        fences = [*after, *rec.last_write.values()]
        slots = (rec.live, *rec.tracks)
        for f in fences:
            f.wait()
        for s in slots:
            self.pool.free(s, rec.owner)
        if self.forensics is not None:
            self.forensics.request_freed(rec.rid, slots)
        self.cache.unlock(rec.lock)
        del self._requests[rec.rid]
        return len(slots)

    # -------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken rule. O(tree + requests).

        No slot id held by the tree and by a request at once; every request slot owned by its
        request in the pool; free + tree + requests == capacity; each request's lock node alive
        and locked; the tree's and the pool's invariants; the forensics' bookkeeping, when on.
        """
        self.cache.check_invariants()
        snapshots = {n.id: n.snapshot for n in self.cache.iter_nodes() if n.snapshot is not None}
        tree_slots = set(snapshots.values())
        if self.forensics is not None:
            self.forensics.check_invariants(snapshots)
        req_slots: set[int] = set()
        for rid, rec in self._requests.items():
            slots = (rec.live, *rec.tracks)
            for s in slots:
                assert s not in tree_slots, f"slot {s} is held by the tree and by request {rid!r}"
                assert s not in req_slots, f"slot {s} is held by two requests (one is {rid!r})"
                owner = self.pool.owner_of(s)
                assert owner == rec.owner, f"request {rid!r} slot {s} is owned by {owner} in the pool"
                req_slots.add(s)
            assert self.pool.slots_of(rec.owner) == frozenset(slots), f"request {rid!r} owns slots it does not track"
            assert rec.lock.snap_lock > 0, f"request {rid!r} lock node {rec.lock!r} is not locked"
            assert rec.lock.depth == 0 or rec.lock.parent is not None, f"request {rid!r} lock node was evicted"
        tree_n = self.pool.num_owned_by(NodeOwner)
        req_n = self.pool.num_owned_by(RequestOwner)
        assert req_n == len(req_slots), f"pool has {req_n} request-owned slots, the manager tracks {len(req_slots)}"
        assert self.pool.num_free + tree_n + req_n == self.pool.capacity, (
            f"free {self.pool.num_free} + tree {tree_n} + requests {req_n} != capacity {self.pool.capacity}"
        )
