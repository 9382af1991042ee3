"""The NCCL path of a regroup, on CPU: the agent's abort reaches a survivor stuck in an NCCL
collective through the preloaded shim (against the shim's NCCL test double)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.launch import REPO, Launch

SCRIPT = REPO / "tests" / "scripts" / "nccl_survivor.py"


def _require_fake_nccl() -> None:
    from ftrun.shim import ShimNotBuiltError, fake_nccl_dir

    try:
        fake_nccl_dir()
    except ShimNotBuiltError as error:
        pytest.fail(str(error))


def _kill_victim_and_wait_for_release(run: Launch) -> str:
    """Kill the victim once the survivor is inside NCCL; return the survivor's release line."""
    victim = int(run.wait_for(
        lambda lines: next((re.search(r"victim pid=(\d+)", x)[1] for x in lines
                            if "victim pid=" in x), None), 120, "the victim"))
    run.wait_for(lambda lines: any("blocking in ncclAllReduce" in x for x in lines), 60,
                 "the survivor inside NCCL")
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    released = run.wait_for(
        lambda lines: next((x for x in lines if "released code=" in x), None), 30, "release")
    waited = time.monotonic() - killed
    print(f"kill to NCCL release: {waited:.3f}s ({released.strip()})")
    return released


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_survivor_blocked_in_nccl_is_released_by_the_shim(job_dir: Path) -> None:
    _require_fake_nccl()
    events = job_dir / "events.jsonl"
    run = Launch(
        ["--nproc-per-node", "2", "--recovery", "regroup", "--on-failure", "shrink",
         "--events-file", str(events), str(SCRIPT), "1"],
        cwd=job_dir,
        env={"FTRUN_SHIM": "1"},  # CPU-only node: the shim is opt-in here
    )
    released = _kill_victim_and_wait_for_release(run)
    assert "code=0" not in released  # the collective failed: no garbage taken as a result
    assert run.wait(60) == 0, run.output
    assert "finished generation=1 world=1 step=3" in run.output
    aborts = [json.loads(x) for x in events.read_text().splitlines() if '"abort"' in x]
    assert aborts and aborts[0]["report"]["entries"], aborts


def test_survivor_blocked_in_nccl_is_released_after_the_job_re_formed(job_dir: Path) -> None:
    """The same release in job generation 1 (the first attempt failed before ftrun.init(), so
    the whole job restarted): the abort must not depend on the job generation the worker's
    control page was made in."""
    _require_fake_nccl()
    script = shutil.copy(SCRIPT, job_dir / SCRIPT.name)  # leftover checks find its workers
    events = job_dir / "events.jsonl"
    run = Launch(
        ["--nproc-per-node", "2", "--recovery", "auto", "--max-restarts", "1",
         "--on-failure", "shrink", "--events-file", str(events), str(script), "1",
         "--restart-first"],
        cwd=job_dir,
        env={"FTRUN_SHIM": "1"},
    )
    run.wait_for(lambda lines: any("failing before ftrun.init()" in x for x in lines), 120,
                 "the first attempt's failure")
    released = _kill_victim_and_wait_for_release(run)
    assert "code=0" not in released
    assert run.wait(60) == 0, run.output
    assert "finished generation=1 world=1 step=3" in run.output
    records = _events(events)
    assert [r["restart_count"] for r in records if r["event"] == "restart"] == [1], records
    at = next((i for i, r in enumerate(records) if r["event"] == "abort"), None)
    assert at is not None and records[at]["report"]["entries"], records
    # the agent's own "generation" records (a job generation: they carry its restart count)
    job_generation = [r["generation"] for r in records[:at]
                      if r["event"] == "generation" and "restart_count" in r]
    assert job_generation[-1:] == [1], records  # the abort happened in job generation 1
