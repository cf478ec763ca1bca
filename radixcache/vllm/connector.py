"""``RadixcacheConnector``: vLLM's KV connector API (v1, hybrid) over a :class:`PagedHostStore`.

vLLM builds the connector twice, once for its scheduler (in the engine core's process) and once
for its worker, for a model on one device (tensor and pipeline parallel size 1, which the
connector requires). The scheduler side builds the engine's :class:`PagedHostStore` and drives it
(look-ups, save plans, the manager's protocol); the worker side only copies bytes between vLLM's
blocks and the store's pages and slots (:class:`~radixcache.vllm.memory.StoreBytes`), those the
step's metadata names. With vLLM's default executor for one device (``uni``) the worker runs in
the engine core's process and copies into the store's own tensors; with its multiprocess
executor (``mp``: what vLLM's CPU build runs whenever the engine core is a process of its own, as
under ``vllm serve``) the worker is a process of its own, and the store keeps its bytes in a
shared mapping the worker maps at its first step (:class:`~radixcache.vllm.memory.StoreMapping`).
The metadata is plain data (page and slot numbers, block ids) either way; the worker reports
each step whose copies it made (:class:`RadixcacheWorkerMetadata`, through vLLM's step output),
and only then does the scheduler side reuse or file what the step copied.

Per step (vLLM runs them in this order):

1. scheduler, ``get_num_new_matched_tokens``: the deepest verified snapshot beyond vLLM's own hit,
   a block multiple, at most the request's tokens minus one; its node is locked (its snapshot's
   slot is then read in place) and verified (forensics checks the snapshot, the store each KV page);
2. scheduler, ``update_state_after_alloc``: the load is planned into the blocks vLLM allocated:
   attention pages into the attention groups' blocks of the hit, the state into each linear
   group's block that holds the state after the hit (``end / block - 1``);
3. scheduler, ``build_connector_meta``: each request whose step ends on a block boundary gets a
   save plan (host pages for the blocks neither the tree nor an earlier plan still pending
   holds, a slot for the state; plans are filed in the order they were made, step by step);
4. worker, ``start_load_kv`` (before the forward): the planned loads are copied into vLLM's blocks;
5. worker, ``wait_for_save`` (after the forward): the planned saves are copied out of vLLM's
   blocks, in the step that wrote them (a later step may have moved the state block on);
6. scheduler, ``update_connector_output`` (vLLM hands it the step's output, with the worker's
   report): the step's loads are released and its saves filed (``commit``).

With asynchronous scheduling (vLLM's default where its executor allows it) the scheduler plans
step N+1 before step N's sampled tokens are known: a decode step's input token is then a
placeholder, so a save of a decode step that ends on a block boundary is planned with the ids
known (one short) and committed with the request's ids once the worker has run the step (by
then vLLM has appended that token; an aborted request that never got it gives the plan back,
counted as ``ids-unknown``). Loads need nothing more: a hit is found for a request's prompt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

from linear_state import StateLayout

from ..core.multimodal import image_cache_ids
from ..forensics import Ledger
from ..policies import make_policy
from ..tiers.host import physical_memory
from ..tiers.store import RedisStore
from .memory import StoreBytes, StoreMapping
from .options import ConnectorOptions, UnsupportedEngine
from .store import VERIFYING, Hit, PagedHostStore, PagedLayout, SavePlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["RadixcacheConnector", "RadixcacheMetadata", "RadixcacheWorkerMetadata", "engine_layout"]

#: With a shared tier, a request waits at most this long (seconds, from its first look-up) for its
#: prefetch's answer before it is served from the host store alone.
PREFETCH_WAIT_S = 1.0


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Groups:
    """Which of vLLM's KV cache groups hold attention and which hold linear state."""

    block: int
    attention: tuple[int, ...]
    linear: tuple[int, ...]
    attention_layers: tuple[tuple[str, int], ...]  # (layer name, group), in group order
    linear_layers: tuple[tuple[str, int], ...]
    #: The most new blocks vLLM 0.32's admission check counts for one Mamba group of a request in
    #: align mode (``MambaManager.get_num_blocks_to_allocate``): its running block, a prefill
    #: checkpoint's where the spec keeps them, speculative blocks (a partial local hit's copy
    #: never meets an external hit: the connector offers none after a hit that ends mid-block).
    mamba_counted: int = 1


def _groups(kv_cache_config: KVCacheConfig) -> _Groups:
    attention: list[int] = []
    linear: list[int] = []
    att_layers: list[tuple[str, int]] = []
    lin_layers: list[tuple[str, int]] = []
    blocks: set[int] = set()
    counted = 1
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        blocks.add(spec.block_size)
        if isinstance(spec, MambaSpec):
            linear.append(g)
            lin_layers += [(n, g) for n in group.layer_names]
            extra = int(getattr(spec, "num_prefill_checkpoint_blocks", 0) > 0)
            counted = max(counted, 1 + extra + int(getattr(spec, "num_speculative_blocks", 0)))
        elif isinstance(spec, AttentionSpec):
            attention.append(g)
            att_layers += [(n, g) for n in group.layer_names]
        else:
            raise UnsupportedEngine(
                f"KV cache group {g} holds {type(spec).__name__}, which RadixcacheConnector does not store"
            )
    if not linear:
        raise UnsupportedEngine(
            "the model has no linear-attention (Mamba / Gated DeltaNet) layers: RadixcacheConnector is for hybrid "
            "models; vLLM's own prefix cache serves this one"
        )
    if not attention:
        raise UnsupportedEngine("the model has no attention layers: RadixcacheConnector stores hybrid models")
    if len(blocks) != 1:
        raise UnsupportedEngine(
            f"KV cache groups of different block sizes {sorted(blocks)}; RadixcacheConnector needs one"
        )
    return _Groups(blocks.pop(), tuple(attention), tuple(linear), tuple(att_layers), tuple(lin_layers), counted)


def engine_layout(kv_cache_config: KVCacheConfig) -> PagedLayout:
    """The :class:`PagedLayout` of an engine's KV cache config: one attention page per layer and
    block (vLLM's page bytes), one snapshot slot holding every linear layer's two states.

    :raises UnsupportedEngine: no linear layers, no attention layers, groups of different block
        sizes, a linear layer whose state is not exactly a conv and a recurrent state of one
        shape across layers.
    """
    gr = _groups(kv_cache_config)
    specs = [kv_cache_config.kv_cache_groups[g].kv_cache_spec for g in gr.linear]
    first = specs[0]
    if len(first.shapes) != 2 or any((s.shapes, s.dtypes) != (first.shapes, first.dtypes) for s in specs):
        raise UnsupportedEngine(
            f"linear layers with states {[s.shapes for s in specs]}: RadixcacheConnector stores one conv and one "
            "recurrent state of the same shapes in every linear layer"
        )
    state = StateLayout(
        num_layers=len(gr.linear_layers),
        conv_shape=tuple(first.shapes[0]),
        recurrent_shape=tuple(first.shapes[1]),
        conv_dtype=first.dtypes[0],
        recurrent_dtype=first.dtypes[1],
    )
    att = [kv_cache_config.kv_cache_groups[g].kv_cache_spec for g in gr.attention]
    formats = {(s.page_size_bytes, _page_format(s)) for s in att}
    if len(formats) != 1:
        raise UnsupportedEngine(f"attention groups with different pages {sorted(formats)}")
    page_bytes, fmt = formats.pop()
    return PagedLayout(gr.block, len(gr.attention_layers), page_bytes, state, kv_format=fmt)


def _page_format(spec: AttentionSpec) -> str:
    """What an attention page's bytes are (the shared tier's KV identity)."""
    return (
        f"vllm:{type(spec).__name__}:heads={spec.num_kv_heads}:head={spec.head_size}:dtype={spec.dtype}"
        f":block={spec.block_size}"
    )


def _model_identity(vllm_config: VllmConfig, opts: ConnectorOptions) -> str:
    if opts.model_identity is not None:
        return opts.model_identity
    mc = vllm_config.model_config
    return f"{mc.model}@{mc.revision}:{mc.dtype}"


# ----------------------------------------------------------------------------- one store per engine
_STORES: dict[str, PagedHostStore] = {}
_STORES_LOCK = threading.Lock()


def _budget(kv_cache_config: KVCacheConfig, layout: PagedLayout, opts: ConnectorOptions) -> int:
    """The store's host bytes, checked to hold a store (ValueError otherwise): the option, or
    twice vLLM's KV space, at most a quarter of the machine's memory."""
    budget = opts.host_budget_bytes
    if budget is None:
        budget = 2 * kv_cache_config.num_blocks * (layout.page_bytes + layout.state.slot_bytes)
        phys = physical_memory()
        if phys is not None:
            budget = min(budget, phys // 4)
    PagedHostStore.capacity(layout, budget, opts.snapshots_per_block)
    return budget


def _store_for(
    engine_id: str, kv_cache_config: KVCacheConfig, opts: ConnectorOptions, on_cuda: bool, model: str, mapped: bool
) -> PagedHostStore:
    """The engine's store, built by its scheduler side (``mapped``: its bytes where a worker in
    another process maps them)."""
    with _STORES_LOCK:
        if engine_id in _STORES:
            raise UnsupportedEngine(f"engine {engine_id!r} has a RadixcacheConnector store already")
        layout = engine_layout(kv_cache_config)
        budget = _budget(kv_cache_config, layout, opts)
        store = PagedHostStore(
            layout,
            budget,
            policy=make_policy(opts.policy),
            verify=opts.verify,
            snapshots_per_block=opts.snapshots_per_block,
            pin_memory=on_cuda and not mapped,
            mapped=mapped,
            ledger=Ledger(opts.ledger) if opts.ledger and opts.verify else None,
            shared=None if opts.redis_url is None else RedisStore(opts.redis_url),
            model=model,
            shared_namespace=opts.shared_namespace,
            copy_thread=opts.copy_thread,
        )
        _STORES[engine_id] = store
        return store


# ----------------------------------------------------------------------------- metadata
@dataclass
class _Load:  # the scheduler side's record of a load in flight
    hit: Hit
    blocks: dict[int, list[int]]  # group -> the engine blocks the hit fills (attention: pages; linear: one)


@dataclass
class _Save:  # the scheduler side's record of a save in flight
    plan: SavePlan
    blocks: dict[int, list[int]]
    request: Request | None = None  # whose ids complete the plan's at its commit (asynchronous scheduling)


@dataclass
class _Step:  # one step's loads and saves, until the worker reports the step done
    step: int
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


@dataclass(frozen=True)
class _Copy:
    """One copy for the worker: host ``pages`` to or from each attention group's ``blocks``, the
    state in host ``slot`` to or from each linear group's ``blocks``."""

    pages: tuple[int, ...]
    slot: int
    blocks: dict[int, list[int]]


@dataclass
class RadixcacheMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """One step's copies for the worker, as plain data (pickled to a worker in another process):
    ``loads`` before the forward, ``saves`` after it; ``mapping``: where the store's bytes are
    mapped from (a worker in another process; ``None`` in the engine core's)."""

    step: int = 0
    loads: list[_Copy] = field(default_factory=list)
    saves: list[_Copy] = field(default_factory=list)
    mapping: StoreMapping | None = None


@dataclass
class RadixcacheWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """The worker's report in a step's output: ``done``, the latest step whose copies it made
    (the scheduler side then releases that step's loads and files its saves)."""

    done: int

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Several workers' reports: a step is done when every worker's copies are."""
        assert isinstance(other, RadixcacheWorkerMetadata)
        return RadixcacheWorkerMetadata(min(self.done, other.done))


def _copy(pages: Sequence[int], slot: int, blocks: dict[int, list[int]]) -> _Copy:
    return _Copy(tuple(int(p) for p in pages), int(slot), {g: [int(b) for b in bs] for g, bs in blocks.items()})


# ----------------------------------------------------------------------------- the connector
class RadixcacheConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]  # vLLM is untyped here
    """radixcache's prefix cache for hybrid models in vLLM (see the module's docstring).

    :ivar store: the engine's :class:`PagedHostStore` (the scheduler side's only).

    Options come from ``kv_transfer_config.kv_connector_extra_config``
    (:class:`~radixcache.vllm.ConnectorOptions`).

    :raises UnsupportedEngine: an unknown option, a model without linear or attention layers,
        the hybrid KV cache manager disabled, tensor or pipeline parallelism, an executor whose
        workers may run on another machine (``ray``), speculative decoding, vLLM's prefix caching
        in a mode other than ``align``, or a second store under one engine id in a process.
    :raises OSError: a worker in a process of its own, and ``/dev/shm`` lacks room for the host
        budget (the message gives the bytes).
    """

    store: PagedHostStore

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        opts = ConnectorOptions.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self._groups = _check_engine(vllm_config, kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)
        assert kv_cache_config is not None
        self.block = self._groups.block
        self._layout = engine_layout(kv_cache_config)
        # Checked on both sides: vLLM builds the worker's first, and a refusal there comes before
        # vLLM sets its process-wide connector (one from the scheduler's would leave it set).
        _budget(kv_cache_config, self._layout, opts)
        engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self._engine_id = engine_id
        # a worker in a process of its own (vLLM's multiprocess executor) maps the store's bytes
        mapped = vllm_config.parallel_config.distributed_executor_backend == "mp"
        if role == KVConnectorRole.SCHEDULER:  # the worker side has no store: it copies bytes
            on_cuda = vllm_config.device_config.device_type == "cuda"
            model = _model_identity(vllm_config, opts)
            self.store = _store_for(engine_id, kv_cache_config, opts, on_cuda, model, mapped)
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._pending: dict[str, Hit] = {}  # found by get_num_new_matched_tokens, not yet allocated
        self._asked: dict[str, float] = {}  # shared tier: when each request's prefetch was issued
        self._step_loads: list[_Load] = []
        self._step = 0
        self._inflight: list[_Step] = []  # steps with copies, in order, until the worker reports them
        # worker side
        self._bytes: StoreBytes | None = None  # the store's bytes, found at the first step
        self._done: int | None = None  # the latest step whose copies were made, not yet reported
        self._attn: list[tuple[torch.Tensor, int]] = []  # (blocks x page bytes, group) per attention layer
        self._linear: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (conv, recurrent views, group)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store serves: a verified snapshot's depth
        minus vLLM's own hit (0 when it has none deeper, when vLLM's hit is not block-aligned,
        or for a request the connector does not key: prompt embeddings); ``None`` while the
        shared tier's prefetch or the hit's verification (on the store's copy thread) runs:
        vLLM asks again at its next step."""
        rid = request.request_id
        stale = self._pending.pop(rid, None)
        if stale is not None:
            self.store.release(stale)
        ids = _cache_ids(request)
        if ids is None or request.skip_reading_prefix_cache or num_computed_tokens % self.block:
            return 0, False
        limit = (request.num_tokens - 1) // self.block * self.block
        if limit <= num_computed_tokens:
            return 0, False
        ns = _namespace(request)
        if self.store.shared is not None:  # the shared tier's probe runs on its own thread
            asked = self._asked.get(rid)
            if asked is None:
                self._asked[rid] = time.monotonic()
                if self.store.prefetch(rid, ids[:limit], namespace=ns):
                    return None, False  # vLLM asks again at its next step
            elif self.store.prefetch_pending(rid) and time.monotonic() - asked < PREFETCH_WAIT_S:
                return None, False
        # A hit vLLM has no room for is declined before its pages are verified and its state
        # copied (the request computes it; the snapshot stays): a waiting request asks every step.
        # The verification runs on the store's copy thread: vLLM asks again at its next step.
        hit = self.store.lookup_in_background(
            rid,
            ids[:limit],
            namespace=ns,
            computed=num_computed_tokens,
            fits=lambda tokens: self._room_for(request, num_computed_tokens, tokens),
        )
        if hit is VERIFYING:
            return None, False
        if hit is None:
            return 0, False
        self._pending[rid] = hit
        return hit.end - num_computed_tokens, False

    def _room_for(self, request: Request, computed: int, external: int) -> bool:
        """Whether vLLM's pool has the blocks a hit of ``external`` tokens beyond vLLM's own hit
        of ``computed`` takes, counted the way its allocator takes them rather than the way its
        admission check counts them.

        vLLM 0.32's check (``get_num_blocks_to_allocate``) counts at most one new block per
        Mamba group, but an external hit makes each Mamba group allocate a block per hit block
        first (``allocate_external_computed_blocks``) and then its running block: under memory
        pressure the check passes and the allocation raises (``Cannot get N free blocks from the
        pool``), which kills the engine (vllm-project/vllm#46892, open). A hit is offered only
        when the free blocks cover a bound on the check's count (each attention group: the
        request's blocks; each Mamba group: what the check counts at most, and the local hit's
        state block it takes back from the free queue) plus the blocks the check leaves out."""
        manager = self._kv_cache_manager
        if manager is None:
            return True
        g = self._groups
        attention = len(g.attention) * -(-request.num_tokens // self.block)
        local = int(computed > 0)
        linear = len(g.linear) * (g.mamba_counted + local + external // self.block)
        return bool(manager.block_pool.get_num_free_blocks() >= attention + linear)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the pending hit's load into the blocks vLLM allocated (or let it go when vLLM
        took none of it)."""
        rid = request.request_id
        self._requests[rid] = request
        hit = self._pending.pop(rid, None)
        if hit is None:
            return
        if num_external_tokens != hit.end - hit.start:
            # vLLM took fewer tokens than offered: the state there is not the snapshot's. The
            # scheduler's own check makes this rare; the request recomputes from its own hit.
            self.store.release(hit)
            if num_external_tokens:
                raise RuntimeError(
                    f"vLLM took {num_external_tokens} of the {hit.end - hit.start} external tokens offered for "
                    f"request {rid}; RadixcacheConnector serves whole hits only"
                )
            return
        self._step_loads.append(_Load(hit, self._blocks_of(blocks.get_block_ids(), hit.start, hit.end)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (planned at allocation) and saves: every scheduled request whose
        step ends on a block boundary files the prefix up to it. The worker copies them; the
        store's pages and slots they name stay the step's until the worker reports it
        (:meth:`update_connector_output`)."""
        self._step += 1
        step = self._plan_step(scheduler_output)
        if step.loads or step.saves:
            self._inflight.append(step)
        return RadixcacheMetadata(
            step=step.step,
            loads=[_copy(x.hit.pages, x.hit.slot, x.blocks) for x in step.loads],
            saves=[_copy(x.plan.pages, x.plan.slot, x.blocks) for x in step.saves],
            mapping=self.store.mapping,
        )

    def _plan_step(self, scheduler_output: SchedulerOutput) -> _Step:
        step = _Step(self._step, loads=self._step_loads)
        self._step_loads = []
        assert self._kv_cache_manager is not None
        for load in step.loads:
            # vLLM copies a request's state into the block of its step's last token before the
            # forward (and before the connector's loads): the state goes there too.
            rid = load.hit.rid
            assert isinstance(rid, str)
            run = -(-(load.hit.end + scheduler_output.num_scheduled_tokens.get(rid, 0)) // self.block) - 1
            if run != load.hit.end // self.block - 1:
                table = self._kv_cache_manager.get_block_ids(rid)
                for g in self._groups.linear:
                    load.blocks[g].append(table[g][run])
        for rid, computed in _scheduled(scheduler_output):
            end = computed + scheduler_output.num_scheduled_tokens[rid]
            request = self._requests.get(rid)
            if request is None or end == 0 or end % self.block:
                continue
            ids = _cache_ids(request)
            if ids is None:
                continue
            # With asynchronous scheduling a decode step is scheduled before the token it reads
            # is sampled (vLLM counts it computed, its id is not in the request yet): the plan
            # holds the ids known now and the commit, after that token's step, the whole prefix.
            plan = self.store.plan_save(rid, ids[:end], end=end, namespace=_namespace(request))
            if plan is None:
                continue
            blocks = self._blocks_of(self._kv_cache_manager.get_block_ids(rid), plan.start, end)
            step.saves.append(_Save(plan, blocks, request))
        return step

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A step's output: with the worker's report, the steps it covers are done (their loads
        released, their saves filed)."""
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, RadixcacheWorkerMetadata):
            self._drain(report.done)

    def _blocks_of(self, table: Sequence[Sequence[int]], start: int, end: int) -> dict[int, list[int]]:
        """The engine blocks of tokens ``start .. end`` (block multiples) a load or save copies:
        each attention group's blocks of that range, each linear group's block holding the
        state after ``end``."""
        first, last = start // self.block, end // self.block
        out = {g: list(table[g][first:last]) for g in self._groups.attention}
        out.update({g: [table[g][last - 1]] for g in self._groups.linear})
        return out

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing is held past the request (its saves were copied in their steps)."""
        self._forget(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As :meth:`request_finished`, for vLLM's hybrid KV cache manager."""
        self._forget(request)
        return False, None

    def _forget(self, request: Request) -> None:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._asked.pop(rid, None)
        hit = self._pending.pop(rid, None)
        if hit is not None:
            self.store.release(hit)
        self.store.finished(rid)

    def _drain(self, done: int) -> None:
        """Release the loads and file the saves of the steps up to ``done`` (the worker made
        their copies)."""
        while self._inflight and self._inflight[0].step <= done:
            step = self._inflight.pop(0)
            for load in step.loads:
                self.store.release(load.hit, loaded=True)
            for save in step.saves:
                self._commit(save)

    def _commit(self, save: _Save) -> None:
        """File a save the worker copied; a plan made before its last ids were known takes them
        from the request now (they are: the worker ran the step that read them), or is given
        back when they never came (the request was aborted first)."""
        plan = save.plan
        if plan.ids.size == plan.end:
            self.store.commit(plan)
            return
        ids = _cache_ids(save.request) if save.request is not None else None
        if ids is None or ids.size < plan.end:
            self.store.abandon(plan, why="ids-unknown")
        else:
            self.store.commit(plan, ids[: plan.end])

    def shutdown(self) -> None:
        """Let the engine's store go (the scheduler side built or shares it), its shared tier's
        publications flushed first."""
        if self.role == KVConnectorRole.SCHEDULER:
            self.store.close(timeout_s=10.0)
            with _STORES_LOCK:
                _STORES.pop(self._engine_id, None)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Views of vLLM's blocks per layer: each attention layer's pages as bytes, each linear
        layer's conv and recurrent state as the typed tensors the layout names.

        :raises UnsupportedEngine: a layer whose blocks are not the outer dimension of its cache
            with each block's bytes contiguous.
        """
        layout = self._layout
        self._attn = []
        for name, g in self._groups.attention_layers:
            t = kv_caches[name]
            pages = _block_bytes(name, t)
            if pages.shape[1] != layout.kv_page_bytes:
                raise UnsupportedEngine(
                    f"attention layer {name} has {pages.shape[1]} bytes per block, the layout {layout.kv_page_bytes}"
                )
            self._attn.append((pages, g))
        self._linear = []
        st = layout.state
        conv_bytes = int(np.prod(st.conv_shape)) * st.conv_dtype.itemsize
        rec_bytes = int(np.prod(st.recurrent_shape)) * st.recurrent_dtype.itemsize
        for name, g in self._groups.linear_layers:
            raw = _block_bytes(name, kv_caches[name])
            if raw.shape[1] < conv_bytes + rec_bytes:
                raise UnsupportedEngine(
                    f"linear layer {name} has {raw.shape[1]} bytes per block, its state {conv_bytes + rec_bytes}"
                )
            conv = raw[:, :conv_bytes].view(st.conv_dtype).view(raw.shape[0], *st.conv_shape)
            rec = (
                raw[:, conv_bytes : conv_bytes + rec_bytes]
                .view(st.recurrent_dtype)
                .view(raw.shape[0], *st.recurrent_shape)
            )
            self._linear.append((conv, rec, g))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy this step's hits into the blocks vLLM allocated for them, before the forward (a
        worker in a process of its own maps the store's bytes at its first step, copies or not:
        the mapping's name goes then)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, RadixcacheMetadata)
        mem = self._memory(meta.mapping)
        for load in meta.loads:
            self._load(load, mem)

    def _load(self, load: _Copy, mem: StoreBytes) -> None:
        mem.copy_out_pages(load.pages, [(t, load.blocks[g]) for t, g in self._attn])
        self._load_state(load, mem)

    def _load_state(self, load: _Copy, mem: StoreBytes) -> None:
        conv, rec = mem.read_state(load.slot)
        for i, (cv, rv, g) in enumerate(self._linear):
            for b in load.blocks[g]:
                cv[b].copy_(conv[i])
                rv[b].copy_(rec[i])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in :meth:`start_load_kv`."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: vLLM calls this for attention layers only, and the state pages
        are copied in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        """Copy this step's planned saves out of vLLM's blocks, in the step that wrote them; the
        step's copies are then done (reported by :meth:`build_connector_worker_meta`)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, RadixcacheMetadata)
        mem = self._memory(meta.mapping)
        for save in meta.saves:
            self._save(save, mem)
        if meta.loads or meta.saves:
            self._done = meta.step

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The report of the latest step whose copies were made, once (``None``: nothing new)."""
        done, self._done = self._done, None
        return None if done is None else RadixcacheWorkerMetadata(done)

    def _save(self, save: _Copy, mem: StoreBytes) -> None:
        mem.copy_in_pages(save.pages, [(t, save.blocks[g]) for t, g in self._attn])
        conv = torch.stack([cv[save.blocks[g][0]] for cv, _, g in self._linear])
        rec = torch.stack([rv[save.blocks[g][0]] for _, rv, g in self._linear])
        mem.write_state(save.slot, conv, rec)

    def _memory(self, mapping: StoreMapping | None) -> StoreBytes:
        """The store's bytes: mapped from ``mapping`` in a worker process of its own, else the
        engine's store's own (in this process)."""
        if self._bytes is None:
            if mapping is not None:
                self._bytes = mapping.attach()
            else:
                with _STORES_LOCK:
                    store = _STORES.get(self._engine_id)
                if store is None:
                    raise RuntimeError(f"no RadixcacheConnector store for engine {self._engine_id!r} in this process")
                self._bytes = store.bytes
        return self._bytes


# ----------------------------------------------------------------------------- helpers
def _check_engine(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> _Groups:
    """Refuse what the connector cannot serve correctly, naming it; the engine's groups."""
    if kv_cache_config is None:
        raise UnsupportedEngine("RadixcacheConnector needs vLLM's KV cache config (vLLM 0.32 or later)")
    groups = _groups(kv_cache_config)  # a model it cannot store is named first
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise UnsupportedEngine(
            f"tensor_parallel_size={pc.tensor_parallel_size}, pipeline_parallel_size={pc.pipeline_parallel_size}: "
            "RadixcacheConnector keeps its store in the engine core's process and serves one device (both must be 1)"
        )
    backend = pc.distributed_executor_backend
    if backend not in (None, "uni", "external_launcher", "mp"):
        raise UnsupportedEngine(
            f"distributed_executor_backend={backend!r}: RadixcacheConnector needs the worker on the engine core's "
            "machine: in its process ('uni') or a process of its own there ('mp')"
        )
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise UnsupportedEngine(
            "disable_hybrid_kv_cache_manager=True: RadixcacheConnector needs vLLM's hybrid KV cache manager (HMA)"
        )
    if vllm_config.speculative_config is not None:
        raise UnsupportedEngine("speculative decoding: RadixcacheConnector does not store draft-token states")
    cc = vllm_config.cache_config
    if not cc.enable_prefix_caching or cc.mamba_cache_mode != "align":
        raise UnsupportedEngine(
            f"enable_prefix_caching={cc.enable_prefix_caching}, mamba_cache_mode={cc.mamba_cache_mode!r}: "
            "RadixcacheConnector needs prefix caching in 'align' mode (the state after each block boundary in a "
            "block of its own)"
        )
    return groups


def _block_bytes(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``'s blocks as ``(blocks, bytes per block)`` uint8 (a view)."""
    try:
        flat = t.view(t.shape[0], -1)  # a view only when each block's elements are contiguous
    except RuntimeError:
        flat = None
    if flat is None or t.dim() < 2 or flat.stride(1) != 1:
        raise UnsupportedEngine(f"layer {name}: its cache {tuple(t.shape)} / {t.stride()} is not block-major")
    return flat.view(torch.uint8)


def _scheduled(so: SchedulerOutput) -> list[tuple[str, int]]:
    """(request id, tokens computed before this step) of every request scheduled in ``so``."""
    out = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
    c = so.scheduled_cached_reqs
    out += list(zip(c.req_ids, c.num_computed_tokens, strict=True))
    return out


def _namespace(request: Request) -> Hashable:
    """A request's namespace: its LoRA adapter and cache salt (``None`` without either)."""
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    salt = request.cache_salt
    return None if lora is None and salt is None else ("vllm", lora, salt)


def _cache_ids(request: Request) -> np.ndarray | None:
    """The ids the tree keys ``request`` on: its tokens, each image's placeholder run replaced by
    ids derived from vLLM's hash of that image. ``None``: prompt embeddings (no ids to key)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    ids = np.asarray(request.all_token_ids, dtype=np.int64)
    for f in request.mm_features or ():
        pos = f.mm_position
        n = int(pos.length)
        ids[pos.offset : pos.offset + n] = image_cache_ids(np.zeros(n, dtype=np.int64), 0, [f.identifier.encode()])
    return ids
