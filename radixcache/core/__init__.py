"""The core: cache keys, the radix tree, the manager a host scheduler calls, multimodal ids."""

from .errors import (
    ConcurrentUseError,
    ForeignObjectError,
    LockError,
    ProtocolError,
    RadixCacheError,
    UnknownRequest,
)
from .keys import IMAGE_ID_BASE, MAX_ID, KeyLike, key_bytes
from .lazy_heap import LazyHeap
from .manager import (
    Admission,
    AdmissionCheck,
    CacheManager,
    Capture,
    DecodeBatchPlan,
    DecodeBatchResult,
    FinishResult,
    Refusal,
    WindowPlan,
    WindowResult,
)
from .metrics import ManagerMetrics, register_prometheus
from .multimodal import MMWindow, image_cache_ids, image_runs, mm_window
from .tree import EvictResult, HybridRadixCache, InsertResult, MatchResult, TreeNode

__all__ = [
    "IMAGE_ID_BASE",
    "MAX_ID",
    "Admission",
    "AdmissionCheck",
    "CacheManager",
    "Capture",
    "DecodeBatchPlan",
    "DecodeBatchResult",
    "ConcurrentUseError",
    "EvictResult",
    "FinishResult",
    "ForeignObjectError",
    "HybridRadixCache",
    "InsertResult",
    "KeyLike",
    "LockError",
    "LazyHeap",
    "MMWindow",
    "ManagerMetrics",
    "MatchResult",
    "ProtocolError",
    "RadixCacheError",
    "Refusal",
    "TreeNode",
    "UnknownRequest",
    "WindowPlan",
    "WindowResult",
    "image_cache_ids",
    "image_runs",
    "key_bytes",
    "mm_window",
    "register_prometheus",
]
