"""The misuse fuzzer: clean on our stack under the CI profile, and each edge bug it exists to
catch found within 300 examples."""

import subprocess
import sys

import pytest
from hypothesis import settings

from radixcache.testing.inject import MISUSE_BUGS
from radixcache.testing.misuse import make_misuse_machine, misuse_adapter

TestMisuse = make_misuse_machine(misuse_adapter, name="MisuseOnOurStack").TestCase
TestMisuse.settings = settings(settings.get_profile("ci"), max_examples=5000, stateful_step_count=30)


@pytest.mark.parametrize("bug", MISUSE_BUGS)
def test_the_misuse_machine_finds_each_edge_bug(bug: str) -> None:
    """Through the CLI, in a fresh process: found within 300 examples with seed 0, exit 1, and the
    shrunk failing program printed."""
    cmd = [sys.executable, "-m", "radixcache.cli", "misuse", "--examples", "300", "--seed", "0", "--inject", bug]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "FAIL after" in out.stdout and "state = " in out.stdout
