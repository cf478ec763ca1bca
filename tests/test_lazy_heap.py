"""LazyHeap pops exactly what one binary heap of (priority, seq) would over each item's latest
entry, whatever the push order: its in-order run and its heap are one queue to every caller, and a
push supersedes the item's earlier entry."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixcache.core.lazy_heap import LazyHeap

# ("push", priority delta, go back?) mostly ascending like the tree's ticks, sometimes an older
# priority (an unlock, a node that became a leaf again); pops with some items dead or locked.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("push"), st.integers(0, 3), st.booleans()),
        st.tuples(
            st.just("pop"), st.frozensets(st.integers(0, 7), max_size=2), st.frozensets(st.integers(0, 7), max_size=2)
        ),
        st.tuples(st.just("compact"), st.frozensets(st.integers(0, 7), max_size=3), st.just(frozenset())),
        st.tuples(st.just("clear"), st.just(frozenset()), st.just(frozenset())),
    ),
    min_size=10,
    max_size=120,
)


def _reference_pop(entries: dict[int, tuple[int, int]], dead: frozenset[int], locked: frozenset[int]) -> int | None:
    """What a single heap of each item's latest (priority, seq) does: walk them ascending, drop dead
    items on the way, set locked ones aside (kept), stop at the first live unlocked one (removed)."""
    for _, _, item in sorted((p, seq, x) for x, (p, seq) in entries.items()):
        if item in dead:
            del entries[item]
            continue
        if item in locked:
            continue
        del entries[item]
        return item
    return None


def _member_of(items: frozenset[int]) -> Callable[[tuple[float, int, int]], bool]:
    return lambda e: e[2] in items


def _member_not_of(items: frozenset[int]) -> Callable[[tuple[float, int, int]], bool]:
    return lambda e: e[2] not in items


@given(_ops)
def test_pops_follow_priority_then_push_order_like_a_single_heap(ops: list[tuple[object, ...]]) -> None:
    h: LazyHeap[int] = LazyHeap()
    ref: dict[int, tuple[int, int]] = {}  # item -> its latest (priority, seq)
    tick, item = 0, 0
    for op in ops:
        if op[0] == "push":
            _, delta, back = op
            assert isinstance(delta, int)
            tick += delta
            p = max(0, tick - 5) if back else tick
            seq = h.push(p, item % 4)  # few items: most pushes supersede an entry
            ref[item % 4] = (p, seq)
            item += 1
        elif op[0] == "pop":
            dead, locked = op[1], op[2]
            assert isinstance(dead, frozenset) and isinstance(locked, frozenset)
            got = h.pop_valid(_member_not_of(dead), skip=_member_of(locked))
            assert got == _reference_pop(ref, dead, locked)
        elif op[0] == "compact":
            dead = op[1]
            assert isinstance(dead, frozenset)
            h.compact(_member_not_of(dead))
            for x in dead:
                ref.pop(x, None)
            assert len(h) == len(ref)  # nothing superseded or dead is left
        else:
            h.clear()
            ref.clear()
        h.check_invariants()
        assert sorted(h.current()) == sorted((p, seq, x) for x, (p, seq) in ref.items())
        assert len(h) >= len(ref)


def test_a_superseded_entry_is_dropped_without_asking_valid() -> None:
    h: LazyHeap[str] = LazyHeap()
    h.push(1, "a")
    h.push(2, "b")
    h.push(3, "a")  # supersedes a's entry at 1
    asked: list[tuple[float, int, str]] = []

    def valid(e: tuple[float, int, str]) -> bool:
        asked.append(e)
        return True

    assert [h.pop_valid(valid) for _ in range(3)] == ["b", "a", None]
    assert [e[2] for e in asked] == ["b", "a"]  # a's entry at 1 was never offered
    assert asked[1][0] == 3 and len(h) == 0


def test_check_invariants_names_a_corrupted_queue() -> None:
    h: LazyHeap[str] = LazyHeap()
    for p, name in ((1, "a"), (5, "b"), (3, "c")):
        h.push(p, name)
    h.check_invariants()
    h._latest["ghost"] = 99  # an item with no entry
    with pytest.raises(AssertionError, match="latest entry held"):
        h.check_invariants()
    del h._latest["ghost"]
    h._run.reverse()
    with pytest.raises(AssertionError, match="out of"):
        h.check_invariants()


def test_out_of_order_pushes_pop_before_later_in_order_ones() -> None:
    h: LazyHeap[str] = LazyHeap()
    for p, name in ((1, "a"), (5, "b"), (9, "c"), (3, "late"), (5, "tie")):
        h.push(p, name)
    out = []
    while (x := h.pop_valid(lambda e: True)) is not None:
        out.append(x)
    assert out == ["a", "late", "b", "tie", "c"]  # equal priorities in push order
    assert len(h) == 0


def test_an_entry_set_aside_as_locked_keeps_its_rank() -> None:
    h: LazyHeap[str] = LazyHeap()
    for p, name in ((1, "locked"), (5, "b"), (9, "c")):
        h.push(p, name)
    assert h.pop_valid(lambda e: True, skip=lambda e: e[2] == "locked") == "b"
    h.push(10, "d")
    assert [h.pop_valid(lambda e: True) for _ in range(3)] == ["locked", "c", "d"]
