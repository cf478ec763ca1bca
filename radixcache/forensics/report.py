"""Read a forensics ledger and say what happened: ``radixcache forensics LEDGER``.

The report gives a summary (events, donations, verified restores, findings by kind), the first bad
event, the suspects ranked over all findings (a request named first in a finding weighs most),
and for each poisoned branch its timeline: the branch's donation, verifications, restores and
eviction, and every alloc and free of its slot, in order.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from .ledger import read_ledger
from .recorder import fingerprint_text

__all__ = ["ForensicsReport", "analyze", "format_forensics"]


@dataclass
class ForensicsReport:
    """What a ledger shows. ``corrupted`` is True when any finding was recorded."""

    events: int
    by_type: dict[str, int]
    findings: list[dict[str, Any]]
    first_bad: dict[str, Any] | None
    suspects: list[tuple[str, float]]
    timelines: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def corrupted(self) -> bool:
        """Any snapshot found changed or never written."""
        return bool(self.findings)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "events": self.events,
            "by_type": self.by_type,
            "corrupted": self.corrupted,
            "findings": self.findings,
            "first_bad": self.first_bad,
            "suspects": [{"request": s, "score": round(w, 3)} for s, w in self.suspects],
            "timelines": self.timelines,
        }


def analyze(path: str | os.PathLike[str], *, max_timelines: int = 5) -> ForensicsReport:
    """Analyse the ledger at ``path`` (with its rotated backups)."""
    events = read_ledger(path)
    by_type = Counter(e.get("ev", "?") for e in events)
    findings = [e for e in events if e.get("ev") == "corruption"]
    score: dict[str, float] = defaultdict(float)
    for f in findings:
        for rank, who in enumerate(f.get("suspects", [])):
            score[str(who)] += 1.0 / (rank + 1)
    suspects = sorted(score.items(), key=lambda kv: (-kv[1], kv[0]))
    timelines: dict[str, list[dict[str, Any]]] = {}
    for f in findings:
        branch = f"{f['key']}@{f['depth']}"
        if branch in timelines or len(timelines) >= max_timelines:
            continue
        node, slot = f["node"], f["slot"]
        timelines[branch] = [
            e for e in events if e.get("node") == node or (e.get("slot") == slot and e.get("ev") in ("alloc", "free"))
        ]
    return ForensicsReport(len(events), dict(by_type), findings, findings[0] if findings else None, suspects, timelines)


def format_forensics(rep: ForensicsReport) -> str:
    """The human-readable report printed by ``radixcache forensics``."""
    t = rep.by_type
    lines = [
        f"events: {rep.events} ({', '.join(f'{k} {v}' for k, v in sorted(t.items()))})",
        f"snapshots donated: {t.get('donate', 0)}, restores verified: {t.get('restore', 0)}, "
        f"verifications: {t.get('verify', 0)}",
    ]
    kinds = Counter(f["kind"] for f in rep.findings)
    if not rep.findings:
        lines.append("findings: none: every verified snapshot matched its donation")
        return "\n".join(lines)
    lines.append(f"findings: {len(rep.findings)} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})")
    f = rep.first_bad
    assert f is not None
    lines += [
        "",
        f"first bad event (step {f['step']}): snapshot {f['kind']} on branch {f['key']} at depth {f['depth']} "
        f"(node {f['node']}, slot {f['slot']})",
        f"  expected {fingerprint_text(f['expected'])}, found {fingerprint_text(f['found'])}; "
        f"donated by {f['donor']}; {f.get('note', '')}",
        f"  suspects, most likely first: {', '.join(map(str, f['suspects'])) or 'none'}",
        "",
        "suspects over all findings (score: 1 for each first place, 1/2 for second, ...):",
    ]
    lines += [f"  {who}: {w:.2f}" for who, w in rep.suspects[:10]]
    for branch, evs in rep.timelines.items():
        lines += ["", f"timeline of branch {branch}:"]
        for e in evs[:40]:
            extra = " ".join(
                f"{k}={e[k]}" for k in ("owner", "fp", "expected", "ok", "why", "kind") if k in e and e[k] is not None
            )
            lines.append(f"  step {e.get('step')}: {e.get('ev')} slot {e.get('slot')} {extra}")
        if len(evs) > 40:
            lines.append(f"  ... {len(evs) - 40} more")
    return "\n".join(lines)
