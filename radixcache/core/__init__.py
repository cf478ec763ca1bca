"""The core: cache keys, the radix tree and its events, the KV allocator protocol, the policy
interface, multimodal ids. It imports only linear_state; the manager (radixcache.manager), the
policies and the tiers build on it."""

from .errors import (
    ConcurrentUseError,
    ForeignObjectError,
    LockError,
    ProtocolError,
    RadixCacheError,
    SnapshotRefused,
    UnknownRequest,
)
from .events import TreeEvent, TreeEventKind, TreeListener, free_kv_to
from .keys import IMAGE_ID_BASE, MAX_ID, CacheKey, KeyLike, key_bytes
from .kv import KVAllocator, KVExhausted, KVFreeList, KVPageList
from .lazy_heap import LazyHeap
from .multimodal import MMWindow, image_cache_ids, image_runs, mm_window
from .tree import EvictResult, HybridRadixCache, InsertResult, MatchResult, TreeNode

__all__ = [
    "IMAGE_ID_BASE",
    "MAX_ID",
    "CacheKey",
    "ConcurrentUseError",
    "EvictResult",
    "ForeignObjectError",
    "HybridRadixCache",
    "InsertResult",
    "KVAllocator",
    "KVExhausted",
    "KVFreeList",
    "KVPageList",
    "KeyLike",
    "LockError",
    "LazyHeap",
    "MMWindow",
    "MatchResult",
    "ProtocolError",
    "RadixCacheError",
    "SnapshotRefused",
    "TreeEvent",
    "TreeEventKind",
    "TreeListener",
    "TreeNode",
    "UnknownRequest",
    "free_kv_to",
    "image_cache_ids",
    "image_runs",
    "key_bytes",
    "mm_window",
]
