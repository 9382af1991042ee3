"""Spawn, watch, signal and reap the local worker processes of one generation.

Every worker is started in its own session (so a signal to its process group reaches the
worker and everything it started, and a terminal's Ctrl-C reaches only the agent, which
forwards it), with ``PR_SET_PDEATHSIG=SIGKILL`` (so ``kill -9`` of the agent cannot leave
workers running), and with a pidfd (so the agent's watch loop sleeps in ``select`` and
wakes the moment a worker exits, instead of polling).

Workers' stdout and stderr come back through pipes and are routed line by line: to the
console with a rank prefix, to torchrun's per-rank log files, or both, as ``--redirects``,
``--tee`` and ``--local-ranks-filter`` say.

Error semantics: :meth:`LocalWorkers.stop` never raises for a process that is already gone;
spawning raises ``OSError`` if the program cannot be executed at all.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import psutil

from ftrun.agent.stacks import stack_source
from ftrun.config import LaunchConfig, Std
from ftrun.host import fdlimit

_PR_SET_PDEATHSIG = 1
STDERR_TAIL_LINES = 200  # a fault handler's dump of every thread (ftrun.agent.stacks)
_libc = ctypes.CDLL(None, use_errno=True)
_console_lock = threading.Lock()

#: torch's C++ backtrace in an error it logs (c10d's store warnings once a store's host
#: died): its head, then its frames
_CPP_TRACE_HEAD = re.compile(r"^Exception raised from (\S+) at \S+ \(most recent call first\):$")
_CPP_TRACE_LINE = re.compile(r"^(frame #\d+: |<omitting python frames>$)")


@dataclass(frozen=True)
class WorkerLaunch:
    """What to start for one local worker, and where its streams go."""

    local_rank: int
    rank: int
    argv: Sequence[str]
    env: Mapping[str, str]
    console: Std  # streams shown on the console
    files: Std  # streams written to log files
    log_dir: Path | None  # <attempt>/<local_rank>/ ; None: no files
    prefix: str  # console line prefix, e.g. "[rank3]:"
    duplicate_dir: Path | None = None
    duplicate_stdout: tuple[str, ...] = ()
    duplicate_stderr: tuple[str, ...] = ()


def die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: SIGKILL us when the agent dies, and the
    open-file limit the agent was started with (ftrun.host.fdlimit: the agent's own may
    have been raised for the stores it serves)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the agent died before prctl took effect
        os._exit(1)
    fdlimit.restore_in_child()


class Child(Protocol):
    """What the agent needs of a started worker: ``subprocess.Popen`` for one it spawned,
    :class:`ftrun.agent.forkserver.ForkedChild` for one its fork server forked."""

    @property
    def pid(self) -> int: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    @property
    def stderr(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...


@dataclass
class WorkerProcess:
    """One running (or finished) worker."""

    launch: WorkerLaunch
    popen: Child
    pidfd: int
    started: float
    returncode: int | None = None
    ended: float | None = None
    stopped_by_agent: bool = False
    killed_frozen: bool = False
    pumps: list[threading.Thread] = field(default_factory=list)
    shim: Any = None  # ftrun.shim.ShimControl while the worker runs with the NCCL shim
    # The last lines the worker wrote to stderr: its own last error when it wrote no
    # error file (a script without @record), read by the cause record.
    stderr_tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    def poll(self) -> int | None:
        """Reap without blocking; records the end time the first time it is seen."""
        if self.returncode is None:
            code = self.popen.poll()
            if code is not None:
                self.returncode = code
                self.ended = getattr(self.popen, "exited_at", None) or time.time()
                self._close_pidfd()
                if self.shim is not None:
                    self.shim.close()
        return self.returncode

    def is_frozen(self) -> bool:
        """Stopped by SIGSTOP or a tracer: it cannot act on SIGTERM until resumed."""
        try:
            return psutil.Process(self.pid).status() in (
                psutil.STATUS_STOPPED,
                psutil.STATUS_TRACING_STOP,
            )
        except psutil.Error:
            return False

    def signal_group(self, sig: int) -> None:
        """``sig`` to the worker's session (it and anything it started). A fork server's
        child is a group leader only once it ran ``setsid`` just after its fork: a signal in
        that window goes to the process itself (a stop sent to the group alone was lost,
        and the agent waited its whole stop grace, 30 s, for a replacement forked 2 ms
        before). Only while the process is known alive: its pid cannot have been reused."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            if self.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(self.pid, sig)
        except PermissionError:
            pass

    def _close_pidfd(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _exec(launch: WorkerLaunch) -> Child:
    agent_pid = os.getpid()
    return subprocess.Popen(
        list(launch.argv),
        env=dict(launch.env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(agent_pid),
        close_fds=True,
    )


def spawn(launch: WorkerLaunch, start: Callable[[WorkerLaunch], Child] = _exec) -> WorkerProcess:
    """Start one worker (``start``: exec the argv, or ask the fork server). Must be called
    from the agent's main thread: PDEATHSIG follows the thread that forked, not the
    process."""
    if launch.log_dir is not None:
        launch.log_dir.mkdir(parents=True, exist_ok=True)
    popen = start(launch)
    try:
        pidfd = os.pidfd_open(popen.pid)
    except ProcessLookupError:  # a forked worker that already ended and was reaped
        pidfd = -1
    worker = WorkerProcess(launch, popen, pidfd, time.time())
    assert popen.stdout is not None and popen.stderr is not None
    for stream, pipe, bit, tail in (
        ("stdout", popen.stdout, Std.OUT, None),
        ("stderr", popen.stderr, Std.ERR, worker.stderr_tail),
    ):
        thread = threading.Thread(
            target=_pump,
            args=(launch, stream, pipe, bit, tail),
            name=f"ftrun-log-{launch.rank}-{stream}",
            daemon=True,
        )
        thread.start()
        worker.pumps.append(thread)
    return worker


class _ConsoleLines:
    """What of a worker's stream the console shows: each C++ backtrace that torch logs with
    an error collapses to one line. After a store's host died every connection to it logs
    one (twenty-odd frames per connection, per worker), which buries the agent's own
    account of the fault. The log files (``--log-dir``) keep every line;
    ``FTRUN_CPP_BACKTRACES=1`` shows them on the console too."""

    def __init__(self) -> None:
        self.whole = os.environ.get("FTRUN_CPP_BACKTRACES", "") not in ("", "0")
        self._in_trace = False

    def shown(self, line: str) -> str | None:
        """The line to print for ``line``, or None."""
        if self.whole:
            return line
        body = line.rstrip("\n")
        if self._in_trace:
            if _CPP_TRACE_LINE.match(body):
                return None
            self._in_trace = False
            if not body.strip():
                return None  # the blank line that ends it
        head = _CPP_TRACE_HEAD.match(body)
        if head is None:
            return line
        self._in_trace = True
        return (f"(C++ backtrace from {head[1]} not shown: --log-dir keeps it, "
                "FTRUN_CPP_BACKTRACES=1 prints it)\n")


def _pump(launch: WorkerLaunch, stream: str, pipe: IO[bytes], bit: Std,
          tail: collections.deque[str] | None) -> None:
    """Copy one worker stream, line by line, to wherever it belongs (and its last lines to
    ``tail``)."""
    console = sys.stdout if stream == "stdout" else sys.stderr
    show = bool(launch.console.value & bit.value)
    log_file = None
    if launch.log_dir is not None and launch.files.value & bit.value:
        log_file = (launch.log_dir / f"{stream}.log").open("w", buffering=1, errors="replace")
    filters = launch.duplicate_stdout if stream == "stdout" else launch.duplicate_stderr
    duplicate = None
    if filters and launch.duplicate_dir is not None:
        duplicate = (launch.duplicate_dir / f"filtered_{stream}.log").open("a", buffering=1)
    lines = _ConsoleLines()
    try:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            if tail is not None:
                tail.append(line[:1000])
            if log_file is not None:
                log_file.write(line)
            shown = lines.shown(line) if show else None
            if shown is not None:
                with _console_lock:
                    console.write(f"{launch.prefix} {shown}")
                    console.flush()
            if duplicate is not None and any(f in line for f in filters):
                with _console_lock:
                    duplicate.write(f"{launch.prefix} {line}")
    except (OSError, ValueError):
        pass  # the console went away; the worker's own fate is reported elsewhere
    finally:
        pipe.close()
        for handle in (log_file, duplicate):
            if handle is not None:
                handle.close()


def readable(fds: Sequence[int], timeout_s: float) -> list[int]:
    """The fds of ``fds`` that are readable (or hung up) within ``timeout_s``; [] when
    interrupted by a signal. ``poll``, not ``select``: an agent that serves a large job's
    stores holds thousands of descriptors, and ``select`` refuses any numbered 1024 or
    above (the leader crashed spawning a worker whose pidfd got such a number)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    try:  # poll's bound is a C int of milliseconds (about 24.8 days)
        events = poller.poll(min(max(timeout_s, 0.0) * 1000.0, 2**31 - 1))
    except InterruptedError:
        return []
    closed = [fd for fd, event in events if event & select.POLLNVAL]
    if closed:  # as select did: a closed fd is the caller's bug, not a readable one
        raise OSError(errno.EBADF, f"fds {closed} are not open")
    return [fd for fd, _ in events]


def wait_any(
    workers: Iterable[WorkerProcess], timeout_s: float, extra_fds: Sequence[int] = ()
) -> list[int]:
    """Sleep until a worker exits, an extra fd is readable, or the timeout passes.

    Returns the extra fds that are readable. Exited workers are reaped (see ``poll``).
    """
    live = [w for w in workers if w.returncode is None and w.pidfd >= 0]
    fds = [w.pidfd for w in live] + list(extra_fds)
    ready = readable(fds, timeout_s)
    for worker in live:
        if worker.pidfd in ready:
            worker.poll()
    return [fd for fd in ready if fd in extra_fds]


def stop(workers: Sequence[WorkerProcess], sig: int, grace_s: float) -> None:
    """Stop every live worker: ``sig`` to its process group, SIGKILL after ``grace_s``.

    A worker that is frozen (SIGSTOP, traced) cannot act on ``sig`` before it is resumed, so
    waiting for it would only burn the grace period: it is killed at once.
    """
    for worker in workers:
        if worker.poll() is not None:
            continue
        worker.stopped_by_agent = True
        if worker.is_frozen():
            worker.killed_frozen = True
            worker.signal_group(signal.SIGKILL)
        else:
            worker.signal_group(sig)
    deadline = time.monotonic() + grace_s
    while any(w.poll() is None for w in workers):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        wait_any(workers, min(left, 0.5))
        # A SIGSTOP sent just before the stop may take effect only after the check above
        # (the target must be scheduled to stop): look again while waiting.
        for worker in workers:
            if not worker.killed_frozen and worker.poll() is None and worker.is_frozen():
                worker.killed_frozen = True
                worker.signal_group(signal.SIGKILL)
    for worker in workers:
        if worker.poll() is None:
            worker.signal_group(signal.SIGKILL)
    kill_deadline = time.monotonic() + 10.0
    while any(w.poll() is None for w in workers) and time.monotonic() < kill_deadline:
        wait_any(workers, 0.2)
    reap_leftovers(workers)


def reap_leftovers(workers: Iterable[WorkerProcess]) -> None:
    """Kill anything the workers started in their sessions and left behind (no orphans)."""
    for worker in workers:
        worker.signal_group(signal.SIGKILL)


def shared_worker_env(config: LaunchConfig) -> dict[str, str]:
    """What every worker's environment shares, as libraries read it at import time."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in os.environ and config.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    if config.hang_timeout_s != 0 and stack_source() == "faulthandler":
        # py-spy cannot read this host's workers: a hung worker's stack comes from the
        # dump Python's fault handler writes when the agent aborts it (ftrun.agent.stacks)
        env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def last_error(lines: Iterable[str]) -> str | None:
    """The exception a Python worker died of, from its last stderr lines: the final line of
    its last traceback ("ValueError: boom"), without the rank prefix torch adds; None when
    the lines hold no traceback."""
    lines = [line.rstrip("\n") for line in lines]
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if not starts:
        return None
    for line in lines[starts[-1] + 1:]:  # the first unindented line ends the traceback
        bare = _RANK_PREFIX.sub("", line)
        if bare.strip() and not bare.startswith((" ", "\t")):
            return bare.strip()[:500]
    return None


_RANK_PREFIX = re.compile(r"^(\[rank\d+\]: ?)+")


def join_pumps(workers: Iterable[WorkerProcess], timeout_s: float = 2.0) -> None:
    """Wait for the log pumps to drain what the workers wrote before they ended."""
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        for thread in worker.pumps:
            thread.join(max(0.0, deadline - time.monotonic()))
