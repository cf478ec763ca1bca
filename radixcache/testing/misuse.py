"""A misuse fuzzer: a hypothesis state machine that interleaves a host's valid steps with calls
carrying wrong types, wrong values, objects of another cache or manager, and lifecycle steps out
of order, against the public API of the pool, the tree and the manager, the manager's constructor,
and the shared tier and its stores (a tier of the machine's own over an in-memory store, whose
blobs, index and counters must not move either); and admissions whose policy raises, which must
give back everything they took.

After every misuse call it asserts that the call raised a typed error (radixcache's own, a
``TypeError``, ``ValueError``, ``KeyError``, ``IndexError`` or a pool error; never an
``AttributeError`` or a silent success), that a digest of pool, tree, manager and policy (owners,
slot fingerprints, nodes, locks, recency, counters, requests, the policy's fields; see
:mod:`radixcache.testing.digest`) is exactly what it was before the call, and that
``check_invariants()`` holds. The valid steps are the host machine's (:mod:`.fuzz`), so the
ground truth keeps being checked in between.

Run it with :func:`run_misuse` (``radixcache misuse``) or as a test:
``TestMisuse = make_misuse_machine(factory).TestCase``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from linear_state import COMPLETE, LinearStatePool, NodeOwner, PoolError, RequestOwner, StateLayout

from ..core.errors import RadixCacheError
from ..core.tree import HybridRadixCache, TreeNode
from ..forensics.recorder import Forensics
from ..manager.cache_manager import CacheManager, WindowPlan
from ..tiers.shared import SharedTier
from ..tiers.store import MemoryStore, RedisStore
from .adapter import FUZZ_LAYOUT, ManagerAdapter
from .digest import state_digest
from .faults import FaultyStore
from .fuzz import HostMachine, run_machine

__all__ = ["MISUSE_ERRORS", "Misuse", "MisuseMachine", "make_misuse_machine", "misuse_adapter", "run_misuse"]

MISUSE_ERRORS: tuple[type[BaseException], ...] = (
    RadixCacheError,
    PoolError,
    TypeError,
    ValueError,
    KeyError,
    IndexError,
)
"""What a refused call may raise: typed errors that name the cause."""

_OTHER_LAYOUT = StateLayout(1, (2, 3), (2, 2))
"""A layout other than the fuzz pools' (the default dtypes): a pool or bridge of another model."""


def _wrong(value: object) -> Any:
    """A deliberately wrong argument (typed ``Any`` so the call type-checks)."""
    return value


@dataclass(frozen=True)
class Misuse:
    """One wrong call: what it is, and the call itself."""

    label: str
    call: Callable[[], object]


class _Foreign:
    """Another pool, tree and manager, with one snapshot and one open plan: the source of foreign
    objects."""

    def __init__(self) -> None:
        pool = LinearStatePool(FUZZ_LAYOUT, 8)
        self.cache = HybridRadixCache(pool)
        self.manager = CacheManager(self.cache, track_slots=1)
        adm = self.manager.admit(0, [1, 2, 3, 4, 5])
        assert adm.admitted
        self.plan = self.manager.plan_prefill(0, 5)
        donor = pool.alloc(RequestOwner("foreign donor"))
        self.node = self.cache.insert([1, 2, 3], torch.arange(3), state_slot=donor).node
        self.slot = donor  # a slot id of another pool (its index is likely in use here too)


class _NoKV:
    """A KV codec for a model without attention layers (the tier's own tests of its edges)."""

    identity = "none"

    def export_kv(self, kv_indices: torch.Tensor, after: object) -> bytes:
        return b""

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        return torch.zeros(num_tokens, dtype=torch.int64)


class _Tier:
    """A shared tier over an in-memory store holding one published blob (bound, this object its
    client), a pool slot to publish from, a tier never bound and one closed: the targets of the
    shared tier's wrong calls."""

    def __init__(self) -> None:
        self.store = MemoryStore()
        self.tier = SharedTier(self.store, model="misuse", kv=_NoKV(), publisher="misuse")
        self.tier.bind(FUZZ_LAYOUT, client=self)
        self.unbound = SharedTier(self.store, model="misuse", kv=_NoKV(), publisher="unbound")
        self.closed = SharedTier(self.store, model="misuse", kv=_NoKV(), publisher="closed")
        self.closed.bind(FUZZ_LAYOUT)
        self.closed.close()
        self.pool = LinearStatePool(FUZZ_LAYOUT, 2)
        self.slot = self.pool.alloc(RequestOwner("publisher"))
        self.ids = np.arange(1, 9, dtype=np.int64)
        assert self.tier.publish(self.ids, None, self.pool, self.slot, torch.arange(8), None)

    def digest(self) -> tuple[object, ...]:
        """Everything a refused call must leave as it was."""
        return (
            repr(self.tier.stats.as_dict()),
            sorted(self.store.blobs.items()),
            sorted((k, sorted(v)) for k, v in self.store.indexes.items()),
            self.pool.owner_of(self.slot),
            self.tier.layout,
            self.tier.client,
            self.tier.prefetching,
            self.unbound.layout,
            self.unbound.client,
            self.closed.prefetching,
        )


class MisuseMachine(HostMachine):
    """The host machine plus a ``misuse`` rule (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._foreign: _Foreign | None = None
        self._tier: _Tier | None = None
        self.misuses = 0

    @property
    def shared(self) -> _Tier:
        if self._tier is None:
            self._tier = _Tier()
        return self._tier

    @property
    def foreign(self) -> _Foreign:
        if self._foreign is None:
            self._foreign = _Foreign()
        return self._foreign

    def catalogue(self, data: st.DataObject) -> list[Misuse]:
        """The wrong calls that apply in the current state."""
        mgr = self.host.manager
        cache, pool = mgr.cache, mgr.pool
        fresh = self.next_rid + 10_000
        bad_keys: list[object] = [{1, 2}, None, 7, "ab", [True, False], [1.5, 2.0], [1, -3], np.array([0.5]), []]
        out = [
            Misuse(
                "admit: bad key", lambda: mgr.admit(fresh, _wrong(data.draw(st.sampled_from(bad_keys), label="key")))
            ),
            Misuse("admit: unhashable rid", lambda: mgr.admit(_wrong([fresh]), [1, 2])),
            Misuse("admit: unhashable namespace", lambda: mgr.admit(fresh, [1, 2], namespace=_wrong({"lora": 1}))),
            Misuse("admit: unhashable session", lambda: mgr.admit(fresh, [1, 2], session=_wrong(["chat", 1]))),
            Misuse("admit: now is not a number", lambda: mgr.admit(fresh, [1, 2], now=_wrong("soon"))),
            Misuse("admit: now is not finite", lambda: mgr.admit(fresh, [1, 2], now=math.nan)),
            Misuse("manager: a clock that is not callable", lambda: CacheManager(cache, clock=_wrong(5))),
            Misuse("manager: a stream that is not one", lambda: CacheManager(cache, stream=_wrong("cuda"))),
            Misuse("manager: kv_bytes_per_token 0", lambda: CacheManager(cache, kv_bytes_per_token=0)),
            Misuse("manager: kv that is not an allocator", lambda: CacheManager(cache, kv=_wrong([0, 1, 2]))),
            Misuse("manager: write_checks not a bool", lambda: CacheManager(cache, write_checks=_wrong("yes"))),
            Misuse(
                "manager: forensics neither one nor 'sampled'", lambda: CacheManager(cache, forensics=_wrong("all"))
            ),
            Misuse("forensics: a sample outside (0, 1]", lambda: Forensics(pool, sample=_wrong(0.0))),
            Misuse("admit: max_new_tokens without kv=", lambda: mgr.admit(fresh, [1, 2], max_new_tokens=4)),
            Misuse("admit: max_new_tokens negative", lambda: mgr.admit(fresh, [1, 2], max_new_tokens=_wrong(-1))),
            Misuse(
                "can_admit: bad key", lambda: mgr.can_admit(_wrong(data.draw(st.sampled_from(bad_keys), label="key")))
            ),
            Misuse("plan_prefill: unknown rid", lambda: mgr.plan_prefill(fresh, 3)),
            Misuse("plan_decode: unknown rid", lambda: mgr.plan_decode(fresh, [1])),
            Misuse("plan_decode_batch: unknown rid", lambda: mgr.plan_decode_batch([fresh], [1])),
            Misuse("commit: not a plan", lambda: mgr.commit(_wrong((fresh, 0, 4)), None, kv_indices=[0, 1, 2, 3])),
            Misuse(
                "commit: another manager's plan", lambda: mgr.commit(self.foreign.plan, None, kv_indices=list(range(5)))
            ),
            Misuse("finish: unknown rid", lambda: mgr.finish(fresh)),
            Misuse("abort: unknown rid", lambda: mgr.abort(fresh)),
            Misuse("evict: negative", lambda: mgr.evict(snapshots=-1)),
            Misuse("lookup: unhashable namespace", lambda: mgr.lookup([1, 2], namespace=_wrong([1]))),
            Misuse("lock: foreign node", lambda: mgr.lock(self.foreign.node)),
            Misuse("relock: foreign nodes", lambda: mgr.relock(self.foreign.node, self.foreign.node)),
            Misuse("make_room: keep a foreign node", lambda: mgr.make_room(keep=self.foreign.node)),
            Misuse("request_info: hit beyond the ids", lambda: mgr.request_info([1, 2], 3)),
            Misuse("admitted: not a RequestInfo", lambda: mgr.admitted(_wrong("info"))),
            Misuse("checkpoint: ids not a sequence", lambda: mgr.checkpoint(_wrong("12"), torch.tensor([0, 1]))),
            Misuse("checkpoint: KV of the wrong length", lambda: mgr.checkpoint([5, 6], torch.tensor([0]))),
            Misuse(
                "checkpoint: known_prefix past the key",
                lambda: mgr.checkpoint([5, 6], torch.tensor([0, 1]), known_prefix=_wrong(3)),
            ),
            Misuse("tree insert: known_prefix a float", lambda: cache.insert([4, 4], [0, 1], known_prefix=_wrong(1.5))),
            Misuse("evict: float", lambda: mgr.evict(kv_tokens=_wrong(1.5))),
            Misuse("tree evict: bool", lambda: cache.evict(snapshots=_wrong(True))),
            Misuse("tree match: unhashable namespace", lambda: cache.match([1, 2], namespace=_wrong([1]))),
            Misuse("tree lock: foreign node", lambda: cache.lock(self.foreign.node)),
            Misuse("tree unlock: foreign node", lambda: cache.unlock(self.foreign.node)),
            Misuse("tree evict_snapshot: foreign node", lambda: cache.evict_snapshot(self.foreign.node)),
            Misuse("tree kv_indices: foreign node", lambda: cache.kv_indices(self.foreign.node)),
            Misuse("tree snapshot_slot: foreign node", lambda: cache.snapshot_slot(self.foreign.node)),
            Misuse(
                "serve_in_place: foreign node",
                lambda: mgr.serve_in_place(self.foreign.node, info=mgr.request_info([1, 2], 0)),
            ),
            Misuse(
                "serve_in_place: info not a RequestInfo", lambda: mgr.serve_in_place(self.foreign.node, info=_wrong(2))
            ),
            Misuse(
                "serve_in_place: fingerprint not a FingerprintJob",
                lambda: mgr.serve_in_place(
                    self.foreign.node, info=mgr.request_info([1, 2], 0), fingerprint=_wrong(0x1234)
                ),
            ),
            Misuse("tree touch: foreign node", lambda: cache.touch(self.foreign.node)),
            Misuse("tree lock: not a node", lambda: cache.lock(_wrong("root"))),
            Misuse("tree relock: not nodes", lambda: cache.relock(_wrong("root"), _wrong("leaf"))),
            Misuse(
                "tree insert: another pool's slot as donor",
                lambda: cache.insert([4, 4], [0, 1], state_slot=self.foreign.slot),
            ),
            Misuse(
                "pool free: another pool's slot", lambda: pool.free(self.foreign.slot, RequestOwner("foreign donor"))
            ),
            Misuse("pool alloc: bad owner", lambda: pool.alloc(_wrong("request 1"))),
            Misuse("pool owner_of: float slot", lambda: pool.owner_of(_wrong(0.5))),
            Misuse("pool free: out of range", lambda: pool.free(pool.capacity, RequestOwner(fresh))),
        ]
        if cache.host_pool is None:
            out.append(
                Misuse(
                    "manager: a host budget above physical memory",
                    lambda: CacheManager(cache, host_budget_bytes=1 << 62),
                )
            )
        out += self._shared_catalogue() + self._forensics_catalogue() + _hf_catalogue()
        stale = getattr(self.host, "last_plan", None)
        if isinstance(stale, WindowPlan):
            out.append(Misuse("commit: a plan committed already", lambda: mgr.commit(stale, None, kv_indices=[0])))
        snaps = [n for n in cache.iter_nodes() if n.snapshot is not None]
        if snaps:
            node = data.draw(st.sampled_from(snaps), label="tree node")
            slot = node.snapshot
            assert slot is not None
            out += [
                Misuse("tree insert: snapshot as donor", lambda: cache.insert([3, 1], [0, 1], state_slot=slot)),
                Misuse("pool zero: a frozen snapshot", lambda: pool.zero(slot, owner=NodeOwner(node.id))),
                Misuse("pool free: not the owner", lambda: pool.free(slot, RequestOwner(fresh))),
                Misuse("pool free: wait not a bool", lambda: pool.free(slot, NodeOwner(node.id), wait=_wrong("no"))),
                Misuse("pool fingerprint_later: bad fence", lambda: pool.fingerprint_later(slot, after=_wrong(["x"]))),
                Misuse("tree restore: into the snapshot itself", lambda: cache.restore(node, slot)),
                Misuse("tree restore: into another pool's slot", lambda: cache.restore(node, self.foreign.slot)),
                Misuse("pool read: out not a pair", lambda: pool.read(slot, out=_wrong([pool.conv[:, 0]]))),
            ]
            others = [s for s in range(pool.capacity) if s != slot and pool.owner_of(s) is not None]
            if others:
                src = data.draw(st.sampled_from(others), label="slot read")
                out.append(
                    Misuse(
                        "pool read: into a snapshot's own rows",
                        lambda: pool.read(src, out=(pool.conv[:, slot], pool.recurrent[:, slot])),
                    )
                )
            out.append(Misuse("tree relock: onto a foreign node", lambda: cache.relock(node, self.foreign.node)))
            if node.snap_lock == 0:
                out.append(Misuse("tree unlock: not locked", lambda: cache.unlock(node)))
                out.append(Misuse("tree snapshot_slot: not locked", lambda: cache.snapshot_slot(node)))
                out.append(
                    Misuse(
                        "serve_in_place: not locked",
                        lambda: mgr.serve_in_place(node, info=mgr.request_info([1, 2], 0)),
                    )
                )
                out.append(Misuse("tree relock: old not locked", lambda: cache.relock(node, node)))
        if self.active:
            rid = data.draw(st.sampled_from(self.active), label="request")
            r = self.host.reqs[rid] if hasattr(self.host, "reqs") else None
            live = r.adm.live_slot if r is not None else None
            out += [
                Misuse("admit: rid already admitted", lambda: mgr.admit(rid, [1, 2, 3])),
                Misuse("plan_prefill: end not an int", lambda: mgr.plan_prefill(rid, _wrong(2.0))),
                Misuse("plan_prefill: end beyond the prompt", lambda: mgr.plan_prefill(rid, 10**6)),
                Misuse("plan_decode: bad id", lambda: mgr.plan_decode(rid, [-5])),
                Misuse("plan_decode_batch: twice the same rid", lambda: mgr.plan_decode_batch([rid, rid], [1, 2])),
                Misuse("finish: ready not a fence", lambda: mgr.finish(rid, _wrong("done"))),
                Misuse("abort: ready not a fence", lambda: mgr.abort(rid, _wrong(0))),
            ]
            if live is not None:
                out += [
                    Misuse(
                        "tree insert: ready not a fence",
                        lambda: cache.insert([2, 2], [0, 1], state_slot=live, ready=_wrong("x")),
                    ),
                    Misuse("tree insert: KV of the wrong length", lambda: cache.insert([2, 2], [0], state_slot=live)),
                    Misuse("pool clone: bad fence", lambda: pool.clone(live, NodeOwner(-5), after=_wrong(["x"]))),
                    Misuse(
                        "pool clone: a single fence, not a list",
                        lambda: pool.clone(live, NodeOwner(-5), after=_wrong(COMPLETE)),
                    ),
                    Misuse("pool copy: onto itself", lambda: pool.copy(live, live)),
                    Misuse("pool free: by another request", lambda: pool.free(live, RequestOwner(fresh))),
                ]
        return out

    def _forensics_catalogue(self) -> list[Misuse]:
        """Wrong calls of the manager's forensics (none without it): a node passed where its id
        goes, fingerprints that are not ints, a reason that is not a string."""
        fx = self.host.manager.forensics
        if fx is None:
            return []
        snaps = [n for n in self.host.manager.cache.iter_nodes() if n.snapshot is not None]
        node: object = snaps[0] if snaps else self.foreign.node  # a TreeNode, not its id
        nid = snaps[0].id if snaps else 0
        return [
            Misuse("forensics verify: a node, not its id", lambda: fx.verify(_wrong(node))),
            Misuse("forensics verify: why not a string", lambda: fx.verify(nid, why=_wrong(3))),
            Misuse("forensics finding: a node, not its id", lambda: fx.finding(_wrong(node))),
            Misuse("forensics expected: a node, not its id", lambda: fx.expected(_wrong(node))),
            Misuse("forensics compared: a node, not its id", lambda: fx.compared(_wrong(node), 1, 2)),
            Misuse("forensics compared: expected a string", lambda: fx.compared(nid, _wrong("1"), 2)),
            Misuse("forensics compared: found a bool", lambda: fx.compared(nid, 1, _wrong(True))),
            Misuse("forensics compared: why not a string", lambda: fx.compared(nid, 1, 2, why=_wrong(None))),
        ]

    def _shared_catalogue(self) -> list[Misuse]:
        """Wrong calls of the shared tier, its stores and its options."""
        sh = self.shared
        tier, pool, slot, ids = sh.tier, sh.pool, sh.slot, sh.ids
        kv = torch.arange(8)
        return [
            Misuse("tier key: negative id", lambda: tier.key(np.array([1, -2, 3]), None)),
            Misuse("tier key: id past 2**31", lambda: tier.key(np.array([1, 2**31]), None)),
            Misuse("tier key: a list, not an array", lambda: tier.key(_wrong([1, 2]), None)),
            Misuse("tier key: 2-D ids", lambda: tier.key(np.ones((2, 2), dtype=np.int64), None)),
            Misuse("tier key: a namespace it cannot address", lambda: tier.key(ids, _wrong((1, 2)))),
            Misuse("tier fetch: negative local", lambda: tier.fetch(np.arange(12), None, -1)),
            Misuse("tier fetch: page 0", lambda: tier.fetch(np.arange(12), None, 0, page=0)),
            Misuse("tier fetch: local past the ids", lambda: tier.fetch(np.arange(12), None, 13)),
            Misuse("tier publish: float KV", lambda: tier.publish(ids, None, pool, slot, kv.float(), None)),
            Misuse("tier publish: KV of the wrong length", lambda: tier.publish(ids, None, pool, slot, kv[:3], None)),
            Misuse("tier publish: not a pool", lambda: tier.publish(ids, None, _wrong("pool"), slot, kv, None)),
            Misuse("tier publish: not a fence", lambda: tier.publish(ids, None, pool, slot, kv, _wrong("x"))),
            Misuse(
                "tier publish: expect a float",
                lambda: tier.publish(ids[:7], None, pool, slot, kv[:7], None, expect=_wrong(1.0)),
            ),
            Misuse(
                "tier publish: token unhashable",
                lambda: tier.publish(ids[:7], None, pool, slot, kv[:7], None, expect=1, token=_wrong({})),
            ),
            Misuse("tier flush: negative timeout", lambda: tier.flush(-1)),
            Misuse("tier bind: not a layout", lambda: tier.bind(_wrong("layout"))),
            Misuse("tier bind: another layout", lambda: tier.bind(_OTHER_LAYOUT)),
            Misuse("tier bind: another client", lambda: tier.bind(FUZZ_LAYOUT, client=object())),
            Misuse("tier fetch before bind", lambda: sh.unbound.fetch(np.arange(12), None, 0)),
            Misuse("tier prefetch before bind", lambda: sh.unbound.prefetch("r", np.arange(12), None, 0)),
            Misuse("tier take before bind", lambda: sh.unbound.take("r", np.arange(12), None, 0)),
            Misuse("tier publish before bind", lambda: sh.unbound.publish(ids, None, pool, slot, kv, None)),
            Misuse("tier start_prefetching before bind", lambda: sh.unbound.start_prefetching()),
            Misuse("tier start_prefetching after close", lambda: sh.closed.start_prefetching()),
            Misuse("tier: an empty model", lambda: SharedTier(sh.store, model="", kv=_NoKV())),
            Misuse("tier: retry_s a string", lambda: SharedTier(sh.store, model="m", kv=_NoKV(), retry_s=_wrong("1"))),
            Misuse("tier: an empty secret", lambda: SharedTier(sh.store, model="m", kv=_NoKV(), secret=b"")),
            Misuse(
                "tier: exit_flush_s negative",
                lambda: SharedTier(sh.store, model="m", kv=_NoKV(), background=True, exit_flush_s=-1.0),
            ),
            Misuse(
                "tier: max_prefetch_bytes 0",
                lambda: SharedTier(sh.store, model="m", kv=_NoKV(), max_prefetch_bytes=0),
            ),
            Misuse(
                "tier: max_prefetch_bytes a bool",
                lambda: SharedTier(sh.store, model="m", kv=_NoKV(), max_prefetch_bytes=_wrong(True)),
            ),
            Misuse(
                "tier: a clock that is not callable",
                lambda: SharedTier(sh.store, model="m", kv=_NoKV(), clock=_wrong(1)),
            ),
            Misuse("redis store: ttl under a millisecond", lambda: RedisStore("redis://127.0.0.1:1/0", ttl_s=0.0004)),
            Misuse("redis store: ttl 0", lambda: RedisStore("redis://127.0.0.1:1/0", ttl_s=0)),
            Misuse("redis store: negative timeout", lambda: RedisStore("redis://127.0.0.1:1/0", timeout_s=-1)),
            Misuse("redis store: not a URL", lambda: RedisStore("notaurl")),
            Misuse("redis store: read_chunk under 4 KiB", lambda: RedisStore("redis://127.0.0.1:1/0", read_chunk=4095)),
            Misuse(
                "redis store: read_chunk a float",
                lambda: RedisStore("redis://127.0.0.1:1/0", read_chunk=_wrong(65536.0)),
            ),
        ]

    def refused(self, case: Misuse) -> None:
        """Make the wrong call; assert a typed error, the digest unchanged, invariants holding."""
        mgr = self.host.manager
        before = state_digest(mgr)
        tier_before = self.shared.digest()
        fx = mgr.forensics
        # its findings; its step too for its own calls (an admission may verify its hit first)
        own = case.label.startswith("forensics")
        fx_before = None if fx is None else (fx.step if own else None, len(fx.findings))
        try:
            case.call()
        except MISUSE_ERRORS:
            pass
        except ImportError:  # a RedisStore without the redis client: nothing to check here
            pass
        else:
            raise AssertionError(f"{case.label}: the call was accepted")
        after = state_digest(mgr)
        assert after == before, f"{case.label}: raised, but changed the state of pool, tree, manager or policy"
        assert self.shared.digest() == tier_before, f"{case.label}: raised, but changed the shared tier or its store"
        if fx is not None:
            got = (fx.step if own else None, len(fx.findings))
            assert got == fx_before, f"{case.label}: raised, but moved the forensics record"
        mgr.check_invariants()
        self.shared.tier.check_invariants()
        self.misuses += 1

    @rule(data=st.data())
    def failing_policy_admission(self, data: st.DataObject) -> None:
        """An admission whose policy raises (a custom policy's bug): AdmissionFailed, and every
        slot, lock, record and counter given back. Its ids match nothing, so no eviction or
        recency refresh (which a failure cannot take back) happens first."""
        mgr = self.host.manager
        policy = mgr.policy
        if mgr.pool.num_free < 1 + mgr.track_slots:
            return
        ids = [2**29 + self.next_rid, *range(2**29 + 1000, 2**29 + 1000 + data.draw(st.integers(0, 6)))]

        def raising(info: object) -> None:
            raise ZeroDivisionError("a bug in the policy")

        policy.admitted = raising  # type: ignore[method-assign, assignment]
        try:
            self.refused(Misuse("admit: the policy raises", lambda: mgr.admit(10**9 + self.next_rid, ids)))
        finally:
            del policy.admitted

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """One wrong call: a typed error, and nothing changed."""
        self.refused(data.draw(st.sampled_from(self.catalogue(data)), label="misuse"))

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data())
    def misuse_open_window(self, data: st.DataObject) -> None:
        """A window planned, then committed wrongly: each refused with nothing changed; then the
        request is aborted (its forward never ran)."""
        rid = data.draw(st.sampled_from(self.active), label="request")
        mgr = self.host.manager
        r = self.host.reqs[rid] if hasattr(self.host, "reqs") else None
        if r is None or r.computed >= r.prompt_len:
            return
        plan = mgr.plan_prefill(rid, min(r.prompt_len, r.computed + 4))
        n = plan.end - plan.start
        wrong = [
            Misuse("commit: KV of the wrong length", lambda: mgr.commit(plan, None, kv_indices=list(range(n + 1)))),
            Misuse("commit: float KV", lambda: mgr.commit(plan, None, kv_indices=torch.zeros(n))),
            Misuse("commit: negative KV", lambda: mgr.commit(plan, None, kv_indices=[-1] * n)),
            Misuse("commit: 2-D KV", lambda: mgr.commit(plan, None, kv_indices=torch.zeros(1, n, dtype=torch.int64))),
            Misuse("commit: ready not a fence", lambda: mgr.commit(plan, _wrong("done"), kv_indices=list(range(n)))),
            Misuse(
                "commit: now not a number", lambda: mgr.commit(plan, None, kv_indices=list(range(n)), now=_wrong("x"))
            ),
            Misuse("plan_prefill: a window is open", lambda: mgr.plan_prefill(rid, plan.end)),
            Misuse("finish: a window is open", lambda: mgr.finish(rid)),
        ]
        for case in data.draw(st.lists(st.sampled_from(wrong), min_size=1, max_size=3), label="wrong commits"):
            self.refused(case)
        self.host.abort(rid)
        self.active.remove(rid)

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data())
    def foreign_node_restore(self, data: st.DataObject) -> None:
        """A hit node of another cache restored into a live request's slot: refused."""
        rid = data.draw(st.sampled_from(self.active), label="request")
        r = self.host.reqs[rid] if hasattr(self.host, "reqs") else None
        if r is None:
            return
        node: TreeNode = self.foreign.node
        live = r.adm.live_slot
        self.refused(
            Misuse(
                "tree restore: a node of another cache",
                lambda: self.host.manager.cache.restore(node, live, dst_owner=RequestOwner(rid)),
            )
        )


@functools.cache
def _hf_config() -> Any:
    """A tiny transformers config (None without transformers), made once."""
    try:
        from ..hf import tiny_config
    except ImportError:
        return None
    return tiny_config("qwen3_next")


def _hf_catalogue() -> list[Misuse]:
    """Wrong options of the transformers bridge and host (when transformers is installed): each a
    typed error before anything is built."""
    cfg = _hf_config()
    if cfg is None:
        return []
    from ..hf import HFStateBridge
    from .hf_engine import HFEngine

    other = _OTHER_LAYOUT
    return [
        Misuse("hf bridge: on_narrowing unknown", lambda: HFStateBridge(cfg, on_narrowing=_wrong("ignore"))),
        Misuse("hf bridge: an unknown device", lambda: HFStateBridge(cfg, device="tpu")),
        Misuse("hf bridge: a layout of another model", lambda: HFStateBridge(cfg, other)),
        Misuse("hf engine: max_running 0", lambda: HFEngine(object(), cfg, max_running=0)),
        Misuse("hf engine: chunk 0", lambda: HFEngine(object(), cfg, chunk=0)),
        Misuse("hf engine: batch_decode not a bool", lambda: HFEngine(object(), cfg, batch_decode=_wrong(1))),
    ]


def misuse_adapter(inject: str | None = None) -> ManagerAdapter:
    """The misuse machine's default host: the fuzz adapter with a shared tier over a
    :class:`~radixcache.testing.faults.FaultyStore` that corrupts, drops and misplaces blobs and
    fails calls in and outside its protocol, and a KV codec that misbehaves on 10% of its calls, so
    the valid steps between the wrong calls keep admitting through every fault (each must be a
    miss: the machine checks every restored state against the ground truth)."""
    store = FaultyStore(seed=0, corrupt=0.2, drop=0.1, misplace=0.2, fail=0.05, foreign=0.05)
    return ManagerAdapter.build(inject=inject, shared=store, codec_faults=0.1)


def make_misuse_machine(factory: Callable[[], ManagerAdapter], *, name: str = "MisusedHost") -> type[MisuseMachine]:
    """A :class:`MisuseMachine` subclass driving adapters from ``factory``."""
    return type(name, (MisuseMachine,), {"adapter_factory": staticmethod(factory)})


def run_misuse(
    examples: int,
    seed: int,
    *,
    inject: str | None = None,
    progress: Callable[[int], None] | None = None,
    stateful_step_count: int = 30,
) -> None:
    """Run ``examples`` programs of the misuse machine with ``seed`` (deterministic); raise on the
    first failure after shrinking it (hypothesis prints the shrunk program).

    :param inject: a bug of :data:`radixcache.testing.inject.MISUSE_BUGS`, committed on purpose.
    """
    machine = make_misuse_machine(lambda: misuse_adapter(inject))
    run_machine(machine, examples, seed, stateful_step_count=stateful_step_count, progress=progress)
