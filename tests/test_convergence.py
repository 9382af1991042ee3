"""Never worse than a restart: the escalation ladder's last rung and the crash-loop rule,
end to end, with real ftrun and real workers (the ladder's restart of a sharded job, which
restores its memory, is in tests/test_sharded.py; the rules themselves in tests/unit).

* the same error at the same step on the same rank, every time: the job stops with exit
  code 4 after ``--max-repeats`` occurrences, not after ``--max-restarts`` full restarts,
  under the restart path (a script without the worker API) and under regroup;
* a recovery that commits no step by its deadline with no restart left: exit 1, the verdict
  said once;
* a combination that cannot make progress (``--on-failure shrink`` with a sharded job) is
  refused once the script showed what it is: exit 2 and one line, before any fault.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ftrun.exitcodes import ExitCode
from tests.launch import PRELOAD, REPO, TRAIN_SCRIPT, Launch
from tests.lines import ElasticStep, find

ELASTIC = REPO / "scripts" / "train_elastic.py"
FSDP = REPO / "scripts" / "train_fsdp.py"
SHARDED_PRELOAD = ("--preload", PRELOAD[1] + ",torch.distributed.fsdp,torch.distributed.tensor")
TIMEOUT_S = 240.0


def _script(job_dir: Path, source: Path) -> str:
    target = job_dir / source.name
    shutil.copy(source, target)
    return str(target)


def _said(launch: Launch, text: str) -> list[str]:
    return [line for line in launch.lines if text in line]


def test_a_script_raising_the_same_error_every_restart_stops_as_a_crash_loop(
        job_dir: Path) -> None:
    """torchrun would restart it --max-restarts times: ftrun stops at the second identical
    failure (the default --max-repeats 2), after one restart."""
    launch = Launch(["--nproc-per-node", "2", "--max-restarts", "5", *PRELOAD,
                     _script(job_dir, TRAIN_SCRIPT), "--steps", "20", "--fail-at-step", "10",
                     "--fail-rank", "1"])
    assert launch.wait(TIMEOUT_S) == ExitCode.CRASH_LOOP, launch.output[-3000:]
    said = _said(launch, "failed 2 times in a row with the same error")
    assert len(said) == 1 and "rank 1 " in said[0], launch.output[-3000:]
    assert "RuntimeError: injected failure at step 10 on rank 1" in said[0]
    assert len(_said(launch, "; restarting (")) == 1, launch.output[-3000:]


def test_a_member_raising_the_same_error_after_every_regroup_stops_as_a_crash_loop(
        job_dir: Path) -> None:
    """Under regroup the failing rank is replaced and the step replayed: without the rule
    the job would replace and replay forever. With --max-repeats 3 it stops at the third."""
    launch = Launch(["--nproc-per-node", "3", "--recovery", "regroup", "--max-repeats", "3",
                     *PRELOAD, _script(job_dir, ELASTIC), "--steps", "30",
                     "--raise-at-step", "10", "--fault-rank", "1", "--raise-every-time"])
    assert launch.wait(TIMEOUT_S) == ExitCode.CRASH_LOOP, launch.output[-3000:]
    said = _said(launch, "failed 3 times in a row with the same error")
    assert len(said) == 1, launch.output[-3000:]
    assert "ValueError: injected error at step 10 on rank 1" in said[0]
    assert len(_said(launch, "failed: exit code 1")) == 3, launch.output[-3000:]
    assert max(s.step for s in find(launch.lines, ElasticStep)) == 10


def test_a_recovery_past_its_deadline_with_no_restart_left_fails_with_the_verdict(
        job_dir: Path) -> None:
    launch = Launch(["--nproc-per-node", "4", "--recovery", "regroup", "--recovery-deadline",
                     "5", *SHARDED_PRELOAD, _script(job_dir, FSDP), "--steps", "8",
                     "--kill-dir", str(job_dir), "--kill", "1:3:backward", "--hang",
                     "2:3:restore", "--hang-until-restart"])
    assert launch.wait(TIMEOUT_S) == ExitCode.WORKER_FAILED, launch.output[-3000:]
    said = _said(launch, "recovery deadline passed: no step committed")
    verdict = [line for line in said if "] recovery deadline passed" in line]
    assert len(verdict) == 1, launch.output[-3000:]
    assert verdict[0].endswith("escalating: the job fails (no restart left)"), verdict
    # its own fault record, in the summary's table (path "escalate")
    assert any(" escalate " in line for line in said if line is not verdict[0]), said


def test_shrink_with_a_sharded_job_is_refused_in_one_line(job_dir: Path) -> None:
    launch = Launch(["--nproc-per-node", "2", "--recovery", "regroup", "--on-failure",
                     "shrink", *SHARDED_PRELOAD, _script(job_dir, FSDP), "--steps", "200"])
    assert launch.wait(TIMEOUT_S) == ExitCode.USAGE, launch.output[-3000:]
    said = _said(launch, "--on-failure shrink cannot be used with a sharded job")
    assert len(said) == 1, launch.output[-3000:]
    assert not _said(launch, "Traceback"), launch.output[-3000:]
