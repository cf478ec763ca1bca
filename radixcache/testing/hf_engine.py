"""A host engine on a real transformers hybrid model (the hammer's ``--model hf:FAMILY``): continuous
batching of :class:`~radixcache.hf.HFSequence` s around ``model(...)``. Needs the ``hf`` extra.

One transformers cache object per running request. Per step: one prefill window of every
prefilling request (plan; forward split at each capture's depth, the bridge storing the state
there; commit), admissions (a hit: the live slot's state loaded into a fresh cache and the tree's
KV of the prefix appended to its attention layers), one decode token of every decoding request,
then greedy sampling; at finish the cache's state is stored into the live slot, which the manager
donates. Decode is batched: the decoding requests' caches are stacked for one forward
(:meth:`HFStateBridge.batch <radixcache.hf.bridge.HFStateBridge.batch>`: linear states stacked,
attention KV left-padded and masked), planned with ``plan_decode_batch`` and committed with
``commit_batch``, then split back; ``batch_decode=False`` decodes request by request.

The engine keeps the attention KV by index (:class:`KVStore`): the tree's ``kv_indices`` are rows
of it, so a later hit reads the KV another request computed. Everything runs on the CPU's
immediate stream: each pool write is complete when it returns.

It is duck-typed to :class:`~radixcache.testing.engine.ReferenceEngine` for the hammer
(``radixcache hammer --model hf:FAMILY``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from linear_state import LinearStatePool, RequestOwner

from ..core.kv import KVFreeList
from ..core.tree import HybridRadixCache
from ..hf.bridge import HFStateBridge
from ..hf.sequence import HFSequence, KVStore
from ..manager.cache_manager import Admission, CacheManager
from ..policies import HitDensity, Policy
from .engine import EngineRequest, ServingQueue, check_policy_clock, take_token

__all__ = ["HFEngine"]


@dataclass(eq=False)
class _Running:
    req: EngineRequest
    seq: HFSequence
    next_token: int | None = None

    @property
    def computed(self) -> int:
        """Tokens in the request's cache (the serving queue's progress reads it)."""
        return self.seq.computed


class HFEngine(ServingQueue):
    """Serves :class:`~radixcache.testing.engine.EngineRequest` s (text, base model) with a
    transformers hybrid model and a radix prefix cache (see the module docstring).

    :param model: a causal LM of a covered family (``radixcache.hf.families.tiny_model``).
    :param config: its config.
    :param policy: the manager's policy (default ``HitDensity(block=track_align)``).
    :param host_slots: the tree's host tier in snapshots (``None``: the manager's default, 0: none).
    :param batch_decode: decode every decoding request in one forward (default), or one by one.
    :param policy_clock: the policy's clock, ``"wall"`` or ``"steps"`` (as the reference engine's).
    :raises TypeError: ``batch_decode`` not a bool. :raises ValueError: a count below its least
        value (``max_running``, ``kv_tokens``, ``chunk``, ``track_slots``, ``track_align`` >= 1;
        ``snapshot_slots``, ``host_slots`` >= 0), an unknown ``policy_clock``. Both before anything
        is built.
    """

    def __init__(
        self,
        model: Any,
        config: Any,
        *,
        max_running: int = 4,
        snapshot_slots: int = 256,
        kv_tokens: int = 65536,
        chunk: int = 256,
        track_slots: int = 2,
        track_align: int = 64,
        policy: Policy | None = None,
        host_slots: int | None = None,
        batch_decode: bool = True,
        policy_clock: str = "wall",
    ) -> None:
        check_policy_clock(policy_clock)
        if type(batch_decode) is not bool:
            raise TypeError(f"batch_decode must be a bool, got {batch_decode!r}")
        for name, v, lo in (
            ("max_running", max_running, 1),
            ("snapshot_slots", snapshot_slots, 0),
            ("kv_tokens", kv_tokens, 1),
            ("chunk", chunk, 1),
            ("track_slots", track_slots, 1),
            ("track_align", track_align, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if host_slots is not None and (
            isinstance(host_slots, bool) or not isinstance(host_slots, int) or host_slots < 0
        ):
            raise ValueError(f"host_slots must be None or an int >= 0, got {host_slots!r}")
        self.model = model
        self.batch_decode = batch_decode
        self.decode_forwards = 0  # decode forwards run (a batch counts once)
        self.bridge = HFStateBridge(config)
        layout = self.bridge.layout
        self.device = torch.device("cpu")
        self.pool = LinearStatePool(layout, max_running * (1 + track_slots) + snapshot_slots)
        self.kv = KVFreeList(kv_tokens)
        self.kv_store = KVStore(model, self.bridge, kv_tokens)
        host = LinearStatePool(layout, host_slots) if host_slots else None
        self.cache = HybridRadixCache(self.pool, host_pool=host)
        self.manager = CacheManager(
            self.cache,
            policy if policy is not None else HitDensity(block=track_align),
            track_slots=track_slots,
            host_tier="auto" if host_slots is None else None,
            kv=self.kv,  # the manager keeps the KV tables and frees into self.kv
            clock=self.step_clock if policy_clock == "steps" else time.monotonic,
        )
        self.host_pool = self.cache.host_pool
        self.forensics = self.manager.forensics  # the manager's default: sampled
        self.max_running, self.chunk = max_running, chunk
        self.waiting: deque[EngineRequest] = deque()
        self.running: dict[Hashable, Any] = {}
        self.finished: list[EngineRequest] = []
        self._progress = 0

    # ---------------------------------------------------------------- public
    def submit(self, req: EngineRequest, *, front: bool = False) -> None:
        """Queue a text request of the base model.

        :raises ValueError: images or a namespace (the HF host serves plain text)."""
        if req.images or req.namespace is not None:
            raise ValueError("the HF engine serves text requests of the base model only")
        req.t_submit = time.perf_counter()
        (self.waiting.appendleft if front else self.waiting.append)(req)

    def drain(self) -> None:
        """Nothing is queued on any stream: everything ran already."""

    def step(self) -> None:
        """Prefill one window of each prefilling request, admit, decode one token of each decoding
        request, sample, finish what is done."""
        self.steps += 1
        for r in [r for r in self.running.values() if r.seq.computed < len(r.req.prompt)]:
            logits = self._prefill(r)
            if logits is not None:
                self._sample(r, logits)
        self._admit()
        decoding = [r for r in self.running.values() if r.next_token is not None]
        if self.batch_decode and len(decoding) > 1:
            for r, logits in zip(decoding, self._decode_batch(decoding), strict=True):
                self._sample(r, logits)
        else:
            for r in decoding:
                self._sample(r, self._decode(r))

    # ------------------------------------------------------------- internals
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            adm = self.manager.admit(req.rid, req.prompt, max_new_tokens=req.max_new_tokens)
            if not isinstance(adm, Admission):
                return
            self.waiting.popleft()
            seq = HFSequence(self.manager, self.model, self.bridge, self.kv_store, adm, req.prompt)
            req.cached_length = adm.cached_length
            req.t_admit = time.perf_counter()
            self.running[req.rid] = _Running(req, seq)
            self._progress += 1

    def _prefill(self, r: _Running) -> torch.Tensor | None:
        end = min(len(r.req.prompt), r.seq.computed + self.chunk)
        logits = r.seq.prefill(end)
        return logits if end == len(r.req.prompt) else None

    def _decode(self, r: _Running) -> torch.Tensor:
        tok = r.next_token
        assert tok is not None
        r.next_token = None
        self.decode_forwards += 1
        return r.seq.decode(tok)

    def _decode_batch(self, batch: list[_Running]) -> torch.Tensor:
        """One decode token of each request of ``batch`` in one forward; its logits, row by row."""
        tokens = [r.next_token for r in batch if r.next_token is not None]
        assert len(tokens) == len(batch), "a decoding request without its next token"
        plan = self.manager.plan_decode_batch([r.req.rid for r in batch], tokens)
        caches = [r.seq.cache for r in batch]
        stacked = self.bridge.batch(caches, [r.seq.computed for r in batch])
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor(tokens, dtype=torch.long).unsqueeze(1),
                attention_mask=stacked.attention_mask,
                position_ids=stacked.position_ids,
                cache=stacked.cache,
                use_cache=True,
            )
        self.decode_forwards += 1
        self.bridge.unbatch(stacked, caches)
        by_rid = {r.req.rid: r for r in batch}
        for rid, p in plan.plans.items():  # a decode window is one token: captures are after it
            for cap in p.captures:
                self.bridge.store(by_rid[rid].seq.cache, self.pool, cap.slot, owner=RequestOwner(rid), after=p.after)
        at = plan.kv_indices
        assert at is not None
        for i, r in enumerate(batch):
            r.next_token = None
            self.kv_store.save(r.seq.cache, r.seq.computed, r.seq.computed + 1, at[i : i + 1])
        self.manager.commit_batch(plan, None)
        for r in batch:
            r.seq.computed += 1
        logits: torch.Tensor = out.logits[:, -1].float()
        return logits

    def _sample(self, r: _Running, logits: torch.Tensor) -> None:
        tok = int(torch.argmax(logits))
        end = take_token(r.req, tok, logits)
        if end is None:
            r.next_token = tok
        else:
            self._end(r, abort=end == "abort")

    def _end(self, r: _Running, *, abort: bool) -> None:
        rid = r.req.rid
        if abort:
            r.seq.abort()
        else:
            r.seq.finish()  # the live slot gets the cache's state, which the manager donates
        r.req.aborted = abort
        r.req.done = True
        self._progress += 1 + r.seq.computed
        del self.running[rid]
        self.finished.append(r.req)
