"""HybridRadixCache: a radix tree of KV pages whose nodes own private linear-state snapshots.

Picture (page_size 1, ``*`` = the node holds a snapshot of the state after its last token)::

    root ── [1 2 3 4]* ──┬── [5 6]*        match([1,2,3,4,5,6,9]) -> token_length 6, length 6
                         └── [7 8 9]       (a tombstone leaf cannot exist: see below)

- Edges are page aligned; a node's value is the KV indices of its edge (1-D int64 tensor).
- A snapshot sits at a node's end depth, in a pool slot owned by ``NodeOwner(node.id)``: a clone
  of the donor's slot taken behind the donor's fence (copy-on-donate). Nobody writes it again.
- Two currencies, evicted independently: KV tokens (leaves only, cascading through parents that
  become tombstone leaves) and snapshots (any unlocked node; an inner node keeps its KV as a
  *tombstone*). A leaf always holds a snapshot: a leaf without one could never serve a hit.
- ``match`` never splits and only refreshes recency; ``insert`` splits where keys diverge.
- Locks: ``lock(node)`` protects the KV of the path to the root and ``node``'s snapshot.

Fields of :class:`TreeNode` are changed only by :class:`HybridRadixCache`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import NamedTuple, TypeGuard

import numpy as np
import torch

from linear_state import (
    COMPLETE,
    Fence,
    LinearStatePool,
    NodeOwner,
    Owner,
    SlotId,
    SlotMisuse,
    SlotWrite,
    Stream,
)

from .errors import ForeignObjectError, LockError
from .events import TreeEvent, TreeEventKind, TreeListener
from .keys import TOKEN_BYTES, KeyLike, key_bytes
from .lazy_heap import LazyHeap
from .native import MODULE as _NATIVE

__all__ = [
    "EvictResult",
    "HybridRadixCache",
    "InsertResult",
    "MatchResult",
    "TreeNode",
]

_EMPTY_KV = torch.empty(0, dtype=torch.int64)


def _check_host_pool(pool: LinearStatePool, host_pool: object) -> None:
    if not isinstance(host_pool, LinearStatePool):
        raise TypeError(f"host_pool must be a LinearStatePool or None, got {host_pool!r}")
    if host_pool is pool:
        raise ValueError("host_pool is the device pool itself")
    if host_pool.device.type != "cpu":
        raise ValueError(f"host_pool must live on the CPU, not on {host_pool.device}")
    if host_pool.layout != pool.layout:
        raise ValueError(f"host_pool layout {host_pool.layout} differs from the pool's {pool.layout}")


_CACHE_SERIAL = itertools.count()  # numbers the caches of a process: node ids never collide


def _root(roots: dict[Hashable, TreeNode], namespace: Hashable) -> TreeNode | None:
    """The root of ``namespace``'s tree, or None. :raises TypeError: an unhashable namespace."""
    # NOTE: the dict lookup is the hashability check: no separate hash() call on the hot path.
    try:
        return roots.get(namespace)
    except TypeError:
        raise TypeError(f"a namespace must be hashable, got {type(namespace).__name__}") from None


class TreeNode:
    """A node of the tree: one page-aligned edge of KV, and maybe a snapshot at its end.

    :ivar id: unique in the process (the first cache numbers from 1, each later one from its own
        multiple of 2**32); the snapshot's owner is ``NodeOwner(id)``.
    :ivar cache: the :class:`HybridRadixCache` the node belongs to.
    :ivar depth: tokens from the root to the end of this node's edge.
    :ivar snapshot: the pool slot of the snapshot at ``depth``, or ``None``.
    :ivar host: the slot of the host tier holding that state instead (a demoted snapshot), or
        ``None``. At most one of ``snapshot`` and ``host`` is set; a node with neither is a
        tombstone.
    :ivar owner: the ``NodeOwner`` its slots are held under (the very object the pools hold, so a
        free is recognised by identity), or ``None`` before the node first held a state.
    """

    __slots__ = (
        "_value",
        "cache",
        "children",
        "depth",
        "host",
        "host_fence",
        "id",
        "key",
        "kv_lock",
        "last_access",
        "owner",
        "parent",
        "snap_lock",
        "snapshot",
        "snapshot_fence",
        "value_np",
    )

    def __init__(
        self,
        node_id: int,
        key: bytes,
        value: torch.Tensor | None,
        parent: TreeNode | None,
        depth: int,
        cache: HybridRadixCache | None = None,
        value_np: np.ndarray | None = None,
    ) -> None:
        self.id = node_id
        self.cache = cache  # the tree that made it: calls with a node of another tree are refused
        self.key = key  # edge key bytes (TOKEN_BYTES per token)
        # KV indices of the edge (see value); with value None, made from value_np when first read
        self._value = value
        # The same indices as a numpy array when they live on the CPU (the tensor is a view of
        # it): comparisons on the insert hot path skip a tensor-to-numpy conversion.
        self.value_np = value_np
        self.parent = parent  # None once removed (and for roots)
        self.children: dict[bytes, TreeNode] = {}  # by the bytes of the child's first page
        self.depth = depth
        self.snapshot: SlotId | None = None
        self.snapshot_fence: Fence = COMPLETE
        self.host: SlotId | None = None  # slot in the cache's host pool (a demoted snapshot)
        self.host_fence: Fence = COMPLETE
        self.owner: NodeOwner | None = None
        self.kv_lock = 0  # locks on this node or below: protects this edge's KV
        self.snap_lock = 0  # locks on this node itself: protects its snapshot
        self.last_access = 0

    @property
    def value(self) -> torch.Tensor:
        """KV indices of the edge (1-D int64). On the CPU a view of :attr:`value_np`, made when
        first read: NOTE: most edges are read through ``value_np`` alone (the native walk, gather
        and compare), and a tensor made for each new edge cost ~2 us of every SGLang checkpoint
        (session 36)."""
        v = self._value
        if v is None:
            assert self.value_np is not None, f"node {self.id} holds neither KV tensor nor numpy indices"
            v = self._value = torch.from_numpy(self.value_np)
        return v

    @value.setter
    def value(self, value: torch.Tensor) -> None:
        self._value = value

    @property
    def num_tokens(self) -> int:
        """Tokens on this node's edge."""
        return len(self.key) // TOKEN_BYTES

    @property
    def is_leaf(self) -> bool:
        """No children."""
        return not self.children

    def __repr__(self) -> str:
        snap = (
            f"snapshot={self.snapshot}"
            if self.snapshot is not None
            else f"host={self.host}"
            if self.host is not None
            else "tombstone"
        )
        locks = f"{self.kv_lock}/{self.snap_lock}"
        return f"<TreeNode {self.id} depth={self.depth} tokens={self.num_tokens} {snap} locks={locks}>"


class MatchResult(NamedTuple):
    """What ``match`` found. Safe to use only while ``node`` is locked (or before any eviction).

    :ivar cached_length: depth of the deepest snapshot on the matched path: the usable hit.
    :ivar token_length: depth to which the key agrees with the tree (diagnostic; >= ``cached_length``).
    :ivar kv_indices: KV indices of the first ``cached_length`` tokens (1-D int64); empty when
        the match was asked without them (``kv=False``).
    :ivar node: the node at ``cached_length`` (a root when it is 0); pass it to lock/restore.
    :ivar snapshot_slot: its snapshot slot, or ``None`` when ``cached_length`` is 0 or the snapshot
        was demoted to the host tier (``cache.tier(node)`` says which).
    """

    cached_length: int
    token_length: int
    kv_indices: torch.Tensor
    node: TreeNode
    snapshot_slot: SlotId | None


class InsertResult(NamedTuple):
    """What ``insert`` did.

    :ivar prefix_length: tokens of the (page-cut) key that were already cached. The caller's KV
        indices for them that differ from the tree's are duplicates: released as a ``KV_FREED`` event.
    :ivar length: tokens of the key the tree now holds KV for: the cut key when a snapshot was
        given, else ``prefix_length`` (the caller keeps the KV of the tail).
    :ivar node: with a snapshot, the node ending at ``length`` (holding it); without, the deepest
        node ending at or above ``length``.
    :ivar snapshot_created: a clone was taken (False when the node already held a snapshot).
    :ivar duplicates: how many caller KV indices were released as duplicates.
    :ivar released: those duplicates, when the caller asked for them back
        (``release_duplicates=False``): still the caller's; empty otherwise (they were released as
        a ``KV_FREED`` event).
    """

    prefix_length: int
    length: int
    node: TreeNode
    snapshot_created: bool
    duplicates: int
    released: torch.Tensor = _EMPTY_KV


class EvictResult(NamedTuple):
    """What ``evict`` freed."""

    kv_tokens: int
    snapshots: int
    nodes_removed: int


_ONE_SNAPSHOT = EvictResult(0, 1, 0)  # a snapshot demoted, or dropped from an inner node


class HybridRadixCache:
    """A radix prefix cache for hybrid models: KV pages plus linear-state snapshots.

    :param pool: where snapshot slots live; the tree owns its slots as ``NodeOwner(node.id)``.
        The pool should serve one tree (``check_invariants`` counts its node-owned slots).
    :param page_size: tokens per KV page; keys are cut down to whole pages.
    :param on_event: the tree's listener (see :mod:`radixcache.core.events`): every KV index,
        snapshot and node the tree lets go is reported to it as a :class:`TreeEvent`, in order,
        from the call that did it. KV freed (evicted edges, duplicates of KV it already held) comes
        only this way: ``on_event=free_kv_to(allocator.free)`` hands it to a host's allocator.
        ``None``: nobody listens (the host does not track KV). A :class:`~radixcache.CacheManager`
        listens first and passes every event on to this one.
    :param stream: stream for snapshot clones, restores, demotions (default: the pool's).
    :param host_pool: the host tier: a CPU pool of the same layout (pinned when ``pool`` is on
        CUDA). A snapshot evicted for lack of device slots is demoted into it (its node keeps its KV
        and still serves hits, restored from host memory) instead of dropped; when the host tier
        is full its least recently used copy goes. KV stays the host engine's: the tier holds
        linear states only. :func:`radixcache.tiers.host.auto_host_pool` sizes one; ``None``
        (default): none here; a :class:`~radixcache.CacheManager` then gives the tree its default
        host tier (see its ``host_tier``) unless told not to.
    :raises ValueError: ``page_size`` not positive; ``host_pool`` not on the CPU, of another
        layout, or ``pool`` itself.
    """

    def __init__(
        self,
        pool: LinearStatePool,
        *,
        page_size: int = 1,
        on_event: TreeListener | None = None,
        stream: Stream | None = None,
        host_pool: LinearStatePool | None = None,
    ) -> None:
        if not isinstance(pool, LinearStatePool):
            raise TypeError(f"pool must be a LinearStatePool, got {type(pool).__name__}")
        if host_pool is not None:
            _check_host_pool(pool, host_pool)
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
            raise TypeError(f"page_size must be an int, got {page_size!r}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable, got {type(on_event).__name__}")
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be a linear_state Stream, got {type(stream).__name__}")
        page_size = int(page_size)
        self._id_base = next(_CACHE_SERIAL) << 32
        self._next_id = self._id_base + 1
        self.pool = pool
        self.host_pool = host_pool
        self.page_size = page_size
        self._on_event = on_event
        self.stream = stream
        # The CacheManager serving this tree (set by it): one manager per tree.
        self.client: object | None = None
        self._page_bytes = page_size * TOKEN_BYTES
        self.reset_state()

    @property
    def on_event(self) -> TreeListener | None:
        """The tree's listener (see ``on_event=``); change it with :meth:`listen`."""
        return self._on_event

    def listen(self, listener: TreeListener | None) -> TreeListener | None:
        """Make ``listener`` the tree's one listener; returns the one it replaces (a listener that
        takes over passes events on to it). ``None``: nobody listens.

        :raises TypeError: ``listener`` is not callable. Nothing changed.
        """
        if listener is not None and not callable(listener):
            raise TypeError(f"listener must be callable, got {type(listener).__name__}")
        previous, self._on_event = self._on_event, listener
        return previous

    def attach_host_pool(self, host_pool: LinearStatePool) -> None:
        """Give a tree built without a host tier its host pool (what ``host_pool=`` does at
        construction). From now on evicted snapshots are demoted into it.

        :raises RuntimeError: the tree has a host tier already. :raises TypeError, ValueError: as
            for ``host_pool=``. Nothing changed.
        """
        if self.host_pool is not None:
            raise RuntimeError("this tree has a host tier already")
        _check_host_pool(self.pool, host_pool)
        self.host_pool = host_pool

    def reset_state(self) -> None:
        """(Re)initialise empty bookkeeping. Internal: use :meth:`reset` on a live cache."""
        self._roots: dict[Hashable, TreeNode] = {}
        # for namespaces never inserted
        self._null_root = TreeNode(self._id_base - 1, b"", _EMPTY_KV, None, 0, self)
        # NOTE: node ids keep growing across reset(): a policy or a ledger that still names an
        # old node can never mistake a new one for it.
        self._tick = 0
        self._touched = 0  # nodes touched since the queues' sizes were last checked
        # NOTE: eviction candidates live in three lazy-deletion queues (LazyHeap), keyed by
        # last_access. A touch pushes a fresh entry (O(1): ticks arrive in order, into the queue's
        # FIFO run; an older tick goes to its heap, O(log n) in C); pop skips entries that are
        # stale (node gone, touched since, locked, no longer a leaf / no snapshot). Evicting a
        # node is O(log n) amortised and never scans the tree; queues are compacted when stale
        # entries outnumber live nodes. sortedcontainers would give the same bounds with a
        # Python-level remove+add on every touch, 3-5x slower per match.
        self._kv_heap: LazyHeap[TreeNode] = LazyHeap()
        self._snap_heap: LazyHeap[TreeNode] = LazyHeap()
        self._host_heap: LazyHeap[TreeNode] = LazyHeap()  # host copies of unlocked nodes, by recency
        self._num_nodes = 0
        self._num_snapshots = 0
        self._num_host = 0
        self._protected_host = 0  # host copies of locked nodes
        self._demotions = 0
        self._evictable_kv = 0
        self._protected_kv = 0
        self._protected_snapshots = 0

    # ------------------------------------------------------------------ sizes
    @property
    def id_base(self) -> int:
        """This cache's node ids are ``id_base + 1, id_base + 2, ...`` (roots: ``id_base``)."""
        return self._id_base

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, roots excluded."""
        return self._num_nodes

    @property
    def num_snapshots(self) -> int:
        """Snapshots held (pool slots the tree owns)."""
        return self._num_snapshots

    @property
    def num_host_snapshots(self) -> int:
        """Snapshots demoted to the host tier (host pool slots the tree owns)."""
        return self._num_host

    @property
    def demotions(self) -> int:
        """Snapshots moved to the host tier so far (since the last :meth:`reset`)."""
        return self._demotions

    @staticmethod
    def tier(node: TreeNode) -> str | None:
        """Where ``node``'s state is: ``"device"`` (a pool slot), ``"host"`` (the host tier), or
        ``None`` (a tombstone, or a removed node). O(1)."""
        if node.parent is None:
            return None
        return "device" if node.snapshot is not None else "host" if node.host is not None else None

    @property
    def evictable_kv_tokens(self) -> int:
        """KV tokens no lock protects."""
        return self._evictable_kv

    @property
    def protected_kv_tokens(self) -> int:
        """KV tokens on the path of some lock."""
        return self._protected_kv

    @property
    def evictable_snapshots(self) -> int:
        """Snapshots of unlocked nodes."""
        return self._num_snapshots - self._protected_snapshots

    @property
    def protected_snapshots(self) -> int:
        """Snapshots of locked nodes."""
        return self._protected_snapshots

    @property
    def total_kv_tokens(self) -> int:
        """All KV tokens the tree holds."""
        return self._evictable_kv + self._protected_kv

    # ------------------------------------------------------------------ match
    def _common_bytes(self, kb: bytes, pos: int, edge: bytes, limit: int) -> int:
        """Bytes (a whole number of pages, >= 1 page) on which ``kb[pos:]`` and ``edge`` agree.

        The first page is known to agree (it indexed the child). Binary search over pages: each
        probe is one memcmp, O(log pages) probes.
        """
        pb = self._page_bytes
        lo, hi = 1, limit // pb  # lo pages agree; answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if kb[pos : pos + mid * pb] == edge[: mid * pb]:
                lo = mid
            else:
                hi = mid - 1
        return lo * pb

    def match(self, key: KeyLike, *, namespace: Hashable = None, touch: bool = True, kv: bool = True) -> MatchResult:
        """Find the longest usable prefix of ``key``: the deepest snapshot on the matched path, on
        the device or in the host tier (``result.snapshot_slot`` is ``None`` for a host copy:
        :meth:`restore` takes either).

        Never splits nodes; refreshes the recency of the nodes it returns unless ``touch`` is
        False (a dry run: nothing at all changes; :meth:`touch` the result later). With ``kv``
        False, ``result.kv_indices`` is left empty (a host that reads the hit's KV later, through
        :meth:`kv_indices` or :meth:`kv_into` of ``result.node``, skips gathering it twice).
        O(nodes on the path + log(key length)), no per-token Python work. The result is valid
        until the next eviction unless ``result.node`` is locked.

        :raises TypeError, ValueError: a bad key (see :mod:`radixcache.core.keys`), an unhashable
            namespace. Nothing changed.
        """
        kb = key_bytes(key)
        end = len(kb) - len(kb) % self._page_bytes  # whole pages only
        root = _root(self._roots, namespace)
        if root is None:
            return MatchResult(0, 0, _EMPTY_KV, self._null_root, None)
        path, pos, snap_at, _ = self._walk(kb, end, root)
        if snap_at == 0:
            return MatchResult(0, pos // TOKEN_BYTES, _EMPTY_KV, root, None)
        used = path[:snap_at]
        if touch:
            self._touch(used)
        target = used[-1]
        got = self._path_kv(target, 0) if kv else _EMPTY_KV
        return MatchResult(target.depth, pos // TOKEN_BYTES, got, target, target.snapshot)

    def root(self, namespace: Hashable = None) -> TreeNode:
        """The root of ``namespace``'s tree: what :meth:`match` returns as ``node`` on a miss (a
        namespace with nothing stored has a placeholder root, the same for every such namespace).
        Reads only. O(1).

        :raises TypeError: an unhashable namespace."""
        root = _root(self._roots, namespace)
        return self._null_root if root is None else root

    def _own(self, node: object) -> TreeNode:
        """``node`` itself, once known to be a node of this tree. :raises TypeError, ForeignObjectError."""
        if type(node) is not TreeNode:
            raise TypeError(f"expected a TreeNode, got {type(node).__name__}")
        if node.cache is not self:
            raise ForeignObjectError(f"{node!r} belongs to another cache; nothing was done")
        return node

    def touch(self, node: TreeNode) -> None:
        """Refresh the recency of ``node`` and its ancestors (what :meth:`match` does to a hit).
        O(depth in nodes). :raises ValueError: ``node`` was removed.
        :raises ForeignObjectError: ``node`` is another cache's."""
        self._own(node)
        if node.parent is None and node.depth > 0:
            raise ValueError(f"node {node.id} was evicted; it cannot be touched")
        path: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n.depth > 0:
            path.append(n)
            n = n.parent
        path.reverse()
        self._touch(path)

    # ------------------------------------------------------ what policies read
    @staticmethod
    def holds_snapshot(node: TreeNode) -> bool:
        """``node`` is in the tree and holds a snapshot. O(1)."""
        return node.parent is not None and node.snapshot is not None

    @staticmethod
    def is_evictable(node: TreeNode) -> bool:
        """``node`` holds a snapshot that no lock protects: :meth:`evict_snapshot` would take it. O(1)."""
        return node.parent is not None and node.snapshot is not None and not node.snap_lock

    @staticmethod
    def snapshot_ancestors(node: TreeNode) -> Iterator[TreeNode]:
        """The ancestors of ``node`` that hold a snapshot, nearest first (roots excluded).
        O(depth in nodes) for the whole walk."""
        anc = node.parent
        while anc is not None and anc.depth > 0:
            if anc.snapshot is not None:
                yield anc
            anc = anc.parent

    @staticmethod
    def snapshots_below(node: TreeNode, *, through: Callable[[TreeNode], bool]) -> Iterator[TreeNode]:
        """The nodes below ``node`` that hold a device snapshot, depth first, each branch down to
        its first such node for which ``through`` is False (the walk does not go below that one).
        The caller may read and note between steps, not change the tree. O(nodes visited)."""
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            if n.snapshot is not None:
                yield n
                if not through(n):
                    continue
            stack.extend(n.children.values())

    @property
    def demotes(self) -> bool:
        """An eviction for slots would demote a snapshot now (the host tier has a free slot or an
        unlocked copy to drop): it then frees the slot alone (see :meth:`eviction_cost`). O(1)."""
        return self._can_demote()

    @staticmethod
    def cascade_stop(node: TreeNode) -> TreeNode:
        """The ancestor where removing leaf ``node`` stops (:meth:`eviction_cost`'s cascade): its
        first ancestor that is the root, branches, or holds a state. O(nodes in the cascade).

        :raises ValueError: ``node`` was removed."""
        n = node
        while True:
            p = n.parent
            if p is None:
                raise ValueError(f"node {n.id} was removed")
            if _stops_cascade(p):
                return p
            n = p

    @staticmethod
    def cost_dependent(node: TreeNode) -> TreeNode | None:
        """The device snapshot whose :meth:`eviction_cost` a change of ``node``'s children may have
        changed: ``node`` itself when it holds one (a leaf or not), else, when ``node`` is a
        tombstone with one child, the snapshot its single-child chain leads to (its cascade
        reaches ``node`` or stops below it). ``None``: no such snapshot (the root, a removed node,
        a host copy, a branching tombstone). For policies that keep costs between evictions: call
        it on :meth:`cascade_stop` of an evicted leaf, on an evicted inner node, and on the nodes a
        new branch split. O(chain)."""
        if node.depth == 0 or node.parent is None or node.host is not None:
            return None
        n = node
        while n.snapshot is None:
            if len(n.children) != 1 or n.host is not None:
                return None
            (n,) = n.children.values()
        return n

    @staticmethod
    def cost_dependents(node: TreeNode) -> list[TreeNode]:
        """The device snapshots whose :meth:`eviction_cost` inserting ``node`` (a new leaf, maybe
        splitting an edge above it) may have changed: the first state-holding ancestor's (it
        gained a child) and, past every tombstone on the way that now branches in two, the
        :meth:`cost_dependent` of each branch (a leaf there cascades less far). ``node`` itself
        is not included. O(path in nodes)."""
        out: list[TreeNode] = []
        n = node.parent
        while n is not None and n.depth > 0:
            if n.snapshot is not None or n.host is not None:
                if n.snapshot is not None:
                    out.append(n)
                break
            if len(n.children) == 2:
                for c in n.children.values():
                    d = HybridRadixCache.cost_dependent(c)
                    if d is not None and d is not node:
                        out.append(d)
            n = n.parent
        return out

    def eviction_cost(self, node: TreeNode, *, demote: bool = True) -> EvictResult:
        """What :meth:`evict_snapshot` of ``node`` (with the same ``demote``) would free, computed
        without changing anything: an inner node frees its snapshot alone; a leaf frees its KV and
        that of every parent it would leave as a tombstone leaf, unless the host tier takes the
        snapshot (``demote`` and a host tier with room: then the slot alone). O(nodes in that
        cascade).

        :raises ValueError: ``node`` was removed or holds no snapshot.
        :raises ForeignObjectError: ``node`` is another cache's.
        """
        self._own(node)
        if node.parent is None or node.snapshot is None:
            raise ValueError(f"node {node.id} holds no snapshot to evict")
        if node.children or (demote and self._can_demote()):
            return EvictResult(0, 1, 0)
        tokens = removed = 0
        n = node
        while True:
            tokens += n.num_tokens
            removed += 1
            p = n.parent
            assert p is not None
            if _stops_cascade(p):
                break
            n = p
        return EvictResult(tokens, 1, removed)

    def kv_indices(self, node: TreeNode, *, start: int = 0) -> torch.Tensor:
        """KV indices of the tokens ``[start, node.depth)`` of ``node``'s path (1-D int64; from the
        root by default). Only the edges below ``start`` are read: O(nodes below ``start``).

        :raises ForeignObjectError: ``node`` is another cache's. :raises TypeError, ValueError:
            ``start`` is not an int in ``[0, node.depth]``."""
        self._own(node)
        return self._path_kv(node, _check_start(start, node))

    def _path_kv(self, node: TreeNode, start: int) -> torch.Tensor:
        """:meth:`kv_indices` of checked arguments (``match``'s too)."""
        if start >= node.depth:
            return _EMPTY_KV
        cut = start - (node.depth - node.num_tokens)
        if cut >= 0:  # one edge holds them: the edge's own tensor, or a view of it; no copy
            return node.value if cut == 0 else node.value[cut:]
        if _NATIVE is not None:
            # NOTE: one pass up the parents into one buffer; torch.cat of the edges cost ~5 us per
            # call inside SGLang's scheduler (every admission's lookup and prefix_device_indices)
            got = _NATIVE.gather(node, start, None)
            if got is not NotImplemented:
                assert got is not None
                return torch.frombuffer(got, dtype=torch.int64)
        parts: list[torch.Tensor] = []
        n: TreeNode | None = node
        top = node
        while n is not None and n.depth > start:
            parts.append(n.value)
            top = n
            n = n.parent
        cut = start - (top.depth - top.num_tokens)  # the top edge starts above ``start``: cut it
        if cut > 0:
            parts[-1] = parts[-1][cut:]
        parts.reverse()
        return torch.cat(parts)

    def kv_into(self, node: TreeNode, out: np.ndarray, *, start: int = 0) -> None:
        """Write the KV indices of the tokens ``[start, node.depth)`` of ``node``'s path into
        ``out[start:node.depth]``: a host's page-table row on the CPU (a writable, contiguous 1-D
        int32 or int64 numpy array at least ``node.depth`` long), in its dtype (int32 keeps the
        low 32 bits, as numpy's assignment does). Only the edges below ``start`` are read, and
        nothing is allocated: what :meth:`kv_indices` and an assignment do, without the tensor in
        between. O(nodes below ``start`` + tokens written).

        :raises ForeignObjectError: ``node`` is another cache's. :raises TypeError: ``out`` is not
            such an array, or ``start`` is not an int. :raises ValueError: ``start`` outside
            ``[0, node.depth]``, or ``out`` shorter than ``node.depth``. Nothing written."""
        self._own(node)
        start = _check_start(start, node)
        if not _plain_index(out):
            what = f"{out.dtype} array of shape {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
            raise TypeError(f"out must be a writable contiguous 1-D int32 or int64 numpy array, got {what}")
        if len(out) < node.depth:
            raise ValueError(f"out holds {len(out)} indices, fewer than node {node.id}'s depth {node.depth}")
        if _NATIVE is None or _NATIVE.gather(node, start, out) is NotImplemented:
            self._gather_py(node, start, out)

    def _gather_py(self, node: TreeNode, start: int, out: np.ndarray) -> None:
        """:meth:`kv_into`'s writes in Python: the reference the native gather is tested against."""
        n: TreeNode | None = node
        while n is not None and n.depth > start:
            top = n.depth - n.num_tokens
            edge = n.value_np if n.value_np is not None else n.value.cpu().numpy()
            out[max(top, start) : n.depth] = edge[max(0, start - top) :]
            n = n.parent

    def kv_prefix(self, key: KeyLike, *, namespace: Hashable = None) -> torch.Tensor:
        """The tree's KV indices for the longest page-cut prefix of ``key`` it holds KV for
        (``match(key).token_length`` tokens: past the deepest snapshot, into an edge), 1-D int64.
        Reads only: no recency refresh. For a host reconciling its own KV table with the tree's
        after an :meth:`insert` (which tokens it gave were duplicates). O(nodes on the path).

        :raises TypeError, ValueError: a bad key or namespace. Nothing changed.
        """
        kb = key_bytes(key)
        end = len(kb) - len(kb) % self._page_bytes  # whole pages only
        root = _root(self._roots, namespace)
        if root is None:
            return _EMPTY_KV
        path, pos, _, partial = self._walk(kb, end, root)
        parts = [n.value for n in path]
        if partial is not None:
            parts.append(partial.value[: (pos // TOKEN_BYTES) - (path[-1].depth if path else 0)])
        if not parts:
            return _EMPTY_KV
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _walk(self, kb: bytes, end: int, root: TreeNode) -> tuple[list[TreeNode], int, int, TreeNode | None]:
        """Follow ``kb[:end]`` down from ``root``: the whole edges matched, the bytes matched, how
        many of those nodes lead to the deepest one holding a snapshot (either tier), and the child
        whose edge the key leaves part-way (``None`` when it leaves at a node). Reads only. Natively
        where the extension is built (:data:`radixcache.core.native.NATIVE`), else
        :meth:`_walk_py`: the same result."""
        if _NATIVE is None:
            return self._walk_py(kb, end, root)
        return _NATIVE.walk(kb, end, root, self._page_bytes)

    def _walk_py(self, kb: bytes, end: int, root: TreeNode) -> tuple[list[TreeNode], int, int, TreeNode | None]:
        """:meth:`_walk` in Python: the reference the native walk is tested against."""
        # NOTE: a bare tuple, unpacked at once by its three callers: match's hot path
        # (benchmarks/bench_tree.py), where a NamedTuple's construction would show.
        pb = self._page_bytes
        node, pos = root, 0
        path: list[TreeNode] = []
        snap_at = 0  # len(path) up to the deepest snapshot
        while pos < end:
            child = node.children.get(kb[pos : pos + pb])
            if child is None:
                break
            edge = child.key
            # NOTE: startswith(edge, pos, end) is kb[pos:end].startswith(edge) without copying the
            # slice (a 4 KB copy per 1,024-token edge otherwise; benchmarks/bench_tree.py).
            if kb.startswith(edge, pos, end):
                pos += len(edge)
                node = child
                path.append(child)
                if child.snapshot is not None or child.host is not None:
                    snap_at = len(path)
                continue
            return path, pos + self._common_bytes(kb, pos, edge, min(len(edge), end - pos)), snap_at, child
        return path, pos, snap_at, None

    # ----------------------------------------------------------------- insert
    def insert(
        self,
        key: KeyLike,
        kv_indices: torch.Tensor | np.ndarray | list[int],
        *,
        state_slot: int | None = None,
        ready: Fence | None = None,
        namespace: Hashable = None,
        release_duplicates: bool = True,
        known_prefix: int = 0,
    ) -> InsertResult:
        """Insert ``key`` with its KV indices, and optionally donate the state after it.

        The key is cut down to whole pages (the tail beyond stays the caller's). With
        ``state_slot``, the snapshot of the state after exactly the cut key is donated: the tree
        clones the slot into a new slot it owns, behind ``ready`` (the producer's fence); the caller
        keeps ``state_slot``. If the node at that depth already holds a snapshot, nothing is cloned.
        Without ``state_slot`` nothing new is stored (a leaf without a snapshot could never serve
        a hit): the tree keeps only KV it already had, and the caller keeps the tail.

        KV ownership: the tree takes the caller's indices for the tokens it stores new (it keeps a
        copy: the caller may reuse its index tensor afterwards). For the
        ``prefix_length`` tokens already cached, any caller index that differs from the tree's is
        a duplicate and is released as a ``KV_FREED`` event (or, with ``release_duplicates=False``,
        handed back in ``result.released``: the caller keeps it); use :meth:`kv_indices` of
        ``result.node`` to get the tree's indices. ``known_prefix``: the caller's first
        ``known_prefix`` indices are the tree's own (it took them from a match of this key and
        holds a lock at or below that depth), so they are not compared (SGLang's
        ``prev_prefix_len``); an index there that is not the tree's would never be released.

        O(nodes on the path + key length / page size) plus one clone.

        :raises ValueError: a bad key, ``kv_indices`` not 1-D integers of the key's length,
            ``ready`` without ``state_slot``, or ``known_prefix`` outside ``[0, len(key)]``.
            Nothing changed.
        :raises TypeError: a key or namespace of the wrong type, ``ready`` not a fence, a slot id
            or ``known_prefix`` that is not an int. Nothing changed.
        :raises linear_state.SlotMisuse: ``state_slot`` is free, or is a tree snapshot (a snapshot
            is never a donor). Nothing changed.
        :raises linear_state.PoolExhausted: no free slot for the clone (evict snapshots first).
            Nothing changed.
        """
        kb = key_bytes(key)
        # NOTE: a numpy view of CPU indices: slicing and comparing through it costs a third of
        # torch's per-op overhead on this hot path (benchmarks/bench_tree.py). A host that has
        # them as a writable int64 or int32 numpy array already (the SGLang backend's CPU rows)
        # hands them over as they are: inside SGLang's scheduler a tensor's .numpy() cost ~5 us.
        kvn: np.ndarray | None
        kv: torch.Tensor | None  # None: the numpy indices alone (a tensor is made only if needed)
        if _plain_index(kv_indices):
            kvn, kv = kv_indices, None
            _check_kv_count(kvn.size, len(kb) // TOKEN_BYTES)
        else:
            kv = _as_kv(kv_indices, len(kb) // TOKEN_BYTES)
            kvn = kv.numpy() if kv.is_cpu else None
        _check_known_prefix(known_prefix, len(kb) // TOKEN_BYTES)
        if ready is not None and state_slot is None:
            raise ValueError("ready was given without a state_slot to donate")
        if ready is not None and not isinstance(ready, Fence):
            raise TypeError(f"ready must be a Fence, got {type(ready).__name__}")
        if state_slot is not None:
            donor = self.pool.owner_of(state_slot)  # validates the id
            if donor is None:
                raise SlotMisuse("donation of a free slot", slot=int(state_slot), owner=None, actor=None)
            if isinstance(donor, NodeOwner):
                raise SlotMisuse("a tree snapshot cannot be a donor", slot=int(state_slot), owner=donor, actor=None)
        end = len(kb) - len(kb) % self._page_bytes  # whole pages only
        root = _root(self._roots, namespace)
        fresh_root = root is None
        if root is None:  # registered only once something is stored
            root = TreeNode(self._id_base, b"", _EMPTY_KV, None, 0, self)
        # Phase 1, read only: find where the key leaves the tree.
        path, pos, _, split_child = self._walk(kb, end, root)
        node = path[-1] if path else root
        split_at = pos - node.depth * TOKEN_BYTES if split_child is not None else 0  # bytes into its edge
        prefix_len = pos // TOKEN_BYTES
        if state_slot is None or end == 0:
            # No snapshot to attach: a new leaf could never serve a hit, a split would add nothing.
            dups = self._duplicates(kv, kvn, path, split_child, split_at, known_prefix)
            self._touch(path)
            return InsertResult(prefix_len, prefix_len, node, False, *self._hand_out(dups, release_duplicates, node))
        grows = pos < end  # a new leaf is needed
        # The target node's id, known before anything changes: new nodes are numbered in order
        # (the split's upper node first, then the new leaf).
        if grows:
            target_id = self._next_id + (1 if split_child is not None else 0)
        elif split_child is not None:
            target_id = self._next_id
        else:
            target_id = node.id
        clone = owner = None
        if grows or split_child is not None or node.snapshot is None:
            owner = NodeOwner(target_id)
            clone = self._take_snapshot(state_slot, owner, ready)
        # Phase 2: mutate. Nothing below raises.
        if fresh_root:
            self._roots[namespace] = root
        dups = self._duplicates(kv, kvn, path, split_child, split_at, known_prefix)
        if split_child is not None:
            node = self._split(split_child, split_at)
            path.append(node)
        if grows:
            stop = end // TOKEN_BYTES
            # A private copy: the caller's index tensor may be a view of its page table, which it
            # rewrites for other requests later.
            # (a tensor of the numpy copy is made when first read: TreeNode.value)
            own = None if kvn is None else kvn[prefix_len:stop].astype(np.int64)  # a copy, int64
            if own is None:
                assert kv is not None  # no numpy indices: a tensor was given
                leaf = TreeNode(self._next_id, kb[pos:end], kv[prefix_len:stop].clone(), node, stop, self)
            else:
                leaf = TreeNode(self._next_id, kb[pos:end], None, node, stop, self, own)
            self._next_id += 1
            node.children[leaf.key[: self._page_bytes]] = leaf
            self._num_nodes += 1
            self._evictable_kv += leaf.num_tokens
            node = leaf
            path.append(leaf)
        assert node.id == target_id, f"snapshot target {target_id} but the key ends at node {node.id}"
        if clone is not None:
            if node.host is not None:  # back on the device: the host copy is redundant
                self._drop_host(node, remove=False)
            node.snapshot = clone.slot
            node.snapshot_fence = clone.fence
            node.owner = owner
            self._num_snapshots += 1
            if node.snap_lock:
                self._protected_snapshots += 1
        self._touch(path)
        return InsertResult(
            prefix_len, node.depth, node, clone is not None, *self._hand_out(dups, release_duplicates, node)
        )

    def _take_snapshot(self, state_slot: int, owner: NodeOwner, ready: Fence | None) -> SlotWrite:
        """Copy-on-donate: a private clone of ``state_slot`` for ``owner``, ordered after ``ready``."""
        return self.pool.clone(state_slot, owner, stream=self.stream, after=() if ready is None else (ready,))

    def _hand_out(self, dups: torch.Tensor | None, release: bool, node: TreeNode) -> tuple[int, torch.Tensor]:
        """Release duplicates as a ``KV_FREED`` event (``release``) or hand them back."""
        if dups is None:
            return 0, _EMPTY_KV
        if not release:
            return int(dups.numel()), dups
        if self._on_event is not None:
            self._on_event(TreeEvent(TreeEventKind.KV_FREED, node, dups))
        return int(dups.numel()), _EMPTY_KV

    def _duplicates(
        self,
        kv: torch.Tensor | None,
        kvn: np.ndarray | None,
        path: list[TreeNode],
        split_child: TreeNode | None,
        split_at: int,
        known: int = 0,
    ) -> torch.Tensor | None:
        """The caller's KV indices that duplicate ones the tree holds (same tokens, other index),
        or None. An index equal to the tree's is the tree's own (the caller got it from ``match``);
        the first ``known`` are not compared (see :meth:`insert`'s ``known_prefix``). Natively
        (:data:`radixcache.core.native.NATIVE`) when every compared index array is a contiguous
        CPU int64 one (the caller's may be int32), else :meth:`_duplicates_py`: the same indices
        (int64) in the same order (natively a copy; the reference may hand back a view of
        ``kv``)."""
        if _NATIVE is not None and kvn is not None:
            out = _NATIVE.duplicates(kvn, path, split_child, split_at // TOKEN_BYTES, known)
            if out is not NotImplemented:
                return None if out is None else torch.frombuffer(out, dtype=torch.int64)
        return self._duplicates_py(kv, kvn, path, split_child, split_at, known)

    def _duplicates_py(
        self,
        kv: torch.Tensor | None,
        kvn: np.ndarray | None,
        path: list[TreeNode],
        split_child: TreeNode | None,
        split_at: int,
        known: int = 0,
    ) -> torch.Tensor | None:
        """:meth:`_duplicates` in Python: the reference the native one is tested against. ``kv``
        may be ``None`` when ``kvn`` holds the indices (a tensor over them is made if needed)."""
        if kv is None:
            assert kvn is not None, "the caller's indices: a tensor or a numpy array"
            kv = torch.from_numpy(kvn)
        spans = [(n.value, n.value_np, n.value.numel()) for n in path if n.depth > known]
        start = path[-1].depth if path else 0
        start -= sum(k for _, _, k in spans)  # the first compared span's start
        if split_child is not None:
            k = split_at // TOKEN_BYTES
            c_np = split_child.value_np
            spans.append((split_child.value[:k], None if c_np is None else c_np[:k], k))
        if known > start and spans:  # the first span starts inside the known prefix: cut it
            theirs, theirs_np, k = spans[0]
            cut = min(known - start, k)
            spans[0] = (theirs[cut:], None if theirs_np is None else theirs_np[cut:], k - cut)
            start += cut
        parts: list[torch.Tensor] = []
        for theirs, theirs_np, k in spans:  # spans are consecutive from ``start``
            if kvn is not None and theirs_np is not None:
                mine_np = kvn[start : start + k]
                differ = np.not_equal(mine_np, theirs_np)
                n_differ = int(np.count_nonzero(differ))
                if n_differ:
                    parts.append(torch.from_numpy(mine_np if n_differ == k else mine_np[differ]))
            else:
                mine = kv[start : start + k]
                theirs = theirs.to(mine.device)
                if not torch.equal(mine, theirs):
                    parts.append(mine[mine != theirs])
            start += k
        if not parts:
            return None
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out if out.dtype == torch.int64 else out.to(torch.int64)  # an int32 row's, widened

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Split ``child``'s edge after ``at`` bytes; return the new upper node (no snapshot).
        The snapshot stays on the deep side, at its depth."""
        parent = child.parent
        assert parent is not None
        k = at // TOKEN_BYTES
        top = child.depth - len(child.key) // TOKEN_BYTES + k
        vnp = child.value_np
        if vnp is not None:  # CPU indices: views of the numpy edge (tensors made when first read)
            upper = TreeNode(self._next_id, child.key[:at], None, parent, top, self, vnp[:k])
            child.value_np, child._value = vnp[k:], None
        else:
            upper = TreeNode(self._next_id, child.key[:at], child.value[:k], parent, top, self)
            child.value = child.value[k:]
        self._next_id += 1
        upper.kv_lock = child.kv_lock
        upper.last_access = child.last_access
        parent.children[upper.key[: self._page_bytes]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[: self._page_bytes]] = child
        self._num_nodes += 1
        return upper

    # ---------------------------------------------------------------- restore
    def restore(
        self, node: TreeNode, dst_slot: int, *, stream: Stream | None = None, dst_owner: Owner | None = None
    ) -> Fence:
        """Copy ``node``'s snapshot into ``dst_slot`` (a slot the caller owns), ordered after the
        snapshot's clone fence (or, for a demoted snapshot, from the host tier after its demotion's
        fence). The copy never aliases: the caller's slot gets its own bytes.

        Returns the fence after which ``dst_slot`` holds the state; the consumer's next forward
        pass must be ordered after it.

        :raises ValueError: ``node`` holds no snapshot.
        :raises ForeignObjectError: ``node`` is another cache's (its snapshot is not in this pool).
        :raises linear_state.SlotMisuse: ``dst_slot`` is not writable (or not ``dst_owner``'s).
        """
        self._own(node)
        if node.snapshot is None and node.host is not None and self.host_pool is not None:
            return self.pool.copy_from(
                self.host_pool,
                node.host,
                dst_slot,
                dst_owner=dst_owner,
                stream=stream if stream is not None else self.stream,
                after=(node.host_fence,),
            )
        if node.snapshot is None:
            raise ValueError(f"node {node.id} at depth {node.depth} holds no snapshot to restore")
        return self.pool.copy(
            node.snapshot,
            dst_slot,
            dst_owner=dst_owner,
            stream=stream if stream is not None else self.stream,
            after=(node.snapshot_fence,),
        )

    def snapshot_slot(self, node: TreeNode) -> tuple[SlotId, Fence]:
        """``node``'s device snapshot slot and the fence after which it holds the state, for a host
        that copies the state out of it itself (into its own request's state, wherever that
        lives) instead of :meth:`restore`'s copy into a slot of this pool. The slot stays the
        tree's: read it only, only after the fence, and only while ``node`` stays locked (a
        locked snapshot is neither evicted, demoted nor discarded, and nobody writes a tree slot).
        O(1).

        :raises ValueError: ``node`` is not locked (:meth:`lock` it first), or its snapshot is not
            on the device (none, or demoted to the host tier: :meth:`restore` copies that one).
        :raises ForeignObjectError: ``node`` is another cache's. :raises TypeError: not a node.
        """
        self._own(node)
        if node.snapshot is None:
            where = "on the host tier (restore copies it)" if node.host is not None else "none"
            raise ValueError(f"node {node.id} at depth {node.depth} holds no device snapshot: {where}")
        if not node.snap_lock:
            raise ValueError(f"node {node.id} at depth {node.depth} is not locked: lock it before reading its slot")
        return node.snapshot, node.snapshot_fence

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """Protect ``node``'s snapshot and the KV of its path to the root from eviction.

        Locks nest (a counter). O(depth in nodes).

        :raises ValueError: ``node`` was removed, or holds no snapshot (only a hit point is locked).
        :raises ForeignObjectError: ``node`` is another cache's.
        """
        self._own(node)
        _check_lockable(node)
        self._hold(node)
        # the path's KV that becomes protected, in key bytes (a root's key is empty); NOTE: summed
        # here and moved once: this walk runs at every lock (SGLang scheduler benchmark)
        moved = 0
        n: TreeNode | None = node
        while n is not None:
            moved += _kv_hold(n)
            n = n.parent
        if moved:
            moved //= TOKEN_BYTES
            self._evictable_kv -= moved
            self._protected_kv += moved

    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` of ``node``. O(depth in nodes).

        :raises LockError: ``node`` is not locked (a caller bug: unlock without lock; a
            ``RuntimeError``).
        :raises ForeignObjectError: ``node`` is another cache's.
        """
        self._own(node)
        _check_locked(node)
        self._let_go(node)
        moved = 0  # the path's KV no longer protected, in key bytes (as in lock)
        n: TreeNode | None = node
        while n is not None:
            moved += self._kv_let_go(n)
            n = n.parent
        if moved:
            moved //= TOKEN_BYTES
            self._evictable_kv += moved
            self._protected_kv -= moved

    def relock(self, old: TreeNode, new: TreeNode) -> None:
        """Move one lock from ``old`` to ``new``: the same as :meth:`lock` of ``new`` then
        :meth:`unlock` of ``old``, walking only the nodes where their paths differ (a request's
        lock moving down to its newest snapshot touches the nodes below the old one, not the
        path above it twice). O(nodes between the two and their deepest common ancestor).

        :raises ValueError: ``new`` was removed or holds no snapshot. :raises LockError: ``old``
            is not locked. :raises ForeignObjectError: either is another cache's. Nothing changed.
        """
        self._own(old)
        self._own(new)
        _check_lockable(new)
        _check_locked(old)
        if old is new:
            return
        self._hold(new)  # the snapshot locks, as lock(new) then unlock(old) move them
        self._let_go(old)
        # The path locks: up from both ends to their deepest common ancestor (None across two
        # namespaces' trees), each step from the deeper end (a parent is always shallower). Above
        # it lock and unlock would cancel out; locked there by ``old``, nothing would change state.
        gained = lost = 0  # KV that becomes protected / evictable, in key bytes
        a: TreeNode | None = new
        b: TreeNode | None = old
        while a is not b:
            if b is None or (a is not None and a.depth >= b.depth):
                assert a is not None
                gained += _kv_hold(a)
                a = a.parent
            else:
                lost += self._kv_let_go(b)
                b = b.parent
        moved = (gained - lost) // TOKEN_BYTES
        self._evictable_kv -= moved
        self._protected_kv += moved

    def _hold(self, node: TreeNode) -> None:
        """One more lock on ``node``'s own state (its path's KV is the caller's to walk)."""
        if node.snap_lock == 0 and node.snapshot is not None:
            self._protected_snapshots += 1
        if node.snap_lock == 0 and node.host is not None:
            self._protected_host += 1
        node.snap_lock += 1

    def _let_go(self, node: TreeNode) -> None:
        """One lock less on ``node``'s own state; the last one queues it for eviction again."""
        node.snap_lock -= 1
        if node.snap_lock == 0 and node.snapshot is not None:
            self._protected_snapshots -= 1
            self._snap_heap.push(node.last_access, node)
        if node.snap_lock == 0 and node.host is not None:
            self._protected_host -= 1
            self._host_heap.push(node.last_access, node)

    def _kv_let_go(self, n: TreeNode) -> int:
        """One lock less on ``n``'s edge KV: its key bytes when that was the last (a leaf is
        queued for eviction again), else 0."""
        n.kv_lock -= 1
        if n.kv_lock or n.depth == 0:
            return 0
        if not n.children:
            self._kv_heap.push(n.last_access, n)
        return len(n.key)

    # --------------------------------------------------------------- eviction
    def evict(self, *, kv_tokens: int = 0, snapshots: int = 0) -> EvictResult:
        """Free at least ``kv_tokens`` KV tokens and ``snapshots`` snapshots, least recently used
        first, or as many as are evictable.

        KV comes from unlocked leaves; a parent left as a tombstone leaf goes too (cascade).
        Snapshots come from any unlocked node: with a host tier the snapshot is demoted there (the
        node keeps its KV and serves hits from host memory); without one, or when it is full of
        locked copies, a leaf goes whole (its KV too) and an inner node stays as a tombstone. What
        goes is reported to the listener as events (KV as ``KV_FREED``); snapshot slots go back to
        the pool after their clone fence.
        O(log n) amortised per evicted node; never scans the tree.

        :raises ValueError: a negative amount. :raises TypeError: an amount that is not an int.
        """
        for name, v in (("kv_tokens", kv_tokens), ("snapshots", snapshots)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"evict {name} must be an int, got {v!r}")
        if kv_tokens < 0 or snapshots < 0:
            raise ValueError(f"evict amounts must be >= 0, got kv_tokens={kv_tokens}, snapshots={snapshots}")
        freed_kv = freed_snaps = removed = 0
        pop_leaf, remove_leaf = self._kv_heap.pop_valid, self._remove_leaf
        while freed_kv < kv_tokens:
            n = pop_leaf(_kv_candidate)
            if n is None:
                break
            k, s, r = remove_leaf(n)
            freed_kv += k
            freed_snaps += s
            removed += r
        while freed_snaps < snapshots:
            n = self._snap_heap.pop_valid(_snap_candidate)
            if n is None:
                break
            k, s, r = self._evict_device_snapshot(n, demote=True)
            freed_kv += k
            freed_snaps += s
            removed += r
        self._maybe_compact()
        return EvictResult(freed_kv, freed_snaps, removed)

    def evict_snapshot(self, node: TreeNode, *, demote: bool = True) -> EvictResult:
        """Evict ``node``'s snapshot now, whatever its recency: for policies that rank snapshots
        themselves. With a host tier that has room (or an unlocked copy to make room) it is demoted
        there; else a leaf goes whole (its KV too, cascading) and an inner node stays a tombstone.
        ``demote=False`` never demotes (an eviction for KV: the leaf and its KV must go).
        O(log n) amortised.

        :raises ValueError: ``node`` was removed or holds no snapshot.
        :raises LockError: ``node`` is locked (a ``RuntimeError``).
        :raises ForeignObjectError: ``node`` is another cache's.
        """
        self._own(node)
        if node.parent is None or node.snapshot is None:
            raise ValueError(f"node {node.id} holds no snapshot to evict")
        if node.snap_lock:
            raise LockError(f"node {node.id} is locked; its snapshot cannot be evicted")
        return self._evict_device_snapshot(node, demote=demote)

    def discard(self, node: TreeNode) -> EvictResult:
        """Drop ``node``'s snapshot wherever it is, on the device or in the host tier, never
        demoting it: a snapshot found corrupt. A leaf then goes with its KV (cascading), an inner
        node stays a tombstone, as in any eviction. Returns what was freed (``snapshots``: 1, the
        device or the host slot). O(depth of the cascade).

        :raises ValueError: ``node`` was removed or holds no snapshot. :raises LockError: ``node``
            is locked. :raises ForeignObjectError: another cache's node. Nothing changed.
        """
        self._own(node)
        if node.parent is None or (node.snapshot is None and node.host is None):
            raise ValueError(f"node {node.id} holds no snapshot to discard")
        if node.snap_lock:
            raise LockError(f"node {node.id} is locked; its snapshot cannot be discarded")
        if node.snapshot is not None:
            return self._evict_device_snapshot(node, demote=False)
        self._drop_host(node, remove=False)
        if node.children or node.kv_lock:
            return _ONE_SNAPSHOT
        freed = self._remove_leaf(node)
        return EvictResult(freed.kv_tokens, 1, freed.nodes_removed)

    def _evict_device_snapshot(self, n: TreeNode, *, demote: bool) -> EvictResult:
        """Unlocked ``n``'s device snapshot goes: to the host tier (``demote``, when it has room),
        else dropped; a leaf then goes whole (its KV too, cascading), an inner node stays a
        tombstone. Returns what was freed."""
        if demote and self._demote(n):
            return _ONE_SNAPSHOT
        if n.children:
            self._free_snapshot(n)
            return _ONE_SNAPSHOT
        return self._remove_leaf(n)

    def _remove_leaf(self, n: TreeNode) -> EvictResult:
        """Remove unlocked leaf ``n`` and every parent it leaves as an unlocked tombstone leaf."""
        freed_kv = freed_snaps = removed = 0
        while True:
            parent = n.parent
            assert parent is not None and not n.children and n.kv_lock == 0, f"cannot remove {n!r}"
            if n.snapshot is not None:
                self._free_snapshot(n)
                freed_snaps += 1
            if n.host is not None:
                self._drop_host(n, remove=False)
            del parent.children[n.key[: self._page_bytes]]
            n.parent = None
            k = len(n.key) // TOKEN_BYTES
            self._evictable_kv -= k
            self._num_nodes -= 1
            freed_kv += k
            removed += 1
            if self._on_event is not None:
                self._on_event(TreeEvent(TreeEventKind.KV_FREED, n, n.value))
                self._on_event(TreeEvent(TreeEventKind.NODE_REMOVED, n, parent=parent))
            if parent.depth == 0 or parent.children:
                break
            if parent.snapshot is not None or parent.host is not None:  # a leaf again, with a state
                if parent.kv_lock == 0:
                    self._kv_heap.push(parent.last_access, parent)
                break
            n = parent  # a tombstone leaf: cannot serve a hit, goes too (it holds no lock: see lock())
        return EvictResult(freed_kv, freed_snaps, removed)

    def _free_snapshot(self, n: TreeNode) -> None:
        slot = n.snapshot
        assert slot is not None
        if self._on_event is not None:
            self._on_event(TreeEvent(TreeEventKind.SNAPSHOT_FREED, n, tier="device", slot=int(slot)))
        owner = n.owner
        assert owner is not None, f"{n!r} holds a snapshot but has no owner"
        self.pool.free(slot, owner, after=(n.snapshot_fence,))
        n.snapshot = None
        n.snapshot_fence = COMPLETE
        self._num_snapshots -= 1

    @staticmethod
    def _owner_of(n: TreeNode) -> NodeOwner:
        """The owner ``n``'s slots are held under (set when it took its snapshot)."""
        owner = n.owner
        assert owner is not None, f"{n!r} holds a state but has no owner"
        return owner

    def _can_demote(self) -> bool:
        """The host tier would take one more snapshot (a free host slot, or an unlocked copy to drop)."""
        hp = self.host_pool
        return hp is not None and (hp.num_free > 0 or self._num_host > self._protected_host)

    def _demote(self, n: TreeNode) -> bool:
        """Move unlocked ``n``'s device snapshot into the host tier, dropping the tier's least
        recently used unlocked copy when it is full. False (nothing changed): no host tier, or no
        room. The device slot goes back to the pool once the copy to the host is done."""
        hp = self.host_pool
        if hp is None or not self._can_demote():
            return False
        if hp.num_free == 0:
            victim = self._host_heap.pop_valid(_host_candidate)
            if victim is None:
                return False
            self._drop_host(victim, remove=True)  # never n (no host copy) nor n's ancestors (n below)
        slot = n.snapshot
        assert slot is not None and not n.snap_lock, (
            f"demoting {n!r}: only an unlocked device snapshot moves to the host"
        )
        owner = self._owner_of(n)
        hs, fence = hp.clone_from(self.pool, slot, owner, stream=self.stream, after=(n.snapshot_fence,))
        self.pool.free(slot, owner, after=(fence,))  # the pool also waits the copy: its last use
        n.snapshot = None
        n.snapshot_fence = COMPLETE
        self._num_snapshots -= 1
        n.host = hs
        n.host_fence = fence
        self._num_host += 1
        self._demotions += 1
        self._host_heap.push(n.last_access, n)
        if self._on_event is not None:
            self._on_event(TreeEvent(TreeEventKind.DEMOTED, n, slot=int(hs)))
        return True

    def _drop_host(self, n: TreeNode, *, remove: bool) -> None:
        """Free ``n``'s host copy; with ``remove``, a leaf left without any state goes too."""
        hs = n.host
        assert hs is not None and self.host_pool is not None
        if self._on_event is not None:
            self._on_event(TreeEvent(TreeEventKind.SNAPSHOT_FREED, n, tier="host", slot=int(hs)))
        if n.snap_lock:
            self._protected_host -= 1
        self.host_pool.free(hs, self._owner_of(n), after=(n.host_fence,))
        n.host = None
        n.host_fence = COMPLETE
        self._num_host -= 1
        if remove and n.parent is not None and not n.children and n.snapshot is None and not n.kv_lock:
            self._remove_leaf(n)

    def _maybe_compact(self) -> None:
        limit = 2 * self._num_nodes + 1024
        if len(self._kv_heap) > limit:
            self._kv_heap.compact(_kv_candidate)
        if len(self._snap_heap) > limit:
            self._snap_heap.compact(_snap_candidate)
        if len(self._host_heap) > limit:
            self._host_heap.compact(_host_candidate)

    def _touch(self, nodes: list[TreeNode]) -> None:
        self._tick += 1
        tick = self._tick
        push_snap, push_kv = self._snap_heap.push, self._kv_heap.push
        for n in nodes:
            n.last_access = tick
            if n.snapshot is not None and not n.snap_lock:
                push_snap(tick, n)
            elif n.host is not None and not n.snap_lock:
                self._host_heap.push(tick, n)
            if not n.children and not n.kv_lock:
                push_kv(tick, n)
        # A touched node pushes at most two entries: checking the queues' sizes once every
        # num_nodes + 1024 touched nodes keeps them within a linear bound, without three len()
        # calls on every match and insert.
        self._touched += len(nodes)
        if self._touched > self._num_nodes + 1024:
            self._touched = 0
            if len(self._kv_heap) + len(self._snap_heap) + len(self._host_heap) > 4 * self._num_nodes + 2048:
                self._maybe_compact()

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Drop every node: its KV reported as ``KV_FREED`` (with ``NODE_REMOVED``), snapshot slots
        back to the pool (``SNAPSHOT_FREED``).

        :raises LockError: some node is locked (a request still uses the tree; a ``RuntimeError``);
            nothing changed.
        """
        if (
            self._protected_kv
            or self._protected_snapshots
            or self._protected_host
            or any(r.kv_lock for r in self._roots.values())
        ):
            raise LockError(
                f"reset while locked: {self._protected_kv} KV tokens, {self._protected_snapshots} snapshots protected"
            )
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                if n.snapshot is not None:
                    self._free_snapshot(n)
                if n.host is not None:
                    self._drop_host(n, remove=False)
                if self._on_event is not None:
                    self._on_event(TreeEvent(TreeEventKind.KV_FREED, n, n.value))
                    self._on_event(TreeEvent(TreeEventKind.NODE_REMOVED, n, parent=n.parent))
                n.parent = None
        self.reset_state()

    # ------------------------------------------------------------- invariants
    def describe(self) -> dict[str, object]:
        """The tree's bookkeeping beyond its nodes (roots, counters, recency clock, eviction
        heaps) as plain objects, for digests and debugging. Reads only."""
        return {
            "roots": {
                ns: (r.id - self._id_base, r.kv_lock, r.snap_lock, sorted(r.children)) for ns, r in self._roots.items()
            },
            "next_id": self._next_id - self._id_base,
            "tick": self._tick,
            "kv_heap": sorted((e[0], e[1], e[2]) for e in self._kv_heap),
            "snap_heap": sorted((e[0], e[1], e[2]) for e in self._snap_heap),
            "host_heap": sorted((e[0], e[1], e[2]) for e in self._host_heap),
            "counters": (
                self._num_nodes,
                self._num_snapshots,
                self._num_host,
                self._protected_host,
                self._evictable_kv,
                self._protected_kv,
                self._protected_snapshots,
            ),
        }

    def iter_nodes(self) -> list[TreeNode]:
        """Every node (roots excluded), parents before children. O(n): for tests and tools."""
        out: list[TreeNode] = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                out.append(n)
                stack.extend(n.children.values())
        return out

    def check_invariants(self) -> None:
        """Walk everything and raise ``AssertionError`` naming the first offending node. O(n).

        Checks: parent/child links and child index keys; page-aligned edges with matching KV
        length and depths; no unlocked tombstone leaf; lock counts consistent along paths; every
        snapshot slot owned by its node in the pool, none shared; size counters; every eviction
        candidate present in its heap; the pool's own invariants.
        """
        pb = self._page_bytes
        seen: set[int] = set()
        slots: dict[int, int] = {}
        nodes = snaps = ev_kv = pr_kv = pr_snaps = 0
        for heap in (self._kv_heap, self._snap_heap, self._host_heap):
            heap.check_invariants()
        # Only current entries can be popped: a node found only in a superseded one is missing.
        host_live = {e[2].id for e in self._host_heap.current() if _host_candidate(e)}
        host_slots: dict[int, int] = {}
        hosts = pr_host = 0
        kv_live = {e[2].id for e in self._kv_heap.current() if _kv_candidate(e)}
        snap_live = {e[2].id for e in self._snap_heap.current() if _snap_candidate(e)}
        for ns, root in self._roots.items():
            assert root.depth == 0 and root.key == b"" and root.parent is None, f"root of {ns!r} is malformed"
            assert root.snapshot is None, f"root of {ns!r} holds a snapshot"
            assert root.kv_lock == root.snap_lock + sum(c.kv_lock for c in root.children.values()), (
                f"root of {ns!r}: kv_lock {root.kv_lock} != own {root.snap_lock} + children"
            )
            stack = [root]
            while stack:
                p = stack.pop()
                for first, n in p.children.items():
                    assert id(n) not in seen, f"{n!r} reachable twice"
                    seen.add(id(n))
                    nodes += 1
                    assert n.parent is p, f"{n!r} parent link broken"
                    assert len(n.key) > 0 and len(n.key) % pb == 0, f"{n!r} edge of {len(n.key)} bytes not page aligned"
                    assert first == n.key[:pb], f"{n!r} indexed under the wrong first page"
                    assert n.value.dim() == 1 and n.value.numel() == n.num_tokens, (
                        f"{n!r} holds {n.value.numel()} KV indices for {n.num_tokens} tokens"
                    )
                    assert n.value.dtype == torch.int64, f"{n!r} holds {n.value.dtype} KV indices, not int64"
                    assert n.value_np is None or np.array_equal(n.value_np, n.value.numpy()), (
                        f"{n!r} numpy view of its KV indices disagrees with the tensor"
                    )
                    assert n.depth == p.depth + n.num_tokens, f"{n!r} depth != parent depth {p.depth} + edge"
                    own = n.snap_lock
                    below = sum(c.kv_lock for c in n.children.values())
                    assert n.kv_lock == own + below, f"{n!r} kv_lock {n.kv_lock} != own {own} + children {below}"
                    stateful = n.snapshot is not None or n.host is not None
                    assert n.snap_lock == 0 or stateful, f"{n!r} locked without a snapshot"
                    assert n.children or stateful, f"{n!r} is a tombstone leaf"
                    assert n.snapshot is None or n.host is None, f"{n!r} holds its state in both tiers"
                    if n.host is not None:
                        assert self.host_pool is not None, f"{n!r} holds a host copy but the cache has no host tier"
                        hosts += 1
                        assert n.host not in host_slots, f"host slot {n.host} held by {host_slots[n.host]} and {n.id}"
                        host_slots[n.host] = n.id
                        howner = self.host_pool.owner_of(n.host)
                        assert howner == NodeOwner(n.id), f"{n!r} host slot {n.host} is owned by {howner}"
                        assert howner is n.owner, f"{n!r} frees its host slot as {n.owner}, not the pool's {howner}"
                        if n.snap_lock:
                            pr_host += 1
                        else:
                            assert n.id in host_live, f"{n!r} unlocked host copy missing from the host heap"
                    if n.kv_lock:
                        pr_kv += n.num_tokens
                    else:
                        ev_kv += n.num_tokens
                        if not n.children:
                            assert n.id in kv_live, f"{n!r} is an evictable leaf missing from the KV heap"
                    if n.snapshot is not None:
                        snaps += 1
                        assert n.snapshot not in slots, (
                            f"slot {n.snapshot} held by nodes {slots.get(n.snapshot)} and {n.id}"
                        )
                        slots[n.snapshot] = n.id
                        owner = self.pool.owner_of(n.snapshot)
                        assert owner == NodeOwner(n.id), f"{n!r} snapshot slot {n.snapshot} is owned by {owner}"
                        assert owner is n.owner, f"{n!r} frees its slot as {n.owner}, not the pool's {owner}"
                        if n.snap_lock:
                            pr_snaps += 1
                        else:
                            assert n.id in snap_live, f"{n!r} evictable snapshot missing from the snapshot heap"
                    stack.append(n)
        assert nodes == self._num_nodes, f"num_nodes {self._num_nodes} != {nodes} reachable"
        assert snaps == self._num_snapshots, f"num_snapshots {self._num_snapshots} != {snaps}"
        assert ev_kv == self._evictable_kv, f"evictable_kv {self._evictable_kv} != {ev_kv}"
        assert pr_kv == self._protected_kv, f"protected_kv {self._protected_kv} != {pr_kv}"
        assert pr_snaps == self._protected_snapshots, f"protected_snapshots {self._protected_snapshots} != {pr_snaps}"
        pool_nodes = self.pool.num_owned_by(NodeOwner)
        assert pool_nodes == snaps, f"pool has {pool_nodes} node-owned slots, the tree holds {snaps} snapshots"
        self.pool.check_invariants()
        assert hosts == self._num_host, f"num_host_snapshots {self._num_host} != {hosts}"
        assert pr_host == self._protected_host, f"protected host copies {self._protected_host} != {pr_host}"
        if self.host_pool is not None:
            held = self.host_pool.num_owned_by(NodeOwner)
            assert held == hosts, f"host pool has {held} node-owned slots, the tree holds {hosts} host copies"
            self.host_pool.check_invariants()


def _kv_hold(n: TreeNode) -> int:
    """One more lock on ``n``'s edge KV: its key bytes when it was unlocked (now protected), else 0."""
    n.kv_lock += 1
    return len(n.key) if n.kv_lock == 1 else 0


def _check_lockable(node: TreeNode) -> None:
    """``node`` can take a lock: in the tree, and holding a state (or a root). :raises ValueError."""
    if node.parent is None and node.depth > 0:
        raise ValueError(f"node {node.id} was evicted; it cannot be locked")
    if node.snapshot is None and node.host is None and node.depth > 0:
        raise ValueError(f"node {node.id} at depth {node.depth} holds no snapshot; lock a node match returned")


def _check_locked(node: TreeNode) -> None:
    """``node`` holds a lock to give up. :raises LockError."""
    if node.snap_lock <= 0:
        raise LockError(f"unlock of node {node.id} at depth {node.depth}, which holds no lock")


def _stops_cascade(p: TreeNode) -> bool:
    """Removing ``p``'s only child leaves ``p`` standing: the root, a branch point, or a node that
    holds a state (it can serve a hit)."""
    return p.depth == 0 or len(p.children) > 1 or p.snapshot is not None or p.host is not None


def _kv_candidate(e: tuple[float, int, TreeNode]) -> bool:
    n = e[2]
    return n.parent is not None and not n.children and not n.kv_lock and n.last_access == e[0]


def _snap_candidate(e: tuple[float, int, TreeNode]) -> bool:
    n = e[2]
    return n.parent is not None and n.snapshot is not None and not n.snap_lock and n.last_access == e[0]


def _host_candidate(e: tuple[float, int, TreeNode]) -> bool:
    n = e[2]
    return n.parent is not None and n.host is not None and not n.snap_lock and n.last_access == e[0]


def _check_known_prefix(known: object, n_tokens: int) -> None:
    """:raises TypeError: not an int. :raises ValueError: outside ``[0, n_tokens]``."""
    if isinstance(known, bool) or not isinstance(known, (int, np.integer)):
        raise TypeError(f"known_prefix must be an int, got {known!r}")
    if not 0 <= known <= n_tokens:
        raise ValueError(f"known_prefix {known} is outside [0, {n_tokens}] for a key of {n_tokens} tokens")


def _check_kv_count(count: int, n_tokens: int) -> None:
    """:raises ValueError: ``count`` KV indices for a key of another length."""
    if count != n_tokens:
        raise ValueError(f"kv_indices has {count} entries for a key of {n_tokens} tokens")


def _check_start(start: object, node: TreeNode) -> int:
    """``start`` as a token position in ``[0, node.depth]``. :raises TypeError, ValueError."""
    if type(start) is int and 0 <= start <= node.depth:
        return start
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
        raise TypeError(f"start must be an int, got {start!r}")
    if not 0 <= start <= node.depth:
        raise ValueError(f"start {start} is outside [0, {node.depth}] (node {node.id}'s depth)")
    return int(start)


_INT64, _INT32 = np.dtype(np.int64), np.dtype(np.int32)
_INDEX_DTYPES = (_INT64, _INT32)


def _plain_index(kv: object) -> TypeGuard[np.ndarray]:
    """``kv`` is a 1-D, contiguous, writable int64 or int32 numpy array (an engine's page-table
    row: read as it is, widened only where the tree keeps a copy): a tensor can share its memory
    as it is (``torch.from_numpy`` warns on read-only arrays; other arrays go through
    :func:`_as_kv`)."""
    if type(kv) is not np.ndarray or kv.ndim != 1:
        return False
    dt = kv.dtype
    # NOTE: numpy's dtypes of native int64 and int32 are singletons: compared by identity first (an
    # equality test runs numpy's dtype comparison, ~1 us of every insert inside SGLang's scheduler)
    if dt is not _INT64 and dt is not _INT32 and dt not in _INDEX_DTYPES:
        return False
    flags = kv.flags  # NOTE: one flags object, not one per attribute: ~1 us per insert in place
    return bool(flags.c_contiguous and flags.writeable)


def _as_kv(kv: torch.Tensor | np.ndarray | list[int], n_tokens: int) -> torch.Tensor:
    if isinstance(kv, torch.Tensor):
        t = kv
    else:
        a = np.asarray(kv)
        if not a.dtype.isnative:  # another byte order (torch reads only the machine's): converted
            a = a.astype(a.dtype.newbyteorder("="))
        t = torch.as_tensor(a if a.flags.writeable else a.copy())  # torch warns on read-only memory
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
        raise ValueError(f"kv_indices must be a 1-D integer tensor, got shape {tuple(t.shape)} dtype {t.dtype}")
    _check_kv_count(t.numel(), n_tokens)
    return t.to(torch.int64) if t.dtype != torch.int64 else t
