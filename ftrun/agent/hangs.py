"""Hangs of scripts that do not use the worker API, seen from outside, in seconds.

Under torchrun a rank that hangs (a deadlock, a wedged host thread, a peer that sleeps) is
noticed only when torch's collective timeout fires, 10 minutes by default. The restart
supervisor asks a :class:`HangWatch` instead, every half second:

* a worker stopped by a signal (SIGSTOP, a tracer) is **frozen**: a failure at once;
* every local worker's CPU time (its whole process tree: data loader workers count) flat,
  none in uninterruptible I/O (a checkpoint being written), for the hang timeout: the
  workers' stacks are read (:mod:`ftrun.agent.stacks`) and decide:

  - some wait in torch's communication (or inside an NCCL call: the NCCL shim counts the
    threads inside each communicator's calls, and knows the call and its sequence number),
    others are idle in their own code: those are the **culprits** the others wait for: a
    hang;
  - all wait in communication: on one node, a collective that never completes (a network
    fault): a hang after three timeouts (nobody to name, so no hurry to guess); on several
    nodes the culprit may be elsewhere: left to its node (or the heartbeats, or the
    collective timeout);
  - none waits in communication: a slow step (every rank sleeps or reads): not a hang, and
    the timeout grows to twice that spell once it ends; ranks still forming their process
    group (``init_process_group``) are left to torch's own rendezvous timeout;
  - stacks unreadable (no py-spy, ptrace denied): a hang only after three timeouts, unnamed.

The timeout (``--hang-timeout``): ``auto`` is max(5 s, twice the longest all-idle spell the
job recovered from by itself); a number fixes it; 0 turns the watch off.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psutil

from ftrun.agent.events import Event
from ftrun.agent.processes import WorkerProcess
from ftrun.agent.services import AgentServices
from ftrun.agent.stacks import Stack, read_stack
from ftrun.control.rendezvous import Generation
from ftrun.shim import ShimError

HANG_FLOOR_S = 5.0
SAMPLE_S = 0.5
IDLE_CPU_FRACTION = 0.05  # less CPU than this share of one core over a sample: idle


@dataclass(frozen=True)
class Hang:
    """What the watch found: a frozen worker, or hung ones and those waiting for them."""

    kind: str  # "frozen" or "hung"
    culprits: tuple[WorkerProcess, ...]  # the ranks the others wait for (may be empty)
    waiting: tuple[WorkerProcess, ...]  # ranks idle inside torch's communication
    idle_s: float  # how long every worker had been idle
    stacks: dict[int, Stack] = field(default_factory=dict)  # by pid, where read
    nccl: dict[int, str] = field(default_factory=dict)  # by pid: "ncclAllReduce #12"

    def where(self, worker: WorkerProcess) -> str:
        """What an idle worker was doing: its NCCL call, else its stack."""
        if worker.pid in self.nccl:
            return f"waiting in {self.nccl[worker.pid]}"
        stack = self.stacks.get(worker.pid)
        return stack.where if stack else "in a collective"

    def describe(self) -> str:
        """One line: who is stuck where, who waits, for how long."""
        if self.kind == "frozen":
            worker = self.culprits[0]
            return f"rank {worker.rank} (pid {worker.pid}) frozen (stopped by a signal)"
        parts = []
        for worker in self.culprits:
            stack = self.stacks.get(worker.pid)
            where = f" stuck {stack.where}" if stack else ""
            parts.append(f"rank {worker.rank} (pid {worker.pid}){where}")
        if self.waiting:
            ranks = ",".join(str(w.rank) for w in self.waiting)
            plural = "s" if len(self.waiting) > 1 else ""
            parts.append(f"rank{plural} {ranks} {self.where(self.waiting[0])}")
        if not parts:
            parts.append("every rank idle (stacks not readable)")
        return "; ".join(parts) + f"; no CPU progress for {self.idle_s:.1f} s"


@dataclass
class _Activity:
    cpu_s: float
    busy_at: float


class HangWatch:
    """Samples the local workers' activity; see the module docstring."""

    def __init__(
        self,
        *,
        timeout_s: float | None,
        multi_node: bool,
        clock: Callable[[], float] = time.monotonic,
        stack_of: Callable[[int], Stack | None] = read_stack,
        nccl_call_of: Callable[[WorkerProcess], str | None] | None = None,
    ) -> None:
        self.fixed_timeout_s = timeout_s  # None: auto
        self.multi_node = multi_node
        self.clock = clock
        self.stack_of = stack_of
        self.nccl_call_of = nccl_call_of or nccl_call
        self.activity: dict[int, _Activity] = {}
        self.longest_spell_s = 0.0  # the longest all-idle spell that ended by itself
        self.spell_s = 0.0
        self.next_sample = clock()
        self.next_check = 0.0  # when a spell's stacks may be read (again)

    @property
    def timeout_s(self) -> float:
        if self.fixed_timeout_s is not None:
            return self.fixed_timeout_s
        return max(HANG_FLOOR_S, 2 * self.longest_spell_s)

    def due_in(self) -> float:
        return max(0.0, self.next_sample - self.clock())

    def sample(self, group: Sequence[WorkerProcess]) -> Hang | None:
        now = self.clock()
        if now < self.next_sample:
            return None
        self.next_sample = now + SAMPLE_S
        live = [w for w in group if w.poll() is None]
        for worker in live:
            if worker.is_frozen():
                return Hang("frozen", (worker,), (), 0.0)
        if not live:
            return None
        for worker in live:
            cpu, in_io = _tree_cpu(worker.pid)
            seen = self.activity.get(worker.pid)
            if seen is None:
                self.activity[worker.pid] = _Activity(cpu, now)
                continue
            if in_io or cpu - seen.cpu_s > IDLE_CPU_FRACTION * SAMPLE_S:
                seen.busy_at = now
            seen.cpu_s = cpu
        idle_s = now - max(self.activity[w.pid].busy_at for w in live
                           if w.pid in self.activity)
        if idle_s < self.spell_s:  # someone worked again: the spell ended by itself
            self.longest_spell_s = max(self.longest_spell_s, self.spell_s)
            self.next_check = 0.0
        self.spell_s = idle_s
        if idle_s < self.timeout_s or now < self.next_check:
            return None
        return self._judge(live, idle_s, now)

    def _judge(self, live: list[WorkerProcess], idle_s: float, now: float) -> Hang | None:
        stacks = {w.pid: s for w in live if (s := self.stack_of(w.pid)) is not None}
        nccl = {w.pid: c for w in live if (c := self.nccl_call_of(w)) is not None}
        self.next_check = now + self.timeout_s  # judged: look again after another timeout
        if any(w.pid not in stacks and w.pid not in nccl for w in live):
            if idle_s >= 3 * self.timeout_s:
                return Hang("hung", (), (), idle_s, stacks, nccl)
            return None

        def waits(worker: WorkerProcess) -> bool:
            return worker.pid in nccl or stacks[worker.pid].waiting

        waiting = tuple(w for w in live if waits(w))
        culprits = tuple(w for w in live if not waits(w))
        if not waiting or any(w.pid in stacks and stacks[w.pid].forming_group
                              for w in waiting):
            return None  # a slow step, or a group still forming: torch's own timeout
        if culprits:
            return Hang("hung", culprits, waiting, idle_s, stacks, nccl)
        if self.multi_node:
            return None  # the rank they wait for is on another node: its node names it
        if idle_s < 3 * self.timeout_s:
            self.next_check = now + SAMPLE_S
            return None
        return Hang("hung", (), waiting, idle_s, stacks, nccl)


def nccl_call(worker: WorkerProcess) -> str | None:
    """The NCCL call a thread of ``worker`` is inside right now ("ncclAllReduce #12": the
    call and the communicator's operation count), from its shim page; None without one."""
    shim = worker.shim
    if shim is None:
        return None
    try:
        inside = [c for c in shim.communicators() if c.inflight > 0]
    except (ShimError, OSError, ValueError):
        return None
    return f"{inside[0].last_op} #{inside[0].seq}" if inside else None


def _tree_cpu(pid: int) -> tuple[float, bool]:
    """CPU seconds of ``pid`` and its descendants, and whether one is in uninterruptible
    I/O (a checkpoint write); a process that is gone counts as nothing."""
    total, in_io = 0.0, False
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, False
    for proc in procs:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                total += times.user + times.system
                in_io = in_io or proc.status() == psutil.STATUS_DISK_SLEEP
        except psutil.Error:
            continue
    return total, in_io


def announce_hang(services: AgentServices, generation: Generation, hang: Hang,
                  group: Sequence[WorkerProcess], detected: float, *, emit: bool = True) -> None:
    """Say a hang (with the culprits' stacks), log it (unless the caller's own failure
    record will), and release every worker blocked in NCCL through its shim, so that the
    stop that follows is not stuck behind a collective."""
    detail = hang.describe()
    if emit:  # otherwise the caller's failure line says it
        services.say(f"{detail}: stopping every worker", style="yellow")
    for worker in hang.culprits:
        stack = hang.stacks.get(worker.pid)
        if stack is not None:
            services.say(f"rank {worker.rank} stack (most recent call last):\n{stack.text()}")
    if emit:
        services.events.emit(
            Event.FAILURE, generation=generation.number, cause=detail, kind=hang.kind,
            rank=hang.culprits[0].rank if hang.culprits else None,
            pid=hang.culprits[0].pid if hang.culprits else None,
            culprits=[w.rank for w in hang.culprits], waiting=[w.rank for w in hang.waiting],
            idle_s=round(hang.idle_s, 2), detected=detected,
            stacks={w.rank: hang.stacks[w.pid].text() for w in group if w.pid in hang.stacks},
        )
    for worker in group:
        if worker.shim is not None and worker.poll() is None:
            with contextlib.suppress(ShimError, OSError):
                worker.shim.abort_all(timeout_s=services.config.abort_timeout_s)
