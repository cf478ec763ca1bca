"""The pool against a shadow map of owners, with check_invariants() after every step."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from linear_state import (
    DeferredStream,
    LinearStatePool,
    NodeOwner,
    Owner,
    PoolExhausted,
    RequestOwner,
    SlotMisuse,
    StateLayout,
)

OWNERS: list[Owner] = [RequestOwner(0), RequestOwner(1), RequestOwner(2), NodeOwner(0), NodeOwner(1)]
CAPACITY = 6


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = LinearStatePool(StateLayout(2, (4, 3), (2, 2, 2)), CAPACITY)
        self.shadow: dict[int, Owner] = {}
        self.values: dict[int, float] = {}

    @rule(owner=st.sampled_from(OWNERS[:3]))
    def alloc(self, owner: Owner) -> None:
        if len(self.shadow) == CAPACITY:
            with pytest.raises(PoolExhausted):
                self.pool.alloc(owner)
            return
        s = self.pool.alloc(owner)
        assert s not in self.shadow
        self.shadow[s] = owner
        self.pool.zero(s, owner=owner)
        self.values[s] = 0.0

    @rule(slot=st.integers(0, CAPACITY - 1), owner=st.sampled_from(OWNERS))
    def free(self, slot: int, owner: Owner) -> None:
        if self.shadow.get(slot) == owner:
            self.pool.free(slot, owner)
            del self.shadow[slot]
            del self.values[slot]
        else:
            with pytest.raises(SlotMisuse):
                self.pool.free(slot, owner)

    @rule(slot=st.integers(0, CAPACITY - 1), value=st.floats(-4, 4, allow_nan=False, width=16))
    def write(self, slot: int, value: float) -> None:
        owner = self.shadow.get(slot)
        if isinstance(owner, RequestOwner):
            self.pool.recurrent[:, slot].fill_(value)
            self.values[slot] = value
        else:
            with pytest.raises(SlotMisuse):
                self.pool.check_writable(slot)

    @rule(src=st.integers(0, CAPACITY - 1), node=st.sampled_from(OWNERS[3:]))
    def clone(self, src: int, node: Owner) -> None:
        if src not in self.shadow:
            with pytest.raises(SlotMisuse):
                self.pool.clone(src, node)
        elif len(self.shadow) == CAPACITY:
            with pytest.raises(PoolExhausted):
                self.pool.clone(src, node)
        else:
            new = self.pool.clone(src, node).slot
            self.shadow[new] = node
            self.values[new] = self.values[src]

    @precondition(lambda self: len(self.shadow) >= 2)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        src = data.draw(st.sampled_from(sorted(self.shadow)))
        dst = data.draw(st.sampled_from(sorted(self.shadow)))
        if src == dst or not isinstance(self.shadow[dst], RequestOwner):
            with pytest.raises(SlotMisuse):
                self.pool.copy(src, dst)
        else:
            self.pool.copy(src, dst, dst_owner=self.shadow[dst])
            self.values[dst] = self.values[src]

    @invariant()
    def matches_shadow(self) -> None:
        self.pool.check_invariants()
        for s in range(CAPACITY):
            assert self.pool.owner_of(s) == self.shadow.get(s)
        assert self.pool.num_free == CAPACITY - len(self.shadow)
        for s, v in self.values.items():
            assert float(self.pool.recurrent[0, s, 0, 0, 0]) == v


TestPoolMachine = PoolMachine.TestCase


SMALL = 3  # few slots: a slot freed with work pending is soon the only free one


class DeferredPoolMachine(RuleBasedStateMachine):
    """A pool on a deferred stream, work left pending until a rule runs it or a read waits it;
    frees drawn with ``wait=False``, and saves that clone a staging slot and free it at once (the
    vLLM store's commit). A fresh slot is written blind at once (as vLLM's worker writes a plan's
    slot), so an alloc that handed out a slot a pending clone still reads would change what the
    clone copies: every value read must match the shadow."""

    def __init__(self) -> None:
        super().__init__()
        self.stream = DeferredStream("pool")
        self.pool = LinearStatePool(StateLayout(2, (4, 3), (2, 2, 2)), SMALL, stream=self.stream)
        self.shadow: dict[int, Owner] = {}
        self.values: dict[int, float] = {}
        self.next_value = 1.0

    def _blind_alloc(self, owner: Owner) -> int | None:
        if len(self.shadow) == SMALL:
            with pytest.raises(PoolExhausted):
                self.pool.alloc(owner)
            return None
        s = self.pool.alloc(owner)
        self.next_value += 1
        self.pool.recurrent[:, s].fill_(self.next_value)
        self.shadow[s], self.values[s] = owner, self.next_value
        return s

    @rule(owner=st.sampled_from(OWNERS[:3]))
    def alloc(self, owner: Owner) -> None:
        self._blind_alloc(owner)

    @rule(slot=st.integers(0, SMALL - 1), owner=st.sampled_from(OWNERS), wait=st.booleans())
    def free(self, slot: int, owner: Owner, wait: bool) -> None:
        if self.shadow.get(slot) == owner:
            self.pool.free(slot, owner, wait=wait)
            del self.shadow[slot]
            del self.values[slot]
        else:
            with pytest.raises(SlotMisuse):
                self.pool.free(slot, owner, wait=wait)

    @rule(owner=st.sampled_from(OWNERS[:3]), node=st.sampled_from(OWNERS[3:]))
    def save(self, owner: Owner, node: Owner) -> None:
        """A staging slot written, cloned into a node's slot, and freed without waiting."""
        staging = self._blind_alloc(owner)
        if staging is None:
            return
        if len(self.shadow) == SMALL:
            with pytest.raises(PoolExhausted):
                self.pool.clone(staging, node)
        else:
            new = self.pool.clone(staging, node).slot
            self.shadow[new], self.values[new] = node, self.values[staging]
        self.pool.free(staging, owner, wait=False)
        del self.shadow[staging]
        del self.values[staging]

    @rule(slot=st.integers(0, SMALL - 1), value=st.floats(-4, 4, allow_nan=False, width=16))
    def write(self, slot: int, value: float) -> None:
        if isinstance(self.shadow.get(slot), RequestOwner):
            self.pool.last_use(slot).wait()  # a host kernel writing a slot it owns orders behind its last use
            self.pool.recurrent[:, slot].fill_(value)
            self.values[slot] = value

    @rule()
    def run_one(self) -> None:
        self.stream.run_next()

    @rule(slot=st.integers(0, SMALL - 1))
    def read(self, slot: int) -> None:
        if slot in self.values:
            assert float(self.pool.read(slot)[1][0, 0, 0, 0]) == self.values[slot]

    @invariant()
    def matches_shadow(self) -> None:
        self.pool.check_invariants()
        for s in range(SMALL):
            assert self.pool.owner_of(s) == self.shadow.get(s)
        assert self.pool.num_free == SMALL - len(self.shadow)


TestDeferredPoolMachine = DeferredPoolMachine.TestCase
