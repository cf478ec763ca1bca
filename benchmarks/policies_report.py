"""Rewrite the results section of docs/policies.md (and docs/policies.json, docs/policies.png) from
a fresh `radixcache policies-report` run: every trace shape x 3 budgets x every policy, for two
seeds and both presets, replayed through the manager's public API (40 to 80 minutes on a 2-core
machine; the plot needs matplotlib, an optional extra).

    python benchmarks/policies_report.py [--doc docs/policies.md] [--png docs/policies.png]
                                         [--preset NAME ...] [--seed N ...]

Only the text between the report markers of the document changes.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from radixcache.policies import POLICIES
from radixcache.simulator import PRESETS, report_markdown, run_report

MARK_BEGIN = "<!-- policies-report:begin -->"
MARK_END = "<!-- policies-report:end -->"


def _f(x: object) -> float:
    assert isinstance(x, (int, float)), x
    return float(x)


def plot(rows: Sequence[dict[str, object]], path: str | os.PathLike[str]) -> bool:
    """Token hit rate and FLOPs saved against budget, one panel pair per trace, one line per policy,
    for the rows' first preset and seed. Returns False (drawing nothing) when matplotlib is not
    installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if rows:
        first = (rows[0]["preset"], rows[0].get("seed", 0))
        rows = [r for r in rows if (r["preset"], r.get("seed", 0)) == first]
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
    """Put the results tables (and a link to the plot) between the report markers of ``doc``, and
    the raw rows next to it as JSON."""
    drew = plot(rows, png)
    body = report_markdown(rows)
    if drew:
        body += f"\n\n![token hit rate and FLOPs saved against budget]({Path(png).name})"
    path = Path(doc)
    text = path.read_text(encoding="utf-8") if path.exists() else f"{MARK_BEGIN}\n{MARK_END}\n"
    if MARK_BEGIN not in text:
        text += f"\n{MARK_BEGIN}\n{MARK_END}\n"
    pre, rest = text.split(MARK_BEGIN, 1)
    _, post = rest.split(MARK_END, 1)
    path.write_text(f"{pre}{MARK_BEGIN}\n{body}\n{MARK_END}{post}", encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(list(rows), indent=1, default=str), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="docs/policies.md")
    ap.add_argument("--png", default="docs/policies.png")
    ap.add_argument("--preset", nargs="+", default=["qwen3-next-80b", "nemotron-h-8b"], choices=sorted(PRESETS))
    ap.add_argument("--seed", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--host-factor", type=float, default=8.0, help="host tier, times the device budget (0: none)")
    args = ap.parse_args()
    rows = run_report(args.seed, args.preset, list(POLICIES), host_factor=args.host_factor)
    write_report(rows, args.doc, args.png)
    print(json.dumps({"doc": args.doc, "png": args.png, "rows": len(rows)}))


if __name__ == "__main__":
    main()
