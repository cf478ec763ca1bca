"""Tests of radixcache inside vLLM: they run where vLLM's CPU build is importable (``make
test-vllm`` builds ``.venv-vllm`` for them) and are skipped everywhere else (each test module
skips itself), so the main suite never needs vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import build_tiny_qwen3_next


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-Next, built once per session with seeded weights."""
    return build_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3-next-tiny"))
