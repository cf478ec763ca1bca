"""Tiny seeded configs of every covered hybrid family, for the hammer and the tests (CPU, fp32).

Each keeps its family's structure (at least one attention layer and linear layers around it, the
family's mixer and cache layer types) at a size that runs in milliseconds; weights come from
``torch.manual_seed(seed)``: nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "HIT_TOLERANCE_PER_GAP",
    "INEXACT_CONFIGS",
    "REALISTIC_LOGIT_GAP",
    "TINY_CONFIGS",
    "hit_tolerance",
    "logit_gap",
    "tiny_config",
    "tiny_model",
]

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_GDN: dict[str, Any] = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_MAMBA2: dict[str, Any] = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4)

# one tiny shape for Qwen3-Next and Qwen3.5-MoE (the same mixer and MoE), one for both LFM2s
_GDN_MOE_TINY: dict[str, Any] = dict(
    _COMMON, num_hidden_layers=4, head_dim=16, **_GDN, **_MOE, shared_expert_intermediate_size=32
)
_LFM2: dict[str, Any] = dict(
    _COMMON, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3
)

#: model_type -> the tiny config's keyword arguments (``AutoConfig.for_model(model_type, **kw)``)
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_next": _GDN_MOE_TINY,
    "qwen3_5_text": dict(_COMMON, num_hidden_layers=4, head_dim=16, **_GDN),
    "qwen3_5_moe_text": _GDN_MOE_TINY,
    "olmo_hybrid": dict(_COMMON, num_hidden_layers=4, **_GDN),
    "kimi_linear": dict(
        _COMMON,
        num_hidden_layers=4,
        num_key_value_heads=4,  # multi-head latent attention: as many KV heads as query heads
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_head_dim=16,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        kv_lora_rank=16,
        q_lora_rank=None,
    ),
    "nemotron_h": dict(
        _COMMON,
        hybrid_override_pattern="M*M-",
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
    ),
    "falcon_h1": dict(
        _COMMON,
        num_hidden_layers=2,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=16,
    ),
    "granitemoehybrid": dict(
        _COMMON,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        **_MAMBA2,
        mamba_chunk_size=16,
    ),
    "zamba2": dict(
        _COMMON,
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "mamba"],
        mamba_d_state=16,
        mamba_d_conv=4,
        n_mamba_heads=4,
        mamba_ngroups=1,
        chunk_size=16,
        attention_head_dim=32,
    ),
    "lfm2": _LFM2,
    "lfm2_moe": dict(
        _LFM2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_dense_layers=1,
    ),
}

#: tiny configs of the families transformers cannot continue exactly (linear_state.hf.INEXACT): the
#: tests measure that it still cannot
INEXACT_CONFIGS: dict[str, dict[str, Any]] = {
    "bamba": dict(_COMMON, num_hidden_layers=4, attn_layer_indices=[1], **_MAMBA2, mamba_chunk_size=16),
    "jamba": dict(
        _COMMON,
        num_hidden_layers=4,
        attn_layer_period=4,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_d_conv=4,
    ),
}


def tiny_config(family: str) -> Any:
    """The tiny fp32 config of ``family`` (a key of :data:`TINY_CONFIGS`).

    :raises ValueError: an unknown family.
    """
    kw = TINY_CONFIGS.get(family, INEXACT_CONFIGS.get(family))
    if kw is None:
        raise ValueError(f"no tiny config for {family!r}; families: {', '.join(TINY_CONFIGS)}")
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(family, **kw)
    cfg.dtype = torch.float32
    return cfg


REALISTIC_LOGIT_GAP = 4.0
"""How far a tiny model's top logit stands above the median one (averaged over a probe prompt's
positions) by default: a trained model's next-token distribution is peaked, and transformers' own
init gives a gap of about 0.45, near-uniform logits that tell little about a wrong state."""

_PROBE = list(range(3, 67))  # the fixed prompt the gap is measured on


def logit_gap(model: Any, ids: list[int] | None = None) -> float:
    """The mean over ``ids``' positions (default: a fixed 64-token probe) of the top logit minus
    the median one. One forward, no cache."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([_PROBE if ids is None else ids])).logits[0].float()
    return float((out.max(-1).values - out.median(-1).values).mean())


HIT_TOLERANCE_PER_GAP = 2.5e-6
"""A prefix hit's first-token logits may differ from the cold run's by this much per unit of
:func:`logit_gap` (1e-5 at :data:`REALISTIC_LOGIT_GAP`). Measured by benchmarks/hf_exactness.py at
gap 4 on every covered family: hits 1.3e-6 to 2.7e-6, transformers' own cached step against a full
forward 1.4e-6 to 3.1e-6 (docs/models.md has the table); the bound leaves at least 3x above both."""


def hit_tolerance(gap: float = REALISTIC_LOGIT_GAP) -> float:
    """The bound a prefix hit's logits must keep to the cold run's on a tiny model of ``gap``
    (:data:`HIT_TOLERANCE_PER_GAP` times the gap; transformers' init, gap about 0.45: use 1e-5
    there too, its drifts are 10x smaller). :raises ValueError: a gap that is not positive."""
    if not gap > 0:
        raise ValueError(f"gap must be positive, got {gap!r}")
    return HIT_TOLERANCE_PER_GAP * max(gap, REALISTIC_LOGIT_GAP)


def tiny_model(family: str, seed: int = 0, *, gap: float | None = REALISTIC_LOGIT_GAP) -> tuple[Any, Any]:
    """``(config, model)``: the tiny config and a causal LM with weights from ``seed``, in eval mode.

    With ``gap`` (default :data:`REALISTIC_LOGIT_GAP`) the output projection is scaled so that the
    top logit stands ``gap`` above the median (:func:`logit_gap`), as a trained model's does; the
    rest of the network is transformers' init. ``gap=None``: transformers' init untouched (logits
    within about 0.7 of each other).

    :raises ValueError: an unknown family, a ``gap`` that is not a positive finite number.
    """
    from transformers import AutoModelForCausalLM

    if gap is not None and (isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 < gap < float("inf")):
        raise ValueError(f"gap must be None or a positive finite number, got {gap!r}")
    cfg = tiny_config(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).eval()  # type: ignore[no-untyped-call]
    if gap is not None:
        head = model.get_output_embeddings()
        if head.weight is model.get_input_embeddings().weight:  # tied: scale the head alone
            head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        with torch.no_grad():
            head.weight.mul_(gap / logit_gap(model))
    return cfg, model
