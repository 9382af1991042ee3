"""Shared fixtures: the real-infrastructure ones (tests/infra) and process hygiene."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch import Launch, assert_no_processes_mention

pytest_plugins = ["tests.infra.fixtures"]


@pytest.fixture
def job_dir(tmp_path: Path) -> Iterator[Path]:
    """A per-test directory; every process whose command line mentions it must be gone
    when the test ends (workers run scripts copied here, so this catches orphans)."""
    yield tmp_path
    for launch in Launch.running:  # a failed test may leave its launcher: end it first
        launch.kill()
    Launch.running.clear()
    assert_no_processes_mention(str(tmp_path), timeout_s=10.0)
