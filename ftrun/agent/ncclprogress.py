"""How far each worker got in NCCL, from its shim page, and who is behind.

NCCL only completes collective number k on a communicator once every rank of it has issued
its k-th collective. A rank that stopped issuing them (wedged in its own code, a dead host
thread, a GPU that fell off the bus) therefore leaves its peers waiting, and where they
wait is often not "in communication" by their Python stacks: their host threads issued the
collective and moved on, to block in a CUDA synchronisation (``loss.item()``) that may even
spin. The shim counts, per communicator, the collectives every rank issued and names the
communicator alike on every rank (``comm_id``, see ``csrc/ftshim_abi.h``), so the agent
can compare ranks directly: on a communicator, the ranks that issued fewer collectives than
a peer are the ones the peers wait for.

Point-to-point calls are left out of the comparison (``coll_seq``): the ranks of one
communicator issue different numbers of them by design (pipeline stages).

Reading a page never raises: a worker whose page cannot be read has no progress.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TypeVar

from ftrun.agent.processes import WorkerProcess
from ftrun.shim import ShimError


@dataclass(frozen=True)
class NcclProgress:
    """One worker's live communicators as its shim counts them."""

    collectives: dict[int, int]  # comm_id -> collectives issued (known ids only)
    last_op: dict[int, str]  # comm_id -> the NCCL function it called last
    operations: int  # every operation on every live communicator: moves with any call
    inside: str | None  # "ncclAllReduce #12" while a thread is inside a call, else None


@dataclass(frozen=True)
class Late:
    """A worker that issued fewer collectives on a communicator than a peer did."""

    comm_id: int
    issued: int  # its own count
    peers: int  # the count the furthest peer reached

    def describe(self) -> str:
        return f"behind on collective #{self.peers} (issued {self.issued})"


def nccl_progress(worker: WorkerProcess) -> NcclProgress | None:
    """The worker's progress; None without a shim page, a readable one, or a live comm."""
    shim = worker.shim
    if shim is None:
        return None
    try:
        comms = [c for c in shim.communicators() if c.state == "live"]
    except (ShimError, OSError, ValueError):
        return None
    if not comms:
        return None
    inside = next((f"{c.last_op} #{c.seq}" for c in comms if c.inflight > 0), None)
    return NcclProgress(
        collectives={c.comm_id: c.coll_seq for c in comms if c.comm_id},
        last_op={c.comm_id: c.last_op for c in comms if c.comm_id},
        operations=sum(c.seq for c in comms),
        inside=inside,
    )


Key = TypeVar("Key", bound=Hashable)


def late_workers(progress: dict[Key, NcclProgress]) -> dict[Key, Late]:
    """By worker (a pid, or (node, pid) across nodes): the workers behind a peer on some
    communicator (the first such one).

    Only counts that can be seen are compared: a communicator whose other ranks live on
    other nodes makes nobody late here (a lower bound of the furthest count still proves a
    rank below it late)."""
    furthest: dict[int, int] = {}
    for seen in progress.values():
        for comm_id, issued in seen.collectives.items():
            furthest[comm_id] = max(furthest.get(comm_id, 0), issued)
    late: dict[Key, Late] = {}
    for key, seen in progress.items():
        for comm_id, issued in sorted(seen.collectives.items()):
            if issued < furthest[comm_id]:
                late[key] = Late(comm_id, issued, furthest[comm_id])
                break
    return late


def waiting_where(seen: NcclProgress, late: Late) -> str:
    """Where a worker ahead of ``late`` waits: the collective the late one never issued."""
    return f"{seen.last_op.get(late.comm_id, 'a collective')} #{late.peers}"
