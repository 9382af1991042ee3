"""Every ``--recovery`` mode a user can choose, on the paths that matter, end to end.

``restart`` runs :class:`ftrun.agent.restart.RestartSupervisor`; ``regroup`` and ``auto``
run the regroup supervisor, which falls back to a restart for a script without the worker
API. Each promise is checked in each mode it applies to, on real ftrun processes:

* a worker crash: under ``restart`` (any script) and under ``auto`` for a script without
  the API, every worker is started again and resumes from the last checkpoint; under
  ``regroup`` and ``auto`` with the API, the survivors carry on in the same processes;
* a signal to ftrun reaches every worker as that signal (tests/scripts/witness.py writes
  down the one it got: a SIGKILLed worker could not) and ftrun exits 128+N;
* ``--max-restarts N``: N restarts, then no more; exit 1 and a summary whose first row is
  the worker that failed;
* ``kill -9`` of ftrun leaves no worker behind (``PR_SET_PDEATHSIG``), whichever supervisor
  started them.

Every test runs in ``job_dir``, whose path is on every worker's command line: the fixture
fails the test if any of them outlives it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import psutil
import pytest

from tests.launch import (
    PRELOAD,
    REPO,
    Launch,
    copy_train_script,
    processes_mentioning,
    running,
    wait_until,
)
from tests.lines import (
    Done,
    ElasticStep,
    Regroup,
    Resumed,
    Start,
    Step,
    assert_steps_consecutive,
    check_regroup_invariants,
    find,
    parse,
    select,
)

WITNESS = REPO / "tests" / "scripts" / "witness.py"
ELASTIC = REPO / "scripts" / "train_elastic.py"
#: Workers that have started and are stepping on this 2-core machine take seconds (import
#: torch, gloo); these deadlines are for a machine shared with other test runs.
START_S = 120.0
JOB_S = 240.0


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


def _training(job_dir: Path, script: str, steps: int) -> list[str]:
    """A private copy of a training script and its arguments: checkpoints every 10 steps,
    a short sleep per step so a test can kill a worker mid-job."""
    if script == "train_ddp.py":
        path = copy_train_script(job_dir)
        extra = ["--checkpoint-dir", str(job_dir)]
    else:
        path = job_dir / "train_elastic.py"
        shutil.copy(ELASTIC, path)
        extra = ["--hidden", "64", "--checkpoint-dir", str(job_dir / "ck")]
    return [str(path), "--steps", str(steps), "--checkpoint-every", "10", "--step-sleep", "0.05",
            *extra]


# --- a worker crash -----------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "script"), [
    ("restart", "train_ddp.py"),
    # no worker API: auto falls back to a restart, as restart-no-api (long tier)
    pytest.param("auto", "train_ddp.py", marks=pytest.mark.long),
    ("restart", "train_elastic.py"),  # the API does not turn restart mode into regroup
], ids=["restart-no-api", "auto-no-api", "restart-api"])
def test_crash_restarts_every_worker_and_resumes_from_the_checkpoint(
        job_dir: Path, mode: str, script: str) -> None:
    steps = 40  # the kill after step 15, the resume from step 10 or later: 25 and more after
    events_file = job_dir / "events.jsonl"
    run = Launch(["--nproc-per-node", "2", "--recovery", mode, "--max-restarts", "1",
                  *PRELOAD, "--events-file", str(events_file),
                  *_training(job_dir, script, steps)], cwd=job_dir)
    victim = run.wait_step(15, START_S, rank=1)
    first_pids = {s.pid for s in run.steps()}
    os.kill(victim.pid, signal.SIGKILL)
    assert run.wait(JOB_S) == 0, run.output
    assert "restarting (1/1)" in run.output, run.output[-3000:]

    events = _events(events_file)
    failure, = _of(events, "failure")
    assert (failure["rank"], failure["pid"], failure["returncode"]) == (
        1, victim.pid, -signal.SIGKILL), failure
    assert [e["restart_count"] for e in _of(events, "restart")] == [1], events
    spawned = {g: {e["pid"] for e in _of(events, "spawn") if e["generation"] == g}
               for g in {e["generation"] for e in _of(events, "spawn")}}
    assert len(spawned) == 2 and all(len(pids) == 2 for pids in spawned.values()), spawned
    old, new = (spawned[g] for g in sorted(spawned))
    assert first_pids <= old and not old & new, spawned  # every worker is a new process

    records = parse(run.lines)
    assert not select(records, Regroup), "a restart mode regrouped"
    resumed = select(records, Resumed)
    assert sorted(r.rank for r in resumed) == [0, 1], run.output[-3000:]
    for line in resumed:  # from the last checkpoint, not from step 0
        assert 10 <= line.step <= victim.step + 1 and line.step % 10 == 0, line.where()
    assert_steps_consecutive(records, new)  # and no step twice after the resume
    for pid in new:
        first = next(s for s in select(records, Step) if s.pid == pid)
        assert first.step == resumed[0].step + 1, first.where()
    done = select(records, Done)
    assert len(done) == 2 and len({d.param_sum for d in done}) == 1, done
    assert all(d.steps == steps for d in done), done


# auto with the worker API regroups by the same path as regroup (long tier).
@pytest.mark.parametrize("mode", ["regroup", pytest.param("auto", marks=pytest.mark.long)])
def test_crash_with_the_worker_api_survivors_continue_in_place(job_dir: Path, mode: str) -> None:
    steps = 80
    events_file = job_dir / "events.jsonl"
    run = Launch(["--nproc-per-node", "3", "--recovery", mode, *PRELOAD, "--events-file",
                  str(events_file), *_training(job_dir, "train_elastic.py", steps)],
                 cwd=job_dir)
    victim = run.wait_step(10, START_S, rank=1)
    run.wait_for(lambda lines: {s.rank for s in find(lines, ElasticStep)
                                if s.step >= victim.step} >= {0, 2}, START_S,
                 "ranks 0 and 2 at the victim's step")
    before = {s.pid: s.step for s in run.steps() if s.pid != victim.pid}
    assert len(before) == 2, before
    os.kill(victim.pid, signal.SIGKILL)
    assert run.wait(JOB_S) == 0, run.output
    check_regroup_invariants(parse(run.lines), survivors=before, finished=steps)
    assert "restarting" not in run.output, run.output[-3000:]
    events = _events(events_file)
    assert not _of(events, "restart"), events
    assert {e["generation"] for e in _of(events, "spawn")} == {0}, events  # no new job gen
    failure = _of(events, "failure")[0]
    assert (failure["pid"], failure["rank"]) == (victim.pid, 1), failure


# --- signals --------------------------------------------------------------------------------


# Each signal once with the worker API and once without: all eight pairings of mode, API and
# signal cost 200 s of a CI run whose budget is 20 minutes, and ftrun forwards both signals by
# one path. auto takes regroup's path with the API and restart's without (long tier).
@pytest.mark.parametrize(("mode", "api", "sig"), [
    ("restart", False, signal.SIGINT), ("regroup", True, signal.SIGTERM),
    pytest.param("auto", True, signal.SIGINT, marks=pytest.mark.long),
    pytest.param("auto", False, signal.SIGTERM, marks=pytest.mark.long),
], ids=["restart-SIGINT", "regroup-api-SIGTERM", "auto-api-SIGINT", "auto-no-api-SIGTERM"])
def test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n(
        job_dir: Path, mode: str, api: bool, sig: signal.Signals) -> None:
    reports = job_dir / "reports"
    reports.mkdir()
    events_file = job_dir / "events.jsonl"
    run = Launch(["--nproc-per-node", "2", "--recovery", mode, "--events-file", str(events_file),
                  str(WITNESS), "--report-dir", str(reports), *(["--api"] if api else [])],
                 cwd=job_dir)
    started = run.wait_for(lambda lines: len(found := find(lines, Start)) == 2 and found,
                           START_S, "both workers running")
    run.proc.send_signal(sig)
    assert run.wait(60) == 128 + sig, run.output
    got = {path.name: path.read_text() for path in reports.glob("signal.*")}
    assert got == {f"signal.rank{s.rank}.pid{s.pid}": sig.name for s in started}, (
        got, run.output[-3000:])
    stops = [e for e in _of(_events(events_file), "stop") if e.get("reason") == "signal"]
    assert stops and all(e["signal"] == sig.name for e in stops), stops


# --- the restart budget ---------------------------------------------------------------------


# Without the worker API regroup and auto take one path (a worker that never called
# ftrun.init() restarts them all), so auto is left to the tests that tell the two apart.
@pytest.mark.parametrize("mode", ["restart", "regroup"])
def test_max_restarts_n_restarts_n_times_then_exits_1_naming_the_failure(
        job_dir: Path, mode: str) -> None:
    budget = 2
    reports = job_dir / "reports"
    reports.mkdir()
    events_file = job_dir / "events.jsonl"
    # Rank 1 fails in every attempt; rank 0 holds on through SIGTERM (--stay) until the
    # SIGKILL after the grace, so the summary lists it too, after the failure.
    run = Launch(["--nproc-per-node", "2", "--recovery", mode, "--max-restarts", str(budget),
                  "--shutdown-timeout", "0.5", "--events-file", str(events_file), str(WITNESS),
                  "--report-dir", str(reports), "--fail-rank", "1", "--stay"], cwd=job_dir)
    assert run.wait(JOB_S) == 1, run.output
    out = run.output
    for count in range(1, budget + 1):
        assert f"restarting ({count}/{budget})" in out, out
    assert f"restarting ({budget + 1}/" not in out, out
    attempts = sorted(s.restart for s in find(run.lines, Start) if s.rank == 1)
    assert attempts == list(range(budget + 1)), out  # the (N+1)th failure is not restarted
    assert f"all {budget} restarts used" in out, out
    summary = out[out.index("job failed"):].splitlines()
    header = next(i for i, line in enumerate(summary) if line.split()[:2] == ["rank", "local"])
    rows = [line.split() for line in summary[header + 1:header + 3]]
    # The first failure first: the failed rank, with the last attempt's exit code; then
    # rank 0, which ftrun stopped.
    assert rows[0][:2] == ["first", "1"] and f"exit code {10 + budget}" in " ".join(rows[0]), (
        "\n".join(summary))
    assert rows[1][:2] == ["stopped", "0"], "\n".join(summary)

    events = _events(events_file)
    assert [e["restart_count"] for e in _of(events, "restart")] == list(range(1, budget + 1))
    failures = _of(events, "failure")
    assert [(e["rank"], e["returncode"]) for e in failures] == [
        (1, 10 + k) for k in range(budget + 1)], failures
    assert len(_of(events, "spawn")) == 2 * (budget + 1), events
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "failed", events[-1]


# --- kill -9 of ftrun -------------------------------------------------------------------------


# auto without the worker API is a restart job, as the first (long tier).
@pytest.mark.parametrize(("mode", "api"), [
    ("restart", False), ("regroup", True), pytest.param("auto", False, marks=pytest.mark.long),
], ids=["restart", "regroup-api", "auto-no-api"])
def test_sigkill_of_ftrun_takes_every_worker_with_it(job_dir: Path, mode: str, api: bool) -> None:
    reports = job_dir / "reports"
    reports.mkdir()
    run = Launch(["--nproc-per-node", "3", "--recovery", mode, str(WITNESS),
                  "--report-dir", str(reports), *(["--api"] if api else [])], cwd=job_dir)
    started = run.wait_for(lambda lines: len(found := find(lines, Start)) == 3 and found,
                           START_S, "three workers running")
    workers = {p.pid for p in processes_mentioning(str(reports))} - {run.proc.pid}
    # with --preload (FTRUN_PRELOAD), the workers' fork server too: their parent
    servers = {psutil.Process(s.pid).ppid() for s in started} - {run.proc.pid}
    assert workers == {s.pid for s in started} | servers, (workers, started)
    run.kill()
    assert run.proc.returncode == -signal.SIGKILL
    # The kernel delivers the death signal as the agent exits; 10 s is for a loaded box.
    wait_until(lambda: not any(running(pid) for pid in workers), 10,
               "the workers dying with their agent")
    assert not list(reports.iterdir()), "a worker was signalled, not killed with its agent"
