"""Seeded hypothesis runs that depend on the seed alone, not on which modules the process loaded.

Hypothesis (6.131 and later) sometimes draws a number or a string from a pool of constants it
reads out of the source of every *local* module the process has imported (a module outside
site-packages and the standard library, test files excepted). The pool therefore changes with
what else was imported before a run: the same ``seed`` and count generated different programs in a
process that had imported ``radixcache.testing.model`` first than in one that had not (seed 0's
200 steps of the default adapter: 3 corrupted blobs and no eviction the host asked for, against
none and 5). A failure found by ``radixcache fuzz --seed N`` inside one test suite could then not
be found again by the same command alone.

:func:`seed_only_constants` keeps that pool empty for the length of a run (hypothesis's own
built-in constants, the same in every process, stay), so a run's programs are decided by its seed.
It reaches into hypothesis internals; where they are not there (a hypothesis without local
constants, or one that renamed them), it changes nothing, and
``tests/test_reproducible.py`` fails if the runs stop being reproducible.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["seed_only_constants"]

_lock = threading.Lock()
_depth = 0
_saved: Callable[[], Any] | None = None


def _internals() -> tuple[Any, Any, Any] | None:
    """hypothesis's provider module (whose local-constants reader the pin replaces), its
    ``Constants`` class (an empty one is the pinned pool) and its constants cache, or None where
    this hypothesis has no such things."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - hypothesis is the test extra
        return None
    read = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    constants = getattr(providers, "Constants", None)
    if read is None or constants is None or not hasattr(getattr(cache, "cache", None), "clear"):
        return None
    return providers, constants, cache


@contextmanager
def seed_only_constants() -> Iterator[bool]:
    """For the ``with`` block, hypothesis draws no constant taken from the process's loaded
    modules, so a seeded run generates the same programs whatever else was imported. Yields
    whether the pool could be pinned (False: this hypothesis has no pool, or its internals moved).

    Re-entrant and thread-safe: nested blocks share one pin, removed when the outermost ends. The
    constants cache is emptied on entry and exit, so no constant read before the block is drawn
    inside it, and none is missing after it."""
    global _depth, _saved
    found = _internals()
    if found is None:
        yield False
        return
    providers, constants, cache = found
    with _lock:
        if _depth == 0:
            _saved = providers._get_local_constants
            providers._get_local_constants = constants
            cache.cache.clear()
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                providers._get_local_constants = _saved
                _saved = None
                cache.cache.clear()
