"""Host memory for a paged engine's hybrid prefix cache: KV pages and snapshot slots behind one
:class:`~radixcache.CacheManager` (what :class:`~radixcache.vllm.RadixcacheConnector` keeps).

A paged engine (vLLM) computes KV a block of ``block_tokens`` tokens at a time and leaves the
linear state after a block-aligned prefix in a block of its own. The store keeps copies of both in
host memory under a byte budget:

- the attention KV of each block, one page per block (``kv_layers`` rows of ``kv_page_bytes``
  raw bytes, the engine's own page bytes), handed out by a :class:`~radixcache.KVPageList`;
- the linear state after a prefix, one slot of a :class:`~linear_state.LinearStatePool`
  (every linear layer's conv and recurrent state, typed).

The tree (``page_size=block_tokens``) is keyed on the prefix's ids in a namespace; the manager
owns it, runs the policy (which snapshot and which KV go when the budget is full), forensics and
the metrics. This module never touches the tree or the policy: it calls the manager's protocol for
hosts that keep their own slots (``lookup``, ``lock``, ``serve_in_place``, ``checkpoint``,
``evict``, ``discard``).

Verification (``verify=True``): every snapshot is fingerprinted when it is filed and checked
before a hit reads it (:mod:`radixcache.forensics`), every KV page is fingerprinted when it is
copied in and checked before a hit that reads it is reported. A mismatch is a finding and a miss
(the snapshot is discarded): a changed byte is never served.

Nothing here imports vLLM; the connector maps vLLM's blocks and layers onto these calls.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from linear_state import (
    COMPLETE,
    Fence,
    FingerprintJob,
    LinearStatePool,
    RequestOwner,
    SlotId,
    StateLayout,
    ThreadStream,
)
from linear_state.fingerprint import SlotHasher

from ..core.errors import SnapshotRefused
from ..core.kv import KVPageList
from ..core.policy import Policy
from ..core.tree import HybridRadixCache, TreeNode
from ..forensics import Forensics, Ledger
from ..manager import CacheManager
from ..tiers.export_buffers import ExportBuffers
from ..tiers.shared import SharedTier
from ..tiers.store import SharedStore
from .memory import StoreBytes, StoreMapping

__all__ = [
    "VERIFYING",
    "Hit",
    "LookupState",
    "PageCorruption",
    "PagedHostStore",
    "PagedKVCodec",
    "PagedLayout",
    "SavePlan",
    "StoreStats",
]


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class PagedLayout:
    """What the store copies of one engine block.

    :ivar block_tokens: tokens per block (the engine's block; the tree's page).
    :ivar kv_layers: attention layers (one KV page row each).
    :ivar kv_page_bytes: bytes of one attention layer's KV for one block.
    :ivar state: the linear layers' state, one slot per snapshot.
    :ivar kv_format: what a page's bytes mean (heads, head size, dtype, the engine's page layout):
        part of the shared tier's content address, so engines whose pages differ never read each
        other's blobs.
    :raises ValueError: a count below 1. :raises TypeError: ``state`` not a ``StateLayout``,
        ``kv_format`` not a string.
    """

    block_tokens: int
    kv_layers: int
    kv_page_bytes: int
    state: StateLayout
    kv_format: str = ""

    def __post_init__(self) -> None:
        for name in ("block_tokens", "kv_layers", "kv_page_bytes"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if not isinstance(self.state, StateLayout):
            raise TypeError(f"state must be a StateLayout, got {type(self.state).__name__}")
        if not isinstance(self.kv_format, str):
            raise TypeError(f"kv_format must be a string, got {type(self.kv_format).__name__}")

    @property
    def identity(self) -> str:
        """What one block's KV pages are, as the shared tier's codec identity."""
        return (
            f"paged|block={self.block_tokens}|layers={self.kv_layers}|page_bytes={self.kv_page_bytes}|{self.kv_format}"
        )

    @property
    def page_bytes(self) -> int:
        """Host bytes of one block's KV (every attention layer)."""
        return self.kv_layers * self.kv_page_bytes


@dataclass(frozen=True, slots=True)
class Hit:
    """A verified hit, held until :meth:`PagedHostStore.release`: the node is locked (its path's
    KV pages and its snapshot stay, unwritten), and ``slot`` holds the snapshot's state, verified.

    :ivar rid: the engine's request. :ivar start: tokens the engine had already (a block
        multiple). :ivar end: the hit's depth (a block multiple, > ``start``). :ivar pages: host
        pages of blocks ``start / block_tokens`` .. ``end / block_tokens - 1``, in order.
    :ivar slot: the snapshot's own slot (the tree's: read it only, while the hit is held).
    """

    rid: Hashable
    node: TreeNode
    start: int
    end: int
    pages: tuple[int, ...]
    slot: SlotId


class LookupState(enum.Enum):
    """What :meth:`PagedHostStore.lookup_in_background` answers while it has no answer yet."""

    VERIFYING = "verifying"
    """A hit is locked and its verification runs on the store's copy thread: ask again."""


VERIFYING = LookupState.VERIFYING


@dataclass(eq=False, slots=True)
class _Verification:  # a hit locked while the copy thread verifies it (lookup_in_background)
    rid: Hashable
    node: TreeNode
    ids: np.ndarray  # the ids it was looked up with
    namespace: Hashable
    computed: int
    end: int
    pages: tuple[int, ...]
    page_fps: list[int]  # filled on the copy thread
    snapshot: FingerprintJob
    done: Fence  # the pages' fingerprints, submitted after the snapshot's


@dataclass(slots=True)
class SavePlan:
    """A block-aligned prefix to copy in and file (:meth:`PagedHostStore.plan_save`): the engine
    copies the blocks of ``start .. end`` into ``pages`` and the state after ``end`` into
    ``slot`` in the step that computes them, then :meth:`PagedHostStore.commit` files it.

    :ivar ids: the prefix's ids known when planned: all ``end`` of them, or its first ones (the
        rest are the step's input tokens not sampled yet; :meth:`PagedHostStore.commit` takes
        the whole prefix then).
    :ivar start: tokens whose KV the tree held when planned, or an earlier plan still pending
        copies (a block multiple): the plan's pages are the blocks after them.
    :ivar indices: the token indices of ``pages`` (the tree's KV indices once filed).
    :ivar after: the earlier plan whose blocks this one relies on (it was pending when this one
        was planned, and its prefix begins this one's), or None: commit that one first. Cleared
        once this plan is committed or abandoned.
    """

    rid: Hashable
    ids: np.ndarray
    namespace: Hashable
    start: int
    end: int
    indices: torch.Tensor
    pages: tuple[int, ...]
    slot: SlotId
    owner: RequestOwner
    after: SavePlan | None = None


@dataclass(frozen=True, slots=True)
class PageCorruption:
    """A KV page whose bytes changed since they were copied in (found before a hit read it)."""

    page: int
    expected: int
    found: int
    rid: Hashable
    depth: int


@dataclass(slots=True)
class StoreStats:
    """What the store did (counts since it was built)."""

    lookups: int = 0
    offers: int = 0  # lookups that found a verified snapshot (held for the engine)
    offered_tokens: int = 0
    hits: int = 0  # offers the engine loaded (released with ``loaded=True``)
    declined: int = 0  # hits the engine had no room for: turned down by lookup(fits=) or withdrawn (declined=True)
    hit_tokens: int = 0
    saves: int = 0  # snapshots filed (one forensics then finds never written is dropped: corrupt_snapshots)
    saved_pages: int = 0  # pages of the saves handed to the tree (a duplicate it gave back included)
    #: saves not filed, by why: ``held`` (the tree has that snapshot), ``planned`` (a pending plan
    #: files it), ``no-pages``, ``no-slot`` (no room, even after evicting), ``prefix-evicted``
    #: (the blocks before the plan's pages left the tree, or the plan it relied on was abandoned
    #: or filed nothing), ``prefix-pending`` (committed before the plan it relies on), ``corrupt``
    #: (its state never written), and the ``why`` of :meth:`PagedHostStore.abandon`
    #: (the connector's: ``ids-unknown``)
    saves_skipped: dict[str, int] = field(default_factory=dict)
    corrupt_snapshots: int = 0  # snapshots a finding named, refused (dropped now, or once no hit holds them)
    corrupt_pages: int = 0
    verified_pages: int = 0  # KV pages read to verify hits (each lookup reads every page of its hit)

    def skip(self, why: str) -> None:
        self.saves_skipped[why] = self.saves_skipped.get(why, 0) + 1


class PagedKVCodec:
    """The shared tier's :class:`~radixcache.tiers.shared.KVCodec` over a store's host pages: a
    prefix's KV travels as its pages' bytes (``[kv_layers, pages, kv_page_bytes]``, C order).
    Built by :class:`PagedHostStore` when it is given a shared store.

    It exports into :class:`~radixcache.tiers.export_buffers.ExportBuffers` (``buffers``): up to
    two of the buffers the tier handed back (:meth:`reuse_kv`), together at most a quarter of the
    store's KV bytes, the smallest that fits taken: a copy into memory already written skips the
    fresh pages' first touch (``benchmarks/bench_vllm_store.py``: ``export_kv_ms``)."""

    def __init__(self, store: PagedHostStore) -> None:
        self._store = store
        self.identity = store.layout.identity
        self.buffers = ExportBuffers(int(store.kv.numel()) // 4)  # bytes (uint8 pages)

    def export_kv(self, kv_indices: torch.Tensor, after: Fence | None) -> memoryview:
        """The bytes of the whole pages ``kv_indices`` name (``[kv_layers, pages, kv_page_bytes]``,
        C order), read once ``after`` completed: a flat view of a buffer of their own (one handed
        back through :meth:`reuse_kv` when one fits).

        :raises ValueError: not whole pages of the store in order."""
        if after is not None:
            after.wait()
        st, lay = self._store, self._store.layout
        pages = st.pages.pages(kv_indices).tolist()
        need = lay.kv_layers * len(pages) * lay.kv_page_bytes
        if not need:
            return memoryview(b"")
        flat = self.buffers.take(need)[:need]
        out = flat.reshape(lay.kv_layers, len(pages), lay.kv_page_bytes)
        # PERF: page by page by numpy (which lets go of the interpreter lock) into a buffer of its
        # own, handed over as it is: torch's indexed uint8 gather and then ``tobytes`` took 52 ms
        # for a 48 MiB prefix, on the thread that publishes (vLLM's scheduler's), against 13
        # into fresh memory (benchmarks/bench_vllm_store.py)
        src = st.kv.numpy()
        for j, p in enumerate(pages):
            out[:, j] = src[:, p]
        return flat.data

    def reuse_kv(self, kv: bytes | memoryview) -> None:
        """The tier is done with ``kv``, a view :meth:`export_kv` returned: its buffer may be
        written by a later export (:meth:`ExportBuffers.give_back`: anything else is ignored)."""
        self.buffers.give_back(kv)

    @property
    def spare_bytes(self) -> int:
        """Bytes of the exported buffers kept for later exports."""
        return self.buffers.spare_bytes

    def check_invariants(self) -> None:
        """The kept buffers' rules (:meth:`ExportBuffers.check_invariants`)."""
        self.buffers.check_invariants()

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        """Pages for ``num_tokens`` tokens (a whole number of blocks) holding ``data``, their
        fingerprints recorded (with ``verify``); ``None`` when no page is free for them.

        :raises ValueError: ``num_tokens`` not whole blocks, or ``data`` not their pages' bytes.
            Nothing allocated."""
        st, lay = self._store, self._store.layout
        if num_tokens % lay.block_tokens:
            raise ValueError(f"{num_tokens} tokens are not whole {lay.block_tokens}-token blocks")
        n = num_tokens // lay.block_tokens
        want = lay.kv_layers * n * lay.kv_page_bytes
        if len(data) != want:
            raise ValueError(f"{len(data)} KV bytes for {n} pages of {lay.page_bytes} bytes ({want} expected)")
        idx = st.pages.alloc(num_tokens)
        if idx is None:
            return None
        pages = st.pages.pages(idx).tolist()
        if pages:
            # PERF: a read-only numpy view of the blob (no copy of it), copied a page at a time by
            # numpy, which lets go of the interpreter lock while it copies: torch's uint8 indexed
            # assignment of a bytearray copy took 9x as long (41 ms against 4.5 for a 48 MiB
            # prefix, on the scheduler's thread; benchmarks/bench_vllm_store.py). NOTE: not
            # ``torch.frombuffer``: it warns that the view is not writable, and silencing that with
            # ``warnings.catch_warnings`` swaps the process's warning filters while the tier's
            # threads run (it is not thread-safe).
            src = np.frombuffer(data, dtype=np.uint8).reshape(lay.kv_layers, n, lay.kv_page_bytes)
            dst = st.kv.numpy()
            for j, p in enumerate(pages):
                dst[:, p] = src[:, j]
        st.record_pages(pages)
        return idx


class PagedHostStore:
    """KV pages and snapshot slots in host memory behind one :class:`CacheManager`.

    :param layout: what one block holds.
    :param budget_bytes: host bytes for KV pages and snapshot slots together.
    :param policy: the manager's policy (default: hit-density).
    :param verify: fingerprint what is copied in and check it before it is served (default on).
    :param snapshots_per_block: snapshot slots per KV page in the budget's split (default 0.5: a
        snapshot every other block; slots also hold the copies in flight).
    :param pin_memory: page-locked host memory (for an engine on CUDA).
    :param mapped: keep the pages and slots in a file-backed shared mapping
        (:class:`~radixcache.vllm.memory.StoreMapping`, :attr:`mapping`) that an engine's worker
        in another process maps (``mapping.attach()``) to copy in and out; not with
        ``pin_memory``.
    :param ledger: a forensics ledger (with ``verify``).
    :param shared: a store other engines reach too (a :class:`~radixcache.tiers.store.RedisStore`):
        every snapshot filed here is published there with its prefix's pages
        (:class:`~radixcache.tiers.shared.SharedTier`, its writer thread doing the uploads), and a
        lookup whose prefix is deeper there than here fetches it first (verified: digest, layout
        identity, fingerprint; a blob that fails is a miss and a finding). Its failures are misses.
    :param model: the model's identity for the shared tier (name, revision, dtype): engines share
        blobs only when it, the state layout and ``layout.identity`` all agree. Needed with
        ``shared``.
    :param shared_namespace: the deployment's key prefix in the shared store.
    :param secret: keys the blobs' digest (see :class:`~radixcache.tiers.shared.SharedTier`).
    :param copy_thread: run the slot pool's copies (the tree's clone of each saved state),
        forensics' donation fingerprints and a save's page fingerprints on a worker thread of the
        store's own (:class:`~linear_state.ThreadStream`, :attr:`copies`) instead of the
        caller's (default on: :meth:`commit` returns before a 77 MB state is copied). Every read
        waits its fence: a lookup verifies pages once their fingerprints are taken and offers a
        snapshot only once its copy is done and verified, a plan's slot freed at the commit is
        handed out again only once the copy read it, and a state found never written is dropped
        at the next call (or :meth:`synchronize`), before any lookup or publication can serve it.
    :raises ValueError: a budget that holds fewer than 1 page and 2 slots, a bad split, ``shared``
        without ``model``, ``mapped`` with ``pin_memory``, ``copy_thread`` not a bool.
        :raises TypeError: ``shared`` not a ``SharedStore``. :raises OSError: ``mapped``, and the
        shared memory lacks room for the budget (the message gives the bytes).
    """

    def __init__(
        self,
        layout: PagedLayout,
        budget_bytes: int,
        *,
        policy: Policy | None = None,
        verify: bool = True,
        snapshots_per_block: float = 0.5,
        pin_memory: bool = False,
        mapped: bool = False,
        ledger: Ledger | None = None,
        shared: SharedStore | None = None,
        model: str | None = None,
        shared_namespace: str = "radixcache",
        secret: bytes | None = None,
        copy_thread: bool = True,
    ) -> None:
        if not isinstance(layout, PagedLayout):
            raise TypeError(f"layout must be a PagedLayout, got {type(layout).__name__}")
        budget = _positive_int("budget_bytes", budget_bytes)
        if type(verify) is not bool:
            raise ValueError(f"verify must be a bool, got {verify!r}")
        if type(copy_thread) is not bool:
            raise ValueError(f"copy_thread must be a bool, got {copy_thread!r}")
        if not isinstance(snapshots_per_block, (int, float)) or not 0 < snapshots_per_block <= 4:
            raise ValueError(f"snapshots_per_block must be in (0, 4], got {snapshots_per_block!r}")
        if type(mapped) is not bool or (mapped and pin_memory):
            raise ValueError(
                f"mapped must be a bool, and not with pin_memory; got mapped={mapped!r}, pin_memory={pin_memory!r}"
            )
        if shared is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"a shared store needs the model's identity (model=), got {model!r}")
        n_pages, n_slots = self.capacity(layout, budget, snapshots_per_block)
        self.layout = layout
        self.block = layout.block_tokens
        kv_shape = (layout.kv_layers, n_pages, layout.kv_page_bytes)
        #: The shared mapping of :attr:`bytes` (``mapped=True``), else ``None``.
        self.mapping: StoreMapping | None = None
        #: The worker thread's stream of the pool's copies (``copy_thread``), else ``None``.
        self.copies: ThreadStream | None = ThreadStream("radixcache-store") if copy_thread else None
        if mapped:
            self.mapping, mem = StoreMapping.create(kv_shape, layout.state, n_slots)
            self.pool = LinearStatePool(
                layout.state, n_slots, "cpu", storage=(mem.conv, mem.recurrent), stream=self.copies
            )
        else:
            kv = torch.zeros(kv_shape, dtype=torch.uint8)
            if pin_memory:
                kv = kv.pin_memory()
            self.pool = LinearStatePool(layout.state, n_slots, "cpu", pin_memory=pin_memory, stream=self.copies)
            mem = StoreBytes(kv, self.pool.conv, self.pool.recurrent)
        #: The pages and slots as tensors, with the copies an engine's worker makes.
        self.bytes = mem
        self.kv = mem.kv
        self.pages = KVPageList(n_pages, layout.block_tokens)
        #: The shared tier's KV codec over these pages (with ``shared``), else ``None``.
        self.kv_codec: PagedKVCodec | None = None
        tier = None
        if shared is not None:
            assert model is not None
            self.kv_codec = PagedKVCodec(self)
            tier = SharedTier(
                shared, model=model, kv=self.kv_codec, namespace=shared_namespace, secret=secret, background=True
            )
        tree = HybridRadixCache(self.pool, page_size=layout.block_tokens)
        self.forensics = Forensics(self.pool, ledger=ledger, mode="record") if verify else None
        self.manager = CacheManager(
            tree,
            policy,
            host_tier=None,
            kv=self.pages,
            forensics=self.forensics,
            kv_bytes_per_token=max(1, math.ceil(layout.page_bytes / layout.block_tokens)),
            write_checks=False,
            shared=tier,
        )
        self.shared = tier
        if tier is not None:
            tier.start_prefetching()  # the connector prefetches at arrival: not on the first one's
        self.verify = verify
        self._kv_hasher = SlotHasher([self.kv]) if verify else None
        # the copy thread's own (a hasher's scratch buffers are one thread's): a save's pages are
        # fingerprinted there; a lookup waits the last such fence before it verifies pages
        self._kv_thread_hasher = SlotHasher([self.kv]) if verify and copy_thread else None
        self._pages_recorded: Fence = COMPLETE
        self._kv_fp: list[int | None] = [None] * n_pages
        self._bad_pages: set[int] = set()  # pages found changed: refused until written anew
        self.page_findings: list[PageCorruption] = []
        self.stats = StoreStats()
        self._admitted: set[Hashable] = set()
        self._planned: dict[int, SavePlan] = {}  # by id(): plans not yet committed or abandoned
        self._held: dict[int, Hit] = {}  # by id(): hits not yet released (each holds a lock)
        # by node id: snapshots filed whose donation fingerprint forensics may not have taken yet
        # (copy_thread): a finding that one was never written drops it at the next sweep
        self._settling: dict[int, TreeNode] = {}
        self._swept = 0  # forensics findings the sweep has seen
        self._verifying: dict[Hashable, _Verification] = {}  # by request: hits verified on the copy thread
        # by node id: snapshots a finding named that a hit held when found: dropped at a later sweep
        self._condemned: dict[int, tuple[TreeNode, bool]] = {}

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def capacity(layout: PagedLayout, budget_bytes: int, snapshots_per_block: float = 0.5) -> tuple[int, int]:
        """The KV pages and snapshot slots a store of ``budget_bytes`` holds (nothing allocated):
        what :class:`PagedHostStore` checks first.

        :raises ValueError: fewer than 1 page and 2 slots (the message gives the bytes needed)."""
        slot_bytes = layout.state.slot_bytes
        n_pages = int(budget_bytes // (layout.page_bytes + snapshots_per_block * slot_bytes))
        n_slots = int(n_pages * snapshots_per_block)
        if n_pages < 1 or n_slots < 2:
            need = math.ceil(layout.page_bytes * max(1, 2 / snapshots_per_block) + 2 * slot_bytes)
            raise ValueError(
                f"a host budget of {budget_bytes} bytes holds {n_pages} KV pages of {layout.page_bytes} bytes and "
                f"{n_slots} snapshot slots of {slot_bytes} bytes; at least 1 page and 2 slots are needed "
                f"(about {need} bytes)"
            )
        return n_pages, n_slots

    @property
    def num_pages(self) -> int:
        """KV pages the budget holds."""
        return self.pages.num_pages

    @property
    def num_slots(self) -> int:
        """Snapshot slots the budget holds (copies in flight included)."""
        return self.pool.capacity

    def describe(self) -> dict[str, Any]:
        """Sizes, counts and the manager's metrics, as plain data."""
        return {
            "block_tokens": self.block,
            "page_bytes": self.layout.page_bytes,
            "slot_bytes": self.layout.state.slot_bytes,
            "pages": self.num_pages,
            "free_pages": self.pages.free_pages,
            "slots": self.num_slots,
            "free_slots": self.pool.num_free,
            "mapped": self.mapping is not None,
            "snapshots": self.manager.cache.num_snapshots,
            "stats": {
                "lookups": self.stats.lookups,
                "offers": self.stats.offers,
                "declined": self.stats.declined,
                "offered_tokens": self.stats.offered_tokens,
                "hits": self.stats.hits,
                "hit_tokens": self.stats.hit_tokens,
                "saves": self.stats.saves,
                "saved_pages": self.stats.saved_pages,
                "saves_skipped": dict(self.stats.saves_skipped),
                "corrupt_snapshots": self.stats.corrupt_snapshots,
                "corrupt_pages": self.stats.corrupt_pages,
                "verified_pages": self.stats.verified_pages,
            },
            "shared": None if self.shared is None else self.shared.stats.as_dict(),
        }

    # ---------------------------------------------------------------- lookups
    def lookup(
        self,
        rid: Hashable,
        ids: Sequence[int] | np.ndarray,
        *,
        namespace: Hashable = None,
        computed: int = 0,
        fits: Callable[[int], bool] | None = None,
    ) -> Hit | None:
        """The deepest verified snapshot on the path of ``ids`` deeper than ``computed`` (the
        tokens the engine holds already, a block multiple; cap ``ids`` yourself: the engine
        recomputes at least its last token), held until :meth:`release`, or ``None``. The first
        lookup of ``rid`` tells the policy of the request (call :meth:`finished` at its end). A
        snapshot or a KV page that fails verification is a finding and is discarded; the lookup
        then tries the next deeper-than-``computed`` snapshot. O(path + hit bytes).

        ``fits``: asked with the tokens a snapshot would serve beyond ``computed`` before its
        pages and its state are verified; ``False`` (the engine has no room for that hit) ends the
        lookup with ``None``, counted in ``stats.declined``: a hit the engine would turn down costs
        no verification (under memory pressure a waiting request is looked up at every step).

        The hit's state is read in place: ``hit.slot`` is the snapshot's own slot, which the
        node's lock keeps until :meth:`release` (no copy is made here).

        :raises ValueError: ``computed`` not a block multiple >= 0; bad ids. :raises TypeError:
            ``fits`` neither callable nor ``None``. Nothing changed.
        """
        self._check_lookup(computed, fits)
        self._begin(rid, ids, namespace)
        while True:
            found = self._candidate(rid, ids, namespace, computed, fits)
            if found is None:
                return None
            node, d, pages = found
            hit = self._serve(rid, ids, node, computed, d, pages)
            if hit is not None:
                return hit

    def _serve(
        self,
        rid: Hashable,
        ids: Sequence[int] | np.ndarray,
        node: TreeNode,
        computed: int,
        d: int,
        pages: tuple[int, ...],
        page_fps: Sequence[int] | None = None,
        fingerprint: FingerprintJob | None = None,
    ) -> Hit | None:
        """Verify the locked candidate ``node`` (its pages against their records, its snapshot
        through forensics; ``page_fps`` and ``fingerprint``: taken on the copy thread already)
        and hold it as a hit; ``None``: a finding (unlocked; discarded, or refused from now on)."""
        mgr = self.manager
        if not self._pages_intact(pages, rid, d, found=page_fps):
            mgr.unlock(node)
            self._discard(node)  # or, held by another hit, refused by _candidate from now on
            return None
        # NOTE: the worker copies the state out of the snapshot's own slot (the node stays
        # locked until the hit is released): no private copy on vLLM's scheduler thread,
        # 8.8 ms for a 77 MB Qwen3-Next-80B-like state on a 2-core CPU, and no slot taken
        try:
            slot, fence = mgr.serve_in_place(
                node, info=mgr.request_info(ids, d), rid=("load", rid), fingerprint=fingerprint
            )
            fence.wait()
        except SnapshotRefused:
            # forensics found the snapshot changed, or never written (its donation fingerprint
            # taken on the copy thread, maybe while another hit held it): never served; the
            # manager drops it once the last hit holding it lets go
            mgr.unlock(node)
            self.stats.corrupt_snapshots += 1
            return None
        except BaseException:
            mgr.unlock(node)
            raise
        self.stats.offers += 1
        self.stats.offered_tokens += d - computed
        hit = Hit(rid, node, computed, d, pages, slot)
        self._held[id(hit)] = hit
        return hit

    def _candidate(
        self,
        rid: Hashable,
        ids: Sequence[int] | np.ndarray,
        namespace: Hashable,
        computed: int,
        fits: Callable[[int], bool] | None,
    ) -> tuple[TreeNode, int, tuple[int, ...]] | None:
        """The deepest snapshot on the path of ``ids`` deeper than ``computed`` that no finding
        names, locked, with its depth and the hit's pages; ``None``: none (or declined). One a
        finding named (its snapshot, or a page it would read) is discarded and the search goes
        on, or, held by another hit, ends it: a miss."""
        mgr = self.manager
        while True:
            m = mgr.lookup(ids, namespace=namespace)
            if rid not in self._admitted:
                mgr.admitted(mgr.request_info(ids, m.cached_length))
                self._admitted.add(rid)
            d = m.cached_length
            if d <= computed:
                return None
            node = m.node
            pages = tuple(self.pages.pages(m.kv_indices[computed:d]).tolist())
            flagged = self._flagged(node)
            if flagged or (self._bad_pages and not self._bad_pages.isdisjoint(pages)):
                if flagged:
                    self._drop_corrupt(node)
                else:
                    self._discard(node)
                if node.snapshot is None:  # gone: look shallower
                    continue
                return None  # another hit holds it: dropped once it lets go
            if fits is not None and not fits(d - computed):
                self.stats.declined += 1
                return None
            mgr.lock(node)
            return node, d, pages

    def _begin(self, rid: Hashable, ids: Sequence[int] | np.ndarray, namespace: Hashable, count: bool = True) -> None:
        """What a lookup does before its search: counted (``count``), the findings swept, and a
        deeper prefix published by another engine filed first."""
        self.stats.lookups += count
        self._sweep()
        if self.shared is not None:
            self.manager.fetch_shared(ids, namespace=namespace, rid=rid)

    def _check_lookup(self, computed: object, fits: object) -> None:
        if isinstance(computed, bool) or not isinstance(computed, int) or computed < 0 or computed % self.block:
            raise ValueError(f"computed must be a multiple of {self.block} >= 0, got {computed!r}")
        if fits is not None and not callable(fits):
            raise TypeError(f"fits must be a callable of the hit's tokens or None, got {type(fits).__name__}")

    def lookup_in_background(
        self,
        rid: Hashable,
        ids: Sequence[int] | np.ndarray,
        *,
        namespace: Hashable = None,
        computed: int = 0,
        fits: Callable[[int], bool] | None = None,
    ) -> Hit | Literal[LookupState.VERIFYING] | None:
        """:meth:`lookup`, with the hit's verification on the store's copy thread instead of the
        caller's: the first call finds the snapshot, locks it, submits the fingerprints of its
        pages and its state there and answers :data:`VERIFYING`; a later call of the same request
        (the same ``computed``, ``namespace`` and ids up to the hit) answers the hit once they are
        taken and match (or looks further when they do not: each mismatch a finding, the snapshot
        discarded, as :meth:`lookup` does). An engine whose scheduler may ask again at its next
        step (vLLM's ``None`` from ``get_num_new_matched_tokens``) pays a dictionary look-up per
        step instead of a read of every byte of the hit; the request waits a step for it.
        ``fits`` is asked again when the hit is ready. A call with other arguments, or
        :meth:`finished`, gives the pending verification up. Without ``copy_thread`` or
        ``verify``: :meth:`lookup`.

        :raises ValueError, TypeError: as :meth:`lookup`. Nothing changed.
        """
        if self.copies is None or self._kv_thread_hasher is None or self.forensics is None:
            return self.lookup(rid, ids, namespace=namespace, computed=computed, fits=fits)
        self._check_lookup(computed, fits)
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        v = self._verifying.get(rid)
        retried = False
        if v is not None:
            if (
                v.computed != computed
                or v.namespace != namespace
                or arr.size < v.end
                or not np.array_equal(arr[: v.end], v.ids[: v.end])
            ):
                self._give_up(rid)
            elif not v.done.is_complete():
                return VERIFYING
            else:
                del self._verifying[rid]
                got = self._finish(v, fits)
                if got == "declined":
                    return None
                if got != "retry":
                    return got
                retried = True  # a finding: the snapshot is gone; look further, in the background
        self._begin(rid, arr, namespace, count=not retried)
        found = self._candidate(rid, arr, namespace, computed, fits)
        if found is None:
            return None
        node, d, pages = found
        slot, _ = self.manager.cache.snapshot_slot(node)
        snapshot = self.pool.fingerprint_later(slot)  # behind the clone and its donation fingerprint
        hasher, fps = self._kv_thread_hasher, [0] * len(pages)

        def work() -> None:
            for i, p in enumerate(pages):
                fps[i] = hasher.fingerprint(p)

        done = self.copies.submit(work, label=f"verify {len(pages)} pages")  # behind the pages' records
        self._verifying[rid] = _Verification(rid, node, arr, namespace, computed, d, pages, fps, snapshot, done)
        return VERIFYING

    def _finish(self, v: _Verification, fits: Callable[[int], bool] | None) -> Hit | Literal["declined", "retry"]:
        """A background verification done: the hit, ``"declined"`` (no room for it now:
        unlocked), or ``"retry"`` (a finding: unlocked and discarded)."""
        mgr, node = self.manager, v.node
        if fits is not None and not fits(v.end - v.computed):
            mgr.unlock(node)
            self.stats.declined += 1
            return "declined"
        v.done.wait()  # complete: raises if the copy thread failed
        hit = self._serve(v.rid, v.ids, node, v.computed, v.end, v.pages, v.page_fps, v.snapshot)
        return "retry" if hit is None else hit

    def _give_up(self, rid: Hashable) -> None:
        """Drop ``rid``'s background verification (its lock goes)."""
        v = self._verifying.pop(rid, None)
        if v is not None:
            self.manager.unlock(v.node)

    def release(self, hit: Hit, *, loaded: bool = False, declined: bool = False) -> None:
        """Let go of ``hit`` once the engine's copies out of it are done: its node is unlocked.
        ``loaded``: the engine read the hit into its own blocks, and it counts in ``stats.hits`` /
        ``stats.hit_tokens`` (a hit the engine did not take, or looked up again at a later step,
        is an offer only). ``declined``: withdrawn before the engine saw it (no room for it
        there), counted in ``stats.declined``.

        :raises ValueError: both ``loaded`` and ``declined``; ``hit`` released already, or not
            this store's (its lock is another hit's: the snapshot a worker still reads would
            become evictable). Nothing changed."""
        if loaded and declined:
            raise ValueError("a hit is either loaded or declined, not both")
        if self._held.get(id(hit)) is not hit:
            raise ValueError(f"the hit of {hit.rid!r} at depth {hit.end} was released already or is not this store's")
        del self._held[id(hit)]
        self.manager.unlock(hit.node)
        if loaded:
            self.stats.hits += 1
            self.stats.hit_tokens += hit.end - hit.start
        self.stats.declined += declined

    def finished(self, rid: Hashable) -> None:
        """``rid`` ended: the next request of that id is a new request to the policy (and an
        unread prefetch of it is dropped)."""
        self._admitted.discard(rid)
        self._give_up(rid)
        if self.shared is not None:
            self.shared.cancel(rid)

    def prefetch(self, rid: Hashable, ids: Sequence[int] | np.ndarray, *, namespace: Hashable = None) -> bool:
        """Start the shared tier's probe and fetch for ``rid``'s :meth:`lookup` (the same capped
        ``ids``) on the tier's fetcher thread; the lookup takes the answer. True when issued
        (False without a shared store, or when this store holds the whole prefix already).

        :raises TypeError, ValueError: bad ids or namespace. Nothing changed."""
        if self.shared is None:
            return False
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self.manager.prefetch(rid, arr, namespace=namespace, limit=int(arr.size))

    def prefetch_pending(self, rid: Hashable) -> bool:
        """Whether ``rid``'s :meth:`prefetch` is still unanswered."""
        return self.manager.shared_pending(rid)

    def _discard(self, node: TreeNode) -> bool:
        if node.snapshot is not None and not node.snap_lock:
            self.manager.discard(node)
            return True
        return False

    def _flagged(self, node: TreeNode) -> bool:
        """Whether forensics named ``node``'s snapshot in a finding (changed, never written)."""
        return self.forensics is not None and self.forensics.flagged(node.id)

    def _drop_corrupt(self, node: TreeNode, *, save: bool = False) -> None:
        """Discard a snapshot forensics named (counted; ``save``: a save's state never written,
        also counted as a skipped save), or, while another hit holds it, at a later sweep."""
        if self._discard(node):
            self.stats.corrupt_snapshots += 1
            if save:
                self.stats.skip("corrupt")
        elif node.snapshot is not None:
            self._condemned[node.id] = (node, save)

    def record_pages(self, pages: Sequence[int]) -> None:
        """Fingerprint ``pages`` as they are now (their bytes were just copied in): a later change
        is a finding before a hit reads them. A no-op without ``verify``."""
        if self._kv_hasher is not None:
            self._bad_pages.difference_update(pages)  # written anew
            for p in pages:
                self._kv_fp[p] = self._kv_hasher.fingerprint(p)

    def _record_pages_later(self, pages: Sequence[int]) -> None:
        """:meth:`record_pages` on the copy thread (``copy_thread``; at once otherwise): a save's
        new pages, which nothing writes once the engine's worker copied them in."""
        hasher, fps = self._kv_thread_hasher, self._kv_fp
        if hasher is None or self.copies is None:
            self.record_pages(pages)
            return
        pages = tuple(pages)
        self._bad_pages.difference_update(pages)  # written anew (a lookup waits the records)

        def work() -> None:
            for p in pages:
                fps[p] = hasher.fingerprint(p)

        self._pages_recorded = self.copies.submit(work, label=f"fingerprint {len(pages)} pages")

    def _pages_intact(
        self, pages: Sequence[int], rid: Hashable, depth: int, *, found: Sequence[int] | None = None
    ) -> bool:
        """Whether ``pages`` match their recorded fingerprints (``found``: taken already, on the
        copy thread, behind the records); each mismatch a finding."""
        hasher = self._kv_hasher
        if hasher is None:
            return True
        if not self._pages_recorded.is_complete():  # a save's page fingerprints, on the copy thread
            self._pages_recorded.wait()
        ok, bad = True, self._bad_pages
        for i, p in enumerate(pages):
            self.stats.verified_pages += 1
            if p in bad:  # reported already
                ok = False
                continue
            want = self._kv_fp[p]
            now = hasher.fingerprint(p) if found is None else found[i]
            if want is not None and now != want:
                self.page_findings.append(PageCorruption(p, want, now, rid, depth))
                self.stats.corrupt_pages += 1
                # NOTE: marked, not re-recorded: a record of the changed bytes let the next
                # shallower snapshot on the same path serve the page in the same lookup
                bad.add(p)
                ok = False
        return ok

    # ------------------------------------------------------------------ saves
    def plan_save(
        self, rid: Hashable, ids: Sequence[int] | np.ndarray, *, end: int | None = None, namespace: Hashable = None
    ) -> SavePlan | None:
        """Reserve what filing the prefix ``ids`` (a whole number of blocks) takes: host pages for
        the blocks the tree lacks and a slot for the state after it (evicting through the policy
        when the budget is full). ``None``: nothing to do (the tree holds a snapshot there) or no
        room (counted). Copy into the plan, then :meth:`commit` it (or :meth:`abandon`).

        ``end``: the prefix's length when not all its ids are known yet, ``ids`` then its first
        ones. An engine that schedules a step before the previous step's sampled token is known
        (vLLM's asynchronous scheduling) plans the step's save with the tokens it has and gives
        :meth:`commit` the whole prefix once the step's input tokens are known; the pages the
        tree lacks are counted from the known ids (at worst a block the tree turns out to hold
        is copied and given back at the commit).

        Plans of one prefix made before either is committed (requests with one system prompt
        scheduled in one step) copy its blocks once: a plan's pages start where the tree's KV, or
        an earlier plan still pending (``plan.after``) whose known ids begin with its own, ends,
        and a plan for the very prefix of a pending one is not made (``None``, counted as
        ``planned``). Commit plans in the order they were made (vLLM's connector does): one
        committed while the plan it relies on is pending files nothing (counted as
        ``prefix-pending``), as one whose prefix was evicted, or whose plan it relied on was
        abandoned or filed nothing (``prefix-evicted``).

        :raises ValueError: ``end`` (``len(ids)`` by default) not a positive whole number of
            blocks, or fewer than ``len(ids)``. Nothing changed.
        """
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if end is None:
            end = int(arr.size)
        elif isinstance(end, bool) or not isinstance(end, (int, np.integer)) or end < arr.size:
            raise ValueError(f"end must be an int >= len(ids) = {arr.size}, got {end!r}")
        end = int(end)
        if end == 0 or end % self.block:
            raise ValueError(f"a saved prefix is a positive multiple of {self.block} tokens, got {end}")
        mgr = self.manager
        m = mgr.lookup(arr, namespace=namespace, touch=False, kv=False)
        if m.cached_length == end:
            self.stats.skip("held")
            return None
        start = m.token_length // self.block * self.block
        start, after = self._pending_cover(arr, namespace, start, end)
        if start == end and arr.size == end and self._pending_same(arr, namespace):
            self.stats.skip("planned")  # a pending plan files this very snapshot
            return None
        need = end - start
        idx = self.pages.alloc(need)
        if idx is None:
            mgr.evict(kv_tokens=need - self.pages.num_free, keep=arr, namespace=namespace)
            idx = self.pages.alloc(need)
        if idx is None:
            self.stats.skip("no-pages")
            return None
        if not mgr.make_room():
            self.pages.free(idx)
            self.stats.skip("no-slot")
            return None
        owner = RequestOwner(("save", rid, end))
        slot = self.pool.alloc(owner)
        plan = SavePlan(rid, arr, namespace, start, end, idx, tuple(self.pages.pages(idx).tolist()), slot, owner, after)
        self._planned[id(plan)] = plan
        return plan

    def _pending_same(self, ids: np.ndarray, namespace: Hashable) -> bool:
        """Whether a pending plan of ``namespace`` files the snapshot of exactly ``ids``."""
        return any(
            p.end == ids.size == p.ids.size and p.namespace == namespace and np.array_equal(p.ids, ids)
            for p in self._planned.values()
        )

    def _pending_cover(self, ids: np.ndarray, namespace: Hashable, start: int, end: int) -> tuple[int, SavePlan | None]:
        """How far the KV of ``ids`` (the tree's up to ``start``) reaches with the plans still
        pending, up to ``end``: a pending plan of ``namespace`` extends it when its pages begin
        within it and its known ids agree with ``ids`` beyond it (whole blocks); the last plan
        that extended it. O(pending plans) scalar tests, and a comparison of the ids of each plan
        that agrees on the next block's last id."""
        after: SavePlan | None = None
        grew = True
        while grew and start < end:
            grew = False
            last = start + self.block - 1  # a plan that extends the reach agrees on the next block's last id
            if ids.size <= last:
                break
            for p in self._planned.values():
                if p.start > start or p.end <= last or p.ids.size <= last or p.ids[last] != ids[last]:
                    continue  # one scalar test rules out a plan of another prompt
                if p.namespace != namespace:
                    continue
                n = min(p.end, p.ids.size, ids.size, end)
                diff = np.flatnonzero(p.ids[:n] != ids[:n])
                reach = (int(diff[0]) if diff.size else n) // self.block * self.block
                if reach > start:
                    start, after, grew = reach, p, True
                    break  # the next pass tests the block after the new reach
        return start, after

    def commit(self, plan: SavePlan, ids: Sequence[int] | np.ndarray | None = None) -> bool:
        """File ``plan`` once its pages and slot hold the engine's bytes: the tree takes the new
        pages and a clone of the slot (the manager's ``checkpoint``), the rest goes back. Returns
        whether a snapshot was filed (``False``: the tree lost the prefix the plan relied on
        meanwhile, the plan it relies on, ``plan.after``, is still pending or was abandoned, or
        the tree held a snapshot there already; the plan's pages and slot go back).

        ``ids``: the whole prefix (``plan.end`` ids beginning with ``plan.ids``); needed when the
        plan was made with fewer (``plan_save(..., end=)``), checked when given.

        :raises ValueError: ``plan`` was committed or abandoned already; ``ids`` missing for a
            plan that lacks some, or not ``plan.end`` ids that begin with ``plan.ids``. Nothing
            changed (the plan stays planned but for the first)."""
        whole = self._whole(plan, ids)
        after = plan.after
        self._take(plan)
        plan.ids = whole
        mgr = self.manager
        # The clone's slot first: an eviction inside checkpoint could remove the very path whose
        # KV indices are read below, and the tree would take back indices it had just freed.
        if not mgr.make_room():
            self.stats.skip("no-slot")
            self.pages.free(plan.indices)
            self.pool.free(plan.slot, plan.owner)
            return False
        held = mgr.kv_prefix(plan.ids, namespace=plan.namespace)
        if held.numel() < plan.start:
            # the blocks before its pages are gone, or never came: the plan it relied on is still
            # pending (committed out of order; "prefix-pending"), or was abandoned or filed nothing
            pending = after is not None and self._planned.get(id(after)) is after
            self.stats.skip("prefix-pending" if pending else "prefix-evicted")
            self.pages.free(plan.indices)
            self.pool.free(plan.slot, plan.owner)
            return False
        self._record_pages_later(plan.pages)
        kv = torch.cat([held[: plan.start], plan.indices])
        try:
            res = mgr.checkpoint(plan.ids, kv, state_slot=plan.slot, namespace=plan.namespace, donor=plan.rid)
        except BaseException:
            self.pages.free(plan.indices)
            self.pool.free(plan.slot, plan.owner)
            raise
        # The tree's clone may still read the plan's slot (copy_thread): free now, handed out
        # again only once the clone read it (the next owner is vLLM's worker, writing it blind).
        self.pool.free(plan.slot, plan.owner, wait=False)
        if res.released.numel():  # another plan filed some of these blocks first: the tree keeps its pages
            self.pages.free(res.released)
        if res.length < plan.end:  # filed without a snapshot: the tail stays ours
            self.pages.free(plan.indices[max(res.length, plan.start) - plan.start :])
        self.stats.saved_pages += len(plan.pages)
        if not res.snapshot_created:
            return False
        node = res.node
        if self.forensics is not None:
            self._settling[node.id] = node
        # A state never written (all zeros) is a finding once forensics has the donation's
        # fingerprint: at once with the copies on this thread (dropped here, not filed), after
        # the copy thread took it otherwise (dropped at the next call).
        self._sweep()
        if node.snapshot is None:
            return False
        self.stats.saves += 1
        if self.shared is not None:
            mgr.publish_pending()  # the copies done by now are handed to the tier's writer
        return True

    def _sweep(self) -> None:
        """Drop the snapshots forensics found never written since the last sweep (with
        ``copy_thread`` their donation fingerprints are taken after their commit returned)."""
        fx = self.forensics
        if fx is None:
            return
        if self._settling:
            fx.settle()
        found = fx.findings
        if len(found) > self._swept:
            for f in found[self._swept :]:
                node = self._settling.pop(f.node, None)
                if f.kind == "never-written" and node is not None:
                    self._condemned[f.node] = (node, True)
            self._swept = len(found)
        if self._condemned:  # dropped once nobody holds them (a lookup of them serves nothing)
            condemned, self._condemned = self._condemned, {}
            for node, save in condemned.values():
                if fx.flagged(node.id):  # still the snapshot a finding named
                    self._drop_corrupt(node, save=save)
        if self._settling:
            self._settling = {k: n for k, n in self._settling.items() if n.snapshot is not None and fx.pending(k)}

    def synchronize(self) -> None:
        """Wait until the store's copies (``copy_thread``) and forensics' fingerprints of them are
        done, and drop what they found never written. A no-op otherwise.

        :raises linear_state.StreamFailed: a copy failed."""
        if self.copies is not None:
            self.copies.synchronize()
        self._sweep()

    @staticmethod
    def _whole(plan: SavePlan, ids: Sequence[int] | np.ndarray | None) -> np.ndarray:
        """The plan's whole prefix: ``ids`` checked against what the plan knew, or its own."""
        known = plan.ids.size
        if ids is None:
            if known != plan.end:
                raise ValueError(
                    f"the plan for {plan.end} tokens of {plan.rid!r} knows {known} of its ids: commit needs all of them"
                )
            return plan.ids
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size != plan.end or not np.array_equal(arr[:known], plan.ids):
            raise ValueError(
                f"the plan for {plan.end} tokens of {plan.rid!r} needs {plan.end} ids beginning with the {known} it "
                f"was planned with, got {arr.size} ids" + ("" if arr.size != plan.end else " that differ from them")
            )
        return arr

    def _take(self, plan: SavePlan) -> None:
        if self._planned.get(id(plan)) is not plan:
            raise ValueError(f"the plan for {plan.end} tokens of {plan.rid!r} was committed or abandoned already")
        del self._planned[id(plan)]
        plan.after = None  # a chain of plans is not kept alive by the ones relying on it

    def abandon(self, plan: SavePlan, *, why: str | None = None) -> None:
        """Give ``plan``'s pages and slot back unfiled (the engine did not copy into it, or the
        prefix's ids never became known); ``why``, when given, is counted in
        ``stats.saves_skipped``.

        :raises ValueError: ``plan`` was committed or abandoned already. Nothing changed."""
        self._take(plan)
        if why is not None:
            self.stats.skip(why)
        self.pages.free(plan.indices)
        self.pool.free(plan.slot, plan.owner)

    def flush_shared(self, timeout_s: float | None = None) -> bool:
        """Publish every snapshot still queued and wait until the shared tier's writer stored them
        (True; False at ``timeout_s``; True without a shared store)."""
        if self.shared is None:
            return True
        self.manager.publish_pending(wait=True)
        return self.shared.flush(timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Finish the store's copies and end their thread (a later save starts it again), flush
        and stop the shared tier's writer, and remove the shared mapping's name if no worker
        mapped it (idempotent; lookups keep working). True when nothing was left behind."""
        if self.copies is not None:
            self.copies.close()
            self._sweep()
        if self.mapping is not None:
            self.mapping.remove()
        if self.shared is None:
            return True
        self.manager.publish_pending(wait=True)
        return self.shared.close(timeout_s)

    # ------------------------------------------------------------------ copies
    def copy_in_pages(self, pages: Sequence[int], layers: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
        """Copy engine blocks into host ``pages`` (:meth:`StoreBytes.copy_in_pages
        <radixcache.vllm.memory.StoreBytes.copy_in_pages>`).

        :raises ValueError: a layer count or a block count that does not match."""
        self.bytes.copy_in_pages(pages, layers)

    def copy_out_pages(self, pages: Sequence[int], layers: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
        """Copy host ``pages`` into engine blocks (``layers`` as :meth:`copy_in_pages`).

        :raises ValueError: a layer count or a block count that does not match."""
        self.bytes.copy_out_pages(pages, layers)

    def copy_in_state(self, plan: SavePlan, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Write the state after ``plan.end`` (``[layers, *conv_shape]``, ``[layers,
        *recurrent_shape]``) into the plan's slot."""
        self.pool.write(plan.slot, conv, recurrent, owner=plan.owner).wait()

    def state_of(self, hit: Hit) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of the hit's verified state: ``conv`` ``[layers, ...]``, ``recurrent``
        ``[layers, ...]``."""
        return self.pool.read(hit.slot)

    # -------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """The manager's, the page list's and the pool's invariants, and page accounting: every
        page is free, held by the tree, or in a plan; every slot free, a snapshot or a plan's; each
        held hit's node locked, its slot still the node's snapshot (``AssertionError`` otherwise).
        Valid at any point between calls."""
        self.manager.check_invariants(host_slots=len(self._planned))
        for hit in self._held.values():  # a held hit's snapshot is read in place: its lock keeps it
            assert hit.node.snap_lock > 0 and hit.node.snapshot == hit.slot, (hit, hit.node)
        for v in self._verifying.values():  # a hit being verified holds its lock too
            assert v.node.snap_lock > 0 and v.node.snapshot is not None, (v.rid, v.node)
        self.pages.check_invariants()
        self.pool.check_invariants()  # the codec's kept buffers: the manager's shared tier checks them
        planned = sum(len(p.pages) for p in self._planned.values())
        tree = self.manager.cache.total_kv_tokens // self.block
        assert self.pages.free_pages + planned + tree == self.num_pages, (
            self.pages.free_pages,
            planned,
            tree,
            self.num_pages,
        )
