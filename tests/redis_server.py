"""A real redis-server for the tests that need one: started on a free loopback port in a temporary
directory, stopped (or killed and restarted on the same port) by the test session.

The binary comes from the distribution's packages (``.ci/run`` installs it when missing). Without
it the tests that need it are skipped, unless ``RADIXCACHE_REQUIRE_REDIS=1`` (CI sets it): then
they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["RedisServer", "redis_binary"]


def redis_binary() -> str | None:
    """The redis-server on PATH (or in /usr/sbin, /usr/bin), or None."""
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.access(p, os.X_OK)), None
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One redis-server process: no persistence, loopback only, its own directory."""

    def __init__(self, directory: Path) -> None:
        binary = redis_binary()
        if binary is None:
            if os.environ.get("RADIXCACHE_REQUIRE_REDIS") == "1":
                pytest.fail("redis-server is not installed (RADIXCACHE_REQUIRE_REDIS=1): run .ci/run's set-up")
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.directory = directory
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (on the same port as before, after :meth:`kill`) and wait for PING."""
        assert self.proc is None, "already running"
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
        ]
        with open(self.directory / "redis.log", "ab") as log:  # the process keeps its own descriptor
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start: see {self.directory / 'redis.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL the server (a crash), and wait for it to be gone."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """Terminate the server."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@contextlib.contextmanager
def redis_url(url: str | None) -> Iterator[str]:
    """``url`` as given, or the URL of a redis-server of our own in a temporary directory, stopped
    on exit (the benchmarks' ``--redis-url``)."""
    if url is not None:
        yield url
        return
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            yield server.url
        finally:
            server.stop()
