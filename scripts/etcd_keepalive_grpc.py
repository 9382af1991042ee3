"""What one lease keepalive costs an etcd member: over etcd's native gRPC stream, or as a
JSON gateway request (what ftrun's etcd-v3 heartbeat, ``LeaseBeat``, sent before it
renewed on the stream: ftrun/control/etcdkeepalive.py).

Why: on one loopback member the gateway keepalives were what limited etcd-v3 store load
(about 2,000 agents a second, docs/scale.md), and a request through
the gateway costs etcd several times its gRPC work. This measures the member's CPU per
keepalive both ways, side by side in one run: ``--leases`` leases (TTL 30 s) kept alive
once a second each, for ``--seconds``, first each on a ``LeaseKeepAlive`` bidirectional
stream of its own (one HTTP/2 channel), then each with a POST to ``/v3/lease/keepalive``
(32 threads with keep-alive sessions). The member's idle CPU is measured between them.
The protobuf messages are written by hand (an int64 field each) so that no generated code
is needed.

Needs ``grpcio`` (a dependency of ftrun's since the agents renew on the stream) and
Debian's ``etcd-server``. Prints a table and, with ``--json``, one JSON object. Above about 500
leases the stream side's client threads (grpcio runs a thread per request iterator) load
this 2-core machine more than etcd does, so keep ``--leases`` small.

    python scripts/etcd_keepalive_grpc.py --leases 500 --seconds 10 --json
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ftrun.control.etcdkeepalive import decode_keepalive, encode_keepalive
from tests.infra.etcd_cluster import loopback_etcd, member_process


def measure(leases: int, seconds: float) -> dict[str, Any]:
    import grpc

    stop = threading.Event()
    with loopback_etcd() as endpoint:
        try:
            return _measure(grpc, endpoint, leases, seconds, stop)
        finally:
            stop.set()


def _measure(grpc: Any, endpoint: str, leases: int, seconds: float,
             stop: threading.Event) -> dict[str, Any]:
    client = f"http://{endpoint}"
    proc = member_process(endpoint)

    def cpu_s() -> float:
        times = proc.cpu_times()
        return float(times.user + times.system)

    def window(count: list[int]) -> tuple[float, float]:
        """(keepalives a second, etcd cores) over ``seconds``."""
        c0, n0, t0 = cpu_s(), count[0], time.monotonic()
        time.sleep(seconds)
        c1, n1, t1 = cpu_s(), count[0], time.monotonic()
        return (n1 - n0) / (t1 - t0), (c1 - c0) / (t1 - t0)

    channel = grpc.insecure_channel(endpoint)
    same = lambda x: x  # noqa: E731  (messages are bytes both ways)
    grant = channel.unary_unary("/etcdserverpb.Lease/LeaseGrant",
                                request_serializer=same, response_deserializer=same)
    # LeaseGrantRequest{TTL: 30} is field 1 too; its answer has the ID in field 2
    ids = [decode_keepalive(grant(encode_keepalive(30), timeout=10))[0]
           for _ in range(leases)]

    keepalive = channel.stream_stream("/etcdserverpb.Lease/LeaseKeepAlive",
                                      request_serializer=same, response_deserializer=same)
    inboxes: list[queue.Queue[bytes | None]] = [queue.Queue() for _ in ids]

    def requests_of(inbox: queue.Queue[bytes | None]) -> Iterator[bytes]:
        while (item := inbox.get()) is not None:
            yield item
    answered = [0]

    def read(stream: Any) -> None:
        for _ in stream:
            answered[0] += 1
    for inbox in inboxes:
        threading.Thread(target=read, args=(keepalive(requests_of(inbox)),),
                         daemon=True).start()

    def pump() -> None:
        due = time.monotonic()
        while not stop.is_set():
            for inbox, lease in zip(inboxes, ids, strict=True):
                inbox.put(encode_keepalive(lease))
            due += 1.0
            time.sleep(max(0.0, due - time.monotonic()))
    threading.Thread(target=pump, daemon=True).start()
    time.sleep(2.0)
    stream_rate, stream_cores = window(answered)
    stop.set()
    for inbox in inboxes:
        inbox.put(None)
    time.sleep(1.0)
    c0 = cpu_s()
    time.sleep(3.0)
    idle_cores = (cpu_s() - c0) / 3.0

    posted, stop_posting = [0], threading.Event()

    def post(part: list[int]) -> None:
        session, due = requests.Session(), time.monotonic()
        while not stop_posting.is_set():
            for lease in part:
                try:
                    session.post(f"{client}/v3/lease/keepalive", json={"ID": str(lease)},
                                 timeout=5)
                    posted[0] += 1
                except requests.RequestException:
                    return
            due += 1.0
            time.sleep(max(0.0, due - time.monotonic()))
    posters = [threading.Thread(target=post, args=(ids[k::32],), daemon=True)
               for k in range(32)]
    for thread in posters:
        thread.start()
    time.sleep(2.0)
    gateway_rate, gateway_cores = window(posted)
    stop_posting.set()
    for thread in posters:
        thread.join(10)
    channel.close()

    def per_keepalive_us(rate: float, cores: float) -> float | None:
        return round((cores - idle_cores) / rate * 1e6, 1) if rate > 0 else None
    return {
        "leases": leases, "window_s": seconds, "etcd_idle_cores": round(idle_cores, 4),
        "grpc_stream": {"keepalives_per_s": round(stream_rate, 1),
                        "etcd_cores": round(stream_cores, 4),
                        "etcd_us_per_keepalive": per_keepalive_us(stream_rate, stream_cores)},
        "json_gateway": {"keepalives_per_s": round(gateway_rate, 1),
                         "etcd_cores": round(gateway_cores, 4),
                         "etcd_us_per_keepalive": per_keepalive_us(gateway_rate,
                                                                   gateway_cores)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--leases", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.leases, args.seconds)
    print(f"{'keepalive path':<16} {'per s':>8} {'etcd cores':>11} {'etcd us each (net)':>19}")
    for name in ("grpc_stream", "json_gateway"):
        row = result[name]
        print(f"{name:<16} {row['keepalives_per_s']:>8} {row['etcd_cores']:>11} "
              f"{row['etcd_us_per_keepalive']!s:>19}")
    print(f"etcd idle: {result['etcd_idle_cores']} cores")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
