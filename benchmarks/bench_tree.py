"""HybridRadixCache on workload W1: 1024 sequences of 1280 tokens built from 32 shared
1024-token prefixes plus 256 random tokens, page_size 1, a small state layout, each sequence
inserted with a snapshot at its end.

Reports median microseconds of insert, match (the full sequence; a shared prefix plus a new
suffix), one eviction of 200,000 KV tokens, one eviction of 256 snapshots, and Python bytes per
node (tracemalloc). Keys are numpy int32 arrays (what an engine holds); list keys are timed too
(insert into a fresh tree of 256 sequences, full match, prefix + new suffix): the operations of
shared/bench/sglang/side_by_side.py, so CI's smoke run covers them.
Prints one JSON object.

    python benchmarks/bench_tree.py [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import tracemalloc
from typing import Any

import numpy as np
import torch

from linear_state import LinearStatePool, RequestOwner, StateLayout
from radixcache import HybridRadixCache, free_kv_to


def build_workload(rng: np.random.Generator, groups: int, per_group: int, prefix: int, suffix: int) -> list[np.ndarray]:
    prefixes = [rng.integers(0, 150_000, prefix, dtype=np.int32) for _ in range(groups)]
    seqs = []
    for i in range(groups * per_group):
        tail = rng.integers(0, 150_000, suffix, dtype=np.int32)
        seqs.append(np.concatenate([prefixes[i % groups], tail]))
    return seqs


def one_round(seqs: list[np.ndarray], rng: np.random.Generator, prefix: int, suffix: int) -> dict[str, float]:
    layout = StateLayout(2, (8, 3), (2, 4, 4))
    pool = LinearStatePool(layout, len(seqs) + 8)
    freed: list[torch.Tensor] = []
    cache = HybridRadixCache(pool, page_size=1, on_event=free_kv_to(freed.append))
    donor = RequestOwner("donor")
    slot = pool.alloc(donor)
    gc.collect()
    gc.disable()
    insert_us = timed_inserts(cache, list(seqs), slot)
    nodes = cache.num_nodes
    match_full, match_new, match_list, match_new_list = [], [], [], []
    for s in seqs:
        t0 = time.perf_counter()
        m = cache.match(s)
        match_full.append((time.perf_counter() - t0) * 1e6)
        assert m.cached_length == len(s)
    as_lists = [s.tolist() for s in seqs[:256]]
    for s in as_lists:
        t0 = time.perf_counter()
        cache.match(s)
        match_list.append((time.perf_counter() - t0) * 1e6)
    for s in seqs:
        q = np.concatenate([s[:prefix], rng.integers(150_000, 151_000, suffix, dtype=np.int32)])
        t0 = time.perf_counter()
        m = cache.match(q)
        match_new.append((time.perf_counter() - t0) * 1e6)
        assert m.token_length == prefix
    for s in seqs[:256]:
        ql = [*s[:prefix].tolist(), *rng.integers(150_000, 151_000, suffix).tolist()]
        t0 = time.perf_counter()
        m = cache.match(ql)
        match_new_list.append((time.perf_counter() - t0) * 1e6)
        assert m.token_length == prefix
    cache.check_invariants()
    t0 = time.perf_counter()
    snaps = cache.evict(snapshots=256)
    evict_snap_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    kv_res = cache.evict(kv_tokens=200_000)
    evict_kv_ms = (time.perf_counter() - t0) * 1e3
    gc.enable()
    assert snaps.snapshots >= 256 and kv_res.kv_tokens >= 200_000, (snaps, kv_res)
    cache.check_invariants()
    return {
        "insert_us": statistics.median(insert_us),
        "match_full_us": statistics.median(match_full),
        "match_prefix_new_suffix_us": statistics.median(match_new),
        "match_full_list_key_us": statistics.median(match_list),
        "match_prefix_new_suffix_list_key_us": statistics.median(match_new_list),
        "insert_list_key_us": list_insert_us(seqs[:256]),
        "evict_256_snapshots_ms": evict_snap_ms,
        "evict_200k_kv_tokens_ms": evict_kv_ms,
        "evicted_nodes_for_200k_kv": kv_res.nodes_removed,
        "nodes": nodes,
    }


def list_insert_us(seqs: list[np.ndarray]) -> float:
    """Median insert with the keys as Python lists (what hosts pass), into a fresh tree."""
    pool = LinearStatePool(StateLayout(2, (8, 3), (2, 4, 4)), len(seqs) + 8)
    cache = HybridRadixCache(pool, page_size=1, on_event=free_kv_to(lambda kv: None))
    slot = pool.alloc(RequestOwner("donor"))
    gc.collect()
    gc.disable()
    out = timed_inserts(cache, [s.tolist() for s in seqs], slot)
    gc.enable()
    return statistics.median(out)


def timed_inserts(cache: HybridRadixCache, keys: list[Any], slot: int) -> list[float]:
    """Microseconds of each insert of ``keys`` (sequence ``i`` with KV indices of its own)."""
    kvs = [torch.arange(i * len(k), (i + 1) * len(k)) for i, k in enumerate(keys)]
    out = []
    for k, kv in zip(keys, kvs, strict=True):
        t0 = time.perf_counter()
        cache.insert(k, kv, state_slot=slot)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def python_bytes_per_node(seqs: list[np.ndarray]) -> float:
    """Python heap bytes per node of a W1 tree (tracemalloc; KV tensors' storage is not Python
    memory and is excluded, their tensor objects are included)."""
    pool = LinearStatePool(StateLayout(2, (8, 3), (2, 4, 4)), len(seqs) + 8)
    cache = HybridRadixCache(pool)
    slot = pool.alloc(RequestOwner("donor"))
    kvs = [torch.arange(i * len(s), (i + 1) * len(s)) for i, s in enumerate(seqs)]
    gc.collect()
    tracemalloc.start()
    mem0 = tracemalloc.get_traced_memory()[0]
    for s, kv in zip(seqs, kvs, strict=True):
        cache.insert(s, kv, state_slot=slot)
    mem1 = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (mem1 - mem0) / cache.num_nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5, help="independent builds; medians across rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke size for CI: 1 round")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    seqs = build_workload(rng, groups=32, per_group=32, prefix=1024, suffix=256)
    rounds = [one_round(seqs, rng, 1024, 256) for _ in range(1 if args.quick else args.rounds)]
    out: dict[str, object] = {"bench": "tree_w1", "sequences": len(seqs), "rounds": len(rounds), "page_size": 1}
    for k in rounds[0]:
        out[k] = round(statistics.median(r[k] for r in rounds), 3)
    out["python_bytes_per_node"] = round(python_bytes_per_node(seqs))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
