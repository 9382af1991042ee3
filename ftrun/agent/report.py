"""The summary a person reads when a job fails: first failure first, then the rest.

Rendered with ``rich`` on the agent's stderr. The same facts go to the event log as JSON;
this module only decides how a person sees them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ftrun.agent.events import WorkerExit


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
