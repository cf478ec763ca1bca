"""The fuzz kit's host machine with stray writes into snapshots at rest
(:class:`radixcache.testing.fuzz.StrayWriteMachine`): every admission must still restore the
ground-truth state of its hit and every finished request must end on the ground truth, with and
without the shared tier. Forensics watches every donation in ``"record"`` mode; a snapshot it
finds changed is never served (the admission takes the next snapshot up its path) nor published.
A seeded longer run: ``HYPOTHESIS_PROFILE=dev pytest tests/test_corruption_stateful.py``."""

from __future__ import annotations

from radixcache.testing.adapter import ManagerAdapter
from radixcache.testing.fuzz import StrayWriteMachine, make_machine

TestStrayWrites = make_machine(
    lambda: ManagerAdapter.build(shared=None), name="StrayWrites", stray_writes=True
).TestCase
TestStrayWritesShared = make_machine(
    lambda: ManagerAdapter.build(), name="StrayWritesShared", stray_writes=True
).TestCase


def test_the_stray_write_machine_is_a_host_machine_with_one_more_rule() -> None:
    machine = make_machine(lambda: ManagerAdapter.build(shared=None), stray_writes=True)
    assert issubclass(machine, StrayWriteMachine)
    state = machine()
    try:
        assert state.host.manager.forensics is not None and state.host.manager.forensics.sample == 1.0
        assert state.stray_writes == 0 and state.unwatched == set()
    finally:
        state.teardown()
