"""Replay a trace through the real CacheManager and HybridRadixCache under a memory budget, with
one snapshot placement and eviction policy, and count what the cache saved.

No model runs: states are never computed, only placed, kept and evicted. Bytes are accounted with
a model preset: KV bytes per token and snapshot bytes from its :class:`StateLayout`. A FLOP model
of the preset counts the prefill FLOPs each hit saves (dense FLOPs per token plus attention FLOPs
growing with position).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from linear_state import LinearStatePool, StateLayout

from .manager import Admission, CacheManager
from .policies import Policy, RequestInfo
from .traces import TraceRecord
from .tree import HybridRadixCache

__all__ = ["PRESETS", "ModelPreset", "ReplayResult", "replay"]


@dataclass(frozen=True)
class ModelPreset:
    """The costs of one model: bytes per KV token, bytes per snapshot, prefill FLOPs."""

    name: str
    layout: StateLayout
    kv_bytes_per_token: int
    dense_flops_per_token: float
    attn_flops_per_token_per_position: float

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one linear-state snapshot."""
        return self.layout.slot_bytes

    def prefill_flops(self, n: int) -> float:
        """FLOPs to prefill positions ``[0, n)``."""
        return self.dense_flops_per_token * n + self.attn_flops_per_token_per_position * n * (n - 1) / 2


PRESETS = {
    # 48 layers: 36 Gated DeltaNet, 12 attention (2 KV heads x 256); ~3B active parameters.
    "qwen3-next-80b": ModelPreset(
        "qwen3-next-80b",
        StateLayout.for_gdn(36, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128),
        kv_bytes_per_token=12 * 2 * 2 * 256 * 2,
        dense_flops_per_token=2 * 3e9,
        attn_flops_per_token_per_position=12 * 4 * 16 * 256,
    ),
    # 52 layers: 24 Mamba2 (128 heads x 64, state 128, 8 groups), 4 attention (8 KV heads x 128).
    "nemotron-h-8b": ModelPreset(
        "nemotron-h-8b",
        StateLayout.for_mamba2(24, num_heads=128, head_dim=64, state_size=128, n_groups=8),
        kv_bytes_per_token=4 * 2 * 8 * 128 * 2,
        dense_flops_per_token=2 * 8e9,
        attn_flops_per_token_per_position=4 * 4 * 32 * 128,
    ),
}

_TINY = StateLayout(1, (1, 1), (1,))  # the replay never computes a state: slots are tokens of ownership


@dataclass
class ReplayResult:
    """What one replay measured."""

    policy: str
    preset: str
    budget_bytes: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    flops_total: float
    flops_saved: float
    requests_with_hit: int
    snapshots_donated: int
    evicted_nodes: int
    eviction_seconds: float
    max_nodes: int
    wall_s: float
    per_session_kind: dict[str, tuple[int, int]] = field(default_factory=dict)  # kind -> (hit, prompt)

    @property
    def token_hit_rate(self) -> float:
        """Prompt tokens served from cache / all prompt tokens."""
        return self.hit_tokens / max(1, self.prompt_tokens)

    @property
    def flops_saved_fraction(self) -> float:
        """Prefill FLOPs saved / prefill FLOPs without a cache."""
        return self.flops_saved / max(1.0, self.flops_total)

    @property
    def eviction_us_per_node(self) -> float:
        """Mean eviction time per evicted node, microseconds."""
        return 1e6 * self.eviction_seconds / max(1, self.evicted_nodes)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready fields, derived rates included."""
        return {
            **{k: v for k, v in self.__dict__.items()},
            "token_hit_rate": self.token_hit_rate,
            "flops_saved_fraction": self.flops_saved_fraction,
            "eviction_us_per_node": self.eviction_us_per_node,
        }


def replay(
    trace: list[TraceRecord],
    policy: Policy,
    preset: ModelPreset,
    budget_bytes: float,
    *,
    chunk: int = 2048,
    max_captures: int = 16,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay ``trace`` (in timestamp order, one request at a time) with ``policy`` under
    ``budget_bytes`` of cache (tree KV plus snapshots).

    :raises ValueError: a budget smaller than one snapshot. :raises TypeError: a budget that is not a
        number (a float is rounded down to whole bytes).
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)):
        raise TypeError(f"budget_bytes must be a number of bytes, got {budget_bytes!r}")
    budget = int(budget_bytes)
    if budget < preset.snapshot_bytes:
        raise ValueError(f"budget {budget} bytes is below one snapshot ({preset.snapshot_bytes} bytes)")
    max_snaps = budget // preset.snapshot_bytes
    pool = LinearStatePool(_TINY, max_snaps + 2 + max_captures)
    cache = HybridRadixCache(pool, page_size=1)
    mgr = CacheManager(cache, track_align=64, track_slots=max_captures)
    kvb, sb = preset.kv_bytes_per_token, preset.snapshot_bytes
    policy.costs(sb, kvb)
    res = ReplayResult(policy.name, preset.name, budget, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0.0, 0, 0.0)
    next_kv = 0
    t0 = time.perf_counter()

    def over() -> bool:
        return cache.total_kv_tokens * kvb + cache.num_snapshots * sb > budget

    def enforce(now: float) -> None:
        while over():
            before = cache.num_nodes
            t = time.perf_counter()
            ok = policy.evict_one(cache, now)
            res.eviction_seconds += time.perf_counter() - t
            res.evicted_nodes += max(1, before - cache.num_nodes)
            if not ok:
                break

    for i, rec in enumerate(sorted(trace, key=lambda r: r.ts)):
        ids = rec.input_tokens
        n = len(ids)
        rid = i
        adm = mgr.admit(rid, ids)
        if not isinstance(adm, Admission):  # cannot happen with the pool sized above
            raise RuntimeError(f"request {i} refused: {adm.reason}")
        req = RequestInfo(n, adm.cached_length, adm.token_length, rec.session_id, rec.ts, hash(tuple(ids)))
        policy.admitted(req)
        if adm.cached_length:
            node = mgr._requests[rid].lock
            policy.touched(node, req, rec.ts)
        kv = torch.arange(next_kv, next_kv + n + len(rec.output_tokens))
        next_kv += len(kv)

        def commit_all(
            depths: list[int], rid: int = rid, kv: torch.Tensor = kv, req: RequestInfo = req, now: float = rec.ts
        ) -> None:
            for d, slot in zip(depths[:max_captures], mgr._requests[rid].tracks, strict=False):
                r = mgr.commit(rid, d, slot, None, kv_indices=kv[:d])
                if r.snapshot_created and r.node is not None:
                    res.snapshots_donated += 1
                    policy.donated(r.node, req, "capture", now)
            enforce(now)

        for start in range(adm.cached_length, n, chunk):
            commit_all(policy.captures(req, start, min(n, start + chunk), decode=False))
        out = rec.output_tokens
        if len(out) > 1:
            mgr.append(rid, out[:-1])
            fed = n + len(out) - 1
            commit_all(policy.captures(req, n, fed, decode=True))
        else:
            fed = n
        if policy.donate_finish(req):
            fin = mgr.finish(rid, None, kv_indices=kv[:fed])
            if fin.node is not None and fin.donated_depth:
                res.snapshots_donated += 1
                policy.donated(fin.node, req, "finish", rec.ts)
        else:
            mgr.finish(rid, None)
        enforce(rec.ts)
        res.requests += 1
        res.prompt_tokens += n
        res.hit_tokens += adm.cached_length
        res.requests_with_hit += adm.cached_length > 0
        res.flops_total += preset.prefill_flops(n)
        res.flops_saved += preset.prefill_flops(adm.cached_length)
        kind = rec.session_id.split("-")[0]
        h, p = res.per_session_kind.get(kind, (0, 0))
        res.per_session_kind[kind] = (h + adm.cached_length, p + n)
        res.max_nodes = max(res.max_nodes, cache.num_nodes)
        if progress is not None:
            progress(i)
    res.wall_s = time.perf_counter() - t0
    mgr.check_invariants()
    policy.check_invariants()
    return res
