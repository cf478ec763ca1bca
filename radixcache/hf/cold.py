"""The ground truth of a transformers host: a prompt generated greedily from an empty cache, every
step's logits kept, to compare a served generation with step by step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .bridge import HFStateBridge
from .sequence import forward_logits

__all__ = ["ColdGeneration", "cold_generation_hf", "generate_cold_hf"]


class ColdGeneration(NamedTuple):
    """A whole greedy generation from an empty cache (:func:`cold_generation_hf`).

    :ivar tokens: the ``n`` greedy tokens.
    :ivar logits: the logits each token was chosen from (``logits[k]`` before ``tokens[k]``), float32,
        one ``[vocab]`` tensor per step: compare a served generation step by step against them.
    """

    tokens: list[int]
    logits: list[torch.Tensor]


def cold_generation_hf(model: Any, bridge: HFStateBridge, prompt: Sequence[int], n: int) -> ColdGeneration:
    """The ground truth of a transformers host: ``prompt`` in one forward from an empty cache,
    then ``n - 1`` single-token steps of transformers' own cache, greedy. Every step's logits
    come back, so an integrator's test compares whole generations, not only the first token.

    :raises ValueError: an empty prompt, or ``n`` below 1. O(prompt + n) forwards' work.
    """
    if not prompt:
        raise ValueError("cold_generation_hf needs a non-empty prompt")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    cache = bridge.new_cache()
    logits = forward_logits(model, cache, prompt)
    tokens: list[int] = []
    steps: list[torch.Tensor] = []
    while True:
        steps.append(logits.clone())
        tokens.append(int(torch.argmax(logits)))
        if len(tokens) == n:
            return ColdGeneration(tokens, steps)
        logits = forward_logits(model, cache, [tokens[-1]])


def generate_cold_hf(model: Any, bridge: HFStateBridge, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy ``n`` tokens of ``prompt`` from an empty cache, one forward for the prompt: the
    ground truth. Returns the tokens and the first token's logits (:func:`cold_generation_hf`
    returns every step's)."""
    gen = cold_generation_hf(model, bridge, prompt, n)
    return gen.tokens, gen.logits[0]
