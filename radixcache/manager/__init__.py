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
    UnwrittenSlotWarning,
    WindowPlan,
    WindowResult,
)
from .metrics import ManagerMetrics, MetricsCounters, register_prometheus

__all__ = [
    "Admission",
    "AdmissionCheck",
    "CacheManager",
    "Capture",
    "DecodeBatchPlan",
    "DecodeBatchResult",
    "FinishResult",
    "ManagerMetrics",
    "MetricsCounters",
    "Refusal",
    "UnwrittenSlotWarning",
    "WindowPlan",
    "WindowResult",
    "register_prometheus",
]
