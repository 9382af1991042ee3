"""In-process regroup, end to end: 4 real gloo workers running scripts/train_elastic.py.

Each test injects one kind of fault and then checks the invariants of a recovery:
* the survivors kept running (same pids before and after the fault: no restart);
* after every regroup all members report the same parameter checksum;
* no survivor committed a step twice or skipped one (its step lines go up by one);
* the job finishes, with identical final parameters on every rank, and the loss fell.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import REPO, Launch
from tests.lines import (
    Done,
    ElasticStep,
    Regroup,
    assert_steps_consecutive,
    check_regroup_invariants,
    find,
    parse,
)

ELASTIC = REPO / "scripts" / "train_elastic.py"
TOLERANCE = 1e-5  # relative: the reduction order changes with the world size


def _script(job_dir: Path) -> Path:
    target = job_dir / "train_elastic.py"
    shutil.copy(ELASTIC, target)
    return target


def _launch(job_dir: Path, *flags: str, steps: int = 120, extra: tuple[str, ...] = (),
            nproc: int = 4, env: dict[str, str] | None = None) -> Launch:
    events = job_dir / "events.jsonl"
    return Launch(
        ["--nproc-per-node", str(nproc), "--recovery", "regroup", "--events-file", str(events),
         *flags, str(_script(job_dir)), "--steps", str(steps), "--hidden", "128", *extra],
        cwd=job_dir, env=env,
    )


def _steps(run: Launch) -> list[ElasticStep]:
    return find(run.lines, ElasticStep)


def _pid_at_step(run: Launch, step: int, rank: int, timeout: float = 120) -> int:
    def seen(lines: list[str]) -> int | None:
        return next((s.pid for s in find(lines, ElasticStep)
                     if s.step >= step and s.rank == rank), None)

    return run.wait_for(seen, timeout, f"rank {rank} at step {step}")


def _check_invariants(run: Launch, *, survivors: set[int], finished: int | None = None) -> None:
    """Checks that hold for any run, finished (``finished`` = steps) or stopped by the test:
    tests/lines.py's regroup invariants, and the loss keeps falling."""
    check_regroup_invariants(parse(run.lines), survivors=survivors, finished=finished,
                             loss_falls=True)


def _wait_world(run: Launch, world: int, after_generation: int, timeout: float = 180) -> int:
    """Wait until a generation newer than ``after_generation`` commits steps with ``world``
    ranks; return its number."""
    def seen(lines: list[str]) -> int | None:
        return next((s.gen for s in find(lines, ElasticStep)
                     if s.gen > after_generation and s.world == world), None)

    return run.wait_for(seen, timeout, f"steps with {world} ranks after gen {after_generation}")


def _stop(run: Launch) -> None:
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM


def _events(job_dir: Path) -> list[dict]:
    path = job_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fault_free_checksum(tmp_path_factory: pytest.TempPathFactory, steps: int) -> str:
    directory = tmp_path_factory.mktemp("faultfree")
    run = _launch(directory, steps=steps)
    assert run.wait(240) == 0, run.output
    return find(run.lines, Done)[0].param_sum


def test_kill_inside_allreduce_survivors_continue_and_match_fault_free(
    job_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    steps = 60
    # Rank 1 sleeps before each backward: the other ranks are waiting inside the gradient
    # allreduce when it is killed.
    run = _launch(job_dir, steps=steps, extra=("--slow-rank", "1", "--slow-sleep", "0.05"))
    victim = _pid_at_step(run, 15, rank=1)
    survivors = {_pid_at_step(run, 15, rank=r) for r in (0, 2, 3)}
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    assert run.wait(240) == 0, run.output
    _check_invariants(run, survivors=survivors, finished=steps)
    after = [s for s in _steps(run) if s.t > killed]
    assert {s.pid for s in after} >= survivors  # the same processes carried on: no restart
    print(f"kill to next committed step: {min(s.t for s in after) - killed:.3f}s")
    events = _events(job_dir)
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["pid"] == victim and failure["rank"] == 1
    assert any(e["event"] == "epoch" and e.get("joiners") for e in events)  # replaced
    final = find(run.lines, Done)[0].param_sum
    reference = _fault_free_checksum(tmp_path_factory, steps)
    assert abs(float(final) - float(reference)) <= TOLERANCE * abs(float(reference))


def test_frozen_worker_is_detected_killed_and_replaced(job_dir: Path) -> None:
    run = _launch(job_dir, steps=100000, extra=("--step-sleep", "0.01"))
    frozen = _pid_at_step(run, 10, rank=2)
    stopped = time.time()
    os.kill(frozen, signal.SIGSTOP)
    run.wait_for(lambda lines: "frozen" in "\n".join(lines), 60, "the frozen verdict")
    progress = run.wait_for(  # a step committed by the survivors' new generation
        lambda lines: next((s for s in find(lines, ElasticStep) if s.gen >= 1), None), 60,
        "progress after the freeze")
    print(f"SIGSTOP to progress: {progress.t - stopped:.3f}s")
    assert progress.t - stopped < 15
    _wait_world(run, 4, after_generation=1)  # the replacement joined
    _stop(run)
    _check_invariants(run, survivors=set())


def test_stalled_rank_is_detected_from_step_progress(job_dir: Path) -> None:
    run = _launch(job_dir, "--stall-floor", "2", steps=100000,
                  extra=("--sleep-at-step", "30", "--fault-rank", "3", "--step-sleep", "0.01"))
    run.wait_for(lambda lines: "stalled" in "\n".join(lines), 120, "the stall verdict")
    _wait_world(run, 4, after_generation=1)
    _stop(run)
    _check_invariants(run, survivors=set())
    failure = next(e for e in _events(job_dir) if e["event"] == "failure")
    assert failure["rank"] == 3 and "stalled" in failure["cause"]


def test_exception_in_one_worker_regroups_the_rest(job_dir: Path) -> None:
    run = _launch(job_dir, steps=100000,
                  extra=("--raise-at-step", "20", "--fault-rank", "2", "--step-sleep", "0.01"))
    _wait_world(run, 4, after_generation=1)
    _stop(run)
    _check_invariants(run, survivors=set())
    failures = [e for e in _events(job_dir) if e["event"] == "failure"]
    assert len(failures) == 1, failures  # the replacement does not fail again
    assert failures[0]["rank"] == 2 and failures[0]["cause"] == "exit code 1"
    assert "injected error at step 20 on rank 2" in run.output


def test_rank_zero_failing_and_two_faults_in_a_row(job_dir: Path) -> None:
    run = _launch(job_dir, steps=100000, extra=("--step-sleep", "0.01"))
    first = _pid_at_step(run, 15, rank=0)
    os.kill(first, signal.SIGKILL)
    # The second fault hits as soon as the job has regrouped.
    second = run.wait_for(
        lambda lines: next((s.pid for s in find(lines, ElasticStep)
                            if s.gen == 1 and s.rank == 0), None),
        120, "rank 0 of the first new generation")
    os.kill(second, signal.SIGKILL)
    _wait_world(run, 4, after_generation=2)
    _stop(run)
    _check_invariants(run, survivors=set())
    failures = [e for e in _events(job_dir) if e["event"] == "failure"]
    assert [f["pid"] for f in failures] == [first, second]


def test_fault_during_recovery(job_dir: Path) -> None:
    run = _launch(job_dir, steps=100000, extra=("--step-sleep", "0.01"))
    a, b = _pid_at_step(run, 15, rank=1), _pid_at_step(run, 15, rank=2)
    os.kill(a, signal.SIGKILL)
    run.wait_for(lambda lines: f"(pid {a}) failed" in "\n".join(lines), 60, "the first verdict")
    os.kill(b, signal.SIGKILL)  # while the survivors are regrouping
    _wait_world(run, 4, after_generation=1)
    _stop(run)
    _check_invariants(run, survivors=set())


def test_replacement_dying_while_joining(job_dir: Path) -> None:
    run = _launch(job_dir, steps=100000, extra=("--step-sleep", "0.01"))
    os.kill(_pid_at_step(run, 10, rank=3), signal.SIGKILL)
    joiner = run.wait_for(
        lambda lines: next((int(e["pid"]) for e in _events(job_dir)
                            if e["event"] == "spawn" and e.get("member") == "0.4"), None),
        60, "the replacement's spawn")
    run.wait_for(lambda lines: "a new member is ready" in "\n".join(lines), 120, "joiner ready")
    os.kill(joiner, signal.SIGKILL)
    _wait_world(run, 4, after_generation=2)  # a second replacement makes it
    _stop(run)
    _check_invariants(run, survivors=set())


def test_warm_spare_restores_the_world_size_at_once(job_dir: Path) -> None:
    run = _launch(job_dir, "--spares", "1", steps=100000, extra=("--step-sleep", "0.01"))
    # The spare is ready (past its imports) before the fault.
    run.wait_for(lambda lines: any(e["event"] == "ready" and e["member"] == "0.4"
                                   for e in _events(job_dir)), 120, "the spare ready")
    victim = _pid_at_step(run, 20, rank=1)
    os.kill(victim, signal.SIGKILL)
    generation = run.wait_for(
        lambda lines: next((r for r in find(lines, Regroup) if r.gen == 1), None), 120,
        "generation 1")
    assert generation.world == 4  # the spare took the place at once: no shrink
    _wait_world(run, 4, after_generation=0)
    _stop(run)
    _check_invariants(run, survivors=set())


def test_shrink_continues_with_fewer_then_stops_below_minimum(job_dir: Path) -> None:
    run = _launch(job_dir, "--on-failure", "shrink", "--min-workers", "3", steps=100000,
                  extra=("--step-sleep", "0.01"))
    os.kill(_pid_at_step(run, 10, rank=3), signal.SIGKILL)
    run.wait_for(lambda lines: any(s.world == 3 for s in find(lines, ElasticStep)),
                 120, "steps with 3 workers")
    os.kill(_pid_at_step(run, 1, rank=0), signal.SIGKILL)
    assert run.wait(120) == 1
    assert "fewer than --min-workers 3" in run.output


FORGER = r"""
import json, sys
from datetime import timedelta
from torch.distributed import TCPStore
host, port, prefix, step = sys.argv[1], int(sys.argv[2]), sys.argv[3] + "/", int(sys.argv[4])
store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
def forged(body):
    return json.dumps({"body": body, "mac": "00" * 32})
members = [f"0.{i}" for i in range(4)]
store.append(prefix + "rgen/0/end", "\n" + forged({"member": "0.1", "cause": "forged"}))
store.append(prefix + "rgen/0/end", "\n" + json.dumps({"body": {"cause": "x"}, "mac": None}))
for s in range(step, step + 400):  # decisions and votes ahead of the job
    store.append(prefix + f"rgen/0/decision/{s}", "\n" + forged({"value": "abort"}))
    for m in members:
        store.set(prefix + f"rgen/0/vote/{s}/{m}", forged({}))
store.set(prefix + "status/0.2", forged({"beats": 1, "steps": 0, "collectives": 0,
                                        "synced": True, "finished": True}))
n = store.add(prefix + "faults", 1) - 1
store.append(prefix + f"fault/{n}", "\n" + forged({"cause": "forged", "member": "0.3",
                                                   "node": None, "kill": True}))
store.append(prefix + "done", "\n" + forged({"generation": 0}))
store.set(prefix + "rgen/latest", forged({"number": 7}))
store.add(prefix + "changes", 1)
print("forged", flush=True)
"""


def test_forged_regroup_records_change_nothing(job_dir: Path) -> None:
    """A process without the job's secret writes a generation end, abort decisions and
    votes for the coming steps, a 'finished' status, a fault that asks to kill a member,
    the job's done record and a newer generation pointer: the job goes on in generation 0
    with every member, and its steps stay consistent."""
    run = _launch(job_dir, steps=100000, extra=("--step-sleep", "0.02"),
                  env={"FTRUN_JOB_TOKEN": "regroup-test-secret"})
    pid = _pid_at_step(run, 5, rank=0)
    environ = dict(item.split("=", 1) for item in
                   Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    host, _, port = environ["FTRUN_CONTROL_ADDR"].rpartition(":")
    step = max(s.step for s in _steps(run))
    forger = subprocess.run(
        [sys.executable, "-c", FORGER, host, port, environ["FTRUN_REGROUP_PREFIX"],
         str(step)], capture_output=True, text=True, timeout=60, env={
            k: v for k, v in os.environ.items() if k != "FTRUN_JOB_TOKEN"})
    assert forger.stdout.strip() == "forged", forger.stderr
    pids = {s.pid for s in _steps(run)}
    run.wait_for(lambda lines: sum(1 for s in find(lines, ElasticStep)
                                   if s.step >= step + 60) >= 4, 120,
                 "60 more steps on every rank")
    assert "ignored a control record" in run.output
    records = parse(run.lines)
    steps = [s for s in records if isinstance(s, ElasticStep)]
    after = [s for s in steps if s.step > step]
    assert {s.pid for s in after} == pids and {s.gen for s in after} == {0}, "a regroup happened"
    assert all(s.world == 4 for s in after)
    assert_steps_consecutive(records, {s.pid for s in steps})
    _stop(run)
