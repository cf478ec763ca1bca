"""How far a policy is from what is possible on a trace: the unbounded ceiling, and a reference
policy that knows the future. Replay only: both read the whole trace in advance.

The ceiling (:func:`ceiling`) is the hit of a cache without any bound that holds the state at every
depth of everything ever computed: a request hits the longest prefix it shares with any earlier
prompt or answer (all of its ids but the last at most). No policy under a budget can beat it.

:class:`FutureKnowledge` is a practical bound under the budget. It places a snapshot exactly where a
later request's ceiling hit will end (on an earlier request that reaches that depth), keeps
a final state only when a later request will resume it, and evicts the snapshot whose next use is
farthest away weighed by its bytes (Belady's rule with sizes): never-used snapshots first, the
biggest of them first.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sortedcontainers import SortedList

from ..core.policy import DonationReason, Policy, RequestInfo
from ..core.tree import HybridRadixCache, TreeNode
from .traces import TraceRecord

__all__ = ["CeilingResult", "FutureKnowledge", "ceiling", "ceiling_hits"]


@dataclass(frozen=True)
class CeilingResult:
    """The unbounded cache's figures on one trace."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    requests_with_hit: int

    @property
    def token_hit_rate(self) -> float:
        """Prompt tokens an unbounded cache serves / all prompt tokens."""
        return self.hit_tokens / max(1, self.prompt_tokens)


def _ordered(trace: Sequence[TraceRecord]) -> list[TraceRecord]:
    return sorted(trace, key=lambda r: r.ts)  # the replay's order (a stable sort)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def ceiling_hits(trace: Sequence[TraceRecord]) -> list[tuple[int, int]]:
    """Per request of ``trace`` in replay order: (its ceiling hit, the index of an earlier request
    whose prompt + answer reaches that deep: the latest of its own session when one does, else one
    found among its lexicographic neighbours; -1 without a hit). O(total tokens log n).

    What request j leaves computed is its prompt and its answer but the last token (the last
    sampled token is never fed), so states at every depth of that sequence are available."""
    recs = _ordered(trace)
    seen: SortedList = SortedList()  # (ids as a tuple, index): lexicographic neighbours share most
    arrays: list[np.ndarray] = []
    out: list[tuple[int, int]] = []
    for k, r in enumerate(recs):
        prompt = np.asarray(r.input_tokens, dtype=np.int64)
        best, who = 0, -1
        if len(seen):
            pos = seen.bisect_left((tuple(r.input_tokens), -1))
            for i in (pos - 1, pos):
                if 0 <= i < len(seen):
                    j = seen[i][1]
                    n = _lcp(prompt, arrays[j])
                    if n > best or (n == best and n and j > who):
                        best, who = n, j
        best = min(best, max(0, prompt.size - 1))
        if best and who >= 0:
            who = _latest_reaching(recs, arrays, k, prompt, best, who)
        out.append((best, who if best else -1))
        seq = list(r.input_tokens) + list(r.output_tokens[:-1])
        arrays.append(np.asarray(seq, dtype=np.int64))
        seen.add((tuple(seq), k))
    return out


def _latest_reaching(
    recs: list[TraceRecord], arrays: list[np.ndarray], k: int, prompt: np.ndarray, depth: int, found: int
) -> int:
    """The latest request before ``k`` whose sequence shares ``depth`` ids with ``prompt`` (the one a
    snapshot for ``k`` is best taken on: it lives the shortest). Looks back over the session's own
    requests first, which is where it almost always is; else keeps ``found``."""
    session = recs[k].session_id
    for j in range(k - 1, found, -1):
        if recs[j].session_id == session and arrays[j].size >= depth and _lcp(prompt[:depth], arrays[j]) >= depth:
            return j
    return found


def ceiling(trace: Sequence[TraceRecord]) -> CeilingResult:
    """The unbounded cache's hit on ``trace`` (see the module docstring)."""
    hits = ceiling_hits(trace)
    recs = _ordered(trace)
    return CeilingResult(
        requests=len(recs),
        prompt_tokens=sum(len(r.input_tokens) for r in recs),
        hit_tokens=sum(h for h, _ in hits),
        requests_with_hit=sum(h > 0 for h, _ in hits),
    )


def _key(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(ids.astype(np.int64).tobytes(), digest_size=16).digest()


class FutureKnowledge(Policy):
    """The future-knowledge reference (see the module docstring). Replay only: made for one trace,
    and the replay must admit that trace's requests in timestamp order, one by one.

    :param trace: the trace the replay will run.
    """

    name = "future-knowledge"
    decode_captures = True

    def __init__(self, trace: Sequence[TraceRecord]) -> None:
        self._recs = _ordered(trace)
        self._seqs = [np.asarray(list(r.input_tokens) + list(r.output_tokens[:-1]), dtype=np.int64) for r in self._recs]
        # demand[j]: depths on request j's sequence that later requests will resume from
        self._demand: list[set[int]] = [set() for _ in self._recs]
        self._uses: dict[bytes, list[int]] = {}  # key of a depth's prefix -> indices of its consumers
        for k, (depth, j) in enumerate(ceiling_hits(self._recs)):
            if depth:
                self._demand[j].add(depth)
                self._uses.setdefault(_key(self._seqs[j][:depth]), []).append(k)
        self._k = -1  # the request admitted last: the one the replay is serving
        self._nodes: dict[int, tuple[TreeNode, list[int]]] = {}  # node id -> (node, its consumers)

    def admitted(self, req: RequestInfo) -> None:
        self._k += 1
        if self._k >= len(self._recs) or len(self._recs[self._k].input_tokens) != req.prompt_len:
            raise RuntimeError(
                "FutureKnowledge must replay the trace it was made for, in timestamp order "
                f"(request {self._k} has prompt length {req.prompt_len})"
            )

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        return sorted(d for d in self._demand[self._k] if start < d <= end)

    def donate_finish(self, req: RequestInfo) -> bool:
        return self._seqs[self._k].size in self._demand[self._k]

    def donated(self, node: TreeNode, req: RequestInfo, reason: DonationReason, now: float) -> None:
        uses = self._uses.get(_key(self._seqs[self._k][: node.depth]), [])
        self._nodes[node.id] = (node, uses)

    def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
        best: TreeNode | None = None
        best_score = -math.inf
        gone: list[int] = []
        for nid, (node, uses) in self._nodes.items():
            if not HybridRadixCache.holds_snapshot(node):
                gone.append(nid)
                continue
            if not HybridRadixCache.is_evictable(node) or (kv and not node.is_leaf):
                continue
            i = bisect.bisect_right(uses, self._k)  # consumers not admitted yet
            size = self.freed_bytes(node, demote=not kv)
            # never used again: first, the biggest first; else (time to next use) x bytes
            score = math.inf if i == len(uses) else max(self._recs[uses[i]].ts - now, 1e-9) * size
            if (
                best is None
                or score > best_score
                or (score == best_score == math.inf and size > self.freed_bytes(best, demote=not kv))
            ):
                best, best_score = node, score
        for nid in gone:
            del self._nodes[nid]
        return best

    def describe(self) -> dict[str, object]:
        return {"admitted": self._k + 1, "tracked": len(self._nodes)}
