"""Executing injected faults on this node: ``--inject SPEC`` and ``ftrun inject`` requests.

An :class:`Injector` runs beside the agent's loop in a thread of its own. It learns which
process holds which rank, the job's committed steps and its first step from the agent's
own events (:meth:`EventLog.add_listener`: spawn, epoch, exit, failure, progress), fires
the scheduled faults that target this node's workers when they are due, and executes the
requests that ``ftrun inject`` writes into the control store.

Every fault is announced with an ``inject`` event *before* the signal is sent, so its
record (ftrun.observe.faults) counts from the injection: ``happened`` is when ftrun acted,
``detected`` when the agent noticed.

``cut-link`` is executed by the agent of the named node on its own host: an iptables chain
of its own (``FTRUN_CUT``) drops every packet in and out except loopback, and a detached
``sh`` (in a session of its own, so that it outlives this agent, which a cut usually ends)
removes the rules after ``for`` seconds. It is refused with one line unless this process
runs in a named network namespace (made by ``ip netns add``: the namespace test hosts,
tests/infra/netns.py): a real machine, or a container's own network, never loses its link
to a test spec. An ``ftrun inject``
request for it is answered before the cut (afterwards the store is out of reach).

Store keys (under the job's prefix ``ftrun/<run id>``, signed like every control record):
``inject/next`` (a counter: ``ftrun inject`` takes the next number), ``inject/<n>`` (the
request: a :class:`ftrun.client.faultspec.Fault`), ``inject/<n>/done/<node rank>`` (the result:
``{"ok": bool, "detail": str}``). The leader also keeps ``ftrun/job`` (outside the run's
prefix, so that a client given only HOST:PORT finds it): the run id, world size and nodes.
On etcd-v3, which many jobs share, the writer keeps it under the run's prefix instead
(``ftrun/<run id>/job``), and the agent that takes a dead writer's place keeps it from then
on (:meth:`Injector.keep_job`).
A request whose signature fails is refused by the store wrapper (said once, a
``rejected`` event) and never executed. A store error is not said: the thread opens a new
client after ``RETRY_S`` (the job's own loop notices a lost store and ends the agent).

Timeouts and cost: each store request is bounded by the client's request timeout; the
thread looks at its schedule every 0.1 s, and at the store (one ``add`` of 0) every
0.25 s on the leader (a single node's agent) and every 2 s on the other agents, so a
request reaches a worker on another node within about 2 s. Only the leader sees the job's
steps: another node's agent with scheduled faults still due reads the step from the job
record every 0.25 s instead (a step trigger fires there up to ~1.3 s late: the record is
refreshed every second, and at once when the world changes).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ftrun.client.faultspec import DEFAULT_CUT_S, NODE_KINDS, Fault, FaultSpecError, Schedule
from ftrun.control.errors import StoreError
from ftrun.control.store import JsonStore
from ftrun.observe.events import Event, EventLog

#: The key (under the ``ftrun`` prefix) that names the job to ``ftrun inject``/``status``.
JOB_KEY = "job"
#: Signals a script handles to take an injected hang or raise (scripts/train_elastic.py).
HANG_SIGNAL = signal.SIGUSR1
RAISE_SIGNAL = signal.SIGUSR2
TICK_S = 0.1
POLL_STORE_S = 0.25  # the leader
POLL_STORE_OTHERS_S = 2.0  # every other agent (the store's load grows with the nodes)
JOB_EVERY_S = 1.0  # the leader refreshes the job's record (ftrun status reads it)
RETRY_S = 2.0  # after a store error, before the thread's next client


CUT_CHAIN = "FTRUN_CUT"


def cut_link_refusal() -> str | None:
    """Why this host's link may not be cut (one line), or None when it may: this process
    must run in a named network namespace (ip netns), with iptables installed."""
    if named_netns() is None:
        return ("cut-link acts only on a host in a named network namespace of its own "
                "(ip netns: the namespace test hosts); refused on this machine's network")
    if _iptables() is None:
        return "cut-link needs iptables on this host (scripts/install_test_services.sh)"
    return None


def named_netns() -> str | None:
    """The ``ip netns`` name of the network namespace this process runs in, or None (the
    machine's own network, a container's: anything not made with ``ip netns add``)."""
    try:
        mine = os.stat("/proc/self/ns/net")
        names = os.listdir("/run/netns")
    except OSError:
        return None
    for name in names:
        try:
            found = os.stat(f"/run/netns/{name}")
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino):
            return name
    return None


def _iptables() -> str | None:
    return shutil.which("iptables") or next(
        (p for p in ("/usr/sbin/iptables", "/sbin/iptables") if os.access(p, os.X_OK)), None)


def cut_link(for_s: float, timeout_s: float = 10.0) -> None:
    """Drop every non-loopback packet of this namespace for ``for_s`` seconds (see the
    module docstring); returns once the rules are in. Raises OSError (iptables missing or
    failing, within ``timeout_s`` per command)."""
    exe = _iptables()
    if exe is None:
        raise OSError("iptables not found")
    rules = [["-N", CUT_CHAIN], ["-A", CUT_CHAIN, "-j", "DROP"],
             ["-I", "INPUT", "!", "-i", "lo", "-j", CUT_CHAIN],
             ["-I", "OUTPUT", "!", "-o", "lo", "-j", CUT_CHAIN]]
    undo = (f"{exe} -w -D INPUT ! -i lo -j {CUT_CHAIN}; {exe} -w -D OUTPUT ! -o lo -j "
            f"{CUT_CHAIN}; {exe} -w -F {CUT_CHAIN}; {exe} -w -X {CUT_CHAIN}")
    for rule in rules:
        done = subprocess.run([exe, "-w", *rule], capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode != 0:
            subprocess.run(["sh", "-c", undo], capture_output=True, timeout=timeout_s)
            raise OSError(f"iptables {' '.join(rule)}: {done.stderr.strip()}")
    subprocess.Popen(["sh", "-c", f"sleep {for_s:.3f}; {undo}"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def request_key(number: int) -> str:
    return f"inject/{number}"


def done_key(number: int, node_rank: int) -> str:
    return f"inject/{number}/done/{node_rank}"


def handles_signal(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its /proc SigCgt mask)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


class Injector:
    """See the module docstring. ``node_rank`` reads this agent's node rank when asked."""

    def __init__(self, schedule: Schedule | None, events: EventLog,
                 say: Callable[..., None], node_rank: Callable[[], int]) -> None:
        self.schedule = schedule
        self.pending = list(enumerate(schedule.faults)) if schedule else []
        self.events = events
        self.say = say
        self.node_rank = node_rank
        self._lock = threading.Lock()
        self.member_pid: dict[str, int] = {}
        self.rank_pid: dict[int, int] = {}  # from spawn events (restart path, first epoch)
        self.epoch_members: list[str] = []  # the latest member epoch, in rank order
        self.gone: set[int] = set()  # pids that exited
        self.step = 0
        self.first_step_at: float | None = None
        self.world_size = 0
        self.nnodes = 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_s = POLL_STORE_S
        self._status: Callable[[], dict[str, Any]] | None = None
        self._job: dict[str, Any] | None = None  # the job's record, on the leader (keep_job)
        self._job_in_run = False
        events.add_listener(self.observe)

    # --- what the events say -------------------------------------------------------------

    def observe(self, record: dict[str, Any]) -> None:
        kind = record.get("event")
        with self._lock:
            if kind == Event.SPAWN.value:
                pid, rank, member = record.get("pid"), record.get("rank"), record.get("member")
                if isinstance(pid, int):
                    if isinstance(member, str):
                        self.member_pid[member] = pid
                    if isinstance(rank, int) and (member is None or not self.epoch_members):
                        self.rank_pid[rank] = pid
            elif kind == Event.EPOCH.value and isinstance(record.get("members"), list):
                self.epoch_members = [m for m in record["members"] if isinstance(m, str)]
                self.world_size = len(self.epoch_members)
            elif kind == Event.GENERATION.value:
                world, nnodes = record.get("world_size"), record.get("nnodes")
                if isinstance(world, int):
                    self.world_size = world
                if isinstance(nnodes, int):
                    self.nnodes = nnodes
                self.epoch_members = []
                self.rank_pid = {}
            elif kind in (Event.EXIT.value, Event.FAILURE.value):
                if isinstance(record.get("pid"), int):
                    self.gone.add(record["pid"])
            elif kind in (Event.PROGRESS.value, Event.FORMED.value):
                step = record.get("step")
                if isinstance(step, int):
                    self.step = max(self.step, step)
                    if step >= 1 and self.first_step_at is None:
                        self.first_step_at = time.monotonic()

    def pid_of(self, rank: int) -> int | None:
        """The live local process that holds ``rank`` now, or None."""
        with self._lock:
            pid = None
            if self.epoch_members and rank < len(self.epoch_members):
                pid = self.member_pid.get(self.epoch_members[rank])
            elif not self.epoch_members:
                pid = self.rank_pid.get(rank)
            if pid is None or pid in self.gone:
                return None
            return pid

    # --- the thread ----------------------------------------------------------------------

    def start(self, store: Callable[[], JsonStore] | None, job: dict[str, Any] | None,
              status: Callable[[], dict[str, Any]] | None = None, *,
              job_in_run: bool = False) -> None:
        """Start the thread. ``store`` opens this thread's own client (None: no requests);
        ``job``: the ``ftrun/job`` record to keep (the leader only), refreshed every
        second with ``status()`` (ftrun.observe.statusboard) for ``ftrun status``;
        ``job_in_run``: the record is the run's own ``job`` key (etcd-v3)."""
        self._job_in_run = job_in_run
        self._status = status
        self.keep_job(job)
        self._thread = threading.Thread(target=self._run, args=(store,),
                                        name="ftrun-inject", daemon=True)
        self._thread.start()

    def keep_job(self, job: dict[str, Any] | None) -> None:
        """Keep (from the thread's next look at the store) the job's record ``job``: the
        leader's duty, taken by an etcd-v3 agent that became the job's writer."""
        self._poll_s = POLL_STORE_S if job is not None or self.pending \
            else POLL_STORE_OTHERS_S
        self._job = job

    def _job_store(self, store: JsonStore) -> JsonStore:
        return store if self._job_in_run else store.scoped("ftrun")

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self, open_store: Callable[[], JsonStore] | None) -> None:
        store: JsonStore | None = None
        handled = 0
        next_poll = 0.0
        job_due = 0.0
        written: tuple[int, int] | None = None  # the world size and nodes the record says
        while not self._stop.wait(TICK_S):
            self._fire_due()
            # a new world is written at the next tick, not at the next refresh: ftrun inject
            # checks a rank against it (a fast request after a regroup was refused)
            job = self._job
            reshaped = job is not None and (self.world_size, self.nnodes) != written
            if open_store is None or (time.monotonic() < next_poll and not reshaped):
                continue
            next_poll = time.monotonic() + self._poll_s
            try:
                if store is None:
                    store = open_store()
                if job is not None and (time.monotonic() >= job_due or reshaped):
                    job_due = time.monotonic() + JOB_EVERY_S
                    written = (self.world_size, self.nnodes)
                    record = {**job, "world_size": self.world_size, "nnodes": self.nnodes}
                    if self._status is not None:
                        record.update(self._status())
                    self._job_store(store).set_record(JOB_KEY, record)
                elif job is None and self.pending:
                    self._read_job_step(store)
                handled = self._requests(store, handled)
            except StoreError:
                # one request that failed (etcd under load: a member slow past the request
                # bound) must not end injection for the rest of the job: a client of its
                # own again after a pause; a lost store is the agent's loop to act on
                store = None
                next_poll = time.monotonic() + max(self._poll_s, RETRY_S)

    def _read_job_step(self, store: JsonStore) -> None:
        """Another node's agent: the job's committed step from the leader's job record
        (only the leader sees progress), so that step and after triggers fire here too."""
        record = self._job_store(store).get_record(JOB_KEY)
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            self.observe({"event": Event.PROGRESS.value, "step": step})

    def _fire_due(self) -> None:
        if not self.pending:
            return
        for index, fault in list(self.pending):
            if not self._due(fault):
                continue
            if fault.random_rank and self.schedule is not None:
                rank = self.schedule.pick_rank(fault, index, self.world_size)
                fault = replace(fault, rank=rank, random_rank=False)
            if not self._mine(fault):
                continue  # another node's, or its rank is not in the job yet: stays due
            self.pending = [p for p in self.pending if p[0] != index]
            ok, detail = self.fire(fault)
            if not ok:
                self.say(f"--inject {fault.text!r}: {detail}", style="yellow")

    def _due(self, fault: Fault) -> bool:
        if fault.step is not None:
            return self.step >= fault.step
        if fault.after_s is not None:
            return self.first_step_at is not None and \
                time.monotonic() - self.first_step_at >= fault.after_s
        return True

    def _mine(self, fault: Fault) -> bool:
        if fault.kind in NODE_KINDS:
            return fault.node == self.node_rank()
        return fault.rank is not None and self.pid_of(fault.rank) is not None

    def _requests(self, store: JsonStore, handled: int) -> int:
        latest = store.add("inject/next", 0)
        while handled < latest:
            number = handled + 1
            if not store.exists(request_key(number)):
                break  # allocated, not written yet: look again next time
            handled = number
            record = store.get_record(request_key(number))
            if record is None:
                continue  # refused (bad signature): said by the store wrapper
            try:
                fault = Fault.from_json(record)
            except FaultSpecError as error:
                store.set_record(done_key(number, self.node_rank()),
                                 {"ok": False, "detail": str(error)})
                continue
            if not self._mine(fault):
                continue
            if fault.kind == "cut-link":  # answered first: the store is out of reach after
                refusal = cut_link_refusal()
                store.set_record(done_key(number, self.node_rank()), {
                    "ok": refusal is None, "detail": refusal or
                    f"cut-link node {fault.node} for {fault.for_s:g} s"})
                if refusal is None:
                    self.fire(fault)
                continue
            ok, detail = self.fire(fault)
            store.set_record(done_key(number, self.node_rank()), {"ok": ok, "detail": detail})
        return handled

    # --- acting --------------------------------------------------------------------------

    def fire(self, fault: Fault) -> tuple[bool, str]:
        """Inject ``fault`` now; (done, what was done or why not)."""
        if fault.kind == "kill-agent":
            self.events.emit(Event.INJECT, spec=fault.text, kind=fault.kind, node=fault.node,
                             pid=os.getpid())
            self.say(f"injected: kill-agent (pid {os.getpid()})", style="yellow")
            os.kill(os.getpid(), signal.SIGKILL)
            return True, "killed"
        if fault.kind == "cut-link":
            return self._cut(fault)
        assert fault.rank is not None
        pid = self.pid_of(fault.rank)
        if pid is None:
            return False, f"rank {fault.rank} is not running on this node"
        sig = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP, "hang": HANG_SIGNAL,
               "raise": RAISE_SIGNAL}[fault.kind]
        if fault.kind in ("hang", "raise") and not handles_signal(pid, sig):
            return False, (f"rank {fault.rank} (pid {pid}) does not handle {sig.name}: a "
                           f"{fault.kind} needs a script that does (see "
                           "scripts/train_elastic.py)")
        self.events.emit(Event.INJECT, spec=fault.text, kind=fault.kind, rank=fault.rank,
                         pid=pid)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False, f"rank {fault.rank} (pid {pid}) already exited"
        with contextlib.suppress(Exception):
            self.say(f"injected: {fault.kind} rank {fault.rank} (pid {pid})", style="yellow")
        return True, f"{fault.kind} rank {fault.rank} (pid {pid}) on node {self.node_rank()}"

    def _cut(self, fault: Fault) -> tuple[bool, str]:
        refusal = cut_link_refusal()
        if refusal is not None:
            return False, refusal
        seconds = fault.for_s or DEFAULT_CUT_S  # a request from the store may omit it
        self.events.emit(Event.INJECT, spec=fault.text, kind=fault.kind, node=fault.node,
                         for_s=seconds)
        try:
            cut_link(seconds)
        except (OSError, subprocess.SubprocessError) as error:
            return False, f"cut-link failed: {error}"
        with contextlib.suppress(Exception):
            self.say(f"injected: cut-link, this host is off the network for {seconds:g} s",
                     style="yellow")
        return True, f"cut-link node {fault.node} for {seconds:g} s"
