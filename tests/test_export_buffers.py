"""The buffers a KV codec exports into and takes back from the shared tier
(:class:`radixcache.tiers.export_buffers.ExportBuffers`): only what it lent is ever written again,
at most two kept, within the cap."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from radixcache.tiers.export_buffers import KEPT_BUFFERS, ExportBuffers


def test_a_buffer_handed_back_is_the_next_export_that_fits() -> None:
    b = ExportBuffers(1000)
    first = b.take(100)
    view = first[:80].data  # what an export returns: a view of a slice
    b.give_back(view)
    assert b.spare_bytes == 100
    assert b.take(90) is first and b.spare_bytes == 0  # the kept one fits: taken, lent again
    assert b.take(90) is not first  # lent: a new one
    b.check_invariants()


def test_the_smallest_that_fits_is_taken() -> None:
    b = ExportBuffers(1000)
    small, large = b.take(100), b.take(400)
    b.give_back(large.data)
    b.give_back(small[:10].data)
    assert b.take(50) is small  # not the larger one that fits too
    assert b.take(300) is large and b.spare_bytes == 0


@pytest.mark.parametrize(
    "foreign",
    [b"bytes", memoryview(b"view of bytes"), np.zeros(10, np.uint8).data, np.zeros(10, np.uint8)[:5].data, None],
)
def test_what_it_did_not_lend_is_ignored(foreign: object) -> None:
    b = ExportBuffers(1000)
    b.give_back(foreign)
    assert b.spare_bytes == 0
    b.check_invariants()


def test_a_buffer_handed_back_twice_is_kept_once() -> None:
    b = ExportBuffers(1000)
    buf = b.take(100)
    b.give_back(buf.data)
    b.give_back(buf.data)
    assert b.spare_bytes == 100
    b.check_invariants()


def test_at_most_two_kept_the_largest_within_the_cap() -> None:
    b = ExportBuffers(1000)
    bufs = [b.take(n) for n in (100, 300, 200)]
    for buf in bufs:
        b.give_back(buf.data)
    assert b.spare_bytes == 500 and KEPT_BUFFERS == 2  # 300 + 200: the smallest dropped
    big = b.take(600)
    b.give_back(big.data)
    assert b.spare_bytes == 900  # 600 + 300: within 1,000, the 200 dropped
    huge = b.take(1001)
    b.give_back(huge.data)
    assert b.spare_bytes == 900  # above the cap: never kept
    b.check_invariants()


def test_no_cap_keeps_nothing_and_bad_caps_are_refused() -> None:
    b = ExportBuffers(0)
    b.give_back(b.take(10).data)
    assert b.spare_bytes == 0
    bad_caps: tuple[object, ...] = (-1, 1.5, True, "8")
    for bad in bad_caps:
        with pytest.raises(ValueError, match="cap_bytes"):
            ExportBuffers(bad)  # type: ignore[arg-type]
    b = ExportBuffers(1000)
    b.give_back(b.take(100).data)
    bad_needs: tuple[object, ...] = (-1, 2.0, True, None)
    for bad in bad_needs:
        with pytest.raises(ValueError, match=f"need must be an int >= 0 \\(bytes\\), got {bad!r}"):
            b.take(bad)  # type: ignore[arg-type]
    assert b.spare_bytes == 100  # nothing lent
    b.check_invariants()


def test_exports_and_hand_backs_on_two_threads_keep_the_rules() -> None:
    b = ExportBuffers(10_000)
    handed: list[memoryview] = []
    lock = threading.Lock()

    def export() -> None:
        for i in range(2000):
            buf = b.take(100 + i % 7)
            buf[:] = 1
            with lock:
                handed.append(buf.data)

    def writer() -> None:
        for _ in range(4000):
            with lock:
                v = handed.pop() if handed else None
            if v is not None:
                b.give_back(v)

    ts = [threading.Thread(target=export), threading.Thread(target=writer)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    b.check_invariants()


def test_the_invariants_name_each_broken_rule() -> None:
    b = ExportBuffers(1000)
    kept = b.take(100)
    b.give_back(kept.data)
    lent = b.take(200)
    spares = b._spares  # the structure under test: broken by hand, one rule at a time
    for broken, word in [
        ([kept, kept.copy(), kept.copy()], "cap 2"),
        ([np.empty(1001, np.uint8)], "past"),
        ([kept.view(np.int16)], "flat bytes"),
        ([kept, kept], "twice"),
        ([kept, lent], "lent"),
    ]:
        spares[:] = broken
        with pytest.raises(AssertionError, match=word):
            b.check_invariants()
    spares[:] = [kept]
    b.check_invariants()
