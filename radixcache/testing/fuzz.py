"""A hypothesis state machine that fuzzes a host integration of the cache.

It drives a :class:`~radixcache.testing.adapter.HostAdapter` through random interleavings of
admit (prompts that share prefixes, re-sends of identical prompts, several namespaces over the same
ids, prompts with images: images that differ anywhere, also past their first 4 KiB), extend (with
captures and commits), decode, finish, abort, eviction, pending device work, and inserts a host
makes into the tree itself through a KV buffer it reuses at once; and checks after every step:

- ownership conservation (free + tree + requests == capacity) and no slot id held by the tree
  and a request at once; the tree's and the pool's invariants (``manager.check_invariants()``);
- every tree snapshot's fingerprint unchanged since it was donated;
- locked nodes never evicted (each live request's lock node alive and locked);
- every restored state equals the ground truth at its depth, in the request's own namespace and
  for its own images, and every finished request's final state equals the ground truth of
  everything it was fed;
- every admission leaves at least one id to compute (a hit never covers the whole prompt);
- KV: never freed twice, never freed while a live request uses it, never lost; the tree's KV
  indices never change under a host's later writes into the buffer it handed them over in.

Run it with :func:`run_fuzz` (``radixcache fuzz``) or as a test: ``TestHost = make_machine(factory).TestCase``.
:class:`StrayWriteMachine` (``make_machine(factory, stray_writes=True)``) adds writes into
snapshots at rest behind the tree's back: what every hit restores must still be the ground truth.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from linear_state import RequestOwner

from ..core.tree import TreeNode
from ..forensics import Forensics
from .adapter import PLACEHOLDER, HostAdapter, ManagerAdapter, default_bridge, ns_salt, prefix_state
from .inject import injected
from .reproducible import seed_only_constants
from .strategies import FUZZ_IMAGES, FuzzRequest, requests, token_keys

__all__ = ["HostMachine", "StrayWriteMachine", "fuzz_hosts", "make_machine", "run_fuzz", "run_machine"]

AdapterFactory = Callable[[], HostAdapter]


class HostMachine(RuleBasedStateMachine):
    """Fuzzes ``adapter_factory()``; subclass or use :func:`make_machine` to set the factory."""

    adapter_factory: AdapterFactory = staticmethod(lambda: ManagerAdapter.build())
    max_active = 4
    on_example: Callable[[], None] | None = None

    def __init__(self) -> None:
        super().__init__()
        if type(self).on_example is not None:
            type(self).on_example()  # type: ignore[misc]
        self.host = type(self).adapter_factory()
        self.active: list[int] = []
        self.next_rid = 0
        self.fingerprints: dict[int, int] = {}  # node id -> fingerprint of its snapshot
        # nodes whose snapshot a subclass changed on purpose (a stray write it injects): the
        # invariant below no longer compares them (what they serve is still checked)
        self.unwatched: set[int] = set()
        self.salts: dict[int, int] = {}
        self.sent: list[FuzzRequest] = []

    def _check_state(self, rid: int, what: str) -> None:
        conv, rec, fed = self.host.state(rid)
        want_conv, want_rec = prefix_state(fed, self.host.manager.pool.layout, salt=self.salts.get(rid, 0))
        assert torch.equal(rec, want_rec) and torch.equal(conv, want_conv), (
            f"request {rid}: {what} state differs from the ground truth after {len(fed)} tokens "
            f"(namespace salt {self.salts.get(rid, 0)})"
        )

    @precondition(lambda self: len(self.active) < self.max_active)
    @rule(req=requests())
    def admit(self, req: FuzzRequest) -> None:
        self._admit(req)

    @precondition(lambda self: len(self.active) < self.max_active and bool(self.sent))
    @rule(data=st.data())
    def resend(self, data: st.DataObject) -> None:
        """An identical prompt again (same ids, namespace and images): the deepest hit there is."""
        self._admit(data.draw(st.sampled_from(self.sent), label="re-send of"))

    @precondition(lambda self: len(self.active) < self.max_active and bool(self.sent))
    @rule(data=st.data())
    def resend_changed(self, data: st.DataObject) -> None:
        """A sent prompt with one id changed strictly inside it: it leaves the tree's edge part-way
        and may agree with the edge again after it (the same first and last page), where a walk
        that does not compare the whole edge serves another branch's state."""
        req = data.draw(st.sampled_from(self.sent), label="changed from")
        if len(req.ids) < 3:
            return
        at = data.draw(st.integers(1, len(req.ids) - 2), label="at")
        new = data.draw(st.integers(1, 4).filter(lambda t: t != req.ids[at]), label="to")
        ids = [*req.ids[:at], new, *req.ids[at + 1 :]]
        if PLACEHOLDER in (req.ids[at], new):  # keep the prompt's image runs as they were
            return
        self._admit(FuzzRequest(ids, req.namespace, req.images))

    @precondition(lambda self: len(self.active) < self.max_active and any(r.images for r in self.sent))
    @rule(data=st.data())
    def resend_other_image(self, data: st.DataObject) -> None:
        """A sent prompt with the same ids and one image swapped for another (often its twin, which
        agrees on the first 4 KiB): every id matches, so only the image's part of the key keeps
        the hit from serving the other image's state."""
        req = data.draw(st.sampled_from([r for r in self.sent if r.images]), label="image changed in")
        at = data.draw(st.integers(0, len(req.images) - 1), label="image")
        others = [i for i, im in enumerate(FUZZ_IMAGES) if im != req.images[at]]
        new = FUZZ_IMAGES[data.draw(st.sampled_from(others), label="to FUZZ_IMAGES[i], i")]
        self._admit(FuzzRequest(req.ids, req.namespace, (*req.images[:at], new, *req.images[at + 1 :])))

    def _admit(self, req: FuzzRequest) -> None:
        self.sent.append(req)
        rid = self.next_rid
        self.next_rid += 1
        cached = self.host.admit(rid, req.ids, namespace=req.namespace, images=req.images)
        if cached is None:
            return
        assert cached < len(req.ids), (
            f"request {rid}: a hit of {cached} covers all {len(req.ids)} ids: nothing to compute"
        )
        self.active.append(rid)
        self.salts[rid] = ns_salt(req.namespace)
        self._check_state(rid, f"restored (hit of {cached})")

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.active))
        self.host.extend(rid)

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data(), tokens=token_keys(min_size=1, max_size=3))
    def decode(self, data: st.DataObject, tokens: list[int]) -> None:
        rid = data.draw(st.sampled_from(self.active))
        while self.host.extend(rid):
            pass
        for t in tokens:
            self.host.decode(rid, t)

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.active))
        while self.host.extend(rid):
            pass
        self._check_state(rid, "final")
        self.host.finish(rid)
        self.active.remove(rid)

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.active))
        self.host.abort(rid)
        self.active.remove(rid)

    @rule(kv_tokens=st.integers(0, 16), snapshots=st.integers(0, 3))
    def evict(self, kv_tokens: int, snapshots: int) -> None:
        self.host.manager.evict(kv_tokens=kv_tokens, snapshots=snapshots)  # through the policy

    @rule(key=token_keys(min_size=1, max_size=12))
    def direct_insert(self, key: list[int]) -> None:
        """The host files a prefix it computed elsewhere through the manager (checkpoint; namespace
        "direct", with the right state), handing the KV over in a buffer it rewrites at once."""
        alloc, free = getattr(self.host, "alloc_kv", None), getattr(self.host, "free_kv", None)
        mgr = self.host.manager
        pool = mgr.pool
        if alloc is None or free is None or not pool.can_alloc(2):
            return
        owner = RequestOwner("direct insert")
        donor = pool.alloc(owner)
        conv, rec = prefix_state(key, pool.layout, salt=ns_salt("direct"))
        pool.write(donor, conv.to(pool.conv.dtype), rec.to(pool.recurrent.dtype), owner=owner).wait()
        handed = alloc(len(key))
        buf = torch.tensor(handed, dtype=torch.int64)
        res = mgr.checkpoint(key, buf, state_slot=donor, namespace="direct", release_duplicates=True)
        buf.fill_(1 << 40)  # the host's next use of its buffer
        if res.length:
            kept = mgr.cache.kv_indices(res.node).tolist()
            assert all(0 <= i < (1 << 40) for i in kept), "the tree's KV indices changed under the host's buffer"
        free(handed[res.length :])  # the tail beyond the last whole page stays the host's
        pool.free(donor, owner)

    @rule(n=st.integers(1, 4))
    def run_pending(self, n: int) -> None:
        for _ in range(n):
            if not self.host.run_pending():
                break

    @invariant()
    def ownership_and_structure(self) -> None:
        self.host.manager.check_invariants()
        check_kv = getattr(self.host, "check_kv", None)
        if check_kv is not None:
            check_kv()

    @invariant()
    def snapshots_never_change(self) -> None:
        """Each snapshot's fingerprint, once its copy landed, is the one it had when first seen: on
        the device, and across its demotion to the host tier (the same bytes in either pool)."""
        cache = self.host.manager.cache
        live = set()
        for node in cache.iter_nodes():
            if node.snapshot is not None:
                pool, slot, fence = cache.pool, node.snapshot, node.snapshot_fence
            elif node.host is not None and cache.host_pool is not None:
                pool, slot, fence = cache.host_pool, node.host, node.host_fence
            else:
                continue
            if not fence.is_complete() or not pool.last_use(slot).is_complete() or node.id in self.unwatched:
                continue
            live.add(node.id)
            fp = pool.fingerprint(slot)
            seen = self.fingerprints.setdefault(node.id, fp)
            assert fp == seen, f"snapshot of node {node.id} ({cache.tier(node)} slot {slot}) changed after its donation"
        self.fingerprints = {k: v for k, v in self.fingerprints.items() if k in live}

    def teardown(self) -> None:
        """Abort what is live and run the pending device work. After a failed step (hypothesis
        runs the teardown while the step's error propagates) an error here is a consequence of
        that one and is not raised in its place: the step's error is the finding."""
        failing = sys.exc_info()[1]
        try:
            for rid in list(self.active):
                self.host.abort(rid)
            while self.host.run_pending():
                pass
        except Exception:
            if failing is None:
                raise


class StrayWriteMachine(HostMachine):
    """:class:`HostMachine` with one more rule: a stray write into one snapshot at rest (on the
    device or in the host tier), behind the tree's back. The machine gives the manager a
    :class:`~radixcache.forensics.Forensics` of its own watching every donation in ``"record"``
    mode (the mode the manager runs by default, sampled), so every such write is found at the
    snapshot's next use; the manager must never serve it (an admission falls back up its path,
    a publication is dropped), so every restored and final state must still be the ground truth.
    The written node joins :attr:`HostMachine.unwatched`: the fingerprint invariant no longer
    compares it."""

    def __init__(self) -> None:
        super().__init__()
        mgr = self.host.manager
        mgr.forensics = Forensics(mgr.pool, mode="record")
        self.stray_writes = 0

    @rule(data=st.data())
    def stray_write(self, data: st.DataObject) -> None:
        """The device work drained first (a write racing a copy out of the slot is beyond any
        check made before the copy) and every donation fingerprint taken (the manager's calls
        take them as they complete); then one element of one snapshot changed."""
        host = self.host
        while host.run_pending():
            pass
        mgr = host.manager
        fx = mgr.forensics
        if fx is None:  # the host turned it off: nothing would find the write
            return
        fx.settle()
        cache = mgr.cache
        held = sorted((n for n in cache.iter_nodes() if n.snapshot is not None or n.host is not None), key=_node_id)
        if not held:
            return
        node = data.draw(st.sampled_from(held), label="snapshot of node")
        if node.snapshot is not None:
            pool, slot = mgr.pool, node.snapshot
        else:
            assert cache.host_pool is not None and node.host is not None
            pool, slot = cache.host_pool, node.host
        pool.recurrent[:, slot] += 1.0
        self.stray_writes += 1
        self.unwatched.add(node.id)


def _node_id(node: TreeNode) -> int:
    return node.id


def make_machine(factory: AdapterFactory, *, name: str = "FuzzedHost", stray_writes: bool = False) -> type[HostMachine]:
    """A :class:`HostMachine` subclass driving adapters from ``factory``; with ``stray_writes``,
    a :class:`StrayWriteMachine` one."""
    base = StrayWriteMachine if stray_writes else HostMachine
    return type(name, (base,), {"adapter_factory": staticmethod(factory)})


def run_fuzz(
    examples: int,
    seed: int,
    *,
    inject: str | None = None,
    page_size: int = 1,
    factory: AdapterFactory | None = None,
    progress: Callable[[int], None] | None = None,
    stateful_step_count: int = 50,
    host_slots: int = 2,
    shared: bool = True,
    shared_redis: str | None = None,
    kv_budget: int | None = 96,
    shrink: bool = True,
    bridge: str | None = "auto",
) -> None:
    """Run ``examples`` programs of the machine with ``seed`` (deterministic); raise on the first
    failure after shrinking it (hypothesis prints the shrunk program).

    Without ``factory`` the built-in adapter (:meth:`ManagerAdapter.build`) runs what a host runs:
    a host tier of ``host_slots`` snapshots (0: none), a KV budget of ``kv_budget`` tokens held
    by eviction (None: unbounded), and unless ``shared`` is False a shared tier over a store that
    corrupts, drops, delays and misplaces blobs: in memory, or over the Redis server at
    ``shared_redis`` (each example under addresses of its own). With ``bridge`` (a transformers
    family; ``"auto"``: ``qwen3_next`` when transformers is installed, else none) a second host
    runs ``examples`` programs too: each request's state kept in a transformers cache between
    windows, loaded from its restored slot through the bridge
    (:class:`~radixcache.testing.adapter.BridgedAdapter`); the plain host runs first (a bridge
    reads a restored slot through the pool, which waits every copy: an ordering bug only the
    plain host, ordered by the fences it was given, can show). These are ignored with
    ``factory``.
    ``shrink=False`` reports the first failing program as found (faster; longer to read).
    """
    from ..tiers.store import RedisStore
    from .faults import FUZZ_STORE_FAULTS, FaultyStore

    store = RedisStore(shared_redis, ttl_s=3600) if shared and shared_redis is not None else None
    run = f"fuzz-{os.getpid()}-{time.time_ns()}"
    made = itertools.count()

    def build(family: str | None) -> HostAdapter:
        faulty = None
        if store is not None:  # each adapter's keys apart in the one database; its faults its own
            faulty = FaultyStore(store, prefix=f"{run}-{next(made)}-", **FUZZ_STORE_FAULTS)
        return ManagerAdapter.build(
            inject=inject,
            page_size=page_size,
            host_slots=host_slots,
            shared=faulty if faulty is not None else ("faulty" if shared else None),
            kv_budget=kv_budget,
            bridge=family,
        )

    factories: list[AdapterFactory] = [factory] if factory is not None else [lambda: build(None)]
    family = default_bridge() if bridge == "auto" else bridge
    if factory is None and family is not None:
        factories.append(lambda: build(family))
    try:
        with injected(inject):
            for i, make in enumerate(factories):
                tick = None if progress is None else (lambda n, off=i * examples: progress(off + n))
                run_machine(
                    make_machine(make),
                    examples,
                    seed,
                    stateful_step_count=stateful_step_count,
                    progress=tick,
                    shrink=shrink,
                )
    finally:
        if store is not None:
            store.close()


def fuzz_hosts(bridge: str | None = "auto") -> int:
    """How many host kinds :func:`run_fuzz` runs with ``bridge`` (each for its examples): the plain
    adapter, and the bridged one when a family is given or ``auto`` finds transformers."""
    return 1 + ((default_bridge() if bridge == "auto" else bridge) is not None)


def run_machine(
    machine: type[HostMachine],
    examples: int,
    seed: int,
    *,
    stateful_step_count: int = 50,
    progress: Callable[[int], None] | None = None,
    shrink: bool = True,
) -> None:
    """Run ``examples`` programs of ``machine`` with ``seed`` (no example database; the same seed
    and count run the same programs in any process, whatever else it imported: see
    :func:`~radixcache.testing.reproducible.seed_only_constants`); raise on the first failure
    after shrinking it (hypothesis attaches the shrunk program; with ``shrink=False``, the program
    as found). ``progress(n)`` is called as each machine starts, ``n`` counting from 0, at most
    ``examples`` times (hypothesis also makes machines it discards: a few more than ``examples``)."""
    count = [0]

    def tick() -> None:
        # hypothesis makes more machines than ``examples`` (those it discards do not count): more
        # ticks would run a progress bar past its total
        if progress is not None and count[0] < examples:
            progress(count[0])
        count[0] += 1

    machine.on_example = staticmethod(tick)
    hyp_seed(seed)(machine)
    with seed_only_constants():  # the seed alone decides the programs, not what else is loaded
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=stateful_step_count,
                deadline=None,
                database=None,
                derandomize=False,
                suppress_health_check=list(HealthCheck),
                print_blob=True,
                phases=list(Phase) if shrink else [p for p in Phase if p not in (Phase.shrink, Phase.explain)],
            ),
        )
