"""Lease renewals on etcd's gRPC keepalive stream (ftrun/control/etcdkeepalive.py), against
a real loopback etcd member: one stream for many renewals, a renewal that really extends
the lease, an expired lease, a frozen member and a dead endpoint."""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.request

import psutil
import pytest

from ftrun.control.etcd import EtcdClient, EtcdOptions, connect_etcd
from ftrun.control.etcdkeepalive import KeepAliveStream, decode_keepalive, encode_keepalive
from tests.infra.etcd_cluster import (
    FreezableRelay,
    etcd_missing_reason,
    loopback_etcd,
    member_process,
    suspend,
)
from tests.launch import wait_until

needs_etcd = pytest.mark.skipif(etcd_missing_reason() is not None,
                                reason=etcd_missing_reason() or "")


def test_keepalive_messages_are_encoded_and_bad_answers_refused() -> None:
    """The request is field 1, a varint; the answer's ID and TTL (fields 2, 3) are read
    past its header (field 1, a message); anything else is a ValueError, never a guess."""
    assert encode_keepalive(1) == b"\x08\x01"
    assert encode_keepalive(300) == b"\x08\xac\x02"
    header = b"\x0a\x06\x08\x01\x10\x02\x18\x03"  # {cluster_id: 1, member_id: 2, revision: 3}
    lease = 7587883245391581955
    answer = header + b"\x10" + encode_keepalive(lease)[1:] + b"\x18\x05"
    assert decode_keepalive(answer) == (lease, 5)
    assert decode_keepalive(header + b"\x10\x09") == (9, 0)  # proto3 leaves a TTL of 0 out
    negative = b"\x18" + b"\xff" * 9 + b"\x01"  # int64 -1, as varints carry it
    assert decode_keepalive(negative) == (0, -1)
    for bad in (b"\x10", b"\x10\x80", b"\x0a\x09\x08", b"\x15\x00\x00\x00\x00",
                b"\x10" + b"\xff" * 11):
        with pytest.raises(ValueError):
            decode_keepalive(bad)
    with pytest.raises(ValueError):
        encode_keepalive(-1)


def _keepalive_counts(endpoint: str) -> dict[str, int]:
    """The member's ``LeaseKeepAlive`` counts so far (its /metrics): streams ``started``
    and ``handled`` (ended; the gateway starts one per renewal request, a held stream one
    in all), and keepalive messages ``msg_received``."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    counts = {"started": 0, "handled": 0, "msg_received": 0}
    for name, value in re.findall(r'^grpc_server_(started|handled|msg_received)_total\{[^}]*'
                                  r'grpc_method="LeaseKeepAlive"[^}]*\} (\S+)$',
                                  text, re.MULTILINE):
        counts[name] += int(float(value))
    return counts


def _keepalive_streams(endpoint: str) -> tuple[int, int]:
    """Keepalive streams so far: (started, ended)."""
    counts = _keepalive_counts(endpoint)
    return counts["started"], counts["handled"]


@needs_etcd
def test_a_lease_is_renewed_on_one_held_stream_and_an_ended_lease_says_so() -> None:
    with loopback_etcd() as endpoint:
        client = connect_etcd(EtcdOptions.parse(endpoint, {}), 10, op_timeout_s=2)
        lease, granted = client.grant_ttl(4)
        stream = KeepAliveStream.for_options(client.options)
        before, _ = _keepalive_streams(endpoint)
        try:
            for _ in range(20):
                assert 0 < client.keep_alive(lease, stream) <= granted
            assert stream.opened == 1
            assert _keepalive_streams(endpoint)[0] - before == 1  # not 20, as the gateway's
            # the renewal reaches etcd: a lease that ran down is full again after one
            wait_until(lambda: client.time_to_live(lease) <= granted - 2, 10,
                       "the lease running down")
            client.keep_alive(lease, stream)
            assert client.time_to_live(lease) >= granted - 1
            client.revoke(lease)
            assert client.keep_alive(lease, stream) == -1  # etcd no longer holds it
            assert stream.opened == 1
        finally:
            stream.close()


@needs_etcd
def test_a_silent_member_fails_a_renewal_in_its_timeout_keeps_the_stream_and_fails_over(
) -> None:
    """A member that answers nothing (SIGSTOP) fails a renewal within the client's request
    timeout, naming the endpoint. With one endpoint the stream is kept: once the member
    runs again the next renewal is answered on it (the late answer to the one given up is
    dropped, not taken for it). With a frozen endpoint first in the list, the renewal
    moves on to the next, as a request does, on a new stream there; so with a refused one."""
    with loopback_etcd() as endpoint:
        member = member_process(endpoint)
        client = connect_etcd(EtcdOptions.parse(endpoint, {}), 10, op_timeout_s=1)
        lease, _ = client.grant_ttl(30)
        stream = KeepAliveStream.for_options(client.options)
        try:
            assert client.keep_alive(lease, stream) > 0
            suspend(member)
            try:
                started = time.monotonic()
                with pytest.raises(RuntimeError, match=re.escape(endpoint)) as failed:
                    client.keep_alive(lease, stream)
                assert time.monotonic() - started < 5, failed.value
                assert "no answer within 1 s" in str(failed.value), failed.value
            finally:
                member.resume()
            assert client.keep_alive(lease, stream) > 0
            assert stream.opened == 1
        finally:
            stream.close()

        relay = FreezableRelay(int(endpoint.rsplit(":", 1)[1]))
        try:
            relay.freeze()
            with socket.socket() as closed:
                closed.bind(("127.0.0.1", 0))
                refused = f"127.0.0.1:{closed.getsockname()[1]}"
            for first in (relay.endpoint, refused):
                both = connect_etcd(EtcdOptions.parse(f"{endpoint},{first}", {}), 10,
                                    op_timeout_s=1)
                both._current = 1  # as after a failover: the bad endpoint is asked first
                stream = KeepAliveStream.for_options(both.options)
                started = time.monotonic()
                assert both.keep_alive(lease, stream) > 0
                assert both.endpoint == endpoint and stream.opened == 2, first
                assert time.monotonic() - started < 5
                stream.close()
        finally:
            relay.close()


@needs_etcd
def _connections_to(endpoint: str) -> int:
    """This process's established TCP connections to ``endpoint``'s port."""
    port = int(endpoint.rsplit(":", 1)[1])
    return sum(1 for c in psutil.Process().net_connections(kind="tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_a_heartbeat_sender_renews_on_one_stream_and_closes_it_when_it_stops() -> None:
    """The agent's real heartbeat: its lease is renewed on one stream, which ends with the
    sender (etcd sees its keepalive streams go back to none), once a third of its TTL
    passed, not at every beat (etcd counts the messages: beats every 0.1 s, a 3 s lease,
    so a renewal a second), and the lease lives on past its TTL. Once its key is put, the
    stream is the only connection the beat holds to the member: the gateway connection of
    its grant and put is not kept idle (a member's descriptors per agent)."""
    from ftrun.control.auth import Signer
    from ftrun.control.heartbeat import HeartbeatSender
    from ftrun.control.store import JsonStore

    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {"etcd_prefix": "/beat"})

        def connect() -> EtcdClient:
            return connect_etcd(options, 10, op_timeout_s=2)
        store = JsonStore(connect(), "ftrun/beat", signer=Signer(b"t" * 16))
        sender = HeartbeatSender(connect, store, "node-a", 0.1, 3.0)  # type: ignore[arg-type]
        before = _connections_to(endpoint)  # the template's own client
        sender.start()
        try:
            wait_until(lambda: sender.seq >= 15 and sender.lease is not None
                       and sender.lease.stream is not None, 20, "15 beats")
            assert sender.lease is not None and sender.lease.stream is not None
            assert sender.lease.stream.opened == 1 and sender.lease.expired == 0
            assert sender.lease.placed
            assert _connections_to(endpoint) - before == 1  # the stream's, no idle gateway
            received, beats = _keepalive_counts(endpoint)["msg_received"], sender.seq
            time.sleep(4.5)  # a window to count in: 1.5 TTLs, 45 beats
            renewals = _keepalive_counts(endpoint)["msg_received"] - received
            beats = sender.seq - beats
            assert beats >= 30 and 3 <= renewals <= 7, (beats, renewals)  # 45 beats: 4-5
            assert sender.lease.expired == 0 and sender.failing_since is None
            assert store.raw.time_to_live(sender.lease.lease) > 0  # alive past its TTL
        finally:
            sender.stop(timeout_s=5)
        wait_until(lambda: _connections_to(endpoint) == before, 10,
                   "the beat's connections closed with it")
        wait_until(lambda: len(set(_keepalive_streams(endpoint))) == 1, 10,
                   "etcd's keepalive streams back to none (as many ended as started)")



@needs_etcd
def test_a_failed_lease_grant_backs_off_then_the_lease_is_granted() -> None:
    """A grant no endpoint answered (a frozen member: the request timeout) makes the next
    beats within a random back-off of up to 2 s (then 4 s ...) raise BeatDeferred at once,
    with no request; past it the grant is made again and succeeds, and the count of
    failures in a row starts over."""
    from ftrun.control.auth import Signer
    from ftrun.control.election import LeaseBeat
    from ftrun.control.errors import BeatDeferred
    from ftrun.control.store import JsonStore

    with loopback_etcd() as endpoint:
        relay = FreezableRelay(int(endpoint.rsplit(":", 1)[1]))
        try:
            signer = Signer(b"t" * 16)
            store = JsonStore(connect_etcd(EtcdOptions.parse(endpoint, {}), 10,
                                           op_timeout_s=1), "ftrun/back", signer=signer)
            frozen = JsonStore(connect_etcd(EtcdOptions.parse(relay.endpoint, {}), 10,
                                            op_timeout_s=1), "ftrun/back", signer=signer)
            relay.freeze()
            now = [100.0]
            beat = LeaseBeat(5.0, clock=lambda: now[0])
            with pytest.raises(RuntimeError, match="no etcd endpoint answered"):
                beat(frozen, "hb/a")
            assert beat.grant_failures == 1 and beat.lease is None
            assert 100.0 <= beat.grant_after < 102.0  # up to 2 s
            asked = time.monotonic()
            with pytest.raises(BeatDeferred):
                beat(frozen, "hb/a")  # no request: the frozen relay would take 1 s
            assert time.monotonic() - asked < 0.5
            now[0] = 102.0
            with pytest.raises(RuntimeError, match="no etcd endpoint answered"):
                beat(frozen, "hb/a")
            assert beat.grant_failures == 2 and 102.0 <= beat.grant_after < 106.0  # 4 s
            now[0] = 106.0
            beat(store, "hb/a")  # past the back-off: granted and put, on a live member
            assert beat.lease is not None and beat.placed and beat.grant_failures == 0
            assert store.raw.time_to_live(beat.lease) > 0
            beat.close()
        finally:
            relay.close()


def test_a_sender_keeps_its_client_while_its_lease_grant_is_held_back() -> None:
    """A beat that failed makes the sender reconnect (a timed-out client may be out of
    step), but a beat held back by the grant's back-off (BeatDeferred) sent no request, so
    the sender keeps the client it has: one reconnect after the failure, not one a beat.
    Thousands of agents backing off together would otherwise each open a connection a
    beat to a member that is already behind."""
    from ftrun.control.auth import Signer
    from ftrun.control.heartbeat import HeartbeatSender
    from ftrun.control.store import JsonStore

    with loopback_etcd() as endpoint:
        relay = FreezableRelay(int(endpoint.rsplit(":", 1)[1]))
        sender = None
        try:
            frozen = connect_etcd(EtcdOptions.parse(relay.endpoint, {}), 10, op_timeout_s=1)
            connects = [0]

            def connect() -> EtcdClient:  # the client made before the freeze, counted
                connects[0] += 1
                return frozen

            template = JsonStore(frozen, "ftrun/held", signer=Signer(b"t" * 16))
            sender = HeartbeatSender(connect, template, "a", 0.1, 5.0)
            assert sender.lease is not None
            sender.lease.clock = lambda: 100.0  # the back-off never runs out
            relay.freeze()
            sender.start()
            deadline = time.monotonic() + 10
            while "held back" not in sender.last_error:
                assert time.monotonic() < deadline, (sender.last_error, connects)
                time.sleep(0.05)
            held_at = connects[0]
            time.sleep(1.0)  # ten beats, each held back
            assert "held back" in sender.last_error, sender.last_error
            assert connects[0] == held_at == 2, connects  # the first, one after the failure
            assert sender.lease.grant_failures == 1
        finally:
            if sender is not None:
                sender.stop(2.0)
            relay.close()


#: An agent's side of the fork hazard, in a fresh interpreter (grpcio not imported yet): a
#: lease renewed on its keepalive stream by a thread while the main thread starts children
#: as the agent starts workers (``subprocess`` with a ``preexec_fn``, closing descriptors).
_FORKER = """
import os, subprocess, sys, threading
from ftrun.control.etcd import EtcdOptions, connect_etcd
from ftrun.control.etcdkeepalive import KeepAliveStream, load_grpc
endpoint = sys.argv[1]
load_grpc()
print("left in environ:", "GRPC_ENABLE_FORK_SUPPORT" in os.environ, flush=True)
client = connect_etcd(EtcdOptions.parse(endpoint, {}), 10, op_timeout_s=2)
lease, _ = client.grant_ttl(30)
stream, stop = KeepAliveStream(), threading.Event()
def renew():
    while not stop.is_set():
        stream.renew(endpoint, lease, 2.0)
renewer = threading.Thread(target=renew, daemon=True)
renewer.start()
codes = []
for _ in range(40):
    child = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=lambda: None,
                             close_fds=True, start_new_session=True)
    codes.append(child.wait())
stop.set()
renewer.join(5)
stream.close()
print("children:", codes.count(0), "of", len(codes), "exited 0", flush=True)
"""


def test_an_agent_forks_its_workers_with_grpcs_fork_support_off() -> None:
    """With grpcio's fork support on, every fork while a keepalive stream runs goes through
    gRPC's fork handlers ("skipping fork() handlers" when a call is in flight), and now and
    then the poller it re-creates in the child aborts the worker before its exec (CI:
    "rank 1 killed by SIGABRT", "Epoll1Poller ... Bad file descriptor"). ``load_grpc``
    imports grpcio with it off, and leaves the environment the workers inherit as it was."""
    import subprocess
    import sys

    with loopback_etcd() as endpoint:
        env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
        done = subprocess.run([sys.executable, "-c", _FORKER, endpoint], capture_output=True,
                              text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left in environ: False" in done.stdout, done.stdout
    assert "children: 40 of 40 exited 0" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "fork() handlers" not in done.stderr, done.stderr[-2000:]


#: Threads that each open their first keepalive stream at once, in a fresh interpreter: a
#: process with more than one lease beat (the benchmark's light agents, a test's senders).
_FIRST_USERS = """
import os, sys, threading
from ftrun.control.etcdkeepalive import load_grpc
start, used = threading.Barrier(8), []
def first_use():
    start.wait()
    used.append(hasattr(load_grpc(), "insecure_channel"))
threads = [threading.Thread(target=first_use) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(60)
print("whole:", used.count(True), "of", len(threads), flush=True)
print("left in environ:", "GRPC_ENABLE_FORK_SUPPORT" in os.environ, flush=True)
"""


def test_threads_that_load_grpc_at_once_all_get_the_whole_module() -> None:
    """One thread's import of grpcio takes a while; another that asked meanwhile must wait
    for it, not be handed the module half made (found on etcd 3.5.1: a second
    HeartbeatSender's first renewal failed with "partially initialized module 'grpc' has no
    attribute 'insecure_channel'"). The fork-support variable is still not left set."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    for _ in range(5):  # each a fresh import; one alone showed the race about 1 time in 2
        done = subprocess.run([sys.executable, "-c", _FIRST_USERS], capture_output=True,
                              text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "whole: 8 of 8" in done.stdout, (done.stdout, done.stderr[-2000:])
        assert "left in environ: False" in done.stdout, done.stdout
