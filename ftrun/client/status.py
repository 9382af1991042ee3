"""``ftrun status [--json] [ENDPOINT|RUN_ID]``: one look at a running job.

Without a name it looks at this host's registry (ftrun.client.jobref): the one live job is shown;
several are listed (run id, where, agent pid, started), each to be named; none is an error.
Every job says its run id and this command in its first line.

Reads the job's record (``ftrun/job``) from its control store, where the leader agent
refreshes it every second (ftrun.observe.statusboard): job generation, member epoch, world,
nodes, each member's rank, process, state and step rate, the committed step, the last
faults with their recovery times, and the ranks judged stragglers. A rich table for
people, ``--json`` for programs (the record as it is, plus ``age_s``: how old it is).
Works from any host that reaches the store (an etcd-v3 job: ``etcd-v3://HOST:PORT,.../RUN_ID``,
ftrun.client.jobref); a job that signs its records is read only
with its token (``FTRUN_JOB_TOKEN``), the same rule as ``ftrun inject``.

Exit codes: 0; 2 bad input (a bad name, no or a wrong token); 3 the store cannot be
reached within ``--timeout`` (default 10 s) or holds no job record, or (no name given) no
live job is registered on this host. Errors are one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ftrun.client.inject import InjectError, open_job, read_job
from ftrun.client.jobref import LiveJob, live_jobs
from ftrun.exitcodes import ExitCode


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise InjectError(message)


def fetch(name: str, timeout_s: float) -> dict[str, Any]:
    """The job's record, checked. Raises InjectError (its code says which exit)."""
    from ftrun.control.errors import StoreError

    ref, signer, client = open_job(name, timeout_s)
    try:
        record = read_job(client, signer, ref.job_key)
    except StoreError as error:
        raise InjectError(f"cannot read the job's store ({ref.describe()}): {error}",
                          ExitCode.RENDEZVOUS_FAILED) from None
    except InjectError as error:
        if "no ftrun job record" in str(error):
            error.code = ExitCode.RENDEZVOUS_FAILED
        raise
    updated = record.get("updated")
    record["age_s"] = round(time.time() - updated, 3) if isinstance(updated, (int, float)) \
        else None
    record["endpoint"] = ref.describe()
    return record


def _cell(value: Any) -> Text:
    return Text("-" if value is None else str(value))


def render(console: Console, job: dict[str, Any]) -> None:
    started = job.get("started")
    since = datetime.fromtimestamp(started).strftime("%H:%M:%S") \
        if isinstance(started, (int, float)) else "?"
    console.print(Text(
        f"job {job.get('run_id')} at {job.get('endpoint')}: generation {job.get('generation')}"
        f", member epoch {job.get('epoch')}, world {job.get('world_size')}, nodes "
        f"{job.get('nnodes')}, step {job.get('step')}, restarts {job.get('restarts')}, "
        f"started {since}, updated {job.get('age_s')} s ago"), style="bold")
    members = job.get("members") if isinstance(job.get("members"), list) else []
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in ("rank", "member", "pid", "state", "steps/s"):
        table.add_column(column)
    for member in members:
        if isinstance(member, dict):
            table.add_row(*(_cell(member.get(k)) for k in ("rank", "member", "pid", "state",
                                                              "step_rate")))
    console.print(table)
    stragglers = job.get("stragglers") if isinstance(job.get("stragglers"), list) else []
    for item in stragglers:
        if isinstance(item, dict):
            console.print(Text(f"straggler: rank {item.get('rank')} (member "
                               f"{item.get('member')}) on node {item.get('straggler_node')}: "
                               f"{item.get('own_s')} s of own work per step vs "
                               f"{item.get('others_s')} s (the others' median)"),
                          style="yellow")
    faults = job.get("faults") if isinstance(job.get("faults"), list) else []
    if not faults:
        console.print("no faults")
        return
    table = Table(title="last faults", show_edge=False, pad_edge=False, box=None,
                  header_style="bold")
    for column in ("#", "rank", "cause", "path", "detect s", "recover s", "steps lost",
                   "world"):
        table.add_column(column)
    for fault in faults:
        if isinstance(fault, dict):
            table.add_row(*(_cell(fault.get(k)) for k in (
                "index", "rank", "cause", "path", "detection_s", "recovery_s", "steps_lost",
                "world")))
    console.print(table)


def _list(jobs: list[LiveJob], as_json: bool) -> None:
    """Several live jobs on this host: one line each, to be named."""
    rows = [{"run_id": j.run_id, "where": j.ref.describe(), "agent_pid": j.pid,
             "started": j.started} for j in jobs]
    if as_json:
        print(json.dumps({"jobs": rows}))
        return
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"{len(jobs)} live ftrun jobs on this host: ftrun status RUN_ID "
                  "shows one", show_edge=False, pad_edge=False, box=None,
                  header_style="bold")
    for column in ("run id", "where", "agent pid", "started"):
        table.add_column(column)
    for row in rows:
        started = row["started"]
        since = datetime.fromtimestamp(started).strftime("%H:%M:%S") \
            if isinstance(started, (int, float)) else "?"
        table.add_row(str(row["run_id"]), str(row["where"]), str(row["agent_pid"]), since)
    console.print(table)


def main(args: Sequence[str]) -> int:
    parser = _Parser(prog="ftrun status", description="One look at a running job.")
    parser.add_argument("job", nargs="?", help="HOST:PORT of its control store, "
                        "etcd-v3://HOST:PORT,.../RUN_ID, or its run id (default: the one "
                        "live job of this host; several are listed)")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to reach the store")
    try:
        ns = parser.parse_args(list(args))
        if not 0 < ns.timeout <= 3600:
            raise InjectError("--timeout must be in (0, 3600] seconds")
        name = ns.job
        if name is None:
            jobs = live_jobs()
            if not jobs:
                raise InjectError("no live ftrun job is registered on this host (name one: "
                                  "HOST:PORT of its control store, or "
                                  "etcd-v3://HOST:PORT,.../RUN_ID)",
                                  ExitCode.RENDEZVOUS_FAILED)
            if len(jobs) > 1:
                _list(jobs, ns.json)
                return ExitCode.SUCCESS
            name = jobs[0].run_id
        job = fetch(name, ns.timeout)
    except InjectError as error:
        print(f"ftrun status: error: {error}", file=sys.stderr)
        return error.code
    if ns.json:
        print(json.dumps(job))
    else:
        render(Console(highlight=False, width=None if sys.stdout.isatty() else 160), job)
    return ExitCode.SUCCESS
