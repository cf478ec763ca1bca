"""``ours``: captures where hits come from; segmented-LRU eviction that keeps what proved useful.

Captures, per scheduled prefill step: the branch point (where the prompt left the KV already in
the tree: a prefix another request proved shared, hit from its second occurrence on), the last
block boundary of the step (a prefix seen once already hits partly), and in the last step the
re-send point (prompt length - 1: identical prompts match all but their last id); at finish, the
final state (multi-turn continuations hit it).

Eviction, each step O(log n) over lazy heaps, in segments evicted in this order:

0. superseded: a conversation's snapshots from earlier turns once a later turn went past them
   (its new final state serves every continuation), unless another session used them or they
   served hits;
1. probation: ends of one request's own text (re-send points, final states) that never served a
   hit, least recently donated first: one-shot traffic churns here;
2. prefix probation: prefix points (block boundaries, branch points) that never served a hit:
   likelier to be shared than one request's own end;
3. protected: snapshots that served a hit, least recently used first: shared system prompts,
   live conversations, re-sent prompts.

A global LRU lets a burst of one-shot snapshots drain the live conversations; here a burst only
cycles through probation.
"""

from __future__ import annotations

from ..tree import HybridRadixCache, TreeNode
from .base import Policy, RequestInfo
from .branch_flop import UtilityHeap

__all__ = ["Ours"]

SUPERSEDED, PROBATION, PREFIX_PROBATION, PROTECTED = 0, 1, 2, 3


class Ours(Policy):
    name = "ours"

    def __init__(self, block: int = 512) -> None:
        self.block = block
        self.heaps = tuple(UtilityHeap() for _ in range(4))
        self.segment: dict[int, int] = {}
        self.session_of: dict[int, str] = {}
        self.is_finish: set[int] = set()
        self.users: dict[int, set[str]] = {}
        self.donated_at: dict[int, float] = {}  # arrival time of the request that donated it

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        if decode:
            return []
        last = end // self.block * self.block
        out = {last} if last > start else set()
        if start < req.branch <= end and req.branch > req.hit:
            out.add(req.branch)
        if end == req.prompt_len and req.prompt_len > 1:
            out.add(req.prompt_len - 1)
        return sorted(d for d in out if start < d <= end)

    def donate_finish(self, req: RequestInfo) -> bool:
        return True

    def _place(self, node: TreeNode, segment: int, now: float) -> None:
        self.segment[node.id] = segment
        self.heaps[segment].push(node, now)

    def donated(self, node: TreeNode, req: RequestInfo, reason: str, now: float) -> None:
        self.donated_at[node.id] = req.ts
        self.session_of[node.id] = req.session
        self.users[node.id] = {req.session}
        if reason == "finish":
            self.is_finish.add(node.id)
            # This conversation went past its own earlier snapshots inside this prompt: a
            # continuation hits the new final state, so those are dead weight unless shared.
            anc = node.parent
            while anc is not None and anc.depth > 0:
                if (
                    anc.snapshot is not None
                    and anc.depth < req.prompt_len - 1
                    and self.session_of.get(anc.id) == req.session
                    and self.donated_at.get(anc.id, now) < req.ts  # an earlier turn's, not this one's
                    and len(self.users.get(anc.id, ())) <= 1
                    and self.segment.get(anc.id) != PROTECTED
                ):
                    self._place(anc, SUPERSEDED, now)
                anc = anc.parent
            self._place(node, PROBATION, now)
        elif node.depth == req.prompt_len - 1 and node.depth != req.branch:
            self._place(node, PROBATION, now)  # a re-send point: serves identical prompts only
        else:
            self._place(node, PREFIX_PROBATION, now)

    def touched(self, node: TreeNode, req: RequestInfo, now: float) -> None:
        self.users.setdefault(node.id, set()).add(req.session)
        self._place(node, PROTECTED, now)

    def evict_one(self, cache: HybridRadixCache, now: float) -> bool:
        for segment, heap in enumerate(self.heaps):
            while (node := heap.pop_evictable()) is not None:
                if self.segment.get(node.id) != segment:
                    continue  # moved to another segment since this entry was pushed
                cache.evict_snapshot(node)
                for d in (self.segment, self.session_of, self.users, self.donated_at):
                    d.pop(node.id, None)
                self.is_finish.discard(node.id)
                return True
        return cache.evict(snapshots=1).snapshots > 0
