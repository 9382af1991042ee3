"""Shared fixtures: the real-infrastructure ones (tests/infra) and process hygiene."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch import Launch, assert_no_processes_mention

# The suite's many short jobs spawn their workers: the default, --preload auto, forks a torch
# script's workers from a server that imports torch and torch._dynamo, 6 s of CPU per job on
# this machine (more than most of these jobs' own imports; CI took 17.5 min instead of 12.5).
# Tests about forked workers pass --preload; those about the default unset this (test_preload).
os.environ.setdefault("FTRUN_PRELOAD", "none")

pytest_plugins = ["tests.infra.fixtures"]

#: ``@pytest.mark.long``: a test whose ground another test in the default run already covers
#: by the same path (another variant, a sibling fault), left out of the default run that CI
#: makes (its budget is 20 minutes on 2 cores) and run by ``bash scripts/test.sh --long``.
LONG_REASON = "in the long tier only: bash scripts/test.sh --long"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="also run the tests marked long (the whole suite)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: left out unless --long (see tests/conftest.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(pytest.mark.skip(reason=LONG_REASON))


@pytest.fixture
def job_dir(tmp_path: Path) -> Iterator[Path]:
    """A per-test directory; every process whose command line mentions it must be gone
    when the test ends (workers run scripts copied here, so this catches orphans)."""
    yield tmp_path
    for launch in Launch.running:  # a failed test may leave its launcher: end it first
        launch.kill()
    Launch.running.clear()
    assert_no_processes_mention(str(tmp_path), timeout_s=10.0)
