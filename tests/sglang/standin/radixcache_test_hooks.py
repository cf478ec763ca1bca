"""What the SGLang engine tests switch on inside SGLang's own processes (loaded by this folder's
``sitecustomize``; never imported by radixcache):

Always: SGLang's extra-buffer strategy is let through on the CPU. SGLang 0.5.23 allows it only on
GPU platforms (``mamba_hook._platform_supports_mamba_cache_extra_buffer``) because the CPU kernel it
ships for the GDN prefill returns no per-chunk states, which its tracking copies into the track
slots; the stand-in kernel returns them (``sgl_kernel/mamba.py``), so SGLang's own tracking code
(the runner's track-slot copies, the scheduler's ping-pong bookkeeping) runs unchanged. Its decode
step pins a host tensor unconditionally (``Tensor.pin_memory()``, which raises where there is no
accelerator); on such a machine pinning returns the tensor itself, as a copy to the "device" (the
CPU) needs no pinned page. Its decode tracking copies states with a Triton kernel
(``track_mamba_states_if_needed`` / ``_all_layers``); :func:`track_mamba_states` is the torch
copy the runner calls instead on such a machine (``track_copy.py``).

When the variables below are set:

``RADIXCACHE_SGLANG_NOISE=<seed>``
    Whenever the scheduler becomes fully idle (between the tests' rounds), every free mamba state
    slot and every free KV token row is filled with noise: a state that was not restored (or was
    restored from the wrong place) is garbage, never a lucky reuse of a slot that still held the
    right one. Each fill appends ``<state slots> <kv rows> <largest batch so far>`` to the file named by
    ``RADIXCACHE_SGLANG_NOISE_LOG`` (if set), so a test can check that it happened, and, with
    radixcache's shared tier on, the tier's counters as a JSON line to that name plus ``.shared``.

``RADIXCACHE_SGLANG_STRAY=1``
    With the noise: at each fill, also a stray write into every snapshot slot of radixcache's tree
    (every donation fingerprint taken first), the bug class forensics exists for. Each fill
    appends a JSON line to ``RADIXCACHE_SGLANG_NOISE_LOG`` plus ``.stray``: the snapshots written
    so far, forensics' findings and the manager's refused hits.

``RADIXCACHE_SGLANG_INJECT=<bug>``
    A bug committed in the radixcache backend on purpose, for negative controls:
    ``skip-restore`` (a hit's state is never copied into the request's slot) or ``alias``
    (radixcache's injected ownership transfer: the tree keeps the donor's own slot as its snapshot
    instead of a private clone, see :mod:`radixcache.testing.inject`) or ``working-slot`` (with
    SGLang's extra buffer, a checkpoint clones the request's working slot, which the runner has
    carried past the tracked depth, instead of the track slot holding the state at that depth) or
    ``shared-kv`` (with the shared tier, a fetched prefix's KV bytes are written rotated by one
    token's worth: every row gets another token's bytes; the blob itself verified).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from track_copy import track_mamba_states  # type: ignore[import-not-found]

NOISE = os.environ.get("RADIXCACHE_SGLANG_NOISE")
NOISE_LOG = os.environ.get("RADIXCACHE_SGLANG_NOISE_LOG")
INJECT = os.environ.get("RADIXCACHE_SGLANG_INJECT")
STRAY = os.environ.get("RADIXCACHE_SGLANG_STRAY") == "1"
INJECTS = ("skip-restore", "alias", "working-slot", "shared-kv")


def _free_kv_rows(alloc: Any) -> torch.Tensor:
    """Every KV token row SGLang's token allocator holds free (pages expanded to tokens)."""
    parts = [p for p in (alloc.free_pages, getattr(alloc, "release_pages", None)) if p is not None]
    pages = torch.cat(parts).long()
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


def stray_writes(scheduler: Any, gen: torch.Generator) -> int:
    """Noise added into every device snapshot slot of radixcache's tree (``scheduler.tree_cache``),
    once forensics took every donation fingerprint. Returns how many slots."""
    cache = scheduler.tree_cache
    fx = cache.manager.forensics
    if fx is not None:
        fx.settle()
    slots = [int(n.snapshot) for n in cache.tree.iter_nodes() if n.snapshot is not None]
    if slots:
        t = scheduler.req_to_token_pool.mamba_pool.mamba_cache.temporal
        idx = torch.tensor(slots)
        t[:, idx] += torch.randn((t.shape[0], len(slots), *t.shape[2:]), generator=gen).to(t.dtype)
    return len(slots)


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
            if STRAY:
                self._radixcache_stray = getattr(self, "_radixcache_stray", 0) + stray_writes(self, gen)
                if NOISE_LOG:
                    mgr = self.tree_cache.manager
                    with open(NOISE_LOG + ".stray", "a") as f:
                        f.write(
                            json.dumps(
                                {
                                    "stray": self._radixcache_stray,
                                    "findings": None if mgr.forensics is None else len(mgr.forensics.findings),
                                    "refused_hits": mgr.metrics().refused_hits,
                                }
                            )
                            + "\n"
                        )
            if NOISE_LOG:
                with open(NOISE_LOG, "a") as f:
                    f.write(f"{n[0]} {n[1]} {getattr(self, '_radixcache_max_batch', 0)}\n")
                shared = getattr(self.tree_cache, "shared", None)
                if shared is not None:  # the shared tier's counters so far, one JSON line per fill
                    with open(NOISE_LOG + ".shared", "a") as f:
                        f.write(json.dumps(dataclasses.asdict(shared.stats)) + "\n")
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
    elif INJECT == "working-slot":
        cls = mod.RadixcacheHybridCache
        real_tracked = cls._tracked

        def tracked(self: Any, req: Any, up_to: int) -> Any:
            got = real_tracked(self, req, up_to)
            if got is None or not req.kv.holds_mamba:
                return got
            return got[0], int(req.kv.mamba_pool_idx)  # BUG: the working slot, not the track slot

        cls._tracked = tracked
    elif INJECT == "shared-kv":
        codec = mod.SGLangKVCodec
        real_import = codec.import_kv

        def import_kv(self: Any, data: Any, num_tokens: int) -> Any:
            b, k = bytes(data), self.bytes_per_token
            return real_import(self, b[-k:] + b[:-k], num_tokens)  # BUG: every row another token's bytes

        codec.import_kv = import_kv


def _lift_extra_buffer_gate(module: types.ModuleType) -> None:
    mod: Any = module
    mod._platform_supports_mamba_cache_extra_buffer = lambda: True


def _cpu_track_copies(module: types.ModuleType) -> None:
    mod: Any = module
    mod.track_mamba_states_if_needed = functools.partial(track_mamba_states, all_layers=False)
    mod.track_mamba_states_all_layers = functools.partial(track_mamba_states, all_layers=True)


_AFTER_LOAD: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.arg_groups.mamba_hook": _lift_extra_buffer_gate,
}
if not torch.cuda.is_available():
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    _AFTER_LOAD["sglang.srt.layers.attention.hybrid_linear_attn_backend"] = _cpu_track_copies
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
