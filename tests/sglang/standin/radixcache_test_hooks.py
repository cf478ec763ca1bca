"""What the SGLang engine tests switch on inside SGLang's own processes (loaded by this folder's
``sitecustomize`` when the variables below are set; never imported by radixcache):

``RADIXCACHE_SGLANG_NOISE=<seed>``
    Whenever the scheduler becomes fully idle (between the tests' rounds), every free mamba state
    slot and every free KV token row is filled with noise: a state that was not restored (or was
    restored from the wrong place) is garbage, never a lucky reuse of a slot that still held the
    right one. Each fill appends ``<state slots> <kv rows> <largest batch so far>`` to the file named by
    ``RADIXCACHE_SGLANG_NOISE_LOG`` (if set), so a test can check that it happened.

``RADIXCACHE_SGLANG_INJECT=<bug>``
    A bug committed in the radixcache backend on purpose, for negative controls:
    ``skip-restore`` (a hit's state is never copied into the request's slot) or ``alias``
    (radixcache's injected ownership transfer: the tree keeps the donor's own slot as its snapshot
    instead of a private clone, see :mod:`radixcache.testing.inject`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

NOISE = os.environ.get("RADIXCACHE_SGLANG_NOISE")
NOISE_LOG = os.environ.get("RADIXCACHE_SGLANG_NOISE_LOG")
INJECT = os.environ.get("RADIXCACHE_SGLANG_INJECT")
INJECTS = ("skip-restore", "alias")


def _free_kv_rows(alloc: Any) -> torch.Tensor:
    """Every KV token row SGLang's token allocator holds free (pages expanded to tokens)."""
    pages = torch.cat((alloc.free_pages, alloc.release_pages)).long()
    size = int(getattr(alloc, "page_size", 1))
    if size == 1:
        return pages
    return (pages[:, None] * size + torch.arange(size)).reshape(-1)


def fill_free_with_noise(scheduler: Any, gen: torch.Generator) -> tuple[int, int]:
    """Noise into the free state slots and free KV rows of ``scheduler``'s pools. Returns how many
    of each."""
    rtp = scheduler.req_to_token_pool
    slots = rtp.mamba_allocator.free_slots.long()
    cache = rtp.mamba_pool.mamba_cache
    for t in (*cache.conv, cache.temporal):
        noise = torch.randn((t.shape[0], len(slots), *t.shape[2:]), generator=gen).to(t.dtype)
        t[:, slots] = noise
    alloc = scheduler.token_to_kv_pool_allocator
    rows = _free_kv_rows(alloc)
    kv = alloc.get_kvcache()
    kv = getattr(kv, "full_kv_pool", kv)
    for buf in (*kv.k_buffer, *kv.v_buffer):
        buf[rows] = torch.randn((len(rows), *buf.shape[1:]), generator=gen).to(buf.dtype)
    return len(slots), len(rows)


def _patch_scheduler(mod: types.ModuleType) -> None:
    cls = mod.Scheduler
    real_on_idle: Callable[[Any], Any] = cls.on_idle
    real_run: Callable[..., Any] = cls.run_batch
    gen = torch.Generator().manual_seed(int(NOISE or 0))

    def on_idle(self: Any) -> Any:
        out = real_on_idle(self)
        if not getattr(self, "_radixcache_noised", False) and self.is_fully_idle():
            n = fill_free_with_noise(self, gen)
            self._radixcache_noised = True
            if NOISE_LOG:
                with open(NOISE_LOG, "a") as f:
                    f.write(f"{n[0]} {n[1]} {getattr(self, '_radixcache_max_batch', 0)}\n")
        return out

    def run_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        self._radixcache_noised = False
        size = len(getattr(batch, "reqs", ()))
        self._radixcache_max_batch = max(getattr(self, "_radixcache_max_batch", 0), size)
        return real_run(self, batch, *args, **kwargs)

    cls.on_idle = on_idle
    cls.run_batch = run_batch


def _patch_backend(module: types.ModuleType) -> None:
    mod: Any = module
    if INJECT == "skip-restore":
        from linear_state import COMPLETE, Fence
        from radixcache.manager.cache_manager import CacheManager

        class SkipRestore(CacheManager):
            def restore(self, node: Any, dst_slot: Any, **kwargs: Any) -> Fence:
                return COMPLETE  # BUG: the request's slot keeps whatever it held

        mod.CacheManager = SkipRestore
    elif INJECT == "alias":
        from radixcache.testing.inject import make_cache

        real = mod.HybridRadixCache

        class AliasTree:
            """Builds the injected tree where the backend builds its tree."""

            holds_snapshot = staticmethod(real.holds_snapshot)

            def __new__(cls, pool: Any, **kwargs: Any) -> Any:
                return make_cache("alias", pool, **kwargs)

        mod.HybridRadixCache = AliasTree


_AFTER_LOAD: dict[str, Callable[[types.ModuleType], None]] = {}
if NOISE is not None:
    _AFTER_LOAD["sglang.srt.managers.scheduler"] = _patch_scheduler
if INJECT:
    if INJECT not in INJECTS:
        raise ValueError(f"RADIXCACHE_SGLANG_INJECT must be one of {INJECTS}, got {INJECT!r}")
    _AFTER_LOAD["radixcache.sglang.backend"] = _patch_backend


class _Patcher(importlib.abc.MetaPathFinder):
    """Runs a patch right after one of :data:`_AFTER_LOAD`'s modules executes."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname not in _AFTER_LOAD:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                real_exec = loader.exec_module
                patch = _AFTER_LOAD[fullname]

                def exec_module(module: types.ModuleType, real_exec: Any = real_exec, patch: Any = patch) -> None:
                    real_exec(module)
                    patch(module)

                loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


if _AFTER_LOAD:
    sys.meta_path.insert(0, _Patcher())
