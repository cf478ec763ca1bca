"""radixcache: a radix prefix cache for hybrid LLMs (attention + linear-attention layers).

The tree's nodes own private clones of linear-state snapshots from a
:class:`linear_state.LinearStatePool`; donation and restore are ordered by fences.
"""

from .keys import IMAGE_ID_BASE, MAX_ID, KeyLike, key_bytes
from .tree import EvictResult, HybridRadixCache, InsertResult, MatchResult, TreeNode

__all__ = [
    "IMAGE_ID_BASE",
    "MAX_ID",
    "EvictResult",
    "HybridRadixCache",
    "InsertResult",
    "KeyLike",
    "MatchResult",
    "TreeNode",
    "key_bytes",
]
