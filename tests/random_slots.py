"""Slots of random bytes (any bit pattern: NaNs and infinities included) in a layout's tensors,
for the fingerprint path equivalence tests (imported by the Triton test's child processes too)."""

from __future__ import annotations

import torch

from linear_state import StateLayout


def random_pool(layout: StateLayout, slots: int, seed: int) -> list[torch.Tensor]:
    """The conv and recurrent tensors ``[layers, slots, ...]`` of ``layout``, every byte random (seeded)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in ((layout.conv_shape, layout.conv_dtype), (layout.recurrent_shape, layout.recurrent_dtype)):
        t = torch.empty(layout.num_layers, slots, *shape, dtype=dtype)
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        out.append(t)
    return out
