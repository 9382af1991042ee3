"""In-process regroup, each agent's side: keep the survivors, replace or drop the failed.

When the workers use the worker API (:mod:`ftrun.worker`), a fault does not stop the job.
Every agent runs a :class:`RegroupSupervisor` for its own member processes
(:mod:`ftrun.agent.members` has their states), and the leader (the agent that hosts the
store; on one node, the agent itself) is the one writer of member epochs
(:mod:`ftrun.agent.leader`). They talk through the control store (:mod:`ftrun.protocol`,
read and written through :mod:`ftrun.agent.membership`):

* an agent whose member exits non-zero or by a signal, is stopped (SIGSTOP, a tracer),
  stops its heartbeat (a wedged process) writes the member generation's end *first* (so the
  survivors' failing collective is explained), kills the member, and appends a fault
  record; the leader does the same for a member that stops reporting steps while the others
  wait for it (its main thread sleeps: only the leader sees every member's progress) and,
  on several nodes, for every member of a node whose agent stopped beating;
* every agent that sees a member epoch end aborts its own survivors' NCCL communicators
  through the shim (every communicator they made so far) and says so; the leader publishes
  the next epoch of survivors, topped up with ready spares, once every surviving node has
  (so no communicator of the new epoch is made before the abort and aborted with the old);
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
import time
from collections.abc import Iterable
from typing import Any

from ftrun import protocol as P
from ftrun.agent import processes as local
from ftrun.agent.hangs import HangWatch, announce_hang, name_after_abort
from ftrun.agent.launcher import WorkerStartError
from ftrun.agent.leader import RegroupLeader, StopJob
from ftrun.agent.memberhangs import MemberHangs, Seen
from ftrun.agent.members import LocalMember, MemberState
from ftrun.agent.membership import Membership
from ftrun.agent.nodes import health_refusal
from ftrun.agent.outcome import (
    GenerationResult,
    Outcome,
    describe_cause,
    mark_root_cause,
    restart_all_words,
)
from ftrun.agent.services import AgentServices
from ftrun.agent.stacks import Stack, read_stack, stack_source
from ftrun.control.endwatch import EndWatcher, ReadEnd
from ftrun.control.errors import StoreError
from ftrun.control.rendezvous import Generation, StoreLostError
from ftrun.decide.crashloop import Failure, signature
from ftrun.observe.events import Event, WorkerExit, describe_returncode
from ftrun.shim import ShimError, ShimTimeoutError

Step = Outcome | GenerationResult | None  # what one look at the job decided


#: Replacements of one node that may fail before it stops replacing (a replacement that
#: cannot start, e.g. a broken node, must not spawn processes forever).
MAX_REPLACEMENT_FAILURES = 3


def wants_replacement(on_failure: str, replacement_failures: int, job_done: bool) -> bool:
    """Whether a member taken out gets a new process: under ``--on-failure replace``, while
    the job is not done and its replacements have not failed too often (``shrink`` goes on
    with fewer ranks)."""
    return (on_failure == "replace" and replacement_failures <= MAX_REPLACEMENT_FAILURES
            and not job_done)


def free_local_rank(held: Iterable[int]) -> int:
    """The ``LOCAL_RANK`` of a member this node starts: the lowest its live members do not
    hold (see :meth:`_RegroupRun._spawn`)."""
    taken = set(held)
    return next(i for i in range(len(taken) + 1) if i not in taken)


class RegroupSupervisor:
    """Runs each job generation with in-process regroup; see the module docstring."""

    def __init__(self, services: AgentServices) -> None:
        self.services = services

    def run(self, generation: Generation) -> GenerationResult:
        with self.services.end_watch(generation) as watcher:
            return _RegroupRun(self.services, generation, watcher).run()


class _RegroupRun:
    """One job generation's regroup on this node: its members, and the leader's part."""

    def __init__(self, services: AgentServices, generation: Generation,
                 end_watcher: EndWatcher | ReadEnd) -> None:
        self.services = services
        self.config = services.config
        self.generation = generation
        self.end_watcher = end_watcher  # the job generation's end
        self.multi = services.multi_node
        self.node_rank = services.node_rank
        self.prefix = P.regroup_prefix(self.config.rdzv_id, generation.number)
        self.m = Membership(services.generation_store(generation, self.prefix), services.say)
        self.members: dict[str, LocalMember] = {}
        self.released: set[int] = set()  # ended epochs whose communicators we aborted
        own = generation.node(services.node_id)
        self.standby = own is not None and own.standby  # --standby-nodes: no rank of its own
        self.gated: set[int] = set()  # ended epochs this standby ran its health gate after
        self.pool_sent: P.Pool | None = None
        self.next_member = 0
        self.first_failure: local.WorkerProcess | None = None
        self.replacement_failures = 0
        self.crash_seen: set[int] = set()  # pids whose failure the crash-loop rule saw
        # members' hangs: this node's rules for them (ftrun.agent.memberhangs)
        self.member_hangs = MemberHangs(hang_timeout_s=self.config.hang_timeout_s,
                                        multi_node=self.multi)
        # Scripts without the worker API fall back to a restart: they get its hang watch.
        self.hangs = None if self.config.hang_timeout_s == 0 else HangWatch(
            timeout_s=self.config.hang_timeout_s, multi_node=self.multi)
        self.leader = RegroupLeader(
            self.m, generation, self.config, events=services.events, say=services.say,
            rdzv=services.rdzv, nodes=services.nodes, once=services.once,
        ) if services.rdzv.is_leader else None

    # --- lifecycle -----------------------------------------------------------------------

    def run(self) -> GenerationResult:
        inbox = self.services.inbox
        try:
            for _ in range(self.config.nproc_per_node):
                self._spawn(initial=True)
            for _ in range(self.config.spares):
                self._spawn(initial=False)
        except WorkerStartError:
            self._stop_all(signal.SIGTERM, "a worker could not start")
            local.join_pumps([x.process for x in self.members.values()])
            raise
        try:
            if self.leader is not None:
                self.leader.publish_initial()
            while True:
                if inbox.received is not None:
                    self._stop_all(inbox.received, "signal")
                    return GenerationResult(Outcome.SIGNALED, self._exits())
                try:
                    result = self._tick()
                except StoreError:
                    if not self._follow_moved_store():
                        raise
                    continue
                if result is not None:
                    return result
                procs = [x.process for x in self.members.values() if x.process.poll() is None]
                woke = local.wait_any(procs, self.config.monitor_interval_s,
                                      [inbox.fd, *self.end_watcher.wake_fds()])
                if inbox.fd in woke:
                    inbox.drain()
        except StoreError as error:
            self._stop_all(signal.SIGTERM, "store lost")
            gone = self.services.writer_gone(self.generation)  # etcd-v3: its store's host
            if gone is not None:
                return GenerationResult(Outcome.REMOTE_FAILED, self._exits(), gone)
            if self.multi:
                raise StoreLostError(self.services.store_lost() or str(error)) from None
            self.services.say(f"control store failed: {error}", style="red")
            return GenerationResult(Outcome.FAILED, self._exits())
        finally:
            local.join_pumps([x.process for x in self.members.values()])

    def _tick(self) -> GenerationResult | None:
        # etcd-v3: this agent took the dead writer's place during this generation
        if self.leader is None and self.services.rdzv.is_leader and self.multi \
                and not self._follow_moved_store():
            raise StoreError("the job's writer died and no store replaced its own")
        if self.multi:
            result = self._watch_job()
            if result is not None:
                return result
        outcome = self.m.follow(self._apply_fault)
        if outcome is None:
            outcome = self._watch_members()
        if outcome is None:
            outcome = self._watch_hangs()
        if outcome is not None:
            return self._result(outcome)
        self._release_ended()
        self._answer_gate()
        self._send_pool()
        if self.leader is not None:
            verdict = self.leader.tick()
            if verdict is not None:
                return self._stop_job(verdict)
        if self.m.done:
            active = [x for x in self.members.values()
                      if self._is_active(x) and not self._waiting(x)]
            if all(x.process.poll() is not None for x in active):
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
        services, generation = self.services, self.generation
        lost = services.store_lost()
        if lost is not None:
            self._stop_all(signal.SIGTERM, "store lost")
            raise StoreLostError(lost)
        cause = services.rdzv.ended(generation.number) if self.end_watcher.end_may_exist \
            else None
        if cause is None and self.leader is not None:
            cause = self.leader.watch_nodes()
        if cause is not None:
            services.say(f"generation {generation.number} ended by node "
                         f"{cause.get('by', cause.get('node_rank'))}: {describe_cause(cause)}")
            if cause.get("kind") == "escalate":
                self._say_stacks("the escalation")
            self._stop_all(signal.SIGTERM, "remote failure")
            return GenerationResult(Outcome.REMOTE_FAILED, self._exits(), cause)
        return None

    def _end_job_generation(self, cause: dict[str, Any]) -> None:
        """Stop the whole job's generation (every agent restarts its workers)."""
        if not self.multi:
            return
        services = self.services
        services.rdzv.end(self.generation.number, {
            **cause, "node_rank": self.node_rank, "node_id": services.node_id,
            "node": services.hostname, "by": self.node_rank, "time": time.time()})

    def _stop_job(self, verdict: StopJob) -> GenerationResult:
        """The job cannot go on in-process: every agent restarts, or gives up (the cause's
        ``kind`` says which: ``refused`` and ``crash loop`` end the job, see agent/loop.py)."""
        self.services.say(verdict.reason, style="red")
        cause = {"kind": "regroup", "reason": verdict.reason, **verdict.cause}
        if cause.get("kind") == "escalate":
            self._say_stacks("the escalation")
        self._end_job_generation(cause)
        self._stop_all(signal.SIGTERM, verdict.reason)
        return GenerationResult(Outcome.FAILED, self._exits(), cause)

    def _follow_moved_store(self) -> bool:
        """etcd-v3: the job's writer died with this generation's member-epoch store. Wait
        (up to three heartbeat timeouts) for the store that replaces it: one this agent
        serves, if it took the writer's place (it seeds it as the regroup leader), or the
        one the new writer announced. Then carry what this agent knows over to it, give its
        live members' last statuses there (their heartbeats reconnect meanwhile: not a
        silence), and hand the address down to the workers. False when none came (the
        generation then ends as for a lost store)."""
        services = self.services
        if self.config.rdzv_backend != "etcd-v3" or not self.multi:
            return False  # the store never moves: losing its host ends the generation
        deadline = time.monotonic() + 3 * self.config.heartbeat_timeout_s
        moved = services.moved_store(self.generation, self.prefix)
        while moved is None:
            if time.monotonic() >= deadline or services.inbox.received is not None \
                    or services.store_lost() is not None:
                return False
            time.sleep(0.1)
            moved = services.moved_store(self.generation, self.prefix)
        old, latest = self.m, self.m.latest
        if latest is None:
            return False
        self.m = Membership(moved.store, services.say)
        self.m.latest, self.m.statuses, self.m.removed = latest, old.statuses, old.removed
        self.m.lost_nodes, self.m.done = old.lost_nodes, old.done
        # A worker's beat blocked on the dead store ends once the worker sees the address
        # handed down below (worker/membership.py _StoreFollower: within 0.1 s, then a
        # reconnect of at most 2 s), or at the latest at its request bound (10 s): silence
        # counts from that bound. A bound, not a measured figure: a surviving worker was
        # silent at most 1.34 s after a move, and no test fails without it
        # (tests/MUTATIONS.md).
        since = time.monotonic() + 10.0
        for member in self.members.values():
            status = old.statuses.get(member.id)
            if member.live and status is not None:
                self.m.store.set_record(P.status_key(member.id), status.to_json())
            member.alive_at = since
        if moved.took_over:
            self.leader = RegroupLeader(
                self.m, self.generation, self.config, events=services.events,
                say=services.say, rdzv=services.rdzv, nodes=services.nodes,
                once=services.once)
            self.leader.take_over(latest, moved.lost)
        elif self.leader is not None:
            self.leader.m = self.m
        self.pool_sent = None
        moved.announce()
        return True

    # --- this node's members -------------------------------------------------------------

    def _spawn(self, *, initial: bool) -> LocalMember:
        """Start member ``<node rank>.<next number>``. Its ``LOCAL_RANK`` is the lowest
        that no live member of this node holds (``LOCAL_WORLD_SIZE`` stays the node's
        ``--nproc-per-node``, as torchrun sets it): the initial workers 0..N-1, then the
        spares N, N+1, ...; on a standby node (no initial workers) spare i is local rank i,
        the local rank of the worker it replaces on a node like it; a replacement takes
        the one its failed member freed. A process keeps its local rank (its GPU) for its
        life: a spare that takes a lost rank does not move to the lost worker's device."""
        number = self.next_member
        self.next_member += 1
        member_id = P.member_id(self.node_rank, number)
        process = self.services.launcher.spawn_worker(
            self.generation, free_local_rank(x.process.local_rank
                                             for x in self.members.values() if x.live),
            member=P.MemberEnv(member_id, self.prefix, initial),
            prefix=f"[rank{self.generation.rank_offset(self.node_rank) + number}]:"
            if initial else f"[member{member_id}]:",
            log_name=str(number) if initial else f"member_{member_id}",  # torchrun's layout
        )
        member = LocalMember(member_id, process, initial)
        self.members[member_id] = member
        return member

    def _is_active(self, member: LocalMember) -> bool:
        """In the latest member epoch, and not taken out."""
        return (self.m.latest is not None and member.state is not MemberState.REMOVED
                and self.m.latest.rank_of(member.id) is not None)

    def _waiting(self, member: LocalMember) -> bool:
        """A joiner that has not received the job's state yet."""
        assert self.m.latest is not None
        entry = next(x for x in self.m.latest.members if x.id == member.id)
        status = self.m.statuses.get(member.id)
        return entry.joiner and not (status is not None and status.synced)

    def _watch_members(self) -> Step:
        """Exits, frozen processes and silent heartbeats of this node's members."""
        now = time.monotonic()
        live = [x for x in self.members.values() if x.live]
        for member in live:  # a member is ready once its status exists: one check each
            if member.state is MemberState.STARTING and self.m.has_status(member.id):
                member.advance(MemberState.READY)
                member.alive_at = now  # its silence counts from here, not from its spawn
                self.services.events.emit(Event.READY, member=member.id,
                                          pid=member.process.pid)
        self._read_statuses([x.id for x in live if x.state is MemberState.READY])
        for member in live:
            status = self.m.statuses.get(member.id)
            if status is not None and status.beats != member.beats \
                    and member.process.shim is None:
                member.beats, member.alive_at = status.beats, now
            shim = member.process.shim
            if shim is not None:  # native: keeps counting while the GIL is held elsewhere
                with contextlib.suppress(ShimError, OSError, ValueError):
                    ticks = shim.liveness()
                    if ticks != member.native_liveness:
                        member.native_liveness, member.alive_at = ticks, now
        for member in live:
            code = member.process.poll()
            if code is not None:
                outcome = self._exited(member, code)
            elif member.process.is_frozen():
                outcome = self._fault(member, "frozen (stopped by a signal)", kill=True)
            elif (member.state is MemberState.READY
                  and now - member.alive_at > self.config.liveness_timeout_s
                  and not self._said_finished(member)):  # its beats end with its loop
                outcome = self._fault(member, "heartbeat lost", kill=True)
            else:
                continue
            if outcome is not None:
                return outcome
        return None

    def _watch_hangs(self) -> Step:
        """A script without the worker API (no member ever became ready) that hangs: the
        restart path's verdict (see ftrun.agent.hangs), then the restart fallback. Members
        of the worker API: :meth:`_watch_member_hangs`."""
        if any(x.has_status for x in self.members.values()):
            return self._watch_member_hangs()
        if self.hangs is None:
            return None
        initial = {x.process.pid: x for x in self.members.values() if x.live and x.initial}
        hang = self.hangs.sample([x.process for x in initial.values()])
        if hang is None:
            return None
        hang = name_after_abort(hang, [x.process for x in initial.values()])
        detected = time.time()
        announce_hang(self.services, self.generation, hang,
                      [x.process for x in initial.values()], detected,
                      emit=not hang.culprits)  # _fault records a named culprit
        if hang.culprits:  # never ready and initial: _fault ends the job generation
            return self._fault(initial[hang.culprits[0].pid], f"hung: {hang.describe()}",
                               kill=True, happened=detected - hang.idle_s)
        return self._stop_job(StopJob(f"hung: {hang.describe()}"))

    def _watch_member_hangs(self) -> Step:
        """A member of the worker API that hangs in its own code (ftrun.agent.memberhangs):
        taken out and replaced in process."""
        seen = {x.id: Seen(x.process, status, self._is_active(x) and not self._waiting(x))
                for x in self.members.values()
                if x.live and x.state is not MemberState.REMOVED
                and (status := self.m.statuses.get(x.id)) is not None}
        for hung in self.member_hangs.look(self.m.latest, seen):
            outcome = self._fault(self.members[hung.member], hung.cause, kill=True,
                                  happened=time.time() - hung.idle_s)
            if outcome is not None:
                return outcome
        return None

    def _said_finished(self, member: LocalMember) -> bool:
        """The member left its training loop (``close()``): its process is only exiting."""
        status = self.m.statuses.get(member.id)
        return status is not None and status.finished

    def _exited(self, member: LocalMember, code: int) -> Step:
        said_finished = self._said_finished(member)
        if self._is_active(member) and (code == 0 or said_finished):
            member.advance(MemberState.FINISHED)
            self.services.events.emit(Event.EXIT, member=member.id, pid=member.process.pid,
                                      returncode=code)
            if code != 0:
                self.services.say(f"member {member.id} (pid {member.process.pid}) finished "
                                  f"training, then exited with {describe_returncode(code)}",
                                  style="yellow")
            if not said_finished:  # a script that never called close(): say it for it
                self.m.say_finished(member.id)
            return None
        cause = describe_returncode(code)
        return self._fault(member, cause, final=self._crash_loop(member, cause))

    def _say_stacks(self, when: str) -> None:
        """Where each live member of this node is, said before the workers stop: a recovery
        that passed its deadline named nobody, and these stacks are what tells why."""
        if stack_source() != "py-spy":
            return
        for member in self.members.values():
            if not member.live or member.process.is_frozen():
                continue
            stack = read_stack(member.process.pid, timeout_s=2.0)
            if stack is not None:
                rank = self.m.rank_of(member.id)
                label = f"rank {rank}" if rank is not None else f"member {member.id}"
                self.services.say(f"{label} (member {member.id}, pid {member.process.pid}) "
                                  f"at {when} (most recent call last):\n{stack.text()}")

    def _stack_before_kill(self, member: LocalMember, cause: str) -> Stack | None:
        """Where a member the leader took out as stuck or stalled was (its Python stack,
        read before the kill, where py-spy may attach): the line that says why it never
        left, for the person reading and for the event."""
        if not cause.startswith(("stuck", "stalled")) or member.process.poll() is not None \
                or member.process.is_frozen() or stack_source() != "py-spy":
            return None
        return read_stack(member.process.pid, timeout_s=2.0)

    def _crash_loop(self, member: LocalMember, cause: str) -> StopJob | None:
        """A member that failed on its own, and the others of its epoch that did too before
        it was seen (a script failing on every rank at once): the same error again is the
        script's bug (ftrun.decide.crashloop), said in a ``crash_loop`` event and, when the
        job stops, one line."""
        latest = self.m.latest
        failed = [member] + [x for x in self.members.values() if x is not member
                             and x.state is not MemberState.REMOVED
                             and x.process.poll() not in (None, 0)
                             and not x.process.stopped_by_agent]
        for one in failed:
            if one.process.pid in self.crash_seen:
                continue
            self.crash_seen.add(one.process.pid)
            rank = latest.rank_of(one.id) if latest is not None else None
            message = self.services.launcher.worker_exit(one.process, 0, first=False).message
            status = self.m.statuses.get(one.id)
            code = one.process.returncode
            verdict = self.services.crash_loop.observe(Failure(
                rank, signature(cause if one is member else describe_returncode(code or 0),
                                message),
                step=status.steps if status else None,
                world=latest.world_size if latest else None,
                epoch=latest.number if latest else None))
            if verdict is not None:
                self.services.events.emit(Event.CRASH_LOOP, rank=verdict.rank, member=one.id,
                                          signature=verdict.signature, count=verdict.count,
                                          everyone=verdict.everyone)
                return StopJob(f"stopping: {verdict.describe()}", {
                    "kind": "crash loop", "rank": verdict.rank,
                    "signature": verdict.signature})
        return None

    def _fault(self, member: LocalMember, cause: str, *, kill: bool = False,
               reported: bool = False, happened: float | None = None,
               final: StopJob | None = None) -> Step:
        """Take a member of this node out: end its epoch, kill it, tell the leader.
        ``happened``: when the fault began, where the verdict came later (a hang: when the
        last worker went quiet); by default the process's exit, else the verdict.
        ``final``: the job stops for good instead of recovering (a crash loop)."""
        services, latest = self.services, self.m.latest
        detected = time.time()
        active = self._is_active(member)
        if active and not reported:
            assert latest is not None
            self.m.end(latest.number, {"member": member.id, "cause": cause})
        if member.state is MemberState.STARTING and self.m.has_status(member.id):
            member.advance(MemberState.READY)  # the cached state may be a tick old
        initial_without_api = member.state is MemberState.STARTING and member.initial
        member.advance(MemberState.REMOVED, cause)
        self.m.removed[member.id] = cause
        stack = self._stack_before_kill(member, cause) if kill else None
        # stuck inside torch's communication: a casualty of the recovery in progress (a
        # collective its ended epoch left it in, which nothing released), not a fault
        casualty = cause.startswith("stuck") and stack is not None and stack.waiting
        if kill:  # after the end is written: survivors that fail next find it explained
            member.process.signal_group(signal.SIGKILL)
        if self.first_failure is None:
            self.first_failure = member.process
        rank = self.m.rank_of(member.id)
        services.events.emit(
            Event.FAILURE, member=member.id, pid=member.process.pid, cause=cause,
            generation=self.generation.number, epoch=latest.number if latest else 0,
            detected=detected, rank=rank, local_rank=member.process.local_rank,
            returncode=member.process.returncode,
            happened=happened or member.process.ended or detected,
            **({"stack": stack.text()} if stack is not None else {}),
            **({"casualty": True} if casualty else {}),
        )
        label = f"rank {rank}" if active else f"member {member.id}"
        if cause.startswith("frozen"):
            services.say(f"{label} (pid {member.process.pid}) was frozen; killed it at once",
                         style="yellow")
        elif casualty:
            assert stack is not None
            services.say(f"{label} (pid {member.process.pid}) {cause}; {stack.where}: a "
                         "casualty of the recovery in progress, replaced", style="yellow")
        else:
            services.say(f"{label} (pid {member.process.pid}) failed: {cause}", style="yellow")
        if stack is not None:
            services.say(f"{label} stack (most recent call last):\n{stack.text()}")
        if final is not None:
            return self._stop_job(final)
        if initial_without_api and active:
            services.say("the failed worker never called ftrun.init(): " + restart_all_words(
                self.generation.restart_count, self.config.max_restarts))
            self._end_job_generation({"kind": "worker", "rank": rank, "member": member.id,
                                      "pid": member.process.pid,
                                      "returncode": member.process.returncode,
                                      "cause": cause})
            self._stop_all(signal.SIGTERM, "restart fallback")
            return Outcome.FAILED
        if not reported:
            self.m.append_fault(P.Fault(cause, member=member.id))
        if not active:
            self.replacement_failures += 1
        self._replace()
        return None

    def _replace(self) -> None:
        if wants_replacement(self.config.on_failure, self.replacement_failures, self.m.done):
            self._spawn(initial=False)

    def _abort_communicators(self, epoch: int) -> None:
        """Release this node's survivors stuck in an NCCL collective of member epoch
        ``epoch`` (see the module docstring for the order). A shim that cannot finish in
        time means a worker wedged in NCCL: it is killed."""
        assert self.m.latest is not None
        for entry in self.m.latest.members:
            member = self.members.get(entry.id)
            if member is None or member.state is MemberState.REMOVED:
                continue
            shim = member.process.shim
            if shim is None or member.process.poll() is not None:
                continue
            try:
                report = shim.abort_all(timeout_s=self.config.abort_timeout_s)
            except ShimTimeoutError:
                self.services.say(f"member {entry.id}: NCCL abort timed out; killing it")
                member.process.signal_group(signal.SIGKILL)
                continue
            except ShimError:
                continue
            if report.entries:
                self.services.events.emit(Event.ABORT, member=entry.id,
                                          generation=self.generation.number, epoch=epoch,
                                          report=report.to_dict())

    def _release_ended(self) -> None:
        """Abort this node's communicators of an ended member epoch, then say so."""
        latest = self.m.latest
        if latest is None or latest.number in self.released:
            return
        if not self.m.epoch_ended(latest.number):
            return
        self.released.add(latest.number)
        self._abort_communicators(latest.number)
        self.m.confirm_released(latest.number, self.node_rank)

    def _answer_gate(self) -> None:
        """A standby node, once per ended member epoch (the moment the leader may give its
        spares a lost node's ranks): run the health gate again (ftrun/doctor/gate.py,
        bounded by its 2 s) and write the answer the leader waits for before it promotes
        them (protocol.gate_key); a failure is said here too."""
        latest = self.m.latest
        if not self.standby or latest is None or latest.number not in self.released \
                or latest.number in self.gated:
            return
        self.gated.add(latest.number)
        failures = health_refusal()
        self.m.answer_gate(self.node_rank, latest.number, failures)
        if failures:
            self.services.say(f"this standby node failed its health gate after member epoch "
                              f"{latest.number} ended, so it takes no lost node's ranks: "
                              f"{failures}", style="yellow")

    def _send_pool(self) -> None:
        live = [x for x in self.members.values() if x.live and x.process.poll() is None]
        pool = P.Pool(tuple(x.id for x in live),
                      frozenset(x.id for x in live if x.state is MemberState.READY),
                      frozenset(x.id for x in self.members.values()
                                if x.state is MemberState.FINISHED))
        if pool != self.pool_sent:
            self.m.send_pool(self.node_rank, pool)
            self.pool_sent = pool

    # --- what the others wrote -----------------------------------------------------------

    def _apply_fault(self, fault: P.Fault) -> Step:
        if fault.node is not None:
            self.m.lost_nodes.add(fault.node)
            if fault.node == self.node_rank:  # declared lost while alive (a partition)
                self.services.say("the leader declared this node lost: stopping its workers "
                                  "and asking to join again", style="yellow")
                self._stop_all(signal.SIGTERM, "node dropped")
                cause = {"kind": "dropped", "node_rank": self.node_rank,
                         "reason": f"the leader left this node out ({fault.cause})"}
                return GenerationResult(Outcome.REMOTE_FAILED, self._exits(), cause)
            return None
        assert fault.member is not None
        self.m.removed.setdefault(fault.member, fault.cause)
        member = self.members.get(fault.member)
        if member is not None and member.live:  # the leader's verdict on our member
            return self._fault(member, fault.cause, kill=fault.kill, reported=True)
        return None

    def _read_statuses(self, members: list[str]) -> None:
        """One ``multi_get`` for the status of ``members`` (and, on the leader, of every
        member it watches)."""
        wanted = set(members) | (self.leader.watched() if self.leader else set())
        known = self.leader.reported() if self.leader else set()
        known |= {x.id for x in self.members.values() if x.has_status}
        self.m.read_statuses(wanted, known)

    # --- endings -------------------------------------------------------------------------

    def _stop_all(self, sig: int, why: str) -> None:
        procs = [x.process for x in self.members.values() if x.process.poll() is None]
        self.services.launcher.stop_workers(procs, sig, why)
        local.reap_leftovers([x.process for x in self.members.values()])

    def _exits(self) -> list[WorkerExit]:
        """Cause records in the agent's vocabulary: the error file's message for a worker
        that failed on its own, the supervisor's verdict for one it took out."""
        epoch = self.m.latest.number if self.m.latest else 0
        exits = []
        for member in self.members.values():
            proc = member.process
            if proc.returncode is None:
                continue
            cause = member.removed_cause
            verdict = cause if cause and not cause.startswith(("exit code", "killed by")) \
                else None
            exits.append(self.services.launcher.worker_exit(
                proc, epoch, first=proc is self.first_failure, verdict=verdict))
        return mark_root_cause(exits)
