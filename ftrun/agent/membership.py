"""The regroup records of one job generation, as one agent reads and writes them.

Under in-process regroup the agents of a job talk through signed records in the control
store (the table is in :mod:`ftrun.protocol`). :class:`Membership` is this agent's one
door to them: the writer (ends, faults, pools, releases, member epochs, a standby's
health-gate answers, the ``changes`` counter bumped after each) and the follower (what
changed since the last look, read in the order it was written). It also holds what this
agent has learned: the latest member epoch, members' statuses, who was removed and which
nodes were lost. The node side
(:class:`~ftrun.agent.regroup.RegroupSupervisor`) and the leader
(:class:`~ftrun.agent.leader.RegroupLeader`) share one instance.

Error semantics: store failures raise ``StoreError`` to the supervisor (which stops its
workers); a record that fails validation is said once and skipped, never trusted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ftrun import protocol as P
from ftrun.control.errors import StoreValueError
from ftrun.control.store import JsonStore

T = TypeVar("T")

#: The longest health-gate answer kept (the checks' one-line failures, joined).
MAX_GATE_TEXT = 2000
#: Member epochs remembered for :meth:`Membership.rank_of`.
EPOCHS_KEPT = 8


class Membership:
    """What this agent knows and writes of the job's members; see the module docstring."""

    def __init__(self, store: JsonStore, say: Callable[..., None]) -> None:
        self.store = store  # scoped to this job generation's regroup prefix
        self.say = say
        self.latest: P.MemberEpoch | None = None
        # the member epochs seen, newest last (a few: a member stuck in an ended one is
        # named by its rank there, not by the rank the next one gave it)
        self._seen_epochs: dict[int, P.MemberEpoch] = {}
        self.statuses: dict[str, P.Status] = {}
        self.removed: dict[str, str] = {}  # every member taken out, job-wide: id -> cause
        self.lost_nodes: set[int] = set()
        self.done = False  # the leader said every member finished
        self.changes_seen = -1  # the ``changes`` count at the last look
        self._ended_here: set[int] = set()  # member epochs whose end this agent wrote
        self._end_checked = -1  # the change count at the last look for an end
        self._faults_seen = 0
        self._fault_missing = (-1, 0.0)  # (index, since when) of a counted, unwritten fault
        self._bad_gate: set[int] = set()  # nodes whose malformed gate record was said
        # status key -> the bytes last read and their record (JsonStore.get_records): a
        # member beats every 0.2 s and the leader reads every 0.1 s, so half the statuses
        # of a read are the last read's bytes, not verified and decoded again
        self._status_bytes: dict[str, tuple[bytes, dict[str, Any] | None]] = {}

    def _remember(self, epoch: P.MemberEpoch) -> None:
        self.latest = epoch
        self._seen_epochs[epoch.number] = epoch
        while len(self._seen_epochs) > EPOCHS_KEPT:
            del self._seen_epochs[min(self._seen_epochs)]

    def rank_of(self, member: str) -> int | None:
        """The member's rank in the member epoch it is inside (its status says which; a
        member stuck in an ended epoch holds that epoch's rank, while the next epoch may
        have given the same number to another), else in the latest epoch."""
        status = self.statuses.get(member)
        inside = self._seen_epochs.get(status.epoch) if status is not None else None
        if inside is not None and (rank := inside.rank_of(member)) is not None:
            return rank
        return self.latest.rank_of(member) if self.latest is not None else None

    @property
    def ended_here(self) -> frozenset[int]:
        """The member epochs whose end this agent wrote."""
        return frozenset(self._ended_here)

    def gone(self, member: str) -> bool:
        """Taken out, or on a lost node."""
        return member in self.removed or P.node_of(member) in self.lost_nodes

    # --- writing -------------------------------------------------------------------------

    def changed(self) -> None:
        self.store.add(P.CHANGES, 1)

    #: How far :meth:`end` walks back over member epochs that have not formed
    MAX_UNFORMED = 8

    def end(self, epoch: int, cause: dict[str, object]) -> None:
        """End member epoch ``epoch`` and the ones before it back to the last that formed
        (once per agent each; the first valid end wins).

        Why the older ones: the leader publishes a joiner's epoch before the members reach
        the step that moves them to it, so until it forms they still step in the last
        formed one, and they watch their own epoch's end (a failed collective, a vote, a
        lost node's connections to cut). An agent that ended only the latest when a member
        died in that window left the others waiting for a dead peer until they gave up
        and the job stopped (seen under load). The members of a formed epoch have left the
        ones before: their ends change nothing for them."""
        first = epoch
        while first > 0 and epoch - first < self.MAX_UNFORMED and not self.formed(first):
            first -= 1
        new = [n for n in range(first, epoch + 1) if n not in self._ended_here]
        for number in new:
            self._ended_here.add(number)
            self.store.put_record(P.end_key(number), cause)
        if new:
            self.changed()

    def formed(self, number: int) -> bool:
        """Whether member epoch ``number`` formed (every member arrived; ftrun.worker)."""
        record = self.store.first_record(P.formed_key(number))
        return record is not None and record.get("value") == P.FORMED

    def append_fault(self, fault: P.Fault) -> None:
        index = self.store.add(P.FAULTS, 1) - 1
        self.store.put_record(P.fault_key(index), fault.to_json())
        self.changed()

    def publish(self, epoch: P.MemberEpoch) -> None:
        """The leader's one write of a member epoch."""
        self.store.set_record(P.generation_key(epoch.number), epoch.to_json())
        self.store.set_record(P.LATEST, {"number": epoch.number})
        self._remember(epoch)
        self.changed()

    def announce_join(self, epoch: int, world_size: int) -> None:
        """A joiner waits: the survivors regroup at their next commit."""
        self.store.put_record(P.join_key(epoch), {"members": world_size})

    def mark_done(self) -> None:
        assert self.latest is not None
        self.store.put_record(P.DONE, {"generation": self.latest.number})
        self.done = True
        self.changed()

    def send_pool(self, node_rank: int, pool: P.Pool) -> None:
        self.store.set_record(P.pool_key(node_rank), pool.to_json())
        self.changed()

    def confirm_released(self, epoch: int, node_rank: int) -> None:
        """This node's communicators of ``epoch`` are aborted."""
        self.store.set_record(P.released_key(epoch, node_rank), {})
        self.changed()

    def answer_gate(self, node_rank: int, epoch: int, failures: str) -> None:
        """A standby node's health-gate answer after member epoch ``epoch`` ended
        (``failures``: "" when it passed)."""
        self.store.set_record(P.gate_key(node_rank), {"epoch": epoch,
                                                      "failures": failures[:MAX_GATE_TEXT]})
        self.changed()

    def say_finished(self, member: str) -> None:
        """For a script that never called close(): its member left the job finished."""
        last = self.statuses.get(member) or P.Status(0, 0, 0, True, False)
        self.store.set_record(P.status_key(member), P.Status(
            last.beats + 1, last.steps, last.collectives, last.synced, True).to_json())
        self.changed()

    # --- reading -------------------------------------------------------------------------

    def has_status(self, member: str) -> bool:
        return self.store.exists(P.status_key(member))

    def follow(self, apply: Callable[[P.Fault], T | None]) -> T | None:
        """Read what changed, in the order it was written: each new fault goes to ``apply``
        (the first non-None result is returned at once), then the latest member epoch and
        whether the job is done."""
        changes = self.store.add(P.CHANGES, 0)
        if changes == self.changes_seen:
            return None
        self.changes_seen = changes
        count = self.store.add(P.FAULTS, 0)
        while self._faults_seen < count:
            record = self.store.first_record(P.fault_key(self._faults_seen))
            if record is None and not self._skip_missing_fault():
                self.changes_seen = -1  # counted, not written yet: look again next tick
                break
            self._faults_seen += 1
            if record is None:
                continue
            try:
                fault = P.Fault.from_json(record)
            except StoreValueError as error:
                self.say(f"ignored an invalid fault record: {error}", style="yellow")
                continue
            result = apply(fault)
            if result is not None:
                return result
        record = self.store.get_record(P.LATEST)
        number = record.get("number") if record else None
        if isinstance(number, int) and (self.latest is None or number > self.latest.number):
            epoch = self.store.get_record(P.generation_key(number))
            if epoch is not None:
                self._remember(P.MemberEpoch.from_json(epoch))
        if not self.done and self.store.first_record(P.DONE) is not None:
            self.done = True
        return None

    def _skip_missing_fault(self) -> bool:
        """Whether to pass over a fault index that holds no valid record: a writer appends
        its record right after counting it, so one that stays empty (or holds only
        records without the job's secret) for a second was counted by someone else."""
        now = time.monotonic()
        if self._fault_missing[0] != self._faults_seen:
            self._fault_missing = (self._faults_seen, now)
        return now - self._fault_missing[1] > 1.0

    def gate_answer(self, node_rank: int) -> tuple[int, str] | None:
        """A standby node's last health-gate answer, ``(epoch, failures)``; None when it has
        none, or a malformed one (said once)."""
        record = self.store.get_record(P.gate_key(node_rank))
        if record is None:
            return None
        epoch, failures = record.get("epoch"), record.get("failures")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0 \
                or not isinstance(failures, str) or len(failures) > MAX_GATE_TEXT:
            if node_rank not in self._bad_gate:
                self._bad_gate.add(node_rank)
                self.say(f"ignored node {node_rank}'s malformed health-gate record",
                         style="yellow")
            return None
        return epoch, failures

    def epoch_ended(self, epoch: int) -> bool:
        """Whether ``epoch`` has an end (read only when something changed since the last
        look, or known at once when this agent wrote it)."""
        if epoch in self._ended_here:
            return True
        if self._end_checked == self.changes_seen:
            return False
        self._end_checked = self.changes_seen
        return self.store.first_record(P.end_key(epoch)) is not None

    def read_statuses(self, wanted: Iterable[str], known: set[str]) -> None:
        """One ``multi_get`` for the status of ``wanted`` members; torch's multi_get waits
        for a missing key, so only statuses already read or ``known`` to exist are asked."""
        present = [m for m in sorted(set(wanted)) if m in self.statuses or m in known]
        if not present:
            return
        keys = [P.status_key(m) for m in present]
        if len(self._status_bytes) > 2 * len(keys):  # members gone since: forget them
            self._status_bytes = {k: self._status_bytes[k] for k in keys
                                  if k in self._status_bytes}
        records = self.store.read_records(keys, self._status_bytes)
        for member, record in zip(present, records, strict=True):
            if record is None:
                continue  # not signed with the job's secret (said once per key)
            try:
                self.statuses[member] = P.Status.from_json(record)
            except StoreValueError:
                continue
