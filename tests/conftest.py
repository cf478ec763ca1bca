"""Test configuration: hypothesis runs derandomized with bounded examples unless told otherwise, and
draws no constants from the modules the session happened to import (a test's examples are the
same alone and in the suite)."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from .redis_server import RedisServer

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def _examples_independent_of_imports() -> Iterator[None]:
    """Derandomized hypothesis still drew constants read from every local module imported so far,
    so a test's examples changed with the tests run before it (radixcache.testing.reproducible).
    Imported here, not at the top: the engine suites' own conftests stub modules first."""
    from radixcache.testing.reproducible import seed_only_constants

    with seed_only_constants():
        yield


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server of this test's own, stopped at the end (see tests/redis_server.py)."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


_ENGINE_SUITES = ("sglang", "vllm")  # the engines' own code opens what it opens: not held to this


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Outside the engine suites a file, socket or subprocess pipe left open is a failure of the
    test that leaked it (a ``ResourceWarning``, or the unraisable warning pytest reports when one
    is collected during the test): library and tests close what they open."""
    here = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(here).parts if item.path.is_relative_to(here) else ()
        if parts and parts[0] in _ENGINE_SUITES:
            continue
        item.add_marker(pytest.mark.filterwarnings("error::ResourceWarning"))
        item.add_marker(pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"))
