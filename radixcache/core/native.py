"""The tree's hot paths in C: whether they run natively here.

``radixcache.core._native`` (``radixcache/core/_native.c``) is built by the package's own set-up
(``pip install``: setuptools and the machine's C compiler). Each native function has a pure-Python
twin (``HybridRadixCache._walk_py`` and ``_duplicates_py``, ``keys._from_words64_py``) that stays
the reference: ``tests/test_native.py`` compares the two on random trees and ids, and the
reference runs wherever the extension is not built. Environment:

- ``RADIXCACHE_NATIVE=0``: run the Python reference even where the extension is built (to compare,
  or to rule the native code out when hunting a bug);
- ``RADIXCACHE_REQUIRE_NATIVE=1``: a missing or broken build is an ``ImportError`` at import
  instead of a silent fallback (CI sets it: a build that stopped compiling must not pass unseen).
"""

from __future__ import annotations

import os
from types import NotImplementedType
from typing import Any, Protocol

__all__ = ["NATIVE", "Core", "load"]


class Core(Protocol):
    """What the compiled module provides (its twins in Python: ``HybridRadixCache._walk_py`` and
    ``_duplicates_py``; the C source documents each)."""

    def walk(self, kb: bytes, end: int, root: Any, page_bytes: int, /) -> tuple[list[Any], int, int, Any]:
        """``HybridRadixCache._walk`` from ``root`` with pages of ``page_bytes``."""

    def duplicates(
        self, kvn: Any, path: list[Any], split_child: Any, split_k: int, known: int, /
    ) -> bytearray | NotImplementedType | None:
        """``HybridRadixCache._duplicates`` as int64 bytes (``None``: none differ;
        ``NotImplemented``: an index array it does not read, the caller runs the reference)."""

    def words_to_key(self, ids: Any, /) -> bytes | None:
        """``radixcache.core.keys._from_words64_py`` of a buffer of 8-byte ids (``None``: an id
        out of range or not such a buffer; the caller runs the reference, which names it)."""


def load() -> Core | None:
    """The compiled module, or ``None`` when it is not built or ``RADIXCACHE_NATIVE=0``.

    :raises ImportError: not built (or not importable) while ``RADIXCACHE_REQUIRE_NATIVE=1``.
    """
    if os.environ.get("RADIXCACHE_NATIVE", "1") == "0":
        return None
    try:
        from . import _native
    except ImportError:
        if os.environ.get("RADIXCACHE_REQUIRE_NATIVE") == "1":
            raise
        return None
    return _native


MODULE: Core | None = load()
"""The module the tree calls (``None``: the Python reference runs)."""

NATIVE: bool = MODULE is not None
"""True when the tree's walk and duplicate search, and the conversion of 8-byte ids to keys, run
natively in this process."""
