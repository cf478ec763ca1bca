"""The torch-native ``sgl_kernel`` stand-ins (tests/sglang/standin) against independent references:
transformers' torch code for the same Qwen3.5 layer where it has one (gated delta rule, causal
conv, gated and Gemma RMS norms, rotary embedding), the formula otherwise. Random fp32 inputs,
several sequences of different lengths in one call (one shorter than the conv window, one across
a 64-token chunk), slot indices out of order and a padded slot (-1) that must be left alone.

Tolerance: 2e-5 absolute on outputs and states for the recurrences (transformers' chunked delta
rule against the stand-in's token-by-token loop differ by float32 rounding only, about 1e-6 on
these sizes), 1e-6 for the element-wise ops."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F  # noqa: N812

pytest.importorskip("sglang")
q35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

STANDIN = Path(__file__).parent / "standin" / "sgl_kernel"
TOL = 2e-5


def _load() -> Any:
    """The stand-in package under a name of its own (this process's ``sgl_kernel`` is the
    conftest's inert module); importing it registers the ops in ``torch.ops.sgl_kernel``."""
    name = "sgl_kernel_standin"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, STANDIN / "__init__.py", submodule_search_locations=[str(STANDIN)]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    importlib.import_module(f"{name}.mamba")
    return mod


K = _load()
ops = torch.ops.sgl_kernel
LENS = [3, 70, 1, 140]  # one below the conv window, two across 64-token chunks, a single token
HK, HV, DK, DV = 2, 4, 16, 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _r(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# ------------------------------------------------------------------ gated delta rule
def _gates(g: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a_log = torch.empty(HV).uniform_(0.002, 0.5, generator=g).log()
    dt_bias = _r(HV, g=g, scale=0.5)
    a, b = _r(t, HV, g=g), _r(t, HV, g=g)
    return a_log, dt_bias, a, b


def _hf_gates(
    a_log: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3_5GatedDeltaNet.forward's gates, as transformers computes them."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def test_chunk_gated_delta_rule_matches_transformers_per_sequence() -> None:
    g = _gen(0)
    t = sum(LENS)
    q, k, v = _r(1, t, HK, DK, g=g), _r(1, t, HK, DK, g=g), _r(1, t, HV, DV, g=g)
    a_log, dt_bias, a, b = _gates(g, t)
    gg, beta = ops.fused_gdn_gating_cpu(a_log, a, b, dt_bias)
    slots = torch.tensor([5, 1, 3, 0])
    pool = _r(7, HV, DV, DK, g=g, scale=0.3)  # [slots, Hv, V, K], SGLang's layout
    before = pool.clone()
    out, finals, h = sys.modules["sgl_kernel_standin.mamba"].chunk_gated_delta_rule_cpu(
        q, k, v, gg, beta, pool, _cu(LENS), False, True, slots
    )
    assert out.shape == (1, t, HV, DV) and finals.shape == (len(LENS), HV, DV, DK)
    chunks = [(n + 63) // 64 for n in LENS]
    assert h.shape == (1, sum(chunks), HV, DV, DK)
    rep = HV // HK

    def reference(sl: slice, init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' chunked delta rule over tokens ``sl`` from ``init``: (output, final state)."""
        out_ref, state = q35.torch_chunk_gated_delta_rule(
            q[:, sl].repeat_interleave(rep, 2),
            k[:, sl].repeat_interleave(rep, 2),
            v[:, sl],
            gg[:, sl],
            beta[:, sl],
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return out_ref, state

    start = 0
    for i, n in enumerate(LENS):
        sl = slice(start, start + n)
        init = before[slots[i]].transpose(-1, -2).unsqueeze(0)  # transformers' [B, H, K, V]
        ref, ref_state = reference(sl, init)
        torch.testing.assert_close(out[:, sl], ref, atol=TOL, rtol=0)
        torch.testing.assert_close(pool[slots[i]], ref_state[0].transpose(-1, -2), atol=TOL, rtol=0)
        torch.testing.assert_close(finals[i], pool[slots[i]])
        for j in range(chunks[i]):  # h: the state at the start of each 64-token chunk
            at = h[0, sum(chunks[:i]) + j]
            if j == 0:
                assert torch.equal(at, before[slots[i]])
                continue
            _, ref_h = reference(slice(start, start + 64 * j), init)
            torch.testing.assert_close(at, ref_h[0].transpose(-1, -2), atol=TOL, rtol=0)
        start += n
    for untouched in (2, 4, 6):
        assert torch.equal(pool[untouched], before[untouched])


def test_decode_gated_delta_update_matches_transformers_recurrent_step() -> None:
    g = _gen(1)
    bs = 3
    q, k, v = _r(1, bs, HK, DK, g=g), _r(1, bs, HK, DK, g=g), _r(1, bs, HV, DV, g=g)
    a_log, dt_bias, a, b = _gates(g, bs)
    slots = torch.tensor([4, -1, 2])  # the second row is padding
    pool = _r(6, HV, DV, DK, g=g, scale=0.3)
    before = pool.clone()
    out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=a_log,
        dt_bias=dt_bias,
        q=q,
        k=k,
        v=v,
        a=a,
        b=b,
        initial_state_source=pool,
        initial_state_indices=slots,
        cu_seqlens=torch.arange(bs + 1, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0,
        softplus_threshold=20.0,
    )
    gg, beta = _hf_gates(a_log, dt_bias, a, b)
    rep = HV // HK
    for i in (0, 2):
        ref, ref_state = q35.torch_recurrent_gated_delta_rule(
            q[:, i : i + 1].repeat_interleave(rep, 2),
            k[:, i : i + 1].repeat_interleave(rep, 2),
            v[:, i : i + 1],
            gg[None, i : i + 1],
            beta[None, i : i + 1],
            initial_state=before[slots[i]].transpose(-1, -2)[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[:, i : i + 1], ref, atol=TOL, rtol=0)
        torch.testing.assert_close(pool[slots[i]], ref_state[0].transpose(-1, -2), atol=TOL, rtol=0)
    assert torch.equal(out[0, 1], torch.zeros(HV, DV))
    for untouched in (0, 1, 3, 5):
        assert torch.equal(pool[untouched], before[untouched])


def test_gdn_gating_is_the_layer_formula() -> None:
    g = _gen(2)
    a_log, dt_bias, a, b = _gates(g, 9)
    gg, beta = ops.fused_gdn_gating_cpu(a_log, a, b, dt_bias)
    ref_g, ref_beta = _hf_gates(a_log, dt_bias, a, b)
    torch.testing.assert_close(gg[0], ref_g, atol=1e-6, rtol=0)
    torch.testing.assert_close(beta[0], ref_beta, atol=1e-6, rtol=0)
    assert gg.dtype == torch.float32 and gg.shape == (1, 9, HV)


# ------------------------------------------------------------------ causal conv
DIM, WIDTH = 12, 4


def test_prefill_conv_matches_transformers_with_and_without_initial_state() -> None:
    g = _gen(3)
    t = sum(LENS)
    x = _r(DIM, t, g=g)
    w, bias = _r(DIM, WIDTH, g=g), _r(DIM, g=g)
    states = _r(6, DIM, WIDTH - 1, g=g)
    before = states.clone()
    slots = torch.tensor([2, 5, 1, 3])
    has_init = torch.tensor([True, False, True, True])
    out = sys.modules["sgl_kernel_standin.mamba"].causal_conv1d_fn_cpu(
        x, w, bias, "silu", states, has_init, slots, _cu(LENS), LENS
    )
    start = 0
    for i, n in enumerate(LENS):
        seq = x[None, :, start : start + n]
        if has_init[i]:
            st = before[slots[i]].clone()[None]
            ref = q35.causal_conv1d_update(seq, st, w, bias, activation="silu")  # continues the state
        else:
            st = torch.zeros(1, DIM, WIDTH - 1)
            ref = q35.causal_conv1d_fn(seq, w, bias, activation="silu")  # from zeros
            q35.causal_conv1d_update(seq, st, w, bias, activation="silu")  # the state it leaves
        torch.testing.assert_close(out[None, :, start : start + n], ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(states[slots[i]], st[0], atol=1e-6, rtol=0)
        start += n
    for untouched in (0, 4):
        assert torch.equal(states[untouched], before[untouched])


def test_decode_conv_update_matches_transformers() -> None:
    g = _gen(4)
    x = _r(3, DIM, g=g)
    w = _r(DIM, WIDTH, g=g)
    states = _r(5, DIM, WIDTH - 1, g=g)
    before = states.clone()
    slots = torch.tensor([3, -1, 0])
    out = sys.modules["sgl_kernel_standin.mamba"].causal_conv1d_update_cpu(x, states, w, None, "silu", slots)
    for i in (0, 2):
        st = before[slots[i]].clone()[None]
        ref = q35.causal_conv1d_update(x[i : i + 1, :, None], st, w, None, activation="silu")
        torch.testing.assert_close(out[i], ref[0, :, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(states[slots[i]], st[0])
    assert torch.equal(out[1], torch.zeros(DIM))
    for untouched in (1, 2, 4):
        assert torch.equal(states[untouched], before[untouched])


# ------------------------------------------------------------------ norms, activations, rotary
def test_norms_match_transformers_qwen3_5_layers() -> None:
    g = _gen(5)
    x, z, res = _r(6, 32, g=g), _r(6, 32, g=g), _r(6, 32, g=g)
    gated = q35.Qwen3_5RMSNormGated(32, eps=1e-6)
    gemma = q35.Qwen3_5RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        gated.weight.copy_(_r(32, g=g))
        gemma.weight.copy_(_r(32, g=g, scale=0.1))
        torch.testing.assert_close(
            ops.fused_rmsnorm_gated_cpu(x, gated.weight, z, 1e-6), gated(x, z), atol=1e-6, rtol=0
        )
        torch.testing.assert_close(ops.gemma_rmsnorm_cpu(x, gemma.weight, 1e-6), gemma(x), atol=1e-6, rtol=0)
        xx, rr = x.clone(), res.clone()
        ops.gemma_fused_add_rmsnorm_cpu(xx, rr, gemma.weight, 1e-6)
        torch.testing.assert_close(rr, x + res)
        torch.testing.assert_close(xx, gemma(x + res), atol=1e-6, rtol=0)
        w = _r(32, g=g)
        torch.testing.assert_close(ops.rmsnorm_cpu(x, w, 1e-6), F.rms_norm(x, (32,), w, 1e-6), atol=1e-6, rtol=0)
        xx, rr = x.clone(), res.clone()
        ops.fused_add_rmsnorm_cpu(xx, rr, w, 1e-6)
        torch.testing.assert_close(xx, F.rms_norm(x + res, (32,), w, 1e-6), atol=1e-6, rtol=0)


def test_qk_gemma_norms_per_head_with_and_without_gate() -> None:
    g = _gen(6)
    heads, kv_heads, d, t = 4, 1, 16, 5
    norm_q, norm_k = q35.Qwen3_5RMSNorm(d), q35.Qwen3_5RMSNorm(d)
    with torch.no_grad():
        norm_q.weight.copy_(_r(d, g=g, scale=0.1))
        norm_k.weight.copy_(_r(d, g=g, scale=0.1))
        q_gate, k = _r(t, heads * 2 * d, g=g), _r(t, kv_heads * d, g=g)
        qn, kn, gate = ops.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, norm_q.weight, norm_k.weight, 1e-6, d, heads)
        # transformers' Qwen3_5Attention: q_proj's output per head is [query | gate]
        ref_q, ref_gate = torch.chunk(q_gate.view(t, heads, 2 * d), 2, dim=-1)
        torch.testing.assert_close(qn, norm_q(ref_q), atol=1e-6, rtol=0)
        torch.testing.assert_close(kn, norm_k(k.view(t, kv_heads, d)), atol=1e-6, rtol=0)
        assert torch.equal(gate, ref_gate)
        q = _r(t, heads * d, g=g)
        qn2, kn2 = ops.fused_qk_gemma_rmsnorm_cpu(q, k, norm_q.weight, norm_k.weight, 1e-6, d)
        torch.testing.assert_close(qn2.view(t, heads, d), norm_q(q.view(t, heads, d)), atol=1e-6, rtol=0)
        torch.testing.assert_close(kn2.view(t, kv_heads, d), norm_k(k.view(t, kv_heads, d)), atol=1e-6, rtol=0)


def test_partial_neox_rotary_matches_transformers() -> None:
    g = _gen(7)
    heads, d, rot, t = 3, 16, 4, 6
    pos = torch.tensor([0, 5, 9, 1, 63, 2])
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # SGLang's cos_sin_cache: [positions, rot]
    q, k = _r(t, heads * d, g=g), _r(t, d, g=g)
    qo, ko = ops.rotary_embedding_cpu(pos, q, k, d, cache, True)
    emb = torch.cat((freqs[pos], freqs[pos]), dim=-1)  # transformers' [t, rot] cos/sin inputs
    ref_q, ref_k = q35.apply_rotary_pos_emb(
        q.view(1, t, heads, d).transpose(1, 2), k.view(1, t, 1, d).transpose(1, 2), emb.cos()[None], emb.sin()[None]
    )
    torch.testing.assert_close(qo.view(1, t, heads, d), ref_q.transpose(1, 2), atol=1e-6, rtol=0)
    torch.testing.assert_close(ko.view(1, t, 1, d), ref_k.transpose(1, 2), atol=1e-6, rtol=0)
    # full-width rotary through apply_rotary_pos_emb_cpu (SGLang's vision path)
    full = torch.cat((torch.outer(pos.float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))),) * 2, dim=-1)
    qh, kh = q.view(t, heads, d), k.view(t, 1, d)
    got_q, got_k = ops.apply_rotary_pos_emb_cpu(qh, kh, full.cos(), full.sin(), 1)
    ref_q2, ref_k2 = q35.apply_rotary_pos_emb(qh, kh, full.cos(), full.sin(), unsqueeze_dim=1)
    torch.testing.assert_close(got_q, ref_q2, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_k, ref_k2, atol=1e-6, rtol=0)


def test_elementwise_ops_are_their_formulas() -> None:
    g = _gen(8)
    x = _r(5, 24, g=g)
    torch.testing.assert_close(ops.silu_and_mul_cpu(x), F.silu(x[:, :12]) * x[:, 12:])
    y, gate = _r(5, 3, 4, g=g), _r(5, 3, 8, g=g)[..., :4]  # a strided gate view
    want = y.reshape(5, 12) * torch.sigmoid(gate.reshape(5, 12))
    flat = y.reshape(5, 12).clone()
    ops.fused_sigmoid_mul_cpu(flat, gate)
    torch.testing.assert_close(flat, want)
    w, bias = _r(7, 24, g=g), _r(7, g=g)
    torch.testing.assert_close(ops.weight_packed_linear(x, ops.convert_weight_packed(w), bias, True), x @ w.T + bias)
    wa, wb = _r(10, 24, g=g), _r(4, 24, g=g)
    got_a, got_b = ops.fused_input_proj_cpu(x, wa, wb, True)
    torch.testing.assert_close(got_a, x @ wa.T)
    torch.testing.assert_close(got_b, x @ wb.T)
    kc, vc = torch.zeros(9, 2, 3), torch.zeros(9, 2, 3)
    kk, vv = _r(3, 2, 3, g=g), _r(3, 2, 3, g=g)
    ops.store_cache_cpu(kk, vv, kc, vc, torch.tensor([7, 0, 4]), 6)
    assert torch.equal(kc[[7, 0, 4]], kk) and torch.equal(vc[[7, 0, 4]], vv) and not kc[[1, 2, 3, 5, 6, 8]].any()


def test_qkvzba_split_of_the_contiguous_layout() -> None:
    t, nk, nv, dk, dv = 3, HK, HV, DK, DV
    parts = [
        torch.full((t, n), float(i)) + torch.arange(n) / 1000
        for i, n in enumerate((nk * dk, nk * dk, nv * dv, nv * dv))
    ]
    b, a = torch.full((t, nv), 7.0), torch.full((t, nv), 8.0)
    qkv, z, bb, aa = ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(
        torch.cat(parts, -1), torch.cat((b, a), -1), nk, nv, dk, dv
    )
    assert torch.equal(qkv, torch.cat(parts[:3], -1))
    assert torch.equal(z, parts[3].view(t, nv, dv))
    assert torch.equal(bb, b) and torch.equal(aa, a)
    assert all(x.is_contiguous() for x in (qkv, z, bb, aa))
    # one token, grad mode on (as in the server's first forward): the op's outputs alias no input
    one = torch.cat(parts, -1)[:1].requires_grad_(False)
    with torch.enable_grad():
        got = ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(one, torch.cat((b, a), -1)[:1], nk, nv, dk, dv)
    assert all(x.data_ptr() not in (one.data_ptr(),) for x in got)


def test_an_unserved_kernel_raises_naming_itself() -> None:
    with pytest.raises(NotImplementedError, match="flash_attn_varlen_func"):
        ops.flash_attn_varlen_func([torch.zeros(1)])
    with pytest.raises(NotImplementedError, match="copy_all_layer_kv_cache_cpu"):
        K.copy_all_layer_kv_cache_cpu()


def _load_track_copy() -> Any:
    spec = importlib.util.spec_from_file_location("track_copy_standin", STANDIN.parent / "track_copy.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("check_freed", [False, True])
@pytest.mark.parametrize("all_layers", [False, True])
def test_decode_track_copy_matches_the_formula(all_layers: bool, check_freed: bool) -> None:
    """SGLang's decode-tracking copy (a Triton kernel on GPUs): rows whose mask is set copy their
    slot's conv and SSM state into their track slot, in every layer; rows past ``batch_size``,
    unmasked rows and (with ``check_freed_slots``) rows naming slot -1 copy nothing."""
    track = _load_track_copy().track_mamba_states
    g = _gen(5)
    lead = (3,) if all_layers else ()
    conv, ssm = _r(*lead, 12, 6, 3, g=g), _r(*lead, 12, HV, DV, DK, g=g)
    cache_indices = torch.tensor([2, 5, 7, 1, 9])
    track_indices = torch.tensor([10, 11, -1 if check_freed else 8, 3, 4])
    mask = torch.tensor([True, False, True, True, True])
    batch = 4  # row 4 is past the batch
    want_conv, want_ssm = conv.clone(), ssm.clone()
    for row in range(batch):
        src, dst = int(cache_indices[row]), int(track_indices[row])
        if not mask[row] or dst < 0:
            continue
        for want, pool in ((want_conv, conv), (want_ssm, ssm)):
            if all_layers:
                want[:, dst] = pool[:, src]
            else:
                want[dst] = pool[src]
    track(conv, ssm, cache_indices, mask, track_indices, batch, all_layers=all_layers, check_freed_slots=check_freed)
    assert torch.equal(conv, want_conv) and torch.equal(ssm, want_ssm)
    assert not torch.equal(conv, _r(*lead, 12, 6, 3, g=_gen(5)))  # something was copied
