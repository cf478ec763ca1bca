"""The shared (Redis) tier inside the SGLang backend, on SGLang's real pools: the KV codec over
SGLang's KV pool, and replicas that resume from each other's snapshots through one store. The
harness's forward checks the state *and* the KV rows a request resumes from (``kv_pool=True``), so
a prefix fetched from the store with wrong state or KV shows up as a mismatch."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sglang", reason="SGLang is not installed here (CI runs these in their own venv)")

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from radixcache.sglang import plugin as rc_plugin
from radixcache.sglang.backend import PREFETCH_WAIT_S, RadixcacheHybridCache
from radixcache.sglang.kv import SGLangKVCodec
from radixcache.tiers.store import MemoryStore, RedisStore, SharedStore

from . import harness as H  # noqa: N812

SEED, REQUESTS = 1, 60


def _replica(store: SharedStore | None, **kw: Any) -> H.Env:
    shared = {} if store is None else {"shared": store, "model_identity": "tiny-hybrid"}
    return H.make_env("radixcache", kv_pool=True, mamba_size=30, cache_kwargs=shared, **kw)


def _serve_and_publish(env: H.Env) -> None:
    H.run_stream(env, SEED, REQUESTS)
    env.cache.manager.publish_pending(wait=True)  # the writer thread stored every blob


def _served_alike_from(store: SharedStore) -> tuple[H.Env, H.Env]:
    """Replica A serves the stream and publishes to ``store``; replica B, fresh pools, serves the
    same stream from ``store``. Both without a mismatch, accounting checked whenever idle."""
    a = _replica(store)
    _serve_and_publish(a)
    b = _replica(store)
    H.run_stream(b, SEED, REQUESTS)
    for env in (a, b):
        assert env.mismatches == [], env.mismatches[:3]
        env.cache.manager.check_invariants()
    return a, b


def test_a_second_replica_resumes_from_the_first_ones_snapshots_through_the_store() -> None:
    """B's hits from the store carry the right state and KV rows, and it serves more hit tokens
    than A did cold and than a replica without a store."""
    alone = _replica(None)
    H.run_stream(alone, SEED, REQUESTS)
    a, b = _served_alike_from(MemoryStore())
    assert a.cache.shared is not None and b.cache.shared is not None
    assert a.cache.shared.stats.published > 0
    st = b.cache.shared.stats
    assert st.hits > 0 and st.hit_tokens > 0 and st.rejected == {} and st.codec_errors == 0
    assert b.hit_tokens > max(a.hit_tokens, alone.hit_tokens), (b.hit_tokens, a.hit_tokens, alone.hit_tokens)


def test_the_oracle_catches_a_codec_that_writes_the_wrong_kv_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: an import that writes the KV bytes rotated by one token's worth (every
    row gets another token's bytes; the blob itself verified) must show up as a KV mismatch in
    the forward."""
    store = MemoryStore()
    _serve_and_publish(_replica(store))
    real = SGLangKVCodec.import_kv

    def rotated(self: SGLangKVCodec, data: Any, num_tokens: int) -> torch.Tensor | None:
        b = bytes(data)
        return real(self, b[-self.bytes_per_token :] + b[: -self.bytes_per_token], num_tokens)

    monkeypatch.setattr(SGLangKVCodec, "import_kv", rotated)
    b = _replica(store)
    H.run_stream(b, SEED, REQUESTS)
    assert b.cache.shared is not None and b.cache.shared.stats.hits > 0
    assert any("KV row" in m for m in b.mismatches), b.mismatches[:3]


def test_corrupted_blobs_are_refused_and_the_stream_is_served_locally() -> None:
    """One bit flipped in every blob A published: B refuses each it reaches (its digest), deletes
    it, and serves from its own tree, answers right."""
    store = MemoryStore()
    _serve_and_publish(_replica(store))
    corrupted: dict[str, bytes] = {}
    for k, blob in list(store.blobs.items()):
        flipped = bytearray(blob)
        flipped[len(flipped) // 2] ^= 0x01
        store.blobs[k] = corrupted[k] = bytes(flipped)
    b = _replica(store)
    H.run_stream(b, SEED, REQUESTS)
    assert b.mismatches == [], b.mismatches[:3]
    st = b.cache.shared
    # each blob refused once, then deleted (B may publish a valid one under its key later); a
    # hit can only be one B published itself meanwhile
    assert st is not None and st.stats.rejected.get("digest", 0) > 0
    unread = [k for k, bad in corrupted.items() if store.blobs.get(k) == bad]
    assert len(unread) + st.stats.rejected["digest"] == len(corrupted)
    assert st.stats.hits <= st.stats.published
    b.cache.manager.check_invariants()


def test_a_fetch_evicts_the_trees_kv_when_sglangs_allocator_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """B's KV pool is nearly full of its own tree's KV (another stream served first): a fetched
    prefix evicts some of it (the codec's ``free_tokens``), as SGLang's admission would, instead of
    being refused for want of room. Without ``free_tokens`` most of the same fetches are lost."""
    store = MemoryStore()
    _serve_and_publish(_replica(store))

    def second_stream() -> tuple[int, int, int, int]:
        b = _replica(store, kv_size=1024)
        H.run_stream(b, 7, REQUESTS)  # fills B's tree (another stream: few of its prefixes stored)
        st = b.cache.shared
        assert st is not None
        free, hits0, no_room0, served0 = b.alloc.available_size(), st.stats.hits, st.stats.no_room, b.hit_tokens
        H.run_stream(b, SEED, REQUESTS)
        assert b.mismatches == [], b.mismatches[:3]
        b.cache.manager.check_invariants()
        return free, st.stats.hits - hits0, st.stats.no_room - no_room0, b.hit_tokens - served0

    free, hits, no_room, served = second_stream()
    assert free < 200 and hits >= 20 and no_room == 0, (free, hits, no_room)
    monkeypatch.delattr(SGLangKVCodec, "free_tokens")
    _, hits_without, no_room_without, served_without = second_stream()
    assert no_room_without >= 10 and hits_without < hits and served_without < served, (
        (hits_without, no_room_without, served_without),
        (hits, served),
    )


def test_replicas_share_prefixes_through_a_real_redis_server(redis_server: Any) -> None:
    _, b = _served_alike_from(RedisStore(redis_server.url))
    assert b.cache.shared is not None and b.cache.shared.stats.hits > 0


def test_a_waiting_queue_probe_prefetches_and_the_admission_takes_the_answer() -> None:
    """A probe of the waiting queue (``match_prefix`` with the request, without ``cow_mamba``)
    issues the tier's prefetch and answers locally; the admission then takes the fetched prefix
    without asking the store again."""
    store = MemoryStore()
    _serve_and_publish(_replica(store))
    b = _replica(store)
    prompt, _, _ = H.stream(SEED, REQUESTS)[0]
    run = H.new_request("probe", prompt, 2, False, random.Random(0))
    key = RadixKey(list(prompt))
    shared = b.cache.shared
    assert shared is not None
    assert b.cache.match_prefix(MatchPrefixParams(key=key, req=run.req)).device_prefix_len == 0
    assert shared.stats.prefetches == 1
    deadline = time.monotonic() + 10
    while b.cache.manager.shared_pending("probe") and time.monotonic() < deadline:
        time.sleep(0.01)
    probes = shared.stats.probes
    assert H.admit(b, run)
    assert run.req.prefix_len > 0 and shared.stats.hits == 1 and shared.stats.probes == probes
    while H.step(b, run, 48):
        pass
    assert b.mismatches == [], b.mismatches[:3]
    b.cache.manager.check_invariants()


class _HeldStore(MemoryStore):
    """A :class:`MemoryStore` whose answers to any thread but the test's wait for ``release``:
    the tier's fetcher thread stays busy with a prefetch for as long as the test likes."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__()
        self.blobs, self.indexes = inner.blobs, inner.indexes
        self.release = threading.Event()
        self._main = threading.get_ident()

    def _hold(self) -> None:
        if threading.get_ident() != self._main:
            self.release.wait(30)

    def get(self, key: str) -> bytes | None:
        self._hold()
        return super().get(key)

    def depths(self, index: str, lo: int, hi: int) -> list[int]:
        self._hold()
        return super().depths(index, lo, hi)


def _held_replica(rid: str) -> tuple[_HeldStore, H.Env, H.Running, Any]:
    """A published to a store, B over it through a :class:`_HeldStore`, a request ``rid`` of the
    stream's first prompt, and B's tier."""
    store = MemoryStore()
    _serve_and_publish(_replica(store))
    held = _HeldStore(store)
    b = _replica(held)
    prompt, _, _ = H.stream(SEED, REQUESTS)[0]
    run = H.new_request(rid, prompt, 2, False, random.Random(0))
    assert b.cache.shared is not None
    return held, b, run, b.cache.shared


def test_an_admission_whose_prefetch_stays_unanswered_asks_the_store_itself() -> None:
    """SGLang admits a request right after it arrives when the batch has room: its prefetch is
    still out then. The admission waits for it at most ``PREFETCH_WAIT_S``, then drops it and asks
    the store on its own thread: the hit is served, never lost to the race."""
    held, b, run, shared = _held_replica("raced")
    try:
        b.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(run.req.origin_input_ids)), req=run.req))
        assert b.cache.manager.shared_pending("raced")
        assert H.admit(b, run)
        assert run.req.prefix_len > 0 and shared.stats.hits == 1 and shared.stats.prefetch_late == 0
        assert shared.stats.prefetch_dropped == 1 and not b.cache.manager.shared_pending("raced")
    finally:
        held.release.set()
    while H.step(b, run, 48):
        pass
    assert b.mismatches == [], b.mismatches[:3]
    b.cache.manager.check_invariants()


def test_an_admission_waits_briefly_for_its_prefetch_and_takes_the_answer() -> None:
    """The fetcher answers a few milliseconds after the admission began: the admission waits for
    it and takes it, without asking the store itself (no probe on the scheduler's thread)."""
    held, b, run, shared = _held_replica("waited")
    assert b.cache.prefetch_request(run.req)
    probes = shared.stats.probes
    timer = threading.Timer(PREFETCH_WAIT_S / 4, held.release.set)
    timer.start()
    try:
        assert H.admit(b, run)
    finally:
        held.release.set()
        timer.join()
    assert run.req.prefix_len > 0 and shared.stats.hits == 1
    assert shared.stats.prefetch_dropped == 0 and shared.stats.probes == probes + 1  # the fetcher's one
    while H.step(b, run, 48):
        pass
    assert b.mismatches == [], b.mismatches[:3]


def test_prefetches_at_arrival_serve_a_queued_stream_as_the_store_would() -> None:
    """Requests arrive eight ahead of their admission, each prefetched as it arrives (what the
    plugin's hook does in SGLang's scheduler): the stream's hits come from the prefetches' answers,
    with the state and KV right."""
    store = MemoryStore()
    _serve_and_publish(_replica(store))
    b = _replica(store)
    H.run_stream(b, SEED, REQUESTS, queued=8, arrived=lambda env, r: env.cache.prefetch_request(r.req))
    st = b.cache.shared
    assert st is not None and b.mismatches == [], b.mismatches[:3]
    assert st.stats.prefetches >= REQUESTS // 2 and st.stats.hits > 0, st.stats
    b.cache.manager.check_invariants()


def test_a_request_aborted_while_it_waits_lets_go_of_its_prefetch() -> None:
    """SGLang's scheduler drops a waiting request it aborts through ``_release_aborted_request``,
    which tells the cache (``finish(handle, ABORT)``): its prefetch and the answer's memory go."""
    from sglang.srt.managers.scheduler import Scheduler

    held, b, run, shared = _held_replica("aborted")
    held.release.set()
    assert b.cache.prefetch_request(run.req)
    deadline = time.monotonic() + 10
    while b.cache.manager.shared_pending("aborted") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert shared.prefetch_bytes > 0
    Scheduler._release_aborted_request(SimpleNamespace(tree_cache=b.cache), run.req)
    ids = np.asarray(run.req.origin_input_ids)
    assert shared.prefetch_bytes == 0 and shared.take("aborted", ids, None, 0) == (False, None)
    b.cache.manager.check_invariants()


def test_the_plugin_hooks_sglangs_arrival_and_prefetches_for_our_cache_only() -> None:
    """After SGLang loads its plugins, its scheduler's ``_prefetch_kvcache`` (called for each
    arriving request) runs our hook: a prefetch for radixcache's cache, nothing for another; a
    prefetch that raises is warned about, never raised into SGLang's arrival path."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins import load_plugins

    load_plugins()
    store = MemoryStore()
    _serve_and_publish(_replica(store))
    b = _replica(store)
    prompt, _, _ = H.stream(SEED, REQUESTS)[0]
    run = H.new_request("arrives", prompt, 2, False, random.Random(0))
    sched = SimpleNamespace(tree_cache=b.cache, enable_hicache_storage=False, enable_lmcache=False)
    Scheduler._prefetch_kvcache(sched, run.req)
    assert b.cache.shared is not None and b.cache.shared.stats.prefetches == 1
    other = SimpleNamespace(tree_cache=object(), enable_hicache_storage=False, enable_lmcache=False)
    Scheduler._prefetch_kvcache(other, run.req)
    run.req.origin_input_ids = [-1, 2]  # an id SGLang's own key would refuse too
    with pytest.warns(RuntimeWarning, match="prefetch at arrival raised"):
        Scheduler._prefetch_kvcache(sched, run.req)


# ------------------------------------------------------------------------------ the codec
def test_the_codec_exports_rows_and_imports_them_into_fresh_indices() -> None:
    env = _replica(None)
    codec = SGLangKVCodec(env.alloc)
    assert env.keys is not None
    assert codec.bytes_per_token == 2 * 2 * 4  # K and V of one layer, one head of two float32
    assert codec.identity == "sglang-kv layers=1 k,v=1x2,1x2 dtype=torch.float32"
    src = env.alloc.alloc(5)
    vals = torch.arange(10, dtype=torch.float32).view(5, 1, 2)
    env.keys[src] = vals
    vbuf = env.alloc.get_kvcache().full_kv_pool.v_buffer[0]
    vbuf[src] = -vals
    blob = bytes(codec.export_kv(src, None))
    assert len(blob) == 5 * codec.bytes_per_token
    free = env.alloc.available_size()
    dst = codec.import_kv(memoryview(blob), 5)
    assert dst is not None and dst.dtype == torch.int64 and env.alloc.available_size() == free - 5
    assert set(dst.tolist()).isdisjoint(src.tolist())
    assert torch.equal(env.keys[dst], vals) and torch.equal(vbuf[dst], -vals)
    env.alloc.free(torch.cat([src, dst]))


def test_the_codec_exports_into_a_buffer_the_tier_handed_back() -> None:
    """``reuse_kv``: the next export that fits is written into the buffer handed back (memory
    written before), with the right rows; ``free_tokens`` is the allocator's free count."""
    env = _replica(None)
    codec = SGLangKVCodec(env.alloc)
    assert env.keys is not None and codec.free_tokens() == env.alloc.available_size()
    src = env.alloc.alloc(6)
    env.keys[src] = torch.arange(12, dtype=torch.float32).view(6, 1, 2)
    first = codec.export_kv(src, None)
    addr = np.frombuffer(first, np.uint8).ctypes.data
    want = bytes(codec.export_kv(src[:4], None))  # not handed back: a buffer of its own
    codec.reuse_kv(first)
    assert codec.buffers.spare_bytes == 6 * codec.bytes_per_token
    del first
    again = codec.export_kv(src[:4], None)
    assert np.frombuffer(again, np.uint8).ctypes.data == addr and bytes(again) == want
    assert codec.buffers.spare_bytes == 0
    assert SGLangKVCodec(env.alloc, keep_bytes=0).buffers.cap_bytes == 0
    with pytest.raises(ValueError, match="cap_bytes"):
        SGLangKVCodec(env.alloc, keep_bytes=-1)
    env.alloc.free(src)


def test_the_codec_refuses_bad_data_and_reports_no_room_allocating_nothing() -> None:
    env = _replica(None, kv_size=16)
    codec = SGLangKVCodec(env.alloc)
    free = env.alloc.available_size()
    with pytest.raises(ValueError, match=r"KV data of 15 bytes for 1 tokens of 16 bytes each"):
        codec.import_kv(b"\0" * 15, 1)
    assert env.alloc.available_size() == free
    assert codec.import_kv(b"\0" * (free + 1) * 16, free + 1) is None
    assert env.alloc.available_size() == free
    with pytest.raises(ValueError, match=r"KV indices must be in \[0, 17\), got \[3, 99\]"):
        codec.export_kv(torch.tensor([3, 99]), None)


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        ({"use_hnd": True}, "the head-major KV layout"),
        ({"k_scale_buffer": [torch.zeros(1)]}, "a KV cache quantized with per-row scales"),
        ({"k_buffer": None}, "a KV pool without per-layer K and V buffers"),
    ],
)
def test_the_codec_refuses_pools_it_cannot_read_by_name(spoil: dict[str, Any], why: str) -> None:
    env = _replica(None)
    full = env.alloc.get_kvcache().full_kv_pool
    for k, v in spoil.items():
        setattr(full, k, v)
    with pytest.raises(NotImplementedError, match=why):
        SGLangKVCodec(env.alloc)
    with pytest.raises(TypeError, match="SGLang's token-to-KV allocator"):
        SGLangKVCodec(object())


def test_a_shared_store_without_a_model_identity_or_of_the_wrong_type_is_refused() -> None:
    env = _replica(None)
    with pytest.raises(ValueError, match="model's identity"):
        RadixcacheHybridCache(env.cache_params, shared=MemoryStore())
    with pytest.raises(TypeError, match="shared must be a SharedStore, got dict"):
        RadixcacheHybridCache(env.cache_params, shared={}, model_identity="m")  # type: ignore[arg-type]


def test_the_factory_reads_the_shared_tier_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _replica(None)
    for v in ("RADIXCACHE_SHARED_NAMESPACE", "RADIXCACHE_SHARED_SECRET", "RADIXCACHE_MODEL_IDENTITY"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.delenv("RADIXCACHE_SHARED_URL", raising=False)
    assert rc_plugin.factory(H.build_context(env.cache_params)).shared is None
    monkeypatch.setenv("RADIXCACHE_SHARED_URL", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="RADIXCACHE_SHARED_URL must be a redis://, rediss:// or unix:// URL, got 'ht"):
        rc_plugin.factory(H.build_context(env.cache_params))
    monkeypatch.setenv("RADIXCACHE_SHARED_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("RADIXCACHE_SHARED_NAMESPACE", "team")
    ctx = H.build_context(env.cache_params, model_path="/m/tiny", revision=None, dtype="float32")
    cache = rc_plugin.factory(ctx)
    tier = cache.shared
    assert tier is not None and isinstance(tier.store, RedisStore)
    assert tier.model == "/m/tiny@None dtype=float32" and tier.namespace == "team"
    monkeypatch.setenv("RADIXCACHE_MODEL_IDENTITY", "mine")
    assert rc_plugin.factory(ctx).shared.model == "mine"


def _serve_one(env: H.Env, rid: str, prompt: list[int], extra_key: str | None) -> H.Running:
    run = H.new_request(rid, prompt, 2, False, random.Random(0))
    run.req.extra_key = extra_key
    assert H.admit(env, run)
    while H.step(env, run, 48):
        pass
    assert env.mismatches == [], env.mismatches[:3]
    return run


def test_replicas_share_an_extra_keys_prefixes_only_under_the_same_key() -> None:
    """SGLang's extra key (a LoRA adapter's, say) is part of the content address: a replica
    serving the same prompt under the same key fetches A's prefix, under another key it does not
    (the same tokens mean other KV and state there)."""
    store = MemoryStore()
    a = _replica(store)
    prompt = list(range(1, 130))
    _serve_one(a, "a", prompt, "lora-a")
    a.cache.manager.publish_pending(wait=True)
    assert store.blobs, "A published nothing under its extra key"
    same, other = _replica(store), _replica(store)
    _serve_one(same, "b", prompt, "lora-a")
    _serve_one(other, "c", prompt, "lora-b")
    assert same.hit_tokens > 0 and same.cache.shared is not None and same.cache.shared.stats.hits == 1
    assert other.hit_tokens == 0 and other.cache.shared is not None and other.cache.shared.stats.hits == 0
    for env in (same, other):
        env.cache.manager.check_invariants()
