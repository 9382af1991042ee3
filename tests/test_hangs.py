"""Hangs of scripts written for torchrun (no ``import ftrun``): found in seconds, named,
restarted; and what must not count as a hang.

End to end, an unmodified DDP script (scripts/train_ddp.py) under ``--recovery restart``
(the restart supervisor) and the default ``auto`` (the regroup supervisor's restart
fallback): one rank sleeps forever while its peer blocks in DDP's backward. torchrun waits
for the collective timeout (10 minutes by default). The rules themselves
(:class:`ftrun.agent.hangs.HangWatch`) are tested on real idle and busy processes with
stacks the test supplies.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftrun.agent.hangs import (
    HANG_FLOOR_S,
    HangWatch,
    JobHang,
    NodeView,
    WorkerView,
    judge_job,
    tree_cpu,
)
from ftrun.agent.ncclprogress import NcclProgress
from ftrun.agent.stacks import Frame, Stack, read_stack, stack_from_fault_dump, stack_source
from ftrun.control.errors import StoreValueError
from tests.launch import PRELOAD, REPO, Launch, copy_train_script, free_port
from tests.lines import Start, find

TORCH = "/venv/lib/python3.11/site-packages/torch"


# --- end to end ---------------------------------------------------------------------------

@pytest.mark.parametrize(("recovery", "stacks"), [("restart", "py-spy"), ("auto", "faulthandler")])
def test_a_hung_rank_is_named_and_the_job_restarts_in_seconds(
    job_dir: Path, recovery: str, stacks: str
) -> None:
    """faulthandler: as on a host where py-spy cannot attach (Yama ptrace_scope 1, no
    CAP_SYS_PTRACE): the hang is decided without stacks, and named from the dumps Python's
    fault handler writes when the agent aborts the workers."""
    script = copy_train_script(job_dir)
    run = Launch(
        [*PRELOAD, "--nproc-per-node", "2", "--recovery", recovery, "--max-restarts", "1",
         str(script), "--steps", "60", "--step-sleep", "0.02", "--fail-at-step", "20",
         "--fail-rank", "1", "--fail-mode", "hang", "--fail-once-marker",
         str(job_dir / "hung-once")],
        cwd=job_dir, env={"FTRUN_STACKS": stacks},
    )
    hung = run.wait_for(lambda lines: next((x for x in lines if "hanging at step" in x), None),
                        120, "the hang")
    hung_at = time.monotonic()
    victim = hung.split("pid=")[1].split()[0]
    run.wait_for(lambda lines: any(s.restart == 1 for s in find(lines, Start)), 90,
                 "the restart")
    restarted_s = time.monotonic() - hung_at
    print(f"hang to restarted workers: {restarted_s:.1f}s ({recovery})")
    assert run.wait(120) == 0, run.output
    out = run.output
    assert f"rank 1 (pid {victim}) stuck in train_ddp.py:" in out, out
    assert "rank 0 waiting in backward (train_ddp.py:" in out, out
    assert "stack (most recent call last)" in out
    assert "restarting (1/1)" in out
    if stacks == "faulthandler":
        assert "Fatal Python error: Aborted" in out  # the dumps the names came from
    # the fault began when the last worker went quiet, at least a timeout before the verdict
    detected = re.search(r"every worker restarted in [\d.]+ s \(generation 1\) "
                         r"\(detected in ([\d.]+) s", " ".join(out.split()))  # lines wrap
    assert detected and float(detected[1]) >= HANG_FLOOR_S, out
    # The floor is 3 s (three of it without stacks) and a restart ~5 s here; torchrun needs
    # the 10-minute timeout.
    assert restarted_s < 60, f"hang to restart took {restarted_s:.1f}s"


def test_a_hang_across_nodes_is_named_with_its_node_from_every_nodes_view(
    job_dir: Path,
) -> None:
    """Two nodes (two agents on this host), one worker each: rank 1 sleeps in its own code
    while rank 0 waits for it in DDP's backward. Neither node can judge alone (node 1 sees
    only an idle rank, node 0 only a waiting one); node 0 judges both nodes' views."""
    script = copy_train_script(job_dir)
    common = [*PRELOAD, "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()), "--recovery", "restart", "--max-restarts", "1"]
    train = [str(script), "--steps", "40", "--step-sleep", "0.02", "--fail-at-step", "15",
             "--fail-rank", "1", "--fail-mode", "hang", "--fail-once-marker",
             str(job_dir / "hung-once")]
    nodes = [Launch([*common, "--node-rank", str(rank), *train], cwd=job_dir)
             for rank in (0, 1)]
    hung = nodes[1].wait_for(lambda lines: next((x for x in lines if "hanging at step" in x),
                                                None), 120, "the hang")
    hung_at = time.monotonic()
    victim = hung.split("pid=")[1].split()[0]
    nodes[0].wait_for(lambda lines: any(s.restart == 1 for s in find(lines, Start)), 90,
                      "the restart")
    restarted_s = time.monotonic() - hung_at
    print(f"hang to restarted workers across two nodes: {restarted_s:.1f}s")
    for node in nodes:
        assert node.wait(120) == 0, node.output
    leader = nodes[0].output
    assert f"rank 1 (node vm, pid {victim}) stuck in train_ddp.py:" in leader.replace(
        f"node {os.uname().nodename},", "node vm,"), leader
    assert "rank 0 waiting in backward (train_ddp.py:" in leader, leader
    assert "(node" in leader and "stack (most recent call last)" in leader
    assert "stuck in train_ddp.py:" in nodes[1].output  # the culprit's node is told why
    assert restarted_s < 60, f"hang to restart took {restarted_s:.1f}s"


# Long tier: the hung-rank tests above name the culprit the same way, and
# test_launcher.py::test_restarts_exhausted_prints_summary_with_root_cause the summary.
@pytest.mark.long
def test_a_hang_with_no_restart_left_names_the_culprit_in_the_summary(job_dir: Path) -> None:
    script = copy_train_script(job_dir)
    run = Launch(
        [*PRELOAD, "--nproc-per-node", "2", "--recovery", "restart", str(script),
         "--steps", "100000", "--step-sleep", "0.02", "--fail-at-step", "10", "--fail-rank", "0",
         "--fail-mode", "hang"],
        cwd=job_dir,
    )
    assert run.wait(120) == 1, run.output
    assert "hung: rank 0 (pid" in run.output and "stuck in train_ddp.py:" in run.output


def test_every_rank_inside_communication_is_a_hang_after_three_timeouts(job_dir: Path) -> None:
    """Rank 1 waits inside a receive no peer sends, rank 0 for it in DDP's all-reduce: both
    inside torch's communication, and gloo has no per-communicator counts to say who is
    behind, so nobody is named: a hang after three timeouts, and the job restarts."""
    script = copy_train_script(job_dir)
    run = Launch(
        [*PRELOAD, "--nproc-per-node", "2", "--recovery", "restart", "--max-restarts", "1",
         "--hang-timeout", "1", str(script), "--steps", "25", "--step-sleep", "0.02",
         "--fail-at-step", "10", "--fail-rank", "1", "--fail-mode", "block",
         "--fail-once-marker", str(job_dir / "blocked-once")],
        cwd=job_dir,
    )
    run.wait_for(lambda lines: any("blocking at step" in x for x in lines), 120, "the block")
    blocked_at = time.monotonic()
    run.wait_for(lambda lines: any(s.restart == 1 for s in find(lines, Start)), 90,
                 "the restart")
    restarted_s = time.monotonic() - blocked_at
    assert run.wait(120) == 0, run.output
    out = " ".join(run.output.split())  # the console wraps long lines
    verdict = re.search(r"rank 0 waiting in backward \(train_ddp.py:\d+ main\); rank 1 "
                        r"waiting in recv \(train_ddp.py:\d+ main\); no CPU progress for "
                        r"([\d.]+) s", out)
    assert verdict and float(verdict[1]) >= 3.0, out  # three timeouts: nobody to name
    assert "stuck in" not in out and "restarting (1/1)" in out, out
    assert restarted_s < 60, f"block to restart took {restarted_s:.1f}s"  # torch: 30 min


def test_a_slow_step_is_not_a_hang(job_dir: Path) -> None:
    """Every rank sleeps three hang timeouts in one step: nobody waits for anybody. Later
    rank 0 awaits a reply over a socket for two timeouts while rank 1 waits for it in the
    all-reduce: a late remote read, given three timeouts, so not a hang either."""
    script = copy_train_script(job_dir)
    run = Launch(
        [*PRELOAD, "--nproc-per-node", "2", "--recovery", "restart", "--hang-timeout", "2",
         str(script), "--steps", "45", "--slow-step-at", "10", "--slow-step-s", "6",
         "--net-wait-at", "40", "--net-wait-s", "4"],  # 30 steps apart: two spells
        cwd=job_dir,
    )
    assert run.wait(120) == 0, run.output
    assert "stuck" not in run.output and "restarting" not in run.output


def test_a_long_checkpoint_write_is_not_a_hang(job_dir: Path) -> None:
    """Rank 0 writes (and fsyncs) for three hang timeouts while rank 1 waits for it in the
    next collective: the writer's CPU and I/O count as work."""
    script = copy_train_script(job_dir)
    run = Launch(
        [*PRELOAD, "--nproc-per-node", "2", "--recovery", "restart", "--hang-timeout", "2",
         str(script), "--steps", "20", "--write-at", "10", "--write-s", "6",
         "--write-dir", str(job_dir)],
        cwd=job_dir,
    )
    assert run.wait(120) == 0, run.output
    assert "stuck" not in run.output and "restarting" not in run.output


def test_a_frozen_worker_restarts_the_job_at_once(job_dir: Path) -> None:
    script = copy_train_script(job_dir)
    run = Launch(
        [*PRELOAD, "--nproc-per-node", "2", "--recovery", "restart", "--max-restarts", "1",
         "--shutdown-timeout", "60", str(script), "--steps", "100000", "--step-sleep", "0.02"],
        cwd=job_dir,
    )
    victim = run.wait_step(5, 120, rank=1)
    os.kill(victim.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    run.wait_for(lambda lines: any(s.restart == 1 for s in find(lines, Start)), 60,
                 "the restart")
    waited = time.monotonic() - stopped_at
    print(f"SIGSTOP to restarted workers: {waited:.1f}s")
    assert f"rank 1 (pid {victim.pid}) frozen" in run.output
    assert waited < 30  # detection within a sample (0.5 s); far inside the 60 s grace
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM


# --- the rules, on real processes ---------------------------------------------------------

@dataclass
class Proc:
    """What HangWatch reads of a worker, backed by a real process."""

    popen: subprocess.Popen[bytes]
    rank: int
    shim: None = None  # no NCCL here

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def is_frozen(self) -> bool:
        return False


@pytest.fixture
def procs() -> Iterator[dict[str, Proc]]:
    idle = "import time; time.sleep(600)"
    busy = "while True: pass"
    made = {
        "idle0": Proc(subprocess.Popen([sys.executable, "-c", idle]), 0),
        "idle1": Proc(subprocess.Popen([sys.executable, "-c", idle]), 1),
        "busy": Proc(subprocess.Popen([sys.executable, "-c", busy]), 2),
    }
    yield made
    for proc in made.values():
        proc.popen.kill()
        proc.popen.wait(10)


def waiting_stack(pid: int) -> Stack:
    return Stack(pid, (Frame("all_reduce", f"{TORCH}/distributed/distributed_c10d.py",
                             "torch/distributed/distributed_c10d.py", 3252),
                       Frame("main", "/job/train.py", "train.py", 88)))


def user_stack(pid: int) -> Stack:
    return Stack(pid, (Frame("main", "/job/train.py", "train.py", 95),))


def network_stack(pid: int) -> Stack:
    """A remote read in a script whose main is under torch's elastic ``record`` decorator
    (its file is in torch/distributed/elastic/multiprocessing/: not a local pipe)."""
    return Stack(pid, (Frame("readinto", "/usr/lib/python3.11/socket.py", "socket.py", 707),
                       Frame("main", "/job/train.py", "train.py", 95),
                       Frame("wrapper", f"{TORCH}/distributed/elastic/multiprocessing/errors/"
                             "__init__.py", "torch/distributed/elastic/multiprocessing/"
                             "errors/__init__.py", 367)))


def forming_stack(pid: int) -> Stack:
    return Stack(pid, (Frame("_store_based_barrier", f"{TORCH}/distributed/c10d.py", "c", 1),
                       Frame("init_process_group", f"{TORCH}/distributed/c10d.py", "c", 2),
                       Frame("main", "/job/train.py", "train.py", 20)))


def run_watch(watch: HangWatch, group: list[Proc], seconds: float) -> object:
    """Sample like the supervisor does (real time: CPU is measured), until a verdict."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        verdict = watch.sample(group)  # type: ignore[arg-type]
        if verdict is not None:
            return verdict
        time.sleep(min(watch.due_in(), 0.5) + 0.01)
    return None


def test_idle_ranks_waiting_on_one_elsewhere_name_it(procs: dict[str, Proc]) -> None:
    stacks = {procs["idle0"].pid: waiting_stack, procs["idle1"].pid: user_stack}
    watch = HangWatch(timeout_s=1.0, multi_node=False,
                      stack_of=lambda pid: stacks[pid](pid))
    hang = run_watch(watch, [procs["idle0"], procs["idle1"]], 10)
    assert hang is not None and hang.kind == "hung"  # type: ignore[attr-defined]
    assert [w.rank for w in hang.culprits] == [1]  # type: ignore[attr-defined]
    assert [w.rank for w in hang.waiting] == [0]  # type: ignore[attr-defined]
    assert "rank 1" in hang.describe() and "stuck in train.py:95 main" in hang.describe()


def test_a_verdict_set_aside_is_looked_at_again_when_its_reason_lapses(
    procs: dict[str, Proc]
) -> None:
    """The worker API's rule sets a verdict aside while the culprit's status moved within a
    timeout (the agent reads statuses a beat late); the watch must look again when that
    lapses, not a timeout after the look it was given (hangs were named after 4.2 s, not
    2.1 s, in one soak run in two)."""
    stacks = {procs["idle0"].pid: waiting_stack, procs["idle1"].pid: user_stack}
    watch = HangWatch(timeout_s=2.0, multi_node=False,
                      stack_of=lambda pid: stacks[pid](pid))
    group = [procs["idle0"], procs["idle1"]]
    assert run_watch(watch, group, 12) is not None
    watch.look_again_at(time.monotonic() + 0.3)
    started = time.monotonic()
    again = run_watch(watch, group, 1.5)
    assert again is not None, "the verdict set aside was not looked at again within 1.5 s"
    assert time.monotonic() - started >= 0.25
    assert [w.rank for w in again.culprits] == [1]  # type: ignore[attr-defined]


def test_a_rank_awaiting_the_network_is_named_only_after_three_timeouts(
    procs: dict[str, Proc]
) -> None:
    """A rank idle in Python's network I/O (a read from object storage) while its peer waits
    for it: a late reply is likelier than none, so the culprit is named after three
    timeouts, not one."""
    stacks = {procs["idle0"].pid: waiting_stack, procs["idle1"].pid: network_stack}
    watch = HangWatch(timeout_s=1.0, multi_node=False, stack_of=lambda pid: stacks[pid](pid))
    hang = run_watch(watch, [procs["idle0"], procs["idle1"]], 15)
    assert hang is not None
    assert [w.rank for w in hang.culprits] == [1]  # type: ignore[attr-defined]
    assert hang.idle_s >= 3.0  # type: ignore[attr-defined]
    assert (f"rank 1 (pid {procs['idle1'].pid}) stuck awaiting the network in "
            "socket.py:707 readinto (train.py:95 main)") in hang.describe(), hang.describe()


def test_a_late_reply_neither_grows_the_timeout_nor_skips_the_rule_under_nccl(
    procs: dict[str, Proc]
) -> None:
    """The three timeouts hold when the NCCL counts name the late rank too (a rank reading
    from object storage is behind its peers by a collective); and a spell given them does
    not grow the auto timeout when it ends (the allowance already covers late replies)."""
    late, ahead = procs["idle1"], procs["idle0"]
    stacks = {late.pid: network_stack, ahead.pid: user_stack}
    counts = {late.pid: issued(5), ahead.pid: issued(6)}
    watch = HangWatch(timeout_s=1.0, multi_node=False, stack_of=lambda pid: stacks[pid](pid),
                      progress_of=lambda w: counts[w.pid])
    hang = run_watch(watch, [ahead, late], 15)
    assert hang is not None
    assert [w.rank for w in hang.culprits] == [1]  # type: ignore[attr-defined]
    assert hang.idle_s >= 3.0  # type: ignore[attr-defined]
    auto = HangWatch(timeout_s=None, multi_node=False, stack_of=lambda pid: stacks[pid](pid),
                     progress_of=lambda w: counts[w.pid])
    group = [ahead, late]
    deadline = time.monotonic() + 15
    while not auto.spell_awaited_network:  # the rule deferred a verdict once
        assert time.monotonic() < deadline, "no deferral for a late reply"
        assert auto.sample(group) is None  # type: ignore[arg-type]
        time.sleep(auto.due_in() + 0.01)
    auto.spell_s, auto.activity[late.pid].busy_at = 10.0, time.monotonic()  # the reply came
    auto.next_sample = 0.0
    auto.sample(group)  # type: ignore[arg-type]
    assert auto.timeout_s == HANG_FLOOR_S and not auto.spell_awaited_network


def test_py_spy_tells_a_remote_read_from_a_local_pipe() -> None:
    """Real stacks: a read through socket.py awaits the network; a data loader's queue
    (multiprocessing selects on a pipe) and a child's output (subprocess) do not."""
    if stack_source() != "py-spy":
        pytest.skip("py-spy cannot attach to a sibling process here (no ptrace)")
    waits = {
        "socket": "import socket; a, b = socket.socketpair(); print('ready', flush=True); "
                  "a.makefile('rb').read(1)",
        "queue": "import multiprocessing as mp; q = mp.Queue(); print('ready', flush=True); "
                 "q.get(timeout=600)",
        "child": "import subprocess, sys; print('ready', flush=True); subprocess.Popen("
                 "[sys.executable, '-c', 'import time; time.sleep(600)'], stdout=subprocess."
                 "PIPE, stderr=subprocess.PIPE).communicate(timeout=600)",
    }
    procs = {name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                    text=True, start_new_session=True)
             for name, code in waits.items()}
    try:
        found = {}
        for name, proc in procs.items():
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            deadline = time.monotonic() + 20
            while (stack := read_stack(proc.pid)) is None or \
                    stack.frames[0].function == "<module>":
                assert time.monotonic() < deadline, f"{name}: never seen waiting: {stack}"
                time.sleep(0.1)
            found[name] = stack
        assert found["socket"].awaits_network, found["socket"].text()
        assert not found["queue"].awaits_network, found["queue"].text()
        assert not found["child"].awaits_network, found["child"].text()
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_a_busy_rank_means_no_hang(procs: dict[str, Proc]) -> None:
    watch = HangWatch(timeout_s=1.0, multi_node=False, stack_of=waiting_stack)
    assert run_watch(watch, [procs["idle0"], procs["busy"]], 4) is None


def test_a_rank_on_the_run_queue_counts_as_working(procs: dict[str, Proc]) -> None:
    """A loaded host may give a working rank too little CPU in a sample to count; it is
    still on the run queue, which the watch reads too. A rank asleep is not."""
    deadline = time.monotonic() + 10
    while not tree_cpu(procs["busy"].pid)[2]:
        assert time.monotonic() < deadline, "a busy loop never seen running"
        time.sleep(0.05)
    while any(tree_cpu(procs["idle0"].pid)[1:]):  # still starting its interpreter
        assert time.monotonic() < deadline, "a sleeping process seen running"
        time.sleep(0.05)


def test_a_verdict_needs_two_looks_that_agree(procs: dict[str, Proc]) -> None:
    """Rank 1 is read in its own code, then in a collective, then in its code again (a
    slow step ending: it wakes while rank 0 already waits): no look is confirmed, no hang."""
    looks = {procs["idle1"].pid: 0}

    def stack_of(pid: int) -> Stack:
        if pid not in looks:
            return waiting_stack(pid)
        looks[pid] += 1
        return user_stack(pid) if looks[pid] % 2 else waiting_stack(pid)

    watch = HangWatch(timeout_s=0.5, multi_node=False, stack_of=stack_of)
    assert run_watch(watch, [procs["idle0"], procs["idle1"]], 3) is None
    assert looks[procs["idle1"].pid] >= 3  # it did look, every sample once the spell began


def test_nobody_waiting_is_a_slow_step_and_the_timeout_grows(procs: dict[str, Proc]) -> None:
    watch = HangWatch(timeout_s=None, multi_node=False, stack_of=user_stack)
    assert watch.timeout_s == HANG_FLOOR_S
    watch.longest_spell_s = 9.0  # what an ended slow spell leaves behind
    assert watch.timeout_s == 18.0
    fixed = HangWatch(timeout_s=1.0, multi_node=False, stack_of=user_stack)
    assert run_watch(fixed, [procs["idle0"], procs["idle1"]], 4) is None


def test_everyone_waiting_is_a_hang_only_on_one_node_and_only_later(
    procs: dict[str, Proc]
) -> None:
    group = [procs["idle0"], procs["idle1"]]
    multi = HangWatch(timeout_s=0.5, multi_node=True, stack_of=waiting_stack)
    assert run_watch(multi, group, 3) is None  # the culprit's own node names it
    single = HangWatch(timeout_s=0.5, multi_node=False, stack_of=waiting_stack)
    started = time.monotonic()
    hang = run_watch(single, group, 10)
    assert hang is not None and not hang.culprits  # type: ignore[attr-defined]
    assert time.monotonic() - started >= 1.5  # three timeouts: nobody to name


def test_ranks_forming_their_group_are_left_to_torch(procs: dict[str, Proc]) -> None:
    stacks = {procs["idle0"].pid: forming_stack, procs["idle1"].pid: user_stack}
    watch = HangWatch(timeout_s=0.5, multi_node=False, stack_of=lambda pid: stacks[pid](pid))
    assert run_watch(watch, [procs["idle0"], procs["idle1"]], 3) is None


def test_unreadable_stacks_decide_only_after_three_timeouts(procs: dict[str, Proc]) -> None:
    watch = HangWatch(timeout_s=0.5, multi_node=False, stack_of=lambda pid: None)
    started = time.monotonic()
    hang = run_watch(watch, [procs["idle0"], procs["idle1"]], 10)
    assert hang is not None and not hang.culprits  # type: ignore[attr-defined]
    assert time.monotonic() - started >= 1.5


def test_a_rank_blocked_inside_nccl_waits_for_the_one_that_stopped_calling(
    job_dir: Path
) -> None:
    """The NCCL shim says which worker is inside which NCCL call: rank 0 waits in
    ncclAllReduce for rank 1, which sleeps in its own code; rank 1 is named, and the shim's
    abort releases rank 0 before the restart (CPU: the shim's NCCL test double)."""
    script = job_dir / "nccl_hang.py"
    script.write_text((REPO / "tests" / "scripts" / "nccl_hang.py").read_text())
    run = Launch(["--nproc-per-node", "2", "--recovery", "restart", "--max-restarts", "1",
                  str(script)], cwd=job_dir, env={"FTRUN_SHIM": "1"})
    assert run.wait(120) == 0, run.output
    out = run.output
    assert "stuck in nccl_hang.py:" in out and "rank 1 (pid" in out, out
    assert "rank 0 waiting in ncclAllReduce #" in out, out
    assert "released code=" in out and "released code=0" not in out  # freed by the abort
    assert "finished rank=0 attempt=1" in out and "finished rank=1 attempt=1" in out


# --- NCCL progress: the shim's per-communicator collective counts ---------------------------

COMM = 0x5EED


def issued(collectives: int, inside: str | None = None) -> NcclProgress:
    """A worker that issued ``collectives`` all-reduces on communicator COMM."""
    return NcclProgress({COMM: collectives}, {COMM: "ncclAllReduce"}, collectives, inside)


def progress_watch(progress: dict[int, NcclProgress], timeout_s: float = 0.5) -> HangWatch:
    return HangWatch(timeout_s=timeout_s, multi_node=False, stack_of=user_stack,
                     progress_of=lambda worker: progress.get(worker.pid))


def test_a_rank_behind_its_peers_in_nccl_is_named_whatever_the_stacks_say(
    procs: dict[str, Proc]
) -> None:
    """Every stack reads 'own code' (the peer waits in a CUDA sync, not in torch's
    communication), and the peer even spins (CPU busy, no NCCL call): the collective counts
    alone name the rank that did not issue collective #6."""
    late, spinning = procs["idle1"], procs["busy"]
    watch = progress_watch({late.pid: issued(5), spinning.pid: issued(6)})
    hang = run_watch(watch, [spinning, late], 10)
    assert hang is not None and [w.rank for w in hang.culprits] == [1]  # type: ignore[attr-defined]
    assert [w.rank for w in hang.waiting] == [2]  # type: ignore[attr-defined]
    text = hang.describe()  # type: ignore[attr-defined]
    assert "rank 1 (pid" in text and "behind on collective #6 (issued 5)" in text, text
    assert "rank 2 waiting in ncclAllReduce #6" in text, text


def test_a_late_rank_that_computes_is_not_a_hang(procs: dict[str, Proc]) -> None:
    """Rank 0 evaluates alone (CPU busy, no NCCL call) while its peer already waits in the
    next collective: slow, not hung; and ranks that compute with nobody behind are not
    hung either."""
    computing, waiting = procs["busy"], procs["idle0"]
    assert run_watch(progress_watch({computing.pid: issued(5), waiting.pid: issued(6)}),
                     [computing, waiting], 3) is None
    assert run_watch(progress_watch({computing.pid: issued(6), waiting.pid: issued(6)}),
                     [computing, waiting], 3) is None


def test_every_rank_inside_one_collective_is_a_hang_after_one_timeout(
    procs: dict[str, Proc]
) -> None:
    """Both ranks' threads are inside ncclAllReduce #7 (a network fault): a hang after one
    timeout, named by the call; with gloo-only stacks the same takes three timeouts."""
    group = [procs["idle0"], procs["idle1"]]
    inside = issued(7, inside="ncclAllReduce #7")
    watch = progress_watch({p.pid: inside for p in group}, timeout_s=2.0)
    hang = run_watch(watch, group, 20)
    assert hang is not None and not hang.culprits  # type: ignore[attr-defined]
    assert hang.idle_s < 6.0  # type: ignore[attr-defined]  # decided before three timeouts
    assert "ranks 0,1 waiting in ncclAllReduce #7" in hang.describe()  # type: ignore[attr-defined]


def test_a_rank_behind_in_nccl_is_named_from_the_shims_counts_and_an_evaluation_is_not(
    job_dir: Path
) -> None:
    """Separate worker processes share NCCL cliques (the test double's shared mode); the
    waiting rank spins in a stream synchronisation in its own code, as on a GPU. First
    attempt: rank 1 stops issuing collectives; the shim's counts name it, and the job
    restarts in seconds. Restarted attempt: rank 0 computes alone for more than two hang
    timeouts while rank 1 waits in the next collective: no second fault."""
    script = job_dir / "nccl_behind.py"
    script.write_text((REPO / "tests" / "scripts" / "nccl_behind.py").read_text())
    run = Launch(["--nproc-per-node", "2", "--recovery", "restart", "--max-restarts", "1",
                  "--hang-timeout", "1.5", str(script), "--eval-s", "4"], cwd=job_dir,
                 env={"FTRUN_SHIM": "1"})
    hung_pid = run.wait_for(lambda lines: next((int(m[1]) for x in lines if (
        m := re.search(r"hanging rank=1 pid=(\d+)", x))), None), 120, "rank 1 hanging")
    hung_at = time.monotonic()
    run.wait_for(lambda lines: any("start rank=0 attempt=1" in x for x in lines), 60,
                 "the restart")
    restarted_s = time.monotonic() - hung_at
    assert run.wait(120) == 0, run.output
    out = run.output
    print(f"rank 1 hanging to the restart: {restarted_s:.1f}s")
    assert re.search(rf"rank 1 \(pid {hung_pid}\) stuck in nccl_behind.py:\d+ main, "
                     r"behind on collective #5 \(issued 4\); rank 0 waiting in "
                     r"ncclAllReduce #5", out), out
    # 1.5 s timeout + two looks; 10x that fails (torch's own timeout would be minutes)
    assert restarted_s < 30, out
    assert "evaluating rank=0" in out and out.count("restarting (1/1)") == 1, out
    assert "finished rank=0 attempt=1" in out and "finished rank=1 attempt=1" in out, out
    assert re.search(r"wall [\d.]+ s, .*, 1 fault\b", out), out
    # the record counts from the moment the last worker went quiet, and names rank 1 once
    detected = re.search(r"every worker restarted in [\d.]+ s \(generation 1\) "
                         r"\(detected in ([\d.]+) s", " ".join(out.split()))  # lines wrap
    assert detected and float(detected[1]) >= 1.5 and "rank 1 rank 1" not in out, out


def test_a_fault_handler_dump_gives_the_main_threads_stack(tmp_path: Path) -> None:
    """A real interpreter with PYTHONFAULTHANDLER=1, a second thread, aborted: the stack
    read from its stderr is the main thread's, innermost first; lines without a dump give
    none."""
    script = tmp_path / "train.py"
    script.write_text(
        "import threading, time\n"
        "def idle():\n    time.sleep(600)\n"
        "def main():\n"
        "    threading.Thread(target=idle, daemon=True).start()\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n"
        "main()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait(10)
    lines = [f"[rank3]: {line}" for line in err.splitlines()]  # as torch prefixes them
    stack = stack_from_fault_dump(proc.pid, lines)
    assert stack is not None, err
    assert [(f.short, f.function) for f in stack.frames] == [
        ("train.py", "main"), ("train.py", "<module>")]
    assert stack.where.startswith("in train.py:") and stack.where.endswith(" main")
    assert stack_from_fault_dump(proc.pid, ["Traceback (most recent call last):"]) is None


# --- the whole job's verdict from every node's view ----------------------------------------

def _view(node_rank: int, idle_since: float, *workers: tuple[int, str]) -> dict:
    """A node's view; the state "network" is "own", awaiting another host's reply."""
    return NodeView(node_rank, f"n{node_rank}", idle_since, 100.0, False, tuple(
        WorkerView(rank, 1000 + rank, "own" if state == "network" else state, f"where {rank}",
                   "stack" if state in ("own", "network") else "", network=state == "network")
        for rank, state in workers)).to_json()


def test_job_verdict_from_node_views_follows_the_single_node_rules() -> None:
    def judge(*records: dict, now: float = 100.0, timeout: float = 5.0) -> JobHang | None:
        return judge_job([NodeView.from_json(r) for r in records], 2, timeout, now)

    culprit = judge(_view(0, 90.0, (0, "waiting")), _view(1, 91.0, (1, "own")))
    assert culprit is not None and [(w.rank, n) for w, n in culprit.culprits] == [(1, "n1")]
    assert "rank 1 (node n1, pid 1001) stuck where 1" in culprit.describe()
    assert judge(_view(0, 90.0, (0, "waiting"))) is None  # a node has no view yet
    assert judge(_view(0, 90.0, (0, "waiting")), _view(1, 97.0, (1, "own"))) is None  # 3 s
    assert judge(_view(0, 90.0, (0, "own")), _view(1, 90.0, (1, "own"))) is None  # slow step
    remote = (_view(0, 90.0, (0, "waiting")), _view(1, 90.0, (1, "network")))
    assert judge(*remote) is None  # a culprit awaiting the network: three timeouts
    late_reply = judge(*remote, timeout=3.0)
    assert late_reply is not None and [w.rank for w, _ in late_reply.culprits] == [1]
    older = _view(1, 90.0, (1, "own"))
    del older["workers"][0]["network"]  # an agent from before the flag: not a network wait
    assert judge(_view(0, 90.0, (0, "waiting")), older) is not None
    forged = _view(1, 90.0, (1, "network"))
    forged["workers"][0]["network"] = "yes"
    with pytest.raises(StoreValueError):
        NodeView.from_json(forged)
    waiting = (_view(0, 90.0, (0, "waiting")), _view(1, 90.0, (1, "waiting")))
    assert judge(*waiting) is None  # all waiting: only after three timeouts
    assert judge(*waiting, now=109.0) is None  # views older than 1.5 timeouts + 1 s: stale
    assert judge(*waiting, timeout=3.0) is not None  # 10 s idle >= 3 x 3 s
    unknown = (_view(0, 90.0, (0, "waiting")), _view(1, 90.0, (1, "unknown")))
    assert judge(*unknown) is None
    unnamed = judge(*unknown, timeout=3.0)
    assert unnamed is not None and unnamed.culprits == ()
    bad = _view(1, 90.0, (1, "own"))
    bad["workers"][0]["state"] = "sleeping"
    with pytest.raises(StoreValueError):
        NodeView.from_json(bad)
    with pytest.raises(StoreValueError):
        NodeView.from_json({**bad, "idle_since": "yesterday"})


def _nccl_view(node_rank: int, rank: int, issued: int, working: bool) -> dict:
    return NodeView(node_rank, f"n{node_rank}", 90.0, 100.0, False, (WorkerView(
        rank, 1000 + rank, "own", f"where {rank}", "stack", {COMM: issued}, working),)
    ).to_json()


def test_job_verdict_names_a_rank_behind_in_nccl_on_another_node() -> None:
    """Each node alone sees one rank of the communicator; the leader compares their counts:
    rank 1 (node n1, idle) never issued collective #6 that rank 0 (node n0, spinning in its
    own code) waits for. A late rank that works, or counts that are not hex, are not."""
    def judge(*records: dict) -> JobHang | None:
        return judge_job([NodeView.from_json(r) for r in records], 2, 5.0, 100.0)

    hang = judge(_nccl_view(0, 0, 6, True), _nccl_view(1, 1, 5, False))
    assert hang is not None and [(w.rank, n) for w, n in hang.culprits] == [(1, "n1")]
    assert ("rank 1 (node n1, pid 1001) stuck where 1, behind on collective #6 (issued 5); "
            "rank 0 waiting for collective #6") in hang.describe(), hang.describe()
    assert judge(_nccl_view(0, 0, 6, False), _nccl_view(1, 1, 5, True)) is None  # evaluating
    assert judge(_nccl_view(0, 0, 6, True), _nccl_view(1, 1, 6, True)) is None  # computing
    forged = _nccl_view(1, 1, 5, False)
    forged["workers"][0]["collectives"] = {"not-hex": 5}
    with pytest.raises(StoreValueError):
        NodeView.from_json(forged)


def test_the_leader_judges_the_view_that_every_node_of_the_generation_published() -> None:
    """The restart supervisor on node rank 0 reads ``hang/<generation>/<node rank>`` of every
    node of the job generation and judges them together (the inputs of the cross-node
    verdict): node 1's rank idle in its own code is the culprit node 0's rank waits for;
    with one node's view missing, or only an older generation's, there is no verdict."""
    import torch.distributed as dist

    from ftrun.agent.restart import RestartSupervisor
    from ftrun.control.rendezvous import Generation, NodeSlot
    from ftrun.control.store import JsonStore

    store = JsonStore(dist.HashStore(), "ftrun/test")
    services = SimpleNamespace(rdzv=SimpleNamespace(is_leader=True, store=store))
    supervisor = RestartSupervisor(services)  # type: ignore[arg-type]
    generation = Generation(number=3, restart_count=1, nodes=tuple(
        NodeSlot(node_rank=n, local_world_size=1, addr=f"10.0.0.{n}", hostname=f"n{n}",
                 pid=10 + n, node_id=f"n{n}-id") for n in range(2)),
        worker_store_host="127.0.0.1", worker_store_port=29500)
    hangs = HangWatch(timeout_s=5.0, multi_node=True)
    now = time.time()

    def view(node_rank: int, state: str) -> dict:
        return NodeView(node_rank, f"n{node_rank}", now - 10.0, now - 0.5, False, (
            WorkerView(node_rank, 1000 + node_rank, state, f"where {node_rank}",
                       "stack" if state == "own" else ""),)).to_json()

    store.set_record("hang/3/0", view(0, "waiting"))
    assert supervisor._judge_job(generation, hangs) is None  # node 1 has not published
    store.set_record("hang/2/1", view(1, "own"))  # another generation's: not this one's
    assert supervisor._judge_job(generation, hangs) is None
    store.set_record("hang/3/1", view(1, "own"))
    hang = supervisor._judge_job(generation, hangs)
    assert hang is not None and [(w.rank, n) for w, n in hang.culprits] == [(1, "n1")]
    assert [w.rank for w in hang.waiting] == [0]
