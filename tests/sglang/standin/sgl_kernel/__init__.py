"""Torch-native stand-ins for the ``sgl_kernel`` CPU ops SGLang 0.5.23 calls on a hybrid Qwen3.5
(Gated DeltaNet) model's path, registered as torch custom ops under the names SGLang looks up
(``torch.ops.sgl_kernel.<name>``), plus the Python wrappers it imports (``sgl_kernel.mamba``).

The index's ``sglang-kernel`` wheel is CUDA only, so SGLang's CPU engine cannot run here without
them. Each op is written from its formula, for clarity rather than speed (a Python loop over
tokens for the recurrences); ``tests/sglang/test_standin_kernels.py`` checks each against an
independent reference (transformers' torch code for the same layer, or a direct formula).

Semantics and layouts are SGLang's (what its call sites pass and expect back):

- GDN state slots are ``[value_heads, head_v, head_k]`` (SGLang's temporal shape; the element for
  key ``i`` and value ``j`` is ``state[h, j, i]``), float32; conv states ``[dim, width - 1]``
  (logical indexing: SGLang's AMX layout makes them strided).
- ``is_vnni`` flags are accepted and ignored: :func:`causal_conv1d_weight_pack` and
  :func:`convert_weight_packed` leave weights as they are, so there is nothing to unpack.
- A slot index of ``-1`` (``pad_slot_id``) is skipped.

Test support only: never imported by radixcache.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F  # noqa: N812

__version__ = "0.0.0+standin"

_NS = "sgl_kernel"


def _op(name: str, mutates: tuple[str, ...] = (), device_types: str | None = "cpu"):  # type: ignore[no-untyped-def]
    return torch.library.custom_op(f"{_NS}::{name}", mutates_args=mutates, device_types=device_types)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _rms(x: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ------------------------------------------------------------------ process set-up
@_op("init_cpu_threads_env", device_types=None)
def init_cpu_threads_env(cpu_ids: str) -> None:
    """SGLang's OpenMP thread binding: left to torch's defaults here."""


@_op("initialize", device_types=None)
def initialize(size: int, rank: int) -> None:
    """SGLang's shared-memory all-reduce set-up: nothing to set up for one process (tensor
    parallelism above 1 is not served by the stand-in)."""
    if size != 1:
        raise NotImplementedError(f"the CPU stand-in serves tensor parallel size 1, got {size}")


# ------------------------------------------------------------------ KV cache
@_op("store_cache_cpu", mutates=("k_cache", "v_cache"))
def store_cache_cpu(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, indices: Tensor, row_dim: int) -> None:
    """Write each token's key and value row (``row_dim`` elements) at its KV index."""
    idx = indices.long()
    k_cache.view(-1, row_dim)[idx] = k.reshape(-1, row_dim).to(k_cache.dtype)
    v_cache.view(-1, row_dim)[idx] = v.reshape(-1, row_dim).to(v_cache.dtype)


# ------------------------------------------------------------------ weight packing (no-ops)
@_op("convert_weight_packed")
def convert_weight_packed(weight: Tensor) -> Tensor:
    """The AMX GEMM weight layout: here the weight itself (a copy; linear ops read it as is)."""
    return weight.clone()


@_op("causal_conv1d_weight_pack")
def causal_conv1d_weight_pack(weight: Tensor) -> Tensor:
    """The AMX conv weight layout: here the weight itself (a copy), ``[dim, width]``."""
    return weight.clone()


@_op("weight_packed_linear")
def weight_packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None, is_vnni: bool) -> Tensor:
    """``x @ weight.T + bias`` (the weight is unpacked, see :func:`convert_weight_packed`)."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


# ------------------------------------------------------------------ norms and activations
@_op("rmsnorm_cpu")
def rmsnorm_cpu(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMS norm over the last dimension, times ``weight``."""
    return (_rms(x, eps) * weight.float()).to(x.dtype)


@_op("fused_add_rmsnorm_cpu", mutates=("x", "residual"))
def fused_add_rmsnorm_cpu(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rmsnorm(residual) * weight``."""
    residual.add_(x)
    x.copy_((_rms(residual, eps) * weight.float()).to(x.dtype))


@_op("gemma_rmsnorm_cpu")
def gemma_rmsnorm_cpu(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMS norm: ``rmsnorm(x) * (1 + weight)``."""
    return (_rms(x, eps) * (1.0 + weight.float())).to(x.dtype)


@_op("gemma_fused_add_rmsnorm_cpu", mutates=("x", "residual"))
def gemma_fused_add_rmsnorm_cpu(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rmsnorm(residual) * (1 + weight)``."""
    residual.add_(x)
    x.copy_((_rms(residual, eps) * (1.0 + weight.float())).to(x.dtype))


@_op("fused_rmsnorm_gated_cpu")
def fused_rmsnorm_gated_cpu(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """``rmsnorm(x) * weight * silu(gate)`` (norm before gate), over the last dimension."""
    return (_rms(x, eps) * weight.float() * F.silu(gate.float())).to(x.dtype)


@_op("silu_and_mul_cpu")
def silu_and_mul_cpu(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d`` half the last dimension."""
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


@_op("fused_sigmoid_mul_cpu", mutates=("x",))
def fused_sigmoid_mul_cpu(x: Tensor, gate: Tensor) -> None:
    """In place: ``x *= sigmoid(gate)`` (``gate`` holds as many elements as ``x``, any view)."""
    x.copy_((x.float() * torch.sigmoid(gate.reshape(x.shape).float())).to(x.dtype))


def _per_head_gemma(x: Tensor, weight: Tensor, eps: float, head_dim: int) -> Tensor:
    return (_rms(x.reshape(-1, head_dim), eps) * (1.0 + weight.float())).to(x.dtype)


@_op("fused_qk_gemma_rmsnorm_cpu")
def fused_qk_gemma_rmsnorm_cpu(
    q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, head_dim: int
) -> tuple[Tensor, Tensor]:
    """Gemma RMS norm of each head of ``q`` and ``k``: ``[tokens * heads, head_dim]`` each."""
    return _per_head_gemma(q, q_weight, eps, head_dim), _per_head_gemma(k, k_weight, eps, head_dim)


@_op("fused_qk_gemma_rmsnorm_with_gate_cpu")
def fused_qk_gemma_rmsnorm_with_gate_cpu(
    q_gate: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, head_dim: int, num_heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``q_gate`` is ``[tokens, heads * 2 * head_dim]``, each head its query then its gate. Returns
    the normed queries ``[tokens, heads, head_dim]``, the normed keys ``[tokens, kv_heads,
    head_dim]`` and the gates ``[tokens, heads, head_dim]`` (untouched, contiguous)."""
    t = q_gate.shape[0]
    qg = q_gate.reshape(t, num_heads, 2 * head_dim)
    q, gate = qg[..., :head_dim], qg[..., head_dim:]
    qn = _per_head_gemma(q, q_weight, eps, head_dim).reshape(t, num_heads, head_dim)
    kn = _per_head_gemma(k, k_weight, eps, head_dim).reshape(t, -1, head_dim)
    return qn, kn, gate.clone(memory_format=torch.contiguous_format)


@_op("rotary_embedding_cpu")
def rotary_embedding_cpu(
    positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    """Rotary embedding of the first ``rotary_dim`` features of each head (``cos_sin_cache`` is
    ``[positions, rotary_dim]``: cosines then sines); NeoX style rotates halves, GPT-J style
    interleaved pairs. Returns new ``query`` and ``key`` of their input shapes."""
    cos, sin = cos_sin_cache[positions.reshape(-1).long()].float().chunk(2, dim=-1)  # [tokens, rot/2]
    rot = cos.shape[-1] * 2

    def apply(x: Tensor) -> Tensor:
        shape = x.shape
        h = x.reshape(positions.numel(), -1, head_size).float()
        r, rest = h[..., :rot], h[..., rot:]
        c, s = cos[:, None, :], sin[:, None, :]
        if is_neox:
            x1, x2 = r[..., : rot // 2], r[..., rot // 2 :]
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
            out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1).to(x.dtype).reshape(shape)

    return apply(query), apply(key)


@_op("apply_rotary_pos_emb_cpu")
def apply_rotary_pos_emb_cpu(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """``x * cos + rotate_half(x) * sin`` for ``q`` and ``k`` (``cos``, ``sin`` unsqueezed at
    ``unsqueeze_dim``; ``rotate_half`` swaps the halves, negating the second)."""
    c, s = cos.unsqueeze(unsqueeze_dim).float(), sin.unsqueeze(unsqueeze_dim).float()

    def one(x: Tensor) -> Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)

    return one(q), one(k)


# ------------------------------------------------------------------ Gated DeltaNet
@_op("fused_input_proj_cpu")
def fused_input_proj_cpu(
    hidden_states: Tensor, qkvz_weight: Tensor, ba_weight: Tensor, is_vnni: bool
) -> tuple[Tensor, Tensor]:
    """Both GDN input projections: ``(x @ qkvz_weight.T, x @ ba_weight.T)``."""
    return F.linear(hidden_states, qkvz_weight), F.linear(hidden_states, ba_weight)


@_op("fused_qkvzba_split_reshape_cat_contiguous_cpu")
def fused_qkvzba_split_reshape_cat_contiguous_cpu(
    mixed_qkvz: Tensor, mixed_ba: Tensor, num_heads_qk: int, num_heads_v: int, head_qk: int, head_v: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Qwen3.5's contiguous projection layout ``[q | k | v | z]`` and ``[b | a]`` split into
    ``mixed_qkv = [q | k | v]`` ``[tokens, 2*qk + v]``, ``z`` ``[tokens, v_heads, head_v]``, ``b``
    and ``a`` ``[tokens, v_heads]``, each a new contiguous tensor (a custom op's outputs may not alias
    its inputs)."""
    qk, v = num_heads_qk * head_qk, num_heads_v * head_v
    q_, k_, v_, z = mixed_qkvz.split_with_sizes([qk, qk, v, v], dim=-1)
    b, a = mixed_ba.split_with_sizes([num_heads_v, num_heads_v], dim=-1)
    t = mixed_qkvz.shape[0]
    return (
        torch.cat((q_, k_, v_), dim=-1),
        z.reshape(t, num_heads_v, head_v).clone(memory_format=torch.contiguous_format),
        b.clone(memory_format=torch.contiguous_format),
        a.clone(memory_format=torch.contiguous_format),
    )


def _gates(A_log: Tensor, a: Tensor, dt_bias: Tensor, beta: float, threshold: float) -> Tensor:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` in float32."""
    return -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=beta, threshold=threshold)


@_op("fused_gdn_gating_cpu")
def fused_gdn_gating_cpu(A_log: Tensor, a: Tensor, b: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """The GDN gates of each token and value head: ``g`` (float32) and ``beta = sigmoid(b)`` (in
    ``b``'s dtype), each ``[1, tokens, v_heads]``."""
    g = _gates(A_log, a, dt_bias, 1.0, 20.0)
    return g.unsqueeze(0), torch.sigmoid(b.float()).to(b.dtype).unsqueeze(0)


def _conv_window(x: Tensor, state: Tensor, weight: Tensor, bias: Tensor | None, silu: bool) -> Tensor:
    """The causal conv over ``x`` ``[dim, T]`` preceded by ``state`` ``[dim, width - 1]``."""
    width = weight.shape[-1]
    full = torch.cat((state.to(x.dtype), x), dim=-1)  # [dim, width - 1 + T]
    win = full.unfold(-1, width, 1)  # [dim, T, width]
    out = (win.float() * weight.float()[:, None, :]).sum(-1)
    if bias is not None:
        out = out + bias.float()[:, None]
    return F.silu(out) if silu else out


@_op("causal_conv1d_fwd_cpu", mutates=("conv_states",))
def causal_conv1d_fwd_cpu(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    query_start_loc: Tensor,
    cache_indices: Tensor,
    has_initial_state: Tensor,
    silu_activation: bool,
    pad_slot_id: int,
    is_vnni: bool,
) -> Tensor:
    """A prefill's depthwise causal conv: ``x`` ``[dim, tokens]`` holds the sequences of
    ``query_start_loc`` back to back; sequence ``i`` starts from its slot's conv state if
    ``has_initial_state[i]`` (else zeros) and leaves its last ``width - 1`` inputs there. Returns
    ``[dim, tokens]``."""
    out = torch.zeros_like(x)
    width = weight.shape[-1]
    loc = query_start_loc.tolist()
    for i in range(len(loc) - 1):
        s, e = loc[i], loc[i + 1]
        slot = int(cache_indices[i])
        if slot == pad_slot_id or e == s:
            continue
        init = conv_states[slot] if bool(has_initial_state[i]) else torch.zeros_like(conv_states[slot])
        seq = x[:, s:e]
        out[:, s:e] = _conv_window(seq, init, weight, bias, silu_activation).to(x.dtype)
        conv_states[slot] = torch.cat((init.to(x.dtype), seq), dim=-1)[:, -(width - 1) :].to(conv_states.dtype)
    return out


@_op("causal_conv1d_update_cpu", mutates=("conv_states",))
def causal_conv1d_update_cpu(
    x: Tensor,
    conv_states: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    silu_activation: bool,
    cache_seqlens: Tensor | None,
    conv_state_indices: Tensor,
    pad_slot_id: int,
    is_vnni: bool,
) -> Tensor:
    """A decode step's conv: row ``b`` of ``x`` (``[batch, dim]`` or ``[batch, dim, steps]``)
    continues slot ``conv_state_indices[b]``'s window, which it then advances. Returns ``x``'s
    shape."""
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    out = torch.zeros_like(xs)
    width = weight.shape[-1]
    for b in range(xs.shape[0]):
        slot = int(conv_state_indices[b])
        if slot == pad_slot_id:
            continue
        init = conv_states[slot]
        out[b] = _conv_window(xs[b], init, weight, bias, silu_activation).to(x.dtype)
        conv_states[slot] = torch.cat((init.to(x.dtype), xs[b]), dim=-1)[:, -(width - 1) :].to(conv_states.dtype)
    return out.squeeze(-1) if squeeze else out


def gated_delta_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule over one sequence, token by token (float32).

    ``q``, ``k`` ``[T, H, K]`` (already normalised and, for ``q``, scaled), ``v`` ``[T, H, V]``,
    ``g``, ``beta`` ``[T, H]``, ``state`` ``[H, K, V]``. For each token: ``S *= exp(g)``;
    ``S += k (beta (v - k S))^T``; ``o = q S``. Returns ``(o [T, H, V], S)``."""
    s = state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        kv = torch.einsum("hk,hkv->hv", k[t], s)
        delta = (v[t] - kv) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out, s


def _prepare_qk(q: Tensor, k: Tensor, heads_v: int, l2: bool) -> tuple[Tensor, Tensor]:
    """``[T, Hk, K]`` queries and keys, normalised (``l2``), queries scaled by ``K**-0.5``, each key
    head repeated for the value heads it serves (``Hv / Hk`` consecutive ones)."""
    qf, kf = (l2norm(q), l2norm(k)) if l2 else (q.float(), k.float())
    qf = qf * q.shape[-1] ** -0.5
    rep = heads_v // q.shape[1]
    if rep > 1:
        qf, kf = qf.repeat_interleave(rep, dim=1), kf.repeat_interleave(rep, dim=1)
    return qf, kf


@_op("chunk_gated_delta_rule_cpu", mutates=("initial_state",))
def chunk_gated_delta_rule_cpu(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor,
    output_final_state: bool,
    cu_seqlens: Tensor,
    head_first: bool,
    use_qk_l2norm_in_kernel: bool,
    initial_state_indices: Tensor,
) -> tuple[Tensor, Tensor]:
    """A prefill's gated delta rule: ``q``, ``k`` ``[1, tokens, Hk, K]``, ``v`` ``[1, tokens, Hv,
    V]``, ``g``, ``beta`` ``[1, tokens, Hv]``; sequence ``i`` (``cu_seqlens``) starts from the
    state in slot ``initial_state_indices[i]`` of ``initial_state`` (``[slots, Hv, V, K]``) and
    leaves its final state there. Returns the output ``[1, tokens, Hv, V]`` (``v``'s dtype) and
    the final states ``[sequences, Hv, V, K]``."""
    if head_first:
        raise NotImplementedError("head_first layouts are not used by SGLang's GDN backend")
    hv = v.shape[2]
    qf, kf = _prepare_qk(q[0], k[0], hv, use_qk_l2norm_in_kernel)
    out = torch.zeros(v.shape[1:], dtype=torch.float32)
    loc = cu_seqlens.tolist()
    finals = []
    for i in range(len(loc) - 1):
        s, e = loc[i], loc[i + 1]
        slot = int(initial_state_indices[i])
        start = initial_state[slot].transpose(-1, -2) if slot >= 0 else torch.zeros(hv, q.shape[-1], v.shape[-1])
        o, st = gated_delta_scan(qf[s:e], kf[s:e], v[0, s:e].float(), g[0, s:e].float(), beta[0, s:e].float(), start)
        out[s:e] = o
        final = st.transpose(-1, -2)
        if slot >= 0:
            initial_state[slot] = final.to(initial_state.dtype)
        finals.append(final)
    stacked = (
        torch.stack(finals).to(initial_state.dtype)
        if finals
        else initial_state.new_zeros((0, *initial_state.shape[1:]))
    )
    return out.to(v.dtype).unsqueeze(0), stacked


@_op("fused_sigmoid_gating_delta_rule_update_cpu", mutates=("initial_state_source",))
def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log: Tensor,
    dt_bias: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    initial_state_source: Tensor,
    initial_state_indices: Tensor,
    cu_seqlens: Tensor,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float,
    softplus_threshold: float,
) -> Tensor:
    """A decode step's gated delta rule with its gates computed in: ``q``, ``k`` ``[1, batch, Hk,
    K]``, ``v`` ``[1, batch, Hv, V]``, ``a``, ``b`` ``[batch, Hv]``; token ``i`` continues slot
    ``initial_state_indices[i]`` (skipped when negative) and advances it. Returns ``[1, batch, Hv,
    V]``."""
    hv = v.shape[2]
    qf, kf = _prepare_qk(q[0], k[0], hv, use_qk_l2norm_in_kernel)
    g = _gates(A_log, a.reshape(-1, hv), dt_bias, softplus_beta, softplus_threshold)
    beta = torch.sigmoid(b.reshape(-1, hv).float())
    out = torch.zeros(v.shape[1:], dtype=torch.float32)
    for i in range(v.shape[1]):
        slot = int(initial_state_indices[i])
        if slot < 0:
            continue
        o, st = gated_delta_scan(
            qf[i : i + 1],
            kf[i : i + 1],
            v[0, i : i + 1].float(),
            g[i : i + 1],
            beta[i : i + 1],
            initial_state_source[slot].transpose(-1, -2),
        )
        out[i] = o[0]
        initial_state_source[slot] = st.transpose(-1, -2).to(initial_state_source.dtype)
    return out.to(v.dtype).unsqueeze(0)


# Ops SGLang looks up at module level on the way to this model, for other models or other hardware
# (vision attention, ...): registered so the lookups succeed, raising if ever called.
_UNSERVED = (
    "flash_attn_varlen_func",
    "conv3d_embed_cpu",
)
_lib = torch.library.Library(_NS, "FRAGMENT")  # type: ignore[no-untyped-call]


def _unserved(name: str) -> None:
    def fail(*args: object) -> Tensor:
        raise NotImplementedError(f"sgl_kernel.{name} was called: the SGLang CPU test stand-in does not serve it")

    _lib.define(f"{name}(Tensor[] args) -> Tensor")  # type: ignore[no-untyped-call]
    _lib.impl(name, fail, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


for _name in _UNSERVED:
    _unserved(_name)


class _Missing:
    """What ``from sgl_kernel import X`` gives for a function this stand-in does not provide:
    SGLang imports many at module level for paths this model never takes; a call raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise NotImplementedError(
            f"sgl_kernel.{self.name} was called: the SGLang CPU test stand-in does not provide it"
        )


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name)
