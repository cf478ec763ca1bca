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
its recency, efficiency and candidacy in arrays, refreshed when the policy sees them change (its
donation or hit; a snapshot donated below it, or a split beside it; an eviction next to it: see
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

from ..core.lazy_heap import LazyHeap
from ..core.tree import HybridRadixCache, TreeNode
from .base import DonationReason, Policy, RequestInfo

__all__ = ["ALPHA_GRID", "FlopEfficiency"]

ALPHA_GRID: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""The alphas the bootstrap replay tries."""


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
        self._nodes: list[TreeNode] = []  # tracked snapshot nodes; row i of the arrays is _nodes[i]
        self._pos: dict[int, int] = {}
        self._r = np.zeros(64)  # last use
        self._e = np.zeros(64)  # FLOP efficiency, at the bytes an eviction for slots frees
        self._cand = np.zeros(64, dtype=bool)  # at most one child
        # lowest recency, highest (negated), lowest efficiency, highest (negated), of the candidates
        self._ends: tuple[LazyHeap[int], ...] = (LazyHeap(), LazyHeap(), LazyHeap(), LazyHeap())
        self._scan: _Scan | None = None
        self._end: list[float | None] = [None, None, None, None]  # the ranges' ends, None: look again
        self._changed: set[int] = set()  # ids whose row changed since the scan
        self._evicted: TreeNode | None = None  # the last victim (inner) or where its cascade stops
        self._demotes: bool | None = None  # the tree's demotes when the rows' bytes were computed
        self._unseen = False  # the tree may have evicted a tracked snapshot the policy did not choose

    def bind(self, cache: HybridRadixCache) -> None:
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
        b = req.branch
        return [b] if b > req.hit and start < b <= end else []

    def donate_finish(self, req: RequestInfo) -> bool:
        return True

    def donated(self, node: TreeNode, req: RequestInfo, reason: DonationReason, now: float) -> None:
        self._put(node, now)
        for d in HybridRadixCache.cost_dependents(node):  # a leaf no more, or a shorter cascade
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
        if not HybridRadixCache.holds_snapshot(node):
            self._drop(node.id)  # a hit served from the host tier: no device snapshot to rank
            return
        pos = self._pos.get(node.id)
        if pos is None:
            pos = self._pos[node.id] = len(self._nodes)
            self._nodes.append(node)
            if pos == len(self._r):
                grow = len(self._r)
                self._r = np.concatenate([self._r, np.zeros(grow)])
                self._e = np.concatenate([self._e, np.zeros(grow)])
                self._cand = np.concatenate([self._cand, np.zeros(grow, dtype=bool)])
        r = float(self._r[pos]) if last is None else last
        if self.cache.demotes != self._demotes:
            self._demotes = None  # rows of both kinds of bytes now: the next eviction refreshes all
        e = self.efficiency(node)
        cand = len(node.children) <= 1
        same = cand and bool(self._cand[pos]) and self._r[pos] == r and self._e[pos] == e
        if same:
            return  # the row, its heap entries and its place in the scan stand
        self._changed.add(node.id)
        self._leave_ends(pos)
        self._r[pos], self._e[pos], self._cand[pos] = r, e, cand
        if cand:
            end = self._end
            for i, v in ((0, r), (2, e)):
                if end[i] is not None and v < end[i]:  # type: ignore[operator]
                    end[i] = v
                if end[i + 1] is not None and v > end[i + 1]:  # type: ignore[operator]
                    end[i + 1] = v
        if cand:
            lo_r, hi_r, lo_e, hi_e = self._ends
            lo_r.push(r, node.id)
            hi_r.push(-r, node.id)
            lo_e.push(e, node.id)
            hi_e.push(-e, node.id)

    def _reshape(self, node: TreeNode) -> None:
        n = HybridRadixCache.cost_dependent(node)
        if n is not None and n.id in self._pos and self._nodes[self._pos[n.id]] is n:
            self._put(n, None)

    def _refresh_all(self) -> None:
        for n in list(getattr(self, "_nodes", ())):
            self._put(n, None)

    def _leave_ends(self, pos: int) -> None:
        """Row ``pos`` is about to change or go: forget each range end it may hold."""
        if pos < len(self._nodes) and self._cand[pos]:
            end, r, e = self._end, self._r[pos], self._e[pos]
            for i, v in ((0, r), (1, r), (2, e), (3, e)):
                if end[i] == v:
                    end[i] = None

    def _drop(self, nid: int) -> None:
        pos = self._pos.get(nid)
        if pos is None:
            return
        self._leave_ends(pos)
        del self._pos[nid]
        self._changed.discard(nid)
        moved = self._nodes.pop()
        last = len(self._nodes)
        if pos < last:
            self._nodes[pos] = moved
            self._pos[moved.id] = pos
            self._r[pos], self._e[pos], self._cand[pos] = self._r[last], self._e[last], self._cand[last]
        self._cand[last] = False

    def _valid(self, column: int) -> Callable[[tuple[float, int, int]], bool]:
        """Whether a heap entry of ``column`` (0, 1: recency; 2, 3: efficiency; odd: negated)
        still holds."""
        values = self._r if column < 2 else self._e
        sign = -1.0 if column % 2 else 1.0

        def valid(entry: tuple[float, int, int]) -> bool:
            pos = self._pos.get(entry[2])
            return pos is not None and bool(self._cand[pos]) and sign * float(values[pos]) == entry[0]

        return valid

    def _ranges(self) -> tuple[float, float, float, float] | None:
        """Lowest and highest recency and efficiency over the candidates; ``None``: none."""
        end = self._end
        for column, heap in enumerate(self._ends):
            if end[column] is not None:
                continue
            if len(heap) > 4 * len(self._nodes) + 64:
                heap.compact(self._valid(column))
            top = heap.peek_valid(self._valid(column))
            if top is None:
                return None
            end[column] = -top[0] if column % 2 else top[0]
        r_lo, r_hi, e_lo, e_hi = end
        assert r_lo is not None and r_hi is not None and e_lo is not None and e_hi is not None
        return r_lo, r_hi, e_lo, e_hi

    # -- eviction ---------------------------------------------------------------------------------

    def _settle(self) -> None:
        """Bring the rows up to date with what the last eviction and the host tier changed, and,
        after a ``None`` (the manager then lets the tree evict by its own LRU, unseen), every row
        (O(n), only then)."""
        if self._unseen:
            self._unseen = False
            self._refresh_all()  # drops the rows gone, refreshes those whose paths changed
        if self._evicted is not None:
            self._reshape(self._evicted)
            self._evicted = None
        demotes = self.cache.demotes
        if demotes != self._demotes:
            self._demotes = demotes
            self._refresh_all()

    def _utility(self, pos: int, a: float, b: float, scan: _Scan) -> float:
        return a * (float(self._r[pos]) - scan.r0) + b * (float(self._e[pos]) - scan.e0)

    def _rescan(self, a: float, b: float, r0: float, e0: float, k: int) -> int:
        """Queue the candidates at or below the ``k``-th lowest utility at weights ``(a, b)``;
        return how many candidates there are."""
        n = len(self._nodes)
        rows = np.flatnonzero(self._cand[:n])
        u = a * (self._r[rows] - r0) + b * (self._e[rows] - e0)
        if len(rows) <= k:
            inside, bound = np.ones(len(rows), dtype=bool), float("inf")
        else:
            kth = np.partition(u, k - 1)[k - 1]
            inside = u <= kth
            bound = float(u[~inside].min())
        nodes = self._nodes
        queue = sorted(zip(u[inside].tolist(), (nodes[i].id for i in rows[inside].tolist()), strict=True))
        self._scan = _Scan(a, b, r0, e0, bound, queue)
        self._changed.clear()
        return len(rows)

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
        pos_of, nodes, cand = self._pos, self._nodes, self._cand
        best: tuple[float, int] | None = None
        best_node: TreeNode | None = None
        for nid in self._changed:
            pos = pos_of.get(nid)
            if pos is not None and cand[pos] and self._free(nodes[pos]):
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
            if pos is None or nid in self._changed or not cand[pos] or not self._free(nodes[pos]):
                continue
            key = (self._utility(pos, a, b, scan), nid)
            if best is None or key < best:
                best, best_node = key, nodes[pos]
        if best is not None and scan.bound + shift > best[0]:
            return best_node
        return None

    def _free(self, node: TreeNode) -> bool:
        """``node`` may be chosen: it holds an unlocked device snapshot. One that lost its snapshot
        unseen is not, and has the rows swept at the next eviction."""
        if node.parent is None or node.snapshot is None:
            self._unseen = True
            return False
        return not node.snap_lock

    def _take(self, node: TreeNode) -> TreeNode:
        # The manager evicts it now: what that leaves is looked at before the next choice.
        self._evicted = node if node.children else HybridRadixCache.cascade_stop(node)
        self._drop(node.id)
        return node

    def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
        self._settle()
        if kv:
            return self._leaf_victim()
        node = self._choose()
        if node is not None and self._unseen:  # met a snapshot gone unseen: its row was in the ranges
            self._settle()
            node = self._choose()
        if node is None:
            self._unseen = True  # the tree chooses by its own LRU now
            return None
        return self._take(node)

    def _choose(self) -> TreeNode | None:
        """Marconi's choice among the tracked rows (see the module's notes); ``None``: no
        candidate, or every one locked."""
        ranges = self._ranges()
        if ranges is None:
            return None
        r_lo, r_hi, e_lo, e_hi = ranges
        a = 1.0 / (r_hi - r_lo) if r_hi > r_lo else 0.0
        b = self.alpha / (e_hi - e_lo) if e_hi > e_lo else 0.0
        node = self._from_scan(a, b, ranges)
        k = self.queue
        while node is None:
            count = self._rescan(a, b, r_lo, e_lo, k)
            node = self._from_scan(a, b, ranges)
            if node is None and k >= count:
                return None
            k *= 4
        return node

    def _leaf_victim(self) -> TreeNode | None:
        """For KV pressure: the lowest utility among the leaf candidates, normalised over them, at
        the bytes a KV eviction frees (the leaf's KV always goes). O(n)."""
        cands: list[tuple[int, float, float, TreeNode]] = []
        for pos, node in enumerate(self._nodes):
            if not node.children and self._free(node):
                cands.append((node.id, float(self._r[pos]), self.efficiency(node, demote=False), node))
        if not cands:
            self._unseen = True
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
        assert len(self._pos) == len(self._nodes), f"{len(self._pos)} positions, {len(self._nodes)} nodes"
        for i, n in enumerate(self._nodes):
            assert self._pos.get(n.id) == i, f"node {n.id} at {i}, position says {self._pos.get(n.id)}"
        assert not self._cand[len(self._nodes) :].any(), "a candidate flag past the tracked rows"

    def describe(self) -> dict[str, object]:
        return {"alpha": self.alpha, "tracked": sorted(self._pos)}
