"""The chaos soak's short run, as CI runs it: every job of the matrix under a fixed schedule
of faults (scripts/soak.py --short), with nothing failing. The long run (1,000 faults, a
random seed) is in docs/soak.md; this one is the safety net every change passes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launch import REPO


@pytest.mark.timeout(900)
def test_the_short_soak_survives_every_fault() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--short",
                           "--json"], capture_output=True, text=True, timeout=850)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert summary["failures"] == [], proc.stderr[-3000:]
    assert summary["faults"] >= 24 and summary["survived"] == summary["faults"], summary
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["max_gap_s"] < summary["deadline_s"], summary
