import json

import pytest

from radixcache.cli import main
from radixcache.stress import tree_stress


@pytest.mark.parametrize(("seed", "page_size"), [(0, 1), (1, 2), (2, 4)])
def test_tree_stress_smoke(seed: int, page_size: int) -> None:
    report = tree_stress(1500, seed, page_size=page_size, slots=32)
    assert report.actions == 1500 and report.inserts > 0
    assert report.restores_checked > 0, "the stress loop must exercise restores"
    assert report.evicted_nodes > 0


def test_stress_is_deterministic() -> None:
    assert tree_stress(400, 5) == tree_stress(400, 5)


def test_cli_stress_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stress", "--count", "200", "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["actions"] == 200 and out["seed"] == 3


def test_cli_hammer_refuses_a_bad_configuration_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["hammer", "--concurrency", "0", "--requests", "3"])  # refused by the flag's type
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "radixcache hammer: error: argument --concurrency: must be an integer >= 1 (finite), got 0"
    assert main(["hammer", "--device", "tpu", "--requests", "3"]) == 2  # refused by check_config
    err = capsys.readouterr().err
    assert err.startswith("radixcache hammer: error: hammer device 'tpu'") and len(err.strip().splitlines()) == 1


def test_cli_demo_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "reads sum=0.0 (stale: the producer had not run)" in out, out
    assert "all checks held" in out and "conserved=False" not in out
    assert "ordered after the fence reads sum=512.0 (expected 512.0)" in out
