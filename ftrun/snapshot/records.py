"""The snapshot records in the control store: the two phases and the restore decision.

Keys live under the job generation's regroup prefix (beside :mod:`ftrun.protocol`'s), each
value a record signed with the job's secret and checked on read:

==================================  ==================  =====================================
key                                 written by          meaning
==================================  ==================  =====================================
``snap/<e>/<s>/local/<rank>``       the rank's worker   phase 1: rank's state at step s of
                                                        member epoch e is written on its node
``snap/<e>/<s>/replica/<rank>``     the rank's worker   phase 2: a copy is on another node,
                                                        written once the buddy's agent
                                                        acknowledged it with the CRC32 it
                                                        verified (several nodes only)
``snap/restore/<e>``                a member, 1st wins  which snapshot every member of member
                                                        epoch e restores (or none)
``snap/<e>/<s>/failed``             a rank              its copy or replica failed: (e, s)
                                                        will never count, stop waiting
``snap/server/<e>/<node>``          the node's workers  its replica server's host:port
``snap/whole-world``                every worker        sharded: replace lost ranks, never
                                                        shrink
==================================  ==================  =====================================

A snapshot (e, s) counts only when every rank of member epoch e has both records (on one
node there is no other node to hold a replica: the local record alone counts, and a lost
node means a lost job there anyway). Recovery reads one decision per member epoch, made
after every member arrived (so no member still writes), by the lowest-ranked member that
held state before: the newest snapshot it published that is complete. Every member
restores that one, so all ranks restore the same step, and a snapshot that was half taken
when the fault came (some ranks' records missing) is never used: nothing is mixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftrun.control.errors import StoreValueError, require


def local_key(epoch: int, step: int, rank: int) -> str:
    return f"snap/{epoch}/{step}/local/{rank}"


def replica_key(epoch: int, step: int, rank: int) -> str:
    return f"snap/{epoch}/{step}/replica/{rank}"


def restore_key(epoch: int) -> str:
    return f"snap/restore/{epoch}"


@dataclass(frozen=True)
class Written:
    """One phase of one rank's snapshot: where a copy is and what it must check to.

    ``replicas``: whether this snapshot needs a replica of every rank to count (its member
    epoch spans several nodes); ``server``: host:port of the replica server of the node
    holding this copy ("" on one node), where a worker of another node can fetch it."""

    node: int
    host: str
    crc32: int
    size: int
    world_size: int
    replicas: bool = False
    server: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "host": self.host, "crc32": self.crc32, "size": self.size,
                "world_size": self.world_size, "replicas": self.replicas,
                "server": self.server}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Written:
        replicas = data.get("replicas", False)
        server = data.get("server", "")
        if not isinstance(replicas, bool) or not isinstance(server, str):
            raise StoreValueError("snapshot record: 'replicas' or 'server' has a bad type")
        return cls(require(data, "node", int), require(data, "host", str),
                   require(data, "crc32", int), require(data, "size", int),
                   require(data, "world_size", int), replicas, server)


#: Written by every ``ftrun.restartable`` worker as it starts: the job's state is sharded,
#: so it cannot go on with fewer ranks; the leader then fills a lost node's ranks with
#: ready spares of the other nodes instead of shrinking (:mod:`ftrun.agent.leader`).
WHOLE_WORLD_KEY = "snap/whole-world"


def failed_key(epoch: int, step: int) -> str:
    """Set by a rank whose copy or replica of snapshot (epoch, step) failed: the others
    stop waiting for that snapshot to complete (it never will)."""
    return f"snap/{epoch}/{step}/failed"


def server_key(epoch: int, node: int) -> str:
    """host:port of node ``node``'s replica server, as its workers of member epoch
    ``epoch`` were told by their agent (the buddies of that epoch read it)."""
    return f"snap/server/{epoch}/{node}"


@dataclass(frozen=True)
class Restore:
    """The snapshot every member of a member epoch restores: taken in member epoch
    ``epoch`` of job generation ``generation`` (an earlier one after a restart: its records
    are under that generation's prefix); ``epoch`` -1: none (start from the script's own
    initial state)."""

    generation: int
    epoch: int
    step: int

    @property
    def held(self) -> tuple[int, int, int]:
        return (self.generation, self.epoch, self.step)

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "epoch": self.epoch, "step": self.step}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Restore:
        generation = require(data, "generation", int)
        epoch, step = require(data, "epoch", int), require(data, "step", int)
        if generation < -1 or epoch < -1 or step < 0:
            raise StoreValueError("restore names a negative generation, epoch or step")
        return cls(generation, epoch, step)


NONE = Restore(-1, -1, 0)
