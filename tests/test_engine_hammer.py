import pytest
import torch

from radixcache.cli import main
from radixcache.testing.engine import EngineRequest, KVAllocator, ReferenceEngine, generate_cold
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
    assert wrong >= 1, out


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


def test_kv_allocator_refuses_double_free() -> None:
    kv = KVAllocator(4)
    idx = kv.alloc(3)
    assert idx is not None and kv.num_free == 1 and kv.alloc(2) is None and kv.num_free == 1
    kv.free(idx[:1])
    with pytest.raises(RuntimeError, match="freed twice"):
        kv.free(idx[:1])


def test_unknown_inject_mode() -> None:
    with pytest.raises(ValueError, match="unknown inject mode"):
        ReferenceEngine(MODEL, inject="typo")


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
