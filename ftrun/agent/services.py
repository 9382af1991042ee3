"""What a supervisor may use of its agent, and the one interface both supervisors implement.

A supervisor runs one job generation on this node and says how it ended
(:class:`Supervisor`). It does not see the agent: only these narrow services, which the
agent builds once it has joined the store. That keeps the dependency one way (the agent
knows its supervisors, never the reverse) and lets the supervisors' decisions be tested
against an in-memory store.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ftrun.agent.launcher import Launcher
from ftrun.agent.nodes import NodeWatch
from ftrun.agent.outcome import GenerationResult
from ftrun.agent.signals import SignalInbox
from ftrun.config import LaunchConfig
from ftrun.control.endwatch import EndWatcher, ReadEnd
from ftrun.control.rendezvous import Generation, Rendezvous
from ftrun.control.store import JsonStore
from ftrun.decide.crashloop import CrashLoop
from ftrun.observe.events import EventLog


@dataclass
class AgentServices:
    """The agent's facilities a supervisor uses (see the module docstring)."""

    config: LaunchConfig
    hostname: str
    node_id: str  # this agent's identity in the store (unique per process)
    say: Callable[..., None]  # one line to the person watching: say(text, style="")
    events: EventLog
    inbox: SignalInbox
    launcher: Launcher
    rdzv: Rendezvous
    nodes: NodeWatch | None  # the leader of a multi-node job only
    store_lost: Callable[[], str | None]  # why this agent lost the store, or None
    open_client: Callable[[], Any] | None  # non-leaders: a store client of a thread's own
    op_timeout_s: float  # the bound on one store request
    # etcd-v3: (generation, key prefix) -> the store of its member epochs (the generation's
    # worker store); None: the control store (see generation_store)
    generation_store_of: Callable[[Generation, str], JsonStore] | None = None
    # etcd-v3: the end cause when a generation's writer (its store's host) is gone, else None
    writer_gone: Callable[[Generation], dict[str, Any] | None] = lambda generation: None
    # etcd-v3: (generation, key prefix) -> the store that replaces a dead writer's member-
    # epoch store (agent/etcdwriter.py MovedStore), or None while nothing replaces it
    moved_store: Callable[[Generation, str], Any] = lambda generation, prefix: None
    # the failures seen in this job, every generation (ftrun.decide.crashloop)
    crash_loop: CrashLoop = field(default_factory=CrashLoop)
    said: set[str] = field(default_factory=set)  # lines said once per agent (see once)

    def once(self, key: str) -> bool:
        """True the first time ``key`` is asked for: a line said once per agent, not once
        per job generation."""
        if key in self.said:
            return False
        self.said.add(key)
        return True

    @property
    def node_rank(self) -> int:
        return self.launcher.node_rank

    @property
    def multi_node(self) -> bool:
        return not self.config.is_single_node

    def generation_store(self, generation: Generation, prefix: str) -> JsonStore:
        """Where ``generation``'s member epochs (ftrun.protocol) live, under ``prefix``: the
        control store, or with the etcd-v3 backend the generation's worker store, which
        its writer agent hosts and its workers reach (ftrun/control/etcd.py)."""
        if self.generation_store_of is None:
            return self.rdzv.store.scoped(prefix)
        return self.generation_store_of(generation, prefix)

    @contextlib.contextmanager
    def end_watch(self, generation: Generation) -> Iterator[EndWatcher | ReadEnd]:
        """A started watcher of ``generation``'s end (see ftrun.control.endwatch); the leader
        and a single node read the end directly (in-process: it costs no network)."""
        if self.open_client is None:
            yield ReadEnd()
            return
        # A wait slice under the request timeout (or the socket gives up first), and short
        # for a prompt stop().
        slice_s = min(1.0, self.op_timeout_s / 2)
        watcher = EndWatcher(self.open_client, self.rdzv.store,
                             f"gen/{generation.number}/end", slice_s).start()
        try:
            yield watcher
        finally:
            # Without a store (the agent exits at once, by os._exit) nothing is waited for.
            watcher.stop(0.0 if self.store_lost() is not None else 5.0)


class Supervisor(Protocol):
    """Runs one job generation on this node: spawns its workers, watches them and the rest of
    the job, and returns how the generation ended. It never raises for anything a job can
    do, except ``StoreLostError`` when this agent lost the store (its workers stopped)."""

    def run(self, generation: Generation) -> GenerationResult: ...
