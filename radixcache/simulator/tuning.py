"""Tuning a policy's knob the way Marconi does: replay a bootstrap window of the workload under
each value of a grid and keep the best.

The paper tunes ``alpha`` on requests recorded once the cache has filled. Here the window is the
trace's first requests, five times as many as it takes to fill the budget (the cumulative KV of
their prompts and answers plus one snapshot each), at least 50 (or the whole trace when shorter).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..policies.flop_efficiency import ALPHA_GRID, FlopEfficiency
from .replay import ModelPreset, replay
from .traces import TraceRecord

__all__ = ["bootstrap_window", "tune_alpha"]


def bootstrap_window(trace: Sequence[TraceRecord], preset: ModelPreset, budget_bytes: float) -> list[TraceRecord]:
    """The first requests of ``trace`` (timestamp order) that :func:`tune_alpha` replays."""
    recs = sorted(trace, key=lambda r: r.ts)
    held, fill = 0, len(recs)
    for i, r in enumerate(recs):
        held += (len(r.input_tokens) + len(r.output_tokens)) * preset.kv_bytes_per_token + preset.snapshot_bytes
        if held >= budget_bytes:
            fill = i + 1
            break
    return recs[: max(50, 5 * fill)]


def tune_alpha(
    trace: Sequence[TraceRecord],
    preset: ModelPreset,
    budget_bytes: float,
    *,
    grid: Sequence[float] = ALPHA_GRID,
) -> float:
    """The ``alpha`` of :class:`~radixcache.policies.FlopEfficiency` with the best token hit rate
    on the bootstrap window of ``trace`` under ``budget_bytes`` (the smallest on ties).

    :raises ValueError: an empty grid."""
    if not grid:
        raise ValueError("the alpha grid is empty")
    window = bootstrap_window(trace, preset, budget_bytes)
    scores = [(replay(window, FlopEfficiency(a), preset, budget_bytes).token_hit_rate, -a) for a in grid]
    return -max(scores)[1]
