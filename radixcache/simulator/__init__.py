"""The offline simulator: seeded trace shapes, replay through the real manager under a byte budget,
and the side-by-side report of policies."""

from .future import CeilingResult, FutureKnowledge, ceiling, ceiling_hits
from .replay import PRESETS, ModelPreset, ReplayResult, replay
from .report import (
    DEFAULT_BUDGETS_GIB,
    REFERENCE,
    bounds_table,
    edge_case_table,
    host_tier_table,
    load_trace,
    markdown_table,
    report_markdown,
    requests_table,
    run_grid,
    run_report,
    summary_table,
    tenants_table,
)
from .traces import TraceRecord, generate, read_trace, write_trace
from .tuning import bootstrap_window, tune_alpha

__all__ = [
    "DEFAULT_BUDGETS_GIB",
    "PRESETS",
    "REFERENCE",
    "CeilingResult",
    "FutureKnowledge",
    "ModelPreset",
    "ReplayResult",
    "TraceRecord",
    "bootstrap_window",
    "bounds_table",
    "ceiling",
    "ceiling_hits",
    "edge_case_table",
    "generate",
    "load_trace",
    "markdown_table",
    "read_trace",
    "replay",
    "report_markdown",
    "requests_table",
    "run_grid",
    "run_report",
    "summary_table",
    "tenants_table",
    "host_tier_table",
    "tune_alpha",
    "write_trace",
]
