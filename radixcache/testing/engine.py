"""A reference serving engine: continuous batching of the reference hybrid model on CacheManager.

Each step: (1) prefill one chunk of every prefilling request (one window of the manager's host
protocol: plan, forward with the planned captures, commit); (2) admit waiting requests (hits
restored); (3) one batched decode over every decoding request (a decode window each); then wait
the forward passes, sample greedily, finish what is done. Forward passes run on a linear_state
stream; with ``deferred=True`` (default) both the forward stream and the copy stream are
:class:`~linear_state.DeferredStream`: forwards run when
the engine needs their logits, copies run as soon as their fences allow (``run_ready``), so an
unordered clone or restore really reads a slot before or after the write it should have waited.

On a CUDA model (``HybridModel(cfg, device="cuda")``) the pools live on the model's device and
both streams are :class:`~linear_state.CudaStream` s: forwards and copies run concurrently on the
GPU, ordered only by the fences' events, as in a real server. Every tensor a forward uses is made
inside its work on the forward stream (or lives as long as the engine), so the CUDA caching
allocator never hands its memory to another stream while the forward still reads it.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from linear_state import CudaStream, DeferredStream, Fence, ImmediateStream, LinearStatePool, RequestOwner, Stream

from ..core.keys import key_bytes
from ..core.kv import KVFreeList
from ..core.multimodal import image_cache_ids
from ..core.tree import HybridRadixCache
from ..forensics import Forensics, Ledger
from ..manager.cache_manager import Admission, CacheManager
from ..policies import Policy
from ..tiers.store import SharedStore
from .inject import make_cache, make_hit_density, make_manager, make_pool, make_shared_tier
from .model import HybridConfig, HybridModel, KVPool

__all__ = [
    "EngineKVCodec",
    "EngineRequest",
    "ReferenceEngine",
    "ServingQueue",
    "ColdJob",
    "check_policy_clock",
    "generate_cold",
    "generate_cold_many",
    "take_token",
]


@dataclass
class EngineRequest:
    """One request and, once served, its results."""

    rid: Hashable
    prompt: list[int]
    max_new_tokens: int
    abort_after: int | None = None  # abort once this many tokens were generated (a dropped stream)
    session: Hashable | None = None  # the conversation it continues, told to the manager's policy
    namespace: Hashable = None  # the tenant's adapter (None: the base model); keys the cache too
    images: list[bytes] = field(default_factory=list)  # one per placeholder run of the prompt
    output: list[int] = field(default_factory=list)
    first_logits: torch.Tensor | None = None
    cached_length: int = 0
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0
    aborted: bool = False
    done: bool = False
    stalled: bool = False  # ended by abort_all (the hammer's watchdog), not by its own life

    def cache_ids(self, placeholder_id: int) -> np.ndarray | list[int]:
        """The ids the cache is keyed on: the prompt, each image's placeholders replaced by ids of
        its bytes (:func:`~radixcache.image_cache_ids`)."""
        return image_cache_ids(self.prompt, placeholder_id, self.images) if self.images else self.prompt


class EngineKVCodec:
    """The reference engine's :class:`~radixcache.tiers.shared.KVCodec`: the K and V rows of every
    attention layer for each token, raw, in the model's dtype."""

    def __init__(self, kv_pool: KVPool, kv: KVFreeList, forward: Stream, cfg: HybridConfig) -> None:
        self.kv_pool, self.kv, self.forward = kv_pool, kv, forward
        k = kv_pool.k
        self._row = (k.shape[0], k.shape[2], k.shape[3])
        self.identity = f"reference-kv layers={k.shape[0]} heads={k.shape[2]} dim={k.shape[3]} dtype={k.dtype}"
        self.bytes_per_token = 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()

    def export_kv(self, kv_indices: torch.Tensor, after: Fence | None) -> bytes:
        """K then V of these tokens (``[layers, tokens, heads, dim]`` each), once ``after`` completed
        (every earlier forward too: they run in order on one stream)."""
        if after is not None:
            after.wait()
        else:
            self.forward.synchronize()
        idx = kv_indices.to(self.kv_pool.k.device)
        k = self.kv_pool.k[:, idx].cpu().contiguous()
        v = self.kv_pool.v[:, idx].cpu().contiguous()
        return k.view(torch.uint8).numpy().tobytes() + v.view(torch.uint8).numpy().tobytes()

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` indices and write ``data`` into them on the forward stream (so
        every later forward reads it). None: the bytes do not fit the layout, or no room."""
        if len(data) != num_tokens * self.bytes_per_token:
            return None
        idx = self.kv.alloc(num_tokens)
        if idx is None:
            return None
        pool = self.kv_pool
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(pool.k.dtype)
        half = raw.numel() // 2
        shape = (self._row[0], num_tokens, self._row[1], self._row[2])
        k, v = raw[:half].reshape(shape), raw[half:].reshape(shape)

        def work() -> None:
            dev = idx.to(pool.k.device)
            pool.k[:, dev] = k.to(pool.k.device)
            pool.v[:, dev] = v.to(pool.v.device)

        self.forward.submit(work, label=f"import KV of {num_tokens} tokens")
        return idx


@dataclass(eq=False)
class _Running:
    req: EngineRequest
    adm: Admission
    computed: int  # tokens fed
    last: Fence | None = None
    next_token: int | None = None


class ServingQueue:
    """What the hammer drives in an engine: a waiting queue, the running requests (each with its
    ``req`` and ``computed`` tokens), the finished ones, and the watchdog's measures. An engine
    subclasses it and provides ``step``, ``drain`` and ``_end(running, abort=)``."""

    waiting: deque[EngineRequest]
    running: dict[Hashable, Any]
    finished: list[EngineRequest]
    _progress: int  # requests admitted and ended so far (see ``progress``)
    steps: int = 0  # scheduler steps run (each engine's ``step`` counts itself)
    STEP_SECONDS = 0.01  # what a step counts on the step clock

    def step_clock(self) -> float:
        """Seconds on the engine's step clock, :data:`STEP_SECONDS` per scheduler step: the
        policy's clock with ``policy_clock="steps"`` (the same figures on every machine)."""
        return self.steps * self.STEP_SECONDS

    @property
    def idle(self) -> bool:
        """Nothing waiting or running."""
        return not self.waiting and not self.running

    @property
    def progress(self) -> int:
        """Tokens fed plus requests admitted and finished: grows on every step that does anything."""
        return self._progress + sum(int(r.computed) for r in self.running.values())

    def abort_all(self) -> int:
        """Abort every running request and drop every waiting one (the hammer's watchdog).
        Returns how many requests were affected."""
        n = len(self.running) + len(self.waiting)
        for r in list(self.running.values()):
            r.req.stalled = True
            self._end(r, abort=True)
        while self.waiting:
            req = self.waiting.popleft()
            self._dropped(req)
            req.aborted = req.done = req.stalled = True
            self.finished.append(req)
        return n

    def run(self) -> list[EngineRequest]:
        """Step until idle; return the finished requests (in finishing order)."""
        while not self.idle:
            self.step()
        self.drain()
        return self.finished

    def step(self) -> None:
        """One scheduler step."""
        raise NotImplementedError

    def drain(self) -> None:
        """Let all queued device work complete."""
        raise NotImplementedError

    def _end(self, r: Any, *, abort: bool) -> None:
        raise NotImplementedError

    def _dropped(self, req: EngineRequest) -> None:
        """A waiting request dropped by :meth:`abort_all` (engines forget what they kept for it)."""


class ReferenceEngine(ServingQueue):
    """Serves :class:`EngineRequest` s with the reference model and a radix prefix cache.

    :param policy: the manager's policy (default: :class:`~radixcache.policies.HitDensity` with
        ``track_align`` blocks: the reference model's kernels expose states at multiples of 64).
    :param track_slots: captures per window.
    :param inject: commit one bug on purpose (see :mod:`radixcache.testing.inject`; the names of
        :data:`~radixcache.testing.inject.FUZZ_BUGS`).
    :param deferred: on the CPU, :class:`~linear_state.DeferredStream` s (default) or immediate
        ones. Ignored for a CUDA model, whose streams are always :class:`~linear_state.CudaStream` s.
    :param host_slots: snapshots the tree's host tier holds (a CPU pool, pinned for a CUDA model);
        0: no host tier, an evicted snapshot is dropped; ``None``: the manager's default
        (``host_tier="auto"``, :data:`~radixcache.core.tree.HOST_TIER_FACTOR` times the device pool).
    :param shared_store: a shared tier's store: snapshots (with their KV, through
        :class:`EngineKVCodec`) are published to it and fetched from it (see
        :mod:`radixcache.tiers.shared`); ``None``: no shared tier.
    :param publisher: this engine's name in the blobs it publishes (a replica's name).
    :param shared_background: the shared tier uploads from its own writer thread
        (``SharedTier(background=True)``).
    :param shared_prefetch: each request's shared-tier probe and fetch start when it is submitted
        (``CacheManager.prefetch``, on the tier's fetcher thread); its admission takes the answer.
        The engine holds the head of its queue back while its prefetch is unanswered, up to
        ``prefetch_wait_s`` (then it is admitted from the tree alone).
    :param prefetch_wait_s: see ``shared_prefetch``.
    :param forward_delay_us: CUDA only: every forward first keeps the GPU busy this long, so a copy
        that does not wait the forward's fence runs while the forward is still pending, as it would
        behind a large model (the tiny reference model's forwards finish before the host queues the
        next copy). The GPU's counterpart of the CPU's deferred streams. It must exceed the host's
        time to queue one forward and its commit (milliseconds of Python here): 0.5 ms exposed
        nothing on an H200.
    :param policy_clock: the policy's clock: ``"wall"`` (default, :func:`time.monotonic`) or
        ``"steps"`` (:meth:`ServingQueue.step_clock`: runs give the same figures on every machine).
    :raises ValueError: ``forward_delay_us`` is negative, or positive for a model not on CUDA; an
        unknown ``policy_clock``.
    """

    def __init__(
        self,
        model: HybridModel,
        *,
        max_running: int = 8,
        snapshot_slots: int = 512,
        kv_tokens: int = 65536,
        chunk: int = 256,
        page_size: int = 1,
        track_align: int = 64,
        track_slots: int = 4,
        policy: Policy | None = None,
        deferred: bool = True,
        inject: str | None = None,
        barrier: str = "fence",
        forensics_ledger: str | None = None,
        record_writes: bool = False,
        forward_delay_us: float = 0.0,
        host_slots: int | None = None,
        shared_store: SharedStore | None = None,
        publisher: str | None = None,
        shared_background: bool = False,
        policy_clock: str = "wall",
        shared_prefetch: bool = False,
        prefetch_wait_s: float = 1.0,
    ) -> None:
        check_policy_clock(policy_clock)
        if forward_delay_us < 0 or (forward_delay_us > 0 and model.device.type != "cuda"):
            raise ValueError(
                f"forward_delay_us={forward_delay_us} needs a value >= 0, and > 0 only for a CUDA model "
                f"(this one is on {model.device})"
            )
        self.model = model
        cfg: HybridConfig = model.cfg
        self.device = model.device
        self.forward: Stream
        self.copies: Stream
        if self.device.type == "cuda":
            self.forward, self.copies = CudaStream(self.device), CudaStream(self.device)
        elif deferred:
            self.forward, self.copies = DeferredStream("forward"), DeferredStream("copies")
        else:
            self.forward, self.copies = ImmediateStream(), ImmediateStream()
        slots = max_running * (1 + track_slots) + snapshot_slots
        self.pool = make_pool(inject, cfg.state_layout(), slots, device=self.device)
        self.kv_pool = KVPool(cfg, kv_tokens, device=self.device)
        self.kv = KVFreeList(kv_tokens)
        self.cache: HybridRadixCache = make_cache(
            inject,
            self.pool,
            page_size=page_size,
            stream=self.copies,
            host_pool=(
                LinearStatePool(cfg.state_layout(), host_slots, pin_memory=self.device.type == "cuda")
                if host_slots
                else None
            ),
        )
        self.kv_codec = EngineKVCodec(self.kv_pool, self.kv, self.forward, cfg)
        self.shared = (
            None
            if shared_store is None
            else make_shared_tier(
                inject,
                shared_store,
                model=f"reference {cfg!r}",
                kv=self.kv_codec,
                publisher=publisher,
                background=shared_background,
            )
        )
        self.forensics = (
            Forensics(self.pool, ledger=Ledger(forensics_ledger), mode="record") if forensics_ledger else None
        )
        self.manager: CacheManager = make_manager(
            inject,
            self.cache,
            policy if policy is not None else make_hit_density(inject, block=track_align),
            track_slots=track_slots,
            barrier=barrier,
            forensics=self.forensics,
            shared=self.shared,
            host_tier="auto" if host_slots is None else None,
            kv=self.kv,  # the manager keeps every request's KV table, and frees the tree's KV here
            clock=self.step_clock if policy_clock == "steps" else time.monotonic,
        )
        self.host_pool = self.cache.host_pool  # the manager's default tier when host_slots is None
        # (forensics step when it ran, request, slot) for every slot a forward wrote: ground truth
        # for tests of the forensics' attribution.
        self.slot_writes: list[tuple[int, Hashable, int]] | None = [] if record_writes else None
        self.max_running = max_running
        self.chunk = chunk
        self._spin_cycles = int(forward_delay_us * _spin_cycles_per_us()) if forward_delay_us else 0
        self.waiting: deque[EngineRequest] = deque()
        self.running: dict[Hashable, Any] = {}
        self.finished: list[EngineRequest] = []
        self._progress = 0  # requests admitted and ended so far (see ``progress``)
        self._ids: dict[Hashable, np.ndarray] = {}  # cache ids of requests not yet ended
        self._stage = torch.empty(0, dtype=torch.int64)  # warm()'s KV staging buffer, reused
        self.shared_prefetch = shared_prefetch
        self.prefetch_wait_s = prefetch_wait_s
        if shared_prefetch and self.manager.shared is not None:
            self.manager.shared.start_prefetching()  # not on the first request's arrival

    # ---------------------------------------------------------------- public
    def submit(self, req: EngineRequest, *, front: bool = False) -> None:
        """Queue a request (at the head of the queue with ``front``).

        :raises ValueError: its placeholder runs and images cannot be paired, or an id is outside
            ``[0, 2**31)``. :raises TypeError: ids that are not integers."""
        # Checked and converted once, here: the manager's calls (prefetch, admit) then take the
        # canonical uint32 words as a byte copy (~1 us for 2,100 ids against ~12 us for a list).
        self._ids[req.rid] = np.frombuffer(key_bytes(req.cache_ids(self.model.cfg.placeholder_id)), dtype=np.uint32)
        req.t_submit = time.perf_counter()
        if self.shared_prefetch:
            self.manager.prefetch(req.rid, self._ids[req.rid], namespace=req.namespace)
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _dropped(self, req: EngineRequest) -> None:
        del self._ids[req.rid]
        if self.shared is not None:
            self.shared.cancel(req.rid)

    def warm(self, prompts: Sequence[Sequence[int]], *, namespace: Hashable = None) -> int:
        """Pre-cache ``prompts`` (system prompts, in ``namespace``: the base model when ``None``, else
        that tenant's adapter) at start-up, as hosts do: each is computed cold in
        a scratch slot and handed to the manager (:meth:`CacheManager.warm`: no request; the policy
        hears of the snapshot), its KV indices staged in one buffer that the engine reuses for the
        next prompt at once. Call it while idle. Returns the tokens cached.

        :raises RuntimeError: requests are running or waiting."""
        if not self.idle:
            raise RuntimeError("warm() runs before serving: requests are running or waiting")
        owner = RequestOwner("warm-up")
        slot = self.pool.alloc(owner)
        pool, kvp, model, page = self.pool, self.kv_pool, self.model, self.cache.page_size
        last: Fence | None = None
        cached = 0
        for prompt in prompts:
            n = len(prompt) // page * page
            fresh = self.kv.alloc(n) if n else None
            if fresh is None:
                continue
            if self._stage.numel() < n:
                self._stage = torch.empty(max(n, 2 * self._stage.numel()), dtype=torch.int64)
            stage = self._stage[:n]
            stage.copy_(fresh)  # what the tree is handed: the staging buffer, rewritten next prompt
            last = pool.zero(slot, owner=owner, stream=self.forward, after=[] if last is None else [last])
            for start in range(0, n, self.chunk):
                end = min(n, start + self.chunk)
                ids = torch.tensor(list(prompt[start:end]))

                def work(
                    ids: torch.Tensor = ids,
                    start: int = start,
                    end: int = end,
                    kv: torch.Tensor = fresh,
                    prompt: Sequence[int] = prompt,
                ) -> None:
                    # its own KV indices, not the staging buffer: a deferred forward may run late;
                    # its embeddings made here, on the forward stream (see the module docstring)
                    x = None if namespace is None else model.inputs(prompt, start, end, namespace=namespace)
                    model.prefill(ids, start, pool, slot, kvp, kv, embeds=x)

                last = self._forward(work, [last], f"warm-up [{start}, {end})")
            res = self.manager.warm(list(prompt[:n]), stage, state_slot=slot, ready=last, namespace=namespace)
            cached += res.length - res.prefix_length
            self._device_progress()
        self.pool.free(slot, owner, after=[] if last is None else [last])
        return cached

    def drain(self) -> None:
        """Let all queued device work complete (and flush the forensics ledger)."""
        self.forward.synchronize()
        self.copies.synchronize()
        if self.forensics is not None:
            self.forensics.flush()

    def close(self) -> None:
        """Drain, then close the forensics ledger's file and stop the shared tier's writer (its
        store stays open: it is the caller's). Idempotent."""
        self.drain()
        if self.forensics is not None:
            self.forensics.close()
        if self.shared is not None:
            self.shared.close()

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """One scheduler step (see the module docstring)."""
        self.steps += 1
        prefilling = [r for r in self.running.values() if r.computed < len(r.req.prompt)]
        decoding = [r for r in self.running.values() if r.next_token is not None]
        ends = [(r, box) for r in prefilling if (box := self._prefill_chunk(r)) is not None]
        self._device_progress()
        self._admit()
        decoded = self._decode(decoding) if decoding else None
        self._device_progress()
        for r, box in ends:  # the engine needs these logits now: their forwards must have run
            assert r.last is not None
            r.last.wait()
            self._sample(r, box["logits"])
        if decoded is not None:
            fence, box = decoded
            fence.wait()
            logits = box["logits"]
            for i, r in enumerate(decoding):
                self._sample(r, logits[i])
        self._device_progress()

    def _device_progress(self) -> None:
        if isinstance(self.copies, DeferredStream):
            self.copies.run_ready()

    # ------------------------------------------------------------- admission
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if self.shared_prefetch:  # its shared-tier answer first (bounded: then from the tree alone)
                deadline = time.monotonic() + self.prefetch_wait_s
                while self.manager.shared_pending(req.rid) and time.monotonic() < deadline:
                    time.sleep(0.0002)
            # The manager reserves the request's KV (prompt and every token it may decode),
            # evicting the tree's KV through its policy when the allocator runs short.
            adm = self.manager.admit(
                req.rid,
                self._ids[req.rid],
                namespace=req.namespace,
                session=req.session,
                max_new_tokens=req.max_new_tokens,
            )
            if not isinstance(adm, Admission):
                return
            self.waiting.popleft()
            req.cached_length = adm.cached_length
            req.t_admit = time.perf_counter()
            self.running[req.rid] = _Running(req, adm, adm.cached_length, adm.ready)
            self._progress += 1
            self._device_progress()

    # --------------------------------------------------------------- forward
    def _prefill_chunk(self, r: _Running) -> dict[str, torch.Tensor] | None:
        """Submit the next prefill chunk and commit its captures. Returns the box its logits land
        in when the chunk ends the prompt."""
        rid, prompt = r.req.rid, r.req.prompt
        start, end = r.computed, min(len(prompt), r.computed + self.chunk)
        plan = self.manager.plan_prefill(rid, end)
        captures = [(c.depth, c.slot) for c in plan.captures]
        after = [f for f in [r.last, *plan.after] if f is not None]
        ids = torch.tensor(prompt[start:end])
        kv_idx = plan.kv_table  # what the window reads, its own tokens' indices last
        assert kv_idx is not None, "the manager owns the KV (kv=)"
        out: dict[str, torch.Tensor] = {}
        model, pool, kvp, live = self.model, self.pool, self.kv_pool, r.adm.live_slot
        req = r.req

        def work() -> None:
            embeds = (
                model.inputs(prompt, start, end, namespace=req.namespace, images=req.images)
                if req.namespace is not None or req.images
                else None
            )
            out["logits"] = model.prefill(ids, start, pool, live, kvp, kv_idx, captures, embeds=embeds)
            self._note_writes(rid, [live, *(t for _, t in captures)])

        r.last = self._forward(work, after, f"prefill {rid} [{start},{end})")
        r.computed = end
        self.manager.commit(plan, r.last)  # the tree's pages come in, duplicates go to self.kv
        self._device_progress()
        return out if end == len(prompt) else None

    def _decode(self, batch: list[_Running]) -> tuple[Fence, dict[str, torch.Tensor]]:
        tokens = [r.next_token for r in batch if r.next_token is not None]
        assert len(tokens) == len(batch), "a decoding request without its next token"
        plan = self.manager.plan_decode_batch([r.req.rid for r in batch], tokens)
        ids = torch.tensor(tokens)
        positions = [r.computed for r in batch]
        slots = torch.tensor([r.adm.live_slot for r in batch])
        kv_idx = plan.kv_tables
        assert kv_idx is not None, "the manager owns the KV (kv=)"
        after = [r.last for r in batch if r.last is not None] + list(plan.after)
        # A decode window is one token: each planned capture is the state after it.
        copies = [(p.live_slot, c.slot, rid) for rid, p in plan.plans.items() for c in p.captures]
        out: dict[str, torch.Tensor] = {}
        model, pool, kvp = self.model, self.pool, self.kv_pool
        namespaces = [r.req.namespace for r in batch]

        def work() -> None:
            bias = _biases(model, namespaces)
            out["logits"] = model.decode(ids, positions, pool, slots, kvp, kv_idx, bias=bias)
            for live, track, _ in copies:
                pool.conv[:, track].copy_(pool.conv[:, live])
                pool.recurrent[:, track].copy_(pool.recurrent[:, live])
            for r in batch:
                self._note_writes(r.req.rid, [r.adm.live_slot])
            for _, track, rid in copies:
                self._note_writes(rid, [track])

        fence = self._forward(work, after, f"decode x{len(batch)}")
        self.manager.commit_batch(plan, fence)
        for r in batch:
            r.computed += 1
            r.last = fence
            r.next_token = None
        return fence, out

    def _forward(self, work: Callable[[], None], after: Sequence[Fence], label: str) -> Fence:
        """Submit a forward on the forward stream (behind the configured GPU delay, if any)."""
        cycles = self._spin_cycles
        if cycles:
            inner = work

            def work() -> None:
                torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
                inner()

        return self.forward.submit(work, after=after, label=label)

    def _note_writes(self, rid: Hashable, slots: list[int]) -> None:
        if self.slot_writes is not None:
            step = self.forensics.step if self.forensics is not None else 0
            self.slot_writes += [(step, rid, s) for s in slots]

    # -------------------------------------------------------------- sampling
    def _sample(self, r: _Running, logits: torch.Tensor) -> None:
        tok = self.model.greedy(logits)
        end = take_token(r.req, tok, logits)
        if end is None:
            r.next_token = tok
        else:
            self._end(r, abort=end == "abort")

    def _end(self, r: _Running, *, abort: bool) -> None:
        rid = r.req.rid
        # The manager gives the request's KV back to self.kv (reused by forwards submitted later).
        if abort:
            self.manager.abort(rid, r.last)
        else:
            self.manager.finish(rid, r.last)
        r.req.aborted = abort
        r.req.done = True
        self._progress += 1 + r.computed  # its tokens leave the running sum
        del self.running[rid]
        del self._ids[rid]
        self.finished.append(r.req)
        self._device_progress()


POLICY_CLOCKS = ("wall", "steps")


def check_policy_clock(clock: object) -> None:
    """:raises ValueError: ``clock`` is not one of :data:`POLICY_CLOCKS`."""
    if clock not in POLICY_CLOCKS:
        raise ValueError(f"policy_clock must be one of {POLICY_CLOCKS}, got {clock!r}")


def take_token(req: EngineRequest, tok: int, logits: torch.Tensor) -> Literal["abort", "finish"] | None:
    """Record a sampled token of ``req`` (its first logits and time on the first one); return
    ``"abort"`` when the request aborts now (``abort_after``), ``"finish"`` when it has all its
    tokens, None when it decodes on. Engines share it: the hammer judges every engine the same way."""
    if not req.output:
        req.first_logits = logits.detach().clone()
        req.t_first = time.perf_counter()
    req.output.append(tok)
    if req.abort_after is not None and len(req.output) >= req.abort_after:
        return "abort"
    return "finish" if len(req.output) >= req.max_new_tokens else None


def generate_cold(
    model: HybridModel,
    prompt: list[int],
    n: int,
    *,
    chunk: int = 256,
    namespace: Hashable = None,
    images: Sequence[bytes] = (),
) -> tuple[list[int], torch.Tensor]:
    """Ground truth: ``prompt`` computed alone, cold, with no cache (a private one-slot pool and
    KV), in ``namespace`` and with ``images``, then ``n`` greedy tokens. Returns the tokens and
    the first token's logits."""
    cfg = model.cfg
    pool = LinearStatePool(cfg.state_layout(), 1, model.device)
    kvp = KVPool(cfg, len(prompt) + n, device=model.device)
    kv_idx = torch.arange(len(prompt) + n)
    slot = pool.alloc(RequestOwner("cold"))
    logits = torch.empty(0)
    plain = namespace is None and not images
    for start in range(0, len(prompt), chunk):
        end = min(len(prompt), start + chunk)
        ids = torch.tensor(prompt[start:end])
        embeds = None if plain else model.inputs(prompt, start, end, namespace=namespace, images=images)
        logits = model.prefill(ids, start, pool, slot, kvp, kv_idx, embeds=embeds)
    first = logits.clone()
    out = [model.greedy(logits)]
    slots = torch.tensor([slot])
    bias = _biases(model, [namespace])
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        logits = model.decode(torch.tensor([out[-1]]), [pos], pool, slots, kvp, [kv_idx[: pos + 1]], bias=bias)[0]
        out.append(model.greedy(logits))
    return out, first


ColdJob = tuple[list[int], int, Hashable, tuple[bytes, ...]]
"""One ground-truth request for :func:`generate_cold_many`: prompt, tokens, namespace, images."""

_WORKER_MODEL: list[HybridModel] = []  # the model a ground-truth worker process computes with


def _init_cold_worker(model: HybridModel) -> None:
    torch.set_num_threads(1)  # one process per core: no thread of one fighting another's
    _WORKER_MODEL[:] = [model]


def _cold_jobs(jobs: list[ColdJob], chunk: int) -> list[tuple[list[int], torch.Tensor]]:
    model = _WORKER_MODEL[0]
    return [generate_cold(model, p, n, chunk=chunk, namespace=ns, images=imgs) for p, n, ns, imgs in jobs]


def generate_cold_many(
    model: HybridModel,
    jobs: Sequence[ColdJob],
    *,
    chunk: int = 256,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
    parallel_above: int = 30_000,
) -> list[tuple[list[int], torch.Tensor]]:
    """:func:`generate_cold` of every job, in order: each prompt computed alone and cold, as
    :func:`generate_cold` computes it, in ``workers`` processes at once (each a private copy of
    ``model`` on one thread; a CPU model only: on another device the jobs run here, one by one).
    ``progress(i)`` after each job (in completion order). Jobs of ``parallel_above`` prompt tokens
    or fewer in all run here: starting a process (importing torch, receiving the model) costs
    about as much as computing that many tokens. The answers are those of
    :func:`generate_cold` run here, token for token (a test compares them on 200 prompts).
    Worker processes are spawned, so a script calling this needs multiprocessing's
    ``if __name__ == "__main__":`` guard; without it the jobs run here (warned).

    :raises ValueError: ``workers`` below 1. O(sum of prompt lengths) work.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    todo = list(jobs)
    out: list[tuple[list[int], torch.Tensor] | None] = [None] * len(todo)
    done = 0

    def answered(i: int, answer: tuple[list[int], torch.Tensor]) -> None:
        nonlocal done
        out[i] = answer
        if progress is not None:
            progress(done)
        done += 1

    small = sum(len(p) for p, _, _, _ in todo) <= parallel_above
    if workers > 1 and model.device.type == "cpu" and len(todo) > 1 and not small:
        import concurrent.futures as cf
        import multiprocessing as mp

        # Longest first, in small batches: the workers finish together, each batch one round trip.
        order = sorted(range(len(todo)), key=lambda i: -len(todo[i][0]))
        batches = [order[i : i + 4] for i in range(0, len(order), 4)]
        ctx = mp.get_context("spawn")  # torch's thread pools do not survive a fork
        try:
            with cf.ProcessPoolExecutor(
                workers, mp_context=ctx, initializer=_init_cold_worker, initargs=(model,)
            ) as ex:
                futures = {ex.submit(_cold_jobs, [todo[i] for i in b], chunk): b for b in batches}
                for fut in cf.as_completed(futures):
                    for i, answer in zip(futures[fut], fut.result(), strict=True):
                        answered(i, answer)
        except (cf.process.BrokenProcessPool, RuntimeError) as e:
            # No worker could start (a script without the ``if __name__ == "__main__"`` guard that
            # spawned processes need, say): the rest here, one by one, with the same answers.
            warnings.warn(f"ground truth: worker processes failed ({e}); computing here", RuntimeWarning, stacklevel=2)
    for i, (p, n, ns, imgs) in enumerate(todo):  # everything no worker answered
        if out[i] is None:
            answered(i, generate_cold(model, p, n, chunk=chunk, namespace=ns, images=imgs))
    return [o for o in out if o is not None]


def _spin_cycles_per_us() -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep`` on the current device, measured."""
    torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]  # loaded before the timed run
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
    end.record()
    end.synchronize()
    return cycles / (1e3 * float(start.elapsed_time(end)))


def _biases(model: HybridModel, namespaces: Sequence[Hashable]) -> torch.Tensor | None:
    """[B, hidden] adapter biases of a decode batch (zero rows for the base model); None when no
    request has an adapter."""
    rows = [model.adapter(ns) for ns in namespaces]
    if all(b is None for b in rows):
        return None
    zero = torch.zeros(model.cfg.hidden_size, dtype=model.cfg.dtype, device=model.device)
    return torch.stack([zero if b is None else b for b in rows])
