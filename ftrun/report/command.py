"""``ftrun report EVENTS.jsonl [-o PICTURE] [--json]``: the command itself.

Exit codes: 0 on success; 2 (usage) for a bad command line, an events file that cannot be
read or is not JSON lines, or a picture path that cannot be written; each is one line on
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from ftrun.exitcodes import ExitCode
from ftrun.observe.faults import FaultBook
from ftrun.observe.summary import print_job_summary
from ftrun.report.events import EventsFileError, read_events


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise _UsageError(message)


def _parser() -> _Parser:
    parser = _Parser(prog="ftrun report", description="A job's faults and recovery costs "
                     "from its event log (--events-file), with a timeline picture.")
    parser.add_argument("events", type=Path, help="the job's events.jsonl")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="write the timeline picture here (.html: plotly, .png)")
    parser.add_argument("--json", action="store_true",
                        help="print the summary and fault records as one JSON object")
    return parser


def main(args: Sequence[str]) -> int:
    try:
        ns = _parser().parse_args(list(args))
    except _UsageError as error:
        print(f"ftrun report: error: {error}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        events = read_events(ns.events)
    except EventsFileError as error:
        print(f"ftrun report: error: {error}", file=sys.stderr)
        return ExitCode.USAGE
    book = FaultBook().replay(events)
    summary = book.summary(ended=max(e["ts"] for e in events
                                     if isinstance(e.get("ts"), (int, float))))
    if ns.output is not None:
        from ftrun.report.timeline import PictureError, build, write

        try:
            write(build(events, book), ns.output, f"ftrun job {ns.events.name}: "
                  f"{len(summary.faults)} faults")
        except PictureError as error:
            print(f"ftrun report: error: {error}", file=sys.stderr)
            return ExitCode.USAGE
    if ns.json:
        print(json.dumps(summary.to_json()))
        return ExitCode.SUCCESS
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    print_job_summary(console, summary)
    if ns.output is not None:
        console.print(f"timeline: {ns.output}")
    return ExitCode.SUCCESS
