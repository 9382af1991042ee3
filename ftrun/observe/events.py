"""What happened to a job, for people and for programs.

Two outputs share one vocabulary:

* :class:`EventLog` writes one JSON object per line (``--events-file``, ``--log-dir``, or
  stderr with ``--event-log-handler console``) for programs; :class:`Event` is the one table
  of event names. Keys never change meaning; new keys may appear.
* :class:`WorkerExit` is the cause record of one worker's end: rank, node, pid, exit code or
  signal, sub-second time, and the root-cause traceback the script left in
  ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record`` decorator writes it).

Writing an event never raises: a full disk must not turn a worker failure into an agent
crash. The first failure of a generation is marked ``first=True``; workers that the agent
stopped because of it carry ``stopped_by_agent=True``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Any

MAX_TRACEBACK_CHARS = 20_000


class Event(str, Enum):
    """Every event an agent writes, and what it means. ``generation`` in a record is always
    the job generation; ``epoch`` the member epoch of an in-process regroup."""

    STARTED = "started"  # the agent started (run_id): the job's wall clock starts here
    SPAWN = "spawn"  # a local worker process started (rank, local_rank, pid; member)
    READY = "ready"  # regroup: a member called ftrun.init() (member, pid)
    EXIT = "exit"  # a local worker exited (rank or member, pid, returncode)
    FAILURE = "failure"  # a worker failed or was taken out (cause, detected, rank/member)
    GENERATION = "generation"  # this agent joined a job generation (world_size, nnodes)
    EPOCH = "epoch"  # regroup leader: a member epoch was published (members, joiners)
    ABORT = "abort"  # the NCCL shim aborted a member's communicators (its report)
    NODE_LOST = "node_lost"  # leader: another node's heartbeats stopped (silent_s)
    REJECTED = "rejected"  # a store record failed its signature check (detail)
    REGENERATE = "regenerate"  # the job re-forms without a failure (a join, a drop)
    RESTART = "restart"  # every worker restarts in a new job generation (restart_count)
    STOP = "stop"  # workers are being stopped, or the job stops (reason)
    DONE = "done"  # this node's workers all finished
    FORMED = "formed"  # regroup leader: the member epoch after a change formed (step, world)
    PROGRESS = "progress"  # regroup leader, once a second: each rank's committed steps
    FAULT = "fault"  # one fault's record, once its recovery completed (ftrun.observe.faults)
    INJECT = "inject"  # a fault was injected on purpose (spec, rank)
    ERROR = "error"  # a failed worker's own last error, once read (rank, pid, message)
    STRAGGLER = "straggler"  # regroup leader: a rank keeps the others waiting (flagged, rank)
    REFUSED = "refused"  # leader: a node failed its health gate and is not in the job (detail)
    ESCALATE = "escalate"  # leader: a recovery passed its deadline: the job restarts (reason)
    CRASH_LOOP = "crash_loop"  # the same error repeated: the job stops (rank, signature)


def describe_returncode(code: int) -> str:
    """'exit code 3', or 'killed by SIGKILL' for a negative (subprocess-style) code."""
    return f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class WorkerExit:
    """How one worker process ended."""

    rank: int
    local_rank: int
    node: str
    pid: int
    generation: int
    returncode: int  # negative: killed by that signal, as subprocess reports it
    time: float
    stopped_by_agent: bool = False
    first: bool = False
    message: str | None = None  # from the error file
    traceback: str | None = None
    error_at: float | None = None  # when the error file was written (its mtime)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def signal_name(self) -> str | None:
        return _signal_name(-self.returncode) if self.returncode < 0 else None

    @property
    def reason(self) -> str:
        """One line: 'exit code 3' or 'killed by SIGKILL', plus the error message."""
        what = describe_returncode(self.returncode)
        if self.stopped_by_agent:
            what += " (stopped by ftrun)"
        return f"{what}: {self.message}" if self.message else what

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["signal"] = self.signal_name
        return data


def read_error_file(path: Path) -> tuple[str | None, str | None]:
    """(message, traceback) from torch's error file, or (None, None) when absent or unreadable.

    The file is written by the worker, so it is treated as untrusted: any shape other than
    torch's documented one yields what can be salvaged, never an exception.
    """
    try:
        raw = path.read_text(errors="replace")
    except OSError:
        return None, None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return raw.strip()[:500] or None, None
    if not isinstance(data, dict):
        return None, None
    message = data.get("message")
    if isinstance(message, str):
        return message[:2000], None
    if isinstance(message, dict):
        text = message.get("message")
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        return (
            text[:2000] if isinstance(text, str) else None,
            stack[-MAX_TRACEBACK_CHARS:] if isinstance(stack, str) else None,
        )
    return None, None


class EventLog:
    """JSON-lines sink for events; safe to call from several threads."""

    def __init__(self, node: str, sinks: Iterable[IO[str]] = ()) -> None:
        self._node = node
        self._sinks = list(sinks)
        self._lock = threading.Lock()
        self._owned: list[IO[str]] = []
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Also hand every event (the dict of its JSON line) to ``listener``, with or
        without sinks; a listener that raises is dropped from that event, never the log."""
        self._listeners.append(listener)

    @classmethod
    def open(cls, node: str, path: Path | None, console: bool) -> EventLog:
        log = cls(node)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = path.open("a", buffering=1)
            log._sinks.append(handle)
            log._owned.append(handle)
        if console:
            log._sinks.append(sys.stderr)
        return log

    def emit(self, event: Event, **fields: Any) -> None:
        if not self._sinks and not self._listeners:
            return
        record = {"ts": round(time.time(), 6), "event": event.value, "node": self._node,
                  **fields}
        line = json.dumps(record, default=str, separators=(",", ":")) + "\n"
        with self._lock:
            for sink in self._sinks:
                try:
                    sink.write(line)
                    sink.flush()
                except (OSError, ValueError):
                    pass
        for listener in self._listeners:  # after the line: what they emit comes later
            with contextlib.suppress(Exception):  # observers never break the log
                listener(record)

    def close(self) -> None:
        with self._lock:
            for handle in self._owned:
                with contextlib.suppress(OSError):
                    handle.close()
            self._sinks = [s for s in self._sinks if s not in self._owned]
            self._owned.clear()
