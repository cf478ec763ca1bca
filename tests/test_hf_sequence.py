"""HFSequence: one request of a transformers host on a manager that owns the KV. A hit's whole
generation equals the cold one; every KV index comes back; bad calls are refused before anything
is loaded or committed."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from linear_state import LinearStatePool
from radixcache import Admission, CacheManager, HybridRadixCache, KVFreeList
from radixcache.hf import HFSequence, HFStateBridge, KVStore, cold_generation_hf, tiny_model
from radixcache.hf.families import hit_tolerance
from radixcache.policies import HitDensity

warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")


@pytest.fixture(scope="module")
def host() -> tuple[object, HFStateBridge, KVStore]:
    _, model = tiny_model("qwen3_next")
    bridge = HFStateBridge(model.config)
    return model, bridge, KVStore(model, bridge, 2048)


def make(bridge: HFStateBridge, kv: KVFreeList | None) -> CacheManager:
    cache = HybridRadixCache(LinearStatePool(bridge.layout, 3 * 3 + 16))
    return CacheManager(cache, HitDensity(block=16), track_slots=2, kv=kv, host_tier=None)


def generate(seq: HFSequence, n: int, chunk: int = 40) -> list[torch.Tensor]:
    out = []
    while seq.computed < len(seq.prompt):
        logits = seq.prefill(min(len(seq.prompt), seq.computed + chunk))
    for _ in range(n):
        out.append(logits.clone())
        if len(out) < n:
            logits = seq.decode(int(logits.argmax()))
    return out


def test_a_hit_generates_what_a_cold_run_does_and_every_index_returns(host: tuple) -> None:  # type: ignore[type-arg]
    model, bridge, store = host
    kv = KVFreeList(2048)
    mgr = make(bridge, kv)
    rng = random.Random(3)
    system = [rng.randrange(3, 200) for _ in range(100)]
    prompts = [system + [rng.randrange(3, 200) for _ in range(k)] for k in (9, 23)]
    hits = []
    for rid, prompt in enumerate(prompts):
        adm = mgr.admit(rid, prompt, max_new_tokens=4)
        assert isinstance(adm, Admission)
        seq = HFSequence(mgr, model, bridge, store, adm, prompt)
        got = generate(seq, 4)
        seq.finish()
        cold = cold_generation_hf(model, bridge, prompt, 4)
        worst = max(float((g - c).abs().max()) for g, c in zip(got, cold.logits, strict=True))
        assert worst < hit_tolerance(), (rid, worst)
        hits.append(adm.cached_length)
    assert hits[0] == 0 and hits[1] >= 64  # the second request resumed inside the shared system prompt
    mgr.check_invariants()
    assert kv.num_free + mgr.cache.total_kv_tokens == kv.capacity


def test_abort_gives_the_reservation_back(host: tuple) -> None:  # type: ignore[type-arg]
    model, bridge, store = host
    kv = KVFreeList(512)
    mgr = make(bridge, kv)
    prompt = list(range(3, 40))
    adm = mgr.admit("a", prompt, max_new_tokens=8)
    assert isinstance(adm, Admission)
    seq = HFSequence(mgr, model, bridge, store, adm, prompt)
    seq.prefill(20)
    seq.abort()
    assert kv.num_free + mgr.cache.total_kv_tokens == kv.capacity and mgr.num_requests == 0


def test_bad_calls_are_refused_before_anything_changes(host: tuple) -> None:  # type: ignore[type-arg]
    model, bridge, store = host
    prompt = list(range(3, 30))
    host_kept = make(bridge, None)
    adm = host_kept.admit("h", prompt)
    assert isinstance(adm, Admission)
    with pytest.raises(ValueError, match="owns the KV"):
        HFSequence(host_kept, model, bridge, store, adm, prompt)
    mgr = make(bridge, KVFreeList(512))
    with pytest.raises(TypeError, match="Admission"):
        HFSequence(mgr, model, bridge, store, "a", prompt)  # type: ignore[arg-type]
    a, b = mgr.admit("a", prompt), mgr.admit("b", prompt)
    assert isinstance(a, Admission) and isinstance(b, Admission)
    seq = HFSequence(mgr, model, bridge, store, a, prompt)
    plan = mgr.plan_prefill("a", 10)
    with pytest.raises(ValueError, match="needs 10 ids, got 3"):
        seq.window(plan, prompt[:3])
    with pytest.raises(ValueError, match="a plan of request 'b'"):
        seq.window(mgr.plan_prefill("b", 10), prompt[:10])
    assert seq.computed == 0 and mgr.cached_length("a") == 0
    mgr.check_invariants()
