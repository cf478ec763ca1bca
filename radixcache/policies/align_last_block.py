"""``align-last-block``: a snapshot only at the last block boundary reached in each scheduled step,
LRU eviction (vLLM's mamba "align" mode)."""

from __future__ import annotations

from ..core.policy import Policy, RequestInfo

__all__ = ["AlignLastBlock"]


class AlignLastBlock(Policy):
    """:param block: the block size whose boundaries hold snapshots."""

    name = "align-last-block"

    def __init__(self, block: int = 512) -> None:
        self.block = block

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        if decode:  # each decode step is a scheduled step: every boundary it crosses
            return list(range((start // self.block + 1) * self.block, end + 1, self.block))
        last = end // self.block * self.block
        return [last] if last > start else []
