"""``flop-efficiency``: Marconi's policy (Pan et al., MLSys 2025), written from the paper's
description.

Admission: a snapshot at the branch point that speculative insertion finds (where a request's
prompt leaves what the tree already holds: the prefix is shared with an earlier sequence, so the
state there is likely reused), and the final state of each request (prompt + answer: the next turn
of a conversation resumes there). At most these two per request.

Eviction: the candidates are the snapshots of nodes with at most one child. Each gets a utility
``recency + alpha * flop_efficiency``, both terms min-max normalised to ``[0, 1]`` over the current
candidates: recency is the time of the node's last use (donation or hit); FLOP efficiency is the
prefill FLOPs a hit on the node saves (all ``depth`` tokens, from the model's FLOP model: attention
quadratic in depth, linear layers and MLP linear) per byte the node holds (its snapshot, plus the
KV it alone keeps when it is a leaf: its edge and the tombstone parents that go with it, what
evicting it frees). The lowest utility goes first (ties: the oldest node). ``alpha`` is tuned by
replaying a bootstrap window of the workload over a grid (:func:`radixcache.simulator.tune_alpha`);
``alpha = 0`` is LRU over the candidates. A snapshot a running request has locked is a candidate
for the normalisation (it has at most one child) but is not chosen.

How the minimum is found, exactly, without scanning every candidate per eviction: normalised, the
utility is ``a * recency + b * efficiency`` with ``a = 1 / (recency range)`` and ``b = alpha /
(efficiency range)`` (measured from any origin: the minimum does not move); the ranges' ends come
from four lazy heaps, looked at again only when a row that held one changes. Each candidate keeps
its recency, efficiency and candidacy in a row (:class:`~radixcache.policies.rows.RowTable`),
refreshed when the policy sees them change (its donation or hit; a snapshot donated below it, or a
split beside it; an eviction next to it, the policy's own or one the tree reports as an event: see
:meth:`HybridRadixCache.cost_dependents`; the host tier starting or stopping to take evictions,
which changes every candidate's bytes). A scan, vectorised, queues the ``queue`` lowest utilities
at the weights ``(a0, b0)`` it ran with, sorted, and keeps ``T``, the lowest utility left out.
Every row the scan saw and that did not change has moved since by ``(a - a0) r + (b - b0) e``,
no less than ``shift``, that difference's minimum over the current ranges. An eviction at weights
``(a, b)`` scores the rows changed since the scan, then walks the queue in scanned order, scoring
each, until a row's scanned utility plus ``shift`` is above the best found (so are all later
rows, and the rows left out are above ``T + shift``): the best is the exact minimum. When the
queue runs out first, or too many rows changed, the scan runs again. Cost per eviction: the changed
rows, a few queued ones, and an O(n) numpy scan shared by the evictions of about one queue.
KV-pressure evictions (leaves only, and the leaf's KV always goes, so the bytes differ) scan every
leaf exactly, O(n).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..core.events import TreeEvent
from ..core.policy import DonationReason, Policy, RequestInfo, TreeView
from ..core.tree import TreeNode
from .rows import RowTable

__all__ = ["ALPHA_GRID", "FlopEfficiency"]

_R, _E, _CAND = range(3)  # columns of a row: last use, FLOP efficiency, 1.0 for a candidate

ALPHA_GRID: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""The alphas the bootstrap replay tries."""


def _widen(m: list[float] | None, r: float, e: float) -> list[float]:
    """``[lowest r, highest r, lowest e, highest e]`` of ``m`` and one more row."""
    return [r, r, e, e] if m is None else [min(m[0], r), max(m[1], r), min(m[2], e), max(m[3], e)]


@dataclass(slots=True)
class _Scan:
    a: float  # weights the scan ran with
    b: float
    r0: float  # the origin its utilities are measured from (argmin is the same from any origin)
    e0: float
    bound: float  # the lowest utility left out of the queue (inf: none left out)
    queue: list[tuple[float, int]]  # (utility, id) of every candidate at or below the queue-th, sorted
    head: int = 0  # queue entries before it were taken or found gone


class FlopEfficiency(Policy):
    """:param alpha: weight of the normalised FLOP efficiency against normalised recency;
    :param queue: candidates a scan keeps (more: fewer scans, more scored per eviction).

    :raises ValueError: ``alpha`` negative or ``queue`` not positive."""

    name = "flop-efficiency"
    decode_captures = False

    def __init__(self, alpha: float = 1.0, *, queue: int = 1024) -> None:
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if queue <= 0:
            raise ValueError(f"queue must be > 0, got {queue}")
        self.alpha = float(alpha)
        self.queue = queue
        self._prefill_flops: Callable[[int], float] = float  # until told: one FLOP per token
        # A row per tracked snapshot: its last use, its FLOP efficiency (at the bytes an eviction
        # for slots frees) and 1.0 when it is a candidate (at most one child).
        self._t = RowTable(3)
        self._scan: _Scan | None = None
        # The ranges' ends: from the scan, the queue-many lowest and highest (value, id) of recency
        # and efficiency (lists 0 to 3, most extreme first), each with how far it is used up and
        # whether rows were left out of it; and the extremes of the rows changed since.
        self._lists: list[list[tuple[float, int]]] = [[], [], [], []]
        self._heads = [0, 0, 0, 0]
        self._partial = [True, True, True, True]
        self._moved: list[float] | None = None  # changed rows' [lowest r, highest r, lowest e, highest e]
        self._moved_stale = False
        self._changed: set[int] = set()  # ids whose row changed since the scan
        self._evicted: TreeNode | None = None  # the last victim (inner) or where its cascade stops
        self._demotes: bool | None = None  # the tree's demotes when the rows' bytes were computed

    def bind(self, cache: TreeView) -> None:
        super().bind(cache)
        self._demotes = cache.demotes

    def flops(self, prefill_flops: Callable[[int], float]) -> None:
        """Take the model's FLOP model (see :meth:`Policy.flops`). Until told, every token costs
        the same."""
        self._prefill_flops = prefill_flops
        self._refresh_all()

    def costs(self, snapshot_bytes: int, kv_bytes_per_token: int) -> None:
        super().costs(snapshot_bytes, kv_bytes_per_token)
        self._refresh_all()

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        if decode:
            return []
        b = req.token_length
        return [b] if b > req.cached_length and start < b <= end else []

    def donate_finish(self, req: RequestInfo) -> bool:
        return True

    def donated(self, node: TreeNode, req: RequestInfo, reason: DonationReason, now: float) -> None:
        self._put(node, now)
        for d in self.cache.cost_dependents(node):  # a leaf no more, or a shorter cascade
            self._reshape(d)

    def touched(self, node: TreeNode, req: RequestInfo, now: float) -> None:
        self._put(node, now)

    def efficiency(self, node: TreeNode, *, demote: bool = True) -> float:
        """Prefill FLOPs a hit on ``node`` saves per byte evicting it frees (``demote``: as
        :meth:`freed_bytes`)."""
        return self._prefill_flops(node.depth) / self.freed_bytes(node, demote=demote)

    # -- the rows ---------------------------------------------------------------------------------

    def _put(self, node: TreeNode, last: float | None) -> None:
        """Track ``node`` (its last use ``last``; ``None``: unchanged) with its row as it is now."""
        if not self.cache.holds_snapshot(node):
            self._drop(node.id)  # a hit served from the host tier: no device snapshot to rank
            return
        pos = self._t.add(node)
        row = self._t.rows[pos]
        r = float(row[_R]) if last is None else last
        if self.cache.demotes != self._demotes:
            self._demotes = None  # rows of both kinds of bytes now: the next eviction refreshes all
        e = self.efficiency(node)
        cand = len(node.children) <= 1
        same = cand and bool(row[_CAND]) and row[_R] == r and row[_E] == e
        if same:
            return  # the row and its place in the scan stand
        if node.id in self._changed:
            self._moved_stale = True  # its earlier values may be an extreme no longer held
        self._changed.add(node.id)
        row[_R], row[_E], row[_CAND] = r, e, cand
        if cand and not self._moved_stale:
            self._moved = _widen(self._moved, r, e)

    def _reshape(self, node: TreeNode) -> None:
        n = self.cache.cost_dependent(node)
        t = self._t
        if n is not None and n.id in t.pos and t.nodes[t.pos[n.id]] is n:
            self._put(n, None)

    def _refresh_all(self) -> None:
        for n in list(self._t.nodes):
            self._put(n, None)

    def _drop(self, nid: int) -> None:
        if self._t.remove(nid):
            self._forget(nid)

    def _forget(self, nid: int) -> None:
        """Node id ``nid`` left the rows: a changed row gone may have held an extreme."""
        if nid in self._changed:
            self._changed.discard(nid)
            self._moved_stale = True

    def tree_event(self, event: TreeEvent) -> None:
        """A tracked snapshot the tree let go unchosen leaves the rows now; the costs it changed are
        refreshed at the next :meth:`victim`."""
        nid = self._t.hear(event)
        if nid is not None:
            self._forget(nid)

    def _ranges(self) -> tuple[float, float, float, float] | None:
        """Lowest and highest recency and efficiency over the candidates, from the scan's end
        lists and the rows changed since; ``None``: a list ran out while the scan left rows out of
        it (a scan is due), or no candidate."""
        pos_of, rows = self._t.pos, self._t.rows
        ends: list[float | None] = []
        for c, lst in enumerate(self._lists):
            col = _R if c < 2 else _E
            h = self._heads[c]
            while h < len(lst):
                value, nid = lst[h]
                pos = pos_of.get(nid)
                if pos is not None and rows[pos, _CAND] and rows[pos, col] == value:
                    break
                h += 1
            self._heads[c] = h
            if h == len(lst) and self._partial[c]:
                return None
            ends.append(lst[h][0] if h < len(lst) else None)
        moved = self._moved_extremes()
        if moved is not None:
            for c in range(4):
                end = ends[c]
                ends[c] = moved[c] if end is None else (min(end, moved[c]) if c % 2 == 0 else max(end, moved[c]))
        r_lo, r_hi, e_lo, e_hi = ends
        if r_lo is None or r_hi is None or e_lo is None or e_hi is None:
            return None
        return r_lo, r_hi, e_lo, e_hi

    def _moved_extremes(self) -> list[float] | None:
        """The changed rows' lowest and highest recency and efficiency (``None``: no candidate
        among them), recounted when a changed row changed again or went."""
        if self._moved_stale:
            self._moved_stale = False
            self._moved = None
            rows, pos_of = self._t.rows, self._t.pos
            for nid in self._changed:
                pos = pos_of[nid]
                if rows[pos, _CAND]:
                    self._moved = _widen(self._moved, float(rows[pos, _R]), float(rows[pos, _E]))
        return self._moved

    # -- eviction ---------------------------------------------------------------------------------

    def _settle(self) -> None:
        """Bring the rows up to date with what the last eviction, the evictions the tree reported
        (its own LRU after a ``None``, a direct one) and the host tier changed."""
        for n in self._t.due(self._evicted):  # the last victim's, then what the tree let go unchosen
            self._reshape(n)
        self._evicted = None
        demotes = self.cache.demotes
        if demotes != self._demotes:
            self._demotes = demotes
            self._refresh_all()

    def _utility(self, pos: int, a: float, b: float, scan: _Scan) -> float:
        row = self._t.rows[pos]
        return a * (float(row[_R]) - scan.r0) + b * (float(row[_E]) - scan.e0)

    def _full_scan(self, k: int) -> tuple[tuple[float, float, float, float] | None, int]:
        """Scan every candidate: the exact ranges, the queue of the ``k`` lowest utilities at
        their weights, the end lists. Returns the ranges (``None``: no candidate) and how many
        candidates there are."""
        n = len(self._t)
        table = self._t.rows
        rows = np.flatnonzero(table[:n, _CAND])
        self._changed.clear()
        self._moved, self._moved_stale = None, False
        if not len(rows):
            self._scan = None
            self._lists, self._partial = [[], [], [], []], [False, False, False, False]
            return None, 0
        r, e = table[rows, _R], table[rows, _E]
        ranges = (float(r.min()), float(r.max()), float(e.min()), float(e.max()))
        a, b = self._weights(ranges)
        u = a * (r - ranges[0]) + b * (e - ranges[2])
        nodes = self._t.nodes
        inside, bound = self._lowest(u, k)
        queue = sorted(zip(u[inside].tolist(), (nodes[i].id for i in rows[inside].tolist()), strict=True))
        self._scan = _Scan(a, b, ranges[0], ranges[2], bound, queue)
        for c, (values, sign) in enumerate(((r, 1.0), (r, -1.0), (e, 1.0), (e, -1.0))):
            ends, _ = self._lowest(sign * values, self.queue)
            picked = sorted(zip((sign * values[ends]).tolist(), rows[ends].tolist(), strict=True))
            self._lists[c] = [(sign * v, nodes[i].id) for v, i in picked]
            self._heads[c] = 0
            self._partial[c] = len(picked) < len(rows)
        return ranges, len(rows)

    @staticmethod
    def _lowest(values: np.ndarray, k: int) -> tuple[np.ndarray, float]:
        """A mask of the values at or below the ``k``-th lowest, and the lowest value left out
        (infinity: none)."""
        if len(values) <= k:
            return np.ones(len(values), dtype=bool), float("inf")
        kth = np.partition(values, k - 1)[k - 1]
        inside = values <= kth
        return inside, float(values[~inside].min()) if (~inside).any() else float("inf")

    def _weights(self, ranges: tuple[float, float, float, float]) -> tuple[float, float]:
        """``(a, b)``: the normalisation's weights of recency and efficiency."""
        r_lo, r_hi, e_lo, e_hi = ranges
        return (1.0 / (r_hi - r_lo) if r_hi > r_lo else 0.0, self.alpha / (e_hi - e_lo) if e_hi > e_lo else 0.0)

    def _from_scan(self, a: float, b: float, ranges: tuple[float, float, float, float]) -> TreeNode | None:
        """The exact choice at weights ``(a, b)`` from the last scan's queue and the rows changed
        since, or ``None`` when they cannot prove it (a scan is due). Every row the scan saw and
        that did not change moved from its scanned utility by ``(a - a0)(r - r0) + (b - b0)(e -
        e0)``, at least ``shift`` over the current ranges: rows are looked at in scanned order
        until their scanned utility plus ``shift`` passes the best found."""
        scan = self._scan
        if scan is None or len(self._changed) > self.queue:
            return None
        r_lo, r_hi, e_lo, e_hi = ranges
        da, db = a - scan.a, b - scan.b
        shift = da * ((r_lo if da > 0 else r_hi) - scan.r0) + db * ((e_lo if db > 0 else e_hi) - scan.e0)
        pos_of, nodes, table = self._t.pos, self._t.nodes, self._t.rows
        best: tuple[float, int] | None = None
        best_node: TreeNode | None = None
        for nid in self._changed:
            pos = pos_of.get(nid)
            if pos is not None and table[pos, _CAND] and self._free(nodes[pos]):
                key = (self._utility(pos, a, b, scan), nid)
                if best is None or key < best:
                    best, best_node = key, nodes[pos]
        queue = scan.queue
        i = scan.head
        while i < len(queue) and pos_of.get(queue[i][1]) is None:
            i += 1  # taken or gone: never looked at again
        scan.head = i
        for u0, nid in queue[i:]:
            if best is not None and u0 + shift > best[0]:
                return best_node  # this row and every later one (and every row left out) are above
            pos = pos_of.get(nid)
            if pos is None or nid in self._changed or not table[pos, _CAND] or not self._free(nodes[pos]):
                continue
            key = (self._utility(pos, a, b, scan), nid)
            if best is None or key < best:
                best, best_node = key, nodes[pos]
        if best is not None and scan.bound + shift > best[0]:
            return best_node
        return None

    def _free(self, node: TreeNode) -> bool:
        """``node`` may be chosen: it holds an unlocked device snapshot (a tracked one never lacks
        it: the tree's events untrack what it lets go, :meth:`tree_event`)."""
        return node.parent is not None and node.snapshot is not None and not node.snap_lock

    def _take(self, node: TreeNode) -> TreeNode:
        # The manager evicts it now: what that leaves is looked at before the next choice.
        self._evicted = node if node.children else self.cache.cascade_stop(node)
        self._drop(node.id)
        return node

    def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
        self._settle()
        if kv:
            return self._leaf_victim()
        node = self._choose()
        return None if node is None else self._take(node)

    def _choose(self) -> TreeNode | None:
        """Marconi's choice among the tracked rows (see the module's notes); ``None``: no
        candidate, or every one locked."""
        node = None
        ranges = self._ranges()
        if ranges is not None:
            node = self._from_scan(*self._weights(ranges), ranges)
        k = self.queue
        while node is None:
            ranges, count = self._full_scan(k)
            if ranges is None:
                return None
            node = self._from_scan(*self._weights(ranges), ranges)
            if node is None and k >= count:
                return None
            k *= 4
        return node

    def _leaf_victim(self) -> TreeNode | None:
        """For KV pressure: the lowest utility among the leaf candidates, normalised over them, at
        the bytes a KV eviction frees (the leaf's KV always goes). O(n)."""
        cands: list[tuple[int, float, float, TreeNode]] = []
        rows = self._t.rows
        for pos, node in enumerate(self._t.nodes):
            if not node.children and self._free(node):
                cands.append((node.id, float(rows[pos, _R]), self.efficiency(node, demote=False), node))
        if not cands:
            return None
        r_lo, r_hi = min(c[1] for c in cands), max(c[1] for c in cands)
        e_lo, e_hi = min(c[2] for c in cands), max(c[2] for c in cands)
        a = 1.0 / (r_hi - r_lo) if r_hi > r_lo else 0.0
        b = self.alpha / (e_hi - e_lo) if e_hi > e_lo else 0.0
        best = min(cands, key=lambda c: (a * c[1] + b * c[2], c[0]))
        return self._take(best[3])

    def check_invariants(self) -> None:
        """Raise AssertionError unless the rows, the positions and the candidate flags agree with
        the tracked nodes."""
        self._t.check_invariants()
        stray = [nid for nid in self._changed if nid not in self._t.pos]
        assert not stray, f"changed but not tracked: {stray}"

    def describe(self) -> dict[str, object]:
        return {"alpha": self.alpha, "tracked": sorted(self._t.pos)}
