"""The packages' compiled parts: loading them, and choosing the pure-Python reference instead.

Two C extensions are built by the package's own set-up (``pip install``: setuptools and the
machine's C compiler): ``linear_state._native`` (the CPU slot fingerprint,
:class:`~linear_state.SlotHasher`'s ``"native"`` path, and a CPU pool's slot copy) and
``radixcache.core._native`` (the tree's hot paths, :mod:`radixcache.core.native`). Each native
function has a pure-Python twin that stays the reference: the tests compare the two, and the
reference runs wherever an extension is not built. Environment (one switch for both):

- ``RADIXCACHE_NATIVE=0``: run the Python references even where the extensions are built (to
  compare, or to rule the native code out when hunting a bug);
- ``RADIXCACHE_REQUIRE_NATIVE=1``: a missing or broken build is an ``ImportError`` at import
  instead of a silent fallback (CI sets it: a build that stopped compiling must not pass unseen).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol

__all__ = ["NATIVE", "Fingerprinter", "load"]


def load(name: str) -> Any | None:
    """The compiled module ``name``, or ``None`` when it is not built or ``RADIXCACHE_NATIVE=0``.

    :raises ImportError: not built (or not importable) while ``RADIXCACHE_REQUIRE_NATIVE=1``.
    """
    if os.environ.get("RADIXCACHE_NATIVE", "1") == "0":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        if os.environ.get("RADIXCACHE_REQUIRE_NATIVE") == "1":
            raise
        return None


class Fingerprinter(Protocol):
    """What ``linear_state._native`` provides (its C source documents it)."""

    def fingerprint(self, views: list[Any], slot: int, weights: Any, block: int, /) -> int:
        """The fingerprint of ``slot`` over ``[L, S, words]`` views (SlotHasher's numpy path)."""

    def copy_slot(self, rows: list[Any], src: int, dst: int, /) -> None:
        """Slot ``src``'s bytes onto slot ``dst``'s in ``[L, S, bytes]`` views (a pool's copy)."""


MODULE: Fingerprinter | None = load("linear_state._native")
"""The module :class:`~linear_state.SlotHasher` and a CPU pool's copies call (``None``: numpy or
torch)."""

NATIVE: bool = MODULE is not None
"""True when the CPU slot fingerprint and CPU pools' slot copies run natively in this process."""
