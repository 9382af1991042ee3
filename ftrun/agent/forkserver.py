"""The agent's end of ``--preload``: start this node's fork server, ask it for workers,
learn how they ended.

The server (:mod:`ftrun.agent.zygote`) imports the preloaded modules while the agent forms the
first job generation, so neither the first launch nor any restart pays for the interpreter
and the imports again. It is started with the workers' common environment (the variables
that libraries read at import time, such as ``OMP_NUM_THREADS``, must already be the
workers'), in its own session, and dies with the agent (``PR_SET_PDEATHSIG``); its workers
die with it.

A forked worker is the server's child, not the agent's: the agent watches it through a
pidfd as any other worker (Linux lets any process open one) and learns its exit status from
the server, which reaps it. :class:`ForkedChild` gives it the face of a
``subprocess.Popen`` so the rest of the agent does not care how a worker was started.

The NCCL shim crosses the fork: it must be loaded before NCCL, so the server preloads it
(``LD_PRELOAD``, without a control page: inert there, and the server never makes a
communicator), and each forked worker, given its own page in its environment, attaches to it
and starts its own control thread (:func:`ftrun.agent.zygote._attach_shim`). A forked worker's
shim is a spawned worker's: the same aborts, counters and liveness, its own.

Error semantics: :meth:`ForkServer.wait_ready` raises :class:`ForkServerError` with the
server's own one-line reason (a module that does not import, one that starts threads or
CUDA) or when the server does not answer within its timeout; :meth:`ForkServer.spawn` raises
``OSError`` like ``subprocess`` when the server cannot start a worker or is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from ftrun.agent.processes import die_with_parent, readable, shared_worker_env
from ftrun.config import LaunchConfig
from ftrun.shim.native import ShimNotBuiltError, shim_library_path

_MAX_LINE = 1 << 16


class ForkServerError(RuntimeError):
    """The fork server could not be made ready (the user's input or this node's state)."""


def preload_unsupported(config: LaunchConfig) -> str | None:
    """Why this job's workers cannot be forked from a server (None: they can)."""
    if config.no_python:
        return "--no-python runs no Python to fork from"
    python_exec = os.environ.get("PYTHON_EXEC")
    if python_exec and os.path.realpath(python_exec) != os.path.realpath(sys.executable):
        return f"PYTHON_EXEC={python_exec} is not the interpreter ftrun runs in"
    return None


def start_fork_server(config: LaunchConfig) -> ForkServer | None:
    """The fork server for ``--preload``, started (its imports run while the caller goes
    on); None without ``--preload`` or where it cannot be honoured (the launcher says why).
    The CLI calls it before the agent imports torch, so that the two imports overlap."""
    if not config.preload or preload_unsupported(config) is not None:
        return None
    path0 = os.getcwd() if config.module else os.path.dirname(os.path.abspath(config.entrypoint))
    # numpy's OpenBLAS starts a thread pool when imported (torch imports numpy), and a fork
    # copies one thread: the server imports with a pool of one. Forked workers' numpy BLAS
    # then runs on one thread; torch's own math (MKL, OpenMP) is unaffected.
    env = {"OPENBLAS_NUM_THREADS": "1", **shared_worker_env(config)}
    shim = _shim_library(config)
    if shim is not None:  # before NCCL, as in a spawned worker; the user's preloads first
        env["LD_PRELOAD"] = ":".join([*filter(None, env.get("LD_PRELOAD", "").split(":")),
                                      shim])
    server = ForkServer(config.preload, env=env, path0=path0,
                        shown=[config.entrypoint, *config.args])
    server.has_shim = shim is not None
    return server


def _shim_library(config: LaunchConfig) -> str | None:
    """The shim library the server preloads, or None (disabled, or not built: the launcher
    says so at the first worker it cannot give a page)."""
    if not config.use_shim:
        return None
    try:
        return str(shim_library_path())
    except ShimNotBuiltError:
        return None


class ForkServer:
    """One fork server per agent (main thread only)."""

    def __init__(self, modules: Sequence[str], *, env: Mapping[str, str], path0: str,
                 python: str = sys.executable, shown: Sequence[str] = ()) -> None:
        """``shown``: the workers' command, appended after ``--`` to the server's command
        line (which its forks inherit), so that ``ps`` names the script."""
        self.modules = tuple(modules)
        self.has_shim = False  # preloads the NCCL shim: its workers get pages of their own
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        agent_pid = os.getpid()
        try:
            self._process = subprocess.Popen(
                [python, "-u", "-m", "ftrun.agent.zygote", str(child.fileno()), path0, *modules,
                 "--", *shown],
                env=dict(env), stdin=subprocess.DEVNULL, pass_fds=(child.fileno(),),
                start_new_session=True, preexec_fn=lambda: die_with_parent(agent_pid),
            )
        finally:
            child.close()
        self._sock = parent
        self._buffer = b""
        self._statuses: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        self.import_s: float | None = None
        self._ready = False

    @property
    def pid(self) -> int:
        return self._process.pid

    def wait_ready(self, timeout_s: float) -> float:
        """Block until the modules are imported; returns the server's import time."""
        if self._ready:
            return self.import_s or 0.0
        message = self._next_reply(timeout_s, waiting_for="the preloaded imports")
        if not message.get("ready"):
            error = message.get("error")
            raise ForkServerError(f"--preload: {error if isinstance(error, str) else message}")
        import_s = message.get("import_s")
        self.import_s = float(import_s) if isinstance(import_s, (int, float)) else 0.0
        self._ready = True
        return self.import_s

    def spawn(self, argv: Sequence[str], *, module: bool, env: Mapping[str, str], cwd: str,
              timeout_s: float = 30.0) -> ForkedChild:
        """Fork one worker running ``argv`` (script or module and its arguments)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = {"spawn": {"argv": list(argv), "module": module, "env": dict(env),
                             "cwd": cwd}}
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode() + b"\n"],
                            [out_w, err_w])
            reply = self._next_reply(timeout_s, waiting_for="a forked worker")
        except (OSError, ForkServerError) as error:
            for fd in (out_r, err_r):
                os.close(fd)
            raise OSError(f"fork server: {error}") from None
        finally:
            os.close(out_w)
            os.close(err_w)
        pid = reply.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            for fd in (out_r, err_r):
                os.close(fd)
            raise OSError(f"fork server: {reply.get('error', reply)}")
        return ForkedChild(self, pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))

    def status(self, pid: int) -> int | None:
        """The exit status of a worker the server reaped, or None while it runs."""
        self._collect(0.0)
        return self._statuses.get(pid)

    def close(self) -> None:
        """Stop the server (its remaining workers die with it) and reap it."""
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)

    # -- the socket ------------------------------------------------------------------------
    def _next_reply(self, timeout_s: float, *, waiting_for: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ForkServerError(f"fork server gave no answer in {timeout_s:g} s while "
                                      f"waiting for {waiting_for}")
            if not self._collect(left) and self._process.poll() is not None:
                raise ForkServerError(
                    f"fork server exited with status {self._process.returncode} while "
                    f"waiting for {waiting_for}")
        return self._replies.pop(0)

    def _collect(self, timeout_s: float) -> bool:
        """Read what the server sent (exit notices are kept, replies queued). False when the
        server closed its end."""
        if self._sock.fileno() < 0:  # closed here (close()): nothing more will come
            return False
        if not readable([self._sock.fileno()], timeout_s):
            return True
        try:
            data = self._sock.recv(_MAX_LINE)
        except OSError:
            return False
        if not data:
            return False
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not ours to act on; the server only writes JSON lines
            if not isinstance(message, dict):
                continue
            pid, status = message.get("exit"), message.get("status")
            if "exit" in message:
                if isinstance(pid, int) and isinstance(status, int):
                    self._statuses[pid] = status
                continue
            self._replies.append(message)
        return True


class ForkedChild:
    """A worker forked by the server, with the part of ``subprocess.Popen`` the agent uses.

    ``poll`` never blocks while the worker runs; once the worker's own pidfd says it has
    exited, it waits (at most ``_STATUS_WAIT_S``) for the server to reap it and send the
    status, so the agent sees the same exit code a child would give it.
    """

    _STATUS_WAIT_S = 5.0

    def __init__(self, server: ForkServer, pid: int, stdout: IO[bytes],
                 stderr: IO[bytes]) -> None:
        self.server = server
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        # When the agent saw it end (its pidfd), not when the server's status arrived a few
        # milliseconds later: which worker failed first is decided on these times.
        self.exited_at: float | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = -1  # already gone: the server has or will have its status

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        exited = self._exited()
        status = self.server.status(self.pid)
        if status is None and exited:
            deadline = time.monotonic() + self._STATUS_WAIT_S
            while status is None and time.monotonic() < deadline:
                self.server._collect(0.05)
                status = self.server.status(self.pid)
            if status is None:
                status = -signal.SIGKILL  # the server died with it: report it as killed
        if status is not None:
            self.returncode = status
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
        return self.returncode

    def _exited(self) -> bool:
        if self._pidfd >= 0 and not readable([self._pidfd], 0.0):
            return False
        if self.exited_at is None:
            self.exited_at = time.time()
        return True

