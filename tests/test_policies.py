from pathlib import Path

import numpy as np
import pytest
import torch

from linear_state import LinearStatePool, RequestOwner, StateLayout
from radixcache import HybridRadixCache
from radixcache.bench_trace import markdown_table, run_grid, write_report
from radixcache.cli import main
from radixcache.policies import POLICIES, AlignLastBlock, BranchFlop, Ours, RequestInfo, TrackAndFinish, make_policy
from radixcache.policies.branch_flop import UtilityHeap
from radixcache.replay import PRESETS, replay
from radixcache.traces import TraceRecord, generate, read_trace, write_trace
from radixcache.tree import TreeNode

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
    req = RequestInfo(prompt_len=2200, hit=0, branch=1500, session="s", ts=0.0)
    assert AlignLastBlock(512).captures(req, 0, 2048, decode=False) == [2048]
    assert AlignLastBlock(512).captures(req, 2048, 2200, decode=False) == []
    assert TrackAndFinish().captures(req, 2048, 2200, decode=False) == [2176]
    assert BranchFlop().captures(req, 0, 2048, decode=False) == [1500]
    assert Ours(512).captures(req, 0, 2048, decode=False) == [1500, 2048]
    assert Ours(512).captures(req, 2048, 2200, decode=False) == [2199]
    short = RequestInfo(prompt_len=40, hit=0, branch=0, session="s", ts=0.0)
    assert AlignLastBlock(512).captures(short, 0, 40, decode=False) == [], "below one block: nothing"
    assert Ours().captures(short, 0, 40, decode=False) == [39]
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lru-ish")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_replay_respects_the_budget_and_conserves(policy: str) -> None:
    budget = 2 * GiB
    res = replay(generate("edge")[:90], make_policy(policy), Q, budget)
    assert res.requests == 90 and 0 <= res.hit_tokens <= res.prompt_tokens
    assert 0.0 <= res.token_hit_rate <= 1.0 and 0.0 <= res.flops_saved_fraction <= 1.0
    assert res.snapshots_donated > 0


def test_every_edge_case_hits_under_ours() -> None:
    res = replay(generate("edge"), make_policy("ours"), Q, 4 * GiB)
    for kind, (hit, _total) in res.per_session_kind.items():
        assert hit > 0, f"{kind}: no hit under ours"
    base = replay(generate("edge"), make_policy("align-last-block"), Q, 4 * GiB)
    assert base.per_session_kind["short"][0] == 0, "align-last-block cannot hit below one block"
    assert base.per_session_kind["midblock"][0] == 0, "nor a shared prefix ending mid-block"


def test_ours_keeps_live_prefixes_on_fanout() -> None:
    trace = generate("fanout")[:300]
    ours = replay(trace, make_policy("ours"), Q, 4 * GiB)
    lru = replay(trace, make_policy("track-and-finish"), Q, 4 * GiB)
    assert ours.token_hit_rate > lru.token_hit_rate


def test_budget_below_one_snapshot_is_refused() -> None:
    with pytest.raises(ValueError, match="below one snapshot"):
        replay([TraceRecord("s", 0, 0.0, [1, 2, 3], [4])], make_policy("ours"), Q, 1000)


def test_report_table_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_grid([("edge", generate("edge")[:60])], ["ours", "branch-flop"], lambda _: (1.0, 2.0))
    table = markdown_table(rows)
    assert table.count("\n") == 3 and "ours: hit / FLOPs saved" in table and "**" in table
    doc = tmp_path / "policies.md"
    doc.write_text("intro\n<!-- policies-report:begin -->\nold\n<!-- policies-report:end -->\noutro\n")
    write_report(rows, doc, tmp_path / "p.png")
    text = doc.read_text()
    assert text.startswith("intro") and text.rstrip().endswith("outro") and "old" not in text
    assert (tmp_path / "policies.json").exists()
    write_trace(generate("edge")[:30], tmp_path / "e.jsonl")
    assert main(["bench-trace", str(tmp_path / "e.jsonl"), "--policy", "ours", "--budget", "1"]) == 0
    assert '"policy": "ours"' in capsys.readouterr().out


class _Tree:
    """A tree whose sequences are distinct 64-token keys under an optional shared prefix."""

    def __init__(self) -> None:
        self.pool = LinearStatePool(StateLayout(1, (1, 1), (1,)), 64)
        self.cache = HybridRadixCache(self.pool)
        self.slot = self.pool.alloc(RequestOwner("donor"))
        self.rng = np.random.default_rng(0)

    def add(self, key: np.ndarray) -> TreeNode:
        return self.cache.insert(key, torch.arange(len(key)), state_slot=self.slot).node

    def fresh(self, n: int = 64) -> np.ndarray:
        return self.rng.integers(0, 1 << 20, n).astype(np.int32)


def test_utility_heap_keeps_a_locked_node_ranked() -> None:
    t, heap = _Tree(), UtilityHeap()
    low, high = t.add(t.fresh()), t.add(t.fresh())
    heap.push(low, 1.0)
    heap.push(high, 2.0)
    t.cache.lock(low)  # a running request restores from it: not evictable now
    assert heap.pop_evictable() is high
    t.cache.unlock(low)
    assert heap.pop_evictable() is low, "the locked node must still be a candidate once unlocked"
    assert heap.pop_evictable() is None
