"""A regroup member process as its agent sees it: one state, its transitions written down.

A *member* is one worker process under in-process regroup, named ``<node rank>.<n>`` for its
whole life (its rank changes with each member epoch; its id does not). Its agent tracks it
through :class:`MemberState`::

    STARTING --(its status record appears: it called ftrun.init())--> READY
    STARTING --(exits 0 while in the current epoch: a script without the API)--> FINISHED
    READY    --(exits 0, or exits after saying it left its loop)--> FINISHED
    STARTING, READY --(exit, frozen, silent heartbeat, stall verdict, node dropped)--> REMOVED

FINISHED and REMOVED are final. Whether a member *computes* is not a state of the process but
of the job: it is in the latest member epoch (:class:`ftrun.protocol.MemberEpoch`) or not (a
spare, or a replacement waiting to join).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from ftrun.agent.processes import WorkerProcess


class MemberState(Enum):
    STARTING = "starting"  # spawned; has not called ftrun.init() (no status record)
    READY = "ready"  # its status record exists: past its imports, using the worker API
    FINISHED = "finished"  # left its training loop and exited with the job
    REMOVED = "removed"  # taken out by its agent or the leader (the cause is kept)


TRANSITIONS: dict[MemberState, frozenset[MemberState]] = {
    MemberState.STARTING: frozenset({MemberState.READY, MemberState.FINISHED,
                                     MemberState.REMOVED}),
    MemberState.READY: frozenset({MemberState.FINISHED, MemberState.REMOVED}),
    MemberState.FINISHED: frozenset(),
    MemberState.REMOVED: frozenset(),
}


@dataclass
class LocalMember:
    """One of this node's member processes and what its agent knows of it."""

    id: str
    process: WorkerProcess
    initial: bool  # started with the job generation (holds the state), not a joiner/spare
    state: MemberState = MemberState.STARTING
    removed_cause: str | None = None
    ready_at: float | None = None  # when its status record was first seen
    beats: int = 0  # the last heartbeat count read from its status
    native_liveness: int = -1  # the shim's liveness counter, where the shim runs
    alive_at: float = field(default_factory=time.monotonic)  # last sign of life

    def advance(self, state: MemberState, cause: str | None = None) -> None:
        """Move to ``state``; an undocumented transition is a bug in ftrun."""
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"member {self.id}: {self.state.name} -> {state.name} is not a "
                               "member transition")
        self.state = state
        if state is MemberState.READY:
            self.ready_at = time.monotonic()
        if state is MemberState.REMOVED:
            self.removed_cause = cause

    @property
    def live(self) -> bool:
        """Neither finished nor removed: its agent still watches it."""
        return self.state in (MemberState.STARTING, MemberState.READY)

    @property
    def has_status(self) -> bool:
        """Its status record exists: it became ready at some point, or finished (its agent
        writes the status of a member that never said so itself)."""
        return self.ready_at is not None or self.state is MemberState.FINISHED
