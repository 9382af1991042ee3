"""Generations: who is in the job, with which ranks, and when that ends.

Membership is a sequence of generations 0, 1, 2, ... Each is one JSON record in the control
store, written once by the leader (the agent that hosts the store): its nodes, every node's
rank offset and local world size, and the address of the worker store that only this
generation's workers use. Any fault ends the generation: the first agent to report it wins
a compare-and-set on ``gen/<N>/end`` and every agent reacts to that one cause.

Keys under ``ftrun/<run id>/``:

=====================  ==============================================================
``gen/N/join/R``       static: node R's slot for generation N (written by node R)
``gen/N/slots``        c10d: every agent's slot, appended (one request each), in
                       arrival order
``gen/N``              the generation record (written by the leader)
``gen/N/as/<node id>`` one node's assignment in generation N: its rank, the world size,
                       the worker store and the digest of ``gen/N`` (written by the
                       leader in one ``multi_set`` just before ``gen/N``)
``gen/N/end``          the first valid cause that ended generation N
``gen/N/done``         counter: nodes whose workers all finished successfully
``latest``             the number of the newest generation record (for newcomers)
``hb/<node id>``       an agent's heartbeat (:mod:`ftrun.control.heartbeat`)
``shutdown``           the job is over; the first valid reason wins
=====================  ==============================================================

Records that steer the job (slots, generation records, ends, shutdown, heartbeats) are
signed with the job's secret when there is one (:mod:`ftrun.control.auth`); the write-once ones
are *appended* and the first valid record wins, so a writer without the secret can neither
forge nor pre-empt them. Counters are plain: their worst abuse is a denial of service.

Two ways to form a generation:

* **static** (``--rdzv-backend static``, and Slurm): every node knows its rank; the leader
  waits for all ``nnodes`` slots.
* **c10d** (dynamic, ``--nnodes MIN:MAX``): each agent appends its signed slot to the
  generation's list (one request); the leader reads the list once per poll and parses
  only what was appended since (a counter and a key per slot made it look for slots drawn
  but not written yet with ``check`` over thousands of keys per poll, and give up on a
  slow joiner after 10 s: most of 4,096 joiners were lost on a loaded machine; a queue
  cost one round trip per slot, 1.8 s at 4,096). It
  waits for MIN valid slots, then ``last_call_timeout`` for more (up to MAX), or, when
  re-forming after a fault, for every surviving member that still beats its heartbeat.
  It gives node ranks (itself 0, then the previous members in their order, then newcomers
  in arrival order) and writes the record. An agent that arrives while a generation runs
  draws a slot in the next one; the leader sees it and ends the running generation with
  the cause ``join`` (when the job has room), and everyone re-forms with the newcomer.

Why assignments: an agent needs its own place to start its workers, not the whole
membership, whose record grows with the job (600 KB at 4,096 nodes). Were every agent to
fetch, verify and parse it at once, a join would cost the store host and the agents
O(N^2) bytes. So each agent waits on its own small record and reads the full one only
when something asks for the membership (:attr:`Generation.nodes`), checking it against
the digest its assignment carries; the leader, which wrote it, holds it already.

Waiting is done in short slices so a signal to the agent is never stuck behind the store,
and every wait also gives up when the agent's heartbeat thread reports the store lost.
A wait that lasts says so every ``WAIT_REPORT_S`` (what it waits for, who is missing, how
long until ``join_timeout``): a job that cannot re-form is otherwise silent for minutes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from ftrun.control.assignments import (
    Assignment,
    Generation,
    LazyNodes,
    NodeSlot,
    assignment_key,
    record_digest,
)
from ftrun.control.errors import RendezvousError, StoreError, StoreValueError
from ftrun.control.heartbeat import HeartbeatMonitor
from ftrun.control.store import JsonStore

T = TypeVar("T")


class Rendezvous:
    """What static and c10d rendezvous share: ends, shutdown, done counts, waiting."""

    def __init__(
        self,
        store: JsonStore,
        *,
        is_leader: bool,
        poll_s: float,
        interrupted: Callable[[], bool],
        lost: Callable[[], str | None] = lambda: None,
        monitor: HeartbeatMonitor | None = None,
        on_wait: Callable[[str], None] = lambda text: None,
        on_refused: Callable[[NodeSlot], None] = lambda slot: None,
    ) -> None:
        self.store = store
        self.on_refused = on_refused  # leader: a node that failed its health gate, once each
        self._refused: set[str] = set()
        # Leader: node ids known dead, whose offered slots a generation formed here leaves
        # out (etcd-v3: the last writer, when this agent took its place during a join)
        self.gone: set[str] = set()
        self.is_leader = is_leader
        self.poll_s = poll_s
        self.interrupted = interrupted
        self.lost = lost
        self.monitor = monitor
        self.on_wait = on_wait
        self._reported_wait: tuple[str, float] = ("", 0.0)  # (what, deadline) of the wait
        self._next_report = 0.0

    # --- forming a generation -----------------------------------------------------------

    def first_number(self) -> int:
        """The generation a newly started agent asks to join: the one after the newest
        record, or 0 in a new job."""
        latest = self.store.get_record("latest")
        number = latest.get("number") if latest else None
        return number + 1 if isinstance(number, int) and number >= 0 else 0

    def join(
        self,
        number: int,
        slot: NodeSlot,
        timeout_s: float,
        open_worker_store: Callable[[], tuple[str, int]],
        *,
        restart_count: int = 0,
        expected: tuple[str, ...] = (),
    ) -> Generation:
        """Offer this node for generation ``number`` (or a later one) and return the first
        generation whose record includes it.

        The leader collects slots (waiting for the ``expected`` members of the previous
        generation while they beat), opens the generation's worker store and writes the
        record with ``restart_count``; the others wait for it.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.is_leader:
                # the wait begun before the offer: once the last node offers, etcd has only
                # the leader's writes and their events to serve, not the nodes' reads and
                # watches as well (4,096 of each at once queued behind the last offer)
                self._repeated(deadline, f"waiting for the record of generation {number}",
                               self.store.arm_wait, self._awaited(number, slot.node_id))
            self._repeated(deadline, f"offering this node for generation {number}",
                           self._offer, number, slot)
            if self.is_leader:
                self.store.close_waits()  # promoted meanwhile (etcd-v3): no wait of its own
                slots = self._collect(number, slot, deadline, expected)
                # only now: every member is back, so every worker of the last generation
                # has stopped (with the one-port contract the agent clears their keys here)
                host, port = open_worker_store()
                generation = Generation(number, restart_count, tuple(slots), host, port)
                self._repeated(deadline, f"writing generation {number}", self._write,
                               generation, slot.node_id)
                return generation
            found = self._wait_assignment(number, slot.node_id, deadline)
            if found is not None:
                return found
            if self.is_leader:
                continue  # became the writer while waiting (etcd-v3): form this generation
            number += 1  # it formed without us (full, or we came too late): the next one

    def _write(self, generation: Generation, own_id: str) -> None:
        """Leader: the assignments first (a node that finds ``gen/N`` without its own is not
        in it), then the record and the ``latest`` pointer."""
        number = generation.number
        record = generation.to_json()
        digest = record_digest(record)
        self.store.set_records({
            assignment_key(number, a.node.node_id): a.to_json()
            for a in generation.assignments(digest) if a.node.node_id != own_id})
        self.store.put_record(f"gen/{number}", record)
        self.store.set_record("latest", {"number": number})

    def _wait_assignment(self, number: int, node_id: str, deadline: float
                         ) -> Generation | None:
        """This node's generation ``number`` once the leader assigned it a place; None when
        the generation formed without it. Waits for any of three keys, in slices: the
        node's own assignment (one small record to read when it comes), ``gen/N`` (the
        leader writes it after every assignment: if it does not name this node, the node
        is out) and the job's shutdown record (``JsonStore.wait_any``: on etcd-v3 one held
        watch of the three, so a slice costs etcd no request)."""
        watched = self._awaited(number, node_id)
        name, record = watched[0], watched[1]
        what = f"the leader's record of generation {number}"
        try:
            while True:
                if self.is_leader:
                    return None  # promoted while waiting (etcd-v3's writer election)
                hit = self._repeated(
                    deadline, f"waiting for {what}", self.store.wait_any, watched,
                    self._slice(deadline))
                key, body = hit if hit is not None else (None, None)
                if key == name:
                    if body is not None:
                        return self._assigned(body, number, node_id, deadline)
                    time.sleep(self.poll_s)  # only forged records so far: read it again
                elif key == record and body is not None:
                    if self._generation_from(number, body).node(node_id) is None:
                        return None
                    # it names this node, so the assignment came first: wait for it alone
                    found, body = self._repeated(
                        deadline, f"waiting for {what}", self.store.wait_record, name,
                        self._slice(deadline))
                    if found and body is not None:
                        return self._assigned(body, number, node_id, deadline)
                elif key is not None and body is None:  # only forged records so far:
                    watched.remove(key)  # looked at each slice below instead
                if record not in watched and self._repeated(
                        deadline, f"waiting for {what}", self._formed_without, number,
                        node_id):
                    return None
                # a slice without news needs no read of the shutdown record if it is watched
                self._check_waiting(deadline, what, read_shutdown=hit is not None
                                    or "shutdown" not in watched)
        finally:
            self.store.close_waits()

    @staticmethod
    def _awaited(number: int, node_id: str) -> list[str]:
        """What a joining node waits for: its assignment, the record, the job's shutdown."""
        return [assignment_key(number, node_id), f"gen/{number}", "shutdown"]

    def _assigned(self, body: dict[str, Any], number: int, node_id: str, deadline: float
                  ) -> Generation:
        name = assignment_key(number, node_id)
        try:
            own = Assignment.from_json(body)
        except StoreValueError as error:
            raise RendezvousError(f"{name}: {error}") from None
        if own.number != number or own.node.node_id != node_id:
            raise RendezvousError(f"{name} names generation {own.number} and "
                                  f"node {own.node.node_id}")
        return Generation(number, own.restart_count,
                          LazyNodes(lambda a=own: self._read_nodes(a, deadline)),
                          own.worker_store_host, own.worker_store_port, own=own)

    def _formed_without(self, number: int, node_id: str) -> bool:
        """Whether generation ``number``'s record exists and leaves this node out."""
        if not self.store.exists(f"gen/{number}"):
            return False
        record = self.store.first_record(f"gen/{number}")
        return record is not None and \
            self._generation_from(number, record).node(node_id) is None

    def _generation_from(self, number: int, record: dict[str, Any]) -> Generation:
        generation = Generation.from_json(record)
        if generation.number != number:
            raise RendezvousError(f"record gen/{number} claims generation "
                                  f"{generation.number}")
        return generation

    def _read_nodes(self, own: Assignment, deadline: float) -> tuple[NodeSlot, ...]:
        """The full membership of ``own``'s generation, checked against its digest."""
        name = f"gen/{own.number}"
        record = self._wait_record(name, max(deadline, time.monotonic() + 60.0),
                                   f"the record of generation {own.number}")
        if record_digest(record) != own.digest:
            raise RendezvousError(f"{name} does not match this node's assignment (digest)")
        generation = self._generation_from(own.number, record)
        if generation.node(own.node.node_id) != own.node:
            raise RendezvousError(f"{name} does not place this node as its assignment does")
        return tuple(generation.nodes)

    def _offer(self, number: int, slot: NodeSlot) -> None:
        raise NotImplementedError

    def _repeated(self, deadline: float, what: str, request: Callable[..., T],
                  *args: Any) -> T:
        """``request(*args)``, made again after each failed store request until the join's
        ``deadline``: a request that failed under load (the store's own retries,
        ``JsonStore.retry_s``, spent) must not end a rendezvous that still has time (512
        agents on a loaded etcd: about one offer in ten failed once; 4,096: the leader's own
        reads of the slots). Only for requests that may be repeated: an offer (a node's
        later slots are skipped: ``_collect`` keeps a node's first), the leader's reads, and
        its write of a generation (the same signed values; a key's first record wins).
        Errors: :class:`StoreLostError` at once when ``lost()`` says the store is gone,
        :class:`RendezvousError` when interrupted or when ``deadline`` passes (naming
        ``what`` and the last failure)."""
        while True:
            try:
                return request(*args)
            except StoreLostError:
                raise
            except StoreError as error:
                failure = str(error)
            if self.interrupted():
                raise RendezvousError(f"interrupted while {what}")
            lost = self.lost()
            if lost:
                raise StoreLostError(lost)
            if time.monotonic() >= deadline:
                raise RendezvousError(f"gave up {what} at the join timeout: {failure}")
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))

    def offer_refused(self, number: int, slot: NodeSlot) -> None:
        """Offer a slot that failed this node's health gate (``slot.health`` says why), so
        the leader says the reason; this agent then leaves without waiting. Offered to the
        next generation too: ``number`` may have formed meanwhile, and the leader looks
        for newcomers (and refusals) in the one after the running one."""
        self._offer(number, slot)
        self._offer(number + 1, slot)

    def _healthy(self, slot: NodeSlot) -> bool:
        """Leader: whether ``slot`` passed its node's health gate; a refusal is said once."""
        if not slot.health:
            return True
        if slot.node_id not in self._refused:
            self._refused.add(slot.node_id)
            self.on_refused(slot)
        return False

    def _collect(self, number: int, own: NodeSlot, deadline: float,
                 expected: tuple[str, ...]) -> list[NodeSlot]:
        raise NotImplementedError

    def pending_join(self, generation: Generation,
                     left_out: Collection[str] = ()) -> NodeSlot | None:
        """Leader: a valid newcomer waiting for the next generation, if the job has room.
        ``left_out``: nodes of ``generation`` that an in-process regroup dropped; they
        free their places, and one of them asking again is a newcomer."""
        return None

    def _wait(self, probe: Callable[[], Any], deadline: float, what: str,
              describe_missing: Callable[[], str] | None = None) -> Any:
        while True:
            value = probe()
            if value is not None:
                return value
            self._check_waiting(deadline, what, describe_missing)
            time.sleep(self.poll_s)

    #: The longest a server-side wait blocks before the agent checks for signals, a lost
    #: store host, shutdown and its deadline (a signal to a joining agent takes effect
    #: within it). On a TCPStore each slice costs the store host a wait, its cancel and two
    #: checks: 32,000 requests per second from 4,096 joining agents at 0.5 s, 8,000 at
    #: 2 s; on etcd-v3 an agent waiting for its assignment holds one watch and a slice
    #: costs etcd nothing (ftrun/control/etcdheld.py).
    WAIT_SLICE_S = 2.0
    #: How often a wait that lasts says what it is waiting for.
    WAIT_REPORT_S = 15.0

    def _slice(self, deadline: float) -> float:
        """The next wait's length: a slice, or what is left of ``deadline`` if less."""
        return min(self.WAIT_SLICE_S, max(deadline - time.monotonic(), 0.001))

    def _wait_record(self, name: str, deadline: float, what: str) -> dict[str, Any]:
        """The first valid record of ``name``: blocks in the store's own ``wait`` (one
        request per slice instead of a poll every ``poll_s``), so hundreds of waiting
        agents cost the store almost nothing."""
        while True:
            if self._repeated(deadline, f"waiting for {what}", self.store.wait_for, name,
                              self._slice(deadline)):
                record = self._repeated(deadline, f"reading {what}", self.store.first_record,
                                        name)
                if record is not None:
                    return record
                time.sleep(self.poll_s)  # only forged records so far: the key exists
            self._check_waiting(deadline, what)

    def _check_waiting(self, deadline: float, what: str,
                       describe_missing: Callable[[], str] | None = None, *,
                       read_shutdown: bool = True) -> None:
        """Raise when the wait is over: interrupted, the store lost, the job shut down (its
        record read unless the caller's wait watches it), the deadline passed."""
        if self.interrupted():
            raise RendezvousError(f"interrupted while waiting for {what}")
        lost = self.lost()
        if lost:
            raise StoreLostError(lost)
        reason = self._repeated(deadline, f"waiting for {what}", self.shutdown_reason) \
            if read_shutdown else None
        if reason is not None:
            raise RendezvousError(f"the job was shut down while waiting for {what}: "
                                  f"{reason.get('reason', 'no reason given')}")
        now = time.monotonic()
        if now >= deadline:
            detail = f" ({describe_missing()})" if describe_missing else ""
            raise RendezvousError(f"timed out waiting for {what}{detail}")
        if self._reported_wait != (what, deadline):  # a new wait: report one period on
            self._reported_wait, self._next_report = (what, deadline), now + self.WAIT_REPORT_S
        elif now >= self._next_report:
            self._next_report = now + self.WAIT_REPORT_S
            detail = f" ({describe_missing()})" if describe_missing else ""
            self.on_wait(f"still waiting for {what}{detail}; giving up in "
                         f"{deadline - now:.0f} s (join_timeout)")

    # --- the life of a generation -------------------------------------------------------

    def end(self, number: int, cause: dict[str, Any]) -> dict[str, Any]:
        """Declare generation ``number`` over; returns the cause that won (maybe another's)."""
        self.store.put_record(f"gen/{number}/end", cause)
        return self.store.first_record(f"gen/{number}/end") or cause

    def ended(self, number: int) -> dict[str, Any] | None:
        return self.store.first_record(f"gen/{number}/end")

    def mark_done(self, number: int) -> int:
        return self.store.add(f"gen/{number}/done", 1)

    def done_count(self, number: int) -> int:
        return self.store.add(f"gen/{number}/done", 0)

    def shut_down(self, reason: dict[str, Any]) -> dict[str, Any]:
        self.store.put_record("shutdown", reason)
        return self.store.first_record("shutdown") or reason

    def shutdown_reason(self) -> dict[str, Any] | None:
        return self.store.first_record("shutdown")


class StoreLostError(RendezvousError):
    """This agent cannot reach the store host any more (its heartbeats fail)."""


class StaticRendezvous(Rendezvous):
    """Forms generations of a fixed set of ``nnodes`` agents identified by node rank."""

    def __init__(self, store: JsonStore, *, node_rank: int, nnodes: int, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        self.node_rank = node_rank
        self.nnodes = nnodes

    def _offer(self, number: int, slot: NodeSlot) -> None:
        self.store.set_record(f"gen/{number}/join/{slot.node_rank}", slot.to_json())

    def _joins(self, number: int, ranks: list[int]) -> dict[int, NodeSlot]:
        """The valid join records of generation ``number`` for ``ranks`` (one bulk read)."""
        names = [f"gen/{number}/join/{r}" for r in ranks]
        present = self.store.present_records(names) if names else {}
        found: dict[int, NodeSlot] = {}
        for rank, name in zip(ranks, names, strict=True):
            data = present.get(name)
            if data is None:
                continue
            try:
                slot = NodeSlot.from_json(data)
            except StoreValueError:
                continue
            if slot.node_rank == rank:
                found[rank] = slot
        return found

    def _collect(self, number: int, own: NodeSlot, deadline: float,
                 expected: tuple[str, ...]) -> list[NodeSlot]:
        slots: dict[int, NodeSlot] = {}
        while True:
            slots.update(self._repeated(
                deadline, f"reading the joins of generation {number}", self._joins, number,
                [r for r in range(self.nnodes) if r not in slots]))
            if len(slots) == self.nnodes:
                return [slots[r] for r in sorted(slots)]
            missing = sorted(set(range(self.nnodes)) - set(slots))
            self._check_waiting(deadline, "nodes", lambda m=missing: f"missing node ranks {m}")
            time.sleep(self.poll_s)

    def pending_join(self, generation: Generation,
                     left_out: Collection[str] = ()) -> NodeSlot | None:
        """A node that a regroup left out asks again under its own node rank (a static job
        has no other room)."""
        gone = [n.node_rank for n in generation.nodes if n.node_id in set(left_out)]
        joins = self._joins(generation.number + 1, gone)
        return next(iter(joins.values()), None)


class DynamicRendezvous(Rendezvous):
    """c10d-style rendezvous of MIN to MAX agents; see the module docstring."""

    def __init__(self, store: JsonStore, *, min_nodes: int, max_nodes: int,
                 last_call_s: float, standby_nodes: int = 0, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        # hot spare nodes beyond MAX: in the generation with no ranks (NodeSlot.standby)
        self.standby_nodes = standby_nodes
        self.last_call_s = last_call_s
        # Leader: every valid slot popped so far, per generation, in arrival order (a
        # newcomer seen by pending_join is in generation N+1's list when it forms).
        self._arrived: dict[int, tuple[list[NodeSlot], int]] = {}  # slots, bytes read
        self._scanned: dict[int, int] = {}  # generation -> arrived slots pending_join read
        self._gated: dict[int, int] = {}  # generation -> arrived slots health-checked

    def _offer(self, number: int, slot: NodeSlot) -> None:
        if self.is_leader:  # its own slot is ``own`` to _collect; offered, it would outlive
            return  # a writer that died before it formed the generation (etcd-v3)
        self.store.put_record(f"gen/{number}/slots", slot.to_json())

    def _arrivals(self, number: int) -> list[NodeSlot]:
        """Generation ``number``'s slots so far, in arrival order: those already read, then
        every one appended since (a record that is not a valid slot is skipped)."""
        arrived, offset = self._arrived.get(number, ([], 0))
        records, offset = self.store.records_after(f"gen/{number}/slots", offset)
        for data in records:
            try:
                if data is not None:
                    arrived.append(NodeSlot.from_json(data))
            except StoreValueError:
                continue
        self._arrived[number] = (arrived, offset)
        return arrived

    def _collect(self, number: int, own: NodeSlot, deadline: float,
                 expected: tuple[str, ...]) -> list[NodeSlot]:
        slots: dict[str, tuple[int, NodeSlot]] = {own.node_id: (0, own)}
        seen = 0
        min_reached: float | None = None
        waiting = set(expected) - {own.node_id}
        if self.monitor is not None:
            self.monitor.watch(waiting)
        while True:
            arrived = self._repeated(deadline, f"reading the slots of generation {number}",
                                     self._arrivals, number)
            now = time.monotonic()
            for index in range(seen, len(arrived)):
                slot = arrived[index]
                if slot.node_id not in slots and slot.node_id not in self.gone \
                        and self._healthy(slot):
                    slots[slot.node_id] = (index + 1, slot)
            seen = len(arrived)
            waiting -= slots.keys() | self._refused
            if self.monitor is not None and waiting:
                self.monitor.watch(waiting)
                waiting -= set(self._repeated(deadline, "reading the last generation's "
                                              "heartbeats", self.monitor.scan))
            if len(slots) >= self.max_nodes + self.standby_nodes:
                break
            if len(slots) >= self.min_nodes:
                min_reached = min_reached if min_reached is not None else now
                if expected and not waiting:
                    break  # re-forming: every member still alive is back
                if not expected and now - min_reached >= self.last_call_s:
                    break
            self._check_waiting(deadline, f"at least {self.min_nodes} nodes",
                                lambda w=waiting: self._join_status(slots, w))
            time.sleep(self.poll_s)
        if self.monitor is not None:
            self.monitor.watch(())
        for old in [k for k in self._arrived if k <= number]:
            del self._arrived[old]
        previous = {node_id: i for i, node_id in enumerate(expected)}

        def order(item: tuple[str, tuple[int, NodeSlot]]) -> tuple[int, int, int]:
            node_id, (index, _) = item
            if node_id == own.node_id:
                return (0, 0, 0)
            if node_id in previous:
                return (1, previous[node_id], 0)
            return (2, 0, index)

        chosen = sorted(slots.items(), key=order)[: self.max_nodes + self.standby_nodes]
        return [slot.with_rank(rank, standby=rank >= self.max_nodes)
                for rank, (_, (_, slot)) in enumerate(chosen)]

    def _join_status(self, slots: dict[str, tuple[int, NodeSlot]], waiting: set[str]) -> str:
        """Who joined and what is missing (built only when a wait is reported: at 4,096
        nodes a string of every node on each poll would cost the leader milliseconds)."""
        joined = ", ".join(sorted(f"{s.hostname} ({s.addr})" for _, s in slots.values()))
        parts = []
        if waiting:
            parts.append(f"{len(waiting)} member(s) of the last generation still beat")
        if len(slots) < self.min_nodes:
            parts.append(f"{self.min_nodes - len(slots)} more needed")
        return f"{len(slots)} joined: {joined}; {'; '.join(parts) or 'last call'}"

    def pending_join(self, generation: Generation,
                     left_out: Collection[str] = ()) -> NodeSlot | None:
        gone = {n.node_id for n in generation.nodes} & set(left_out)
        number = generation.number + 1
        arrived = self._arrivals(number)
        for slot in arrived[self._gated.get(number, 0):]:  # refusals are said even when full
            self._healthy(slot)
        self._gated[number] = len(arrived)
        if generation.nnodes - len(gone) >= self.max_nodes + self.standby_nodes:
            return None
        for index in range(self._scanned.get(number, 0), len(arrived)):
            self._scanned[number] = index + 1
            slot = arrived[index]
            if not self._healthy(slot):
                continue
            if generation.node(slot.node_id) is None or slot.node_id in gone:
                return slot
        return None
