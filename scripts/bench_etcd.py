"""What one agent's liveness and end watch cost an etcd member (the etcd-v3 backend).

    python scripts/bench_etcd.py            # table, then one JSON object
    python scripts/bench_etcd.py --seconds 5 --end-watch-s 20

Why: the etcd-v3 backend's heartbeats are leases (ftrun/control/election.py LeaseBeat):
one keepalive per beat instead of the signed ``set`` and the ``check`` that prove a
TCPStore beat (ftrun/control/heartbeat.py). etcd renews a lease on its leader in memory
(no raft proposal, no write to its log), so a keepalive should be the cheaper request;
this measures by how much, and what the agent's end watch costs
(ftrun/control/endwatch.py on etcd: a read and a watch from a revision per slice).

What it runs, on one etcd member on loopback (tests/infra/etcd_cluster.py's
``loopback_etcd``: Debian's etcd-server, its own ports and data, removed after):

* ``beats``: one client, one beat after another for ``--seconds`` each way, through the
  product's own code: ``put`` is the TCPStore-style beat on etcd (``JsonStore.set_record``
  of a signed ``{"seq": n}`` then ``exists``), ``keepalive`` is ``LeaseBeat`` after its
  first grant. Per beat: HTTP requests, wall time, and the CPU the etcd process and this
  client used (``/proc``), so the figure does not depend on how busy the machine was.
* ``end_watch``: one ``EndWatcher`` (the class the agent runs) on a key nobody writes, for
  ``--end-watch-s``, with the agent's slice at the default heartbeat timeout (5 s: request
  timeout 1.67 s, slice 0.83 s); requests are counted at the client's HTTP session, and
  the etcd process's CPU is read over the same time, and before it over as long with
  nothing running (etcd's own idle CPU, subtracted in ``etcd_cpu_ms_per_s_net``).

Errors: etcd-server missing: one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _cpu_s(pid: int) -> float:
    """CPU seconds the process has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _etcd_pid(endpoint: str) -> int:
    import psutil

    port = int(endpoint.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.pid and c.laddr.port == port)


def _counted(client: Any, counts: Counter[str]) -> Any:
    """``client`` (an EtcdClient) with every HTTP request its sessions make counted by path."""
    for inner in client._clients:
        session = inner.session
        send = session.request

        def request(method: str, url: str, *args: Any, _send: Any = send, **kwargs: Any) -> Any:
            counts[url.rsplit("/v3/", 1)[-1]] += 1
            return _send(method, url, *args, **kwargs)
        session.request = request
    return client


def measure_beats(endpoint: str, seconds: float) -> dict[str, dict[str, float]]:
    from ftrun.control.auth import Signer
    from ftrun.control.election import LeaseBeat
    from ftrun.control.etcd import EtcdOptions, connect_etcd
    from ftrun.control.heartbeat import heartbeat_key
    from ftrun.control.store import JsonStore

    options = EtcdOptions.parse(endpoint, {})
    etcd = _etcd_pid(endpoint)
    results: dict[str, dict[str, float]] = {}
    for kind in ("put", "keepalive"):
        counts: Counter[str] = Counter()
        client = _counted(connect_etcd(options, 10, op_timeout_s=5), counts)
        store = JsonStore(client, "ftrun/bench", signer=Signer(b"bench-token"))
        lease = LeaseBeat(5.0)
        key = heartbeat_key(f"node-{kind}")
        lease(store, key)  # the grant and the put: once per lease, not per beat
        counts.clear()
        beats, seq = 0, 0
        etcd_before, mine_before = _cpu_s(etcd), time.process_time()
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            if kind == "put":
                seq += 1
                store.set_record(key, {"seq": seq})
                store.exists(key)
            else:
                lease(store, key)
            beats += 1
        wall = time.monotonic() - started
        etcd_cpu, mine = _cpu_s(etcd) - etcd_before, time.process_time() - mine_before
        results[kind] = {
            "beats": beats, "beats_per_s": round(beats / wall, 1),
            "requests_per_beat": round(sum(counts.values()) / beats, 2),
            "ms_per_beat": round(1000 * wall / beats, 3),
            "etcd_cpu_us_per_beat": round(1e6 * etcd_cpu / beats, 1),
            "client_cpu_us_per_beat": round(1e6 * mine / beats, 1),
        }
    return results


def measure_end_watch(endpoint: str, seconds: float) -> dict[str, Any]:
    from ftrun.control.auth import Signer
    from ftrun.control.endwatch import EndWatcher
    from ftrun.control.etcd import EtcdOptions, connect_etcd
    from ftrun.control.store import JsonStore

    options = EtcdOptions.parse(endpoint, {})
    op = max(1.0, 5.0 / 3)  # the agent's request timeout at the 5 s default (agent/loop.py)
    slice_s = min(1.0, op / 2)  # agent/services.py end_watch
    counts: Counter[str] = Counter()
    template = JsonStore(connect_etcd(options, 10, op_timeout_s=op), "ftrun/bench",
                         signer=Signer(b"bench-token"))
    etcd = _etcd_pid(endpoint)
    etcd_before = _cpu_s(etcd)  # first, etcd alone for as long (its raft ticks, its timers)
    time.sleep(seconds)
    idle = (_cpu_s(etcd) - etcd_before) / seconds
    etcd_before = _cpu_s(etcd)
    started = time.monotonic()
    watcher = EndWatcher(lambda: _counted(connect_etcd(options, op, op_timeout_s=op), counts),
                         template, "gen/0/end", slice_s).start()
    time.sleep(seconds)
    watcher.stop()
    wall = time.monotonic() - started
    etcd_cpu = _cpu_s(etcd) - etcd_before
    total = sum(counts.values())
    return {"seconds": round(wall, 2), "slice_s": round(slice_s, 3),
            "requests": dict(counts), "requests_per_s": round(total / wall, 2),
            "etcd_cpu_ms_per_s": round(1000 * etcd_cpu / wall, 3),
            "etcd_idle_cpu_ms_per_s": round(1000 * idle, 3),
            "etcd_cpu_ms_per_s_net": round(1000 * (etcd_cpu / wall - idle), 3),
            "fired": watcher.fired.is_set()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="how long each kind of beat runs (default 5)")
    parser.add_argument("--end-watch-s", type=float, default=20.0,
                        help="how long the end watch runs (default 20)")
    parser.add_argument("--json", action="store_true", help="(the JSON object is always last)")
    args = parser.parse_args()
    from tests.infra.etcd_cluster import etcd_missing_reason, loopback_etcd

    reason = etcd_missing_reason()
    if reason is not None:
        print(f"bench_etcd: {reason}", file=sys.stderr)
        return 2
    load = os.getloadavg()
    with loopback_etcd() as endpoint:
        beats = measure_beats(endpoint, args.seconds)
        end_watch = measure_end_watch(endpoint, args.end_watch_s)
    print(f"etcd on loopback; load average {load[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print(f"{'beat':<10} {'beats/s':>8} {'requests':>9} {'ms':>7} {'etcd CPU us':>12} "
          f"{'client CPU us':>14}")
    for kind, row in beats.items():
        print(f"{kind:<10} {row['beats_per_s']:>8} {row['requests_per_beat']:>9} "
              f"{row['ms_per_beat']:>7} {row['etcd_cpu_us_per_beat']:>12} "
              f"{row['client_cpu_us_per_beat']:>14}")
    print(f"end watch: {end_watch['requests_per_s']} requests/s "
          f"({end_watch['requests']}, slice {end_watch['slice_s']} s), etcd "
          f"{end_watch['etcd_cpu_ms_per_s']} ms of CPU per second "
          f"({end_watch['etcd_idle_cpu_ms_per_s']} ms/s idle: "
          f"{end_watch['etcd_cpu_ms_per_s_net']} ms/s for the watch)")
    print(json.dumps({"beats": beats, "end_watch": end_watch,
                      "load_before": round(load[0], 2),
                      "load_after": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
