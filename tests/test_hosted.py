"""The manager's calls for hosts that keep their own slots and KV (SGLang's scheduler, vLLM's):
lookup, lock / unlock, make_room, request_info / admitted, restore, checkpoint, warm, reset. The
policy, the metrics and the tree hear of each; bad calls change nothing."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from linear_state import LinearStatePool, RequestOwner, SlotId
from radixcache import (
    Admission,
    CacheKey,
    CacheManager,
    ForeignObjectError,
    Forensics,
    HybridRadixCache,
    LockError,
    SnapshotCorruption,
    SnapshotRefused,
)
from radixcache.core.keys import key_bytes
from radixcache.core.kv import KVFreeList
from radixcache.core.policy import DonationReason, RequestInfo
from radixcache.forensics import key_digest
from radixcache.policies import FixedPoints
from radixcache.testing.adapter import FUZZ_LAYOUT

from .tree_helpers import prefix_value


class Recording(FixedPoints):
    """FixedPoints that remembers what it heard."""

    def __init__(self) -> None:
        super().__init__(align=8)
        self.heard: list[tuple[str, object, object]] = []
        self.infos: list[RequestInfo] = []  # what donated heard of each donor

    def admitted(self, req: RequestInfo) -> None:
        self.heard.append(("admitted", req, None))
        super().admitted(req)

    def touched(self, node, req, now):  # type: ignore[no-untyped-def]
        self.heard.append(("touched", node, req))
        super().touched(node, req, now)

    def donated(self, node, req, reason, now):  # type: ignore[no-untyped-def]
        self.heard.append(("donated", node, reason))
        self.infos.append(req)
        super().donated(node, req, reason, now)


def make(slots: int = 8, kv: KVFreeList | None = None) -> tuple[CacheManager, Recording]:
    pol = Recording()
    cache = HybridRadixCache(LinearStatePool(FUZZ_LAYOUT, slots), page_size=1)
    return CacheManager(cache, pol, host_tier=None, kv=kv, write_checks=False), pol


def donor(mgr: CacheManager, ids: list[int], rid: str = "host") -> tuple[SlotId, RequestOwner]:
    """A host slot holding the state after ``ids``."""
    owner = RequestOwner(rid)
    slot = mgr.pool.alloc(owner)
    mgr.pool.conv[:, slot].fill_(prefix_value(ids))
    mgr.pool.recurrent[:, slot].fill_(prefix_value(ids))
    return slot, owner


def file(mgr: CacheManager, ids: list[int], base: int = 0) -> object:
    slot, owner = donor(mgr, ids)
    res = mgr.checkpoint(ids, torch.arange(base, base + len(ids)), state_slot=slot, donor="h")
    mgr.pool.free(slot, owner)
    return res


def test_checkpoint_files_a_snapshot_the_policy_and_metrics_hear_of() -> None:
    mgr, pol = make()
    res = file(mgr, [1, 2, 3, 4])
    assert res.snapshot_created and res.node.depth == 4  # type: ignore[attr-defined]
    assert [h[0] for h in pol.heard] == ["donated"] and pol.heard[0][2] is DonationReason.CAPTURE
    assert mgr.metrics().donations["capture"] == 1
    again = file(mgr, [1, 2, 3, 4], base=100)  # held already: the caller's KV comes back as duplicates
    assert not again.snapshot_created and again.released.tolist() == [100, 101, 102, 103]  # type: ignore[attr-defined]
    assert mgr.metrics().donations_skipped["held"] == 1
    mgr.check_invariants()


def test_lookup_restore_serve_the_exact_state_and_tell_the_policy() -> None:
    mgr, pol = make()
    file(mgr, [5, 6, 7])
    assert mgr.lookup([], touch=False).node.depth == 0  # the root
    bare = mgr.lookup([5, 6, 7, 8], touch=False, kv=False)  # the hit alone: its KV is read later
    m = mgr.lookup([5, 6, 7, 8])
    assert m.cached_length == 3 and m.kv_indices.numel() == 3
    assert (bare.cached_length, bare.node, bare.kv_indices.numel()) == (3, m.node, 0)
    info = mgr.request_info([5, 6, 7, 8], m.cached_length)
    mgr.admitted(info)
    mgr.lock(m.node)
    owner = RequestOwner("r")
    dst = mgr.pool.alloc(owner)
    mgr.restore(m.node, dst, dst_owner=owner, info=info).wait()
    assert float(mgr.pool.recurrent[:, dst].flatten()[0]) == prefix_value([5, 6, 7])
    assert ("touched", m.node, info) in pol.heard
    met = mgr.metrics()
    assert (met.admissions, met.hits, met.hit_tokens, met.restores, met.prompt_tokens) == (1, 1, 3, 1, 4)
    mgr.unlock(m.node)
    mgr.pool.free(dst, owner)
    mgr.check_invariants()


def test_request_info_is_the_one_admit_gives_the_policy() -> None:
    mgr, pol = make()
    ids = [9, 8, 7, 6]
    got = mgr.request_info(ids, 0, session="s")
    adm = mgr.admit("a", ids, session="s")
    seen = next(h[1] for h in pol.heard if h[0] == "admitted")
    assert isinstance(seen, RequestInfo) and adm.admitted
    assert (got.prompt_len, got.prompt_digest, got.session) == (seen.prompt_len, seen.prompt_digest, seen.session)
    with pytest.raises(ValueError, match="cached_length must be an int in"):
        mgr.request_info(ids, 5)
    with pytest.raises(ValueError, match="cached_length must be an int in"):
        mgr.request_info(CacheKey(ids), 5)
    with pytest.raises(TypeError, match="RequestInfo"):
        mgr.admitted("a")  # type: ignore[arg-type]
    mgr.abort("a")


def test_a_lock_protects_the_hit_from_eviction_and_unlock_is_checked() -> None:
    mgr, _ = make()
    node = file(mgr, [1, 2]).node  # type: ignore[attr-defined]
    mgr.lock(node)
    assert mgr.evict(snapshots=5, kv_tokens=5).snapshots == 0
    assert mgr.lookup([1, 2, 3]).cached_length == 2
    mgr.unlock(node)
    with pytest.raises(LockError):
        mgr.unlock(node)
    mgr.check_invariants()
    assert mgr.evict(snapshots=1).snapshots == 1


def test_relock_moves_a_hold_to_the_newer_snapshot_and_a_bad_move_changes_nothing() -> None:
    mgr, _ = make()
    short = file(mgr, [1, 2]).node  # type: ignore[attr-defined]
    mgr.lock(short)
    deep = file(mgr, [1, 2, 3, 4]).node  # type: ignore[attr-defined]
    mgr.relock(short, deep)  # a request's hold following its checkpoint
    assert (short.snap_lock, deep.snap_lock) == (0, 1)
    with pytest.raises(LockError):  # short's lock moved: it holds none to move again
        mgr.relock(short, deep)
    with pytest.raises(TypeError):
        mgr.relock(deep, "node")  # type: ignore[arg-type]
    assert (short.snap_lock, deep.snap_lock) == (0, 1)
    mgr.check_invariants()
    assert mgr.evict(snapshots=5, kv_tokens=5).snapshots == 1  # short's snapshot only: deep is held
    assert mgr.lookup([1, 2, 3, 4]).cached_length == 4
    mgr.unlock(deep)
    mgr.check_invariants()
    assert mgr.evict(snapshots=1).snapshots == 1


def test_make_room_evicts_through_the_policy_but_keeps_the_hit() -> None:
    mgr, _ = make(slots=4)
    a = file(mgr, [1, 2]).node  # type: ignore[attr-defined]
    file(mgr, [3, 4])
    file(mgr, [5, 6])
    assert mgr.cache.num_snapshots == 3
    held, owner = donor(mgr, [0])  # the host holds the last free slot
    assert mgr.make_room(keep=a) and mgr.pool.num_free == 1
    assert mgr.lookup([1, 2, 9]).cached_length == 2 and a.snap_lock == 0  # kept, and the hold let go
    assert mgr.cache.num_snapshots == 2
    assert mgr.make_room()  # a free slot already: nothing evicted
    assert mgr.cache.num_snapshots == 2 and mgr.metrics().evictions["host"] == 1
    mgr.pool.free(held, owner)
    mgr.check_invariants()


def test_checkpoint_without_a_free_slot_evicts_then_files_kv_alone() -> None:
    mgr, _ = make(slots=2)
    keep = file(mgr, [1, 2]).node  # type: ignore[attr-defined]
    mgr.lock(keep)
    slot, owner = donor(mgr, [3, 4])  # the last free slot: none left for the clone
    res = mgr.checkpoint([3, 4], torch.tensor([50, 51]), state_slot=slot, ready=mgr.pool.last_use(slot))
    assert not res.snapshot_created and mgr.metrics().donations_skipped["no-slot"] == 1
    assert mgr.lookup([3, 4, 5]).cached_length == 0  # the KV alone is no hit
    mgr.pool.free(slot, owner)
    mgr.unlock(keep)
    mgr.check_invariants()


def test_warm_frees_duplicates_to_the_allocator_and_refuses_while_serving() -> None:
    kv = KVFreeList(64)
    mgr, _ = make(kv=kv)
    for _ in range(2):
        got = kv.alloc(4)
        assert got is not None
        slot, owner = donor(mgr, [1, 2, 3, 4], "warm-up")
        mgr.warm([1, 2, 3, 4], got, state_slot=slot)
        mgr.pool.free(slot, owner)
    assert kv.num_free + mgr.cache.total_kv_tokens == 64  # the second copy went back
    adm = mgr.admit("r", [1, 2, 3, 4, 5])
    assert isinstance(adm, Admission) and adm.cached_length == 4
    before = (kv.num_free, mgr.cache.total_kv_tokens)
    with pytest.raises(RuntimeError, match="1 requests are admitted"):
        mgr.warm([7, 7], torch.tensor([0, 1]), state_slot=adm.live_slot)
    with pytest.raises(RuntimeError, match="reset"):
        mgr.reset()
    assert (kv.num_free, mgr.cache.total_kv_tokens) == before
    mgr.abort("r")
    mgr.reset()
    assert mgr.cache.num_snapshots == 0 and kv.num_free == 64
    mgr.check_invariants()


def test_restore_of_a_node_without_a_snapshot_is_refused() -> None:
    mgr, _ = make()
    root = mgr.lookup([], touch=False).node
    owner = RequestOwner("r")
    dst = mgr.pool.alloc(owner)
    info = mgr.request_info([1], 0)
    with pytest.raises(ValueError, match="holds no snapshot"):
        mgr.restore(root, dst, dst_owner=owner, info=info)
    with pytest.raises(TypeError, match="RequestInfo"):
        mgr.restore(root, dst, dst_owner=owner, info=None)  # type: ignore[arg-type]
    assert mgr.metrics().restores == 0
    mgr.pool.free(dst, owner)


ROOT = pathlib.Path(__file__).resolve().parents[1]
MUTATORS = re.compile(r"\b(?:cache|tree)\.(insert|evict|evict_snapshot|lock|unlock|restore|reset|touch)\(")
# Modules that exercise the tree itself, not hosts: its stress loop, the misuse fuzzer's tree
# entries (each checks the tree refuses a bad call) and the injected bugs (tree subclasses).
TREE_TOOLS = {"radixcache/stress.py", "radixcache/testing/misuse.py", "radixcache/testing/inject.py"}


def test_no_module_but_the_manager_drives_the_tree() -> None:
    found = []
    for path in sorted([*ROOT.joinpath("radixcache").rglob("*.py"), *ROOT.joinpath("examples").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel in TREE_TOOLS or rel in ("radixcache/manager/cache_manager.py", "radixcache/core/tree.py"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if MUTATORS.search(code) and not code.lstrip().startswith(("``", ":")):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "the tree is driven outside the manager:\n" + "\n".join(found)


def test_bad_input_to_checkpoint_or_restore_changes_nothing() -> None:
    mgr, pol = make(slots=2)
    file(mgr, [1, 2])
    slot, owner = donor(mgr, [3, 4])  # the pool is full: a good checkpoint would evict [1, 2]
    heard = len(pol.heard)
    with pytest.raises(TypeError):
        mgr.checkpoint("34", torch.tensor([50, 51]), state_slot=slot)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        mgr.checkpoint([3, 4], torch.tensor([50]), state_slot=slot)  # KV of the wrong length
    info = mgr.request_info([1, 2, 3], 2)
    with pytest.raises(TypeError, match="TreeNode"):
        mgr.restore("node", slot, dst_owner=owner, info=info)  # type: ignore[arg-type]
    assert mgr.cache.num_snapshots == 1 and mgr.lookup([1, 2, 3], touch=False).cached_length == 2
    assert len(pol.heard) == heard and mgr.metrics().evictions["donation"] == 0
    mgr.pool.free(slot, owner)
    mgr.check_invariants()


def test_discard_drops_a_snapshot_never_demoted_and_kv_prefix_reads_the_path() -> None:
    mgr, _ = make()
    file(mgr, [1, 2, 3, 4], base=0)
    res = file(mgr, [1, 2, 3, 4, 5, 6], base=10)  # the first four are duplicates of the tree's
    assert mgr.kv_prefix([1, 2, 3, 4, 5, 6, 7]).tolist() == [0, 1, 2, 3, 14, 15]
    with pytest.raises((TypeError, ValueError)):
        mgr.kv_prefix("not ids")  # type: ignore[arg-type]
    deep = res.node  # type: ignore[attr-defined]
    mgr.lock(deep)
    with pytest.raises(LockError):
        mgr.discard(deep)
    mgr.unlock(deep)
    with pytest.raises(TypeError, match="TreeNode"):
        mgr.discard("node")  # type: ignore[arg-type]
    out = mgr.discard(deep)
    assert out.snapshots == 1 and out.kv_tokens == 2  # the leaf went with its own KV
    assert mgr.metrics().evictions["corrupt"] == 1
    assert mgr.lookup([1, 2, 3, 4, 5, 6]).cached_length == 4
    with pytest.raises(ValueError, match="holds no snapshot"):
        mgr.discard(deep)
    mgr.check_invariants()


def test_a_checkpoints_snapshot_is_known_to_forensics_by_its_own_prefix() -> None:
    """A checkpoint's key is longer than the page-cut prefix its snapshot holds: forensics files
    the snapshot under that prefix's digest, which a finding about it names."""
    pool = LinearStatePool(FUZZ_LAYOUT, 8)
    fx = Forensics(pool, mode="record")  # every donation watched
    mgr = CacheManager(HybridRadixCache(pool, page_size=4), FixedPoints(align=4), host_tier=None, forensics=fx)
    ids = [1, 2, 3, 4, 5, 6]
    slot, owner = donor(mgr, ids[:4])
    res = mgr.checkpoint(ids, torch.arange(6), state_slot=slot, donor="h")
    mgr.pool.free(slot, owner)
    assert res.snapshot_created and res.node.depth == 4
    pool.recurrent[:, res.node.snapshot] += 1.0  # the snapshot changes behind the tree's back
    dst_owner = RequestOwner("reader")
    dst = pool.alloc(dst_owner)
    with pytest.raises(SnapshotRefused, match="found it changed"):
        mgr.restore(res.node, dst, dst_owner=dst_owner, info=mgr.request_info(ids, 4))
    assert [(f.kind, f.key) for f in fx.findings] == [("changed", key_digest(key_bytes(ids[:4])))]


def test_a_checkpoint_tells_the_policy_of_its_key_without_a_prompt_digest() -> None:
    """A checkpoint's key is not a prompt: the policy hears its length, no digest (an admission's
    request info carries one)."""
    mgr, pol = make()
    file(mgr, [1, 2, 3, 4])
    heard = [h for h in pol.heard if h[0] == "donated"]
    assert len(heard) == 1
    assert mgr.request_info([1, 2, 3, 4], 0).prompt_digest is not None
    assert pol.infos[-1].prompt_len == 4 and pol.infos[-1].prompt_digest is None


def test_a_cache_key_is_heard_as_its_ids() -> None:
    """The same request info and the same filed prefix whether the host passes ids or a
    :class:`CacheKey` of them, image spans included (the key's own image check, not the ids')."""
    img = 2**30
    ids = [1, 2, img, img + 1, 3, img + 2]
    mgr, _ = make()
    for key in (ids, CacheKey(ids), CacheKey(torch.tensor(ids)), CacheKey([*ids, 4, 5]).prefix(6)):
        got = mgr.request_info(key, 2, session="s")
        assert (got.prompt_len, got.image_starts, got.cached_length) == (6, (2, 5), 2)
        assert got.prompt_digest == mgr.request_info(ids, 2, session="s").prompt_digest
    # another prompt (one id changed, or one id fewer) has another digest
    others = ([1, 2, img, img + 1, 3, img + 3], ids[:-1], [*ids, 0])
    assert len({mgr.request_info(k, 0).prompt_digest for k in (ids, *others)}) == 4
    assert mgr.request_info(CacheKey(ids).prefix(2), 0).image_starts == ()
    slot, owner = donor(mgr, [1, 2, 3, 4])
    res = mgr.checkpoint(CacheKey([1, 2, 3, 4]), torch.arange(4), state_slot=slot, donor="h")
    mgr.pool.free(slot, owner)
    assert res.snapshot_created
    assert mgr.lookup([1, 2, 3, 4]).node is res.node and mgr.lookup(CacheKey([1, 2, 3, 4])).cached_length == 4
    mgr.check_invariants()


def test_serve_in_place_hands_out_the_locked_snapshots_own_slot_and_tells_the_policy() -> None:
    """A host whose request's state lives outside the pool copies it out of the snapshot's slot
    itself: no slot of the pool is taken, the policy and the metrics hear of the hit."""
    mgr, pol = make()
    file(mgr, [5, 6, 7])
    m = mgr.lookup([5, 6, 7, 8])
    info = mgr.request_info([5, 6, 7, 8], m.cached_length)
    free = mgr.pool.num_free
    with pytest.raises(ValueError, match="not locked"):
        mgr.serve_in_place(m.node, info=info)  # the lock must come first: nothing heard
    assert mgr.metrics().hits == 0 and not [h for h in pol.heard if h[0] == "touched"]
    mgr.lock(m.node)
    slot, fence = mgr.serve_in_place(m.node, info=info, rid="r")
    fence.wait()
    assert slot == m.node.snapshot and mgr.pool.num_free == free
    assert float(mgr.pool.recurrent[:, slot].flatten()[0]) == prefix_value([5, 6, 7])
    assert ("touched", m.node, info) in pol.heard
    met = mgr.metrics()
    assert (met.hits, met.hit_tokens, met.restores) == (1, 3, 0)
    assert mgr.make_room(keep=None) and mgr.cache.num_snapshots == 1, "a locked snapshot is never evicted"
    with pytest.raises(TypeError, match="RequestInfo"):
        mgr.serve_in_place(m.node, info=None)  # type: ignore[arg-type]
    mgr.unlock(m.node)
    mgr.check_invariants()
    other, _ = make()
    file(other, [5, 6, 7])
    theirs = other.lookup([5, 6, 7]).node
    other.lock(theirs)
    with pytest.raises(ForeignObjectError):
        mgr.serve_in_place(theirs, info=info)
    assert mgr.metrics().hits == 1


def test_serve_in_place_verifies_the_snapshot_first() -> None:
    pool = LinearStatePool(FUZZ_LAYOUT, 8)
    fx = Forensics(pool)  # raise mode, every donation watched
    mgr = CacheManager(HybridRadixCache(pool, page_size=1), FixedPoints(align=1), host_tier=None, forensics=fx)
    file(mgr, [1, 2, 3])
    node = mgr.lookup([1, 2, 3]).node
    mgr.lock(node)
    pool.recurrent[:, node.snapshot] += 1.0  # changed behind the tree's back
    with pytest.raises(SnapshotCorruption):
        mgr.serve_in_place(node, info=mgr.request_info([1, 2, 3], 3), rid="r")
    assert mgr.metrics().hits == 0
    mgr.unlock(node)
    mgr.check_invariants()


def test_serve_in_place_compares_a_fingerprint_taken_on_the_pools_stream() -> None:
    """The fingerprint the host took (``pool.fingerprint_later``) is what forensics compares: one
    taken after a stray write is a finding; one of another slot, or not a job, is refused first."""
    pool = LinearStatePool(FUZZ_LAYOUT, 8)
    fx = Forensics(pool, mode="record")
    mgr = CacheManager(HybridRadixCache(pool, page_size=1), FixedPoints(align=1), host_tier=None, forensics=fx)
    file(mgr, [1, 2, 3])
    file(mgr, [4, 5])
    node, other = mgr.lookup([1, 2, 3]).node, mgr.lookup([4, 5]).node
    assert node.snapshot is not None and other.snapshot is not None
    info = mgr.request_info([1, 2, 3], 3)
    mgr.lock(node)
    good = pool.fingerprint_later(node.snapshot)
    with pytest.raises(ValueError, match=f"fingerprint is of slot {other.snapshot}"):
        mgr.serve_in_place(node, info=info, fingerprint=pool.fingerprint_later(other.snapshot))
    with pytest.raises(TypeError, match="FingerprintJob"):
        mgr.serve_in_place(node, info=info, fingerprint=good.result())  # type: ignore[arg-type]
    assert mgr.metrics().hits == 0 and not fx.findings
    mgr.serve_in_place(node, info=info, rid="r", fingerprint=good)
    assert mgr.metrics().hits == 1 and not fx.findings
    pool.recurrent[:, node.snapshot] += 1.0  # a stray write, then the host's fingerprint of it
    with pytest.raises(SnapshotRefused):
        mgr.serve_in_place(node, info=info, rid="r", fingerprint=pool.fingerprint_later(node.snapshot))
    assert [f.kind for f in fx.findings] == ["changed"] and fx.flagged(node.id)
    assert mgr.metrics().hits == 1 and node.snapshot is not None  # not served; held, so not dropped yet
    mgr.unlock(node)
    assert node.snapshot is None and mgr.metrics().evictions["corrupt"] == 1  # dropped at the last unlock
    mgr.check_invariants()


def test_snapshot_slot_refuses_a_node_without_a_snapshot() -> None:
    # (a demoted one: tests/test_host_tier.py)
    cache = HybridRadixCache(LinearStatePool(FUZZ_LAYOUT, 4), page_size=1)
    with pytest.raises(ValueError, match="holds no device snapshot: none"):
        cache.snapshot_slot(cache.match([1, 2]).node)  # the root
    with pytest.raises(TypeError):
        cache.snapshot_slot("node")  # type: ignore[arg-type]
