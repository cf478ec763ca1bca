"""Replay traces under several policies and budgets, side by side, and report: the engine of
``radixcache bench-trace`` and ``radixcache policies-report``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from .policies import make_policy
from .replay import PRESETS, replay
from .traces import TraceRecord, generate, read_trace

__all__ = ["DEFAULT_BUDGETS_GIB", "edge_case_table", "load_trace", "markdown_table", "plot", "run_grid", "write_report"]

GiB = 1 << 30
DEFAULT_BUDGETS_GIB: dict[str, tuple[float, ...]] = {
    "chat": (4, 8, 16),
    "agentic": (2, 4, 8),
    "fanout": (2, 4, 8),
    "edge": (1, 2, 4),
}
_MARK_BEGIN = "<!-- policies-report:begin -->"
_MARK_END = "<!-- policies-report:end -->"


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


def plot(rows: Sequence[dict[str, object]], path: str | os.PathLike[str]) -> bool:
    """Token hit rate and FLOPs saved against budget, one panel pair per trace, one line per policy.
    Returns False (drawing nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    traces = list(dict.fromkeys(str(r["trace"]) for r in rows))
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    fig, axes = plt.subplots(2, len(traces), figsize=(4 * len(traces), 6.5), squeeze=False)
    for j, t in enumerate(traces):
        for i, metric in enumerate(("token_hit_rate", "flops_saved_fraction")):
            ax = axes[i][j]
            for p in policies:
                pts = sorted((_f(r["budget_gib"]), _f(r[metric])) for r in rows if r["trace"] == t and r["policy"] == p)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{t}: {'token hit rate' if i == 0 else 'prefill FLOPs saved'}")
            ax.set_xlabel("cache budget (GiB)")
            ax.set_ylim(0, 1)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(rows: Sequence[dict[str, object]], doc: str | os.PathLike[str], png: str | os.PathLike[str]) -> None:
    """Put the results table (and a link to the plot) between the report markers of ``doc``, and
    the raw rows next to it as JSON."""
    drew = plot(rows, png)
    body = markdown_table(rows)
    edge = edge_case_table(rows)
    if edge:
        body += "\n\nEdge cases, token hit rate of each (**0**: no hit at all):\n\n" + edge
    if drew:
        body += f"\n\n![token hit rate and FLOPs saved against budget]({Path(png).name})"
    path = Path(doc)
    text = path.read_text(encoding="utf-8") if path.exists() else f"{_MARK_BEGIN}\n{_MARK_END}\n"
    if _MARK_BEGIN not in text:
        text += f"\n{_MARK_BEGIN}\n{_MARK_END}\n"
    pre, rest = text.split(_MARK_BEGIN, 1)
    _, post = rest.split(_MARK_END, 1)
    path.write_text(f"{pre}{_MARK_BEGIN}\n{body}\n{_MARK_END}{post}", encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(list(rows), indent=1, default=str), encoding="utf-8")
