"""The table of docs/models.md: each family's state shapes and bytes per snapshot at real sizes.

Sizes come from transformers' own default config of each family (no download); ``nemotron_h``'s
default is a 4-layer toy, so its row uses Nemotron-H-8B's published shape instead (the replay
preset ``nemotron-h-8b``). Run ``python -m radixcache.hf.table`` to print it.
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


def real_config(family: str) -> Any:
    """The config a row of the table describes, in bf16 (as the checkpoints ship)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(family, **(_NEMOTRON_H_8B if family == "nemotron_h" else {}))
    cfg.dtype = torch.bfloat16
    return cfg


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


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
        source = "Nemotron-H-8B" if family == "nemotron_h" else "transformers' default config"
        bridge = "layout only (not exact in transformers)" if family in INEXACT else "load / store, hammer"
        rows.append(
            f"| {family} | {mixer} | {source} | {lay.num_layers} / {text.num_hidden_layers} | "
            f"{lay.conv_shape} | {lay.recurrent_shape} | {_mib(lay.slot_bytes)} | {bridge} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(models_table())
