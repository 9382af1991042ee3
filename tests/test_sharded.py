"""Sharded training survives a fault in process: ``ftrun.restartable`` and in-memory snapshots.

Real ftrun, real worker processes running FSDP2 (and FSDP2 + tensor parallel on a 2x2
mesh) on gloo, a real SIGKILL inside backward. Each test checks several invariants of one
run (the run costs ~10-20 s of imports and steps on this machine):

* the job finishes (exit 0) and its final parameters are bitwise equal to a fault-free
  run's with the same seed (each step's data depends on (seed, step, data-parallel rank)
  only and the world size and mesh are the same, so the replay is exact);
* every member of the new member epoch restored the same snapshot, at most K steps behind
  the last step committed before the fault, ranks 0..3 each once, the replacement included;
* the survivors re-entered in the same process (their pids print steps before and after);
* recovery (the SIGKILL to the first step after it) is bounded, loosely;
* the agent's snapshot memory is gone after the job, and no process is left behind.

Helpers run the jobs; the reference digests of fault-free runs are computed once per
configuration and shared by the tests that need them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.launch import PRELOADED, REPO, Launch
from tests.lines import Done, Restored, RestoredAfterRestart, Step, Victim, find, parse

SCRIPT = REPO / "scripts" / "train_fsdp.py"
STEPS = 8
# Measured here (2 cores, loaded by other jobs): SIGKILL to the first step after it
# 3.5-4.5 s (the replacement's start: importing torch). 10x that fails.
RECOVERY_BOUND_S = 45.0
JOB_TIMEOUT_S = 240.0
# The workers fork from a fork server that imported torch and what FSDP2 and DTensor need
# (torch._dynamo too): each of a test's nine worker starts costs no imports (4.5 s of CPU on
# this 2-core machine otherwise). Snapshots and restores run in the forked workers alike.
PRELOAD = ("--preload",
           ",".join((*PRELOADED, "torch.distributed.fsdp", "torch.distributed.tensor")))

_reference: dict[tuple[str, ...], str] = {}


def _run(job_dir: Path, args: list[str], name: str,
         env: dict[str, str] | None = None, flags: list[str] | None = None
         ) -> tuple[int, Launch]:
    script = job_dir / "train_fsdp.py"
    if not script.exists():
        shutil.copy(SCRIPT, script)
    work = job_dir / name
    work.mkdir()
    launch = Launch(["--nproc-per-node", "4", "--recovery", "regroup", *PRELOAD, *(flags or []),
                     str(script),
                     "--steps", str(STEPS), "--kill-dir", str(work), *args], env=env)
    code = launch.wait(JOB_TIMEOUT_S)
    return code, launch


def _snapshot_dirs_of(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"ftrun-snap-*-{pid}")]


def _digest(launch: Launch, world: int = 4) -> str:
    done = find(launch.lines, Done)
    assert sorted(d.rank for d in done) == list(range(world)), launch.output[-3000:]
    assert {d.steps for d in done} == {STEPS}, [d.where() for d in done]
    digests = {d.param_sum for d in done}
    assert len(digests) == 1, [d.where() for d in done]
    return digests.pop()


def _reference_digest(job_dir: Path, args: list[str]) -> str:
    key = tuple(args)
    if key not in _reference:
        code, launch = _run(job_dir, args, "reference")
        assert code == 0, launch.output[-3000:]
        assert not find(launch.lines, Restored), "a fault-free run restored a snapshot"
        _reference[key] = _digest(launch)
    return _reference[key]


def _check_cap_said_once(launch: Launch) -> None:
    said = [line for line in launch.lines if "more than the cap 1000 bytes" in line]
    assert len(said) == 4, launch.output[-3000:]
    for rank in range(4):
        assert any(f"rank {rank} " in line and "4 local ranks x 2 x" in line
                   for line in said), said
    assert not any("Traceback" in line for line in launch.lines), launch.output[-3000:]


def _check_recovery(launch: Launch, *, kill_step: int, every: int, good_step: int) -> None:
    """The invariants of one recovery (see the module): ``kill_step`` is the index of the
    step in whose backward the victim died (``kill_step`` steps were committed), the
    restore must be of ``good_step`` (the newest snapshot that can be complete)."""
    records = parse(launch.lines)
    victims = [r for r in records if isinstance(r, Victim)]
    assert len(victims) == 1, launch.output[-3000:]
    restored = [r for r in records if isinstance(r, Restored)]
    assert sorted(r.rank for r in restored) == [0, 1, 2, 3], [r.where() for r in restored]
    assert len({(r.step, r.epoch, r.taken_in) for r in restored}) == 1, \
        [r.where() for r in restored]
    step = restored[0].step
    assert kill_step - step <= every, f"restored step {step}, {kill_step} committed"
    assert step == good_step, [r.where() for r in restored]
    assert restored[0].epoch > restored[0].taken_in  # a snapshot of an earlier member epoch
    # The replacement (a joiner label, not one of the first four) restored a rank too.
    assert any(r.source and r.source.startswith("member") for r in restored), \
        [r.where() for r in restored]
    steps = [r for r in records if isinstance(r, Step)]
    victim = victims[0]
    survivors = {s.pid for s in steps if records.index(s) < records.index(victim)} \
        - {victim.pid}
    assert len(survivors) == 3, survivors
    after = [s for s in steps if s.step > step and records.index(s) > records.index(victim)]
    for pid in survivors:  # re-entered in the same process, and went on
        assert any(s.pid == pid for s in after), \
            f"survivor {pid} printed no step after: {launch.output[-4000:]}"
    assert not any(s.pid == victim.pid for s in after)


def _recovery_s(launch: Launch, kill_dir: Path) -> float:
    killed_at = float((kill_dir / "killed").read_text().split()[1])
    after = [s.t for s in find(launch.lines, Step) if s.t > killed_at]
    assert after, "no step after the fault"
    return min(after) - killed_at


def test_fsdp_sigkill_in_backward_restores_from_memory(job_dir: Path) -> None:
    """FSDP2, 4 workers, K=1: rank 1 SIGKILLed inside the backward of step index 5."""
    reference = _reference_digest(job_dir, [])
    code, launch = _run(job_dir, ["--kill-rank", "1", "--kill-step", "5"], "fault")
    assert code == 0, launch.output[-3000:]
    _check_recovery(launch, kill_step=5, every=1, good_step=5)
    assert _digest(launch) == reference
    recovery = _recovery_s(launch, job_dir / "fault")
    assert recovery < RECOVERY_BOUND_S, f"recovery took {recovery:.1f} s"
    assert _snapshot_dirs_of(launch.proc.pid) == []


def test_fsdp_tp_2x2_sigkill_in_backward_and_the_memory_cap(job_dir: Path) -> None:
    """FSDP2 on "dp" x tensor parallel on "tp" (a 2x2 mesh): the same recovery, DTensor
    shards back onto their 2-D placements. Its fault-free reference runs with
    FTRUN_SNAPSHOT_CAP_BYTES below what two snapshots of every local rank need (snapshots
    do not change the parameters): each rank says so once, in one line with the sizes, and
    the job runs to its end."""
    code, launch = _run(job_dir, ["--tp", "2"], "capped",
                        env={"FTRUN_SNAPSHOT_CAP_BYTES": "1000"})
    assert code == 0, launch.output[-3000:]
    _check_cap_said_once(launch)
    reference = _digest(launch)
    code, launch = _run(job_dir, ["--tp", "2", "--kill-rank", "2", "--kill-step", "4"],
                        "fault")
    assert code == 0, launch.output[-3000:]
    _check_recovery(launch, kill_step=4, every=1, good_step=4)
    assert _digest(launch) == reference
    assert _snapshot_dirs_of(launch.proc.pid) == []


def test_bad_state_then_faults_while_snapshotting_twice_and_during_recovery(
        job_dir: Path) -> None:
    """One job, bad input and three faults: rank 1 dies while the snapshot of step 2 is
    being taken (inside its capture: its file never exists, the other ranks' do), so every
    member restores step 1, not the half-taken 2; a registered state holds a ``set`` at
    step 5: every rank says so in one line naming the object's path and that snapshot is
    not taken; rank 2 dies in the backward of step index 5, so every member restores step
    4, the last good one; the replacement dies while restoring it (a fault during the
    recovery), and the next member epoch restores step 4 again. The job still ends with the
    fault-free parameters."""
    reference = _reference_digest(job_dir, [])
    code, launch = _run(job_dir, ["--bad-state-step", "5", "--kill", "1:2:capture",
                                  "--kill", "2:5:backward", "--kill", "3:4:restore"],
                        "fault")
    assert code == 0, launch.output[-3000:]
    said = [line for line in launch.lines if "snapshot of step 5 not taken" in line]
    assert said, launch.output[-3000:]
    for line in said:
        assert "registered 'loader': state['recent'] is a builtins.set" in line, line
    assert not any("Traceback" in line for line in launch.lines), launch.output[-3000:]
    records = parse(launch.lines)
    assert len([r for r in records if isinstance(r, Victim)]) == 3, launch.output[-3000:]
    by_epoch: dict[int, list[Restored]] = {}
    for r in records:
        if isinstance(r, Restored):
            by_epoch.setdefault(r.epoch, []).append(r)
    steps = []
    for _, restored in sorted(by_epoch.items()):
        assert len({(r.step, r.taken_in) for r in restored}) == 1, \
            [r.where() for r in restored]
        assert len({r.rank for r in restored}) == len(restored), [r.where() for r in restored]
        steps.append(restored[0].step)
    assert steps == [1, 4, 4], {e: [r.where() for r in rs] for e, rs in by_epoch.items()}
    last = by_epoch[max(by_epoch)]
    assert sorted(r.rank for r in last) == [0, 1, 2, 3], [r.where() for r in last]
    assert _digest(launch) == reference
    assert _snapshot_dirs_of(launch.proc.pid) == []



def test_two_ranks_that_hang_at_once_are_named_at_once(job_dir: Path) -> None:
    """Ranks 1 and 2 both sleep in the training loop at the same step while 0 and 3 wait
    for them in a collective: one verdict names both (the soak: named one after the other,
    the second only once the first's epoch had ended, a double hang cost 5.4 s), and the
    job recovers in process with the fault-free parameters."""
    reference = _reference_digest(job_dir, [])
    code, launch = _run(job_dir, ["--hang", "1:5:backward", "--hang", "2:5:backward"],
                        "fault")
    assert code == 0, launch.output[-3000:]
    named = [line for line in launch.lines if "failed: hung in train_fsdp.py" in line]
    assert len(named) == 2, launch.output[-3000:]
    assert {"rank 1 " in line for line in named} == {True, False}
    assert all("ranks 0,3 waited for it in a collective" in line for line in named), named
    assert _digest(launch) == reference


def test_a_member_that_never_leaves_the_ended_epoch_is_replaced_not_those_waiting(
        job_dir: Path) -> None:
    """The convergence issue's case, made deterministic. On a 2x2 mesh, rank 0 dies in the
    backward of step index 4 and its tensor-parallel peer, rank 1, never leaves member epoch
    0 (it sleeps before its next step, as it sat in a collective nothing released under
    load). Ranks 2 and 3 leave and wait for the next epoch. Before the fix the stall rule
    compared the waiting ranks with the stuck one, killed 2 and 3, and the job waited
    forever; now rank 1 is taken out, replaced, and the job ends with the fault-free
    parameters. Asleep in its own code, it is named hung by its agent
    (ftrun.agent.lingering) after the hang timeout, not left to the stuck rule's longer
    bound, which is for members still unwinding."""
    reference = _reference_digest(job_dir, ["--tp", "2"])
    code, launch = _run(job_dir, ["--tp", "2", "--kill-rank", "0", "--kill-step", "4",
                                  "--hang", "1:5:backward"], "fault")
    assert code == 0, launch.output[-3000:]
    taken = [line for line in launch.lines if "inside member epoch 0, which ended" in line
             or "stuck in member epoch 0" in line]
    assert taken and all("rank 1 " in line for line in taken), launch.output[-3000:]
    assert "failed: hung in train_fsdp.py" in taken[0], taken
    assert not any("stalled" in line for line in launch.lines), launch.output[-3000:]
    assert _digest(launch) == reference
    assert _snapshot_dirs_of(launch.proc.pid) == []


def test_a_member_lost_while_the_mesh_is_built_ends_the_build_not_the_job(
        job_dir: Path) -> None:
    """The long soak's one failure, made deterministic. On a 2x2 mesh rank 3 dies in the
    backward of step index 4; in the member epoch that recovers it, rank 1 dies after the
    epoch formed, just before it builds its device mesh, so its peers sit in the mesh's
    subgroup builds waiting on the control store for its address (gloo's 30-minute default).
    The epoch's end shuts down the store connection its groups wait on: they fail at once,
    the members re-enter with a second replacement, and the job ends in process with the
    fault-free parameters. Before the fix nothing released that wait: every member sat in
    it until the recovery deadline restarted every worker."""
    reference = _reference_digest(job_dir, ["--tp", "2"])
    code, launch = _run(job_dir, ["--tp", "2", "--kill", "3:4:backward",
                                  "--kill", "1:4:mesh"], "fault")
    assert code == 0, launch.output[-3000:]
    assert len(find(launch.lines, Victim)) == 2, launch.output[-3000:]
    assert not any("recovery deadline passed" in line or "every worker restarted" in line
                   for line in launch.lines), launch.output[-3000:]
    regrouped = [line for line in launch.lines if "survivors regrouped in" in line]
    assert len(regrouped) == 2, launch.output[-3000:]
    assert _digest(launch) == reference
    assert _snapshot_dirs_of(launch.proc.pid) == []


def test_survivors_of_a_failed_group_build_meet_fresh_members_under_one_name(
        job_dir: Path) -> None:
    """The long soak's one escalation, made deterministic. Rank 3 dies in the backward of
    step index 5; in the member epoch that recovers it, rank 1 dies just before its group
    build, so the others' builds of the default group fail. torch had counted those builds:
    in the next epoch the survivors met under group name 1 and the fresh replacements under
    0, each waiting for the other's keys, and the epoch formed and stood still until the
    recovery deadline restarted every worker. Now every member numbers its groups afresh
    (ftrun.worker.reentry.forget_group_names): the job recovers in process, twice, with the
    fault-free parameters."""
    reference = _reference_digest(job_dir, [])
    code, launch = _run(job_dir, ["--kill", "3:5:backward", "--kill", "1:2:group"], "fault")
    assert code == 0, launch.output[-3000:]
    assert len(find(launch.lines, Victim)) == 2, launch.output[-3000:]
    assert not any("recovery deadline passed" in line or "restarting" in line
                   for line in launch.lines), launch.output[-3000:]
    assert _digest(launch) == reference
    assert _snapshot_dirs_of(launch.proc.pid) == []


def test_a_recovery_that_never_commits_escalates_to_a_restart_that_restores_memory(
        job_dir: Path) -> None:
    """The escalation ladder, end to end: rank 1 dies at step index 3; in the member epoch
    that recovers it rank 2 hangs while it restores (alive and beating, inside the new
    epoch), and so does every replacement the hang watch gives it, until the job generation
    restarts. No step commits by the recovery deadline (counted from the first fault: the
    hangs fold into its recovery), so ftrun restarts the job generation; the restarted workers
    restore the newest complete snapshot the first generation left in memory (not step 0)
    and the job ends with the fault-free parameters."""
    reference = _reference_digest(job_dir, [])
    code, launch = _run(job_dir, ["--kill", "1:3:backward", "--hang", "2:3:restore",
                                  "--hang-until-restart"], "fault",
                        flags=["--recovery-deadline", "6", "--max-restarts", "1"])
    assert code == 0, launch.output[-3000:]
    escalated = [line for line in launch.lines if "] recovery deadline passed" in line]
    assert len(escalated) == 1, launch.output[-3000:]
    assert escalated[0].endswith("escalating: restarting all (1/1)"), escalated
    # where each member was when nobody could be named (rank 2 in its hang, the restore)
    at = [i for i, line in enumerate(launch.lines) if "at the escalation (most recent" in line]
    assert at and any("train_fsdp.py" in line for line in launch.lines[at[0]:]), \
        launch.output[-3000:]
    assert any("restarting (1/1)" in line for line in launch.lines), launch.output[-3000:]
    after = find(launch.lines, RestoredAfterRestart)
    assert sorted(r.rank for r in after) == [0, 1, 2, 3], launch.output[-3000:]
    assert {(r.generation, r.step) for r in after} == {(0, 3)}, [r.where() for r in after]
    assert _digest(launch) == reference
    assert _snapshot_dirs_of(launch.proc.pid) == []


def test_a_rank_that_hangs_in_its_own_code_is_named_and_replaced_in_process(
        job_dir: Path) -> None:
    """Rank 2 sleeps in the training loop (alive, beating) while the others wait for it in
    a collective. A sharded job's process groups report no collective counts, so the stall
    rule cannot name it; the hang watch does (every member idle, the stacks: rank 2 in its
    own code, the others in torch's communication), within seconds, and the job recovers
    in process with the fault-free parameters."""
    reference = _reference_digest(job_dir, [])
    code, launch = _run(job_dir, ["--hang", "2:5:backward"], "fault")
    assert code == 0, launch.output[-3000:]
    named = [line for line in launch.lines if "failed: hung in train_fsdp.py" in line]
    assert len(named) == 1 and "rank 2 " in named[0], launch.output[-3000:]
    assert "ranks 0,1,3 waited for it in a collective" in named[0]
    assert _digest(launch) == reference
