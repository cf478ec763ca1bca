"""Eviction cost per evicted node under each policy, with 10k and 100k snapshot nodes in the tree.

Builds a tree of N distinct sequences (shared prefixes, a snapshot at each end) and tells the
policy about each donation and some hits; then times evicting 2,000 nodes through the policy in
ten batches, alternating between the two sizes so both see the same machine: once in bursts (every
eviction of a batch at one ``now``, as when one admission needs room for many) and once spread
(each eviction at its own ``now``, as when every admission needs one). Prints JSON: the median over
the batches of microseconds per evicted node at each size, and the growth ratio (target: < 2x).

    python benchmarks/bench_policies.py [--sizes 10000 100000] [--quick] [--policies NAME ...]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

from linear_state import LinearStatePool, RequestOwner, StateLayout
from radixcache import CacheManager, HybridRadixCache
from radixcache.policies import POLICIES, DonationReason, RequestInfo, make_policy


def build(policy_name: str, n: int, seed: int = 0) -> tuple[HybridRadixCache, CacheManager]:
    """A tree of ``n`` snapshot nodes the policy was told about (donations and some hits)."""
    rng = random.Random(seed)
    pool = LinearStatePool(StateLayout(1, (1, 1), (1,)), n + 8)
    cache = HybridRadixCache(pool)
    policy = make_policy(policy_name)
    mgr = CacheManager(cache, policy, host_tier=None)  # evictions go through the manager, as a host's do
    slot = pool.alloc(RequestOwner("donor"))
    prefixes = [np.array([rng.randrange(1 << 20) for _ in range(64)], dtype=np.int32) for _ in range(256)]
    nodes = []
    for i in range(n):
        key = np.concatenate([prefixes[i % 256], np.array([rng.randrange(1 << 20) for _ in range(16)], dtype=np.int32)])
        res = cache.insert(key, torch.arange(len(key)), state_slot=slot)
        req = RequestInfo(len(key), 0, 0, f"s{i % 1000}", float(i))
        policy.donated(res.node, req, DonationReason.FINISH if i % 3 else DonationReason.CAPTURE, float(i))
        nodes.append((res.node, req))
        if i % 7 == 0:
            node, r = nodes[rng.randrange(len(nodes))]
            if node.snapshot is not None:
                policy.touched(node, r, float(i))
    pool.free(slot, RequestOwner("donor"))  # the fixture's donor is not one of the manager's requests
    return cache, mgr


def time_batch(cache: HybridRadixCache, mgr: CacheManager, evictions: int, now: float, spread: bool = False) -> float:
    """Microseconds per node removed while evicting ``evictions`` snapshots through the policy: in
    one burst (one ``now``, as when one admission needs room), or ``spread`` (each at its own
    ``now``, as when every admission needs one)."""
    before = cache.num_nodes
    step = 1e-6 if spread else 0.0
    t0 = time.perf_counter()
    for i in range(evictions):
        mgr.evict(snapshots=1, now=now + i * step)
    dt = time.perf_counter() - t0
    return 1e6 * dt / max(1, before - cache.num_nodes)


def eviction_costs(
    policy_name: str, sizes: tuple[int, int], evictions: int, spread: bool = False
) -> tuple[float, float]:
    """Median microseconds per evicted node at both sizes, in alternating batches (side by side)."""
    trees = [build(policy_name, n) for n in sizes]
    batch = max(1, evictions // 10)
    times: list[list[float]] = [[], []]
    for _ in range(0, evictions, batch):
        for i, (cache, policy) in enumerate(trees):
            times[i].append(time_batch(cache, policy, batch, float(sizes[i]), spread))
    for _, mgr in trees:
        mgr.check_invariants()
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs=2, default=[10_000, 100_000])
    ap.add_argument("--evictions", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="smoke size for CI")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    args = ap.parse_args()
    sizes, ev = ((500, 2000), 100) if args.quick else ((args.sizes[0], args.sizes[1]), args.evictions)
    out: dict[str, object] = {"bench": "policy_eviction", "sizes": list(sizes), "evictions": ev}
    for p in args.policies:
        small, large = eviction_costs(p, sizes, ev)
        s_small, s_large = eviction_costs(p, sizes, ev, spread=True)
        out[p] = {
            "us_per_node_small": round(small, 2),
            "us_per_node_large": round(large, 2),
            "growth": round(large / small, 2),
            "spread_us_per_node_small": round(s_small, 2),
            "spread_us_per_node_large": round(s_large, 2),
            "spread_growth": round(s_large / s_small, 2),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
