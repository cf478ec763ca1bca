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
evicting it frees). The lowest utility goes first. ``alpha``
is tuned by replaying a bootstrap window of the workload over a grid
(:func:`radixcache.simulator.tune_alpha`); ``alpha = 0`` is LRU over the candidates.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.tree import HybridRadixCache, TreeNode
from .base import DonationReason, Policy, RequestInfo

__all__ = ["ALPHA_GRID", "FlopEfficiency"]

ALPHA_GRID: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""The alphas the bootstrap replay tries."""


class FlopEfficiency(Policy):
    """:param alpha: weight of the normalised FLOP efficiency against normalised recency.

    :raises ValueError: ``alpha`` negative."""

    name = "flop-efficiency"
    decode_captures = False

    def __init__(self, alpha: float = 1.0) -> None:
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.alpha = float(alpha)
        self._last: dict[int, tuple[TreeNode, float]] = {}  # node id -> (node, time of last use)
        self._prefill_flops: Callable[[int], float] = float  # until told: one FLOP per token

    def flops(self, prefill_flops: Callable[[int], float]) -> None:
        """Take the model's FLOP model (see :meth:`Policy.flops`). Until told, every token costs
        the same."""
        self._prefill_flops = prefill_flops

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        if decode:
            return []
        b = req.branch
        return [b] if b > req.hit and start < b <= end else []

    def donate_finish(self, req: RequestInfo) -> bool:
        return True

    def donated(self, node: TreeNode, req: RequestInfo, reason: DonationReason, now: float) -> None:
        self._last[node.id] = (node, now)

    def touched(self, node: TreeNode, req: RequestInfo, now: float) -> None:
        self._last[node.id] = (node, now)

    def efficiency(self, node: TreeNode, *, demote: bool = True) -> float:
        """Prefill FLOPs a hit on ``node`` saves per byte evicting it frees (``demote``: as
        :meth:`freed_bytes`)."""
        return self._prefill_flops(node.depth) / self.freed_bytes(node, demote=demote)

    def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
        cands: list[tuple[TreeNode, float, float]] = []
        gone: list[int] = []
        for nid, (node, last) in self._last.items():
            if not HybridRadixCache.holds_snapshot(node):
                gone.append(nid)
            elif len(node.children) <= 1 and HybridRadixCache.is_evictable(node) and (node.is_leaf or not kv):
                cands.append((node, last, self.efficiency(node, demote=not kv)))  # KV pressure drops
        for nid in gone:
            del self._last[nid]
        if not cands:
            return None
        r_lo, r_hi = min(c[1] for c in cands), max(c[1] for c in cands)
        e_lo, e_hi = min(c[2] for c in cands), max(c[2] for c in cands)

        def utility(c: tuple[TreeNode, float, float]) -> float:
            r = (c[1] - r_lo) / (r_hi - r_lo) if r_hi > r_lo else 0.0
            e = (c[2] - e_lo) / (e_hi - e_lo) if e_hi > e_lo else 0.0
            return r + self.alpha * e

        node = min(cands, key=utility)[0]
        del self._last[node.id]
        return node

    def check_invariants(self) -> None:
        for nid, (node, _) in self._last.items():
            assert node.id == nid, f"entry {nid} holds node {node.id}"

    def describe(self) -> dict[str, object]:
        return {"alpha": self.alpha, "tracked": sorted(self._last)}
