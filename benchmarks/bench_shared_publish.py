"""What a shared-tier publication costs the scheduler's thread: uploads inline against a background
writer, on a real redis-server.

Per mode, ``--blobs`` snapshots of a replay preset's layout (the state of ``--preset``, plus the KV
of ``--tokens`` tokens at the preset's bytes per token, as a host's codec would export it) are
published under distinct keys through :class:`~radixcache.tiers.shared.SharedTier`; each
``publish()`` call is timed on the calling thread (read-back, fingerprint, encoding, and, inline,
the upload), then the tier is flushed and every blob is checked to be in the store. Modes:
``inline``, ``background`` (published back to back: the writer falls behind), and
``background_spaced`` (the writer stores each before the next is published: the tier's host copies
of an encoded publication are reused, so the first call pays fresh pages and the later ones do not).
Two more modes time a watched snapshot's verification on the way out (forensics watching every
donation): ``background_spaced_verify_first`` (``Forensics.verify`` on the calling thread, then
``publish``: what the manager did until 2026-12-07) and ``background_spaced_expect``
(``publish(expect=)``: the writer compares the fingerprint it takes anyway; what it does now).
Modes alternate ``--reps`` times, each on a fresh key space; medians over reps. Prints one JSON
object.

The server: ``--redis-url``, or a redis-server of the benchmark's own on a free loopback port
(tests/redis_server.py: the binary from the distribution's packages).

    python benchmarks/bench_shared_publish.py [--preset qwen3-next-80b] [--blobs 8] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from linear_state import COMPLETE, LinearStatePool, RequestOwner, StateLayout
from radixcache.forensics import Forensics
from radixcache.simulator.replay import PRESETS
from radixcache.tiers.shared import SharedTier
from radixcache.tiers.store import RedisStore


class BytesKV:
    """A KV codec whose export is ``bytes_per_token`` zero bytes per token (a host's KV blob)."""

    identity = "bench"

    def __init__(self, bytes_per_token: int) -> None:
        self.bytes_per_token = bytes_per_token
        self._made: dict[int, bytes] = {}

    def export_kv(self, kv_indices: torch.Tensor, after: object) -> bytes:
        # One buffer per length, made once: what a host's export costs is the host's, not the tier's
        # (a fresh 25 MB bytes took 0 to 15 ms here, as the allocator's heap grew and shrank).
        n = self.bytes_per_token * int(kv_indices.numel())
        got = self._made.get(n)
        if got is None:
            got = self._made[n] = bytes(n)
        return got

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        return torch.arange(num_tokens)


def random_slot(layout: StateLayout) -> tuple[LinearStatePool, int]:
    """A one-slot pool of ``layout`` whose slot holds a random state: the snapshot published."""
    pool = LinearStatePool(layout, 1)
    slot = pool.alloc(RequestOwner("bench"))
    pool.conv[:, slot].normal_()
    pool.recurrent[:, slot].normal_()
    return pool, slot


def run_mode(
    url: str,
    background: bool,
    layout: StateLayout,
    kv: BytesKV,
    tokens: int,
    blobs: int,
    tag: str,
    spaced: bool = False,
    check: str = "none",
) -> dict[str, float]:
    """Publish ``blobs`` snapshots; caller-thread seconds per publish (median, max, the first,
    the median of the others) and wall to stored. ``spaced``: the writer stores each before the
    next is published (untimed), as with publications rarer than its pace. ``check``: ``none``;
    ``verify`` (forensics verifies the slot on the calling thread first, timed with the call);
    ``expect`` (the donation fingerprint handed to ``publish``)."""
    store = RedisStore(url, timeout_s=30.0)
    tier = SharedTier(store, model=f"bench-{tag}", kv=kv, background=background, max_queued_bytes=1 << 40)
    tier.bind(layout)
    pool, slot = random_slot(layout)
    fx = Forensics(pool, mode="record", sample=1.0)
    fx.donated(1, tokens, b"bench", slot, "bench", COMPLETE, None)
    assert fx.settle() == 0
    kv_idx = torch.arange(tokens)
    calls: list[float] = []
    t0 = time.perf_counter()
    for i in range(blobs):
        ids = np.arange(i * tokens, (i + 1) * tokens, dtype=np.int64)
        t = time.perf_counter()
        if check == "verify":
            assert fx.verify(1, "publish")
            ok = tier.publish(ids, None, pool, slot, kv_idx, None)
        elif check == "expect":
            ok = tier.publish(ids, None, pool, slot, kv_idx, None, expect=fx.expected(1), token=1)
        else:
            ok = tier.publish(ids, None, pool, slot, kv_idx, None)
        calls.append(time.perf_counter() - t)
        assert ok, f"publication {i} was not taken ({tier.stats.as_dict()})"
        if spaced:
            assert tier.flush(timeout_s=600)
    assert tier.close(timeout_s=600), "the writer did not finish"
    wall = time.perf_counter() - t0
    assert tier.stats.published == blobs and tier.stats.errors == 0, tier.stats.as_dict()
    checks = tier.checks()
    assert len(checks) == (blobs if check == "expect" else 0) and all(c.ok for c in checks)
    keys = [tier.key(np.arange(i * tokens, (i + 1) * tokens, dtype=np.int64), None) for i in range(blobs)]
    assert all(store.exists(keys)), "a published blob is missing from the store"
    for k in keys:
        store.delete(k)
    return {
        "call_median_s": statistics.median(calls),
        "call_max_s": max(calls),
        "call_first_s": calls[0],
        "call_later_median_s": statistics.median(calls[1:] or calls),
        "wall_s": wall,
    }


@dataclass
class BlobSetup:
    """A shared-tier benchmark's command line, applied: the layout, prefix length, blob count and
    repetitions (``--quick``: 2 layers, 64 tokens, ``quick_blobs`` blobs, 1 rep) and the codec."""

    args: argparse.Namespace
    layout: StateLayout
    tokens: int
    blobs: int
    reps: int
    kv: BytesKV

    @property
    def blob_bytes(self) -> int:
        return self.layout.slot_bytes + self.tokens * self.kv.bytes_per_token


def blob_setup(description: str | None, *, blobs: int, reps: int, quick_blobs: int) -> BlobSetup:
    """Parse a shared-tier benchmark's common options (``--preset``, ``--tokens``, ``--blobs``,
    ``--reps``, ``--redis-url``, ``--quick``) and apply them."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-next-80b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=1024, help="prefix length whose KV travels with each state")
    ap.add_argument("--blobs", type=int, default=blobs)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--redis-url", help="an existing server (default: start one of our own)")
    ap.add_argument(
        "--quick", action="store_true", help=f"smoke size for CI: 2 layers, 64 tokens, {quick_blobs} blobs, 1 rep"
    )
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    layout, tokens, n, r = preset.layout, args.tokens, args.blobs, args.reps
    if args.quick:
        layout = StateLayout(2, layout.conv_shape, layout.recurrent_shape, layout.conv_dtype, layout.recurrent_dtype)
        tokens, n, r = 64, quick_blobs, 1
    return BlobSetup(args, layout, tokens, n, r, BytesKV(preset.kv_bytes_per_token))


def main() -> None:
    setup = blob_setup(__doc__, blobs=8, reps=3, quick_blobs=3)
    args, layout, tokens, blobs, reps, kv = setup.args, setup.layout, setup.tokens, setup.blobs, setup.reps, setup.kv
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.redis_server import redis_url

    with redis_url(args.redis_url) as url:
        checks = {"background_spaced_verify_first": "verify", "background_spaced_expect": "expect"}
        modes = ["inline", "background", "background_spaced", *checks]
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for r in range(reps):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                runs[mode].append(
                    run_mode(
                        url,
                        mode != "inline",
                        layout,
                        kv,
                        tokens,
                        blobs,
                        f"{mode}{r}",
                        spaced="spaced" in mode,
                        check=checks.get(mode, "none"),
                    )
                )
    out: dict[str, Any] = {
        "bench": "shared_publish",
        "preset": args.preset,
        "blob_bytes": setup.blob_bytes,
        "blobs": blobs,
        "reps": reps,
    }
    for mode, rs in runs.items():
        out[mode] = {
            k.replace("_s", "_ms"): round(1e3 * statistics.median(x[k] for x in rs), 3)
            for k in ("call_median_s", "call_max_s", "call_first_s", "call_later_median_s", "wall_s")
        }
    out["caller_thread_inline_over_background"] = round(
        out["inline"]["call_median_ms"] / max(out["background"]["call_median_ms"], 1e-9), 2
    )
    out["caller_thread_verify_first_over_expect"] = round(
        out["background_spaced_verify_first"]["call_median_ms"]
        / max(out["background_spaced_expect"]["call_median_ms"], 1e-9),
        2,
    )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
