"""The examples run, and the integration guide's step table is the minimal host's code."""

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_minimal_host_serves_with_hits_and_exact_restores(capsys: pytest.CaptureFixture[str]) -> None:
    host = _load("minimal_host")
    host.main()  # asserts every restore against the cold state, and invariants at the end
    out = capsys.readouterr().out
    m = re.search(r"(\d+) requests, (\d+) hits, (\d+) of (\d+) prompt tokens from cache", out)
    assert m is not None, out
    requests, hits, hit_tokens, prompt_tokens = map(int, m.groups())
    assert requests == 9 and hits >= 6 and hit_tokens > prompt_tokens // 2
    assert host.manager.num_requests == 0 and host.kv.num_free + host.cache.total_kv_tokens == 4096


def test_minimal_host_is_short() -> None:
    assert len((ROOT / "examples" / "minimal_host.py").read_text().splitlines()) <= 84


def test_integration_guide_step_table_is_the_minimal_hosts_code() -> None:
    guide = (ROOT / "docs" / "integration.md").read_text()
    code = (ROOT / "examples" / "minimal_host.py").read_text()
    table = guide.split("<!-- steps:begin -->", 1)[1].split("<!-- steps:end -->", 1)[0]
    calls = re.findall(r"`([^`]*\bmanager\.[a-z_]+\([^`]*\))`", table)
    assert len(calls) >= 8, table
    for call in calls:
        assert call in code, f"the guide shows {call!r}, which examples/minimal_host.py does not do"


def test_hf_host_serves_a_transformers_model_with_exact_hits(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    _load("hf_host").main()  # asserts every hit's first-token logits within 1e-5 of the cold run
    out = capsys.readouterr().out
    m = re.search(r"(\d+) requests, (\d+) hits, max \|hit - cold\| first-token logit (\S+)", out)
    assert m is not None, out
    assert int(m.group(2)) >= 3 and float(m.group(3)) < 1e-5


def test_hf_host_is_short() -> None:
    assert len((ROOT / "examples" / "hf_host.py").read_text().splitlines()) <= 64
