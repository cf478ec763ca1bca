"""The table of docs/models.md: each family's state shapes and bytes per snapshot at real sizes.

Sizes come from transformers' own default config of each family (no download), except where that
default is a toy: ``nemotron_h`` (4 layers; its row is Nemotron-H-8B, the replay preset
``nemotron-h-8b``) and ``lfm2`` / ``lfm2_moe`` (no conv layer; their rows are the model cards'
shapes). Run ``python -m radixcache.hf.table`` to print it.
"""

from __future__ import annotations

from typing import Any

import torch

from linear_state import StateLayout
from linear_state.hf import FAMILIES, INEXACT

__all__ = ["models_table", "real_config"]

# Nemotron-H-8B: 52 layers, 24 Mamba2 (128 heads x 64, state 128, 8 groups), 4 attention, 24 MLP.
_NEMOTRON_H_8B = dict(
    hidden_size=4096,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-",
    mamba_num_heads=128,
    mamba_head_dim=64,
    ssm_state_size=128,
    n_groups=8,
    conv_kernel=4,
)


# LFM2's default configs have no conv layer at all (every layer attention); their rows use the
# model cards' shapes, entered by hand: LFM2-1.2B (16 layers, 10 short-conv) and LFM2-8B-A1B (24
# layers, 18 short-conv), hidden 2048, L_cache 3.
_LFM2_1B2 = dict(hidden_size=2048, num_hidden_layers=16, full_attn_idxs=[2, 5, 8, 10, 12, 14], conv_L_cache=3)
_LFM2_8B_A1B = dict(
    hidden_size=2048,
    num_hidden_layers=24,
    layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
    conv_L_cache=3,
)
_REAL: dict[str, tuple[str, dict[str, Any]]] = {
    "nemotron_h": ("Nemotron-H-8B", _NEMOTRON_H_8B),
    "lfm2": ("LFM2-1.2B (model card)", _LFM2_1B2),
    "lfm2_moe": ("LFM2-8B-A1B (model card)", _LFM2_8B_A1B),
}


def real_config(family: str) -> Any:
    """The config a row of the table describes, in bf16 (as the checkpoints ship)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(family, **_REAL.get(family, ("", {}))[1])
    cfg.dtype = torch.bfloat16
    return cfg


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def models_table() -> str:
    """The markdown table (one row per family of :data:`linear_state.hf.FAMILIES`)."""
    rows = [
        "| family (`model_type`) | mixer | sizes of | linear / all layers | conv state per layer | "
        "recurrent state per layer | bytes per snapshot (bf16 conv, fp32 recurrent) | bridge |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family, (mixer, _) in FAMILIES.items():
        cfg = real_config(family)
        text = cfg.get_text_config()
        lay = StateLayout.from_hf_config(cfg)
        assert lay.model_layers is not None
        source = _REAL[family][0] if family in _REAL else "transformers' default config"
        bridge = "layout only (not exact in transformers)" if family in INEXACT else "load / store, hammer"
        rows.append(
            f"| {family} | {mixer} | {source} | {lay.num_layers} / {text.num_hidden_layers} | "
            f"{lay.conv_shape} | {lay.recurrent_shape} | {_mib(lay.slot_bytes)} | {bridge} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(models_table())
