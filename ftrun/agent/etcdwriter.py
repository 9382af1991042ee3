"""The agent's part of an etcd-v3 job (``--rdzv-backend etcd-v3``) that the TCPStore
backend has no use for: an agent that is not the writer runs for the writer's key once
the last writer's lease expired, and takes the writer's duties when it wins; every agent
reads a generation's member epochs from the worker store of the writer that formed it.

When that writer dies, its store (the member epochs, the step decisions) dies with it.
The agent that takes over serves a new, empty store for the running generation
(:func:`moved_store`), seeds it (agent/leader.py, ``take_over``) and then announces it: a
signed record ``gen/<N>/store`` in etcd for the other agents, and for its own workers the
store file (:func:`hand_down`, ``protocol.STORE_FILE_ENV``), which every agent rewrites
when it follows the move; the workers' failed requests reconnect to the address it names
(worker/membership.py), so the survivors keep their processes and regroup in place. The
generation ends instead (:func:`writer_gone`: a lost node) only when no new store is
announced in time. Functions of the :class:`~ftrun.agent.loop.Agent` whose state they read
and change (called from its loop, or from the writer watch's thread for :func:`promote`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftrun import protocol as P
from ftrun.agent.nodes import NodeWatch
from ftrun.control.auth import Signer, load_secret
from ftrun.control.errors import StoreError
from ftrun.control.heartbeat import HeartbeatMonitor, serve_presence
from ftrun.control.rendezvous import Generation, NodeSlot, Rendezvous
from ftrun.control.store import JsonStore
from ftrun.control.tcpstore import connect_store, reconnect_store, serve_store
from ftrun.observe.events import Event

if TYPE_CHECKING:
    from ftrun.control.election import Election

# ftrun.agent.loop.Agent, which imports this module (not imported back: no cycle)
Agent = Any


def watch_writer(agent: Agent, rdzv: Rendezvous) -> None:
    """etcd-v3, an agent that is not the writer: run for the writer's key once the last
    writer's lease expired (ftrun.control.election.WriterWatch); see :func:`promote`."""
    if agent.config.rdzv_backend != "etcd-v3" or agent.config.is_single_node \
            or agent.election is not None or agent._open_client is None:
        return
    from ftrun.control.election import WriterWatch
    agent._writer_watch = WriterWatch(
        agent._open_client, f"ftrun/{agent.run_id}/writer", agent.node_id,
        ttl_s=math.ceil(agent.config.heartbeat_timeout_s),
        interval_s=agent.config.heartbeat_interval_s,
        on_won=lambda election: promote(agent, rdzv, election)).start()
    if agent.heartbeat is not None:  # its presence port refused: the writer's agent died
        agent.heartbeat.on_server_gone = agent._writer_watch.nudge


def stop_watches(agent: Agent) -> None:
    """The agent stops (Agent.run's end): the writer watch's thread, and the lease view's
    thread of its heartbeat monitor (etcd-v3; waited for a slice and a request, not at all
    when the store is lost), said when still alive. Nothing else of the agent's is stopped."""
    if agent._writer_watch is not None:
        agent._writer_watch.stop(0.0)
    close_monitor(agent, 0.0 if agent.store_lost else None)


def close_monitor(agent: Agent, timeout_s: float | None = None) -> None:
    """Stop the agent's heartbeat monitor's lease view (HeartbeatMonitor.close: waited up
    to ``timeout_s``, default a slice and a request) and say so when its thread is still
    alive then; nothing when the agent has no monitor."""
    if agent.nodes is not None:
        stuck = agent.nodes.monitor.close(timeout_s)
        if stuck:
            agent.say(f"node {agent.node_id}: {stuck}", style="yellow")


def job_record(agent: Agent) -> dict[str, Any]:
    """The job's record as the writer keeps it (ftrun status adds what the status board
    knows; agent/inject.py). No store endpoint: the job's store is etcd. ``started`` is
    when this writer began to keep it."""
    return {"run_id": agent.run_id, "backend": "etcd-v3", "host": agent.store_host,
            "started": time.time()}


def promote(agent: Agent, rdzv: Rendezvous, election: Election) -> None:
    """This agent became the job's writer (called from the writer watch's thread): it
    serves the presence connections (ftrun/control/presence.py: a killed agent is lost at
    once) and watches the other agents' heartbeats, hosts the next generations' worker
    stores and forms them; the generation running now ends by itself (its workers lose the dead
    writer's store and their peers on its node), and the join of the next one, where
    the others wait, is formed here (ftrun.control.rendezvous: a promoted waiter
    forms the generation it waited for)."""
    agent.election = election
    if election.previous is not None:  # a join in progress leaves the dead writer's slot out
        rdzv.gone.add(election.previous)
    agent._bind_stores()
    # the presence connections move here: every agent's heartbeat thread connects to the
    # server the record names, once its connection to the dead writer has ended
    agent.presence = serve_presence(rdzv.store, Signer(load_secret()), agent.run_id,
                                    agent.store_bind, agent.store_host,
                                    agent._rejected_record)
    close_monitor(agent)  # a monitor replaced (none yet, as a rule): its lease view ends
    monitor = HeartbeatMonitor(rdzv.store, agent.config.heartbeat_timeout_s, agent.presence,
                               agent.config.heartbeat_interval_s)
    agent.nodes = NodeWatch(monitor, node_id=agent.node_id,
                            heartbeat_interval_s=agent.config.heartbeat_interval_s,
                            events=agent.events, say=agent.say)
    agent.nodes.begin(max(agent.node_rank, 0))
    rdzv.monitor = monitor
    if agent._services is not None:
        agent._services.nodes = agent.nodes
    agent.injector.keep_job(job_record(agent))  # ftrun status and inject read it
    rdzv.is_leader = True  # last: the rest is in place when the main thread sees it
    how = "its agent died: its lease was revoked" if election.gone_at is not None \
        else "its lease expired"
    agent.say(f"the job's writer is gone ({how}): this agent took over", style="yellow")


def generation_store(agent: Agent, generation: Generation, prefix: str) -> JsonStore:
    """etcd-v3: the store of ``generation``'s member epochs (its worker store, hosted by
    the agent that formed it), with the control store's secret and reconnection."""
    host, port, op = generation.worker_store_host, generation.worker_store_port, \
        agent._op_timeout
    own = agent.worker_stores[-1] if agent.worker_stores else None
    if own is not None and int(own.port) == port and host == agent.store_host:
        # the writer: its own store, in process (no connection, no connect to wait for)
        return JsonStore(own, prefix, signer=Signer(load_secret()),
                         on_reject=agent._rejected_record)
    connect = lambda: reconnect_store(host, port, op, op_timeout_s=op)  # noqa: E731
    # the first connect waits longer: the writer may still be opening it
    first = connect_store(host, port, agent.config.heartbeat_timeout_s * 3, op_timeout_s=op)
    return JsonStore(first, prefix, signer=Signer(load_secret()), reconnect=connect,
                     retry_s=agent.config.heartbeat_timeout_s * 3,
                     lost=lambda: agent._lost_reason() is not None or
                     writer_gone(agent, generation) is not None,
                     on_reject=agent._rejected_record)


def writer_gone(agent: Agent, generation: Generation) -> dict[str, Any] | None:
    """etcd-v3: the end cause ("node lost") when ``generation``'s writer (its node rank
    0, which formed it, or the agent that took its store over) no longer holds the
    writer's key (its lease expired); None while it does, or when etcd cannot say now."""
    if agent._rdzv is None or not generation.nodes:
        return None
    writer = _writer_of(agent, generation)
    if writer is None:
        return None
    try:
        held = agent._rdzv.store.raw.read(f"ftrun/{agent.run_id}/writer")
    except (RuntimeError, AttributeError):
        return None
    if held == writer.node_id.encode():
        return None
    return {"kind": "node lost", "node_id": writer.node_id, "node_rank": writer.node_rank,
            "node": writer.hostname, "addr": writer.addr,
            "silent_s": math.ceil(agent.config.heartbeat_timeout_s), "by": agent.node_rank,
            "time": time.time()}


def _writer_of(agent: Agent, generation: Generation) -> NodeSlot | None:
    """The node whose agent hosts ``generation``'s member-epoch store now."""
    node_id = agent.generation_writers.get(generation.number)
    if node_id is None:
        return generation.nodes[0]
    return generation.node(node_id)


def hand_down(agent: Agent, generation: Generation, host: str, port: int) -> None:
    """Tell this node's workers (those started from now on by their environment, the
    running ones by the file's new content) where ``generation``'s member-epoch store is: a
    record signed with the job's secret, replaced atomically (worker/membership.py reads
    it and follows it when it changes)."""
    agent.launcher.control_addr = f"{host}:{port}"
    path = Path(agent.launcher.run_log_dir) / "member-store.json"
    key = P.store_file_key(agent.config.rdzv_id, generation.number)
    record = Signer(load_secret()).wrap(
        key, {"generation": generation.number, "host": host, "port": int(port)})
    temporary = path.with_name(path.name + ".new")
    temporary.write_text(json.dumps(record))
    os.replace(temporary, path)
    os.environ[P.STORE_FILE_ENV] = str(path)


@dataclass
class MovedStore:
    """The store that replaces a dead writer's for the running generation."""

    store: JsonStore  # under the generation's regroup prefix
    lost: NodeSlot  # the dead writer's node
    took_over: bool  # this agent serves it (and seeds it before announcing it)
    announce: Callable[[], None]  # once seeded: the other agents and the workers may use it


def moved_store(agent: Agent, generation: Generation, prefix: str) -> MovedStore | None:
    """etcd-v3, after a failed request to ``generation``'s member-epoch store: the store
    that replaces it, when its writer died and this agent is the writer now (a new store
    served here), or another agent took over and announced its store in etcd; None when
    nothing replaces it (yet). The caller seeds a store this agent serves, then calls
    ``announce``. A record that is not signed with the job's secret is not read."""
    rdzv = agent._rdzv
    old = _writer_of(agent, generation)
    if rdzv is None or old is None:
        return None
    key = f"gen/{generation.number}/store"
    secret = Signer(load_secret())
    if agent.election is not None and rdzv.is_leader and old.node_id != agent.node_id:
        _say_lost_writer(agent, generation, old)
        server = serve_store(0, agent.config.join_timeout_s, host=agent.store_bind)
        agent.worker_stores.append(server)
        host, port = agent.store_host, int(server.port)
        agent.generation_writers[generation.number] = agent.node_id

        def announce() -> None:
            rdzv.store.set_record(key, {"host": host, "port": port, "writer": agent.node_id})
            hand_down(agent, generation, host, port)
            agent.say(f"serving generation {generation.number}'s member epochs at "
                      f"{host}:{port} (its store died with node {old.node_rank})",
                      style="yellow")
        return MovedStore(JsonStore(server, prefix, signer=secret,
                                    on_reject=agent._rejected_record), old, True, announce)
    try:
        record = rdzv.store.get_record(key)
    except StoreError:
        return None
    if record is None:
        return None
    host, port, writer = record.get("host"), record.get("port"), record.get("writer")
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(writer, str) \
            or writer == old.node_id or generation.node(writer) is None:
        return None  # not moved yet (or a record this job did not write)
    op = agent._op_timeout
    try:
        client = connect_store(host, port, agent.config.heartbeat_timeout_s, op_timeout_s=op)
    except StoreError:
        return None
    agent.generation_writers[generation.number] = writer
    store = JsonStore(
        client, prefix, signer=secret,
        reconnect=lambda: reconnect_store(host, port, op, op_timeout_s=op),
        retry_s=agent.config.heartbeat_timeout_s * 3,
        lost=lambda: agent._lost_reason() is not None or
        writer_gone(agent, generation) is not None,
        on_reject=agent._rejected_record)
    return MovedStore(store, old, False, lambda: hand_down(agent, generation, host, port))


def _say_lost_writer(agent: Agent, generation: Generation, old: NodeSlot) -> None:
    """The lost writer's ``node_lost`` event, for this agent's fault record (its cause and
    its detection time, ftrun/observe/faults.py): silent since its last sign of life, the
    last renewal of its lease, which expired a whole TTL after it. When the key was seen
    free (``vacated_at``) dates that renewal to a TTL before at the latest, and at most one
    watch interval earlier (when it was last seen held); the later bound is taken, so the
    detection time is never overstated. Without a campaign (this agent was elected at
    start) the detection time is a TTL. When a survivor revoked the lease because the
    writer's agent was seen dead (``gone_at``: its presence port refused), silent since
    that was seen."""
    election = agent.election
    now = time.time()
    vacated = election.vacated_at if election is not None and election.vacated_at else now
    ttl = election.ttl_s if election is not None else agent.config.heartbeat_timeout_s
    since, via = vacated - ttl, "lease"
    if election is not None and election.gone_at is not None:
        since, via = election.gone_at, "presence"
    agent.events.emit(Event.NODE_LOST, generation=generation.number, node=old.hostname,
                      node_rank=old.node_rank, node_id=old.node_id,
                      silent_s=round(max(0.0, now - since), 3), via=via)
