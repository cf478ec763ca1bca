"""The SGLang backend against SGLang 0.5.23 itself: plugin registration, SGLang's own mamba unit
test scenarios on our backend, and the differential harness against SGLang's built-in cache."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed here (CI runs these in their own venv)")

import torch
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from radixcache.forensics import SAMPLED
from radixcache.sglang import BACKEND_NAME
from radixcache.sglang import plugin as rc_plugin
from radixcache.sglang.backend import RadixcacheHybridCache

from . import harness as H  # noqa: N812


def test_sglangs_plugin_loader_resolves_our_backend_name_to_our_factory() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.plugins import load_plugins

    load_plugins()  # reads the sglang.srt.plugins entry points, as every SGLang process does
    assert get_radix_cache_factory(BACKEND_NAME) is rc_plugin.factory
    rc_plugin.register()  # a second load changes nothing
    assert get_radix_cache_factory(BACKEND_NAME) is rc_plugin.factory


def test_factory_refuses_what_it_does_not_serve_by_name() -> None:
    env = H.make_env("builtin")  # pools only; the factory never reaches them when it refuses
    ctx = H.build_context(SimpleNamespace(req_to_token_pool=env.rtp), speculative_algorithm="EAGLE")
    ctx.enable_hierarchical_cache = True
    with pytest.raises(NotImplementedError, match=r"hierarchical cache.*speculative decoding"):
        rc_plugin.factory(ctx)
    ctx.enable_hierarchical_cache, ctx.server_args.speculative_algorithm, ctx.is_hybrid_ssm = False, None, False
    with pytest.raises(NotImplementedError, match="without linear-attention state"):
        rc_plugin.factory(ctx)


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("enable_lmcache", True, "--enable-lmcache"),
        ("enable_flexkv", True, "--enable-flexkv"),
        ("enable_session_radix_cache", True, "--enable-session-radix-cache"),
        ("hicache_storage_backend", "mooncake", "--hicache-storage-backend"),
        ("kv_events_config", '{"publisher": "zmq"}', "--kv-events-config"),
        ("radix_eviction_policy", "tlru", "--radix-eviction-policy"),
    ],
)
def test_flags_that_bypass_the_cache_are_refused_at_start_by_name(flag: str, value: object, named: str) -> None:
    env = H.make_env("builtin")
    ctx = H.build_context(SimpleNamespace(req_to_token_pool=env.rtp), **{flag: value})
    with pytest.raises(NotImplementedError, match=re.escape(named)):
        rc_plugin.factory(ctx)


def test_the_lazy_extra_buffer_is_refused_at_start_by_name() -> None:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    env = H.make_env("builtin", extra_buffer=True)
    env.rtp.enable_mamba_extra_buffer_lazy = True
    init = CacheInitParams(req_to_token_pool=env.rtp, token_to_kv_pool_allocator=env.alloc, page_size=1, disable=False)
    with pytest.raises(NotImplementedError, match="extra_buffer_lazy"):
        RadixcacheHybridCache(init)


@pytest.mark.parametrize("page_size", [1, 4])
def test_extra_buffer_stream_against_sglangs_builtin_cache(page_size: int) -> None:
    """SGLang's extra buffer (two track slots per request, the runner's tracking simulated as
    SGLang's runner and result processing leave it): 300 seeded requests, every forward finds
    its prefix's exact state (a snapshot filed from the working slot, which has run past the
    tracked depth, would not be), SGLang's accounting holds when idle (track slots included),
    hit tokens at least the built-in's, which takes the same tracked states."""
    envs = {}
    for kind in ("builtin", "radixcache"):
        env = H.make_env(kind, extra_buffer=True, mamba_size=30, page_size=page_size)
        H.run_stream(env, page_size, 300, chunk=128)
        assert env.mismatches == [], env.mismatches[:3]
        envs[kind] = env
    ours, theirs = envs["radixcache"], envs["builtin"]
    assert ours.cache.extra_buffer and ours.cache.stats["donations"] > 0
    assert ours.requests == theirs.requests == 300
    assert ours.hit_tokens >= theirs.hit_tokens > 0


def _tracking(env: H.Env, *, last: int | None, prev: int | None, finished: bool) -> Any:
    """A request holding a working slot and two track slots: slot ``buf[1]`` the latest tracked
    state (``last`` tokens), ``buf[0]`` the earlier one (``prev``)."""
    slots = env.rtp.mamba_allocator.alloc(3)
    assert slots is not None
    kv = SimpleNamespace(
        mamba_pool_idx=slots[0],
        mamba_ping_pong_track_buffer=slots[1:],
        mamba_last_track_idx=1,
        mamba_last_track_seqlen=last,
        mamba_prev_track_seqlen=prev,
    )
    return SimpleNamespace(kv=kv, finished=lambda: finished)


def test_extra_buffer_checkpoints_take_the_tracked_state_sglang_takes() -> None:
    env = H.make_env("radixcache", extra_buffer=True, page_size=4, mamba_size=30)
    cache = env.cache
    req = _tracking(env, last=128, prev=64, finished=False)
    late = int(req.kv.mamba_ping_pong_track_buffer[1])
    assert cache._tracked(req, 130) == (128, late)  # the latest, not the working slot
    assert req.kv.mamba_last_track_seqlen is None and req.kv.mamba_prev_track_seqlen is None  # consumed
    assert cache._tracked(req, 130) is None  # nothing tracked since
    req = _tracking(env, last=128, prev=64, finished=False)
    assert cache._tracked(req, 100) is None  # ran past a running request's key: nothing
    req = _tracking(env, last=128, prev=64, finished=True)
    early = int(req.kv.mamba_ping_pong_track_buffer[0])
    assert cache._tracked(req, 100) == (64, early)  # at the finish: the earlier state
    assert req.kv.mamba_last_track_seqlen == 128  # a finished request's record is left to SGLang
    req = _tracking(env, last=128, prev=None, finished=True)
    assert cache._tracked(req, 100) is None
    req = _tracking(env, last=126, prev=None, finished=True)
    assert cache._tracked(req, 130) is None  # off the page grid: no key to file it under
    req = _tracking(env, last=None, prev=None, finished=True)
    assert cache._tracked(req, 130) is None


def _slot_with(env: H.Env, n: int, h: int) -> torch.Tensor:
    got: torch.Tensor | None = env.rtp.mamba_allocator.alloc(1)
    assert got is not None
    env.write_state(int(got[0]), n, h)
    return got


def test_sglangs_mamba_unit_scenarios_on_our_backend() -> None:
    """SGLang's test_mamba_radix_cache_1 (insert four sequences, evict a KV token and snapshots,
    match, copy-on-write), through the public interface. Our insert clones the state: the caller
    keeps its slot (``mamba_exist``) and frees it."""
    env = H.make_env("radixcache", kv_size=128, mamba_size=20)
    cache = env.cache
    seqs = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]]
    for i, ids in enumerate(seqs):
        slot = _slot_with(env, len(ids), 100 + i)
        r = cache.insert(InsertParams(key=RadixKey(ids), value=env.alloc.alloc(len(ids)), mamba_value=slot))
        assert r.mamba_exist
        env.rtp.mamba_allocator.free(slot)
    assert cache.total_size() == (3 + 4 + 3 + 2, 4)
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted >= 1
    assert cache.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted >= 1
    cache.sanity_check()
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 60, 70])))
    # every surviving hit is a snapshot's depth, and its KV is the path's
    assert m.device_prefix_len in (0, 3, 7)
    assert len(cache.path_device_indices(m.last_device_node)) == m.device_prefix_len
    while cache.mamba_evictable_size():
        cache.evict(EvictParams(mamba_num=1))
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 6, 7]))).device_prefix_len == 0
    slot = _slot_with(env, 7, 7)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5, 6, 7]), value=env.alloc.alloc(7), mamba_value=slot))
    env.rtp.mamba_allocator.free(slot)
    req = SimpleNamespace(
        rid="r9",
        kv=SimpleNamespace(mamba_pool_idx=None, mamba_cow_src_index=None, mamba_needs_clear=True, holds_mamba=False),
        session_id=None,
    )
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 6, 7]), req=req, cow_mamba=True))
    assert m.device_prefix_len == 7 and req.kv.mamba_pool_idx is not None
    assert env.read_state(int(req.kv.mamba_pool_idx)) == (7, 7, True)
    env.rtp.mamba_allocator.free(req.kv.mamba_pool_idx.reshape(1))
    cache.sanity_check()


@pytest.mark.parametrize("seed", [0, 1])
def test_differential_stream_against_sglangs_builtin_cache(seed: int) -> None:
    """1,000 seeded requests per seed (aborts, re-sends, follow-ups, prefixes cut anywhere, prompt
    lengths 1 mod 64) through SGLang's helpers: every forward finds the exact state of its prefix
    in the request's slot, SGLang's slot accounting holds whenever idle, and our hit tokens are at
    least the built-in cache's."""
    envs = {}
    for kind in ("builtin", "radixcache"):
        env = H.make_env(kind)
        H.run_stream(env, seed, 1000)
        assert env.mismatches == [], env.mismatches[:3]
        envs[kind] = env
    ours, theirs = envs["radixcache"], envs["builtin"]
    assert ours.requests == theirs.requests == 1000  # every request admitted once (no retraction here)
    assert ours.hit_tokens >= theirs.hit_tokens > 0


def test_between_pressure_and_room_the_default_policy_serves_at_least_the_builtins_hits() -> None:
    """40 state slots for 3 requests in flight (the grid's middle, seed 1): where HitDensity's
    general bonus for sole hits (1,000 tokens) let the built-in lead by 4.6%, the backend's
    default (SGLANG_HIT_BONUS) serves at least its hit tokens; the general bonus still trails here,
    so the check tells the two apart."""
    from radixcache.policies import HitDensity
    from radixcache.sglang.backend import SGLANG_HIT_BONUS, RadixcacheHybridCache

    hits = {}
    for kind in ("builtin", "radixcache", "general"):
        env = H.make_env("builtin" if kind == "builtin" else "radixcache", mamba_size=40)
        if kind == "general":
            env.cache = RadixcacheHybridCache(env.cache_params, policy=HitDensity(), clock=H.StepClock())
        elif kind == "radixcache":
            policy = env.cache.policy
            assert isinstance(policy, HitDensity) and policy.hit_bonus == SGLANG_HIT_BONUS
        H.run_stream(env, 1, 1000)
        assert env.mismatches == [], env.mismatches[:3]
        hits[kind] = env.hit_tokens
    assert hits["radixcache"] >= hits["builtin"] > hits["general"] > 0, hits


def test_differential_stream_with_retractions() -> None:
    """500 requests, each decode step retracting its request with probability 0.05 (SGLang's
    release_req; the request resumes later with its outputs as prompt, matching again): no
    mismatch in either cache, ours at least the built-in's hit tokens."""
    envs = {}
    for kind in ("builtin", "radixcache"):
        env = H.make_env(kind)
        H.run_stream(env, 5, 500, retract_p=0.05)
        assert env.mismatches == [], env.mismatches[:3]
        assert env.retractions > 50
        envs[kind] = env
    assert envs["radixcache"].hit_tokens >= envs["builtin"].hit_tokens > 0


@pytest.mark.parametrize("seed", [2, 3])
def test_pages_above_one_token_never_file_a_state_at_the_wrong_depth(seed: int) -> None:
    """Page size 4 (SGLang's built-in hybrid cache refuses it without the extra buffer) with
    chunks of 46 tokens: checkpoints land mid-page, and the stream's prefixes are cut anywhere;
    no snapshot may be filed there. 1,000 requests per seed, ours alone."""
    env = H.make_env("radixcache", page_size=4)
    H.run_stream(env, seed, 1000, chunk=46)
    assert env.mismatches == [], env.mismatches[:3]
    assert env.requests == 1000 and env.hit_tokens > 0 and env.hit_tokens % 4 == 0


def _b_admitted_before_a_files(seed: int) -> tuple[Any, Any, Any]:
    """Requests a and b over one 150-token prompt, b admitted (64-token chunks) before a (48):
    b computes the prefix a files first."""
    env = H.make_env("radixcache")
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 30000) for _ in range(150)]
    a = H.new_request("a", [*prompt, 7, 7, 7], 2, False, rng)
    b = H.new_request("b", [*prompt, 9, 9, 9], 2, False, rng)
    assert H.admit(env, b, chunk=64) and H.admit(env, a, chunk=48)
    return env, a, b


def test_a_skipped_donation_over_another_requests_prefix_frees_each_duplicate_once() -> None:
    """Request b computed a prefix request a filed first (b was admitted before a's checkpoints).
    b's first checkpoint (64 tokens) finds no slot for its clone (SGLang's allocator has none and
    every snapshot is held, so none can be evicted), so the tree files no snapshot and
    the deepest snapshot it reaches is a's at 48: b's KV for [0, 48) are duplicates freed now and
    the row takes the tree's; b's [48, 64) stay b's (freed when b's later checkpoint or release
    replaces them). Freeing those here too would free them twice: SGLang's idle accounting fails."""
    env, a, b = _b_admitted_before_a_files(0)
    while H.step(env, a, 48):  # a files snapshots at 48, 96, 144 and its final state
        pass
    skipped = env.cache.stats["skipped_donations"]
    tree, mgr, alloc = env.cache.tree, env.cache.manager, env.rtp.mamba_allocator
    held = list(tree.snapshots_below(tree.match([]).node, through=lambda n: True))
    assert sorted(n.depth for n in held)[:3] == [48, 96, 144]  # and a's final state
    for n in held:
        mgr.lock(n)
    env.cache.slots.flush()  # a's released slot, kept for the next clone, goes back to SGLang first
    taken = alloc.alloc(alloc.available_size())
    assert alloc.available_size() == 0 and env.cache.state_pool.num_free == 0
    assert H.step(env, b, 64)
    alloc.free(taken)
    for n in held:
        mgr.unlock(n)
    assert env.cache.stats["skipped_donations"] == skipped + 1
    assert tree.num_snapshots == len(held)  # nothing was evicted for the clone that could not be made
    assert int(b.req.kv.cache_protected_len) == 48  # moved onto a's snapshot, not past it
    while H.step(env, b, 64):
        pass
    assert env.mismatches == []
    env.idle_check()


def test_a_checkpoint_over_another_requests_prefix_repoints_the_row_onto_the_trees_kv() -> None:
    """Request b computed the 48 tokens request a filed first: b's checkpoint at 64 frees b's own
    indices for [0, 48) (duplicates), each once, and its row names the tree's from then on (the
    freed indices may be handed to another request next); [48, 64) the tree adopted from b's row."""
    env, a, b = _b_admitted_before_a_files(1)
    assert H.step(env, a, 48)  # a files its snapshot at 48
    row = env.rtp.req_to_token[b.req.kv.req_pool_idx]
    assert b.first_kv is not None
    mine = b.first_kv.clone()  # b's own indices for [0, 64), written into its row by its step
    free_before = env.alloc.available_size()
    assert H.step(env, b, 64)
    node = b.req.last_node
    assert int(b.req.kv.cache_protected_len) == node.depth == 64
    tree_kv = env.cache.tree.kv_indices(node)
    assert torch.equal(row[:64].to(torch.int64), tree_kv)  # the row names the tree's KV
    assert torch.equal(tree_kv[48:], mine[48:].to(torch.int64))  # adopted from b's row
    assert not bool((tree_kv[:48] == mine[:48].to(torch.int64)).any())  # a's, not b's
    assert env.alloc.available_size() - free_before == 48  # b's 48 duplicates, freed once
    while H.step(env, b, 64):
        pass
    while H.step(env, a, 48):
        pass
    assert env.mismatches == []
    env.idle_check()


def test_no_assert_under_slot_pressure() -> None:
    """Four state slots for three requests in flight. SGLang 0.5.23's built-in cache dies on
    "Can not alloc mamba cache" (sglang#36770) on this stream; ours evicts through its policy or
    skips the donation, never asserts, and nothing it serves is wrong."""
    builtin = H.make_env("builtin", mamba_size=4)
    with pytest.raises(AssertionError, match="Can not alloc mamba cache"):
        H.run_stream(builtin, 3, 300, concurrency=3)
    env = H.make_env("radixcache", mamba_size=4)
    H.run_stream(env, 3, 300, concurrency=3)
    assert env.mismatches == []
    assert env.requests == 300 and env.cache.stats["skipped_donations"] > 0 and env.hit_tokens > 0


def test_stats_count_restores_and_donations() -> None:
    env = H.make_env("radixcache")
    s: dict[str, Any] = env.cache.stats  # held from the start: kept current (the cost benchmark's copy count)
    H.run_stream(env, 4, 100)
    assert s["admissions"] >= env.requests and s["restores"] > 0 and s["donations"] > 0
    assert s["hit_tokens"] == env.hit_tokens


def test_sglangs_prev_prefix_len_scenario_on_our_backend() -> None:
    """SGLang's test_insert_prev_prefix_len: ``prev_prefix_len`` says which of the caller's indices
    for already cached tokens are the tree's own (kept) and which are duplicates (freed)."""
    env = H.make_env("radixcache", kv_size=128, mamba_size=20)
    cache, alloc = env.cache, env.alloc
    start = alloc.available_size()

    def ins(ids: list[int], prev: int) -> int:
        slot = _slot_with(env, len(ids), len(ids))
        r = cache.insert(
            InsertParams(key=RadixKey(ids), value=alloc.alloc(len(ids)), mamba_value=slot, prev_prefix_len=prev)
        )
        env.rtp.mamba_allocator.free(slot)
        return int(r.prefix_len)

    assert ins([1, 2, 3], 0) == 0 and alloc.available_size() == start - 3
    assert ins([1, 2, 3, 4, 5, 6, 7], 0) == 3 and alloc.available_size() == start - 7  # 3 duplicates freed
    assert ins([1, 2, 3, 4, 5, 6, 7, 8], 2) == 7 and alloc.available_size() == start - 10  # 5 freed, 2 kept
    assert ins([1, 2, 3, 4, 5, 6, 7, 8, 9], 8) == 8 and alloc.available_size() == start - 19  # none freed
    cache.sanity_check()


def test_sglangs_create_tree_cache_builds_our_backend_for_the_flag() -> None:
    """What SGLang's KV-cache builder does at start with ``--radix-cache-backend radixcache`` on a
    hybrid model: its registry routes to our factory, and its check that a hybrid model's cache
    ``supports_mamba`` passes."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    env = H.make_env("builtin")  # its pools; the cache create_tree_cache builds is a new one
    args = ServerArgs(model_path="dummy", page_size=1, radix_cache_backend=BACKEND_NAME)
    set_global_server_args_for_scheduler(args)
    load_plugins()
    init = CacheInitParams(req_to_token_pool=env.rtp, token_to_kv_pool_allocator=env.alloc, page_size=1, disable=False)
    ctx = TreeCacheBuildContext(
        server_args=args,
        params=init,
        is_hybrid_swa=False,
        is_hybrid_ssm=True,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    cache = create_tree_cache(ctx)
    assert isinstance(cache, RadixcacheHybridCache) and cache.supports_mamba()
    H.setup_sglang()  # back to the default backend for the other tests


def test_probe_matches_change_no_counts_and_dfs_order_keeps_every_request() -> None:
    env = H.make_env("radixcache", kv_size=256, mamba_size=20)
    cache = env.cache
    for ids, extra in (([1, 2, 3, 4], None), ([1, 2, 9], None), ([5, 6, 7], "lora-a")):
        slot = _slot_with(env, len(ids), 1)
        cache.insert(InsertParams(key=RadixKey(ids, extra), value=env.alloc.alloc(len(ids)), mamba_value=slot))
        env.rtp.mamba_allocator.free(slot)
    before = dict(cache.stats)
    nodes = [
        cache.match_prefix(MatchPrefixParams(key=RadixKey(ids, extra))).last_device_node
        for ids, extra in (([5, 6, 7, 8], "lora-a"), ([1, 2, 3, 4, 5], None), ([1, 2, 9, 9], None), ([7], None))
    ]
    assert cache.stats == before  # probes: no admission, no restore
    order = cache.dfs_weight_order(nodes)
    assert sorted(order) == [0, 1, 2, 3]
    assert order[0] == 0  # the first tree seen comes first, whole


def test_lock_builds_the_tree_lock_sglangs_base_lock_builds() -> None:
    """Our lock builds SGLang's TreeLock without the receipt's round trip: the same receipt as
    SGLang's own ``BasePrefixCache.lock`` over our ``inc_lock_ref``, one lock taken by each, and
    either one's unlock lets go of exactly one."""
    env = H.make_env("radixcache", kv_size=256, mamba_size=20)
    cache = env.cache
    slot = _slot_with(env, 4, 1)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4], None), value=env.alloc.alloc(4), mamba_value=slot))
    env.rtp.mamba_allocator.free(slot)
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4], None))).last_device_node
    ours = cache.lock(node)
    theirs = BasePrefixCache.lock(cache, node)
    assert ours == theirs and ours.node is node and ours.receipt.node_id == node.id
    assert node.snap_lock == 2 and cache.protected_size() == 4
    cache.unlock(theirs)
    assert node.snap_lock == 1
    BasePrefixCache.unlock(cache, ours)
    assert node.snap_lock == 0 and cache.protected_size() == 0
    cache.unlock(None)  # SGLang's contract: nothing to release
    cache.sanity_check()


def test_a_hit_with_no_slot_to_restore_into_is_a_miss_not_an_assert() -> None:
    """Two state slots: one holds the only snapshot, locked by a running request; the host holds
    the other. A new request that hits has nowhere to receive the state: the match reports no hit
    (SGLang asserts "Can not alloc mamba cache" here) and changes nothing."""
    env = H.make_env("radixcache", kv_size=64, mamba_size=2)
    cache = env.cache
    slot = _slot_with(env, 3, 3)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=env.alloc.alloc(3), mamba_value=slot))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4])))
    assert m.device_prefix_len == 3
    lock = cache.lock(m.last_device_node)  # a running request holds the hit
    assert env.rtp.mamba_allocator.available_size() == 0  # the host still holds `slot`
    req = SimpleNamespace(
        rid="late",
        kv=SimpleNamespace(mamba_pool_idx=None, mamba_cow_src_index=None, mamba_needs_clear=True, holds_mamba=False),
        session_id=None,
    )
    before = (cache.total_size(), dict(cache.stats))
    r = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]), req=req, cow_mamba=True))
    assert r.device_prefix_len == 0 and req.kv.mamba_pool_idx is None
    assert cache.total_size() == before[0] and cache.stats["restores"] == before[1]["restores"]
    cache.unlock(lock)
    env.rtp.mamba_allocator.free(slot)
    cache.sanity_check()


def test_a_host_tier_keeps_what_sglangs_state_slots_cannot() -> None:
    """The same pressure with a host tier of 32 slots: snapshots evicted from SGLang's pool are
    demoted to host memory and restored from there; more hit tokens, nothing wrong, and SGLang's
    idle invariants (which count its own pool only) still hold."""
    without = H.make_env("radixcache", mamba_size=4)
    H.run_stream(without, 3, 300, concurrency=3)
    env = H.make_env("radixcache", mamba_size=4)
    slot_bytes = env.cache.state_pool.layout.slot_bytes
    env.cache = RadixcacheHybridCache(env.cache_params, host_budget_bytes=32 * slot_bytes, clock=H.StepClock())
    loads: list[tuple[int, str]] = []  # what SGLang's metrics collector would count (--enable-metrics)
    env.cache.metrics_collector = SimpleNamespace(
        increment_load_back_num_tokens=lambda n, pool: loads.append((n, pool)),
        observe_eviction_duration=lambda s: None,
        increment_eviction_num_tokens=lambda n: None,
    )
    H.run_stream(env, 3, 300, concurrency=3)
    assert env.mismatches == []
    assert env.cache.stats["host_restores"] > 0 and env.cache.tree.num_host_snapshots > 0
    assert env.hit_tokens > without.hit_tokens
    assert len(loads) == env.cache.stats["host_restores"] and all(n > 0 and p == "mamba" for n, p in loads)


def test_the_policy_hears_of_a_request_once_however_often_it_is_matched() -> None:
    env = H.make_env("radixcache", kv_size=256, mamba_size=20)
    cache = env.cache
    heard: list[int] = []
    real = cache.policy.admitted

    def admitted(info: Any) -> None:
        heard.append(info.prompt_len)
        real(info)

    cache.policy.admitted = admitted
    run = H.new_request("again", [1, 2, 3, 4], 1, False, random.Random(0))
    for _ in range(3):  # not added twice (the scheduler frees the slot and retries), then added
        run.req.init_next_round_input(cache)
        if run.req.kv.holds_mamba:
            env.rtp.mamba_allocator.free(run.req.kv.mamba_pool_idx.reshape(1))
            run.req.kv.mamba_pool_idx = None
    assert heard == [4] and cache.stats["admissions"] == 3


def test_bad_calls_raise_typed_errors_and_change_nothing() -> None:
    """A KV tensor of the wrong length, an unlock without a lock, a node of another cache: each a
    typed error naming what is wrong, with the tree, the pools and SGLang's allocators as before
    (the slot lent for the failed clone is back with its owner)."""
    from radixcache.core.errors import ForeignObjectError, LockError

    env = H.make_env("radixcache", kv_size=64, mamba_size=6)
    cache = env.cache
    slot = _slot_with(env, 3, 3)
    free_kv, free_m = env.alloc.available_size(), env.rtp.mamba_allocator.available_size()
    kv = env.alloc.alloc(2)
    with pytest.raises(ValueError, match="kv_indices has 2 entries for a key of 3 tokens"):
        cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=kv, mamba_value=slot))
    assert cache.total_size() == (0, 0) and env.rtp.mamba_allocator.available_size() == free_m
    assert env.alloc.available_size() == free_kv - 2
    cache.state_pool.check_invariants()
    env.alloc.free(kv)
    r = cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=env.alloc.alloc(3), mamba_value=slot))
    node = r.last_device_node
    with pytest.raises(LockError, match="holds no lock"):
        cache.dec_lock_ref(node)
    other = H.make_env("radixcache", kv_size=64, mamba_size=6).cache
    with pytest.raises(ForeignObjectError, match="another cache"):
        other.inc_lock_ref(node)
    # the clone's slot came with a batch: the rest is held in the reserve, evictable too
    assert cache.total_size() == (3, 1) and cache.mamba_evictable_size() == 1 + len(cache.slots.reserve)
    env.rtp.mamba_allocator.free(slot)
    cache.sanity_check()


def test_register_refuses_a_foreign_factory_under_our_name_and_bad_constructor_arguments() -> None:
    from sglang.srt.mem_cache import registry

    saved = dict(registry._RADIX_CACHE_REGISTRY)
    try:
        registry._RADIX_CACHE_REGISTRY[BACKEND_NAME] = lambda ctx: None
        with pytest.raises(RuntimeError, match="another factory is registered as 'radixcache'"):
            rc_plugin.register()
    finally:
        registry._RADIX_CACHE_REGISTRY.clear()
        registry._RADIX_CACHE_REGISTRY.update(saved)
    env = H.make_env("radixcache")
    with pytest.raises(ValueError, match="host_budget_bytes must be an int >= 0, got -1"):
        RadixcacheHybridCache(env.cache_params, host_budget_bytes=-1)
    with pytest.raises(ValueError, match="forensics must be 'sampled', 'all' or None, got 'every'"):
        RadixcacheHybridCache(env.cache_params, forensics="every")  # type: ignore[arg-type]
    env.cache.sanity_check()


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("RADIXCACHE_HOST_TIER_BYTES", "lots", "RADIXCACHE_HOST_TIER_BYTES must be a byte count, got 'lots'"),
        ("RADIXCACHE_FORENSICS", "Off", "RADIXCACHE_FORENSICS must be 'sampled', 'all' or 'off', got 'Off'"),
    ],
)
def test_the_factory_refuses_bad_environment_values_by_name(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, message: str
) -> None:
    env = H.make_env("radixcache")
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        rc_plugin.factory(H.build_context(env.cache_params))
    env.cache.sanity_check()


@pytest.mark.parametrize(("env_value", "watched"), [(None, True), ("sampled", True), ("all", True), ("off", False)])
def test_forensics_is_sampled_by_default_and_off_when_asked(
    monkeypatch: pytest.MonkeyPatch, env_value: str | None, watched: bool
) -> None:
    """``RADIXCACHE_FORENSICS`` (the factory) and ``forensics=`` (the constructor) choose whether
    the manager watches donations; a stream served either way answers like SGLang's cache."""
    env = H.make_env("radixcache")
    monkeypatch.delenv("RADIXCACHE_FORENSICS", raising=False)
    if env_value is not None:
        monkeypatch.setenv("RADIXCACHE_FORENSICS", env_value)
    cache = rc_plugin.factory(H.build_context(env.cache_params))
    assert (cache.manager.forensics is not None) is watched
    env.cache = cache
    H.run_stream(env, 0, 40)
    assert env.mismatches == []
    fx = cache.manager.forensics
    if watched:
        assert fx.donations_seen == cache.stats["donations"] > 0
        assert fx.sample == (1.0 if env_value == "all" else SAMPLED) and fx.mode == "record"
        assert (fx.donations_watched == fx.donations_seen) is (env_value == "all")
    cache.sanity_check()


def test_wrong_calls_between_a_streams_steps_raise_typed_errors_and_change_nothing() -> None:
    """The misuse fuzzer's rule on the SGLang backend: after every scheduler step of a seeded
    stream, one wrong call drawn at random (KV indices that are floats, 2-D, negative or of the
    wrong length; a key that is not a RadixKey or holds a negative id; a negative eviction; an
    unlock without a lock; a node of another cache). Each raises a typed error, and the tree, the
    pool, the manager, the policy and SGLang's allocators are exactly as before; the stream's
    answers stay right."""
    from radixcache.core.tree import TreeNode
    from radixcache.testing.digest import state_digest
    from radixcache.testing.misuse import MISUSE_ERRORS

    other = H.make_env("radixcache", kv_size=64, mamba_size=6).cache
    foreign = other.insert(InsertParams(key=RadixKey([9, 9, 9]), value=other.token_to_kv_pool_allocator.alloc(3)))
    foreign_node = foreign.last_device_node
    seen: dict[str, int] = {}

    def digest(env: H.Env) -> tuple[object, ...]:
        cache = env.cache
        return (
            state_digest(cache.manager),
            env.alloc.available_size(),
            env.rtp.mamba_allocator.available_size(),
            cache.total_size(),
        )

    def wrong(env: H.Env, rng: random.Random) -> None:
        cache = env.cache
        kv = torch.arange(3, dtype=torch.int64)
        unlocked = [n for n in cache.tree.iter_nodes() if isinstance(n, TreeNode) and not n.kv_lock and not n.snap_lock]
        calls = {
            "insert: float KV": lambda: cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=kv.float())),
            "insert: 2-D KV": lambda: cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=kv.reshape(1, 3))),
            "insert: negative KV": lambda: cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=-1 - kv)),
            "insert: KV of the wrong length": lambda: cache.insert(InsertParams(key=RadixKey([1, 2]), value=kv)),
            "insert: a negative id": lambda: cache.insert(InsertParams(key=RadixKey([1, -2, 3]), value=kv)),
            "insert: not a RadixKey": lambda: cache.insert(InsertParams(key=[1, 2, 3], value=kv)),
            "match: not a RadixKey": lambda: cache.match_prefix(MatchPrefixParams(key=(1, 2, 3))),
            "evict: negative tokens": lambda: cache.evict(EvictParams(num_tokens=-1)),
            "evict: negative snapshots": lambda: cache.evict(EvictParams(num_tokens=0, mamba_num=-2)),
            "lock: a node of another cache": lambda: cache.inc_lock_ref(foreign_node),
            "unlock: a node of another cache": lambda: cache.dec_lock_ref(foreign_node),
        }
        if unlocked:
            node = rng.choice(unlocked)
            calls["unlock: a node holding no lock"] = lambda: cache.dec_lock_ref(node)
        label = rng.choice(sorted(calls))
        before = digest(env)
        with pytest.raises(MISUSE_ERRORS):
            calls[label]()
        assert digest(env) == before, f"{label}: raised, but changed the cache or SGLang's pools"
        cache.manager.check_invariants()
        seen[label] = seen.get(label, 0) + 1

    env = H.make_env("radixcache", kv_size=4096, mamba_size=10)
    H.run_stream(env, 0, 60, between=wrong)
    assert not env.mismatches, env.mismatches[:3]
    assert len(seen) >= 10 and sum(seen.values()) >= 100, seen
    env.cache.sanity_check()


def test_sglang_metrics_count_our_evictions() -> None:
    """With SGLang's --enable-metrics the backend builds SGLang's radix-cache metrics collector, and
    each eviction pass adds the KV tokens it freed to ``sglang:evicted_tokens_total``."""
    from prometheus_client import REGISTRY

    env = H.make_env("radixcache", kv_size=128, mamba_size=20)
    params = env.cache_params
    params.enable_metrics = True
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0, pp_rank=0):  # a scheduler's rank, as SGLang publishes it
        cache = RadixcacheHybridCache(params, clock=H.StepClock())
    assert cache.metrics_collector is not None
    labels = {k: str(v) for k, v in cache.metrics_collector.labels.items()}

    def evicted() -> float:
        return REGISTRY.get_sample_value("sglang:evicted_tokens_total", labels) or 0.0

    before = evicted()
    for i, ids in enumerate([[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12]]):
        slot = _slot_with(env, len(ids), 100 + i)
        cache.insert(InsertParams(key=RadixKey(ids), value=env.alloc.alloc(len(ids)), mamba_value=slot))
        env.rtp.mamba_allocator.free(slot)
    freed = cache.evict(EvictParams(num_tokens=4)).num_tokens_evicted
    assert freed >= 4 and evicted() - before == freed
    cache.sanity_check()


def _finished(env: Any, rng: random.Random, rid: str, prompt: list[int] | None = None) -> tuple[Any, int]:
    """Request ``rid`` admitted and run to its finish (48-token chunks); its mamba slot's index."""
    run = H.new_request(rid, prompt or [rng.randrange(1, 30000) for _ in range(100)], 2, False, rng)
    assert H.admit(env, run)
    slot = int(run.req.kv.mamba_pool_idx)
    while H.step(env, run, 48):
        pass
    return run, slot


def test_a_finished_requests_slot_becomes_the_next_clones() -> None:
    """Copy-on-donate clones a finished request's state, then the request lets its slot go: the
    slot waits in the backend's reserve (not on SGLang's free list, counted as the cache's by
    SGLang's census and as evictable), and the next clone takes it without SGLang's allocator."""
    env = H.make_env("radixcache")
    cache, alloc = env.cache, env.rtp.mamba_allocator
    rng = random.Random(0)
    a, slot = _finished(env, rng, "a")
    held = list(cache.slots.reserve)
    assert held[-1] == slot and a.req.kv.mamba_pool_idx is None  # kept last: handed out next
    assert slot not in alloc.free_slots.tolist() and cache.state_pool.owner_of(slot) is None
    assert cache.mamba_evictable_size() == cache.tree.evictable_snapshots + len(held)
    env.idle_check()  # SGLang's formula and census: the reserved slots are the cache's
    b = H.new_request("b", [rng.randrange(1, 30000) for _ in range(100)], 2, False, rng)
    assert H.admit(env, b)  # a miss: b's own slot from SGLang's allocator
    free = alloc.available_size()
    assert H.step(env, b, 48)  # b's first checkpoint clones b's state into a's old slot
    assert cache.slots.reserve == held[:-1] and alloc.available_size() == free
    assert cache.tree.match(b.tokens[:48]).node.snapshot == slot
    while H.step(env, b, 48):
        pass
    assert env.mismatches == []
    env.idle_check()


def test_sglang_gets_recycled_slots_back_first() -> None:
    """evict hands the reserve back before any snapshot goes (counted as evicted: SGLang asked for
    slots, it got them), reset hands it back, and an admission takes its slot from the reserve
    before SGLang's free list: one that finds that list empty evicts no snapshot for its hit, and
    only one that finds the reserve empty too evicts one (through the policy, its hit kept)."""
    env = H.make_env("radixcache")
    cache, alloc = env.cache, env.rtp.mamba_allocator
    rng = random.Random(1)
    prompt = [rng.randrange(1, 30000) for _ in range(100)]
    _, slot = _finished(env, rng, "a", prompt)
    held = list(cache.slots.reserve)
    assert held[-1] == slot
    snaps, free = cache.tree.num_snapshots, alloc.available_size()
    got = cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert got.mamba_num_evicted == 1 and cache.tree.num_snapshots == snaps  # no snapshot lost for it
    assert cache.slots.reserve == held[:-1] and alloc.available_size() == free + 1 and slot in alloc.free_slots.tolist()
    env.idle_check()
    _finished(env, rng, "b")
    held, snaps, free = list(cache.slots.reserve), cache.tree.num_snapshots, alloc.available_size()
    assert len(held) >= 2
    h = H.new_request("h", [*prompt, 4], 2, False, rng)  # a hit on a's prompt: a reserved slot, not SGLang's
    h.req.init_next_round_input(cache)
    assert h.req.prefix_len > 0 and int(h.req.kv.mamba_pool_idx) == held[-1] and alloc.available_size() == free
    assert cache.slots.keep(int(h.req.kv.mamba_pool_idx))  # h goes away unscheduled: its slot back where it was
    h.req.kv.mamba_pool_idx = None
    assert cache.slots.reserve == held
    taken = alloc.alloc(alloc.available_size())  # SGLang's free list runs dry
    c = H.new_request("c", [*prompt, 5], 2, False, rng)  # a hit on a's prompt
    c.req.init_next_round_input(cache)
    idx = c.req.kv.mamba_pool_idx
    assert c.req.prefix_len > 0 and idx.dim() == 0 and int(idx) == held[-1]  # SGLang's 0-d index, reserved slot
    assert cache.tree.num_snapshots == snaps and cache.slots.reserve == held[:-1]  # nothing evicted for it
    alloc.free(idx.reshape(1))  # c goes away unscheduled
    c.req.kv.mamba_pool_idx = None
    assert cache.slots.flush() == len(held) - 1 and cache.slots.reserve == []
    taken = torch.cat([taken, alloc.alloc(alloc.available_size())])  # nothing free, nothing held
    d = H.new_request("d", [*prompt, 6], 2, False, rng)
    d.req.init_next_round_input(cache)
    assert d.req.prefix_len > 0 and d.req.kv.holds_mamba  # the hit kept, a snapshot evicted for its slot
    assert cache.tree.num_snapshots == snaps - 1 and cache.slots.reserve == []
    alloc.free(d.req.kv.mamba_pool_idx.reshape(1))
    d.req.kv.mamba_pool_idx = None
    alloc.free(taken)
    _finished(env, rng, "e")
    assert cache.slots.reserve
    cache.reset()
    assert cache.slots.reserve == [] and cache.total_size() == (0, 0)
    env.idle_check()


def test_the_reserve_is_bounded_handed_out_first_and_refused_with_the_extra_buffer() -> None:
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

    from radixcache.sglang.backend import RECYCLED_SLOTS, TAKE_BATCH, SGLangSlots

    alloc = MambaSlotAllocator(8, "cpu")
    slots = SGLangSlots(alloc, recycle=2)
    got = slots.take(3)
    assert got == [1, 2, 3]  # SGLang's free list, first in, first out
    assert slots.keep(got[0]) and slots.keep(got[1]) and not slots.keep(got[2])  # at most 2 kept
    with pytest.raises(ValueError, match=f"slot {got[0]} cannot be reserved"):
        slots.keep(got[0])  # held already: two holders otherwise
    with pytest.raises(ValueError, match="slot -1 cannot be reserved"):
        slots.keep(-1)
    with pytest.raises(TypeError, match="a reserved slot is an int, got Tensor"):
        slots.keep(torch.tensor(7))  # type: ignore[arg-type]
    assert slots.reserve == [got[0], got[1]]  # nothing changed
    assert slots.available() == alloc.available_size() + 2 == 7
    assert slots.take(1) == [got[1]]  # the reserve first
    assert slots.take(2) == [4, 5]  # several at once: SGLang's
    assert slots.flush() == 1 and slots.reserve == [] and int(alloc.free_slots[-1]) == got[0]
    assert slots.flush(3) == 0
    with pytest.raises(ValueError, match="recycle must be >= 0, got -1"):
        SGLangSlots(alloc, recycle=-1)
    for bad in (True, 2.0, "4"):
        with pytest.raises(TypeError, match="recycle must be an int"):
            SGLangSlots(alloc, recycle=bad)  # type: ignore[arg-type]
    batched = SGLangSlots(alloc, recycle=3, batch=3)
    assert alloc.free_slots.tolist() == [6, 7, 8, 1]
    assert batched.take(1) == [6] and batched.reserve == [8, 7]  # one allocator call for three
    assert alloc.free_slots.tolist() == [1]
    assert batched.take(1) == [7] and batched.take(1) == [8] and batched.reserve == []  # in SGLang's order
    assert batched.keep(6) and batched.take(1) == [6]  # a kept slot first, as before
    assert batched.take(1) == [1] and batched.reserve == []  # fewer free than a batch: one
    assert batched.take(1) is None  # none free, none held
    alloc.free(torch.tensor([2, 3, 4, 5, 6, 7, 8]))
    assert batched.take(1) == [2] and batched.reserve == [4, 3]
    assert batched.flush(1) == 1 and batched.reserve == [4]
    assert batched.take(2) == [5, 6]  # several at once: SGLang's, even with one held
    for bad in (0, 4):
        with pytest.raises(ValueError, match=rf"batch must be in \[1, recycle \+ 1\] = \[1, 3\], got {bad}"):
            SGLangSlots(alloc, recycle=2, batch=bad)
    with pytest.raises(TypeError, match="batch must be an int"):
        SGLangSlots(alloc, recycle=2, batch=2.0)  # type: ignore[arg-type]
    plain = H.make_env("radixcache").cache
    assert plain.slots.recycle == RECYCLED_SLOTS and plain.slots.batch == TAKE_BATCH
    # with the extra buffer SGLang's release also frees the request's track slots: its own path
    assert H.make_env("radixcache", extra_buffer=True).cache.slots.recycle == 0


def test_sanity_check_finds_a_recycled_slot_sglang_also_holds_free() -> None:
    env = H.make_env("radixcache")
    _, slot = _finished(env, random.Random(2), "a")
    env.cache.sanity_check()
    env.rtp.mamba_allocator.free(torch.tensor([slot]))  # a double holder: the reserve and SGLang
    with pytest.raises(AssertionError, match=rf"recycled slots \[{slot}\] are on SGLang's free list too"):
        env.cache.sanity_check()


def test_a_checkpoint_moves_the_requests_own_lock_and_hits_share_a_slots_index_tensor() -> None:
    """A checkpoint moves the request's lock to the deeper snapshot in place (the same TreeLock,
    its node and receipt re-pointed, the old node let go); a hit's slot is SGLang's 0-d index
    tensor, the same one for every request restored into that slot."""
    env = H.make_env("radixcache")
    cache = env.cache
    rng = random.Random(3)
    prompt = [rng.randrange(1, 30000) for _ in range(100)]
    a = H.new_request("a", prompt, 2, False, rng)
    assert H.admit(env, a)
    lock = a.req.lock
    assert H.step(env, a, 48)  # the first chunk's checkpoint: a snapshot at 48
    node = cache.tree.match(a.tokens[:48]).node
    assert a.req.lock is lock and lock.node is node and lock.receipt.node_id == node.id
    assert node.snap_lock == 1
    assert H.step(env, a, 48)  # the second: the lock moves on, the first node is let go
    deeper = cache.tree.match(a.tokens[:96]).node
    assert a.req.lock is lock and lock.node is deeper and lock.receipt.node_id == deeper.id
    assert node.snap_lock == 0 and deeper.snap_lock == 1
    while H.step(env, a, 48):
        pass
    seen = []
    for rid in ("b", "c"):
        r = H.new_request(rid, [*prompt, 7], 2, False, rng)
        r.req.init_next_round_input(cache)
        idx = r.req.kv.mamba_pool_idx
        assert r.req.prefix_len > 0 and idx.dim() == 0 and idx.dtype == torch.int64
        seen.append((int(idx), idx))
        assert cache.slots.keep(int(idx))  # r goes away unscheduled: its slot back to the reserve
        r.req.kv.mamba_pool_idx = None
    assert seen[0][0] == seen[1][0] and seen[0][1] is seen[1][1]  # one slot: one tensor
    cache.sanity_check()


def test_a_hit_forensics_finds_changed_falls_back_to_the_next_snapshot_up_its_path() -> None:
    """Until 2026-12-07 the manager restored a snapshot forensics (``"record"`` mode, the
    backend's default) had just found changed: the request computed on from a wrong state. The
    restore is now refused (``SnapshotRefused``), the changed snapshot dropped, and the admission
    takes the next snapshot up its path (one of the request's earlier checkpoints)."""
    from radixcache import Forensics

    env = H.make_env("radixcache")
    cache = env.cache
    mgr = cache.manager
    mgr.forensics = Forensics(mgr.pool, mode="record")  # every donation watched
    rng = random.Random(3)
    prompt = [rng.randrange(1, 30000) for _ in range(100)]
    _finished(env, rng, "a", prompt)
    b = H.new_request("b", [*prompt, 4], 2, False, rng)
    node = mgr.lookup(b.tokens[:100]).node
    up = next(mgr.cache.snapshot_ancestors(node))
    assert node.snapshot is not None and 0 < up.depth < node.depth
    env.temporal[:, node.snapshot] += 1.0  # a stray write into the tree's snapshot
    assert H.admit(env, b) and b.done == up.depth and cache.stats["restores"] == 1
    assert [f.kind for f in mgr.forensics.findings] == ["changed"] and node.snapshot is None
    assert mgr.metrics().refused_hits == 1 and mgr.metrics().hits == 1
    while H.step(env, b, 48):
        pass
    assert env.mismatches == []
    env.idle_check()


def test_a_refused_hit_with_nothing_above_it_is_a_miss_computed_from_the_zero_state() -> None:
    """Every snapshot on the path changed: each refused in turn, then a miss; SGLang clears the
    request's slot before its forward (without that mark the slot keeps what it held)."""
    from radixcache import Forensics

    env = H.make_env("radixcache")
    cache = env.cache
    mgr = cache.manager
    mgr.forensics = Forensics(mgr.pool, mode="record")
    rng = random.Random(3)
    prompt = [rng.randrange(1, 30000) for _ in range(100)]
    _finished(env, rng, "a", prompt)
    b = H.new_request("b", [*prompt, 4], 2, False, rng)
    node = mgr.lookup(b.tokens[:100]).node
    path = [node, *mgr.cache.snapshot_ancestors(node)]
    for n in path:
        env.temporal[:, n.snapshot] += 1.0
    assert H.admit(env, b) and b.done == 0 and cache.stats["restores"] == 0
    assert len(mgr.forensics.findings) == len(path) == mgr.metrics().refused_hits and mgr.metrics().hits == 0
    while H.step(env, b, 48):
        pass
    c = H.new_request("c", [*prompt, 5], 2, False, rng)  # b filed the prefix again
    assert H.admit(env, c) and c.done > 0
    while H.step(env, c, 48):
        pass
    assert env.mismatches == []
    env.idle_check()
