"""A seeded run depends on its seed alone: importing another local module does not change it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixcache.testing.reproducible import seed_only_constants

_DRAWS = """
import importlib, json, sys
from hypothesis import given, settings, seed, strategies as st
from radixcache.testing.reproducible import seed_only_constants

def draws(pin):
    seen = []

    @seed(3)
    @settings(max_examples=60, database=None, derandomize=False, deadline=None)
    @given(st.lists(st.integers(0, 9_999), min_size=50, max_size=50))
    def record(xs):
        seen.append(xs)

    if pin:
        with seed_only_constants() as pinned:
            assert pinned, "this hypothesis draws no constants from loaded modules"
            record()
    else:
        record()
    return seen

before = (draws(True), draws(False))
sys.path.insert(0, sys.argv[1])
importlib.import_module("extra_constants")
after = (draws(True), draws(False))
print(json.dumps({"pinned_same": before[0] == after[0], "unpinned_same": before[1] == after[1]}))
"""


def test_the_pin_keeps_a_seeded_runs_draws_when_a_local_module_is_imported(tmp_path: Path) -> None:
    """In a process of its own (the suite's runs are pinned by conftest): sixty seeded examples of
    fifty integers, before and after importing a local module holding 1,000 new constants."""
    (tmp_path / "extra_constants.py").write_text(f"VALUES = ({', '.join(str(v) for v in range(1000, 2000))})\n")
    out = subprocess.run(
        [sys.executable, "-c", _DRAWS, str(tmp_path)], capture_output=True, text=True, timeout=300, check=False
    )
    if "draws no constants from loaded modules" in out.stderr:
        pytest.skip("this hypothesis draws no constants from loaded modules")
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the control: without the pin, the new module's constants are drawn and the run changes
    assert got == {"pinned_same": True, "unpinned_same": False}


def test_the_pin_nests_and_restores_what_it_replaced() -> None:
    from hypothesis.internal.conjecture import providers

    original = providers._get_local_constants
    with seed_only_constants() as outer:
        inner_fn = providers._get_local_constants
        with seed_only_constants() as inner:
            assert inner == outer
            assert providers._get_local_constants is inner_fn
        assert providers._get_local_constants is inner_fn  # the outer block still pins
        if outer:
            assert len(providers._get_local_constants()) == 0
    assert providers._get_local_constants is original


_MACHINE = """
import contextlib, importlib, json, sys, warnings
import radixcache.testing.fuzz as fuzz
from radixcache.testing.adapter import ManagerAdapter

def trace(pin):
    made = []

    def factory():
        made.append(ManagerAdapter.build())
        return made[-1]

    pinned = fuzz.seed_only_constants
    if not pin:  # the control: run_machine as it was, without its pin
        fuzz.seed_only_constants = contextlib.nullcontext
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the faulty store's warned-once failures
            fuzz.run_machine(fuzz.make_machine(factory), 60, 3, stateful_step_count=30)
    finally:
        fuzz.seed_only_constants = pinned
    return [a.manager.metrics().as_dict() for a in made]

before = (trace(True), trace(False))
sys.path.insert(0, sys.argv[1])
importlib.import_module("extra_constants")
after = (trace(True), trace(False))
same = {"pinned_same": before[0] == after[0], "unpinned_same": before[1] == after[1]}
print(json.dumps({"programs": len(before[0]), **same}))
"""


def test_the_fuzz_machine_runs_the_same_programs_after_a_local_module_is_imported(tmp_path: Path) -> None:
    """run_machine's contract, in a process of its own (the suite's runs are pinned by conftest):
    the seed and the count decide the programs. The control runs without run_machine's pin: seed
    3's 60 examples then ran other programs once a module holding the integers 100 to 999 was
    imported (seeds 0 to 2 happened not to draw one of them)."""
    (tmp_path / "extra_constants.py").write_text(f"VALUES = ({', '.join(str(v) for v in range(100, 1000))})\n")
    out = subprocess.run(
        [sys.executable, "-c", _MACHINE, str(tmp_path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["programs"] >= 60 and got["pinned_same"] and not got["unpinned_same"], got
