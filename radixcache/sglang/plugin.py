"""The entry point SGLang calls when it loads its plugins: registers the radixcache backend, and a
hook that tells it when a request arrives (for the shared tier's prefetch)."""

from __future__ import annotations

import warnings
from typing import Any

from . import BACKEND_NAME

__all__ = ["ARRIVAL_HOOK_TARGET", "factory", "on_arrival", "register"]

ARRIVAL_HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache"
"""The scheduler method the arrival hook runs after: SGLang calls it for each request as it joins
the waiting queue (its own use: the hierarchical cache's storage prefetch)."""

_warned = False


def factory(ctx: Any) -> Any:
    """Build the backend from SGLang's ``TreeCacheBuildContext`` (what the registry passes).

    :raises NotImplementedError: a configuration the backend does not serve yet (the message
        says which and what to run instead); see :class:`~radixcache.sglang.backend.RadixcacheHybridCache`.
    """
    from .backend import RadixcacheHybridCache

    return RadixcacheHybridCache.from_build_context(ctx)


def on_arrival(result: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """SGLang's ``AFTER`` hook on :data:`ARRIVAL_HOOK_TARGET`: when the scheduler's cache is
    radixcache's, its :meth:`~radixcache.sglang.backend.RadixcacheHybridCache.prefetch_request`
    for ``req``; any other cache, nothing. Returns None (SGLang's result stands). A prefetch that
    raises is warned about once and otherwise ignored: the request is queued as if there were no
    hook (its admission then asks the store itself)."""
    global _warned
    prefetch = getattr(getattr(scheduler, "tree_cache", None), "prefetch_request", None)
    if prefetch is None:
        return
    try:
        prefetch(req)
    except Exception as e:  # never in the way of SGLang's arrival path
        if not _warned:
            _warned = True
            warnings.warn(
                f"radixcache: the shared tier's prefetch at arrival raised ({type(e).__name__}: {e}); "
                "admissions ask the store themselves",
                RuntimeWarning,
                stacklevel=2,
            )


def register() -> None:
    """Register :func:`factory` as ``--radix-cache-backend radixcache``, and :func:`on_arrival`
    after :data:`ARRIVAL_HOOK_TARGET` in SGLang's hook registry (applied by SGLang once its plugins
    are loaded). Idempotent: a second call (SGLang loads plugins in every process, sometimes
    twice) leaves the first registration.

    :raises RuntimeError: another factory is registered under the name.
    """
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    current = get_radix_cache_factory(BACKEND_NAME)
    if current is factory:
        return
    if current is not None:
        raise RuntimeError(f"another factory is registered as {BACKEND_NAME!r}: {current!r}")
    register_radix_cache_backend(BACKEND_NAME, factory)
    HookRegistry.register(ARRIVAL_HOOK_TARGET, on_arrival, HookType.AFTER)
