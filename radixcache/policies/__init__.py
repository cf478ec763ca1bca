"""Snapshot placement and eviction policies, each behind :class:`Policy`; see docs/policies.md.

:class:`HitDensity` is the default of :class:`~radixcache.CacheManager`: it measured best on every
trace shape (docs/policies.md). The others are baselines, selectable by name.
"""

from ..core.policy import DonationReason, Policy, RequestInfo, TreeView, set_default_policy
from .align_last_block import AlignLastBlock
from .fixed_points import FixedPoints
from .flop_efficiency import ALPHA_GRID, FlopEfficiency
from .hit_density import HitDensity
from .sglang_like import SglangLike
from .track_and_finish import TrackAndFinish
from .vllm_like import VllmLike

__all__ = [
    "ALPHA_GRID",
    "DEFAULT_POLICY",
    "POLICIES",
    "AlignLastBlock",
    "DonationReason",
    "FixedPoints",
    "FlopEfficiency",
    "HitDensity",
    "Policy",
    "RequestInfo",
    "SglangLike",
    "TrackAndFinish",
    "TreeView",
    "VllmLike",
    "make_policy",
]

POLICIES: dict[str, type[Policy]] = {
    "hit-density": HitDensity,
    "align-last-block": AlignLastBlock,
    "track-and-finish": TrackAndFinish,
    "flop-efficiency": FlopEfficiency,
    "fixed-points": FixedPoints,
    "sglang-like": SglangLike,
    "vllm-like": VllmLike,
}
DEFAULT_POLICY = "hit-density"
set_default_policy(POLICIES[DEFAULT_POLICY])  # what CacheManager builds when given no policy


def make_policy(name: str) -> Policy:
    """A fresh policy by name (see :data:`POLICIES`). :raises ValueError: unknown name."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()
