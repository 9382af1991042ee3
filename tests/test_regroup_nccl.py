"""The NCCL path of a regroup, on CPU: the agent's abort reaches a survivor stuck in an NCCL
collective through the preloaded shim (against the shim's NCCL test double)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.launch import REPO, Launch

SCRIPT = REPO / "tests" / "scripts" / "nccl_survivor.py"


def test_survivor_blocked_in_nccl_is_released_by_the_shim(job_dir: Path) -> None:
    from ftrun.shim import ShimNotBuiltError, fake_nccl_dir

    try:
        fake_nccl_dir()
    except ShimNotBuiltError as error:
        pytest.fail(str(error))
    events = job_dir / "events.jsonl"
    run = Launch(
        ["--nproc-per-node", "2", "--recovery", "regroup", "--on-failure", "shrink",
         "--events-file", str(events), str(SCRIPT), "1"],
        cwd=job_dir,
        env={"FTRUN_SHIM": "1"},  # CPU-only node: the shim is opt-in here
    )
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
    assert "code=0" not in released  # the collective failed: no garbage taken as a result
    assert run.wait(60) == 0, run.output
    assert "finished generation=1 world=1 step=3" in run.output
    aborts = [json.loads(x) for x in events.read_text().splitlines() if '"abort"' in x]
    assert aborts and aborts[0]["report"]["entries"], aborts
