"""A job generation's membership: the record itself (:class:`Generation`) and how each node
receives it: a node's slot (:class:`NodeSlot`), its signed assignment (:class:`Assignment`,
one small record per node, so thousands of agents need not each read the whole membership),
and the whole record read lazily and checked against the assignment's digest
(:class:`LazyNodes`). Split out of ``rendezvous.py``, which forms generations; this module
only describes them."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from ftrun.control.auth import canonical
from ftrun.control.errors import RendezvousError, StoreValueError, require


def assignment_key(number: int, node_id: str) -> str:
    return f"gen/{number}/as/{node_id}"


@dataclass(frozen=True)
class NodeSlot:
    """One agent's offer to take part in a generation (c10d: ``node_rank`` is given by the
    leader in the record; the agent offers -1).

    ``standby``: in a generation record, a hot spare node (``--standby-nodes``): it holds no
    rank (``local_world_size`` 0), its agent starts its workers as waiting spares, and the
    regroup leader gives them a lost node's ranks. ``health``: in an offer, why the node
    failed its health gate (the quick ``ftrun doctor`` checks, :mod:`ftrun.doctor.gate`);
    the leader refuses such an offer and says why. Both are left out of the JSON when unset
    (the records of jobs without them are unchanged)."""

    node_rank: int
    local_world_size: int
    addr: str
    hostname: str
    pid: int
    node_id: str = ""
    standby: bool = False
    health: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeSlot:
        slot = cls(
            node_id=require(data, "node_id", str),
            node_rank=require(data, "node_rank", int),
            local_world_size=require(data, "local_world_size", int),
            addr=require(data, "addr", str),
            hostname=require(data, "hostname", str),
            pid=require(data, "pid", int),
            standby=data.get("standby", False),
            health=data.get("health", ""),
        )
        if not isinstance(slot.standby, bool) or not isinstance(slot.health, str) \
                or len(slot.health) > 2000:
            raise StoreValueError("node slot with a malformed standby or health field")
        if slot.node_rank < -1 or not slot.node_id or \
                slot.local_world_size < (0 if slot.standby else 1):
            raise StoreValueError("node slot with a bad rank, no workers or no id")
        return slot

    def to_json(self) -> dict[str, Any]:
        """The record's fields (``dataclasses.asdict`` deep-copies: 20x slower, and the
        leader writes 4,096 of these per generation at that size)."""
        made: dict[str, Any] = {
            "node_rank": self.node_rank, "local_world_size": self.local_world_size,
            "addr": self.addr, "hostname": self.hostname, "pid": self.pid,
            "node_id": self.node_id}
        if self.standby:
            made["standby"] = True
        if self.health:
            made["health"] = self.health
        return made

    def with_rank(self, node_rank: int, *, standby: bool = False) -> NodeSlot:
        """This node at ``node_rank`` in a generation (``standby``: as a hot spare node,
        with no rank of its own)."""
        return NodeSlot(node_rank, 0 if standby else self.local_world_size, self.addr,
                        self.hostname, self.pid, self.node_id, standby)


@dataclass(frozen=True)
class Assignment:
    """One node's place in a generation: everything its agent needs to start its workers,
    and the digest of the full record (``gen/N``) it belongs to."""

    number: int
    restart_count: int
    node: NodeSlot  # with its node rank in this generation
    rank_offset: int
    nnodes: int
    world_size: int
    worker_store_host: str
    worker_store_port: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"number": self.number, "restart_count": self.restart_count,
                "node": self.node.to_json(), "rank_offset": self.rank_offset,
                "nnodes": self.nnodes, "world_size": self.world_size,
                "worker_store_host": self.worker_store_host,
                "worker_store_port": self.worker_store_port, "digest": self.digest}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Assignment:
        numbers = {name: require(data, name, int) for name in (
            "number", "restart_count", "rank_offset", "nnodes", "world_size",
            "worker_store_port")}
        made = cls(node=NodeSlot.from_json(require(data, "node", dict)),
                   worker_store_host=require(data, "worker_store_host", str),
                   digest=require(data, "digest", str), **numbers)
        node = made.node
        if not (0 <= node.node_rank < made.nnodes and made.rank_offset >= 0
                and made.rank_offset + node.local_world_size <= made.world_size):
            raise StoreValueError("assignment with a rank outside its generation")
        if not 0 < made.worker_store_port < 65536:
            raise StoreValueError("assignment with an invalid worker store port")
        return made


def record_digest(record: dict[str, Any]) -> str:
    """SHA-256 of a generation record's canonical JSON (what an assignment names)."""
    return hashlib.sha256(canonical(record)).hexdigest()


class LazyNodes(Sequence[NodeSlot]):
    """A generation's node list read from the store on first use (see the module
    docstring: an agent holds its assignment; the membership is fetched when asked for).
    ``load`` returns the nodes or raises :class:`RendezvousError`/``StoreError``."""

    def __init__(self, load: Callable[[], tuple[NodeSlot, ...]]) -> None:
        self._load = load
        self._nodes: tuple[NodeSlot, ...] | None = None
        self._lock = threading.Lock()

    def _get(self) -> tuple[NodeSlot, ...]:
        with self._lock:
            if self._nodes is None:
                self._nodes = self._load()
            return self._nodes

    @property
    def loaded(self) -> bool:
        return self._nodes is not None

    @overload
    def __getitem__(self, index: int) -> NodeSlot: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[NodeSlot]: ...

    def __getitem__(self, index: int | slice) -> NodeSlot | Sequence[NodeSlot]:
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[NodeSlot]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LazyNodes({self._nodes!r})" if self.loaded else "LazyNodes(<not read>)"


@dataclass(frozen=True)
class Generation:
    """One membership of the job; immutable once written. A non-leader's generation is
    built from its :class:`Assignment`: its own place, the world size and the node count
    are known at once, ``nodes`` is a :class:`LazyNodes` read on first use."""

    number: int
    restart_count: int
    nodes: Sequence[NodeSlot]  # ordered by node rank
    worker_store_host: str
    worker_store_port: int
    own: Assignment | None = field(default=None, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        if self.own is not None:
            return self.own.world_size
        return sum(node.local_world_size for node in self.nodes)

    @property
    def nnodes(self) -> int:
        if self.own is not None:
            return self.own.nnodes
        return len(self.nodes)

    def rank_offset(self, node_rank: int) -> int:
        if self.own is not None and node_rank == self.own.node.node_rank:
            return self.own.rank_offset
        offset = 0
        for node in self.nodes:
            if node.node_rank == node_rank:
                return offset
            offset += node.local_world_size
        raise RendezvousError(f"node rank {node_rank} is not in generation {self.number}")

    def node(self, node_id: str) -> NodeSlot | None:
        if self.own is not None and node_id == self.own.node.node_id:
            return self.own.node
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def assignments(self, digest: str) -> list[Assignment]:
        """Every node's assignment in this (complete) generation, in node rank order."""
        made = []
        offset, world, nnodes = 0, self.world_size, len(self.nodes)
        for node in self.nodes:
            made.append(Assignment(self.number, self.restart_count, node, offset, nnodes,
                                   world, self.worker_store_host, self.worker_store_port,
                                   digest))
            offset += node.local_world_size
        return made

    @property
    def node_ids(self) -> frozenset[str]:
        return frozenset(n.node_id for n in self.nodes)

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "restart_count": self.restart_count,
            "nodes": [node.to_json() for node in self.nodes],
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
        if not nodes or ranks[0] < 0 or len(generation.node_ids) != len(nodes):
            raise StoreValueError("generation record with no nodes, a negative rank or a "
                                  "duplicate node id")
        if not 0 < generation.worker_store_port < 65536:
            raise StoreValueError("generation record with an invalid worker store port")
        return generation
