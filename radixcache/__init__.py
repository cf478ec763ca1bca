"""radixcache: a radix prefix cache for hybrid LLMs (attention + linear-attention layers).

The tree's nodes own private clones of linear-state snapshots from a
:class:`linear_state.LinearStatePool`; donation and restore are ordered by fences; a host
scheduler plugs in through :class:`CacheManager`, whose policy places captures and picks victims.

Subpackages: ``core`` (keys, tree, manager, multimodal ids), ``forensics`` (ledger, recorder,
report), ``policies``, ``simulator`` (traces, replay, report) and ``testing`` (reference engine,
hammer, fuzzing kit).
"""

from .core import (
    IMAGE_ID_BASE,
    MAX_ID,
    Admission,
    AdmissionCheck,
    CacheManager,
    Capture,
    ConcurrentUseError,
    DecodeBatchPlan,
    DecodeBatchResult,
    EvictResult,
    FinishResult,
    HybridRadixCache,
    InsertResult,
    KeyLike,
    ManagerMetrics,
    MatchResult,
    MMWindow,
    ProtocolError,
    RadixCacheError,
    Refusal,
    TreeNode,
    UnknownRequest,
    WindowPlan,
    WindowResult,
    image_cache_ids,
    image_runs,
    key_bytes,
    mm_window,
    register_prometheus,
)
from .forensics import Forensics, Ledger, SnapshotCorruption, read_ledger
from .policies import POLICIES, HitDensity, Policy, make_policy

__all__ = [
    "IMAGE_ID_BASE",
    "MAX_ID",
    "POLICIES",
    "Admission",
    "AdmissionCheck",
    "CacheManager",
    "Capture",
    "DecodeBatchPlan",
    "DecodeBatchResult",
    "ConcurrentUseError",
    "EvictResult",
    "FinishResult",
    "Forensics",
    "HitDensity",
    "HybridRadixCache",
    "InsertResult",
    "KeyLike",
    "Ledger",
    "MMWindow",
    "ManagerMetrics",
    "MatchResult",
    "Policy",
    "ProtocolError",
    "RadixCacheError",
    "Refusal",
    "SnapshotCorruption",
    "TreeNode",
    "UnknownRequest",
    "WindowPlan",
    "WindowResult",
    "image_cache_ids",
    "image_runs",
    "key_bytes",
    "make_policy",
    "mm_window",
    "read_ledger",
    "register_prometheus",
]
