"""The leader's watch over the other nodes of a multi-node job.

Only the agent that hosts the control store (the leader) runs a :class:`NodeWatch`. Both
supervisors ask it the same question at their own pace: which other nodes of this job
generation stopped beating (or, sooner, closed their presence connection without a goodbye:
ftrun/control/presence.py), and does a newcomer wait to join? What to do about it is theirs:
the restart supervisor ends the job generation, the regroup leader drops the lost node's
members (:meth:`NodeWatch.drop`) and goes on.

The sets of nodes that finished or were dropped belong to one job generation: the agent
calls :meth:`NodeWatch.begin` for each, so a node dropped from the last one is back in this.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

from ftrun.config import LaunchConfig
from ftrun.control.heartbeat import HeartbeatMonitor
from ftrun.control.rendezvous import Generation, NodeSlot, Rendezvous
from ftrun.observe.events import Event, EventLog

LostNode = tuple[NodeSlot, dict[str, Any]]
#: The longest gap between two of the leader's scans for lost nodes (a heartbeat read of
#: every node and a look for a newcomer).
SCAN_S = 0.25


def health_refusal() -> str:
    """Why this node fails its health gate (the quick ``ftrun doctor`` checks,
    :mod:`ftrun.doctor.gate`), or "" when it passes or the gate is off. Run by every agent
    but the store's host before it offers itself to a generation, and by a standby node
    after each member epoch ends, before the leader may promote its spares
    (:meth:`ftrun.agent.leader.RegroupLeader._promotable`)."""
    from ftrun.doctor.gate import gate_enabled, health_gate  # the doctor only when used

    if not gate_enabled():
        return ""
    return "; ".join(health_gate())


def passes_health_gate(rdzv: Rendezvous, number: int, slot: NodeSlot,
                       events: EventLog) -> bool:
    """Before an agent offers ``slot`` for generation ``number``: run the health gate; a
    node that fails offers its refusal (the leader says why), says it in one line and
    leaves (False)."""
    health = health_refusal()
    if not health:
        return True
    rdzv.offer_refused(number, dataclasses.replace(slot, health=health))
    events.emit(Event.STOP, reason="health gate", detail=health)
    print(f"ftrun: error: {slot.hostname} failed its health gate, not joining: {health}",
          file=sys.stderr)
    return False


def standby_config(config: LaunchConfig, standby: bool,
                   say: Callable[..., None]) -> LaunchConfig:
    """The configuration a supervisor runs this node's share of a generation with: as given,
    or on a standby node (``--standby-nodes``: no rank of its own, said once per
    generation) one where every one of its ``--nproc-per-node`` workers starts as a spare
    (``ftrun.agent.regroup`` spawns ``nproc_per_node`` members and ``spares`` spares) and
    waits, torch imported, for the leader to give it a lost node's rank."""
    if not standby:
        return config
    say("standing by: the workers start and wait to take a lost node's ranks")
    return dataclasses.replace(config, nproc_per_node=0,
                               spares=config.spares + config.nproc_per_node)


def say_refused(slot: NodeSlot, say: Callable[..., None], events: EventLog, *,
                promotion: bool = False) -> None:
    """The leader's line and event for a node its health gate refused: when it offered
    itself to a generation, or (``promotion``) a standby node when its spares were about to
    take a lost node's ranks (the event's ``at``: ``join`` or ``promotion``)."""
    when = " when promoted from standby" if promotion else ""
    text = (f"node {slot.hostname} ({slot.addr}) refused: it failed its health gate{when}: "
            f"{slot.health}")
    say(text, style="yellow")
    events.emit(Event.REFUSED, node=slot.hostname, addr=slot.addr, node_id=slot.node_id,
                node_rank=slot.node_rank if promotion else None,
                at="promotion" if promotion else "join", detail=slot.health)


class NodeWatch:
    """Lost nodes and newcomers, seen by the leader; see the module docstring."""

    def __init__(
        self,
        monitor: HeartbeatMonitor,
        *,
        node_id: str,
        heartbeat_interval_s: float,
        events: EventLog,
        say: Callable[..., None],
    ) -> None:
        self.monitor = monitor
        self.node_id = node_id
        self.node_rank = 0
        self.heartbeat_interval_s = heartbeat_interval_s
        self.events = events
        self.say = say
        self.finished: set[str] = set()  # done and gone: never lost
        self.dropped: set[str] = set()  # lost, and left out by a regroup
        self._next_scan = 0.0

    def begin(self, node_rank: int) -> None:
        """A new job generation: nobody is done or dropped in it yet."""
        self.node_rank = node_rank
        self.finished.clear()
        self.dropped.clear()

    def drop(self, node_id: str) -> None:
        """A regroup goes on without this node: it is not watched, nor waited for at the end."""
        self.dropped.add(node_id)

    def scan(
        self, rdzv: Rendezvous, generation: Generation
    ) -> tuple[list[LostNode], dict[str, Any] | None]:
        """At most every half heartbeat interval, and every eighth of the heartbeat timeout
        down to :data:`SCAN_S` (presence pings make silence visible that finely; 0.25 s
        with the 2 s default): the other nodes of
        ``generation`` that went silent or whose agent's connection closed (and that are
        not done), each with the cause that would end the generation for it, and a
        newcomer's join cause if one waits. Each is said and logged once; ending anything
        is the caller's choice."""
        now = time.monotonic()
        if now < self._next_scan:
            return [], None
        # as fine as an eighth of the timeout (down to SCAN_S), never coarser than before
        self._next_scan = now + min(self.heartbeat_interval_s / 2,
                                    max(SCAN_S, self.monitor.timeout_s / 8))
        members = {n.node_id for n in generation.nodes} - {self.node_id}
        self.monitor.watch(members - self.finished - self.dropped)
        lost: list[LostNode] = []
        for node_id in self.monitor.scan():
            if rdzv.store.get_record(f"gen/{generation.number}/done/{node_id}") is not None:
                self.finished.add(node_id)
                continue
            node = generation.node(node_id)
            assert node is not None
            silent = self.monitor.silent_s(node_id)
            # its agent's process ended (presence connection closed), or it went silent
            via = "connection" if node_id in self.monitor.closed else "heartbeat"
            how = ": its agent's connection closed without a goodbye" \
                if via == "connection" else ""
            self.say(f"node {node.node_rank} ({node.hostname}, {node.addr}) lost: no heartbeat "
                     f"for {silent:.1f} s{how}", style="yellow")
            self.events.emit(Event.NODE_LOST, generation=generation.number, node=node.hostname,
                             node_rank=node.node_rank, node_id=node_id, silent_s=silent, via=via)
            lost.append((node, {
                "kind": "node lost", "node_id": node.node_id, "node_rank": node.node_rank,
                "node": node.hostname, "addr": node.addr, "silent_s": round(silent, 2),
                "via": via, "by": self.node_rank, "time": time.time(),
            }))
        newcomer = rdzv.pending_join(generation, self.dropped)
        join = None
        if newcomer is not None:
            self.say(f"node {newcomer.hostname} ({newcomer.addr}) asks to join: re-forming "
                     "the job with it")
            join = {"kind": "join", "node_id": newcomer.node_id, "node": newcomer.hostname,
                    "addr": newcomer.addr, "by": self.node_rank, "time": time.time()}
        return lost, join
