"""The front door: :class:`CacheManager`, the one client of the tree a host scheduler calls, and
its metrics. It sits above core (keys, tree, events, policy interface) and the tiers, and drives
them; hosts (engines, the reference engine, the SGLang backend) drive it."""

from .cache_manager import (
    Admission,
    AdmissionCheck,
    CacheManager,
    Capture,
    DecodeBatchPlan,
    DecodeBatchResult,
    FinishResult,
    Refusal,
    RefusalCause,
    UnwrittenSlotWarning,
    WindowPlan,
    WindowResult,
)
from .metrics import EvictionReason, ManagerMetrics, MetricsCounters, SkipReason, register_prometheus

__all__ = [
    "Admission",
    "AdmissionCheck",
    "CacheManager",
    "Capture",
    "DecodeBatchPlan",
    "DecodeBatchResult",
    "EvictionReason",
    "FinishResult",
    "ManagerMetrics",
    "MetricsCounters",
    "Refusal",
    "RefusalCause",
    "SkipReason",
    "UnwrittenSlotWarning",
    "WindowPlan",
    "WindowResult",
    "register_prometheus",
]
