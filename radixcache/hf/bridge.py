"""The bridge between a pool slot and a transformers cache, for every covered hybrid family.

A host running a transformers hybrid model keeps one cache object per request
(``bridge.new_cache()``: transformers' ``DynamicCache`` for the model's config). The bridge moves
the linear states between that object and pool slots:

- :meth:`HFStateBridge.load`: a slot's states into a fresh cache, marked as a continuation (the
  next forward extends them instead of starting from zero): the state of a hit, restored.
- :meth:`HFStateBridge.store`: the cache's states after a forward into a slot: a capture (split
  the forward at the capture's depth: forward ``[start, depth)``, store, forward ``[depth, end)``),
  or the live state before ``finish`` donates it.

Attention KV is not the bridge's: the host keeps its KV by index (the tree's ``kv_indices``) and
appends a hit's prefix to the cache's attention layers itself (:meth:`HFStateBridge.attention_layers`
names them; :class:`~radixcache.hf.HFSequence` shows how).

Layouts are :meth:`StateLayout.from_hf_config <linear_state.StateLayout.from_hf_config>`'s: each
family's own shapes, transformers' ``kernel``-column conv windows, pool layer ``i`` = model layer
``layout.model_layers[i]``.

Decode batches: transformers' caches hold one batch of equal-length rows, so per-request caches of
different lengths are stacked for one decode forward by :meth:`HFStateBridge.batch` (linear
states stacked as they are; attention KV left-padded, with the attention mask and position ids
that hide the padding) and split back by :meth:`HFStateBridge.unbatch`. Every covered family's
batched decode equals its one-request decode within fp32 rounding (checked per family by the
tests), so :class:`~radixcache.testing.hf_engine.HFEngine` decodes its running requests in one forward.

Precision: :meth:`store` never narrows silently. A state wider than its slot's dtype (an fp32 conv
state into a bf16 slot, say) raises :class:`PrecisionLoss` with ``on_narrowing="raise"`` (the
default), or is narrowed with one ``RuntimeWarning`` per bridge with ``"warn"``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from linear_state import Fence, LinearStatePool, PrecisionLoss, RequestOwner, StateLayout, check_device
from linear_state.hf import CONV_ONLY, INEXACT, hf_family

try:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("radixcache.hf needs transformers: pip install 'radixcache[hf]'") from e

__all__ = ["DecodeBatch", "HFStateBridge", "PrecisionLoss"]


@dataclass(frozen=True)
class DecodeBatch:
    """Per-request caches stacked for one decode forward (:meth:`HFStateBridge.batch`).

    Forward it as ``model(input_ids=ids[:, None], attention_mask=attention_mask,
    position_ids=position_ids, cache=cache, use_cache=True)``, then :meth:`HFStateBridge.unbatch`.

    :ivar cache: the batched transformers cache (row ``b`` is request ``b``).
    :ivar attention_mask: ``[batch, max(lengths) + 1]``, 0 on each row's left padding.
    :ivar position_ids: ``[batch, 1]``, each row's own position (its length).
    :ivar lengths: the tokens each request's cache held when stacked.
    """

    cache: Any
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    lengths: tuple[int, ...]


def _is_linear(layer: Any) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _is_attention(layer: Any) -> bool:
    return isinstance(layer, DynamicLayer) and layer.keys is not None


def _set_length(layer: Any, tokens: int) -> None:
    """Set a linear layer's token count where transformers keeps one. From 5.25 a linear layer
    counts its tokens and a cache whose layer 0 is linear reports that count as its sequence length,
    which positions the next forward: a state written in without it would be continued from
    position 0. Older versions count none (nothing to set)."""
    count = getattr(layer, "cumulative_length_linear", None)
    if isinstance(count, torch.Tensor):
        count.fill_(tokens)


def _wider(src: torch.dtype, dst: torch.dtype) -> bool:
    if src == dst:
        return False
    if src.itemsize != dst.itemsize:
        return src.itemsize > dst.itemsize
    return True  # same width, other format (bf16 vs fp16): either direction loses values


class HFStateBridge:
    """Load and store a transformers hybrid model's linear states (see the module docstring).

    :param config: the model's config (a ``PretrainedConfig`` of a covered family).
    :param layout: the pool's layout (default: ``StateLayout.from_hf_config(config)``); it must name
        its ``model_layers``.
    :param on_narrowing: ``"raise"`` (default) or ``"warn"`` (once per bridge) when a state is wider
        than its slot.
    :param device: where the model (and so the cache's states) lives.
    :param allow_inexact: serve a family of :data:`linear_state.hf.INEXACT` anyway (its hits will
        not equal its cold runs within 1e-5: transformers' own forward does not).
    :raises ValueError: an uncovered family (or an inexact one, see ``allow_inexact``), a layout
        whose layers or shapes are not the config's.
    """

    def __init__(
        self,
        config: Any,
        layout: StateLayout | None = None,
        *,
        on_narrowing: Literal["raise", "warn"] = "raise",
        device: torch.device | str = "cpu",
        allow_inexact: bool = False,
    ) -> None:
        family = hf_family(config)
        if family in INEXACT and not allow_inexact:
            raise ValueError(f"{family}: {INEXACT[family]} (pass allow_inexact=True to serve it anyway)")
        if on_narrowing not in ("raise", "warn"):
            raise ValueError(f"on_narrowing must be 'raise' or 'warn', got {on_narrowing!r}")
        auto = StateLayout.from_hf_config(config)
        layout = auto if layout is None else layout
        if layout.model_layers != auto.model_layers:
            raise ValueError(
                f"layout model_layers {layout.model_layers} are not the config's linear layers {auto.model_layers}"
            )
        if (layout.conv_shape, layout.recurrent_shape) != (auto.conv_shape, auto.recurrent_shape):
            raise ValueError(
                f"layout shapes {layout.conv_shape}, {layout.recurrent_shape} are not the config's "
                f"{auto.conv_shape}, {auto.recurrent_shape}"
            )
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.layout = layout
        self.on_narrowing = on_narrowing
        self.conv_only = family in CONV_ONLY  # no recurrent state: the slot's is a placeholder
        self.device = check_device(device)
        self.narrowed = 0  # states narrowed so far (with on_narrowing="warn")
        assert layout.model_layers is not None
        self._layers: tuple[int, ...] = layout.model_layers

    def new_cache(self) -> Any:
        """A fresh transformers cache for one request (batch 1) of this model."""
        return DynamicCache(config=self.config)

    def attention_layers(self, cache: Any) -> list[int]:
        """The cache's layers that hold attention KV (the host appends a hit's prefix to them)."""
        return [i for i, layer in enumerate(cache.layers) if isinstance(layer, DynamicLayer)]

    def batch(self, caches: Sequence[Any], lengths: Sequence[int]) -> DecodeBatch:
        """Stack per-request caches of this model (batch 1 each, ``lengths[b]`` tokens in
        ``caches[b]``) into one cache for a decode forward of one token per request: linear
        states stacked, attention KV left-padded with zeros to the longest, the padding masked.
        The caches are read, not changed. O(total KV).

        :raises ValueError: no caches, lengths not one non-negative int per cache, a cache whose
            attention layers hold another length, or a cache with no state yet (no forward ran).
        """
        n = len(caches)
        if n == 0:
            raise ValueError("batch of no caches")
        lens = tuple(lengths)
        if len(lens) != n or any(type(x) is not int or x < 0 for x in lens):
            raise ValueError(f"lengths {lens!r} are not one non-negative int for each of the {n} caches")
        width = max(lens)
        out = DynamicCache(config=self.config)
        layers: list[Any] = list(out.layers)
        for i, layer in enumerate(layers):
            src = [c.layers[i] for c in caches]
            if _is_linear(layer):
                for s in range(layer.number_of_states):
                    k = src[0].conv_kernel_size[s]
                    for conv, what in ((True, "conv"), (False, "recurrent")):
                        init = "is_conv_states_initialized" if conv else "is_recurrent_states_initialized"
                        have = [getattr(x, init)[s] for x in src]
                        if not any(have):
                            continue
                        if not all(have):
                            raise ValueError(f"cache layer {i} holds no {what} state in some request: forward first")
                        states = [(x.conv_states if conv else x.recurrent_states)[s] for x in src]
                        t = torch.cat(states)
                        if conv:
                            layer.lazy_initialization(conv_states=t, state_idx=s, conv_kernel_size=k)
                            layer.conv_states[s].copy_(t)
                        else:
                            layer.lazy_initialization(recurrent_states=t, state_idx=s)
                            layer.recurrent_states[s].copy_(t)
                    layer.has_previous_state[s] = all(x.has_previous_state[s] for x in src)
                _set_length(layer, width)  # as the padded attention layers hold
            if _is_attention(src[0]):
                keys, values = src[0].keys, src[0].values
                pk = keys.new_zeros(n, keys.shape[1], width, keys.shape[3])
                pv = values.new_zeros(n, values.shape[1], width, values.shape[3])
                for b, (x, m) in enumerate(zip(src, lens, strict=True)):
                    if x.keys is None or x.keys.shape[2] != m:
                        got = None if x.keys is None else x.keys.shape[2]
                        raise ValueError(f"cache {b} layer {i} holds {got} KV tokens, its length says {m}")
                    pk[b, :, width - m :] = x.keys[0]
                    pv[b, :, width - m :] = x.values[0]
                layer.update(pk, pv)
        mask = torch.ones(n, width + 1, dtype=torch.long, device=self.device)
        for b, m in enumerate(lens):
            mask[b, : width - m] = 0
        pos = torch.tensor(lens, dtype=torch.long, device=self.device).unsqueeze(1)
        return DecodeBatch(out, mask, pos, lens)

    def unbatch(self, batch: DecodeBatch, caches: Sequence[Any]) -> None:
        """After the decode forward of ``batch``: append each row's new KV token to its
        request's cache and copy its linear states back (the caches it was stacked from, in
        order). O(batch).

        :raises ValueError: not as many caches as the batch has rows, or no forward ran. Nothing
            changed (checked before the first cache is written).
        """
        if len(caches) != len(batch.lengths):
            raise ValueError(f"{len(caches)} caches for a batch of {len(batch.lengths)}")
        width = max(batch.lengths)
        layers: list[Any] = list(batch.cache.layers)
        for i, layer in enumerate(layers):
            if _is_attention(layer) and layer.keys.shape[2] != width + 1:
                raise ValueError(f"batched layer {i} holds {layer.keys.shape[2]} tokens: run the forward first")
        for i, layer in enumerate(layers):
            dst = [c.layers[i] for c in caches]
            if _is_linear(layer):
                for s in range(layer.number_of_states):
                    for b, x in enumerate(dst):
                        if layer.is_conv_states_initialized[s]:
                            x.conv_states[s].copy_(layer.conv_states[s][b : b + 1])
                        if layer.is_recurrent_states_initialized[s]:
                            x.recurrent_states[s].copy_(layer.recurrent_states[s][b : b + 1])
                for b, x in enumerate(dst):
                    _set_length(x, batch.lengths[b] + 1)
            if _is_attention(layer):
                for b, x in enumerate(dst):
                    x.update(layer.keys[b : b + 1, :, width:], layer.values[b : b + 1, :, width:])

    def _linear(self, cache: Any, i: int) -> Any:
        layer = cache.layers[i]
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise ValueError(f"cache layer {i} is {type(layer).__name__}, not a linear layer")
        return layer

    def load(self, pool: LinearStatePool, slot: int, cache: Any, *, tokens: int) -> None:
        """Write ``slot``'s states (after the pool's pending work on it) into ``cache``, a fresh
        cache of this model, as the state after a prefix of ``tokens`` tokens: the next forward
        continues from it, at position ``tokens``.

        ``tokens`` is the hit's depth (``Admission.cached_length``). transformers 5.25 and later
        count a linear layer's tokens and position the next forward by that count when the model's
        first layer is linear; the count is set here, so the host need not pass ``position_ids``.

        :raises ValueError: ``tokens`` is not a non-negative int, or ``cache`` is not a fresh cache
            of this model's layers. Nothing changed.
        """
        if type(tokens) is not int or tokens < 0:
            raise ValueError(f"tokens must be the prefix's length, a non-negative int; got {tokens!r}")
        for i in self._layers:
            layer = self._linear(cache, i)
            if layer.is_conv_states_initialized[0] or layer.has_previous_state[0]:
                raise ValueError(f"cache layer {i} already holds a state: load into a fresh cache")
        conv, rec = pool.read(slot)
        k = self.layout.conv_shape[-1]
        for j, i in enumerate(self._layers):
            layer = cache.layers[i]
            c = conv[j].unsqueeze(0).to(device=self.device, dtype=self.layout.conv_dtype)
            r = None if self.conv_only else rec[j].unsqueeze(0).to(device=c.device)
            layer.lazy_initialization(conv_states=c, recurrent_states=r, conv_kernel_size=k)
            layer.conv_states[0].copy_(c)
            if r is not None:
                layer.recurrent_states[0].copy_(r)
            layer.has_previous_state[0] = True
            _set_length(layer, tokens)

    def store(
        self, cache: Any, pool: LinearStatePool, slot: int, *, owner: RequestOwner, after: tuple[Fence, ...] = ()
    ) -> Fence:
        """Copy ``cache``'s current linear states (batch row 0) into ``slot``, a slot ``owner`` (the
        request whose cache it is) holds: a pool write, ordered behind ``after``; returns its fence.

        :raises TypeError: ``owner`` is not a :class:`~linear_state.RequestOwner` (it is required:
            without it a write could land in another request's slot).
        :raises linear_state.SlotMisuse: ``slot`` is not ``owner``'s (another request's, a tree
            snapshot, free); nothing was written.
        :raises PrecisionLoss: a state wider than the slot's dtype, with ``on_narrowing="raise"``;
            nothing was written.
        :raises ValueError: a layer has no state yet (no forward ran), or shapes differ.
        """
        if not isinstance(owner, RequestOwner):
            raise TypeError(f"store needs the owner of the request whose state it writes, got {owner!r}")
        pool.check_writable(slot, owner)
        convs, recs = [], []
        for i in self._layers:
            layer = self._linear(cache, i)
            c, r = layer.conv_states[0], layer.recurrent_states[0]
            if self.conv_only and c is not None:
                r = c.new_zeros((1, *self.layout.recurrent_shape), dtype=self.layout.recurrent_dtype)
            if c is None or r is None:
                raise ValueError(f"cache layer {i} holds no state yet: run a forward first")
            convs.append(c[0])
            recs.append(r[0])
        conv, rec = torch.stack(convs), torch.stack(recs)
        for what, t, dtype in (("conv", conv, self.layout.conv_dtype), ("recurrent", rec, self.layout.recurrent_dtype)):
            if _wider(t.dtype, dtype):
                msg = f"the {what} state is {t.dtype}, the slot keeps {dtype}: storing it loses precision"
                if self.on_narrowing == "raise":
                    raise PrecisionLoss(msg + " (pass on_narrowing='warn', or a layout of the state's dtype)")
                if not self.narrowed:
                    warnings.warn(msg + " (reported once per bridge)", RuntimeWarning, stacklevel=2)
                self.narrowed += 1
        conv = conv.to(dtype=self.layout.conv_dtype, device=pool.device)
        rec = rec.to(dtype=self.layout.recurrent_dtype, device=pool.device)
        return pool.write(slot, conv, rec, owner=owner, after=after)
