"""Process helpers shared by the test infrastructure (namespaces and the Slurm cluster)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def kill_and_wait(pids: Sequence[int], timeout: float, grace: float | None = None) -> list[int]:
    """SIGTERM, SIGKILL after ``grace`` seconds (default half the deadline; 0 = SIGKILL at
    once), wait until gone or the deadline; returns the survivors."""
    deadline = time.monotonic() + timeout
    grace = timeout / 2 if grace is None else min(grace, timeout)
    for sig, until in ((signal.SIGTERM, time.monotonic() + grace), (signal.SIGKILL, deadline)):
        if sig == signal.SIGTERM and grace <= 0:
            continue
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        while time.monotonic() < until:
            if not any(pid_alive(p) for p in pids):
                return []
            time.sleep(0.02)
    return [p for p in pids if pid_alive(p)]
