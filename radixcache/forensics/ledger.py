"""The forensics ledger: an append-only, size-bounded JSONL event log, and its reader."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Ledger", "read_ledger"]


class Ledger:
    """An append-only JSONL event log, size-bounded with rotation.

    Events are buffered and written ``flush_every`` at a time, so the hot path pays a list append.
    When the file would pass ``max_bytes`` it is renamed ``PATH.1`` (older ones shift up to
    ``PATH.<backups>``, the oldest is dropped) and a new file starts.

    :raises ValueError: non-positive sizes.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, max_bytes: int = 64 << 20, backups: int = 3, flush_every: int = 512
    ) -> None:
        if max_bytes <= 0 or backups < 0 or flush_every <= 0:
            raise ValueError(f"bad ledger sizes: max_bytes={max_bytes}, backups={backups}, flush_every={flush_every}")
        self.path = Path(path)
        self.max_bytes, self.backups, self.flush_every = max_bytes, backups, flush_every
        self._buf: list[dict[str, Any]] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO | None = self.path.open("a", encoding="utf-8")
        self._size = self.path.stat().st_size

    def write(self, event: dict[str, Any]) -> None:
        """Append one event (flushed in batches)."""
        self._buf.append(event)
        if len(self._buf) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write buffered events to disk, rotating when the size bound would be passed."""
        if not self._buf:
            return
        lines = [json.dumps(e, separators=(",", ":"), default=repr) + "\n" for e in self._buf]
        self._buf.clear()
        if self._fh is None:  # closed: events after close append to the file again
            self._fh = self.path.open("a", encoding="utf-8")
            self._size = self.path.stat().st_size
        for line in lines:
            n = len(line.encode())
            if self._size and self._size + n > self.max_bytes:
                self._rotate()
            self._fh.write(line)
            self._size += n
        self._fh.flush()

    def _rotate(self) -> None:
        assert self._fh is not None
        self._fh.close()
        if self.backups:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink()
        self._fh = self.path.open("a", encoding="utf-8")
        self._size = 0

    def close(self) -> None:
        """Flush and close the file (idempotent). An event written after it opens the file again."""
        self.flush()
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a ledger and its rotated backups, oldest first.

    :raises FileNotFoundError: neither the ledger nor a backup of it exists (a mistyped path must
        never read as a ledger without findings). :raises ValueError: a line that is not a JSON
        event, named by file and line number. :raises OSError: a file that cannot be read.
    """
    p = Path(path)
    files = sorted(p.parent.glob(p.name + ".*"), key=lambda f: -int(f.suffix[1:]) if f.suffix[1:].isdigit() else 0)
    found = [f for f in [*[f for f in files if f.suffix[1:].isdigit()], p] if f.exists()]
    if not found:
        raise FileNotFoundError(f"no forensics ledger at {str(p)!r} (nor a rotated backup of it)")
    events: list[dict[str, Any]] = []
    for f in found:
        with f.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    raise ValueError(f"{f}:{n}: not a forensics ledger line (not JSON)") from None
                if not isinstance(event, dict) or "ev" not in event:
                    raise ValueError(f"{f}:{n}: not a forensics ledger event (no 'ev' field)")
                events.append(event)
    return events
