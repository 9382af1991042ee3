"""The summaries a person reads: when a job fails, the first failure first, then the
rest; at every end (success too), wall and productive time, goodput and one row per fault.

Rendered with ``rich`` on the agent's stderr. The same facts go to the event log as JSON;
this module only decides how a person sees them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ftrun.observe.events import WorkerExit
from ftrun.observe.faults import FaultRecord, JobSummary


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]


def _one_line(text: str, limit: int) -> str:
    first = text.splitlines()[0] if text else ""
    return first if len(first) <= limit else first[: limit - 1] + "…"


def print_failure_summary(
    console: Console,
    failures: list[WorkerExit],
    *,
    remote_cause: dict[str, Any] | None,
    max_restarts: int,
) -> None:
    """Print why the job failed. ``failures`` are this node's non-successful workers."""
    ordered = sorted(failures, key=lambda e: (not e.first, e.stopped_by_agent, e.time))
    restarts = "no restart" if max_restarts == 0 else f"all {max_restarts} restarts used"
    console.print(f"[bold red]ftrun: job failed[/bold red] ({restarts})")
    if remote_cause is not None:
        console.print(
            Text(
                f"  first failure on node {remote_cause.get('node_rank')} "
                f"({remote_cause.get('node')}): rank {remote_cause.get('rank')}, "
                f"pid {remote_cause.get('pid')}, returncode {remote_cause.get('returncode')}"
            )
        )
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in ("", "rank", "local", "node", "pid", "time", "cause"):
        table.add_column(column, no_wrap=column != "cause")
    for item in ordered:
        mark = "first" if item.first else ("stopped" if item.stopped_by_agent else "after")
        reason = item.reason if item.first else _one_line(item.reason, 120)
        cells = (mark, item.rank, item.local_rank, item.node, item.pid, _clock(item.time), reason)
        table.add_row(*(Text(str(cell)) for cell in cells))  # worker text is never markup
    console.print(table)
    root = next((e for e in ordered if e.traceback), None)
    if root is not None:
        console.print(f"[bold]root cause (rank {root.rank}):[/bold]")
        console.print(Text(root.traceback.rstrip()), soft_wrap=True)  # verbatim, unwrapped


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_job_summary(console: Console, summary: JobSummary) -> None:
    """The end-of-job summary, success or failure: wall and productive time, goodput, each
    fault with its detection and recovery latency and steps lost, the first cause."""
    wall, productive, goodput = summary.wall_s, summary.productive_s, summary.goodput
    head = f"ftrun: wall {_seconds(wall)} s"
    if productive is not None and goodput is not None:
        head += f", productive {productive:.2f} s, goodput {goodput:.1%}"
    else:
        head += ", goodput unknown (no committed step seen: the worker API reports steps)"
    faults = summary.faults
    head += f", {len(faults)} fault{'s' if len(faults) != 1 else ''}"
    console.print(Text(head), style="bold")
    if not faults:
        return
    console.print(fault_table(faults))
    if summary.first_cause:
        console.print(Text(f"  first failure: {summary.first_cause}"))


def fault_table(faults: list[FaultRecord]) -> Table:
    """One row per fault (the report and the end summary share it)."""
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for column in ("#", "time", "who", "cause", "path", "detect s", "recover s",
                   "steps lost", "world", "step"):
        table.add_column(column, no_wrap=column != "cause")
    for f in faults:
        cause = f.cause if not f.injected else f"{f.cause} (injected: {f.injected})"
        cells = (f.index, _clock(f.happened), f.who, _one_line(cause, 80), f.path or "-",
                 _seconds(f.detection_s), _seconds(f.recovery_s),
                 "-" if f.steps_lost is None else f.steps_lost,
                 "-" if f.world is None else f.world, "-" if f.step is None else f.step)
        table.add_row(*(Text(str(cell)) for cell in cells))
    return table
