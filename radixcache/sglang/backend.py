"""The radixcache backend for SGLang's scheduler (SGLang 0.5.23): a ``BasePrefixCache`` whose tree,
slot ownership and eviction choices are radixcache's.

How it maps SGLang's calls (see docs/sglang.md):

- Slots: SGLang's own mamba pool tensors, wrapped by a :class:`~linear_state.HostedStatePool`
  that allocates through SGLang's ``mamba_allocator`` (slot 0, SGLang's dummy slot, reserved), so
  SGLang's accounting stays true: every tree snapshot is one slot of SGLang's pool. Without the
  extra buffer, a released request's slot goes to a reserve of at most ``RECYCLED_SLOTS`` that
  the next clones and hits take before SGLang's free list, and a dry reserve takes
  ``TAKE_BATCH`` slots from SGLang's allocator in one call (:class:`SGLangSlots`): counted in
  ``mamba_evictable_size`` and given back first by ``evict`` and ``reset``.
- ``match_prefix``: the deepest snapshot on the key's path, capped at the request's
  ``_compute_max_prefix_len`` (a request computes at least one token, so the restored state is
  always at the depth the scheduler resumes from). With ``cow_mamba`` the hit state is copied
  into the request's own slot at once (taken from the reserve or SGLang's allocator, evicting a
  snapshot through the policy when none is free; when still none, the match is a miss, never an
  assert).
- ``checkpoint``: copy-on-donate. The request's slot is cloned into a slot the tree owns (SGLang
  hands the slot itself over); the request keeps its slot until it is released. A snapshot is
  taken only where the state is exactly at the inserted key's end (``up_to`` on a page
  boundary): the KV of a cut tail stays the request's, and no state is ever filed at a depth it
  does not belong to.
- The extra buffer (``--mamba-radix-cache-strategy extra_buffer``, SGLang's default with overlap
  scheduling or pages above 1): the request's working slot runs ahead of what the scheduler has
  processed, so ``checkpoint`` clones the state SGLang's runner left in the request's ping-pong
  track slot instead, filed at the depth SGLang recorded for it (``mamba_last_track_seqlen``; when
  that ran past ``up_to`` at the finish, the other track slot's earlier state, as SGLang's own
  cache chooses), and the KV past that depth stays the request's. The runner writes the next
  state into the other track slot, so the one cloned is not being written.
- ``evict``: both currencies through radixcache's policy (:class:`~radixcache.CacheManager`'s
  ``evict``), KV freed through SGLang's allocator.
- The shared tier (opt in, ``shared=`` or ``RADIXCACHE_SHARED_URL``): every snapshot filed is
  published with its prefix's KV rows (:class:`~radixcache.sglang.kv.SGLangKVCodec`) by the
  tier's writer thread; an admission whose local match is shorter than the request first takes a
  deeper verified prefix from the store (``CacheManager.fetch_shared``), a waiting-queue probe
  issues the request's prefetch.

Refused at start with a message (not served correctly yet): the lazy extra buffer
(``extra_buffer_lazy``: track slots taken on demand), speculative decoding, int8 state
checkpoints, virtual mamba slot ids, SWA components, several conv states per layer, hierarchical
cache and disabled radix cache.
"""

from __future__ import annotations

import json
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
    _dfs_weight_order,
)
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

from linear_state import HostedStatePool, RequestOwner, StateLayout, Stream

from ..core.errors import SnapshotRefused
from ..core.events import free_kv_to
from ..core.keys import CacheKey
from ..core.policy import DonationReason, Policy
from ..core.tree import HybridRadixCache, TreeNode
from ..forensics import Forensics
from ..manager.cache_manager import CacheManager
from ..manager.metrics import SkipReason
from ..policies import HitDensity, RequestInfo
from ..tiers.shared import SharedTier
from ..tiers.store import RedisStore, SharedStore
from .kv import SGLangKVCodec

__all__ = ["RadixcacheHybridCache", "SGLangSlots", "sglang_state_pool"]


class SGLangSlots:
    """SGLang's ``MambaSlotAllocator`` as a :class:`~linear_state.SlotLender`, with a reserve of
    at most ``recycle`` slots handed out before SGLang's free list: slots finished requests let go
    (:meth:`keep`), and, with ``batch`` above 1, the rest of a batch taken from SGLang's allocator
    in one call when the reserve ran dry (:meth:`take`). NOTE: on the CPU each allocator call (two
    slices of SGLang's free list and a ``len`` of it) cost ~9 us inside its scheduler, a free (a
    ``torch.cat`` of the whole free list) more (session 35); copy-on-donate makes a round trip per
    finished request (the tree clones the request's final state into a slot of its own, then the
    request's slot is freed), and every clone and hit takes a slot. A reserved slot is SGLang's to
    ask back: the backend counts the reserve as evictable and gives it back first (:meth:`flush`)
    when SGLang evicts, resets, or a slot is needed and SGLang has none free. Each slot has one
    holder throughout: a request, the reserve, SGLang's free list or a tree node.

    :raises TypeError: ``recycle`` or ``batch`` not an int. :raises ValueError: ``recycle``
        negative, ``batch`` below 1, or ``batch`` above ``recycle + 1`` (the rest of a batch is
        held in the reserve).
    """

    def __init__(self, allocator: Any, *, recycle: int = 0, batch: int = 1) -> None:
        for name, v in (("recycle", recycle), ("batch", batch)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if recycle < 0:
            raise ValueError(f"recycle must be >= 0, got {recycle}")
        if not 1 <= batch <= recycle + 1:
            raise ValueError(f"batch must be in [1, recycle + 1] = [1, {recycle + 1}], got {batch}")
        self.allocator = allocator
        self.recycle = recycle
        self.batch = batch
        self.reserve: list[int] = []
        """Slots held for the next takes (no owner in the pool; not on SGLang's free list)."""

    def take(self, n: int) -> list[int] | None:
        """``n`` slots: one from the reserve when it holds any, else from SGLang's free list (for
        one slot, a whole ``batch`` in one call when SGLang has that many free, the rest into the
        reserve); ``None`` when SGLang has too few."""
        if n == 1:
            if self.reserve:
                return [self.reserve.pop()]
            if self.batch > 1:
                got = self.allocator.alloc(self.batch)
                if got is not None:
                    out = _ints(got)
                    self.reserve.extend(out[:0:-1])  # handed out in SGLang's order: its first now
                    return out[:1]
        got = self.allocator.alloc(n)
        return None if got is None else _ints(got)

    def give(self, slots: Sequence[int]) -> None:
        """Back onto SGLang's free list."""
        if slots:
            self.allocator.free(torch.tensor(list(slots), dtype=torch.int64, device=self.allocator.device))

    def available(self) -> int:
        """SGLang's free count, and the reserve's."""
        return int(self.allocator.available_size()) + len(self.reserve)

    def keep(self, slot: int) -> bool:
        """Hold ``slot`` (a request's, which the caller takes from the request) in the reserve:
        False when the reserve is full (the caller frees it to SGLang as before).

        :raises TypeError: ``slot`` not an int. :raises ValueError: ``slot`` negative, or held in
            the reserve already. Nothing changed."""
        if type(slot) is not int:
            raise TypeError(f"a reserved slot is an int, got {type(slot).__name__}")
        if slot < 0 or slot in self.reserve:
            raise ValueError(f"slot {slot} cannot be reserved: negative, or held already ({self.reserve})")
        if len(self.reserve) >= self.recycle:
            return False
        self.reserve.append(slot)
        return True

    def flush(self, n: int | None = None) -> int:
        """Give ``n`` reserved slots (all by default; fewer when fewer are held) back to SGLang's
        free list; returns how many."""
        k = len(self.reserve) if n is None else max(0, min(int(n), len(self.reserve)))
        if k:
            back = self.reserve[-k:]
            del self.reserve[-k:]
            self.give(back)
        return k


def _ints(got: torch.Tensor) -> list[int]:
    """SGLang's allocated slot indices as ints (tolist makes them). NOTE: SGLang hands out a 1-D
    slice of its free list; reshaping it first cost ~8 us per request inside its scheduler (py-spy,
    session 34)."""
    out: list[int] = got.tolist() if got.dim() == 1 else got.reshape(-1).tolist()
    return out


def sglang_state_pool(
    req_to_token_pool: Any, *, stream: Stream | None = None, recycle: int = 0, batch: int = 1
) -> HostedStatePool:
    """A :class:`~linear_state.HostedStatePool` over ``req_to_token_pool``'s mamba pool tensors
    (``conv[0]`` and ``temporal``, layer-major), allocating through its ``mamba_allocator``
    (an :class:`SGLangSlots` with a reserve of ``recycle`` slots, taking ``batch`` at a time),
    slot 0 reserved.

    :raises NotImplementedError: a mamba pool with several conv states per layer.
    :raises TypeError: not a ``HybridReqToTokenPool``; ``recycle`` or ``batch`` not an int.
    :raises ValueError: as :class:`SGLangSlots`.
    """
    if not isinstance(req_to_token_pool, HybridReqToTokenPool):
        raise TypeError(f"a hybrid model's HybridReqToTokenPool is needed, got {type(req_to_token_pool).__name__}")
    cache = req_to_token_pool.mamba_pool.mamba_cache
    if len(cache.conv) != 1:
        raise NotImplementedError(f"mamba pools with {len(cache.conv)} conv states per layer are not served yet")
    conv, temporal = cache.conv[0], cache.temporal
    layout = StateLayout(
        int(conv.shape[0]),
        tuple(conv.shape[2:]),
        tuple(temporal.shape[2:]),
        conv_dtype=conv.dtype,
        recurrent_dtype=temporal.dtype,
    )
    return HostedStatePool(
        layout,
        conv,
        temporal,
        SGLangSlots(req_to_token_pool.mamba_allocator, recycle=recycle, batch=batch),
        reserved=(0,),
        stream=stream,
    )


def _refusals(params: Any) -> list[str]:
    """What in ``params`` the backend cannot serve correctly yet, as messages."""
    out = []
    rtp = params.req_to_token_pool
    if not isinstance(rtp, HybridReqToTokenPool):
        out.append(f"a model without linear-attention state (req_to_token_pool is {type(rtp).__name__})")
        return out
    if getattr(rtp, "enable_mamba_extra_buffer_lazy", False):
        out.append(
            "the lazy mamba extra buffer (--mamba-radix-cache-strategy extra_buffer_lazy):"
            " run with extra_buffer or no_buffer"
        )
    if getattr(rtp, "mamba_v2p_table", None) is not None:
        out.append("virtual mamba slot ids (a unified memory pool)")
    mp = rtp.mamba_pool
    if getattr(mp, "int8_ckpt_pool", None) is not None or getattr(params, "mamba_int8_ckpt", False):
        out.append("int8 state checkpoints")
    if getattr(mp, "enable_linear_replayssm", False) or getattr(mp, "enable_linear_replayssm_spec", False):
        out.append("ReplaySSM ring buffers")
    if getattr(params, "is_eagle", False) or getattr(params, "mtp_draft_mamba_pools", None):
        out.append("speculative decoding")
    if getattr(params, "sliding_window_size", None):
        out.append("sliding-window attention layers")
    if len(mp.mamba_cache.conv) != 1:
        out.append(f"{len(mp.mamba_cache.conv)} conv states per layer")
    return out


# Server flags whose feature bypasses or replaces the prefix cache's own calls: a flag set to anything
# but its default is refused by name, so nobody believes it is served.
_UNSERVED_FLAGS: tuple[tuple[str, str, object], ...] = (
    ("enable_lmcache", "LMCache (--enable-lmcache)", False),
    ("enable_flexkv", "FlexKV (--enable-flexkv)", False),
    ("enable_session_radix_cache", "the session radix cache (--enable-session-radix-cache)", False),
    ("hicache_storage_backend", "a hierarchical-cache storage backend (--hicache-storage-backend)", None),
    ("kv_events_config", "KV cache events (--kv-events-config): the backend publishes none", None),
    ("radix_eviction_policy", "--radix-eviction-policy other than lru (radixcache's policy evicts)", "lru"),
)


def _refused_flags(server_args: Any) -> list[str]:
    """What ``server_args`` asks of the prefix cache that the backend does not serve, by flag."""
    return [
        what
        for name, what, default in _UNSERVED_FLAGS
        if getattr(server_args, name, default) not in (default, None, False, "")
    ]


# The default policy's bonus for a hit no other snapshot on its path would serve, in tokens. SGLang
# checkpoints on a 64-token grid and its prompts are a few hundred tokens, where HitDensity's
# general default (1,000) keeps shallow sole snapshots over deeper ones that save more: at 40 state
# slots the built-in then served up to 4.6% more hit tokens (sglang_differential.py --slots-grid,
# seeds 0 and 1). 300 serves at least the built-in's in every cell of that grid (docs/sglang.md).
SGLANG_HIT_BONUS = 300.0

# Slots the backend holds for the next clones and hits (SGLangSlots' reserve; without the extra
# buffer): those finished requests let go, and the rest of a batch taken from SGLang's allocator in
# one call when none is held. A request releases one slot and takes about 2.4 (its clones, its
# hit), so the reserve runs dry often: a batch of TAKE_BATCH makes one allocator call of several.
# SGLang sees the reserve as evictable and gets it back first.
RECYCLED_SLOTS = 8
TAKE_BATCH = 4

PREFETCH_WAIT_S = 0.02
"""How long an admission waits for its request's prefetch to be answered before asking the store
itself (seconds)."""
_PREFETCH_POLL_S = 0.0002
_ADMITTED_MEMORY = 1 << 16  # requests remembered as admitted (a bound: aborted waiters never release)
_SLOT_INDEX_MEMORY = 1 << 14  # 0-d slot index tensors kept for reuse (_slot_index): ~16K slots, a few MB


def _shared_from_env(server_args: Any) -> dict[str, Any]:
    """The shared tier's arguments from SGLang's environment: ``RADIXCACHE_SHARED_URL`` (a
    ``redis://``, ``rediss://`` or ``unix://`` URL; unset or empty: no shared tier),
    ``RADIXCACHE_SHARED_NAMESPACE`` (default ``radixcache``), ``RADIXCACHE_SHARED_SECRET`` (its
    UTF-8 bytes) and ``RADIXCACHE_MODEL_IDENTITY`` (default: the model path, revision and dtype
    of ``server_args``).

    :raises ValueError: a URL of another scheme, naming it."""
    url = os.environ.get("RADIXCACHE_SHARED_URL", "")
    if not url:
        return {}
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"RADIXCACHE_SHARED_URL must be a redis://, rediss:// or unix:// URL, got {url!r}")
    identity = os.environ.get("RADIXCACHE_MODEL_IDENTITY") or (
        f"{getattr(server_args, 'model_path', None)}@{getattr(server_args, 'revision', None)}"
        f" dtype={getattr(server_args, 'dtype', None)}"
    )
    secret = os.environ.get("RADIXCACHE_SHARED_SECRET")
    return {
        "shared": RedisStore(url),
        "model_identity": identity,
        "shared_namespace": os.environ.get("RADIXCACHE_SHARED_NAMESPACE", "radixcache"),
        "secret": secret.encode() if secret else None,
    }


def _namespace(extra_key: Any, cache_salt: Any) -> Hashable:
    """The tree's namespace of SGLang's ``extra_key`` (a LoRA adapter's, say) and ``cache_salt``:
    None without either; for strings, one string per pair (the pair's JSON: injective), which the
    shared tier can put in a content address, so replicas share such prefixes only under the same
    pair; anything else the pair itself (served locally only)."""
    if extra_key is None and cache_salt is None:
        return None
    if isinstance(extra_key, (str, type(None))) and isinstance(cache_salt, (str, type(None))):
        return "sglang:" + json.dumps([extra_key, cache_salt])
    return (extra_key, cache_salt)


def _key(key: Any) -> tuple[CacheKey, CacheKey, Hashable]:
    """A ``RadixKey``'s whole ids, the ids within its ``limit``, and its namespace.

    :raises TypeError: not a ``RadixKey`` (no ``token_ids`` and ``extra_key``)."""
    if not (hasattr(key, "token_ids") and hasattr(key, "extra_key")):
        raise TypeError(f"key must be SGLang's RadixKey, got {type(key).__name__}")
    full = _ids(key.token_ids)
    ids = full.prefix(len(key)) if getattr(key, "limit", None) is not None else full
    return full, ids, _namespace(key.extra_key, getattr(key, "cache_salt", None))


def _kv(value: Any, what: str) -> torch.Tensor:
    """SGLang's KV indices as a 1-D int64 CPU tensor.

    :raises TypeError: not a tensor of integers. :raises ValueError: not 1-D, or a negative index
        (a float or negative index would be handed back to SGLang's allocator later)."""
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype.is_complex:
        raise TypeError(f"{what} must be an integer tensor of KV indices, got {getattr(value, 'dtype', type(value))}")
    if value.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(value.shape)}")
    if value.numel() and int(value.min()) < 0:
        raise ValueError(f"{what} holds a negative KV index ({int(value.min())})")
    return value.to(torch.int64).cpu()


def _ids(tokens: Any) -> CacheKey:
    """Token ids as radixcache's key, checked and converted once here (SGLang's ``array("q")`` read
    as a buffer, without numpy) and taken as they are by every later call of the request's
    admission or checkpoint (the lookup, the policy's request info, the tree's insert, forensics).

    :raises TypeError, ValueError: as :func:`radixcache.key_bytes` (an id out of range is named
        as SGLang sent it)."""
    if type(tokens) is array:  # key_bytes reads an 8-byte array as a buffer, other typecodes as ids
        return CacheKey(tokens)
    return CacheKey(np.asarray(tokens, dtype=np.int64).reshape(-1))


class RadixcacheHybridCache(BasePrefixCache):  # type: ignore[misc]  # SGLang is untyped
    """SGLang's prefix cache for hybrid models, on radixcache's tree, pool rules and policy.

    :param params: SGLang's ``CacheInitParams`` (``req_to_token_pool`` a ``HybridReqToTokenPool``).
    :param policy: the snapshot policy (default :class:`~radixcache.policies.HitDensity` with
        ``hit_bonus=SGLANG_HIT_BONUS``).
    :param stream: where clones and restores run; on CUDA, the forward stream SGLang hands the
        factory, so they are ordered with the model's kernels (default: immediate, the CPU's).
    :param clock: seconds for the policy.
    :param host_budget_bytes: a host-memory tier of this many bytes (pinned when the pool is on
        CUDA, allocated now): a snapshot evicted for want of SGLang state slots is demoted there
        and still serves hits, restored into the request's slot (docs/host_tier.md). ``None``
        (default): no host tier; SGLang sizes host memory itself, so the plugin takes none unless
        asked (the factory reads ``RADIXCACHE_HOST_TIER_BYTES``).
    :param forensics: ``"sampled"`` (default: one donation in ten fingerprinted and its restores
        verified, findings in ``manager.forensics``; :class:`~radixcache.CacheManager`'s
        ``forensics``), ``"all"`` (every donation watched and every hit verified: to chase a
        wrong-answer report; a snapshot a finding names is never served either way) or ``None``
        (off; on the CPU harness a sampled fingerprint costs about 2 us in C, docs/sglang.md).
        The factory reads ``RADIXCACHE_FORENSICS`` (``sampled``, ``all`` or ``off``).
    :param shared: a store other replicas reach too (a :class:`~radixcache.tiers.store.RedisStore`,
        docs/host_tier.md): every snapshot the tree files is published there with its prefix's KV
        rows (:class:`~radixcache.sglang.kv.SGLangKVCodec`) by the tier's writer thread, and an
        admission whose local match is shorter than the request takes a deeper verified prefix
        from it (its KV from SGLang's allocator, its state cloned into a snapshot) before the hit
        is restored. ``None`` (default): no shared tier. The factory reads
        ``RADIXCACHE_SHARED_URL`` (a ``redis://`` URL), ``RADIXCACHE_SHARED_NAMESPACE`` and
        ``RADIXCACHE_SHARED_SECRET``.
    :param model_identity: what names the model in the shared tier's content address (required
        with ``shared``; the factory's default: the model path, revision and dtype SGLang loaded):
        replicas share blobs only when it agrees.
    :param shared_namespace: the deployment's key prefix in the store (default ``"radixcache"``).
    :param secret: the shared tier's key for its blob digests (1 to 64 bytes; default none):
        replicas with the same secret accept each other's blobs, a blob written by anyone else is
        refused.
    :raises NotImplementedError: a configuration listed in the module's docstring, each named; with
        ``shared``, a KV pool the codec cannot read (MLA, per-row scales, head-major layout).
    :raises ValueError: a negative ``host_budget_bytes``; a ``forensics`` other than
        ``"sampled"``, ``"all"`` or ``None``; ``shared`` without a ``model_identity``.
    :raises TypeError: ``shared`` not a :class:`~radixcache.tiers.store.SharedStore`.
    """

    def __init__(
        self,
        params: Any,
        *,
        policy: Policy | None = None,
        stream: Stream | None = None,
        clock: Any = time.monotonic,
        host_budget_bytes: int | None = None,
        forensics: Literal["sampled", "all"] | None = "sampled",
        shared: SharedStore | None = None,
        model_identity: str | None = None,
        shared_namespace: str = "radixcache",
        secret: bytes | None = None,
    ) -> None:
        if forensics not in ("sampled", "all", None):
            raise ValueError(f"forensics must be 'sampled', 'all' or None, got {forensics!r}")
        if shared is not None and not isinstance(shared, SharedStore):
            raise TypeError(f"shared must be a SharedStore, got {type(shared).__name__}")
        if shared is not None and (not isinstance(model_identity, str) or not model_identity):
            raise ValueError(f"a shared store needs the model's identity (model_identity=), got {model_identity!r}")
        refused = _refusals(params)
        if refused:
            raise NotImplementedError("the radixcache backend does not serve " + "; ".join(refused) + " yet")
        tier = None
        if shared is not None:
            assert model_identity is not None
            tier = SharedTier(
                shared,
                model=model_identity,
                kv=SGLangKVCodec(params.token_to_kv_pool_allocator),
                namespace=shared_namespace,
                secret=secret,
                background=True,
            )
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = int(params.page_size)
        self.disable = bool(params.disable)
        self.extra_buffer = bool(getattr(self.req_to_token_pool, "enable_mamba_extra_buffer", False))
        """SGLang's extra buffer: snapshots come from the request's track slots (module docstring)."""
        self.clock = clock
        # SGLang's request-to-token table as numpy rows when it lives on the CPU (one view, made
        # once; re-made if SGLang replaces the table): a checkpoint reads its request's row there.
        self._rows_of: torch.Tensor | None = None
        self._rows_np: np.ndarray | None = None
        # Without the extra buffer a finished request's slot may become the next clone's (the
        # reserve of SGLangSlots); with it, SGLang's release frees track slots too: its own path.
        recycle, batch = (0, 1) if self.extra_buffer else (RECYCLED_SLOTS, TAKE_BATCH)
        self.state_pool = sglang_state_pool(self.req_to_token_pool, stream=stream, recycle=recycle, batch=batch)
        self.slots: SGLangSlots = self.state_pool.lender  # type: ignore[assignment]
        """The pool's lender: SGLang's allocator and the reserve of recycled slots."""
        # slot ids as 0-d index tensors on SGLang's device, the first _SLOT_INDEX_MEMORY of them
        # kept once made (_slot_index)
        self._slot_index_of: dict[int, torch.Tensor] = {}
        self.tree = HybridRadixCache(self.state_pool, page_size=self.page_size, on_event=free_kv_to(self._free_kv))
        # The manager serves eviction through the policy; SGLang's scheduler drives the requests.
        if policy is None:
            policy = HitDensity(hit_bonus=SGLANG_HIT_BONUS)
        self.manager = CacheManager(
            self.tree,
            policy,
            host_tier=None if host_budget_bytes is None else "auto",
            host_budget_bytes=host_budget_bytes,
            clock=clock,
            forensics=Forensics(self.state_pool, mode="record", warn=True) if forensics == "all" else forensics,
            shared=tier,
        )
        self.shared = tier
        """The shared tier (``shared=``), else None: its ``stats`` say what it published and served."""
        self.policy = self.manager.policy
        self.stats = dict.fromkeys(
            ("admissions", "hit_tokens", "restores", "host_restores", "donations", "skipped_donations"), 0
        )
        """Counters, kept current (hold the dict and read it later): admissions (matches with
        copy-on-write), hit tokens they served, restores (of which from the host tier), donations
        (snapshots cloned), donations skipped for want of a slot (the manager's count)."""
        # Requests the policy heard of (admitted() once per request, however often it is matched).
        # NOTE: with each one's owner in the slot pool, made once per request: a RequestOwner (a
        # frozen dataclass) built at every restore and checkpoint cost ~4 us a request inside
        # SGLang's scheduler (session 36)
        self._admitted: OrderedDict[Hashable, RequestOwner] = OrderedDict()
        if getattr(params, "enable_metrics", False):  # SGLang's --enable-metrics
            self.init_metrics_collector()  # SGLang's radix-cache collector: evictions, load-backs

    @classmethod
    def from_build_context(cls, ctx: Any) -> RadixcacheHybridCache:
        """The factory's work: refuse what SGLang's build context asks that is not served, then build.

        :raises NotImplementedError: a hierarchical cache, a disabled radix cache, a model that is
            not hybrid, or a configuration listed in the module's docstring.
        :raises ValueError: ``RADIXCACHE_HOST_TIER_BYTES`` not a byte count, or
            ``RADIXCACHE_FORENSICS`` not ``sampled``, ``all`` or ``off``.
        """
        refused = []
        if not ctx.is_hybrid_ssm:
            refused.append("models without linear-attention state (use SGLang's default cache)")
        if ctx.is_hybrid_swa:
            refused.append("sliding-window attention layers")
        if ctx.enable_hierarchical_cache:
            refused.append("the hierarchical cache (--enable-hierarchical-cache)")
        if ctx.disable_radix_cache:
            refused.append("a disabled radix cache (drop --radix-cache-backend)")
        sa = ctx.server_args
        if getattr(sa, "speculative_algorithm", None):
            refused.append("speculative decoding")
        refused += _refused_flags(sa)
        if refused:
            raise NotImplementedError("the radixcache backend does not serve " + "; ".join(refused) + " yet")
        stream = None
        runner = getattr(getattr(ctx, "tp_worker", None), "model_runner", None)
        fwd = getattr(runner, "forward_stream", None)
        if fwd is not None and isinstance(fwd, torch.cuda.Stream):
            from linear_state import CudaStream

            stream = CudaStream(stream=fwd)
        host = os.environ.get("RADIXCACHE_HOST_TIER_BYTES")
        try:
            host_bytes = None if not host else int(host)
        except ValueError:
            raise ValueError(f"RADIXCACHE_HOST_TIER_BYTES must be a byte count, got {host!r}") from None
        fx = os.environ.get("RADIXCACHE_FORENSICS", "sampled")
        if fx not in ("sampled", "all", "off"):
            raise ValueError(f"RADIXCACHE_FORENSICS must be 'sampled', 'all' or 'off', got {fx!r}")
        return cls(
            ctx.params,
            stream=stream,
            host_budget_bytes=host_bytes,
            forensics="all" if fx == "all" else "sampled" if fx == "sampled" else None,
            **_shared_from_env(sa),
        )

    # ------------------------------------------------------------------ SGLang's interface
    def reset(self) -> None:
        """Drop every cached prefix: snapshot slots, the reserve of recycled slots and KV go back
        to SGLang's allocators."""
        self.manager.reset()
        self.slots.flush()

    def supports_mamba(self) -> bool:
        """True: this cache keeps linear-state snapshots."""
        return True

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The deepest cached snapshot on the key's path (see the module docstring), never deeper
        than the request's ``_compute_max_prefix_len`` of the whole key. With ``params.cow_mamba``
        and a request (an admission), the hit state is in the request's slot on return, ordered on
        the backend's stream, and the policy hears of the admission and the hit; without (the
        scheduler's probes for its waiting queue) only recency changes."""
        full, ids, ns = _key(params.key)
        req = params.req
        if req is not None and hasattr(req, "_compute_max_prefix_len"):
            ids = ids.prefix(req._compute_max_prefix_len(len(full)))
        mgr = self.manager
        # NOTE: no KV gathered: SGLang reads the hit's KV itself later (prefix_device_indices ->
        # path_device_indices), ~3 us per admission gathered twice otherwise (session 35)
        admission = bool(params.cow_mamba) and req is not None
        if self.disable or not len(ids):
            m = None
        elif self.shared is not None and req is not None:
            m = self._shared_match(req.rid, ids, ns, admission)
        else:
            m = mgr.lookup(ids, namespace=ns, kv=False)
        info = None  # what the policy hears of this admission: computed once, for both calls
        if admission:
            self.stats["admissions"] += 1
            if req.rid not in self._admitted:  # a request the scheduler could not add is matched again
                self._admitted[req.rid] = RequestOwner(("sglang", req.rid))
                if len(self._admitted) > _ADMITTED_MEMORY:
                    self._admitted.popitem(last=False)
                info = mgr.request_info(full, 0 if m is None else m.cached_length, session=_session(req))
                mgr.admitted(info)
        if m is None or m.cached_length == 0:
            return self._miss(ns)
        node = m.node
        if admission:
            while True:
                try:
                    restored = self._restore_into(req, node, full, m.cached_length, info)
                except SnapshotRefused:
                    # forensics names the snapshot: the manager dropped it (or, while another
                    # request holds it, will); the next snapshot up the path, when the lookup
                    # finds another, else a miss
                    again = mgr.lookup(ids, namespace=ns, kv=False)
                    if again.cached_length == 0 or again.node is node:
                        return self._miss(ns)
                    m, node, info = again, again.node, None
                    continue
                break
            if not restored:
                return self._miss(ns)
            self.stats["hit_tokens"] += m.cached_length
        n = m.cached_length
        return MatchResult(n, node, node, node, cache_protected_len=n, full_kv_hit_length=n)

    def _shared_match(self, rid: Hashable, ids: CacheKey, ns: Hashable, admission: bool) -> Any:
        """The match with the shared tier on: at an admission, a deeper verified prefix from the
        store filed into the tree first (the answer of a prefetch this request's earlier probe
        issued, else the store asked now); at a probe of the waiting queue, the prefetch issued
        (answered on the tier's fetcher thread) and the local match."""
        mgr = self.manager
        if admission:
            if mgr.shared_pending(rid) and not self._answered(rid):
                # NOTE: the fetcher still at it after PREFETCH_WAIT_S: the prefetch is dropped and
                # the store asked now, so a hit is never lost to the race (the manager would serve
                # the admission locally)
                assert self.shared is not None
                self.shared.cancel(rid)
                rid = None
            return mgr.fetch_shared(ids, namespace=ns, rid=rid)
        mgr.prefetch(rid, ids, namespace=ns, limit=len(ids))
        return mgr.lookup(ids, namespace=ns, kv=False)

    def _answered(self, rid: Hashable) -> bool:
        """Wait, at most :data:`PREFETCH_WAIT_S`, for ``rid``'s prefetch to be answered (SGLang
        admits a request in the scheduler step it arrived in when the batch has room: its
        prefetch is then a round trip or two from its answer, less than asking the store anew)."""
        mgr = self.manager
        deadline = time.monotonic() + PREFETCH_WAIT_S
        while mgr.shared_pending(rid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_PREFETCH_POLL_S)  # lets go of the interpreter lock: the fetcher runs
        return True

    def prefetch_request(self, req: Any) -> bool:
        """When ``req`` arrives (the plugin's hook after SGLang's ``Scheduler._prefetch_kvcache``,
        :func:`radixcache.sglang.plugin.register`): start the shared tier's probe and fetch for
        its prompt on the tier's fetcher thread, so that its admission takes the answer with one
        look-up instead of asking the store on the scheduler's thread. True when issued; False
        without a shared tier, for a prefix the tree holds already, a namespace the tier cannot
        address (an extra key or cache salt), a request whose prefix SGLang does not cache
        (positional embedding overrides), or one with a prefetch out. O(match).

        :raises TypeError, ValueError: token ids SGLang would refuse too (as ``match_prefix``)."""
        if self.shared is None or self.disable or getattr(req, "positional_embed_overrides", None) is not None:
            return False
        out = req.output_ids
        ids = _ids(req.origin_input_ids if not out else [*req.origin_input_ids, *out])
        n = req._compute_max_prefix_len(len(ids))
        if n <= 0:
            return False
        ns = _namespace(req.extra_key, getattr(req, "cache_salt", None))
        return self.manager.prefetch(req.rid, ids, namespace=ns, limit=n)

    def release_aborted_request(self, handle: Any) -> None:
        """SGLang's call (through ``finish(handle, ABORT)``) for a request aborted while it waited
        or refused at arrival: its shared-tier prefetch is dropped, and the answer's memory with
        it. Nothing else of the cache is the request's before its admission."""
        if self.shared is not None:
            self.shared.cancel(getattr(handle, "rid", None))

    def dfs_weight_order(self, node_handles: Sequence[Any]) -> list[int]:
        """Request indices in depth-first, subtree-weight order (SGLang's DFS-weight scheduling),
        per tree: requests under one extra key stay together, trees in order of first appearance."""
        groups: dict[int, list[int]] = {}
        roots: dict[int, Any] = {}
        for i, node in enumerate(node_handles):
            r = node
            while r.parent is not None:
                r = r.parent
            groups.setdefault(id(r), []).append(i)
            roots[id(r)] = r
        order: list[int] = []
        for rid, members in groups.items():
            sub = _dfs_weight_order(roots[rid], [node_handles[i] for i in members], lambda h: h)
            order.extend(members[j] for j in sub)
        return order

    def _restore_into(
        self, req: Any, node: TreeNode, full: CacheKey, hit: int, info: RequestInfo | None = None
    ) -> bool:
        """Copy ``node``'s snapshot into the request's slot (allocated if it has none); the policy
        hears of the hit of ``full`` (the request's ids) at depth ``hit`` (``info``: the
        admission's request info of that hit, when the caller has it). False: no slot to be
        had (a miss).

        :raises SnapshotRefused: the manager refused the snapshot for a finding of forensics;
            the request's slot is then marked for SGLang to clear before its forward (a miss,
            unless the caller finds another hit)."""
        kv = req.kv
        mgr = self.manager
        if not kv.holds_mamba:
            # NOTE: through the reserve (SGLangSlots.take), not SGLang's allocator: its calls cost
            # ~9 us each inside the scheduler, a batch of them one (session 36)
            got = self.slots.take(1)
            if got is None:  # none free nor held: one snapshot goes through the policy, the hit kept
                mgr.make_room(keep=node)
                got = self.slots.take(1)
            if got is None:
                return False
            kv.mamba_pool_idx = self._slot_index(got[0])
        from_host = node.snapshot is None
        if info is None:
            info = mgr.request_info(full, hit, session=_session(req))
        owner = self._owner(req)
        slot = self.state_pool.lend(int(kv.mamba_pool_idx), owner)
        try:
            mgr.restore(node, slot, dst_owner=owner, info=info)
        except SnapshotRefused:
            # forensics names the snapshot (changed, or never written): not served; unless the
            # caller restores another hit, the request computes its prompt from the zero state,
            # which SGLang writes into its slot before the forward
            kv.mamba_cow_src_index = None
            kv.mamba_needs_clear = True
            raise
        finally:  # SGLang's slot again, whatever happened
            self.state_pool.reclaim(slot, owner)
        if from_host:
            self.stats["host_restores"] += 1
            if self.metrics_collector is not None:  # a hit of `hit` tokens served from host memory
                self.metrics_collector.increment_load_back_num_tokens(hit, "mamba")
        kv.mamba_cow_src_index = None
        kv.mamba_needs_clear = False
        self.stats["restores"] += 1
        return True

    def insert(self, params: InsertParams) -> InsertResult:
        """Insert ``params.key`` with its KV (``params.value``); with ``params.mamba_value`` (a slot
        holding the state after the page-cut key) the tree clones it and keeps the new tail's KV.
        Of the caller's indices for tokens already cached, those past ``params.prev_prefix_len``
        that differ from the tree's are duplicates and go back to SGLang's allocator; those
        before it are the caller's copy of the tree's and are left alone (SGLang's contract).
        The caller keeps its slot: ``mamba_exist`` is always True (SGLang's callers then free
        the slot they passed)."""
        _, ids, ns = _key(params.key)
        kv = _kv(params.value, "insert's value")
        slot = None if params.mamba_value is None else int(params.mamba_value.reshape(-1)[0])
        prev = min(int(params.prev_prefix_len), len(ids))
        res = self._insert(ids, kv, slot, ns, RequestOwner(("sglang-insert", id(params))), None, prev)
        if res.duplicates:  # the tree compared [prev, prefix_length) and handed the differing ones back
            self._free_kv(res.released)
        return InsertResult(
            prefix_len=res.prefix_length, total_len=len(ids), last_device_node=res.node, mamba_exist=True
        )

    def _insert(
        self,
        ids: CacheKey,
        kv: torch.Tensor | np.ndarray,
        slot: int | None,
        ns: Hashable,
        owner: RequestOwner,
        req: Any,
        known: int,
    ) -> Any:
        """Insert with ``slot`` lent to ``owner`` (the donor) for the clone and reclaimed after; no
        free slot for the clone even after evicting one through the policy: insert without a
        snapshot. The first
        ``known`` indices are the tree's own (SGLang's contract: not compared). ``kv``: a tensor
        of indices, or a CPU row's numpy view (int32 or int64: the tree copies what it stores)."""
        if isinstance(kv, torch.Tensor):
            kv = kv.to(torch.int64).cpu()
        mgr = self.manager
        # NOTE: no make_room first: a clone that finds no slot makes the manager evict one snapshot
        # through the policy, or file the KV alone (counted as skipped for want of a slot), and a
        # donation the tree already holds takes no slot, so evicts nothing
        if slot is None:
            return mgr.checkpoint(ids, kv, namespace=ns, known_prefix=known)
        reason = DonationReason.FINISH if req is not None and req.finished() else DonationReason.CAPTURE
        s = self.state_pool.lend(slot, owner)
        try:
            res = mgr.checkpoint(
                ids,
                kv,
                state_slot=s,
                namespace=ns,
                donor=owner.rid,
                reason=reason,
                session=_session(req),
                known_prefix=known,
            )
        finally:  # SGLang's slot again, whatever happened
            self.state_pool.reclaim(s, owner)
        if res.snapshot_created:
            self.stats["donations"] += 1
        else:  # held already, or no slot even after an eviction: the manager counted which
            self.stats["skipped_donations"] = mgr.metrics().donations_skipped[SkipReason.NO_SLOT.value]
        return res

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Insert ``[cache_protected_len, up_to)`` of the request's row, donating a clone of its
        state when ``up_to`` is page aligned, then repoint the row onto the tree's KV, move the
        request's lock to the deepest snapshot it reaches and advance ``cache_protected_len``.
        With the extra buffer: the row up to the tracked state's depth (:meth:`_tracked`), with a
        clone of that track slot; nothing when no state was tracked since the last checkpoint."""
        if self.disable:
            return
        kvr = req.kv
        slot: int | None = None
        if self.extra_buffer:
            tracked = self._tracked(req, int(up_to))
            if tracked is None:
                return
            up_to, slot = tracked
        ids = _ids(req.full_untruncated_fill_ids[:up_to])
        n = len(ids)
        prot = int(kvr.cache_protected_len)
        if n <= prot:
            return
        row = self._row(kvr.req_pool_idx)
        # NOTE: a CPU row's indices as a numpy view (int32), which the tree reads as they are and
        # widens only where it keeps a copy: the torch slice, conversion and .numpy() cost ~13 us
        # of a checkpoint inside SGLang's scheduler, widening the whole row ~4 us (session 34)
        kv = row[:n]
        ns = _namespace(req.extra_key, getattr(req, "cache_salt", None))
        if not self.extra_buffer and kvr.holds_mamba and n % self.page_size == 0:
            slot = int(kvr.mamba_pool_idx)
        # [0, prot) of the row is the tree's own KV (the admission's match or the last checkpoint's
        # repointing; the request's lock keeps it): not compared again
        res = self._insert(ids, kv, slot, ns, self._owner(req), req, prot)
        node = res.node
        if not (HybridRadixCache.holds_snapshot(node) or node.host is not None) or node.depth <= prot:
            return  # nothing new a later request could resume from: the row stays the request's
        depth = node.depth
        if res.duplicates:  # another request filed some of the key first: take the tree's KV here
            if res.prefix_length <= depth:
                # The tree compared [prot, prefix_length) and handed back exactly the row's indices
                # there that differ from its own.
                self._free_kv(res.released)
            else:
                # The donation was skipped and the node is shallower than the key: duplicates past
                # `depth` stay the row's, for SGLang's release to free; those before it are found
                # by comparing.
                self._free_differing(row, self.tree.kv_indices(node, start=prot), prot, depth)
            # freed first (they may be a view of the row): the row names the tree's KV from here on
            if isinstance(row, np.ndarray):
                # NOTE: straight from the edges into the row: the tensor of kv_indices and its
                # assignment cost ~13 us per request inside SGLang's scheduler (session 34)
                self.tree.kv_into(node, row, start=prot)
            else:
                _write_row(row, self.tree.kv_indices(node, start=prot), prot, depth)
        # else the tree adopted the row's own indices for [prot, depth): the row already names them
        old = req.lock
        if old is None:
            req.lock = self.lock(node)
        else:  # SGLang's unlock then lock, in one walk of the paths where the two nodes differ
            self.manager.relock(old.node, node)
            # NOTE: the request's lock re-pointed, not rebuilt: SGLang's lock dataclasses cost ~3 us
            # a checkpoint inside its scheduler (session 36); only the request holds its lock
            old.node = node
            old.receipt.node_id = node.id
        kvr.cache_protected_len = depth
        req.last_node = node
        if self.shared is not None:  # what this checkpoint filed goes to the tier's writer now
            self.manager.publish_pending()

    def _tracked(self, req: Any, up_to: int) -> tuple[int, int] | None:
        """The extra buffer's state to file at a checkpoint up to ``up_to``: ``(depth, track slot)``,
        or ``None`` when there is none. The latest tracked state (``mamba_last_track_seqlen``, in
        the slot ``mamba_last_track_idx``); at the finish, when that ran past ``up_to``, the other
        slot's earlier one (``mamba_prev_track_seqlen``), as SGLang's own cache chooses. A running
        request's tracked depths are then cleared (SGLang's protocol): its next checkpoint files
        only what its runner tracks after this one."""
        kvr = req.kv
        pool = self.req_to_token_pool
        buf = kvr.mamba_ping_pong_track_buffer
        last = kvr.mamba_last_track_seqlen
        if not req.finished():
            kvr.mamba_last_track_seqlen = None
            kvr.mamba_prev_track_seqlen = None
        if buf is None or last is None:
            return None
        keep = int(kvr.mamba_last_track_idx)
        depth = int(last)
        if depth > up_to:
            prev = kvr.mamba_prev_track_seqlen
            two = pool.mamba_ping_pong_track_buffer_size == 2
            if not req.finished() or not two or prev is None or int(prev) > up_to:
                return None
            depth, keep = int(prev), pool.get_mamba_ping_pong_other_idx(keep)
        if depth % self.page_size:
            return None  # SGLang tracks on its page grid: a state off it has no key to file under
        return depth, int(buf[keep])

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        """The request's row is freed and its lock dropped: its mamba slot goes to the reserve of
        recycled slots for the next clone (:class:`SGLangSlots`; without the extra buffer, while
        the reserve has room), else back to SGLang's allocator (the tree kept clones, never the
        slot)."""
        self._admitted.pop(req.rid, None)
        kv = req.kv
        if kv.holds_mamba:
            # NOTE: what SGLang's free_mamba_cache does without the extra buffer, the slot kept
            # instead of freed: the next clone takes it without SGLang's allocator (session 35)
            if self.slots.recycle and self.slots.keep(int(kv.mamba_pool_idx)):
                kv.mamba_pool_idx = None
            else:
                self.req_to_token_pool.free_mamba_cache(req)

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` KV tokens and ``params.mamba_num`` snapshots, in the
        policy's order (or as many as are evictable). With SGLang's metrics on, the KV tokens freed
        and the pass's duration go to SGLang's eviction metrics."""
        start = time.perf_counter()
        want = int(params.mamba_num)
        back = self.slots.flush(want)  # the reserve first: slots no snapshot is lost for
        r = self.manager.evict(snapshots=want - back, kv_tokens=int(params.num_tokens))
        self.update_eviction_metrics(r.kv_tokens, start)  # SGLang's sglang:evicted_tokens_total
        return EvictResult(num_tokens_evicted=r.kv_tokens, mamba_num_evicted=r.snapshots + back)

    def lock(self, node: Any) -> TreeLock:
        """Take a tree lock on ``node`` for one holder (SGLang's ``lock``: :meth:`inc_lock_ref` and
        its receipt, built directly); :meth:`unlock` releases it."""
        self.manager.lock(node)
        return _tree_lock(node)

    def unlock(self, lock: TreeLock | None) -> None:
        """Release a :meth:`lock` (SGLang's ``unlock``: :meth:`dec_lock_ref` of its node)."""
        if lock is not None:
            self.manager.unlock(lock.node)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        """Lock ``node`` (its snapshot and its path's KV)."""
        self.manager.lock(node)
        return _locked(node)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        """Undo one :meth:`inc_lock_ref` of ``node``."""
        self.manager.unlock(node)
        return DecLockRefResult(delta=0)

    def path_device_indices(self, node: Any) -> torch.Tensor:
        """KV indices of the path from the root to ``node``."""
        return self.tree.kv_indices(node)

    def root_node_handle(self, extra_key: str | None = None) -> Any:
        """The root of ``extra_key``'s tree."""
        return self.tree.root(_namespace(extra_key, None))

    @property
    def root_node(self) -> Any:
        """The root of the tree without an extra key."""
        return self.root_node_handle()

    def evictable_size(self) -> int:
        """KV tokens the tree holds unlocked."""
        return self.tree.evictable_kv_tokens

    full_evictable_size = evictable_size  # one KV pool

    def protected_size(self) -> int:
        """KV tokens on locked paths."""
        return self.tree.protected_kv_tokens

    full_protected_size = protected_size  # one KV pool

    def mamba_evictable_size(self) -> int:
        """Slots of SGLang's mamba pool :meth:`evict` can free: the tree's unlocked snapshots and
        the reserve of recycled slots (:class:`SGLangSlots`)."""
        return self.tree.evictable_snapshots + len(self.slots.reserve)

    def mamba_protected_size(self) -> int:
        """Locked snapshots."""
        return self.tree.protected_snapshots

    def total_size(self) -> tuple[int, int]:
        """(KV tokens, snapshots) the tree holds."""
        return self.tree.total_kv_tokens, self.tree.num_snapshots

    def sanity_check(self) -> None:
        """Every invariant of the tree, its pool and its policy, and of the reserve of recycled
        slots: at most its bound, each slot once, owned by nobody in the pool, not SGLang's dummy
        slot and not on SGLang's free list (raises ``AssertionError``)."""
        held = self.slots.reserve  # first: a double holder breaks the pool's count below too
        assert len(held) <= self.slots.recycle, f"{len(held)} recycled slots, at most {self.slots.recycle}"
        assert len(set(held)) == len(held), f"a recycled slot held twice: {sorted(held)}"
        for x in held:
            assert x not in self.state_pool.reserved, f"SGLang's dummy slot {x} was recycled"
            assert self.state_pool.owner_of(x) is None, f"recycled slot {x} is owned by {self.state_pool.owner_of(x)}"
        free = getattr(self.req_to_token_pool.mamba_allocator, "free_slots", None)
        if held and isinstance(free, torch.Tensor):
            both = sorted(set(held) & set(free.tolist()))
            assert not both, f"recycled slots {both} are on SGLang's free list too"
        self.manager.check_invariants()
        self.state_pool.check_invariants()

    def pretty_print(self) -> None:
        """Print the tree's summary."""
        print(self.tree.describe())

    def all_values_flatten(self) -> torch.Tensor:
        """Every KV index the tree holds (SGLang's leak census reads it)."""
        parts = [n.value for n in self.tree.iter_nodes() if n.depth > 0]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def all_mamba_values_flatten(self) -> torch.Tensor:
        """Every mamba slot the cache holds: the tree's snapshots and the reserve of recycled
        slots (SGLang's leak census reads it)."""
        slots = [int(n.snapshot) for n in self.tree.iter_nodes() if n.snapshot is not None]
        return torch.tensor(slots + self.slots.reserve, dtype=torch.int64)

    def take_events(self) -> list[Any]:
        """No KV placement events are published."""
        return []

    # ------------------------------------------------------------------ helpers
    def _row(self, req_pool_idx: int) -> torch.Tensor | np.ndarray:
        """SGLang's request-to-token row ``req_pool_idx``: a numpy view when the table is on the
        CPU (it shares the table's memory), else the tensor row."""
        table = self.req_to_token_pool.req_to_token
        if table is not self._rows_of:
            self._rows_of = table
            self._rows_np = table.numpy() if table.device.type == "cpu" else None
        if self._rows_np is None:
            row: torch.Tensor = table[req_pool_idx]
            return row
        return self._rows_np[req_pool_idx]  # type: ignore[no-any-return]

    def _owner(self, req: Any) -> RequestOwner:
        """``req``'s owner in the slot pool: the one made at its admission (or an equal one)."""
        owner = self._admitted.get(req.rid)
        return RequestOwner(("sglang", req.rid)) if owner is None else owner

    def _slot_index(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` as the 0-d index tensor SGLang's own code holds in ``mamba_pool_idx`` (its
        allocator's slice, ``[0]``). NOTE: made once per slot and kept (up to
        ``_SLOT_INDEX_MEMORY``): making one cost ~5 us a hit inside SGLang's scheduler
        (session 36). Nothing writes an index tensor in place, so requests that hold the same
        slot one after the other may share one."""
        t = self._slot_index_of.get(slot)
        if t is None:
            t = torch.tensor(slot, dtype=torch.int64, device=self.slots.allocator.device)
            if len(self._slot_index_of) < _SLOT_INDEX_MEMORY:
                self._slot_index_of[slot] = t
        return t

    def _miss(self, ns: Hashable) -> MatchResult:
        """A match without a hit: the tree's root for ``ns`` in every node field."""
        root = self.tree.root(ns)
        return MatchResult(0, root, root, root, cache_protected_len=0)

    def _free_differing(self, row: torch.Tensor | np.ndarray, tree_kv: torch.Tensor, start: int, end: int) -> None:
        """Free the row's indices in ``[start, end)`` that differ from the tree's KV ``tree_kv``
        (int64, on the CPU): duplicates the tree did not adopt. ``row``: :meth:`_row`'s (a CPU
        row is a numpy view: NOTE: the torch masked select cost ~15 us of a checkpoint's ~250 in
        the SGLang scheduler benchmark). The differing indices are copied out (a mask), so the row
        may be rewritten after."""
        if isinstance(row, np.ndarray):
            old = row[start:end]
            differ = old != tree_kv.numpy()
            if differ.any():
                self._free_kv(torch.from_numpy(old[differ].astype(np.int64, copy=False)))
            return
        cur = row[start:end]
        dup = cur[cur != tree_kv.to(row.device)]
        if dup.numel():
            self._free_kv(dup)

    def _free_kv(self, kv: torch.Tensor) -> None:
        self.token_to_kv_pool_allocator.free(kv.to(self.token_to_kv_pool_allocator.device))


def _write_row(row: torch.Tensor, kv: torch.Tensor, start: int, end: int) -> None:
    """``row[start:end] = kv`` (int64 on the CPU) in the device row's dtype and on its device (a
    CPU row, a numpy view, takes the tree's KV through :meth:`HybridRadixCache.kv_into`)."""
    row[start:end] = kv.to(row.device, row.dtype)


def _session(req: Any) -> Hashable | None:
    """The conversation SGLang says ``req`` continues (its ``session_id``), if any."""
    return getattr(req, "session_id", None) if req is not None else None


def _locked(node: TreeNode) -> IncLockRefResult:
    """SGLang's receipt of a lock on ``node`` (one pool of KV: nothing to replay but the node)."""
    return IncLockRefResult(delta=0, node_id=node.id)


def _tree_lock(node: TreeNode) -> TreeLock:
    """SGLang's ``TreeLock`` on ``node``: what ``TreeLock(node, _locked(node).to_dec_params())``
    builds (a receipt naming the node, nothing else to replay), without the receipt's round trip.
    NOTE: SGLang's dataclasses cost ~5 us a lock that way inside its scheduler."""
    return TreeLock(node, DecLockRefParams(node_id=node.id))
