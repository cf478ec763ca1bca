"""``track-and-finish``: the prompt's deepest 64-aligned boundary plus the finish state, LRU (the
engine in shared/reference/004; SGLang's own placement is ``sglang-like``)."""

from __future__ import annotations

from ..core.policy import Policy, RequestInfo

__all__ = ["TrackAndFinish"]


class TrackAndFinish(Policy):
    name = "track-and-finish"
    decode_captures = False

    def __init__(self, align: int = 64) -> None:
        self.align = align

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        if decode:
            return []
        d = req.prompt_len // self.align * self.align
        return [d] if start < d <= end else []

    def donate_finish(self, req: RequestInfo) -> bool:
        return True
