"""The entry point SGLang calls when it loads its plugins: registers the radixcache backend."""

from __future__ import annotations

from typing import Any

from . import BACKEND_NAME

__all__ = ["factory", "register"]


def factory(ctx: Any) -> Any:
    """Build the backend from SGLang's ``TreeCacheBuildContext`` (what the registry passes).

    :raises NotImplementedError: a configuration the backend does not serve yet (the message
        says which and what to run instead); see :class:`~radixcache.sglang.backend.RadixcacheHybridCache`.
    """
    from .backend import RadixcacheHybridCache

    return RadixcacheHybridCache.from_build_context(ctx)


def register() -> None:
    """Register :func:`factory` as ``--radix-cache-backend radixcache``. Idempotent: a second call
    (SGLang loads plugins in every process, sometimes twice) leaves the first registration.

    :raises RuntimeError: another factory is registered under the name.
    """
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    current = get_radix_cache_factory(BACKEND_NAME)
    if current is factory:
        return
    if current is not None:
        raise RuntimeError(f"another factory is registered as {BACKEND_NAME!r}: {current!r}")
    register_radix_cache_backend(BACKEND_NAME, factory)
