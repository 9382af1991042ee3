"""The regroup leader: the one writer of member epochs for the whole job.

The agent that hosts the control store (on one node, the agent itself) runs a
:class:`RegroupLeader` beside its own :class:`~ftrun.agent.regroup.RegroupSupervisor`.
Every tick it:

* regroups when a member of the latest epoch is gone (removed, or on a lost node): it ends the
  epoch, waits until every surviving node confirmed its NCCL abort (bounded by the abort and
  heartbeat timeouts), then publishes the survivors topped up with ready idle members (a
  standby node's only after its health gate, run again after the end, passed);
* admits a replacement or spare that became ready (the survivors take it at a step boundary);
* finds a stalled member: one whose progress stopped while others issued more collectives,
  for max(``--stall-floor``, 20 x the median step time);
* says the job is done when every member that holds the state left its loop.

Decisions it cannot carry out in process come back as a :class:`StopJob` for the supervisor
to act on (end the job generation: every agent restarts or gives up): fewer workers than
``--min-workers``, fewer nodes than MIN, no survivor holding the state, a failed member that
never called ``ftrun.init()``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftrun import protocol as P
from ftrun.agent.membership import Membership
from ftrun.agent.nodes import NodeWatch, say_refused
from ftrun.agent.outcome import restart_all_words
from ftrun.agent.stragglers import StragglerWatch
from ftrun.config import LaunchConfig
from ftrun.control.errors import StoreValueError
from ftrun.control.rendezvous import Generation, NodeSlot, Rendezvous
from ftrun.decide.deadline import RecoveryDeadline, auto_deadline_s, describe_setting
from ftrun.decide.progress import Observation, ProgressWatch
from ftrun.observe.events import Event, EventLog
from ftrun.observe.faults import ProgressReport
from ftrun.snapshot import records as snapshot_records

#: How long the leader waits, after a member epoch ended, for a standby node's health-gate
#: answer before it promotes that node's spares anyway: the gate's own bound (2 s,
#: ftrun.doctor.gate.DEFAULT_TIMEOUT_S; not imported: the doctor loads only where it runs)
#: and a margin for the standby to notice the end and write.
GATE_WAIT_S = 3.0


@dataclass(frozen=True)
class StopJob:
    """The job cannot go on in process: end the job generation."""

    reason: str
    cause: dict[str, Any] = field(default_factory=dict)


class RegroupLeader:
    """The leader's side of in-process regroup; see the module docstring."""

    def __init__(
        self,
        membership: Membership,
        generation: Generation,
        config: LaunchConfig,
        *,
        events: EventLog,
        say: Callable[..., None],
        rdzv: Rendezvous | None = None,
        nodes: NodeWatch | None = None,
        clock: Callable[[], float] = time.monotonic,
        once: Callable[[str], bool] = lambda key: True,
    ) -> None:
        self.m = membership
        self.generation = generation  # the job generation these member epochs belong to
        self.config = config
        self.events = events
        self.say = say
        self.rdzv = rdzv
        self.nodes = nodes  # several nodes only
        self.clock = clock  # monotonic seconds (a test drives its own)
        self.once = once  # whether a line said once per agent is due (AgentServices.once)
        self.pools: dict[int, P.Pool] = {}
        self.pools_seen = -1
        # A sharded job (ftrun.restartable) cannot shrink: a lost node's ranks are filled
        # with spares of the other nodes (read at the first regroup).
        self.whole_world = False
        # Who keeps the others waiting (ftrun.decide.progress), when each member epoch
        # ended as this leader saw it, and the recovery in progress with its deadline.
        self.watch = ProgressWatch(config.stall_floor_s)
        self.ended_at: dict[int, float] = {}
        # ended member epoch -> when a later one was published: the stuck rule's clock
        self.superseded_at: dict[int, float] = {}
        self.deadline = RecoveryDeadline(config.recovery_deadline_s)
        self.created_at = clock()
        self.start_s: float | None = None  # the first member epoch's workers' start
        self.whole_world_checked = False
        self.waiting_since: float | None = None
        self.ready_checked: set[str] = set()  # failed members whose readiness was looked up
        # Standby nodes' health gates (--standby-nodes): the ended member epoch whose gate
        # answers count, since when they are awaited, and the refusals already said.
        self.gate_epoch: int | None = None
        self.gate_since = 0.0
        self.gate_said: set[tuple[int, int]] = set()
        self.finishing = False
        self.took_over = False  # etcd-v3: formed on the store of a writer that died
        # The recovery record's half that only the leader sees: formed epochs, steps.
        marks = [f.step for f in config.inject.faults if f.step is not None] \
            if config.inject is not None else []
        self.report = ProgressReport(  # self.m, not the one of now: a moved store replaces it
            events, generation.number, lambda number: self.m.formed(number),
            self._last_commit, marks=marks)
        hosts = {n.node_rank: n.hostname for n in generation.nodes}
        self.stragglers = StragglerWatch(  # ranks that keep the others waiting
            policy=config.straggler_policy, factor=config.straggler_factor,
            window_s=config.straggler_window_s, events=events, say=say,
            node_name=lambda rank: hosts.get(rank, ""))

    @property
    def latest(self) -> P.MemberEpoch:
        assert self.m.latest is not None
        return self.m.latest

    def watched(self) -> set[str]:
        return {m.id for m in self.m.latest.members} if self.m.latest else set()

    def reported(self) -> set[str]:
        """Members whose agents say their status exists (ready or finished)."""
        return set().union(*(pool.ready | pool.finished for pool in self.pools.values()))

    def publish_initial(self) -> None:
        members: list[P.Member] = []
        for node in sorted(self.generation.nodes, key=lambda n: n.node_rank):
            for number in range(node.local_world_size):
                members.append(P.Member(P.member_id(node.node_rank, number), len(members),
                                        False))
        self.publish(members)

    def publish(self, members: list[P.Member],
                gone: list[dict[str, Any]] | None = None) -> None:
        number = 0 if self.m.latest is None else self.m.latest.number + 1
        epoch = P.MemberEpoch(number, tuple(members))
        self.m.publish(epoch)
        published = self.clock()
        for ended in range(number):
            self.superseded_at.setdefault(ended, published)
        self.waiting_since = None
        self.watch.restart_clocks(self.clock())  # a regroup is not a stall: count from here
        self.stragglers.reset()
        self.events.emit(
            Event.EPOCH, epoch=number, generation=self.generation.number,
            world_size=epoch.world_size, members=[m.id for m in members],
            joiners=[m.id for m in members if m.joiner], gone=gone or [],
        )
        self.report.published(number, epoch.world_size)

    def _last_commit(self, number: int, step: int, most: int = 10_000) -> int:
        """The committed steps when member epoch ``number`` ended, counted on from
        ``step`` (as a status reported it; the beats lag by a few): a step's decision key
        is the count before it (ftrun.worker), one ``check`` per step."""
        for _ in range(most):
            record = self.m.store.first_record(P.decision_key(number, step))
            if record is None or record.get("value") not in (P.COMMIT, P.COMMIT_REGROUP):
                return step
            step += 1
        return step

    # --- each tick -----------------------------------------------------------------------

    def tick(self) -> StopJob | None:
        self._read_pools()
        self._note_ends()
        verdict = self._escalate()
        if verdict is not None:
            return verdict
        gone = [m for m in self.latest.members if self.m.gone(m.id)]
        if gone:
            verdict = self._regroup(gone)
            self._note_ends()
            return verdict
        self._admit_ready_joiners()
        verdict = self._watch_progress()
        self._note_ends()
        if verdict is None:
            self._check_done()
        return verdict

    # --- the recovery deadline (ftrun.decide.deadline) -------------------------------------

    def _note_ends(self) -> None:
        """Member epochs this leader ended since the last look (every end of a fault passes
        through it: its regroup ends the latest epoch again): when, and the recovery's
        start."""
        new = [n for n in self.m.ended_here if n not in self.ended_at]
        if not new:
            return
        now = self.clock()
        for number in new:
            self.ended_at[number] = now
        self.deadline.fault(now, max(new), self.auto_deadline_s())

    def _superseded(self) -> dict[int, float]:
        """The stuck rule's clock per member epoch that a fault ended: from the publication
        of a later one. Only ended epochs: an epoch followed by one that admits a joiner goes
        on until its members' next step boundary, and a member that does not reach it is the
        stall rule's and the hang watch's (the soak: a hang there took out every member as
        stuck, and the job restarted). An epoch that ended before this leader took over has
        no publication time here: its end stands for it."""
        latest = self.m.latest.number if self.m.latest is not None else -1
        clocks = {}
        for number, ended in self.ended_at.items():
            if number in self.superseded_at:
                clocks[number] = max(ended, self.superseded_at[number])
            elif number < latest:
                clocks[number] = ended
        return clocks

    def auto_deadline_s(self) -> float:
        return auto_deadline_s(peer_write_s=self._peer_write_s, limit_s=self.watch.limit_s(),
                               start_s=self.start_s, step_s=self.watch.median_step_s)

    def _escalate(self) -> StopJob | None:
        """A recovery past its deadline: the job generation restarts (the ladder's next
        rung), said in one line and an ``escalate`` event (its own fault record)."""
        late = self.deadline.overdue(self.clock())
        if late is None:
            return None
        reason = f"recovery deadline passed: {late.describe()}; escalating: " + \
            restart_all_words(self.generation.restart_count, self.config.max_restarts)
        self.events.emit(Event.ESCALATE, generation=self.generation.number,
                         epoch=self.latest.number, ended_epoch=late.ended_epoch,
                         deadline_s=round(late.deadline_s, 3), waited_s=round(late.waited_s, 3),
                         happened=time.time() - late.waited_s, reason=reason)
        return StopJob(reason, {"kind": "escalate"})

    @property
    def _peer_write_s(self) -> float:
        """How long a regroup waits for a live node's agent to write to the store (its
        abort's confirmation; after a takeover, its pool and statuses again): what its
        workers' abort may take, then the heartbeat timeout in which a silent node is
        found."""
        return self.config.abort_timeout_s + self.config.heartbeat_timeout_s

    def _synced(self, member: P.Member) -> bool:
        status = self.m.statuses.get(member.id)
        return not member.joiner or (status is not None and status.synced)

    def _regroup(self, gone: list[P.Member]) -> StopJob | None:
        m, latest = self.m, self.latest
        first = gone[0].id
        cause = m.removed.get(first) or f"node {P.node_of(first)} lost"
        m.end(latest.number, {"member": first, "cause": cause})
        survivors = [x for x in latest.members if not m.gone(x.id)]
        if not self.whole_world:
            self.whole_world = m.store.get_record(snapshot_records.WHOLE_WORLD_KEY) is not None
        if self.waiting_since is None:
            self.waiting_since = self.clock()
        if self.gate_epoch != latest.number:  # standbys answer their gate after this end
            self.gate_epoch, self.gate_since = latest.number, self.clock()
        unchecked = [x for x in gone if x.id not in self.ready_checked]  # once per member
        self.ready_checked.update(x.id for x in unchecked)
        never_ready = [x.id for x in unchecked if not x.joiner and x.id not in m.statuses
                       and not m.has_status(x.id)]
        if never_ready:  # its agent saw it die before it knew the generation
            self.say(f"member {never_ready[0]} failed before it called ftrun.init(): "
                     + restart_all_words(self.generation.restart_count,
                                         self.config.max_restarts))
            return StopJob("a worker without the worker API failed", {"member": never_ready[0]})
        if self._catching_up(survivors):
            return None
        if not any(self._synced(x) for x in survivors):
            return StopJob("no surviving member holds the job's state")
        # Every surviving node aborts its communicators of the ended epoch first.
        nodes = sorted({P.node_of(x.id) for x in survivors} - m.lost_nodes)
        confirmed = m.store.present_records([P.released_key(latest.number, n) for n in nodes])
        missing = [n for n in nodes if P.released_key(latest.number, n) not in confirmed]
        if missing:
            waited = self.clock() - self.waiting_since
            if waited < self._peer_write_s:
                return None
            self.say(f"nodes {missing} did not confirm their NCCL abort in {waited:.1f} s;"
                     " publishing the next generation anyway", style="yellow")
        members = [P.Member(x.id, rank, not self._synced(x)) for rank, x in enumerate(survivors)]
        topped = self._top_up(members)
        if topped is None:
            return None  # a standby's health gate has not answered yet
        members = topped
        live_nodes = {P.node_of(x.id) for x in members}
        if len(members) < self.config.min_workers:
            return StopJob(f"{len(members)} workers left, fewer than --min-workers "
                           f"{self.config.min_workers}")
        if not self.config.is_single_node and len(live_nodes) < self.config.nnodes_min:
            return StopJob(f"{len(live_nodes)} nodes left, fewer than the minimum "
                           f"{self.config.nnodes_min}")
        self.publish(members, gone=[{"member": x.id, "rank": x.rank,
                                     "cause": m.removed.get(x.id) or "node lost"}
                                    for x in gone])
        return None

    def take_over(self, latest: P.MemberEpoch, lost: NodeSlot) -> None:
        """etcd-v3: this agent became the job's writer after ``lost``'s agent, the last
        writer, died with the store of these member epochs; ``m`` is on a new, empty store.
        Publish ``latest`` again there (the members' next epoch is counted from it), end it
        for the lost node (its address in the end: workers cut their connections to it)
        and drop that node, and mark the next member epoch as one whose members compare
        their committed steps (``protocol.resync_key``: the step decisions died too). Every
        member of ``latest`` had called ftrun.init() (it was in a formed member epoch), and
        the new store holds none of their statuses until they write again: a member lost
        before it does (its node cut off, or lost in a later takeover) must not look like a
        script without the worker API, so none of them gets the restart fallback."""
        m = self.m
        self.took_over = True
        self.ready_checked.update(x.id for x in latest.members)
        m.publish(latest)
        m.lost_nodes.add(lost.node_rank)
        if self.nodes is not None:  # a new watch: it knows no node dropped before
            for node in self.generation.nodes:
                if node.node_rank in m.lost_nodes:
                    self.nodes.drop(node.node_id)
        m.store.put_record(P.resync_key(latest.number + 1), {})
        self.report.resynced.add(latest.number + 1)
        m.end(latest.number, {"node": lost.node_rank, "addr": lost.addr,
                              "cause": "node lost"})
        m.append_fault(P.Fault("node lost: the job's writer, with the member epochs' store",
                               node=lost.node_rank))

    def _read_pools(self) -> None:
        m = self.m
        if self.pools_seen == m.changes_seen:
            return
        self.pools_seen = m.changes_seen
        nodes = [n.node_rank for n in self.generation.nodes if n.node_rank not in m.lost_nodes]
        found = m.store.present_records([P.pool_key(n) for n in nodes])
        for node in nodes:
            record = found.get(P.pool_key(node))
            if record is None:
                continue
            try:
                self.pools[node] = P.Pool.from_json(record, node)
            except StoreValueError as error:
                self.say(f"ignored node {node}'s pool record: {error}", style="yellow")

    @property
    def target(self) -> int:
        """The world size the job aims for: every node's share, lost nodes aside (a sharded
        job's whole world, lost nodes included: their ranks go to spares; so also with
        standby nodes in the generation, whose workers wait as spares to take them)."""
        if self.whole_world or any(n.standby for n in self.generation.nodes):
            return self.generation.world_size
        return sum(n.local_world_size for n in self.generation.nodes
                   if n.node_rank not in self.m.lost_nodes)

    def _top_up(self, members: list[P.Member]) -> list[P.Member] | None:
        """Fill free ranks with ready, idle members (spares, replacements), in node rank
        order; a standby node's only once its health gate passed (:meth:`_promotable`).
        None: wait (a standby whose answer is due would be next)."""
        self._read_pools()
        taken = {x.id for x in members}
        for node in sorted(self.pools):
            if node in self.m.lost_nodes:
                continue
            idle = [x for x in self.pools[node].members if x in self.pools[node].ready
                    and x not in taken and not self.m.gone(x)]
            if not idle or len(members) >= self.target:
                continue
            promotable = self._promotable(node)
            if promotable is None:
                return None
            for member in idle if promotable else ():
                if len(members) >= self.target:
                    return members
                members.append(P.Member(member, len(members), True))
                taken.add(member)
        return members

    def _catching_up(self, survivors: list[P.Member]) -> bool:
        """After a takeover (etcd-v3, ``take_over``: a new, empty store), whether the
        regroup waits for records that died with the old one: a live node's pool, and, while
        no survivor is known to hold the job's state, the surviving joiners' statuses.
        Without them the first regroup would find no standby's spares (and shrink, or stop
        the job below ``--nnodes`` MIN) or take a promoted standby's worker for one that
        never received the state. The agents that follow the move write both again
        (agent/regroup.py, ``_follow_moved_store``). Bounded from the regroup's start as a
        node's abort confirmation is, by the abort timeout plus the heartbeat timeout: what
        is still missing then is left out (a silent node is the heartbeat's to judge). The
        heartbeat timeout alone was too short under load: a CI run's survivor wrote its
        status after it, and the job stopped with no survivor known to hold the state.
        Never on the store the job started with, where every node wrote its pool at its
        first tick."""
        if not self.took_over or self.waiting_since is None \
                or self.clock() - self.waiting_since >= self._peer_write_s:
            return False
        self._read_pools()
        if any(n.node_rank not in self.m.lost_nodes and n.node_rank not in self.pools
               for n in self.generation.nodes):
            return True
        return not any(self._synced(x) for x in survivors) \
            and any(x.joiner and x.id not in self.m.statuses for x in survivors)

    def _promotable(self, node_rank: int) -> bool | None:
        """Whether ``node_rank``'s idle spares may take ranks. Yes on a node that is not a
        standby (its agent passed the gate to join), and on a standby before any member
        epoch ended (no rank was free). Otherwise its agent runs the health gate after
        the end (ftrun/agent/regroup.py) and the leader waits for that answer: a failure
        refuses it (said once per end: the console and a ``refused`` event) and the next
        node's spares, or the job's usual rule for a lost node, take the ranks. No answer
        within :data:`GATE_WAIT_S` (the gate's own bound and a margin) promotes it: as for
        one check, no answer proves a slow node, not a broken one (None until then)."""
        slot = next((n for n in self.generation.nodes if n.node_rank == node_rank), None)
        if slot is None or not slot.standby or self.gate_epoch is None:
            return True
        answer = self.m.gate_answer(node_rank)
        if answer is not None and answer[0] >= self.gate_epoch:
            if not answer[1]:
                return True
            if (node_rank, self.gate_epoch) not in self.gate_said:
                self.gate_said.add((node_rank, self.gate_epoch))
                say_refused(dataclasses.replace(slot, health=answer[1]), self.say,
                            self.events, promotion=True)
            return False
        if self.clock() - self.gate_since < GATE_WAIT_S:
            return None
        if (node_rank, self.gate_epoch) not in self.gate_said:
            self.gate_said.add((node_rank, self.gate_epoch))
            self.say(f"standby node {node_rank} ({slot.hostname}) gave no health-gate answer "
                     f"in {GATE_WAIT_S:.0f} s: promoting it", style="yellow")
        return True

    def _admit_ready_joiners(self) -> None:
        """A replacement that became ready joins at the survivors' next step boundary."""
        latest = self.latest
        if latest.world_size >= self.target or self.finishing:
            return
        members = self._top_up(list(latest.members))
        if members is None or len(members) == latest.world_size:
            return
        self.m.announce_join(latest.number, len(members))
        self.say(f"a new member is ready: it joins at the next step ({len(members)} ranks)")
        self.publish(members)

    # --- detection -----------------------------------------------------------------------

    def watch_nodes(self) -> dict[str, Any] | None:
        """Several nodes: lost nodes become faults of all their members (the job generation
        goes on); a newcomer ends the job generation (everyone re-forms with it). Returns
        the job generation's end, if this ends it."""
        assert self.nodes is not None and self.rdzv is not None
        m, rdzv = self.m, self.rdzv
        lost, join = self.nodes.scan(rdzv, self.generation)
        for node, cause in lost:
            if node.node_rank in m.lost_nodes:
                continue
            members = [x for x in self.latest.members if P.node_of(x.id) == node.node_rank]
            if any(not m.has_status(x.id) for x in members):
                self.say("the lost node's workers never called ftrun.init(): "
                         + restart_all_words(self.generation.restart_count,
                                             self.config.max_restarts))
                return rdzv.end(self.generation.number, cause)
            self.nodes.drop(node.node_id)
            m.lost_nodes.add(node.node_rank)
            if members:
                m.end(self.latest.number, {"node": node.node_rank, "addr": node.addr,
                                           "cause": "node lost"})
            m.append_fault(P.Fault(f"node lost: no heartbeat for {cause['silent_s']} s",
                                   node=node.node_rank))
        return rdzv.end(self.generation.number, join) if join is not None else None

    def _watch_progress(self) -> StopJob | None:
        """Every member's progress this tick: the progress report, the recovery's end, the
        stuck and stalled verdicts (ftrun.decide.progress: each member taken out like a
        failed one, its agent kills it), stragglers; and, once every first member is ready,
        what a sharded job cannot do (refused in one line)."""
        m, now = self.m, self.clock()
        seen: list[Observation] = []
        steps: dict[int, int] = {}
        for member in self.latest.members:
            status = m.statuses.get(member.id)
            if status is None:
                continue
            if status.finished:
                self.finishing = True  # a member left its loop: the job ends, admit no one
                continue
            if (member.joiner and not status.synced) or member.id in m.removed:
                continue
            seen.append(Observation(member.id, status.epoch, status.steps,
                                    status.collectives, status.epoch_steps))
            steps[member.rank] = status.steps
        self.report.observe(steps)
        if self.start_s is None and all(x.id in m.statuses for x in self.latest.members):
            self.start_s = now - self.created_at
            refused = self._refuse_what_cannot_progress()
            if refused is not None:
                return refused
            if not any(m.statuses[x.id].finished for x in self.latest.members) \
                    and self.once("deadline"):  # the workers use the API: recoveries ahead
                self.say(describe_setting(self.config.recovery_deadline_s,
                                          self.config.max_restarts))
        self.deadline.observe(seen)
        self._watch_stragglers(now)
        for verdict in self.watch.observe(now, seen, self.ended_at,
                                          judge_stalls=not self.finishing,
                                          superseded=self._superseded()):
            m.end(self.latest.number, {"member": verdict.member, "cause": verdict.cause})
            m.append_fault(P.Fault(verdict.cause, member=verdict.member, kill=True))
            m.removed[verdict.member] = verdict.cause
        return None

    def _refuse_what_cannot_progress(self) -> StopJob | None:
        """A sharded job (``ftrun.restartable``: its workers write the whole-world record
        before they say they are ready) needs every rank back after a fault; with
        ``--on-failure shrink`` no replacement would ever come and the survivors would wait
        for one. Refused once its workers are ready, before any fault."""
        if self.whole_world_checked:
            return None
        self.whole_world_checked = True
        self.whole_world = self.whole_world or \
            self.m.store.get_record(snapshot_records.WHOLE_WORLD_KEY) is not None
        if self.whole_world and self.config.on_failure == "shrink":
            reason = ("--on-failure shrink cannot be used with a sharded job "
                      "(ftrun.restartable): its state is sharded over every rank, so it never "
                      "goes on with fewer; use --on-failure replace (the default)")
            return StopJob(reason, {"kind": "refused"})
        return None

    def _watch_stragglers(self, now: float) -> None:
        """Straggler verdicts (ftrun.agent.stragglers); policy fault: out like a stall."""
        m = self.m
        beats = {x.id: (x.rank, s.beats, s.collectives) for x in self.latest.members
                 if (s := m.statuses.get(x.id)) is not None and not s.finished
                 and (s.synced or not x.joiner) and x.id not in m.removed}
        for verdict in self.stragglers.observe(now, beats, self.watch.median_step_s):
            cause = f"straggler on node {verdict.node}: {verdict.figures()}"
            m.end(self.latest.number, {"member": verdict.member, "cause": cause})
            m.append_fault(P.Fault(cause, member=verdict.member, kill=True))
            m.removed[verdict.member] = cause

    def _check_done(self) -> None:
        """Every member that holds the job's state left its loop: the job is over."""
        if self.m.done:
            return
        deciding = [x for x in self.latest.members if self._synced(x)]
        if deciding and all((s := self.m.statuses.get(x.id)) is not None and s.finished
                            for x in deciding):
            self.m.mark_done()
