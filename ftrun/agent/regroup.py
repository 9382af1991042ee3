"""In-process regroup, the agents' side: keep the survivors, replace or drop the failed.

When the workers use the worker API (:mod:`ftrun.worker`), a fault does not stop the job.
Every agent runs a :class:`RegroupSupervisor` for its own member processes, and the leader
(the agent that hosts the store; on one node, the agent itself) is the one writer of member
generations. They talk through the control store (:mod:`ftrun.protocol`):

* an agent whose member exits non-zero or by a signal, is stopped (SIGSTOP, a tracer),
  stops its heartbeat (a wedged process) writes the member generation's end *first* (so the
  survivors' failing collective is explained), kills the member, and appends a fault
  record; the leader does the same for a member that stops reporting steps while the others
  wait for it (its main thread sleeps: only the leader sees every member's progress) and,
  on several nodes, for every member of a node whose agent stopped beating;
* every agent that sees a generation end aborts its own survivors' NCCL communicators
  through the shim and says so; the leader publishes the next generation of survivors,
  topped up with ready spares, once every surviving node has (so no communicator of the
  new generation is made under the old number and aborted with the old ones);
* with ``--on-failure replace`` the failed member's agent starts a new process; the
  survivors do not wait for it (importing torch takes seconds): it joins at a later step
  boundary when ready and receives the state from a survivor; with ``shrink``, and for the
  members of a lost node, the job goes on with fewer ranks down to ``--min-workers`` and
  ``MIN`` nodes;
* scripts that never called ``ftrun.init()`` cannot regroup: with ``--recovery auto`` the
  generation of the whole job ends and every agent restarts its workers (torchrun's way).

Detection bounds (defaults): exit at once; SIGSTOP within one monitor interval (0.1 s);
a stopped heartbeat after ``--liveness-timeout`` (5 s, counted from the worker's
``ftrun.init()``: an import can starve a process for over a second on a busy node); a
stalled rank after max(``--stall-floor`` 5 s, 20 x the median step time); a lost node after
``--heartbeat-timeout``. Progress is (committed steps, collectives issued), reported by
the worker's heartbeat thread: a member is attributed a stall only when the others have
reported more than it has; a hang that every rank shares (inside one collective) is left to
the collective timeout on gloo and to the shim on NCCL.

Store cost per agent and monitor interval: one counter read (the ``changes`` counter says
whether anything else needs reading), one ``multi_get`` of its own members' status, and on
several nodes one check of the job generation's end. The leader also reads every member's
status once per interval.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftrun import protocol as P
from ftrun.agent import processes as local
from ftrun.agent.events import WorkerExit, describe_returncode, read_error_file
from ftrun.agent.outcome import GenerationResult, Outcome, describe_cause
from ftrun.control.endwatch import EndWatcher, ReadEnd
from ftrun.control.rendezvous import StoreLostError
from ftrun.control.store import StoreError, StoreValueError
from ftrun.shim import ShimError, ShimTimeoutError

if TYPE_CHECKING:
    from ftrun.agent.loop import Agent
    from ftrun.control.rendezvous import Generation, Rendezvous


@dataclass
class Slot:
    """One of this node's member processes and what its agent knows of it."""

    member: str
    process: local.WorkerProcess
    initial: bool
    heartbeat: int = 0
    native_liveness: int = -1
    heartbeat_at: float = field(default_factory=time.monotonic)
    ready: bool = False
    finished: bool = False  # exited 0 (or crashed after saying it finished) as a member
    removed: str | None = None  # why it was taken out


@dataclass
class Progress:
    """The leader's view of one member's progress."""

    value: tuple[int, int] = (-1, -1)  # (committed steps, collectives issued)
    changed_at: float = field(default_factory=time.monotonic)
    step_at: float = field(default_factory=time.monotonic)


class RegroupSupervisor:
    """Runs one job generation with in-process regroup; see the module docstring."""

    def __init__(self, agent: Agent, generation: Generation, rdzv: Rendezvous) -> None:
        self.agent = agent
        self.config = agent.config
        self.generation = generation
        self.rdzv = rdzv
        self.multi = not self.config.is_single_node
        self.node_rank = agent.node_rank
        self.prefix = f"ftrun/{agent.run_id}/rg{generation.number}"
        self.store = rdzv.store.scoped(self.prefix)
        self.slots: dict[str, Slot] = {}
        self.latest: P.MemberGeneration | None = None
        self.statuses: dict[str, P.Status] = {}
        self.removed: dict[str, str] = {}  # every member taken out, job-wide: id -> cause
        self.lost_nodes: set[int] = set()
        self.released: set[int] = set()  # ended generations whose communicators we aborted
        self.ended_here: set[int] = set()  # generations whose end this agent wrote
        self.end_checked = -1  # the change count at the last look for an end
        self.done = False
        self.changes_seen = -1
        self.faults_seen = 0
        self.fault_missing = (-1, 0.0)  # (index, since when) of a counted, unwritten fault
        self.pool_sent: P.Pool | None = None
        self.next_member = 0
        self.failures: list[Slot] = []
        self.first_failure: local.WorkerProcess | None = None
        self.replacement_failures = 0
        self.leader = _Leader(self) if rdzv.is_leader else None
        self.end_watcher: EndWatcher | ReadEnd = ReadEnd()  # the job generation's end

    # --- lifecycle -----------------------------------------------------------------------

    def run(self) -> GenerationResult:
        if self.multi:
            self.end_watcher = self.agent.end_watcher(self.rdzv, self.generation)
        try:
            return self._run()
        finally:
            self.agent.stop_end_watcher(self.end_watcher)

    def _run(self) -> GenerationResult:
        for _ in range(self.config.nproc_per_node):
            self._spawn(initial=True)
        for _ in range(self.config.spares):
            self._spawn(initial=False)
        try:
            if self.leader is not None:
                self.leader.publish_initial()
            while True:
                if self.agent.inbox.received is not None:
                    self._stop_all(self.agent.inbox.received, "signal")
                    return GenerationResult(Outcome.SIGNALED, self._exits())
                result = self._tick()
                if result is not None:
                    return result
                procs = [s.process for s in self.slots.values() if s.process.poll() is None]
                woke = local.wait_any(procs, self.config.monitor_interval_s,
                                      [self.agent.inbox.fd, *self.end_watcher.wake_fds()])
                if self.agent.inbox.fd in woke:
                    self.agent.inbox.drain()
        except StoreError as error:
            self._stop_all(signal.SIGTERM, "store lost")
            if self.multi:
                raise StoreLostError(self.agent._lost_reason() or str(error)) from None
            self.agent.say(f"control store failed: {error}", style="red")
            return GenerationResult(Outcome.FAILED, self._exits())
        finally:
            local.join_pumps([s.process for s in self.slots.values()])

    def _tick(self) -> GenerationResult | None:
        if self.multi:
            result = self._watch_job()
            if result is not None:
                return result
        outcome = self._follow()
        if outcome is None:
            outcome = self._watch_members()
        if outcome is not None:
            return self._result(outcome)
        self._release_ended()
        self._send_pool()
        if self.leader is not None:
            outcome = self.leader.tick()
            if outcome is not None:
                return self._result(outcome)
        if self.done:
            active = [s for s in self.slots.values()
                      if self._is_active(s) and not self._waiting(s)]
            if all(s.process.poll() is not None for s in active):
                self._stop_all(signal.SIGTERM, "job finished")
                return GenerationResult(Outcome.SUCCEEDED, self._exits())
        return None

    def _result(self, outcome: Outcome | GenerationResult) -> GenerationResult:
        if isinstance(outcome, GenerationResult):
            return outcome
        return GenerationResult(outcome, self._exits())

    # --- the job around this node (several nodes) ----------------------------------------

    def _watch_job(self) -> GenerationResult | None:
        """The job generation: ended by another agent (a restart, a join), this agent's
        store host lost, and on the leader a lost node or a newcomer."""
        agent, rdzv, generation = self.agent, self.rdzv, self.generation
        lost = agent._lost_reason()
        if lost is not None:
            self._stop_all(signal.SIGTERM, "store lost")
            raise StoreLostError(lost)
        cause = rdzv.ended(generation.number) if self.end_watcher.end_may_exist else None
        if cause is None and self.leader is not None:
            cause = self.leader.watch_nodes()
        if cause is not None:
            agent.say(f"generation {generation.number} ended by node "
                      f"{cause.get('by', cause.get('node_rank'))}: {describe_cause(cause)}")
            self._stop_all(signal.SIGTERM, "remote failure")
            return GenerationResult(Outcome.REMOTE_FAILED, self._exits(), cause)
        return None

    def end_job_generation(self, cause: dict[str, Any]) -> dict[str, Any]:
        """Stop the whole job's generation (every agent restarts its workers)."""
        if not self.multi:
            return cause
        return self.rdzv.end(self.generation.number, {
            **cause, "node_rank": self.node_rank, "node_id": self.agent.node_id,
            "node": self.agent.hostname, "by": self.node_rank, "time": time.time()})

    # --- this node's members -------------------------------------------------------------

    def _spawn(self, *, initial: bool) -> Slot:
        number = self.next_member
        self.next_member += 1
        member = P.member_id(self.node_rank, number)
        extra = {
            "FTRUN_MEMBER_ID": member,
            "FTRUN_REGROUP_PREFIX": self.prefix,
            "FTRUN_INITIAL": "1" if initial else "0",
        }
        process = self.agent.spawn_worker(
            self.generation, number if initial else 0, extra_env=extra,
            prefix=f"[rank{self.generation.rank_offset(self.node_rank) + number}]:"
            if initial else f"[member{member}]:",
            log_name=str(number) if initial else f"member_{member}",  # torchrun's layout
        )
        slot = Slot(member, process, initial)
        self.slots[member] = slot
        return slot

    def _is_active(self, slot: Slot) -> bool:
        return (self.latest is not None and slot.removed is None
                and self.latest.rank_of(slot.member) is not None)

    def _waiting(self, slot: Slot) -> bool:
        """A joiner that has not received the job's state yet."""
        assert self.latest is not None
        member = next(m for m in self.latest.members if m.id == slot.member)
        status = self.statuses.get(slot.member)
        return member.joiner and not (status is not None and status.synced)

    def _watch_members(self) -> Outcome | GenerationResult | None:
        """Exits, frozen processes and silent heartbeats of this node's members."""
        now = time.monotonic()
        live = [s for s in self.slots.values() if s.removed is None and not s.finished]
        for slot in live:  # a member is ready once its status exists: one check each
            if not slot.ready and self.store.exists(P.status_key(slot.member)):
                slot.ready = True
                self.agent.events.emit("ready", member=slot.member, pid=slot.process.pid)
        self._read_statuses([s.member for s in live if s.ready])
        for slot in live:
            status = self.statuses.get(slot.member)
            if status is not None and status.beats != slot.heartbeat \
                    and slot.process.shim is None:
                slot.heartbeat, slot.heartbeat_at = status.beats, now
            shim = slot.process.shim
            if shim is not None:  # native: keeps counting while the GIL is held elsewhere
                with contextlib.suppress(ShimError, OSError, ValueError):
                    ticks = shim.liveness()
                    if ticks != slot.native_liveness:
                        slot.native_liveness, slot.heartbeat_at = ticks, now
        for slot in live:
            code = slot.process.poll()
            if code is not None:
                outcome = self._exited(slot, code)
            elif slot.process.is_frozen():
                outcome = self._fault(slot, "frozen (stopped by a signal)", kill=True)
            elif (slot.ready and now - slot.heartbeat_at > self.config.liveness_timeout_s
                  and not self._said_finished(slot)):  # its beats end with its loop
                outcome = self._fault(slot, "heartbeat lost", kill=True)
            else:
                continue
            if outcome is not None:
                return outcome
        return None

    def _said_finished(self, slot: Slot) -> bool:
        """The member left its training loop (``close()``): its process is only exiting."""
        status = self.statuses.get(slot.member)
        return status is not None and status.finished

    def _exited(self, slot: Slot, code: int) -> Outcome | None:
        status = self.statuses.get(slot.member)
        said_finished = self._said_finished(slot)
        if self._is_active(slot) and (code == 0 or said_finished):
            slot.finished = True
            self.agent.events.emit("exit", member=slot.member, pid=slot.process.pid,
                                   returncode=code)
            if code != 0:
                self.agent.say(f"member {slot.member} (pid {slot.process.pid}) finished "
                               f"training, then exited with {describe_returncode(code)}",
                               style="yellow")
            if not said_finished:  # a script that never called close(): say it for it
                last = status or P.Status(0, 0, 0, True, False)
                self.store.set_record(P.status_key(slot.member), P.Status(
                    last.beats + 1, last.steps, last.collectives, last.synced, True).to_json())
                self._changed()
            return None
        return self._fault(slot, describe_returncode(code))

    def _fault(self, slot: Slot, cause: str, *, kill: bool = False,
               reported: bool = False) -> Outcome | None:
        """Take a member of this node out: end its generation, kill it, tell the leader."""
        detected = time.time()
        active = self._is_active(slot)
        assert self.latest is not None or not active
        if active and not reported:
            assert self.latest is not None
            self._end(self.latest.number, {"member": slot.member, "cause": cause})
        slot.removed = cause
        self.removed[slot.member] = cause
        if kill:  # after the end is written: survivors that fail next find it explained
            slot.process.signal_group(signal.SIGKILL)
        if self.first_failure is None:
            self.first_failure = slot.process
        self.failures.append(slot)
        number = self.latest.number if self.latest else 0
        rank = self.latest.rank_of(slot.member) if self.latest else None
        self.agent.events.emit(
            "failure", member=slot.member, pid=slot.process.pid, cause=cause,
            generation=number, detected=detected, rank=rank,
            local_rank=slot.process.local_rank, returncode=slot.process.returncode,
        )
        label = f"rank {rank}" if active else f"member {slot.member}"
        if cause.startswith("frozen"):
            self.agent.say(f"{label} (pid {slot.process.pid}) was frozen; killed it at once",
                           style="yellow")
        else:
            self.agent.say(f"{label} (pid {slot.process.pid}) failed: {cause}", style="yellow")
        if not slot.ready:  # the cached flag may be a tick old: ask the store
            slot.ready = self.store.exists(P.status_key(slot.member))
        if not slot.ready and slot.initial and active:
            self.agent.say("the failed worker never called ftrun.init(): restarting all")
            self.end_job_generation({"kind": "worker", "rank": rank, "member": slot.member,
                                     "pid": slot.process.pid,
                                     "returncode": slot.process.returncode,
                                     "cause": cause})
            self._stop_all(signal.SIGTERM, "restart fallback")
            return Outcome.FAILED
        if not reported:
            self._append_fault(P.Fault(cause, member=slot.member))
        if not active:
            self.replacement_failures += 1
        self._replace()
        return None

    def _replace(self) -> None:
        if self.config.on_failure != "replace" or self.replacement_failures > 3 or self.done:
            return
        self._spawn(initial=False)

    def _abort_communicators(self, number: int) -> None:
        """Release this node's survivors stuck in an NCCL collective of generation
        ``number`` (see the module docstring for the order). A shim that cannot finish in
        time means a worker wedged in NCCL: it is killed."""
        assert self.latest is not None
        for member in self.latest.members:
            slot = self.slots.get(member.id)
            if slot is None or slot.removed is not None:
                continue
            shim = slot.process.shim
            if shim is None or slot.process.poll() is not None:
                continue
            try:
                report = shim.abort(number + 1, timeout_s=self.config.abort_timeout_s)
            except ShimTimeoutError:
                self.agent.say(f"member {member.id}: NCCL abort timed out; killing it")
                slot.process.signal_group(signal.SIGKILL)
                continue
            except ShimError:
                continue
            if report.entries:
                self.agent.events.emit("abort", member=member.id, generation=number + 1,
                                       report=report.to_dict())

    def _release_ended(self) -> None:
        """Abort this node's communicators of an ended generation, then say so."""
        latest = self.latest
        if latest is None or latest.number in self.released:
            return
        if latest.number not in self.ended_here:
            if self.end_checked == self.changes_seen:
                return  # nothing was written since the last look
            self.end_checked = self.changes_seen
            if self.store.first_record(P.end_key(latest.number)) is None:
                return
        self.released.add(latest.number)
        self._abort_communicators(latest.number)
        self.store.set_record(P.released_key(latest.number, self.node_rank), {})
        self._changed()

    def _send_pool(self) -> None:
        live = [s for s in self.slots.values() if s.removed is None and not s.finished
                and s.process.poll() is None]
        pool = P.Pool(tuple(s.member for s in live),
                      frozenset(s.member for s in live if s.ready),
                      frozenset(s.member for s in self.slots.values() if s.finished))
        if pool != self.pool_sent:
            self.store.set_record(P.pool_key(self.node_rank), pool.to_json())
            self.pool_sent = pool
            self._changed()

    # --- what the others wrote -----------------------------------------------------------

    def _follow(self) -> Outcome | GenerationResult | None:
        """Read what changed in the store: faults, the latest generation, the job's end."""
        changes = self.store.add(P.CHANGES, 0)
        if changes == self.changes_seen:
            return None
        self.changes_seen = changes
        count = self.store.add(P.FAULTS, 0)
        while self.faults_seen < count:
            record = self.store.first_record(P.fault_key(self.faults_seen))
            if record is None and not self._skip_missing_fault():
                self.changes_seen = -1  # counted, not written yet: look again next tick
                break
            self.faults_seen += 1
            if record is None:
                continue
            try:
                fault = P.Fault.from_json(record)
            except StoreValueError as error:
                self.agent.say(f"ignored an invalid fault record: {error}", style="yellow")
                continue
            outcome = self._apply_fault(fault)
            if outcome is not None:
                return outcome
        record = self.store.get_record(P.LATEST)
        number = record.get("number") if record else None
        if isinstance(number, int) and (self.latest is None or number > self.latest.number):
            generation = self.store.get_record(P.generation_key(number))
            if generation is not None:
                self.latest = P.MemberGeneration.from_json(generation)
        if not self.done and self.store.first_record(P.DONE) is not None:
            self.done = True
        return None

    def _skip_missing_fault(self) -> bool:
        """Whether to pass over a fault index that holds no valid record: a writer appends
        its record right after counting it, so one that stays empty (or holds only
        records without the job's secret) for a second was counted by someone else."""
        now = time.monotonic()
        if self.fault_missing[0] != self.faults_seen:
            self.fault_missing = (self.faults_seen, now)
        return now - self.fault_missing[1] > 1.0

    def _apply_fault(self, fault: P.Fault) -> Outcome | GenerationResult | None:
        if fault.node is not None:
            self.lost_nodes.add(fault.node)
            if fault.node == self.node_rank:  # declared lost while alive (a partition)
                self.agent.say("the leader declared this node lost: stopping its workers "
                               "and asking to join again", style="yellow")
                self._stop_all(signal.SIGTERM, "node dropped")
                cause = {"kind": "dropped", "node_rank": self.node_rank,
                         "reason": f"the leader left this node out ({fault.cause})"}
                return GenerationResult(Outcome.REMOTE_FAILED, self._exits(), cause)
            return None
        assert fault.member is not None
        self.removed.setdefault(fault.member, fault.cause)
        slot = self.slots.get(fault.member)
        if slot is not None and slot.removed is None:  # the leader's verdict on our member
            return self._fault(slot, fault.cause, kill=fault.kill, reported=True)
        return None

    def _read_statuses(self, members: list[str]) -> None:
        """One ``multi_get`` for the status of ``members`` (and, on the leader, of every
        member it watches)."""
        wanted = sorted(set(members) | (self.leader.watched() if self.leader else set()))
        # torch's multi_get waits for a missing key: only read statuses known to exist.
        known = self.leader.reported() if self.leader else set()
        known |= {s.member for s in self.slots.values() if s.ready or s.finished}
        present = [m for m in wanted if m in self.statuses or m in known]
        if not present:
            return
        records = self.store.read_records([P.status_key(m) for m in present])
        for member, record in zip(present, records, strict=True):
            if record is None:
                continue  # not signed with the job's secret (said once per key)
            try:
                self.statuses[member] = P.Status.from_json(record)
            except StoreValueError:
                continue

    # --- writing -------------------------------------------------------------------------

    def _end(self, number: int, cause: dict[str, Any]) -> None:
        if number not in self.ended_here:
            self.ended_here.add(number)
            self.store.put_record(P.end_key(number), cause)
            self._changed()

    def _append_fault(self, fault: P.Fault) -> None:
        index = self.store.add(P.FAULTS, 1) - 1
        self.store.put_record(P.fault_key(index), fault.to_json())
        self._changed()

    def _changed(self) -> None:
        self.store.add(P.CHANGES, 1)

    # --- endings -------------------------------------------------------------------------

    def stop_job(self, why: str, cause: dict[str, Any]) -> Outcome:
        """The job cannot go on in-process: every agent restarts (or gives up)."""
        self.agent.say(why, style="red")
        self.end_job_generation({"kind": "regroup", "reason": why, **cause})
        self._stop_all(signal.SIGTERM, why)
        return Outcome.FAILED

    def _stop_all(self, sig: int, why: str) -> None:
        procs = [s.process for s in self.slots.values() if s.process.poll() is None]
        self.agent.stop_workers(procs, sig, why)
        local.reap_leftovers([s.process for s in self.slots.values()])

    def _exits(self) -> list[Any]:
        """Cause records in the agent's vocabulary: the error file's message for a worker
        that failed on its own, the supervisor's verdict for one it took out."""
        exits = []
        for slot in self.slots.values():
            proc = slot.process
            if proc.returncode is None:
                continue
            message, traceback = read_error_file(Path(proc.launch.env["TORCHELASTIC_ERROR_FILE"]))
            verdict = slot.removed if slot.removed and not slot.removed.startswith(
                ("exit code", "killed by")) else None
            exits.append(WorkerExit(
                rank=proc.rank, local_rank=proc.local_rank, node=self.agent.hostname,
                pid=proc.pid, generation=self.latest.number if self.latest else 0,
                returncode=proc.returncode, time=proc.ended or time.time(),
                stopped_by_agent=proc.stopped_by_agent, first=proc is self.first_failure,
                message=verdict or message, traceback=traceback,
            ))
        return exits


class _Leader:
    """The leader's side: the one writer of member generations."""

    def __init__(self, supervisor: RegroupSupervisor) -> None:
        self.sup = supervisor
        self.pools: dict[int, P.Pool] = {}
        self.pools_seen = -1
        self.progress: dict[str, Progress] = {}
        self.step_intervals: deque[float] = deque(maxlen=64)
        self.waiting_since: float | None = None
        self.ready_checked: set[str] = set()  # failed members whose readiness was looked up
        self.finishing = False

    @property
    def latest(self) -> P.MemberGeneration:
        assert self.sup.latest is not None
        return self.sup.latest

    def watched(self) -> set[str]:
        return {m.id for m in self.sup.latest.members} if self.sup.latest else set()

    def reported(self) -> set[str]:
        """Members whose agents say their status exists (ready or finished)."""
        return set().union(*(pool.ready | pool.finished for pool in self.pools.values()))

    def publish_initial(self) -> None:
        members: list[P.Member] = []
        for node in sorted(self.sup.generation.nodes, key=lambda n: n.node_rank):
            for number in range(node.local_world_size):
                members.append(P.Member(P.member_id(node.node_rank, number), len(members),
                                        False))
        self.publish(members)

    def publish(self, members: list[P.Member]) -> None:
        sup = self.sup
        number = 0 if sup.latest is None else sup.latest.number + 1
        generation = P.MemberGeneration(number, tuple(members))
        sup.store.set_record(P.generation_key(number), generation.to_json())
        sup.store.set_record(P.LATEST, {"number": number})
        sup.latest = generation
        sup._changed()
        self.waiting_since = None
        now = time.monotonic()
        for progress in self.progress.values():  # a regroup is not a stall: count from here
            progress.changed_at = now
        sup.agent.events.emit(
            "generation", generation=number, world_size=generation.world_size,
            members=[m.id for m in members], joiners=[m.id for m in members if m.joiner],
        )

    # --- each tick -----------------------------------------------------------------------

    def tick(self) -> Outcome | None:
        self._read_pools()
        gone = [m for m in self.latest.members if self._gone(m.id)]
        if gone:
            return self._regroup(gone)
        self._admit_ready_joiners()
        self._watch_progress()
        self._check_done()
        return None

    def _gone(self, member: str) -> bool:
        return member in self.sup.removed or P.node_of(member) in self.sup.lost_nodes

    def _synced(self, member: P.Member) -> bool:
        status = self.sup.statuses.get(member.id)
        return not member.joiner or (status is not None and status.synced)

    def _regroup(self, gone: list[P.Member]) -> Outcome | None:
        sup, latest = self.sup, self.latest
        first = gone[0].id
        cause = sup.removed.get(first) or f"node {P.node_of(first)} lost"
        sup._end(latest.number, {"member": first, "cause": cause})
        survivors = [m for m in latest.members if not self._gone(m.id)]
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        unchecked = [m for m in gone if m.id not in self.ready_checked]  # once per member
        self.ready_checked.update(m.id for m in unchecked)
        never_ready = [m.id for m in unchecked if not m.joiner and m.id not in sup.statuses
                       and not sup.store.exists(P.status_key(m.id))]
        if never_ready:  # its agent saw it die before it knew the generation
            sup.agent.say(f"member {never_ready[0]} failed before it called ftrun.init(): "
                          "restarting all")
            return sup.stop_job("a worker without the worker API failed",
                                {"member": never_ready[0]})
        if not any(self._synced(m) for m in survivors):
            return sup.stop_job("no surviving member holds the job's state", {})
        # Every surviving node aborts its communicators of the ended generation first.
        nodes = sorted({P.node_of(m.id) for m in survivors} - sup.lost_nodes)
        confirmed = sup.store.present_records(
            [P.released_key(latest.number, n) for n in nodes])
        missing = [n for n in nodes if P.released_key(latest.number, n) not in confirmed]
        if missing:
            waited = time.monotonic() - self.waiting_since
            if waited < sup.config.abort_timeout_s + sup.config.heartbeat_timeout_s:
                return None
            sup.agent.say(f"nodes {missing} did not confirm their NCCL abort in {waited:.1f} s;"
                          " publishing the next generation anyway", style="yellow")
        members = [P.Member(m.id, rank, not self._synced(m)) for rank, m in enumerate(survivors)]
        members = self._top_up(members)
        live_nodes = {P.node_of(m.id) for m in members}
        if len(members) < sup.config.min_workers:
            return sup.stop_job(f"{len(members)} workers left, fewer than --min-workers "
                                f"{sup.config.min_workers}", {})
        if sup.multi and len(live_nodes) < sup.config.nnodes_min:
            return sup.stop_job(f"{len(live_nodes)} nodes left, fewer than the minimum "
                                f"{sup.config.nnodes_min}", {})
        self.publish(members)
        return None

    def _read_pools(self) -> None:
        sup = self.sup
        if self.pools_seen == sup.changes_seen:
            return
        self.pools_seen = sup.changes_seen
        nodes = [n.node_rank for n in sup.generation.nodes if n.node_rank not in sup.lost_nodes]
        found = sup.store.present_records([P.pool_key(n) for n in nodes])
        for node in nodes:
            record = found.get(P.pool_key(node))
            if record is None:
                continue
            try:
                self.pools[node] = P.Pool.from_json(record, node)
            except StoreValueError as error:
                sup.agent.say(f"ignored node {node}'s pool record: {error}", style="yellow")

    @property
    def target(self) -> int:
        """The world size the job aims for: every node's share, lost nodes aside."""
        return sum(n.local_world_size for n in self.sup.generation.nodes
                   if n.node_rank not in self.sup.lost_nodes)

    def _top_up(self, members: list[P.Member]) -> list[P.Member]:
        """Fill free ranks with ready, idle members (spares, replacements)."""
        self._read_pools()
        taken = {m.id for m in members}
        for node in sorted(self.pools):
            if node in self.sup.lost_nodes:
                continue
            for member in self.pools[node].members:
                if len(members) >= self.target:
                    return members
                if member in self.pools[node].ready and member not in taken \
                        and not self._gone(member):
                    members.append(P.Member(member, len(members), True))
                    taken.add(member)
        return members

    def _admit_ready_joiners(self) -> None:
        """A replacement that became ready joins at the survivors' next step boundary."""
        latest = self.latest
        if latest.world_size >= self.target or self.finishing:
            return
        members = self._top_up(list(latest.members))
        if len(members) == latest.world_size:
            return
        self.sup.store.put_record(P.join_key(latest.number), {"members": len(members)})
        self.sup.agent.say(f"a new member is ready: it joins at the next step "
                           f"({len(members)} ranks)")
        self.publish(members)

    # --- detection -----------------------------------------------------------------------

    def watch_nodes(self) -> dict[str, Any] | None:
        """Lost nodes become faults of all their members (the job generation goes on); a
        newcomer ends the job generation (everyone re-forms with it). Returns the job
        generation's end, if this ends it."""
        sup, agent = self.sup, self.sup.agent
        lost, join = agent.watch_other_nodes(sup.rdzv, sup.generation)
        for node, cause in lost:
            if node.node_rank in sup.lost_nodes:
                continue
            members = [m for m in self.latest.members if P.node_of(m.id) == node.node_rank]
            if any(not sup.store.exists(P.status_key(m.id)) for m in members):
                agent.say("the lost node's workers never called ftrun.init(): restarting all")
                return sup.rdzv.end(sup.generation.number, cause)
            agent.dropped_nodes.add(node.node_id)
            sup.lost_nodes.add(node.node_rank)
            if members:
                sup._end(self.latest.number, {"node": node.node_rank, "addr": node.addr,
                                              "cause": "node lost"})
            sup._append_fault(P.Fault(f"node lost: no heartbeat for {cause['silent_s']} s",
                                      node=node.node_rank))
        return sup.rdzv.end(sup.generation.number, join) if join is not None else None

    def _watch_progress(self) -> None:
        sup, now = self.sup, time.monotonic()
        active: list[tuple[str, Progress]] = []
        for member in self.latest.members:
            status = sup.statuses.get(member.id)
            if status is None:
                continue
            if status.finished:
                self.finishing = True  # a member left its loop: the job ends, admit no one
                continue
            if member.joiner and not status.synced:
                continue
            progress = self.progress.setdefault(member.id, Progress())
            reported = (status.steps, status.collectives)
            if reported != progress.value:
                if progress.value[0] >= 0 and reported[0] != progress.value[0]:
                    self.step_intervals.append(now - progress.step_at)
                    progress.step_at = now
                progress.value, progress.changed_at = reported, now
            active.append((member.id, progress))
        if len(active) < 2 or not self.step_intervals or self.finishing:
            return
        limit = max(sup.config.stall_floor_s, 20 * statistics.median(self.step_intervals))
        if now - max(p.changed_at for _, p in active) < limit:
            return
        lowest = min(p.value for _, p in active)
        if lowest == max(p.value for _, p in active):
            return  # everyone waits at the same step: not attributable to one rank
        for member, progress in active:
            if progress.value != lowest:
                continue
            cause = (f"stalled: no progress for {now - progress.changed_at:.1f}s "
                     f"(limit {limit:.1f}s) while the others issued more collectives")
            sup._end(self.latest.number, {"member": member, "cause": cause})
            sup._append_fault(P.Fault(cause, member=member, kill=True))
            sup.removed[member] = cause

    def _check_done(self) -> None:
        """Every member that holds the job's state left its loop: the job is over."""
        sup = self.sup
        if sup.done:
            return
        deciding = [m for m in self.latest.members if self._synced(m)]
        if deciding and all((s := sup.statuses.get(m.id)) is not None and s.finished
                            for m in deciding):
            sup.store.put_record(P.DONE, {"generation": self.latest.number})
            sup.done = True
            sup._changed()
