"""What a watch and its event cost an etcd member: through the JSON gateway, as ftrun's
held waits watch today (ftrun/control/etcdheld.py), or on etcd's native gRPC ``Watch``.

Why: in the 4,096-agent etcd-v3 join the member's profile put the JSON gateway first (docs/scale.md:
in the second after the leader had every slot, 0.26 of 0.73 s
sampled on etcd 3.5.1, 0.39 of 1.26 s on 3.4.23). Most of it is the agents' watches: each
waits for its assignment on a stream of its own, and each event is turned into JSON for its
stream. Whether moving those waits to the native stream (as the keepalives moved,
scripts/etcd_keepalive_grpc.py) is worth its code is decided by what it saves per watch,
measured here side by side on one member, like for like.

What a round does, each way (``gateway``, then ``native``, alternating first each round):
``--watchers`` watchers, each on a connection of its own (as agents on their own hosts),
each watching one key of its own from the store's revision: on the gateway a connection made
for the watch, as a held wait makes it (an HTTP/1.1 stream holds its connection); natively a
stream on a grpcio channel (local subchannel pool: a connection each) made and connected
before the figures start, as an agent's keepalive channel would be; then ``--watchers`` keys
written in transactions of 128 puts through the gateway (as the leader writes assignments),
and every watcher waits for its event; then the watches ended. The member's
CPU (``/proc``) is read around each phase: ``create`` (the watches made and confirmed),
``deliver`` (the writes and every event) and ``close`` (the gateway's connections closed,
the native streams cancelled). A third pass, ``writes alone``, writes as many keys with no
watcher, so that ``deliver`` minus it is the events' share. Per watcher figures are in µs of
member CPU.

Bounds: each phase waits at most ``--timeout`` seconds and the round fails with a one-line
RuntimeError naming the phase and how many watchers were done. The gateway side is one
thread (non-blocking sockets); the native side runs a grpcio thread per stream, so above a
few thousand watchers this process loads the 2 cores more than the member does.

    python scripts/etcd_watch_grpc.py --watchers 1000 --rounds 2 --json
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ftrun.control.etcdkeepalive import (
    as_is,
    drained,
    encode_varint,
    load_grpc,
    protobuf_fields,
)
from tests.infra.etcd_cluster import (
    etcd_missing_reason,
    etcd_version,
    loopback_etcd,
    member_process,
    use_etcd_binary,
)

WATCH = "/etcdserverpb.Watch/Watch"
RANGE = "/etcdserverpb.KV/Range"
TXN_OPS = 128


def encode_watch_create(key: bytes, start_revision: int) -> bytes:
    """``WatchRequest{create_request: WatchCreateRequest{key, start_revision}}``."""
    inner = b"\x0a" + encode_varint(len(key)) + key + b"\x18" + encode_varint(start_revision)
    return b"\x0a" + encode_varint(len(inner)) + inner


def watch_response_kind(message: bytes) -> str:
    """``"events"`` when a ``WatchResponse`` carries events (field 11), ``"created"`` when
    it confirms a watch (field 3), ``"canceled"`` (field 4), else ``"other"``."""
    fields = {number for number, _, value in protobuf_fields(message)
              if not isinstance(value, int) or value}
    for number, name in ((11, "events"), (4, "canceled"), (3, "created")):
        if number in fields:
            return name
    return "other"


class GatewayWatchers:
    """Watchers on the JSON gateway's ``/v3/watch``: one HTTP/1.1 connection each, one
    thread for all (non-blocking sockets)."""

    def __init__(self, endpoint: str, keys: list[bytes], revision: int) -> None:
        host, port = endpoint.rsplit(":", 1)
        self.sel = selectors.DefaultSelector()
        self.seen: dict[int, bytearray] = {}
        self.created = self.fired = 0
        self._state: dict[int, int] = {}  # fd -> 0 waiting, 1 created, 2 fired
        for key in keys:
            body = json.dumps({"create_request": {
                "key": base64.b64encode(key).decode(), "start_revision": revision}})
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall((f"POST /v3/watch HTTP/1.1\r\nHost: {endpoint}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                          f"\r\n\r\n{body}").encode())
            sock.setblocking(False)
            self.sel.register(sock, selectors.EVENT_READ)
            self.seen[sock.fileno()] = bytearray()
            self._state[sock.fileno()] = 0

    def pump(self, until: Callable[[], bool], deadline: float) -> None:
        while not until() and time.monotonic() < deadline:
            for key, _ in self.sel.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # the member closed it: that watcher waits for nothing more
                    self.sel.unregister(sock)
                    sock.close()
                    continue
                fd = sock.fileno()
                self.seen[fd] += data
                if self._state[fd] == 0 and b'"created":true' in self.seen[fd]:
                    self._state[fd], self.created = 1, self.created + 1
                if self._state[fd] == 1 and b'"events":[' in self.seen[fd]:
                    self._state[fd], self.fired = 2, self.fired + 1
                    self.seen[fd] = bytearray()

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        self.sel.close()


class NativeWatchers:
    """Watchers on etcd's gRPC ``Watch``: a channel (one HTTP/2 connection) each, made
    and connected beforehand (an agent's keepalive stream holds one already), and a
    thread per stream reading its answers."""

    def __init__(self, channels: list[Any], keys: list[bytes], revision: int) -> None:
        self.created = self.fired = 0
        self._lock = threading.Lock()
        self.outboxes: list[queue.SimpleQueue[bytes | None]] = []
        self.calls: list[Any] = []
        for key, channel in zip(keys, channels, strict=True):
            method = channel.stream_stream(WATCH, request_serializer=as_is,
                                           response_deserializer=as_is)
            outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
            outbox.put(encode_watch_create(key, revision))
            call = method(drained(outbox))
            threading.Thread(target=self._read, args=(call,), daemon=True).start()
            self.outboxes.append(outbox)
            self.calls.append(call)

    def _read(self, call: Any) -> None:
        try:
            for message in call:
                kind = watch_response_kind(message)  # a ValueError: said, not swallowed
                with self._lock:
                    if kind == "created":
                        self.created += 1
                    elif kind == "events":
                        self.fired += 1
        except load_grpc().RpcError:  # the cancel at close ends the stream: nothing to count
            return

    def pump(self, until: Callable[[], bool], deadline: float) -> None:
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        """Each stream cancelled; its connection stays (the keepalive stream's)."""
        for outbox, call in zip(self.outboxes, self.calls, strict=True):
            outbox.put(None)
            call.cancel()


def connected_channels(endpoint: str, count: int, timeout_s: float) -> list[Any]:
    """``count`` grpcio channels to ``endpoint``, each its own connection, connected."""
    grpc = load_grpc()
    channels = [grpc.insecure_channel(endpoint, options=[
        ("grpc.use_local_subchannel_pool", 1), ("grpc.enable_http_proxy", 0),
        ("grpc.http2.bdp_probe", 0)])
        for _ in range(count)]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        # one request first, as the keepalives were: the connection's header tables warm
        channel.unary_unary(RANGE, request_serializer=as_is, response_deserializer=as_is)(
            b"\x0a\x01x", timeout=timeout_s)  # RangeRequest{key: "x"}
    return channels


def measure_round(endpoint: str, way: str, watchers: int, timeout_s: float,
                  tag: str) -> dict[str, Any]:
    member = member_process(endpoint)

    def cpu_s() -> float:
        return _cpu_s(member)

    session = requests.Session()
    base = f"http://{endpoint}/v3"
    keys = [f"/bench/{tag}/{way}/{i}".encode() for i in range(watchers)]
    result: dict[str, Any] = {"way": way, "watchers": watchers}
    channels: list[Any] = []
    try:
        revision = int(session.post(f"{base}/kv/range", json={"key": "AA=="}, timeout=10)
                       .json()["header"]["revision"]) + 1
        if way == "native":
            channels = connected_channels(endpoint, watchers, timeout_s)
        time.sleep(0.5)
        c0, t0 = cpu_s(), time.monotonic()
        if way == "gateway":
            group: GatewayWatchers | NativeWatchers = GatewayWatchers(endpoint, keys, revision)
        else:
            group = NativeWatchers(channels, keys, revision)
        return _round(group, result, session, base, keys, timeout_s, cpu_s, c0, t0)
    finally:
        session.close()
        for channel in channels:
            channel.close()


def _round(group: GatewayWatchers | NativeWatchers, result: dict[str, Any],
           session: requests.Session, base: str, keys: list[bytes], timeout_s: float,
           cpu_s: Callable[[], float], c0: float, t0: float) -> dict[str, Any]:
    """The three phases of :func:`measure_round` on watchers just made (created at ``t0``,
    the member's CPU then ``c0``); the watches are ended whatever happens."""
    way, watchers = result["way"], len(keys)
    try:
        _await(group, "created", watchers, timeout_s, f"{way}: create")
        c1, t1 = cpu_s(), time.monotonic()
        result["create_s"] = round(t1 - t0, 3)
        result["create_us_per_watcher"] = round((c1 - c0) / watchers * 1e6, 1)
        time.sleep(0.5)  # the member's own work after the creates settles
        c1 = cpu_s()
        writer = threading.Thread(target=_write, args=(session, base, keys))
        t1 = time.monotonic()
        writer.start()
        _await(group, "fired", watchers, timeout_s, f"{way}: deliver")
        writer.join(timeout_s)
        c2, t2 = cpu_s(), time.monotonic()
        result["deliver_s"] = round(t2 - t1, 3)
        result["deliver_us_per_watcher"] = round((c2 - c1) / watchers * 1e6, 1)
        time.sleep(0.5)
        c2 = cpu_s()
    finally:
        group.close()
    time.sleep(1.0)  # the member notices the closes
    result["close_us_per_watcher"] = round((cpu_s() - c2) / watchers * 1e6, 1)
    return result


def _await(group: GatewayWatchers | NativeWatchers, counter: str, watchers: int,
           timeout_s: float, phase: str) -> None:
    """Until ``counter`` (``created``, ``fired``) reaches ``watchers``; RuntimeError past
    ``timeout_s`` naming the phase and how many were done."""
    group.pump(lambda: getattr(group, counter) >= watchers, time.monotonic() + timeout_s)
    if getattr(group, counter) < watchers:
        raise RuntimeError(f"{phase}: {getattr(group, counter)} of {watchers} {counter} "
                           f"within {timeout_s:.0f} s")


def _cpu_s(member: Any) -> float:
    times = member.cpu_times()
    return float(times.user + times.system)


def writes_alone(endpoint: str, watchers: int, tag: str) -> float:
    """µs of member CPU per key for the same writes with no watcher."""
    member = member_process(endpoint)
    keys = [f"/bench/{tag}/alone/{i}".encode() for i in range(watchers)]
    c0 = _cpu_s(member)
    with requests.Session() as session:
        _write(session, f"http://{endpoint}/v3", keys)
    time.sleep(0.5)
    return round((_cpu_s(member) - c0) / watchers * 1e6, 1)


def _write(session: requests.Session, base: str, keys: list[bytes]) -> None:
    for start in range(0, len(keys), TXN_OPS):
        puts = [{"request_put": {"key": base64.b64encode(k).decode(),
                                 "value": base64.b64encode(b"x" * 96).decode()}}
                for k in keys[start:start + TXN_OPS]]
        session.post(f"{base}/kv/txn", json={"success": puts}, timeout=30).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watchers", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--etcd-binary", default=None, metavar="PATH")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.watchers < 1 or args.rounds < 1:
        parser.error("--watchers and --rounds must be at least 1")
    if args.etcd_binary:
        try:
            use_etcd_binary(args.etcd_binary)
        except ValueError as error:
            parser.error(f"--etcd-binary: {error}")
    if reason := etcd_missing_reason():
        parser.error(reason)
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    rounds: list[dict[str, Any]] = []
    alone: list[float] = []
    try:
        with loopback_etcd() as endpoint:
            for k in range(args.rounds):
                ways = ("gateway", "native") if k % 2 == 0 else ("native", "gateway")
                for way in ways:
                    rounds.append(measure_round(endpoint, way, args.watchers, args.timeout,
                                                f"r{k}"))
                    print(f"  {rounds[-1]}", file=sys.stderr, flush=True)
                alone.append(writes_alone(endpoint, args.watchers, f"r{k}"))
    except RuntimeError as error:
        sys.exit(f"etcd_watch_grpc: {error}")
    result = {"etcd_version": etcd_version(), "watchers": args.watchers,
              "writes_alone_us_per_key": alone, "rounds": rounds}
    print(f"etcd {result['etcd_version']}, {args.watchers} watchers, a connection each; "
          "µs of member CPU per watcher:")
    print(f"  {'way':8} {'create':>8} {'deliver':>8} {'close':>8} {'deliver s':>10}")
    for r in rounds:
        print(f"  {r['way']:8} {r['create_us_per_watcher']:8.1f} "
              f"{r['deliver_us_per_watcher']:8.1f} {r['close_us_per_watcher']:8.1f} "
              f"{r['deliver_s']:10.3f}")
    print(f"  the same writes with no watcher: {alone} µs per key")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
