"""A torch stand-in for SGLang's decode-tracking copy (``track_mamba_states_if_needed`` and
``track_mamba_states_all_layers`` in ``sglang.kernels.ops.mamba.mamba_state_scatter_triton``, Triton
kernels with no CPU path), for the extra buffer on the CPU. No side effects on import; never
imported by radixcache."""

from __future__ import annotations

import torch


def track_mamba_states(
    conv: torch.Tensor,
    ssm: torch.Tensor,
    cache_indices: torch.Tensor,
    mask: torch.Tensor,
    track_indices: torch.Tensor,
    batch_size: int,
    *,
    all_layers: bool,
    check_freed_slots: bool = False,
) -> None:
    """SGLang's decode-tracking copy: for each of the first ``batch_size`` rows whose ``mask`` is
    set, the conv and SSM state in slot ``cache_indices[row]`` is copied to slot
    ``track_indices[row]``; ``all_layers``: the pools are ``[layers, slots, ...]`` and every layer
    is copied, else ``[slots, ...]``. With ``check_freed_slots``, rows naming a slot ``-1`` are
    skipped."""
    rows = mask[:batch_size].nonzero(as_tuple=True)[0]
    src, dst = cache_indices[rows].long(), track_indices[rows].long()
    if check_freed_slots:
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]
    for pool in (conv, ssm):
        if all_layers:
            pool[:, dst] = pool[:, src]
        else:
            pool[dst] = pool[src]
