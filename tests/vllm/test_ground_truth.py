"""The oracle the connector is judged by, checked on vLLM alone: greedy token ids with prefix
caching off are the ground truth; vLLM's own prefix cache serves exactly them on the workload
(and does hit); and with the prefix cache reset and every free block filled with noise between
rounds, vLLM still serves exactly them: noise in a block no request reads changes nothing, so
in the connector's tests a wrong answer can only come from a state it restored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm runs these in .venv-vllm)")

from .harness import (
    Served,
    Workload,
    close,
    compare,
    fill_free_blocks_with_noise,
    kv_pages,
    make_llm,
    serve,
    tie_bound,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _run(model: Path, *, prefix_caching: bool, between: Any = None) -> Served:
    llm = make_llm(model, prefix_caching=prefix_caching)
    try:
        return serve(llm, Workload(seed=0), between=between)
    finally:
        close(llm)


def _reset_and_noise(llm: Any, round_: int) -> None:
    assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache (a request still running?)"
    assert fill_free_blocks_with_noise(llm, seed=round_) > 0


def test_vllm_prefix_caching_serves_the_ground_truth_and_noise_in_free_blocks_changes_nothing(
    tiny_model: Path,
) -> None:
    cold = _run(tiny_model, prefix_caching=False)
    assert len(cold.prompts) >= 40 and sum(cold.cached) == 0
    assert len({tuple(a) for a in cold.answers}) > len(cold.answers) // 2, "answers depend on the prompt"
    own = _run(tiny_model, prefix_caching=True)
    wrong, ties = compare(cold, own)
    assert not wrong, f"vLLM's own prefix cache changed {len(wrong)} answers: {wrong[:8]}"
    assert len(ties) <= tie_bound(own), f"{len(ties)} requests parted at a near tie: the model's margins are too thin"
    assert sum(own.cached) >= 10 * 640, f"vLLM's prefix cache hit only {sum(own.cached)} tokens"
    noisy = _run(tiny_model, prefix_caching=True, between=_reset_and_noise)
    wrong, ties = compare(cold, noisy)
    assert not wrong, f"noise in free blocks changed {len(wrong)} answers: {wrong[:8]}"
    assert sum(noisy.cached) < sum(own.cached), "the resets between rounds left hits across rounds"


def test_the_oracle_calls_a_garbage_state_wrong(tiny_model: Path) -> None:
    """The oracle's negative control: noise written into the blocks of the prefixes vLLM holds
    cached (what a connector restoring the wrong bytes would serve) is called wrong."""
    cold = _run(tiny_model, prefix_caching=False)

    def poison(llm: Any, round_: int) -> None:
        pages = kv_pages(llm)
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        cached = [b.block_id for b in pool.blocks if b.block_hash is not None and not b.is_null]
        assert cached, "vLLM holds no cached block to poison"
        pages[cached] = 0xFF  # NaN in every bf16 and fp32 element of those pages

    bad = _run(tiny_model, prefix_caching=True, between=poison)
    wrong, _ = compare(cold, bad)
    assert len(wrong) >= 8, f"only {len(wrong)} requests called wrong after their cached pages were poisoned"
