"""Replay traces under several policies and budgets, side by side, and tabulate: the engine of
``radixcache bench-trace`` and ``radixcache policies-report`` (benchmarks/policies_report.py
writes the tables into docs/policies.md)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..policies import make_policy
from .replay import PRESETS, replay
from .traces import TraceRecord, generate, read_trace

__all__ = ["DEFAULT_BUDGETS_GIB", "edge_case_table", "load_trace", "markdown_table", "report_markdown", "run_grid"]

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
) -> list[dict[str, object]]:
    """Every (trace, budget, policy) replay; rows of JSON-ready results."""
    rows: list[dict[str, object]] = []
    n = 0
    for name, records in traces:
        for b in budgets_gib(name):
            for p in policies:
                r = replay(records, make_policy(p), PRESETS[preset], int(b * GiB))
                row = r.as_dict()
                row.update(trace=name, budget_gib=b)
                rows.append(row)
                if progress is not None:
                    progress(n)
                n += 1
    return rows


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    """Token hit rate and FLOPs saved, one row per (trace, budget), one column pair per policy."""
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


def report_markdown(rows: Sequence[dict[str, object]]) -> str:
    """The whole report: the results table, then the edge-case table when there are edge rows."""
    body = markdown_table(rows)
    edge = edge_case_table(rows)
    if edge:
        body += "\n\nEdge cases, token hit rate of each (**0**: no hit at all):\n\n" + edge
    return body
