"""A chaos soak: real jobs under a random fault schedule drawn from a seed, each checked for
what a user relies on.

    python scripts/soak.py --short --json            # CI: 28 faults, a fixed seed
    python scripts/soak.py --faults 1000 --burners 2  # the long run: a random seed, printed
    python scripts/soak.py --seed 812 --faults 40     # the same schedule as a run of seed 812
    python scripts/soak.py --jobs fsdp_tp --run-seed 74806729   # one failed run's schedule

Jobs (``--jobs``, all by default): ``ddp`` (the worker API, scripts/train_elastic.py, in-process
regroup), ``fsdp`` and ``fsdp_tp`` (``ftrun.restartable``, scripts/train_fsdp.py, FSDP2 and
FSDP2 + tensor parallel on a 2x2 mesh), ``torchrun_ddp`` (an unmodified torchrun script,
scripts/train_ddp.py: the restart path, resuming from its own checkpoints) and ``two_node``
(the worker API on two network-namespace hosts, root only: node faults too). Every job runs
with ftrun's defaults but ``--recovery`` and ``--max-restarts`` (the escalation ladder needs
a rung to climb to) and a fork server.

Faults: SIGKILL and SIGSTOP of a live worker, a worker that hangs (SIGUSR1: it sleeps in its
own loop) or raises (SIGUSR2), and on the namespace hosts a node's agent and workers killed
or its link cut for a few seconds (a new agent joins again afterwards). Each fault fires at a
step drawn from the seed, or, for the in-process jobs, a moment after the previous one:
several faults close together, and faults during a recovery.

Checks per run (a failure names the job, the seed and why):

* every launcher exits 0 (a node whose link was cut exits 3, as documented);
* the final parameters equal the fault-free run's: bitwise for the sharded jobs (fsdp,
  fsdp_tp: the snapshot restores every byte and the world never changes), to a relative
  1e-6 for DDP (ddp, two_node: a regroup runs steps on fewer ranks; torchrun_ddp: a
  restarted DDP model's first step buckets its gradients differently, and gloo's ring sums
  each element in another order);
* one fault record per fault (the agent's own records, ``ftrun.observe.faults``; a recovery
  that passed its deadline adds an ``escalate`` record, counted apart);
* no process left behind (every process of the run carries a marker variable);
* the longest time without a committed step stays under the recovery deadline
  (``--deadline``, ftrun's auto floor by default).

The fault-free reference of each job runs beside its first faulty run (it adds load, which
is where the convergence bug lived). ``--burners N`` keeps N CPU burners spinning.

Printed last with ``--json`` (a contract: keys are kept)::

    {"faults": N, "survived": N, "failures": [{"job":..., "seed":..., "why":...}],
     "recovery_s": {"p50": x, "p99": x, "max": x}, "max_gap_s": x, "goodput": x, ...}

``survived`` counts the faults of runs that passed every check; ``recovery_s`` is every
fault record's fault-to-progress time, ``recovery_s_in_process`` the same for the regroup
paths alone, ``recovery_s_in_process_isolated`` for those of them that no other fault
overlapped (none happened from a second before to the recovery: a hang's detection, or the
stuck rule's floor for a member that a second fault caught, sits in the others);
``goodput`` is the agents' productive time over wall time, summed over the runs whose agents
know it (scripts with the worker API).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.insert(0, str(REPO))

from cpuload import Burners  # noqa: E402

from ftrun.observe.faults import FaultBook, FaultRecord  # noqa: E402

MARKER = "FTRUN_SOAK_RUN"
STEP = re.compile(r"step=(\d+) loss=\S+ rank=(\d+) pid=(\d+) t=([\d.]+)")
DONE = re.compile(r"done rank=(\d+) steps=(\d+) param_sum=(\S+)")
PRELOAD = "torch,torch._dynamo"
SHARDED_PRELOAD = PRELOAD + ",torch.distributed.fsdp,torch.distributed.tensor"
SHORT_SEED = 20261206
DEFAULT_DEADLINE_S = 30.0  # ftrun's auto recovery deadline's floor (ftrun.decide.deadline)
WORKER_FAULTS = ("kill", "freeze", "hang", "raise")
NODE_FAULTS = ("kill-agent", "cut-link")
SIGNALS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP, "hang": signal.SIGUSR1,
           "raise": signal.SIGUSR2}
CUT_S = 4.0  # how long a cut link stays down
TOKEN = "soak-token"


@dataclass(frozen=True)
class JobKind:
    """One job of the matrix: how to start it and which faults it takes."""

    name: str
    script: str
    flags: tuple[str, ...]
    args: tuple[str, ...]
    steps: int
    faults: tuple[str, ...]
    bitwise: bool
    in_process: bool  # faults may come a moment after the previous one (during recovery)
    nodes: int = 1
    most: int = 6  # faults a run of it takes at most (a node fault costs a rejoin)


JOBS: dict[str, JobKind] = {
    "ddp": JobKind("ddp", "train_elastic.py",
                   ("--nproc-per-node", "4", "--recovery", "regroup", "--max-restarts", "3",
                    "--preload", PRELOAD),
                   ("--hidden", "128", "--step-sleep", "0.02"), 150, WORKER_FAULTS,
                   bitwise=False, in_process=True),
    "fsdp": JobKind("fsdp", "train_fsdp.py",
                    ("--nproc-per-node", "4", "--recovery", "regroup", "--max-restarts", "3",
                     "--preload", SHARDED_PRELOAD),
                    ("--step-sleep", "0.05"), 60, WORKER_FAULTS, bitwise=True,
                    in_process=True),
    "fsdp_tp": JobKind("fsdp_tp", "train_fsdp.py",
                       ("--nproc-per-node", "4", "--recovery", "regroup", "--max-restarts",
                        "3", "--preload", SHARDED_PRELOAD),
                       ("--tp", "2", "--step-sleep", "0.05"), 60, WORKER_FAULTS,
                       bitwise=True, in_process=True),
    "torchrun_ddp": JobKind("torchrun_ddp", "train_ddp.py",
                            ("--nproc-per-node", "4", "--recovery", "restart",
                             "--max-restarts", "20", "--preload", PRELOAD),
                            ("--hidden", "64", "--step-sleep", "0.03", "--checkpoint-every",
                             "5"), 150, WORKER_FAULTS, bitwise=False, in_process=False),
    "two_node": JobKind("two_node", "train_elastic.py",
                        ("--nproc-per-node", "2", "--recovery", "regroup", "--max-restarts",
                         "3", "--preload", PRELOAD),
                        ("--hidden", "128", "--step-sleep", "0.05"), 250,
                        ("kill", "kill", *NODE_FAULTS), bitwise=False, in_process=True,
                        nodes=2, most=4),
}


@dataclass(frozen=True)
class Planned:
    """A fault to inject: ``kind``; when: at ``step`` committed steps, or ``soon_s`` after
    the previous fault (during its recovery)."""

    kind: str
    step: int | None = None
    soon_s: float | None = None


def plan(job: JobKind, rng: random.Random, count: int) -> list[Planned]:
    """``count`` faults for one run of ``job``, in order, from ``rng``."""
    first, last = max(5, job.steps // 10), int(job.steps * 0.7)
    steps = sorted(rng.randint(first, last) for _ in range(count))
    faults = []
    for step in steps:
        kind = rng.choice(job.faults)
        if faults and job.in_process and kind in WORKER_FAULTS and rng.random() < 0.35:
            faults.append(Planned(kind, soon_s=round(rng.uniform(0.05, 1.5), 3)))
        else:
            faults.append(Planned(kind, step=step))
    return faults


# --- one launcher's output ---------------------------------------------------------------


class Output:
    """The lines of one or more launchers, stamped as they arrive."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str, str]] = []  # (time, node, line)
        self.cond = threading.Condition()

    def pump(self, proc: subprocess.Popen[str], node: str) -> threading.Thread:
        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                with self.cond:
                    self.lines.append((time.time(), node, line.rstrip("\n")))
                    self.cond.notify_all()
            with self.cond:
                self.cond.notify_all()
        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return thread

    def steps(self, since: float = 0.0,
              node: str | None = None) -> list[tuple[int, int, int, float, float]]:
        """(step, rank, pid, t, seen) of every step line seen at or after ``since`` (of
        ``node``'s launcher only, when given)."""
        with self.cond:
            found = [(int(m[1]), int(m[2]), int(m[3]), float(m[4]), seen)
                     for seen, where, line in self.lines
                     if seen >= since and (node is None or where == node)
                     for m in [STEP.search(line)] if m]
        return found

    def text(self) -> str:
        with self.cond:
            return "\n".join(f"[{node}] {line}" for _, node, line in self.lines)

    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.2))
        return True


def tagged_processes(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``MARKER=tag``."""
    needle = f"{MARKER}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle not in handle.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def launcher() -> str:
    candidate = Path(sys.executable).parent / "ftrun"
    return str(candidate) if candidate.exists() else "ftrun"


# --- one run -------------------------------------------------------------------------------


@dataclass
class RunResult:
    job: str
    seed: int
    faults: list[str]
    codes: list[int | None] = field(default_factory=list)
    digest: str | None = None
    problems: list[str] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    in_process_s: list[float] = field(default_factory=list)
    isolated_s: list[float] = field(default_factory=list)  # in process, no fault overlapped
    escalations: int = 0
    max_gap_s: float = 0.0
    productive_s: float | None = None
    wall_s: float | None = None
    workdir: str = ""
    # faults that acted at the victim's next step but whose job generation a restart had
    # already ended (see absorbed_by_restart)
    absorbed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class Job:
    """One single-node job: the launcher, its output, its faults."""

    def __init__(self, kind: JobKind, workdir: Path, tag: str, faulty: bool) -> None:
        self.kind = kind
        self.workdir = workdir
        self.tag = tag
        self.faulty = faulty
        self.out = Output()
        self.events = workdir / "events.jsonl"
        self.procs: list[subprocess.Popen[str]] = []
        self.pumps: list[threading.Thread] = []
        self.injected: list[tuple[float, str]] = []
        self.victims: set[int] = set()
        self._started: list[float] = []  # when each launcher started

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[MARKER] = self.tag
        env["FTRUN_JOB_TOKEN"] = TOKEN
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def script_args(self) -> list[str]:
        kind = self.kind
        args = [str(self.workdir / kind.script), "--steps", str(kind.steps), *kind.args]
        if kind.name == "torchrun_ddp":
            args += ["--checkpoint-dir", str(self.workdir / "ckpt")]
        return args

    def start(self) -> None:
        shutil.copy(SCRIPTS / self.kind.script, self.workdir / self.kind.script)
        (self.workdir / "ckpt").mkdir()
        argv = [launcher(), *self.kind.flags, "--events-file", str(self.events),
                *self.script_args()]
        self._spawn(argv, "node0", cwd=self.workdir)

    def _spawn(self, argv: Sequence[str], node: str, cwd: Path,
               host: Any = None) -> subprocess.Popen[str]:
        kwargs: dict[str, Any] = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, text=True, errors="replace",
                                      env=self.env(), cwd=cwd)
        proc = host.popen(list(argv), **kwargs) if host is not None else \
            subprocess.Popen(list(argv), start_new_session=True, **kwargs)
        self.procs.append(proc)
        self._started.append(time.time())
        self.pumps.append(self.out.pump(proc, node))
        return proc

    # --- faults ----------------------------------------------------------------------------

    def committed(self) -> int:
        steps = self.out.steps()
        return max((s[0] for s in steps), default=0)

    def live_workers(self, since: float) -> dict[int, int]:
        """rank -> pid of workers that printed a step at or after ``since`` (by wall time
        seen), are alive, and were not a victim."""
        found: dict[int, int] = {}
        for _, rank, pid, _, _ in self.out.steps(since):
            found[rank] = pid
        return {r: p for r, p in found.items() if p not in self.victims and _running(p)}

    def inject(self, fault: Planned, rng: random.Random, timeout_s: float) -> str | None:
        """Inject ``fault`` when due; returns what was done, or None when the job ended (or
        no victim came) first."""
        last = self.injected[-1][0] if self.injected else 0.0
        if fault.step is not None:
            if not self.out.wait(lambda: self.committed() >= fault.step or self.ended(),
                                 timeout_s):
                return None
            since = time.time() - 2.0
        else:
            assert fault.soon_s is not None
            time.sleep(max(0.0, last + fault.soon_s - time.time()))
            since = last - 2.0  # a survivor of the previous fault, during its recovery
        if self.ended():
            return None
        if fault.kind in NODE_FAULTS:
            return self.node_fault(fault.kind)
        # a victim that stepped since the previous fault on the restart path (the agent
        # stops every worker of the old generation: a signal to one of them is lost)
        floor = since if self.kind.in_process else max(since, last)
        if not self.out.wait(lambda: bool(self.live_workers(floor)) or self.ended(),
                             timeout_s):
            return None
        workers = self.live_workers(floor)
        if not workers:
            return None
        rank = rng.choice(sorted(workers))
        pid = workers[rank]
        try:
            os.kill(pid, SIGNALS[fault.kind])
        except ProcessLookupError:
            return None
        self.victims.add(pid)
        what = f"{fault.kind} rank {rank} (pid {pid})"
        self.note(what)
        return what

    def note(self, what: str) -> None:
        """An injected fault, in the list and in the output (where it happened)."""
        now = time.time()
        self.injected.append((now, what))
        with self.out.cond:
            self.out.lines.append((now, "soak", f"injected: {what} at {now:.3f}"))

    def node_fault(self, kind: str) -> str | None:
        raise NotImplementedError(f"{kind} needs the namespace hosts")

    def ended(self) -> bool:
        """The job ended, or is ending (a rank finished its steps: a fault now would hit a
        process that left the job, which is no fault of the job)."""
        return all(p.poll() is not None for p in self.procs[:1]) or bool(self.digests())

    # --- the end ---------------------------------------------------------------------------

    def finish(self, timeout_s: float) -> list[int | None]:
        codes: list[int | None] = []
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def stop(self) -> int:
        """Stop what still runs; how many processes of the run were left after its
        launchers ended (each a bug)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pump in self.pumps:
            pump.join(10)
        deadline = time.monotonic() + 10.0
        left = tagged_processes(self.tag)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = tagged_processes(self.tag)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        return len(left)

    def expected_codes(self) -> list[set[int]]:
        return [{0}]

    def digests(self) -> dict[int, str]:
        found: dict[int, str] = {}
        with self.out.cond:
            for _, _, line in self.out.lines:
                if m := DONE.search(line):
                    found[int(m[1])] = m[3]
        return found


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE,
                                                    psutil.STATUS_DEAD)
    except psutil.Error:
        return False


class TwoNodeJob(Job):
    """The worker API on two namespace hosts: h1 leads, h2's agent may be killed or cut off
    and a new one joins again once the survivors went on."""

    def __init__(self, kind: JobKind, workdir: Path, tag: str, faulty: bool,
                 net: Any) -> None:
        super().__init__(kind, workdir, tag, faulty)
        self.net = net
        self.h2_expected: list[set[int]] = []
        self.h2_since = 0.0  # when h2's current agent started

    def _args(self, host: Any) -> list[str]:
        leader = self.net["h1"]
        return [launcher(), "--nnodes", "1:2", *self.kind.flags, "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{leader.addr}:29400", "--rdzv-id", self.tag,
                "--rdzv-conf", "last_call_timeout=1", "--heartbeat-interval", "0.5",
                "--heartbeat-timeout", "3", "--local-addr", host.addr,
                "--events-file", str(self.workdir / f"events-{host.name}.jsonl"),
                *self.script_args()]

    def env(self) -> dict[str, str]:
        env = super().env()
        env["GLOO_SOCKET_IFNAME"] = "eth0"
        return env

    def script_args(self) -> list[str]:
        return [*super().script_args(), "--checkpoint-dir", str(self.workdir / "ckpt"),
                "--checkpoint-every", "10"]

    def start(self) -> None:
        shutil.copy(SCRIPTS / self.kind.script, self.workdir / self.kind.script)
        (self.workdir / "ckpt").mkdir()
        self.events = self.workdir / "events-h1.jsonl"
        for name in ("h1", "h2"):
            host = self.net[name]
            self._spawn(self._args(host), name, cwd=self.workdir, host=host)
        self.h2_since = time.time()
        self.h2_expected.append({0})

    def node_fault(self, kind: str) -> str | None:
        """Kill h2's agent, or cut its link for CUT_S; then, once h2's agent is gone and the
        survivors stepped again, a new agent joins from h2."""
        h2, proc = self.net["h2"], self.procs[-1]
        # only an agent that is in the job (its workers stepped): one still joining is not
        # a fault of the job, and gets no record
        if not self.out.wait(lambda: bool(self.out.steps(self.h2_since, "h2")) or
                             self.ended() or proc.poll() is not None, 120):
            return None
        if proc.poll() is not None or self.ended():
            return None
        when = time.time()
        if kind == "kill-agent":
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            self.h2_expected[-1] = {-signal.SIGKILL}
        else:
            self.net.cut_link(h2)
            # it gives up on the store (3), or it rejoins once the link is back: the leader
            # declared it lost, it stopped its workers, asked to join, and the job ran on to
            # its end with it (0; the long soak's two_node run, seed 821068364)
            self.h2_expected[-1] = {0, 3}
        what = f"{kind} node 1 (h2)"
        self.note(what)
        if kind == "cut-link":
            time.sleep(CUT_S)
            self.net.restore_link(h2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        self.out.wait(lambda: any(s[4] > when + 0.5 for s in self.out.steps(when)) or
                      self.ended(), 60)
        if not self.ended() and self.committed() < self.kind.steps * 0.6:
            self._spawn(self._args(h2), "h2", cwd=self.workdir, host=h2)
            self.h2_since = time.time()
            self.h2_expected.append({0})
        return what

    def finish(self, timeout_s: float) -> list[int | None]:
        """The leader first; then an h2 agent still trying to join a job that ended (it
        started after the last node fault, the job finished meanwhile) is stopped after a
        short grace: it may exit 3 (the store is gone) or by the stop."""
        codes = super().finish(timeout_s) if len(self.procs) == 1 else []
        if codes:
            return codes
        leader = self.procs[0]
        try:
            first = leader.wait(timeout_s)
        except subprocess.TimeoutExpired:
            first = None
        codes = [first]
        for index, proc in enumerate(self.procs[1:], start=1):
            try:
                codes.append(proc.wait(20.0))
            except subprocess.TimeoutExpired:
                joined = bool(self.out.steps(self._started[index], "h2"))
                proc.terminate()
                codes.append(proc.wait(30))
                if not joined:  # it never got into the job: the stop is expected
                    self.h2_expected[index - 1] = self.h2_expected[index - 1] | {
                        -signal.SIGTERM, 128 + signal.SIGTERM, 3}
        return codes

    def expected_codes(self) -> list[set[int]]:
        return [{0}, *self.h2_expected]


# --- checks ------------------------------------------------------------------------------


def max_gap_s(steps: list[tuple[int, int, int, float, float]]) -> float:
    """The longest time between two consecutive commits (any rank), from the first."""
    times = sorted(t for _, _, _, t, _ in steps)
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def same_parameters(found: str, reference: str, bitwise: bool) -> bool:
    if bitwise or found == reference:
        return found == reference
    try:
        a, b = float(found), float(reference)
    except ValueError:
        return False
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def check(job: Job, result: RunResult, reference: str | None, deadline_s: float) -> None:
    problems = result.problems
    for code, allowed, proc in zip(result.codes, job.expected_codes(), job.procs,
                                   strict=False):
        if code not in allowed:
            problems.append(f"launcher {proc.pid} exited {code}, expected {sorted(allowed)}")
    digests = job.digests()
    values = set(digests.values())
    if len(values) != 1:
        problems.append(f"final parameters differ between ranks or are missing: {digests}")
    else:
        result.digest = values.pop()
        if reference is not None and not same_parameters(result.digest, reference,
                                                         job.kind.bitwise):
            problems.append(f"final parameters {result.digest} are not the fault-free "
                            f"{reference}")
    records = []
    generation_of: dict[int, int] = {}
    with contextlib.suppress(OSError):
        lines = job.events.read_text().splitlines()
        events = []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
        generation_of = {e["pid"]: e["generation"] for e in events
                         if e.get("event") == "spawn" and isinstance(e.get("pid"), int)
                         and isinstance(e.get("generation"), int)}
        book = FaultBook().replay(events)
        records = book.faults
        summary = book.summary()
        result.productive_s, result.wall_s = summary.productive_s, summary.wall_s
    faults = [r for r in records if r.path != "escalate"]
    result.escalations = len(records) - len(faults)
    result.absorbed = absorbed_by_restart(job.injected, faults, generation_of)
    if len(faults) + len(result.absorbed) != len(job.injected):
        problems.append(f"{len(faults)} fault records for {len(job.injected)} faults"
                        f"{f' ({len(result.absorbed)} absorbed)' if result.absorbed else ''}: "
                        f"{[r.headline for r in faults]}")
    for record in records:
        if record.recovery_s is not None and record.path != "none":
            result.recovery_s.append(record.recovery_s)
            if record.path in ("regroup", "replace"):
                result.in_process_s.append(record.recovery_s)
                if not overlapped(record, records):
                    result.isolated_s.append(record.recovery_s)
    result.max_gap_s = max_gap_s(job.out.steps())
    if result.max_gap_s >= deadline_s:
        problems.append(f"{result.max_gap_s:.1f}s without a committed step (the recovery "
                        f"deadline is {deadline_s:g}s)")


# --- the soak ----------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.references: dict[str, str] = {}
        self.pending: dict[str, Job] = {}  # reference runs started, not yet collected
        self.results: list[RunResult] = []
        self.counter = 0

    def _job(self, kind: JobKind, faulty: bool, net: Any) -> Job:
        self.counter += 1
        workdir = self.workdir / f"run{self.counter}_{kind.name}{'' if faulty else '_ref'}"
        workdir.mkdir()
        tag = uuid.uuid4().hex
        if kind.nodes > 1:
            return TwoNodeJob(kind, workdir, tag, faulty, net)
        return Job(kind, workdir, tag, faulty)

    def reference(self, kind: JobKind) -> Job | None:
        """The fault-free run of ``kind`` (its digest), started beside the first faulty
        run; a job on several nodes is compared with the same script, steps and world
        size on one node (ddp's launcher flags with the job's world)."""
        name = kind.name
        if name in self.references or name in self.pending:
            return None
        ref = kind
        if kind.nodes > 1:
            world = kind.nodes * int(kind.flags[kind.flags.index("--nproc-per-node") + 1])
            flags = list(JOBS["ddp"].flags)
            flags[flags.index("--nproc-per-node") + 1] = str(world)
            ref = dataclasses.replace(kind, flags=tuple(flags), nodes=1)
        job = self._job(ref, faulty=False, net=None)
        job.start()
        self.pending[name] = job
        return job

    def collect_reference(self, kind: JobKind) -> str | None:
        name = kind.name
        job = self.pending.pop(name, None)
        if job is not None:
            codes = job.finish(self.args.timeout)
            left = job.stop()
            digests = set(job.digests().values())
            if codes == [0] and len(digests) == 1 and not left:
                self.references[name] = digests.pop()
            else:
                print(f"# reference run of {name} failed: exit {codes}, leftovers {left}; "
                      f"its output in {job.workdir}", file=sys.stderr)
                (job.workdir / "output.txt").write_text(job.out.text())
        return self.references.get(name)

    def run(self, kind: JobKind, seed: int, count: int, net: Any) -> RunResult:
        rng = random.Random(seed)
        faults = plan(kind, rng, count)
        self.reference(kind)
        job = self._job(kind, faulty=True, net=net)
        result = RunResult(kind.name, seed, [], workdir=str(job.workdir))
        try:
            job.start()
            for fault in faults:
                what = job.inject(fault, rng, self.args.timeout)
                if what is None:
                    break
                result.faults.append(what)
            result.codes = job.finish(self.args.timeout)
        finally:
            left = job.stop()
        reference = self.collect_reference(kind)
        if reference is None:
            result.problems.append("no fault-free reference to compare with")
        if left:
            result.problems.append(f"{left} processes left behind")
        check(job, result, reference, self.args.deadline)
        if len(result.faults) < len(faults):  # the soak goes on with the next run
            print(f"# {kind.name} seed={seed}: {len(result.faults)} of {len(faults)} faults "
                  "injected before the job ended", file=sys.stderr)
        (job.workdir / "output.txt").write_text(job.out.text())
        if result.ok and not self.args.keep_logs:
            shutil.rmtree(job.workdir, ignore_errors=True)
        self.results.append(result)
        status = "ok" if result.ok else "FAILED: " + "; ".join(result.problems)
        print(f"# {time.strftime('%H:%M:%S')} {kind.name} seed={seed} faults="
              f"{len(result.faults)} recovery={[round(r, 2) for r in result.recovery_s]} "
              f"gap={result.max_gap_s:.1f}s {status}", file=sys.stderr, flush=True)
        return result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return round(ordered[index], 3)


#: A raise or a hang acts at the victim's next step; a restart of its generation that
#: detected another fault this soon after the injection stopped the victim before it could
#: act (a step took 3.5 s in the long soak, a restart's first steps on busy cores).
ABSORB_WINDOW_S = 10.0
#: A fault this long before another counts as overlapping it (recovery_s_in_process_isolated).
OVERLAP_BEFORE_S = 1.0
#: An injected fault as the soak notes it: "<kind> rank R (pid P)".
_VICTIM = re.compile(r"^(\S+) rank \d+ \(pid (\d+)\)$")


def absorbed_by_restart(injected: list[tuple[float, str]], records: list[FaultRecord],
                        generation_of: dict[int, int]) -> list[str]:
    """The injected faults that never acted, each named in another fault's record:

    * a raise or hang (it acts at the victim's next step) whose victim no record names,
      where a restart of the victim's own job generation (``generation_of``: pid ->
      generation, from the spawn events) detected another fault within
      :data:`ABSORB_WINDOW_S` of the injection: the victim was stopped before its next step;
    * any fault whose victim is a casualty of another fault's recovery (taken out while it
      waited in a collective of the epoch that fault ended: it never reached the step where
      its own fault would act; the record names it).

    A kill or a freeze acts at once and otherwise needs its own record."""
    named = {r.pid for r in records if r.pid is not None}
    casualties = {pid for r in records for pid in r.casualty_pids}
    absorbed = []
    for at, what in injected:
        victim = _VICTIM.match(what)
        if victim is None:
            continue
        kind, pid = victim[1], int(victim[2])
        if pid in named:
            continue
        if pid in casualties:
            absorbed.append(what)
            continue
        if kind not in ("raise", "hang"):
            continue
        generation = generation_of.get(pid)
        if any(r.path == "restart" and r.generation == generation
               and abs(r.detected - at) <= ABSORB_WINDOW_S for r in records):
            absorbed.append(what)
    return absorbed


def overlapped(record: FaultRecord, records: list[FaultRecord]) -> bool:
    """Whether another fault happened from a second before ``record``'s to its recovery (the
    recovery then holds the other's detection or recovery too)."""
    end = record.happened + (record.recovery_s or 0.0)
    return any(other is not record and record.happened - OVERLAP_BEFORE_S <= other.happened
               <= end for other in records)


def figures(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99),
            "max": round(max(values), 3) if values else None}


def summarize(results: list[RunResult], args: argparse.Namespace, seed: int,
              elapsed_s: float) -> dict[str, Any]:
    recovery = [r for result in results for r in result.recovery_s]
    in_process = [r for result in results for r in result.in_process_s]
    isolated = [r for result in results for r in result.isolated_s]
    productive = [r.productive_s for r in results if r.productive_s is not None and r.wall_s]
    walls = [r.wall_s for r in results if r.productive_s is not None and r.wall_s]
    by_job: dict[str, dict[str, Any]] = {}
    for result in results:
        entry = by_job.setdefault(result.job, {"runs": 0, "faults": 0, "failed_runs": 0,
                                               "recovery_s": []})
        entry["runs"] += 1
        entry["faults"] += len(result.faults)
        entry["failed_runs"] += 0 if result.ok else 1
        entry["recovery_s"] += result.recovery_s
    for entry in by_job.values():
        entry["recovery_s"] = figures(entry["recovery_s"])
    return {
        "faults": sum(len(r.faults) for r in results),
        "survived": sum(len(r.faults) for r in results if r.ok),
        "failures": [{"job": r.job, "seed": r.seed, "why": "; ".join(r.problems),
                      "faults": r.faults, "logs": r.workdir} for r in results if not r.ok],
        "recovery_s": figures(recovery),
        "recovery_s_in_process": figures(in_process),
        "recovery_s_in_process_isolated": figures(isolated),
        "max_gap_s": round(max((r.max_gap_s for r in results), default=0.0), 3),
        "goodput": round(sum(productive) / sum(walls), 4) if walls else None,
        "escalations": sum(r.escalations for r in results),
        "absorbed": [f"{r.job} seed={r.seed}: {what}" for r in results for what in r.absorbed],
        "runs": len(results),
        "by_job": by_job,
        "seed": seed,
        "deadline_s": args.deadline,
        "burners": args.burners,
        "elapsed_s": round(elapsed_s, 1),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "faults_asked": args.faults,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=30, help="faults to inject in all")
    parser.add_argument("--seed", type=int, default=None,
                        help="the schedule's seed (default: random, printed)")
    parser.add_argument("--short", action="store_true",
                        help=f"CI: 28 faults, seed {SHORT_SEED}, every job once")
    parser.add_argument("--jobs", default=",".join(JOBS),
                        help="comma-separated job kinds (default: all)")
    parser.add_argument("--per-run", type=int, default=6, help="faults per run")
    parser.add_argument("--run-seed", type=int, default=None,
                        help="run once, the first of --jobs with this run's seed (a failure "
                        "names it), and --per-run faults")
    parser.add_argument("--burners", type=int, default=0, help="CPU burners while it runs")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                        help="the longest allowed time without a committed step")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    parser.add_argument("--keep-logs", type=Path, default=None,
                        help="keep every run's output here (failed runs' are always kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no new run after this long (the summary says how many "
                        "of --faults were injected)")
    args = parser.parse_args(argv)
    if args.short:
        args.faults, args.per_run = 28, 6
        args.seed = SHORT_SEED if args.seed is None else args.seed
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    kinds = [k.strip() for k in args.jobs.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in JOBS]
    if unknown:
        parser.error(f"unknown jobs {unknown} (known: {', '.join(JOBS)})")
    net_needed = "two_node" in kinds
    if net_needed and (os.geteuid() != 0 or shutil.which("ip") is None):
        print("# two_node needs root and iproute2: left out", file=sys.stderr)
        kinds.remove("two_node")
        net_needed = False
    print(f"# soak seed={seed} faults={args.faults} jobs={','.join(kinds)} "
          f"burners={args.burners}", file=sys.stderr, flush=True)
    started = time.time()
    base = args.keep_logs or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ftrun_soak_", dir=base))
    rng = random.Random(seed)
    soak = Soak(args, workdir)
    with contextlib.ExitStack() as stack:
        stack.enter_context(Burners(args.burners))
        net = None
        if net_needed:
            from tests.infra.netns import netns_hosts
            net = stack.enter_context(netns_hosts(2))
        index = 0
        if args.run_seed is not None:
            kind = JOBS[kinds[0]]
            soak.run(kind, args.run_seed, min(args.per_run, kind.most), net)
            args.faults = 0
        while sum(len(r.faults) for r in soak.results) < args.faults:
            if args.time_budget is not None and time.time() - started > args.time_budget:
                print(f"# time budget of {args.time_budget:.0f} s spent: no new run",
                      file=sys.stderr, flush=True)
                break
            kind = JOBS[kinds[index % len(kinds)]]
            index += 1
            left = args.faults - sum(len(r.faults) for r in soak.results)
            result = soak.run(kind, rng.randrange(10**9), min(args.per_run, left, kind.most),
                              net)
            if not result.faults:  # nothing could be injected: do not loop forever
                break
    summary = summarize(soak.results, args, seed, time.time() - started)
    if not summary["failures"] and not args.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        summary["logs"] = str(workdir)
    if not args.json:
        print(f"faults {summary['faults']}, survived {summary['survived']}, failures "
              f"{len(summary['failures'])}; recovery p50/p99/max {summary['recovery_s']}; "
              f"in process {summary['recovery_s_in_process']} (no other fault "
              f"overlapping: {summary['recovery_s_in_process_isolated']}); longest gap "
              f"{summary['max_gap_s']} s; goodput {summary['goodput']}; seed {seed}")
        for failure in summary["failures"]:
            print(f"FAILED {failure['job']} seed={failure['seed']}: {failure['why']}")
    print(json.dumps(summary))
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
