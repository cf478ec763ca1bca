"""What the shared tier costs the scheduler's thread per admission: probed at admission (the store's
round trips on the thread) against prefetched when the request arrives (``CacheManager.prefetch``:
the round trips, the digest and the fingerprint on the tier's fetcher thread; the admission takes
the answer with one dictionary look-up), on a real redis-server.

The store's depth index of the namespace first gets ``--depths`` depths (1 to ``--depths``), as a
busy deployment's would: most are other prompts' (the probe checks this prompt's key at each, and
finds none). A publisher engine (the reference engine) serves ``--prompts`` prompts of
``--tokens`` tokens sharing a system prompt and publishes their snapshots. Then three fresh
replicas serve the same stream of ``--requests`` requests (those prompts again and new ones of the
same system prompt), each from the same store (flushed and published again before each): one
fetching at admission, one prefetching at submission (all requests arrive at once, while the
fetcher thread works through their probes), and one prefetching at submission with the fetcher
thread held in its store until every request arrived and serving started once every prefetch was
answered ("alone": the calls' own cost, nothing competing with the scheduler's thread). Every
shared-tier call made on the scheduler's thread is timed (``fetch``, ``take``, ``cancel`` at
admission; the manager's ``prefetch``, its tree match included, at arrival); the replicas take
turns ``--reps`` times. Hit tokens are reported: the prefetching replica holds a request back
until its prefetch is answered (at most 1 s; the time it waited is latency, not scheduler-thread
work).

The server: ``--redis-url``, or a redis-server of the benchmark's own on a free loopback port
(tests/redis_server.py: the binary from the distribution's packages). Prints one JSON object.

    python benchmarks/bench_shared_probe.py [--depths 2048] [--tokens 2100] [--requests 40] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

from radixcache.testing.engine import EngineRequest, ReferenceEngine
from radixcache.testing.model import HybridConfig, HybridModel
from radixcache.tiers.shared import SharedTier
from radixcache.tiers.store import RedisStore


class _GatedStore(RedisStore):
    """A Redis store whose reads wait until ``gate`` opens: the fetcher thread sleeps in its first
    call (holding neither the interpreter lock nor a core) while the requests arrive."""

    def __init__(self, url: str, gate: threading.Event) -> None:
        super().__init__(url, timeout_s=5.0)
        self.gate = gate

    def deepest(self, index: str, lo: int, hi: int, count: int) -> list[int]:
        self.gate.wait()
        return super().deepest(index, lo, hi, count)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.gate.wait()
        return super().exists(keys)

    def get(self, key: str) -> bytes | memoryview | None:
        self.gate.wait()
        return super().get(key)


def _timed(fn: Callable[..., Any], bucket: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket.append(time.perf_counter() - t)

    return wrapper


def _prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(500) for _ in range(tokens - 100)]
    return [system + [rng.randrange(500) for _ in range(100)] for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_replica(
    model: HybridModel, url: str, stream: list[list[int]], prefetch: bool, tag: str, settle: bool = False
) -> dict[str, float]:
    """One replica serving ``stream``; its scheduler-thread time in the shared tier. With
    ``settle``, the calls' own cost: the fetcher thread waits in its store while every request
    arrives, and serving starts once every prefetch was answered (nothing competes with the
    scheduler's thread for the interpreter lock or a core)."""
    gate = threading.Event()
    if not settle:
        gate.set()
    store = _GatedStore(url, gate)
    eng = ReferenceEngine(model, shared_store=store, publisher=tag, shared_prefetch=prefetch)
    tier = eng.shared
    assert isinstance(tier, SharedTier)
    at_admission: list[float] = []
    for name in ("fetch", "take", "cancel"):  # what the manager asks of the tier at admission
        setattr(tier, name, _timed(getattr(tier, name), at_admission))
    # at arrival: the manager's prefetch (its tree match and the tier's queue append)
    at_arrival: list[float] = []
    eng.manager.prefetch = _timed(eng.manager.prefetch, at_arrival)  # type: ignore[method-assign]
    waits: list[float] = []
    pending = eng.manager.shared_pending

    def timed_pending(rid: Any) -> bool:  # the head's wait for its answer (latency, not thread work)
        t = time.perf_counter()
        out = pending(rid)
        if out:
            waits.append(time.perf_counter() - t)
        return out

    eng.manager.shared_pending = timed_pending  # type: ignore[method-assign]
    for i, p in enumerate(stream):
        eng.submit(EngineRequest(f"{tag}-{i}", p, 2))
    gate.set()
    if settle:
        deadline = time.monotonic() + 60
        while any(pending(f"{tag}-{i}") for i in range(len(stream))) and time.monotonic() < deadline:
            time.sleep(0.001)
    finished = eng.run()
    n = len(finished)
    st = tier.stats
    calls = at_arrival + at_admission
    out = {
        "per_admission_ms": 1e3 * sum(calls) / n,
        "at_arrival_ms": 1e3 * sum(at_arrival) / n,
        "at_admission_ms": 1e3 * sum(at_admission) / n,
        "call_p50_ms": 1e3 * _pct(calls, 0.5),
        "call_p99_ms": 1e3 * _pct(calls, 0.99),
        "calls": len(calls),
        "shared_hit_tokens": st.hit_tokens,
        "cached_tokens": sum(r.cached_length for r in finished),
        "late": st.prefetch_late,
        "held_back_polls": len(waits),
    }
    eng.close()
    return out


def _publish(model: HybridModel, url: str, prompts: list[list[int]], depths: int, tag: str) -> None:
    """The store as a busy deployment's: ``depths`` depths in the namespace's index (most of them
    other prompts'), and a publisher engine's snapshots of ``prompts``."""
    publisher = ReferenceEngine(model, shared_store=RedisStore(url, timeout_s=5.0), publisher=tag)
    tier = publisher.shared
    assert tier is not None
    for d in range(1, depths + 1):
        tier.store.add_depth(tier.index(None), d)
    for i, p in enumerate(prompts):
        publisher.submit(EngineRequest(f"{tag}-{i}", p, 2))
    publisher.run()
    publisher.manager.publish_pending(wait=True)
    assert tier.stats.published > 0, tier.stats.as_dict()
    publisher.close()
    del publisher, tier
    gc.collect()  # the publisher's garbage is not the next replica's to collect inside a timed call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, default=2048, help="depths in the namespace's index")
    ap.add_argument("--tokens", type=int, default=2100, help="tokens per request")
    ap.add_argument("--prompts", type=int, default=8, help="prompts the publisher serves and publishes")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--redis-url", help="an existing server (default: start one of our own)")
    ap.add_argument("--quick", action="store_true", help="smoke size for CI: 256 depths, 600 tokens, 8 requests, 1 rep")
    args = ap.parse_args()
    depths, tokens, n_prompts, requests, reps = args.depths, args.tokens, args.prompts, args.requests, args.reps
    if args.quick:
        depths, tokens, n_prompts, requests, reps = 256, 600, 3, 8, 1
    model = HybridModel(HybridConfig())
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.redis_server import redis_url

    runs: dict[str, list[dict[str, float]]] = {"at_admission": [], "prefetched": [], "prefetched_alone": []}
    with redis_url(args.redis_url) as url:
        for r in range(reps):
            prompts = _prompts(n_prompts, tokens, seed=r)
            more = _prompts(requests, tokens, seed=r)  # same system prompt (same seed), other tails
            stream = [prompts[i % n_prompts] if i % 2 == 0 else more[i] for i in range(requests)]
            order = ["at_admission", "prefetched", "prefetched_alone"]
            for mode in order if r % 2 == 0 else order[::-1]:
                # Each replica finds the same store: the publisher's snapshots alone (a replica
                # publishes what it computes, and the next one would find more: 43,980 shared hit
                # tokens against 18,584 in the runs before 2026-12-04 came from that, not prefetch).
                redis.Redis.from_url(url).flushall()
                _publish(model, url, prompts, depths, f"pub{r}{mode}")
                pre = mode != "at_admission"
                runs[mode].append(run_replica(model, url, stream, pre, f"{mode}{r}", mode == "prefetched_alone"))
    out: dict[str, Any] = {
        "bench": "shared_probe",
        "depths": depths,
        "tokens": tokens,
        "requests": requests,
        "reps": reps,
    }
    for mode, rs in runs.items():
        out[mode] = {k: round(statistics.median(float(x[k]) for x in rs), 4) for k in rs[0]}
    out["per_admission_prefetched_over_at_admission"] = round(
        out["prefetched"]["per_admission_ms"] / max(out["at_admission"]["per_admission_ms"], 1e-9), 4
    )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
