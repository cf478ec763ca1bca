import dataclasses

import pytest
import torch

from radixcache.cli import main
from radixcache.core.kv import KVFreeList
from radixcache.policies import FixedPoints
from radixcache.testing.engine import EngineRequest, ReferenceEngine, generate_cold
from radixcache.testing.hammer import HammerConfig, format_report, run_hammer
from radixcache.testing.model import HybridConfig, HybridModel

MODEL = HybridModel(HybridConfig())


def test_small_hammer_is_clean_and_hits() -> None:
    rep = run_hammer(HammerConfig(requests=60, concurrency=6, seed=3), model=MODEL)
    assert rep.ok, format_report(rep)
    assert rep.wrong_answers == 0 and rep.slots_leaked == 0 and rep.kv_leaked == 0
    assert rep.hits > 0 and rep.cached_fraction > 0.2
    assert rep.aborted > 0, "the mix aborts some streams midway"
    assert rep.probe_hit_fraction >= 0.9 and rep.probe_ttft_hit_ms < rep.probe_ttft_cold_ms


@pytest.mark.parametrize("bug", ["alias", "no-donate-fence", "no-restore-fence"])
def test_every_injected_bug_is_caught(bug: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["hammer", "--requests", "80", "--seed", "0", "--inject", bug])
    out = capsys.readouterr().out
    assert status != 0, out
    assert "RESULT: FAIL" in out
    wrong = int(out.split("wrong answers")[1].split()[0])
    unwritten = int(out.split("snapshots donated unwritten (write checks)")[1].split()[0])
    # A clone taken before its producer wrote the track slot copies the manager's NaN probes: the
    # write checks name it (no-donate-fence); the ground truth names what was served wrong.
    assert wrong >= 1 or (bug == "no-donate-fence" and unwritten >= 1), out


def test_engine_serves_identical_prompts_with_a_hit_and_the_same_answer() -> None:
    engine = ReferenceEngine(MODEL, max_running=2)
    prompt = [int(x) for x in torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1))]
    engine.submit(EngineRequest("a", prompt, 5))
    engine.run()
    engine.submit(EngineRequest("b", list(prompt), 5))
    a, b = engine.run()
    gt, _ = generate_cold(MODEL, prompt, 5)
    assert a.output == b.output == gt
    assert a.cached_length == 0 and b.cached_length == 299
    engine.manager.check_invariants()


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ([1, -2, 3], ValueError, "key id -2 at position 1"),
        ([1, 2**31], ValueError, "outside"),
        ([1, 2.5], TypeError, "2.5"),
    ],
)
def test_submit_refuses_ids_the_cache_cannot_key_and_queues_nothing(
    prompt: list[int], error: type[Exception], message: str
) -> None:
    engine = ReferenceEngine(MODEL)
    with pytest.raises(error, match=message):
        engine.submit(EngineRequest("bad", prompt, 1))
    assert not engine.waiting and engine.run() == []
    engine.submit(EngineRequest("good", [1, 2, 3], 1))  # the ids are checked once, at submit
    (done,) = engine.run()
    assert done.rid == "good" and len(done.output) == 1
    engine.manager.check_invariants()


def test_kv_allocator_refuses_double_free() -> None:
    kv = KVFreeList(4)
    idx = kv.alloc(3)
    assert idx is not None and kv.num_free == 1 and kv.alloc(2) is None and kv.num_free == 1
    kv.free(idx[:1])
    with pytest.raises(RuntimeError, match="freed twice"):
        kv.free(idx[:1])


def test_unknown_inject_mode() -> None:
    with pytest.raises(ValueError, match="unknown inject mode"):
        ReferenceEngine(MODEL, inject="typo")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("concurrency", 0, "concurrency must be an int >= 1, got 0"),
        ("requests", -1, "requests must be an int >= 0, got -1"),
        ("chunk", 2.5, "chunk must be an int >= 1, got 2.5"),
        ("max_new_tokens", 2, r"max_new_tokens must be an int >= min_new_tokens \(4\), got 2"),
        ("tenant_share", 1.5, r"tenant_share must be a fraction in \[0, 1\], got 1.5"),
        ("host_slots", -3, "host_slots must be None or an int >= 0, got -3"),
        ("logit_tol", float("nan"), "logit_tol must be a number >= 0, got nan"),
        ("policy", "lru", "hammer policy 'lru': known"),
        ("inject", "typo", "hammer inject 'typo': known"),
        ("clock", "lunar", "hammer clock 'lunar': known"),
    ],
)
def test_a_hammer_config_out_of_range_is_refused_before_anything_runs(field: str, value: object, message: str) -> None:
    # concurrency 0 used to spin until the watchdog; the others failed deep inside the run
    cfg = dataclasses.replace(HammerConfig(requests=4), **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        run_hammer(cfg, model=MODEL)


def test_a_hammer_without_ground_truth_says_so_and_never_passes() -> None:
    rep = run_hammer(HammerConfig(requests=6, concurrency=3, seed=1, ground_truth=False), model=MODEL)
    text = format_report(rep)
    assert not rep.checked and not rep.ok
    assert "NOT CHECKED" in text and "PASS" not in text and "not checked (no ground truth)" in text


def test_the_watchdog_fails_a_hammer_that_stops_making_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the engine can never move (here: prefill chunks that compute nothing) ends the
    run as a failure after stall_steps steps, instead of hanging it."""
    monkeypatch.setattr(ReferenceEngine, "_prefill_chunk", lambda self, r: None)
    rep = run_hammer(HammerConfig(requests=5, concurrency=2, seed=2, stall_steps=50), model=MODEL)
    assert rep.stuck > 0 and not rep.ok
    assert "stuck requests (aborted by the watchdog)" in format_report(rep) and "RESULT: FAIL" in format_report(rep)
    assert rep.slots_leaked == 0 and rep.kv_leaked == 0, "the watchdog's aborts free what the requests held"


def test_the_mix_carries_tenants_images_one_token_requests_and_warm_prompts() -> None:
    cfg = HammerConfig(requests=60, concurrency=6, seed=5, image_share=0.5, tenant_share=0.5, single_token_share=0.2)
    rep = run_hammer(cfg, model=MODEL)
    assert rep.ok, format_report(rep)
    assert rep.tenant_requests > 0 and rep.image_requests > 0
    assert "tenant / image requests" in format_report(rep)


# Each class of keying or KV-aliasing bug fails the hammer. The mix is the default one with more
# of the requests each bug needs (the default 500-request hammer catches each too: docs/hammer.md).
FOCUSED = {
    "namespace-blind": HammerConfig(requests=40, seed=0, tenant_share=0.6),
    "image-digest-prefix": HammerConfig(requests=120, seed=0, image_share=0.7, tenant_share=0.0),
    "full-hit-admission": HammerConfig(requests=120, seed=0, single_token_share=0.5, stall_steps=300),
    "tree-keeps-kv-view": HammerConfig(requests=40, seed=0),
}


@pytest.mark.parametrize("bug", sorted(FOCUSED))
def test_keying_and_kv_aliasing_bugs_fail_the_hammer(bug: str) -> None:
    clean = run_hammer(FOCUSED[bug], model=MODEL)
    assert clean.ok, format_report(clean)
    rep = run_hammer(dataclasses.replace(FOCUSED[bug], inject=bug), model=MODEL)
    assert not rep.ok and "RESULT: FAIL" in format_report(rep)
    assert rep.wrong_answers + rep.stuck > 0 or rep.error is not None, format_report(rep)


def test_an_exception_out_of_the_engine_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = ReferenceEngine.step

    def step(self: ReferenceEngine) -> None:
        calls["n"] += 1
        if calls["n"] == 30:
            raise RuntimeError("KV index 7 freed twice")
        real(self)

    monkeypatch.setattr(ReferenceEngine, "step", step)
    rep = run_hammer(HammerConfig(requests=8, concurrency=2, seed=2), model=MODEL)
    assert rep.error == "RuntimeError: KV index 7 freed twice" and not rep.ok
    assert "error (the run ended here)" in format_report(rep) and "RESULT: FAIL" in format_report(rep)


def test_warm_caches_prompts_through_a_reused_staging_buffer() -> None:
    engine = ReferenceEngine(MODEL, max_running=2)
    gen = torch.Generator().manual_seed(4)
    systems = [[int(x) for x in torch.randint(0, 511, (n,), generator=gen)] for n in (200, 130)]
    assert engine.warm(systems) == 330 and engine.warm(systems, namespace="t") == 330
    kv_a = engine.cache.kv_indices(engine.cache.match(systems[0]).node)
    assert len(set(kv_a.tolist())) == 200 and engine.cache.num_snapshots == 4
    prompt = systems[0] + [5, 6, 7]
    engine.submit(EngineRequest("a", prompt, 4))
    engine.submit(EngineRequest("b", prompt, 4, namespace="t"))
    a, b = engine.run()
    assert a.cached_length == b.cached_length == 200
    assert (a.output, b.output) == (
        generate_cold(MODEL, prompt, 4)[0],
        generate_cold(MODEL, prompt, 4, namespace="t")[0],
    )
    assert a.output != b.output, "the tenant's adapter makes it another model"
    engine.submit(EngineRequest("c", [1, 2, 3], 2))
    with pytest.raises(RuntimeError, match="before serving"):
        engine.warm(systems)
    engine.run()
    engine.manager.check_invariants()


def test_images_key_by_every_byte_and_a_hit_inside_an_image_is_exact() -> None:
    ph = MODEL.cfg.placeholder_id
    image = bytes(range(256)) * 40  # 10 KiB
    variant = image[:5000] + b"\xff" + image[5001:]  # differs beyond the first 4 KiB only
    assert not torch.equal(MODEL.image_rows(image, 3), MODEL.image_rows(variant, 3))
    assert torch.equal(MODEL.image_rows(image, 5)[:3], MODEL.image_rows(image, 3)), "row k depends on k only"
    prompt = list(range(40)) + [ph] * 30 + list(range(50, 70))
    engine = ReferenceEngine(MODEL, max_running=2, chunk=64, policy=FixedPoints(16))  # snapshots every 16
    engine.submit(EngineRequest("a", prompt, 3, images=[image]))
    engine.run()
    # Cut inside the image run: the hit ends mid-image; the rest of the run is scattered after it.
    cut = prompt[:60] + list(range(100, 140))
    engine.submit(EngineRequest("b", cut, 3, images=[image]))
    engine.submit(EngineRequest("c", list(prompt), 3, images=[variant]))
    _, b, c = engine.run()
    assert 40 < b.cached_length <= 60, b.cached_length
    assert c.cached_length <= 40, "another image must not hit the first image's states"
    assert b.output == generate_cold(MODEL, cut, 3, images=[image])[0]
    assert c.output == generate_cold(MODEL, prompt, 3, images=[variant])[0]
    assert all(t != ph for r in (b, c) for t in r.output), "the placeholder is never generated"


def test_the_hammer_refuses_a_device_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="'tpu:0'"):
        run_hammer(HammerConfig(requests=1, device="tpu:0"))
    with pytest.raises(ValueError, match="'not-a-device'"):
        run_hammer(HammerConfig(requests=1, device="not-a-device"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"'cuda'.*CUDA is not available"):
            run_hammer(HammerConfig(requests=1, device="cuda"))


def test_the_model_draws_its_weights_once_for_every_device() -> None:
    """The weights come from the CPU generator and are then moved: the same model everywhere."""
    a, b = HybridModel(HybridConfig(), device="cpu"), HybridModel(HybridConfig())
    assert a.device == torch.device("cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert "mixers.3.inv_freq" not in a.state_dict()  # a buffer that moves with the model, not a weight


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_hammer_on_cuda_is_clean_and_hits() -> None:  # pragma: no cover - GPU only
    """Forwards and copies on two CUDA streams, ordered by fences alone: every answer still equals
    the cold one (computed on the same device), nothing leaks, and the mix hits."""
    rep = run_hammer(HammerConfig(requests=60, device="cuda"))
    assert rep.device.startswith("cuda")
    assert rep.ok, format_report(rep)
    assert rep.hits > 0.5 * rep.requests


def test_a_forward_delay_is_refused_off_cuda_and_when_negative() -> None:
    with pytest.raises(ValueError, match=r"forward_delay_us=5.*cpu"):
        ReferenceEngine(MODEL, forward_delay_us=5)
    with pytest.raises(ValueError, match=r"forward_delay_us=-1"):
        ReferenceEngine(MODEL, forward_delay_us=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("bug", [None, "no-donate-fence", "no-restore-fence"])
def test_on_cuda_delayed_forwards_expose_each_missing_fence(bug: str | None) -> None:  # pragma: no cover
    """With every forward held on the GPU longer than the host takes to queue it and its commit, an
    unfenced copy reads its slot before the forward wrote it: each fence bug serves wrong answers,
    while the correct cache stays exact. (A 0.5 ms hold was too short on an H200: the host's
    Python queues a forward in milliseconds, so the GPU had caught up before any copy was queued;
    20 ms is not yet confirmed on a GPU.)"""
    rep = run_hammer(HammerConfig(requests=60, device="cuda", inject=bug, forward_delay_us=20_000))
    assert rep.ok == (bug is None), format_report(rep)


def test_the_ground_truth_in_worker_processes_is_the_alone_answer_on_200_prompts() -> None:
    """generate_cold_many (two spawned processes, one thread each) against generate_cold here, one
    prompt at a time: the same tokens and bit-identical first logits on 200 prompts with shared
    system prompts, two namespaces and images, so the hammer's faster ground truth is still the
    cold, alone answer."""
    import random

    from radixcache.testing.engine import generate_cold_many

    rng = random.Random(11)
    ph = MODEL.cfg.placeholder_id
    systems = [[rng.randrange(ph) for _ in range(rng.randint(60, 140))] for _ in range(3)]
    jobs = []
    for i in range(200):
        prompt = rng.choice(systems) + [rng.randrange(ph) for _ in range(rng.randint(1, 40))]
        images: tuple[bytes, ...] = ()
        if i % 5 == 0:
            prompt = prompt + [ph] * 6 + [rng.randrange(ph) for _ in range(3)]
            images = (bytes([i % 256]) * 64,)
        jobs.append((prompt, rng.randint(1, 4), "tenant" if i % 3 == 0 else None, images))
    seen: list[int] = []
    many = generate_cold_many(MODEL, jobs, chunk=64, workers=2, progress=seen.append, parallel_above=0)
    assert sorted(seen) == list(range(200))
    for (prompt, n, ns, images), (tokens, first) in zip(jobs, many, strict=True):
        alone, alone_first = generate_cold(MODEL, prompt, n, chunk=64, namespace=ns, images=images)
        assert tokens == alone and torch.equal(first, alone_first), (len(prompt), ns, bool(images))
    with pytest.raises(ValueError, match="workers"):
        generate_cold_many(MODEL, jobs[:2], workers=0)


# ------------------------------------------------------------------ the hit-rate guard (issue 37)
def test_the_default_mix_puts_the_pools_under_pressure_and_passes_the_hit_rate_guard() -> None:
    """The default hammer (served without its ground truth here: the guard reads cached tokens
    only) evicts for slots and for KV, demotes to the host tier and hits there, and serves what
    the repository recorded for seeds 0 and 7."""
    for seed in (0, 7):
        rep = run_hammer(HammerConfig(seed=seed, ground_truth=False), model=MODEL)
        assert rep.hit_guard is not None and rep.hit_guard["status"] == "pass", rep.hit_guard
        m = rep.metrics
        assert isinstance(m["evictions"], dict) and m["evictions"]["admission"] and m["evictions"]["kv-pressure"]
        assert m["demotions"] and m["host_hits"], m
        assert "hit-rate guard" in format_report(rep) and "pass" in format_report(rep)


def test_captures_one_token_late_fail_the_hit_rate_guard() -> None:
    """A placement bug: every answer exact, fewer prompt tokens served from cache. The guard fails
    it; nothing else in the hammer would."""
    rep = run_hammer(HammerConfig(seed=0, inject="capture-one-late"), model=MODEL)
    assert rep.hit_guard is not None and rep.hit_guard["status"] == "fail", rep.hit_guard
    assert float(rep.hit_guard["drop"]) > 0.02  # type: ignore[arg-type]
    assert rep.wrong_answers == 0 and rep.error is None, "the bug costs hits, not answers"
    assert not rep.ok and "RESULT: FAIL" in format_report(rep)
    assert dataclasses.replace(rep, hit_guard=None).ok, "only the guard sees it"


def test_an_unrecorded_configuration_is_neither_pass_nor_fail() -> None:
    rep = run_hammer(HammerConfig(requests=8, concurrency=2, seed=2), model=MODEL)
    assert rep.ok and rep.hit_guard is not None and rep.hit_guard["status"] == "unrecorded"
    off = run_hammer(HammerConfig(requests=8, concurrency=2, seed=2, hit_guard=False), model=MODEL)
    assert off.hit_guard is None and "hit-rate guard" in format_report(off)


def test_the_guard_key_leaves_out_what_does_not_shape_hits() -> None:
    from radixcache.testing.hammer import guard_fields

    base = guard_fields(HammerConfig())
    assert guard_fields(HammerConfig(inject="alias", forensics="x", workers=3, ground_truth=False)) == base
    assert guard_fields(HammerConfig(seed=1)) != base
    assert guard_fields(HammerConfig(clock="wall")) != base  # the policy's clock shapes what it keeps
    with_redis = guard_fields(HammerConfig(shared_redis="redis://127.0.0.1:1/0"))
    assert with_redis == guard_fields(HammerConfig(shared_redis="redis://127.0.0.1:2/0"))
    assert with_redis["shared_redis"] is True and "shared_corrupt" not in base


def test_the_hammer_knows_the_bugs_it_injects() -> None:
    with pytest.raises(ValueError, match="hf:FAMILY"):
        run_hammer(HammerConfig(requests=1, inject="hf-conv-shift"), model=MODEL)
    with pytest.raises(ValueError, match="shared_corrupt"):
        run_hammer(HammerConfig(requests=1, shared_corrupt=1.5), model=MODEL)


def test_on_the_step_clock_two_runs_serve_the_same_figures() -> None:
    """The hammer's default clock counts scheduler steps: the policy's choices, and so every
    figure, are the same run after run (on the wall clock they move with the machine's pace)."""
    cfg = HammerConfig(requests=60, concurrency=6, seed=3, ground_truth=False, hit_guard=False)
    a, b = run_hammer(cfg, model=MODEL), run_hammer(cfg, model=MODEL)
    assert (a.cached_tokens, a.hits, a.metrics) == (b.cached_tokens, b.hits, b.metrics)
    with pytest.raises(ValueError, match="policy_clock must be one of"):
        ReferenceEngine(MODEL, policy_clock="lunar")
    engine = ReferenceEngine(MODEL, policy_clock="steps")
    engine.step()
    engine.step()
    assert engine.manager.clock() == pytest.approx(2 * engine.STEP_SECONDS)
