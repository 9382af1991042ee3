"""Generations: who is in the job, with which ranks, and when that ends.

Membership is a sequence of generations 0, 1, 2, ... Each is one JSON record in the control
store, written once by the leader (the agent that hosts the store): its nodes, every node's
rank offset and local world size, and the address of the worker store that only this
generation's workers use. Any fault ends the generation: the first agent to report it wins
a compare-and-set on ``gen/<N>/end`` and every agent reacts to that one cause.

Keys under ``ftrun/<run id>/``:

=====================  ==============================================================
``gen/N/join/R``       node R's slot for generation N (written by node R)
``gen/N``              the generation record (written by the leader)
``gen/N/end``          the first cause that ended generation N (first writer wins)
``gen/N/done``         counter: nodes whose workers all finished successfully
``shutdown``           the job is over; the reason and exit code every agent uses
=====================  ==============================================================

This module implements the static rendezvous (every node known up front by its node rank).
Waiting is done in short slices so a signal to the agent is never stuck behind the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ftrun.store import JsonStore, StoreValueError, require


class RendezvousError(RuntimeError):
    """The generation could not be formed (timeout, store lost, inconsistent records)."""


@dataclass(frozen=True)
class NodeSlot:
    """One agent's offer to take part in a generation."""

    node_rank: int
    local_world_size: int
    addr: str
    hostname: str
    pid: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeSlot:
        slot = cls(
            node_rank=require(data, "node_rank", int),
            local_world_size=require(data, "local_world_size", int),
            addr=require(data, "addr", str),
            hostname=require(data, "hostname", str),
            pid=require(data, "pid", int),
        )
        if slot.node_rank < 0 or slot.local_world_size < 1:
            raise StoreValueError("node slot with a negative rank or no workers")
        return slot


@dataclass(frozen=True)
class Generation:
    """One membership of the job; immutable once written."""

    number: int
    restart_count: int
    nodes: tuple[NodeSlot, ...]  # ordered by node rank
    worker_store_host: str
    worker_store_port: int

    @property
    def world_size(self) -> int:
        return sum(node.local_world_size for node in self.nodes)

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    def rank_offset(self, node_rank: int) -> int:
        offset = 0
        for node in self.nodes:
            if node.node_rank == node_rank:
                return offset
            offset += node.local_world_size
        raise RendezvousError(f"node rank {node_rank} is not in generation {self.number}")

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "restart_count": self.restart_count,
            "nodes": [asdict(node) for node in self.nodes],
            "worker_store_host": self.worker_store_host,
            "worker_store_port": self.worker_store_port,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Generation:
        nodes = require(data, "nodes", list)
        generation = cls(
            number=require(data, "number", int),
            restart_count=require(data, "restart_count", int),
            nodes=tuple(NodeSlot.from_json(n) for n in nodes if isinstance(n, dict)),
            worker_store_host=require(data, "worker_store_host", str),
            worker_store_port=require(data, "worker_store_port", int),
        )
        ranks = [n.node_rank for n in generation.nodes]
        if len(generation.nodes) != len(nodes) or ranks != sorted(set(ranks)):
            raise StoreValueError("generation record with malformed or duplicate nodes")
        if not 0 < generation.worker_store_port < 65536:
            raise StoreValueError("generation record with an invalid worker store port")
        return generation


class StaticRendezvous:
    """Forms generations of a fixed set of ``nnodes`` agents identified by node rank."""

    def __init__(
        self,
        store: JsonStore,
        *,
        node_rank: int,
        nnodes: int,
        is_leader: bool,
        poll_s: float,
        interrupted: Callable[[], bool],
    ) -> None:
        self.store = store
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.is_leader = is_leader
        self.poll_s = poll_s
        self.interrupted = interrupted

    def join(
        self,
        number: int,
        slot: NodeSlot,
        timeout_s: float,
        open_worker_store: Callable[[], tuple[str, int]],
    ) -> Generation:
        """Offer this node for generation ``number`` and wait for the record.

        The leader waits for every node's slot, opens the generation's worker store with
        ``open_worker_store`` and writes the record; the others wait for it.
        """
        self.store.set(f"gen/{number}/join/{slot.node_rank}", asdict(slot))
        deadline = time.monotonic() + timeout_s
        if self.is_leader:
            slots = self._wait_for_slots(number, deadline)
            host, port = open_worker_store()
            generation = Generation(number, number, tuple(slots), host, port)
            self.store.set(f"gen/{number}", generation.to_json())
            return generation
        record = self._wait(lambda: self.store.get(f"gen/{number}"), deadline,
                            f"the leader's record of generation {number}")
        generation = Generation.from_json(record)
        if generation.number != number:
            raise RendezvousError(f"record gen/{number} claims generation {generation.number}")
        return generation

    def _wait_for_slots(self, number: int, deadline: float) -> list[NodeSlot]:
        slots: dict[int, NodeSlot] = {}

        def collect() -> list[NodeSlot] | None:
            for rank in range(self.nnodes):
                if rank not in slots:
                    data = self.store.get(f"gen/{number}/join/{rank}")
                    if data is not None:
                        slots[rank] = NodeSlot.from_json(data)
            return [slots[r] for r in sorted(slots)] if len(slots) == self.nnodes else None

        missing = lambda: sorted(set(range(self.nnodes)) - set(slots))  # noqa: E731
        return self._wait(collect, deadline, "nodes", describe_missing=missing)

    def _wait(
        self,
        probe: Callable[[], Any],
        deadline: float,
        what: str,
        describe_missing: Callable[[], list[int]] | None = None,
    ) -> Any:
        while True:
            value = probe()
            if value is not None:
                return value
            if self.interrupted():
                raise RendezvousError(f"interrupted while waiting for {what}")
            if time.monotonic() >= deadline:
                detail = f" (missing node ranks {describe_missing()})" if describe_missing else ""
                raise RendezvousError(f"timed out waiting for {what}{detail}")
            time.sleep(self.poll_s)

    def end(self, number: int, cause: dict[str, Any]) -> dict[str, Any]:
        """Declare generation ``number`` over; returns the cause that won (maybe another's)."""
        return self.store.set_first(f"gen/{number}/end", cause)

    def ended(self, number: int) -> dict[str, Any] | None:
        return self.store.get(f"gen/{number}/end")

    def mark_done(self, number: int) -> int:
        return self.store.add(f"gen/{number}/done", 1)

    def done_count(self, number: int) -> int:
        return self.store.add(f"gen/{number}/done", 0)

    def shut_down(self, reason: dict[str, Any]) -> dict[str, Any]:
        return self.store.set_first("shutdown", reason)

    def shutdown_reason(self) -> dict[str, Any] | None:
        return self.store.get("shutdown")
