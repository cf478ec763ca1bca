"""``vllm-like``: what vLLM's prefix caching keeps for hybrid models. Linear state only on the block
grid: the state at every block boundary a request crosses, in prefill and decode, and no other
(a final state off the grid is dropped); eviction least recently used.

vLLM enlarges the attention block of hybrid models until one block of a layer's KV is at least one
layer's state (it logs 528 tokens for Qwen3.5-4B), so the grid is hundreds of tokens wide; the
default here is 512."""

from __future__ import annotations

from ..core.policy import Policy, RequestInfo

__all__ = ["VllmLike"]


class VllmLike(Policy):
    """:param block: tokens per block: states are kept at its multiples only.

    :raises ValueError: ``block`` not positive."""

    name = "vllm-like"

    def __init__(self, block: int = 512) -> None:
        if block <= 0:
            raise ValueError(f"block must be positive, got {block}")
        self.block = block

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        b = self.block
        return list(range((start // b + 1) * b, end + 1, b))
