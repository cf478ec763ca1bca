"""The host protocol of CacheManager: the policy inside, decode-time captures, all-or-nothing
admission and its dry run, KV pressure, metrics, and the single-thread guard."""

import ast
import functools
import importlib
import itertools
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from linear_state import LinearStatePool
from radixcache import (
    CacheManager,
    ConcurrentUseError,
    HitDensity,
    HybridRadixCache,
    ProtocolError,
    Refusal,
    TreeNode,
    UnknownRequest,
    free_kv_to,
)
from radixcache.policies import DonationReason, FixedPoints, Policy, RequestInfo
from radixcache.testing.digest import state_digest

from .host_sim import LAYOUT, Host
from .tree_helpers import scribble

RNG = np.random.default_rng(99)


def tokens(n: int) -> list[int]:
    return [int(x) for x in RNG.integers(0, 5000, n)]


def serve(h: Host, rid: Hashable, prompt: list[int], answer: list[int], session: Hashable = None) -> int:
    """Admit, prefill, decode ``answer`` one token per window, finish. Returns the hit."""
    r = h.admit(rid, prompt, session=session)
    assert r is not None
    assert r.restored_ok, f"{rid}: restored state differs from the cold state at {r.adm.cached_length}"
    h.prefill(rid)
    for t in answer:
        h.decode(rid, [t])
    assert h.final_state_ok(rid)
    h.finish(rid)
    h.forward.synchronize()
    h.copies.synchronize()
    h.check_kv()
    h.mgr.check_invariants()
    return r.adm.cached_length


@pytest.mark.parametrize("page", [1, 16, 64])
def test_next_turn_hits_the_deepest_page_aligned_depth_of_prompt_and_answer(page: int) -> None:
    h = Host(page_size=page, policy=HitDensity(block=64), track_slots=3)
    turn1, answer = tokens(301), tokens(50)
    assert serve(h, "t1", turn1, answer, session="chat") == 0
    fed = len(turn1) + len(answer)
    hit = serve(h, "t2", turn1 + answer + tokens(40), tokens(3), session="chat")
    assert hit >= fed // page * page, f"page {page}: turn 2 hit {hit} of the {fed} tokens turn 1 computed"
    m = h.mgr.metrics()
    assert m.donations["finish"] >= 1  # turn 1 (turn 2 may end off the page grid)
    if page > 1:
        assert m.captures_planned["final"] >= 1


def test_no_decode_capture_when_the_policy_keeps_no_final_state() -> None:
    class NoFinal(FixedPoints):
        def donate_finish(self, req: RequestInfo) -> bool:
            return False

    h = Host(page_size=16, policy=NoFinal(64))
    serve(h, "a", tokens(100), tokens(40))
    m = h.mgr.metrics()
    assert m.captures_planned["final"] == 0
    assert m.donations["finish"] == 0 and m.donations_skipped["declined"] == 0


def _two_live_one_snapshot() -> Host:
    """8 slots: two live requests hold 6, the tree keeps 2 snapshots (one evictable)."""
    h = Host(slots=8, track_slots=2)
    serve(h, "donor", tokens(100), [])
    assert h.cache.num_snapshots == 3
    for rid in ("a", "b"):
        assert h.admit(rid, tokens(30)) is not None
    assert h.pool.num_free == 0 and h.cache.num_snapshots == 2
    return h


def test_a_refused_admission_changes_nothing_not_even_an_eviction() -> None:
    h = _two_live_one_snapshot()
    before = state_digest(h.mgr, metrics=False)
    res = h.mgr.admit("c", tokens(40))
    assert isinstance(res, Refusal) and res.slots_needed == 3 and res.slots_available == 2
    assert state_digest(h.mgr, metrics=False) == before, "a refused admission changed tree, pool or policy"
    assert h.mgr.metrics().refusals == 1


def test_the_dry_run_changes_nothing_and_agrees_with_admit() -> None:
    h = Host(slots=12)
    shared = tokens(200)
    serve(h, "donor", shared + tokens(20), [])
    before = state_digest(h.mgr)
    check = h.mgr.can_admit(shared + tokens(5))
    assert check.admissible and check.cached_length == 192 and check.token_length == 200
    assert state_digest(h.mgr) == before, "can_admit refreshed recency or changed state"
    adm = h.mgr.admit("x", shared + tokens(5))
    assert not isinstance(adm, Refusal) and adm.cached_length == check.cached_length
    h.mgr.abort("x")


def test_admission_evicts_through_the_policy_only_when_it_succeeds() -> None:
    asked: list[float] = []

    class Spy(FixedPoints):
        def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
            asked.append(now)
            return None  # the tree's LRU

    h = Host(slots=8, track_slots=2, policy=Spy(64))
    serve(h, "donor", tokens(100), [])
    h.admit("a", tokens(30))
    assert h.admit("b", tokens(30)) is not None, "b needs one eviction, and gets it"
    assert len(asked) == 1
    assert h.mgr.admit("c", tokens(30)).admitted is False
    assert len(asked) == 1, "a refused admission asked the policy for a victim"


class _Chooser(FixedPoints):
    """Evicts the node the test names, else the tree's LRU."""

    def __init__(self) -> None:
        super().__init__(64)
        self.pick: TreeNode | None = None
        self.kv_asked = 0

    def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
        self.kv_asked += kv
        node, self.pick = self.pick, None
        return node


def test_kv_pressure_evicts_leaves_in_the_policy_order_and_never_a_locked_path() -> None:
    pol = _Chooser()
    h = Host(slots=20, policy=pol)
    serve(h, "old", tokens(130), [])
    serve(h, "new", tokens(130), [])
    leaves = [n for n in h.cache.iter_nodes() if n.is_leaf]
    leaf = max(leaves, key=lambda n: n.last_access)  # the most recent: LRU would keep it
    pol.pick = leaf
    freed_before = len(h.kv_free)
    res = h.mgr.evict(kv_tokens=1)
    assert res.kv_tokens == leaf.num_tokens and leaf.parent is None, "the policy's leaf went, not the LRU one"
    assert len(h.kv_free) - freed_before == res.kv_tokens, "evicted KV reaches the host through on_free_kv"
    assert pol.kv_asked == 1
    live = h.admit("live", tokens(130))
    assert live is not None
    h.prefill("live")
    h.mgr.evict(kv_tokens=10**6)
    assert h.cache.evictable_kv_tokens == 0 and h.cache.protected_kv_tokens > 0, "the live path survived"
    assert all(n.kv_lock for n in h.cache.iter_nodes()), "only the live request's path is left"
    assert h.mgr.metrics().evictions["kv-pressure"] >= 2
    assert h.final_state_ok("live")
    h.finish("live")
    h.mgr.check_invariants()


def test_kv_pressure_with_keep_never_takes_the_hit_the_dry_run_found() -> None:
    """The soak's find: making room for a request evicted the prefix it was going to hit, so the
    KV it needed grew between the dry run and the admission."""
    h = Host(slots=20, policy=HitDensity(block=64))
    shared = tokens(200)
    serve(h, "a", shared + tokens(10), [])
    serve(h, "other", tokens(200), [])  # more recent: an LRU-like order evicts `a`'s path first
    prompt = shared + tokens(20)
    check = h.mgr.can_admit(prompt)
    assert check.cached_length >= 128
    for n in h.cache.iter_nodes():  # make `a`'s path the policy's first choice
        n.last_access = 0 if n.depth <= len(shared) + 10 else n.last_access
    before = state_digest(h.mgr)
    with pytest.raises(ValueError, match="no ids"):
        h.mgr.evict(kv_tokens=1, keep=[])
    with pytest.raises(TypeError):
        h.mgr.evict(kv_tokens=1, keep=prompt, namespace=["unhashable"])  # type: ignore[arg-type]
    assert state_digest(h.mgr) == before, "a refused evict changed something"
    res = h.mgr.evict(kv_tokens=10**6, keep=prompt)
    assert res.kv_tokens > 0, "everything else went"
    assert h.mgr.can_admit(prompt).cached_length == check.cached_length, "the kept hit was evicted"
    assert h.cache.protected_kv_tokens == 0, "the lock taken for the eviction was released"
    h.mgr.evict(kv_tokens=10**6)
    assert h.mgr.can_admit(prompt).cached_length == 0, "without keep= the hit is evictable"
    h.mgr.check_invariants()


def test_a_policy_choosing_a_locked_victim_is_reported() -> None:
    pol = _Chooser()
    h = Host(slots=20, policy=pol)
    p = tokens(100)
    serve(h, "a", p, [])
    h.admit("b", p[:64] + tokens(10))
    locked = next(n for n in h.cache.iter_nodes() if n.snap_lock)
    pol.pick = locked
    with pytest.raises(RuntimeError, match="not an evictable"):
        h.mgr.evict(snapshots=1)


def test_metrics_count_what_happened() -> None:
    h = Host(slots=16, policy=FixedPoints(64))
    p = tokens(200)
    serve(h, "a", p, tokens(5))
    serve(h, "b", p, [])
    m = h.mgr.metrics()
    assert (m.admissions, m.refusals, m.hits, m.restores) == (2, 0, 1, 1)
    assert m.prompt_tokens == 400 and m.hit_tokens == 199 and m.hit_rate == 199 / 400
    # a: the re-send point 199 and 128 (two track slots; 64 is dropped); b hit 199: nothing left
    assert m.captures_planned == {"prefill": 2, "decode": 0, "final": 0}
    # a donates 128 and 199, then its final state (205); b its final state (200)
    assert m.donations == {"capture": 2, "finish": 2}
    assert m.snapshots_held == h.cache.num_snapshots and m.live_requests == 0
    assert m.snapshot_bytes_held == m.snapshots_held * LAYOUT.slot_bytes
    d = m.as_dict()
    assert d["donations"] == {"capture": 2, "finish": 2} and d["hit_rate"] == m.hit_rate


def test_prometheus_export() -> None:
    prom = pytest.importorskip("prometheus_client")
    from radixcache import register_prometheus

    h = Host()
    serve(h, "a", tokens(100), [])
    registry = prom.CollectorRegistry()
    register_prometheus(h.mgr.metrics, registry=registry)
    text = prom.generate_latest(registry).decode()
    assert "radixcache_admissions_total 1.0" in text
    assert 'radixcache_donations_total{reason="finish"} 1.0' in text
    assert f"radixcache_snapshots_held {float(h.cache.num_snapshots)}" in text


def test_a_second_thread_gets_a_clear_error_and_changes_nothing() -> None:
    entered, release = threading.Event(), threading.Event()

    class Slow(FixedPoints):
        def admitted(self, req: RequestInfo) -> None:
            entered.set()
            assert release.wait(10)

    h = Host(policy=Slow(64))
    t = threading.Thread(target=lambda: h.mgr.admit("first", tokens(50)))
    t.start()
    assert entered.wait(10)
    try:
        with pytest.raises(ConcurrentUseError, match="not thread-safe"):
            h.mgr.admit("second", tokens(50))
        with pytest.raises(ConcurrentUseError):
            h.mgr.evict(snapshots=1)
    finally:
        release.set()
        t.join()
    assert "first" in h.mgr and "second" not in h.mgr
    h.mgr.check_invariants()


def test_a_callback_re_entering_the_manager_is_refused() -> None:
    pool = LinearStatePool(LAYOUT, 12)
    seen: list[BaseException] = []
    holder: list[CacheManager] = []

    def on_free_kv(t: torch.Tensor) -> None:
        try:
            holder[0].evict(snapshots=1)
        except ConcurrentUseError as exc:
            seen.append(exc)

    mgr = CacheManager(HybridRadixCache(pool, on_event=free_kv_to(on_free_kv)), FixedPoints(64))
    holder.append(mgr)
    adm = mgr.admit("a", list(range(100)))
    assert adm.admitted
    plan = mgr.plan_prefill("a", 100)
    scribble(pool, plan)
    mgr.commit(plan, None, kv_indices=torch.arange(100))
    mgr.finish("a")
    mgr.evict(kv_tokens=10**6)  # releases KV through the callback, which tries to re-enter
    assert seen, "the re-entrant call was not refused"


def test_every_policy_is_notified_in_order() -> None:
    calls: list[str] = []

    class Log(Policy):
        name = "log"

        def admitted(self, req: RequestInfo) -> None:
            calls.append(f"admitted hit={req.cached_length}")

        def touched(self, node: TreeNode, req: RequestInfo, now: float) -> None:
            calls.append(f"touched {node.depth}")

        def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
            calls.append(f"captures {start} {end} {decode}")
            return [64] if start < 64 <= end else []

        def donate_finish(self, req: RequestInfo) -> bool:
            calls.append("donate_finish")
            return True

        def donated(self, node: TreeNode, req: RequestInfo, reason: DonationReason, now: float) -> None:
            calls.append(f"donated {node.depth} {reason.value}")

    h = Host(policy=Log())
    p = tokens(100)
    serve(h, "a", p, [7])
    serve(h, "b", [*p, 7, *tokens(3)], [])
    assert calls == [
        "admitted hit=0",
        "captures 0 100 False",
        "donated 64 capture",
        "captures 100 101 True",
        "donate_finish",
        "donated 101 finish",
        "admitted hit=101",
        "touched 101",
        "captures 101 104 False",
        "donate_finish",
        "donated 104 finish",
    ]


def test_replay_uses_the_managers_public_api_only() -> None:
    replay_module = importlib.import_module("radixcache.simulator.replay")
    tree = ast.parse(Path(str(replay_module.__file__)).read_text(encoding="utf-8"))
    private = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
    ]
    assert private == [], f"replay reaches into private names: {private}"


def test_host_sim_restores_are_exact_under_hit_density() -> None:
    h = Host(policy=HitDensity(block=64), slots=24)
    base = tokens(300)
    for i in range(6):
        prompt = base[: 64 * (i % 4) + 50] + tokens(30)
        serve(h, i, prompt, tokens(4), session=i % 2)
    assert h.mgr.metrics().hits >= 3


def _decode_both_ways(page: int) -> tuple[Host, Host]:
    """The same three conversations on two hosts: one decodes request by request, the other in
    batches; then a next turn on each."""
    hosts = (
        Host(page_size=page, policy=HitDensity(block=64), slots=24),
        Host(page_size=page, policy=HitDensity(block=64), slots=24),
    )
    for h in hosts:  # the same clock for both: the policy's timestamps are part of the digest
        h.mgr.clock = functools.partial(next, map(float, itertools.count()))
    prompts = [tokens(90 + 7 * i) for i in range(3)]
    answers = [tokens(21) for _ in range(3)]
    for k, h in enumerate(hosts):
        for i, p in enumerate(prompts):
            assert h.admit(i, p, session=f"s{i}") is not None
            h.prefill(i)
        for step in range(21):
            if k == 0:
                for i in range(3):
                    h.decode(i, [answers[i][step]])
            else:
                h.decode_batch([0, 1, 2], [answers[i][step] for i in range(3)])
        for i in range(3):
            assert h.final_state_ok(i)
            h.finish(i)
        h.forward.synchronize()
        h.copies.synchronize()
        h.check_kv()
        h.mgr.check_invariants()
    return hosts


@pytest.mark.parametrize("page", [1, 16])
def test_decode_batch_does_what_single_windows_do(page: int) -> None:
    single, batched = _decode_both_ways(page)
    # policies key their state by node id, and node ids differ between two caches: compared apart
    assert state_digest(single.mgr, policy=False) == state_digest(batched.mgr, policy=False)
    assert len(single.mgr.policy.describe()["_entries"]) == len(batched.mgr.policy.describe()["_entries"])  # type: ignore[arg-type]
    assert single.mgr.metrics() == batched.mgr.metrics()
    if page > 1:
        assert batched.mgr.metrics().captures_planned["final"] > 0, "the batch planned held-back final captures"


def test_decode_batch_is_all_or_nothing() -> None:
    h = Host()
    for rid in ("a", "b"):
        assert h.admit(rid, tokens(40)) is not None
        h.prefill(rid)
    h.forward.synchronize()  # the digest fingerprints slots: let pending device work land first
    h.copies.synchronize()
    before = state_digest(h.mgr)
    with pytest.raises(UnknownRequest):
        h.mgr.plan_decode_batch(["a", "nobody"], [1, 2])
    with pytest.raises(ValueError, match="twice"):
        h.mgr.plan_decode_batch(["a", "a"], [1, 2])
    with pytest.raises(ValueError, match="not an int"):
        h.mgr.plan_decode_batch(["a", "b"], [1, -2])
    with pytest.raises(ValueError, match="2 requests but 1 ids"):
        h.mgr.plan_decode_batch(["a", "b"], [1])
    assert state_digest(h.mgr) == before, "a refused batch planned some of its requests"
    batch = h.mgr.plan_decode_batch(["a", "b"], [1, 2])
    planned = state_digest(h.mgr)
    with pytest.raises(ProtocolError, match="decode batch"):
        h.mgr.plan_decode("a", [3])
    with pytest.raises(ValueError, match="entries for a window of 2 tokens"):
        h.mgr.commit_batch(batch, None, kv_indices=torch.arange(3))
    with pytest.raises(TypeError, match="DecodeBatchPlan"):
        h.mgr.commit_batch(list(batch), None, kv_indices=torch.arange(2))  # type: ignore[arg-type]
    assert state_digest(h.mgr) == planned
    h.mgr.commit_batch(batch, None, kv_indices=torch.arange(1000, 1002))
    with pytest.raises(ProtocolError, match="not open"):
        h.mgr.commit_batch(batch, None, kv_indices=torch.arange(2))
    h.kv_next = 1002
    h.mgr.abort("a")
    h.mgr.abort("b")
    h.reqs.clear()
    h.mgr.check_invariants()


def test_a_decode_batchs_free_kv_is_the_concatenation_of_its_requests_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """DecodeBatchResult.free_kv is every per-request WindowResult.free_kv, concatenated in the
    order of results: a host frees one or the other, never both. (Each request's commit is made
    to free two indices of its own, so the contract is checked with something to free.)"""
    h = Host(page_size=16, policy=HitDensity(block=64), slots=24)
    rids = ["a", "b", "c"]
    for rid in rids:
        assert h.admit(rid, tokens(90), session=rid) is not None  # one length: captures in the same steps
        h.prefill(rid)
    real = CacheManager._apply_commit

    def freeing(self: CacheManager, rec: Any, plan: Any, *args: Any) -> Any:
        out = real(self, rec, plan, *args)
        base = 10_000 + 10 * ord(str(rec.rid)[0])
        return out._replace(free_kv=torch.tensor([base, base + 1]))

    monkeypatch.setattr(CacheManager, "_apply_commit", freeing)
    checked = 0
    for step in range(40):
        batch = h.mgr.plan_decode_batch(rids, [step + 1] * 3)
        res = h.mgr.commit_batch(batch, None, kv_indices=h.alloc_kv(3))
        assert set(res.results) == set(batch.plans)
        if res.results:
            parts = [one.free_kv for one in res.results.values()]
            assert torch.equal(res.free_kv, torch.cat(parts))
            checked += len(res.results) > 1
    assert checked, "no decode step committed captures of two requests: the test checked nothing"


def test_eviction_reasons_name_the_call_that_evicted() -> None:
    """evict(kv_tokens=) counts kv-pressure (leaves dropped for KV); evict(snapshots=) counts host."""
    h = Host(slots=20)
    for rid in range(3):
        serve(h, rid, tokens(70), [])
    ev = dict(h.mgr.metrics().evictions)
    h.mgr.evict(snapshots=1)
    after = dict(h.mgr.metrics().evictions)
    assert after["host"] == ev["host"] + 1 and after["kv-pressure"] == ev["kv-pressure"]
    h.mgr.evict(kv_tokens=1)
    last = dict(h.mgr.metrics().evictions)
    assert last["kv-pressure"] > after["kv-pressure"] and last["host"] == after["host"]
    h.mgr.check_invariants()
