"""Real hybrid models: layouts from transformers configs, the slot/cache bridge, and a host serving
tiny seeded models of every covered family with hits equal to cold runs."""

from __future__ import annotations

import dataclasses
import random
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from linear_state import LinearStatePool, RequestOwner, SlotMisuse, StateLayout
from linear_state.hf import CONV_ONLY, FAMILIES, INEXACT, UNSUPPORTED
from radixcache.hf import HFStateBridge, PrecisionLoss, generate_cold_hf, tiny_config, tiny_model
from radixcache.hf.families import INEXACT_CONFIGS, TINY_CONFIGS, hit_tolerance, logit_gap
from radixcache.testing.engine import EngineRequest
from radixcache.testing.hf_engine import HFEngine

COVERED = sorted(TINY_CONFIGS)
TOL = hit_tolerance()  # 1e-5 at tiny_model's realistic logit gap (docs/models.md)

warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")


def _forward(model: Any, cache: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    logits: torch.Tensor = out.logits[0, -1]
    return logits


def test_every_family_transformers_ships_is_covered_or_says_why() -> None:
    shipped = {
        "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "nemotron_h",
        "falcon_h1", "bamba", "granitemoehybrid", "zamba2", "jamba", "lfm2", "minimax", "recurrent_gemma",
    }  # fmt: skip
    assert shipped <= set(FAMILIES) | set(UNSUPPORTED)
    assert set(TINY_CONFIGS) == set(FAMILIES) - set(INEXACT)  # every exact family is served in tests
    assert set(INEXACT_CONFIGS) == set(INEXACT)


@pytest.mark.parametrize("family", COVERED + sorted(INEXACT_CONFIGS))
def test_the_layout_is_what_the_familys_cache_holds(family: str) -> None:
    cfg, model = tiny_model(family)
    layout = StateLayout.from_hf_config(cfg)
    assert layout.conv_dtype == torch.float32 and layout.recurrent_dtype == torch.float32
    cache = HFStateBridge(cfg, allow_inexact=True).new_cache()
    _forward(model, cache, list(range(3, 12)))
    assert layout.model_layers is not None
    linear = [i for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states")]
    assert list(layout.model_layers) == linear
    for i in layout.model_layers:
        layer = cache.layers[i]
        assert tuple(layer.conv_states[0].shape[1:]) == layout.conv_shape
        if family in CONV_ONLY:  # a one-element placeholder in the slot; nothing in the cache
            assert layer.recurrent_states[0] is None and layout.recurrent_shape == (1,)
        else:
            assert tuple(layer.recurrent_states[0].shape[1:]) == layout.recurrent_shape


def test_dtypes_follow_the_model_unless_overridden() -> None:
    cfg = tiny_config("qwen3_next")
    cfg.dtype = torch.bfloat16
    layout = StateLayout.from_hf_config(cfg)
    assert (layout.conv_dtype, layout.recurrent_dtype) == (torch.bfloat16, torch.float32)
    assert "conv_dtype=torch.bfloat16" in repr(layout) and "recurrent_dtype=torch.float32" in repr(layout)
    over = StateLayout.from_hf_config(cfg, conv_dtype=torch.float32, recurrent_dtype=torch.bfloat16)
    assert (over.conv_dtype, over.recurrent_dtype) == (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("family", sorted(UNSUPPORTED))
def test_uncovered_families_say_why(family: str) -> None:
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="not covered"):
        StateLayout.from_hf_config(AutoConfig.for_model(family))


@pytest.mark.parametrize("family", sorted(INEXACT_CONFIGS))
def test_inexact_families_are_refused_and_transformers_still_cannot_continue_them(family: str) -> None:
    """When transformers fixes its cached forward for these, this test fails: cover them then."""
    cfg, model = tiny_model(family)
    with pytest.raises(ValueError, match="allow_inexact"):
        HFStateBridge(cfg)
    bridge = HFStateBridge(cfg, allow_inexact=True)
    ids = [random.Random(1).randrange(3, 256) for _ in range(40)]
    full = _forward(model, bridge.new_cache(), ids)
    cache = bridge.new_cache()
    for s in range(0, 40, 5):
        out = _forward(model, cache, ids[s : s + 5])
    assert float((full - out).abs().max()) > TOL


def test_model_layers_are_validated() -> None:
    with pytest.raises(ValueError, match="model_layers"):
        StateLayout(2, (4, 3), (2, 2), model_layers=(0,))
    with pytest.raises(ValueError, match="model_layers"):
        StateLayout(2, (4, 3), (2, 2), model_layers=(3, 1))
    assert StateLayout(2, (4, 3), (2, 2), model_layers=(1, 3)).model_layers == (1, 3)


def test_storing_a_wider_state_into_a_narrower_slot_is_refused_or_reported_once() -> None:
    cfg, model = tiny_model("qwen3_next")
    narrow = StateLayout.from_hf_config(cfg, conv_dtype=torch.bfloat16)
    pool = LinearStatePool(narrow, 2)
    owner = RequestOwner("r")
    slot = pool.alloc(owner)
    cache = HFStateBridge(cfg).new_cache()
    _forward(model, cache, list(range(3, 20)))
    before = pool.read(slot)
    with pytest.raises(PrecisionLoss, match="float32"):
        HFStateBridge(cfg, narrow).store(cache, pool, slot, owner=owner)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.read(slot), strict=True))  # nothing written
    warn = HFStateBridge(cfg, narrow, on_narrowing="warn")
    with pytest.warns(RuntimeWarning, match="reported once"):
        warn.store(cache, pool, slot, owner=owner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn.store(cache, pool, slot, owner=owner)  # not reported again
    assert warn.narrowed == 2


def test_store_refuses_a_slot_its_request_does_not_own_and_writes_nothing() -> None:
    cfg, model = tiny_model("qwen3_next")
    bridge = HFStateBridge(cfg)
    pool = LinearStatePool(bridge.layout, 3)
    mine, theirs = RequestOwner("mine"), RequestOwner("theirs")
    my_slot, their_slot = pool.alloc(mine), pool.alloc(theirs)
    cache = bridge.new_cache()
    _forward(model, cache, list(range(3, 20)))
    before = pool.fingerprint(their_slot)
    with pytest.raises(SlotMisuse, match="owned by someone else"):
        bridge.store(cache, pool, their_slot, owner=mine)
    with pytest.raises(TypeError, match="owner"):
        bridge.store(cache, pool, their_slot, owner=None)  # type: ignore[arg-type]
    with pytest.raises(SlotMisuse, match="free slot"):
        bridge.store(cache, pool, 2, owner=mine)
    assert pool.fingerprint(their_slot) == before  # nothing written
    bridge.store(cache, pool, my_slot, owner=mine).wait()
    assert pool.fingerprint(my_slot) != pool.fingerprint(their_slot)


def test_load_refuses_a_cache_that_already_ran() -> None:
    cfg, model = tiny_model("nemotron_h")
    bridge = HFStateBridge(cfg)
    pool = LinearStatePool(bridge.layout, 2)
    slot = pool.alloc(RequestOwner("r"))
    cache = bridge.new_cache()
    _forward(model, cache, [5, 6, 7])
    with pytest.raises(ValueError, match="fresh cache"):
        bridge.load(pool, slot, cache, tokens=3)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_a_loaded_cache_continues_at_the_prefixs_position(family: str) -> None:
    """A cache loaded from a slot reports the prefix's length (transformers 5.25 positions the next
    forward by its first layer's count, a linear layer in qwen3_next), so the continuation without
    explicit positions equals the cold run's."""
    cfg, model = tiny_model(family)
    bridge = HFStateBridge(cfg)
    pool = LinearStatePool(bridge.layout, 2)
    owner = RequestOwner("r")
    slot = pool.alloc(owner)
    prefix = list(range(3, 40))
    cold = bridge.new_cache()
    _forward(model, cold, prefix)
    bridge.store(cold, pool, slot, owner=owner).wait()
    cache = bridge.new_cache()
    for bad in (-1, 2.0, True, None):
        with pytest.raises(ValueError, match="tokens"):
            bridge.load(pool, slot, cache, tokens=bad)  # type: ignore[arg-type]
    assert not any(cache.layers[i].is_conv_states_initialized[0] for i in bridge.layout.model_layers or ())
    bridge.load(pool, slot, cache, tokens=len(prefix))
    for i in bridge.attention_layers(cache):  # the prefix's KV, as a host appends it from its store
        cache.layers[i].update(cold.layers[i].keys, cold.layers[i].values)
    assert int(cache.get_seq_length()) == len(prefix)
    assert float((_forward(model, cache, [9, 10]) - _forward(model, cold, [9, 10])).abs().max()) < TOL


def _serve(engine: HFEngine, prompts: list[list[int]], new: int = 3) -> list[EngineRequest]:
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(len(engine.finished) + len(engine.waiting) + 1000 * i, p, new))
        engine.run()  # one at a time: each later prompt finds the earlier ones in the tree
    return engine.finished


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 256) for _ in range(150)]
    first = system + [rng.randrange(3, 256) for _ in range(30)]
    return [first, first + [rng.randrange(3, 256) for _ in range(20)], [*system, 7, 8, 9, 10]]


@pytest.mark.parametrize("family", COVERED)
def test_a_hit_equals_the_cold_run_and_a_perturbed_state_does_not(family: str) -> None:
    cfg, model = tiny_model(family)
    engine = HFEngine(model, cfg, track_align=16)
    finished = _serve(engine, _prompts())
    assert finished[0].cached_length == 0 and finished[1].cached_length >= len(_prompts()[0]) - 1  # the finish state
    for r in finished:
        gt, first = generate_cold_hf(model, engine.bridge, r.prompt, len(r.output))
        assert r.output == gt
        assert r.first_logits is not None and float((r.first_logits - first).abs().max()) < TOL, family
    engine.manager.check_invariants()

    # The same hit with its restored state perturbed: the check above fails.
    cfg, model = tiny_model(family)
    engine = HFEngine(model, cfg, track_align=16)
    prompts = _prompts()
    _serve(engine, prompts[:1])
    for node in engine.cache.iter_nodes():
        if node.snapshot is not None:
            engine.pool.recurrent[:, node.snapshot] += 0.5
            engine.pool.conv[:, node.snapshot] += 0.5
    r = _serve(engine, prompts[1:2])[-1]
    assert r.cached_length > 0
    _, first = generate_cold_hf(model, engine.bridge, r.prompt, 1)
    assert r.first_logits is not None and float((r.first_logits - first).abs().max()) > TOL


def _prefilled(family: str, lens: tuple[int, ...]) -> tuple[Any, Any, HFStateBridge, list[Any], list[Any]]:
    """The family's tiny model and, for each length, a prefilled cache and an identical copy."""
    import copy

    cfg, model = tiny_model(family)
    bridge = HFStateBridge(cfg)
    g = torch.Generator().manual_seed(1)
    caches = []
    for n in lens:
        c = bridge.new_cache()
        _forward(model, c, torch.randint(3, 256, (n,), generator=g).tolist())
        caches.append(c)
    return cfg, model, bridge, caches, copy.deepcopy(caches)


def _linear_states(bridge: HFStateBridge, cache: Any) -> list[torch.Tensor]:
    pool = LinearStatePool(bridge.layout, 2)
    owner = RequestOwner("probe")
    slot = pool.alloc(owner)
    bridge.store(cache, pool, slot, owner=owner)
    conv, rec = pool.read(slot)
    return [conv.clone(), rec.clone()]


@pytest.mark.parametrize("family", COVERED)
def test_a_batched_decode_equals_each_request_decoded_alone(family: str) -> None:
    lens = (5, 12, 9)
    _, model, bridge, caches, alone = _prefilled(family, lens)
    tokens = [7, 8, 9]
    ref = [_forward(model, c, [t]) for c, t in zip(alone, tokens, strict=True)]
    stacked = bridge.batch(caches, list(lens))
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens).unsqueeze(1),
            attention_mask=stacked.attention_mask,
            position_ids=stacked.position_ids,
            cache=stacked.cache,
            use_cache=True,
        )
    bridge.unbatch(stacked, caches)
    for b in range(len(lens)):
        assert float((out.logits[b, -1] - ref[b]).abs().max()) < TOL, (family, b)
        for got, want in zip(_linear_states(bridge, caches[b]), _linear_states(bridge, alone[b]), strict=True):
            assert float((got - want).abs().max()) < TOL, (family, b)
        for i in bridge.attention_layers(caches[b]):
            assert caches[b].layers[i].keys.shape[2] == lens[b] + 1
            assert float((caches[b].layers[i].keys - alone[b].layers[i].keys).abs().max()) < TOL
            assert float((caches[b].layers[i].values - alone[b].layers[i].values).abs().max()) < TOL
        # the split-back cache counts its new token: the next forward (positions from the cache) goes on
        assert int(caches[b].get_seq_length()) == int(alone[b].get_seq_length()) == lens[b] + 1
        assert float((_forward(model, caches[b], [5]) - _forward(model, alone[b], [5])).abs().max()) < TOL


def test_a_batch_without_its_padding_mask_is_wrong() -> None:
    """The mask is what makes the left padding harmless: without it the shorter rows attend to
    zero keys and their logits move (so the check above can fail)."""
    lens = (5, 12)
    _, model, bridge, caches, alone = _prefilled("qwen3_next", lens)
    ref = _forward(model, alone[0], [7])
    stacked = bridge.batch(caches, list(lens))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[7], [8]]), position_ids=stacked.position_ids, cache=stacked.cache)
    assert float((out.logits[0, -1] - ref).abs().max()) > 1e-3


def test_batch_refuses_lengths_that_are_not_the_caches() -> None:
    _, _, bridge, caches, _ = _prefilled("qwen3_next", (5, 12))
    with pytest.raises(ValueError, match="lengths"):
        bridge.batch(caches, [5])
    with pytest.raises(ValueError, match="lengths"):
        bridge.batch(caches, [5, -1])
    with pytest.raises(ValueError, match="holds 12 KV tokens, its length says 11"):
        bridge.batch(caches, [5, 11])
    with pytest.raises(ValueError, match="no caches"):
        bridge.batch([], [])
    fresh = bridge.new_cache()
    with pytest.raises(ValueError, match="holds no conv state in some request"):
        bridge.batch([caches[0], fresh], [5, 0])
    stacked = bridge.batch(caches, [5, 12])
    before = [_linear_states(bridge, c) for c in caches]
    stacked.cache.layers[0].recurrent_states[0].add_(1.0)  # a batch that ran no forward, states moved
    with pytest.raises(ValueError, match="run the forward first"):
        bridge.unbatch(stacked, caches)
    for b, c in zip(before, caches, strict=True):  # nothing was written back
        assert all(torch.equal(x, y) for x, y in zip(b, _linear_states(bridge, c), strict=True))
    with pytest.raises(ValueError, match="1 caches for a batch of 2"):
        bridge.unbatch(stacked, caches[:1])


def test_the_engine_refuses_a_batch_decode_that_is_not_a_bool() -> None:
    cfg, model = tiny_model("nemotron_h")
    with pytest.raises(TypeError, match="batch_decode must be a bool, got 'no'"):
        HFEngine(model, cfg, batch_decode="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("batch_decode", [True, False])
def test_the_engine_decodes_its_running_requests_in_one_forward(batch_decode: bool) -> None:
    cfg, model = tiny_model("nemotron_h")
    engine = HFEngine(model, cfg, track_align=16, batch_decode=batch_decode)
    prompts = _prompts()
    for i, p in enumerate(prompts):  # all at once: they decode side by side
        engine.submit(EngineRequest(i, p, 6))
    engine.run()
    decoded = sum(len(r.output) - 1 for r in engine.finished)
    if batch_decode:
        assert engine.decode_forwards < decoded
    else:
        assert engine.decode_forwards == decoded
    for r in engine.finished:
        assert r.output == generate_cold_hf(model, engine.bridge, r.prompt, len(r.output))[0]
    engine.manager.check_invariants()


def test_the_hammer_serves_a_transformers_model_exactly() -> None:
    from radixcache.testing.hammer import HammerConfig, run_hammer

    rep = run_hammer(HammerConfig(model="hf:nemotron_h", requests=16, concurrency=4, logit_tol=TOL, probe_tokens=512))
    assert rep.ok, rep.as_dict()
    assert rep.cached_tokens > 0 and rep.wrong_answers == 0


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_a_conv_window_loaded_one_column_off_fails_the_hf_hammer(family: str) -> None:
    """The bridge bug the fuzzing kit cannot see (it never runs the bridge): the hammer on a
    transformers model finds wrong answers, and the bridge is put back afterwards."""
    from radixcache.hf.bridge import HFStateBridge
    from radixcache.testing.hammer import HammerConfig, format_report, run_hammer

    real = HFStateBridge.load
    cfg = HammerConfig(model=f"hf:{family}", requests=16, concurrency=4, logit_tol=TOL, probe_tokens=512)
    rep = run_hammer(dataclasses.replace(cfg, inject="hf-conv-shift"))
    assert not rep.ok and rep.wrong_answers > 0, format_report(rep)
    assert HFStateBridge.load is real


def test_the_hammer_refuses_what_the_hf_engine_cannot_do() -> None:
    from radixcache.testing.hammer import HammerConfig, run_hammer

    with pytest.raises(ValueError, match="hf:FAMILY"):
        run_hammer(HammerConfig(model="hf:minimax"))
    with pytest.raises(ValueError, match="reference engine"):
        run_hammer(HammerConfig(model="hf:qwen3_next", inject="alias"))


def test_docs_models_table_is_the_generated_one() -> None:
    from pathlib import Path

    from radixcache.hf.table import models_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    table = doc.split("-->", 1)[1].split("<!-- table:end -->", 1)[0].strip()
    assert table == models_table()


def test_the_readme_lists_exactly_the_covered_families() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("Hybrid families served:"))
    listed = {x.strip(" .`") for x in line.split(":", 1)[1].split(",")}
    assert listed == set(TINY_CONFIGS)


def test_the_cold_generation_returns_every_steps_logits_and_matches_a_full_forward() -> None:
    """cold_generation_hf: the first token's logits are generate_cold_hf's, every step's logits
    chose its token, and each step equals a full forward of the prompt and the tokens so far
    (transformers' cached step against no cache) within the 1e-5 the docs state."""
    from radixcache.hf import cold_generation_hf

    cfg, model = tiny_model("qwen3_next")
    bridge = HFStateBridge(cfg)
    prompt = list(range(3, 40))
    gen = cold_generation_hf(model, bridge, prompt, 5)
    tokens, first = generate_cold_hf(model, bridge, prompt, 5)
    assert gen.tokens == tokens and torch.equal(gen.logits[0], first) and len(gen.logits) == 5
    for k, (tok, logits) in enumerate(zip(gen.tokens, gen.logits, strict=True)):
        assert int(torch.argmax(logits)) == tok
        full = bridge.new_cache()
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt + gen.tokens[:k]]), cache=full, use_cache=True)
        assert float((out.logits[0, -1].float() - logits).abs().max()) < 1e-5, k
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="n must be"):
            cold_generation_hf(model, bridge, prompt, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        cold_generation_hf(model, bridge, [], 1)


@pytest.mark.parametrize("family", COVERED)
def test_tiny_models_have_a_realistic_logit_scale_and_init_on_request(family: str) -> None:
    """The tests run at a realistic scale: the top logit 4 above the median (transformers' init
    gives about 0.45, where a wrong state moves the logits less); gap=None keeps the init."""
    from radixcache.hf.families import REALISTIC_LOGIT_GAP

    _, model = tiny_model(family)
    assert abs(logit_gap(model) - REALISTIC_LOGIT_GAP) < 1e-3
    _, init = tiny_model(family, gap=None)
    assert logit_gap(init) < 1.0
    for other, mine in zip(init.parameters(), model.parameters(), strict=True):
        if other.shape == model.get_output_embeddings().weight.shape and not torch.equal(other, mine):
            continue  # the output projection: scaled
        assert torch.equal(other, mine)  # every other weight is transformers' init, unchanged
    with pytest.raises(ValueError, match="gap"):
        tiny_model(family, gap=0)
