"""Rendezvous at scale: each agent waits for its own assignment, not the whole record.

A generation record names every node (600 KB at 4,096 nodes); had every agent to fetch,
verify and parse it, a join would cost O(N^2) bytes. The leader instead writes one small
signed assignment per node (``gen/N/as/<node id>``, one ``multi_set``) before the record,
and an agent reads the record only when something asks for the membership, checked against
the digest in its assignment. These tests run the real join on a real TCPStore with real
agents (threads, each on a connection of its own, as the benchmark's light agents are).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from ftrun.control.auth import Signer
from ftrun.control.etcd import EtcdClient, EtcdOptions, connect_etcd
from ftrun.control.etcdwire import deadline_error
from ftrun.control.heartbeat import HeartbeatMonitor, serve_presence
from ftrun.control.rendezvous import (
    DynamicRendezvous,
    Generation,
    LazyNodes,
    NodeSlot,
    RendezvousError,
    assignment_key,
)
from ftrun.control.store import JsonStore
from ftrun.control.tcpstore import connect_store, serve_store
from tests.infra.etcd_cluster import FreezableRelay, etcd_missing_reason, loopback_etcd

TOKEN = b"scale-test-token"


@pytest.fixture
def server() -> Iterator[object]:
    yield serve_store(0, 30)


def _rdzv(port: int, run: str, *, leader: bool, n: int) -> DynamicRendezvous:
    client = connect_store("127.0.0.1", port, 10, op_timeout_s=5)
    store = JsonStore(client, f"ftrun/{run}", signer=Signer(TOKEN))
    return DynamicRendezvous(store, min_nodes=n, max_nodes=n, last_call_s=0,
                             is_leader=leader, poll_s=0.01, interrupted=lambda: False)


def _slot(i: int, workers: int = 2) -> NodeSlot:
    return NodeSlot(-1, workers, f"10.0.{i // 250}.{i % 250}", f"h{i}", 1000 + i, f"node-{i}")


def _join_all(port: int, run: str, n: int, *, extra: int = 0, timeout_s: float = 20.0,
              extra_timeout_s: float | None = None
              ) -> tuple[Generation, dict[int, Generation | BaseException]]:
    """The leader (node-0) and ``n - 1 + extra`` agents join a generation of ``n``; the
    last ``extra`` of them give up after ``extra_timeout_s`` (default ``timeout_s``)."""
    results: dict[int, Generation | BaseException] = {}

    def agent(i: int) -> None:
        limit = timeout_s if i < n or extra_timeout_s is None else extra_timeout_s
        try:
            results[i] = _rdzv(port, run, leader=False, n=n).join(
                0, _slot(i), limit, lambda: ("unused", 1))
        except BaseException as error:  # reported by the test
            results[i] = error

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(1, n + extra)]
    for t in threads:
        t.start()
    leader = _rdzv(port, run, leader=True, n=n).join(
        0, _slot(0), timeout_s, lambda: ("10.9.9.9", 4242))
    for t in threads:
        t.join(timeout_s + 10)
    return leader, results


def test_agents_hold_their_assignment_and_read_the_membership_only_when_asked(
        server) -> None:  # type: ignore[no-untyped-def]
    """32 agents join a generation of 32 (a 33rd is left out and asks for the next one):
    each knows its rank offset, the world size, the node count and the worker store from
    its assignment alone; the full membership, read on demand, equals the leader's."""
    port = int(server.port)  # type: ignore[attr-defined]
    n = 32
    leader, results = _join_all(port, "scale", n, extra=1, timeout_s=8.0, extra_timeout_s=3.0)
    assert leader.nnodes == n and leader.world_size == 2 * n
    joined = {i: g for i, g in results.items() if isinstance(g, Generation)}
    assert len(joined) == n - 1, results  # the leader is the 32nd
    for i, generation in joined.items():
        node = generation.node(f"node-{i}")
        assert node is not None and generation.world_size == 2 * n and generation.nnodes == n
        assert generation.rank_offset(node.node_rank) == 2 * node.node_rank
        assert (generation.worker_store_host, generation.worker_store_port) == \
            ("10.9.9.9", 4242)
        assert isinstance(generation.nodes, LazyNodes) and not generation.nodes.loaded
    left_out = [i for i, g in results.items() if not isinstance(g, Generation)]
    assert len(left_out) == 1 and isinstance(results[left_out[0]], RendezvousError), results
    assert "timed out" in str(results[left_out[0]]) and "generation" in str(
        results[left_out[0]])  # it waited in generation 1, which never formed
    some = next(iter(joined.values()))
    assert tuple(some.nodes) == tuple(leader.nodes) and some.nodes.loaded
    assert [n_.node_rank for n_ in leader.nodes] == list(range(n))
    assert sorted(leader.nodes, key=lambda s: s.node_rank)[0].node_id == "node-0"


def test_forged_assignments_are_ignored_and_a_record_that_does_not_match_is_refused(
        server) -> None:  # type: ignore[no-untyped-def]
    """An assignment written without the job's token is ignored (the agent goes on waiting
    for the leader's); a generation record changed after the assignments were written
    (its digest differs) is refused when the membership is read."""
    port = int(server.port)  # type: ignore[attr-defined]
    forger = JsonStore(connect_store("127.0.0.1", port, 10), "ftrun/forge",
                       signer=Signer(b"not-the-token"))
    forged = {"number": 0, "restart_count": 0, "node": asdict(_slot(1).with_rank(1)),
              "rank_offset": 0, "nnodes": 1, "world_size": 2,
              "worker_store_host": "6.6.6.6", "worker_store_port": 666, "digest": "0" * 64}
    forger.set_record(assignment_key(0, "node-1"), forged)
    leader, results = _join_all(port, "forge", 2)
    generation = results[1]
    assert isinstance(generation, Generation), results
    assert generation.worker_store_host == "10.9.9.9"
    # rewrite the record under the token (as a compromised writer could): digest mismatch
    signed = JsonStore(connect_store("127.0.0.1", port, 10), "ftrun/forge",
                       signer=Signer(TOKEN))
    signed.raw.delete_key(signed.key("gen/0"))
    body = leader.to_json()
    body["worker_store_port"] = 1
    signed.put_record("gen/0", body)
    with pytest.raises(RendezvousError, match="digest"):
        list(generation.nodes)



def test_an_agent_that_finds_only_a_forged_assignment_waits_for_the_leader_s(
        server) -> None:  # type: ignore[no-untyped-def]
    """The forged assignment is there before the agent looks (no leader has joined yet):
    the agent goes on waiting past it, however long the leader takes, and takes its place
    from the leader's assignment once there is one."""
    port = int(server.port)  # type: ignore[attr-defined]
    forger = JsonStore(connect_store("127.0.0.1", port, 10), "ftrun/forged-first",
                       signer=Signer(b"not-the-token"))
    forged = {"number": 0, "restart_count": 0, "node": asdict(_slot(1).with_rank(1)),
              "rank_offset": 0, "nnodes": 1, "world_size": 2,
              "worker_store_host": "6.6.6.6", "worker_store_port": 666, "digest": "0" * 64}
    forger.set_record(assignment_key(0, "node-1"), forged)
    results: dict[int, Generation | BaseException] = {}

    def agent() -> None:
        try:
            results[1] = _rdzv(port, "forged-first", leader=False, n=2).join(
                0, _slot(1), 30, lambda: ("unused", 1))
        except BaseException as error:  # reported by the test
            results[1] = error

    waiter = threading.Thread(target=agent, daemon=True)
    waiter.start()
    # its slot offered: it is waiting for its assignment, where the forged one already is
    assert _until(lambda: forger.exists("gen/0/slots"), 20), "the agent never offered its slot"
    waiter.join(0.5)
    assert waiter.is_alive() and not results, results
    leader = _rdzv(port, "forged-first", leader=True, n=2).join(
        0, _slot(0), 30, lambda: ("10.9.9.9", 4242))
    waiter.join(40)
    generation = results.get(1)
    assert isinstance(generation, Generation), results
    assert (generation.worker_store_host, generation.worker_store_port) == ("10.9.9.9", 4242)
    assert tuple(generation.nodes) == tuple(leader.nodes)


def _loadgen() -> Any:
    """scripts/loadgen.py, the scale benchmarks' simulated agents (scripts/ is no package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "loadgen.py"
    spec = importlib.util.spec_from_file_location("ftrun_loadgen", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module



@pytest.mark.parametrize("ended", [
    {"error": {"grpc_code": 4, "http_code": 504, "message": "context deadline exceeded"}},
    {"error": {"grpc_code": 2, "http_code": 500, "message": "context deadline exceeded"}},
], ids=["deadline-exceeded", "unknown"])
def test_a_simulated_agents_watch_takes_either_form_of_the_gateways_deadline(
        ended: dict[str, Any]) -> None:
    """A simulated etcd agent's watch stream (scripts/loadgen.py ``HttpConn.stream``) that
    the gateway ends at its deadline, as etcd's gateways say it: DEADLINE_EXCEEDED, or
    UNKNOWN "context deadline exceeded" (etcd 3.4's). Its event reaches the agent, the
    deadline's message does not, and the stream ends as the wait's timeout (the connection
    kept for the next request), not as a failure, however early its clock says it is."""
    loadgen = _loadgen()
    errors: list[str] = []
    gen = SimpleNamespace(loop=loadgen.Loop(), etcd_port=0, host="127.0.0.1",
                          count_error=errors.append)
    ours, gateway = socket.socketpair()
    try:
        ours.setblocking(False)
        conn = loadgen.HttpConn(gen, None, on_live=lambda: None)
        conn.sock, conn.live = ours, True
        gen.loop.sel.register(ours, selectors.EVENT_READ, conn._on_read)
        messages: list[dict[str, Any]] = []
        timed_out: list[bool] = []
        conn.stream("/watch", {"create_request": {"key": "YQ=="}}, messages.append, 60.0,
                    lambda: timed_out.append(True))
        assert gateway.recv(65536).startswith(b"POST /v3/watch HTTP/1.1\r\n")
        event = {"result": {"events": [{"kv": {"key": "YQ==", "value": "QQ=="}}]}}

        def chunk(data: bytes) -> bytes:
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"
        gateway.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + chunk(json.dumps(event).encode() + b"\n")
                        + chunk(json.dumps(ended).encode()) + chunk(b""))
        deadline = time.monotonic() + 10
        while not timed_out and not conn.closed and time.monotonic() < deadline:
            gen.loop.run_once(0.05)
        assert timed_out == [True] and not conn.closed, (messages, errors)
        assert messages == [event["result"]] and errors == []
        assert not conn.streaming and conn.sock is ours
    finally:
        ours.close()
        gateway.close()


def _until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_simulated_agents_speak_the_real_protocols_to_the_real_leader(job_dir: Path) -> None:
    """The store-load benchmark's event-driven agents (scripts/loadgen.py), 20 in two
    processes, against ftrun's own leader: its TCPStore, PresenceServer and
    HeartbeatMonitor. Their signed heartbeats verify and keep growing, their presence
    hellos are accepted, and for longer than the timeout none is lost; a stopped agent is
    lost by silence, a killed one at once by its connection, and no other; every other
    agent reads and verifies the end record the leader writes, and says goodbye."""
    loadgen = _loadgen()
    server = serve_store(0, 30)
    signer = Signer(TOKEN)
    store = JsonStore(server, "ftrun/gen", signer=signer)
    rejected: list[str] = []
    presence = serve_presence(store, signer, "gen", "127.0.0.1", "127.0.0.1",
                              rejected.append)
    monitor = HeartbeatMonitor(store, 2.0, presence, 0.25)  # the TCPStore default timeout
    n, ids = 20, [f"sim-{i}" for i in range(20)]
    cfg = {"store_port": server.port, "presence_port": presence.port,  # type: ignore[attr-defined]
           "token": TOKEN.decode(), "prefix": "ftrun/gen", "run_id": "gen", "interval": 0.25,
           "op_timeout": 1.0, "slice": 0.5, "ping_s": 0.125}
    fleet = loadgen.Fleet(cfg, list(range(n)), 2, tag=str(job_dir))
    try:
        fleet.wait_for("ready", 30)
        monitor.watch(ids)
        assert _until(lambda: presence.connected() == set(ids), 5), presence.connected()
        first = store.get_records([f"hb/{i}" for i in ids])
        assert all(b is not None and b["seq"] >= 1 for b in first), first  # signed, verified
        quiet_until = time.monotonic() + 2.2  # longer than the timeout
        while time.monotonic() < quiet_until:
            assert monitor.scan() == []
            time.sleep(0.05)
        later = store.get_records([f"hb/{i}" for i in ids])
        assert all(b is not None and a is not None and b["seq"] > a["seq"]
                   for a, b in zip(first, later, strict=True)), (first, later)
        fleet.send({"cmd": "freeze", "agents": [3]})  # as SIGSTOP: silent, sockets open
        fleet.send({"cmd": "kill", "agents": [5]})  # as SIGKILL: its sockets close
        began, lost = time.monotonic(), {}
        while len(lost) < 2 and time.monotonic() - began < 10:
            for node_id in monitor.scan():
                lost.setdefault(node_id, time.monotonic() - began)
            time.sleep(0.02)
        assert set(lost) == {"sim-3", "sim-5"}, lost
        assert "sim-5" in presence.gone() and "sim-3" not in presence.gone()
        # sim-5 through its closed connection, sim-3 only once silent past the timeout
        # (less its ping period: never sooner, whatever the load)
        assert "sim-5" in monitor.closed and "sim-3" not in monitor.closed, lost
        assert lost["sim-3"] >= 1.5, lost
        written = time.time()
        store.put_record("gen/0/end", {"kind": "test"})
        fleet.send({"cmd": "finish", "end_by": time.time() + 5})
        reports = fleet.wait_for("report", 10)
        seen = [t for r in reports for t in r["end_seen"]]
        assert len(seen) == n - 2 and all(written <= t < written + 5 for t in seen), reports
        assert not any(r["errors"] for r in reports), reports
        assert _until(lambda: len(presence.left()) == n - 2, 5), presence.left()
        assert rejected == []
    finally:
        fleet.close()
        presence.close()


def _forge_assignment(client: Any, prefix: str) -> None:
    """node-3's assignment in generation 0, written without the job's token (a world of 1,
    worker store 6.6.6.6:666): the agents must ignore it."""
    forger = JsonStore(client, prefix, signer=Signer(b"not-the-token"))
    forged = {"number": 0, "restart_count": 0, "node": asdict(_slot(3, 1).with_rank(0)),
              "rank_offset": 0, "nnodes": 1, "world_size": 1,
              "worker_store_host": "6.6.6.6", "worker_store_port": 666, "digest": "0" * 64}
    forger.set_record(assignment_key(0, "node-3"), forged)


def _check_joined(reports: list[dict[str, Any]], leader: Generation, n: int) -> list[str]:
    """The simulated agents' reports of a join: every one of the ``n - 1`` holds the rank
    the leader gave it (once each), the world of ``n`` and the worker store; their request
    errors' names are returned."""
    joined = [j for r in reports for j in r["joined"]]
    assert len(joined) == n - 1 and not any(r["join_failed"] for r in reports), reports
    ranks = {node.node_id: node.node_rank for node in leader.nodes}
    assert sorted(ranks.values()) == list(range(n)) and ranks["node-0"] == 0
    for offered, held, rank, offset, world, nnodes, store_port in joined:
        assert offered <= held and rank == offset and world == nnodes == n, joined
        assert store_port == 4242
    assert sorted(j[2] for j in joined) == list(range(1, n))
    return [e for r in reports for e in r["errors"]]


def test_simulated_agents_join_through_the_real_rendezvous(job_dir: Path) -> None:
    """The light-rendezvous benchmark's event-driven agents (scripts/loadgen.py, ``--light-
    harness events``), 15 in two processes, join a generation of 16 that ftrun's own leader
    forms: each appends its signed slot and waits for its own assignment in torch's
    protocol, verifies it and holds the rank the leader gave it. One agent's assignment is
    forged beforehand (written without the token): it ignores it and takes the leader's."""
    loadgen = _loadgen()
    server = serve_store(0, 30)
    port = int(server.port)  # type: ignore[attr-defined]
    _forge_assignment(connect_store("127.0.0.1", port, 10), "ftrun/rz")
    n = 16
    fleet = loadgen.Fleet({"store_port": port, "token": TOKEN.decode(), "prefix": "ftrun/rz",
                           "mode": "rdzv", "number": 0, "id_prefix": "node-", "interval": 0.25,
                           "op_timeout": 5.0}, list(range(1, n)), 2, tag=str(job_dir))
    try:
        fleet.wait_for("ready", 30)
        fleet.send({"cmd": "join", "timeout": 20})
        leader = _rdzv(port, "rz", leader=True, n=n).join(
            0, _slot(0, 1), 20, lambda: ("10.9.9.9", 4242))
        reports = fleet.wait_for("report", 30)
    finally:
        fleet.close()
    errors = _check_joined(reports, leader, n)
    assert any("ignored an assignment" in e for e in errors), reports  # node-3's forgery


@pytest.mark.skipif(etcd_missing_reason() is not None, reason=etcd_missing_reason() or "")
def test_simulated_etcd_agents_keep_leases_the_real_writer_sees_and_join_its_generation(
        job_dir: Path) -> None:
    """The etcd-v3 store load's event-driven agents (scripts/loadgen.py, mode ``etcd``), 12
    in two processes, on a loopback etcd: each grants a lease, puts its signed liveness key
    bound to it and keeps it alive over its own HTTP connection, and pings on its presence
    connection, and watches the generation's end as the EndWatcher does on etcd (a read,
    then a watch stream per slice). ftrun's own writer (a HeartbeatMonitor whose LeaseView
    watches the liveness keys) knows every one of them from its verified record and loses
    none; the end record the writer appends is seen and verified by every agent. Then
    the light rendezvous's etcd agents join a generation on the same etcd
    (:func:`_etcd_agents_join`)."""
    loadgen = _loadgen()
    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {})
        store = JsonStore(connect_etcd(options, 10, op_timeout_s=2), "ftrun/el",
                          signer=Signer(TOKEN),
                          reconnect=lambda: connect_etcd(options, 2, op_timeout_s=2))
        presence = serve_presence(store, store.signer, "el", "127.0.0.1", "127.0.0.1",
                                  lambda line: None)
        monitor = HeartbeatMonitor(store, 5.0, presence, 1.0)
        assert monitor.leases is not None  # the etcd-v3 writer's path
        ids = [f"sim-{i}" for i in range(12)]
        fleet = loadgen.Fleet({"mode": "etcd", "store_port": 0,
                               "etcd_port": int(endpoint.split(":")[1]),
                               "etcd_root": options.prefix.rstrip("/") + "/", "ttl_s": 5,
                               "presence_port": presence.port, "token": TOKEN.decode(),
                               "prefix": "ftrun/el", "run_id": "el", "interval": 0.5,
                               "op_timeout": 2.0, "ping_s": 0.25},
                              list(range(12)), 2, tag=str(job_dir))
        try:
            ready = fleet.wait_for("ready", 30)
            assert sum(r["beaten"] for r in ready) == 12, ready  # a keepalive answered each
            monitor.watch(ids)
            assert _until(lambda: set(monitor.leases.heard(ids)) == set(ids), 10), \
                monitor.leases.heard(ids)  # type: ignore[union-attr]
            assert monitor.scan() == [] and presence.connected() == set(ids)
            written = time.time()
            store.put_record("gen/0/end", {"kind": "test"})
            fleet.send({"cmd": "finish", "end_by": time.time() + 10})
            reports = fleet.wait_for("report", 15)
            assert not any(r["errors"] for r in reports), reports
            seen = [t for r in reports for t in r["end_seen"]]  # read back and verified
            assert len(seen) == 12 and all(written <= t < written + 10 for t in seen), reports
            assert sum(r["watchers"] for r in reports) == 12
        finally:
            fleet.close()
            monitor.close()
            presence.close()
        _etcd_agents_join(loadgen, endpoint, job_dir)
        _etcd_reads_cost_what_changed(endpoint)


def _etcd_agents_join(loadgen: Any, endpoint: str, job_dir: Path) -> None:
    """The etcd-v3 light rendezvous's event-driven agents (mode ``rdzv`` on etcd), 11 in
    two processes with their lease beats, join a generation of 12 that ftrun's own leader
    (DynamicRendezvous on the etcd-v3 client) forms: each reads its own assignment, the
    record and the shutdown record in one transaction, holds one stream of their watches
    through the gateway, then appends its signed slot as a part key, takes its assignment
    from the watch's event, verifies it and holds the rank the leader gave it.
    One agent's assignment is forged beforehand (without the token): it ignores it."""
    options = EtcdOptions.parse(endpoint, {})
    _forge_assignment(connect_etcd(options, 10, op_timeout_s=2), "ftrun/ej")
    n = 12
    fleet = loadgen.Fleet({"mode": "rdzv", "store_port": 0, "number": 0, "id_prefix": "node-",
                           "etcd_port": int(endpoint.split(":")[1]),
                           "etcd_root": options.prefix.rstrip("/") + "/", "ttl_s": 5,
                           "token": TOKEN.decode(), "prefix": "ftrun/ej", "interval": 0.5,
                           "op_timeout": 2.0}, list(range(1, n)), 2, tag=str(job_dir))
    try:
        ready = fleet.wait_for("ready", 30)
        assert sum(r["beaten"] for r in ready) == n - 1, ready  # each lease kept once
        watchers = _etcd_metric(endpoint, "etcd_debugging_mvcc_watcher_total")
        fleet.send({"cmd": "join", "timeout": 20})
        # the leader writes once every agent but node-3 (its forged assignment read, it
        # reads again) holds its wait's stream: three watches each
        assert _until(lambda: _etcd_metric(endpoint, "etcd_debugging_mvcc_watcher_total")
                      >= watchers + 3 * (n - 2), 20)
        store = JsonStore(connect_etcd(options, 10, op_timeout_s=2), "ftrun/ej",
                          signer=Signer(TOKEN))
        leader = DynamicRendezvous(store, min_nodes=n, max_nodes=n, last_call_s=0,
                                   is_leader=True, poll_s=0.01, interrupted=lambda: False
                                   ).join(0, _slot(0, 1), 20, lambda: ("10.9.9.9", 4242))
        reports = fleet.wait_for("report", 30)
    finally:
        fleet.close()
    errors = _check_joined(reports, leader, n)
    assert errors and all("ignored an assignment" in e for e in errors), reports  # node-3's
    # every agent but node-3 waited on its held stream (none found its assignment at its
    # first read) and most took the assignment from the watch's event (no second read;
    # etcd may deliver the record's event first: the agent then reads)
    calls = [r["calls"] for r in reports]
    # node-3 reads its forged assignment again and again, a new stream each time: the
    # leader's write may end one of them too
    assert n - 2 <= sum(c.get("rdzv.held wait ended by an event", 0) for c in calls) \
        <= n - 1, calls
    assert sum(c.get("rdzv.assignment from the watch event", 0) for c in calls) >= n // 2, \
        calls


def _held_wait_threads() -> set[int | None]:
    """The held etcd waits' stream threads alive now (ftrun/control/etcdheld.py)."""
    return {t.ident for t in threading.enumerate() if t.name == "ftrun-etcd-wait"}


def _etcd_metric(endpoint: str, line_start: str) -> float:
    """One counter of the etcd member's own ``/metrics`` (its gRPC server, which the JSON
    gateway calls)."""
    import requests

    text = requests.get(f"http://{endpoint}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(line_start))


def _etcd_reads_cost_what_changed(endpoint: str) -> None:
    """The etcd-v3 client's two reads for a rendezvous at scale (ftrun/control/etcdwire.py):
    a key with appended parts read again costs etcd only the parts appended since (its
    gRPC bytes sent), and is always what a fresh client reads, also after the key was
    set, deleted and appended again, or a part overwritten by a foreign put; a wait for a
    missing key that the leader then writes returns the value from the watch's event,
    with no second read (etcd's count of Range calls), and a wait ended by an appended
    part reads the key whole."""
    options = EtcdOptions.parse(endpoint, {})
    reader, writer = (connect_etcd(options, 10, op_timeout_s=5) for _ in range(2))

    def fresh(key: str) -> bytes | None:
        return connect_etcd(options, 10, op_timeout_s=5).read(key)

    sent = "etcd_network_client_grpc_sent_bytes_total"
    for i in range(40):
        writer.append("slots", f"slot-{i:03d}-{'x' * 1000};")
    before = _etcd_metric(endpoint, sent)
    first = reader.get("slots")
    whole = _etcd_metric(endpoint, sent) - before
    assert first == fresh("slots")
    writer.append("slots", "late;")
    before = _etcd_metric(endpoint, sent)
    again = reader.get("slots")
    assert _etcd_metric(endpoint, sent) - before < whole / 10, whole  # the new part only
    assert again == fresh("slots") == first + b"late;"
    writer.set("slots", "replaced")
    assert reader.get("slots") == b"replaced" == fresh("slots")
    writer.append("slots", "+1")
    assert reader.get("slots") == b"replaced+1" == fresh("slots")
    writer.delete_key("slots")
    writer.append("slots", "again")
    assert reader.get("slots") == b"again" == fresh("slots")
    writer.append("slots", ";more")
    assert reader.get("slots") == b"again;more"
    part = next(k for k, v, _ in writer.range_prefix("slots")[0] if v == b"again")
    writer._post("/kv/put", {"key": writer._key(part), "value": "Zm9yZ2Vk"})  # a foreign put
    assert reader.get("slots") == fresh("slots") == b"forged;more"
    assert reader.read("nothing") is None

    # a wait's slices: etcd's gateway ends each watch stream at its deadline (the
    # Grpc-Timeout header), so the next slice's read and watch reuse the connection
    etcd_port = int(endpoint.rsplit(":", 1)[1])

    def connections() -> set[int]:  # this process's local ports to the etcd member
        return {c.laddr.port for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.raddr.port == etcd_port and c.status == "ESTABLISHED"}
    assert reader.read("never") is None
    before = connections()
    for _ in range(3):
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="wait timeout"):
            reader.wait(["never"], timedelta(seconds=0.3))
        assert 0.25 < time.monotonic() - started < 5.0
    assert reader.read("never") is None  # on the same connection as the first read
    assert connections() - before == set(), (before, connections())
    # the gateway's two ways of saying a wait's deadline came (etcd 3.4, seen here): the
    # stream's last message, or a 504 answer when it came before the stream began
    assert deadline_error({"error": {"grpc_code": 2, "http_code": 500,
                                     "message": "context deadline exceeded"}})
    assert deadline_error({"error": "context deadline exceeded", "code": 4,
                           "message": "context deadline exceeded"})
    assert not deadline_error({"error": {"grpc_code": 14, "message": "unavailable"}})

    ranges = 'grpc_server_handled_total{grpc_code="OK",grpc_method="Range"'

    def key_and_part() -> None:  # one revision: the key and a part of it
        writer._txn([], [{"request_put": {"key": writer._key("as/3"), "value": "QQ=="}},
                         {"request_put": {"key": writer._key("as/3\x00p"), "value": "Qg=="}}],
                    [])
    for name, write, expected, reads in (
            ("as/1", lambda: writer.multi_set(["as/1"], ["assigned"]), b"assigned", 1),
            ("as/2", lambda: writer.append("as/2", "part"), b"part", 2),
            ("as/3", key_and_part, b"AB", 2)):
        watchers = _etcd_metric(endpoint, "etcd_debugging_mvcc_watcher_total")

        def write_once_watched(write: Callable[[], None] = write, base: float = watchers
                               ) -> None:  # only once the reader's watch is in place
            _until(lambda: _etcd_metric(endpoint, "etcd_debugging_mvcc_watcher_total")
                   > base, 10)
            write()
        timer = threading.Thread(target=write_once_watched)
        before = _etcd_metric(endpoint, ranges)
        timer.start()
        assert reader.get(name) == expected
        timer.join()
        # the first read found nothing; a put of the key itself is read from the event,
        # an appended part, or the key with a part at once, by a second read
        assert _etcd_metric(endpoint, ranges) - before == reads, name


def test_the_load_generators_harness_keeps_early_events_and_tells_failures_from_size(
        ) -> None:
    """scripts/loadgen.py's harness end (``Fleet.wait_for``) fed its processes' events as
    its reader threads feed them: a process that says ``ready`` before another says
    ``connected`` is not taken for a failure and its ``ready`` is there for the next wait;
    a process that ended after its report fails a later wait at once; a deadline passed is
    ``TooMany`` (the benchmark may try fewer agents) and a process's own error is not
    (the benchmark reports it instead of halving N). ``end_watch_below`` 0 is no watch."""
    import queue

    loadgen = _loadgen()
    fleet = loadgen.Fleet.__new__(loadgen.Fleet)
    fleet.events, fleet.procs, fleet._early = queue.Queue(), [object(), object()], []
    for event in ((0, "connected"), (0, "ready"), (1, "connected"), (1, "ready")):
        fleet.events.put((event[0], {"event": event[1]}))
    assert [e["event"] for e in fleet.wait_for("connected", 1)] == ["connected"] * 2
    assert [e["event"] for e in fleet.wait_for("ready", 1)] == ["ready"] * 2
    fleet.events.put((0, {"event": "report"}))
    fleet.events.put((0, {"event": "exited", "code": 0}))
    with pytest.raises(loadgen.TooMany, match="1 of 2 said 'report'"):
        fleet.wait_for("report", 0.2)
    fleet.events.put((1, {"event": "error", "error": "KeyError: 'ids'"}))
    with pytest.raises(RuntimeError, match=r"process 0: .*exited") as failed:
        fleet.wait_for("report", 5)
    assert not isinstance(failed.value, loadgen.TooMany)
    with pytest.raises(RuntimeError, match="KeyError") as failed:
        fleet.wait_for("report", 5)
    assert not isinstance(failed.value, loadgen.TooMany)
    fleet.events.put((1, {"event": "error", "error": "RuntimeError: connections not made"}))
    with pytest.raises(loadgen.TooMany):
        fleet.wait_for("ready", 5)
    for below, watching in ((0, [False, False]), (1, [True, False]), (None, [True, True])):
        generator = loadgen.Generator({"store_port": 1, "token": "t", "prefix": "p",
                                       "ids": [0, 1], "end_watch_below": below})
        generator.loop.sel.close()
        assert [a.ew is not None for a in generator.agents] == watching, below


@pytest.mark.skipif(etcd_missing_reason() is not None, reason=etcd_missing_reason() or "")
def test_a_renewed_etcd_wait_costs_no_read_and_misses_no_write() -> None:
    """A wait in slices (the rendezvous's) on etcd-v3: the first slice reads the key, the
    next ones only watch from the revision that read found it missing at (etcd's count of
    Range calls does not move). A write made while no watch is open, between two slices,
    is seen by the next one, and as what the key holds then (two sets: the second; a set
    then a delete: still missing); a put while a renewed watch is open is taken from its
    event with no read; a compacted revision, another endpoint, or a key last read more
    than ``MissedAt``'s ``max_lag`` revisions before the store's is read again."""
    ranges = 'grpc_server_handled_total{grpc_code="OK",grpc_method="Range"'
    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(f"{endpoint},{endpoint}", {})  # one member, twice
        reader, writer = (connect_etcd(options, 10, op_timeout_s=5) for _ in range(2))

        def reads_in(step: Callable[[], object]) -> tuple[object, float]:
            before = _etcd_metric(endpoint, ranges)
            result = step()
            return result, _etcd_metric(endpoint, ranges) - before

        def slice_(key: str) -> bool:  # one slice: whether the key exists
            try:
                reader.wait([key], timedelta(seconds=0.3))
                return True
            except RuntimeError as error:
                assert "wait timeout after" in str(error), error
                return False
        assert reads_in(lambda: slice_("as/a")) == (False, 1)
        assert reads_in(lambda: [slice_("as/a") for _ in range(3)]) == ([False] * 3, 0)
        writer.set("as/a", "first")  # between two slices, with no watch open
        writer.set("as/a", "second")
        reader.set_timeout(timedelta(seconds=5))
        started = time.monotonic()
        assert reader.get("as/a") == b"second" and time.monotonic() - started < 2.0
        assert slice_("as/b") is False  # put and deleted between slices: still missing
        writer.set("as/b", "gone")
        writer.delete_key("as/b")
        assert reads_in(lambda: slice_("as/b")) == (False, 1)  # the replayed put: read
        assert reads_in(lambda: slice_("as/b")) == (False, 0)  # from the new read on

        watchers = _etcd_metric(endpoint, "etcd_debugging_mvcc_watcher_total")

        def put_once_watched() -> None:  # only once the renewed watch is in place
            _until(lambda: _etcd_metric(endpoint, "etcd_debugging_mvcc_watcher_total")
                   > watchers, 10)
            writer.multi_set(["as/b"], ["live"])
        timer = threading.Thread(target=put_once_watched)
        timer.start()
        assert reads_in(lambda: reader.get("as/b")) == (b"live", 0)
        timer.join()

        assert slice_("as/c") is False and slice_("as/d") is False
        writer.set("as/d", "before the compaction")
        writer.set("other", "moves the revision on: as/c's watch would start before it")
        revision = writer.range_prefix("as/")[1]
        writer._post("/kv/compaction", {"revision": str(revision), "physical": True})
        assert reads_in(lambda: slice_("as/c")) == (False, 1)  # canceled: read again
        assert reads_in(lambda: slice_("as/d")) == (True, 1)
        assert reads_in(lambda: slice_("as/c")) == (False, 0)
        reader._current = 1  # failed over to the other endpoint: read there first
        assert reads_in(lambda: slice_("as/c")) == (False, 1)
        for i in range(300):  # a busy store: etcd would replay all of it, read again
            writer._post("/kv/put", {"key": writer._key(f"busy/{i}"), "value": "eA=="})
        assert reads_in(lambda: slice_("as/c")) == (False, 0)  # its watch saw the store
        assert reads_in(lambda: slice_("as/c")) == (False, 1)
        assert reads_in(lambda: slice_("as/c")) == (False, 0)


@pytest.mark.skipif(etcd_missing_reason() is not None, reason=etcd_missing_reason() or "")
def test_a_held_etcd_wait_costs_no_request_per_slice_and_misses_no_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A joining agent's wait on etcd-v3 (``EtcdClient.wait_any``, ftrun/control/
    etcdheld.py): its first slice opens one watch stream of every key and, once etcd
    confirmed it, reads them all in one transaction; the next slices cost etcd nothing (its
    counts of handled requests and of started watch streams do not move). A write made
    between two slices is seen (the stream is held), from the event with no read, as the
    key it named; a wait for a key already written costs a stream and a read. A stream to
    an endpoint on which another request of this process failed since (a member gone
    silent) is given up and the client moves to the next endpoint, where the next slice
    reads again; one the gateway ended (its hold) is read and watched again at once, on
    the same endpoint. A stream whose member no client of the process has heard from for
    ``UNHEARD_S`` costs one read there, and is kept when the read is answered. No wait
    thread outlives its stream."""
    from ftrun.control import etcdheld
    from ftrun.control.etcdheld import note_failure

    monkeypatch.setattr(etcdheld, "UNHEARD_S", 60.0)  # no look at the member, but below
    others = _held_wait_threads()  # another test's, still ending: not this one's

    handled = 'grpc_server_handled_total{grpc_code="OK"'
    streams = 'grpc_server_started_total{grpc_method="Watch"'
    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(f"{endpoint},{endpoint}", {})  # one member, twice
        reader, writer = (connect_etcd(options, 10, op_timeout_s=5) for _ in range(2))

        def costs(step: Callable[[], object]) -> tuple[object, float, float]:
            before = (_etcd_metric(endpoint, handled), _etcd_metric(endpoint, streams))
            result = step()
            return (result, _etcd_metric(endpoint, handled) - before[0],
                    _etcd_metric(endpoint, streams) - before[1])

        keys = ["as/1", "gen/1", "shutdown"]
        assert costs(lambda: reader.wait_any(keys, 0.3)) == (None, 1, 1)
        started = time.monotonic()
        assert costs(lambda: [reader.wait_any(keys, 0.3) for _ in range(4)]) == \
            ([None] * 4, 0, 0)
        assert time.monotonic() - started > 4 * 0.25  # each slice waited its time
        writer.set("gen/1", "the record")  # between two slices
        assert costs(lambda: reader.wait_any(keys, 5)) == ((1, b"the record"), 0, 0)
        assert costs(lambda: reader.wait_any(keys, 0.3)) == ((1, b"the record"), 1, 1)

        keys = ["as/2", "gen/2", "shutdown"]
        assert reader.wait_any(keys, 0.3) is None

        def put_in_a_slice() -> None:
            time.sleep(0.5)  # inside the next slice's wait, not before it
            writer.multi_set(["as/2"], ["assigned"])
        timer = threading.Thread(target=put_in_a_slice)
        timer.start()
        started = time.monotonic()
        # the writer's transaction is the one request handled; no read
        assert costs(lambda: reader.wait_any(keys, 10)) == ((0, b"assigned"), 1, 0)
        assert time.monotonic() - started < 5
        timer.join()

        keys = ["as/3", "gen/3", "shutdown"]
        assert reader.wait_any(keys, 0.3) is None
        note_failure(reader.endpoint)  # another client's request to it failed
        assert reader._current == 0
        assert costs(lambda: reader.wait_any(keys, 0.3)) == (None, 0, 0)  # given up
        assert reader._current == 1  # failed over
        assert costs(lambda: reader.wait_any(keys, 0.3)) == (None, 1, 1)  # read there

        monkeypatch.setattr(etcdheld, "UNHEARD_S", 2.0)
        keys = ["as/4", "gen/4", "shutdown"]
        assert costs(lambda: reader.wait_any(keys, 0.3)) == (None, 1, 1)
        assert _until(lambda: reader._held.held is not None and reader._held.held.unheard(),
                      10)
        # unheard for 2 s: one read of the keys on the same member, which answers: the
        # stream is kept, and the member is heard again (the next slice costs nothing)
        assert costs(lambda: reader.wait_any(keys, 0.3)) == (None, 1, 0)
        assert costs(lambda: reader.wait_any(keys, 0.3)) == (None, 0, 0)
        monkeypatch.setattr(etcdheld, "UNHEARD_S", 60.0)

        reader._held.close()
        assert _until(lambda: not _held_wait_threads() - others, 10)
        reader._held.hold_s = 1.0  # the gateway ends each stream after 1 s
        assert costs(lambda: reader.wait_any(keys, 0.3)) == (None, 1, 1)
        assert _until(lambda: reader._held.held is not None and reader._held.held.done.is_set(),
                      10)
        # ended: read and watched again at once, on the same endpoint (not a failure)
        assert costs(lambda: reader.wait_any(keys, 0.3)) == (None, 1, 1)
        assert reader._current == 1
        reader._held.close()
        assert _until(lambda: not _held_wait_threads() - others, 10)

        class NoWatch:  # a gateway whose streams fail at once (HTTP 404)
            def __init__(self, real: Any) -> None:
                self.session = real.session

            def get_url(self, path: str) -> str:
                return f"http://{endpoint}/v3/no-such{path}"
        real_gateway = reader._held._gateway
        reader._held._gateway = lambda: (real_gateway()[0], NoWatch(real_gateway()[1]))
        started = time.monotonic()
        # each failed stream leaves its slice to pass, with a failover and no read (the
        # read follows etcd's confirmation of the watches), not a loop of streams
        assert costs(lambda: [reader.wait_any(keys, 0.3) for _ in range(4)]) == \
            ([None] * 4, 0, 0)
        assert time.monotonic() - started > 4 * 0.25



def test_a_held_etcd_wait_whose_stream_ends_inside_its_slice_waits_out_the_slice() -> None:
    """The gateway ends a held wait's stream (its hold, 1 s here) inside a 4 s slice of
    ``EtcdClient.wait_any``: the call still lasts its slice, without news, and only the
    next one watches again (a stream that ends early never makes a loop of streams)."""
    if etcd_missing_reason() is not None:
        pytest.skip(etcd_missing_reason() or "")
    others = _held_wait_threads()
    streams = 'grpc_server_started_total{grpc_method="Watch"'
    with loopback_etcd() as endpoint:
        reader = connect_etcd(EtcdOptions.parse(endpoint, {}), 10, op_timeout_s=5)
        reader._held.hold_s = 1.0  # the gateway ends each stream after 1 s
        keys = ["as/9", "gen/9", "shutdown"]
        before = _etcd_metric(endpoint, streams)
        started = time.monotonic()
        assert reader.wait_any(keys, 4.0) is None
        took = time.monotonic() - started
        held = reader._held.held
        assert held is not None and held.done.is_set() and held.outcome is None
        assert took >= 3.9, f"the call returned {took:.2f} s into its 4 s slice"
        assert _etcd_metric(endpoint, streams) - before == 1
        reader._held.close()
        assert _until(lambda: not _held_wait_threads() - others, 10)


def _write_and_see(writer: Any, reader: Any, keys: list[str], since: float) -> None:
    """Write the first of ``keys`` and wait in slices until the reader's held wait
    (``EtcdClient.wait_any``) tells it, within 15 s of ``since``."""
    writer.set(keys[0], "assigned")
    found = None
    while found is None:
        assert time.monotonic() - since < 15, "the write was not seen"
        found = reader.wait_any(keys, 0.3)
    assert found == (0, b"assigned"), found


def test_a_held_etcd_wait_on_a_member_nobody_hears_moves_to_the_next_endpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two endpoints: a relay to the member, which then freezes (silent, its connections
    open, as a SIGSTOPped member), and the member itself. A held wait
    (``EtcdClient.wait_any``) on the relay, with no other client of the process talking
    to it: once the relay has been unheard for ``UNHEARD_S`` (1 s here), the wait's read
    from it times out and moves on to the next endpoint, and the stream moves with it in
    the same slice; a write made after that is seen from the new stream, all well before
    the old stream's read bound (``HOLD_S``, 30 s)."""
    from ftrun.control import etcdheld

    if etcd_missing_reason() is not None:
        pytest.skip(etcd_missing_reason() or "")
    monkeypatch.setattr(etcdheld, "UNHEARD_S", 1.0)
    with loopback_etcd() as endpoint:
        relay = FreezableRelay(int(endpoint.rsplit(":", 1)[1]))
        try:
            reader = connect_etcd(EtcdOptions.parse(f"{relay.endpoint},{endpoint}", {}), 10,
                                  op_timeout_s=1)
            writer = connect_etcd(EtcdOptions.parse(endpoint, {}), 10, op_timeout_s=5)
            keys = ["as/9", "gen/9", "shutdown"]
            assert reader.wait_any(keys, 0.3) is None
            first = reader._held.held
            assert first is not None and first.endpoint == relay.endpoint
            assert _until(lambda: first.stream.confirmed, 10)
            relay.freeze()
            frozen = time.monotonic()
            while reader.endpoint != endpoint:
                assert time.monotonic() - frozen < 10, "the wait never left the frozen relay"
                assert reader.wait_any(keys, 0.3) is None
            moved = reader._held.held
            assert moved is not None and moved is not first and moved.endpoint == endpoint
            # a new client of the process (a reconnect, the next end watch) starts where
            # the others are heard, not at the frozen first endpoint
            fresh = EtcdClient(EtcdOptions.parse(f"{relay.endpoint},{endpoint}", {}), 1.0)
            assert fresh.endpoint == endpoint  # before any request of its own
            _write_and_see(writer, reader, keys, frozen)
            print(f"frozen to written and seen elsewhere: {time.monotonic() - frozen:.2f} s")
        finally:
            relay.close()


def test_a_held_etcd_wait_whose_watch_etcd_never_confirms_moves_to_the_next_endpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first endpoint is a relay frozen from the start (it accepts, never answers: a
    SIGSTOPped member). A held wait begun there (``EtcdClient.wait_any``) makes its stream
    and waits for etcd's confirmation before its read: none comes, so the first call
    returns after ``CONFIRM_S`` (1 s here) without news, the stream kept (a busy member
    confirms late). The relay is then found as any silent member is: unheard for
    ``UNHEARD_S`` (1 s here), the wait reads from it, which fails and moves on; the wait
    watches and reads at the member itself, and a write made then is seen."""
    from ftrun.control import etcdheld

    if etcd_missing_reason() is not None:
        pytest.skip(etcd_missing_reason() or "")
    monkeypatch.setattr(etcdheld, "CONFIRM_S", 1.0)
    monkeypatch.setattr(etcdheld, "UNHEARD_S", 1.0)
    with loopback_etcd() as endpoint:
        relay = FreezableRelay(int(endpoint.rsplit(":", 1)[1]))
        try:
            relay.freeze()
            writer = connect_etcd(EtcdOptions.parse(endpoint, {}), 10, op_timeout_s=5)
            reader = EtcdClient(EtcdOptions.parse(f"{relay.endpoint},{endpoint}", {}), 1.0)
            reader._current = 0  # begin at the frozen relay
            keys = ["as/7", "gen/7", "shutdown"]
            started = time.monotonic()
            assert reader.wait_any(keys, 0.0) is None  # a join's arm: no timeout of its own
            assert 1.0 <= time.monotonic() - started < 3.0  # CONFIRM_S, then back
            first = reader._held.held
            assert first is not None and first.endpoint == relay.endpoint
            assert not first.stream.confirmed
            while reader.endpoint != endpoint:
                assert time.monotonic() - started < 10, "the wait never left the relay"
                assert reader.wait_any(keys, 0.3) is None
            moved = reader._held.held
            assert moved is not None and moved.endpoint == endpoint and moved.keys_read
            _write_and_see(writer, reader, keys, started)
        finally:
            relay.close()


def test_an_etcd_end_watcher_holds_one_stream_and_wakes_on_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An etcd-v3 agent's EndWatcher (ftrun/control/endwatch.py over ``JsonStore.wait_any``):
    its first slice reads the end key and opens one watch stream; ten more slices cost
    etcd no request and no stream (before, each slice watched again); the end written
    later wakes its fd from the stream's event, not another watcher's; a watcher stopped
    before its end ends its stream too: no wait thread is left and etcd holds no watch
    stream of either."""
    import select

    from ftrun.control import etcdheld
    from ftrun.control.endwatch import EndWatcher

    if etcd_missing_reason() is not None:
        pytest.skip(etcd_missing_reason() or "")
    monkeypatch.setattr(etcdheld, "UNHEARD_S", 60.0)  # no other client here: no look

    done: dict[str, int] = {"gen/0/end": 0, "gen/1/end": 0}  # finished slices, per key

    class Counted(JsonStore):
        """The watchers' stores (``with_client`` keeps the class): count finished slices."""

        def with_client(self, client: Any) -> JsonStore:
            return Counted(client, self.prefix, signer=self.signer)

        def wait_any(self, names: list[str], timeout_s: float) -> Any:
            try:
                return super().wait_any(names, timeout_s)
            finally:
                done[names[0]] += 1

        def wait_for(self, name: str, timeout_s: float) -> bool:
            try:
                return super().wait_for(name, timeout_s)
            finally:
                done[name] += 1

    others = _held_wait_threads()  # another test's, still ending: not this one's

    handled = 'grpc_server_handled_total{grpc_code="OK"'
    started = 'grpc_server_started_total{grpc_method="Watch"'
    open_streams = "etcd_debugging_mvcc_watch_stream_total"
    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {})
        connect = lambda: connect_etcd(options, 10, op_timeout_s=5)  # noqa: E731
        writer = Counted(connect(), "ftrun/ew", signer=Signer(TOKEN))
        baseline = _etcd_metric(endpoint, open_streams)
        streams = _etcd_metric(endpoint, started)
        watcher = EndWatcher(connect, writer, "gen/0/end", slice_s=0.2).start()
        idle = EndWatcher(connect, writer, "gen/1/end", slice_s=0.2).start()
        try:
            # each one's first slice (its read) is over and both streams reached etcd
            assert _until(lambda: min(done.values()) >= 1
                          and _etcd_metric(endpoint, started) >= streams + 2, 30)
            before = (_etcd_metric(endpoint, handled), _etcd_metric(endpoint, started))
            first = dict(done)
            assert _until(lambda: all(done[k] >= first[k] + 10 for k in done), 30)
            after = (_etcd_metric(endpoint, handled), _etcd_metric(endpoint, started))
            assert after == before, (before, after)
            assert _etcd_metric(endpoint, open_streams) == baseline + 2
            assert not watcher.fired.is_set() and watcher.healthy
            writer.put_record("gen/0/end", {"kind": "worker", "rank": 1})
            written = time.monotonic()
            assert select.select([watcher.fd, idle.fd], [], [], 10)[0] == [watcher.fd]
            assert time.monotonic() - written < 5
            assert watcher.fired.is_set() and not idle.fired.is_set()
            # the fired one's stream is over; the idle one's ends when it is stopped
            assert _until(lambda: _etcd_metric(endpoint, open_streams) == baseline + 1, 10)
            idle.stop()
        finally:
            watcher.stop()
            if idle._thread.is_alive():  # the test failed before its stop
                idle.stop()
        assert not watcher._thread.is_alive() and not idle._thread.is_alive()
        assert _until(lambda: not _held_wait_threads() - others, 10)
        assert _until(lambda: _etcd_metric(endpoint, open_streams) == baseline, 10)


@pytest.mark.parametrize("forged", ["none", "assignment", "record"])
@pytest.mark.parametrize("backend", ["tcpstore", "etcd-v3"])
def test_a_forged_record_never_hides_a_shutdown_from_a_waiting_agent(
        backend: str, forged: str) -> None:
    """A joining agent waits for its assignment, ``gen/N`` and the shutdown record at once
    (``JsonStore.wait_any``): a valid shutdown ends its join within a few slices, not at
    its deadline (on etcd-v3 through the held watch's event). A record there without the
    job's secret (its assignment, or the generation's) is ignored and must not hide the
    shutdown; the forged key is looked at each slice from then on, as before held
    waits."""
    if backend == "etcd-v3" and etcd_missing_reason() is not None:
        pytest.skip(etcd_missing_reason() or "")
    with contextlib.ExitStack() as stack:
        if backend == "etcd-v3":
            options = EtcdOptions.parse(stack.enter_context(loopback_etcd()), {})
        else:
            server = serve_store(0, 30)  # the server fixture's way: ends with the test

        def connect() -> Any:
            if backend == "etcd-v3":
                return connect_etcd(options, 10, op_timeout_s=5)
            return connect_store("127.0.0.1", server.port, 10, op_timeout_s=5)
        forger = JsonStore(connect(), "ftrun/fs", signer=Signer(b"not-the-token"))
        if forged == "assignment":
            _forge_assignment(forger.raw, "ftrun/fs")
        elif forged == "record":
            forger.put_record("gen/0", {"number": 0, "nodes": []})
        agent = DynamicRendezvous(JsonStore(connect(), "ftrun/fs", signer=Signer(TOKEN)),
                                  min_nodes=2, max_nodes=2, last_call_s=0, is_leader=False,
                                  poll_s=0.01, interrupted=lambda: False)
        outcome: list[BaseException | Generation] = []

        def join() -> None:
            try:
                outcome.append(agent.join(0, _slot(3, 1), 60, lambda: ("", 0)))
            except RendezvousError as error:
                outcome.append(error)
        waiter = threading.Thread(target=join)
        waiter.start()
        owner = JsonStore(connect(), "ftrun/fs", signer=Signer(TOKEN))
        assert _until(lambda: owner.exists("gen/0/slots"), 10)  # it offered, and waits
        time.sleep(2 * DynamicRendezvous.WAIT_SLICE_S)  # a slice or two on the forged key
        owner.put_record("shutdown", {"reason": "the operator stopped it"})
        shut = time.monotonic()
        waiter.join(30)
        assert not waiter.is_alive() and len(outcome) == 1, outcome
        assert isinstance(outcome[0], RendezvousError), outcome
        assert "the operator stopped it" in str(outcome[0]), outcome
        assert time.monotonic() - shut < 5 * DynamicRendezvous.WAIT_SLICE_S, outcome
