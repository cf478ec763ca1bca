"""benchmarks/gpu_check.py's own plumbing, on the CPU: its sections need a GPU, but a lent GPU's
minutes are few, so what decides the verdict and what survives a failing section is checked here
with the sections replaced by stand-ins."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hammer(caught: bool = True) -> dict[str, Any]:
    runs = {k: {"ok": True} for k in ("clean", "forensics", "clean-delayed")}
    runs |= {k: {"ok": not caught} for k in ("no-donate-fence-delayed", "no-restore-fence-delayed")}
    return runs


def _run(mod: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any, **over: Any) -> Any:
    sections: dict[str, Any] = {
        "device_info": lambda: {"name": "stand-in"},
        "fences": lambda: {"ordered_ok": True, "unordered_stale": True},
        "hosted_stream": lambda: {"ok": True},
        "shared_tier": lambda: {"ok": True},
        "fingerprint_warm_up": lambda: {"ok": True},
        "clone_and_fingerprint": lambda reps: ({"ratio": 0.9}, {"over_clone": 1.0}),
        "hammer": lambda requests, delay_us: _hammer(),
    }
    sections.update(over)
    for name, fn in sections.items():
        monkeypatch.setattr(mod, name, fn)
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: True)
    path = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--reps", "1", "--out", str(path)])
    mod.main()
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(path.read_text()) == printed
    return printed


def test_every_section_passing_is_ok(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any) -> None:
    got = _run(_script(), monkeypatch, tmp_path, capsys)
    assert got["ok"] is True and got["clone"] == {"ratio": 0.9} and got["fingerprint"] == {"over_clone": 1.0}


def test_a_section_that_raises_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    def boom(*a: object) -> dict[str, Any]:
        raise RuntimeError("stand-in failure")

    got = _run(_script(), monkeypatch, tmp_path, capsys, hosted_stream=boom, clone_and_fingerprint=boom)
    assert got["hosted_stream"] == {"ok": False, "error": "RuntimeError: stand-in failure"}
    assert "error" in got["clone"] and "error" in got["fingerprint"]
    assert got["shared_tier"] == {"ok": True} and got["hammer"]["clean"] == {"ok": True}
    assert got["ok"] is False


@pytest.mark.parametrize(
    "over",
    [
        {"hammer": lambda requests, delay_us: _hammer(caught=False)},  # a fence bug the hammer missed
        {"fences": lambda: {"ordered_ok": True, "unordered_stale": False}},  # a check that cannot tell
        {"shared_tier": lambda: {"ok": False}},
        {"fingerprint_warm_up": lambda: {"ok": False}},  # a fingerprint compiled after the warm-up
    ],
)
def test_a_missed_bug_or_failed_check_is_not_ok(
    over: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    assert _run(_script(), monkeypatch, tmp_path, capsys, **over)["ok"] is False


def test_a_run_cut_short_leaves_the_sections_it_finished(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mod = _script()

    def cut(requests: int, delay_us: float) -> dict[str, Any]:
        raise KeyboardInterrupt  # what a time limit's signal looks like to the script: not caught

    with pytest.raises(KeyboardInterrupt):
        _run(mod, monkeypatch, tmp_path, None, hammer=cut)
    kept = json.loads((tmp_path / "out.json").read_text())
    assert kept["fences"]["ordered_ok"] is True and kept["fingerprint"] == {"over_clone": 1.0}
    assert "hammer" not in kept and "ok" not in kept
