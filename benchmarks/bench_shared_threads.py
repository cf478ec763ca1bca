"""What the shared tier's own threads take from the scheduler's thread: the interpreter lock.

``SharedTier(background=True)`` encodes and uploads on a writer thread and ``prefetch`` fetches and
verifies on a fetcher thread, so the scheduler's thread does not pay for them directly; but a copy
made while holding the interpreter lock stops every other Python thread until it ends, however
many cores the machine has. This benchmark runs a stand-in scheduler loop on the main thread (a
few microseconds of Python per step, as a scheduler forming batches does) and records how long
each step had to wait beyond its own work, while:

- ``encode``: a worker thread encodes one snapshot blob (the state of ``--preset`` plus the KV of
  ``--tokens`` tokens), with :func:`~radixcache.tiers.blob.encode_blob` and with the encoding the
  tier used before 2026-12-06 (``tensor_bytes`` of each state tensor, then byte-string
  concatenation: restated below as the baseline);
- ``decode``: a worker thread turns a fetched blob's state back into tensors, with
  :func:`~radixcache.tiers.blob.bytes_tensor` and with the ``bytearray`` copy used before;
- ``idle``: no worker (the loop's own jitter);
- ``get``: a worker thread reads one blob of that size back from a real redis-server, in one ``GET``
  (as before 2026-12-06) and in ranges (:class:`~radixcache.tiers.store.RedisStore`'s default);
- ``publish`` / ``prefetch``: the real tier against a real redis-server: ``--blobs`` publications
  handed to the writer thread, the loop running until the writer has stored them all; then a
  second replica prefetching them on its fetcher thread, the loop running until every answer came.

Per case: the worker's wall time, and the loop's longest wait and 99th percentile, in ms. The
encode, decode and get cases alternate ``--reps`` times; medians over reps. Prints one JSON object.

    python benchmarks/bench_shared_threads.py [--preset qwen3-next-80b] [--tokens 1024] [--blobs 4] [--reps 5] [--quick]
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_shared_publish import BytesKV, blob_setup, random_slot

from linear_state import StateLayout
from radixcache.tiers.blob import BLOB_MAGIC, blob_digest, bytes_tensor, encode_blob, parse_blob
from radixcache.tiers.shared import SharedTier
from radixcache.tiers.store import RedisStore

_STEP_WORK = 200  # loop iterations of Python per scheduler step (a few microseconds)


def _scheduler_loop(until: Callable[[], bool], min_s: float = 0.0) -> list[float]:
    """Run scheduler steps until ``until()`` (and at least ``min_s``); each step's wait in seconds:
    its wall time less the fastest step seen (the work itself)."""
    steps: list[float] = []
    start = last = time.perf_counter()
    while True:
        x = 0
        for i in range(_STEP_WORK):
            x += i
        time.sleep(0)  # a scheduler's step ends in a system call (polling its sockets): the lock may change hands
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        if until() and now - start >= min_s:
            break
    floor = min(steps)
    return [s - floor for s in steps]


def _waits(steps: list[float]) -> dict[str, float]:
    return {
        "longest_wait_ms": round(1e3 * max(steps), 3),
        "p99_wait_ms": round(1e3 * float(np.percentile(steps, 99)), 3),
        "steps": len(steps),
    }


def _beside(work: Callable[[], object]) -> dict[str, float]:
    """``work`` on a worker thread while the scheduler loop runs; the worker's ms and the loop's waits."""
    took: list[float] = []

    def run() -> None:
        t = time.perf_counter()
        work()
        took.append(time.perf_counter() - t)

    th = threading.Thread(target=run)
    th.start()
    steps = _scheduler_loop(lambda: not th.is_alive())
    th.join()
    return {"worker_ms": round(1e3 * took[0], 3), **_waits(steps)}


def _encode_before(header: dict[str, object], conv: torch.Tensor, rec: torch.Tensor, kv: bytes) -> bytes:
    """The encoding before 2026-12-06, restated as the baseline: each state tensor's bytes through
    numpy's ``tobytes``, then byte strings concatenated (every copy under the interpreter lock)."""
    state = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in (conv, rec))
    h = json.dumps(header, sort_keys=True).encode()
    signed = BLOB_MAGIC + len(h).to_bytes(4, "little") + h + state + kv
    return signed + blob_digest("k", signed)


def _decode_before(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The state's bytes as a tensor before 2026-12-06, restated: a ``bytearray`` copy (under the lock)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def codec_cases(layout: StateLayout, kv_bytes: int, reps: int) -> dict[str, Any]:
    """Encode and decode one blob, before and now, alternating; medians over ``reps``."""
    conv = torch.randn(layout.num_layers, *layout.conv_shape).to(layout.conv_dtype)
    rec = torch.randn(layout.num_layers, *layout.recurrent_shape).to(layout.recurrent_dtype)
    kv = bytes(kv_bytes)
    header: dict[str, object] = {"state_bytes": conv.nbytes + rec.nbytes, "kv_bytes": kv_bytes}
    blob = encode_blob(header, (conv, rec), kv, key="k")
    assert bytes(blob) == _encode_before(header, conv, rec, kv), "the two encodings differ"
    parsed = parse_blob(bytes(blob))
    assert parsed is not None
    body = parsed[1]
    cases: dict[str, Callable[[], object]] = {
        "idle": lambda: time.sleep(0.05),
        "encode_before": lambda: _encode_before(header, conv, rec, kv),
        "encode_now": lambda: encode_blob(header, (conv, rec), kv, key="k"),
        "decode_before": lambda: (
            _decode_before(body[: conv.nbytes], conv.dtype, tuple(conv.shape)),
            _decode_before(body[conv.nbytes : conv.nbytes + rec.nbytes], rec.dtype, tuple(rec.shape)),
        ),
        "decode_now": lambda: (
            bytes_tensor(body[: conv.nbytes], conv.dtype, tuple(conv.shape)),
            bytes_tensor(body[conv.nbytes : conv.nbytes + rec.nbytes], rec.dtype, tuple(rec.shape)),
        ),
    }
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(_beside(cases[name]))
    out: dict[str, Any] = {
        name: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]} for name, rs in runs.items()
    }
    for what in ("encode", "decode"):
        before, now = out[f"{what}_before"], out[f"{what}_now"]
        waited = before["longest_wait_ms"]  # 0 for a blob too small to make the loop wait (--quick)
        out[f"{what}_longest_wait_now_over_before"] = round(now["longest_wait_ms"] / waited, 3) if waited else None
    return out


def store_cases(url: str, blob_bytes: int, reps: int) -> dict[str, Any]:
    """One blob read back from Redis, whole (one request for all of it, as a ``GET``) and in
    ranges (:class:`RedisStore`'s default), alternating; medians over ``reps``."""
    ranges = RedisStore(url, timeout_s=60.0)
    whole = RedisStore(url, timeout_s=60.0, read_chunk=blob_bytes + 1)
    blob = np.random.default_rng(0).integers(0, 256, blob_bytes, dtype=np.uint8).tobytes()
    assert ranges.put("bench-threads-get", blob)
    for store in (ranges, whole):
        got = store.get("bench-threads-get")
        assert got is not None and bytes(got) == blob, "the blob read back differs"
    cases = {"get_whole": whole, "get_ranges": ranges}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(_beside(lambda s=cases[name]: s.get("bench-threads-get")))  # type: ignore[misc]
    ranges.delete("bench-threads-get")
    out: dict[str, Any] = {
        name: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]} for name, rs in runs.items()
    }
    waited = out["get_whole"]["longest_wait_ms"]
    out["get_longest_wait_ranges_over_whole"] = (
        round(out["get_ranges"]["longest_wait_ms"] / waited, 3) if waited else None
    )
    return out


def tier_cases(url: str, layout: StateLayout, kv: BytesKV, tokens: int, blobs: int) -> dict[str, Any]:
    """The writer thread publishing ``blobs`` snapshots, then another replica's fetcher thread
    prefetching them, each beside the scheduler loop."""
    store = RedisStore(url, timeout_s=60.0)
    a = SharedTier(store, model="bench-threads", kv=kv, publisher="A", background=True, max_queued_bytes=1 << 40)
    a.bind(layout)
    pool, slot = random_slot(layout)
    kv_idx = torch.arange(tokens)
    prompts = [np.arange(i * tokens, (i + 1) * tokens + 1, dtype=np.int64) for i in range(blobs)]
    t = time.perf_counter()
    for ids in prompts:  # each published at its first `tokens` ids; the request has one more
        assert a.publish(ids[:-1], None, pool, slot, kv_idx, None), a.stats.as_dict()
    publish_calls = time.perf_counter() - t
    pub = _waits(_scheduler_loop(lambda: a.pending_writes == 0))
    pub["publish_calls_ms"] = round(1e3 * publish_calls, 3)
    assert a.close(timeout_s=600) and a.stats.published == blobs, a.stats.as_dict()

    b = SharedTier(store, model="bench-threads", kv=kv, publisher="B", max_prefetches=blobs)
    b.bind(layout)
    b.start_prefetching()
    t = time.perf_counter()
    for i, ids in enumerate(prompts):
        assert b.prefetch(i, ids, None, 0)
    issue_calls = time.perf_counter() - t
    pre = _waits(_scheduler_loop(lambda: not any(b.prefetch_pending(i) for i in range(blobs))))
    pre["prefetch_calls_ms"] = round(1e3 * issue_calls, 3)
    hits = 0
    for i, ids in enumerate(prompts):
        issued, got = b.take(i, ids, None, 0)
        hits += int(issued and got is not None and got.depth == tokens)
    assert hits == blobs, f"{hits} of {blobs} prefetches answered with their blob ({b.stats.as_dict()})"
    b.check_invariants()
    b.close()
    for ids in prompts:
        store.delete(a.key(ids[:-1], None))
    return {"publish": pub, "prefetch": pre, "prefetch_hits": hits}


def main() -> None:
    setup = blob_setup(__doc__, blobs=4, reps=5, quick_blobs=2)
    out: dict[str, Any] = {
        "bench": "shared_threads",
        "preset": setup.args.preset,
        "blob_bytes": setup.blob_bytes,
        "reps": setup.reps,
        "switch_interval_ms": round(1e3 * sys.getswitchinterval(), 3),
    }
    layout, tokens, reps = setup.layout, setup.tokens, setup.reps
    out["codec"] = codec_cases(layout, tokens * setup.kv.bytes_per_token, reps)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.redis_server import redis_url

    with redis_url(setup.args.redis_url) as url:
        out["store"] = store_cases(url, setup.blob_bytes, reps)
        out["tier"] = tier_cases(url, layout, setup.kv, tokens, setup.blobs)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
