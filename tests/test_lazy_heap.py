"""LazyHeap pops exactly what one binary heap of (priority, seq) would, whatever the push order:
its in-order run and its heap are one queue to every caller."""

from __future__ import annotations

from collections.abc import Callable

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


def _reference_pop(entries: list[tuple[int, int, int]], dead: frozenset[int], locked: frozenset[int]) -> int | None:
    """What a single heap does: walk (priority, seq) ascending, drop dead entries on the way, set
    locked ones aside (kept), stop at the first live unlocked one (removed)."""
    for e in sorted(entries):
        if e[2] in dead:
            entries.remove(e)
            continue
        if e[2] in locked:
            continue
        entries.remove(e)
        return e[2]
    return None


def _member_of(items: frozenset[int]) -> Callable[[tuple[float, int, int]], bool]:
    return lambda e: e[2] in items


def _member_not_of(items: frozenset[int]) -> Callable[[tuple[float, int, int]], bool]:
    return lambda e: e[2] not in items


@given(_ops)
def test_pops_follow_priority_then_push_order_like_a_single_heap(ops: list[tuple[object, ...]]) -> None:
    h: LazyHeap[int] = LazyHeap()
    ref: list[tuple[int, int, int]] = []
    tick, item = 0, 0
    for op in ops:
        if op[0] == "push":
            _, delta, back = op
            assert isinstance(delta, int)
            tick += delta
            p = max(0, tick - 5) if back else tick
            seq = h.push(p, item % 8)
            ref.append((p, seq, item % 8))
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
            ref[:] = [e for e in ref if e[2] not in dead]
        else:
            h.clear()
            ref.clear()
        assert len(h) == len(ref)
        assert sorted(h) == sorted(ref)


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
