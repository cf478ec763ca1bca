"""The core: cache keys, the radix tree, the manager a host scheduler calls, multimodal ids."""

from .errors import (
    ConcurrentUseError,
    ForeignObjectError,
    LockError,
    ProtocolError,
    RadixCacheError,
    UnknownRequest,
)
from .events import TreeEvent, TreeEventKind, TreeListener, free_kv_to
from .keys import IMAGE_ID_BASE, MAX_ID, KeyLike, key_bytes
from .kv import KVAllocator, KVExhausted, KVFreeList
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
    UnwrittenSlotWarning,
    WindowPlan,
    WindowResult,
)
from .metrics import ManagerMetrics, register_prometheus
from .multimodal import MMWindow, image_cache_ids, image_runs, mm_window
from .shared import KVCodec, MemoryStore, RedisStore, SharedStore, SharedStoreError, SharedTier
from .tree import HOST_TIER_FACTOR, EvictResult, HybridRadixCache, InsertResult, MatchResult, TreeNode, auto_host_pool

__all__ = [
    "HOST_TIER_FACTOR",
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
    "KVAllocator",
    "KVCodec",
    "KVExhausted",
    "KVFreeList",
    "KeyLike",
    "LockError",
    "LazyHeap",
    "MMWindow",
    "ManagerMetrics",
    "MatchResult",
    "MemoryStore",
    "ProtocolError",
    "RadixCacheError",
    "RedisStore",
    "Refusal",
    "SharedStore",
    "SharedStoreError",
    "SharedTier",
    "TreeEvent",
    "TreeEventKind",
    "TreeListener",
    "TreeNode",
    "UnknownRequest",
    "UnwrittenSlotWarning",
    "WindowPlan",
    "WindowResult",
    "auto_host_pool",
    "free_kv_to",
    "image_cache_ids",
    "image_runs",
    "key_bytes",
    "mm_window",
    "register_prometheus",
]
