"""End to end: real ftrun, real worker processes, real gloo DDP, real signals.

Every test runs its script from a private directory (``job_dir``) and fails if any process
mentioning that directory is still alive afterwards. Signal forwarding, the restart budget
and ``kill -9`` of ftrun are checked in every ``--recovery`` mode in
tests/test_recovery_modes.py.

Latency bounds: each is about 10 times the figure measured on this 2-core machine while
other test runs shared it, so a 10x regression fails and a loaded machine passes; the
figures are beside each bound.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch import PRELOAD, REPO, Launch, copy_train_script, launcher, processes_mentioning
from tests.lines import Done, Resumed, Start, Step, find

ENV_DUMP = """
import json, os
keys = [k for k in os.environ if k.startswith(("TORCH", "FTRUN_")) or k in {names}]
print("ENV " + json.dumps({{k: os.environ[k] for k in sorted(keys)}}), flush=True)
"""
TORCHRUN_NAMES = {
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
}
VARIES = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
WITNESS = REPO / "tests" / "scripts" / "witness.py"

#: A worker's exit to the agent's failure record (pidfd: at once). Measured 0.03-0.07 s,
#: median 0.057 s (5 runs, load 6).
DETECT_BOUND_S = 0.5
#: A crash to the first step of the restarted workers (import torch, a new gloo group, the
#: checkpoint). Measured 6.0-8.9 s with 4 workers, 3.9-13.5 s with 3 (median 7.4 s, 15
#: runs, load 2-8): a 10x regression (60 s and more) fails.
RESTART_BOUND_S = 30.0
#: A SIGSTOPped worker, when the job stops: killed at once instead of after the grace
#: (60 s in the test). From the other worker's crash to the frozen one's end: 0.002-0.010 s
#: with one outlier of 0.141 s (22 runs, load 1-3, the crash tests running beside); next to
#: three training workers at load 2-8, 0.011-0.073 s, median 0.045 s (10 runs); 0.51 s in
#: one clean-clone CI run at load 6 (2026-12-02). What the bound tells apart is at once
#: against the 60 s grace: 3 s is 6x the worst figure seen and 20x under the grace.
FROZEN_KILL_BOUND_S = 3.0
#: Past the stop grace: SIGKILL, reaping, ftrun's own exit. Measured 0.47-1.13 s over a 1 s
#: grace, median 0.68 s (5 runs, load 5).
SHUTDOWN_OVER_GRACE_S = 3.0


def _env_by_rank(launch: Launch) -> dict[str, dict[str, str]]:
    # torchrun's workers share one unprefixed stdout: two dumps can land on one line.
    decoder, result = json.JSONDecoder(), {}
    for line in launch.lines:
        start = line.find("ENV {")
        while start >= 0:
            env, end = decoder.raw_decode(line, start + len("ENV "))
            result[env["RANK"]] = env
            start = line.find("ENV {", end)
    return result


@pytest.mark.parametrize(
    "flags",
    [
        ["--nproc-per-node", "2"],
        ["--standalone", "--nproc-per-node", "3", "--max-restarts", "2", "--role", "trainer"],
        ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
         "--master-port", "{port}", "--nproc-per-node", "2"],
    ],
)
def test_worker_environment_matches_torchrun(job_dir: Path, flags: list[str]) -> None:
    script = job_dir / "dump_env.py"
    script.write_text(ENV_DUMP.format(names=sorted(TORCHRUN_NAMES)))
    seen, ports = {}, {}
    for index, program in enumerate(("torchrun", "ftrun")):
        ports[program] = str(29631 + index)
        filled = [f.format(port=ports[program]) for f in flags]
        run = Launch([*filled, str(script)], program=program, cwd=job_dir)
        assert run.wait(120) == 0, run.output
        seen[program] = _env_by_rank(run)
    assert seen["torchrun"].keys() == seen["ftrun"].keys()
    for rank, theirs in seen["torchrun"].items():
        ours = {k: v for k, v in seen["ftrun"][rank].items() if not k.startswith("FTRUN_")}
        theirs = {k: v for k, v in theirs.items() if not k.startswith("FTRUN_")}  # inherited
        assert ours.keys() == theirs.keys(), (rank, ours.keys() ^ theirs.keys())
        differing = {k for k in theirs if theirs[k] != ours[k]}
        assert differing <= VARIES, {k: (theirs[k], ours[k]) for k in differing - VARIES}
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        if "--master-port" in flags:  # torchrun's one-port contract: the port given
            assert theirs["MASTER_PORT"] == ports["torchrun"] and \
                ours["MASTER_PORT"] == ports["ftrun"], (theirs, ours)
        assert seen["ftrun"][rank]["FTRUN_GENERATION"] == "0"


def test_killed_worker_restarts_resumes_from_checkpoint_and_completes(job_dir: Path) -> None:
    script = copy_train_script(job_dir)
    events = job_dir / "events.jsonl"
    run = Launch(
        # Three workers: each spawned worker imports torch, and the restart spawns them all
        # again; with four this was the suite's dearest test in CPU (53 s under CI load).
        ["--nproc-per-node", "3", "--max-restarts", "3", "--events-file", str(events),
         str(script), "--steps", "60", "--checkpoint-dir", str(job_dir),
         "--checkpoint-every", "10", "--step-sleep", "0.05"],
        cwd=job_dir,
    )
    victim = run.wait_step(25, 120, rank=2)
    first_pids = {s.pid for s in run.steps()}
    killed = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    run.wait_for(lambda lines: find(lines, Resumed), 120, "a resume")
    assert run.wait(180) == 0, run.output
    resumed = [r.step for r in find(run.lines, Resumed)]
    assert resumed and all(step >= 20 for step in resumed), resumed  # from its checkpoint
    records = [json.loads(line) for line in events.read_text().splitlines()]
    failure = next(r for r in records if r["event"] == "failure")
    assert failure["rank"] == 2 and failure["returncode"] == -signal.SIGKILL
    assert failure["pid"] == victim.pid
    assert any(r["event"] == "restart" for r in records)
    assert "generation 0 ended: rank 2 (killed by SIGKILL)" in run.output
    done = find(run.lines, Done)  # after the restart, every rank ends with one set of weights
    assert len(done) == 3 and len({d.param_sum for d in done}) == 1, run.output
    kinds = [r["event"] for r in records]  # an exit record is a worker's own end, not a kill
    assert kinds.count("spawn") == 6 and kinds.count("exit") == 3 and kinds[-1] == "done", kinds
    detected = failure["detected"] - killed
    back = min(s.t for s in run.steps() if s.pid not in first_pids) - killed
    print(f"crash to failure record {detected:.3f} s, to a step after the restart {back:.2f} s")
    assert detected < DETECT_BOUND_S, detected
    assert back < RESTART_BOUND_S, back


# fresh: the default path, which every other restart test takes (long tier); one-port is
# torchrun's failure.
@pytest.mark.parametrize("port", [pytest.param([], marks=pytest.mark.long),
                                  ["--master-port", "29681"]], ids=["fresh", "one-port"])
def test_many_consecutive_restarts_always_recover(job_dir: Path, port: list[str]) -> None:
    """The failure torchrun shows here (pytorch#135712): a restart reading stale addresses.
    Each generation has its own worker store (fresh), or, with an explicit --master-port,
    the one store at that port with every worker key of the dead generation deleted
    (one-port): either way every restart must form its group."""
    script = copy_train_script(job_dir)
    kills = 5
    run = Launch(
        [*port, "--nproc-per-node", "2", "--max-restarts", str(kills), *PRELOAD, str(script),
         "--steps", "100000", "--step-sleep", "0.02"],
        cwd=job_dir,
    )
    for restart in range(kills):
        start: Start = run.wait_for(
            lambda lines, r=restart: next(
                (s for s in find(lines, Start) if s.restart == r and s.rank == 1), None
            ),
            120,
            f"rank 1 of restart {restart}",
        )
        first = len(run.lines)
        run.wait_for(
            lambda lines, f=first: any(s.rank == 1 for s in find(lines[f:], Step)),
            120, f"a step of restart {restart}",
        )
        os.kill(start.pid, signal.SIGKILL)
    run.wait_for(
        lambda lines: any(s.restart == kills for s in find(lines, Start)), 120,
        "the last restart",
    )
    run.wait_for(lambda lines: any(s.rank == 0 for s in find(lines, Step)), 60, "progress")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM


def test_restarts_exhausted_prints_summary_with_root_cause(job_dir: Path) -> None:
    """The same error twice would also be a crash loop (--max-repeats, default 2): this test
    is about restarts running out, so the crash-loop rule is set to the third."""
    script = copy_train_script(job_dir)
    run = Launch(
        ["--nproc-per-node", "3", "--max-restarts", "1", "--max-repeats", "3", *PRELOAD,
         str(script), "--steps",
         "50", "--fail-at-step", "3", "--fail-rank", "1"],
        cwd=job_dir,
    )
    assert run.wait(180) == 1, run.output
    out = run.output
    assert "job failed" in out and "all 1 restarts used" in out
    summary = out[out.index("job failed"):]
    first_row = next(line for line in summary.splitlines() if line.lstrip().startswith("first"))
    assert " 1 " in first_row and "injected failure at step 3 on rank 1" in first_row
    assert "root cause (rank 1)" in summary and "Traceback" in summary
    agent_lines = [x for x in run.lines if not x.startswith("[rank")]
    assert not any("ftrun/" in x and "File " in x for x in agent_lines)  # no agent traceback


def test_shutdown_timeout_kills_workers_that_ignore_the_signal(job_dir: Path) -> None:
    """The workers get SIGINT first (each writes it down and runs on), then SIGKILL once the
    1 s grace has passed: not before it, and not much after."""
    grace = 1.0
    reports = job_dir / "reports"
    reports.mkdir()
    run = Launch(["--nproc-per-node", "2", "--shutdown-timeout", str(grace), str(WITNESS),
                  "--report-dir", str(reports), "--stay"], cwd=job_dir)
    started = run.wait_for(lambda lines: len(found := find(lines, Start)) == 2 and found, 60,
                           "both workers")
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(30) == 128 + signal.SIGINT, run.output
    took = time.monotonic() - sent
    got = {path.name: path.read_text() for path in reports.glob("signal.*")}
    assert got == {f"signal.rank{s.rank}.pid{s.pid}": "SIGINT" for s in started}, got
    print(f"SIGINT to ftrun's exit with a {grace} s grace: {took:.2f} s")
    assert grace <= took < grace + SHUTDOWN_OVER_GRACE_S, took


@pytest.mark.parametrize("mode", ["restart", "auto"])
def test_frozen_worker_does_not_cost_the_grace_period(job_dir: Path, mode: str) -> None:
    """A SIGSTOPped worker cannot act on SIGTERM: the witness handles it, and a stopped
    process runs no handler (an unhandled SIGTERM would kill it even stopped, which is why
    the training script would not do here). Waited for, it would cost the whole 60 s grace;
    it is killed at once. restart: when another rank's crash stops the job; auto: the
    regroup supervisor's watch sees it stopped."""
    reports = job_dir / "reports"
    reports.mkdir()
    run = Launch(["--nproc-per-node", "3", "--recovery", mode, "--max-restarts", "1",
                  "--shutdown-timeout", "60", str(WITNESS), "--report-dir", str(reports)],
                 cwd=job_dir)
    started = run.wait_for(lambda lines: len(found := find(lines, Start)) == 3 and found, 60,
                           "three workers")
    pids = {s.rank: s.pid for s in started}
    frozen = os.pidfd_open(pids[1])  # readable the moment the process ends
    try:
        os.kill(pids[1], signal.SIGSTOP)
        killed_at = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)
        # 60 s: the grace, which a frozen worker that is waited for would cost.
        ended = select.select([frozen], [], [], 60)[0]
        frozen_gone = time.monotonic() - killed_at
    finally:
        os.close(frozen)
    assert ended, "the frozen worker outlived the grace"
    run.wait_for(lambda lines: {s.rank for s in find(lines, Start) if s.restart == 1}
                 == {0, 1, 2}, 60, "the restart")
    print(f"crash to the frozen worker's end: {frozen_gone:.3f} s")
    assert frozen_gone < FROZEN_KILL_BOUND_S, frozen_gone
    assert "was frozen; killed it at once" in run.output
    assert not (reports / f"signal.rank1.pid{pids[1]}").exists(), "it was signalled, not killed"
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM, run.output


def test_log_dir_layout_redirects_and_rank_filter(job_dir: Path) -> None:
    script = job_dir / "talk.py"
    script.write_text(
        "import os, sys\nr = os.environ['LOCAL_RANK']\n"
        "print(f'out {r}', flush=True)\nprint(f'err {r}', file=sys.stderr, flush=True)\n"
    )
    logs = job_dir / "logs"
    run = Launch(
        ["--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "0:3",
         "--tee", "1:1", "--local-ranks-filter", "1", str(script)],
        cwd=job_dir,
    )
    assert run.wait(60) == 0, run.output
    (run_dir,) = logs.iterdir()
    attempt = run_dir / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text() == "out 0\n"
    assert (attempt / "0" / "stderr.log").read_text() == "err 0\n"
    assert (attempt / "1" / "stdout.log").read_text() == "out 1\n"
    assert not (attempt / "1" / "stderr.log").exists()
    assert "[rank1]: out 1" in run.output and "[rank1]: err 1" in run.output
    assert "out 0" not in run.output and "err 0" not in run.output
    assert (run_dir / "events.jsonl").exists()


_STORE_HOST_DIES = """
import datetime, sys
import torch.distributed as dist
host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", host.port, is_master=False,
                       timeout=datetime.timedelta(seconds=5))
client.set("a", "1")
del host  # the store's host is gone: torch logs the failed request with its C++ backtrace
try:
    client.add("b", 1)
except Exception as error:
    print(f"store request failed: {type(error).__name__}", file=sys.stderr, flush=True)
print("after the backtrace", file=sys.stderr, flush=True)
"""


def test_torch_cpp_backtraces_collapse_to_one_console_line(job_dir: Path) -> None:
    """A worker whose store's host died: torch logs the failed request with a C++
    backtrace of twenty-odd frames, which the console shows as one line (the warning
    itself and the worker's next lines stay); ``--log-dir`` keeps the backtrace whole, and
    ``FTRUN_CPP_BACKTRACES=1`` prints it."""
    script = job_dir / "store_dies.py"
    script.write_text(_STORE_HOST_DIES)
    logs = job_dir / "logs"
    run = Launch(["--nproc-per-node", "1", "--log-dir", str(logs), "--tee", "3", str(script)],
                 cwd=job_dir)
    assert run.wait(60) == 0, run.output
    shown = [line for line in run.lines if line.startswith("[rank0]:")]
    assert any("sendBytes failed" in line or "recvValue failed" in line for line in shown), \
        run.output
    collapsed = [line for line in shown if "C++ backtrace from" in line]
    assert collapsed and "FTRUN_CPP_BACKTRACES=1" in collapsed[0], run.output
    assert not any("frame #" in line or "Exception raised from" in line for line in shown), \
        run.output
    assert "[rank0]: store request failed" in run.output
    assert "[rank0]: after the backtrace" in run.output
    (stderr_log,) = logs.glob("*/attempt_0/0/stderr.log")
    kept = stderr_log.read_text()
    assert "Exception raised from" in kept and kept.count("frame #") >= 5, kept[-2000:]
    assert "C++ backtrace from" not in kept
    whole = Launch(["--nproc-per-node", "1", str(script)], cwd=job_dir,
                   env={"FTRUN_CPP_BACKTRACES": "1"})
    assert whole.wait(60) == 0, whole.output
    assert "[rank0]: Exception raised from" in whole.output
    assert "C++ backtrace from" not in whole.output


def test_static_multi_node_on_localhost_restarts_both_nodes(job_dir: Path) -> None:
    script = copy_train_script(job_dir)
    port = 29651
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--max-restarts", "1", *PRELOAD]
    train = [str(script), "--steps", "40", "--step-sleep", "0.03"]
    nodes = [
        Launch([*common, "--node-rank", str(rank), *train], cwd=job_dir) for rank in (0, 1)
    ]
    victim = nodes[1].wait_step(10, 120, rank=3)
    os.kill(victim.pid, signal.SIGKILL)
    for node in nodes:
        assert node.wait(180) == 0, node.output
    # node 0 restarted because of node 1
    assert any(s.restart == 1 for s in find(nodes[0].lines, Start))
    assert "ended by node 1" in nodes[0].output
    sums = {d.param_sum for n in nodes for d in find(n.lines, Done)}
    assert len(sums) == 1


def test_script_entry_with_module_and_no_python(job_dir: Path) -> None:
    result = subprocess.run(
        [launcher(), "--nproc-per-node", "2", "--no-python", "sh", "-c", "echo rank=$RANK"],
        capture_output=True, text=True, timeout=60, cwd=job_dir,
    )
    assert result.returncode == 0, result.stderr
    assert "[rank0]: rank=0" in result.stdout and "[rank1]: rank=1" in result.stdout
    module = subprocess.run(
        [launcher(), "-m", "platform"], capture_output=True, text=True, timeout=60
    )
    assert module.returncode == 0 and "[rank0]: Linux" in module.stdout


def test_no_zombies_or_children_after_success(job_dir: Path) -> None:
    script = job_dir / "spawner.py"
    script.write_text(
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{job_dir}'])\n"
        "print('spawned', flush=True)\n"
    )
    run = Launch(["--nproc-per-node", "2", str(script)], cwd=job_dir)
    assert run.wait(60) == 0, run.output
    # The grandchildren that the workers left behind are gone with the job.
    deadline = time.monotonic() + 5
    while processes_mentioning(str(job_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in processes_mentioning(str(job_dir)) if p.status() != "zombie"] == []


def test_cause_without_record_is_the_scripts_own_last_error(job_dir: Path) -> None:
    """torchrun prints <N/A> for a script without @record; ftrun reads the failed rank's own
    last traceback line from its stderr (the exception, not a chained one's first)."""
    script = job_dir / "raiser.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['RANK'] == '1':\n"
        "    try:\n        {}['missing']\n"
        "    except KeyError as e:\n        raise ValueError('boom on rank 1') from e\n"
        "print('fine', file=sys.stderr)\n"
    )
    run = Launch(["--nproc-per-node", "2", str(script)], cwd=job_dir)
    assert run.wait(60) == 1, run.output
    first = next(line for line in run.lines if line.lstrip().startswith("first"))
    assert "exit code 1: ValueError: boom on rank 1" in first, run.output
