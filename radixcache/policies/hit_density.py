"""``hit-density``: captures where hits come from; evicts the snapshot with the lowest *hit density*.

Captures, per scheduled prefill step: the last block boundary of the step (a prefix seen once
already hits partly), the branch point (where the prompt left the KV already in the tree: a
prefix another request proved shared) and, in the last step, the re-send point (prompt length - 1:
identical prompts match all but their last id); at finish, the final state (a conversation's next
turn continues it). A kind of capture whose measured reuse rate is below ``min_rate`` is skipped;
for block and branch captures, whose rate is measured on what the cache kept, one in ``explore``
is still taken so the rate keeps being measured.

Eviction ranks each snapshot by its hit density: the prefill tokens it is expected to save, per
byte it holds, per second it will hold them (the idea of LHD, Beckmann et al., NSDI 2018, in tokens
and bytes)::

    density = q * gain / (bytes * wait)

- ``gain``: tokens a hit saves over the next snapshot up the path that would still serve it (an
  ancestor from another conversation, or one several conversations used); when there is none, the
  request would miss altogether without this snapshot, and the gain is its depth plus
  ``hit_bonus`` (1,000 tokens by default). Without it a short prompt's snapshot, which saves few
  tokens but costs as many bytes as a long one, always goes first, and a tenant of short prompts
  loses nearly every request while the token hit rate looks fine (the ``mixed`` trace: 16 of 800
  short requests hit at 2 GiB with no bonus, 428 with it; the token hit rate rises too, 27.0% to
  29.0%);
- ``bytes``: the snapshot plus, for a leaf, the KV that goes with it (:meth:`Policy.freed_bytes`);
- ``q`` and ``wait``: the chance it is used again and the expected time until then. For a final
  state these come from the conversations' *think time* (the gaps between a session's requests,
  measured on every request whether it hit or not): a conversation just answered waits a whole
  think time, one idle for a while is due soon, one idle beyond every observed gap is over. The
  chance that it comes back at all is measured per request count: of the sessions seen after
  their k-th request, the share that made another within every observed think time (sessions of
  10 to 14 turns: all go on after their ninth, none after their fourteenth). Without it, a
  conversation that has ended looks ever more due until its longest think time has passed.
  For other kinds, ``q`` is the kind's measured reuse rate and ``wait`` the mean gap between the
  snapshot's own uses so far (the kind's mean reuse gap standing in for the first), plus the time
  it has been idle (older is colder): a prefix every conversation hits waits seconds, however
  many tokens deeper snapshots would save. A hit counts as a use of the snapshot that served it and
  of its anchors (below): those would have served the request had it gone.

Before any of that, a conversation's snapshots from earlier turns go as soon as a later turn went
past them (superseded), unless another conversation used them (a branch point counts as used by
another: the prompt left another sequence's KV there). Sessions that come back to where
they were (a request no longer than the session's last: parallel tool calls, a dead end left, a
re-send) keep the ends of earlier prompts and what already served a hit, once such requests are
at least ``min_rate`` of a session's requests.

Why not LRU: with many live conversations and a budget that holds only some, LRU evicts each one
just before its next turn (the least recently used is the one about to come back) and hits almost
nothing; ranking by think time keeps a stable set of conversations whole. Reuse rates of final
states and re-send points are measured on the request stream (how often a session comes back, how
often a prompt repeats), never on what the cache kept, so an early eviction cannot teach the
policy that a kind is useless.

Without session ids from the host (``session=None``) nothing says when a conversation comes back:
final states are then kept by default and ranked like any other kind.

Cost per eviction: exact over every tracked snapshot up to ``exact_below`` of them. Past that, in
batches: ``sample x b`` snapshots are drawn at random (seeded; a repeat counts once), where ``b`` is
``batch``, or one in 1,024 of the tracked snapshots if that is fewer (at least 1), and scored at
once, vectorised, from a row of numbers per snapshot: its kind, times and hits (kept current by
every event) and the gain and bytes of its path (refreshed when the policy sees the path change: a
snapshot donated above or below it, a split beside it, an ancestor that starts or stops to anchor
it, an eviction next to it, the policy's own or one the tree reports as an event; see
:meth:`HybridRadixCache.cost_dependents` and :class:`~radixcache.policies.rows.RowTable`). The ``b``
lowest are queued.
Each eviction takes the next queued snapshot that is still evictable. Within the burst the batch
was drawn in (the same ``now``, no request admitted, no snapshot donated or touched since) with its
row as drawn, its estimate is its density, and it goes (the reuse rates move by the burst's own
evictions, about 0.1% each: the estimate ignores that). Otherwise it is scored again from its row
at the current time (what the events since changed is in the row): it goes if that is no higher
than the batch's highest estimate, else the next is tried. Three batches in a row with nothing
evictable (every drawn snapshot locked) fall back to the exact scan. That reaches the quantile
``sample`` draws per eviction reach, at a constant cost per eviction whatever the tree's size. A
pool of runners-up kept between evictions without a re-score (Redis's way) was faster and worse,
its stale scores outranking fresh ones (docs/policies.md has the figures).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from ..core.events import TreeEvent, TreeEventKind
from ..core.policy import DonationReason, Policy, RequestInfo
from ..core.tree import TreeNode
from .rows import RowTable

__all__ = ["HitDensity"]

FINISH, RESEND, BLOCK, BRANCH, HIT = "finish", "resend", "block", "branch", "hit"
_DECAY = 0.999  # counts fade with a half-life of ~700 events: a policy for a changing workload
_MIN_THINK_SAMPLES = 8
_MIN_SESSIONS = 8  # sessions seen at a request count before their share that went on is used
_REMEMBER = 1 << 16  # sessions and prompt digests remembered
_REDRAWS = 3  # batches drawn per eviction before the exact scan
_SHARED = "<shared>"  # a user standing for "another sequence", for branch points
_KINDS = (FINISH, RESEND, BLOCK, BRANCH, HIT)
_CODE = {k: i for i, k in enumerate(_KINDS)}
# Columns of a tracked snapshot's row (what the batched estimate reads): times and hits as its last
# event left them, its kind's code, and its path's gain and bytes (kept, dropped) then.
_LAST, _BORN, _HITS, _KIND, _GAIN, _KEEP, _DROP, _LEAF, _TURN = range(9)


def _gone(node: TreeNode) -> bool:
    """The node left the tree or lost its snapshot (a cascade, a reset, the tree's own eviction)."""
    return node.parent is None or node.snapshot is None


@dataclass(slots=True)
class _Entry:
    node: TreeNode
    kind: str
    last: float  # donation or last hit
    session: Hashable | None
    ts: float  # arrival of the donating request
    users: set[Hashable | None] = field(default_factory=set)
    born: float = 0.0  # donation, or first sight
    hits: int = 0
    turn: int = 0  # a final state: the requests its session had made by then


class _Decayed:
    """A decayed sum of samples and their count: a mean of values, or (with 0/1 samples) a
    success fraction with a uniform prior."""

    __slots__ = ("n", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self.n = 0.0

    def add(self, x: float) -> None:
        self.total = self.total * _DECAY + x
        self.n = self.n * _DECAY + 1.0

    def mean(self, default: float) -> float:
        """The mean of the samples; ``default`` before the first."""
        return self.total / self.n if self.n else default

    @property
    def rate(self) -> float:
        """(successes + 1) / (samples + 2)."""
        return (self.total + 1.0) / (self.n + 2.0)


class _Gaps:
    """The last ``window`` think times; survival and mean residual wait at an age, O(log window)."""

    def __init__(self, window: int = 1024) -> None:
        self.window = window
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        self._suffix: list[float] | None = None  # suffix sums of _sorted, rebuilt lazily

    def __len__(self) -> int:
        return len(self._fifo)

    def tails(self, ages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`tail` of each of ``ages`` at once."""
        n = len(self._sorted)
        i = np.searchsorted(np.asarray(self._sorted), ages, side="right")
        left = n - i
        suffix = np.asarray([*self._suffix_sums(), 0.0])[i]
        alive = left / n
        wait = np.where(left > 0, suffix / np.maximum(left, 1) - ages, 0.0)
        return alive, wait

    def add(self, gap: float) -> None:
        self._fifo.append(gap)
        bisect.insort(self._sorted, gap)
        if len(self._fifo) > self.window:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._suffix = None

    def longest(self) -> float:
        """The longest gap in the window (0 when empty)."""
        return self._sorted[-1] if self._sorted else 0.0

    def check_invariants(self) -> None:
        assert len(self._fifo) == len(self._sorted) <= self.window, "think-time window out of step"
        assert self._sorted == sorted(self._fifo), "think-time order lost"

    def tail(self, age: float) -> tuple[float, float]:
        """``(P(gap > age), E[gap - age | gap > age])``; ``(0, 0)`` beyond every observed gap."""
        n = len(self._sorted)
        i = bisect.bisect_right(self._sorted, age)
        if i >= n:
            return 0.0, 0.0
        return (n - i) / n, self._suffix_sums()[i] / (n - i) - age

    def _suffix_sums(self) -> list[float]:
        """Sums of the sorted gaps from each position to the end (rebuilt after an add)."""
        if self._suffix is None:
            self._suffix = [*accumulate(reversed(self._sorted))][::-1]
        return self._suffix


class HitDensity(Policy):
    """:param block: block size of the boundary captures; :param min_rate: captures of a kind reused
    less often than this are skipped (but one in ``explore`` is taken); :param hit_bonus: tokens a
    hit is worth beyond those it saves when no other snapshot on its path would serve the request
    (the request would miss altogether); 0 ranks by tokens alone; :param sample: candidates
    drawn per eviction once more than ``exact_below`` snapshots are tracked; :param batch: the
    most evictions served from one draw (fewer in trees of under ``1024 x batch`` snapshots);
    :param seed: of the draw.

    :raises ValueError: a non-positive ``block``, ``explore``, ``sample`` or ``batch``, ``min_rate``
        outside ``[0, 1)``, or a negative ``hit_bonus``.
    """

    name = "hit-density"
    decode_captures = False
    batch_share = 1024  # a batch serves at most one in this many tracked snapshots' evictions

    def __init__(
        self,
        block: int = 512,
        *,
        min_rate: float = 0.05,
        explore: int = 16,
        hit_bonus: float = 1000.0,
        sample: int = 32,
        batch: int = 64,
        exact_below: int = 256,
        seed: int = 0,
    ) -> None:
        if block <= 0 or explore <= 0 or sample <= 0 or batch <= 0 or not 0.0 <= min_rate < 1.0 or not hit_bonus >= 0.0:
            raise ValueError(
                "need block > 0, explore > 0, sample > 0, batch > 0, 0 <= min_rate < 1, hit_bonus >= 0; got "
                f"block={block}, explore={explore}, sample={sample}, batch={batch}, min_rate={min_rate}, "
                f"hit_bonus={hit_bonus}"
            )
        self.hit_bonus = float(hit_bonus)
        self.block, self.min_rate, self.explore = block, min_rate, explore
        self.sample, self.batch, self.exact_below = sample, batch, exact_below
        self._draw = np.random.default_rng(seed)
        self._entries: dict[int, _Entry] = {}
        self._t = RowTable(9)  # row i: what the batched estimate knows of the i-th tracked snapshot
        self._queue: deque[int] = deque()  # a batch's lowest, lowest first (node ids)
        self._queue_leaf = False  # the batch was drawn for KV pressure (leaves only)
        self._queue_bound = 0.0  # the batch's highest estimate
        self._queue_at = (-1, 0.0)  # (events seen, now) when the batch was drawn
        self._rewritten: set[int] = set()  # ids whose row changed since the batch was drawn
        self._stale: dict[int, None] = {}  # tracked ids whose row's costs are not computed yet
        self._events = 0  # requests admitted, snapshots donated and touched: what moves densities
        self._evicted: TreeNode | None = None  # the last victim (inner) or where its cascade stops
        self._unanchored: list[TreeNode] = []  # tracked snapshots the tree let go unchosen, nodes kept
        self._superseded: dict[int, None] = {}  # tracked ids, oldest first
        self._outcome = {k: _Decayed() for k in (BLOCK, BRANCH, HIT)}  # measured on what the cache kept
        self._continued = _Decayed()  # requests whose session came before: reuse of final states
        self._repeated = _Decayed()  # requests whose prompt came before: reuse of re-send points
        self._gap = {k: _Decayed() for k in (BLOCK, BRANCH, HIT, RESEND, FINISH)}
        self._think = _Gaps()
        self._sessions: OrderedDict[Hashable, tuple[float, int, int]] = OrderedDict()  # last (arrival, prompt), turns
        # A session's k-th request waits here until every observed think time has passed since it:
        # by then the session either made another request (it went on after k) or is taken to have
        # ended at k. _goes_on[k]: the faded fraction that went on.
        self._pending: deque[tuple[float, Hashable, int]] = deque()  # (arrival, session, k)
        self._goes_on: list[_Decayed] = [_Decayed()]
        self._revisited = _Decayed()  # a session's request no longer than its last: it branched or went back
        self._digests: OrderedDict[int, None] = OrderedDict()
        self._skipped = dict.fromkeys((FINISH, RESEND, BLOCK, BRANCH), 0)

    # -- what the request stream says -------------------------------------------------------------

    def admitted(self, req: RequestInfo) -> None:
        self._events += 1
        if req.session is not None:
            self._see_session(req.session, req.ts, req.prompt_len)
        if req.prompt_digest is not None:
            seen = req.prompt_digest in self._digests
            self._repeated.add(seen)
            self._digests[req.prompt_digest] = None
            self._digests.move_to_end(req.prompt_digest)
            if len(self._digests) > _REMEMBER:
                self._digests.popitem(last=False)

    def _see_session(self, session: Hashable, ts: float, prompt_len: int) -> None:
        last = self._sessions.pop(session, None)
        self._continued.add(last is not None)
        turns = 1
        if last is not None:
            self._think.add(max(0.0, ts - last[0]))
            self._revisited.add(prompt_len <= last[1])
            turns = last[2] + 1
        self._sessions[session] = (ts, prompt_len, turns)
        if len(self._sessions) > _REMEMBER:
            self._sessions.popitem(last=False)
        self._pending.append((ts, session, turns))
        self._settle(ts)

    def _settle(self, now: float) -> None:
        """Count the requests older than every observed think time by whether their session went
        on after them (a request of each session's is settled in order)."""
        if len(self._think) < _MIN_THINK_SAMPLES:
            return
        horizon = self._think.longest()
        while self._pending and (now - self._pending[0][0] > horizon or len(self._pending) > _REMEMBER):
            _, session, k = self._pending.popleft()
            seen = self._sessions.get(session)
            while k >= len(self._goes_on):
                self._goes_on.append(_Decayed())
            self._goes_on[k].add(seen is not None and seen[2] > k)

    def continuation(self, turns: int) -> float | None:
        """Measured chance that a session which has made ``turns`` requests makes another: the
        share of sessions seen at that count that went on within every observed think time
        (counts fade like the reuse rates); ``None`` until 8 sessions were seen at that count.

        :raises TypeError: ``turns`` not an int. :raises ValueError: ``turns`` negative."""
        if isinstance(turns, bool) or not isinstance(turns, int):
            raise TypeError(f"turns must be an int (a count of requests), got {turns!r}")
        if turns < 0:
            raise ValueError(f"turns must be >= 0, got {turns}")
        if not 0 < turns < len(self._goes_on):
            return None
        d = self._goes_on[turns]
        return d.mean(0.0) if d.n >= _MIN_SESSIONS * _DECAY**_MIN_SESSIONS else None  # n is a faded count

    def rate(self, kind: str) -> float:
        """Measured reuse rate of a kind of snapshot (``finish``, ``resend``, ``block``, ``branch``,
        ``hit``: one that served a hit already)."""
        if kind == FINISH:
            return self._continued.rate
        if kind == RESEND:
            return self._repeated.rate
        return self._outcome[kind].rate

    # -- captures ---------------------------------------------------------------------------------

    def _want(self, kind: str) -> bool:
        if self.rate(kind) >= self.min_rate:
            return True
        self._skipped[kind] += 1
        # Final states and re-send points have their rates from the request stream: no need to
        # spend memory finding out. Block and branch captures learn only from what was kept.
        return kind in (BLOCK, BRANCH) and self._skipped[kind] % self.explore == 0

    @staticmethod
    def _kind(req: RequestInfo, depth: int) -> str:
        if depth == req.token_length:
            return BRANCH
        return RESEND if depth == req.prompt_len - 1 else BLOCK

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        if decode:
            return []
        out = set()
        last = end // self.block * self.block
        if last > start:
            out.add(last)
        if req.cached_length < req.token_length < req.prompt_len - 1 and start < req.token_length <= end:
            out.add(req.token_length)  # where the prompt leaves the tree (a whole-prompt match has none)
        if end == req.prompt_len and req.prompt_len > 1:
            out.add(req.prompt_len - 1)
        return sorted(d for d in out if start < d <= end and self._want(self._kind(req, d)))

    def donate_finish(self, req: RequestInfo) -> bool:
        return self._want(FINISH)

    # -- what the tree holds ----------------------------------------------------------------------

    def _track(self, e: _Entry) -> None:
        """Track ``e``: its row (recency, hits, kind, turn, and the costs: gain, bytes freed, leaf)
        is written from the entry before the next choice reads it (:meth:`_refresh_due`). NOTE:
        the costs walk the tree (the eviction cascade, the anchors): at every donation and hit
        that was ~10 us inside SGLang's scheduler, for rows most of which no choice reads before
        they change again; the entry's own numbers went into the row here too until session 35
        (~2 us per donation and hit there), and the refresh wrote them again."""
        node = e.node
        self._entries[node.id] = e
        self._t.add(node)
        self._rewritten.add(node.id)
        self._stale[node.id] = None

    def _refresh(self, pos: int, e: _Entry) -> None:
        """Row ``pos`` from entry ``e`` and its path as they are now."""
        node = e.node
        if self.cache.holds_snapshot(node):
            drop = self.freed_bytes(node, demote=False)
            # a leaf's slot alone when the host tier would take it; without room there (or no
            # tier, SGLang's default) the same cascade as ``drop``: not walked twice
            keep = self.freed_bytes(node, demote=True) if drop > self.snapshot_bytes and self.cache.demotes else drop
        else:  # a hit served from the host tier: not a device snapshot to evict (yet)
            drop = keep = self.snapshot_bytes
        leaf = not node.children
        self._t.rows[pos] = (e.last, e.born, e.hits, _CODE[e.kind], self._gain(e), keep, drop, leaf, e.turn)
        self._rewritten.add(node.id)

    def _untrack(self, nid: int) -> None:
        self._stale.pop(nid, None)
        self._entries.pop(nid, None)
        self._superseded.pop(nid, None)
        self._t.remove(nid)

    def tree_event(self, event: TreeEvent) -> None:
        """A tracked snapshot the tree let go unchosen leaves the rows now; the costs it changed are
        refreshed at the next :meth:`victim`."""
        nid = self._t.hear(event)
        if nid is not None:
            self._untrack(nid)  # its row is gone already: the entry and the superseded mark go too
            if event.kind is not TreeEventKind.NODE_REMOVED:
                self._unanchored.append(event.node)

    def donated(self, node: TreeNode, req: RequestInfo, reason: DonationReason, now: float) -> None:
        self._events += 1
        finish = reason is DonationReason.FINISH
        kind = FINISH if finish else self._kind(req, node.depth)
        self._superseded.pop(node.id, None)
        # A branch point is shared by construction: another sequence's KV goes on past it.
        users: set[Hashable | None] = {req.session, _SHARED} if kind == BRANCH else {req.session}
        turn = 0
        if finish and req.session is not None:
            seen = self._sessions.get(req.session)
            turn = seen[2] if seen is not None else 0
        self._track(_Entry(node, kind, now, req.session, req.ts, users, born=now, turn=turn))
        if node.children:
            self._reanchor(node)  # a new snapshot above others: it may anchor them
        # A leaf no more, or a shorter cascade: their rows are refreshed before the next choice
        # (victim, estimates) reads them. NOTE: not here: two of every three row refreshes were
        # these, and a burst of donations between two evictions refreshes each row once.
        self._t.mark(self.cache.cost_dependents(node))
        if not finish or req.session is None:
            return
        # This conversation went past its own earlier snapshots: its next turn continues the new
        # final state, so those are dead weight unless another conversation used them. When
        # sessions come back to where they were (tool-calling agents: parallel calls, dead ends;
        # re-sends), the ends of earlier prompts and what already served a hit are kept.
        revisits = self._revisited.rate >= self.min_rate
        for anc in self.cache.snapshot_ancestors(node):
            e = self._entries.get(anc.id)
            mine = e is not None and e.session == req.session and e.ts < req.ts and len(e.users) <= 1
            if mine and not (revisits and e is not None and e.kind in (RESEND, HIT)):
                self._superseded[anc.id] = None

    def touched(self, node: TreeNode, req: RequestInfo, now: float) -> None:
        self._events += 1
        e = self._entries.get(node.id)
        if e is None or e.node is not node:
            e = _Entry(node, HIT, now, req.session, req.ts, born=now)
            users = -1
        else:
            users = len(e.users)
            if e.kind in self._outcome:
                self._outcome[e.kind].add(True)
            self._gap[e.kind].add(now - e.last)
            e.hits += 1
        e.kind, e.last = HIT, now
        e.users.add(req.session)
        superseded = self._superseded.pop(node.id, 0) is None
        self._track(e)
        if node.children and (superseded or len(e.users) != users):
            self._reanchor(node)  # it may anchor more of the snapshots below it now
        # The snapshots above it on the path that would serve the request if it went (its anchors:
        # another conversation's, or shared) were used too: a shared prefix that new
        # conversations reach rarely stays while the conversations below it live.
        for anc in self.cache.snapshot_ancestors(node):
            a = self._entries.get(anc.id)
            if a is not None and anc.id not in self._superseded and (len(a.users) > 1 or a.session != req.session):
                a.last, a.hits = max(a.last, now), a.hits + 1
                row = self._t.rows[self._t.pos[anc.id]]
                row[_LAST], row[_HITS] = a.last, a.hits

    # -- eviction ---------------------------------------------------------------------------------

    def _anchors_all(self, node: TreeNode) -> bool:
        """``node``'s snapshot would serve a hit on any path below it, whoever's (see
        :meth:`_anchor_depth`)."""
        if node.snapshot is None or node.id in self._superseded:
            return False
        a = self._entries.get(node.id)
        return a is None or a.node is not node or a.session is None or len(a.users) > 1

    def _reanchor(self, top: TreeNode) -> None:
        """Refresh the gain in the rows of the tracked snapshots below ``top`` that it may anchor
        now (each branch down to its first snapshot that anchors everything below it)."""
        for n in self.cache.snapshots_below(top, through=lambda n: not self._anchors_all(n)):
            e = self._entries.get(n.id)
            if e is not None and e.node is n:
                self._t.rows[self._t.pos[n.id], _GAIN] = self._gain(e)
                self._rewritten.add(n.id)

    def _refresh_due(self, first: TreeNode | None = None) -> None:
        """Refresh the rows whose costs changed since the last choice (:meth:`RowTable.due`) and
        the rows tracked or touched since (their own costs)."""
        for n in self._t.due(first):
            self._reshape(n)
        if self._stale:
            entries, pos = self._entries, self._t.pos
            for nid in self._stale:
                e = entries.get(nid)
                if e is not None:
                    self._refresh(pos[nid], e)
            self._stale.clear()

    def _reshape(self, top: TreeNode) -> None:
        """Refresh the row of the snapshot whose freed bytes a change below ``top`` may have
        moved (:meth:`HybridRadixCache.cost_dependent`)."""
        n = self.cache.cost_dependent(top)
        e = None if n is None else self._entries.get(n.id)
        if e is not None and e.node is n:
            self._refresh(self._t.pos[n.id], e)

    def _anchor_depth(self, e: _Entry) -> int:
        """Depth of the nearest ancestor snapshot that would still serve a hit on ``e``'s path."""
        for anc in self.cache.snapshot_ancestors(e.node):
            if anc.id not in self._superseded:
                a = self._entries.get(anc.id)
                if a is None or a.session is None or a.session != e.session or len(a.users) > 1:
                    return anc.depth
        return 0

    def _mean_gap(self, kind: str) -> float:
        g = self._gap[kind]
        if g.n:
            return g.mean(1.0)
        total = sum(x.total for x in self._gap.values())
        n = sum(x.n for x in self._gap.values())
        return total / n if n else 1.0

    def density(self, node: TreeNode, now: float, *, demote: bool = True) -> float:
        """Expected prefill tokens saved per byte per second by keeping ``node``'s snapshot (lower
        goes first; superseded ones are -1); ``demote``: as :meth:`freed_bytes`.
        :raises KeyError: the node is not tracked."""
        if node.id in self._superseded:
            return -1.0
        e = self._entries[node.id]
        q, wait = self._odds(e, now)
        if q == 0.0:
            return 0.0
        return q * self._gain(e) / (self.freed_bytes(node, demote=demote) * max(wait, 1e-3))

    def _row_density(self, e: _Entry, now: float, leaf: bool) -> float:
        """:meth:`density` with the gain and bytes of ``e``'s row (as its path was when last seen)."""
        if e.node.id in self._superseded:
            return -1.0
        q, wait = self._odds(e, now)
        if q == 0.0:
            return 0.0
        row = self._t.rows[self._t.pos[e.node.id]]
        return q * float(row[_GAIN]) / (float(row[_DROP if leaf else _KEEP]) * max(wait, 1e-3))

    def _odds(self, e: _Entry, now: float) -> tuple[float, float]:
        """``(q, wait)`` of :meth:`density`: the chance ``e``'s snapshot is used again and the
        expected time until then; ``(0, 0)``: its conversation is over."""
        r = self.rate(e.kind)
        age = max(0.0, now - e.last)
        if e.kind == FINISH and len(self._think) >= _MIN_THINK_SAMPLES:
            # requests are settled only once think times are known: before, there is no count
            c = self.continuation(e.turn) if e.turn else None
            r = r if c is None else c
            alive, wait = self._think.tail(age)
            if alive <= 0.0:
                return 0.0, 0.0  # idle beyond every observed think time
            return r * alive / (r * alive + (1.0 - r)), wait
        # the mean gap between this snapshot's uses so far (the kind's mean gap as the prior),
        # plus the time since the last: a prefix every conversation hits waits seconds
        return r, (self._mean_gap(e.kind) + e.last - e.born) / (e.hits + 1) + age

    def _gain(self, e: _Entry) -> float:
        """Tokens a hit on ``e`` saves over its anchor (no anchor: its depth plus the hit bonus)."""
        anchor = self._anchor_depth(e)
        return e.node.depth - anchor + (self.hit_bonus if anchor == 0 else 0.0)

    def estimates(self, rows: np.ndarray, now: float, *, leaf: bool = False) -> np.ndarray:
        """:meth:`density` of the tracked snapshots at positions ``rows``, all at once, from what
        their last event left in their rows (a path changed since is not seen; superseded ones
        are not told apart); ``leaf``: for KV pressure (non-leaves get infinity)."""
        self._refresh_due()  # the rows whose costs a donation changed (see donated)
        r = self._t.rows[rows]
        last, born, hits, gain = r[:, _LAST], r[:, _BORN], r[:, _HITS], r[:, _GAIN]
        kind = r[:, _KIND].astype(np.intp)
        rates = np.array([self.rate(k) for k in _KINDS])[kind]
        gaps = np.array([self._mean_gap(k) for k in _KINDS])[kind]
        age = np.maximum(now - last, 0.0)
        q = rates
        wait = (gaps + last - born) / (hits + 1.0) + age
        fin = kind == _CODE[FINISH]
        if len(self._think) >= _MIN_THINK_SAMPLES and fin.any():
            alive, w = self._think.tails(age[fin])
            rf = rates[fin]
            turns = r[fin, _TURN].astype(np.intp)
            for t in np.unique(turns[turns > 0]).tolist():
                c = self.continuation(t)
                if c is not None:
                    rf[turns == t] = c
            q = q.copy()
            # idle beyond every observed think time (alive 0): over, as _odds says (q 0); not 0/0
            # where every such conversation went on (rf 1), a NaN estimate no batch would choose
            live = alive > 0.0
            q[fin] = np.where(live, rf * alive / np.where(live, rf * alive + (1.0 - rf), 1.0), 0.0)
            wait[fin] = w
        dens: np.ndarray = q * gain / ((r[:, _DROP] if leaf else r[:, _KEEP]) * np.maximum(wait, 1e-3))
        if leaf:
            dens[r[:, _LEAF] == 0] = np.inf
        return dens

    def _victim(self, now: float, leaf: bool) -> TreeNode | None:
        dead: list[int] = []
        first: TreeNode | None = None
        for nid in self._superseded:
            old = self._entries[nid].node
            if _gone(old):
                dead.append(nid)
            elif self.cache.is_evictable(old) and (old.is_leaf or not leaf):
                first = old
                break
        for nid in dead:
            self._untrack(nid)
        if first is not None:
            return first
        if len(self._t) <= self.exact_below:
            self._queue.clear()
            return self._lowest(self._tracked(), now, leaf)
        return self._batched(now, leaf)

    def _draw_batch(self, now: float, leaf: bool, skip: list[int]) -> None:
        """Queue the lowest estimates of ``sample x b`` tracked snapshots drawn at random (a repeat
        counted once; all of them when there are no more), leaving out the node ids ``skip``."""
        n = len(self._t)
        b = max(1, min(self.batch, n // self.batch_share))
        k = self.sample * b
        if n <= k:
            rows = np.arange(n)
        else:
            rows = np.sort(self._draw.integers(0, n, size=k))
            rows = rows[np.concatenate(([True], rows[1:] != rows[:-1]))]  # a repeat counted once
        dens = self.estimates(rows, now, leaf=leaf)
        keep = np.isfinite(dens)
        if skip:
            pos = self._t.pos
            keep &= ~np.isin(rows, [pos[i] for i in skip if i in pos])
        rows, dens = rows[keep], dens[keep]
        m = min(b, len(rows))
        if m < len(rows):
            low = np.argpartition(dens, m - 1)[:m]
            rows, dens = rows[low], dens[low]
        order = np.lexsort((self._t.rows[rows, _LAST], dens))  # lowest density, then least recently used
        nodes = self._t.nodes
        self._queue = deque(nodes[i].id for i in rows[order].tolist())
        self._queue_leaf = leaf
        self._queue_bound = float(dens[order[-1]]) if m else 0.0
        self._queue_at = (self._events, now)
        self._rewritten.clear()

    def _batched(self, now: float, leaf: bool) -> TreeNode | None:
        """The next queued snapshot that may go (see the module's notes): a new batch when the
        queue runs out, without the snapshots found locked (or inner, for KV pressure); after
        ``_REDRAWS`` batches with none, the exact scan."""
        if self._queue_leaf != leaf:
            self._queue.clear()
        draws = 0
        skip: list[int] = []
        while True:
            if not self._queue:
                if draws == _REDRAWS:
                    return self._lowest(self._tracked(), now, leaf)
                self._draw_batch(now, leaf, skip)
                draws += 1
                continue
            nid = self._queue.popleft()
            e = self._entries.get(nid)
            if e is None:
                continue
            node = e.node
            if node.parent is None or node.snapshot is None:
                self._untrack(nid)
                continue
            if node.snap_lock or (leaf and node.children):
                skip.append(nid)
                continue
            if self._queue_at == (self._events, now) and nid not in self._rewritten:
                return node  # the burst its batch was drawn in, its row as drawn: the estimate stands
            if self._row_density(e, now, leaf) <= self._queue_bound:
                return node

    def _tracked(self) -> list[int]:
        return [n.id for n in self._t.nodes]

    def _lowest(self, nids: list[int], now: float, leaf: bool) -> TreeNode | None:
        """The evictable node of lowest density among the tracked ``nids`` (a leaf when ``leaf``;
        ties: least recently used, then the first given); nodes found gone are untracked."""
        entries, density = self._entries, self.density
        best: TreeNode | None = None
        best_key = (0.0, 0.0)
        for nid in nids:
            e = entries.get(nid)
            if e is None:
                continue
            node = e.node
            if node.parent is None or node.snapshot is None:
                self._untrack(nid)
            elif not node.snap_lock and not (leaf and node.children):
                key = (density(node, now, demote=not leaf), e.last)  # a KV-pressure leaf is dropped
                if best is None or key < best_key:
                    best, best_key = node, key
        return best

    def check_invariants(self) -> None:
        """Raise AssertionError unless the tracked ids, their positions, the entries, the superseded
        set and the think-time window agree."""
        self._t.check_invariants()
        assert self._entries.keys() == self._t.pos.keys(), "entries and tracked ids differ"
        for nid, e in self._entries.items():
            assert e.node.id == nid, f"entry {nid} holds node {e.node.id}"
        for i, node in enumerate(self._t.nodes):
            nid = node.id
            e = self._entries[nid]
            assert e.node is node, f"row {i} holds another node than entry {nid}"
            if nid in self._stale:
                continue  # written from the entry before the next choice reads it (_refresh_due)
            row = self._t.rows[i]
            assert (row[_LAST], row[_BORN], row[_HITS], row[_KIND], row[_TURN]) == (
                e.last,
                e.born,
                e.hits,
                _CODE[e.kind],
                e.turn,
            ), f"row {i} of node {nid} out of step with its entry"
        stray = [nid for nid in self._superseded if nid not in self._entries]
        assert not stray, f"superseded but not tracked: {stray}"
        stray = [nid for nid in self._stale if nid not in self._entries]
        assert not stray, f"costs pending but not tracked: {stray}"
        self._think.check_invariants()
        for k, d in enumerate(self._goes_on):
            assert 0.0 <= d.total <= d.n + 1e-9, f"sessions going on after request {k}: {d.total} of {d.n}"
        assert len(self._pending) <= _REMEMBER + 1, f"{len(self._pending)} requests waiting to be settled"

    def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
        """The tracked snapshot of lowest hit density (superseded turns first); ``None`` when
        nothing tracked is evictable. The eviction is counted against its kind's reuse rate."""
        self._refresh_due(self._evicted)  # the last victim's, then what the tree let go unchosen
        self._evicted = None
        for n in self._unanchored:
            if n.parent is not None and n.snapshot is None:
                self._reanchor(n)  # a tracked inner snapshot went: the rows it anchored anchor higher
        self._unanchored.clear()
        node = self._victim(now, kv)
        if node is None:
            return None
        # The manager evicts it now: what that leaves is looked at before the next choice.
        self._evicted = node if node.children else self.cache.cascade_stop(node)
        e = self._entries[node.id]
        if e.kind in self._outcome and node.id not in self._superseded:
            self._outcome[e.kind].add(False)
        self._untrack(node.id)
        return node
