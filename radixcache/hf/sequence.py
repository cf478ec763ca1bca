"""One request of a transformers host, on a :class:`~radixcache.CacheManager` that owns the KV:
the glue every transformers host writes between ``model(...)`` and the manager's protocol.

:class:`KVStore` keeps the attention K and V rows by KV index (the tree's ``kv_indices`` are rows of
it, so a hit reads KV another request computed). :class:`HFSequence` carries one admitted request:
at construction a hit's state is loaded from the live slot into a fresh transformers cache and the
tree's KV of the prefix appended to its attention layers; :meth:`HFSequence.window` runs a planned
window (forward split at each capture's depth, the bridge storing the state there, the window's
KV saved where the plan says, commit); :meth:`HFSequence.finish` stores the final state into the
live slot, which the manager donates. A host is then a loop of admit, prefill, decode, finish::

    adm = manager.admit(rid, prompt, max_new_tokens=n)
    seq = HFSequence(manager, model, bridge, kv_store, adm, prompt)
    logits = seq.prefill()
    for _ in range(n - 1):
        logits = seq.decode(int(logits.argmax()))
    seq.finish()

Runs on the CPU's immediate stream (each pool write complete when it returns), as
:class:`~radixcache.testing.hf_engine.HFEngine` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from linear_state import RequestOwner

from ..manager.cache_manager import Admission, CacheManager, FinishResult, WindowPlan
from .bridge import HFStateBridge

__all__ = ["HFSequence", "KVStore", "forward_logits"]


class KVStore:
    """Attention K and V rows by KV index, one pair of ``[num_tokens, heads, head_dim]`` tensors per
    attention layer of the model (shapes learnt from one probe forward)."""

    def __init__(self, model: Any, bridge: HFStateBridge, num_tokens: int) -> None:
        cache = bridge.new_cache()
        with torch.no_grad():
            model(input_ids=torch.ones(1, 1, dtype=torch.long), cache=cache, use_cache=True)
        self.layers = bridge.attention_layers(cache)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for i in self.layers:
            keys, values = cache.layers[i].keys, cache.layers[i].values
            self.k[i] = torch.zeros(num_tokens, keys.shape[1], keys.shape[3], dtype=keys.dtype)
            self.v[i] = torch.zeros(num_tokens, values.shape[1], values.shape[3], dtype=values.dtype)

    def save(self, cache: Any, start: int, end: int, idx: torch.Tensor) -> None:
        """Rows ``[start, end)`` of ``cache``'s attention layers into KV indices ``idx``."""
        for i in self.layers:
            layer = cache.layers[i]
            self.k[i][idx] = layer.keys[0, :, start:end].transpose(0, 1)
            self.v[i][idx] = layer.values[0, :, start:end].transpose(0, 1)

    def load(self, cache: Any, idx: torch.Tensor) -> None:
        """Append the KV of ``idx`` (a prefix, in order) to ``cache``'s attention layers."""
        for i in self.layers:
            k = self.k[i][idx].transpose(0, 1).unsqueeze(0)
            v = self.v[i][idx].transpose(0, 1).unsqueeze(0)
            cache.layers[i].update(k, v)


def forward_logits(model: Any, cache: Any, ids: Sequence[int]) -> torch.Tensor:
    """The float32 logits after ``ids``, run through ``model`` on ``cache`` (no grad)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)], dtype=torch.long), cache=cache, use_cache=True)
    logits: torch.Tensor = out.logits[0, -1].float()
    return logits


class HFSequence:
    """One admitted request of a transformers host (see the module docstring).

    :param manager: the manager that admitted it; it must own the KV (``CacheManager(kv=...)``),
        its pool the one ``bridge`` stores into.
    :param adm: the request's :class:`~radixcache.Admission`. A hit is loaded at once (waiting
        its restore's fence).
    :param prompt: the ids the request was admitted with.
    :ivar cache: the request's transformers cache. :ivar computed: tokens in it.
    :raises ValueError: a manager that does not own the KV. :raises TypeError: ``adm`` not an
        ``Admission``. Both before anything is loaded.
    """

    def __init__(
        self,
        manager: CacheManager,
        model: Any,
        bridge: HFStateBridge,
        kv_store: KVStore,
        adm: Admission,
        prompt: Sequence[int],
    ) -> None:
        if manager.kv is None:
            raise ValueError("HFSequence needs a manager that owns the KV: CacheManager(..., kv=KVFreeList(n))")
        if not isinstance(adm, Admission):
            raise TypeError(f"adm must be the request's Admission, got {type(adm).__name__}")
        self.manager, self.model, self.bridge, self.kv_store = manager, model, bridge, kv_store
        self.adm = adm
        self.prompt = list(prompt)
        self.owner = RequestOwner(adm.rid)
        self.cache = bridge.new_cache()
        if adm.cached_length:  # the hit: state from the slot, KV of the prefix from the tree's indices
            adm.ready.wait()
            bridge.load(manager.pool, adm.live_slot, self.cache, tokens=adm.cached_length)
            kv_store.load(self.cache, adm.kv_indices)
        self.computed = adm.cached_length

    def window(self, plan: WindowPlan, ids: Sequence[int]) -> torch.Tensor:
        """Run ``plan`` over ``ids`` (its tokens ``[plan.start, plan.end)``): forward split at each
        capture, whose state the bridge stores into its slot; the window's KV saved into
        ``plan.kv_indices``; commit. Returns the logits after the window's last token.

        :raises ValueError: ``ids`` not the window's length, or a plan of another request.
        """
        if len(ids) != plan.end - plan.start:
            raise ValueError(f"the window [{plan.start}, {plan.end}) needs {plan.end - plan.start} ids, got {len(ids)}")
        if plan.rid != self.adm.rid:
            raise ValueError(f"a plan of request {plan.rid!r} run on request {self.adm.rid!r}")
        pos, logits = plan.start, None
        for cap in plan.captures:
            if cap.depth > pos:
                logits = forward_logits(self.model, self.cache, ids[pos - plan.start : cap.depth - plan.start])
                pos = cap.depth
            self.bridge.store(self.cache, self.manager.pool, cap.slot, owner=self.owner, after=plan.after)
        if plan.end > pos:
            logits = forward_logits(self.model, self.cache, ids[pos - plan.start :])
        assert logits is not None and plan.kv_indices is not None
        self.kv_store.save(self.cache, plan.start, plan.end, plan.kv_indices)
        self.computed = plan.end
        self.manager.commit(plan, None)
        return logits

    def prefill(self, end: int | None = None) -> torch.Tensor:
        """Prefill the prompt's tokens ``[computed, end)`` (default: to the prompt's end) as one
        window; the logits after it.

        :raises ValueError: ``end`` not in ``(computed, len(prompt)]`` (the manager's plan refuses it).
        """
        start, end = self.computed, len(self.prompt) if end is None else end
        return self.window(self.manager.plan_prefill(self.adm.rid, end), self.prompt[start:end])

    def decode(self, token: int) -> torch.Tensor:
        """One decode window of ``token``; the logits after it."""
        return self.window(self.manager.plan_decode(self.adm.rid, [token]), [token])

    def finish(self) -> FinishResult:
        """Store the final state into the live slot and finish: the manager donates it and takes
        the KV the tree does not hold back into its allocator."""
        ready = self.bridge.store(self.cache, self.manager.pool, self.adm.live_slot, owner=self.owner)
        return self.manager.finish(self.adm.rid, ready)

    def abort(self) -> FinishResult:
        """Abort: nothing is donated from the live slot."""
        return self.manager.abort(self.adm.rid)
