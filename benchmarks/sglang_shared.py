"""What the shared (Redis) tier costs and gives a second SGLang replica's scheduler thread, as JSON.

Replica A (the radixcache backend with a shared tier on a real redis-server) serves the CPU
differential harness's request stream (tests/sglang/harness.py: SGLang's real pools and its own
scheduler-side helpers; the KV pool on, so every forward checks the state and the KV rows it
resumes from) and publishes every snapshot. Then replica B, fresh pools, serves the same stream
in alternation: without a shared tier (``local``), with one on the same server (``shared``: no
prefetch, each admission whose local match is short asks the store on the scheduler's thread),
and with each request prefetched as it arrives (``prefetched``: what the plugin's hook on
SGLang's ``Scheduler._prefetch_kvcache`` does). In every mode requests arrive eight ahead of
their admission (a waiting queue). Each run is a fresh interpreter. Timed: every call of B's
cache that SGLang's scheduler makes (``sglang_scheduler_cost.Meter``: the outermost call of each public method,
charged to the request being admitted or stepped), so the shared runs' time includes their
admissions' probes and fetches from Redis (or their prefetches' issue and take) and their
checkpoints' publications (the state and KV copies; the encoding and upload run on the tier's
writer thread). Beside the time: the hit tokens each served (a hit token is a token the model
does not compute) and the tier's counters.

The server: ``--redis-url``, or one of the benchmark's own on a free loopback port
(tests/redis_server.py). Runs where SGLang is importable (``make test-sglang`` builds
``.venv-sglang``)::

    .venv-sglang/bin/python benchmarks/sglang_shared.py [--requests 300] [--reps 3] [--seed 1]

``--codec`` instead times the KV codec's export on the thread that publishes (the scheduler's):
a 2,048-token prefix of a Qwen3-Next-80B-like KV pool (12 full-attention layers, 2 KV heads of
256, bf16: 48 MiB) into fresh memory, against into a buffer the tier handed back
(``SGLangKVCodec.reuse_kv``), alternating, ms per export.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tests.sglang.conftest  # noqa: E402,F401  (inert stand-ins for SGLang's GPU-only imports)
from tests.sglang import harness as H  # noqa: E402,N812

MODEL = "bench-tiny-hybrid"
QUEUED = 8  # requests waiting ahead of their admission (every mode: the same schedule)
MODES = ("local", "shared", "prefetched")


def _env(url: str | None, requests: int, seed: int) -> Any:
    from radixcache.tiers.store import RedisStore

    toks = sum(len(p) + out for p, out, _ in H.stream(seed, requests))
    shared = {} if url is None else {"shared": RedisStore(url), "model_identity": MODEL}
    slots = 4 * requests + 64
    return H.make_env("radixcache", kv_pool=True, kv_size=toks + 4096, mamba_size=slots, cache_kwargs=shared)


def run_one(mode: str, url: str, requests: int, seed: int) -> dict[str, Any]:
    """``publish``: replica A serves the stream and publishes (waited for; before each shared run,
    into a flushed server); ``local``, ``shared``,
    ``prefetched``: replica B serves it timed, without the shared tier, with it (each admission
    asks the store), with it and each request prefetched as it arrives (the plugin's hook)."""
    from sglang_scheduler_cost import Meter, pct

    env = _env(None if mode == "local" else url, requests, seed)
    if mode == "publish":
        H.run_stream(env, seed, requests)
        env.cache.manager.publish_pending(wait=True)
        return {"published": env.cache.shared.stats.published, "mismatches": len(env.mismatches)}
    meter = Meter(env.cache, 0)
    meter.also(env.cache, "prefetch_request", "prefetch_request")
    orig = (H.admit, H.step)

    def timed(fn: Any) -> Any:
        def call(env_: Any, run: Any, *a: Any, **k: Any) -> Any:
            meter.enter(run.req.rid)
            try:
                return fn(env_, run, *a, **k)
            finally:
                meter.leave()

        return call

    H.admit, H.step = timed(orig[0]), timed(orig[1])
    arrived = timed(lambda env_, run: env_.cache.prefetch_request(run.req)) if mode == "prefetched" else None
    try:
        H.run_stream(env, seed, requests, queued=QUEUED, arrived=arrived)
    finally:
        H.admit, H.step = orig
    per_req = list(meter.per_req.values())
    st = env.cache.shared.stats if env.cache.shared is not None else None
    return {
        "per_request_us": {
            "p50": pct(per_req, 0.5),
            "p99": pct(per_req, 0.99),
            "mean": round((sum(per_req) + meter.unattributed) / max(1, len(per_req)) / 1e3, 2),
        },
        "per_op": {
            op: {"calls": len(v), "p50_us": pct(v, 0.5), "p99_us": pct(v, 0.99), "total_ms": round(sum(v) / 1e6, 2)}
            for op, v in sorted(meter.per_op.items())
            if op in ("match_prefix", "checkpoint", "prefetch_request")
        },
        "hit_tokens": env.hit_tokens,
        "mismatches": len(env.mismatches),
        "shared": None
        if st is None
        else {
            "probes": st.probes,
            "hits": st.hits,
            "hit_tokens": st.hit_tokens,
            "published": st.published,
            "prefetches": st.prefetches,
            "prefetch_dropped": st.prefetch_dropped,
            # a store call that failed or timed out, and the calls skipped while it was held down
            # (a loaded machine's smoke run would otherwise fail without saying why)
            "errors": st.errors,
            "skipped_down": st.skipped_down,
            "no_room": st.no_room,
            "rejected": dict(st.rejected),
        },
    }


def codec_export_ms(reps: int, tokens: int = 2048) -> dict[str, Any]:
    """``SGLangKVCodec.export_kv`` of ``tokens`` scattered KV indices, each export into fresh
    memory (the buffer dropped) against into the one handed back before (``reuse_kv``), the two
    alternating; ms per export, median and min over ``reps``."""
    import time

    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from radixcache.sglang.kv import SGLangKVCodec

    H.setup_sglang(1)
    size = 8 * tokens  # the kept buffers are capped at a quarter of the pool: 4x the export
    pool = MHATokenToKVPool(
        size=size, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=256, layer_num=12,
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    alloc = TokenToKVPoolAllocator(size=size, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False)
    for t in (*pool.k_buffer, *pool.v_buffer):
        t.normal_()
    fresh, reusing = SGLangKVCodec(alloc, keep_bytes=0), SGLangKVCodec(alloc)
    idx = torch.randperm(size)[:tokens] + 1
    reusing.reuse_kv(reusing.export_kv(idx, None))
    times: dict[str, list[float]] = {"fresh": [], "reused": []}
    for _ in range(reps):
        for name, codec in (("fresh", fresh), ("reused", reusing)):
            t0 = time.perf_counter()
            out = codec.export_kv(idx, None)
            times[name].append((time.perf_counter() - t0) * 1e3)
            codec.reuse_kv(out)  # kept by ``reusing``; ``fresh`` keeps nothing (its cap is 0)
            del out
    # the comparison means something only if the buffer was kept (within the cap) and taken
    assert reusing.buffers.spare_bytes == tokens * reusing.bytes_per_token, reusing.buffers.spare_bytes
    assert bytes(fresh.export_kv(idx, None)) == bytes(reusing.export_kv(idx, None))
    return {
        "bench": "sglang_kv_codec_export",
        "tokens": tokens,
        "mib": round(tokens * fresh.bytes_per_token / 2**20, 1),
        "export_ms": {k: {"median": round(statistics.median(v), 2), "min": round(min(v), 2)} for k, v in times.items()},
        "reused_over_fresh": round(statistics.median(times["reused"]) / statistics.median(times["fresh"]), 3),
    }


def _isolated(mode: str, url: str, requests: int, seed: int) -> dict[str, Any]:
    from sglang_scheduler_cost import json_of

    cmd = [sys.executable, os.path.abspath(__file__), "--one", mode, url, "--requests", str(requests)]
    return json_of([*cmd, "--seed", str(seed)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3, help="repetitions (shared and local alternate in each)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--redis-url", help="an existing server (default: start one of our own)")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "URL"), help=argparse.SUPPRESS)
    ap.add_argument("--codec", action="store_true", help="instead: the KV codec's export, fresh memory or reused")
    args = ap.parse_args()
    if args.codec:
        print(json.dumps(codec_export_ms(max(args.reps, 1) * 10), indent=1))
        return
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.requests, args.seed)))
        return
    import redis

    from tests.redis_server import redis_url

    with redis_url(args.redis_url) as url:
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for rep in range(args.reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                if mode != "local":  # each finds what A published, and only that
                    redis.Redis.from_url(url).flushall()
                    published = _isolated("publish", url, args.requests, args.seed)
                runs[mode].append(_isolated(mode, url, args.requests, args.seed))

    def ratio(mode: str) -> dict[str, float]:
        return {
            k: round(
                statistics.median(
                    s["per_request_us"][k] / max(c["per_request_us"][k], 1e-9)
                    for s, c in zip(runs[mode], runs["local"], strict=True)
                ),
                3,
            )
            for k in ("p50", "p99", "mean")
        }

    out = {
        "bench": "sglang_shared",
        "requests": args.requests,
        "queued": QUEUED,
        "replica_a": published,
        "per_request_us_each_rep": {m: [r["per_request_us"] for r in rs] for m, rs in runs.items()},
        "ratio_over_local": {m: ratio(m) for m in MODES[1:]},
        "hit_tokens": {m: rs[0]["hit_tokens"] for m, rs in runs.items()},
        "shared_counters": {m: runs[m][0]["shared"] for m in MODES[1:]},
        "per_op_first_rep": {m: rs[0]["per_op"] for m, rs in runs.items()},
        "mismatches": sum(r["mismatches"] for rs in runs.values() for r in rs),
    }
    out["ok"] = out["mismatches"] == 0 and all(out["hit_tokens"][m] > out["hit_tokens"]["local"] for m in MODES[1:])
    print(json.dumps(out, indent=1))
    if not out["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
