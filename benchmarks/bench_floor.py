"""Where the floor is: a minimal Python radix tree doing W1's work, beside HybridRadixCache.

Issue 18 asks how far each tree operation is from what the same work costs in plain Python on
this machine. :class:`Floor` is that minimum, written for W1 only (page size 1, one namespace, no
locks, no host tier, no fences, no validation of anything, no metrics): a dict of children keyed
by the first token's bytes, edges as ``bytes`` compared with one ``==`` (memcmp), KV indices as
numpy arrays, recency as a lazy heap, and a snapshot slot of the same
:class:`~linear_state.LinearStatePool`'s tensors copied with one ``torch._foreach_copy_`` of the
slot's conv and recurrent views (the least a clone can cost through torch). Per operation:

- insert: the key's bytes, the walk, a split where the key leaves an edge inside it, the
  duplicate KV of the cached prefix found (numpy ``!=``) and released, one leaf with a private
  copy of its KV, one clone, the path's recency;
- match of a full sequence: the walk, the deepest snapshot, the KV of the path as one tensor;
- match of a prefix + new suffix: the walk to where the key leaves the tree, the common pages of
  that edge found by binary search;
- evict 256 snapshots, then 200,000 KV tokens (as benchmarks/bench_tree.py): pop the least
  recently used leaf off the heap, release its KV and slot, cascade to a parent left as a
  childless tombstone.

Both trees get identical inputs (W1 from benchmarks/bench_tree.py's own generator: 1024
sequences of 1280 tokens over 32 shared 1024-token prefixes, numpy int32 keys, a 14,016-byte
Mamba2-shaped state as in shared/bench/sglang), and both do identical work (node counts and
evicted amounts are checked). Phases alternate between the two, the first one swapping round
by round; one torch thread; gc off while timing. Prints one JSON object: median per operation, and ours / floor.

    python benchmarks/bench_floor.py [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from bench_tree import build_workload

from linear_state import LinearStatePool, NodeOwner, RequestOwner, StateLayout
from radixcache import HybridRadixCache, free_kv_to

LAYOUT = StateLayout(3, (96, 3), (2, 32, 16), conv_dtype=torch.bfloat16, recurrent_dtype=torch.float32)


class _Node:
    __slots__ = ("children", "key", "kv", "last", "parent", "snap")

    def __init__(self, key: bytes, kv: np.ndarray, parent: _Node | None) -> None:
        self.key, self.kv, self.parent = key, kv, parent
        self.children: dict[bytes, _Node] = {}
        self.snap: int | None = None
        self.last = 0


def _common_tokens(kb: bytes, pos: int, edge: bytes, limit: int) -> int:
    """Tokens (>= 1, the first is known equal) on which ``kb[pos:]`` and ``edge`` agree: binary
    search, one memcmp per probe."""
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kb[pos : pos + mid * 4] == edge[: mid * 4]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Floor:
    """The minimal tree (see the module docstring). Not a product: W1 only, nothing checked."""

    def __init__(self, pool: LinearStatePool, sink: Callable[[Any], None]) -> None:
        self.root = _Node(b"", np.empty(0, dtype=np.int64), None)
        self.pool, self.sink = pool, sink
        self.rows = [[pool.conv[:, s], pool.recurrent[:, s]] for s in range(pool.capacity)]
        self.free_slots = [s for s in range(pool.capacity) if pool.owner_of(s) is None]
        self.owner = NodeOwner(1)
        self.tick = 0
        self.leaves: list[tuple[int, int, _Node]] = []  # (last, id, node): LRU leaves
        self.nodes = 1

    def _touch(self, path: list[_Node]) -> None:
        self.tick += 1
        for n in path:
            n.last = self.tick
        leaf = path[-1]
        if not leaf.children:
            heapq.heappush(self.leaves, (self.tick, id(leaf), leaf))

    def insert(self, key: np.ndarray, kv: torch.Tensor, donor: int) -> None:
        kb = key.tobytes()
        kvn = kv.numpy()
        node, pos, end = self.root, 0, len(kb)
        path = []
        while pos < end:
            child = node.children.get(kb[pos : pos + 4])
            if child is None:
                break
            n = len(child.key)
            if kb[pos : pos + n] == child.key:
                pos += n
                node = child
                path.append(child)
                continue
            lo = _common_tokens(kb, pos, child.key, min(n, end - pos) // 4)
            upper = _Node(child.key[: lo * 4], child.kv[:lo], node)
            node.children[upper.key[:4]] = upper
            child.key, child.kv, child.parent = child.key[lo * 4 :], child.kv[lo:], upper
            upper.children[child.key[:4]] = child
            self.nodes += 1
            pos += lo * 4
            node = upper
            path.append(upper)
            break
        start = 0
        for on_path in path:  # the caller's duplicates of the cached prefix go back to it
            k = len(on_path.kv)
            mine = kvn[start : start + k]
            differ = mine != on_path.kv
            if differ.any():
                self.sink(torch.from_numpy(mine[differ]))
            start += k
        leaf = _Node(kb[pos:], kvn[pos // 4 :].copy(), node)
        node.children[leaf.key[:4]] = leaf
        self.nodes += 1
        slot = self.free_slots.pop()
        torch._foreach_copy_(self.rows[slot], self.rows[donor])
        leaf.snap = slot
        path.append(leaf)
        self._touch(path)

    def match(self, key: np.ndarray) -> tuple[int, torch.Tensor]:
        kb = key.tobytes()
        node, pos, end = self.root, 0, len(kb)
        path: list[_Node] = []
        snap_at = 0
        while pos < end:
            child = node.children.get(kb[pos : pos + 4])
            if child is None:
                break
            n = len(child.key)
            if n <= end - pos and kb[pos : pos + n] == child.key:
                pos += n
                node = child
                path.append(child)
                if child.snap is not None:
                    snap_at = len(path)
                continue
            _common_tokens(kb, pos, child.key, min(n, end - pos) // 4)
            break
        if not snap_at:
            return 0, torch.empty(0, dtype=torch.int64)
        used = path[:snap_at]
        self._touch(used)
        return pos // 4, torch.from_numpy(np.concatenate([n.kv for n in used]))

    def _remove_leaf(self, n: _Node) -> int:
        """Remove leaf ``n`` (KV and slot released) and every tombstone parent left childless."""
        freed = 0
        while True:
            self.sink(n.kv)
            freed += len(n.kv)
            if n.snap is not None:
                self.free_slots.append(n.snap)
                n.snap = None
            parent = n.parent
            assert parent is not None
            del parent.children[n.key[:4]]
            n.parent = None
            self.nodes -= 1
            if parent.children or parent.parent is None:
                return freed
            if parent.snap is not None:
                heapq.heappush(self.leaves, (parent.last, id(parent), parent))
                return freed
            n = parent

    def _pop_leaf(self) -> _Node | None:
        while self.leaves:
            last, _, n = heapq.heappop(self.leaves)
            if n.last == last and not n.children and n.parent is not None:
                return n
        return None

    def evict_kv(self, tokens: int) -> int:
        freed = 0
        while freed < tokens and (n := self._pop_leaf()) is not None:
            freed += self._remove_leaf(n)
        return freed

    def evict_snapshots(self, count: int) -> int:
        """LRU snapshot leaves removed whole (W1's trees keep their snapshots on leaves)."""
        freed = 0
        while freed < count and (n := self._pop_leaf()) is not None:
            if n.snap is not None:
                freed += 1
                self._remove_leaf(n)
        return freed


class _Side:
    """One tree of a round, with what it was given: pool, donor slot, KV inputs."""

    def __init__(self, kind: str, seqs: list[np.ndarray]) -> None:
        self.kind = kind
        self.pool = LinearStatePool(LAYOUT, len(seqs) + 8)
        self.freed: list[Any] = []
        self.donor = self.pool.alloc(RequestOwner("donor"))
        self.kvs = [torch.arange(i * len(s), (i + 1) * len(s)) for i, s in enumerate(seqs)]
        if kind == "ours":
            self.tree: Any = HybridRadixCache(self.pool, on_event=free_kv_to(self.freed.append))
        else:
            self.tree = Floor(self.pool, self.freed.append)

    def insert(self, s: np.ndarray, kv: torch.Tensor) -> None:
        if self.kind == "floor":
            self.tree.insert(s, kv, self.donor)
        else:
            self.tree.insert(s, kv, state_slot=self.donor)

    def match(self, s: np.ndarray) -> int:
        if self.kind == "floor":
            return int(self.tree.match(s)[0])
        return int(self.tree.match(s).cached_length)

    def nodes(self) -> int:
        return int(self.tree.nodes - 1) if self.kind == "floor" else int(self.tree.num_nodes)

    def evict(self, kv: int = 0, snaps: int = 0) -> int:
        if self.kind == "floor":
            return int(self.tree.evict_kv(kv) if kv else self.tree.evict_snapshots(snaps))
        r = self.tree.evict(kv_tokens=kv, snapshots=snaps)
        return int(r.kv_tokens if kv else r.snapshots)


def one_round(seqs: list[np.ndarray], queries: list[np.ndarray], flip: bool) -> dict[str, dict[str, float]]:
    kinds = ["floor", "ours"] if not flip else ["ours", "floor"]
    sides = {k: _Side(k, seqs) for k in kinds}
    out: dict[str, dict[str, float]] = {k: {} for k in kinds}
    checks: dict[str, list[int]] = {k: [] for k in kinds}

    def inserts(sd: _Side) -> list[float]:
        out, clock = [], time.perf_counter
        for q, kv in zip(seqs, sd.kvs, strict=True):
            t0 = clock()
            sd.insert(q, kv)
            out.append((clock() - t0) * 1e6)
        return out

    def matches(qs: list[np.ndarray]) -> Callable[[_Side], list[float]]:
        def run(sd: _Side) -> list[float]:
            out, clock = [], time.perf_counter
            for q in qs:
                t0 = clock()
                sd.match(q)
                out.append((clock() - t0) * 1e6)
            return out

        return run

    phases = [
        ("insert_us", inserts),
        ("match_full_us", matches(seqs)),
        ("match_prefix_new_suffix_us", matches(queries)),
    ]
    for name, phase in phases:
        for k in kinds:
            gc.collect()
            gc.disable()
            out[k][name] = statistics.median(phase(sides[k]))
            gc.enable()
        kinds.reverse()
    for k in kinds:
        checks[k].append(sides[k].nodes())
    for name, amount in (("evict_256_snapshots_ms", {"snaps": 256}), ("evict_200k_kv_ms", {"kv": 200_000})):
        for k in kinds:
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            got = sides[k].evict(**amount)
            out[k][name] = (time.perf_counter() - t0) * 1e3
            gc.enable()
            checks[k].append(got >= next(iter(amount.values())))
            checks[k].append(sides[k].nodes())
        kinds.reverse()
    if checks["floor"] != checks["ours"]:
        raise SystemExit(f"the two trees did different work: floor {checks['floor']} ours {checks['ours']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke size for CI: 1 round")
    args = ap.parse_args()
    torch.set_num_threads(1)
    seqs = build_workload(np.random.default_rng(args.seed), groups=32, per_group=32, prefix=1024, suffix=256)
    rng = np.random.default_rng(args.seed + 1)
    queries = [np.concatenate([s[:1024], rng.integers(150_000, 151_000, 256, dtype=np.int32)]) for s in seqs]
    rounds = [one_round(seqs, queries, flip=bool(r % 2)) for r in range(1 if args.quick else args.rounds)]
    result: dict[str, Any] = {"bench": "floor_w1", "rounds": len(rounds), "sequences": len(seqs)}
    for op in rounds[0]["ours"]:
        ours = [r["ours"][op] for r in rounds]
        floor = [r["floor"][op] for r in rounds]
        ratios = [o / f for o, f in zip(ours, floor, strict=True)]
        result[op] = {
            "ours": round(statistics.median(ours), 3),
            "floor": round(statistics.median(floor), 3),
            "ours_over_floor": round(statistics.median(ratios), 2),
            "ours_over_floor_min": round(min(ratios), 2),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
