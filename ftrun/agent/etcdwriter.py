"""The agent's part of an etcd-v3 job (``--rdzv-backend etcd-v3``) that the TCPStore
backend has no use for: an agent that is not the writer runs for the writer's key once
the last writer's lease expired, and takes the writer's duties when it wins; every agent
reads a generation's member epochs from the worker store of the writer that formed it,
and ends that generation when its writer is gone. Functions of the :class:`~ftrun.agent.
loop.Agent` whose state they read and change (called from its loop, or from the writer
watch's thread for :func:`promote`).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from ftrun.agent.nodes import NodeWatch
from ftrun.control.auth import Signer, load_secret
from ftrun.control.heartbeat import HeartbeatMonitor
from ftrun.control.rendezvous import Generation, Rendezvous
from ftrun.control.store import JsonStore, connect_store

if TYPE_CHECKING:
    from ftrun.control.etcd import Election

# ftrun.agent.loop.Agent, which imports this module (not imported back: no cycle)
Agent = Any


def watch_writer(agent: Agent, rdzv: Rendezvous) -> None:
    """etcd-v3, an agent that is not the writer: run for the writer's key once the last
    writer's lease expired (ftrun.control.etcd.WriterWatch); see :func:`promote`."""
    if agent.config.rdzv_backend != "etcd-v3" or agent.config.is_single_node \
            or agent.election is not None or agent._open_client is None:
        return
    from ftrun.control.etcd import WriterWatch
    agent._writer_watch = WriterWatch(
        agent._open_client, f"ftrun/{agent.run_id}/writer", agent.node_id,
        ttl_s=math.ceil(agent.config.heartbeat_timeout_s),
        interval_s=agent.config.heartbeat_interval_s,
        on_won=lambda election: promote(agent, rdzv, election)).start()


def promote(agent: Agent, rdzv: Rendezvous, election: Election) -> None:
    """This agent became the job's writer (called from the writer watch's thread): it
    watches the other agents' heartbeats, hosts the next generations' worker stores and
    forms them; the generation running now ends by itself (its workers lose the dead
    writer's store and their peers on its node), and the join of the next one, where
    the others wait, is formed here (ftrun.control.rendezvous: a promoted waiter
    forms the generation it waited for)."""
    agent.election = election
    agent._bind_stores()
    monitor = HeartbeatMonitor(rdzv.store, agent.config.heartbeat_timeout_s)
    agent.nodes = NodeWatch(monitor, node_id=agent.node_id,
                            heartbeat_interval_s=agent.config.heartbeat_interval_s,
                            events=agent.events, say=agent.say)
    agent.nodes.begin(max(agent.node_rank, 0))
    rdzv.monitor = monitor
    if agent._services is not None:
        agent._services.nodes = agent.nodes
    rdzv.is_leader = True  # last: the rest is in place when the main thread sees it
    agent.say("the job's writer is gone (its lease expired): this agent took over",
              style="yellow")


def generation_store(agent: Agent, generation: Generation, prefix: str) -> JsonStore:
    """etcd-v3: the store of ``generation``'s member epochs (its worker store, hosted by
    the agent that formed it), with the control store's secret and reconnection."""
    host, port, op = generation.worker_store_host, generation.worker_store_port, \
        agent._op_timeout
    own = agent.worker_stores[-1] if agent.worker_stores else None
    if own is not None and int(own.port) == port and host == agent.store_host:
        # the writer: its own store, in process (no connect: one to the last writer's
        # dead host may still hold the connect lock, see control/store.py)
        return JsonStore(own, prefix, signer=Signer(load_secret()),
                         on_reject=agent._rejected_record)
    connect = lambda: connect_store(host, port, op, op_timeout_s=op)  # noqa: E731
    # the first connect waits longer: the writer may still be opening it, and a connect
    # to the last writer's dead host may hold the connect lock for an op timeout
    first = connect_store(host, port, agent.config.heartbeat_timeout_s * 3, op_timeout_s=op)
    return JsonStore(first, prefix, signer=Signer(load_secret()), reconnect=connect,
                     retry_s=agent.config.heartbeat_timeout_s * 3,
                     lost=lambda: agent._lost_reason() is not None or
                     writer_gone(agent, generation) is not None,
                     on_reject=agent._rejected_record)


def writer_gone(agent: Agent, generation: Generation) -> dict[str, Any] | None:
    """etcd-v3: the end cause ("node lost") when ``generation``'s writer, its node rank
    0, which formed it and hosts its store, no longer holds the writer's key (its lease
    expired); None while it does, or when etcd cannot say now."""
    if agent._rdzv is None or not generation.nodes:
        return None
    writer = generation.nodes[0]
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
