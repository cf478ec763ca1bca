"""The tree's hot paths in C: whether they run natively here.

``radixcache.core._native`` (``radixcache/core/_native.c``) is built by the package's own set-up.
Each native function has a pure-Python twin (``HybridRadixCache._walk_py``, ``_duplicates_py`` and
``_gather_py``, ``keys._from_words64_py``) that stays the reference: ``tests/test_native.py`` compares the two on
random trees and ids. Loading, the fallback and the environment switches (``RADIXCACHE_NATIVE=0``,
``RADIXCACHE_REQUIRE_NATIVE=1``) are :func:`linear_state.native.load`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from types import NotImplementedType
from typing import Any, Protocol

from linear_state.native import load

__all__ = ["NATIVE", "Core"]


class Core(Protocol):
    """What the compiled module provides (its twins in Python: ``HybridRadixCache._walk_py`` and
    ``_duplicates_py``; the C source documents each)."""

    def walk(self, kb: bytes, end: int, root: Any, page_bytes: int, /) -> tuple[list[Any], int, int, Any]:
        """``HybridRadixCache._walk`` from ``root`` with pages of ``page_bytes``."""

    def duplicates(
        self, kvn: Any, path: list[Any], split_child: Any, split_k: int, known: int, /
    ) -> bytearray | NotImplementedType | None:
        """``HybridRadixCache._duplicates`` of ``kvn`` (int64 or int32) as int64 bytes (``None``:
        none differ; ``NotImplemented``: an index array it does not read, the caller runs the
        reference)."""

    def gather(self, node: Any, start: int, out: Any, /) -> bytearray | NotImplementedType | None:
        """The KV indices of ``[start, node.depth)`` up ``node``'s path: written into
        ``out[start:node.depth]`` (int64 or int32; returns ``None``), or with ``out`` ``None``
        returned as int64 bytes (``HybridRadixCache._gather_py``'s writes; ``NotImplemented``:
        an array it does not read, the caller runs the reference)."""

    def exclusive(self, method: Callable[..., Any], busy: Callable[[str], BaseException], /) -> Callable[..., Any]:
        """``method`` run under its first argument's non-blocking ``_guard`` (a lock): the twin of
        ``radixcache.manager.cache_manager._exclusive``'s Python wrapper; ``busy(name)`` is the
        exception raised when the guard is held. Binds as a method."""

    def words_to_key(self, ids: Any, /) -> tuple[bytes, bool] | None:
        """``radixcache.core.keys._from_words64_py`` of a buffer of 8-byte ids, and whether one
        is an image id (``_has_images`` of those bytes, read in the same pass) (``None``: an id
        out of range or not such a buffer; the caller runs the reference, which names it)."""


MODULE: Core | None = load("radixcache.core._native")
"""The module the tree calls (``None``: the Python reference runs)."""

NATIVE: bool = MODULE is not None
"""True when the tree's walk, duplicate search and KV gathering, the conversion of 8-byte ids to
keys, and the manager's guard around its calls run natively in this process."""
