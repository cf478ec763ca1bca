"""Running a script in a fresh interpreter and checking how it ends: the library's threads (the
streams' workers, the shared tier's writer and fetcher) must be ended by its own exit hooks,
before the interpreter finalizes. A thread still inside a torch kernel at finalization aborts
the process only now and then (exit status 134), so the exit status alone catches a missing hook
by chance; the check here does not depend on it: a hook registered before the library is
imported runs after the library's (``atexit`` runs them last registered first) and names every
library thread still alive."""

from __future__ import annotations

import subprocess
import sys

_PRELUDE = """
import atexit as _atexit, threading as _threading

def _threads_left():  # registered first: runs after every exit hook the library registers
    left = sorted(t.name for t in _threading.enumerate() if t.is_alive() and t.name.startswith(_LIBRARY))
    print("library threads at exit:", ",".join(left) or "none", flush=True)

_LIBRARY = ("radixcache-", "linear-state-")
_atexit.register(_threads_left)
"""


def run_exiting(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (with ``args``) in a fresh interpreter without closing what it made; assert
    it exited with status 0 and that no thread of the library was alive once the library's exit
    hooks had run. Returns the finished process (its stdout for further checks)."""
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + script, *args], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    left = [line for line in done.stdout.splitlines() if line.startswith("library threads at exit:")]
    assert left == ["library threads at exit: none"], (left, done.stdout[-2000:])
    return done
