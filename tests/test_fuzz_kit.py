"""The fuzzing kit: the machine passes on the real stack, and finds every injected bug within
300 examples with a fixed seed at its defaults, printing the failing program (shrunk for one of
them: shrinking a stateful program takes minutes)."""

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given

from radixcache import image_cache_ids
from radixcache.testing.adapter import HostAdapter, ManagerAdapter, prefix_state
from radixcache.testing.fuzz import make_machine, run_fuzz, run_machine
from radixcache.testing.inject import FUZZ_BUGS
from radixcache.testing.strategies import FUZZ_IMAGES, FuzzRequest, Lifecycle, image_prompts, lifecycles, requests

TestHostMachine = make_machine(lambda: ManagerAdapter.build(), name="HostMachine").TestCase
TestPagedHostMachine = make_machine(lambda: ManagerAdapter.build(page_size=2), name="PagedHostMachine").TestCase
TestLocalOnlyHostMachine = make_machine(
    lambda: ManagerAdapter.build(host_slots=0, shared=None, kv_budget=None), name="LocalOnlyHostMachine"
).TestCase


def test_the_host_tier_machine_demotes_and_hits_from_the_host() -> None:
    """The machine above really exercises the tier: evictions demote, and admissions hit there."""
    made: list[ManagerAdapter] = []

    def factory() -> ManagerAdapter:
        made.append(ManagerAdapter.build(host_slots=2))
        return made[-1]

    run_machine(make_machine(factory), 40, 1)
    assert sum(a.manager.cache.demotions for a in made) > 0
    assert sum(a.manager.metrics().host_hits for a in made) > 0


def test_default_adapter_satisfies_the_protocol() -> None:
    assert isinstance(ManagerAdapter.build(), HostAdapter)


SHRUNK = "alias"  # the one bug whose program the test also shrinks


def _fuzz_cli(bug: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "radixcache.cli", "fuzz", "--examples", "300", "--seed", "0", "--inject", bug]
    return subprocess.run(
        cmd + ([] if bug == SHRUNK else ["--no-shrink"]), capture_output=True, text=True, timeout=600, check=False
    )


@pytest.fixture(scope="module")
def fuzz_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """One CLI run per injected bug, each in a fresh process, as many at once as there are cores
    (they are independent and CPU-bound: sequential, they were most of the suite's time on a
    2-core machine)."""
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        return dict(zip(FUZZ_BUGS, pool.map(_fuzz_cli, FUZZ_BUGS), strict=True))


def test_a_late_write_is_caught_as_it_lands(fuzz_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """``free-before-fence`` is found by the adapter's write oracle (a forward that runs after its
    request's slots went back to the pool), not only when the late state is read back: before it,
    the machine found the bug with some seeds within 300 examples and not with others (seeds 0, 3
    and 7 of the first eight passed), as the reads that would show it were a matter of luck."""
    out = fuzz_runs["free-before-fence"]
    late = ("SlotMisuse: write into a free slot", "SlotMisuse: write into a slot owned by someone else")
    assert any(m in out.stdout for m in late), out.stdout[-2000:]


@pytest.mark.parametrize("bug", FUZZ_BUGS)
def test_machine_finds_each_injected_bug(bug: str, fuzz_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """Through the CLI at its defaults, in a fresh process: found within 300 examples with seed 0,
    exit 1, and the failing program (each rule call) printed."""
    out = fuzz_runs[bug]
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "FAIL after" in out.stdout
    assert "state = " in out.stdout and "state.teardown()" in out.stdout, "the failing program is printed"


@given(lifecycles())
def test_lifecycles_run_clean_through_the_adapter(life: Lifecycle) -> None:
    host = ManagerAdapter.build()
    for rid in range(2):  # the second is a re-send: it hits what the first donated
        assert host.admit(rid, life.prompt) is not None
        steps = 0
        while host.extend(rid):
            steps += 1
        for t in life.decode:
            host.decode(rid, t)
        conv, rec, fed = host.state(rid)
        assert fed == life.prompt + life.decode
        assert torch.equal(rec, prefix_state(fed)[1]) and torch.equal(conv, prefix_state(fed)[0])
        if life.abort_at is not None and life.abort_at <= steps:
            host.abort(rid)
        else:
            host.finish(rid)
        host.manager.check_invariants()
        host.check_kv()


@given(image_prompts())
def test_image_prompts_give_image_keyed_ids(prompt: tuple[list[int], list[bytes]]) -> None:
    ids, images = prompt
    out = image_cache_ids(ids, 9, images)
    placeholders = np.asarray(ids) == 9
    assert (out[~placeholders] == np.asarray(ids)[~placeholders]).all()
    assert (out[placeholders] >= 2**30).all()
    if images:
        other = image_cache_ids(ids, 9, [img + b"!" for img in images])
        assert (other[placeholders] != out[placeholders]).all()


def test_the_example_adapter_runs_clean() -> None:
    spec = importlib.util.spec_from_file_location(
        "fuzz_example", Path(__file__).parent.parent / "examples" / "fuzz_your_scheduler.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert isinstance(module.ToyAdapter(), HostAdapter)
    run_fuzz(40, seed=1, factory=module.ToyAdapter)


def test_progress_counts_each_example_once_and_stops_at_the_count() -> None:
    """Hypothesis makes a few more machines than the examples asked for (those it discards do not
    count: 31 for 25 with this seed); a progress bar hears of the examples only."""
    seen: list[int] = []
    run_machine(make_machine(lambda: ManagerAdapter.build()), 25, 0, progress=seen.append, stateful_step_count=20)
    assert seen == list(range(25))


def test_the_kit_is_exported_from_radixcache_testing() -> None:
    import radixcache.testing as kit

    assert kit.make_machine is make_machine and kit.ManagerAdapter is ManagerAdapter
    assert set(kit.FUZZ_BUGS) == set(FUZZ_BUGS) and callable(kit.shared_prefix_keys)
    with pytest.raises(AttributeError, match="no attribute"):
        kit.not_a_thing  # noqa: B018


def test_a_failed_steps_error_is_reported_not_the_teardowns_that_follows_it() -> None:
    """Hypothesis runs the teardown while a failed step's error propagates; the teardown's own
    error (here the pending work it drains, as after a write into a freed slot) used to replace
    the step's, so the finding printed was a consequence and not the bug."""

    class Broken(ManagerAdapter):
        failed = False

        def extend(self, rid: int) -> bool:
            type(self).failed = True
            raise AssertionError("the step's finding")

        def run_pending(self) -> bool:
            if type(self).failed:
                raise RuntimeError("the teardown's consequence")
            return super().run_pending()

    with pytest.raises(AssertionError, match="the step's finding"):
        run_machine(make_machine(lambda: Broken.build()), 50, 0, shrink=False)


@given(requests())
def test_a_printed_request_names_its_images_and_runs_as_python(req: FuzzRequest) -> None:
    """A failing program prints each request on one line, each image as ``FUZZ_IMAGES[i]``
    (printed as their bytes, a request took tens of kilobytes), and the line rebuilds the request."""
    from hypothesis.vendor.pretty import pretty

    shown = pretty(req)
    assert shown == repr(req) and "\n" not in shown and "\\x01" not in shown
    assert eval(shown, {"FuzzRequest": FuzzRequest, "FUZZ_IMAGES": FUZZ_IMAGES}) == req
