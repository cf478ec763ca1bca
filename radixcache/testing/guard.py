"""The hit-rate guard: tokens served from cache, compared with the figure recorded for the same
seed, policy and configuration.

A placement bug keeps every answer exact and still costs hits: captures taken one token past
where the policy chose them served 20-52% fewer prompt tokens from cache, and every ground-truth
check passed. The guard turns that into a failure. The hammer (:func:`~radixcache.testing.hammer.run_hammer`)
and trace replay (``radixcache bench-trace``) look their run's key up in the recorded figures
(``hit_rates.json`` beside this module, in the repository) and fail when the cached tokens fall
more than :data:`TOLERANCE` below the record. A run with no record is ``unrecorded`` (neither
pass nor fail); a run above its record passes (record the better figure when you mean it).

Records change only on purpose: ``radixcache hammer --record-hit-rate REASON`` (or ``bench-trace
--record-hit-rate REASON``) writes the run's figure with the reason beside it, and the commit that
changes the file says why.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

__all__ = ["RECORDS", "TOLERANCE", "GuardResult", "check", "load_records", "record", "replay_key"]

RECORDS = Path(__file__).with_name("hit_rates.json")
"""The recorded figures: ``{key: {"cached_tokens": n, "reason": why}}``."""

TOLERANCE = 0.02
"""The largest drop of cached tokens below the record that still passes, as a fraction of the
record. The hammer's figure moves by about 0.01% between runs of one seed (its policy reads the
wall clock); the placement bug above moves it by 20% and more."""

Status = Literal["pass", "fail", "unrecorded"]


@dataclass(frozen=True)
class GuardResult:
    """One comparison: ``measured`` cached tokens against ``recorded`` (None: no record) for
    ``key``; ``status`` is ``fail`` when the drop is beyond ``tolerance``."""

    key: str
    measured: int
    recorded: int | None
    tolerance: float
    status: Status

    @property
    def drop(self) -> float:
        """(recorded - measured) / recorded: negative when the run served more; 0 unrecorded."""
        if not self.recorded:
            return 0.0
        return (self.recorded - self.measured) / self.recorded

    def as_dict(self) -> dict[str, object]:
        """Every field and the drop, for JSON."""
        return {**asdict(self), "drop": self.drop}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> GuardResult:
        """The result :meth:`as_dict` wrote (its derived ``drop`` ignored).

        :raises KeyError: a field missing. :raises ValueError: a field of the wrong type."""
        key, measured, recorded, tolerance, status = (
            d[k] for k in ("key", "measured", "recorded", "tolerance", "status")
        )
        if not (
            isinstance(key, str)
            and isinstance(measured, int)
            and (recorded is None or isinstance(recorded, int))
            and isinstance(tolerance, float)
            and status in ("pass", "fail", "unrecorded")
        ):
            raise ValueError(f"not a GuardResult: {d!r}")
        return cls(key, measured, recorded, tolerance, status)

    def describe(self) -> str:
        """One line for a report."""
        if self.recorded is None:
            return f"unrecorded ({self.measured} cached tokens; no figure for this configuration)"
        return (
            f"{self.status}: {self.measured} cached tokens against {self.recorded} recorded "
            f"({-100 * self.drop:+.2f}%, fails below -{100 * self.tolerance:.0f}%)"
        )


def _key(kind: str, fields: dict[str, object]) -> str:
    return kind + " " + json.dumps(fields, sort_keys=True, separators=(",", ":"))


def replay_key(trace: str, seed: int, preset: str, policy: str, budget_bytes: int, host_bytes: int = 0) -> str:
    """The record key of one trace replay row (a built-in trace shape)."""
    return _key(
        "replay",
        {
            "trace": trace,
            "seed": seed,
            "preset": preset,
            "policy": policy,
            "budget_bytes": budget_bytes,
            "host_bytes": host_bytes,
        },
    )


def hammer_key(fields: dict[str, object]) -> str:
    """The record key of a hammer run whose configuration shaping its hits is ``fields``."""
    return _key("hammer", fields)


def load_records(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, object]]:
    """The recorded figures in ``path`` (default :data:`RECORDS`; none when the file does not exist).

    :raises ValueError: the file is not a JSON object of records."""
    p = Path(RECORDS if path is None else path)
    if not p.exists():
        return {}
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("cached_tokens"), int) for v in data.values()
    ):
        raise ValueError(f"{p}: not a JSON object of {{key: {{'cached_tokens': int, 'reason': str}}}} records")
    return data


def check(
    key: str,
    measured: int,
    *,
    path: str | os.PathLike[str] | None = None,
    tolerance: float = TOLERANCE,
) -> GuardResult:
    """Compare ``measured`` cached tokens with the record of ``key`` in ``path`` (default
    :data:`RECORDS`).

    :raises ValueError: a negative ``measured``, a ``tolerance`` outside [0, 1), or a bad file."""
    if isinstance(measured, bool) or not isinstance(measured, int) or measured < 0:
        raise ValueError(f"measured cached tokens must be an int >= 0, got {measured!r}")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    rec = load_records(path).get(key)
    if rec is None:
        return GuardResult(key, measured, None, tolerance, "unrecorded")
    recorded = int(rec["cached_tokens"])  # type: ignore[call-overload]
    status: Status = "fail" if measured < recorded * (1.0 - tolerance) else "pass"
    return GuardResult(key, measured, recorded, tolerance, status)


def record(key: str, measured: int, reason: str, *, path: str | os.PathLike[str] | None = None) -> None:
    """Write ``measured`` as the figure of ``key`` in ``path`` (default :data:`RECORDS`), with
    ``reason`` beside it (the
    file stays sorted by key, one record a line, so a diff shows what changed).

    :raises ValueError: an empty reason, a negative figure, or a bad file."""
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("a recorded figure needs a reason (why it changed)")
    if isinstance(measured, bool) or not isinstance(measured, int) or measured < 0:
        raise ValueError(f"measured cached tokens must be an int >= 0, got {measured!r}")
    records = load_records(path)
    records[key] = {"cached_tokens": measured, "reason": reason.strip()}
    lines = [f"  {json.dumps(k)}: {json.dumps(records[k], sort_keys=True)}" for k in sorted(records)]
    Path(RECORDS if path is None else path).write_text("{\n" + ",\n".join(lines) + "\n}\n")
