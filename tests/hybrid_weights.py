"""Random weights for the tiny hybrid models the engine tests build: wide enough that a greedy answer
depends on the whole prompt, with a long linear-attention memory. Used by the SGLang tests' model;
tests/vllm/harness.py still draws its Qwen3-Next the same way inline (the vLLM suite's exact
figures were not re-verified with this helper on a machine where that suite passes)."""

from __future__ import annotations

from typing import Any

import torch


def widen_and_remember(model: Any, seed: int) -> None:
    """Redraw ``model``'s matrices from N(0, 0.05) (torch's global generator, which the caller
    seeds) and each Gated DeltaNet layer's ``A`` in (0.002, 0.02) (from ``seed``), in place.

    transformers draws ``A`` in (0, 16), and a GDN layer with decay ``exp(-A * dt)`` forgets its
    state within a few tokens, so a state restored wrong (even zeros) would barely change an
    answer. With ``A`` in (0.002, 0.02) a state carries over a few hundred tokens: a wrong one
    changes answers decisively."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)  # torch's global generator: the caller seeds it
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.002, 0.02, generator=gen).log())
