"""CacheManager: the request lifecycle a host scheduler calls, with the policy inside.

One record per request; the host passes ids, token ids, fences and KV indices and never hands the
manager its own objects. The manager asks its :class:`~radixcache.policies.Policy` where to
capture and what to evict; the host never chooses depths or victims. Per request::

    admit ── match(ids[:-1]) (dry run first: a refusal changes nothing), lock the hit,
             alloc live + track slots, restore the hit ──ready──> the first forward
    per window (a prefill chunk or a decode step):
      plan   = plan_prefill(rid, end) | plan_decode(rid, new_ids)
               -> plan.captures: (depth, track slot) pairs, ascending; plan.after
      forward over [plan.start, plan.end): writes the live slot, copies the state after exactly
               depth tokens into each capture's slot (writes ordered after plan.after) ──ready──>
      res    = commit(plan, ready, kv_indices=<the window's KV indices>)
               clones each capture into the tree behind ready (copy-on-donate), splices the tree's
               pages into the request's KV table, hands back KV indices the host may reuse
               (res.free_kv, after res.free_after)
    finish ── donate the final state (or the deepest page-aligned one captured while decoding),
              unlock, free every slot after its last writer; returns the KV the host frees
    abort  ── at any point: unlock, free every slot after its last writer; returns the KV

Ownership: every slot the manager hands out is owned by ``RequestOwner(rid)``; tree snapshots
are owned by tree nodes. No slot id is ever held by the tree and a request at once.

Thread-safety: none by design (one scheduler thread drives one manager). Every public call that
changes state takes a non-blocking guard; a second thread (or a callback re-entering the
manager) gets :class:`~radixcache.core.errors.ConcurrentUseError` and changes nothing.
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, ParamSpec, TypeVar

import numpy as np
import torch

from linear_state import (
    COMPLETE,
    Fence,
    FingerprintJob,
    HostedStatePool,
    PoolExhausted,
    RequestOwner,
    SlotId,
    Stream,
    device_synchronize,
)
from linear_state.owners import NodeOwner

from ..core.errors import (
    AdmissionFailed,
    ConcurrentUseError,
    ForeignObjectError,
    ProtocolError,
    RadixCacheError,
    SnapshotRefused,
    UnknownRequest,
)
from ..core.events import TreeEvent, TreeEventKind
from ..core.keys import IMAGE_ID_BASE, MAX_ID, TOKEN_BYTES, CacheKey, KeyLike, key_bytes
from ..core.kv import KVAllocator, KVExhausted
from ..core.native import MODULE as _NATIVE
from ..core.policy import DonationReason, Policy, RequestInfo, default_policy
from ..core.tree import EvictResult, HybridRadixCache, InsertResult, MatchResult, TreeNode
from ..forensics.recorder import SAMPLED, Forensics, SnapshotCorruption
from ..tiers.host import auto_host_pool
from ..tiers.shared import Fetched, Rejection, SharedTier
from .metrics import EvictionReason, ManagerMetrics, MetricsCounters, SkipReason

__all__ = [
    "UnwrittenSlotWarning",
    "AdmissionCheck",
    "Admission",
    "CacheManager",
    "Capture",
    "DecodeBatchPlan",
    "DecodeBatchResult",
    "FinishResult",
    "Refusal",
    "RefusalCause",
    "WindowPlan",
    "WindowResult",
]

Barrier = Literal["fence", "device"]
P = ParamSpec("P")
R = TypeVar("R")
_EMPTY_KV = torch.empty(0, dtype=torch.int64)
_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


class UnwrittenSlotWarning(RuntimeWarning):
    """The host committed a capture slot it never wrote, or finished a request whose live slot
    still held the state it was admitted with: the snapshot taken from it is wrong. The manager
    evicts it (``metrics().unwritten_snapshots``); the host's forward must write every planned
    capture and store the final state into the live slot before ``finish``."""


class Admission(NamedTuple):
    """An admitted request: what the host needs before its first forward.

    :ivar cached_length: tokens served from the cache; the host computes ``[cached_length, n)``.
    :ivar token_length: depth to which the ids agreed with the tree (diagnostic).
    :ivar kv_indices: the tree's KV indices for ``[0, cached_length)`` (locked while the request
        lives: safe to read until finish/abort).
    :ivar live_slot: the request's own state slot (restored from the hit, or zeroed).
    :ivar track_slots: slots the manager plans captures into.
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


class RefusalCause(enum.Enum):
    """What an admission lacked."""

    #: State slots: too few free, even counting every snapshot that could be evicted.
    SLOTS = "slots"
    #: KV indices (a manager that owns the KV): too few free after evicting the tree's unlocked KV.
    KV = "kv"


class Refusal(NamedTuple):
    """The request could not be admitted now: nothing was allocated, locked or evicted.

    :ivar cause: what it lacked (:class:`RefusalCause`); :ivar reason: the same, in words, with
        the numbers.
    :ivar slots_needed: state slots admission needs (live + track).
    :ivar slots_available: free slots plus snapshots that could be evicted for it.
    """

    rid: Hashable
    cause: RefusalCause
    reason: str
    slots_needed: int
    slots_available: int

    @property
    def admitted(self) -> bool:
        """Always False."""
        return False


class AdmissionCheck(NamedTuple):
    """What :meth:`CacheManager.can_admit` found; nothing changed to find it.

    :ivar admissible: :meth:`CacheManager.admit` would succeed now.
    :ivar cached_length: the hit it would get; :ivar token_length: depth the ids agree with the tree.
    :ivar slots_needed: state slots admission needs; :ivar slots_available: free slots plus
        snapshots that could be evicted for it.
    """

    admissible: bool
    cached_length: int
    token_length: int
    slots_needed: int
    slots_available: int


class Capture(NamedTuple):
    """One state the host copies during a window: the state after exactly ``depth`` tokens, into
    track slot ``slot``."""

    depth: int
    slot: SlotId


class WindowPlan(NamedTuple):
    """The capture plan of one forward window over tokens ``[start, end)`` of request ``rid``.

    The host's forward writes ``live_slot`` and, for each capture, copies the state after exactly
    ``capture.depth`` tokens into ``capture.slot``; its writes into those slots must be ordered after
    every fence in ``after`` (earlier clones may still read them). Then :meth:`CacheManager.commit`.
    A plan is good for one commit, on the manager that made it (the very object: a copy is not
    the plan).

    With a manager that owns the KV (``CacheManager(kv=...)``): ``kv_indices`` are where the window
    writes its tokens' KV (one per token of ``[start, end)``) and ``kv_table`` what its attention
    reads (the request's indices for ``[0, end)``, the window's last); both are safe to use until
    the request's next commit, finish or abort. ``None`` when the host keeps its own tables.
    """

    rid: Hashable
    start: int
    end: int
    captures: tuple[Capture, ...]
    after: tuple[Fence, ...]
    live_slot: SlotId
    decode: bool
    manager_id: int
    kv_indices: torch.Tensor | None = None
    kv_table: torch.Tensor | None = None


class DecodeBatchPlan(NamedTuple):
    """The decode windows of a batch, one id each (see :meth:`CacheManager.plan_decode_batch`).

    :ivar rids: the requests, in the order their ids and KV indices go.
    :ivar plans: the requests whose window carries captures, with their :class:`WindowPlan`
        (copy each capture's state after the token, as for a single window); empty most steps.
    :ivar after: order the forward's writes into those capture slots after these fences.
    :ivar kv_indices: with a manager that owns the KV, where each request's token writes its KV
        (``kv_indices[i]`` for ``rids[i]``); :ivar kv_tables: what each one's attention reads
        (its indices for ``[0, computed + 1)``). Safe until the next commit; ``None`` otherwise.
    """

    rids: tuple[Hashable, ...]
    plans: dict[Hashable, WindowPlan]
    after: tuple[Fence, ...]
    manager_id: int
    kv_indices: torch.Tensor | None = None
    kv_tables: tuple[torch.Tensor, ...] | None = None


class DecodeBatchResult(NamedTuple):
    """What :meth:`CacheManager.commit_batch` did.

    :ivar results: the :class:`WindowResult` of each request that had captures (keyed by rid);
        the others only recorded their token.
    :ivar free_kv: host KV indices the tree made redundant: the concatenation of the ``free_kv``
        of every result in ``results``, in their order. Free either this or the per-request
        ones, never both (a host that frees both frees every index twice)...
    :ivar free_after: ...free them after this fence.
    """

    results: dict[Hashable, WindowResult]
    free_kv: torch.Tensor
    free_after: Fence


class WindowResult(NamedTuple):
    """What a window's commit did.

    :ivar donated: depths at which the tree took a snapshot from this window (ascending).
    :ivar kv_held: the tree holds (and will free) the request's KV for ``[0, kv_held)``.
    :ivar spliced: the request's KV table changed: from now on use :meth:`CacheManager.kv_indices`
        (the tree's indices for ``[0, kv_held)``, the host's own beyond).
    :ivar free_kv: host KV indices the tree made redundant (it holds the same tokens): free them...
        (empty with a manager that owns the KV: it gave them to the allocator itself)
    :ivar free_after: ...once this fence completed (their last writer: the window's forward).
    :ivar kv_table: with a manager that owns the KV, the request's KV table for
        ``[0, tokens committed)`` after this commit (safe until its next commit, finish or abort);
        ``None`` otherwise.
    """

    donated: tuple[int, ...]
    kv_held: int
    spliced: bool
    free_kv: torch.Tensor
    free_after: Fence
    kv_table: torch.Tensor | None = None


class FinishResult(NamedTuple):
    """What finish/abort did.

    :ivar donated_depth: depth of the final state donated (``None``: none).
    :ivar slots_freed: state slots returned to the pool.
    :ivar kv_held: the tree holds the KV of ``[0, kv_held)``.
    :ivar free_kv: every KV index of the request the host must now free (its own beyond
        ``kv_held``, and duplicates of the final donation; empty with a manager that owns the
        KV: it gave them to the allocator, the reservation never used included)...
    :ivar free_after: ...once this fence completed.
    :ivar node: the node holding the donated final state (None when nothing was donated).
    """

    donated_depth: int | None
    slots_freed: int
    kv_held: int
    free_kv: torch.Tensor
    free_after: Fence
    node: TreeNode | None = None


class _SharedHit(NamedTuple):
    """A prefix the shared tier served at admission: the verified blob, the tree's match now that
    it is inserted (locked), and the fence the live slot's write completes behind."""

    fetched: Fetched
    match: MatchResult
    ready: Fence


class _KVShort(Exception):
    """Inside an admission: its hit was refused for a finding, and the shallower one needs more
    KV than the allocator has even after evictions (turned into a ``Refusal``)."""

    def __init__(self, need: int, free: int) -> None:
        super().__init__(need, free)
        self.need, self.free = need, free


class _Ended(NamedTuple):
    """What the end of a request released: state slots freed, KV for the host to free (empty when
    the manager owns the KV), and the donations the write checks found unwritten."""

    slots_freed: int
    free_kv: torch.Tensor
    unwritten: list[tuple[TreeNode, str]]


@dataclass(eq=False, slots=True)
class _Request:
    rid: Hashable
    owner: RequestOwner
    info: RequestInfo
    ids: np.ndarray  # cache ids: the prompt, then output ids folded in from ``out``
    out: list[int]  # decode ids not yet folded into ``ids``
    namespace: Hashable
    live: SlotId
    tracks: tuple[SlotId, ...]
    lock: TreeNode
    computed: int  # tokens computed: their windows committed
    kv_parts: list[torch.Tensor]  # the KV table of [0, computed - len(kv_tail)), in pieces (joined when needed)
    kv_tail: list[int]  # then the KV of small (decode) windows, as ints: cheaper than a tensor each
    kv_held: int  # the tree holds the KV of [0, kv_held)
    last_write: dict[int, Fence] = field(default_factory=dict)  # host fences per slot
    plan: WindowPlan | DecodeBatchPlan | None = None
    final: Capture | None = None  # planned decode capture held for the final state
    pending: tuple[Capture, Fence | None] | None = None  # the deepest such capture committed
    # With a manager that owns the KV: the request's KV table for [0, computed), then its reserved
    # indices (kv_parts and kv_tail stay empty). The request owns kv_full[committed:].
    kv_full: torch.Tensor | None = None
    hit: TreeNode | None = None  # the node whose snapshot was restored at admission (None: zeros)
    unverified: list[TreeNode] = field(default_factory=list)  # donated from marked capture slots


def _busy(name: str) -> ConcurrentUseError:
    return ConcurrentUseError(
        f"CacheManager.{name} entered while another call runs in this manager "
        "(it is not thread-safe: drive it from one scheduler thread)"
    )


def _exclusive(method: Callable[P, R]) -> Callable[P, R]:
    """Run ``method`` under the manager's non-blocking guard (see the module docstring): natively
    where the extension is built (:data:`radixcache.core.native.NATIVE`; NOTE: this wrapper's
    frame and argument packing cost ~5% of the cache's time in the SGLang scheduler benchmark,
    about seven guarded calls a request, session 35), else this Python wrapper, the reference
    (the same guard, the same exception)."""

    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        if not args:
            raise TypeError(f"{method.__name__}() needs the object it guards as its first argument")
        self = args[0]
        assert isinstance(self, CacheManager)
        if not self._guard.acquire(False):
            raise _busy(method.__name__)
        try:
            return method(*args, **kwargs)
        finally:
            self._guard.release()

    fast: Callable[P, R] = guarded if _NATIVE is None else _NATIVE.exclusive(method, _busy)
    fast.__name__ = method.__name__
    fast.__qualname__ = method.__qualname__
    fast.__doc__ = method.__doc__
    fast.__wrapped__ = method  # type: ignore[attr-defined]
    return fast


class CacheManager:
    """The request lifecycle of a hybrid prefix cache, for a host scheduler.

    :param cache: the tree (and through it the slot pool).
    :param policy: where captures go and which snapshot is evicted (default:
        :class:`~radixcache.policies.HitDensity`, the one that measured best). One policy
        instance per manager.
    :param track_slots: track slots per request: at most this many captures per window.
    :param barrier: ``"fence"`` orders donate and restore by fences only; ``"device"`` also runs a
        full device synchronize at donation and hit admission (defence in depth).
    :param stream: stream for restores and clones (default: the tree's).
    :param forensics: fingerprint donations and verify their restores (see
        :mod:`radixcache.forensics`): ``"sampled"`` (default) watches one donation in ten
        (:data:`~radixcache.forensics.SAMPLED`, chosen from the measured cost), records findings in
        ``manager.forensics.findings`` and warns once per kind; a :class:`Forensics` of your own
        (every donation by default, a ledger, ``mode="raise"``); ``None``: off, costs nothing.
    :param kv_bytes_per_token: the host's KV bytes per token; given, the policy weighs snapshots
        (the pool's slot bytes) against KV in bytes.
    :param clock: seconds for the policy's notion of time when a call passes no ``now``
        (default :func:`time.monotonic`).
    :param shared: the shared tier (:class:`~radixcache.tiers.shared.SharedTier`): every snapshot
        the tree takes is published once its fences completed (at a later call of the manager, or
        :meth:`publish_pending`), and an admission whose local match is shorter than the request
        fetches the deepest verified published prefix into its live slot and the tree. ``None``
        (default): no shared tier.
    :param host_tier: ``"auto"`` (default): a tree built without a host tier gets
        :func:`~radixcache.core.tree.auto_host_pool` (``host_budget_bytes``; by default 4x the
        device pool's bytes, at most a quarter of physical memory, allocated now, page-locked for a
        CUDA pool): evicted snapshots are demoted to host memory instead of dropped
        (docs/host_tier.md). ``None``: no host tier unless the tree has its own.
    :param host_budget_bytes: the auto host tier's bytes (fewer than one slot's: none).
    :param kv: the host's KV allocator (:class:`~radixcache.core.kv.KVAllocator`, e.g.
        :class:`~radixcache.core.kv.KVFreeList`): the manager then owns every request's KV table.
        :meth:`admit` reserves the request's KV (evicting the tree's through the policy when the
        allocator runs short), each plan carries the indices its window writes and the table it
        reads, :meth:`commit` takes no indices, and every index the tree or a request lets go
        returns through ``kv.free`` (the tree's ``KV_FREED`` events go there, not on to its listener). ``None``
        (default): the host keeps its tables and frees what results hand back.
    :param write_checks: catch two silent host mistakes without forensics (default on): each
        planned capture slot gets NaN probe elements before the host's forward (ordered in
        ``plan.after``), and a snapshot donated from a slot still carrying them, or from a live
        slot whose probe elements still equal the state restored at admission, is evicted with an
        :class:`UnwrittenSlotWarning` when its request ends (finish or abort, which wait the
        host's fences anyway). Cost per capture: one small write; per request end: a read of a few
        elements per layer for each snapshot it donated (benchmarks/bench_manager.py).
    :raises ValueError: bad options. :raises TypeError: a policy that is not a
        :class:`~radixcache.policies.Policy`, a shared tier that is not a ``SharedTier``.
        :raises RuntimeError: the policy (or the shared tier, or the tree) serves another manager.
    """

    def __init__(
        self,
        cache: HybridRadixCache,
        policy: Policy | None = None,
        *,
        track_slots: int = 2,
        barrier: Barrier = "fence",
        stream: Stream | None = None,
        forensics: Forensics | Literal["sampled"] | None = "sampled",
        kv_bytes_per_token: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedTier | None = None,
        host_tier: Literal["auto"] | None = "auto",
        host_budget_bytes: int | None = None,
        kv: KVAllocator | None = None,
        write_checks: bool = True,
    ) -> None:
        # Everything is checked before anything is bound, attached or allocated: a constructor
        # that raises leaves the cache, the policy and the shared tier as they were.
        if not isinstance(cache, HybridRadixCache):
            raise TypeError(f"cache must be a HybridRadixCache, got {type(cache).__name__}")
        if host_tier not in ("auto", None):
            raise ValueError(f"host_tier must be 'auto' or None, got {host_tier!r}")
        if host_budget_bytes is not None and (
            isinstance(host_budget_bytes, bool)
            or not isinstance(host_budget_bytes, (int, np.integer))
            or host_budget_bytes < 0
        ):
            raise ValueError(f"host_budget_bytes must be an int >= 0, got {host_budget_bytes!r}")
        if policy is not None and not isinstance(policy, Policy):
            hint = " (make_policy(name) builds one by name)" if isinstance(policy, str) else ""
            raise TypeError(f"policy must be a Policy, got {type(policy).__name__}{hint}")
        if policy is not None and getattr(policy, "cache", None) not in (None, cache):
            raise RuntimeError(f"policy {policy.name!r} already serves another cache; make one policy per manager")
        if shared is not None and not isinstance(shared, SharedTier):
            raise TypeError(f"shared must be a SharedTier, got {type(shared).__name__}")
        if shared is not None and shared.client is not None:
            raise ProtocolError("this SharedTier serves another manager already (one tier per manager)")
        if isinstance(track_slots, bool) or not isinstance(track_slots, int) or track_slots < 1:
            raise ValueError(f"track_slots must be an int >= 1, got {track_slots!r}")
        if barrier not in ("fence", "device"):
            raise ValueError(f"barrier must be 'fence' or 'device', got {barrier!r}")
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be a linear_state Stream or None, got {type(stream).__name__}")
        if forensics is not None and not isinstance(forensics, (Forensics, str)):
            raise TypeError(f"forensics must be a Forensics, 'sampled' or None, got {type(forensics).__name__}")
        if isinstance(forensics, str) and forensics != "sampled":
            raise ValueError(f"forensics must be a Forensics, 'sampled' or None, got {forensics!r}")
        if isinstance(forensics, Forensics) and forensics.pool is not cache.pool:
            raise ValueError("forensics must watch the cache's own pool")
        if kv_bytes_per_token is not None and (
            isinstance(kv_bytes_per_token, bool) or not isinstance(kv_bytes_per_token, int) or kv_bytes_per_token < 1
        ):
            raise ValueError(f"kv_bytes_per_token must be None or an int >= 1, got {kv_bytes_per_token!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        if shared is not None and shared.layout is not None and shared.layout != cache.pool.layout:
            raise ProtocolError("this SharedTier serves another layout already (one tier per manager)")
        if type(write_checks) is not bool:
            raise ValueError(f"write_checks must be a bool, got {write_checks!r}")
        if kv is not None and not isinstance(kv, KVAllocator):
            raise TypeError(f"kv must be a KVAllocator (num_free, alloc, free), got {type(kv).__name__}")
        if kv is not None and cache.on_event is not None:
            raise ValueError(
                "the tree has a listener already (on_event); with kv= the manager frees the tree's KV into "
                "kv.free: build the tree without on_event"
            )
        # Last of the checks: a bad option is reported as itself even on a served tree.
        if cache.client is not None:
            raise RuntimeError(
                "this HybridRadixCache is served by another CacheManager already (one manager per tree: a "
                "second one would evict, lock and restore behind the first one's requests)"
            )
        host = None
        if host_tier == "auto" and cache.host_pool is None:
            host = auto_host_pool(cache.pool, host_budget_bytes)  # raises before anything is bound
        if policy is None:
            policy = default_policy()
        policy.bind(cache)
        if shared is not None:
            shared.bind(cache.pool.layout, client=self)
        if host is not None:
            cache.attach_host_pool(host)
        if kv_bytes_per_token is not None:
            policy.costs(cache.pool.layout.slot_bytes, kv_bytes_per_token)
        # The tree's one channel: every KV index, snapshot and node it lets go comes here first.
        self._host_listener = cache.listen(self._tree_event)
        cache.client = self
        self.kv = kv
        self.write_checks = write_checks
        self.cache = cache
        self.pool = cache.pool
        self.policy = policy
        self.track_slots = track_slots
        self.barrier: Barrier = barrier
        self.stream = stream
        if forensics == "sampled":
            forensics = Forensics(cache.pool, mode="record", sample=SAMPLED, warn=True)
        self.forensics: Forensics | None = forensics
        self.clock = clock
        self.shared = shared
        if shared is not None:
            shared.on_reject = self._shared_rejected
        # Snapshots to publish once their fences completed: (node, ids, namespace, KV writer fence).
        self._to_publish: deque[tuple[TreeNode, np.ndarray, Hashable, Fence | None]] = deque()
        self._requests: dict[Hashable, _Request] = {}
        # Snapshots a finding named, refused while a lock held them: dropped once none does.
        self._condemned: dict[int, TreeNode] = {}
        self._guard = threading.Lock()
        self._counters = MetricsCounters()

    # ----------------------------------------------------------------- queries
    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._requests

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet finished or aborted."""
        return len(self._requests)

    def cached_length(self, rid: Hashable) -> int:
        """The hit length of ``rid`` at admission. :raises UnknownRequest: unknown rid."""
        return self._get(rid).info.cached_length

    def kv_indices(self, rid: Hashable) -> torch.Tensor:
        """The request's KV table for ``[0, tokens committed)``: the tree's indices for the prefix
        it holds, the host's own beyond. O(tokens) the first time after a change.

        :raises UnknownRequest: unknown rid.
        """
        return self._table(self._get(rid))

    def metrics(self) -> ManagerMetrics:
        """A typed snapshot of the counters (see :class:`ManagerMetrics`). O(1); reads only."""
        return self._counters.snapshot(
            snapshots_held=self.cache.num_snapshots,
            snapshot_bytes=self.pool.layout.slot_bytes,
            live_requests=len(self._requests),
            demotions=self.cache.demotions,
            host_snapshots_held=self.cache.num_host_snapshots,
            shared=None if self.shared is None else self._shared_counts(),
        )

    def _shared_counts(self) -> dict[str, int]:
        st = self.shared.stats if self.shared is not None else None
        assert st is not None
        return {
            "hits": st.hits,
            "foreign_hits": st.foreign_hits,
            "published": st.published,
            "rejected": sum(st.rejected.values()),
            "errors": st.errors,
        }

    def describe(self) -> dict[str, object]:
        """The manager's own bookkeeping as plain objects (each request's record, the counters),
        for digests and debugging. Reads only; the result shares nothing mutable with the manager
        but the tree nodes it names."""
        return {
            "requests": {rid: _fields(rec) for rid, rec in self._requests.items()},
            "counters": _fields(self._counters),
            "track_slots": self.track_slots,
            "barrier": self.barrier,
        }

    def _get(self, rid: Hashable) -> _Request:
        try:
            return self._requests[rid]
        except (KeyError, TypeError):
            raise UnknownRequest(f"request {rid!r} is not admitted (or already finished or aborted)") from None

    def _now(self, now: float | None) -> float:
        """``now``, or the clock's time when None, as finite seconds.

        :raises TypeError: not a number. :raises ValueError: not finite (a policy fed NaN or
            infinity ranks nothing). Both name where the value came from."""
        t = self.clock() if now is None else now
        if type(t) is float and t - t == 0.0:  # NOTE: the common case in one test (inf - inf, nan - nan: nan)
            return t
        source = "now" if now is not None else "the manager's clock"
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"{source} must give seconds (a number), got {t!r}")
        if not math.isfinite(t):
            raise ValueError(f"{source} must give finite seconds, got {t!r}")
        return float(t)

    # ------------------------------------------------------------------- admit
    def _ids(self, rid: Hashable, cache_ids: KeyLike) -> tuple[CacheKey, np.ndarray]:
        ck = _request_key(rid, cache_ids)
        return ck, ck.ids.astype(np.int64)

    def _match(self, ck: CacheKey, namespace: Hashable) -> MatchResult:
        """The admission's dry-run match: all ids but the last (a request always computes at least
        one token), in the request's namespace; the key as it is, not converted again. Changes
        nothing."""
        return self.cache.match(ck.prefix(len(ck) - 1), namespace=namespace, touch=False)

    def _available(self, hit: TreeNode, length: int) -> int:
        """Slots an admission locking ``hit`` could get: free ones plus evictable snapshots."""
        own = 1 if length and self.cache.is_evictable(hit) else 0
        return self.pool.num_free + self.cache.evictable_snapshots - own

    @_exclusive
    def can_admit(self, cache_ids: KeyLike, *, namespace: Hashable = None) -> AdmissionCheck:
        """Would :meth:`admit` succeed now, and with what hit? Changes nothing at all (no lock, no
        eviction, no recency refresh, no counter). O(match).

        :raises ValueError: bad or empty ids.
        """
        m = self._match(_request_key("(dry run)", cache_ids), namespace)
        if self.forensics is not None:
            m = self._skip_flagged(m, refuse=False)
        need = 1 + self.track_slots
        avail = self._available(m.node, m.cached_length)
        return AdmissionCheck(avail >= need, m.cached_length, m.token_length, need, avail)

    @_exclusive
    def admit(
        self,
        rid: Hashable,
        cache_ids: KeyLike,
        *,
        namespace: Hashable = None,
        session: Hashable | None = None,
        now: float | None = None,
        max_new_tokens: int = 0,
    ) -> Admission | Refusal:
        """Admit a request: match, lock the hit, allocate slots, order the restore.

        Matches on all ids but the last (a request computes at least one token). Allocates one live
        slot and ``track_slots`` track slots, evicting snapshots through the policy only when that
        makes the admission succeed. The live slot receives the hit snapshot (a copy, ordered after
        the snapshot's fence) or the zero state. With ``barrier="device"`` the device is
        synchronized after the restore.

        With a manager that owns the KV (``kv=``), the request's KV is reserved here: the tokens
        beyond the hit plus ``max_new_tokens``; when the allocator has fewer free, the tree's
        unlocked KV is evicted through the policy first (the hit is kept). Decode windows beyond
        the reservation allocate as they go.

        :param session: the conversation the request continues (lets the policy learn think times).
        :param now: the time of arrival in seconds (default: the manager's clock).
        :param max_new_tokens: tokens the request may decode, reserved with its prompt (``kv=``
            only).
        :returns: an :class:`Admission`, or a :class:`Refusal` when slots (or KV) cannot be found;
            then tree, pool and policy are exactly as they were, except that a KV refusal keeps
            the evictions made for it, and snapshots a finding of forensics names are dropped
            (never served: the hit falls back up the path, docs/forensics.md).
        :raises ValueError: ``rid`` already admitted, bad or empty ids, ``max_new_tokens`` not an
            int >= 0 (or given without ``kv=``). :raises TypeError: an unhashable ``rid`` or
            ``session``, ids of the wrong type. Nothing changed. :raises SnapshotCorruption:
            forensics in ``"raise"`` mode found a snapshot changed: the hit's, at its restore, or,
            before anything of this request changed, one the shared tier refused to publish since
            the last call (every such check recorded, the first raised; the request is not
            admitted and the next call does not raise for them).
        """
        for what, v in (("request id", rid), ("session", session)):
            try:
                hash(v)
            except TypeError:
                raise TypeError(f"{what} must be hashable, got {type(v).__name__}") from None
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already admitted")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if max_new_tokens and self.kv is None:
            raise ValueError("max_new_tokens reserves KV: it needs CacheManager(kv=...)")
        ck, ids = self._ids(rid, cache_ids)
        t = self._now(now)
        if self._to_publish or (self.shared is not None and self.shared.has_checks):
            self._publish_ready(False)
        need = 1 + self.track_slots
        fx = self.forensics
        if self._condemned:  # before the match: a snapshot dropped now is not its hit
            self._sweep_condemned()
        m = self._match(ck, namespace)
        if fx is not None and m.cached_length and fx.flagged(m.node.id):
            m = self._skip_flagged(m, refuse=True)
        node = m.node
        avail = self._available(node, m.cached_length)
        if avail < need:
            self._counters.refusals += 1
            return Refusal(
                rid,
                RefusalCause.SLOTS,
                f"{need} state slots needed, {self.pool.num_free} free and {avail} with evictions",
                need,
                avail,
            )
        kv = self.kv
        if kv is not None:
            kv_need = int(ids.size) - m.cached_length + max_new_tokens
            if kv.num_free < kv_need:  # KV pressure: the policy evicts, keeping the hit
                self._evict_kv(kv_need - kv.num_free, t, node if m.cached_length else None)
            if kv.num_free < kv_need:
                self._counters.refusals += 1
                return Refusal(
                    rid,
                    RefusalCause.KV,
                    f"{kv_need} KV indices needed, {kv.num_free} free after evicting the tree's unlocked KV",
                    need,
                    avail,
                )
        # From here on the admission succeeds: every step below is within what was counted. Only
        # code outside the manager can still raise (the policy, the stream, a store or codec
        # outside its protocol); then everything taken is given back (AdmissionFailed).
        owner = RequestOwner(rid)
        refused = False  # the hit the KV was counted for was refused for a finding
        slots: list[SlotId] = []
        ready: Fence = COMPLETE
        locked: TreeNode | None = None
        fresh: torch.Tensor | None = None
        try:
            if m.cached_length:
                self.cache.touch(node)
            self.cache.lock(node)
            locked = node
            short = need - self.pool.num_free
            if short > 0:
                self._evict_snapshots(short, t, EvictionReason.ADMISSION)
            slots = self.pool.alloc_many(owner, need)
            live, tracks = slots[0], tuple(slots[1:])
            if fx is not None:
                fx.request_slots(rid, slots)
            stream = self.stream or self.cache.stream
            fetched: Fetched | None = None
            if self.shared is not None and m.cached_length < ids.size - 1:
                got = self._fetch_shared(rid, ids, namespace, m, owner, live, stream, t)
                if got is not None:
                    fetched, m, ready = got.fetched, got.match, got.ready
                    node = locked = m.node
            elif self.shared is not None:
                self.shared.cancel(rid)  # the tree had it all: a prefetch's answer is not needed
            if fetched is None and m.cached_length and fx is not None:
                # verified before anything is counted or told: a hit a finding names now falls
                # back to the next snapshot up its path (or a miss), never served
                verified = self._verified_hit(m, rid, live)
                refused, m = verified is not m, verified
                node = locked = m.node
            if kv is not None:  # after the fetch: its hit imported KV of its own
                n_kv = int(ids.size) - m.cached_length + max_new_tokens
                if kv.num_free < n_kv and refused:  # the shallower hit needs more than was counted
                    self._evict_kv(n_kv - kv.num_free, t, node if m.cached_length else None)
                    if kv.num_free < n_kv:
                        raise _KVShort(n_kv, kv.num_free)
                fresh = kv.alloc(n_kv)
                if fresh is None:
                    raise RuntimeError(f"the KV allocator refused {n_kv} indices that its num_free promised")
            info = _request_info(ck, m.cached_length, m.token_length, session, t)
            # The policy hears of the admission before the live slot is written: a policy that
            # raises then leaves the slot's contents as they were (nothing to take back).
            self.policy.admitted(info)
            if fetched is not None:
                self.policy.donated(node, info, DonationReason.CAPTURE, t)
            if m.cached_length:
                self.policy.touched(node, info, t)
            if fetched is None and m.cached_length:
                ready = self.cache.restore(node, live, stream=stream, dst_owner=owner)
            elif fetched is None:
                ready = self.pool.zero(live, owner=owner, stream=stream)
            # (a fetched hit's state is in the live slot already, written behind ``ready``)
            if m.cached_length and self.barrier == "device":  # a hit from the tree or the shared tier
                ready.wait()
                device_synchronize(self.pool.device)
        except BaseException as e:
            self._undo_admission(rid, owner, slots, ready, locked)
            if fresh is not None:
                assert kv is not None
                kv.free(fresh)
            if isinstance(e, _KVShort):
                self._counters.refusals += 1
                return Refusal(
                    rid,
                    RefusalCause.KV,
                    f"{e.need} KV indices needed once a hit was refused for a finding, {e.free} free after "
                    "evicting the tree's unlocked KV",
                    need,
                    avail,
                )
            if isinstance(e, Exception) and not isinstance(e, (RadixCacheError, SnapshotCorruption)):
                raise AdmissionFailed(
                    f"admission of request {rid!r} failed in code the manager called ({type(e).__name__}: {e}); "
                    f"its {len(slots)} slots and its lock were given back"
                ) from e
            raise
        rec = _Request(
            rid=rid,
            owner=owner,
            info=info,
            ids=ids,
            out=[],
            namespace=namespace,
            live=live,
            tracks=tracks,
            lock=node,
            computed=m.cached_length,
            kv_parts=[m.kv_indices] if fresh is None else [],
            kv_tail=[],
            kv_held=m.cached_length,
            kv_full=None if fresh is None else torch.cat([m.kv_indices, fresh]),
            hit=node if m.cached_length else None,
        )
        rec.last_write[live] = ready
        self._requests[rid] = rec
        c = self._counters
        c.admissions += 1
        c.prompt_tokens += int(ids.size)
        if m.cached_length:
            c.hits += 1
            c.hit_tokens += m.cached_length
            c.restores += fetched is None
            c.host_hits += fetched is None and node.snapshot is None
        return Admission(rid, m.cached_length, m.token_length, m.kv_indices, live, tracks, ready)

    def _undo_admission(
        self, rid: Hashable, owner: RequestOwner, slots: Sequence[SlotId], ready: Fence, locked: TreeNode | None
    ) -> None:
        """Give back what a failed admission took: its slots (after the restore's fence, when one
        was submitted), its forensics record and its lock. Never raises for the admission's own
        state; a fence that itself raises is not waited (the pool still waits each slot's last
        use)."""
        with contextlib.suppress(Exception):  # a broken stream: the pool still waits each slot's last use
            ready.wait()
        for s in reversed(slots):  # the free list as it was: the next admission gets the same slots
            self.pool.free(s, owner)
        if slots and self.forensics is not None:
            self.forensics.request_freed(rid, slots)
        if locked is not None:
            self.cache.unlock(locked)

    # ------------------------------------------------------------- shared tier
    def _fetch_shared(
        self,
        rid: Hashable,
        ids: np.ndarray,
        namespace: Hashable,
        m: MatchResult,
        owner: RequestOwner,
        live: SlotId,
        stream: Stream | None,
        now: float,
    ) -> _SharedHit | None:
        """A deeper prefix from the shared tier: verified, written into ``live``, inserted into the
        tree (the tree clones ``live`` behind the write) and locked in place of ``m.node``. None: a
        miss; nothing changed but the tier's counters."""
        shared = self.shared
        assert shared is not None
        blob = self._shared_blob(ids, namespace, m.cached_length, None, 1, now, m.node, False, rid)
        if blob is None:
            return None
        got, kv = blob
        d = got.depth
        ready = self._write_fetched(got, live, owner, stream)
        key = ids[:d]
        res = self.cache.insert(key, kv, state_slot=live, ready=ready, namespace=namespace)
        node = res.node
        if res.snapshot_created and self.forensics is not None:
            self._record_donation(f"shared:{got.publisher}", node, key)
        hit = MatchResult(d, max(d, m.token_length), self.cache.kv_indices(node), node, node.snapshot)
        self.cache.relock(m.node, node)  # the lock moves last: the caller's undo unlocks the node it was told of
        shared.counted_hit(got, d - m.cached_length)
        # The tree's clone reads ``live`` after the copy: the host's first forward, which waits the
        # admission's fence alone, must wait the clone too, or it writes the slot before the clone
        # reads it and the tree keeps a state tokens too deep (the misuse machine's find, on
        # deferred streams). The slot's last use is the clone's fence, or the copy's when the
        # tree had the snapshot already.
        return _SharedHit(got, hit, self.pool.last_use(live))

    def _shared_blob(
        self,
        ids: np.ndarray,
        namespace: Hashable,
        local: int,
        limit: int | None,
        slots: int,
        now: float,
        hold: TreeNode,
        kv_room: bool,
        rid: Hashable,
    ) -> tuple[Fetched, torch.Tensor] | None:
        """The shared tier's deepest verified blob for ``ids`` past ``local`` (at most ``limit``
        deep), with ``slots`` pool slots free for it (evicting snapshots through the policy, never
        ``hold``, the local match, or its path) and its KV imported through the codec (with
        ``kv_room``, KV evicted first for it when the manager owns the allocator or the codec
        says what the host's has free, ``KVCodec``'s ``free_tokens``). A request with a
        prefetch takes its answer (never waiting for it); without one the store is asked now.
        None: a miss; nothing changed but the tier's counters and what the evictions freed."""
        shared = self.shared
        assert shared is not None
        if not shared.addressable(namespace):  # served locally only
            return None
        page = self.cache.page_size
        prefetched, got = shared.take(rid, ids, namespace, local, page=page, limit=limit)
        if not prefetched:
            got = shared.fetch(ids, namespace, local, page=page, limit=limit)
        if got is None:
            return None
        d = got.depth
        if local:
            self.cache.lock(hold)
        try:
            if not self.pool.can_alloc(slots):
                self._evict_snapshots(slots - self.pool.num_free, now, EvictionReason.ADMISSION)
            if kv_room and self.pool.can_alloc(slots):
                free = self.kv.num_free if self.kv is not None else shared.kv_free_tokens()
                if free is not None and free < d:
                    self._evict_kv(min(d - free, self.cache.evictable_kv_tokens), now, None)
        finally:
            if local:
                self.cache.unlock(hold)
        if not self.pool.can_alloc(slots):
            shared.stats.no_room += 1
            return None
        try:
            kv = shared.kv.import_kv(got.kv, d)
        except Exception as e:  # the host's code: a miss, never a half-made admission
            shared.codec_failed("import_kv", e)
            return None
        if kv is None:
            shared.stats.no_room += 1
            return None
        bad = _bad_imported_kv(kv, d)
        if bad is not None:  # the host's code broke its contract: a miss, its indices back to it
            if _bad_imported_kv(kv, int(getattr(kv, "shape", (0,))[0])) is None:
                self._give_back_kv(kv.to(torch.int64), hold)  # 1-D non-negative integers of the wrong count
            shared.codec_failed("import_kv", ValueError(bad))
            return None
        return got, kv

    @_exclusive
    def fetch_shared(
        self,
        cache_ids: KeyLike,
        *,
        namespace: Hashable = None,
        limit: int | None = None,
        rid: Hashable = None,
        now: float | None = None,
    ) -> MatchResult:
        """For a host that keeps its own slots (it calls :meth:`lookup`, not :meth:`admit`): ask the
        shared tier for a prefix of ``cache_ids`` deeper than the tree's match, at most ``limit``
        tokens deep (default: every id; cap them as for :meth:`lookup`) and a whole number of
        pages; a verified blob is filed into the tree (its KV through the tier's codec, its state
        cloned into a snapshot, announced to the policy and recorded by forensics) before the
        match is taken. Room is made for it through the policy, never on the local match's path:
        snapshots for its two slots, and the tree's KV when the manager owns the allocator or the
        codec says what the host's has free (``KVCodec``'s ``free_tokens``). Returns the match,
        as :meth:`lookup` (not locked, recency refreshed, never a snapshot a finding names: the
        store is asked past the one below it). No shared tier, a namespace the tier
        cannot address, a miss, or no room: the local match.
        Publications whose fences completed go out first. With ``rid`` and a :meth:`prefetch` of
        it, its answer is taken instead of asking the store now (not answered yet: the local
        match). O(match + blob).

        :raises TypeError, ValueError: bad ids, namespace or ``limit`` (outside ``[0, len(ids)]``).
            Nothing changed.
        """
        ck, ids = self._ids("(fetch_shared)", cache_ids)
        key = ids[: _depth_limit(ids, limit, ids.size)]
        m = self._served_match(key, namespace, touch=False, kv=False)  # a named snapshot: fetch past it
        shared = self.shared
        if shared is None or m.cached_length >= key.size or not shared.addressable(namespace):
            if shared is not None:
                shared.cancel(rid)  # the tree has it all: a prefetch's answer is not needed
            return self._served_match(key, namespace)
        if self._to_publish or shared.has_checks:
            self._publish_ready(False)
        t = self._now(now)
        blob = self._shared_blob(ids, namespace, m.cached_length, int(key.size), 2, t, m.node, True, rid)
        if blob is None:
            return self._served_match(key, namespace)
        got, kv = blob
        d = got.depth
        owner = RequestOwner(("shared-fetch", got.publisher))
        tmp = self.pool.alloc(owner)
        try:
            ready = self._write_fetched(got, tmp, owner, None)
            res = self.cache.insert(ids[:d], kv, state_slot=tmp, ready=ready, namespace=namespace)
        except BaseException:
            self.pool.free(tmp, owner)
            raise
        self.pool.free(tmp, owner, after=(self.pool.last_use(tmp),))  # behind the tree's clone of it
        if res.snapshot_created:
            if self.forensics is not None:
                self._record_donation(f"shared:{got.publisher}", res.node, ids[:d])
            # the policy hears of it as of a capture (the admission path's fetched hit does too)
            self.policy.donated(res.node, _request_info(ck, 0, 0, None, t), DonationReason.CAPTURE, t)
        shared.counted_hit(got, d - m.cached_length)
        return self._served_match(key, namespace)

    def _write_fetched(self, got: Fetched, slot: SlotId, owner: RequestOwner, stream: Stream | None) -> Fence:
        """A verified blob's state into ``slot``: from the prefetch's host copy, or the staging slot."""
        shared = self.shared
        assert shared is not None
        if got.state is not None:
            return self.pool.write(slot, got.state[0], got.state[1], owner=owner, stream=stream)
        stage, sslot, _ = shared.staging
        return self.pool.copy_from(stage, sslot, slot, dst_owner=owner, stream=stream)

    @_exclusive
    def prefetch(
        self, rid: Hashable, cache_ids: KeyLike, *, namespace: Hashable = None, limit: int | None = None
    ) -> bool:
        """When request ``rid`` arrives, before its admission: start the shared tier's probe and
        fetch for it on the tier's fetcher thread, past the tree's match now, at most ``limit``
        tokens deep (default: all ids but the last, as :meth:`admit` serves; for
        :meth:`fetch_shared`, its own ``limit``). Its :meth:`admit` (or ``fetch_shared(...,
        rid=rid)``) then takes the answer with one dictionary look-up, never waiting: a request
        admitted before the answer came is served from the tree alone (``shared_pending`` says
        whether it is still out). True when issued; False without a shared tier, for a namespace
        it cannot address, when the tree already holds the prefix, or when ``rid`` has one out.
        O(match).

        :raises TypeError, ValueError: bad ids, namespace or ``limit``. Nothing changed.
        """
        # NOTE: a view of the canonical bytes (checked in range), not an int64 copy: the tree's
        # match takes uint32 ids as a byte copy, and the tier widens them on its fetcher thread.
        # The arrival call went from ~90 to ~40 us for a 2,100-id list (benchmarks/bench_shared_probe.py).
        ids = _request_key(rid, cache_ids).ids
        n = _depth_limit(ids, limit, ids.size - 1)
        shared = self.shared
        if shared is None or not shared.addressable(namespace):
            return False
        m = self.cache.match(ids[:n], namespace=namespace, touch=False, kv=False)
        return shared.prefetch(rid, ids, namespace, m.cached_length, page=self.cache.page_size, limit=n)

    def shared_pending(self, rid: Hashable) -> bool:
        """Whether ``rid``'s :meth:`prefetch` is still unanswered (False without one). A host may
        hold the request back while it is (the answer usually comes within a store round trip).
        Thread-safe; O(1)."""
        return self.shared is not None and self.shared.prefetch_pending(rid)

    def _queue_publication(self, node: TreeNode, key: np.ndarray, namespace: Hashable, kv_after: Fence | None) -> None:
        shared = self.shared
        assert shared is not None
        if not shared.addressable(namespace):
            return
        q = self._to_publish
        q.append((node, key.copy(), namespace, kv_after))
        while len(q) > shared.max_pending:
            q.popleft()
            shared.stats.publish_skipped += 1

    def _publish_ready(self, wait: bool) -> int:
        """Publish the queued snapshots whose fences completed (all of them with ``wait``), once
        forensics heard what the tier's checks of earlier ones found."""
        shared = self.shared
        assert shared is not None
        q, n = self._to_publish, 0
        keep: deque[tuple[TreeNode, np.ndarray, Hashable, Fence | None]] = deque()
        fx = self.forensics
        self._take_checks()
        if fx is not None and q:
            fx.settle()  # a donation is published only once forensics has its fingerprint
        while q:
            item = q.popleft()
            node, key, ns, kv_after = item
            if node.snapshot is not None:
                pool, slot, fence = self.pool, node.snapshot, node.snapshot_fence
            elif node.host is not None and self.cache.host_pool is not None:
                pool, slot, fence = self.cache.host_pool, node.host, node.host_fence
            else:  # evicted before it could be published
                shared.stats.publish_skipped += 1
                continue
            if not wait and not (
                (fence is None or fence.is_complete())
                and (kv_after is None or kv_after.is_complete())
                and (fx is None or not fx.pending(node.id))
            ):
                keep.append(item)
                continue
            # Never written, or changed since its donation: not for other engines (a watched
            # snapshot written behind the tree's back after its fingerprint was taken was once
            # published with a fingerprint of the changed bytes, and other engines served it).
            # A finding already named: skipped here. Otherwise the tier compares the fingerprint
            # it takes of its copy (on its writer thread) with the donation's, and stores nothing
            # that differs; _take_checks hands the outcome to forensics. One read of the slot.
            expect = None
            if fx is not None:
                expect = fx.expected(node.id)  # waits its donation fingerprint: a finding first
                if fx.flagged(node.id):
                    shared.stats.publish_skipped += 1
                    continue
            n += shared.publish(
                key, ns, pool, slot, self.cache.kv_indices(node), kv_after, expect=expect, token=node.id
            )
        self._to_publish = keep
        return n

    def _take_checks(self) -> None:
        """Hand forensics what the shared tier's fingerprints of published copies found (a copy
        that differs from its donation's fingerprint was not stored: a ``changed`` finding)."""
        shared, fx = self.shared, self.forensics
        assert shared is not None
        if not shared.has_checks:
            return
        raised: SnapshotCorruption | None = None
        for check in shared.checks():
            if fx is not None and isinstance(check.token, int):
                try:
                    fx.compared(check.token, check.expected, check.found, "publish")
                except SnapshotCorruption as e:  # "raise" mode: every check recorded, the first raised
                    raised = raised or e
        if raised is not None:
            raise raised

    @_exclusive
    def publish_pending(self, *, wait: bool = False) -> int:
        """Publish the snapshots queued for the shared tier whose fences completed (every one with
        ``wait``, waiting their fences, and, with a background tier, until its writer stored
        them). The manager also does this at each admission. Returns the blobs stored: with
        ``wait``, those this call's publications added to the store (a copy refused for its
        fingerprint, an upload the store failed, a blob already there: not counted); without,
        with a background tier, those handed to its writer, which may still refuse or fail them
        (``stats`` of the tier say). 0 without a shared tier.

        :raises SnapshotCorruption: forensics in ``"raise"`` mode and the tier refused a
            publication whose copy differed from its donation's fingerprint (every check recorded,
            the first raised, once)."""
        shared = self.shared
        if shared is None:
            return 0
        if not wait:
            return self._publish_ready(False)
        # NOTE: until 2026-12-08 this counted the blobs handed to a background writer, those it
        # then refused included. The writer is drained first, so that what it stores from here
        # on is this call's.
        shared.flush()
        before = shared.stats.published
        self._publish_ready(True)
        shared.flush()
        self._take_checks()
        return shared.stats.published - before

    def _shared_rejected(self, rej: Rejection) -> None:
        if self.forensics is not None:
            self.forensics.shared_rejected(rej.reason.value, rej.key, rej.depth, rej.publisher, rej.expected, rej.found)

    # ------------------------------------------------------------------ plans
    def _pick(self, rec: _Request, depths: Iterable[int], start: int, end: int, budget: int) -> list[int]:
        """Policy depths cut to the page, inside ``(start, end]``, beyond the tree's, at most ``budget``."""
        page = self.cache.page_size
        out: list[int] = []
        for d in depths:
            d -= d % page
            if start < d <= end and d > rec.kv_held and d not in out:
                out.append(d)
                if len(out) == budget:
                    break
        out.sort()
        return out

    def _plan(self, rec: _Request, start: int, end: int, depths: list[int], final: int, decode: bool) -> WindowPlan:
        full = rec.kv_full
        table = None if full is None else full[:end]
        window = None if table is None else table[start:]
        if not depths and not final:  # the common decode step: nothing to capture
            rec.final = None
            rec.plan = plan = WindowPlan(rec.rid, start, end, (), (), rec.live, decode, id(self), window, table)
            return plan
        free = [s for s in rec.tracks if rec.pending is None or s != rec.pending[0].slot]
        caps = [Capture(d, s) for d, s in zip(depths, free, strict=False)]
        rec.final = None
        if final:
            slot = (
                rec.pending[0].slot if rec.pending is not None else (free[len(caps)] if len(free) > len(caps) else None)
            )
            if slot is not None:
                rec.final = Capture(final, slot)
                caps.append(rec.final)
        last_use = self.pool.last_use
        if self.write_checks:  # NaN probes the host's write must cover (checked when the request ends)
            stream, mark = self.stream or self.cache.stream, self.pool.mark_unwritten
            after = tuple(mark(c.slot, owner=rec.owner, stream=stream, after=(last_use(c.slot),)) for c in caps)
        else:
            after = tuple(last_use(c.slot) for c in caps)
        plan = WindowPlan(
            rec.rid,
            start,
            end,
            tuple(caps),
            after,
            rec.live,
            decode,
            id(self),
            window,
            table,
        )
        rec.plan = plan
        return plan

    def _reserve(self, wants: list[tuple[_Request, int]]) -> None:
        """Grow each request's KV to cover ``[0, end)`` from the allocator, evicting the tree's
        unlocked KV through the policy when it runs short. All or nothing.

        :raises KVExhausted: not enough even with every unlocked KV token evicted (then nothing
            was evicted or allocated)."""
        kv = self.kv
        assert kv is not None
        grow = [(rec, end - int(rec.kv_full.numel())) for rec, end in wants if rec.kv_full is not None]
        grow = [(rec, g) for rec, g in grow if g > 0]
        if not grow:
            return
        n = sum(g for _, g in grow)
        if kv.num_free < n:
            if kv.num_free + self.cache.evictable_kv_tokens < n:
                raise KVExhausted(
                    f"{n} KV indices needed for request {grow[0][0].rid!r}'s window, {kv.num_free} free and "
                    f"{self.cache.evictable_kv_tokens} evictable in the tree",
                    needed=n,
                    free=kv.num_free,
                )
            self._evict_kv(n - kv.num_free, self._now(None), None)
        got = kv.alloc(n)
        if got is None:
            raise KVExhausted(
                f"{n} KV indices needed, {kv.num_free} free after evicting the tree's unlocked KV",
                needed=n,
                free=kv.num_free,
            )
        i = 0
        for rec, g in grow:
            assert rec.kv_full is not None
            rec.kv_full = torch.cat([rec.kv_full, got[i : i + g]])
            i += g

    def _check_open(self, rec: _Request) -> None:
        plan = rec.plan
        if plan is not None:
            what = f"[{plan.start}, {plan.end})" if isinstance(plan, WindowPlan) else "a decode batch"
            raise ProtocolError(f"request {rec.rid!r} has a window {what} planned and not committed")

    @_exclusive
    def plan_prefill(self, rid: Hashable, end: int) -> WindowPlan:
        """Plan the prefill window over prompt tokens ``[computed, end)``, where ``computed`` is the
        request's committed length (its hit, then each committed window's end).

        Captures are the policy's depths in ``(computed, end]``, cut down to the page size, beyond
        the snapshots the request already donated, at most ``track_slots``, ascending. Changes
        only the request's open plan. O(captures).

        :raises UnknownRequest: unknown rid. :raises ProtocolError: a window is open.
        :raises ValueError: ``end`` not an int in ``(computed, prompt length]``. Nothing changed.
        """
        rec = self._get(rid)
        self._check_open(rec)
        n = rec.info.prompt_len
        if isinstance(end, bool) or not isinstance(end, (int, np.integer)) or not rec.computed < end <= n:
            raise ValueError(
                f"prefill window end {end!r} of request {rid!r} must be an int in ({rec.computed}, {n}] "
                f"(committed {rec.computed} of {n} prompt tokens)"
            )
        end = int(end)
        if rec.kv_full is not None:
            self._reserve([(rec, end)])
        depths = self._pick(
            rec, self.policy.captures(rec.info, rec.computed, end, decode=False), rec.computed, end, self.track_slots
        )
        self._counters.captures_planned["prefill"] += len(depths)
        return self._plan(rec, rec.computed, end, depths, 0, False)

    def plan_decode(self, rid: Hashable, new_ids: KeyLike) -> WindowPlan:
        """Plan a decode window: the request consumes ``new_ids`` (cache ids of generated tokens)
        after everything committed so far; the prompt must be fully committed.

        Captures are the policy's decode depths, as for :meth:`plan_prefill`; and when the window
        ends on a page boundary with the page size above 1 and the policy keeps final states, one
        more capture at the window's end, held back: :meth:`finish` donates the deepest such
        capture when the final length is not page aligned (so the next turn of a conversation hits
        there). O(captures + len(new_ids)).

        :raises UnknownRequest: unknown rid. :raises ProtocolError: a window is open, or the
            prompt is not fully committed. :raises ValueError: bad or empty ids. Nothing changed.
        """
        # NOTE: the guard is inlined on the two per-step calls (plan_decode, commit): a decorator's
        # extra frame is a third of their cost (benchmarks/bench_manager.py).
        if not self._guard.acquire(False):
            raise _busy("plan_decode")
        try:
            return self._plan_decode(rid, new_ids)
        finally:
            self._guard.release()

    def _plan_decode(self, rid: Hashable, new_ids: KeyLike) -> WindowPlan:
        rec, new = self._check_decode(rid, new_ids)
        if rec.kv_full is not None:
            self._reserve([(rec, rec.computed + len(new))])
        return self._apply_decode(rec, new)

    def _check_decode(self, rid: Hashable, new_ids: KeyLike) -> tuple[_Request, list[int]]:
        """Validate a decode window; change nothing."""
        rec = self._get(rid)
        if rec.plan is not None:
            self._check_open(rec)
        if rec.computed < rec.info.prompt_len:
            raise ProtocolError(
                f"request {rid!r}: decode planned with {rec.computed} of {rec.info.prompt_len} prompt tokens committed"
            )
        new = _small_ids(new_ids)
        if new is None:
            new = np.frombuffer(key_bytes(new_ids), dtype=np.uint32).tolist()
        if not new:
            raise ValueError(f"request {rid!r}: a decode window needs at least one id")
        return rec, new

    def _apply_decode(self, rec: _Request, new: list[int]) -> WindowPlan:
        start = rec.computed
        end = start + len(new)
        rec.out += new
        page = self.cache.page_size
        policy = self.policy
        wanted = policy.captures(rec.info, start, end, decode=True) if policy.decode_captures else None
        if not wanted and (page == 1 or end % page):  # the common decode step: nothing to capture
            return self._plan(rec, start, end, [], 0, True)
        depths = self._pick(rec, wanted, start, end, self.track_slots) if wanted else []
        # Held back for finish: the deepest page-aligned state, when the final length may not be.
        aligned = page > 1 and end % page == 0 and end > rec.kv_held and end not in depths
        final = end if aligned and policy.donate_finish(rec.info) else 0
        c = self._counters.captures_planned
        c["decode"] += len(depths)
        plan = self._plan(rec, start, end, depths, final, True)
        if rec.final is not None:
            c["final"] += 1
        return plan

    def plan_decode_batch(self, rids: Sequence[Hashable], new_ids: Sequence[int]) -> DecodeBatchPlan:
        """Plan one decode window of one id for each request of a batch (``new_ids[i]`` for
        ``rids[i]``): what :meth:`plan_decode` would plan for each, in one call. A request whose
        window carries captures gets its :class:`WindowPlan` in ``result.plans``; the others (the
        common case) need nothing but the batch. All or nothing: when any request's window is
        refused, nothing is planned. O(batch).

        :raises ValueError: lengths differ, a request twice, an id not an int in ``[0, 2**31)``.
        Otherwise as :meth:`plan_decode`. Nothing changed.
        """
        if not self._guard.acquire(False):
            raise _busy("plan_decode_batch")
        try:
            return self._plan_decode_batch(rids, new_ids)
        finally:
            self._guard.release()

    def _plan_decode_batch(self, rids: Sequence[Hashable], new_ids: Sequence[int]) -> DecodeBatchPlan:
        if len(rids) != len(new_ids):
            raise ValueError(f"{len(rids)} requests but {len(new_ids)} ids")
        get = self._requests.get
        recs: list[_Request] = []
        for rid, t in zip(rids, new_ids, strict=True):
            try:
                rec = get(rid)
            except TypeError:  # unhashable
                rec = None
            if rec is None or rec.plan is not None or rec.computed < rec.info.prompt_len:
                self._check_decode(rid, [t])  # raises the precise error
            if type(t) is not int or not 0 <= t < MAX_ID:
                raise ValueError(f"decode id {t!r} of request {rid!r} is not an int in [0, 2**31)")
            assert rec is not None
            recs.append(rec)
        if len({id(r) for r in recs}) != len(recs):
            raise ValueError("a request appears twice in one decode batch")
        if self.kv is not None:
            self._reserve([(r, r.computed + 1) for r in recs])
        # Validated (and the KV reserved): from here on nothing raises.
        page = self.cache.page_size
        quiet = not self.policy.decode_captures
        plans: dict[Hashable, WindowPlan] = {}
        plain: list[_Request] = []  # nothing to capture: their open window is the batch itself
        for rec, t in zip(recs, new_ids, strict=True):
            end = rec.computed + 1
            if quiet and (page == 1 or end % page):
                rec.out.append(t)
                rec.final = None
                plain.append(rec)
            else:
                plan = self._apply_decode(rec, [t])  # opens the request's own plan
                if plan.captures:
                    plans[rec.rid] = plan
                else:
                    plain.append(rec)
        after = tuple(f for p in plans.values() for f in p.after)
        if self.kv is None:
            batch = DecodeBatchPlan(tuple(rids), plans, after, id(self))
        else:
            tables = tuple(r.kv_full[: r.computed + 1] for r in recs if r.kv_full is not None)
            at = torch.tensor([int(t[-1]) for t in tables], dtype=torch.int64)
            batch = DecodeBatchPlan(tuple(rids), plans, after, id(self), at, tables)
        for rec in plain:
            rec.plan = batch
        return batch

    # ------------------------------------------------------------------ commit
    def commit(
        self,
        plan: WindowPlan,
        ready: Fence | None,
        *,
        kv_indices: torch.Tensor | np.ndarray | Sequence[int] | None = None,
        now: float | None = None,
    ) -> WindowResult:
        """Commit a planned window: the host's forward over it was submitted, ``ready`` is its fence.

        Records the window's KV indices (one per token of ``[plan.start, plan.end)``), then donates
        each capture: the tree clones its slot behind ``ready`` into a slot it owns
        (copy-on-donate; with ``barrier="device"`` after a device synchronize), inserts the KV up
        to its depth and splices its own pages into the request's KV table; the request's lock
        moves to the deepest new snapshot. A capture the pool has no slot for, even after
        evicting through the policy, is skipped (a lost hit, never a wrong one).

        :param ready: the window's forward fence (``None``: the host's work already completed).
        :param kv_indices: the window's KV indices, one per token; given by a host that keeps its
            own tables, never with a manager that owns the KV (its plan said where they are).
        :param now: seconds, for the policy (default: the manager's clock).
        :raises ProtocolError: ``plan`` is not this manager's open plan of a live request.
        :raises TypeError: ``ready`` not a fence. :raises ValueError: ``kv_indices`` not 1-D
            integers, one per window token (or given, or missing, against ``kv=``). Nothing changed.
        """
        if not self._guard.acquire(False):
            raise _busy("commit")
        try:
            return self._commit(plan, ready, kv_indices, now)
        finally:
            self._guard.release()

    def _commit(
        self,
        plan: WindowPlan,
        ready: Fence | None,
        kv_indices: torch.Tensor | np.ndarray | Sequence[int] | None,
        now: float | None,
    ) -> WindowResult:
        _check_fence(ready)
        rec = self._check_plan(plan)
        self._check_kv_arg(kv_indices)
        t = None if now is None and not plan.captures else self._now(now)  # the clock only when a policy hears it
        if kv_indices is None:  # the manager's own table holds the window's indices
            return self._apply_commit(rec, plan, ready, None, None, t)
        n = plan.end - plan.start
        small = _small_kv(kv_indices, n)
        kv = _as_window_kv(kv_indices, n) if small is None else None
        return self._apply_commit(rec, plan, ready, small, kv, t)

    def _check_kv_arg(self, kv_indices: object) -> None:
        """:raises ValueError: KV indices given to a manager that owns the KV, or missing."""
        if self.kv is not None and kv_indices is not None:
            raise ValueError("this manager owns the KV (kv=): commit takes no kv_indices, the plan said where they are")
        if self.kv is None and kv_indices is None:
            raise ValueError("commit needs the window's kv_indices (or a manager built with kv=)")

    def _check_plan(self, plan: WindowPlan) -> _Request:
        """The request whose open plan ``plan`` is; change nothing."""
        if type(plan) is not WindowPlan:
            raise TypeError(f"commit takes the WindowPlan from plan_prefill/plan_decode, got {type(plan).__name__}")
        if plan.manager_id != id(self):
            raise ProtocolError(f"plan of request {plan.rid!r} was made by another manager")
        rec = self._requests.get(plan.rid)
        if rec is None or rec.plan is not plan:
            raise ProtocolError(
                f"plan [{plan.start}, {plan.end}) of request {plan.rid!r} is not open (committed twice, or stale)"
            )
        return rec

    def _apply_commit(
        self,
        rec: _Request,
        plan: WindowPlan,
        ready: Fence | None,
        small: list[int] | None,
        kv: torch.Tensor | None,
        now: float | None,
    ) -> WindowResult:
        """Commit a validated window. Nothing here raises (but the allocator's ``free``)."""
        rec.plan = None
        if small is not None:
            rec.kv_tail += small
        elif kv is not None:
            if rec.kv_tail:
                rec.kv_parts.append(torch.tensor(rec.kv_tail, dtype=torch.int64))
                rec.kv_tail = []
            rec.kv_parts.append(kv)
        rec.computed = plan.end
        if ready is not None:
            rec.last_write[rec.live] = ready
            for c in plan.captures:
                rec.last_write[c.slot] = ready
        full = rec.kv_full
        if not plan.captures:
            return WindowResult(
                (), rec.kv_held, False, _EMPTY_KV, COMPLETE, None if full is None else full[: rec.computed]
            )
        t = now
        assert t is not None, "the caller reads the clock for a window with captures"
        donated: list[int] = []
        freed: list[torch.Tensor] = []
        for c in plan.captures:
            if c is rec.final:
                rec.pending = (c, ready)
                continue
            node = self._donate(rec, c.depth, c.slot, ready, DonationReason.CAPTURE, t, freed)
            if node is not None:
                donated.append(c.depth)
        rec.final = None
        free = _EMPTY_KV if not freed else (freed[0] if len(freed) == 1 else torch.cat(freed))
        after = ready if ready is not None else COMPLETE
        full = rec.kv_full
        if full is None:
            return WindowResult(tuple(donated), rec.kv_held, bool(donated), free, after)
        if free.numel():
            self._free_kv(free, after)
        return WindowResult(tuple(donated), rec.kv_held, bool(donated), _EMPTY_KV, after, full[: rec.computed])

    def commit_batch(
        self,
        batch: DecodeBatchPlan,
        ready: Fence | None,
        *,
        kv_indices: torch.Tensor | np.ndarray | Sequence[int] | None = None,
        now: float | None = None,
    ) -> DecodeBatchResult:
        """Commit a planned decode batch (one forward, fence ``ready``): ``kv_indices[i]`` is the
        KV index of the token of ``batch.rids[i]``. The requests with a plan in ``batch.plans``
        are committed as :meth:`commit` does; the others only record their token. All or nothing:
        everything is validated before the first request is committed. O(batch).

        With a manager that owns the KV, pass no ``kv_indices`` (the batch plan said where they are).

        :raises ProtocolError: not this manager's open batch. :raises TypeError: ``ready`` not a
            fence. :raises ValueError: ``kv_indices`` not one integer per request (or given, or
            missing, against ``kv=``). Nothing changed.
        """
        if not self._guard.acquire(False):
            raise _busy("commit_batch")
        try:
            return self._commit_batch(batch, ready, kv_indices, now)
        finally:
            self._guard.release()

    def _commit_batch(
        self,
        batch: DecodeBatchPlan,
        ready: Fence | None,
        kv_indices: torch.Tensor | np.ndarray | Sequence[int] | None,
        now: float | None,
    ) -> DecodeBatchResult:
        if type(batch) is not DecodeBatchPlan:
            raise TypeError(f"commit_batch takes the DecodeBatchPlan of plan_decode_batch, got {type(batch).__name__}")
        if batch.manager_id != id(self):
            raise ProtocolError("decode batch was planned by another manager")
        _check_fence(ready)
        self._check_kv_arg(kv_indices)
        get, plans = self._requests.get, batch.plans
        t = None if now is None and not any(p.captures for p in plans.values()) else self._now(now)
        recs: list[_Request] = []
        for rid in batch.rids:
            rec = get(rid)
            if rec is None or (rec.plan is not batch and rec.plan is not plans.get(rid, batch)):
                raise ProtocolError(f"decode batch of request {rid!r} is not open (committed twice, or stale)")
            recs.append(rec)
        ids: list[int | None] = [None] * len(recs)
        if kv_indices is not None:
            ids = _as_window_kv(kv_indices, len(recs)).tolist()
        # Validated: from here on nothing raises.
        results: dict[Hashable, WindowResult] = {}
        for rec, i in zip(recs, ids, strict=True):
            plan = plans.get(rec.rid)
            if plan is not None:
                results[rec.rid] = self._apply_commit(rec, plan, ready, None if i is None else [i], None, t)
                continue
            rec.plan = None
            if i is not None:
                rec.kv_tail.append(i)
            rec.computed += 1
            if ready is not None:
                rec.last_write[rec.live] = ready
        freed = [r.free_kv for r in results.values() if r.free_kv.numel()]
        free = _EMPTY_KV if not freed else torch.cat(freed)
        return DecodeBatchResult(results, free, ready if ready is not None else COMPLETE)

    def _table(self, rec: _Request) -> torch.Tensor:
        if rec.kv_full is not None:
            return rec.kv_full[: rec.computed]
        parts = rec.kv_parts
        if rec.kv_tail:
            parts.append(torch.tensor(rec.kv_tail, dtype=torch.int64))
            rec.kv_tail = []
        if len(parts) != 1:
            rec.kv_parts = parts = [torch.cat(parts) if parts else _EMPTY_KV]
        return parts[0]

    def _key(self, rec: _Request, depth: int) -> np.ndarray:
        if rec.out:
            rec.ids = np.concatenate([rec.ids, np.asarray(rec.out, dtype=np.int64)])
            rec.out = []
        return rec.ids[:depth]

    def _donate(
        self,
        rec: _Request,
        depth: int,
        slot: int,
        ready: Fence | None,
        reason: DonationReason,
        now: float,
        freed: list[torch.Tensor],
    ) -> TreeNode | None:
        """Clone ``slot`` (the state after ``depth`` tokens) into the tree; splice the tree's KV
        into the request's table; collect duplicates in ``freed``. None when nothing was donated."""
        if self.barrier == "device":
            if ready is not None:
                ready.wait()
            device_synchronize(self.pool.device)
        key = self._key(rec, depth)
        ns = rec.namespace
        if (
            not self.pool.can_alloc(1)
            and self.cache.match(key, namespace=ns, touch=False, kv=False).cached_length != depth
        ):
            self._evict_snapshots(1, now, EvictionReason.DONATION)
        table = self._table(rec)
        try:
            res = self.cache.insert(
                key, table[:depth], state_slot=slot, ready=ready, namespace=ns, release_duplicates=False
            )
        except PoolExhausted:
            # NOTE: no slot for the clone: nothing is inserted at all. Inserting the KV alone would
            # hand the host tree indices beyond its lock, which an eviction could free under it.
            self._counters.donations_skipped[SkipReason.NO_SLOT.value] += 1
            return None
        node = res.node
        if res.released.numel():
            freed.append(res.released)
        if res.snapshot_created:
            if self.write_checks and slot != rec.live:
                rec.unverified.append(node)
            self._counters.donations[reason.value] += 1
            if self.forensics is not None:
                self._record_donation(rec.rid, node, key)
            if self.shared is not None:
                self._queue_publication(node, key, ns, ready)
        else:
            self._counters.donations_skipped[SkipReason.HELD.value] += 1
        if node.depth > rec.lock.depth:
            self.cache.relock(rec.lock, node)
            rec.lock = node
        rec.kv_held = max(rec.kv_held, depth)
        if rec.kv_full is not None:  # the tree's pages, then the request's own and its reservation
            rec.kv_full = torch.cat([self.cache.kv_indices(node), rec.kv_full[depth:]])
        else:
            rec.kv_parts = [self.cache.kv_indices(node), table[depth:]]
        if res.snapshot_created:
            self.policy.donated(node, rec.info, reason, now)
        return node

    def _record_donation(self, donor: Hashable, node: TreeNode, key: np.ndarray | bytes | memoryview) -> None:
        """Tell forensics of ``node``'s new snapshot, filed under ``key`` (its ids, or their
        canonical bytes: NOTE: a checkpoint passes a view of the bytes it has, since forensics
        digests the key only for the one donation in ten it watches; converting int64 ids cost
        ~12 us). The nearest snapshot ancestor is found only for a watched donation."""
        fx = self.forensics
        assert fx is not None and node.snapshot is not None
        fx.donated(
            node.id,
            node.depth,
            key if isinstance(key, (bytes, memoryview)) else key_bytes(key),
            node.snapshot,
            donor,
            node.snapshot_fence,
            lambda: _nearest_snapshot(self.cache, node),
        )

    # --------------------------------------------------------------- eviction
    def _evict_snapshots(self, n: int, now: float, why: EvictionReason) -> EvictResult:
        kv = snaps = removed = 0
        while snaps < n:
            r = self._evict_one(now, False)
            if r is None:
                break
            kv, snaps, removed = kv + r.kv_tokens, snaps + r.snapshots, removed + r.nodes_removed
        self._counters.evictions[why.value] += snaps
        self._counters.evicted_kv_tokens += kv
        return EvictResult(kv, snaps, removed)

    def _evict_one(self, now: float, kv: bool) -> EvictResult | None:
        """One snapshot through the policy (a leaf when ``kv``), else the tree's LRU; None: none left."""
        victim = self.policy.victim(now, kv=kv)
        if victim is None:
            r = self.cache.evict(kv_tokens=1) if kv else self.cache.evict(snapshots=1)
            return r if r.snapshots or r.kv_tokens else None
        if not self.cache.is_evictable(victim) or (kv and not victim.is_leaf):
            raise RuntimeError(
                f"policy {self.policy.name!r} chose {victim!r}, which is not an evictable "
                f"{'leaf ' if kv else ''}snapshot (a policy bug)"
            )
        return self.cache.evict_snapshot(victim, demote=not kv)  # KV pressure: the leaf goes

    @_exclusive
    def evict(
        self,
        *,
        snapshots: int = 0,
        kv_tokens: int = 0,
        now: float | None = None,
        keep: KeyLike | None = None,
        namespace: Hashable = None,
    ) -> EvictResult:
        """Free at least ``snapshots`` snapshots and ``kv_tokens`` KV tokens, in the policy's order
        (or as many as are evictable). Call it when the host's KV allocator runs short (the KV goes
        to the host's allocator as the tree's ``KV_FREED`` events; reuse it for work ordered
        after this call) or to hold a byte budget. Locked snapshots and their paths are never
        touched. O(log n) per snapshot for heap policies.

        :param keep: the ids of a request about to be admitted: the hit :meth:`can_admit` reports
            for them (in ``namespace``) is protected during this eviction, so the dry run's
            ``cached_length`` still holds afterwards. Without it, making room for a request can
            evict the very prefix it was going to hit, and the KV it needs grows.
        :raises ValueError: a negative or non-integer amount, bad ``keep`` ids. Nothing changed.
        :raises TypeError: ``keep`` or ``namespace`` of the wrong type. Nothing changed.
        """
        for name, v in (("snapshots", snapshots), ("kv_tokens", kv_tokens)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"evict {name} must be an int >= 0, got {v!r}")
        hold: TreeNode | None = None
        if keep is not None:
            m = self._match(_request_key("(evict keep)", keep), namespace)
            hold = m.node if m.cached_length else None
        t = self._now(now)
        if hold is not None:
            self.cache.lock(hold)  # released below: the hit is kept only for this eviction
        try:
            out = self._evict_snapshots(int(snapshots), t, EvictionReason.HOST) if snapshots else EvictResult(0, 0, 0)
            more = self._evict_kv(kv_tokens - out.kv_tokens, t, None) if out.kv_tokens < kv_tokens else None
        finally:
            if hold is not None:
                self.cache.unlock(hold)
        if more is None:
            return out
        return EvictResult(
            out.kv_tokens + more.kv_tokens, out.snapshots + more.snapshots, out.nodes_removed + more.nodes_removed
        )

    def _evict_kv(self, n: int, now: float, hold: TreeNode | None) -> EvictResult:
        """Free at least ``n`` KV tokens through the policy (leaves), then the tree's LRU, keeping
        ``hold`` (locked for the eviction)."""
        if hold is not None:
            self.cache.lock(hold)
        kv = snaps = removed = 0
        try:
            while kv < n:
                r = self._evict_one(now, True)
                if r is None:
                    break
                kv, snaps, removed = kv + r.kv_tokens, snaps + r.snapshots, removed + r.nodes_removed
                self._counters.evictions[EvictionReason.KV_PRESSURE.value] += r.snapshots
                self._counters.evicted_kv_tokens += r.kv_tokens
        finally:
            if hold is not None:
                self.cache.unlock(hold)
        return EvictResult(kv, snaps, removed)

    def verify_all(self) -> int:
        """Verify every snapshot's fingerprint against its donation (forensics only).

        :returns: snapshots checked. :raises radixcache.SnapshotCorruption: in ``raise`` mode.
        :raises RuntimeError: forensics is off.
        """
        if self.forensics is None:
            raise RuntimeError("verify_all needs CacheManager(..., forensics=Forensics(...))")
        return self.forensics.verify_all()

    # ------------------------------------------------ hosts that keep their own slots
    # An engine whose scheduler allocates each request's state slot and KV itself (SGLang's, vLLM's)
    # calls the cache at its own points: a match at admission, a checkpoint when a chunk or the
    # request ends, lock references on the nodes it holds. These calls give it the tree through the
    # manager, so the policy, the metrics, forensics and the shared tier hear of everything, and no
    # host drives the tree or the policy itself.

    @_exclusive
    def lookup(
        self, cache_ids: KeyLike, *, namespace: Hashable = None, touch: bool = True, kv: bool = True
    ) -> MatchResult:
        """The deepest cached snapshot on the path of ``cache_ids`` (every id: cap them yourself),
        as :meth:`HybridRadixCache.match`; an empty key gives ``namespace``'s root. ``touch``
        refreshes the recency of what it returns; ``kv=False`` leaves ``result.kv_indices``
        empty (a host reading the hit's KV later through the tree's ``kv_indices`` or
        ``kv_into`` of ``result.node``). Locks nothing: :meth:`lock` the node before an eviction
        could remove it. O(match).

        A snapshot a finding of forensics names (``forensics.flagged``) is never the result: the
        lookup takes the next snapshot up its path (or the root), and the named one is dropped
        (or, while a lock holds it, dropped once none does), counted in
        ``metrics().refused_hits``, as :meth:`admit` does. One found changed only by the
        :meth:`restore` that reads it is refused there (:class:`SnapshotRefused`): look up again.

        :raises TypeError, ValueError: bad ids or an unhashable namespace. Nothing changed.
        """
        return self._served_match(cache_ids, namespace, touch=touch, kv=kv)

    def _served_match(self, key: KeyLike, namespace: Hashable, *, touch: bool = True, kv: bool = True) -> MatchResult:
        """The tree's match of ``key``, moved past the snapshots findings name (each refused:
        dropped, or condemned while locked), as :meth:`lookup` and :meth:`fetch_shared` return it."""
        m = self.cache.match(key, namespace=namespace, touch=touch, kv=kv)
        fx = self.forensics
        if fx is not None and m.cached_length and fx.flagged(m.node.id):
            m = self._skip_flagged(m, refuse=True)
            if self._condemned:
                self._sweep_condemned()
        return m

    @_exclusive
    def lock(self, node: TreeNode) -> None:
        """Hold ``node`` (one :meth:`lookup` or :meth:`checkpoint` returned): its snapshot and its
        path's KV survive every eviction until :meth:`unlock`. Locks nest.

        :raises ValueError: ``node`` was evicted or holds no snapshot. :raises ForeignObjectError:
            another tree's node. Nothing changed.
        """
        self.cache.lock(node)

    @_exclusive
    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` of ``node``.

        :raises LockError: ``node`` is not locked. :raises ForeignObjectError: another tree's node.
            Nothing changed.
        """
        self.cache.unlock(node)
        if self._condemned:
            self._sweep_condemned()

    @_exclusive
    def relock(self, old: TreeNode, new: TreeNode) -> None:
        """Move one lock from ``old`` to ``new`` (:meth:`lock` of ``new``, then :meth:`unlock` of
        ``old``, in one walk: a request's hold moving to the snapshot its checkpoint filed), as
        :meth:`HybridRadixCache.relock`.

        :raises ValueError: ``new`` was evicted or holds no snapshot. :raises LockError: ``old`` is
            not locked. :raises ForeignObjectError: another tree's node. Nothing changed.
        """
        self.cache.relock(old, new)
        if self._condemned:
            self._sweep_condemned()

    @_exclusive
    def kv_prefix(self, cache_ids: KeyLike, *, namespace: Hashable = None) -> torch.Tensor:
        """The tree's KV indices for the longest page-cut prefix of ``cache_ids`` it holds KV for
        (past the deepest snapshot, into an edge), 1-D int64, as
        :meth:`HybridRadixCache.kv_prefix`: for a host that copies only the KV the tree lacks
        before it files a prefix. Reads only. O(nodes on the path).

        :raises TypeError, ValueError: bad ids or namespace. Nothing changed.
        """
        return self.cache.kv_prefix(cache_ids, namespace=namespace)

    @_exclusive
    def discard(self, node: TreeNode) -> EvictResult:
        """Drop ``node``'s snapshot now, on the device or in the host tier, never demoting it:
        the host's own check of the bytes failed, so no later lookup serves it (a snapshot a
        finding of forensics names needs no call: the manager refuses and drops it itself). A
        leaf goes with its KV (cascading), an inner node stays a tombstone, as any eviction; the
        policy and forensics hear of it through the tree's events. Counted as
        :attr:`EvictionReason.CORRUPT`.

        :raises TypeError: ``node`` not a ``TreeNode``. :raises ForeignObjectError: another
            tree's node. :raises ValueError: ``node`` holds no snapshot.
            :raises LockError: ``node`` is locked (unlock it first). Nothing changed.
        """
        if not isinstance(node, TreeNode):
            raise TypeError(f"node must be a TreeNode (lookup returns one), got {type(node).__name__}")
        return self._discard(node)

    def _discard(self, node: TreeNode) -> EvictResult:
        r = self.cache.discard(node)
        self._counters.evictions[EvictionReason.CORRUPT.value] += r.snapshots
        self._counters.evicted_kv_tokens += r.kv_tokens
        self._condemned.pop(node.id, None)
        return r

    # ------------------------------------------------- snapshots a finding named
    # NOTE: forensics in "record" mode (the default, sampled) reports a snapshot it finds changed
    # or never written and goes on; until 2026-12-07 the manager then restored it anyway, and a
    # later hit of it passed (its fingerprint "reported once"). A snapshot a finding names is now
    # never served: an admission falls back up the path, restore and serve_in_place raise
    # SnapshotRefused, and the snapshot is dropped (at once, or once no lock holds it).

    @staticmethod
    def _shallower(m: MatchResult) -> MatchResult:
        """``m``'s hit moved to the next snapshot up its path (device or host tier), or to its
        root (a miss). Changes nothing."""
        anc = m.node.parent
        while anc is not None and anc.depth > 0 and anc.snapshot is None and anc.host is None:
            anc = anc.parent
        assert anc is not None, f"{m.node!r} is not in the tree"
        d = anc.depth
        return MatchResult(d, m.token_length, m.kv_indices[:d], anc, anc.snapshot)

    def _skip_flagged(self, m: MatchResult, *, refuse: bool) -> MatchResult:
        """``m`` moved up its path past every snapshot a finding names (each refused: dropped, or
        condemned while locked, when ``refuse``)."""
        fx = self.forensics
        assert fx is not None
        while m.cached_length and fx.flagged(m.node.id):
            up = self._shallower(m)
            if refuse:
                self._refuse(m.node)
            m = up
        return m

    def _verified_hit(self, m: MatchResult, rid: Hashable, live: SlotId) -> MatchResult:
        """Forensics' verification of the admission's hit ``m`` (locked) before its restore into
        ``live``; while a finding names the hit, the next snapshot up the path, the lock moved
        to it (verified in turn), the refused one dropped or condemned. Raises as forensics does
        in ``"raise"`` mode."""
        fx = self.forensics
        assert fx is not None
        while m.cached_length:
            node = m.node
            fx.before_restore(node.id, rid, live)
            if not fx.flagged(node.id):
                return m
            up = self._skip_flagged(self._shallower(m), refuse=True)
            self.cache.relock(node, up.node)
            self._refuse(node)
            m = up
            if m.cached_length:
                self.cache.touch(m.node)
        return m

    def _refuse(self, node: TreeNode) -> None:
        """``node``'s snapshot, named by a finding, was not served: dropped now, or condemned
        until no lock holds it (:meth:`_sweep_condemned`, at :meth:`unlock`, :meth:`relock` and
        each admission). Counted once per snapshot."""
        if node.id in self._condemned:
            return
        self._counters.refused_hits += 1
        if node.snap_lock:
            self._condemned[node.id] = node
        else:
            self._discard(node)

    def _refused(self, node: TreeNode) -> SnapshotRefused:
        """The error a host's restore of ``node`` gets, once the snapshot is refused."""
        fx = self.forensics
        finding = fx.finding(node.id) if fx is not None else None
        depth = node.depth
        self._refuse(node)
        return SnapshotRefused(node.id, depth, finding.kind if finding is not None else "corrupt")

    def _sweep_condemned(self) -> None:
        """Drop the condemned snapshots no lock holds any more (one gone already, or replaced by
        a new donation no finding names, is forgotten)."""
        fx = self.forensics
        for nid, node in list(self._condemned.items()):
            gone = node.parent is None or (node.snapshot is None and node.host is None)
            if gone or fx is None or not fx.flagged(nid):
                del self._condemned[nid]
            elif not node.snap_lock:
                self._discard(node)

    @_exclusive
    def make_room(self, *, keep: TreeNode | None = None, now: float | None = None) -> bool:
        """Whether the pool has a free slot, evicting one snapshot through the policy first when it
        has none; ``keep`` (a node about to be restored) is held during that eviction.

        :raises TypeError: ``keep`` not a ``TreeNode``. :raises ForeignObjectError: another tree's
            node. :raises ValueError: ``keep`` cannot be locked. Nothing changed.
        """
        if keep is not None and not isinstance(keep, TreeNode):
            raise TypeError(f"keep must be a TreeNode (lookup returns one), got {type(keep).__name__}")
        if keep is not None and keep.cache is not self.cache:
            raise ForeignObjectError(f"keep is node {keep.id} of another tree")
        if self.pool.num_free:  # NOTE: one count when there is room (a host allocator's call each)
            return True
        t = self._now(now)
        if keep is not None:
            self.cache.lock(keep)
        try:
            self._evict_snapshots(1, t, EvictionReason.HOST)
        finally:
            if keep is not None:
                self.cache.unlock(keep)
        return self.pool.num_free > 0

    def request_info(
        self, cache_ids: KeyLike, cached_length: int, *, session: Hashable | None = None, now: float | None = None
    ) -> RequestInfo:
        """What the policy is told of a request of a host that keeps its own slots, its hit
        ``cached_length`` tokens deep: the same fields (and prompt digest) :meth:`admit` computes.
        Changes nothing.

        :raises TypeError, ValueError: bad ids, a ``cached_length`` outside ``[0, len(ids)]``.
        """
        ck = CacheKey(cache_ids)
        n = cached_length
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= len(ck):
            raise ValueError(f"cached_length must be an int in [0, {len(ck)}], got {n!r}")
        return _request_info(ck, int(n), int(n), session, self._now(now))

    @_exclusive
    def admitted(self, info: RequestInfo) -> None:
        """A host that keeps its own slots admitted a request (``info`` from
        :meth:`request_info`): the policy hears of it and the metrics count it. Call it once per
        request, before its :meth:`restore`.

        :raises TypeError: not a ``RequestInfo``. Nothing changed.
        """
        if not isinstance(info, RequestInfo):
            raise TypeError(f"info must be a RequestInfo (request_info builds one), got {type(info).__name__}")
        self.policy.admitted(info)
        self._counters.admissions += 1
        self._counters.prompt_tokens += info.prompt_len

    @_exclusive
    def restore(
        self,
        node: TreeNode,
        dst_slot: SlotId,
        *,
        dst_owner: RequestOwner,
        info: RequestInfo,
        now: float | None = None,
    ) -> Fence:
        """Serve a hit of a host that keeps its own slots: copy ``node``'s snapshot (device or host
        tier) into ``dst_slot`` (owned by ``dst_owner``; lend the host's slot to the pool for the
        call), ordered after the snapshot's fence; the policy hears of the hit (``info``'s request)
        and forensics verifies the copy when on. Returns the fence the request's next forward waits.

        :raises ValueError: ``node`` holds no snapshot. :raises TypeError: ``info`` not a
            ``RequestInfo``, ``node`` not a ``TreeNode``. :raises linear_state.SlotMisuse:
            ``dst_slot`` not ``dst_owner``'s. Nothing changed.
        :raises SnapshotRefused: a finding names the snapshot (forensics in ``"record"`` mode
            found it changed now, or any finding before): nothing copied, no hit counted; the
            snapshot is dropped (now, or once no lock holds it). A miss, or look up again.
        :raises SnapshotCorruption: forensics in ``"raise"`` mode found it changed now.
        """
        if not isinstance(info, RequestInfo):
            raise TypeError(f"info must be a RequestInfo (request_info builds one), got {type(info).__name__}")
        if not isinstance(node, TreeNode):
            raise TypeError(f"node must be a TreeNode (lookup returns one), got {type(node).__name__}")
        if node.snapshot is None and node.host is None:
            raise ValueError(f"node {node.id} at depth {node.depth} holds no snapshot to restore")
        t = self._now(now)
        host_hit = node.snapshot is None
        fx = self.forensics
        if fx is not None:
            if fx.flagged(node.id):
                raise self._refused(node)
            fx.before_restore(node.id, dst_owner.rid, dst_slot)
            if fx.flagged(node.id):
                raise self._refused(node)
        ready = self.cache.restore(node, dst_slot, stream=self.stream or self.cache.stream, dst_owner=dst_owner)
        self.policy.touched(node, info, t)
        c = self._counters
        c.hits += 1
        c.hit_tokens += node.depth
        c.restores += 1
        c.host_hits += host_hit
        return ready

    @_exclusive
    def serve_in_place(
        self,
        node: TreeNode,
        *,
        info: RequestInfo,
        rid: Hashable = None,
        now: float | None = None,
        fingerprint: FingerprintJob | None = None,
    ) -> tuple[SlotId, Fence]:
        """Serve a hit of a host that copies the state itself, straight out of the snapshot's own
        slot: no copy into a slot of the pool (:meth:`restore` makes one). For a host whose
        request's state lives outside the pool (the vLLM connector's worker copies it into vLLM's
        block). The host must hold a :meth:`lock` on ``node`` from before this call until its copy
        completed, read the slot only, and order its copy after the returned fence. Forensics
        verifies the snapshot first, as before a restore (``rid``: whose hit, for its record); the
        policy hears of the hit (``info``'s request). Returns the slot and the fence. O(1) plus
        the verification.

        ``fingerprint``: the snapshot slot's fingerprint the host submitted on the pool's stream
        (``pool.fingerprint_later(slot)``) after it locked ``node``, so that forensics compares
        it rather than reading the slot on this thread (the vLLM store verifies a hit on its copy
        thread while vLLM's scheduler goes on).

        :raises ValueError: ``node`` not locked, or its snapshot not on the device (demoted: use
            :meth:`restore`); ``fingerprint`` of another slot. :raises TypeError: ``info`` not a
            ``RequestInfo``, ``node`` not a ``TreeNode``, ``fingerprint`` not a
            ``FingerprintJob``. :raises ForeignObjectError: another tree's node. Nothing changed.
        :raises SnapshotRefused: a finding names the snapshot (found now in ``"record"`` mode, or
            before): not served, no hit counted; it is dropped once the host's lock (and every
            other) goes. Unlock ``node`` and take a miss, or look up again.
        :raises SnapshotCorruption: forensics in ``"raise"`` mode found the snapshot changed.
        """
        if not isinstance(info, RequestInfo):
            raise TypeError(f"info must be a RequestInfo (request_info builds one), got {type(info).__name__}")
        if fingerprint is not None and not isinstance(fingerprint, FingerprintJob):
            raise TypeError(f"fingerprint must be a FingerprintJob or None, got {type(fingerprint).__name__}")
        slot, fence = self.cache.snapshot_slot(node)
        if fingerprint is not None and (fingerprint.pool is not self.pool or fingerprint.slot != slot):
            raise ValueError(f"fingerprint is of slot {fingerprint.slot}, node {node.id}'s snapshot is slot {slot}")
        t = self._now(now)
        fx = self.forensics
        if fx is not None:
            if fx.flagged(node.id):
                raise self._refused(node)
            fx.before_restore(node.id, rid, None, taken=fingerprint)
            if fx.flagged(node.id):
                raise self._refused(node)
        self.policy.touched(node, info, t)
        c = self._counters
        c.hits += 1
        c.hit_tokens += node.depth
        return slot, fence

    @_exclusive
    def checkpoint(
        self,
        cache_ids: KeyLike,
        kv_indices: torch.Tensor | np.ndarray,
        *,
        state_slot: SlotId | None = None,
        ready: Fence | None = None,
        namespace: Hashable = None,
        donor: Hashable = None,
        reason: DonationReason = DonationReason.CAPTURE,
        session: Hashable | None = None,
        now: float | None = None,
        release_duplicates: bool = False,
        known_prefix: int = 0,
    ) -> InsertResult:
        """File a prefix a host that keeps its own slots computed: ``cache_ids`` with their KV (a
        1-D integer tensor, or numpy array: a writable contiguous int64 or int32 one on the CPU, a
        page-table row, is read as it is and copied only where the tree keeps it), and,
        with ``state_slot`` (the state after the page-cut key, owned by the caller; lend the host's
        slot to the pool for the call), a clone of that state. When the clone needs a slot and none
        is free, one snapshot is evicted through the policy (after every argument was checked);
        when still none, the KV is filed without a snapshot
        (counted as a donation skipped for want of a slot). A new snapshot is announced to the
        policy (``reason``), recorded by forensics (``donor``) and queued for the shared tier.
        Duplicates of KV the tree holds go back as ``KV_FREED`` events (see ``kv=``), or, with
        ``release_duplicates=False``, back to the caller in ``result.released``. ``known_prefix``:
        the first ``known_prefix`` indices are the tree's own, not compared (as
        :meth:`HybridRadixCache.insert`). O(key).

        :raises TypeError, ValueError: bad ids, KV, slot or ``known_prefix`` (as
            :meth:`HybridRadixCache.insert`). Nothing changed.
        """
        return self._file(
            cache_ids, kv_indices, state_slot, ready, namespace, donor, reason, session, now, release_duplicates, False,
            known_prefix,
        )  # fmt: skip

    def _file(
        self,
        cache_ids: KeyLike,
        kv_indices: torch.Tensor | np.ndarray,
        state_slot: SlotId | None,
        ready: Fence | None,
        namespace: Hashable,
        donor: Hashable,
        reason: DonationReason,
        session: Hashable | None,
        now: float | None,
        release_duplicates: bool,
        shared: bool,
        known_prefix: int = 0,
    ) -> InsertResult:
        """:meth:`checkpoint`'s work; ``shared``: the host says the prefix is shared (a warm-up's
        system prompt), so the policy hears of it as a branch point."""
        # checked and converted once: the tree, forensics and policy take it as is (a CacheKey
        # already is one: immutable, so shared rather than copied)
        ck = cache_ids if type(cache_ids) is CacheKey else CacheKey(cache_ids)
        t = self._now(now)
        try:
            res = self.cache.insert(
                ck,
                kv_indices,
                state_slot=state_slot,
                ready=ready,
                namespace=namespace,
                release_duplicates=release_duplicates,
                known_prefix=known_prefix,
            )
        except PoolExhausted:
            # Everything was validated and nothing changed: only the clone lacks a slot. One
            # snapshot goes through the policy; with none evictable the KV is filed alone.
            self._evict_snapshots(1, t, EvictionReason.DONATION)
            if self.pool.num_free == 0:
                self._counters.donations_skipped[SkipReason.NO_SLOT.value] += 1
                state_slot = ready = None
            res = self.cache.insert(
                ck,
                kv_indices,
                state_slot=state_slot,
                ready=ready,
                namespace=namespace,
                release_duplicates=release_duplicates,
                known_prefix=known_prefix,
            )
        if state_slot is None:
            return res
        # NOTE: an enum member's _value_, not .value (a Python-level property: ~1 us a donation
        # inside SGLang's scheduler, session 35)
        if not res.snapshot_created:
            self._counters.donations_skipped[SkipReason.HELD._value_] += 1
            return res
        node = res.node
        self._counters.donations[reason._value_] += 1
        if self.forensics is not None:
            self._record_donation(donor, node, memoryview(ck.data)[: node.depth * TOKEN_BYTES])
        if self.shared is not None:
            self._queue_publication(node, ck.ids[: node.depth].astype(np.int64), namespace, ready)
        # the policy hears of the donor's key (its whole ids, the page-cut tail included); a
        # shared prefix as a branch point: other sequences go on past it
        branch = node.depth if shared else 0
        self.policy.donated(node, _request_info(ck, 0, branch, session, t, prompt=False), reason, t)
        return res

    @_exclusive
    def warm(
        self,
        cache_ids: KeyLike,
        kv_indices: torch.Tensor,
        *,
        state_slot: SlotId,
        ready: Fence | None = None,
        namespace: Hashable = None,
    ) -> InsertResult:
        """Pre-cache a prefix the host computed at start-up (a system prompt): :meth:`checkpoint`
        with the state in ``state_slot``, duplicates freed as the tree's ``KV_FREED`` events (the
        manager's ``kv.free`` with ``kv=``). The tree copies ``kv_indices``: reuse the buffer at
        once. The policy hears of the snapshot as a branch point (a prefix other sequences go on
        past). Call it while no request is admitted. Returns what the tree did; the KV beyond
        ``result.length`` stays the caller's.

        :raises RuntimeError: requests are admitted. :raises TypeError, ValueError: as
            :meth:`checkpoint`. Nothing changed.
        """
        if self._requests:
            raise RuntimeError(f"warm() runs before serving: {len(self._requests)} requests are admitted")
        return self._file(
            cache_ids,
            kv_indices,
            state_slot,
            ready,
            namespace,
            "warm-up",
            DonationReason.CAPTURE,
            None,
            None,
            True,
            True,
        )

    @_exclusive
    def reset(self) -> None:
        """Drop every cached prefix: snapshot slots back to the pool, KV to the host's allocator
        (``kv.free``, else the tree's ``KV_FREED`` events).

        :raises RuntimeError: requests are admitted, or a node is locked. Nothing changed.
        """
        if self._requests:
            raise RuntimeError(f"reset() with {len(self._requests)} requests admitted")
        self.cache.reset()
        self._condemned.clear()  # every snapshot went with the tree's reset

    # --------------------------------------------------------- finish / abort
    @_exclusive
    def finish(self, rid: Hashable, ready: Fence | None = None, *, now: float | None = None) -> FinishResult:
        """Finish a request: donate its final state, unlock, free its slots after their last writer.

        The final state is the live slot after every committed token; it is donated when the
        policy keeps final states and that length is page aligned, else the deepest page-aligned
        state captured while decoding is donated in its place. Returns the KV the host must free.

        With ``write_checks`` (the default), every snapshot the request donated from a slot its host
        never wrote is evicted here with an :class:`UnwrittenSlotWarning` (then the result reports
        no final donation when it was the final state).

        :param ready: fence of the last forward that wrote the request's slots.
        :raises UnknownRequest: unknown rid. :raises ProtocolError: a window is open (commit or
            abort it). :raises TypeError: ``ready`` not a fence. Nothing changed.
        """
        rec = self._get(rid)
        self._check_open(rec)
        _check_fence(ready)
        t = self._now(now)
        if ready is not None:
            rec.last_write[rec.live] = ready
        n = rec.computed
        freed: list[torch.Tensor] = []
        donated: int | None = None
        node: TreeNode | None = None
        if n > rec.kv_held:
            target: tuple[int, int, Fence | None] | None = None
            if n % self.cache.page_size == 0:
                target = (n, rec.live, ready)
            elif rec.pending is not None and rec.pending[0].depth > rec.kv_held:
                target = (rec.pending[0].depth, rec.pending[0].slot, rec.pending[1])
            if target is None:
                self._counters.donations_skipped[SkipReason.UNALIGNED.value] += 1
            elif not self.policy.donate_finish(rec.info):
                self._counters.donations_skipped[SkipReason.DECLINED.value] += 1
            else:
                node = self._donate(rec, target[0], target[1], target[2], DonationReason.FINISH, t, freed)
                if node is not None:
                    donated = target[0]
        freed.append(self._own_kv(rec))
        free = freed[0] if len(freed) == 1 else torch.cat(freed)
        held = rec.kv_held
        after = ready if ready is not None else self._last_fence(rec)
        live_node = node if node is not None and target is not None and target[1] == rec.live else None
        end = self._end(rec, ready, after, free, live_node)
        n_slots, free, bad = end.slots_freed, end.free_kv, end.unwritten
        if node is not None and any(b is node for b, _ in bad):
            donated, node = None, None
        return FinishResult(donated, n_slots, held, free, after, node)

    @_exclusive
    def abort(self, rid: Hashable, ready: Fence | None = None) -> FinishResult:
        """Abort a request at any point of its lifecycle (an open window included): unlock, free
        every slot after its last writer (``ready``, and every fence the manager saw for it).
        Nothing is donated. Returns the KV the host must free (KV it allocated for a window it
        never committed stays its own). Snapshots donated from capture slots the host never wrote
        are evicted, as at :meth:`finish`.

        :raises UnknownRequest: unknown rid. :raises TypeError: ``ready`` not a fence. Nothing changed.
        """
        rec = self._get(rid)
        _check_fence(ready)
        after = ready if ready is not None else self._last_fence(rec)
        held = rec.kv_held
        end = self._end(rec, ready, after, self._own_kv(rec), None)
        return FinishResult(None, end.slots_freed, held, end.free_kv, after)

    def _end(
        self, rec: _Request, ready: Fence | None, after: Fence, free: torch.Tensor, live_node: TreeNode | None
    ) -> _Ended:
        """The end of finish and abort: check the request's donations (write checks), release its
        slots and lock, give its KV ``free`` to the allocator (with ``kv=``; then the host frees
        nothing), evict what the checks found."""
        bad = self._unwritten(rec, live_node, ready)
        n_slots = self._release(rec, (ready,) if ready is not None else ())
        if rec.kv_full is not None:
            self._free_kv(free, after)
            free = _EMPTY_KV
        if bad:
            self._drop_unwritten(rec.rid, bad)
        return _Ended(n_slots, free, bad)

    def _unwritten(self, rec: _Request, live_node: TreeNode | None, ready: Fence | None) -> list[tuple[TreeNode, str]]:
        """The snapshots ``rec`` donated from slots its host never wrote, with what gave each away
        (``write_checks``; empty without). Waits the request's fences first, as its release does."""
        if not self.write_checks or (live_node is None and not rec.unverified):
            return []
        for f in (ready, *rec.last_write.values()):
            if f is not None:
                f.wait()
        bad: list[tuple[TreeNode, str]] = []
        host = self.cache.host_pool
        for n in rec.unverified:
            if n.snapshot is not None and self.pool.unwritten(n.snapshot):
                bad.append((n, "a capture slot still carrying the manager's NaN probes"))
            elif n.snapshot is None and n.host is not None and host is not None and host.unwritten(n.host):
                bad.append((n, "a capture slot still carrying the manager's NaN probes (demoted since)"))
        if live_node is not None:
            hit, now = rec.hit, self.pool.probe(rec.live)
            ref: torch.Tensor | None = None
            if hit is None:
                ref = torch.zeros_like(now)
            elif hit.snapshot is not None:
                ref = self.pool.probe(hit.snapshot)
            elif hit.host is not None and host is not None:
                ref = host.probe(hit.host)
            # NOTE: equal probes after tokens were computed: the live slot still holds the state it
            # was admitted with (a state that is a fixed point of its inputs would pass for one too,
            # and lose a hit: never serve a wrong one).
            if ref is not None and torch.equal(now, ref):
                bad.append((live_node, "a live slot still holding the state it was admitted with"))
        return bad

    def _drop_unwritten(self, rid: Hashable, bad: list[tuple[TreeNode, str]]) -> None:
        """Evict the snapshots :meth:`_unwritten` found (those a hit locked stay, said so) and warn."""
        for n, why in bad:
            self._counters.unwritten_snapshots += 1
            if self.cache.is_evictable(n):
                self._counters.evicted_kv_tokens += self.cache.evict_snapshot(n, demote=False).kv_tokens
                outcome = "evicted"
            else:
                outcome = "kept: another request holds it (its hit restored it already)"
            warnings.warn(
                UnwrittenSlotWarning(
                    f"request {rid!r} donated the snapshot at depth {n.depth} from {why}: its host never wrote "
                    f"that state (write every planned capture; store the final state into the live slot before "
                    f"finish); {outcome}"
                ),
                stacklevel=5,  # the host's finish or abort (through _end and the guard),
            )

    def _own_kv(self, rec: _Request) -> torch.Tensor:
        """The KV indices the request owns: its table beyond what the tree holds (with a manager
        that owns the KV, its unused reservation too)."""
        if rec.kv_full is not None:
            return rec.kv_full[rec.kv_held :]
        return self._table(rec)[rec.kv_held :]

    def _tree_event(self, event: TreeEvent) -> None:
        """The tree's listener: every event to the policy; freed KV to the host's allocator
        (``kv.free`` when the manager owns the KV, else the listener the tree was built with),
        dropped and demoted snapshots to forensics, then every event on to the tree's own listener."""
        kind = event.kind
        self.policy.tree_event(event)
        if kind is TreeEventKind.KV_FREED and self.kv is not None:
            assert event.kv is not None
            self.kv.free(event.kv)
            return
        fx = self.forensics
        if fx is not None:
            if kind is TreeEventKind.SNAPSHOT_FREED:
                fx.snapshot_freed(event.node.id, int(event.slot or 0))
            elif kind is TreeEventKind.DEMOTED:
                assert self.cache.host_pool is not None and event.slot is not None
                fx.snapshot_demoted(event.node.id, self.cache.host_pool, event.slot)
        if self._host_listener is not None:
            self._host_listener(event)

    def _give_back_kv(self, idx: torch.Tensor, node: TreeNode) -> None:
        """Hand KV indices the host gave but the tree did not take back through the KV channel."""
        if self.kv is not None:
            self.kv.free(idx)
        elif self._host_listener is not None:
            self._host_listener(TreeEvent(TreeEventKind.KV_FREED, node, idx))

    def _free_kv(self, idx: torch.Tensor, after: Fence) -> None:
        """Give ``idx`` back to the host's allocator (reused after ``after``)."""
        assert self.kv is not None
        self.kv.free(idx, after)

    @staticmethod
    def _last_fence(rec: _Request) -> Fence:
        pending = [f for f in rec.last_write.values() if not f.is_complete()]
        return pending[-1] if pending else COMPLETE

    def _release(self, rec: _Request, after: Iterable[Fence]) -> int:
        fences = [*after, *rec.last_write.values()]
        slots = (rec.live, *rec.tracks)
        for f in fences:
            f.wait()
        for s in slots:
            self.pool.free(s, rec.owner)
        if self.forensics is not None:
            self.forensics.request_freed(rec.rid, slots)
        # NOTE: a condemned snapshot this request held is dropped at the next admission (or
        # unlock), not here: its KV would be freed to the host while the host still ends the request
        self.cache.unlock(rec.lock)
        del self._requests[rec.rid]
        return len(slots)

    # -------------------------------------------------------------- invariants
    def check_invariants(self, *, host_slots: int = 0) -> None:
        """Raise ``AssertionError`` naming the first broken rule. O(tree + requests).

        ``host_slots``: slots of the pool the host owns itself, outside the manager's requests
        (the private copies of a host that keeps its own slots, such as
        :class:`radixcache.vllm.PagedHostStore`'s hits and save plans); every other request-owned
        slot must be one of the manager's requests.

        No slot id held by the tree and by a request at once; every request slot owned by its
        request in the pool; free + tree + requests == capacity; each request's lock node alive
        and locked; KV tables as long as the committed tokens; the tree's, the pool's, the
        policy's and (when on) the forensics' and the shared tier's own invariants, and the
        publications queued for the shared tier (at most ``max_pending``, each a node of this
        tree with the key of its depth); the manager still the tree's client and its listener.
        """
        self.cache.check_invariants()
        for nid, node in self._condemned.items():
            assert node.id == nid and node.cache is self.cache, f"condemned {node!r} filed as {nid}, or of another tree"
        assert self.cache.client is self, "the tree is served by another client"
        assert self.cache.on_event == self._tree_event, "the tree's events no longer reach this manager"
        self.policy.check_invariants()
        if self.shared is not None:
            self.shared.check_invariants()
            q = self._to_publish
            assert len(q) <= self.shared.max_pending, f"{len(q)} publications queued, max {self.shared.max_pending}"
            for node, key, _, _ in q:
                assert node.cache is self.cache, f"queued publication of {node!r}, a node of another tree"
                assert key.size == node.depth, f"queued publication of {node!r} with a key of {key.size} ids"
        nodes = self.cache.iter_nodes()
        snapshots = {n.id: n.snapshot for n in nodes if n.snapshot is not None}
        tree_slots = set(snapshots.values())
        if self.forensics is not None:
            self.forensics.check_invariants(snapshots, {n.id: n.host for n in nodes if n.host is not None})
        req_slots: set[int] = set()
        req_kv: set[int] = set()
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
            if rec.kv_full is not None:
                assert self.kv is not None and not rec.kv_parts and not rec.kv_tail, f"request {rid!r}: two KV tables"
                kv_len = int(rec.kv_full.numel())
                n = rec.computed
                assert kv_len >= n, f"request {rid!r} KV table holds {kv_len} indices for {n} tokens"
                own = rec.kv_full[rec.kv_held :].tolist()
                clash = req_kv.intersection(own)
                assert not clash and len(set(own)) == len(own), f"request {rid!r} shares KV indices {sorted(clash)[:4]}"
                req_kv.update(own)
            else:
                assert self.kv is None, f"request {rid!r} has no KV table of the manager's"
                kv_len = sum(int(p.numel()) for p in rec.kv_parts) + len(rec.kv_tail)
                n = rec.computed
                assert kv_len == n, f"request {rid!r} KV table holds {kv_len} indices for {n} tokens"
            held, n = rec.kv_held, rec.computed
            assert held <= n, f"request {rid!r}: the tree holds {held} of its {n} tokens"
            assert rec.ids.size + len(rec.out) >= rec.computed, f"request {rid!r} has fewer ids than tokens committed"
        tree_n = self.pool.num_owned_by(NodeOwner)
        req_n = self.pool.num_owned_by(RequestOwner)
        assert req_n == len(req_slots) + host_slots, (
            f"pool has {req_n} request-owned slots, the manager tracks {len(req_slots)} and the host {host_slots}"
        )
        if isinstance(self.pool, HostedStatePool):  # the host holds the slots its own requests use
            room = self.pool.capacity - len(self.pool.reserved)
            assert self.pool.num_free + tree_n + req_n <= room, (
                f"host-free {self.pool.num_free} + tree {tree_n} + requests {req_n} > {room} usable slots"
            )
            return
        assert self.pool.num_free + tree_n + req_n == self.pool.capacity, (
            f"free {self.pool.num_free} + tree {tree_n} + requests {req_n} != capacity {self.pool.capacity}"
        )


def _request_key(rid: Hashable, cache_ids: KeyLike) -> CacheKey:
    """A request's key. :raises ValueError: no ids (or as :func:`key_bytes`)."""
    ck = CacheKey(cache_ids)
    if not ck.data:
        raise ValueError(f"request {rid!r} has no ids")
    return ck


def _depth_limit(ids: np.ndarray, limit: object, default: int) -> int:
    """A caller's cap on a shared-tier depth (``None``: ``default``), checked against ``ids``.

    :raises TypeError: not an int or None. :raises ValueError: outside ``[0, len(ids)]``."""
    if limit is None:
        return default
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)):
        raise TypeError(f"limit must be an int or None, got {limit!r}")
    if not 0 <= limit <= ids.size:
        raise ValueError(f"limit {limit} is outside [0, {ids.size}] for {ids.size} ids")
    return int(limit)


def _request_info(
    key: CacheKey,
    cached_length: int,
    token_length: int,
    session: Hashable | None,
    t: float,
    *,
    prompt: bool = True,
) -> RequestInfo:
    """What the policy hears of a request: its prompt's length, digest (the hash of the canonical
    key bytes, so one prompt has one digest whichever front door it came through) and image starts.
    Without ``prompt`` (``key`` is a checkpoint's, not a prompt) no digest: NOTE: hashing a
    2,000-id key cost ~10 us of every checkpoint, for a digest no policy reads there. NOTE: the
    interpreter's own 64-bit hash of the bytes, not blake2b: 2.0 against 9.3 us for an 8 KB prompt
    (at every SGLang admission); a policy compares digests only within its own process."""
    digest = hash(key) if prompt else None
    n = len(key)
    if not key.has_images:  # text only (most prompts): at most one reduction, none when the key knows
        return RequestInfo(n, cached_length, token_length, session, t, digest, ())
    is_img = key.ids >= IMAGE_ID_BASE
    starts = np.flatnonzero(is_img & ~np.concatenate([[False], is_img[:-1]]))
    return RequestInfo(n, cached_length, token_length, session, t, digest, tuple(int(s) for s in starts))


def _nearest_snapshot(cache: HybridRadixCache, node: TreeNode) -> tuple[int | None, int]:
    """Id and depth of ``node``'s nearest ancestor holding a snapshot (``(None, 0)``: none)."""
    anc = next(cache.snapshot_ancestors(node), None)
    return (None, 0) if anc is None else (anc.id, anc.depth)


def _check_fence(ready: object) -> None:
    """:raises TypeError: ``ready`` is neither a Fence nor None."""
    if ready is not None and not isinstance(ready, Fence):
        raise TypeError(f"ready must be a Fence or None, got {type(ready).__name__}")


def _fields(obj: object) -> dict[str, object]:
    """A slotted dataclass's fields, copied one level deep."""
    out: dict[str, object] = {}
    for name in getattr(type(obj), "__slots__", ()):
        v = getattr(obj, name)
        out[name] = dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v
    return out


def _small_ids(ids: object) -> list[int] | None:
    """``ids`` as a list when it is a short list or tuple of in-range Python ints (the decode fast
    path); None otherwise (the caller validates through :func:`key_bytes`)."""
    if type(ids) not in (list, tuple) or len(ids) > 16:  # type: ignore[arg-type]
        return None
    for t in ids:  # type: ignore[attr-defined]
        if type(t) is not int or not 0 <= t < MAX_ID:
            return None
    return list(ids)  # type: ignore[call-overload, no-any-return]


def _small_kv(kv: object, n: int) -> list[int] | None:
    """The KV indices of a window of at most 4 tokens as ints, when they are a CPU int64 tensor or a
    list of ints of the right length (the decode fast path); None: take the general path."""
    if n > 4:
        return None
    if type(kv) is torch.Tensor:
        if kv.dtype is not torch.int64 or kv.dim() != 1 or kv.shape[0] != n or not kv.is_cpu:
            return None
        out: list[int] = kv.tolist()
        return out if all(i >= 0 for i in out) else None
    if type(kv) is list and len(kv) == n and all(type(i) is int and i >= 0 for i in kv):
        return list(kv)
    return None


def _bad_imported_kv(kv: object, n: int) -> str | None:
    """Why the KV indices a codec's ``import_kv`` returned break its contract (a 1-D integer
    tensor of ``n`` non-negative indices), or None when they keep it."""
    if not isinstance(kv, torch.Tensor) or kv.dtype not in _INT_DTYPES:
        return f"import_kv returned {type(kv).__name__} of {getattr(kv, 'dtype', None)}, not integer KV indices"
    if kv.dim() != 1 or kv.shape[0] != n:
        return f"import_kv returned shape {tuple(kv.shape)} for {n} tokens"
    if n and int(kv.min()) < 0:
        return f"negative KV index {int(kv.min())} from import_kv"
    return None


def _as_window_kv(kv: object, n: int) -> torch.Tensor:
    """The window's KV indices as a 1-D int64 tensor of ``n`` entries. :raises TypeError, ValueError."""
    if isinstance(kv, torch.Tensor):
        t = kv
    elif isinstance(kv, (np.ndarray, list, tuple)):
        arr = np.asarray(kv)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu" or arr.dtype == np.uint64:
            raise ValueError(f"kv_indices must be integers, got dtype {arr.dtype}")
        t = torch.from_numpy(arr.astype(np.int64))
    else:
        raise TypeError(f"kv_indices must be a tensor, numpy array or list of ints, got {type(kv).__name__}")
    if t.dim() != 1 or t.dtype not in _INT_DTYPES:
        raise ValueError(f"kv_indices must be 1-D integers, got shape {tuple(t.shape)} dtype {t.dtype}")
    if t.shape[0] != n:
        raise ValueError(f"kv_indices has {t.shape[0]} entries for a window of {n} tokens")
    if n and int(t.min()) < 0:
        raise ValueError(f"kv_indices holds a negative KV index ({int(t.min())})")
    # A private copy: the host may rewrite its index buffer for other requests right after.
    return t.to(torch.int64) if t.dtype != torch.int64 else t.clone()
