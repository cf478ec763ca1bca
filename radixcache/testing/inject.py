"""The historical bugs, committed on purpose, so the hammer and the fuzzing kit prove they catch
them. Never use these classes outside tests.

================  =============================================================================
``alias``         ownership transfer instead of copy-on-donate: the tree records the donor's own
                  slot as its snapshot; the donor's later writes (and the next owner of the
                  slot once the donor frees it) poison every hit on that branch.
no-donate-fence   the donate clone is not ordered after the producer's fence: it can copy the
                  slot before the capturing forward wrote it.
no-restore-fence  the hit restore copies the snapshot at once, not ordered after the clone that
                  fills it.
================  =============================================================================

The fuzzing kit adds bugs of the host side (:data:`FUZZ_BUGS`):

=====================  ========================================================================
free-before-fence      a request's slots go back to the pool without waiting its last forward:
                       the late write lands in the next owner's state.
unlock-before-restore  the hit is unlocked as soon as the restore is queued: eviction can free
                       the KV the request is about to read.
snapshot-off-by-page   a captured state is donated one page shallower than where it was taken.
double-free-swallowed  track slots are freed twice and the pool swallows it, putting them on the
                       free list twice.
tree-keeps-kv-view     the tree keeps a view of the caller's KV index buffer instead of a copy:
                       a host that reuses its buffer rewrites the tree's pages.
namespace-blind        the tree matches without the request's namespace: a LoRA request is
                       served the base model's state.
image-digest-prefix    image digests cover the first 4 KiB of each image only: two images that
                       differ further on share cache ids.
full-hit-admission     admission matches all ids instead of all but the last: a full hit leaves
                       the host no token to compute.
host-restore-early     a hit served from the host tier returns the fence of the snapshot's
                       demotion instead of the promote copy's: the request's first forward runs
                       before its state arrived.
demote-keeps-slot      a demotion gives the device slot back to the pool but leaves the node
                       pointing at it: the next owner of the slot writes the node's snapshot.
shared-trusts-sizes    the shared tier takes a blob whose sizes match without checking its digest
                       or its state's fingerprint: a corrupted or misplaced blob is served.
shared-key-no-ns       the shared tier's addresses (keys and depth index) leave the request's
                       namespace out: a LoRA request is served the base model's published state.
edge-last-page-only    the tree's walk takes an edge when the key agrees with its last page
                       only: a match returns a sibling branch's snapshot.
lru-evicts-locked      the tree's LRU snapshot queue no longer skips locked nodes: a snapshot a
                       live request holds is evicted.
=====================  ========================================================================

hf-conv-shift          the transformers bridge loads the conv window one column off when it
                       restores a hit (the kit's default bridge adapter, and ``radixcache hammer
                       --model hf:FAMILY``, find it; needs the hf extra).
=====================  ========================================================================

One more is found by the hammer, not the fuzzing kit (:data:`HAMMER_ONLY_BUGS`):

=====================  ========================================================================
capture-one-late       hit-density captures one token past each point it chose (a block
                       boundary, a branch, the resend point): every answer stays exact, fewer
                       prompt tokens are served from cache. The hit-rate guard
                       (:mod:`radixcache.testing.guard`) fails it.
=====================  ========================================================================

The misuse fuzzer adds bugs of the edges (:data:`MISUSE_BUGS`):

=========================  ====================================================================
validates-after-mutating   commit counts the window's tokens before it checks the window's KV
                           indices: a refused commit leaves the request claiming tokens it has
                           no KV for.
accepts-foreign-node       the tree takes any node, whichever cache made it: a foreign node is
                           locked, unlocked, evicted or restored from this cache's pool.
accepts-negative-kv        commit takes negative KV indices: the tree would hand them back to
                           the host's allocator through ``KV_FREED`` events.
keeps-failed-admission     an admission that fails in code the manager called (its policy)
                           raises but keeps its slots and its lock.
=========================  ====================================================================
Where a bug can be committed through a public seam it is (``no-donate-fence`` through the pool's
``clone``, ``double-free-swallowed``'s swallowing through its ``free``, ``namespace-blind`` through
the tree's ``match``, ``alias`` and ``no-restore-fence`` through the tree's ``restore``,
``unlock-before-restore`` through the manager's ``admit``, ``tree-keeps-kv-view`` through the
tree's ``insert``); the rest override the private step that holds the mistake (the manager waits a
request's fences itself before it frees its slots: forgetting that is a private step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from linear_state import (
    COMPLETE,
    Fence,
    LinearStatePool,
    NodeOwner,
    Owner,
    RequestOwner,
    SlotId,
    SlotWrite,
    StateLayout,
    Stream,
)

from ..core.events import TreeEvent, TreeEventKind, TreeListener
from ..core.keys import CacheKey, KeyLike
from ..core.policy import DonationReason, RequestInfo
from ..core.tree import HybridRadixCache, InsertResult, MatchResult, TreeNode
from ..manager.cache_manager import Admission, CacheManager, Refusal, WindowPlan, WindowResult, _Request
from ..policies import FixedPoints, HitDensity, Policy
from ..tiers.blob import DIGEST_BYTES, bytes_tensor, parse_blob
from ..tiers.shared import Fetched, SharedTier
from ..tiers.store import SharedStore

__all__ = [
    "BUGS",
    "FUZZ_BUGS",
    "HAMMER_BUGS",
    "HAMMER_ONLY_BUGS",
    "MISUSE_BUGS",
    "injected",
    "make_cache",
    "make_fuzz_stack",
    "make_hit_density",
    "make_manager",
    "make_pool",
    "make_shared_tier",
]


def _raw_restore(tree: HybridRadixCache, node: TreeNode, dst_slot: int, ordered: bool) -> Fence:
    """A restore as engines without an ownership-checking pool do it: a raw copy of the rows."""
    if node.snapshot is None:
        raise ValueError(f"node {node.id} holds no snapshot to restore")
    src, pool = node.snapshot, tree.pool

    def work() -> None:
        torch._foreach_copy_(
            (pool.conv[:, dst_slot], pool.recurrent[:, dst_slot]), (pool.conv[:, src], pool.recurrent[:, src])
        )

    if not ordered:
        work()  # BUG (no-restore-fence): runs now, whatever the clone filling ``src`` has done
        return COMPLETE
    assert tree.stream is not None
    return tree.stream.submit(work, after=(node.snapshot_fence,), label=f"raw restore {src}->{dst_slot}")


class _AliasTree(HybridRadixCache):
    def restore(
        self, node: TreeNode, dst_slot: int, *, stream: Stream | None = None, dst_owner: Owner | None = None
    ) -> Fence:
        # The snapshot slot is not the tree's: the pool would (rightly) refuse to read it once the
        # donor freed it, so this tree copies raw rows, ordered after the snapshot's fence.
        return _raw_restore(self, node, dst_slot, ordered=True)

    def _take_snapshot(self, state_slot: int, owner: NodeOwner, ready: Fence | None) -> SlotWrite:
        return SlotWrite(SlotId(state_slot), COMPLETE)  # BUG: the donor's slot, not a private clone

    def _free_snapshot(self, n: TreeNode) -> None:
        # The aliased slot belongs to the donor (or its next owner): dropping it is all we can do.
        if self.on_event is not None:
            self.on_event(TreeEvent(TreeEventKind.SNAPSHOT_FREED, n, tier="device", slot=n.snapshot))
        n.snapshot = None
        n.snapshot_fence = COMPLETE
        self._num_snapshots -= 1


class _NoDonateFencePool(LinearStatePool):
    """Through the pool's public ``clone``: the device pool's one clone is the tree's donation."""

    def clone(self, src: int, owner: Owner, *, stream: Stream | None = None, after: Iterable[Fence] = ()) -> SlotWrite:
        return super().clone(src, owner, stream=stream)  # BUG: the producer's fence ``after`` not waited


class _NoRestoreFenceTree(HybridRadixCache):
    def restore(
        self, node: TreeNode, dst_slot: int, *, stream: Stream | None = None, dst_owner: Owner | None = None
    ) -> Fence:
        self.pool.check_writable(dst_slot, dst_owner)
        return _raw_restore(self, node, dst_slot, ordered=False)


BUGS: tuple[str, ...] = ("alias", "no-donate-fence", "no-restore-fence")
"""The three historical bugs of hybrid prefix caches (the first table above)."""


class _FreeBeforeFenceManager(CacheManager):
    # Not through the pool's ``free``: the manager waits the request's fences itself, then frees.
    def _release(self, rec: _Request, after: Iterable[Fence]) -> int:
        slots = (rec.live, *rec.tracks)
        for s in slots:
            self.pool.free(s, rec.owner)  # BUG: the host's last forward may still write these
        self.cache.unlock(rec.lock)
        del self._requests[rec.rid]
        return len(slots)


class _UnlockBeforeRestoreManager(CacheManager):
    def admit(
        self,
        rid: Hashable,
        cache_ids: KeyLike,
        *,
        namespace: Hashable = None,
        session: Hashable | None = None,
        now: float | None = None,
        max_new_tokens: int = 0,
    ) -> Admission | Refusal:
        res = super().admit(
            rid, cache_ids, namespace=namespace, session=session, now=now, max_new_tokens=max_new_tokens
        )
        if isinstance(res, Admission) and res.cached_length:
            rec = self._requests[rid]
            self.cache.unlock(rec.lock)  # BUG: the hit (and its KV) is unprotected from here on
            rec.lock = self.cache._null_root
            self.cache.lock(rec.lock)
        return res


class _OffByPageManager(CacheManager):
    def _donate(
        self,
        rec: _Request,
        depth: int,
        slot: int,
        ready: Fence | None,
        reason: DonationReason,
        now: float,
        freed: list[torch.Tensor],
    ) -> TreeNode | None:
        page = self.cache.page_size
        if depth > page:  # BUG: the state captured at ``depth`` is keyed one page shallower
            depth -= page
        return super()._donate(rec, depth, slot, ready, reason, now, freed)


class _SwallowingPool(LinearStatePool):
    def free(self, slot: int, owner: Owner, *, after: Iterable[Fence] = (), wait: bool = True) -> None:
        if self.owner_of(slot) is None:
            self._free.append(SlotId(int(slot)))  # BUG: a double free is swallowed (and listed twice)
            return
        super().free(slot, owner, after=after, wait=wait)


class _DoubleFreeManager(CacheManager):
    def _release(self, rec: _Request, after: Iterable[Fence]) -> int:
        n = super()._release(rec, after)
        for s in rec.tracks:
            self.pool.free(s, rec.owner)  # BUG: freed a second time
        return n


class _KVViewTree(HybridRadixCache):
    """Inserts keep the caller's index memory: the private copy is skipped (the bug)."""

    def insert(
        self,
        key: KeyLike,
        kv_indices: torch.Tensor | np.ndarray | list[int],
        *,
        state_slot: int | None = None,
        ready: Fence | None = None,
        namespace: Hashable = None,
        release_duplicates: bool = True,
        known_prefix: int = 0,
    ) -> InsertResult:
        res = super().insert(
            key,
            kv_indices,
            state_slot=state_slot,
            ready=ready,
            namespace=namespace,
            release_duplicates=release_duplicates,
            known_prefix=known_prefix,
        )
        if isinstance(kv_indices, torch.Tensor) and kv_indices.dtype == torch.int64 and res.length > res.prefix_length:
            node = res.node  # BUG: the new edge aliases the caller's tensor instead of a copy
            node.value = kv_indices[node.depth - node.num_tokens : node.depth]
            node.value_np = node.value.numpy() if node.value.is_cpu else None
        return res


class _NamespaceBlindTree(HybridRadixCache):
    """Through the tree's public ``match``: every lookup lands in the base model's namespace."""

    def match(self, key: KeyLike, *, namespace: Hashable = None, touch: bool = True, kv: bool = True) -> MatchResult:
        return super().match(key, namespace=None, touch=touch, kv=kv)  # BUG: the namespace is ignored


class _FullHitManager(CacheManager):
    def _match(self, ck: CacheKey, namespace: Hashable) -> MatchResult:
        return self.cache.match(ck, namespace=namespace, touch=False)  # BUG: all ids, the last too


@contextlib.contextmanager
def injected(inject: str | None) -> Iterator[None]:
    """Commit bug ``inject`` for the duration of the block when it lives outside the pool, tree and
    manager classes: ``image-digest-prefix`` patches the image digest of ``image_cache_ids``,
    ``hf-conv-shift`` the transformers bridge's ``load`` (needs the hf extra)."""
    if inject == "image-digest-prefix":
        from ..core import multimodal

        real = multimodal._digest

        def first_4k(*parts: memoryview) -> int:
            return real(*(p[:4096] for p in parts))  # BUG: the rest of each image is ignored

        multimodal._digest = first_4k
        try:
            yield
        finally:
            multimodal._digest = real
    elif inject == "hf-conv-shift":
        from ..hf.bridge import HFStateBridge

        real_load = HFStateBridge.load

        def shifted(self: HFStateBridge, pool: LinearStatePool, slot: int, cache: Any, *, tokens: int) -> None:
            real_load(self, pool, slot, cache, tokens=tokens)
            for i in self.layout.model_layers or ():  # BUG: the window lands one column to the right
                conv = cache.layers[i].conv_states[0]
                conv.copy_(torch.roll(conv, 1, dims=-1))

        HFStateBridge.load = shifted  # type: ignore[method-assign]
        try:
            yield
        finally:
            HFStateBridge.load = real_load  # type: ignore[method-assign]
    else:
        yield


class _ValidateLateManager(CacheManager):
    def _commit(
        self,
        plan: WindowPlan,
        ready: Fence | None,
        kv_indices: torch.Tensor | np.ndarray | Sequence[int] | None,
        now: float | None,
    ) -> WindowResult:
        rec = self._requests.get(plan.rid) if type(plan) is WindowPlan else None
        if rec is not None and rec.plan is plan:
            rec.computed = plan.end  # BUG: counted before the KV indices are checked
        return super()._commit(plan, ready, kv_indices, now)


class _NegativeKVManager(CacheManager):
    def _commit(
        self,
        plan: WindowPlan,
        ready: Fence | None,
        kv_indices: torch.Tensor | np.ndarray | Sequence[int] | None,
        now: float | None,
    ) -> WindowResult:
        kv = torch.as_tensor(kv_indices) if isinstance(kv_indices, (list, tuple, np.ndarray)) else kv_indices
        if isinstance(kv, torch.Tensor) and kv.dim() == 1 and kv.numel() and int(kv.min()) < 0:
            rec = self._check_plan(plan)
            t = self.clock() if now is None else now  # BUG: negative KV indices taken as they are
            return self._apply_commit(rec, plan, ready, None, kv.to(torch.int64), t)
        return super()._commit(plan, ready, kv_indices, now)


class _KeepFailedAdmissionManager(CacheManager):
    def _undo_admission(
        self, rid: Hashable, owner: RequestOwner, slots: Sequence[SlotId], ready: Fence, locked: TreeNode | None
    ) -> None:
        return  # BUG: the failed admission's slots and lock stay behind, tracked by nobody


class _ForeignNodeTree(HybridRadixCache):
    def _own(self, node: object) -> TreeNode:
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a TreeNode, got {type(node).__name__}")
        return node  # BUG: whichever cache made it


class _HostRestoreEarlyTree(HybridRadixCache):
    def restore(
        self, node: TreeNode, dst_slot: int, *, stream: Stream | None = None, dst_owner: Owner | None = None
    ) -> Fence:
        from_host = node.snapshot is None and node.host is not None
        fence = super().restore(node, dst_slot, stream=stream, dst_owner=dst_owner)
        return node.host_fence if from_host else fence  # BUG: the demotion's fence, not the copy's


class _DemoteKeepsSlotTree(HybridRadixCache):
    def _demote(self, n: TreeNode) -> bool:
        slot = n.snapshot
        if not super()._demote(n):
            return False
        n.snapshot = slot  # BUG: the slot went back to the pool; the node still points at it
        return True


class _EdgeLastPageTree(HybridRadixCache):
    def _walk(self, kb: bytes, end: int, root: TreeNode) -> tuple[list[TreeNode], int, int, TreeNode | None]:
        pb = self._page_bytes
        node, pos = root, 0
        path: list[TreeNode] = []
        snap_at = 0
        while pos < end:
            child = node.children.get(kb[pos : pos + pb])
            if child is None:
                break
            edge = child.key
            stop = pos + len(edge)
            # BUG: the edge is taken when its last page agrees; the pages between are not compared
            if stop <= end and kb[stop - pb : stop] == edge[-pb:]:
                pos = stop
                node = child
                path.append(child)
                if child.snapshot is not None or child.host is not None:
                    snap_at = len(path)
                continue
            return path, pos + self._common_bytes(kb, pos, edge, min(len(edge), end - pos)), snap_at, child
        return path, pos, snap_at, None


def _lru_any(e: tuple[float, int, TreeNode]) -> bool:
    n = e[2]  # BUG: the lock is not checked
    return n.parent is not None and n.snapshot is not None and n.last_access == e[0]


class _LRUEvictsLockedTree(HybridRadixCache):
    def evict(self, *, kv_tokens: int = 0, snapshots: int = 0) -> Any:
        out = super().evict(kv_tokens=kv_tokens)
        kv, snaps, removed = out
        while snaps < snapshots:
            n = self._snap_heap.pop_valid(_lru_any)  # BUG: a locked snapshot is a candidate too
            if n is None:
                break
            k, s, r = self._evict_device_snapshot(n, demote=True)
            kv, snaps, removed = kv + k, snaps + s, removed + r
        return type(out)(kv, snaps, removed)


class _TrustingTier(SharedTier):
    def _verify(
        self,
        blob: bytes | memoryview,
        key: str,
        depth: int,
        stage: LinearStatePool | None,
        slot: int,
        owner: RequestOwner,
        keep_state: bool,
    ) -> Fetched | None:
        parsed = parse_blob(blob)
        layout = self.layout
        if parsed is None or layout is None or stage is None:
            return super()._verify(blob, key, depth, stage, slot, owner, keep_state)
        header, body = parsed
        kv_bytes = header.get("kv_bytes")
        if (
            header.get("identity") != self.identity
            or header.get("state_bytes") != layout.slot_bytes
            or not isinstance(kv_bytes, int)
            or len(body) != layout.slot_bytes + kv_bytes + DIGEST_BYTES
        ):
            return super()._verify(blob, key, depth, stage, slot, owner, keep_state)
        # BUG: the sizes match, so the blob is taken: its digest and its state's fingerprint unchecked
        conv_n = layout.num_layers * layout.conv_bytes_per_layer
        conv_shape, rec_shape = layout.state_shapes
        conv = bytes_tensor(body[:conv_n], layout.conv_dtype, conv_shape)
        rec = bytes_tensor(body[conv_n : layout.slot_bytes], layout.recurrent_dtype, rec_shape)
        stage.write(slot, conv, rec, owner=owner).wait()
        publisher = str(header.get("publisher", "?"))
        state = (conv, rec) if keep_state else None
        kv = bytes(body[layout.slot_bytes : -DIGEST_BYTES])
        return Fetched(depth, kv, publisher, stage.fingerprint(slot), state)


class _NamespaceBlindTier(SharedTier):
    def _keys(self, ids: np.ndarray, namespace: Hashable, depths: Sequence[int], yields: bool = False) -> list[str]:
        return super()._keys(ids, None, depths, yields)  # BUG: every namespace shares the base model's keys

    def index(self, namespace: Hashable) -> str:
        return super().index(None)  # BUG: and its index of published depths


class _LateCaptures(HitDensity):
    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        # BUG: each point taken one token past where it was chosen (dropped past the window)
        return [d + 1 for d in super().captures(req, start, end, decode=decode) if d + 1 <= end]


MISUSE_BUGS: tuple[str, ...] = (
    "validates-after-mutating",
    "accepts-foreign-node",
    "accepts-negative-kv",
    "keeps-failed-admission",
)

FUZZ_BUGS: tuple[str, ...] = (
    "alias",
    "no-donate-fence",
    "no-restore-fence",
    "free-before-fence",
    "unlock-before-restore",
    "snapshot-off-by-page",
    "double-free-swallowed",
    "tree-keeps-kv-view",
    "namespace-blind",
    "image-digest-prefix",
    "full-hit-admission",
    "host-restore-early",
    "demote-keeps-slot",
    "shared-trusts-sizes",
    "shared-key-no-ns",
    "edge-last-page-only",
    "lru-evicts-locked",
    "hf-conv-shift",
)
"""Bugs the fuzzing kit finds at its defaults (``radixcache fuzz --inject BUG``; ``hf-conv-shift``
where transformers is installed: the kit's default bridge needs it)."""

HAMMER_ONLY_BUGS: tuple[str, ...] = ("capture-one-late",)
"""Bugs found by the hammer only: a placement bug that keeps answers exact (the hit-rate guard
fails it)."""

HAMMER_BUGS: tuple[str, ...] = FUZZ_BUGS + HAMMER_ONLY_BUGS
"""Every bug ``radixcache hammer --inject`` commits."""

_SHARED_TIERS: dict[str, type[SharedTier]] = {
    "shared-trusts-sizes": _TrustingTier,
    "shared-key-no-ns": _NamespaceBlindTier,
}
_POOLS: dict[str, type[LinearStatePool]] = {
    "no-donate-fence": _NoDonateFencePool,
    "double-free-swallowed": _SwallowingPool,
}
_MANAGERS: dict[str, type[CacheManager]] = {
    "free-before-fence": _FreeBeforeFenceManager,
    "unlock-before-restore": _UnlockBeforeRestoreManager,
    "snapshot-off-by-page": _OffByPageManager,
    "double-free-swallowed": _DoubleFreeManager,
    "validates-after-mutating": _ValidateLateManager,
    "accepts-negative-kv": _NegativeKVManager,
    "keeps-failed-admission": _KeepFailedAdmissionManager,
    "full-hit-admission": _FullHitManager,
}


_TREES: dict[str, type[HybridRadixCache]] = {
    "alias": _AliasTree,
    "no-restore-fence": _NoRestoreFenceTree,
    "namespace-blind": _NamespaceBlindTree,
    "tree-keeps-kv-view": _KVViewTree,
    "accepts-foreign-node": _ForeignNodeTree,
    "host-restore-early": _HostRestoreEarlyTree,
    "demote-keeps-slot": _DemoteKeepsSlotTree,
    "edge-last-page-only": _EdgeLastPageTree,
    "lru-evicts-locked": _LRUEvictsLockedTree,
}


def _check_bug(inject: str | None) -> None:
    if inject is not None and inject not in HAMMER_BUGS + MISUSE_BUGS:
        raise ValueError(f"unknown inject mode {inject!r}; known: {list(HAMMER_BUGS + MISUSE_BUGS)}")


def make_shared_tier(inject: str | None, store: SharedStore, **options: Any) -> SharedTier:
    """A correct :class:`~radixcache.tiers.shared.SharedTier` over ``store``, or the tier of bug
    ``inject`` when the bug lives in the tier. ``options`` are the tier's keyword arguments.

    :raises ValueError: unknown bug name (and whatever the tier's constructor raises)."""
    _check_bug(inject)
    return _SHARED_TIERS.get(inject or "", SharedTier)(store, **options)


def make_hit_density(inject: str | None, *, block: int) -> HitDensity:
    """A correct :class:`~radixcache.policies.HitDensity` on a ``block`` grid, or its placement
    bug (``capture-one-late``).

    :raises ValueError: unknown bug name, a bad ``block``."""
    _check_bug(inject)
    return (_LateCaptures if inject == "capture-one-late" else HitDensity)(block=block)


def make_pool(
    inject: str | None, layout: StateLayout, slots: int, device: torch.device | str = "cpu"
) -> LinearStatePool:
    """A correct pool on ``device``, or the pool of bug ``inject`` when the bug lives in the pool.

    :raises ValueError: unknown bug name."""
    _check_bug(inject)
    return _POOLS.get(inject or "", LinearStatePool)(layout, slots, device)


def make_cache(
    inject: str | None,
    pool: LinearStatePool,
    *,
    page_size: int = 1,
    on_event: TreeListener | None = None,
    stream: Stream | None = None,
    host_pool: LinearStatePool | None = None,
) -> HybridRadixCache:
    """A correct :class:`HybridRadixCache` (with the host tier ``host_pool``, if any), or the tree
    of bug ``inject`` when the bug lives in the tree (a bug that lives elsewhere gets a correct
    tree).

    :raises ValueError: unknown bug name.
    """
    _check_bug(inject)
    cls = _TREES.get(inject or "", HybridRadixCache)
    return cls(pool, page_size=page_size, on_event=on_event, stream=stream, host_pool=host_pool)


def make_manager(inject: str | None, cache: HybridRadixCache, policy: Policy | None, **options: object) -> CacheManager:
    """A correct :class:`CacheManager` over ``cache``, or the manager of bug ``inject`` when the
    bug lives in the manager. ``options`` are the manager's keyword arguments.

    :raises ValueError: unknown bug name."""
    _check_bug(inject)
    return _MANAGERS.get(inject or "", CacheManager)(cache, policy, **options)  # type: ignore[arg-type]


def make_fuzz_stack(
    inject: str | None,
    layout: StateLayout,
    slots: int,
    *,
    page_size: int = 1,
    track_align: int = 4,
    track_slots: int = 2,
    on_event: TreeListener | None = None,
    stream: Stream | None = None,
    policy: Policy | None = None,
    host_slots: int = 0,
    shared: SharedTier | None = None,
) -> CacheManager:
    """Pool, tree and manager for the fuzzing kit, correct or committing bug ``inject``
    (one of :data:`FUZZ_BUGS`). The default policy is :class:`~radixcache.policies.FixedPoints`
    on a ``track_align`` grid: the most captures per window, so the most donations to check.
    ``host_slots``: a host tier of that many snapshots (0: none); ``shared``: the manager's shared tier.

    :raises ValueError: unknown bug name.
    """
    pool = make_pool(inject, layout, slots)
    host = LinearStatePool(layout, host_slots) if host_slots else None
    tree = make_cache(inject, pool, page_size=page_size, on_event=on_event, stream=stream, host_pool=host)
    return make_manager(
        inject,
        tree,
        policy if policy is not None else FixedPoints(track_align),
        track_slots=track_slots,
        host_tier=None,  # the machine's tier is host_slots, exactly
        shared=shared,
    )
