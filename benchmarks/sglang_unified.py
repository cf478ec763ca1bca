"""W1 side by side against SGLang 0.5.23's UnifiedRadixCache (issue 18's third column).

SGLang 0.5.23 deleted ``MambaRadixCache``, which shared/bench/sglang/side_by_side.py drives; its
hybrid default is ``UnifiedRadixCache`` (components FULL + MAMBA) over a tree core that is Rust by
default (``rust_tree_core``, shipped compiled in the wheel) or Python. This script reuses that
harness as it is (its workload, its radixcache adapter, its phases, alternation and identical-work
checks: imported from ``--harness``, read only) and adds one adapter for ``UnifiedRadixCache``,
selected in the worker instead of the harness's SGLang adapter. Same spirit: identical inputs,
loops alternating between the libraries in one process, one torch thread, ratios per paired
sample. 0.5.23 takes keys as ``array('q')`` only: list keys are converted inside the timed
call, as radixcache converts them inside its own. The match is timed with
``path_device_indices`` of the matched node (0.5.23's match result carries no KV indices; a
scheduler fetches them that way), as radixcache's match returns its KV indices.

Build the venv (CPU; SGLang's own pins are torch 2.14.1 and a CUDA stack, so ``--no-deps``)::

    python3 -m venv /tmp/sglang-0.5.23 && V=/tmp/sglang-0.5.23/bin
    $V/pip install torch==2.13.0 && $V/pip install --no-deps sglang==0.5.23
    $V/pip install aiohttp dill einops fastapi huggingface_hub ipython msgspec numpy openai==2.8.0 \\
        orjson partial-json-parser pillow prometheus_client psutil pybase64 pydantic pyyaml pyzmq \\
        requests setproctitle starlette tqdm transformers==5.19.0 triton==3.9.0 opentelemetry-api \\
        sortedcontainers xxhash zstandard
    $V/pip install --no-deps xgrammar==0.2.7 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 loguru gguf

Run (from the repository root)::

    python3 benchmarks/sglang_unified.py --python /tmp/sglang-0.5.23/bin/python \\
        --harness /work/shared/bench/sglang [--core rust|python] [--rounds 7 --reps 2]

Prints one JSON object: per operation, the median (min, max) of each library and of the ratio
SGLang / radixcache over the paired samples, and the identical-work checks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from array import array
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _unified_adapter(sbs: Any, core: str) -> Any:
    """An adapter with the harness's SGLang adapter's interface, over UnifiedRadixCache."""

    class UnifiedAdapter(sbs.SglangAdapter):  # type: ignore[misc]
        def __init__(self) -> None:
            sys.path.insert(0, sbs.HERE)
            import stubs  # the harness's stubs: torchvision, sentencepiece, sgl_kernel

            stubs.STUBS.update({"compressed_tensors", "gguf"})
            from importlib.metadata import version

            import torch
            from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
            from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
            from sglang.srt.mem_cache.radix_cache import RadixKey
            from sglang.srt.mem_cache.rust_tree_core import adapter as rust_adapter
            from sglang.srt.mem_cache.unified_cache.components import ComponentType
            from sglang.srt.mem_cache.unified_cache.components import mamba as mamba_component
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
            from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

            set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1))
            # Both read the model's config otherwise (a download): the harness's 0.5.20 value.
            mamba_component.mamba_cache_chunk_size = lambda: 64
            mamba_component.mamba_checkpoint_grid = lambda page: 64
            rust_adapter.mamba_cache_chunk_size = lambda: 64
            self.torch = torch
            self.version = f"sglang {version('sglang')} UnifiedRadixCache ({core} tree core)"
            self.new_api = True
            self.EvictParams, self.InsertParams, self.MatchPrefixParams = EvictParams, InsertParams, MatchPrefixParams
            self.RadixKey, self.CacheInitParams = RadixKey, CacheInitParams
            self.TokenToKVPoolAllocator, self.HybridReqToTokenPool = TokenToKVPoolAllocator, HybridReqToTokenPool
            self.UnifiedRadixCache, self.components = UnifiedRadixCache, (ComponentType.FULL, ComponentType.MAMBA)
            shape = Mamba2StateShape.create(
                tp_world_size=1,
                intermediate_size=sbs.HEADS * sbs.HEAD_DIM,
                n_groups=sbs.N_GROUPS_SSM,
                num_heads=sbs.HEADS,
                head_dim=sbs.HEAD_DIM,
                state_size=sbs.STATE,
                conv_kernel=sbs.KERNEL,
            )
            self.params = Mamba2CacheParams(shape=shape, layers=list(range(sbs.LAYERS)))
            self.slot_bytes = self.params.mamba_cache_per_req

        def new_tree(self) -> None:
            torch = self.torch
            self.pool = self.HybridReqToTokenPool(
                size=8,
                mamba_size=sbs.POOL_SLOTS,
                mamba_spec_state_size=8,
                max_context_len=64,
                device="cpu",
                enable_memory_saver=False,
                cache_params=self.params,
                mamba_layer_ids=list(range(sbs.LAYERS)),
                enable_mamba_extra_buffer=False,
                enable_overlap_schedule=False,
            )
            alloc = self.TokenToKVPoolAllocator(
                size=8, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
            )
            self.sink: list[Any] = []
            alloc.free = self.sink.append
            alloc.free_segment = lambda idx, start_pos=0: self.sink.append(idx)
            params = self.CacheInitParams(
                req_to_token_pool=self.pool,
                token_to_kv_pool_allocator=alloc,
                page_size=1,
                disable=False,
                tree_components=self.components,
                tree_core_backend=core,
            )
            self.cache = self.UnifiedRadixCache(params)
            self.alloc = alloc
            self.donor = self._alloc_slot()

        def _insert_call(self, key: Any, kv: Any, slot: Any) -> None:
            if type(key) is list:  # 0.5.23's keys must be array('q'): a host converts, timed
                key = array("q", key)
            self.cache.insert(self.InsertParams(key=self.RadixKey(key), value=kv, mamba_value=slot))

        def match(self, key: Any) -> tuple[float, int]:
            t0 = time.perf_counter()
            if type(key) is list:
                key = array("q", key)
            r = self.cache.match_prefix(self.MatchPrefixParams(key=self.RadixKey(key)))
            kv = self.cache.path_device_indices(r.last_device_node)
            dt = time.perf_counter() - t0
            assert len(kv) == r.device_prefix_len
            return dt, int(r.device_prefix_len)

        def _sizes(self) -> tuple[int, int, int]:
            c = self.cache
            return c.full_evictable_size(), c.mamba_evictable_size(), self.num_nodes()

        def num_nodes(self) -> int:
            # Not timed. The tree cores keep no count; total KV tokens held is what both can report.
            return -1

        def check(self) -> None:
            self.cache.sanity_check()

    return UnifiedAdapter


def worker(harness: str, core: str, seed: int, flip: bool, reps: int) -> dict[str, Any]:
    sys.path.insert(0, harness)
    import side_by_side as sbs

    adapter = _unified_adapter(sbs, core)
    sbs.make_adapter = lambda kind: sbs.RadixcacheAdapter() if kind == "radixcache" else adapter()
    out: dict[str, Any] = sbs.worker_round(["radixcache", "sglang"], seed, 1, flip, reps, "phase")
    return out


CHECKS = ("workload_sha", "slot_bytes", "hits_prefix_new_suffix", "evict_kv_post_hits", "evict_snaps_post_hits")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", help="the SGLang 0.5.23 venv's python (required)")
    ap.add_argument("--harness", default="/work/shared/bench/sglang", help="folder of side_by_side.py")
    ap.add_argument("--core", choices=["rust", "python"], default="rust")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--flip", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.harness, args.core, args.seed, args.flip, args.reps)))
        return
    if not args.python:
        ap.error("--python (the SGLang 0.5.23 venv's python) is required")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("SGLANG_MAMBA_SSM_DTYPE", "float32")
    samples: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for r in range(args.rounds):
        cmd = [args.python, os.path.abspath(__file__), "--worker", "--harness", args.harness, "--core", args.core]
        cmd += ["--seed", str(args.seed), "--reps", str(args.reps)] + (["--flip"] if r % 2 else [])
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=args.harness)
        if p.returncode:
            raise SystemExit(f"worker failed:\n{p.stderr[-4000:]}")
        for rc, sg in json.loads(p.stdout.strip().splitlines()[-1])["results"]:
            samples.append((rc, sg))
        print(f"round {r}: {time.time() - t0:.1f}s", file=sys.stderr)
    rc0, sg0 = samples[0]
    checks = {k: {"radixcache": rc0[k], "sglang": sg0[k], "same": rc0[k] == sg0[k]} for k in CHECKS}
    for k in ("evict_kv_effect", "evict_snaps_effect"):  # the KV and snapshots freed (node counts: see num_nodes)
        a, b = ({x: v for x, v in w[k].items() if x != "nodes"} for w in (rc0, sg0))
        checks[k] = {"radixcache": a, "sglang": b, "same": a == b}
    table: dict[str, Any] = {}
    for group in ("native", "list"):
        for op in rc0[group]:
            rcv = [rc[group][op] for rc, _ in samples]
            sgv = [sg[group][op] for _, sg in samples]
            ratio = [s / r for r, s in zip(rcv, sgv, strict=True)]
            table[f"{group}/{op}"] = {
                "radixcache": _stats(rcv),
                "sglang": _stats(sgv),
                "ratio_sglang_over_radixcache": _stats(ratio),
            }
    print(
        json.dumps(
            {
                "workload": "W1 (shared/bench/sglang/side_by_side.py)",
                "versions": {"radixcache": rc0["impl"], "sglang": sg0["impl"]},
                "samples": len(samples),
                "checks": checks,
                "state_copy_alone_us": {
                    "radixcache": round(statistics.median(rc["state_copy_alone_us"] for rc, _ in samples), 2),
                    "sglang": round(statistics.median(sg["state_copy_alone_us"] for _, sg in samples), 2),
                },
                "table": table,
            },
            indent=1,
        )
    )


def _stats(v: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2)}


if __name__ == "__main__":
    main()
