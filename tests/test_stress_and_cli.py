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
    assert main(["hammer", "--concurrency", "0", "--requests", "3"]) == 2
    err = capsys.readouterr().err
    assert "radixcache hammer: hammer concurrency must be an int >= 1, got 0" in err and "Traceback" not in err


def test_cli_demo_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "reads sum=0.0 (stale: the producer had not run)" in out, out
    assert "all checks held" in out and "conserved=False" not in out
    assert "ordered after the fence reads sum=512.0 (expected 512.0)" in out
