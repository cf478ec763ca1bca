"""The Python wrappers SGLang imports from ``sgl_kernel.mamba`` on the CPU, over the stand-in ops
of this package (their signatures are SGLang 0.5.23's call sites)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import causal_conv1d_fwd_cpu as _registered  # noqa: F401  (registers the ops)

__all__ = ["causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"]


def causal_conv1d_fn_cpu(
    mixed_qkv_transposed: Tensor,
    conv_weights: Tensor,
    bias: Tensor | None,
    activation: str | None,
    conv_states: Tensor,
    has_initial_state: Tensor,
    cache_indices: Tensor,
    query_start_loc: Tensor,
    seq_lens_cpu: Any = None,
    **kwargs: Any,
) -> Tensor:
    """A prefill's conv (``[dim, tokens]`` in and out); see the ``causal_conv1d_fwd_cpu`` op."""
    if kwargs.get("block_table") is not None:
        raise NotImplementedError("conv block tables are not served by the CPU stand-in")
    out: Tensor = torch.ops.sgl_kernel.causal_conv1d_fwd_cpu(
        mixed_qkv_transposed,
        conv_weights,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        activation in ("silu", "swish"),
        -1,
        True,
    )
    return out


def causal_conv1d_update_cpu(
    mixed_qkv: Tensor,
    conv_states: Tensor,
    conv_weights: Tensor,
    bias: Tensor | None,
    activation: str | None,
    conv_state_indices: Tensor,
    intermediate_conv_window: Any = None,
    intermediate_state_indices: Any = None,
    **kwargs: Any,
) -> Tensor:
    """A decode step's conv; see the ``causal_conv1d_update_cpu`` op. Speculative verification
    (intermediate windows) is not served."""
    if intermediate_conv_window is not None:
        raise NotImplementedError("speculative verification is not served by the CPU stand-in")
    out: Tensor = torch.ops.sgl_kernel.causal_conv1d_update_cpu(
        mixed_qkv, conv_states, conv_weights, bias, activation in ("silu", "swish"), None, conv_state_indices, -1, True
    )
    return out


def chunk_gated_delta_rule_cpu(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor,
    cu_seqlens: Tensor,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    initial_state_indices: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor, None]:
    """A prefill's gated delta rule: ``(output, final states, None)`` (no per-chunk states, as the
    CPU kernel SGLang ships)."""
    if initial_state_indices is None:
        initial_state_indices = torch.arange(cu_seqlens.numel() - 1, dtype=torch.int64)
    out, final = torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(
        q, k, v, g, beta, initial_state, True, cu_seqlens, head_first, use_qk_l2norm_in_kernel, initial_state_indices
    )
    return out, final, None
