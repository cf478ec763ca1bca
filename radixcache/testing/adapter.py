"""The host-adapter protocol the fuzzing machine drives, the exact ground-truth state, and the
default adapter over :class:`~radixcache.CacheManager`.

Ground truth: the "model" of a fuzzed host is a polynomial hash of the prefix, written into the
pool's tensors token by token (:func:`advance`). It is exact in float64 and remembers every token
and its position, so any restore, clone or late write that lands the wrong state is seen. What the
model consumes is what a real one would: a namespace (a LoRA adapter, a tenant) changes every
step (:func:`ns_salt`), and an image placeholder is the image's content at that position
(:func:`model_inputs`, from a SHA-256 of the image's bytes: independent of radixcache's own cache
ids, so a collision of cache ids is seen as a wrong state).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from linear_state import DeferredStream, Fence, LinearStatePool, RequestOwner, StateLayout

from ..core.events import free_kv_to
from ..core.keys import IMAGE_ID_BASE
from ..core.multimodal import image_cache_ids, image_runs
from ..manager.cache_manager import Admission, CacheManager, WindowPlan
from ..tiers.store import SharedStore

__all__ = [
    "AdapterKV",
    "BridgedAdapter",
    "FUZZ_LAYOUT",
    "PLACEHOLDER",
    "HostAdapter",
    "ManagerAdapter",
    "advance",
    "default_bridge",
    "model_inputs",
    "ns_salt",
    "prefix_state",
]

PLACEHOLDER = 9
"""The image placeholder id of fuzzed prompts."""

FUZZ_LAYOUT = StateLayout(1, (2, 3), (2, 2), conv_dtype=torch.float64, recurrent_dtype=torch.float64)
"""A small float64 layout: exact for the hash below."""

_P = 1_000_003.0  # a prime below 2**20: state * 37 + id * weight stays exact in float64


def _weights(shape: Sequence[int]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return torch.arange(1, n + 1, dtype=torch.float64).reshape(tuple(shape))


def ns_salt(namespace: Hashable) -> int:
    """What a namespace changes in the ground-truth model (0 for none): stable across processes."""
    if namespace is None:
        return 0
    return 1 + int.from_bytes(hashlib.sha256(repr(namespace).encode()).digest()[:2], "little")


def model_inputs(ids: Sequence[int], placeholder: int, images: Sequence[bytes]) -> list[int]:
    """What the ground-truth model consumes for a prompt: text ids as they are, each placeholder
    replaced by its image's content at its position in the run (from a SHA-256 of the image's
    bytes; one digest of all images when runs and images cannot be paired)."""
    out = [int(i) for i in ids]
    runs = image_runs(np.asarray(out, dtype=np.int64), placeholder)
    if not runs:
        return out

    def h(*blobs: bytes) -> int:
        return int.from_bytes(hashlib.sha256(b"|".join(blobs)).digest()[:4], "little")

    if len(runs) == len(images):
        for (start, end), img in zip(runs, images, strict=True):
            base = h(img)
            for k in range(start, end):
                out[k] = IMAGE_ID_BASE + (base + k - start) % IMAGE_ID_BASE
    else:
        base = h(*images)
        where = [k for k, i in enumerate(out) if i == placeholder]
        for j, k in enumerate(where):
            out[k] = IMAGE_ID_BASE + (base + j) % IMAGE_ID_BASE
    return out


def advance(conv: torch.Tensor, rec: torch.Tensor, token: int, salt: int = 0) -> None:
    """Advance a state (``conv`` [L, *conv_shape], ``rec`` [L, *recurrent_shape], in place) by one
    token of the ground-truth model: a polynomial hash of the prefix, element-wise; ``salt`` (see
    :func:`ns_salt`) makes each namespace a different model."""
    t = float(token + 1 + salt * 65_537)
    rec.mul_(31).add_(_weights(rec.shape[1:]) * t).remainder_(_P)
    conv.mul_(37).add_(_weights(conv.shape[1:]) * t).remainder_(_P)


def prefix_state(
    ids: Sequence[int], layout: StateLayout = FUZZ_LAYOUT, salt: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ground-truth state after model inputs ``ids`` (see :func:`model_inputs`) in the
    namespace of ``salt``, computed cold from zeros."""
    conv = torch.zeros(layout.num_layers, *layout.conv_shape, dtype=torch.float64)
    rec = torch.zeros(layout.num_layers, *layout.recurrent_shape, dtype=torch.float64)
    for t in ids:
        advance(conv, rec, int(t), salt)
    return conv, rec


@runtime_checkable
class HostAdapter(Protocol):
    """What the fuzzing machine needs from a host integration. Request ids are ints.

    ``manager`` gives the machine the cache to check invariants and evict. Every method is the
    host's own scheduler doing one thing; device work may stay pending (on deferred streams)
    until :meth:`run_pending` or a fence the host waits runs it.
    """

    manager: CacheManager

    def admit(
        self, rid: int, ids: list[int], *, namespace: Hashable = None, images: Sequence[bytes] = ()
    ) -> int | None:
        """Admit a request (its ids, with image placeholders :data:`PLACEHOLDER` paired with
        ``images``, in ``namespace``); return its cached length, or None when refused (nothing
        held). The host keys it by ``image_cache_ids`` and its model consumes
        :func:`model_inputs` under :func:`ns_salt`."""

    def extend(self, rid: int) -> bool:
        """Prefill the next chunk of the prompt, capturing and committing track points.
        Return False (doing nothing) once the prompt is fully prefilled."""

    def decode(self, rid: int, token: int) -> None:
        """Feed one more token (after the prompt) to the request."""

    def finish(self, rid: int) -> None:
        """Finish the request (donating its final state)."""

    def abort(self, rid: int) -> None:
        """Abort the request at any point."""

    def run_pending(self) -> bool:
        """Run one unit of pending device work; False when nothing was pending."""

    def state(self, rid: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The request's live conv and recurrent state (waiting what it must) and the model inputs
        they cover (its cached prefix, the prompt prefilled so far, then decoded tokens)."""


@dataclass
class _Req:
    ids: list[int]  # model inputs: text ids, image content at placeholders, then decoded ids
    salt: int
    prompt_len: int
    adm: Admission
    kv: list[int]  # the KV table of [0, computed): the tree's pages, then the host's own
    computed: int
    last: Fence | None


class AdapterKV:
    """The :class:`~radixcache.tiers.shared.KVCodec` of :class:`ManagerAdapter`: its KV has no
    contents (the ground truth is the state), so a prefix's KV travels as 8 bytes a token and is
    imported as fresh indices of the adapter's allocator."""

    identity = "fuzz-kv 8 bytes/token"

    def __init__(self, holder: list[ManagerAdapter]) -> None:
        self._holder = holder

    def export_kv(self, kv_indices: torch.Tensor, after: Fence | None) -> bytes:
        """8 zero bytes per token."""
        return bytes(8 * kv_indices.numel())

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` fresh indices; None when ``data`` is not 8 bytes a token."""
        if len(data) != 8 * num_tokens:
            return None
        return torch.tensor(self._holder[0].alloc_kv(num_tokens, room=False), dtype=torch.int64)


class ManagerAdapter:
    """The default adapter: a small host scheduler on :class:`CacheManager`'s host protocol, with
    a deferred forward stream, a deferred copy stream and a strict KV allocator. It hands each
    window's KV indices over in one reused buffer, and overwrites the buffer right after the
    commit, as hosts that stage their page table do: a cache that kept a view of it would see
    its indices change (:meth:`check_kv` finds them).

    :param manager: a manager whose tree's freed KV reaches :meth:`free_kv` (see :meth:`build`).
    """

    def __init__(
        self,
        manager: CacheManager,
        forward: DeferredStream,
        copies: DeferredStream,
        chunk: int,
        *,
        kv_budget: int | None = None,
    ) -> None:
        self.manager = manager
        self.kv_budget = kv_budget
        self.kv_evictions = 0  # evictions this host asked for to stay within kv_budget
        self.pool: LinearStatePool = manager.pool
        self.forward = forward
        self.copies = copies
        self.chunk = chunk
        self.reqs: dict[int, _Req] = {}
        self.kv_next = 0
        self.kv_free: set[int] = set()
        self.last_plan: WindowPlan | None = None  # the last window committed (the misuse fuzzer's stale plan)
        self._buf = torch.empty(0, dtype=torch.int64)  # the staging buffer every window's KV goes through

    @classmethod
    def build(
        cls,
        *,
        slots: int = 12,
        page_size: int = 1,
        track_align: int = 4,
        track_slots: int = 2,
        chunk: int = 8,
        inject: str | None = None,
        host_slots: int = 2,
        shared: SharedStore | Literal["faulty"] | None = "faulty",
        codec_faults: float = 0.0,
        kv_budget: int | None = 96,
        seed: int = 0,
        bridge: str | None = None,
    ) -> ManagerAdapter:
        """A fresh adapter (and cache) committing fuzzing bug ``inject`` when given.

        The defaults put what a host runs under pressure: a pool of ``slots`` state slots (the
        tree's snapshots compete with the requests' live and track slots, so donations and
        admissions evict), a host tier of ``host_slots`` snapshots (0: none) that evictions demote
        into and hits promote from, a KV budget of ``kv_budget`` tokens (None: unbounded) that the
        host holds by asking the manager to evict before it allocates (:meth:`alloc_kv`), and a
        shared tier over a :class:`~radixcache.testing.faults.FaultyStore` (``shared="faulty"``:
        in memory, corrupting, dropping, delaying and misplacing blobs, seeded by ``seed``; a
        store of your own, a real Redis through :class:`~radixcache.tiers.shared.RedisStore` say,
        is used as given (wrap one that outlives the adapter in a ``FaultyStore`` with a ``prefix``
        of its own); None: no shared tier). Its KV codec, :class:`AdapterKV` behind a
        :class:`~radixcache.testing.faults.FaultyCodec`, misbehaves on ``codec_faults`` of its calls.
        ``bridge``: a transformers family (``radixcache.hf.TINY_CONFIGS``): the host keeps each
        request's state in a transformers cache of that family's tiny model between windows, as
        a transformers host does (:class:`BridgedAdapter`; needs the ``hf`` extra).

        :raises ValueError: ``track_slots`` below 1, a ``kv_budget`` below 1, an unknown bug or
            family.
        """
        from .faults import FUZZ_STORE_FAULTS, FaultyCodec, FaultyStore
        from .inject import make_fuzz_stack, make_shared_tier

        if kv_budget is not None and (isinstance(kv_budget, bool) or not isinstance(kv_budget, int) or kv_budget < 1):
            raise ValueError(f"kv_budget must be None or an int >= 1, got {kv_budget!r}")
        layout, hf_bridge = FUZZ_LAYOUT, None
        if bridge is not None:
            hf_bridge = _tiny_bridge(bridge)
            layout = hf_bridge.layout
        forward, copies = DeferredStream("forward"), DeferredStream("copies")
        holder: list[ManagerAdapter] = []
        tier = None
        if shared == "faulty":
            shared = FaultyStore(seed=seed, **FUZZ_STORE_FAULTS)
        if shared is not None:
            codec = FaultyCodec(AdapterKV(holder), p=codec_faults, free=lambda t: holder[0].free_kv(t))
            # The tier's clock counts its own calls, a tenth of a second each: when a failed call
            # marks the store down, how long it stays down depends on the program, not on how
            # fast the machine ran it (hypothesis replays a failure exactly).
            calls = itertools.count()
            tier = make_shared_tier(
                inject,
                shared,
                model="fuzz",
                kv=codec,
                publisher="fuzz",
                clock=lambda: next(calls) / 10,
            )
        manager = make_fuzz_stack(
            inject,
            layout,
            slots,
            page_size=page_size,
            track_align=track_align,
            track_slots=track_slots,
            on_event=free_kv_to(lambda t: holder[0].free_kv(t)),
            stream=copies,
            host_slots=host_slots,
            shared=tier,
        )
        if hf_bridge is not None:
            adapter: ManagerAdapter = BridgedAdapter(
                manager, forward, copies, chunk, kv_budget=kv_budget, bridge=hf_bridge
            )
        else:
            adapter = cls(manager, forward, copies, chunk, kv_budget=kv_budget)
        holder.append(adapter)
        return adapter

    # KV ------------------------------------------------------------------
    def free_kv(self, idx: torch.Tensor | list[int]) -> None:
        """Free KV indices (the tree's ``KV_FREED`` events, and what commit, finish and abort hand
        back): never an index freed twice, never one a live request's table still holds."""
        live = {i for r in self.reqs.values() for i in r.kv}
        for i in idx.tolist() if isinstance(idx, torch.Tensor) else idx:
            assert 0 <= i < self.kv_next, f"KV index {i} was never handed out (a stale view of a reused buffer?)"
            assert i not in self.kv_free, f"KV index {i} freed twice"
            assert i not in live, f"KV index {i} freed while a live request uses it"
            self.kv_free.add(i)

    @property
    def kv_in_use(self) -> int:
        """KV indices handed out and not freed (the tree's and the live requests')."""
        return self.kv_next - len(self.kv_free)

    def make_room(self, n: int, keep: Sequence[int] | np.ndarray | None = None, namespace: Hashable = None) -> bool:
        """Ask the manager to evict until ``n`` more KV tokens fit in the budget (protecting the
        hit of ``keep`` in ``namespace``, a request about to be admitted); whether they fit."""
        if self.kv_budget is None:
            return True
        over = self.kv_in_use + n - self.kv_budget
        if over > 0:
            self.kv_evictions += 1
            self.manager.evict(kv_tokens=over, keep=keep, namespace=namespace if keep is not None else None)
        return self.kv_in_use + n <= self.kv_budget

    def alloc_kv(self, n: int, *, room: bool = True) -> list[int]:
        """``n`` fresh KV indices of this host's allocator (never reused: a freed one stays free),
        after asking the manager to make room for them within the budget when ``room`` (a soft
        budget: a request already running gets its indices even when the tree cannot give enough
        back). ``room=False`` inside a call of the manager's (its codec importing a fetched
        prefix's KV), which must not call the manager again."""
        if room:
            self.make_room(n)
        out = list(range(self.kv_next, self.kv_next + n))
        self.kv_next += n
        return out

    def _window(self, r: _Req, plan: WindowPlan, kv: list[int], work: Callable[[], None], label: str) -> None:
        """Submit one window's forward (ordered after the plan's fences) and commit it."""
        after = [f for f in [r.last, *plan.after] if f is not None]
        r.last = self.forward.submit(work, after=after, label=label)
        r.computed = plan.end
        if self._buf.numel() < len(kv):
            self._buf = torch.empty(max(len(kv), 64), dtype=torch.int64)
        staged = self._buf[: len(kv)]
        staged.copy_(torch.tensor(kv, dtype=torch.int64))
        res = self.manager.commit(plan, r.last, kv_indices=staged)
        self._buf.fill_(1 << 40)  # the host reuses its buffer at once: junk no index may keep
        self.last_plan = plan
        r.kv = self.manager.kv_indices(plan.rid).tolist() if res.spliced else r.kv + kv
        self.free_kv(res.free_kv)  # reused only by work ordered after res.free_after

    # protocol -------------------------------------------------------------
    def admit(
        self, rid: int, ids: list[int], *, namespace: Hashable = None, images: Sequence[bytes] = ()
    ) -> int | None:
        key = image_cache_ids(ids, PLACEHOLDER, images) if images else list(ids)
        # A host's admission: what the prompt still needs of the KV budget, made room for with
        # the request's own hit kept; refused when it cannot fit.
        need = len(key) - self.manager.can_admit(key, namespace=namespace).cached_length
        if not self.make_room(need, keep=key, namespace=namespace):
            return None
        adm = self.manager.admit(rid, key, namespace=namespace)
        if not isinstance(adm, Admission):
            return None
        inputs = model_inputs(ids, PLACEHOLDER, images)
        salt = ns_salt(namespace)
        self.reqs[rid] = _Req(inputs, salt, len(ids), adm, adm.kv_indices.tolist(), adm.cached_length, adm.ready)
        return adm.cached_length

    def extend(self, rid: int) -> bool:
        r = self.reqs[rid]
        start, end = r.computed, min(r.prompt_len, r.computed + self.chunk)
        if start >= end:
            return False
        plan = self.manager.plan_prefill(rid, end)
        work = self._prefill_work(rid, start, end, {c.depth: c.slot for c in plan.captures})
        self._window(r, plan, self.alloc_kv(end - start), work, f"extend {rid} [{start},{end})")
        return True

    def decode(self, rid: int, token: int) -> None:
        r = self.reqs[rid]
        plan = self.manager.plan_decode(rid, [token])
        work = self._decode_work(rid, token, [c.slot for c in plan.captures])
        r.ids.append(token)
        self._window(r, plan, self.alloc_kv(1), work, f"decode {rid}")

    def _owned_when_written(self, rid: int, slots: list[int]) -> None:
        """The oracle of a late write: when a forward runs, the slots it writes are still its
        request's. A manager frees a request's slots only after waiting its forwards' fences; one
        that does not (the ``free-before-fence`` bug) lets this forward land in a slot that is free
        or another owner's now, raised here at once instead of only when the late state happens
        to be read (a copy into a later snapshot or request)."""
        owner = RequestOwner(rid)
        for s in slots:
            self.pool.check_writable(s, owner)

    def _prefill_work(self, rid: int, start: int, end: int, caps: dict[int, int]) -> Callable[[], None]:
        """The forward of prompt tokens ``[start, end)``: the model on the live slot's rows, each
        capture's slot written with the state after exactly its depth."""
        r = self.reqs[rid]
        pool, live, ids, salt = self.pool, r.adm.live_slot, r.ids, r.salt

        def forward_pass() -> None:
            self._owned_when_written(rid, [live, *caps.values()])
            conv, rec = pool.conv[:, live], pool.recurrent[:, live]
            for i in range(start, end):
                advance(conv, rec, ids[i], salt)
                if i + 1 in caps:
                    pool.conv[:, caps[i + 1]].copy_(conv)
                    pool.recurrent[:, caps[i + 1]].copy_(rec)

        return forward_pass

    def _decode_work(self, rid: int, token: int, caps: list[int]) -> Callable[[], None]:
        """The forward of one decoded token (every capture is the state after it)."""
        r = self.reqs[rid]
        pool, live, salt = self.pool, r.adm.live_slot, r.salt

        def forward_pass() -> None:
            self._owned_when_written(rid, [live, *caps])
            advance(pool.conv[:, live], pool.recurrent[:, live], token, salt)
            for t in caps:
                pool.conv[:, t].copy_(pool.conv[:, live])
                pool.recurrent[:, t].copy_(pool.recurrent[:, live])

        return forward_pass

    def finish(self, rid: int) -> None:
        r = self.reqs[rid]
        res = self.manager.finish(rid, r.last)
        del self.reqs[rid]
        self.free_kv(res.free_kv)

    def abort(self, rid: int) -> None:
        r = self.reqs[rid]
        res = self.manager.abort(rid, r.last)
        del self.reqs[rid]
        self.free_kv(res.free_kv)

    def run_pending(self) -> bool:
        return self.forward.run_next() or self.copies.run_next()

    def state(self, rid: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        r = self.reqs[rid]
        if r.last is not None:
            r.last.wait()
        live = r.adm.live_slot
        return self.pool.conv[:, live].clone(), self.pool.recurrent[:, live].clone(), r.ids[: r.computed]

    def check_kv(self) -> None:
        """Every KV index handed out is free, held by the tree, or used by a live request."""
        tree = {i for n in self.manager.cache.iter_nodes() for i in n.value.tolist()}
        stray = [i for i in tree if not 0 <= i < self.kv_next]
        assert not stray, f"the tree holds KV indices the host never handed out: {stray[:5]} (a view of its buffer?)"
        live = {i for r in self.reqs.values() for i in r.kv}
        assert not tree & self.kv_free, f"KV indices both free and held by the tree: {sorted(tree & self.kv_free)[:5]}"
        lost = set(range(self.kv_next)) - tree - live - self.kv_free
        assert not lost, f"KV indices leaked: {sorted(lost)[:5]}"


_BRIDGES: dict[str, Any] = {}


def _tiny_bridge(family: str) -> Any:
    """An ``HFStateBridge`` of ``family``'s tiny config over a float64 layout (exact for the
    ground-truth hash), made once per process."""
    if family not in _BRIDGES:
        from ..hf import HFStateBridge
        from ..hf.families import TINY_CONFIGS, tiny_config

        if family not in TINY_CONFIGS:
            raise ValueError(f"bridge family {family!r}: known {', '.join(TINY_CONFIGS)}")
        config = tiny_config(family)
        layout = StateLayout.from_hf_config(config, conv_dtype=torch.float64, recurrent_dtype=torch.float64)
        _BRIDGES[family] = HFStateBridge(config, layout)
    return _BRIDGES[family]


def default_bridge() -> str | None:
    """The family the fuzzing kit runs through a transformers cache by default: ``qwen3_next``
    when transformers is installed, else None."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    return "qwen3_next"


class BridgedAdapter(ManagerAdapter):
    """:class:`ManagerAdapter` as a transformers host runs it: each request's state lives in a
    transformers cache between windows. Admission loads the live slot (restored from a hit, or
    zeroed) into a fresh cache through ``bridge.load``; each window advances the cache's own
    conv and recurrent tensors; each capture and, at the window's end, the live state are
    written into the pool's rows (what the forward's kernels do). A bridge that loads a state
    wrong (a conv window a column off, layers swapped) makes the request's later states differ
    from the ground truth.

    :param bridge: a :class:`~radixcache.hf.HFStateBridge` whose layout is the pool's.
    """

    def __init__(self, *args: Any, bridge: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if bridge.layout != self.manager.pool.layout:
            raise ValueError("the bridge's layout must be the pool's")
        self.bridge = bridge
        self.caches: dict[int, Any] = {}

    def admit(
        self, rid: int, ids: list[int], *, namespace: Hashable = None, images: Sequence[bytes] = ()
    ) -> int | None:
        cached = super().admit(rid, ids, namespace=namespace, images=images)
        if cached is not None:
            cache = self.bridge.new_cache()
            self.bridge.load(self.pool, self.reqs[rid].adm.live_slot, cache, tokens=cached)  # after the restore
            self.caches[rid] = cache
        return cached

    def _advance(self, cache: Any, token: int, salt: int) -> None:
        """One token of the ground-truth model on a request's transformers cache."""
        for i in self.bridge.layout.model_layers or ():
            layer = cache.layers[i]
            advance(layer.conv_states[0], layer.recurrent_states[0], token, salt)

    def _put(self, cache: Any, slot: int) -> None:
        """A request's cached states into ``slot``'s rows, as the forward's kernels write the
        pool (inside the forward's own stream item: no fence of its own)."""
        pool = self.pool
        for j, i in enumerate(self.bridge.layout.model_layers or ()):
            layer = cache.layers[i]
            pool.conv[j, slot].copy_(layer.conv_states[0][0])
            pool.recurrent[j, slot].copy_(layer.recurrent_states[0][0])

    def _prefill_work(self, rid: int, start: int, end: int, caps: dict[int, int]) -> Callable[[], None]:
        r, cache = self.reqs[rid], self.caches[rid]  # the work may run after the request ended
        live, ids, salt = r.adm.live_slot, r.ids, r.salt

        def forward_pass() -> None:
            self._owned_when_written(rid, [live, *caps.values()])
            for i in range(start, end):
                self._advance(cache, ids[i], salt)
                if i + 1 in caps:
                    self._put(cache, caps[i + 1])
            self._put(cache, live)

        return forward_pass

    def _decode_work(self, rid: int, token: int, caps: list[int]) -> Callable[[], None]:
        r, cache = self.reqs[rid], self.caches[rid]
        live, salt = r.adm.live_slot, r.salt

        def forward_pass() -> None:
            self._owned_when_written(rid, [live, *caps])
            self._advance(cache, token, salt)
            for t in [*caps, live]:
                self._put(cache, t)

        return forward_pass

    def finish(self, rid: int) -> None:
        super().finish(rid)
        self.caches.pop(rid, None)

    def abort(self, rid: int) -> None:
        super().abort(rid)
        self.caches.pop(rid, None)
