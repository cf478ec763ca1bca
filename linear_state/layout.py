"""The shape of one sequence's linear-attention state: what a slot of the pool holds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["StateLayout"]


def _is_int(v: object) -> bool:
    """An int (numpy's too), never a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Per-sequence linear-attention state of a hybrid model, across all its linear layers.

    A slot of :class:`~linear_state.LinearStatePool` holds, for each of ``num_layers`` linear
    layers, one conv window of ``conv_shape`` (``conv_dtype``) and one recurrent state of
    ``recurrent_shape`` (``recurrent_dtype``).

    ``model_layers``, when given, names the model layer of each slot layer (slot layer ``i`` holds
    the state of model layer ``model_layers[i]``; hybrid models number their layers over attention
    and linear layers alike). The dtypes are explicit: a state of a wider dtype is never silently
    narrowed into a slot (see :mod:`radixcache.hf`).

    :raises ValueError: a non-positive layer count or dimension, a non-floating dtype, or
        ``model_layers`` not ``num_layers`` distinct non-negative ascending ints.
    :raises TypeError: a layer count, a dimension or a model layer id that is not an int (a bool,
        a float, a str), a dtype that is not a ``torch.dtype``.
    """

    num_layers: int
    conv_shape: tuple[int, ...]
    recurrent_shape: tuple[int, ...]
    conv_dtype: torch.dtype = torch.bfloat16
    recurrent_dtype: torch.dtype = torch.float32
    model_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.num_layers):
            raise TypeError(f"num_layers must be an int, got {self.num_layers!r}")
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        object.__setattr__(self, "num_layers", int(self.num_layers))
        for name, shape in (("conv_shape", self.conv_shape), ("recurrent_shape", self.recurrent_shape)):
            if not isinstance(shape, (tuple, list, torch.Size)) or not all(_is_int(d) for d in shape):
                raise TypeError(f"{name} must be a tuple of ints, got {shape!r}")
            if not shape or any(d <= 0 for d in shape):
                raise ValueError(f"{name} must be non-empty with positive dims, got {shape}")
            object.__setattr__(self, name, tuple(int(d) for d in shape))
        for name, dtype in (("conv_dtype", self.conv_dtype), ("recurrent_dtype", self.recurrent_dtype)):
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"{name} must be a torch.dtype, got {dtype!r}")
            if not dtype.is_floating_point:
                raise ValueError(f"{name} must be a floating dtype, got {dtype}")
        if self.model_layers is not None:
            if not isinstance(self.model_layers, (tuple, list)) or not all(_is_int(i) for i in self.model_layers):
                raise TypeError(f"model_layers must be a tuple of ints, got {self.model_layers!r}")
            ids = tuple(int(i) for i in self.model_layers)
            if len(ids) != self.num_layers or any(i < 0 for i in ids) or list(ids) != sorted(set(ids)):
                raise ValueError(
                    f"model_layers must be {self.num_layers} distinct ascending layer ids >= 0, got {self.model_layers}"
                )
            object.__setattr__(self, "model_layers", ids)

    @classmethod
    def from_hf_config(
        cls, config: Any, *, conv_dtype: torch.dtype | None = None, recurrent_dtype: torch.dtype | None = None
    ) -> StateLayout:
        """The layout of a transformers hybrid model from its config (see :mod:`linear_state.hf`:
        the families covered, each family's own state shapes, which layers are linear; the conv
        state in the model's dtype, the recurrent state in float32, unless overridden).

        :raises ValueError: a family not covered (with the reason for those transformers ships).
        :raises ImportError: transformers is not installed (``pip install 'radixcache[hf]'``).
        """
        from .hf import layout_fields

        f = layout_fields(config, conv_dtype=conv_dtype, recurrent_dtype=recurrent_dtype)
        return cls(
            f["num_layers"],
            f["conv_shape"],
            f["recurrent_shape"],
            conv_dtype=f["conv_dtype"],
            recurrent_dtype=f["recurrent_dtype"],
            model_layers=f["model_layers"],
        )

    @property
    def conv_bytes_per_layer(self) -> int:
        """Bytes of one layer's conv window."""
        return math.prod(self.conv_shape) * self.conv_dtype.itemsize

    @property
    def recurrent_bytes_per_layer(self) -> int:
        """Bytes of one layer's recurrent state."""
        return math.prod(self.recurrent_shape) * self.recurrent_dtype.itemsize

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one slot's conv and recurrent state as whole tensors, every layer's:
        ``(num_layers, *conv_shape)`` and ``(num_layers, *recurrent_shape)``."""
        return (self.num_layers, *self.conv_shape), (self.num_layers, *self.recurrent_shape)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: every layer's conv window plus recurrent state."""
        return self.num_layers * (self.conv_bytes_per_layer + self.recurrent_bytes_per_layer)

    @classmethod
    def for_gdn(
        cls,
        num_layers: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        *,
        conv_dtype: torch.dtype = torch.bfloat16,
        recurrent_dtype: torch.dtype = torch.float32,
    ) -> StateLayout:
        """Layout of Gated DeltaNet layers (Qwen3-Next, Qwen3.5).

        The causal conv runs over q, k and v together, so it has
        ``2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim`` channels and keeps the last
        ``conv_kernel - 1`` inputs. The recurrent state is one ``[head_k_dim, head_v_dim]`` matrix per
        value head.

        >>> StateLayout.for_gdn(1, 1, 1, 2, 2, 4).conv_shape
        (6, 3)

        :raises ValueError: ``conv_kernel < 2`` or any non-positive size.
        """
        if conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2 (the state keeps conv_kernel - 1 inputs), got {conv_kernel}")
        channels = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
        return cls(
            num_layers=num_layers,
            conv_shape=(channels, conv_kernel - 1),
            recurrent_shape=(num_v_heads, head_k_dim, head_v_dim),
            conv_dtype=conv_dtype,
            recurrent_dtype=recurrent_dtype,
        )

    @classmethod
    def for_mamba2(
        cls,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int = 1,
        conv_kernel: int = 4,
        *,
        conv_dtype: torch.dtype = torch.bfloat16,
        recurrent_dtype: torch.dtype = torch.float32,
    ) -> StateLayout:
        """Layout of Mamba2 layers (Nemotron-H, Jamba-style hybrids).

        The conv runs over x, B and C: ``num_heads * head_dim + 2 * n_groups * state_size`` channels,
        keeping ``conv_kernel - 1`` inputs; the SSM state is ``[num_heads, head_dim, state_size]``.

        :raises ValueError: ``conv_kernel < 2`` or any non-positive size.
        """
        if conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2 (the state keeps conv_kernel - 1 inputs), got {conv_kernel}")
        channels = num_heads * head_dim + 2 * n_groups * state_size
        return cls(
            num_layers=num_layers,
            conv_shape=(channels, conv_kernel - 1),
            recurrent_shape=(num_heads, head_dim, state_size),
            conv_dtype=conv_dtype,
            recurrent_dtype=recurrent_dtype,
        )
