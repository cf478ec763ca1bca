"""The shared tier: snapshots published to a store several replicas reach, fetched on a miss.

A replica's manager publishes every snapshot its tree takes (the linear state, the KV of the
prefix through the host's :class:`KVCodec`, and the slot fingerprint) under a content address: the
tier's namespace, its identity (the model, the state layout, the KV codec's identity, the blob
format and which secret keys the digests), the request's namespace and the cache ids up to the
snapshot's depth. Replicas of another identity never read each other's blobs: one mid-upgrade to
another blob format, or one given another secret, neither refuses nor deletes the others'.
Another replica admitting a request whose local match is shorter asks the store for the deepest
published prefix of its ids, verifies the blob (format, layout identity, lengths, its digest,
then the fingerprint of the state as it will be restored) and only then writes it into the
request's live slot and inserts it into its own tree. A blob that fails any check is a
miss (and a forensics finding when the manager has forensics), never a restore; it is deleted from
the store so that a healthy replica can publish it again.

Which check covers what. Every blob ends in a 32-byte blake2b digest over its address (the store
key, itself a blake2b digest of the tier's namespace, its identity, the request namespace and
every cache id up to the depth) and every byte before the digest: magic, header, state
and KV. It is what makes bytes that crossed a network and a store trustworthy: a flipped bit
anywhere, a region replaced by another prompt's, or a whole blob stored under another key (another
prompt's, or the same ids in another namespace) fails it. With ``secret`` the digest is keyed (a
deployment secret every replica shares): a writer without the secret cannot plant a blob that
verifies. The slot fingerprint in the header is a different check with a different job: it is the
publisher's :meth:`~linear_state.LinearStatePool.fingerprint` of the state, recomputed here on the
state as it will be restored, so a blob whose bytes are intact but whose publisher serialised
another state than the one its fingerprint names (an aliased slot) is refused too. It is a block
sum made to catch an engine's aliasing cheaply, not an integrity check: changes that cancel inside
a block pass it, which is why the digest comes first.

Why KV travels too: a replica that never computed a prefix holds no attention KV for it, and the
state alone cannot be served without it. Models without attention layers pass a codec whose KV is
empty.

The store is reached through :class:`SharedStore`: :class:`RedisStore` (the ``redis`` extra, a real
server) or :class:`MemoryStore` (one process, tests). A store that cannot be reached raises
:class:`SharedStoreError`; the tier turns it into a miss (or a skipped publication), stops asking
for ``retry_s`` seconds, then tries again, so a replica keeps serving, from its own tree only,
while the server is down and uses it again once it is back.

Costs: a publication reads the snapshot (and its KV) back to the host once its fences completed
(the manager defers it until then and publishes at its next call), plus one store round trip; a
probe is one round trip for the published depths and one for the blobs' existence (per batch of
candidates, deepest first: 64, then 128, ...), a fetch one more. Probes happen only when the
local match is shorter than the request.

With ``background=True`` a publication's fingerprint, encoding and store round trip (the upload is
the slowest part with a remote store and a large state) run on one writer thread of the tier's
own, so the scheduler's thread pays only the copy out of the slot and the codec's KV export; the
thread touches nothing but its own one-slot staging pool, the store and the tier's counters, and
publications beyond ``max_queued_bytes`` waiting for it are dropped (counted). Fetches stay on the
caller's thread: an admission needs their answer.
"""

from __future__ import annotations

import atexit
import enum
import hashlib
import hmac
import threading
import time
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from linear_state import Fence, LinearStatePool, RequestOwner, StateLayout

from ..core.errors import ProtocolError
from ..core.keys import MAX_ID
from .blob import BLOB_MAGIC, DIGEST_BYTES, blob_digest, bytes_tensor, encode_blob, parse_blob
from .store import SharedStore, SharedStoreError, deepest_of, finite_seconds

__all__ = [
    "Fetched",
    "KVCodec",
    "PublishCheck",
    "RejectReason",
    "Rejection",
    "SharedStats",
    "SharedTier",
]

_FIRST_BATCH = 64  # candidate depths checked in a probe's first round trip (deepest first)
_SPARES = 2  # host state copies kept for reuse by publications (see SharedTier._spares)
_DONE_CAP = 65536  # keys published or fetched here, remembered (oldest forgotten first)
_CHECKS_CAP = 4096  # publication checks kept for SharedTier.checks (oldest dropped first)


class KVCodec(Protocol):
    """How the host's attention KV travels with a shared snapshot.

    :ivar identity: what a KV blob's bytes mean (layers, heads, head size, dtype): part of the
        content address, so replicas with another KV layout never read each other's blobs.
    """

    identity: str

    def export_kv(self, kv_indices: torch.Tensor, after: Fence | None) -> bytes | memoryview:
        """The KV of these indices (one per token, in order), read once ``after`` completed:
        ``bytes``, or a flat byte ``memoryview`` of a buffer nothing else writes (the tier keeps
        it until the blob is encoded).

        A codec may also have ``reuse_kv(kv)``: the tier calls it, on whichever thread encoded
        the blob, with what ``export_kv`` returned once it is encoded or its publication dropped,
        after which the tier never reads it again and the codec may write its buffer for a later
        export (a buffer already written costs less to copy into than fresh memory). Without it,
        the tier just drops its reference."""
        ...

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` KV indices, write ``data`` (what :meth:`export_kv` returned) into
        them, ordered before any later forward of the host's, and return them (the host's, until
        the tree takes them); None when the host has no room (nothing allocated). ``data`` is a
        bytes-like object: a fetched blob's KV arrives as a read-only ``memoryview`` of the blob
        (no copy; ``bytes(data)`` makes one where a ``bytes`` is needed).

        A codec over an allocator the host keeps (the manager was given no ``kv``) may also have
        ``free_tokens() -> int``: how many KV tokens :meth:`import_kv` could allocate now. With
        it, :meth:`CacheManager.fetch_shared` evicts the tree's KV (through the policy, never the
        request's local match or a locked path) until a fetched prefix fits, as it does with an
        allocator it owns. Without it, a fetch that finds the host's allocator full is a miss
        (``stats.no_room``), however much of the tree's KV could have been evicted for it."""
        ...


@dataclass
class SharedStats:
    """What a :class:`SharedTier` did (monotonic counters).

    :ivar published: blobs stored; :ivar publish_skipped: publications dropped (the snapshot left
        the device before its fences completed, or too many were pending);
    :ivar probes: admissions that asked the store; :ivar hits: blobs fetched, verified and
        inserted; :ivar foreign_hits: those published by another replica;
    :ivar hit_tokens: tokens those hits covered beyond the local match;
    :ivar rejected: blobs refused, by why (the :class:`RejectReason` values: ``format``,
        ``layout``, ``length``, ``digest``, ``fingerprint``);
    :ivar no_room: verified blobs not used for want of a slot or KV room;
    :ivar codec_errors: the host's KV codec raised (an export at publication: that publication
        dropped; an import at fetch: a miss); the first one is also warned about;
    :ivar errors: store calls that failed (server down); :ivar skipped_down: calls not made while
        the store was considered down;
    :ivar prefetches: probes issued ahead of an admission (:meth:`SharedTier.prefetch`), answered
        on the tier's fetcher thread; :ivar prefetch_late: admissions that came before their
        prefetch was answered (served locally); :ivar prefetch_dropped: prefetches not issued or
        dropped unread (too many outstanding, answered beyond ``max_prefetch_bytes``, or
        cancelled);
    :ivar trimmed: depths removed from the depth index because every blob at them had expired;
    :ivar publish_changed: publications not stored because the copy read out of the slot did not
        have the fingerprint the publisher expected (``publish(expect=)``: the snapshot changed
        after its donation); each is also a :class:`PublishCheck` in :meth:`SharedTier.checks`.
    """

    published: int = 0
    publish_skipped: int = 0
    probes: int = 0
    hits: int = 0
    foreign_hits: int = 0
    hit_tokens: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    no_room: int = 0
    errors: int = 0
    codec_errors: int = 0
    skipped_down: int = 0
    prefetches: int = 0
    prefetch_late: int = 0
    prefetch_dropped: int = 0
    trimmed: int = 0
    publish_changed: int = 0

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class PublishCheck:
    """A publication compared with the fingerprint its publisher expected
    (:meth:`SharedTier.publish` with ``expect=``), on whichever thread fingerprinted its copy (the
    writer's, with ``background``): collected by :meth:`SharedTier.checks`.

    :ivar token: what the publisher passed with it (the manager: the node's id);
    :ivar key: the blob's store key; :ivar depth: its depth in tokens;
    :ivar expected: the fingerprint the publisher expected; :ivar found: the copy's.
    A check whose ``found`` differs from ``expected`` was not stored.
    """

    token: Hashable
    key: str
    depth: int
    expected: int
    found: int

    @property
    def ok(self) -> bool:
        """Whether the copy had the expected fingerprint (and was stored, unless the store failed)."""
        return self.found == self.expected


class RejectReason(enum.Enum):
    """Why the shared tier refused a blob (its value names the counter in ``SharedStats.rejected``
    and the forensics finding ``shared-<value>``)."""

    #: Not a blob, or truncated.
    FORMAT = "format"
    #: Published for another layout or model under this address.
    LAYOUT = "layout"
    #: Its sizes disagree with the layout or the depth.
    LENGTH = "length"
    #: Its bytes changed since they were published, it was published under another address, or
    #: with another secret.
    DIGEST = "digest"
    #: The bytes are the publisher's, but the state is not the one its fingerprint names.
    FINGERPRINT = "fingerprint"


@dataclass(frozen=True)
class Rejection:
    """A blob the tier refused: a miss, reported to the manager's forensics.

    :ivar reason: why (:class:`RejectReason`).
    :ivar key: the store key; :ivar depth: the depth it was published for;
    :ivar publisher: who published it (as the blob says; ``?`` when unreadable);
    :ivar expected: the stored fingerprint; :ivar found: the state's fingerprint (either ``None``
        when the blob was refused before it was read).
    """

    reason: RejectReason
    key: str
    depth: int
    publisher: str
    expected: int | None = None
    found: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class Fetched:
    """A verified blob: the state after ``depth`` tokens and the KV bytes of ``[0, depth)`` (a
    read-only ``memoryview`` of the blob: the store's reply is not copied again). The state is in
    the tier's one-slot staging pool (:attr:`SharedTier.staging`) when ``state`` is ``None`` (a
    fetch on the caller's thread); a prefetched blob carries it as ``(conv, recurrent)`` host
    tensors, verified against the fingerprint (write them into the slot)."""

    depth: int
    kv: bytes | memoryview
    publisher: str
    fingerprint: int
    state: tuple[torch.Tensor, torch.Tensor] | None = None


def _held_bytes(got: Fetched) -> int:
    """What a prefetch's answer keeps alive: the whole blob its KV view is a view of, and its
    state's host copy."""
    kv = got.kv
    n = memoryview(kv.obj if isinstance(kv, memoryview) else kv).nbytes
    if got.state is not None:
        n += sum(t.numel() * t.element_size() for t in got.state)
    return int(n)


def _check_ids(ids: object) -> None:
    """Cache ids as the tier takes them: a 1-D integer numpy array."""
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu":
        kind = type(ids).__name__ if not isinstance(ids, np.ndarray) else f"array of {ids.dtype}"
        raise TypeError(f"ids must be an integer numpy array, got {kind}")
    if ids.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
    if not ids.size:
        return
    low = 0 if ids.dtype.kind == "u" else int(ids.min())  # unsigned ids cannot go below: one reduction
    if low < 0 or int(ids.max()) >= MAX_ID:
        bad = low if low < 0 else int(ids.max())
        raise ValueError(f"cache id {bad} is outside [0, 2**31)")


def _check_timeout(timeout_s: float | None) -> None:
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s >= 0):
        raise ValueError(f"timeout_s must be None or a number >= 0, got {timeout_s!r}")


def _secret_id(secret: bytes) -> str:
    """Which secret keys a tier's digests, as its address shows it: a blake2b keyed with it of a
    fixed text (16 hex digits), which says nothing of the secret itself."""
    return hashlib.blake2b(b"radixcache shared-tier secret id", key=secret, digest_size=8).hexdigest()


def _ns_name(namespace: Hashable) -> str:
    """A request namespace as it enters a content address (stable across processes)."""
    if namespace is None or isinstance(namespace, (str, int, bytes)):
        return repr(namespace)
    raise TypeError(f"the shared tier addresses namespaces that are None, str, int or bytes, got {namespace!r}")


class SharedTier:
    """Publish and fetch snapshots through a :class:`SharedStore` (see the module docstring).

    Give it to :class:`~radixcache.CacheManager` (``shared=``); the manager calls it. One tier per
    manager.

    :param store: where blobs live.
    :param model: the model's identity (name and revision, say): replicas share blobs only when
        it, the pool's :class:`~linear_state.StateLayout` and the codec's identity all agree.
    :param kv: how the host's KV travels with a state.
    :param namespace: the deployment's namespace in the store (a key prefix).
    :param publisher: this replica's name, written into its blobs (default: host and process id).
    :param max_probes: the deepest this many depths published in the request's namespace (past its
        local match, up to its length) are checked per probe, deepest first, in round trips of 64,
        128, 256, ... depths (the first present one is fetched). The index lists
        the depths of every prefix published in the namespace, most of them other prefixes': too
        small a number misses a published prefix that many deeper depths of other prompts hide.
    :param retry_s: after a failed store call, no call is made for this long.
    :param max_pending: publications waiting for their fences beyond this are dropped (oldest first).
    :param clock: seconds, for ``retry_s``.
    :param background: store publications from a writer thread of the tier's own (started at the
        first publication) instead of the caller's; :meth:`flush` waits for it, :meth:`close`
        stops it. Recommended with a remote store: an upload never stalls the scheduler.
    :param max_queued_bytes: with ``background``, the blob bytes that may wait for the writer; a
        publication that would pass it is dropped (``stats.publish_skipped``).
    :param exit_flush_s: with ``background``, when the interpreter exits without :meth:`close`,
        how long the writer may go on storing what was queued (default 5 s); what is still
        queued then is dropped, the upload in flight finishes. ``0``: drop the queue at once.
    :param max_prefetches: prefetches (:meth:`prefetch`) outstanding at most; the oldest goes
        beyond it.
    :param max_prefetch_bytes: what the answered prefetches waiting for their admissions may hold
        at most (each its blob and its state's host copy); beyond it the oldest answered ones are
        dropped (``stats.prefetch_dropped``: their admissions ask the store themselves). A host
        that prefetches at arrival keeps one answer per waiting request: with large states and
        long prompts a count alone does not bound the memory.
    :param secret: a deployment secret (1 to 64 bytes) that keys every blob's digest: replicas
        share blobs only when they hold the same secret, and a writer without it cannot plant a
        blob that verifies. ``None`` (default): an unkeyed digest, which still catches every
        change of the bytes and every blob stored under another address.
    :raises ValueError: an empty ``model`` or ``namespace``, a bad number, a ``secret`` outside 1
        to 64 bytes. :raises TypeError: a store that is not a :class:`SharedStore`, a codec without
        an identity, a ``clock`` that is not callable, a ``secret`` that is not bytes, a
        ``background`` that is not a bool. Nothing is bound or started when it raises.
    """

    def __init__(
        self,
        store: SharedStore,
        *,
        model: str,
        kv: KVCodec,
        namespace: str = "radixcache",
        publisher: str | None = None,
        max_probes: int = 1024,
        retry_s: float = 1.0,
        max_pending: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        background: bool = False,
        max_queued_bytes: int = 1 << 30,
        secret: bytes | None = None,
        max_prefetches: int = 1024,
        max_prefetch_bytes: int = 1 << 30,
        exit_flush_s: float = 5.0,
    ) -> None:
        if not isinstance(store, SharedStore):
            raise TypeError(f"store must implement SharedStore, got {type(store).__name__}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        if not isinstance(namespace, str) or not namespace or ":" in namespace:
            raise ValueError(f"namespace must be a non-empty string without ':', got {namespace!r}")
        if not isinstance(getattr(kv, "identity", None), str):
            raise TypeError("kv must be a KVCodec (an `identity` string, export_kv and import_kv)")
        for name, v in (("max_probes", max_probes), ("max_pending", max_pending), ("max_prefetches", max_prefetches)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not (finite_seconds(retry_s) and retry_s >= 0):
            raise ValueError(f"retry_s must be a finite number of seconds >= 0, got {retry_s!r}")
        if not (finite_seconds(exit_flush_s) and exit_flush_s >= 0):
            raise ValueError(f"exit_flush_s must be a finite number of seconds >= 0, got {exit_flush_s!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        if publisher is not None and (not isinstance(publisher, str) or not publisher):
            raise ValueError(f"publisher must be None or a non-empty string, got {publisher!r}")
        if secret is not None:
            if not isinstance(secret, (bytes, bytearray)):
                raise TypeError(f"secret must be bytes or None, got {type(secret).__name__}")
            if not 1 <= len(secret) <= 64:
                raise ValueError(f"secret must hold 1 to 64 bytes (blake2b's key), got {len(secret)}")
        if not isinstance(background, bool):
            raise TypeError(f"background must be a bool, got {background!r}")
        for name, v in (("max_queued_bytes", max_queued_bytes), ("max_prefetch_bytes", max_prefetch_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if publisher is None:
            import os
            import socket

            publisher = f"{socket.gethostname()}:{os.getpid()}"
        self.store = store
        self.model = model
        self.kv = kv
        self.namespace = namespace
        self.publisher = publisher
        self.max_probes = max_probes
        self.retry_s = float(retry_s)
        self.max_pending = max_pending
        self.clock = clock
        self.stats = SharedStats()
        self._secret = None if secret is None else bytes(secret)
        self.on_reject: Callable[[Rejection], None] | None = None
        self._down_until = -1.0
        self._layout: StateLayout | None = None
        self._identity = ""
        self._id_digest = ""
        self._stage: LinearStatePool | None = None
        self._stage_slot = 0
        self._stage_owner = RequestOwner("shared-tier staging")
        self._done: OrderedDict[str, None] = OrderedDict()  # keys published or fetched here (bounded)
        self.background = background
        self.max_queued_bytes = max_queued_bytes
        self.exit_flush_s = float(exit_flush_s)
        # Counters and the down state are written by the writer thread too: under this lock.
        self._lock = threading.Lock()
        self._writer: _Writer | None = None
        # Host tensors of the bound layout's state, done with (encoded), for the next publication's
        # copy out of its slot: a fresh 77 MB pair costs its pages' first touch on the scheduler's
        # thread (18 ms; 6 ms reused). At most _SPARES kept, under the lock.
        self._spares: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._closed = False
        self._warned_foreign = False
        self._client: object | None = None
        self.max_prefetches = max_prefetches
        self.max_prefetch_bytes = max_prefetch_bytes
        self._prefetches: OrderedDict[Hashable, _Prefetch] = OrderedDict()  # by request, under _lock
        self._prefetch_bytes = 0  # what the listed answered prefetches hold (their nbytes), under _lock
        self._fetcher: _Fetcher | None = None
        # What lookups on the fetcher thread learnt, for the scheduler's thread: rejections
        # (reason, key, depth, publisher, details) and keys fetched. Under _lock.
        self._deferred: list[tuple[RejectReason, str, int, str, dict[str, object]] | str] = []
        # publications compared with their expect=, under _lock (the oldest dropped beyond the cap)
        self._checks: deque[PublishCheck] = deque(maxlen=_CHECKS_CAP)
        self._trimmed_at: dict[str, float] = {}
        # (model digest, namespace) -> index name: a hash per admission saved on the scheduler's thread
        self._indexes: dict[tuple[str, type, Hashable], str] = {}

    # ----------------------------------------------------------------- set-up
    def bind(self, layout: StateLayout, *, client: object | None = None) -> None:
        """Called by the manager (``client``, itself): the layout of the pool the tier serves. A
        tier serves one layout and one manager; binding again with the same layout and no other
        client changes nothing.

        :raises TypeError: ``layout`` not a StateLayout. :raises ProtocolError: (a
            ``RuntimeError``) bound already to another layout or another client. Nothing changes
            when it raises.
        """
        if not isinstance(layout, StateLayout):
            raise TypeError(f"layout must be a StateLayout, got {type(layout).__name__}")
        if client is not None and self._client is not None and self._client is not client:
            raise ProtocolError("this SharedTier serves another manager already (one tier per manager)")
        if self._layout is not None:
            if self._layout != layout:
                raise ProtocolError("this SharedTier serves another layout already (one tier per manager)")
            self._client = self._client if client is None else client
            return
        self._client = client
        self._layout = layout
        # NOTE: the blob format and the secret (a keyed hash of it, never the secret) are part of
        # the address: a replica of another format (mid-upgrade) or with another secret
        # (misconfigured) reads and writes keys of its own, never refusing, and so never deleting,
        # the deployment's blobs. Refusal (and deletion) is left to bytes that changed under an
        # address of this identity.
        secret_id = "none" if self._secret is None else _secret_id(self._secret)
        self._identity = (
            f"model={self.model}|layout={layout!r}|kv={self.kv.identity}"
            f"|format={BLOB_MAGIC.decode('ascii')}|secret={secret_id}"
        )
        self._id_digest = hashlib.blake2b(self._identity.encode(), digest_size=10).hexdigest()
        self._stage = LinearStatePool(layout, 1)
        self._stage_slot = self._stage.alloc(self._stage_owner)

    @property
    def layout(self) -> StateLayout | None:
        """The layout of the pool the tier serves (None until bound)."""
        return self._layout

    @property
    def client(self) -> object | None:
        """The manager the tier serves (None until a manager bound it)."""
        return self._client

    @property
    def identity(self) -> str:
        """What this tier's blobs carry and are addressed by (empty until bound): the model, the
        state layout, the KV codec's identity, the blob format and which secret keys the digests
        (a keyed hash of it, ``none`` without one). Replicas share blobs only when it is equal."""
        return self._identity

    def key(self, ids: np.ndarray, namespace: Hashable) -> str:
        """The store key of the snapshot after all of ``ids`` (int64 cache ids) in ``namespace``.

        :raises TypeError: ``ids`` is not an integer numpy array, or a namespace the tier cannot
            address. :raises ValueError: ``ids`` is not 1-D.
        """
        _check_ids(ids)
        return self._keys(ids, namespace, [int(ids.size)])[0]

    def _keys(self, ids: np.ndarray, namespace: Hashable, depths: Sequence[int], yields: bool = False) -> list[str]:
        """``key(ids[:d], namespace)`` for every ``d`` of ``depths`` (ascending), hashing ``ids``
        once: the hash of a longer prefix continues from the shorter one's."""
        h = hashlib.blake2b(digest_size=20)
        h.update(self._identity.encode())
        h.update(b"\0" + _ns_name(namespace).encode() + b"\0")
        words = np.ascontiguousarray(ids, dtype=np.int64)
        out, at = [], 0
        for i, d in enumerate(depths):
            h.update(words[at:d].tobytes())
            at = d
            out.append(f"{self.namespace}:{self._id_digest}:{h.hexdigest()}")  # digest() leaves h as is
            if yields and i % 64 == 63:
                time.sleep(0)  # on the fetcher thread: the scheduler's gets the GIL between keys
        return out

    @staticmethod
    def addressable(namespace: Hashable) -> bool:
        """Whether ``namespace`` can be part of a content address (None, str, int or bytes); requests
        in other namespaces are served locally only."""
        return namespace is None or isinstance(namespace, (str, int, bytes))

    def codec_failed(self, what: str, error: BaseException) -> None:
        """The host's KV codec raised during ``what``: counted, warned about the first time."""
        with self._lock:  # the writer thread's reuse_kv too
            self.stats.codec_errors += 1
            first = self.stats.codec_errors == 1
        if first:
            warnings.warn(
                f"shared tier: the KV codec raised during {what} ({type(error).__name__}: {error}); "
                "served as a miss / publication dropped (counted in stats.codec_errors)",
                RuntimeWarning,
                stacklevel=3,
            )

    def index(self, namespace: Hashable) -> str:
        """The store's index of published depths for ``namespace``.

        :raises TypeError: a namespace the tier cannot address (see :meth:`addressable`)."""
        if not self.addressable(namespace):
            _ns_name(namespace)  # raises, naming it
        memo = (self._id_digest, type(namespace), namespace)  # the type: True == 1, but not as a name
        got = self._indexes.get(memo)
        if got is None:
            ns = hashlib.blake2b(_ns_name(namespace).encode(), digest_size=8).hexdigest()
            got = f"{self.namespace}:{self._id_digest}:depths:{ns}"
            if len(self._indexes) >= _DONE_CAP:
                self._indexes.clear()
            self._indexes[memo] = got
        return got

    # ----------------------------------------------------------- store calls
    @property
    def down(self) -> bool:
        """The store failed recently; calls are skipped until ``retry_s`` passed."""
        return self.clock() < self._down_until

    def _guarded(self, fn: Callable[[], object]) -> tuple[bool, object]:
        """Run one store call: (True, its answer), or (False, None) when the store is down or the
        call raised. Any exception counts as a failed call, not only :class:`SharedStoreError`: a
        store is outside code, and what it raises must cost a hit, never an admission."""
        if self.down:
            with self._lock:
                self.stats.skipped_down += 1
            return False, None
        try:
            return True, fn()
        except Exception as e:
            with self._lock:
                self.stats.errors += 1
                self._down_until = self.clock() + self.retry_s
                first_foreign = not isinstance(e, SharedStoreError) and not self._warned_foreign
                self._warned_foreign = self._warned_foreign or first_foreign
            if first_foreign:
                warnings.warn(
                    f"shared tier: the store raised {type(e).__name__} outside the SharedStore protocol ({e}); "
                    "counted as a failed call (stats.errors), served as a miss",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return False, None

    # ------------------------------------------------------------- publish
    def publish(
        self,
        ids: np.ndarray,
        namespace: Hashable,
        pool: LinearStatePool,
        slot: int,
        kv_indices: torch.Tensor,
        kv_after: Fence | None,
        *,
        expect: int | None = None,
        token: Hashable = None,
    ) -> bool:
        """Publish the state in ``pool``'s ``slot`` (the state after all of ``ids``) with the KV of
        ``kv_indices``; the caller made sure the slot's and the KV's writers completed or passes
        their fence (``kv_after``; the pool orders its own reads). True when a blob was stored
        (with ``background``: handed to the writer, which stores it unless the store fails).
        A key this tier published or fetched before is not published again (one whose copy was
        refused for its fingerprint, see ``expect``, is).

        With ``expect`` (the fingerprint the state must have: forensics' donation fingerprint), the
        fingerprint the tier takes of its copy anyway (on the writer thread, with ``background``)
        is compared with it: a copy that differs is not stored (``stats.publish_changed``), and
        every compared publication becomes a :class:`PublishCheck` carrying ``token`` (any
        hashable), collected by :meth:`checks`. The slot is read once either way: the check costs
        the calling thread nothing more.

        :raises ProtocolError: (a ``RuntimeError``) the tier was never bound. :raises TypeError:
            ``ids`` not an integer numpy array, ``pool`` not a pool, ``kv_indices`` not an integer
            tensor, ``kv_after`` not a fence, ``expect`` not an int (or None), ``token``
            unhashable, a namespace the tier cannot address. :raises ValueError: ``ids`` not 1-D,
            or ``kv_indices`` not one index per id. Nothing changes when it raises.
        """
        if self._layout is None:
            raise ProtocolError("SharedTier.publish before bind (give the tier to a CacheManager)")
        _check_ids(ids)
        if not isinstance(pool, LinearStatePool):
            raise TypeError(f"pool must be a LinearStatePool, got {type(pool).__name__}")
        dt = kv_indices.dtype if isinstance(kv_indices, torch.Tensor) else None
        if dt is None or dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise TypeError(f"kv_indices must be an integer tensor, got {type(kv_indices).__name__} of {dt}")
        if kv_indices.dim() != 1 or kv_indices.numel() != ids.size:
            raise ValueError(
                f"kv_indices must hold one index per id: shape {tuple(kv_indices.shape)} for {ids.size} ids"
            )
        if kv_after is not None and not isinstance(kv_after, Fence):
            raise TypeError(f"kv_after must be a Fence or None, got {type(kv_after).__name__}")
        if expect is not None and (isinstance(expect, bool) or not isinstance(expect, (int, np.integer))):
            raise TypeError(f"expect must be an int fingerprint or None, got {type(expect).__name__}")
        try:
            hash(token)
        except TypeError:
            raise TypeError(f"token must be hashable, got {type(token).__name__}") from None
        depth = int(ids.size)
        key = self._keys(ids, namespace, [depth])[0]  # ids checked above
        if key in self._done or self.down:
            return False
        spare = None
        if pool.layout == self._layout:
            with self._lock:
                spare = self._spares.pop() if self._spares else None
        try:
            conv, rec = pool.read(slot, out=spare)  # host copies: the slot may be reused once this returns
        except BaseException:
            if spare is not None:
                self._spare(spare)  # nothing changes when it raises
            raise
        try:
            kv = self.kv.export_kv(kv_indices, kv_after)
        except Exception as e:  # the host's code: this publication is dropped, serving goes on
            self.codec_failed("export_kv", e)
            self._spare((conv, rec))
            return False
        job = _Upload(key, self.index(namespace), depth, conv, rec, kv, None if expect is None else int(expect), token)
        if self.background:
            # The fingerprint, the encoding and the upload run on the writer thread, from the copies.
            if self._writer is None and not self._closed:
                self._writer = _Writer(self)
            if self._writer is None or not self._writer.submit(job):
                with self._lock:
                    self.stats.publish_skipped += 1
                self._spare((conv, rec))
                self._reuse_kv(kv)
                return False
            self._remember(key)  # a failed upload is not retried: the tree still serves it here
            return True
        ok, _ = self._store(job, pool.fingerprint(slot))
        if not ok:
            return False
        self._remember(key)
        return True

    def checks(self) -> list[PublishCheck]:
        """The publications compared with their ``expect`` fingerprint since the last call, oldest
        first (and forgets them; at most the last 4,096 are kept between calls). Thread-safe.
        With ``background``, a check comes once the writer fingerprinted the copy (:meth:`flush`
        waits for every one queued)."""
        with self._lock:
            got = list(self._checks)
            self._checks.clear()
        return got

    @property
    def has_checks(self) -> bool:
        """Whether :meth:`checks` has something to return (one read of a deque's length: O(1))."""
        return bool(self._checks)

    def _spare(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep a publication's host copies, encoded and no longer read, for a later one's copy."""
        if not self._spare_fits(state):
            return
        with self._lock:
            if len(self._spares) < _SPARES:
                self._spares.append(state)

    def _reuse_kv(self, kv: bytes | memoryview) -> None:
        """Hand an exported KV the tier is done with back to a codec that reuses its buffers."""
        reuse = getattr(self.kv, "reuse_kv", None)
        if reuse is None:
            return
        try:
            reuse(kv)
        except Exception as e:  # the host's code: its buffer is lost to it, nothing else
            self.codec_failed("reuse_kv", e)

    def kv_free_tokens(self) -> int | None:
        """What the codec's ``free_tokens()`` says the host's allocator has free (see
        :class:`KVCodec`), or None: no such method, or it raised (counted as a codec error) or
        answered something other than an int >= 0 (counted too)."""
        free = getattr(self.kv, "free_tokens", None)
        if free is None:
            return None
        try:
            n = free()
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise TypeError(f"free_tokens() must return an int >= 0, got {n!r}")
        except Exception as e:  # the host's code: no eviction for this fetch, nothing else
            self.codec_failed("free_tokens", e)
            return None
        return int(n)

    def _spare_fits(self, state: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether ``state`` is a host pair of the bound layout's shapes and dtypes."""
        lay = self._layout
        return (
            lay is not None
            and (tuple(state[0].shape), tuple(state[1].shape)) == lay.state_shapes
            and state[0].dtype == lay.conv_dtype
            and state[1].dtype == lay.recurrent_dtype
            and state[0].device.type == state[1].device.type == "cpu"
        )

    def _store(self, job: _Upload, fingerprint: int) -> tuple[bool, bool]:
        """Encode one publication and upload it, recording its depth (the caller's thread or the
        writer's): whether the store answered, and whether the blob was stored (not there
        already). The state copies are kept for reuse once encoded (``fingerprint`` was taken
        before). A copy whose fingerprint is not the one ``job.expect`` names is not stored:
        (False, False), as for a store that did not answer."""
        if job.expect is not None:
            check = PublishCheck(job.token, job.key, job.depth, job.expect, fingerprint)
            with self._lock:
                self._checks.append(check)
                self.stats.publish_changed += not check.ok
                if not check.ok:  # a later publication of this prefix (a clean copy) is stored
                    self._done.pop(job.key, None)
            if not check.ok:
                self._spare((job.conv, job.rec))
                self._reuse_kv(job.kv)
                return False, False
        header = {
            "identity": self._identity,
            "depth": job.depth,
            "fingerprint": fingerprint,
            "state_bytes": job.conv.nbytes + job.rec.nbytes,
            "kv_bytes": memoryview(job.kv).nbytes,
            "publisher": self.publisher,
        }
        blob = encode_blob(header, (job.conv, job.rec), job.kv, key=job.key, secret=self._secret)
        self._spare((job.conv, job.rec))  # fingerprinted and encoded: the copies are done with
        self._reuse_kv(job.kv)
        key, index, depth = job.key, job.index, job.depth

        def put() -> bool:
            stored = self.store.put(key, blob)
            self.store.add_depth(index, depth)
            return stored

        ok, stored = self._guarded(put)
        if ok and stored:
            with self._lock:
                self.stats.published += 1
        return ok, bool(ok and stored)

    @property
    def pending_writes(self) -> int:
        """Publications handed to the writer thread and not stored yet (0 without ``background``)."""
        return 0 if self._writer is None else self._writer.pending

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the writer thread stored every publication handed to it (or failed to);
        True when none is left (always without ``background``), False at ``timeout_s``.

        :raises ValueError: a negative or NaN ``timeout_s``.
        """
        _check_timeout(timeout_s)
        return True if self._writer is None else self._writer.flush(timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush, then stop the writer thread and the fetcher thread; later publications are dropped
        (counted in ``stats.publish_skipped``), later prefetches not issued, those still out
        forgotten (their :meth:`take` finds none; counted in ``stats.prefetch_dropped`` when not
        answered). Idempotent; fetches keep working. True when the writer left nothing behind.

        :raises ValueError: a negative or NaN ``timeout_s``.
        """
        _check_timeout(timeout_s)
        self._closed = True
        if self._fetcher is not None:
            self._fetcher.close(timeout_s)
        with self._lock:  # the prefetches still out will not be answered
            for job in self._prefetches.values():
                self._forget(job)
            self._prefetches.clear()
        return True if self._writer is None else self._writer.close(timeout_s)

    def _remember(self, key: str) -> None:
        with self._lock:  # the writer thread forgets a key whose copy it refused
            self._done[key] = None
            if len(self._done) > _DONE_CAP:
                self._done.popitem(last=False)

    # --------------------------------------------------------------- fetch
    def _fetch_args(
        self, call: str, ids: np.ndarray, local: int, page: int, limit: int | None, *, scan: bool = True
    ) -> int:
        """Check the arguments of ``call`` (:meth:`fetch`, :meth:`prefetch` or :meth:`take`, as
        :meth:`fetch` documents them); the depth limit. Without ``scan`` the ids' values are not
        range-checked (:meth:`take` only compares them with the prefetch's, which were)."""
        if self._layout is None:
            raise ProtocolError(f"SharedTier.{call} before bind (give the tier to a CacheManager)")
        if scan:
            _check_ids(ids)
        elif not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            _check_ids(ids)  # raises, naming what is wrong
        n = max(int(ids.size) - 1, 0) if limit is None else limit
        for name, v, lo in (("local", local, 0), ("page", page, 1), ("limit", n, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {v!r}")
            if v < lo:
                raise ValueError(f"{name} must be >= {lo}, got {v}")
        if local > ids.size:
            raise ValueError(f"local match {local} is longer than the request's {ids.size} ids")
        if n > ids.size:
            raise ValueError(f"limit {n} is longer than the request's {ids.size} ids")
        return int(n)

    def fetch(
        self, ids: np.ndarray, namespace: Hashable, local: int, *, page: int = 1, limit: int | None = None
    ) -> Fetched | None:
        """The deepest verified blob for a prefix of ``ids`` deeper than ``local`` tokens and at most
        ``limit`` deep (default ``len(ids) - 1``: an admission computes at least its last token)
        whose depth is a multiple of ``page`` (the tree keeps whole pages only: a replica with
        another page size may have published depths this tree cannot hold), staged in the tier's
        staging slot; None: a miss (nothing deeper, the store down, or the blob rejected: then
        ``on_reject`` heard why and the blob was deleted). On the caller's thread: up to three
        store round trips (see :meth:`prefetch` for the way off it).

        :raises ProtocolError: (a ``RuntimeError``) the tier was never bound. :raises TypeError:
            ``ids`` not an integer numpy array, ``local``, ``page`` or ``limit`` not ints, a
            namespace the tier cannot address. :raises ValueError: ``ids`` not 1-D, ``local``
            outside ``[0, len(ids)]``, ``page`` < 1, ``limit`` outside ``[0, len(ids)]``. Nothing
            changes when it raises.
        """
        n = self._fetch_args("fetch", ids, local, page, limit)
        index = self.index(namespace)  # an unaddressable namespace: a TypeError before anything is counted
        self._drain_deferred()
        if n <= local:
            return None
        got = self._lookup(ids, namespace, index, local, n, page, self._stage, self._stage_slot, self._stage_owner)
        self._drain_deferred()
        return got

    def _lookup(
        self,
        ids: np.ndarray,
        namespace: Hashable,
        index: str,
        local: int,
        n: int,
        page: int,
        stage: LinearStatePool | None,
        slot: int,
        owner: RequestOwner,
        keep_state: bool = False,
    ) -> Fetched | None:
        """:meth:`fetch`'s store work, on the caller's thread or (``keep_state``: the verified
        state stays in the answer) the fetcher's, which yields the GIL while it hashes keys: what
        it learns for the scheduler's thread (rejections, keys fetched) waits in the deferred
        queue."""
        with self._lock:
            self.stats.probes += 1
        self._trim(index)
        # Deepest first, in batches that double (64, 128, ...), each asked of the store's index and
        # checked in one round trip each: the prefix a request finds is nearly always among the
        # deepest candidates (its own end, or its shared prompt's), so its keys are the only ones
        # hashed; max_probes (1,024) candidates cost at most 5 batches. NOTE: reading the whole
        # range first (2,048 depths on a busy index) cost the fetcher thread 0.6 ms of CPU per
        # probe, and hashing every key before one check about 2 ms (benchmarks/bench_shared_probe.py).
        deepest = deepest_of(self.store)
        hi, batch, left = n, _FIRST_BATCH, self.max_probes
        while left > 0:
            ask = min(batch, left)
            ok, got = self._guarded(lambda hi=hi, ask=ask: deepest(index, local, hi, ask))  # type: ignore[misc]
            if not ok or not isinstance(got, list):
                return None
            # what the store answered, as the protocol says: in (local, hi], deepest first, once each
            # (a key hashed for a depth out of order would name another prefix's blob)
            raw = sorted({int(d) for d in got if isinstance(d, (int, np.integer)) and local < d <= hi}, reverse=True)
            if not raw:
                return None
            part = (raw if page == 1 else [d for d in raw if d % page == 0])[:left]
            left -= len(part)
            keys = self._keys(ids, namespace, part[::-1], keep_state)[::-1]  # deepest first
            ok, there = self._guarded(lambda keys=keys: self.store.exists(keys) if keys else [])  # type: ignore[misc]
            if not ok:
                return None
            assert isinstance(there, list)
            for d, k, present in zip(part, keys, there, strict=True):
                if not present:
                    continue
                ok, blob = self._guarded(lambda k=k: self.store.get(k))  # type: ignore[misc]
                if not ok:
                    return None
                if blob is None:  # deleted in between
                    continue
                assert isinstance(blob, (bytes, memoryview))
                got_blob = self._verify(blob, k, d, stage, slot, owner, keep_state)
                if got_blob is None:
                    self._remove_refused(k, blob)
                    return None
                return got_blob
            if len(got) < ask:  # the index has nothing shallower
                return None
            hi, batch = raw[-1] - 1, 2 * batch
        return None

    def _remove_refused(self, key: str, blob: bytes | memoryview) -> None:
        """Remove the refused ``blob`` from the store, so that a healthy replica can publish the
        prefix again: only while it is still the version read (its last bytes, where a valid
        blob's digest is), when the store can say (``delete_version``), else by key."""
        tail = bytes(memoryview(blob)[-DIGEST_BYTES:])
        remove = getattr(self.store, "delete_version", None)
        if remove is not None:
            self._guarded(lambda: remove(key, tail))
        else:
            self._guarded(lambda: self.store.delete(key))

    def _trim(self, index: str) -> None:
        """Drop the depths of ``index`` whose every blob expired (stores that know: a
        :class:`RedisStore` with a ``ttl_s``), at most once per ``retry_s`` per index."""
        trim = getattr(self.store, "trim_depths", None)
        if trim is None:
            return
        now = self.clock()
        with self._lock:
            if self._trimmed_at.get(index, -1e300) + max(self.retry_s, 1.0) > now:
                return
            self._trimmed_at[index] = now
            if len(self._trimmed_at) > _DONE_CAP:
                self._trimmed_at.clear()
        ok, n = self._guarded(lambda: trim(index))
        if ok and isinstance(n, int) and n:
            with self._lock:
                self.stats.trimmed += n

    # ------------------------------------------------------------ prefetch
    def prefetch(
        self,
        rid: Hashable,
        ids: np.ndarray,
        namespace: Hashable,
        local: int,
        *,
        page: int = 1,
        limit: int | None = None,
    ) -> bool:
        """Start :meth:`fetch`'s work for request ``rid`` on the tier's fetcher thread (started at
        the first prefetch): call it when the request arrives; :meth:`take` reads the answer when
        it is admitted. The scheduler's thread pays this call (a copy of ``ids`` and a queue
        append) and :meth:`take`'s dictionary look-up; the store's round trips, the digest and the
        fingerprint run on the fetcher thread, in a one-slot pool of its own. True when issued;
        False: nothing to ask (``limit <= local``, an unaddressable namespace), ``rid`` has one
        outstanding already, or the tier is closed. Beyond ``max_prefetches`` outstanding, the
        oldest is dropped (counted in ``stats.prefetch_dropped``).

        :raises: as :meth:`fetch` for bad arguments; :raises TypeError: an unhashable ``rid``.
            Nothing changes when it raises.
        """
        n = self._fetch_args("prefetch", ids, local, page, limit)
        if not self.addressable(namespace):
            return False
        index = self.index(namespace)
        hash(rid)
        self._drain_deferred()
        if n <= local or self._closed:
            return False
        with self._lock:
            if rid in self._prefetches:
                return False
            job = _Prefetch(rid, ids.copy(), namespace, index, int(local), n, int(page))
            self._prefetches[rid] = job
            self.stats.prefetches += 1
            while len(self._prefetches) > self.max_prefetches:
                _, old = self._prefetches.popitem(last=False)
                old.cancelled = True
                self.stats.prefetch_dropped += 1
                self._release(old)
        self.start_prefetching()  # a host that did not call it at set-up: started here
        assert self._fetcher is not None
        self._fetcher.submit(job)
        return True

    def start_prefetching(self) -> None:
        """Start the fetcher thread :meth:`prefetch` hands its work to (and its one-slot staging
        pool) now: a host that prefetches calls it at set-up, so its first request's arrival does
        not pay for them (0.5 to 2.5 ms on the scheduler's thread, measured on a 2-core CPU).
        Without it the first :meth:`prefetch` starts them. Idempotent.

        :raises ProtocolError: (a ``RuntimeError``) the tier was never bound (a
            :class:`CacheManager` binds it), or it is closed. Nothing changes when it raises.
        """
        if self._layout is None:
            raise ProtocolError("SharedTier.start_prefetching before bind (give the tier to a CacheManager)")
        if self._closed:
            raise ProtocolError("SharedTier.start_prefetching after close")
        if self._fetcher is None:
            self._fetcher = _Fetcher(self)

    @property
    def prefetching(self) -> bool:
        """Whether the fetcher thread was started (and the tier not closed since)."""
        return self._fetcher is not None and not self._closed

    @property
    def prefetch_bytes(self) -> int:
        """What the answered prefetches waiting for their admissions hold now (bytes, at most
        ``max_prefetch_bytes``)."""
        with self._lock:
            return self._prefetch_bytes

    def prefetch_pending(self, rid: Hashable) -> bool:
        """Whether ``rid`` has a prefetch the fetcher thread has not answered yet (a host may hold
        the request back until it is answered, as the vLLM connector does)."""
        with self._lock:
            job = self._prefetches.get(rid)
            return job is not None and not job.done

    def cancel(self, rid: Hashable) -> None:
        """Forget ``rid``'s prefetch (the request ended without an admission); a no-op without one."""
        with self._lock:
            job = self._prefetches.pop(rid, None)
            if job is not None:
                self._forget(job)

    def _forget(self, job: _Prefetch) -> None:
        """A prefetch no one will take (the caller holds the lock and unlists it): the fetcher
        skips it, and it counts as dropped when it was not answered."""
        job.cancelled = True
        self.stats.prefetch_dropped += not job.done
        self._release(job)

    def _release(self, job: _Prefetch) -> None:
        """An unlisted prefetch lets go of its answer (the caller holds the lock)."""
        self._prefetch_bytes -= job.nbytes
        job.nbytes = 0
        job.result = None

    def _answered(self, job: _Prefetch, got: Fetched | None) -> None:
        """The fetcher's answer to ``job`` (the caller holds the lock): kept while the request is
        still listed, then the oldest answers dropped while they hold more than
        ``max_prefetch_bytes`` (this one last)."""
        job.done = True
        if job.cancelled or got is None or self._prefetches.get(job.rid) is not job:
            return
        job.result, job.nbytes = got, _held_bytes(got)
        self._prefetch_bytes += job.nbytes
        while self._prefetch_bytes > self.max_prefetch_bytes:
            rid, old = next((r, j) for r, j in self._prefetches.items() if j.nbytes)
            del self._prefetches[rid]
            old.cancelled = True
            self.stats.prefetch_dropped += 1
            self._release(old)

    def take(
        self,
        rid: Hashable,
        ids: np.ndarray,
        namespace: Hashable,
        local: int,
        *,
        page: int = 1,
        limit: int | None = None,
    ) -> tuple[bool, Fetched | None]:
        """At ``rid``'s admission: ``(False, None)`` when it has no prefetch (fetch now, or serve
        locally); else ``(True, blob)``: the prefetched blob when it is answered, deeper than
        ``local``, within ``limit``, a multiple of ``page`` and a prefix of these ``ids`` in this
        namespace (with its state in ``blob.state``), or ``None`` (not answered yet: counted in
        ``stats.prefetch_late``; a miss; or no longer deeper than the local match). One dictionary
        look-up, plus a comparison of the blob's ids on a hit. The prefetch is consumed.

        :raises: as :meth:`fetch` for bad arguments. Nothing changes when it raises.
        """
        n = self._fetch_args("take", ids, local, page, limit, scan=False)
        with self._lock:
            job = self._prefetches.pop(rid, None)
            if job is None:
                return False, None
            late = not job.done
            if late:
                job.cancelled = True
                self.stats.prefetch_late += 1
            got = None if late else job.result
            self._release(job)
        self._drain_deferred()
        if got is None:
            return True, None
        d = got.depth
        same = job.namespace == namespace and np.array_equal(ids[:d], job.ids[:d])
        if not (local < d <= n and d % page == 0 and same):
            return True, None
        return True, got

    def _drain_deferred(self) -> None:
        """Deliver what the fetcher thread learnt (rejections to ``on_reject``, fetched keys to the
        remembered ones), on the caller's (the scheduler's) thread."""
        if not self._deferred:
            return
        with self._lock:
            items, self._deferred = self._deferred, []
        for item in items:
            if isinstance(item, str):
                self._remember(item)
            else:
                reason, key, depth, publisher, kw = item
                self._reject(reason, key, depth, publisher, **kw)

    def _refuse(self, reason: RejectReason, key: str, depth: int, publisher: str, **kw: object) -> None:
        """A blob refused during a lookup: reported on the scheduler's thread (deferred)."""
        with self._lock:
            self._deferred.append((reason, key, depth, publisher, kw))

    def _reject(self, reason: RejectReason, key: str, depth: int, publisher: str, **kw: object) -> None:
        self.stats.rejected[reason.value] = self.stats.rejected.get(reason.value, 0) + 1
        if self.on_reject is not None:
            self.on_reject(Rejection(reason, key, depth, publisher, **kw))  # type: ignore[arg-type]

    def _verify(
        self,
        blob: bytes | memoryview,
        key: str,
        depth: int,
        stage: LinearStatePool | None,
        slot: int,
        owner: RequestOwner,
        keep_state: bool,
    ) -> Fetched | None:
        parsed = parse_blob(blob)
        if parsed is None:
            self._refuse(RejectReason.FORMAT, key, depth, "?", detail=f"{len(blob)} bytes, not a whole blob header")
            return None
        header, body = parsed
        publisher = str(header.get("publisher", "?"))
        if header.get("identity") != self._identity:
            self._refuse(RejectReason.LAYOUT, key, depth, publisher, detail=f"published for {header.get('identity')!r}")
            return None
        layout = self._layout
        assert layout is not None and stage is not None
        state_bytes, kv_bytes, fp = header.get("state_bytes"), header.get("kv_bytes"), header.get("fingerprint")
        if (
            header.get("depth") != depth
            or state_bytes != layout.slot_bytes
            or not isinstance(kv_bytes, int)
            or not isinstance(fp, int)
            or len(body) != layout.slot_bytes + kv_bytes + DIGEST_BYTES
        ):
            self._refuse(
                RejectReason.LENGTH,
                key,
                depth,
                publisher,
                detail=f"depth {header.get('depth')}, state {state_bytes} of {layout.slot_bytes} bytes, "
                f"kv {kv_bytes}, body {len(body)} bytes",
            )
            return None
        signed, stored = memoryview(blob)[:-DIGEST_BYTES], blob[-DIGEST_BYTES:]  # a view: no copy of the blob
        if not hmac.compare_digest(blob_digest(key, signed, self._secret), stored):
            self._refuse(
                RejectReason.DIGEST,
                key,
                depth,
                publisher,
                detail="blake2b over the address, header, state and KV does not match"
                + (" (keyed: another secret, or the bytes changed)" if self._secret else " (the bytes changed)"),
            )
            return None
        conv_n = layout.num_layers * layout.conv_bytes_per_layer
        conv_shape, rec_shape = layout.state_shapes
        conv = bytes_tensor(body[:conv_n], layout.conv_dtype, conv_shape)
        rec = bytes_tensor(body[conv_n : layout.slot_bytes], layout.recurrent_dtype, rec_shape)
        stage.write(slot, conv, rec, owner=owner).wait()
        found = stage.fingerprint(slot)
        if found != fp:
            self._refuse(RejectReason.FINGERPRINT, key, depth, publisher, expected=fp, found=found)
            return None
        with self._lock:
            self._deferred.append(key)  # fetched here: never published again from here
        state = (conv, rec) if keep_state else None
        # NOTE: a view, not bytes(...): the copy of a 1 MB KV held the interpreter lock for about
        # 0.2 ms per fetched blob, on the fetcher thread or, for a fetch at admission, the caller's.
        return Fetched(depth, body[layout.slot_bytes : -DIGEST_BYTES], publisher, fp, state)

    @property
    def staging(self) -> tuple[LinearStatePool, int, RequestOwner]:
        """The one-slot CPU pool, its slot and owner a verified fetch is staged in."""
        assert self._stage is not None, "bind first"
        return self._stage, self._stage_slot, self._stage_owner

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken rule: the staging pool holds exactly
        its one slot, owned by the staging owner, and passes its own invariants; the remembered
        keys stay bounded; the counters are consistent (no hit without a probe, no foreign hit
        without a hit, none negative); the KV codec's own ``check_invariants`` when it has one
        (the engines' codecs: their kept export buffers). O(counters)."""
        if self._stage is not None:
            stage = self._stage
            stage.check_invariants()
            owner = stage.owner_of(self._stage_slot)
            assert owner == self._stage_owner, f"staging slot {self._stage_slot} is owned by {owner}"
            assert stage.num_free == 0 and stage.capacity == 1, (
                f"staging pool: {stage.num_free} free of {stage.capacity}, expected its one slot held"
            )
        else:
            assert not self._identity, "an identity without a bound layout"
        assert len(self._done) <= _DONE_CAP, f"{len(self._done)} remembered keys, cap {_DONE_CAP}"
        assert self.background or self._writer is None, "a writer thread on a tier without background"
        if self._writer is not None:
            self._writer.check_invariants()
        with self._lock:
            assert len(self._spares) <= _SPARES, f"{len(self._spares)} spare state copies kept, cap {_SPARES}"
            assert all(self._spare_fits(st) for st in self._spares), "a spare state copy of another layout"
            assert len({id(t) for st in self._spares for t in st}) == 2 * len(self._spares), "a spare kept twice"
            assert len(self._prefetches) <= self.max_prefetches, (
                f"{len(self._prefetches)} prefetches outstanding, cap {self.max_prefetches}"
            )
            assert all(not job.cancelled for job in self._prefetches.values()), "a cancelled prefetch still listed"
            held = sum(job.nbytes for job in self._prefetches.values())
            assert held == self._prefetch_bytes <= self.max_prefetch_bytes, (
                f"answered prefetches hold {held} bytes, counted {self._prefetch_bytes}, cap {self.max_prefetch_bytes}"
            )
        if self._fetcher is not None:
            self._fetcher.check_invariants()
        codec_check = getattr(self.kv, "check_invariants", None)  # a codec's own (its kept buffers)
        if codec_check is not None:
            codec_check()
        st = self.stats
        for name, v in st.as_dict().items():
            values = v.values() if isinstance(v, dict) else [v]
            assert all(isinstance(x, int) and x >= 0 for x in values), f"stats.{name} = {v!r}"
        assert st.hits <= st.probes, f"{st.hits} shared hits from {st.probes} probes"
        assert st.foreign_hits <= st.hits, f"{st.foreign_hits} foreign hits of {st.hits} hits"

    def counted_hit(self, fetched: Fetched, extra_tokens: int) -> None:
        """The manager served a request from ``fetched`` (covering ``extra_tokens`` beyond its
        local match)."""
        self.stats.hits += 1
        self.stats.hit_tokens += extra_tokens
        self.stats.foreign_hits += fetched.publisher != self.publisher


@dataclass(frozen=True)
class _Upload:
    """One publication, copied out of its slot: what the store gets, once fingerprinted and encoded."""

    key: str
    index: str
    depth: int
    conv: torch.Tensor  # host copies of the slot's state
    rec: torch.Tensor
    kv: bytes | memoryview
    expect: int | None = None  # the fingerprint the copy must have (publish(expect=)), else unchecked
    token: Hashable = None  # the publisher's, returned in the PublishCheck

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.rec.nbytes + memoryview(self.kv).nbytes


@dataclass(eq=False)
class _Prefetch:
    """One request's prefetch: its arguments, then (set by the fetcher thread) its answer."""

    rid: Hashable
    ids: np.ndarray
    namespace: Hashable
    index: str
    local: int
    limit: int
    page: int
    done: bool = False
    cancelled: bool = False
    result: Fetched | None = None
    nbytes: int = 0  # what its answer holds while listed (SharedTier.max_prefetch_bytes)


class _Fetcher:
    """The tier's fetcher thread: answers prefetches in arrival order, one at a time, with the
    store's round trips, the digest and the fingerprint (in a one-slot CPU pool of its own). It
    touches only its pool, the store, the prefetch records and the tier's locked counters and
    deferred queue; the scheduler's thread delivers what it learnt."""

    def __init__(self, tier: SharedTier) -> None:
        self.tier = tier
        assert tier.layout is not None, "bind first"
        self._stage = LinearStatePool(tier.layout, 1)
        self._owner = RequestOwner("shared-tier fetcher")
        self._slot = self._stage.alloc(self._owner)
        self._cv = threading.Condition()
        self._queue: deque[_Prefetch] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixcache-shared-fetcher", daemon=True)
        self._thread.start()
        _THREADS.add(self)

    def submit(self, job: _Prefetch) -> None:
        with self._cv:
            if self._closed:
                job.cancelled = True
                return
            self._queue.append(job)
            self._cv.notify_all()

    def _run(self) -> None:
        tier = self.tier
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
            if job.cancelled:
                continue
            got: Fetched | None = None
            try:
                got = tier._lookup(
                    job.ids, job.namespace, job.index, job.local, job.limit, job.page, self._stage, self._slot,
                    self._owner, True,
                )  # fmt: skip
            except Exception as e:  # outside code raised past the guards: a miss, the thread goes on
                with tier._lock:
                    tier.stats.errors += 1
                warnings.warn(
                    f"shared tier fetcher: a prefetch raised {type(e).__name__}: {e}", RuntimeWarning, stacklevel=1
                )
            with tier._lock:
                tier._answered(job, got)

    def close(self, timeout_s: float | None) -> None:
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.cancelled = True
            self._queue.clear()
            self._cv.notify_all()
        self._thread.join(timeout_s)

    def stop_at_exit(self) -> None:
        """The interpreter exits: the queued prefetches are dropped, the one in flight finishes."""
        self.close(None)

    def check_invariants(self) -> None:
        assert self._stage.owner_of(self._slot) == self._owner, "the fetcher's staging slot changed owner"


class _Writer:
    """The tier's writer thread: fingerprints, encodes and uploads queued publications in order,
    one at a time, from their host copies (in a one-slot CPU pool of its own, so the fingerprint is
    the pool's). Nothing it runs touches the manager's pools, a tree or a device: only its own
    pool, the store and the tier's locked counters."""

    def __init__(self, tier: SharedTier) -> None:
        self.tier = tier
        assert tier.layout is not None, "bind first"
        self._stage = LinearStatePool(tier.layout, 1)
        self._owner = RequestOwner("shared-tier writer")
        self._slot = self._stage.alloc(self._owner)
        self._cv = threading.Condition()
        self._queue: deque[_Upload] = deque()
        self._queued_bytes = 0
        self._busy = False  # an upload in flight (popped, not finished)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixcache-shared-writer", daemon=True)
        self._thread.start()
        _THREADS.add(self)

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + self._busy

    def submit(self, job: _Upload) -> bool:
        """Queue one publication; False (nothing queued) when closed or over the byte cap."""
        with self._cv:
            if self._closed or self._queued_bytes + job.nbytes > self.tier.max_queued_bytes:
                return False
            self._queue.append(job)
            self._queued_bytes += job.nbytes
            self._cv.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:  # closed and drained
                    return
                job = self._queue.popleft()
                self._queued_bytes -= job.nbytes
                self._busy = True
            try:
                self._stage.write(self._slot, job.conv, job.rec, owner=self._owner).wait()
                self.tier._store(job, self._stage.fingerprint(self._slot))
            except Exception as e:  # a store outside the protocol: the upload is lost, the thread goes on
                with self.tier._lock:
                    self.tier.stats.errors += 1
                warnings.warn(
                    f"shared tier writer: upload of {job.key} raised {type(e).__name__}: {e}",
                    RuntimeWarning,
                    stacklevel=1,
                )
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def flush(self, timeout_s: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, timeout_s: float | None) -> bool:
        drained = self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        return drained

    def stop_at_exit(self) -> None:
        """The interpreter exits without :meth:`SharedTier.close`: the queued uploads are stored
        for up to ``exit_flush_s`` seconds (they were dropped at once until 2026-12-07: a replica
        that exits took its last publications with it), the rest dropped, the one in flight
        finishes."""
        if self.tier.exit_flush_s > 0:
            self.flush(self.tier.exit_flush_s)
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._queued_bytes = 0
            self._cv.notify_all()
        self._thread.join()

    def check_invariants(self) -> None:
        with self._cv:
            got = sum(job.nbytes for job in self._queue)
            assert got == self._queued_bytes, f"writer queue holds {got} bytes, counted {self._queued_bytes}"
            assert self._queued_bytes <= self.tier.max_queued_bytes, (
                f"writer queue holds {self._queued_bytes} bytes, cap {self.tier.max_queued_bytes}"
            )
            assert self._stage.owner_of(self._slot) == self._owner, "the writer's staging slot changed owner"


# The tiers' threads run torch work (a blob's digest, fingerprint and copies): one still inside a
# torch kernel when the interpreter finalizes aborts the process ("terminate called without an
# active exception", exit status 134), which a CI smoke run of the SGLang shared benchmark hit
# (2026-12-07). At exit, before finalization, each thread finishes its job in flight and ends.
_THREADS: weakref.WeakSet[_Fetcher | _Writer] = weakref.WeakSet()


@atexit.register
def _stop_threads_at_exit() -> None:
    for worker in list(_THREADS):
        worker.stop_at_exit()
