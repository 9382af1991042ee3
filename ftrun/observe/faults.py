"""One record per fault, built from the agent's own events: what recovery cost.

Teams judge a fault-tolerant launcher by one figure, how long a fault costs them. This
module turns the event stream that every agent already writes (:mod:`ftrun.observe.events`)
into one :class:`FaultRecord` per fault: when it happened, when it was detected, when
training progressed again, the steps lost, the path taken (regroup, replace,
restart) and the ranks involved; and the whole job into a :class:`JobSummary` (wall time,
productive time, goodput, the first failure's cause).

Why from events: the same :class:`FaultBook` runs live inside the agent (fed by
:meth:`EventLog.add_listener`, it prints one line per completed recovery and emits the
finished record as a ``fault`` event) and after the job in ``ftrun report`` (fed by the
JSON-lines log). One code path, so the console, the summary and the report never disagree.

Where the times come from:

* happened: the worker's exit as the agent reaped it (``happened`` in the ``failure``
  event), the last heartbeat of a lost node, or the injection time of an injected fault;
* detected: the ``detected`` time of the ``failure`` event (or the ``node_lost`` event);
* progressing again (regroup): the ``formed`` event, written by the regroup leader when the
  member epoch after the fault has formed, i.e. every survivor rebuilt its group and is
  repeating the interrupted step. The leader looks once per monitor tick, so this is late
  by at most ``--monitor-interval`` (0.1 s by default);
* steps lost: the highest committed step seen before the fault minus the step training
  resumed from (regroup: 0 by the commit vote; restart: unknown to the agent unless the
  script uses the worker API);
* restart: scripts without the worker API report no steps, so the record says when the
  workers were started again (``restarted``), not when they progressed.

:class:`ProgressReport` is the regroup leader's half: it emits ``formed`` and, once a
second while steps move, ``progress`` (each rank's committed steps), so that the report can
draw ranks over time. Nothing here raises on a malformed event: a record read back from a
file is untrusted input and its bad fields are ignored.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ftrun import protocol as P
from ftrun.observe.events import Event, EventLog, WorkerExit, describe_returncode

#: Seconds between two ``progress`` events while steps move (the report's resolution).
PROGRESS_EVERY_S = 1.0


@dataclass
class FaultRecord:
    """One fault and what its recovery cost; times are UNIX seconds."""

    index: int
    cause: str  # 'killed by SIGKILL', 'exit code 1', 'frozen ...', 'node lost ...'
    detected: float
    happened: float
    rank: int | None = None
    member: str | None = None
    node: str | None = None  # the host that saw it (or the lost node's rank)
    pid: int | None = None
    generation: int = 0
    injected: str | None = None  # the injected fault's spec, when it was injected
    # regroup | replace (a ready spare at once) | restart | escalate (a recovery past its
    # deadline: the restart that followed) | none
    path: str | None = None
    ranks: list[int] = field(default_factory=list)  # ranks involved (failed ones)
    world: int | None = None  # world size training resumed with
    step: int | None = None  # committed steps when training resumed
    steps_lost: int | None = None
    recovered: float | None = None  # training progressing again (or restarted)
    recovered_how: str = ""  # 'formed' (progress seen) | 'restarted' (workers respawned)
    joined: float | None = None  # a replacement or spare joined (regroup)
    joined_step: int | None = None
    joined_world: int | None = None
    epoch: int | None = None  # the member epoch that recovery formed
    join_epoch: int | None = None
    # ranks taken out during this recovery as its casualties: stuck in a collective of the
    # epoch the fault ended, which nothing released (replaced; not faults of their own)
    casualties: list[int] = field(default_factory=list)
    casualty_pids: list[int] = field(default_factory=list)  # their processes, in that order

    @property
    def detection_s(self) -> float:
        return max(0.0, self.detected - self.happened)

    @property
    def recovery_s(self) -> float | None:
        """Fault to training progressing again (None while unknown)."""
        return None if self.recovered is None else max(0.0, self.recovered - self.happened)

    @property
    def who(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank}"
        if self.member is not None:
            return f"member {self.member}"
        return f"node {self.node}"

    @property
    def headline(self) -> str:
        """Who and the cause ("rank 1 exit code 1: ..."); a cause that already starts by
        naming them (a hang's "rank 1 (pid ..) stuck in ...") is not prefixed twice."""
        if self.cause.startswith(f"{self.who} "):
            return self.cause
        return f"{self.who} {self.cause}"

    def line(self) -> str:
        """The console line said when the recovery completes."""
        at = f" at step {self.step}" if self.step is not None else ""
        head = f"{self.headline}{at}"
        if self.injected:
            head = f"{head} (injected: {self.injected})"
        if self.path in ("regroup", "replace") and self.recovery_s is not None:
            how = "a ready member took its place" if self.path == "replace" \
                else "survivors regrouped"
            text = f"{head}: {how} in {self.recovery_s:.2f} s, world {self.world}"
        elif self.path in ("restart", "escalate") and self.recovery_s is not None:
            text = (f"{head}: every worker restarted in {self.recovery_s:.2f} s "
                    f"(generation {self.generation + 1})")
        else:
            text = f"{head}: {self.path or 'not recovered'}"
        lost = f", {self.steps_lost} steps lost" if self.steps_lost else ""
        if self.casualties:
            ranks = ", ".join(map(str, self.casualties))
            lost += f"; rank{'s' if len(self.casualties) > 1 else ''} {ranks} replaced: " \
                "stuck in a collective of the ended epoch"
        return f"{text} (detected in {self.detection_s:.2f} s{lost})"

    def join_line(self) -> str:
        return (f"{self.who}'s replacement joined at step {self.joined_step}, "
                f"world {self.joined_world}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["detection_s"] = round(self.detection_s, 6)
        data["recovery_s"] = None if self.recovery_s is None else round(self.recovery_s, 6)
        return data


@dataclass
class JobSummary:
    """The job as a whole: wall time, productive time, goodput, the faults."""

    started: float | None
    ended: float | None
    first_step: float | None
    faults: list[FaultRecord]
    succeeded: bool | None

    @property
    def wall_s(self) -> float | None:
        if self.started is None or self.ended is None:
            return None
        return max(0.0, self.ended - self.started)

    @property
    def downtime_s(self) -> float:
        """Time lost to faults: each fault's happening to training progressing again (an
        unrecovered one counts to the end), overlaps counted once."""
        spans = sorted((f.happened, f.recovered if f.recovered is not None else
                        (self.ended or f.detected)) for f in self.faults)
        total, reach = 0.0, -math.inf
        for start, end in spans:
            start = max(start, reach)
            if end > start:
                total += end - start
            reach = max(reach, end)
        return total

    @property
    def productive_s(self) -> float | None:
        """From the first step to the end, less the time lost to faults; None when no step
        was seen (a script without the worker API reports none to the agent)."""
        if self.first_step is None or self.ended is None:
            return None
        return max(0.0, self.ended - self.first_step - self.downtime_s)

    @property
    def goodput(self) -> float | None:
        wall, productive = self.wall_s, self.productive_s
        if not wall or productive is None:
            return None
        return min(1.0, productive / wall)

    @property
    def first_cause(self) -> str | None:
        if not self.faults:
            return None
        return min(self.faults, key=lambda f: f.happened).headline

    def to_json(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "productive_s": self.productive_s,
                "goodput": self.goodput, "first_step": self.first_step,
                "started": self.started, "ended": self.ended, "succeeded": self.succeeded,
                "first_cause": self.first_cause, "faults": [f.to_json() for f in self.faults]}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


#: The causes of a failure that is a fault of its own, never a casualty of another rank's
#: error (a casualty exits with an error of its own, or aborts): a kill from outside (the
#: OOM killer, a person, the soak), a freeze, a hang the agent named.
_OWN_FAULTS = ("killed by SIGKILL", "frozen", "hung", "stuck")


class FaultBook:
    """Fault records from a stream of events (see the module docstring).

    ``on_line`` receives each console line as a recovery completes; ``on_record`` each
    finished record (the agent emits it as a ``fault`` event). Both are optional: the
    report replays a log without them.
    """

    def __init__(self, on_line: Callable[[str], None] | None = None,
                 on_record: Callable[[FaultRecord], None] | None = None) -> None:
        self.faults: list[FaultRecord] = []
        self.on_line = on_line
        self.on_record = on_record
        self.started: float | None = None
        self.ended: float | None = None
        self.first_step: float | None = None
        self.succeeded: bool | None = None
        self.last_step: int | None = None  # the highest committed step seen
        self.progress: list[dict[str, Any]] = []  # the progress events, for pictures
        self.injections: list[dict[str, Any]] = []  # inject events not yet matched
        self._casualties: set[tuple[int, str]] = set()  # (generation, member) folded in
        self._lock = threading.RLock()  # events come from several threads; re-entered by
        # on_record, whose own event comes back here

    # --- feeding -------------------------------------------------------------------------

    def replay(self, records: Iterable[dict[str, Any]]) -> FaultBook:
        for record in records:
            self.observe(record)
        return self

    def observe(self, record: dict[str, Any]) -> None:
        """Take one event (the dict of one JSON line); unknown or malformed ones are
        ignored."""
        ts = _num(record.get("ts"))
        kind = record.get("event")
        if ts is None or not isinstance(kind, str):
            return
        with self._lock:
            if self.started is None:
                self.started = ts
            handler = self._handlers().get(kind)
            if handler is not None:
                handler(ts, record)

    def _handlers(self) -> dict[str, Callable[[float, dict[str, Any]], None]]:
        return {
            Event.FAILURE.value: self._failure,
            Event.NODE_LOST.value: self._node_lost,
            Event.EPOCH.value: self._epoch,
            "formed": self._formed,
            "progress": self._progress,
            "inject": self._inject,
            Event.ERROR.value: self._error,
            Event.RESTART.value: self._restart,
            Event.ESCALATE.value: self._escalate,
            Event.GENERATION.value: self._generation,
            Event.STOP.value: self._stop,
            Event.DONE.value: self._done,
        }

    # --- events --------------------------------------------------------------------------

    def _open(self, ts: float, cause: str, **fields: Any) -> FaultRecord:
        detected = _num(fields.pop("detected", None)) or ts
        happened = _num(fields.pop("happened", None)) or detected
        record = FaultRecord(index=len(self.faults), cause=cause, detected=detected,
                             happened=min(happened, detected), **fields)
        if record.rank is not None:
            record.ranks = [record.rank]
        self._match_injection(record)
        self.faults.append(record)
        return record

    def _match_injection(self, record: FaultRecord) -> None:
        """An injected fault on this rank (or node) before its detection: the fault
        happened at the injection, also where the verdict's own estimate is earlier (a hang's
        idle spell is known to a sample, 0.5 s, and a rank idle in its step's sleep when the
        hang was injected counts as idle before it)."""
        for inj in self.injections:
            target_rank = _int(inj.get("rank"))
            if target_rank is not None and target_rank != record.rank:
                continue
            at = _num(inj.get("ts"))
            if at is None or at > record.detected:
                continue
            record.injected = _str(inj.get("spec")) or "yes"
            record.happened = at
            self.injections.remove(inj)
            return

    def _failure(self, ts: float, ev: dict[str, Any]) -> None:
        member, rank = _str(ev.get("member")), _int(ev.get("rank"))
        cause = _str(ev.get("cause"))
        code = _int(ev.get("returncode"))
        if cause is None:
            cause = describe_returncode(code) if code is not None else "failed"
        generation = _int(ev.get("generation")) or 0
        if member is not None and ((generation, member) in self._casualties or any(
                f.member == member and f.generation == generation for f in self.faults)):
            return  # the same member's second report (a verdict on a dead process)
        pid = _int(ev.get("pid"))
        if pid is not None and any(f.pid == pid and f.generation == generation
                                   for f in self.faults):
            return  # the same process's second report (frozen: its hang, then its kill)
        if ev.get("casualty") is True:  # part of the recovery in progress: its record's
            recovering = next((f for f in self.faults if f.generation == generation
                               and f.recovered is None and f.path != "none"), None)
            if recovering is not None and rank is not None and member is not None:
                recovering.casualties.append(rank)
                if pid is not None:
                    recovering.casualty_pids.append(pid)
                self._casualties.add((generation, member))
                return
        record = self._open(ts, cause, detected=ev.get("detected"), happened=ev.get("happened"),
                            rank=rank, member=member, node=_str(ev.get("node")),
                            pid=_int(ev.get("pid")),
                            generation=_int(ev.get("generation")) or 0)
        if member is not None and rank is None:  # a joiner or spare that never trained
            record.path, record.recovered, record.recovered_how = "none", record.detected, \
                "not in the job"
            self._finish(record)
        # A hang with several culprits (two ranks hung at once: one restart) is a fault of
        # each: a record per culprit, the same cause and times.
        culprits = ev.get("culprits")
        for other in culprits[1:] if isinstance(culprits, list) else ():
            if _int(other) is not None and other != rank:
                self._open(ts, cause, detected=ev.get("detected"),
                           happened=ev.get("happened"), rank=other,
                           node=_str(ev.get("node")), generation=generation)

    def _node_lost(self, ts: float, ev: dict[str, Any]) -> None:
        silent = _num(ev.get("silent_s")) or 0.0
        node = ev.get("lost_node", ev.get("node_rank"))
        self._open(ts, f"lost: no heartbeat for {silent:.1f} s", detected=ts,
                   happened=ts - silent, node=str(node),
                   generation=_int(ev.get("generation")) or 0)

    def _error(self, ts: float, ev: dict[str, Any]) -> None:
        """A failed worker's own last error (read once its stderr drained): the record of
        that process says it after its exit code, as the failure summary does."""
        pid, message = _int(ev.get("pid")), _str(ev.get("message"))
        if pid is None or not message:
            return
        for record in self.faults:
            if record.pid == pid and _BARE_CAUSE.match(record.cause):
                record.cause = f"{record.cause}: {message.splitlines()[0][:300]}"
                return

    def _inject(self, ts: float, ev: dict[str, Any]) -> None:
        self.injections.append({**ev, "ts": ts})

    def _epoch(self, ts: float, ev: dict[str, Any]) -> None:
        """A member epoch published: the members it left out (``gone``) get their records'
        path (one record each, or the lost node's), or a replacement was admitted. Member
        ids and epoch numbers start again in each job generation: a record is matched in
        the event's own generation only."""
        epoch, world = _int(ev.get("epoch")), _int(ev.get("world_size"))
        generation = _int(ev.get("generation")) or 0
        gone = ev.get("gone")
        joiners = ev.get("joiners")
        joiners = joiners if isinstance(joiners, list) else []
        if isinstance(gone, list) and gone:
            for item in gone:
                if not isinstance(item, dict):
                    continue
                member = _str(item.get("member"))
                if member is not None and (generation, member) in self._casualties:
                    continue  # named in the record of the fault it was a casualty of
                mine = [f for f in self.faults if f.generation == generation]
                record = next((f for f in mine if f.member == member and f.path is None),
                              None)
                if record is None and member is not None and \
                        not any(f.member == member for f in mine):
                    record = self._lost_node_of(member, epoch, generation)
                    if record is not None:  # one record per lost node, naming its ranks
                        rank = _int(item.get("rank"))
                        if rank is not None and rank not in record.ranks:
                            record.ranks.append(rank)
                        record.path, record.epoch, record.world = "regroup", epoch, world
                        continue
                if record is None and member is not None and \
                        not any(f.member == member for f in mine):
                    cause = _str(item.get("cause")) or "failed"
                    record = self._open(ts, cause, detected=ts, member=member,
                                        rank=_int(item.get("rank")),
                                        node=str(P.node_of(member))
                                        if _valid_member(member) else None,
                                        generation=generation)
                if record is None:
                    continue
                if record.rank is None:
                    record.rank = _int(item.get("rank"))
                    record.ranks = [record.rank] if record.rank is not None else []
                record.path = "replace" if joiners else "regroup"
                record.epoch, record.world = epoch, world
            return
        if joiners:  # a replacement admitted: the oldest fault still missing one
            for record in self.faults:
                if record.path == "regroup" and record.join_epoch is None \
                        and record.generation == generation:
                    record.join_epoch = epoch
                    break

    def _lost_node_of(self, member: str, epoch: int | None,
                      generation: int) -> FaultRecord | None:
        """The lost-node record of ``member``'s node still waiting for its regroup (or
        being regrouped by this same epoch of this job generation), if any."""
        if not _valid_member(member):
            return None
        node = str(P.node_of(member))
        return next((f for f in self.faults if f.node == node and f.rank is None
                     and f.generation == generation
                     and f.member is None and f.cause.startswith("lost:")
                     and (f.path is None or (f.path == "regroup" and f.epoch == epoch))),
                    None)

    def _formed(self, ts: float, ev: dict[str, Any]) -> None:
        epoch, step = _int(ev.get("epoch")), _int(ev.get("step"))
        world = _int(ev.get("world_size"))
        generation = _int(ev.get("generation")) or 0
        for record in self.faults:
            if record.generation != generation:  # epoch numbers start again in each
                continue
            # The replacement's epoch may be the one that recovers the fault too: its
            # joiner was ready before the survivors' own epoch formed. The record then
            # carries both, and both lines are said, the recovery's first.
            joins = record.join_epoch == epoch and record.joined is None
            if joins:
                record.joined, record.joined_step, record.joined_world = ts, step, world
            # An epoch superseded before it formed (a joiner admitted at once, another
            # fault) is recovered by the later one that forms.
            if record.epoch is not None and epoch is not None and record.epoch <= epoch \
                    and record.recovered is None:
                record.recovered, record.recovered_how = ts, "formed"
                record.step = step
                if world is not None:
                    record.world = world
                if step is not None and self.last_step is not None:
                    record.steps_lost = max(0, self.last_step - step)
                elif step is not None:
                    record.steps_lost = 0
                if record.path == "replace":
                    record.joined, record.joined_step, record.joined_world = ts, step, world
                self._finish(record)
            if joins and self.on_line is not None:
                self.on_line(record.join_line())
        if step is not None:
            self.last_step = max(self.last_step or 0, step)

    def _progress(self, ts: float, ev: dict[str, Any]) -> None:
        step = _int(ev.get("step"))
        if step is None:
            return
        if self.first_step is None and step >= 1:
            self.first_step = ts
        self.last_step = max(self.last_step or 0, step)
        self.progress.append({"ts": ts, "step": step, "steps": ev.get("steps"),
                              "world_size": ev.get("world_size")})

    def _restart(self, ts: float, ev: dict[str, Any]) -> None:
        generation = _int(ev.get("generation")) or 0
        pending = [f for f in self.faults if f.path is None and f.generation == generation]
        escalated = any(f.path == "escalate" and f.recovered is None
                        and f.generation == generation for f in self.faults)
        if not pending and not escalated:  # another node's failure: its cause only
            cause = _str(ev.get("cause")) or "generation ended on another node"
            pending = [self._open(ts, cause, detected=ts, generation=generation,
                                  node=_str(ev.get("node")))]
        for record in pending:
            record.path = "restart"
        self._name_root(ts, pending, ev)

    def _name_root(self, ts: float, pending: list[FaultRecord], ev: dict[str, Any]) -> None:
        """The agent's root cause (a ``restart`` or ``stop`` event's root fields,
        outcome.root_fields) may be another rank than the exit it saw first (a rank that
        raised can exit after the peer its exception broke: outcome.mark_root_cause): the
        one record of that generation then names the root, with its own error. Not when the
        root already has a record of its own (a regroup that fell back to a restart: the
        pending record is another fault's, which renaming would lose and the root's
        duplicate; the long soak)."""
        root_pid, code = _int(ev.get("pid")), _int(ev.get("returncode"))
        if root_pid is not None and any(f.pid == root_pid for f in self.faults
                                        if f not in pending):
            return
        if len(pending) == 1 and root_pid is not None and code is not None \
                and pending[0].pid not in (None, root_pid):
            record, message = pending[0], _str(ev.get("message"))
            cause = describe_returncode(code) + (
                f": {message.splitlines()[0][:300]}" if message else "")
            if record.cause.startswith(_OWN_FAULTS):
                # the exit seen first was a fault of its own (a kill from outside, a
                # freeze, a hang), not a casualty of the root's error: two faults, ended
                # by one restart, each with its record (the soak: a raise, then a kill
                # 63 ms later, had one record)
                root = self._open(ts, cause, detected=record.detected,
                                  rank=_int(ev.get("rank")), pid=root_pid,
                                  generation=record.generation, node=record.node)
                root.path = "restart"
                return
            record.rank, record.pid, record.member = _int(ev.get("rank")), root_pid, None
            record.cause = cause

    def _escalate(self, ts: float, ev: dict[str, Any]) -> None:
        """A recovery passed its deadline: a record of its own (path ``escalate``), and
        the faults it left unrecovered are recovered by the restart that follows."""
        generation = _int(ev.get("generation")) or 0
        for record in self.faults:
            if record.recovered is None and record.generation == generation \
                    and record.path not in ("none", "escalate"):
                record.path = "restart"
        record = self._open(ts, _str(ev.get("reason")) or "recovery deadline passed",
                            detected=ts, happened=ev.get("happened"), generation=generation,
                            node=_str(ev.get("node")))
        record.path, record.epoch = "escalate", _int(ev.get("epoch"))

    def _generation(self, ts: float, ev: dict[str, Any]) -> None:
        number = _int(ev.get("generation"))
        if number is None:
            return
        for record in self.faults:
            if record.path in ("restart", "escalate") and record.recovered is None and \
                    record.generation < number:
                record.recovered, record.recovered_how = ts, "restarted"
                record.world = _int(ev.get("world_size"))
                self._finish(record)

    def _stop(self, ts: float, ev: dict[str, Any]) -> None:
        if ev.get("reason") in ("failed", "signal", "store lost", "rendezvous"):
            self.ended = ts
            self.succeeded = False
            pending = [f for f in self.faults if f.recovered is None and f.path is None]
            for record in pending:
                record.path = "none"
            if ev.get("reason") == "failed":  # no restart left: the same root as a restart's
                self._name_root(ts, pending, ev)

    def _done(self, ts: float, ev: dict[str, Any]) -> None:
        self.ended = ts
        self.succeeded = True

    def _finish(self, record: FaultRecord) -> None:
        if self.on_line is not None and record.path != "none":
            self.on_line(record.line())
        if self.on_record is not None:
            self.on_record(record)

    # --- reading -------------------------------------------------------------------------

    def summary(self, ended: float | None = None) -> JobSummary:
        with self._lock:
            return JobSummary(self.started, self.ended or ended, self.first_step,
                              list(self.faults), self.succeeded)


#: A cause that says only how the process ended (its error may be added).
_BARE_CAUSE = re.compile(r"^(exit code -?\d+|killed by \S+)$")


def explain_exits(events: EventLog, exits: Iterable[WorkerExit]) -> None:
    """Emit an ``error`` event for each worker that failed on its own and left an error
    (its error file's message, or the last exception in its stderr): the fault table's
    cause then names it. Workers stopped by ftrun are consequences, not causes."""
    for item in exits:
        if not item.ok and item.message and not item.stopped_by_agent:
            events.emit(Event.ERROR, rank=item.rank, pid=item.pid, node=item.node,
                        message=item.message.splitlines()[0][:300])


def _valid_member(text: str) -> bool:
    try:
        P.node_of(text)
    except (ValueError, IndexError):
        return False
    return True


class ProgressReport:
    """The regroup leader's half (see the module docstring): ``formed`` once the member
    epoch published after a change has formed, ``progress`` once a second while steps move.

    Store cost: one ``check`` per monitor tick for each published epoch not seen formed yet
    (one, or two when a replacement followed a fault at once), nothing otherwise.
    """

    def __init__(self, events: EventLog, generation: int,
                 formed: Callable[[int], bool],
                 last_commit: Callable[[int, int], int] | None = None,
                 clock: Callable[[], float] = time.time,
                 every_s: float = PROGRESS_EVERY_S, marks: Iterable[int] = ()) -> None:
        self.events = events
        self.generation = generation
        self.formed = formed  # member epoch number -> whether its formed record exists
        # (member epoch, a committed step) -> the epoch's last committed step at or past it
        self.last_commit = last_commit
        self.clock = clock
        self.every_s = every_s
        # Published member epochs not seen formed yet, oldest first: (epoch, world size, the
        # highest step reported before its publication). Several when one is followed by
        # another before a tick sees it form (a replacement admitted at once): each that
        # forms gets its own record; one that never forms is dropped once a later one has.
        self.pending: list[tuple[int, int, int]] = []
        # The last member epoch seen formed and the step it resumed from: where the next
        # one's count of committed steps starts (unknown to a leader that took over).
        self.resumed: tuple[int, int] | None = None
        self.steps: dict[int, int] = {}  # rank -> committed steps, as last reported
        self.epoch = -1
        self.world = 0
        self.sent_at = -math.inf
        self.sent: dict[int, int] = {}
        self.stepped = False
        self.highest = 0  # the highest committed step reported
        # Steps at which a progress event goes out at once (--inject's step triggers).
        self.marks = sorted(set(marks))
        # Member epochs whose members resync (an etcd-v3 takeover: the step decisions died
        # with the old store): each member takes the furthest committed state.
        self.resynced: set[int] = set()

    def published(self, epoch: int, world_size: int) -> None:
        self.epoch, self.world = epoch, world_size
        if epoch > 0:
            self.pending.append((epoch, world_size, self.highest))
        else:
            self.resumed = (0, 0)

    def observe(self, steps: dict[int, int]) -> None:
        """Each rank's committed steps as the leader read them this tick."""
        self.steps = steps
        self.highest = max([self.highest, *steps.values()])
        now = self.clock()
        self._report_formed(steps)
        if not steps or steps == self.sent:
            return
        first = not self.stepped and max(steps.values()) >= 1  # the job's first step
        marked = bool(self.marks) and max(steps.values()) >= self.marks[0]
        while self.marks and max(steps.values()) >= self.marks[0]:
            self.marks.pop(0)
        if first or marked or now - self.sent_at >= self.every_s:
            self.stepped = self.stepped or first
            self.sent, self.sent_at = dict(steps), now
            self.events.emit(Event.PROGRESS, generation=self.generation, epoch=self.epoch,
                             world_size=self.world, step=max(steps.values()),
                             steps={str(r): s for r, s in sorted(steps.items())})

    def _report_formed(self, steps: dict[int, int]) -> None:
        """A ``formed`` event for each pending member epoch that formed, oldest first."""
        formed = [p for p in self.pending if self.formed(p[0])]
        if not formed:
            return
        self.pending = [p for p in self.pending if p[0] > formed[-1][0]]
        for epoch, world, reported in formed:
            if epoch in self.resynced:
                step = max(steps.values()) if steps else self.highest
            elif self.last_commit is not None:
                # The decisions of the last epoch that formed (the one before, unless that
                # never formed) say exactly which step this one resumes after, counted on
                # from a step known to be in it: one reported before this epoch was
                # published, or where that epoch resumed. The beats lag commits (0.2 s),
                # and those read now may already be of a later epoch.
                base, floor = self.resumed if self.resumed is not None else (epoch - 1, 0)
                step = self.last_commit(base, max(reported, floor))
            else:
                step = reported
            self.resumed = (epoch, step)
            self.events.emit(Event.FORMED, generation=self.generation, epoch=epoch,
                             world_size=world, step=step)
