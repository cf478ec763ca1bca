"""A progress bar for long CLI runs: tqdm when installed, a plain counter on stderr otherwise;
nothing at all when the environment sets ``RADIXCACHE_NO_PROGRESS`` (to anything but ``""`` or
``0``: CI logs, scripts that parse stderr)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

__all__ = ["progress_callback"]


def progress_callback(total: int, desc: str, unit: str = "step") -> tuple[Callable[[int], None], Callable[[], None]]:
    """Return ``(update(step), close())`` for a run of ``total`` steps, each one ``unit`` (shown
    in its plural: ``steps``, ``examples``); both do nothing under ``RADIXCACHE_NO_PROGRESS``.

    :raises TypeError: ``unit`` not a str. :raises ValueError: ``unit`` empty."""
    if not isinstance(unit, str):
        raise TypeError(f"unit must be a str, got {type(unit).__name__} {unit!r}")
    if not unit:
        raise ValueError("unit must name what a step counts, got ''")
    if os.environ.get("RADIXCACHE_NO_PROGRESS", "") not in ("", "0"):

        def nothing(step: int = 0) -> None:
            return None

        return nothing, nothing
    try:
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        start = time.monotonic()
        last = [0.0]
        closed = [False]

        def update(step: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 1.0 or step + 1 == total:
                last[0] = now
                done, spent = step + 1, now - start
                left = f", ~{spent / done * (total - done):.0f}s left" if done < total else ""
                line = f"\r{desc}: {done}/{total} {unit}s ({spent:.0f}s{left})"
                print(line, end="", file=sys.stderr, flush=True)

        def close() -> None:
            if not closed[0]:  # once: a second close prints nothing
                closed[0] = True
                print(file=sys.stderr)

        return update, close
    bar = tqdm(total=total, desc=desc, unit=unit, mininterval=0.5)

    def update_bar(step: int) -> None:
        bar.update(1)

    return update_bar, bar.close
