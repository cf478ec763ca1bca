"""Replay traces under several policies and budgets, side by side, and tabulate: the engine of
``radixcache bench-trace`` and ``radixcache policies-report`` (benchmarks/policies_report.py
writes the tables into docs/policies.md)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..core.policy import Policy
from ..policies import DEFAULT_POLICY, POLICIES, FlopEfficiency, make_policy
from .future import FutureKnowledge, ceiling
from .replay import PRESETS, replay
from .traces import TraceRecord, generate, read_trace
from .tuning import tune_alpha

__all__ = [
    "DEFAULT_BUDGETS_GIB",
    "REFERENCE",
    "bounds_table",
    "edge_case_table",
    "host_tier_table",
    "load_trace",
    "markdown_table",
    "report_markdown",
    "requests_table",
    "run_grid",
    "run_report",
    "summary_table",
    "tenants_table",
]

REFERENCE = "future-knowledge"
"""The replay-only reference policy's name in report rows (see :mod:`radixcache.simulator.future`)."""

GiB = 1 << 30
DEFAULT_BUDGETS_GIB: dict[str, tuple[float, ...]] = {
    "chat": (4, 8, 16),
    "agentic": (2, 4, 8),
    "fanout": (2, 4, 8),
    "edge": (1, 2, 4),
    "rag": (2, 4, 8),
    "tools": (2, 4, 8),
    "mixed": (2, 4, 8),
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
    seed: int = 0,
    host_factor: float = 0.0,
) -> list[dict[str, object]]:
    """Every (trace, budget, policy) replay; rows of JSON-ready results, each tagged with ``seed``
    (the traces' seed, for the tables; the traces themselves are given). With ``reference``, each
    (trace, budget) also gets a row of the future-knowledge reference (policy :data:`REFERENCE`),
    and every row carries ``ceiling_hit_rate`` (the unbounded cache's) and ``of_ceiling`` /
    ``of_reference``: its token hit rate as a fraction of each. With ``host_factor``, every policy's
    row also replays the same trace with a host tier of ``host_factor`` times the device budget
    (docs/host_tier.md) and carries ``host_hit_rate``, ``host_hits``, ``host_restore_s`` and
    ``host_prefill_s_saved`` (the reference is not replayed twice).

    :raises KeyError: an unknown preset or policy name."""
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
                row.update(trace=name, budget_gib=b, seed=seed)
                if isinstance(pol, FlopEfficiency):
                    row.update(alpha=pol.alpha)
                if host_factor and p != REFERENCE:
                    tiered = replay(
                        records,
                        _policy(p, records, preset, int(b * GiB)),
                        PRESETS[preset],
                        int(b * GiB),
                        host_budget_bytes=host_factor * b * GiB,
                    )
                    row.update(
                        host_factor=host_factor,
                        host_hit_rate=tiered.token_hit_rate,
                        host_hits=tiered.host_hits,
                        host_restore_s=tiered.host_restore_s,
                        host_prefill_s_saved=tiered.host_prefill_s_saved,
                    )
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


def run_report(
    seeds: Sequence[int] = (0,),
    presets: Sequence[str] = ("qwen3-next-80b",),
    policies: Sequence[str] | None = None,
    *,
    shapes: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    host_factor: float = 0.0,
) -> list[dict[str, object]]:
    """The policies report's rows: every shape of :data:`DEFAULT_BUDGETS_GIB` (or ``shapes``) at
    its three budgets, under every policy (default: all of them) and the future-knowledge
    reference, for each seed and preset; with ``host_factor``, each policy also with a host tier
    of that many times the device budget (see :func:`run_grid`).

    :raises KeyError: an unknown preset (before any replay). :raises ValueError: an unknown
        policy or shape."""
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:  # before any replay: a typo should not cost the first preset's run
        raise KeyError(f"unknown presets {unknown}; known: {sorted(PRESETS)}")
    names = list(policies) if policies is not None else list(POLICIES)
    todo = list(shapes) if shapes is not None else list(DEFAULT_BUDGETS_GIB)
    rows: list[dict[str, object]] = []
    done = 0

    def step(_: int) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done - 1)

    for preset in presets:
        for seed in seeds:
            traces = [load_trace(shape, seed) for shape in todo]
            rows += run_grid(
                traces,
                names,
                lambda t: DEFAULT_BUDGETS_GIB[t],
                preset=preset,
                progress=step,
                seed=seed,
                host_factor=host_factor,
            )
    return rows


def _policy(name: str, records: list[TraceRecord], preset: str, budget: int) -> Policy:
    """A fresh policy for one replay: the reference made for the trace, ``flop-efficiency`` with
    its alpha tuned on the trace's bootstrap window (as Marconi does), any other by name."""
    if name == REFERENCE:
        return FutureKnowledge(records)
    if name == FlopEfficiency.name:
        return FlopEfficiency(tune_alpha(records, PRESETS[preset], budget))
    return make_policy(name)


_Key = tuple[str, int, str, float]  # (preset, seed, trace, budget in GiB)


def _groups(rows: Sequence[dict[str, object]]) -> list[tuple[_Key, dict[str, dict[str, object]]]]:
    """Rows by (preset, seed, trace, budget), in first-seen order; each group by policy."""
    out: dict[_Key, dict[str, dict[str, object]]] = {}
    for r in rows:
        seed = r.get("seed", 0)
        assert isinstance(seed, int), seed
        key = (str(r["preset"]), seed, str(r["trace"]), _f(r["budget_gib"]))
        out.setdefault(key, {})[str(r["policy"])] = r
    return list(out.items())


def _labels(rows: Sequence[dict[str, object]]) -> tuple[list[str], Callable[[_Key], list[str]]]:
    """The leading columns of a row: preset and seed only when the rows hold more than one."""
    many_presets = len({str(r["preset"]) for r in rows}) > 1
    many_seeds = len({r.get("seed", 0) for r in rows}) > 1
    head = (["preset"] if many_presets else []) + (["seed"] if many_seeds else []) + ["trace", "budget"]

    def label(k: _Key) -> list[str]:
        return ([k[0]] if many_presets else []) + ([str(k[1])] if many_seeds else []) + [k[2], f"{k[3]:g} GiB"]

    return head, label


def _table(head: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    """Token hit rate and FLOPs saved, one row per (preset, seed, trace, budget), one column per
    policy, the best in bold (the future-knowledge reference is left to :func:`bounds_table`)."""
    rows = [r for r in rows if r["policy"] != REFERENCE]
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    head, label = _labels(rows)
    lines = []
    for key, here in _groups(rows):
        best = max(_f(r["token_hit_rate"]) for r in here.values())
        cells = []
        for p in policies:
            hit, fl = _f(here[p]["token_hit_rate"]), _f(here[p]["flops_saved_fraction"])
            cell = f"{hit:.1%} / {fl:.1%}"
            cells.append(f"**{cell}**" if hit == best else cell)
        lines.append(label(key) + cells)
    return _table(head + [f"{p}: hit / FLOPs saved" for p in policies], lines)


def host_tier_table(rows: Sequence[dict[str, object]]) -> str:
    """Token hit rate without and with the host tier, one row per (preset, seed, trace, budget),
    one column per policy (``device-only -> with host tier``), and the default policy's ratio. Empty
    when no row carries ``host_hit_rate``."""
    rows = [r for r in rows if "host_hit_rate" in r]
    if not rows:
        return ""
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    head, label = _labels(rows)
    lines = []
    for key, here in _groups(rows):
        cells = [
            f"{_f(here[p]['token_hit_rate']):.1%} -> {_f(here[p]['host_hit_rate']):.1%}" if p in here else "-"
            for p in policies
        ]
        ours = here.get(DEFAULT_POLICY)
        ratio = f"{_f(ours['host_hit_rate']) / max(1e-12, _f(ours['token_hit_rate'])):.2f}x" if ours else "-"
        lines.append([*label(key), *cells, ratio])
    return _table([*head, *policies, f"{DEFAULT_POLICY}: with / without"], lines)


_EDGE_CASES = {
    "resend": "identical re-send",
    "midblock": "1,500 shared + 700 unique",
    "short": "shorter than one block",
}


def edge_case_table(rows: Sequence[dict[str, object]]) -> str:
    """Token hit rate per edge case (rows of the ``edge`` trace, of the first preset and seed), one
    column per policy; a policy that hits nothing on a case shows **0**. Empty when there are no
    edge rows."""
    edge = [r for r in rows if r["trace"] == "edge"]
    if not edge:
        return ""
    first = (edge[0]["preset"], edge[0].get("seed", 0))
    edge = [r for r in edge if (r["preset"], r.get("seed", 0)) == first]
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
    future-knowledge reference, per (preset, seed, trace, budget). Empty without reference rows."""
    if not any(r["policy"] == REFERENCE for r in rows):
        return ""
    policies = [p for p in dict.fromkeys(str(r["policy"]) for r in rows) if p != REFERENCE]
    head, label = _labels(rows)
    lines = []
    for key, here in _groups(rows):
        ref = here[REFERENCE]
        cells = [f"{_f(here[p]['of_ceiling']):.0%} / {_f(here[p]['of_reference']):.2f}x" for p in policies]
        lines.append([*label(key), f"{_f(ref['ceiling_hit_rate']):.1%}", f"{_f(ref['token_hit_rate']):.1%}", *cells])
    return _table([*head, "ceiling", REFERENCE, *policies], lines)


def requests_table(rows: Sequence[dict[str, object]]) -> str:
    """Per request rather than per token: the share of requests with any hit, and the prefill
    tokens computed per request (p50 / p99), per (preset, seed, trace, budget) and policy."""
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    head, label = _labels(rows)
    lines = []
    for key, here in _groups(rows):
        cells = []
        for p in policies:
            r = here[p]
            share = _f(r["requests_with_hit"]) / max(1.0, _f(r["requests"]))
            cells.append(f"{share:.0%} / {_f(r['computed_p50']):,.0f}, {_f(r['computed_p99']):,.0f}")
        lines.append(label(key) + cells)
    return _table(head + [f"{p}: with hit / computed p50, p99" for p in policies], lines)


def tenants_table(rows: Sequence[dict[str, object]]) -> str:
    """Requests with any hit per tenant (the session id's prefix) of the ``mixed`` trace, per
    policy (the reference left out); the best of each tenant in bold, and a cell of
    :data:`DEFAULT_POLICY` below the best baseline marked with a trailing ``<``. Empty without
    mixed rows."""
    mixed = [r for r in rows if r["trace"] == "mixed" and r["policy"] != REFERENCE]
    if not mixed:
        return ""
    policies = list(dict.fromkeys(str(r["policy"]) for r in mixed))
    head, label = _labels(mixed)
    lines = []
    for key, here in _groups(mixed):
        first = here[policies[0]]["per_session_kind_requests"]
        assert isinstance(first, dict)
        for tenant in sorted(first):
            counts = {}
            for p in policies:
                kinds = here[p]["per_session_kind_requests"]
                assert isinstance(kinds, dict)
                counts[p] = tuple(kinds.get(tenant, (0, 0)))
            best = max(c[0] for c in counts.values())
            rivals = [c[0] for p, c in counts.items() if p != DEFAULT_POLICY]
            cells = []
            for p in policies:
                hits, total = counts[p]
                cell = f"{hits}/{total}"
                if hits == best:
                    cell = f"**{cell}**"
                if p == DEFAULT_POLICY and rivals and hits < max(rivals):
                    cell += " <"
                cells.append(cell)
            lines.append([*label(key), tenant, *cells])
    return _table([*head, "tenant", *policies], lines)


def summary_table(rows: Sequence[dict[str, object]], policy: str = DEFAULT_POLICY) -> str:
    """The acceptance view, per (preset, seed, trace) at its tightest budget: ``policy``'s token hit
    rate, the best other policy's (named), their ratio, ``policy`` as a fraction of the
    future-knowledge reference and of the ceiling, and the cells of that trace (any budget) where a
    baseline beat ``policy``. Empty when ``policy`` has no rows."""
    if not any(r["policy"] == policy for r in rows):
        return ""
    groups = _groups(rows)
    head, label = _labels(rows)
    head = head[:-1]  # the budget gets its own column below
    lines = []
    seen: set[tuple[str, int, str]] = set()
    for key, here in groups:
        trace_key = key[:3]
        if trace_key in seen or policy not in here:
            continue
        seen.add(trace_key)
        same = [(k, h) for k, h in groups if k[:3] == trace_key]
        tight_key, tight = min(same, key=lambda kh: kh[0][3])
        ours = _f(tight[policy]["token_hit_rate"])
        others = [(p, _f(r["token_hit_rate"])) for p, r in tight.items() if p not in (policy, REFERENCE)]
        best_name, best = max(others, key=lambda x: x[1]) if others else ("-", 0.0)
        behind = [
            f"{k[3]:g} GiB: {p} {_f(r['token_hit_rate']):.1%}"
            for k, h in same
            for p, r in h.items()
            if p not in (policy, REFERENCE) and _f(r["token_hit_rate"]) > _f(h[policy]["token_hit_rate"])
        ]
        ref = tight.get(REFERENCE)
        lines.append(
            [
                *label(tight_key)[:-1],
                f"{tight_key[3]:g} GiB",
                f"{ours:.1%}",
                f"{best_name} {best:.1%}",
                f"{ours / best:.2f}x" if best > 0 else "-",
                f"{_f(tight[policy]['of_reference']):.2f}x" if ref is not None else "-",
                f"{_f(tight[policy]['of_ceiling']):.2f}x" if ref is not None else "-",
                "; ".join(behind) or "none",
            ]
        )
    return _table(
        [*head, "tightest", policy, "best other", "ratio", "of reference", "of ceiling", "cells behind a baseline"],
        lines,
    )


def report_markdown(rows: Sequence[dict[str, object]]) -> str:
    """The whole report: the summary (with :data:`DEFAULT_POLICY` rows), the results table, the
    bounds table (with reference rows), the per-request table, the per-tenant table (with mixed
    rows), then the edge-case table (with edge rows)."""
    parts = []
    summary = summary_table(rows)
    if summary:
        parts.append(
            f"Summary: `{DEFAULT_POLICY}` at each trace's tightest budget against the best other policy, "
            "as a fraction of the future-knowledge reference and of the ceiling, and every cell where "
            "a baseline is ahead of it:\n\n" + summary
        )
    parts.append("Token hit rate / prefill FLOPs saved:\n\n" + markdown_table(rows))
    bounds = bounds_table(rows)
    if bounds:
        parts.append(
            "Against the limit: each policy's token hit rate as a fraction of the unbounded ceiling "
            "and of the future-knowledge reference (ceiling and reference in their own columns):\n\n" + bounds
        )
    parts.append(
        "Per request: the share of requests with any hit, and the prefill tokens each request "
        "computed (p50, p99):\n\n" + requests_table(rows)
    )
    tenants = tenants_table(rows)
    if tenants:
        parts.append(
            "Per tenant of the mixed trace: requests with any hit (best in bold; `<`: "
            f"`{DEFAULT_POLICY}` behind a baseline):\n\n" + tenants
        )
    host = host_tier_table(rows)
    if host:
        factor = next(_f(r["host_factor"]) for r in rows if "host_factor" in r)
        parts.append(
            f"With a host tier of {factor:g}x the device budget (docs/host_tier.md): token hit rate "
            "device-only -> with the tier. The device budget still holds the KV of every hit:\n\n" + host
        )
    edge = edge_case_table(rows)
    if edge:
        parts.append("Edge cases, token hit rate of each (**0**: no hit at all):\n\n" + edge)
    return "\n\n".join(parts)
