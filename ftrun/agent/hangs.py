"""Hangs of scripts that do not use the worker API, seen from outside, in seconds.

Under torchrun a rank that hangs (a deadlock, a wedged host thread, a peer that sleeps) is
noticed only when torch's collective timeout fires, 10 minutes by default. The restart
supervisor asks a :class:`HangWatch` instead, every half second:

* a worker stopped by a signal (SIGSTOP, a tracer) is **frozen**: a failure at once;
* every local worker quiet for the hang timeout: its CPU time (its whole process tree: data
  loader workers count) flat, none in uninterruptible I/O (a checkpoint being written); or,
  for a worker with NCCL communicators, no NCCL call at all (its host thread may spin in a
  CUDA wait). Then:

  - NCCL: a worker that issued fewer collectives on a communicator than a peer did
    (:mod:`ftrun.agent.ncclprogress`), and is itself idle, is the **culprit** its peers
    wait for: a hang, whatever the stacks say; a late worker still using CPU is working
    (rank 0 evaluating while the others wait): not a hang;
  - a worker that uses CPU without calling NCCL and is not behind anyone is working: not a
    hang (the rules below need every worker idle);
  - every worker inside an NCCL call (the shim counts the threads inside each call) of
    the same collective, nobody behind: a collective that never completes (a network
    fault): a hang after one timeout, named by the call and its number;

  otherwise the workers' stacks are read (:mod:`ftrun.agent.stacks`) and decide:

  - some wait in torch's communication (or inside an NCCL call: the NCCL shim counts the
    threads inside each communicator's calls, and knows the call and its sequence number),
    others are idle in their own code: those are the **culprits** the others wait for: a
    hang; but when every culprit awaits a reply from another host (its innermost frame in
    Python's network I/O, not a pipe to a local process: a read from object storage, a
    remote service), only after three timeouts, named: such a reply is late more often
    than it never comes (the same holds for culprits named by the NCCL counts, and a spell
    given that allowance does not grow the timeout when it ends);
  - all wait in communication: on one node, a collective that never completes (a network
    fault): a hang after three timeouts (nobody to name, so no hurry to guess); on several
    nodes the culprit may be elsewhere: see below;
  - none waits in communication: a slow step (every rank sleeps or reads): not a hang, and
    the timeout grows to twice that spell once it ends; ranks still forming their process
    group (``init_process_group``) are left to torch's own rendezvous timeout;
  - stacks unreadable (no py-spy, ptrace denied): a hang only after three timeouts, unnamed.

Several nodes: a node whose workers are all idle cannot always judge alone (its ranks wait
for a rank elsewhere, or its only rank idles in its own code while the ranks waiting for it
are elsewhere). Each agent whose local spell reaches the timeout publishes its
:class:`NodeView` (every local worker: waiting, in its own code, or unknown, with where) in
the control store; the agent of node rank 0 reads them all and applies the same rules to the
whole job (:func:`judge_job`): every node idle together for the timeout, ranks waiting in
communication and ranks idle in their own code -> those are the culprits, named with their
node and stack; all waiting -> a hang after three timeouts.

The timeout (``--hang-timeout``): ``auto`` is max(2 s, twice the longest all-idle spell the
job recovered from by itself); a number fixes it; 0 turns the watch off. The floor is what
a hang costs before the restart, and what a healthy rank may block without CPU (not in
communication, not in I/O, not awaiting the network) while its peers wait for it, before
it is taken for a hang the first time; after such a spell ends by itself the timeout grows.
A worker whose main thread is on the run queue counts as busy, so a loaded host that
starves a working rank of CPU does not make it look idle; the verdict's two looks straddle
the timeout's end (the first a sample before it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psutil

from ftrun.agent.ncclprogress import Late, NcclProgress, late_workers, nccl_progress, waiting_where
from ftrun.agent.processes import WorkerProcess, join_pumps, wait_any
from ftrun.agent.services import AgentServices
from ftrun.agent.stacks import Stack, read_stack, stack_from_fault_dump, stack_source
from ftrun.control.errors import StoreValueError, require
from ftrun.control.rendezvous import Generation
from ftrun.observe.events import Event
from ftrun.shim import ShimError

HANG_FLOOR_S = 2.0
SAMPLE_S = 0.5
IDLE_CPU_FRACTION = 0.05  # less CPU than this share of one core over a sample: idle


def waiting_phrases(ranks_where: Iterable[tuple[int, str]]) -> list[str]:
    """"rank 0 waiting in backward (..)", "ranks 1,2 waiting in recv (..)": the waiting
    ranks grouped by where each waits, in the order given."""
    by_where: dict[str, list[int]] = {}
    for rank, where in ranks_where:
        by_where.setdefault(where, []).append(rank)
    return [f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))} {where}"
            for where, ranks in by_where.items()]


@dataclass(frozen=True)
class Hang:
    """What the watch found: a frozen worker, or hung ones and those waiting for them."""

    kind: str  # "frozen" or "hung"
    culprits: tuple[WorkerProcess, ...]  # the ranks the others wait for (may be empty)
    waiting: tuple[WorkerProcess, ...]  # ranks idle inside torch's communication
    idle_s: float  # how long every worker had been idle
    stacks: dict[int, Stack] = field(default_factory=dict)  # by pid, where read
    nccl: dict[int, str] = field(default_factory=dict)  # by pid: "ncclAllReduce #12"
    late: dict[int, Late] = field(default_factory=dict)  # by pid: culprits behind in NCCL

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
            if worker.pid in self.late:
                where += f", {self.late[worker.pid].describe()}"
            parts.append(f"rank {worker.rank} (pid {worker.pid}){where}")
        parts += waiting_phrases((w.rank, self.where(w)) for w in self.waiting)
        if not parts:
            parts.append("every rank idle (stacks not readable)")
        progress = "NCCL or CPU progress" if self.late or self.nccl else "CPU progress"
        return "; ".join(parts) + f"; no {progress} for {self.idle_s:.1f} s"


@dataclass(frozen=True)
class WorkerView:
    """One idle worker as its agent saw it, for the other nodes."""

    rank: int
    pid: int
    state: str  # "waiting" (in torch's communication or NCCL), "own" (its code), "unknown"
    where: str
    stack: str = ""  # the stack's text, for a worker idle in its own code
    collectives: dict[int, int] = field(default_factory=dict)  # NCCL: comm_id -> issued
    working: bool = False  # used CPU in the last sample (without calling NCCL)
    network: bool = False  # idle in its own code awaiting another host's reply


@dataclass(frozen=True)
class NodeView:
    """A node whose workers have all been idle for the hang timeout: what each does.

    Published as a JSON record in the control store (``hang/<generation>/<node rank>``)
    and validated when read: it comes from another process."""

    node_rank: int
    node: str
    idle_since: float  # wall clock: when the last local worker stopped using CPU
    at: float  # wall clock: when this view was taken
    forming: bool  # a worker is still in init_process_group
    workers: tuple[WorkerView, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, "node": self.node,
                "idle_since": self.idle_since, "at": self.at, "forming": self.forming,
                "workers": [{"rank": w.rank, "pid": w.pid, "state": w.state,
                             "where": w.where[:300], "stack": w.stack[:4000],
                             "collectives": {f"{c:x}": n for c, n in w.collectives.items()},
                             "working": w.working, "network": w.network}
                            for w in self.workers]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeView:
        """Raises StoreValueError on any field of the wrong type."""
        workers = require(data, "workers", list)
        views = []
        for item in workers:
            if not isinstance(item, dict):
                raise StoreValueError("hang view: a worker entry is not an object")
            state = require(item, "state", str)
            if state not in ("waiting", "own", "unknown"):
                raise StoreValueError(f"hang view: unknown worker state {state!r}")
            views.append(WorkerView(require(item, "rank", int), require(item, "pid", int),
                                    state, require(item, "where", str),
                                    require(item, "stack", str),
                                    _collectives(require(item, "collectives", dict)),
                                    require(item, "working", bool), _network(item)))
        return cls(require(data, "node_rank", int), require(data, "node", str),
                   float(require(data, "idle_since", (int, float))),
                   float(require(data, "at", (int, float))),
                   require(data, "forming", bool), tuple(views))


def _network(item: dict[str, Any]) -> bool:
    """A worker view's ``network`` flag: absent (an agent older than the flag) is False."""
    network = item.get("network", False)
    if not isinstance(network, bool):
        raise StoreValueError("hang view: 'network' is not a boolean")
    return network


def _collectives(data: dict[str, Any]) -> dict[int, int]:
    """A worker view's NCCL counts ({hex comm_id: issued}); StoreValueError if malformed."""
    if len(data) > 256:
        raise StoreValueError("hang view: more communicators than a shim tracks")
    counts = {}
    for key, issued in data.items():
        try:
            comm_id = int(key, 16)
        except ValueError:
            raise StoreValueError(f"hang view: communicator id {key[:20]!r} is not hex") from None
        if not 0 < comm_id < 2**64 or not isinstance(issued, int) or issued < 0:
            raise StoreValueError(f"hang view: bad count for communicator {key[:20]}")
        counts[comm_id] = issued
    return counts


@dataclass(frozen=True)
class JobHang:
    """The whole job's verdict from every node's view (node rank 0 judges)."""

    culprits: tuple[tuple[WorkerView, str], ...]  # (worker, its node)
    waiting: tuple[WorkerView, ...]
    idle_s: float
    late: Late | None = None  # the first culprit's NCCL lag, when that named it

    def describe(self) -> str:
        behind = f", {self.late.describe()}" if self.late else ""
        parts = [f"rank {w.rank} (node {node}, pid {w.pid}) stuck {w.where}{behind}"
                 for w, node in self.culprits]
        behind_peers = f"waiting for collective #{self.late.peers}" if self.late else ""
        parts += waiting_phrases((w.rank, behind_peers or w.where)
                                 for w in sorted(self.waiting, key=lambda w: w.rank))
        if not parts:
            parts.append("every rank idle (stacks not readable)")
        return "; ".join(parts) + f"; no CPU progress on any node for {self.idle_s:.1f} s"


def judge_job(views: Sequence[NodeView], nnodes: int, timeout_s: float,
              now: float) -> JobHang | None:
    """The single-node rules applied to every node's view at once (see the module
    docstring); None while some node has no fresh view, works, or forms its group."""
    fresh = [v for v in views if now - v.at <= 1.5 * timeout_s + 2 * SAMPLE_S]
    if len({v.node_rank for v in fresh}) < nnodes or any(v.forming for v in fresh):
        return None
    idle_s = now - max(v.idle_since for v in fresh)
    if idle_s < timeout_s:
        return None  # the spells do not overlap for long enough
    workers = [(w, v.node) for v in fresh for w in v.workers]
    progress = {(node, w.pid): NcclProgress(w.collectives, {}, 0, None)
                for w, node in workers if w.collectives}
    late = late_workers(progress)
    if late:
        if any(w.working for w, node in workers if (node, w.pid) in late):
            return None  # a late rank still computes
        culprits = tuple((w, node) for w, node in workers if (node, w.pid) in late)
        if all(w.network for w, _ in culprits) and idle_s < 3 * timeout_s:
            return None  # late replies from other hosts: three timeouts
        ahead = tuple(w for w, node in workers if (node, w.pid) not in late)
        first, node = culprits[0]
        return JobHang(culprits, ahead, idle_s, late[(node, first.pid)])
    if any(w.working for w, _ in workers):
        return None  # CPU used without NCCL calls, nobody behind: computing
    waiting = tuple(w for w, _ in workers if w.state == "waiting")
    culprits = tuple((w, node) for w, node in workers if w.state == "own")
    if any(w.state == "unknown" for w, _ in workers):
        return JobHang((), waiting, idle_s) if idle_s >= 3 * timeout_s else None
    if not waiting:
        return None  # a slow step everywhere
    if culprits and not all(w.network for w, _ in culprits):
        return JobHang(culprits, waiting, idle_s)
    # culprits that await a reply from another host, or nobody to name: three timeouts
    return JobHang(culprits, waiting, idle_s) if idle_s >= 3 * timeout_s else None


@dataclass
class _Activity:
    cpu_s: float
    busy_at: float  # when it last did something that ends a quiet spell
    cpu_at: float  # when its CPU time last moved
    nccl_ops: int = -1  # NCCL operations issued when last sampled; -1: no communicator


class HangWatch:
    """Samples the local workers' activity; see the module docstring."""

    def __init__(
        self,
        *,
        timeout_s: float | None,
        multi_node: bool,
        clock: Callable[[], float] = time.monotonic,
        stack_of: Callable[[int], Stack | None] | None = None,
        progress_of: Callable[[WorkerProcess], NcclProgress | None] | None = None,
    ) -> None:
        self.fixed_timeout_s = timeout_s  # None: auto
        self.multi_node = multi_node
        self.clock = clock
        if stack_of is None:  # where py-spy cannot attach, stacks come after an abort
            stack_of = read_stack if stack_source() == "py-spy" else _unreadable
        self.stack_of = stack_of
        self.progress_of = progress_of or nccl_progress
        self.progress: dict[int, NcclProgress] = {}  # by pid, at the last sample
        self.activity: dict[int, _Activity] = {}
        self.longest_spell_s = 0.0  # the longest all-idle spell that ended by itself
        self.spell_s = 0.0
        self.spell_awaited_network = False  # this spell's culprits were given three timeouts
        self.next_sample = clock()
        self.next_check = 0.0  # when a spell's stacks may be read (again)
        self.last_look: tuple[tuple[int, str], ...] = ()  # this spell's last states read
        self.view: NodeView | None = None  # several nodes: this node's idle spell, judged
        self.node_rank = 0
        self.node = ""
        self.wall: Callable[[], float] = time.time

    @property
    def timeout_s(self) -> float:
        if self.fixed_timeout_s is not None:
            return self.fixed_timeout_s
        return max(HANG_FLOOR_S, 2 * self.longest_spell_s)

    def due_in(self) -> float:
        return max(0.0, self.next_sample - self.clock())

    def look_again_at(self, when: float) -> None:
        """The caller set a verdict aside for a reason that lapses at ``when`` (by this
        watch's clock): look again then, not a whole timeout later. The worker API's hang
        rule sets aside a culprit whose status moved within a timeout, and the agent sees a
        status a beat late: without this, half the hangs were named after two timeouts."""
        self.next_check = min(self.next_check, when)
        self.next_sample = min(self.next_sample, when)

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
        self.progress = {w.pid: p for w in live if (p := self.progress_of(w)) is not None}
        for worker in live:
            cpu, in_io, running = tree_cpu(worker.pid)
            nccl = self.progress.get(worker.pid)
            ops = nccl.operations if nccl is not None else -1
            seen = self.activity.get(worker.pid)
            if seen is None:
                self.activity[worker.pid] = _Activity(cpu, now, now, ops)
                continue
            # on the run queue counts as use: on a loaded host a working rank may get too
            # little CPU in a sample to count, and it must not look like one that waits
            used_cpu = cpu - seen.cpu_s > IDLE_CPU_FRACTION * SAMPLE_S or running
            if used_cpu:
                seen.cpu_at = now
            # CPU without NCCL calls may be a host thread spinning in a CUDA wait for a
            # collective: quiet, as far as a hang goes (the verdict tells it from work)
            spinning = ops >= 0 and ops == seen.nccl_ops
            if in_io or (used_cpu and not spinning):
                seen.busy_at = now
            seen.cpu_s = cpu
            seen.nccl_ops = ops
        idle_s = now - max(self.activity[w.pid].busy_at for w in live
                           if w.pid in self.activity)
        if idle_s < self.spell_s:  # someone worked again: the spell ended by itself
            if not self.spell_awaited_network:  # a late reply has its own allowance
                self.longest_spell_s = max(self.longest_spell_s, self.spell_s)
            self.spell_awaited_network = False
            self.next_check = 0.0
            self.last_look = ()
            self.view = None
        self.spell_s = idle_s
        # the first of the verdict's two looks comes a sample before the timeout, so that
        # the second, which decides, comes at it
        if idle_s < self.timeout_s - SAMPLE_S or now < self.next_check:
            return None
        return self._judge(live, idle_s, now)

    def _judge(self, live: list[WorkerProcess], idle_s: float, now: float) -> Hang | None:
        stacks = {w.pid: s for w in live if (s := self.stack_of(w.pid)) is not None}
        progress = {w.pid: self.progress[w.pid] for w in live if w.pid in self.progress}
        nccl = {pid: p.inside for pid, p in progress.items() if p.inside is not None}
        late = late_workers(progress)
        working = {w.pid for w in live if now - self.activity[w.pid].cpu_at <= 1.5 * SAMPLE_S}
        look = tuple((w.pid, _state(w.pid, stacks, nccl), w.pid in late, w.pid in working)
                     for w in live)
        if look != self.last_look:
            # A verdict needs two looks, a sample apart, that agree: at the end of a slow
            # step a rank can be read still in its sleep while its peer, awake a moment
            # earlier, already waits for it in the next collective (its CPU since the
            # sample too little to count).
            self.last_look = look
            self.next_check = now + SAMPLE_S
            return None
        if idle_s < self.timeout_s:  # two looks agree, but the spell is not long enough yet
            self.next_check = now + SAMPLE_S
            return None
        self.next_check = now + self.timeout_s  # judged: look again after another timeout
        if self.multi_node:
            self.view = self._view(live, idle_s, stacks, nccl, progress, working)
        if late:
            if working & late.keys():
                return None  # a late rank still computes: a slow step of its own
            culprits = tuple(w for w in live if w.pid in late)
            if self._awaiting_network(culprits, stacks, idle_s, now):
                return None
            ahead = tuple(w for w in live if w.pid not in late)
            first = late[culprits[0].pid]
            where = {w.pid: waiting_where(progress[w.pid], first) for w in ahead
                     if w.pid in progress}
            return Hang("hung", culprits, ahead, idle_s, stacks, {**nccl, **where}, late)
        if working:
            return None  # CPU used without NCCL calls, nobody behind: computing
        if nccl and len(nccl) == len(live) and len(set(nccl.values())) == 1 \
                and not self.multi_node:
            # every rank inside the same call: a collective that never completes
            return Hang("hung", (), tuple(live), idle_s, stacks, nccl)
        if any(w.pid not in stacks and w.pid not in nccl for w in live):
            if idle_s >= 3 * self.timeout_s:
                return Hang("hung", (), (), idle_s, stacks, nccl)
            return None

        waiting, culprits = _split(live, stacks, nccl)
        if not waiting or any(w.pid in stacks and stacks[w.pid].forming_group
                              for w in waiting):
            return None  # a slow step, or a group still forming: torch's own timeout
        if culprits:
            if self._awaiting_network(culprits, stacks, idle_s, now):
                return None
            return Hang("hung", culprits, waiting, idle_s, stacks, nccl)
        if self.multi_node:
            return None  # the rank they wait for is on another node: its node names it
        if idle_s < 3 * self.timeout_s:  # nobody to name: three timeouts
            self.next_check = now + SAMPLE_S
            return None
        return Hang("hung", (), waiting, idle_s, stacks, nccl)

    def _awaiting_network(self, culprits: Sequence[WorkerProcess], stacks: dict[int, Stack],
                          idle_s: float, now: float) -> bool:
        """Whether to wait longer for culprits that all await another host's reply (their
        stacks in Python's network I/O): until three timeouts, looking every sample."""
        if not all(w.pid in stacks and stacks[w.pid].awaits_network for w in culprits):
            return False
        self.spell_awaited_network = True
        if idle_s >= 3 * self.timeout_s:
            return False
        self.next_check = now + SAMPLE_S
        return True

    def _view(self, live: list[WorkerProcess], idle_s: float, stacks: dict[int, Stack],
              nccl: dict[int, str], progress: dict[int, NcclProgress],
              working: set[int]) -> NodeView:
        workers = []
        for worker in live:
            stack = stacks.get(worker.pid)
            state = _state(worker.pid, stacks, nccl)
            if worker.pid in nccl:
                where = f"waiting in {nccl[worker.pid]}"
            else:
                where = stack.where if stack is not None else "stack not readable"
            counts = progress[worker.pid].collectives if worker.pid in progress else {}
            workers.append(WorkerView(worker.rank, worker.pid, state, where,
                                      stack.text() if stack and state == "own" else "",
                                      counts, worker.pid in working,
                                      state == "own" and stack is not None
                                      and stack.awaits_network))
        wall = self.wall()
        return NodeView(self.node_rank, self.node, wall - idle_s, wall,
                        any(s.forming_group for s in stacks.values()), tuple(workers))


def _unreadable(pid: int) -> None:
    return None


def _split(live: Sequence[WorkerProcess], stacks: dict[int, Stack], nccl: dict[int, str]
           ) -> tuple[tuple[WorkerProcess, ...], tuple[WorkerProcess, ...]]:
    """(waiting in communication, idle in their own code), of workers whose state is known."""
    waiting = tuple(w for w in live if _state(w.pid, stacks, nccl) == "waiting")
    return waiting, tuple(w for w in live if _state(w.pid, stacks, nccl) == "own")


def name_after_abort(hang: Hang, group: Sequence[WorkerProcess], timeout_s: float = 5.0
                     ) -> Hang:
    """A hang decided without stacks (py-spy cannot attach here): abort every live worker
    with SIGABRT, on which Python's fault handler (``PYTHONFAULTHANDLER``, set by the
    launcher on such hosts) writes its threads' stacks to stderr; read them and apply the
    single-node rules. Returns ``hang`` with the culprits named where the dumps allow, else
    unchanged but for the stacks; unchanged where stacks were read (or could be: py-spy) or
    the worker was frozen. Never raises; workers that do not end within ``timeout_s`` are
    left to the caller's stop."""
    if hang.kind != "hung" or hang.stacks or stack_source() != "faulthandler":
        return hang
    live = [w for w in group if w.poll() is None]
    for worker in live:
        worker.stopped_by_agent = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGABRT)
    deadline = time.monotonic() + timeout_s
    while any(w.poll() is None for w in live) and time.monotonic() < deadline:
        wait_any(live, deadline - time.monotonic())
    join_pumps(live, max(0.1, deadline - time.monotonic()))
    stacks = {w.pid: s for w in live
              if (s := stack_from_fault_dump(w.pid, list(w.stderr_tail))) is not None}
    waiting, culprits = _split(live, stacks, hang.nccl)
    if waiting and culprits and len(stacks) == len(live):
        return Hang("hung", culprits, waiting, hang.idle_s, stacks, hang.nccl)
    return replace(hang, stacks=stacks)


def _state(pid: int, stacks: dict[int, Stack], nccl: dict[int, str]) -> str:
    """"waiting" (in torch's communication or an NCCL call), "own" (its code), "unknown"."""
    if pid in nccl:
        return "waiting"
    stack = stacks.get(pid)
    if stack is None:
        return "unknown"
    return "waiting" if stack.waiting else "own"


def tree_cpu(pid: int) -> tuple[float, bool, bool]:
    """CPU seconds of ``pid`` and its descendants, whether one is in uninterruptible I/O (a
    checkpoint write), and whether one's main thread is running or waits for a CPU; a
    process that is gone counts as nothing."""
    total, in_io, running = 0.0, False, False
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, False, False
    for proc in procs:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                total += times.user + times.system
                status = proc.status()
        except psutil.Error:
            continue
        in_io = in_io or status == psutil.STATUS_DISK_SLEEP
        running = running or status == psutil.STATUS_RUNNING
    return total, in_io, running


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
        services.events.emit(  # the hang began when the last worker went quiet
            Event.FAILURE, generation=generation.number, cause=detail, kind=hang.kind,
            happened=detected - hang.idle_s,
            rank=hang.culprits[0].rank if hang.culprits else None,
            pid=hang.culprits[0].pid if hang.culprits else None,
            culprits=[w.rank for w in hang.culprits], waiting=[w.rank for w in hang.waiting],
            idle_s=round(hang.idle_s, 2), detected=detected,
            stacks={w.rank: hang.stacks[w.pid].text() for w in group if w.pid in hang.stacks},
        )
    release_nccl(services, group)


def release_nccl(services: AgentServices, group: Sequence[WorkerProcess]) -> None:
    """Abort every live worker's NCCL communicators through its shim, so that the stop
    that follows is not stuck behind a collective."""
    for worker in group:
        if worker.shim is not None and worker.poll() is None:
            with contextlib.suppress(ShimError, OSError):
                worker.shim.abort_all(timeout_s=services.config.abort_timeout_s)
