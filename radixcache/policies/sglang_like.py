"""``sglang-like``: what SGLang's Mamba radix cache keeps. The state at the end of every chunked-
prefill chunk (SGLang caches an unfinished request after each chunk) and the final state at finish
(prompt + answer), nothing during decode; eviction least recently used over snapshots."""

from __future__ import annotations

from ..core.policy import Policy, RequestInfo

__all__ = ["SglangLike"]


class SglangLike(Policy):
    """Captures at each prefill window's end (the host's chunk boundaries, the prompt's end
    included) and the final state; the tree's LRU evicts (:meth:`Policy.victim` returns ``None``)."""

    name = "sglang-like"
    decode_captures = False

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        return [] if decode else [end]

    def donate_finish(self, req: RequestInfo) -> bool:
        return True
