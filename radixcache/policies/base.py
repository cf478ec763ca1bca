"""The interface every snapshot placement and eviction policy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..tree import HybridRadixCache, TreeNode

__all__ = ["Policy", "RequestInfo"]


@dataclass(frozen=True)
class RequestInfo:
    """What a policy may know about a request when it places captures.

    :ivar prompt_len: prompt tokens; :ivar hit: tokens served from cache at admission;
    :ivar branch: depth to which the prompt agreed with the tree (where it leaves the tree);
    :ivar session: the session id; :ivar ts: arrival time in seconds.
    """

    prompt_len: int
    hit: int
    branch: int
    session: str
    ts: float


class Policy(ABC):
    """Where to capture snapshots and which to evict. One instance per replay.

    ``captures`` is asked once per scheduled prefill step over ``[start, end)`` and once for the
    decode phase; ``donated`` tells the policy what the tree now holds and why; ``evict_one``
    frees at least one snapshot or returns False.
    """

    name: str = "policy"

    @abstractmethod
    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        """Depths in ``(start, end]`` to capture and donate (ascending)."""

    def donate_finish(self, req: RequestInfo) -> bool:
        """Whether to donate the final state (prompt + output) at finish."""
        return False

    def donated(self, node: TreeNode, req: RequestInfo, reason: str, now: float) -> None:  # noqa: B027
        """``node`` now holds a snapshot; ``reason`` is "capture" or "finish"."""

    def touched(self, node: TreeNode, req: RequestInfo, now: float) -> None:  # noqa: B027
        """``node`` served a hit for ``req``."""

    def evict_one(self, cache: HybridRadixCache, now: float) -> bool:
        """Free at least one snapshot (default: the least recently used). False: nothing evictable."""
        return cache.evict(snapshots=1).snapshots > 0
