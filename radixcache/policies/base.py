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
    :ivar session: the session id; :ivar ts: arrival time in seconds;
    :ivar prompt_digest: a hash of the prompt's token ids (equal digests: identical prompts; 0 when
        the host does not compute one).
    """

    prompt_len: int
    hit: int
    branch: int
    session: str
    ts: float
    prompt_digest: int = 0


class Policy(ABC):
    """Where to capture snapshots and which to evict. One instance per replay.

    ``admitted`` is told of each request first; ``captures`` is asked once per scheduled prefill
    step over ``[start, end)`` and once for the decode phase; ``donated`` tells the policy what
    the tree now holds and why; ``evict_one`` frees at least one snapshot or returns False.
    """

    name: str = "policy"
    snapshot_bytes: int = 2048
    kv_bytes_per_token: int = 1

    def costs(self, snapshot_bytes: int, kv_bytes_per_token: int) -> None:
        """The model's bytes per snapshot and per KV token, before the first request. Policies that
        weigh bytes use them; until told, a snapshot counts as 2,048 tokens of KV.

        :raises ValueError: a non-positive size.
        """
        if snapshot_bytes <= 0 or kv_bytes_per_token <= 0:
            raise ValueError(f"costs must be positive, got snapshot {snapshot_bytes}, kv/token {kv_bytes_per_token}")
        self.snapshot_bytes, self.kv_bytes_per_token = snapshot_bytes, kv_bytes_per_token

    def admitted(self, req: RequestInfo) -> None:  # noqa: B027
        """``req`` was admitted (called once per request, before its captures)."""

    def check_invariants(self) -> None:  # noqa: B027
        """Raise AssertionError if the policy's own bookkeeping is inconsistent (default: none kept)."""

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
