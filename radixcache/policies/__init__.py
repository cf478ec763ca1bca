"""Snapshot placement and eviction policies, each behind :class:`Policy`; see docs/policies.md."""

from .align_last_block import AlignLastBlock
from .base import Policy, RequestInfo
from .branch_flop import BranchFlop
from .ours import Ours
from .track_and_finish import TrackAndFinish

__all__ = ["POLICIES", "AlignLastBlock", "BranchFlop", "Ours", "Policy", "RequestInfo", "TrackAndFinish", "make_policy"]

POLICIES = {
    "align-last-block": AlignLastBlock,
    "track-and-finish": TrackAndFinish,
    "branch-flop": BranchFlop,
    "ours": Ours,
}


def make_policy(name: str) -> Policy:
    """A fresh policy by name. :raises ValueError: unknown name."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()
