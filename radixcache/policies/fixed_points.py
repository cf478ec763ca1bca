"""``fixed-points``: the manager's original placement rules as a policy, LRU eviction.

Per window, within the track budget, most valuable first: the branch point (where the request's
ids left the tree at admission), the start of each image span, the re-send point (the prompt's
last id: an identical prompt matches all but it), then multiples of ``align`` below the prompt
length, deepest first; the final state at finish.
"""

from __future__ import annotations

from ..core.policy import Policy, RequestInfo

__all__ = ["FixedPoints"]


class FixedPoints(Policy):
    """:param align: the aligned capture grid (64 for chunked delta-rule kernels).

    :raises ValueError: ``align`` not positive.
    """

    name = "fixed-points"
    decode_captures = False

    def __init__(self, align: int = 64) -> None:
        if align <= 0:
            raise ValueError(f"align must be positive, got {align}")
        self.align = align

    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        if decode:
            return []
        cands = [req.token_length, *req.image_starts, req.prompt_len - 1]
        first = (start // self.align + 1) * self.align
        last = min(end, req.prompt_len - 1) // self.align * self.align
        cands += range(last, first - 1, -self.align)
        return [d for d in dict.fromkeys(cands) if start < d <= end]

    def donate_finish(self, req: RequestInfo) -> bool:
        return True
