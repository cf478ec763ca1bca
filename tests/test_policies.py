import importlib.util
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from linear_state import LinearStatePool, RequestOwner, StateLayout
from radixcache import HybridRadixCache
from radixcache.cli import main
from radixcache.core.events import TreeEvent
from radixcache.core.tree import TreeNode
from radixcache.policies import (
    ALPHA_GRID,
    POLICIES,
    AlignLastBlock,
    DonationReason,
    FixedPoints,
    FlopEfficiency,
    HitDensity,
    Policy,
    RequestInfo,
    SglangLike,
    TrackAndFinish,
    VllmLike,
    make_policy,
)
from radixcache.simulator import (
    PRESETS,
    REFERENCE,
    FutureKnowledge,
    TraceRecord,
    bootstrap_window,
    bounds_table,
    ceiling,
    ceiling_hits,
    edge_case_table,
    generate,
    markdown_table,
    read_trace,
    replay,
    report_markdown,
    run_grid,
    run_report,
    summary_table,
    tenants_table,
    tune_alpha,
    write_trace,
)

P = TypeVar("P", bound=Policy)

FINISH, CAPTURE = DonationReason.FINISH, DonationReason.CAPTURE
ROOT = Path(__file__).resolve().parent.parent

Q = PRESETS["qwen3-next-80b"]
GiB = 1 << 30


def test_traces_are_seeded_and_shaped() -> None:
    assert generate("edge", 3) == generate("edge", 3)
    assert generate("edge", 3) != generate("edge", 4)
    chat = generate("chat")
    sessions = {r.session_id for r in chat}
    assert len(sessions) == 100
    assert all(sum(r.session_id == s for r in chat) >= 10 for s in list(sessions)[:10])
    agentic = generate("agentic")
    assert max(len(r.input_tokens) for r in agentic) <= 32_000 + 4_200
    fan = generate("fanout")
    assert len(fan) == 64 * 16 and all(len(r.input_tokens) == 2048 + 128 for r in fan)
    rag = generate("rag")
    system = rag[0].input_tokens[:300]
    assert all(r.input_tokens[:300] == system for r in rag), "every question starts with the system prompt"
    firsts = {tuple(r.input_tokens[300:310]) for r in rag if r.turn_id == 0}
    assert 10 < len(firsts) < len(rag) / 2, "popular documents lead many prompts, not all"
    tools = generate("tools")
    by_ctx: dict[tuple[str, int], int] = {}
    for r in tools:
        key = (r.session_id, len(r.input_tokens))
        by_ctx[key] = by_ctx.get(key, 0) + 1
    assert max(by_ctx.values()) >= 2, "parallel calls from one context"
    backtracks = sum(
        any(len(b.input_tokens) < len(a.input_tokens) for b in tools if b.session_id == a.session_id and b.ts > a.ts)
        for a in tools[:50]
    )
    assert backtracks > 0, "an agent returns to a shorter context"
    mixed = generate("mixed")
    assert {r.session_id.split("-")[0] for r in mixed} == {"chat", "agent", "rag", "short"}
    assert all(len(r.input_tokens) < 512 for r in mixed if r.session_id.startswith("short-"))
    with pytest.raises(ValueError, match="unknown trace shape"):
        generate("nope")


def test_trace_jsonl_round_trip_and_bad_lines(tmp_path: Path) -> None:
    recs = generate("edge")[:5]
    write_trace(recs, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == recs
    (tmp_path / "bad.jsonl").write_text('{"session_id": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_trace(tmp_path / "bad.jsonl")


def test_policy_captures() -> None:
    req = RequestInfo(prompt_len=2200, cached_length=0, token_length=1500, session="s", ts=0.0)
    assert AlignLastBlock(512).captures(req, 0, 2048, decode=False) == [2048]
    assert AlignLastBlock(512).captures(req, 2048, 2200, decode=False) == []
    assert TrackAndFinish().captures(req, 2048, 2200, decode=False) == [2176]
    assert FlopEfficiency().captures(req, 0, 2048, decode=False) == [1500]
    assert FlopEfficiency().captures(req, 0, 2048, decode=True) == [] and FlopEfficiency().donate_finish(req)
    assert HitDensity(512).captures(req, 0, 2048, decode=False) == [1500, 2048]
    assert HitDensity(512).captures(req, 2048, 2200, decode=False) == [2199]
    short = RequestInfo(prompt_len=40, cached_length=0, token_length=0, session="s", ts=0.0)
    assert AlignLastBlock(512).captures(short, 0, 40, decode=False) == [], "below one block: nothing"
    assert HitDensity().captures(short, 0, 40, decode=False) == [39]
    assert FixedPoints(64).captures(req, 0, 2048, decode=False) == [1500, *range(2048, 0, -64)]
    assert FixedPoints(64).captures(req, 2048, 2200, decode=False) == [2199, 2176, 2112]
    assert FixedPoints(64).captures(req, 0, 2200, decode=True) == []
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lru-ish")


def test_engine_like_baselines_keep_what_those_engines_keep() -> None:
    req = RequestInfo(prompt_len=2200, cached_length=0, token_length=1500, session="s", ts=0.0)
    sg, vl = SglangLike(), VllmLike(512)
    # SGLang: every chunk's end (the prompt's end is the last one) and the final state, no decode.
    assert sg.captures(req, 0, 2048, decode=False) == [2048] and sg.captures(req, 2048, 2200, decode=False) == [2200]
    assert sg.captures(req, 2200, 2300, decode=True) == [] and sg.donate_finish(req)
    # vLLM: every block boundary crossed, in prefill and in decode; nothing off the grid.
    assert vl.captures(req, 0, 2048, decode=False) == [512, 1024, 1536, 2048]
    assert vl.captures(req, 2048, 2200, decode=False) == [] and vl.captures(req, 2500, 2600, decode=True) == [2560]
    assert not vl.donate_finish(req)
    with pytest.raises(ValueError, match="block must be positive"):
        VllmLike(0)
    # Through the manager: what each donates on a two-chunk prompt with an answer.
    trace = [TraceRecord("s-0", 0, 0.0, list(range(3000)), list(range(5000, 5600)))]
    sgm = replay(trace, SglangLike(), Q, 64 * GiB, chunk=2048).metrics
    vlm = replay(trace, VllmLike(512), Q, 64 * GiB, chunk=2048).metrics
    assert sgm["donations"] == {"capture": 2, "finish": 1}, sgm["donations"]
    assert vlm["donations"] == {"capture": 7, "finish": 0}, vlm["donations"]  # 512..3584 in 3,599 fed tokens


def test_the_ceiling_is_the_longest_prefix_computed_before() -> None:
    a = TraceRecord("a-0", 0, 0.0, list(range(10)), [11, 12])
    b = TraceRecord("a-1", 1, 1.0, [*range(10), 11, 20], [1])  # resumes a's prompt and answer
    c = TraceRecord("b-0", 0, 2.0, list(range(10)), [3])  # a re-send: all but its last id
    d = TraceRecord("c-0", 0, 3.0, [500, 501], [1])  # nothing shared
    hits = ceiling_hits([d, c, b, a])  # any order in: replayed by timestamp
    assert hits == [(0, -1), (11, 0), (9, 0), (0, -1)]  # c: another session, a's sequence reaches 10
    res = ceiling([a, b, c, d])
    assert (res.hit_tokens, res.requests_with_hit, res.prompt_tokens) == (20, 2, 34)


@pytest.mark.parametrize(("shape", "budget"), [("chat", 4), ("agentic", 2)])
def test_no_policy_passes_the_ceiling_and_the_reference_reaches_it_unbounded(shape: str, budget: int) -> None:
    trace = generate(shape)
    top = ceiling(trace).token_hit_rate
    for p in ("hit-density", "sglang-like", "vllm-like"):
        assert replay(trace, make_policy(p), Q, budget * GiB).token_hit_rate <= top
    # With room for everything the reference places exactly the snapshots the ceiling's hits need.
    assert replay(trace, FutureKnowledge(trace), Q, 2048 * GiB).token_hit_rate == pytest.approx(top)
    tight = replay(trace, FutureKnowledge(trace), Q, budget * GiB).token_hit_rate
    assert tight <= top
    # Its eviction is what makes it a reference: least recently used in its place does worse.

    class LruInItsPlace(FutureKnowledge):
        def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
            return None  # the tree's least recently used

    assert replay(trace, LruInItsPlace(trace), Q, budget * GiB).token_hit_rate < tight


def test_the_reference_refuses_another_trace() -> None:
    trace = generate("edge")[:5]
    other = [TraceRecord("x-0", 0, 0.0, [1] * 7, [2])]
    with pytest.raises(RuntimeError, match="must replay the trace it was made for"):
        replay(other, FutureKnowledge(trace), Q, 4 * GiB)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_replay_respects_the_budget_and_conserves(policy: str) -> None:
    budget = 2 * GiB
    seen: list[int] = []

    def held(i: int, nbytes: int) -> None:
        assert nbytes <= budget, f"request {i}: the tree holds {nbytes} bytes over a budget of {budget}"
        seen.append(nbytes)

    res = replay(generate("edge")[:90], make_policy(policy), Q, budget, on_step=held)
    assert len(seen) >= 2 * res.requests and max(seen) > budget // 2, "the budget was never under pressure"
    assert res.requests == 90 and 0 <= res.hit_tokens <= res.prompt_tokens
    assert 0.0 <= res.token_hit_rate <= 1.0 and 0.0 <= res.flops_saved_fraction <= 1.0
    assert res.snapshots_donated > 0


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("shape", ["tools", "mixed"])
def test_the_row_keeping_policies_hold_up_in_a_replay_past_their_exact_sizes(shape: str, host: bool) -> None:
    """hit-density forced onto its batched path (tiny batches) and flop-efficiency with a queue of
    2 (a scan every few evictions), through the manager under budget pressure, with and without a
    host tier: every choice is evictable (the manager checks), the invariants hold at the end (the
    replay checks), and the batched ranking stays near the exact one."""
    trace = generate(shape, 1)[:300]
    nemotron, tier = PRESETS["nemotron-h-8b"], 8 * GiB if host else 0
    exact = replay(trace, HitDensity(), nemotron, 1 * GiB, host_budget_bytes=tier)
    batched = replay(trace, HitDensity(exact_below=0, sample=4, batch=4), nemotron, 1 * GiB, host_budget_bytes=tier)
    assert batched.hit_tokens >= 0.8 * exact.hit_tokens, (batched.token_hit_rate, exact.token_hit_rate)
    marconi = replay(trace, FlopEfficiency(1.0, queue=2), nemotron, 1 * GiB, host_budget_bytes=tier)
    assert marconi.requests == len(trace) and marconi.snapshots_donated > 0


def test_every_edge_case_hits_under_ours() -> None:
    res = replay(generate("edge"), make_policy("hit-density"), Q, 4 * GiB)
    for kind, (hit, _total) in res.per_session_kind.items():
        assert hit > 0, f"{kind}: no hit under ours"
    base = replay(generate("edge"), make_policy("align-last-block"), Q, 4 * GiB)
    assert base.per_session_kind["short"][0] == 0, "align-last-block cannot hit below one block"
    assert base.per_session_kind["midblock"][0] == 0, "nor a shared prefix ending mid-block"


def test_ours_keeps_live_prefixes_on_fanout() -> None:
    trace = generate("fanout")[:300]
    ours = replay(trace, make_policy("hit-density"), Q, 4 * GiB)
    lru = replay(trace, make_policy("track-and-finish"), Q, 4 * GiB)
    assert ours.token_hit_rate > lru.token_hit_rate


def test_budget_below_one_snapshot_is_refused() -> None:
    with pytest.raises(ValueError, match="below one snapshot"):
        replay([TraceRecord("s", 0, 0.0, [1, 2, 3], [4])], make_policy("hit-density"), Q, 1000)
    with pytest.raises(TypeError, match="number of bytes"):
        replay([TraceRecord("s", 0, 0.0, [1, 2, 3], [4])], make_policy("hit-density"), Q, "4GiB")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy must be a Policy"):
        replay(generate("edge")[:9], "hit-density", Q, 4 * GiB)  # type: ignore[arg-type]
    for chunk in (0, -64, 2.5, True):
        with pytest.raises(ValueError, match=f"chunk must be an int >= 1 .*got {chunk!r}"):
            replay(generate("edge")[:9], make_policy("hit-density"), Q, 4 * GiB, chunk=chunk)  # type: ignore[arg-type]
    res = replay(generate("edge")[:9], make_policy("hit-density"), Q, 1.5 * GiB)  # a float budget: whole bytes
    assert res.budget_bytes == int(1.5 * GiB)


# The lead at the tightest budget: three quarters on chat; on agentic the faithful Marconi
# (flop-efficiency) comes within 10% (70.3% against 63.9% at its default alpha): issue 14 is open.
@pytest.mark.parametrize(("shape", "budget", "lead"), [("chat", 4, 1.2), ("agentic", 2, 1.05)])
def test_ours_leads_every_baseline_at_the_tightest_budget(shape: str, budget: int, lead: float) -> None:
    trace = generate(shape)
    ours = replay(trace, make_policy("hit-density"), Q, budget * GiB).token_hit_rate
    best = max(replay(trace, make_policy(p), Q, budget * GiB).token_hit_rate for p in POLICIES if p != "hit-density")
    assert ours >= lead * best, f"{shape} at {budget} GiB: ours {ours:.3f}, best baseline {best:.3f}"


# -- the mechanics of `ours`, on a small tree ---------------------------------------------------


class _Tree:
    """A tree whose sequences are distinct 64-token keys under an optional shared prefix."""

    def __init__(self, host_slots: int = 0) -> None:
        """``host_slots``: a host tier of that many slots (a leaf's eviction for slots demotes)."""
        self.pool = LinearStatePool(StateLayout(1, (1, 1), (1,)), 64)
        self.listeners: list[Policy] = []
        # As a manager would: every policy bound here hears what the tree does.
        host = LinearStatePool(self.pool.layout, host_slots) if host_slots else None
        self.cache = HybridRadixCache(self.pool, on_event=self.hear, host_pool=host)
        self.slot = self.pool.alloc(RequestOwner("donor"))
        self.rng = np.random.default_rng(0)

    def hear(self, event: TreeEvent) -> None:
        for p in self.listeners:
            p.tree_event(event)

    def policy(self, pol: P) -> P:
        pol.bind(self.cache)
        self.listeners.append(pol)
        return pol

    def add(self, key: np.ndarray) -> TreeNode:
        return self.cache.insert(key, torch.arange(len(key)), state_slot=self.slot).node

    def fresh(self, n: int = 64) -> np.ndarray:
        return self.rng.integers(0, 1 << 20, n).astype(np.int32)


def test_flop_efficiency_weighs_normalised_flops_per_byte_against_normalised_recency() -> None:
    """Marconi's rule: old-but-efficient outlives recent-but-wasteful once alpha weighs efficiency.
    The FLOPs per byte here are tiny numbers (about 0.001): left unnormalised, the efficiency term
    would vanish next to recency; dropped, the older node would go. Either way this test fails."""
    t = _Tree()
    deep_key = t.fresh(1024)
    deep = t.add(deep_key)
    t.add(np.concatenate([deep_key, t.fresh(64)]))  # `deep` now has one child: it frees no KV
    shallow = t.add(t.fresh(600))  # 600 deep, a leaf of 600 tokens of its own KV
    pol = FlopEfficiency(alpha=2.0)
    t.policy(pol)
    pol.costs(1000, 10)
    pol.flops(lambda n: n * 0.001)
    pol.donated(deep, _req("a", 0.0), CAPTURE, 0.0)  # the oldest
    pol.donated(shallow, _req("c", 10.0), CAPTURE, 10.0)  # the most recent
    assert pol.efficiency(deep) == pytest.approx(1.024 / 1000)  # no KV of its own: the snapshot only
    assert pol.efficiency(shallow) == pytest.approx(0.6 / (1000 + 6000))
    # normalised: deep 0 (recency) + 2 * 1 (efficiency) = 2; shallow 1 + 2 * 0 = 1
    assert pol.victim(20.0) is shallow
    lru = FlopEfficiency(alpha=0.0)
    t.policy(lru)
    lru.costs(1000, 10)
    for n, ts in ((deep, 0.0), (shallow, 10.0)):
        lru.donated(n, _req("x", ts), CAPTURE, ts)
    t.cache.lock(deep)
    assert lru.victim(20.0) is shallow, "a locked snapshot is not a candidate"
    t.cache.unlock(deep)
    assert lru.victim(20.0) is deep, "alpha 0 is LRU over the candidates"
    # A node with two children is never a candidate: its snapshot serves two branches.
    t.add(np.concatenate([deep_key, t.fresh(8)]))
    assert len(deep.children) == 2
    only = FlopEfficiency(alpha=0.0)
    t.policy(only)
    only.donated(deep, _req("f", 0.0), CAPTURE, 0.0)
    assert only.victim(1.0) is None
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        FlopEfficiency(-1)
    with pytest.raises(ValueError, match="alpha must be >= 0, got nan"):
        FlopEfficiency(float("nan"))
    with pytest.raises(ValueError, match="queue must be > 0, got 0"):
        FlopEfficiency(1.0, queue=0)


def _marconi_by_scan(pol: FlopEfficiency, last: dict[int, float], nodes: list[TreeNode], kv: bool = False) -> set[int]:
    """Marconi's choice computed the slow way: every tracked snapshot with at most one child is a
    candidate of the normalisation; the lowest normalised utility among the unlocked ones goes.
    For KV pressure (``kv``): the unlocked leaves, normalised over them, at a KV eviction's bytes.
    Returns the ids tied at the lowest (within rounding)."""
    cands = [n for n in nodes if n.snapshot is not None and n.parent is not None and len(n.children) <= 1]
    if kv:
        cands = [n for n in cands if not n.children and not n.snap_lock]
    if not cands:
        return set()
    eff = {n.id: pol.efficiency(n, demote=not kv) for n in cands}
    r_lo, r_hi = min(last[n.id] for n in cands), max(last[n.id] for n in cands)
    e_lo, e_hi = min(eff.values()), max(eff.values())

    def u(n: TreeNode) -> float:
        r = (last[n.id] - r_lo) / (r_hi - r_lo) if r_hi > r_lo else 0.0
        e = (eff[n.id] - e_lo) / (e_hi - e_lo) if e_hi > e_lo else 0.0
        return r + pol.alpha * e

    free = [n for n in cands if not n.snap_lock]
    if not free:
        return set()
    low = min(u(n) for n in free)
    return {n.id for n in free if u(n) <= low + 1e-9}


@pytest.mark.parametrize("alpha", [0.0, 0.5, 4.0])
def test_flop_efficiency_without_a_full_scan_chooses_what_the_full_scan_chooses(alpha: float) -> None:
    """The queue, the bound and the row refreshes (donations below and across a split, evictions
    next to a node, locks) give Marconi's exact choice: checked against the full scan at every
    eviction of a random run, with a queue of 3 so the bound and the rescans are both exercised."""
    rng = np.random.default_rng(int(alpha * 10))
    pool = LinearStatePool(StateLayout(1, (1, 1), (1,)), 400)
    cache = HybridRadixCache(pool)
    slot = pool.alloc(RequestOwner("donor"))
    pol = FlopEfficiency(alpha, queue=3)
    pol.bind(cache)
    pol.costs(1000, 7)
    pol.flops(lambda n: float(n) ** 2 / 100 + n)
    last: dict[int, float] = {}
    keys: dict[int, np.ndarray] = {}
    nodes: list[TreeNode] = []
    prefixes = [rng.integers(0, 1 << 20, 32).astype(np.int32) for _ in range(6)]
    locked: list[TreeNode] = []
    checked = 0
    for step in range(400):
        now = float(step)
        op = rng.random()
        live = [n for n in nodes if n.snapshot is not None and n.parent is not None]
        if op < 0.45 or not live:
            base = prefixes[rng.integers(len(prefixes))]
            if live and rng.random() < 0.5:  # extend, or split, an existing sequence
                other = keys[live[rng.integers(len(live))].id]
                base = other if rng.random() < 0.5 else other[: int(rng.integers(1, len(other) + 1))]
            key = np.concatenate([base, rng.integers(0, 1 << 20, int(rng.integers(1, 24))).astype(np.int32)])
            res = cache.insert(key, torch.arange(len(key)), state_slot=slot)
            keys[res.node.id] = key
            if res.node not in nodes:
                nodes.append(res.node)
            last[res.node.id] = now
            pol.donated(res.node, _req(f"s{step}", now), CAPTURE, now)
        elif op < 0.65:
            n = live[rng.integers(len(live))]
            last[n.id] = now
            pol.touched(n, _req(f"s{step}", now), now)
        elif op < 0.72:
            n = live[rng.integers(len(live))]
            cache.lock(n)
            locked.append(n)
        elif op < 0.78 and locked:
            cache.unlock(locked.pop(rng.integers(len(locked))))
        elif op < 0.81:  # every candidate locked: no choice, and the tree evicts by its own LRU
            free = [n for n in live if len(n.children) <= 1 and not n.snap_lock]
            for n in free:
                cache.lock(n)
            assert pol.victim(now) is None
            cache.evict(snapshots=1)
            for n in free:
                cache.unlock(n)
        else:
            kv = rng.random() < 0.25
            pol._settle()  # what victim() does first; then the ranges it reads must be exact
            cands = [n for n in nodes if n.snapshot is not None and n.parent is not None and len(n.children) <= 1]
            ranges = pol._ranges()
            if ranges is not None and cands:
                effs = [pol.efficiency(n) for n in cands]
                exact = (min(last[n.id] for n in cands), max(last[n.id] for n in cands), min(effs), max(effs))
                assert ranges == pytest.approx(exact, rel=1e-12), (step, ranges, exact)
            want = _marconi_by_scan(pol, last, nodes, kv)
            v = pol.victim(now, kv=kv)
            if not want:
                assert v is None
                continue
            assert v is not None and v.id in want, (step, v, want)
            checked += 1
            cache.evict_snapshot(v, demote=not kv)
            pol.check_invariants()
            cache.check_invariants()
    assert checked > 60


def test_alpha_is_tuned_on_a_bootstrap_window() -> None:
    trace = generate("chat")
    window = bootstrap_window(trace, Q, 4 * GiB)
    assert 50 <= len(window) < len(trace) and window == sorted(trace, key=lambda r: r.ts)[: len(window)]
    best = tune_alpha(trace, Q, 4 * GiB, grid=(0.0, 8.0))
    rates = {a: replay(window, FlopEfficiency(a), Q, 4 * GiB).token_hit_rate for a in (0.0, 8.0)}
    assert best == max(rates, key=lambda a: (rates[a], -a)), rates
    with pytest.raises(ValueError, match="grid is empty"):
        tune_alpha(trace, Q, 4 * GiB, grid=())
    rows = run_grid([("chat", trace[:200])], ["flop-efficiency"], lambda _: (4.0,), reference=False)
    assert rows[0]["alpha"] in ALPHA_GRID


def _evict(pol: HitDensity, now: float) -> None:
    """Evict the policy's victim, as the manager does."""
    node = pol.victim(now)
    assert node is not None and node.cache is not None, "the policy found no victim"
    node.cache.evict_snapshot(node)


def _req(session: str, ts: float, n: int = 64, digest: int | None = None) -> RequestInfo:
    return RequestInfo(n, 0, 0, session, ts, digest)


def _think(policy: HitDensity, gaps: list[float]) -> None:
    """Teach the policy think times: one session per gap, two requests that far apart."""
    for i, g in enumerate(gaps):
        policy.admitted(_req(f"teach{i}", 0.0))
        policy.admitted(_req(f"teach{i}", g))


def test_ours_evicts_superseded_turns_first() -> None:
    t = _Tree()
    pol = t.policy(HitDensity())
    turn1 = t.fresh()
    a1 = t.add(turn1)
    pol.donated(a1, _req("a", 0.0), FINISH, 0.0)
    other = t.add(t.fresh())
    pol.donated(other, _req("b", 1.0), FINISH, 1.0)
    a2 = t.add(np.concatenate([turn1, t.fresh()]))
    pol.donated(a2, _req("a", 10.0, 128), FINISH, 10.0)  # turn 2 went past turn 1's final state
    assert pol.density(a1, 10.0) < 0 <= pol.density(other, 10.0)
    _evict(pol, 10.0)
    assert a1.snapshot is None and other.snapshot is not None and a2.snapshot is not None
    t.cache.check_invariants()


def test_ours_keeps_a_superseded_turn_another_session_used() -> None:
    t = _Tree()
    pol = t.policy(HitDensity())
    turn1 = t.fresh()
    a1 = t.add(turn1)
    pol.donated(a1, _req("a", 0.0), FINISH, 0.0)
    pol.touched(a1, _req("c", 5.0), 5.0)  # another conversation hit it: shared now
    a2 = t.add(np.concatenate([turn1, t.fresh()]))
    pol.donated(a2, _req("a", 10.0, 128), FINISH, 10.0)
    assert pol.density(a1, 10.0) >= 0


def test_ours_ranks_final_states_by_think_time() -> None:
    t = _Tree()
    pol = t.policy(HitDensity())
    _think(pol, [5.0 + 55.0 * i / 99 for i in range(100)])  # 5 to 60 s between turns
    just_answered, halfway, over = (t.add(t.fresh()) for _ in range(3))
    now = 100.0
    pol.donated(just_answered, _req("a", now), FINISH, now)
    pol.donated(halfway, _req("b", now - 40.0), FINISH, now - 40.0)
    pol.donated(over, _req("c", now - 70.0), FINISH, now - 70.0)  # idle beyond every think time
    assert pol.density(over, now) == 0.0
    assert pol.density(just_answered, now) < pol.density(halfway, now)
    victims = []
    for _ in range(2):
        before = {n.id for n in (just_answered, halfway, over) if n.snapshot is not None}
        _evict(pol, now)
        victims += [i for i in before if i not in {n.id for n in (just_answered, halfway, over) if n.snapshot}]
    assert victims == [over.id, just_answered.id], "the over conversation, then the one furthest from its turn"


def test_ours_learns_which_captures_pay_from_the_request_stream() -> None:
    pol = HitDensity()
    for i in range(100):  # one-shot sessions, never a repeated prompt (a fan-out)
        pol.admitted(_req(f"s{i}", float(i), digest=i + 1))
    assert pol.rate("finish") < 0.05 and pol.rate("resend") < 0.05
    req = RequestInfo(2200, 0, 1500, "new", 200.0, 7)
    assert not pol.donate_finish(req)
    assert pol.captures(req, 2048, 2200, decode=False) == [], "no re-send point: prompts never repeat"
    assert pol.captures(req, 0, 2048, decode=False) == [1500, 2048], "prefix captures are still taken"
    chatty = HitDensity()
    for i in range(100):  # every session comes back with the same prompt
        chatty.admitted(_req(f"s{i % 10}", float(i), digest=i % 10 + 1))
    assert chatty.rate("finish") > 0.8 and chatty.rate("resend") > 0.8
    assert chatty.donate_finish(req) and chatty.captures(req, 2048, 2200, decode=False) == [2199]


def test_ours_values_a_prefix_by_what_it_adds_over_its_anchor() -> None:
    t = _Tree()
    pol = t.policy(HitDensity())
    pol.costs(snapshot_bytes=1000, kv_bytes_per_token=1)
    shared = t.fresh()
    root = t.add(shared)
    pol.donated(root, _req("sys", 0.0), CAPTURE, 0.0)
    pol.touched(root, _req("x", 1.0), 1.0)  # used by two sessions: an anchor for everyone
    deep = t.add(np.concatenate([shared, t.fresh()]))
    pol.donated(deep, _req("y", 2.0, 128), CAPTURE, 2.0)
    assert pol._anchor_depth(pol._entries[deep.id]) == 64
    mine = t.add(np.concatenate([shared, t.fresh(), t.fresh()]))
    pol.donated(mine, _req("z", 3.0, 192), CAPTURE, 3.0)
    assert pol._anchor_depth(pol._entries[mine.id]) == 64


def _refuses(pol: Policy, match: str) -> None:
    """``pol.check_invariants()`` names the corruption just made."""
    with pytest.raises(AssertionError, match=match):
        pol.check_invariants()


def test_ours_reanchors_the_rows_below_an_anchor_the_tree_let_go() -> None:
    """A shared anchor's snapshot goes without the policy choosing it (a direct eviction): the
    snapshots below it are valued from the root again, in their rows too, by the next choice."""
    t = _Tree()
    pol = t.policy(HitDensity(exact_below=0))
    pol.costs(snapshot_bytes=1000, kv_bytes_per_token=1)
    shared = t.fresh()
    anchor = t.add(shared)
    pol.donated(anchor, _req("sys", 0.0), CAPTURE, 0.0)
    pol.touched(anchor, _req("x", 1.0), 1.0)  # used by two sessions: an anchor for everyone
    below = [t.add(np.concatenate([shared, t.fresh()])) for _ in range(2)]
    for i, n in enumerate(below):
        pol.donated(n, _req(f"y{i}", 2.0 + i, 128), CAPTURE, 2.0 + i)
    kept = below[1]
    gain = float(pol._t.rows[pol._t.pos[kept.id], 4])
    t.cache.evict_snapshot(anchor, demote=False)  # an inner node: it stays, a tombstone
    assert anchor.id not in pol._t.pos and pol._anchor_depth(pol._entries[kept.id]) == 0
    t.cache.lock(kept)
    assert pol.victim(5.0) is below[0]
    t.cache.unlock(kept)
    now = float(pol._t.rows[pol._t.pos[kept.id], 4])
    assert now == pol._gain(pol._entries[kept.id]) and now > gain, "its row still counts the anchor"


def test_policy_check_invariants_detect_corruption() -> None:
    t = _Tree()
    pol = t.policy(HitDensity())
    nodes = [t.add(t.fresh()) for _ in range(3)]
    for i, n in enumerate(nodes):
        pol.donated(n, _req(f"s{i}", float(i)), FINISH, float(i))
    pol.admitted(_req("a", 0.0))
    pol.admitted(_req("a", 5.0))
    pol.check_invariants()
    pol._t.pos[nodes[0].id] = 2  # a position that points at another node
    _refuses(pol, "position says 2")
    pol._t.pos[nodes[0].id] = 0
    pol._superseded[999] = None
    _refuses(pol, "superseded but not tracked")
    del pol._superseded[999]
    pol._think._sorted.append(1.0)
    _refuses(pol, "think-time")


def test_ours_sampled_eviction_and_argument_errors() -> None:
    t = _Tree()
    pol = t.policy(HitDensity(sample=4, exact_below=8))
    nodes = [t.add(t.fresh()) for _ in range(40)]
    for i, n in enumerate(nodes):
        pol.donated(n, _req(f"s{i}", float(i)), CAPTURE, float(i))
    for _ in range(30):
        _evict(pol, 50.0)
    assert t.cache.num_snapshots == 10
    t.cache.check_invariants()
    with pytest.raises(ValueError, match=r"min_rate=1\.5"):
        HitDensity(min_rate=1.5)
    with pytest.raises(ValueError, match=r"hit_bonus=-1\.0"):
        HitDensity(hit_bonus=-1.0)
    with pytest.raises(ValueError, match=r"hit_bonus=nan"):
        HitDensity(hit_bonus=float("nan"))
    with pytest.raises(ValueError, match=r"batch=0"):
        HitDensity(batch=0)
    with pytest.raises(ValueError, match="kv/token 0"):
        pol.costs(100, 0)


class _Scored(HitDensity):
    """Ours with densities the test sets, exact and estimated: the batched eviction's mechanics alone
    (a batch as large as ``batch`` whatever the tree's size)."""

    batch_share = 1

    def __init__(self, exact: dict[int, float], estimate: dict[int, float] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.exact = exact
        self.estimate = exact if estimate is None else estimate
        self.draws = 0

    def density(self, node: TreeNode, now: float, *, demote: bool = True) -> float:
        return self.exact[node.id]

    def _row_density(self, e: Any, now: float, leaf: bool) -> float:
        return self.exact[e.node.id]

    def estimates(self, rows: np.ndarray, now: float, *, leaf: bool = False) -> np.ndarray:
        self.draws += 1
        return np.array([self.estimate[self._t.nodes[i].id] for i in rows.tolist()])


def _scored(
    n: int, exact: list[float], estimate: list[float] | None = None, **kw: Any
) -> tuple[_Tree, list[TreeNode], _Scored]:
    """A tree of ``n`` snapshots, the i-th with exact density ``exact[i]`` (estimated ``estimate[i]``)."""
    t = _Tree()
    nodes = [t.add(t.fresh()) for _ in range(n)]
    est = None if estimate is None else {x.id: estimate[i] for i, x in enumerate(nodes)}
    pol = _Scored({x.id: exact[i] for i, x in enumerate(nodes)}, est, exact_below=0, **kw)
    t.policy(pol)
    for i, x in enumerate(nodes):
        pol.donated(x, _req(f"s{i}", float(i)), CAPTURE, float(i))
    return t, nodes, pol


def _victims(t: _Tree, pol: HitDensity, k: int, now: float = 20.0) -> list[TreeNode]:
    out = []
    for _ in range(k):
        v = pol.victim(now)
        assert v is not None
        out.append(v)
        t.cache.evict_snapshot(v)
    return out


def test_ours_batched_eviction_serves_a_batch_of_the_lowest_from_one_draw() -> None:
    """Past ``exact_below`` snapshots, one draw of ``sample x batch`` serves ``batch`` evictions,
    lowest estimate first; a draw that covers every snapshot gives the exact order."""
    scores = [float((7 * i) % 12) for i in range(12)]  # lowest: nodes[0], then [7], [2], [9]
    t, nodes, pol = _scored(12, scores, sample=3, batch=4)
    assert _victims(t, pol, 4) == [nodes[0], nodes[7], nodes[2], nodes[9]]
    assert pol.draws == 1, "four evictions from one draw"
    assert _victims(t, pol, 1) == [nodes[4]] and pol.draws == 2
    t.cache.check_invariants()
    pol.check_invariants()
    # One draw per eviction, of one snapshot: whatever was drawn, not the exact order.
    t2, more, narrow = _scored(12, [float(i) for i in range(12)], sample=1, batch=1, seed=3)
    assert {v.id for v in _victims(t2, narrow, 6)} != {n.id for n in more[:6]}, "one draw is not the exact order"
    # Under 1,024 snapshots per evicted one a batch is one eviction: every eviction draws afresh.
    t3, _, small = _scored(12, scores, sample=3, batch=4)
    small.batch_share = HitDensity.batch_share
    _victims(t3, small, 3)
    assert small.draws == 3


def test_ours_batched_eviction_rescores_outside_its_burst() -> None:
    """Within the burst its batch was drawn in (same ``now``, no event since) a queued snapshot goes
    on its estimate; after that, one whose density now is above its batch's highest estimate is
    skipped, and a fresh batch decides when the queue runs out."""
    est = [-1.0, 0.0, 1.0, 2.0, 10.0, 11.0]
    exact = [-1.0, 5.0, 1.0, 2.0, 10.0, 11.0]  # nodes[1] looks cheap but is not
    t, nodes, pol = _scored(6, exact, est, sample=2, batch=4)  # queue: 0, 1, 2, 3; bound 2.0
    assert _victims(t, pol, 1) == [nodes[0]]
    assert _victims(t, pol, 1, now=21.0) == [nodes[2]], "a later now: re-scored, the stale one skipped"
    t2, nodes2, pol2 = _scored(6, exact, est, sample=2, batch=4)
    assert _victims(t2, pol2, 2) == [nodes2[0], nodes2[1]], "the same burst: the estimates stand"
    t3, nodes3, pol3 = _scored(6, exact, est, sample=2, batch=4)
    assert _victims(t3, pol3, 1) == [nodes3[0]]
    pol3.admitted(_req("x", 20.0))  # an event: densities may have moved
    assert _victims(t3, pol3, 1) == [nodes3[2]]
    # A carried-over queue whose snapshots are all above the bound now: skipped; a fresh batch decides.
    t4, nodes4, pol4 = _scored(4, [9.0, 8.0, 7.0, 6.0], [0.0, 1.0, 2.0, 3.0], sample=4, batch=2)
    assert _victims(t4, pol4, 1) == [nodes4[0]]  # queue left: [1], bound 1.0
    pol4.estimate = pol4.exact
    assert _victims(t4, pol4, 1, now=21.0) == [nodes4[3]], "the stale one skipped, the fresh batch's lowest"


def test_ours_batched_eviction_falls_back_to_the_exact_scan_when_all_it_draws_is_locked() -> None:
    t, nodes, pol = _scored(12, [float(i) for i in range(12)], sample=1, batch=1, seed=0)
    for n in nodes[:11]:
        t.cache.lock(n)
    assert pol.victim(20.0) is nodes[11], "one draw of one, three times, then every snapshot"
    assert pol.draws == 3


@pytest.mark.parametrize("host_slots", [0, 4])
def test_ours_estimates_are_its_densities_while_paths_stand_still(host_slots: int) -> None:
    """The batched estimate of each snapshot equals its exact density when nothing changed its path
    since its last event: every kind, final states ranked by think time, hits, anchors, leaves;
    with a host tier that would take a leaf's snapshot (an eviction for slots frees the slot
    alone, one for KV the leaf's path) and without one."""
    t = _Tree(host_slots)
    assert t.cache.demotes is (host_slots > 0)
    pol = t.policy(HitDensity(exact_below=0))
    pol.costs(snapshot_bytes=500, kv_bytes_per_token=3)
    _think(pol, [5.0 + 55.0 * i / 19 for i in range(20)])
    shared = t.fresh()
    root = t.add(shared)
    pol.donated(root, RequestInfo(64, 0, 64, "sys", 0.0), CAPTURE, 0.0)  # a branch point
    nodes = [root]
    for i in range(12):
        key = np.concatenate([shared, t.fresh()]) if i % 2 else t.fresh()
        n = t.add(key)
        kind = FINISH if i % 3 else CAPTURE
        pol.donated(n, RequestInfo(len(key), 0, 0, f"s{i}", float(i), i + 1), kind, float(i))
        nodes.append(n)
    for i, n in enumerate(nodes[::3]):
        pol.touched(n, _req(f"h{i}", 20.0 + i), 20.0 + i)
    rows = np.array([pol._t.pos[n.id] for n in nodes])
    for now in (30.0, 50.0, 90.0):
        for leaf in (False, True):
            est = pol.estimates(rows, now, leaf=leaf)
            for n, e in zip(nodes, est.tolist(), strict=True):
                want = float("inf") if leaf and n.children else pol.density(n, now, demote=not leaf)
                assert e == pytest.approx(want, rel=1e-9, abs=1e-15), (n.id, now, leaf)
                if not (leaf and n.children):  # one row, at another time than it was written
                    got = pol._row_density(pol._entries[n.id], now, leaf)
                    assert got == pytest.approx(want, rel=1e-9, abs=1e-15), (n.id, now, leaf)


def test_freed_bytes_count_the_tombstone_parents_a_leaf_takes_with_it() -> None:
    t = _Tree()
    pol = t.policy(HitDensity())
    pol.costs(snapshot_bytes=1000, kv_bytes_per_token=1)
    prompt = t.fresh(100)
    leaf = t.add(np.concatenate([prompt, t.fresh(20)]))
    other = t.add(np.concatenate([prompt, t.fresh(30)]))  # splits: a 100-token tombstone parent
    assert leaf.num_tokens == 20 and leaf.parent is not None and leaf.parent.snapshot is None
    assert pol.freed_bytes(leaf) == 1000 + 20, "the parent stays for the sibling"
    t.cache.evict_snapshot(other)
    assert pol.freed_bytes(leaf) == 1000 + 120, "the tombstone parent goes with the leaf"
    assert pol.freed_bytes(leaf) == 1000 + t.cache.evict_snapshot(leaf).kv_tokens


@pytest.mark.parametrize("budget", [2, 4])
def test_ours_keeps_every_tenants_requests_on_the_mixed_trace(budget: int) -> None:
    """Token hit rate hides short requests: a short prompt's snapshot costs as many bytes as a long
    one. Per tenant, ours must give at least as many requests a hit as the best baseline. With
    ``hit_bonus=0`` the short tenant gets 16 of 800 at 2 GiB where Marconi's policy gets 134."""
    trace = generate("mixed")
    ours = replay(trace, make_policy("hit-density"), Q, budget * GiB)
    for p in POLICIES:
        if p == "hit-density":
            continue
        theirs = replay(trace, make_policy(p), Q, budget * GiB).per_session_kind_requests
        for tenant, (hits, total) in theirs.items():
            mine = ours.per_session_kind_requests[tenant][0]
            assert mine >= hits, f"{tenant} at {budget} GiB: ours {mine}/{total}, {p} {hits}/{total}"


def test_report_table_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_grid([("edge", generate("edge")[:60])], ["hit-density", "flop-efficiency"], lambda _: (1.0, 2.0))
    table = markdown_table(rows)
    assert table.count("\n") == 3 and "hit-density: hit / FLOPs saved" in table and "**" in table
    edge = edge_case_table(
        run_grid([("edge", generate("edge"))], ["align-last-block", "hit-density"], lambda _: (2.0,))
    )
    short = next(line for line in edge.splitlines() if line.startswith("| shorter than one block"))
    assert short.split(" | ")[2] == "**0**" and "**0**" not in short.split(" | ")[3], short
    assert edge_case_table(rows).count("\n") == 3, "the one case this trace has, 2 budgets"
    assert table in report_markdown(rows) and "Edge cases" in report_markdown(rows)
    assert REFERENCE not in table, "the reference has its own table"
    bounds = bounds_table(rows)
    assert bounds.count("\n") == 3 and "| edge | 1 GiB |" in bounds and "x |" in bounds
    ref = [r for r in rows if r["policy"] == REFERENCE]
    assert len(ref) == 2 and all(r["of_reference"] == pytest.approx(1.0) for r in ref)
    assert all(0.0 <= float(r["of_ceiling"]) <= 1.0 for r in rows)  # type: ignore[arg-type]
    assert "Per request" in report_markdown(rows) and "computed p50, p99" in report_markdown(rows)
    write_trace(generate("edge")[:30], tmp_path / "e.jsonl")
    assert main(["bench-trace", str(tmp_path / "e.jsonl"), "--policy", "hit-density", "--budget", "1"]) == 0
    assert '"policy": "hit-density"' in capsys.readouterr().out


def test_report_over_seeds_and_presets_with_tenants_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_report((0, 1), ("qwen3-next-80b", "nemotron-h-8b"), ["hit-density", "sglang-like"], shapes=["edge"])
    assert len(rows) == 2 * 2 * 3 * 3, "2 presets x 2 seeds x 3 budgets x (2 policies + the reference)"
    assert {(r["preset"], r["seed"]) for r in rows} == {(p, s) for p in PRESETS for s in (0, 1)}
    table = markdown_table(rows)
    assert table.splitlines()[0].startswith("| preset | seed | trace | budget |") and table.count("\n") == 13
    assert "| nemotron-h-8b | 1 | edge | 4 GiB |" in table
    summary = summary_table(rows)
    assert summary.count("\n") == 5, "one line per (preset, seed, trace)"
    line = summary.splitlines()[2]
    assert "| 1 GiB |" in line and "sglang-like" in line and "x |" in line
    assert summary_table(rows, "fixed-points") == "", "no rows of that policy"
    assert tenants_table(rows) == "", "no mixed rows"
    steps: list[int] = []
    with pytest.raises(KeyError, match="no-such-model"):
        run_report((0,), ("qwen3-next-80b", "no-such-model"), ["hit-density"], shapes=["edge"], progress=steps.append)
    assert steps == [], "an unknown preset is refused before any replay"
    with pytest.raises(ValueError, match="unknown trace shape 'nope'"):
        run_report((0,), ("qwen3-next-80b",), ["hit-density"], shapes=["nope"])
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        run_report((0,), ("qwen3-next-80b",), ["nope"], shapes=["edge"])
    assert main(["policies-report", "--shape", "edge", "--policy", "hit-density", "--seed", "0", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Summary") and "| seed |" in out


def test_tenants_table_marks_ours_behind_a_baseline() -> None:
    def row(policy: str, kinds: dict[str, tuple[int, int]]) -> dict[str, object]:
        return {
            "policy": policy,
            "preset": "qwen3-next-80b",
            "seed": 0,
            "trace": "mixed",
            "budget_gib": 2.0,
            "per_session_kind_requests": kinds,
        }

    rows = [
        row("hit-density", {"short": (5, 10), "chat": (9, 9)}),
        row("sglang-like", {"short": (7, 10), "chat": (3, 9)}),
    ]
    table = tenants_table(rows)
    lines = table.splitlines()
    assert lines[0] == "| trace | budget | tenant | hit-density | sglang-like |"
    assert lines[2] == "| mixed | 2 GiB | chat | **9/9** | 3/9 |"
    assert lines[3] == "| mixed | 2 GiB | short | 5/10 < | **7/10** |"


def test_policies_report_script_rewrites_only_its_section(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("policies_report", ROOT / "benchmarks" / "policies_report.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = run_grid([("edge", generate("edge")[:60])], ["hit-density", "flop-efficiency"], lambda _: (1.0, 2.0))
    doc = tmp_path / "policies.md"
    doc.write_text("intro\n<!-- policies-report:begin -->\nold\n<!-- policies-report:end -->\noutro\n")
    script.write_report(rows, doc, tmp_path / "p.png")
    text = doc.read_text()
    assert text.startswith("intro") and text.rstrip().endswith("outro") and "old" not in text
    assert markdown_table(rows) in text and "edge case" in text
    assert (tmp_path / "policies.json").exists()


def test_ours_keeps_earlier_prompt_ends_when_sessions_come_back() -> None:
    """A linear conversation's earlier prompt end is superseded by its next turn; an agent that
    comes back to earlier contexts (parallel calls, dead ends) keeps it."""

    def run(revisit: bool) -> bool:
        t = _Tree()
        pol = t.policy(HitDensity())
        for i in range(40):  # sessions whose second request is no longer (revisit) or longer
            pol.admitted(RequestInfo(100, 0, 0, f"w{i}", 0.0))
            pol.admitted(RequestInfo(100 if revisit else 200, 0, 0, f"w{i}", 1.0))
        prompt = t.fresh()
        end = t.add(prompt[:-1])
        req = RequestInfo(64, 0, 0, "a", 10.0, 5)
        pol.donated(end, req, CAPTURE, 10.0)
        assert pol._entries[end.id].kind == "resend"
        final = t.add(np.concatenate([prompt, t.fresh(16)]))  # the session's next turn went past it
        pol.donated(final, RequestInfo(80, 63, 63, "a", 20.0, 6), FINISH, 21.0)
        return end.id in pol._superseded

    assert run(revisit=False), "a linear conversation went past its prompt's end"
    assert not run(revisit=True), "an agent that comes back keeps its earlier prompt ends"


def test_ours_waits_less_for_a_snapshot_used_often() -> None:
    """Two snapshots of the same kind, depth and age: the one hit every second outranks the one hit
    once, though the kind's mean gap is the same for both."""
    t = _Tree()
    pol = t.policy(HitDensity())
    busy, quiet = t.add(t.fresh()), t.add(t.fresh())
    for n in (busy, quiet):
        pol.donated(n, _req("d", 0.0), CAPTURE, 0.0)
    pol.touched(quiet, _req("q", 50.0), 50.0)
    for k in range(1, 51):
        pol.touched(busy, _req(f"b{k}", float(k)), float(k))
    assert pol.density(busy, 50.0) > 5 * pol.density(quiet, 50.0)


def test_ours_counts_a_hit_below_an_anchor_as_a_use_of_the_anchor() -> None:
    """A shared prefix that new conversations reach rarely, under conversations that hit their own
    deeper snapshots often: each of those hits is a use of the prefix too (it would have served)."""
    t = _Tree()
    pol = t.policy(HitDensity())
    shared = t.fresh()
    anchor = t.add(shared)
    pol.donated(anchor, _req("a", 0.0), CAPTURE, 0.0)
    below = t.add(np.concatenate([shared, t.fresh()]))
    pol.donated(below, _req("b", 1.0, 128), FINISH, 1.0)
    alone = t.add(t.fresh())
    pol.donated(alone, _req("z", 0.0), CAPTURE, 0.0)
    for k in range(2, 40):
        pol.touched(below, _req("b", float(k), 128), float(k))
    assert pol._entries[anchor.id].hits == 38 and pol._entries[anchor.id].last == 39.0
    assert pol.density(anchor, 40.0) > 5 * pol.density(alone, 40.0)
    pol.touched(alone, _req("z", 41.0), 41.0)  # no anchor above: nothing else is counted
    assert pol._entries[anchor.id].hits == 38


def test_ours_never_supersedes_a_branch_point() -> None:
    """A branch point is where a prompt left another sequence's KV: shared by construction, so the
    session that happened to capture it going further does not make it dead weight."""
    t = _Tree()
    pol = t.policy(HitDensity())
    shared = t.fresh()
    t.add(np.concatenate([shared, t.fresh()]))  # another sequence went on past the prefix
    branch = t.add(shared)
    pol.donated(branch, RequestInfo(128, 0, 64, "a", 1.0, 3), CAPTURE, 1.0)
    assert pol._entries[branch.id].kind == "branch"
    mine = t.add(np.concatenate([shared, t.fresh(), t.fresh()]))
    pol.donated(mine, RequestInfo(160, 64, 64, "a", 5.0, 4), FINISH, 6.0)  # the session's next turn
    assert branch.id not in pol._superseded and pol.density(branch, 6.0) > 0


def test_ours_hears_the_tree_evict_by_its_own_lru_and_refreshes_what_it_moved() -> None:
    """After ``victim`` answers None the manager lets the tree evict by its own LRU: an untracked
    parent's snapshot goes and the leaf below now cascades through it. The policy hears it as an
    event (no sweep of every row): the next choice starts from rows that agree with the tree."""
    t = _Tree()
    pol = t.policy(HitDensity(exact_below=0, sample=4, batch=1))
    pol.costs(snapshot_bytes=100, kv_bytes_per_token=1)
    base = t.fresh()
    parent = t.add(base)  # a snapshot the policy was never told of
    child = t.add(np.concatenate([base, t.fresh()]))
    other = t.add(t.fresh())
    for i, n in enumerate((child, other)):
        pol.donated(n, _req(f"s{i}", float(i)), CAPTURE, float(i))
    for ts in (2.0, 3.0, 4.0):  # the child is used often: the other one is the one to go
        pol.touched(child, _req(f"h{ts}", ts), ts)
    before = pol._t.rows[pol._t.pos[child.id], 6]  # its bytes when dropped: its own 64 tokens
    for n in (child, other):
        t.cache.lock(n)
    assert pol.victim(5.0) is None
    t.cache.evict(snapshots=1)  # the tree's LRU: the parent, the one unlocked snapshot
    assert parent.snapshot is None
    for n in (child, other):
        t.cache.unlock(n)
    assert pol.freed_bytes(child, demote=False) > before, "the child's cascade now takes the parent's KV"
    assert pol.victim(6.0) is other
    for i, n in enumerate(pol._t.nodes):
        assert pol._t.rows[i, 6] == pol.freed_bytes(n, demote=False), n


def test_row_bookkeeping_invariants_detect_corruption() -> None:
    """Both policies that keep rows check them: positions, flags past the rows, stray changed ids,
    a row out of step with its entry."""
    t = _Tree()
    fe = FlopEfficiency(queue=2)
    t.policy(fe)
    hd = t.policy(HitDensity())
    nodes = [t.add(t.fresh()) for _ in range(3)]
    for i, n in enumerate(nodes):
        fe.donated(n, _req(f"s{i}", float(i)), CAPTURE, float(i))
        hd.donated(n, _req(f"s{i}", float(i)), CAPTURE, float(i))
    fe.check_invariants()
    hd.check_invariants()
    fe._t.pos[nodes[0].id] = 1
    _refuses(fe, "position says 1")
    fe._t.pos[nodes[0].id] = 0
    fe._t.rows[5, 2] = 1.0  # a candidate flag past the tracked rows
    _refuses(fe, "past the tracked ones")
    fe._t.rows[5, 2] = 0.0
    fe._changed.add(999)
    _refuses(fe, "changed but not tracked")
    hd._t.rows[0, 0] += 1.0  # a row not read yet: written from its entry before the next choice
    hd.check_invariants()
    hd._refresh_due()  # what every choice does first
    assert hd._t.rows[0, 0] == 0.0  # the entry's last use again
    hd._t.rows[0, 0] += 1.0  # the last use its row says, once written
    _refuses(hd, "out of step")


def _sessions(pol: HitDensity, count: int, turns: int, *, start: float = 0.0, gap: float = 10.0) -> None:
    """``count`` sessions of exactly ``turns`` requests, ``gap`` seconds apart."""
    for i in range(count):
        for k in range(turns):
            pol.admitted(_req(f"len{turns}-{start}-{i}", start + i * 0.01 + k * gap))


def test_ours_measures_how_often_sessions_go_on_after_each_request() -> None:
    pol = HitDensity()
    _sessions(pol, 8, 3)  # every session ends after its third request
    _sessions(pol, 8, 2, start=0.5)  # ... or its second
    assert pol.continuation(3) is None, "the last requests are not older than every think time yet"
    pol.admitted(_req("late", 100.0))  # every request above is settled now
    assert pol.continuation(1) == pytest.approx(1.0)
    assert pol.continuation(2) == pytest.approx(0.5, abs=0.01), "half the sessions went on after their second"
    assert pol.continuation(3) == pytest.approx(0.0)
    assert pol.continuation(4) is None and pol.continuation(0) is None, "no session seen at that count"
    few = HitDensity()
    _sessions(few, 7, 2)
    few.admitted(_req("late", 100.0))
    assert few.continuation(2) is None, "seven sessions are not evidence"
    before = pol.continuation(2)
    for bad, err in ((2.0, TypeError), ("2", TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(err, match="turns must be"):
            pol.continuation(bad)  # type: ignore[arg-type]
    assert pol.continuation(2) == before, "a refused query changes nothing"
    pol.check_invariants()
    pol._goes_on[2].total = 99.0
    _refuses(pol, "going on after request 2")
    pol._goes_on[2].total = 0.0
    pol._pending.extend([(0.0, "s", 1)] * (1 << 17))  # more than the sessions remembered
    _refuses(pol, "waiting to be settled")


def test_ours_evicts_the_final_state_of_a_session_where_sessions_end() -> None:
    """Sessions of three requests: a conversation's state after its third is dead weight, however
    soon its think time says a next turn would come; after its second it is due."""
    t = _Tree()
    pol = t.policy(HitDensity())
    _sessions(pol, 16, 3)
    now = 200.0
    for k in range(3):  # x makes its third request, y its second, 10 s apart like everyone
        pol.admitted(_req("x", now - 20.0 + k * 10.0))
        if k:
            pol.admitted(_req("y", now - 20.0 + k * 10.0))
    third, second = t.add(t.fresh()), t.add(t.fresh())
    pol.donated(third, _req("x", now), FINISH, now)
    pol.donated(second, _req("y", now), FINISH, now)
    assert pol.continuation(3) == pytest.approx(0.0) and pol.continuation(2) == pytest.approx(1.0)
    assert pol.density(third, now + 5.0) == 0.0 < pol.density(second, now + 5.0)
    est = pol.estimates(np.array([pol._t.pos[third.id], pol._t.pos[second.id]]), now + 5.0)
    assert est[0] == 0.0 < est[1], "the batched estimate reads the request count from the row"
    _evict(pol, now + 5.0)
    assert third.snapshot is None and second.snapshot is not None
    pol.check_invariants()
    t.cache.check_invariants()


def test_ours_refreshes_a_donors_dependents_before_the_next_choice() -> None:
    """A donation below a snapshot changes what evicting that snapshot frees (a leaf no more: its
    KV stays for the child). Its row is refreshed before anything reads it again: the batched
    estimate equals the exact density, and the next victim is chosen on the fresh row."""
    t = _Tree()
    pol = t.policy(HitDensity(exact_below=0))
    pol.costs(snapshot_bytes=500, kv_bytes_per_token=3)
    key = t.fresh()
    top = t.add(key)
    pol.donated(top, _req("a", 0.0), CAPTURE, 0.0)
    row = np.array([pol._t.pos[top.id]])
    assert np.isfinite(pol.estimates(row, 5.0, leaf=True)[0]), "a leaf: evictable for KV"
    below = t.add(np.concatenate([key, t.fresh()]))
    pol.donated(below, _req("b", 1.0), CAPTURE, 1.0)
    assert pol.freed_bytes(top, demote=False) == 500, "an inner snapshot frees its slot alone"
    est = pol.estimates(row, 5.0, leaf=False)
    assert est[0] == pytest.approx(pol.density(top, 5.0, demote=False), rel=1e-12), "read after a refresh"
    assert pol.estimates(row, 5.0, leaf=True)[0] == np.inf, "no longer a leaf"
    assert pol.victim(5.0, kv=True) is below, "for KV, the leaf below goes"
    pol.check_invariants()


def test_a_batched_estimate_of_a_conversation_past_every_think_time_is_its_density() -> None:
    """A final state whose conversation always went on (continuation 1.0) but is idle beyond every
    observed think time: the exact density says 0 (its conversation is over, it goes first), and
    so must the batched estimate (it was 0/0, NaN, and a NaN estimate is never chosen)."""
    t = _Tree()
    pol = t.policy(HitDensity(exact_below=0))
    _sessions(pol, 16, 3)
    now = 200.0
    for k in range(2):  # y makes its second request: every session went on after its second
        pol.admitted(_req("y", now - 10.0 + k * 10.0))
    node = t.add(t.fresh())
    pol.donated(node, _req("y", now), FINISH, now)
    assert pol.continuation(2) == pytest.approx(1.0)
    late = now + 10_000.0  # beyond every think time observed (10 s)
    assert pol.density(node, late) == 0.0
    with np.errstate(invalid="raise"):
        est = pol.estimates(np.array([pol._t.pos[node.id]]), late)
    assert est[0] == 0.0
