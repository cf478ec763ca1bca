"""Replay a trace through the real CacheManager (with one snapshot placement and eviction policy
inside) and HybridRadixCache under a memory budget, and count what the cache saved. The replay is
a host like any other: it uses the manager's public protocol alone, so what it measures is what a
host gets.

No model runs: states are never computed, only placed, kept and evicted. Bytes are accounted with
a model preset: KV bytes per token and snapshot bytes from its :class:`StateLayout`. A FLOP model
of the preset counts the prefill FLOPs each hit saves (dense FLOPs per token plus attention FLOPs
growing with position).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from linear_state import LinearStatePool, StateLayout

from ..core.policy import Policy
from ..core.tree import HybridRadixCache
from ..manager.cache_manager import Admission, CacheManager
from ..tiers.shared import SharedTier
from ..tiers.store import MemoryStore
from .traces import TraceRecord

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


def _host_hits(mgr: CacheManager) -> int:
    """Hits the manager restored from its tree's host tier so far."""
    return mgr.metrics().host_hits


class _ReplayKV:
    """The replay's KV codec: no bytes travel (no model runs); an import takes fresh KV indices."""

    identity = "replay"

    def __init__(self) -> None:
        self.next_kv = 0

    def export_kv(self, kv_indices: torch.Tensor, after: object) -> bytes:
        return b""

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor:
        out = torch.arange(self.next_kv, self.next_kv + num_tokens)
        self.next_kv += num_tokens
        return out


_TINY = StateLayout(1, (1, 1), (1,))  # the replay never computes a state: slots are tokens of ownership
_WINDOW_CAPTURES = 16  # track slots per request: more than any policy asks for in one window


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
    # kind -> (requests with any hit, requests): a tenant's requests, not only its tokens
    per_session_kind_requests: dict[str, tuple[int, int]] = field(default_factory=dict)
    computed_p50: float = 0.0  # prefill tokens computed per request (prompt - hit), median
    computed_p99: float = 0.0  # the same, 99th percentile
    metrics: dict[str, object] = field(default_factory=dict)  # the manager's counters at the end
    host_budget_bytes: int = 0  # the host tier (0: none)
    host_hits: int = 0  # hits restored from the host tier
    host_hit_tokens: int = 0  # prompt tokens those hits served
    host_restore_s: float = 0.0  # their restores at the modelled host bandwidth
    host_prefill_s_saved: float = 0.0  # the prefill those hits avoided, at the modelled FLOP rate
    shared_hits: int = 0  # hits fetched from the shared store (its state and the prefix's KV)
    shared_hit_tokens: int = 0  # prompt tokens those hits served
    shared_restore_s: float = 0.0  # their fetches (snapshot + KV bytes) at the modelled store bandwidth
    shared_prefill_s_saved: float = 0.0  # the prefill those hits avoided, at the modelled FLOP rate

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
    progress: Callable[[int], None] | None = None,
    on_step: Callable[[int, int], None] | None = None,
    host_budget_bytes: float = 0,
    host_gbps: float = 25.0,
    prefill_tflops: float = 400.0,
    shared_gbps: float = 0.0,
) -> ReplayResult:
    """Replay ``trace`` (in timestamp order, one request at a time) through a
    :class:`~radixcache.CacheManager` with ``policy`` inside, under ``budget_bytes`` of cache
    (tree KV plus snapshots), using the manager's public host protocol only: admit, one plan and
    commit per prefill chunk, one decode window for the answer, finish, and
    :meth:`~radixcache.CacheManager.evict` whenever the bytes held pass the budget.

    :param on_step: called after every window and every finish, once the budget was enforced, with
        the request's index and the bytes the tree holds (KV plus snapshots).
    :param host_budget_bytes: a host tier of this many bytes of snapshots (docs/host_tier.md): an
        evicted snapshot is demoted there and still serves hits; 0: none. The device budget counts
        the device's KV and snapshots only.
    :param host_gbps: the host link, GB/s, that a restore from the host tier is modelled at.
    :param prefill_tflops: the prefill rate, TFLOP/s, that the prefill a host or shared hit
        avoids is modelled at (``preset.prefill_flops``).
    :param shared_gbps: a shared tier (docs/host_tier.md) whose store keeps every snapshot ever
        published, fetched at this many GB/s (the snapshot and the KV of its prefix); 0: none. With
        one replica replayed, that is the bound a fleet's store gives it: every prefix this trace
        computed before stays fetchable after the tree dropped it.
    :raises ValueError: a budget smaller than one snapshot, a negative host budget, a bandwidth or
        rate that is not positive, a ``chunk`` below 1. :raises TypeError: a budget that is not a
        number (a float is rounded down to whole bytes), a policy that is not a ``Policy``.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy (make_policy(name)), got {type(policy).__name__}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1 (tokens per prefill window), got {chunk!r}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)):
        raise TypeError(f"budget_bytes must be a number of bytes, got {budget_bytes!r}")
    budget = int(budget_bytes)
    if budget < preset.snapshot_bytes:
        raise ValueError(f"budget {budget} bytes is below one snapshot ({preset.snapshot_bytes} bytes)")
    if host_budget_bytes < 0 or host_gbps <= 0 or prefill_tflops <= 0 or not shared_gbps >= 0:
        raise ValueError(
            f"host_budget_bytes and shared_gbps must be >= 0 and host_gbps, prefill_tflops > 0; got "
            f"{host_budget_bytes}, {shared_gbps}, {host_gbps}, {prefill_tflops}"
        )
    max_snaps = budget // preset.snapshot_bytes
    host_slots = int(host_budget_bytes) // preset.snapshot_bytes
    # Room for the budget's snapshots plus one request's slots and one window's clones: the byte
    # budget, enforced below through the policy, is what binds, never the pool.
    pool = LinearStatePool(_TINY, max_snaps + 2 * (1 + _WINDOW_CAPTURES))
    host = LinearStatePool(_TINY, host_slots) if host_slots else None
    cache = HybridRadixCache(pool, page_size=1, host_pool=host)
    kvb, sb = preset.kv_bytes_per_token, preset.snapshot_bytes
    policy.costs(sb, kvb)
    policy.flops(preset.prefill_flops)
    codec = _ReplayKV()
    shared = SharedTier(MemoryStore(), model=preset.name, kv=codec) if shared_gbps else None
    # NOTE: the replay runs no forward, so no slot is ever written: the write checks (which would
    # find every snapshot unwritten) are off; what it measures is the policy's hit tokens.
    mgr = CacheManager(
        cache, policy, track_slots=_WINDOW_CAPTURES, shared=shared, host_tier=None, write_checks=False, forensics=None
    )
    res = ReplayResult(policy.name, preset.name, budget, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0.0, 0, 0.0)
    res.host_budget_bytes = host_slots * preset.snapshot_bytes
    computed: list[int] = []
    t0 = time.perf_counter()

    def held() -> int:
        return cache.total_kv_tokens * kvb + cache.num_snapshots * sb

    def enforce(now: float, i: int) -> None:
        while held() > budget:
            before = cache.num_nodes
            t = time.perf_counter()
            out = mgr.evict(snapshots=1, now=now)
            if not out.snapshots and host is not None:
                # every device snapshot was demoted: what is left over the budget is KV
                out = mgr.evict(kv_tokens=max(1, (held() - budget) // kvb), now=now)
            res.eviction_seconds += time.perf_counter() - t
            res.evicted_nodes += max(1, before - cache.num_nodes)
            if not out.snapshots and not out.kv_tokens:
                break
        if on_step is not None:
            on_step(i, held())

    for i, rec in enumerate(sorted(trace, key=lambda r: r.ts)):
        ids = rec.input_tokens
        n = len(ids)
        host_hits = _host_hits(mgr) if host is not None else 0
        shared_hits = shared.stats.hits if shared is not None else 0
        adm = mgr.admit(i, ids, session=rec.session_id, now=rec.ts)
        if not isinstance(adm, Admission):  # cannot happen with the pool sized above
            raise RuntimeError(f"request {i} refused: {adm.reason}")
        if host is not None and _host_hits(mgr) > host_hits:
            res.host_hits += 1
            res.host_hit_tokens += adm.cached_length
            res.host_restore_s += sb / (host_gbps * 1e9)
            res.host_prefill_s_saved += preset.prefill_flops(adm.cached_length) / (prefill_tflops * 1e12)
        if shared is not None and shared.stats.hits > shared_hits:
            res.shared_hits += 1
            res.shared_hit_tokens += adm.cached_length
            res.shared_restore_s += (sb + adm.cached_length * kvb) / (shared_gbps * 1e9)
            res.shared_prefill_s_saved += preset.prefill_flops(adm.cached_length) / (prefill_tflops * 1e12)
            enforce(rec.ts, i)  # the fetched prefix's KV now sits in the device budget
        for start in range(adm.cached_length, n, chunk):
            end = min(n, start + chunk)
            plan = mgr.plan_prefill(i, end)
            mgr.commit(plan, None, kv_indices=codec.import_kv(b"", end - start), now=rec.ts)
            enforce(rec.ts, i)
        out = rec.output_tokens
        if len(out) > 1:  # the last answer token is sampled, never fed
            plan = mgr.plan_decode(i, out[:-1])
            mgr.commit(plan, None, kv_indices=codec.import_kv(b"", len(out) - 1), now=rec.ts)
            enforce(rec.ts, i)
        mgr.finish(i, None, now=rec.ts)
        enforce(rec.ts, i)
        res.requests += 1
        res.prompt_tokens += n
        res.hit_tokens += adm.cached_length
        res.requests_with_hit += adm.cached_length > 0
        res.flops_total += preset.prefill_flops(n)
        res.flops_saved += preset.prefill_flops(adm.cached_length)
        kind = rec.session_id.split("-")[0]
        h, p = res.per_session_kind.get(kind, (0, 0))
        res.per_session_kind[kind] = (h + adm.cached_length, p + n)
        w, q = res.per_session_kind_requests.get(kind, (0, 0))
        res.per_session_kind_requests[kind] = (w + (adm.cached_length > 0), q + 1)
        computed.append(n - adm.cached_length)
        res.max_nodes = max(res.max_nodes, cache.num_nodes)
        if progress is not None:
            progress(i)
    res.wall_s = time.perf_counter() - t0
    if computed:
        res.computed_p50, res.computed_p99 = (float(x) for x in np.percentile(computed, [50, 99]))
    m = mgr.metrics()
    res.snapshots_donated = sum(m.donations.values())
    res.metrics = m.as_dict()
    mgr.check_invariants()
    return res
