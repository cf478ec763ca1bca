"""radixcache: a radix prefix cache for hybrid LLMs (attention + linear-attention layers).

The tree's nodes own private clones of linear-state snapshots from a
:class:`linear_state.LinearStatePool`; donation and restore are ordered by fences; a host
scheduler plugs in through :class:`CacheManager`.
"""

from .forensics import Forensics, Ledger, SnapshotCorruption, read_ledger
from .keys import IMAGE_ID_BASE, MAX_ID, KeyLike, key_bytes
from .manager import Admission, CacheManager, CommitResult, FinishResult, Refusal
from .multimodal import MMWindow, image_cache_ids, image_runs, mm_window
from .tree import EvictResult, HybridRadixCache, InsertResult, MatchResult, TreeNode

__all__ = [
    "IMAGE_ID_BASE",
    "MAX_ID",
    "Admission",
    "CacheManager",
    "CommitResult",
    "EvictResult",
    "FinishResult",
    "Forensics",
    "Ledger",
    "SnapshotCorruption",
    "read_ledger",
    "HybridRadixCache",
    "InsertResult",
    "KeyLike",
    "MMWindow",
    "MatchResult",
    "Refusal",
    "TreeNode",
    "image_cache_ids",
    "image_runs",
    "key_bytes",
    "mm_window",
]
