"""Replay traces under several policies and budgets, side by side, and tabulate: the engine of
``radixcache bench-trace`` and ``radixcache policies-report`` (benchmarks/policies_report.py
writes the tables into docs/policies.md)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..policies import FlopEfficiency, make_policy
from ..policies.base import Policy
from .future import FutureKnowledge, ceiling
from .replay import PRESETS, replay
from .traces import TraceRecord, generate, read_trace
from .tuning import tune_alpha

__all__ = [
    "DEFAULT_BUDGETS_GIB",
    "REFERENCE",
    "bounds_table",
    "edge_case_table",
    "load_trace",
    "markdown_table",
    "report_markdown",
    "requests_table",
    "run_grid",
]

REFERENCE = "future-knowledge"
"""The replay-only reference policy's name in report rows (see :mod:`radixcache.simulator.future`)."""

GiB = 1 << 30
DEFAULT_BUDGETS_GIB: dict[str, tuple[float, ...]] = {
    "chat": (4, 8, 16),
    "agentic": (2, 4, 8),
    "fanout": (2, 4, 8),
    "edge": (1, 2, 4),
}


def _f(x: object) -> float:
    assert isinstance(x, (int, float)), x
    return float(x)


def load_trace(spec: str, seed: int = 0) -> tuple[str, list[TraceRecord]]:
    """A trace from a JSONL path, or generated from a shape name. Returns (name, records)."""
    if os.path.exists(spec):
        return Path(spec).stem, read_trace(spec)
    return spec, generate(spec, seed)


def run_grid(
    traces: Sequence[tuple[str, list[TraceRecord]]],
    policies: Sequence[str],
    budgets_gib: Callable[[str], Sequence[float]],
    *,
    preset: str = "qwen3-next-80b",
    progress: Callable[[int], None] | None = None,
    reference: bool = True,
) -> list[dict[str, object]]:
    """Every (trace, budget, policy) replay; rows of JSON-ready results. With ``reference``, each
    (trace, budget) also gets a row of the future-knowledge reference (policy :data:`REFERENCE`),
    and every row carries ``ceiling_hit_rate`` (the unbounded cache's) and ``of_ceiling`` /
    ``of_reference``: its token hit rate as a fraction of each."""
    rows: list[dict[str, object]] = []
    n = 0
    for name, records in traces:
        ceil = ceiling(records).token_hit_rate if reference else None
        for b in budgets_gib(name):
            group: list[dict[str, object]] = []
            for p in [*policies, REFERENCE] if reference else policies:
                pol = _policy(p, records, preset, int(b * GiB))
                r = replay(records, pol, PRESETS[preset], int(b * GiB))
                row = r.as_dict()
                row.update(trace=name, budget_gib=b)
                if isinstance(pol, FlopEfficiency):
                    row.update(alpha=pol.alpha)
                group.append(row)
                if progress is not None:
                    progress(n)
                n += 1
            if reference:
                ref = _f(group[-1]["token_hit_rate"])
                for row in group:
                    hit = _f(row["token_hit_rate"])
                    row.update(
                        ceiling_hit_rate=ceil, of_ceiling=hit / max(1e-12, _f(ceil)), of_reference=hit / max(1e-12, ref)
                    )
            rows += group
    return rows


def _policy(name: str, records: list[TraceRecord], preset: str, budget: int) -> Policy:
    """A fresh policy for one replay: the reference made for the trace, ``flop-efficiency`` with
    its alpha tuned on the trace's bootstrap window (as Marconi does), any other by name."""
    if name == REFERENCE:
        return FutureKnowledge(records)
    if name == FlopEfficiency.name:
        return FlopEfficiency(tune_alpha(records, PRESETS[preset], budget))
    return make_policy(name)


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    """Token hit rate and FLOPs saved, one row per (trace, budget), one column pair per policy (the
    future-knowledge reference is left to :func:`bounds_table`)."""
    rows = [r for r in rows if r["policy"] != REFERENCE]
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    keys = list(dict.fromkeys((str(r["trace"]), _f(r["budget_gib"])) for r in rows))
    head = "| trace | budget | " + " | ".join(f"{p}: hit / FLOPs saved" for p in policies) + " |"
    lines = [head, "|" + "---|" * (2 + len(policies))]
    for trace, b in keys:
        cells = []
        best = max(_f(r["token_hit_rate"]) for r in rows if r["trace"] == trace and r["budget_gib"] == b)
        for p in policies:
            r = next(x for x in rows if x["trace"] == trace and x["budget_gib"] == b and x["policy"] == p)
            hit, fl = _f(r["token_hit_rate"]), _f(r["flops_saved_fraction"])
            cell = f"{hit:.1%} / {fl:.1%}"
            cells.append(f"**{cell}**" if hit == best else cell)
        lines.append(f"| {trace} | {b:g} GiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_EDGE_CASES = {
    "resend": "identical re-send",
    "midblock": "1,500 shared + 700 unique",
    "short": "shorter than one block",
}


def edge_case_table(rows: Sequence[dict[str, object]]) -> str:
    """Token hit rate per edge case (rows of the ``edge`` trace), one column per policy; a policy
    that hits nothing on a case shows **0**. Empty when there are no edge rows."""
    edge = [r for r in rows if r["trace"] == "edge"]
    if not edge:
        return ""
    policies = list(dict.fromkeys(str(r["policy"]) for r in edge))
    budgets = list(dict.fromkeys(_f(r["budget_gib"]) for r in edge))
    lines = ["| edge case | budget | " + " | ".join(policies) + " |", "|" + "---|" * (2 + len(policies))]
    for kind, label in _EDGE_CASES.items():
        for b in budgets:
            cells = []
            for p in policies:
                r = next(x for x in edge if x["budget_gib"] == b and x["policy"] == p)
                kinds = r["per_session_kind"]
                assert isinstance(kinds, dict)
                hit, total = kinds.get(kind, (0, 0))
                if total:
                    cells.append("**0**" if hit == 0 else f"{hit / total:.1%}")
            if cells:  # the case occurs in this trace
                lines.append(f"| {label} | {b:g} GiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bounds_table(rows: Sequence[dict[str, object]]) -> str:
    """Each policy's token hit rate as a fraction of the unbounded ceiling and of the
    future-knowledge reference, per (trace, budget). Empty without reference rows."""
    if not any(r["policy"] == REFERENCE for r in rows):
        return ""
    policies = [p for p in dict.fromkeys(str(r["policy"]) for r in rows) if p != REFERENCE]
    keys = list(dict.fromkeys((str(r["trace"]), _f(r["budget_gib"])) for r in rows))
    head = "| trace | budget | ceiling | future-knowledge | " + " | ".join(policies) + " |"
    lines = [head, "|" + "---|" * (4 + len(policies))]
    for trace, b in keys:
        here = {str(x["policy"]): x for x in rows if x["trace"] == trace and x["budget_gib"] == b}
        ref = here[REFERENCE]
        cells = [f"{_f(here[p]['of_ceiling']):.0%} / {_f(here[p]['of_reference']):.2f}x" for p in policies]
        lines.append(
            f"| {trace} | {b:g} GiB | {_f(ref['ceiling_hit_rate']):.1%} | {_f(ref['token_hit_rate']):.1%} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def requests_table(rows: Sequence[dict[str, object]]) -> str:
    """Per request rather than per token: the share of requests with any hit, and the prefill
    tokens computed per request (p50 / p99), per (trace, budget) and policy."""
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    keys = list(dict.fromkeys((str(r["trace"]), _f(r["budget_gib"])) for r in rows))
    lines = [
        "| trace | budget | " + " | ".join(f"{p}: with hit / computed p50, p99" for p in policies) + " |",
        "|" + "---|" * (2 + len(policies)),
    ]
    for trace, b in keys:
        cells = []
        for p in policies:
            r = next(x for x in rows if x["trace"] == trace and x["budget_gib"] == b and x["policy"] == p)
            share = _f(r["requests_with_hit"]) / max(1.0, _f(r["requests"]))
            cells.append(f"{share:.0%} / {_f(r['computed_p50']):,.0f}, {_f(r['computed_p99']):,.0f}")
        lines.append(f"| {trace} | {b:g} GiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_markdown(rows: Sequence[dict[str, object]]) -> str:
    """The whole report: the results table, the bounds table (with reference rows), the
    per-request table, then the edge-case table when there are edge rows."""
    body = markdown_table(rows)
    bounds = bounds_table(rows)
    if bounds:
        body += (
            "\n\nAgainst the limit: each policy's token hit rate as a fraction of the unbounded ceiling "
            "and of the future-knowledge reference (ceiling and reference in their own columns):\n\n" + bounds
        )
    body += (
        "\n\nPer request: the share of requests with any hit, and the prefill tokens each request "
        "computed (p50, p99):\n\n" + requests_table(rows)
    )
    edge = edge_case_table(rows)
    if edge:
        body += "\n\nEdge cases, token hit rate of each (**0**: no hit at all):\n\n" + edge
    return body
