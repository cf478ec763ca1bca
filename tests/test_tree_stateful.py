"""HybridRadixCache against a shadow model, with deferred streams and check_invariants() after
every step. Every donated slot is filled (by a deferred "forward") with a value derived from its
prefix, so every restore is checked exactly; every KV index handed to the tree is accounted for."""

from collections import Counter
from collections.abc import Hashable

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from linear_state import DeferredStream, Fence, LinearStatePool, RequestOwner
from radixcache import HybridRadixCache, TreeNode, free_kv_to

from .tree_helpers import LAYOUT, prefix_value

NAMESPACES: list[Hashable] = [None, "adapter"]
keys = st.lists(st.integers(1, 3), min_size=1, max_size=7)
DONOR = RequestOwner("donor")
READER = RequestOwner("reader")


def snapshot_prefixes(cache: HybridRadixCache) -> dict[tuple[Hashable, tuple[int, ...]], TreeNode]:
    """(namespace, prefix) of every node holding a snapshot (on the device or in the host tier),
    read off the tree."""
    out: dict[tuple[Hashable, tuple[int, ...]], TreeNode] = {}
    for ns, root in cache._roots.items():
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                p = prefix + tuple(int(x) for x in memoryview(child.key).cast("I"))
                if child.snapshot is not None or child.host is not None:
                    out[(ns, p)] = child
                stack.append((child, p))
    return out


KvKey = tuple[Hashable, tuple[int, ...], int]


def kv_key(ns: Hashable, tokens: tuple[int, ...], i: int, page: int) -> KvKey:
    """Token ``i`` is shared exactly with keys that agree up to the end of its page."""
    return (ns, tokens[: (i // page + 1) * page], i)


def tree_kv(cache: HybridRadixCache) -> dict[KvKey, int]:
    """(namespace, prefix to the end of token i's page, i) -> the KV index the tree holds."""
    out: dict[KvKey, int] = {}
    for ns, root in cache._roots.items():
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                path = prefix + tuple(int(x) for x in memoryview(child.key).cast("I"))
                for j, idx in enumerate(child.value.tolist()):
                    i = len(prefix) + j
                    out[kv_key(ns, path, i, cache.page_size)] = idx
                stack.append((child, path))
    return out


class TreeMachine(RuleBasedStateMachine):
    page_size = 1
    host_slots = 0  # the tree's host tier (0: none)

    def __init__(self) -> None:
        super().__init__()
        self.forward = DeferredStream("forward")
        self.copies = DeferredStream("copies")
        self.freed: list[int] = []
        self.pool = LinearStatePool(LAYOUT, 24)
        self.host = LinearStatePool(LAYOUT, self.host_slots) if self.host_slots else None
        self.cache = HybridRadixCache(
            self.pool,
            page_size=self.page_size,
            on_event=free_kv_to(lambda t: self.freed.extend(t.tolist())),
            stream=self.copies,
            host_pool=self.host,
        )
        self.next_kv = 0
        self.handed_out: set[int] = set()
        self.present: set[tuple[Hashable, tuple[int, ...]]] = set()
        self.kv: dict[KvKey, int] = {}
        self.locks: Counter[tuple[Hashable, tuple[int, ...]]] = Counter()
        self.locked_nodes: list[tuple[tuple[Hashable, tuple[int, ...]], TreeNode]] = []
        self.donors: list[tuple[int, Fence]] = []

    def cut(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: len(key) - len(key) % self.page_size])

    @rule(key=keys, ns=st.sampled_from(NAMESPACES), fenced=st.booleans())
    def donate(self, key: list[int], ns: Hashable, fenced: bool) -> None:
        if not self.pool.can_alloc(3):
            return
        cut = self.cut(key)
        slot = self.pool.alloc(DONOR)
        value = prefix_value(cut)
        pool = self.pool

        def forward_pass() -> None:
            pool.recurrent[:, slot].fill_(value)
            pool.conv[:, slot].fill_(value)

        # Unfenced: the host wrote the state synchronously and has nothing to wait.
        ready = self.forward.submit(forward_pass, label=f"forward {cut}") if fenced else None
        if not fenced:
            forward_pass()
        kv = torch.arange(self.next_kv, self.next_kv + len(key))
        self.next_kv += len(key)
        self.handed_out.update(kv.tolist())
        before = snapshot_prefixes(self.cache).get((ns, cut))
        on_host = before is not None and before.host is not None
        res = self.cache.insert(key, kv, state_slot=slot, ready=ready, namespace=ns)
        # The donor keeps decoding into its own slot, ordered after the pool's last use of it (the
        # clone), and frees it later after its own last write.
        later = self.forward.submit(
            lambda: pool.recurrent[:, slot].fill_(-1.0), after=[pool.last_use(slot)], label=f"decode {cut}"
        )
        self.donors.append((slot, later))
        assert res.length == len(cut)
        already = (ns, cut) in self.present
        # a donation where the host tier holds the state brings it back to the device
        assert res.snapshot_created == (len(cut) > 0 and (not already or on_host))
        dup = 0
        for i in range(len(cut)):
            p = kv_key(ns, cut, i, self.page_size)
            if p in self.kv:
                assert i < res.prefix_length
                dup += int(self.kv[p] != int(kv[i]))
            else:
                assert i >= res.prefix_length
                self.kv[p] = int(kv[i])
        assert res.duplicates == dup
        # The caller keeps the KV of the page-cut tail; it is "freed" by the caller here.
        self.freed.extend(kv[len(cut) :].tolist())
        if cut:
            self.present.add((ns, cut))

    @rule(key=keys, ns=st.sampled_from(NAMESPACES), lock=st.booleans())
    def match(self, key: list[int], ns: Hashable, lock: bool) -> None:
        res = self.cache.match(key, namespace=ns)
        cut = self.cut(key)
        want = max((d for d in range(1, len(cut) + 1) if (ns, cut[:d]) in self.present), default=0)
        assert res.cached_length == want, f"match {cut} in {ns!r}: length {res.cached_length}, shadow says {want}"
        assert res.cached_length <= res.token_length <= len(cut)
        assert res.kv_indices.tolist() == [self.kv[kv_key(ns, cut, i, self.page_size)] for i in range(want)]
        if want:
            dst = self.pool.alloc(READER)
            self.cache.restore(res.node, dst, dst_owner=READER).wait()
            _, rec = self.pool.read(dst)
            assert torch.all(rec == prefix_value(cut[:want])), f"restore of {cut[:want]} is wrong"
            self.pool.free(dst, READER)
            if lock:
                self.cache.lock(res.node)
                self.locks[(ns, cut[:want])] += 1
                self.locked_nodes.append(((ns, cut[:want]), res.node))

    @precondition(lambda self: bool(self.locked_nodes))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locked_nodes) - 1))
        prefix, node = self.locked_nodes.pop(i)
        self.cache.unlock(node)
        self.locks[prefix] -= 1

    @precondition(lambda self: bool(self.locked_nodes))
    @rule(data=st.data(), key=keys, ns=st.sampled_from(NAMESPACES))
    def relock(self, data: st.DataObject, key: list[int], ns: Hashable) -> None:
        """A held lock moves to what a match returns (a request's hold following its newest
        snapshot): the invariants check every count lock then unlock would have left."""
        res = self.cache.match(key, namespace=ns, touch=False)
        if res.cached_length == 0:
            return
        i = data.draw(st.integers(0, len(self.locked_nodes) - 1))
        prefix, node = self.locked_nodes[i]
        self.cache.relock(node, res.node)
        self.locks[prefix] -= 1
        moved = (ns, self.cut(key)[: res.cached_length])
        self.locks[moved] += 1
        self.locked_nodes[i] = (moved, res.node)

    @rule(kv_tokens=st.integers(0, 12), snapshots=st.integers(0, 4))
    def evict(self, kv_tokens: int, snapshots: int) -> None:
        before_kv = self.cache.evictable_kv_tokens
        before_snaps = self.cache.evictable_snapshots
        res = self.cache.evict(kv_tokens=kv_tokens, snapshots=snapshots)
        assert res.kv_tokens >= min(kv_tokens, before_kv) or self.cache.evictable_kv_tokens == 0
        assert res.snapshots >= min(snapshots, before_snaps) or self.cache.evictable_snapshots == 0
        now = set(snapshot_prefixes(self.cache))
        assert now <= self.present, f"snapshots appeared from nowhere: {now - self.present}"
        if self.host is None:
            assert len(self.present - now) == res.snapshots
        else:  # a demoted snapshot stays present; a host copy dropped (room, a leaf's KV) does not
            assert len(self.present - now) <= res.snapshots + res.nodes_removed
        for p, n in self.locks.items():
            if n:
                assert p in now, f"locked snapshot {p} was evicted"
        self.present = now
        held = tree_kv(self.cache)
        assert set(held) <= set(self.kv)
        self.kv = {p: idx for p, idx in self.kv.items() if p in held}

    @precondition(lambda self: bool(self.donors))
    @rule(data=st.data())
    def finish_donor(self, data: st.DataObject) -> None:
        slot, last = self.donors.pop(data.draw(st.integers(0, len(self.donors) - 1)))
        self.pool.free(slot, DONOR, after=[last])

    @rule()
    def run_forward(self) -> None:
        self.forward.run_next()

    @rule()
    def run_copies(self) -> None:
        self.copies.run_next()

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        held = tree_kv(self.cache)
        assert held == self.kv
        assert set(snapshot_prefixes(self.cache)) == self.present
        freed = Counter(self.freed)
        assert all(c == 1 for c in freed.values()), "a KV index was released twice"
        assert set(freed).isdisjoint(held.values()), "a KV index is both held and released"
        assert set(freed) | set(held.values()) == self.handed_out, "a KV index leaked"
        snaps = self.cache.num_snapshots
        assert self.pool.num_free + snaps + len(self.pool.slots_of(DONOR)) == self.pool.capacity
        if self.host is not None:
            assert self.host.num_free + self.cache.num_host_snapshots == self.host.capacity


class PagedTreeMachine(TreeMachine):
    page_size = 2


class HostTierTreeMachine(TreeMachine):
    """Evicted snapshots go to a three-slot host tier, and come back on a new donation."""

    host_slots = 3


TestTreeMachine = TreeMachine.TestCase
TestPagedTreeMachine = PagedTreeMachine.TestCase
TestHostTierTreeMachine = HostTierTreeMachine.TestCase
