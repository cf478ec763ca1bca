"""Our Gated DeltaNet layer against transformers' Qwen3-Next implementation (the `hf` extra):
outputs and final conv and recurrent states, float32, 1e-5, for prefills of 1 to 300 tokens and
for prefill followed by decode steps."""

import os

import pytest
import torch

from radixcache.testing.model import GatedDeltaNet, HybridConfig

# CI installs the `hf` extra and must run this check; elsewhere it is skipped without transformers.
if not os.environ.get("CI"):
    pytest.importorskip("transformers")
from transformers import DynamicCache, Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

CFG = HybridConfig(dtype=torch.float32, hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
TOL = 1e-5


def hf_pair(seed: int) -> tuple[GatedDeltaNet, Qwen3NextGatedDeltaNet, Qwen3NextConfig]:
    ours = GatedDeltaNet(CFG, torch.Generator().manual_seed(seed))
    hf_cfg = Qwen3NextConfig(
        hidden_size=CFG.hidden_size,
        linear_num_key_heads=CFG.num_k_heads,
        linear_num_value_heads=CFG.num_v_heads,
        linear_key_head_dim=CFG.head_k_dim,
        linear_value_head_dim=CFG.head_v_dim,
        linear_conv_kernel_dim=CFG.conv_kernel,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=CFG.rms_eps,
        hidden_act="silu",
    )
    theirs = Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).to(torch.float32).eval()
    with torch.no_grad():
        theirs.in_proj_qkvz.weight.copy_(ours.in_proj_qkvz)
        theirs.in_proj_ba.weight.copy_(ours.in_proj_ba)
        theirs.conv1d.weight.copy_(ours.conv_weight.unsqueeze(1))
        theirs.dt_bias.copy_(ours.dt_bias)
        theirs.A_log.copy_(ours.A_log)
        theirs.norm.weight.copy_(ours.norm_weight)
        theirs.out_proj.weight.copy_(ours.out_proj)
    return ours, theirs, hf_cfg


def zero_states() -> tuple[torch.Tensor, torch.Tensor]:
    layout = CFG.state_layout()
    return torch.zeros(layout.conv_shape), torch.zeros(layout.recurrent_shape)


def hf_states(cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    conv = cache.get_conv_state(0)
    rec = cache.get_recurrent_state(0)
    assert conv is not None and rec is not None
    # transformers keeps the last `kernel` inputs; the state proper is the last kernel-1.
    return conv[0, :, 1:], rec[0]


@pytest.mark.parametrize("T", [1, 2, 3, 5, 63, 64, 65, 130, 200, 300])
@torch.no_grad()
def test_prefill_matches_transformers(T: int) -> None:
    ours, theirs, hf_cfg = hf_pair(seed=T)
    x = torch.randn(1, T, CFG.hidden_size, generator=torch.Generator().manual_seed(100 + T))
    cache = DynamicCache(config=hf_cfg)
    ref = theirs(x, cache=cache)
    out, conv, rec, _ = ours.prefill(x[0], *zero_states())
    ref_conv, ref_rec = hf_states(cache)
    torch.testing.assert_close(out, ref[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(conv, ref_conv, atol=TOL, rtol=TOL)
    torch.testing.assert_close(rec, ref_rec, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(("T", "steps"), [(1, 4), (17, 6), (128, 5), (250, 8)])
@torch.no_grad()
def test_prefill_then_decode_matches_transformers(T: int, steps: int) -> None:
    ours, theirs, hf_cfg = hf_pair(seed=7 + T)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(1, T + steps, CFG.hidden_size, generator=gen)
    cache = DynamicCache(config=hf_cfg)
    ref_prefill = theirs(x[:, :T], cache=cache)
    out, conv, rec, _ = ours.prefill(x[0, :T], *zero_states())
    torch.testing.assert_close(out, ref_prefill[0], atol=TOL, rtol=TOL)
    conv_pool, rec_pool = conv.unsqueeze(0).clone(), rec.unsqueeze(0).clone()
    slot = torch.tensor([0])
    for s in range(steps):
        ref = theirs(x[:, T + s : T + s + 1], cache=cache)
        mine = ours.decode(x[0, T + s : T + s + 1], conv_pool, rec_pool, slot)
        torch.testing.assert_close(mine, ref[0], atol=TOL, rtol=TOL)
    ref_conv, ref_rec = hf_states(cache)
    torch.testing.assert_close(conv_pool[0], ref_conv, atol=TOL, rtol=TOL)
    torch.testing.assert_close(rec_pool[0], ref_rec, atol=TOL, rtol=TOL)
