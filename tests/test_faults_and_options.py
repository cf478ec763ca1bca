"""Failures of code the manager calls (a store, a KV codec, a clock, a policy) and bad options of
every constructor: each is a typed error naming the value, or a miss, and nothing is left behind
(slots, locks, KV indices); the command line answers bad input with one line and exit status 2."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from linear_state import (
    DeviceUnavailable,
    LinearStatePool,
    PrecisionLoss,
    RequestOwner,
    StateLayout,
)
from radixcache import Admission, CacheManager, HybridRadixCache
from radixcache.cli import main
from radixcache.core.errors import AdmissionFailed
from radixcache.policies import HitDensity
from radixcache.testing.digest import state_digest
from radixcache.testing.engine import EngineRequest, ReferenceEngine, generate_cold
from radixcache.testing.model import HybridConfig, HybridModel
from radixcache.tiers.host import auto_host_pool
from radixcache.tiers.shared import SharedTier
from radixcache.tiers.store import MemoryStore, RedisStore, SharedStoreError

from .redis_server import RedisServer
from .test_shared_tier import _NoKV
from .tree_helpers import scribble

LAYOUT = StateLayout(2, (4, 3), (2, 4, 4))


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(HybridConfig())


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(500) for _ in range(300)]
    return [system + [rng.randrange(500) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def _published(model: HybridModel, store: Any) -> tuple[ReferenceEngine, list[list[int]]]:
    """A publisher filled ``store``; returns a fresh fetching replica and the prompts."""
    a = ReferenceEngine(model, shared_store=store, publisher="A")
    prompts = _prompts(2)
    for i, p in enumerate(prompts):
        a.submit(EngineRequest(f"a{i}", p, 3))
    a.run()
    assert a.manager.publish_pending(wait=True) > 0
    return ReferenceEngine(model, shared_store=store, publisher="B"), prompts


def _serve_exact(model: HybridModel, e: ReferenceEngine, prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        e.submit(EngineRequest(f"b{i}", p, 3))
    for r in e.run():
        assert r.output == generate_cold(model, r.prompt, 3)[0], r.rid


def _nothing_leaked(e: ReferenceEngine) -> None:
    e.manager.check_invariants()
    assert e.manager.num_requests == 0
    pool, cache = e.pool, e.cache
    assert pool.capacity - pool.num_free == cache.num_snapshots  # free + tree-owned == capacity
    assert e.kv.capacity - e.kv.num_free == cache.total_kv_tokens  # every KV index free or the tree's


# ------------------------------------------------------------ B: admission under failures
class _RaisingStore(MemoryStore):
    """A store whose calls raise an exception outside the SharedStore protocol."""

    def __init__(self, inner: MemoryStore, call: str, error: BaseException) -> None:
        super().__init__()
        self.blobs, self.indexes = inner.blobs, inner.indexes
        self.call, self.error = call, error

    def __getattribute__(self, name: str) -> Any:
        if name == object.__getattribute__(self, "call"):
            raise object.__getattribute__(self, "error")
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("call", ["depths", "exists", "get"])
def test_a_store_raising_outside_its_protocol_costs_a_hit_never_the_admission(model: HybridModel, call: str) -> None:
    store = MemoryStore()
    _, prompts = _published(model, store)
    b = ReferenceEngine(model, shared_store=_RaisingStore(store, call, ValueError("not a RedisError")), publisher="B")
    with pytest.warns(RuntimeWarning, match="outside the SharedStore protocol"):
        _serve_exact(model, b, prompts)
    assert b.shared is not None and b.shared.stats.errors >= 1 and b.shared.stats.hits == 0
    _nothing_leaked(b)


def test_a_non_integer_member_in_the_redis_depth_index_is_a_store_error(redis_server: RedisServer) -> None:
    import redis

    store = RedisStore(redis_server.url)
    r = redis.Redis.from_url(redis_server.url)
    r.zadd("radixcache:x:depths:y", {"not-a-depth": 5, "7": 7})
    with pytest.raises(SharedStoreError, match="non-integer member"):
        store.depths("radixcache:x:depths:y", 0, 10)
    r.close()
    store.close()


@pytest.mark.parametrize("how", ["too-few", "float", "2-d", "negative", "list"])
def test_a_kv_codec_returning_bad_indices_is_a_miss_and_nothing_leaks(model: HybridModel, how: str) -> None:
    store = MemoryStore()
    b, prompts = _published(model, store)

    def bad(data: bytes, n: int) -> Any:
        if how == "too-few":  # the host allocated, then answered out of contract: they go back to it
            return b.kv.alloc(n - 1)
        if how == "float":
            return torch.arange(n, dtype=torch.float32)
        if how == "2-d":
            return torch.arange(n).reshape(1, n)
        if how == "negative":
            return torch.full((n,), -1, dtype=torch.int64)
        return list(range(n))

    b.kv_codec.import_kv = bad  # type: ignore[method-assign, assignment]
    with pytest.warns(RuntimeWarning, match="import_kv"):
        _serve_exact(model, b, prompts)
    assert b.shared is not None and b.shared.stats.codec_errors >= 1 and b.shared.stats.hits == 0
    _nothing_leaked(b)


def _manager(**kw: Any) -> CacheManager:
    pool = LinearStatePool(LAYOUT, 16)
    return CacheManager(HybridRadixCache(pool), host_tier=None, **kw)


@pytest.mark.parametrize("bad", ["soon", math.nan, math.inf, None], ids=["str", "nan", "inf", "none"])
def test_a_clock_giving_no_finite_seconds_refuses_the_admission_and_changes_nothing(bad: object) -> None:
    mgr = _manager(clock=lambda: bad)
    before = state_digest(mgr)
    with pytest.raises((TypeError, ValueError), match="clock"):
        mgr.admit("r", [1, 2, 3])
    assert state_digest(mgr) == before
    mgr.check_invariants()
    for now in (math.nan, -math.inf):
        with pytest.raises(ValueError, match="finite"):
            mgr.admit("r", [1, 2, 3], now=now)
    assert state_digest(mgr) == before


class _FailingPolicy(HitDensity):
    def admitted(self, info: Any) -> None:
        raise ZeroDivisionError("a bug in a custom policy")


def test_a_policy_raising_during_admission_gives_back_every_slot_and_lock() -> None:
    mgr = _manager(policy=_FailingPolicy())
    free = mgr.pool.num_free
    with pytest.raises(AdmissionFailed, match="ZeroDivisionError") as info:
        mgr.admit("r", list(range(40)))
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert "r" not in mgr and mgr.pool.num_free == free
    assert mgr.metrics().admissions == 0
    mgr.check_invariants()


def test_a_failed_admission_after_a_hit_unlocks_the_hit() -> None:
    pool = LinearStatePool(LAYOUT, 16)
    mgr = CacheManager(HybridRadixCache(pool), host_tier=None)
    ids = list(range(40))
    adm = mgr.admit("a", ids)
    assert isinstance(adm, Admission)
    plan = mgr.plan_prefill("a", 40)
    scribble(pool, plan)
    mgr.commit(plan, None, kv_indices=torch.arange(40))
    mgr.finish("a")
    assert adm.cached_length == 0 and mgr.cache.num_snapshots > 0

    def touched(*args: object) -> None:
        raise RuntimeError("a bug in a custom policy")

    mgr.policy.touched = touched  # type: ignore[method-assign, assignment]
    with pytest.raises(AdmissionFailed):
        mgr.admit("b", [*ids, 99])
    mgr.check_invariants()  # no node is left locked by the failed admission
    assert mgr.cache.evictable_snapshots == mgr.cache.num_snapshots


# ------------------------------------------------------------------ C-F: options
@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"ttl_s": 0}, ValueError, "ttl_s"),
        ({"ttl_s": -5}, ValueError, "ttl_s"),
        ({"ttl_s": 0.0004}, ValueError, "ttl_s"),
        ({"ttl_s": math.inf}, ValueError, "ttl_s"),
        ({"timeout_s": -1}, ValueError, "timeout_s"),
        ({"timeout_s": "x"}, ValueError, "timeout_s"),
        ({"timeout_s": 0}, ValueError, "timeout_s"),
    ],
)
def test_redis_store_options_are_checked_at_construction(kw: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RedisStore("redis://127.0.0.1:1/0", **kw)
    with pytest.raises(ValueError, match="url"):
        RedisStore("notaurl")


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"retry_s": "1"}, ValueError, "retry_s.*'1'"),
        ({"retry_s": math.nan}, ValueError, "retry_s"),
        ({"clock": 5}, TypeError, "clock"),
        ({"publisher": ""}, ValueError, "publisher"),
        ({"secret": b"x" * 65}, ValueError, "secret"),
    ],
)
def test_shared_tier_options_are_checked_at_construction(kw: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SharedTier(MemoryStore(), model="m", kv=_NoKV(), **kw)


def test_one_shared_tier_serves_one_manager() -> None:
    tier = SharedTier(MemoryStore(), model="m", kv=_NoKV())
    _manager(shared=tier)
    policy = HitDensity()
    pool = LinearStatePool(LAYOUT, 16)
    cache = HybridRadixCache(pool)
    with pytest.raises(RuntimeError, match="another manager"):
        CacheManager(cache, policy, shared=tier, host_tier=None)
    assert getattr(policy, "cache", None) is None  # refused before anything was bound


def test_one_tree_is_served_by_one_manager() -> None:
    """A second manager on a tree the first serves would evict, lock and restore behind the first
    one's requests: refused before anything is bound."""
    pool = LinearStatePool(LAYOUT, 16)
    cache = HybridRadixCache(pool)
    first = CacheManager(cache, host_tier=None)
    assert cache.client is first
    policy = HitDensity()
    with pytest.raises(RuntimeError, match="one manager per tree"):
        CacheManager(cache, policy, host_tier=None)
    assert getattr(policy, "cache", None) is None and cache.client is first
    first.check_invariants()


def test_no_progress_in_the_environment_silences_the_bars(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from radixcache.progress import progress_callback

    monkeypatch.setenv("RADIXCACHE_NO_PROGRESS", "1")
    update, close = progress_callback(3, "quiet")
    for i in range(3):
        update(i)
    close()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RADIXCACHE_NO_PROGRESS", "0")
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain counter, whatever is installed
    update, close = progress_callback(3, "loud")
    update(2)
    close()
    assert "loud: 3/3 steps" in capsys.readouterr().err
    update, close = progress_callback(2, "fuzz", "example")
    update(1)
    close()
    assert "fuzz: 2/2 examples" in capsys.readouterr().err
    with pytest.raises(TypeError, match="unit must be a str, got int 3"):
        progress_callback(2, "fuzz", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unit must name"):
        progress_callback(2, "fuzz", "")


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"clock": 5}, TypeError, "clock"),
        ({"stream": object()}, TypeError, "stream"),
        ({"forensics": "on"}, ValueError, "forensics"),
        ({"forensics": 1}, TypeError, "forensics"),
        ({"kv_bytes_per_token": 0}, ValueError, "kv_bytes_per_token"),
        ({"host_tier": "auto", "host_budget_bytes": 2**60}, ValueError, "memory"),
    ],
)
def test_a_manager_constructor_that_raises_binds_and_attaches_nothing(
    kw: dict[str, Any], error: type, match: str
) -> None:
    pool = LinearStatePool(LAYOUT, 16)
    cache = HybridRadixCache(pool)
    policy = HitDensity()
    tier = SharedTier(MemoryStore(), model="m", kv=_NoKV())
    with pytest.raises(error, match=match):
        CacheManager(cache, policy, shared=tier, **{"host_tier": None, **kw})
    assert getattr(policy, "cache", None) is None and tier.layout is None and tier.client is None
    assert cache.host_pool is None
    CacheManager(cache, policy, shared=tier, host_tier=None)  # all three still usable


def test_a_host_budget_above_physical_memory_is_refused() -> None:
    with pytest.raises(ValueError, match="memory"):
        auto_host_pool(LinearStatePool(LAYOUT, 2), 2**60)


def test_commit_refuses_negative_kv_indices_and_changes_nothing() -> None:
    mgr = _manager()
    mgr.admit("r", list(range(10)))
    plan = mgr.plan_prefill("r", 10)
    before = state_digest(mgr)
    for kv in (torch.arange(-1, 9), np.arange(-5, 5), [-1] * 10):
        with pytest.raises(ValueError, match="negative"):
            mgr.commit(plan, None, kv_indices=kv)
    assert state_digest(mgr) == before
    mgr.commit(plan, None, kv_indices=torch.arange(10))
    small = mgr.plan_decode("r", [5])
    with pytest.raises(ValueError, match="negative"):
        mgr.commit(small, None, kv_indices=[-3])
    mgr.check_invariants()


def test_shared_ids_outside_the_id_range_are_refused() -> None:
    tier = SharedTier(MemoryStore(), model="m", kv=_NoKV())
    tier.bind(LAYOUT)
    for ids in (np.array([1, -2, 3]), np.array([1, 2**31])):
        with pytest.raises(ValueError, match=r"outside \[0, 2\*\*31\)"):
            tier.key(ids, None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_a_pool_write_never_narrows_a_state_silently(dtype: torch.dtype) -> None:
    layout = StateLayout(2, (4, 3), (2, 4, 4), conv_dtype=torch.float32, recurrent_dtype=torch.float32)
    pool = LinearStatePool(layout, 2)
    owner = RequestOwner("r")
    s = pool.alloc(owner)
    before = pool.fingerprint(s)
    with pytest.raises(PrecisionLoss, match=str(dtype)):
        pool.write(s, torch.ones(2, 4, 3, dtype=dtype), torch.ones(2, 2, 4, 4), owner=owner)
    assert pool.fingerprint(s) == before
    pool.write(s, torch.ones(2, 4, 3, dtype=torch.bfloat16), torch.ones(2, 2, 4, 4), owner=owner).wait()  # widening


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_on_a_machine_without_cuda_is_a_typed_error() -> None:
    from radixcache.hf import HFStateBridge, tiny_config

    with pytest.raises(DeviceUnavailable, match="CUDA is not available"):
        LinearStatePool(LAYOUT, 2, device="cuda")
    with pytest.raises(DeviceUnavailable, match="CUDA is not available"):
        HFStateBridge(tiny_config("qwen3_next"), device="cuda")
    with pytest.raises(DeviceUnavailable, match="unknown device"):
        LinearStatePool(LAYOUT, 2, device="tpu")


@pytest.mark.parametrize("kw", [{"max_running": 0}, {"chunk": 0}, {"kv_tokens": -1}, {"host_slots": -2}])
def test_hf_engine_counts_are_checked_before_anything_is_built(kw: dict[str, Any]) -> None:
    from radixcache.hf import tiny_config
    from radixcache.testing.hf_engine import HFEngine

    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        HFEngine(object(), tiny_config("qwen3_next"), **kw)


# ------------------------------------------------------------------ H: the command line
BAD_COMMANDS = [
    ["hammer", "--replica", "3/2"],
    ["hammer", "--replica", "x"],
    ["hammer", "--device", "tpu"],
    ["hammer", "--model", "hf:nope"],
    ["hammer", "--shared-redis", "notaurl"],
    ["hammer", "--forensics", "/dev/null/ledger.jsonl"],
    ["hammer", "--host-slots", "-5"],
    ["hammer", "--requests", "-1"],
    ["hammer", "--concurrency", "0"],
    ["hammer", "--chunk", "0"],
    ["hammer", "--logit-tol", "-1"],
    ["hammer", "--forward-delay-us", "nan"],
    ["stress", "--slots", "0"],
    ["stress", "--count", "-5"],
    ["bench-trace", "/nonexistent/trace.jsonl"],
    ["bench-trace", "chat", "--budget", "-1"],
    ["make-trace", "chat", "/dev/null/trace.jsonl"],
    ["policies-report", "--host-factor", "-1"],
    ["fuzz", "--examples", "0"],
    ["misuse", "--steps", "0"],
    ["forensics", "/nonexistent/ledger.jsonl"],
]


@pytest.mark.parametrize("argv", BAD_COMMANDS, ids=[" ".join(a) for a in BAD_COMMANDS])
def test_a_bad_flag_or_input_is_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code: int | str | None
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code  # argparse's own refusal
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err and not out, (out, err)
    assert argv[0] in lines[0]  # names the command


def test_forensics_of_a_garbage_ledger_is_an_error_never_an_all_clear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "ledger.jsonl"
    garbage.write_text("this is not a ledger\n")
    assert main(["forensics", str(garbage)]) == 2
    out, err = capsys.readouterr()
    assert "findings: none" not in out and "ledger.jsonl:1" in err


# ------------------------------------------------------------------ the faulty store and codec
def test_the_faulty_store_commits_each_fault_and_counts_it() -> None:
    from radixcache.testing.faults import FaultyStore

    for bad in (-0.1, 1.5, "x", True):
        with pytest.raises(ValueError, match="probability"):
            FaultyStore(corrupt=bad)  # type: ignore[arg-type]
    s = FaultyStore(corrupt=1.0, misplace=1.0)
    assert s.put("a", b"blob-a") and s.put("b", b"blob-b")
    assert s.faults.misplaced == 1 and s.blobs["a"] == b"blob-b"  # b's put also landed under a
    got = s.get("b")
    assert got is not None and got != b"blob-b" and len(got) == 6 and s.faults.corrupted == 1
    assert s.faults.served_bad == {"b"}
    with pytest.raises(SharedStoreError):
        FaultyStore(fail=1.0).get("a")
    with pytest.raises(RuntimeError, match="outside the protocol"):
        FaultyStore(foreign=1.0).depths("i", 0, 5)
    dropping = FaultyStore(drop=1.0)
    dropping.put("k", b"v")
    assert dropping.get("k") is None and dropping.faults.dropped == 1


def test_every_blob_a_corrupting_store_hands_out_is_refused(model: HybridModel) -> None:
    from radixcache.testing.faults import FaultyStore

    clean = MemoryStore()
    _, prompts = _published(model, clean)
    store = FaultyStore(clean, seed=3, corrupt=1.0)  # the same server, read through a bad link
    b = ReferenceEngine(model, shared_store=store, publisher="B", forensics_ledger=None)
    _serve_exact(model, b, prompts)
    assert b.shared is not None
    assert store.faults.corrupted >= 1 and b.shared.stats.hits == 0
    assert sum(b.shared.stats.rejected.values()) == store.faults.corrupted  # each one refused
    assert store.faults.rejected_bad == store.faults.corrupted and store.faults.accepted_bad == 0
    _nothing_leaked(b)


def test_the_faulty_codec_gives_back_what_it_left_out() -> None:
    from radixcache.testing.faults import FaultyCodec

    freed: list[list[int]] = []

    codec = FaultyCodec(_NoKV(), seed=0, p=1.0, free=lambda t: freed.append(t.tolist()))
    outcomes: set[object] = set()
    for _ in range(40):
        try:
            got = codec.import_kv(b"", 5)
        except RuntimeError:
            outcomes.add("raised")
            continue
        assert got is not None
        outcomes.add((str(got.dtype), tuple(got.shape)))
    assert outcomes == {"raised", ("torch.int64", (4,)), ("torch.float32", (5,)), ("torch.int64", (1, 5))}
    assert freed and all(f == [4] for f in freed)  # the index left out went back to the host
    with pytest.raises(ValueError, match="probability"):
        FaultyCodec(_NoKV(), p=2.0)
