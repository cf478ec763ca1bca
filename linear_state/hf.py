"""Layouts of the hybrid families transformers ships, read from a model's config.

``StateLayout.from_hf_config(config)`` builds its layout from :func:`layout_fields`. The layout keeps each
family's own per-layer state exactly as transformers' cache holds it (batch dimension dropped), so
a bridge copies tensors without reshaping:

========================  ==================  =========================================  ===================
family (``model_type``)   mixer               conv state                                 recurrent state
========================  ==================  =========================================  ===================
qwen3_next, qwen3_5,      Gated DeltaNet      ``(2 * nk * dk + nv * dv, kernel)``        ``(nv, dk, dv)``
qwen3_5_moe, olmo_hybrid
kimi_linear               KDA                 ``(3 * heads * head_dim, kernel)``         ``(heads, d, d)``
nemotron_h, falcon_h1,    Mamba2              ``(inner + 2 * groups * state, kernel)``   ``(heads, head_dim, state)``
bamba, granitemoehybrid,
zamba2
jamba                     Mamba               ``(inner, kernel)``                        ``(inner, state)``
lfm2, lfm2_moe            short convolution   ``(hidden, L_cache)``                      ``(1,)`` placeholder
========================  ==================  =========================================  ===================

The conv window keeps ``kernel`` columns, as transformers does (``StateLayout.for_gdn`` and
``for_mamba2`` keep ``kernel - 1``, as the fused kernels of serving engines do): a slot filled
from one convention is not readable in the other.

Dtypes: the conv state follows the model's dtype (``config.dtype``, float32 when unset), the
recurrent state is float32 for every family (their kernels accumulate in float32; a narrower state
widens losslessly). Both can be overridden; the layout's repr shows them.

Layout only (the bridge refuses them unless ``allow_inexact=True``): ``bamba`` and ``jamba``, whose
transformers forward cannot continue a prompt from its own cache exactly (:data:`INEXACT`).

LFM2 keeps no recurrent state: its slots carry a one-element placeholder (4 bytes per layer) that
the bridge writes as zero and never loads.

Not covered, and why: ``minimax`` (lightning attention keeps a ``linear_cache`` outside transformers' linear
cache layers), ``recurrent_gemma`` (its state lives in the modules and its prefill always starts
from zero, so a prompt cannot continue from a restored state).

Needs transformers (the ``hf`` extra) only to find which layers are linear.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CONV_ONLY", "FAMILIES", "INEXACT", "UNSUPPORTED", "hf_family", "layout_fields", "linear_layer_ids"]

Shapes = tuple[tuple[int, ...], tuple[int, ...]]


def _gdn(c: Any) -> Shapes:
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    return (2 * nk * dk + nv * dv, c.linear_conv_kernel_dim), (nv, dk, dv)


def _kda(c: Any) -> Shapes:
    h, d = c.linear_num_heads, c.linear_head_dim
    return (3 * h * d, c.linear_conv_kernel_dim), (h, d, d)


def _mamba2(
    heads: str, head_dim: str, state: str, groups: str, kernel: str, inner: Callable[[Any], int]
) -> Callable[[Any], Shapes]:
    def shapes(c: Any) -> Shapes:
        n_heads, n, g, k = getattr(c, heads), getattr(c, state), getattr(c, groups), getattr(c, kernel)
        d_inner = inner(c)
        hd = getattr(c, head_dim, "auto")
        if not isinstance(hd, int):  # "auto" (bamba, granitemoehybrid, falcon_h1) or unset (zamba2)
            hd = d_inner // n_heads
        return (d_inner + 2 * g * n, k), (n_heads, hd, n)

    return shapes


def _expand(c: Any) -> int:
    return int(c.mamba_expand * c.hidden_size)


_MAMBA2_N = _mamba2("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", _expand)


def _short_conv(c: Any) -> Shapes:
    return (c.hidden_size, c.conv_L_cache), (1,)  # no recurrent state: a one-element placeholder


def _jamba(c: Any) -> Shapes:
    inner = int(c.mamba_expand * c.hidden_size)
    return (inner, c.mamba_d_conv), (inner, c.mamba_d_state)


#: model_type -> (mixer, shapes of one linear layer's conv and recurrent state from the config)
FAMILIES: dict[str, tuple[str, Callable[[Any], Shapes]]] = {
    "qwen3_next": ("gated-deltanet", _gdn),
    "qwen3_5_text": ("gated-deltanet", _gdn),
    "qwen3_5_moe_text": ("gated-deltanet", _gdn),
    "olmo_hybrid": ("gated-deltanet", _gdn),
    "kimi_linear": ("kda", _kda),
    "nemotron_h": (
        "mamba2",
        _mamba2(
            "mamba_num_heads",
            "mamba_head_dim",
            "ssm_state_size",
            "n_groups",
            "conv_kernel",
            lambda c: c.mamba_num_heads * c.mamba_head_dim,
        ),
    ),
    "falcon_h1": (
        "mamba2",
        _mamba2(
            "mamba_n_heads",
            "mamba_d_head",
            "mamba_d_state",
            "mamba_n_groups",
            "mamba_d_conv",
            lambda c: c.mamba_d_ssm if c.mamba_d_ssm is not None else _expand(c),
        ),
    ),
    "bamba": (
        "mamba2",
        _mamba2("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", _expand),
    ),
    "granitemoehybrid": (
        "mamba2",
        _mamba2("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", _expand),
    ),
    "zamba2": (
        "mamba2",
        _mamba2("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv", _expand),
    ),
    "jamba": ("mamba", _jamba),
    "lfm2": ("short-conv", _short_conv),
    "lfm2_moe": ("short-conv", _short_conv),
}

#: families without a recurrent state: their slots carry a one-element placeholder in its place
CONV_ONLY = frozenset({"lfm2", "lfm2_moe"})

#: families whose layout is known but whose transformers forward cannot continue a prompt from its
#: own cache exactly (measured on tiny fp32 models with transformers 5.24; no radixcache involved):
#: a prefix cache over transformers' implementation cannot hold the 1e-5 a hit must, so the bridge
#: refuses them unless told otherwise
INEXACT: dict[str, str] = {
    "bamba": "transformers' cached forward (the prompt's second half continued from the cache of its first, "
    "or token by token) differs from one forward of the whole prompt by ~4e-3 in the logits",
    "jamba": "transformers' cached multi-token forward drifts from one forward of the whole prompt "
    "(1.5e-5 in chunks of 5 tokens, 1.2e-4 in a served run), above the 1e-5 a hit must hold",
}

#: families transformers ships with a recurrent or convolutional state that this layout does not cover
UNSUPPORTED: dict[str, str] = {
    "minimax": "lightning attention keeps its state in MiniMaxCache.linear_cache, outside transformers' linear "
    "layers, and transformers' cached forward of it is not exact: a prompt's second half continued from the "
    "cache of its first differs from one forward by 1.6e-3 in the logits (tiny fp32 model, one expert)",
    "recurrent_gemma": "its state lives in the modules and every multi-token forward restarts it from zero",
}


def _text(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def hf_family(config: Any) -> str:
    """The supported ``model_type`` of ``config`` (its text config's, for a multimodal one).

    :raises ValueError: a family not covered (the reason for those transformers ships), or no
        ``model_type`` at all.
    """
    mt = getattr(_text(config), "model_type", None)
    if mt in FAMILIES:
        return str(mt)
    if mt in UNSUPPORTED:
        raise ValueError(f"model_type {mt!r} is not covered: {UNSUPPORTED[mt]}")
    raise ValueError(f"model_type {mt!r} is not a hybrid family radixcache covers (covered: {', '.join(FAMILIES)})")


def _model_dtype(config: Any) -> torch.dtype:
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) and d.is_floating_point else torch.float32


def linear_layer_ids(config: Any) -> tuple[int, ...]:
    """The model layers with a linear state, in order (pool layer ``i`` is model layer
    ``linear_layer_ids(config)[i]``): the layers transformers' cache gives a linear cache layer.

    :raises ImportError: transformers is not installed (``pip install 'radixcache[hf]'``).
    """
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the layers of a transformers config need transformers: pip install 'radixcache[hf]'") from e
    cache = DynamicCache(config=_text(config))
    return tuple(i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin))


def layout_fields(
    config: Any, *, conv_dtype: torch.dtype | None = None, recurrent_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The arguments of the :class:`~linear_state.StateLayout` of a transformers hybrid model (see
    the module docstring): one slot layer per linear model layer (``model_layers``), each family's
    own state shapes, the conv state in the model's dtype and the recurrent state in float32
    unless overridden. ``StateLayout.from_hf_config(config)`` builds the layout from them (this
    module never imports the layout's: the dependency runs one way).

    :raises ValueError: a family not covered, or a config without linear layers.
    :raises ImportError: transformers is not installed.
    """
    family = hf_family(config)
    text = _text(config)
    conv, rec = FAMILIES[family][1](text)
    layers = linear_layer_ids(config)
    if not layers:
        raise ValueError(f"{family} config has no linear layers (layer types: {getattr(text, 'layer_types', None)})")
    return {
        "num_layers": len(layers),
        "conv_shape": conv,
        "recurrent_shape": rec,
        "conv_dtype": conv_dtype or _model_dtype(text),
        "recurrent_dtype": recurrent_dtype or torch.float32,
        "model_layers": layers,
    }
