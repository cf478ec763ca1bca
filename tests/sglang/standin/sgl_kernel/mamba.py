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


# The chunk of SGLang's GDN prefill kernels (FLA's): ``h`` holds a sequence's state at the start of each
# of its 64-token chunks, which SGLang's extra-buffer tracking copies into its track slots.
CHUNK = 64


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
) -> tuple[Tensor, Tensor, Tensor]:
    """A prefill's gated delta rule: ``(output, final states, h)``. ``h`` (``[1, chunks, Hv, V, K]``,
    the state pool's layout) holds, for each sequence in order, its state at the start of each of
    its :data:`CHUNK`-token chunks (``ceil(length / CHUNK)`` of them; the first is the initial
    state), as FLA's chunked kernel SGLang runs on GPUs returns them. (The CPU kernel SGLang ships
    returns none, so SGLang's extra-buffer tracking cannot run on the CPU with it.)

    Computed by running the op chunk by chunk: round ``r`` carries every sequence that has an
    ``r``-th chunk one chunk further from the state the previous round left in its slot."""
    n = cu_seqlens.numel() - 1
    if initial_state_indices is None:
        initial_state_indices = torch.arange(n, dtype=torch.int64)
    slots = [int(x) for x in initial_state_indices.reshape(-1).tolist()]
    if any(s < 0 for s in slots):
        raise NotImplementedError("a sequence without a state slot is not served by the CPU stand-in")
    loc = [int(x) for x in cu_seqlens.tolist()]
    lens = [loc[i + 1] - loc[i] for i in range(n)]
    chunks = [(ln + CHUNK - 1) // CHUNK for ln in lens]
    offsets = [sum(chunks[:i]) for i in range(n)]
    h = initial_state.new_empty((sum(chunks), *initial_state.shape[1:]))
    out = torch.empty((1, v.shape[1], *v.shape[2:]), dtype=v.dtype)
    for r in range(max(chunks, default=0)):
        rows = [i for i in range(n) if chunks[i] > r]
        pieces = [(loc[i] + r * CHUNK, min(loc[i + 1], loc[i] + (r + 1) * CHUNK)) for i in rows]
        idx = torch.cat([torch.arange(a, b) for a, b in pieces])
        cu = torch.tensor([0, *torch.tensor([b - a for a, b in pieces]).cumsum(0).tolist()], dtype=cu_seqlens.dtype)
        row_slots = torch.tensor([slots[i] for i in rows], dtype=torch.int64)
        h[torch.tensor([offsets[i] + r for i in rows])] = initial_state[row_slots]
        o, _ = torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(
            q[:, idx], k[:, idx], v[:, idx], g[:, idx], beta[:, idx], initial_state, True, cu,
            head_first, use_qk_l2norm_in_kernel, row_slots,
        )  # fmt: skip
        out[:, idx] = o
    final = initial_state[torch.tensor(slots, dtype=torch.int64)] if n else initial_state[:0]
    return out, final.clone(), h.unsqueeze(0)
