"""What the regroup leader's status read costs as a job grows.

Under ``--recovery regroup`` every worker's heartbeat thread writes a signed status record
(``ftrun/worker/membership.py``, every ``FTRUN_HEARTBEAT_S``, 0.2 s by default) to the
leader's member-epoch store, and the leader reads every member's status in one
``multi_get`` per tick of its loop (``--monitor-interval``, 0.1 s;
``ftrun/agent/regroup.py`` ``_read_statuses``). This measures one such read with the
real pieces: a real TCPStore served here, records written with the job's signer, and
``ftrun.agent.membership.Membership.read_statuses`` verifying them, in turns: with every
record changed since the last read (the worst case), and with half of them changed (a
0.2 s beat read every 0.1 s: the default), where the bytes of an unchanged record are not
parsed and verified again. It prints what each read costs and what share of one core the
leader spends on it at the default tick, next to the workers' write rate the store then
serves. To compare two versions of ftrun, run this file with ``PYTHONPATH`` set to a
worktree of the other.

torchrun has no counterpart to measure beside it: its agent keeps no per-worker liveness
in the store (a hung worker is found by the collective's timeout).

    .venv/bin/python scripts/bench_member_statuses.py --workers 512 4096 32768 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from ftrun import protocol as P
from ftrun.agent.membership import Membership
from ftrun.control.auth import Signer
from ftrun.control.store import JsonStore
from ftrun.control.tcpstore import connect_store, serve_store

_TICK_S = 0.1  # LaunchConfig.monitor_interval_s
_BEAT_S = 0.2  # ftrun.worker.settings.HEARTBEAT_DEFAULT_S


def _measure(workers: int, repeats: int) -> dict[str, float]:
    server = serve_store(0, 30)
    client = connect_store("127.0.0.1", int(server.port), 30)
    signer = Signer(b"bench-token")
    writer = JsonStore(client, "ftrun/bench/regroup/0", signer=signer)
    reader = Membership(JsonStore(connect_store("127.0.0.1", int(server.port), 30),
                                  "ftrun/bench/regroup/0", signer=signer), lambda *a, **k: None)
    members = [P.member_id(i // 8, i % 8) for i in range(workers)]
    every: list[float] = []  # every status changed since the last read
    half: list[float] = []  # half of them: the default beat and tick

    def beat_and_read(beat: int, who: list[str], seconds: list[float]) -> None:
        status = P.Status(beat, beat, 0, True, False).to_json()
        for start in range(0, len(who), 1024):
            writer.set_records({P.status_key(m): status for m in who[start:start + 1024]})
        began = time.perf_counter()
        reader.read_statuses(members, set(members))
        seconds.append(time.perf_counter() - began)
        assert all(reader.statuses[m].beats == beat for m in who), "a status was not read"

    beat_and_read(1, members, [])  # a warm-up (connections, caches)
    for repeat in range(repeats):
        beat_and_read(2 * repeat + 2, members, every)
        beat_and_read(2 * repeat + 3, members[repeat % 2::2], half)
    del server
    read_s, half_s = statistics.median(every), statistics.median(half)
    return {"workers": workers, "read_s": round(read_s, 4),
            "leader_core_share": round(read_s / _TICK_S, 2),
            "read_half_changed_s": round(half_s, 4),
            "leader_core_share_half_changed": round(half_s / _TICK_S, 2),
            "worker_writes_per_s": round(workers / _BEAT_S)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[512, 4096, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)
    rows = [_measure(n, args.repeats) for n in args.workers]
    table = Table(title=f"regroup leader: one read of every member's status "
                        f"(median of {args.repeats}; tick {_TICK_S} s, beats {_BEAT_S} s)")
    for column in ("workers", "read (s), every status changed", "share of a core",
                   "read (s), half changed (default beat and tick)", "share of a core",
                   "worker status writes/s the store serves"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["workers"]), f"{row['read_s']:.4f}",
                      f"{row['leader_core_share']:.2f}", f"{row['read_half_changed_s']:.4f}",
                      f"{row['leader_core_share_half_changed']:.2f}",
                      str(row["worker_writes_per_s"]))
    Console(file=sys.stderr).print(table)
    if args.json:
        print(json.dumps({"member_status_read": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
