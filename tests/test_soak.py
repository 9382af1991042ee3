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


def test_only_faults_that_another_faults_recovery_beat_are_absorbed() -> None:
    """The soak's accounting (one record per fault): a raise injected 34 ms (CI's
    torchrun_ddp run, seed 813507845) or 3.5 s (the long soak, seed 642195640: a slow step)
    before a restart of its generation detected another fault never acted (its victim was
    stopped first), so it is absorbed, not missing. A kill needs its record; so does a raise
    into another generation, or one a restart followed much later."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import soak
    finally:
        sys.path.remove(str(REPO / "scripts"))
    from ftrun.observe.faults import FaultRecord

    restart = FaultRecord(index=0, cause="killed by SIGKILL", detected=100.034, happened=100.0,
                          rank=2, pid=711, generation=3, path="restart")
    generation_of = {711: 3, 714: 3, 715: 3, 800: 4}
    injected = [(100.0, "kill rank 2 (pid 711)"), (99.999, "raise rank 3 (pid 714)"),
                (100.0, "kill rank 1 (pid 715)"), (100.0, "hang rank 0 (pid 800)"),
                (80.0, "raise rank 3 (pid 714)")]
    assert soak.absorbed_by_restart(injected, [restart], generation_of) == [
        "raise rank 3 (pid 714)"]
    # a victim taken out as another fault's casualty (waiting in a collective of the epoch
    # it ended) never reached the step where its hang would act: named in that record (the
    # long soak's ddp run, seed 470599239)
    regroup = FaultRecord(index=1, cause="killed by SIGKILL", detected=200.0, happened=200.0,
                          rank=2, pid=691, generation=0, path="regroup", casualties=[0],
                          casualty_pids=[622])
    assert soak.absorbed_by_restart([(199.4, "hang rank 0 (pid 622)"),
                                     (199.4, "hang rank 1 (pid 623)")], [regroup], {}) == [
        "hang rank 0 (pid 622)"]


def test_an_isolated_recovery_is_one_no_other_fault_overlapped() -> None:
    """recovery_s_in_process_isolated leaves out a recovery during which another fault
    happened, or that began within a second after another (a hang just before a kill: the
    kill's recovery holds the hang's detection), and keeps the others."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import soak
    finally:
        sys.path.remove(str(REPO / "scripts"))
    from ftrun.observe.faults import FaultRecord

    def record(index: int, happened: float, recovered: float) -> FaultRecord:
        return FaultRecord(index=index, cause="killed by SIGKILL", detected=happened,
                           happened=happened, path="regroup", recovered=recovered)

    lone, hang, kill, late = (record(0, 10.0, 10.5), record(1, 20.0, 22.0),
                              record(2, 20.6, 25.7), record(3, 26.0, 26.4))
    records = [lone, hang, kill, late]
    assert [soak.overlapped(r, records) for r in records] == [False, True, True, False]
