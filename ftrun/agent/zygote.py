"""The fork server behind ``ftrun --preload``: one process per node that has imported the
script's heavy modules once, and forks every worker of every job generation from there.

Why: a worker started the normal way pays for the interpreter and for ``import torch``
(seconds) at the first launch and again at every restart. A fork of a process that already
holds those modules starts in milliseconds and shares their pages copy-on-write.

Why it is safe only under conditions, and what it checks: ``fork`` copies one thread. A
process whose imports started threads (a thread pool, CUDA) would hand its children locks
held by threads that do not exist in them. So the server refuses, before the first fork, any
preload that left more than one thread in the process or initialised CUDA, and says which.

What a worker sees (the same as a worker started as ``python -u SCRIPT ARGS``): its own
session, ``PR_SET_PDEATHSIG=SIGKILL`` (it dies with the server, which dies with the agent),
its environment and working directory from the agent, ``sys.argv``, ``sys.path[0]`` (the
script's directory, or the working directory with ``-m``), ``__main__``, unbuffered output on
the pipes the agent gave it, Python's default signal dispositions, and Python's own exit
status rules (the script runs at the top of the process, so an uncaught exception, a
``SystemExit`` or a ``KeyboardInterrupt`` end it exactly as they would end ``python``).

Started as ``python -u -m ftrun.agent.zygote FD PATH0 MODULE... -- SCRIPT ARGS``: ``FD`` is its
end of a Unix socket to the agent, ``PATH0`` what ``sys.path[0]`` is for the worker (the script's
directory, or the working directory with ``-m``), so the preloaded imports resolve as the
script's own would. This module imports nothing from ftrun but, in a forked worker, the
stdlib-only ``ftrun.exithook`` (the package's ``__init__`` is lazy), so the workers' address
space holds only what the script would import.

Protocol with the agent:

* server -> agent, once: ``{"ready": true, "import_s": ...}`` or ``{"ready": false,
  "error": "..."}`` (then the server exits 2);
* agent -> server: ``{"spawn": {"argv": [...], "module": bool, "env": {...}, "cwd": "..."}}``
  with the worker's stdout and stderr pipe ends as SCM_RIGHTS; server -> agent:
  ``{"pid": N}`` or ``{"error": "..."}``;
* server -> agent, whenever a worker ends: ``{"exit": pid, "status": code}``, ``code`` as
  ``subprocess`` reports it (negative: killed by that signal).

Every message is one JSON object per line, length-limited and validated; no pickle.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
from typing import Any

_MAX_MESSAGE = 1 << 22  # a worker's environment and argv fit easily in 4 MiB
_PR_SET_PDEATHSIG = 1
#: The shim's control page variable (ftrun.shim.abi.ENV_CONTROL; this module imports no ftrun)
SHIM_CONTROL_ENV = "FTRUN_SHIM_CONTROL"


class _Request:
    """One validated spawn request."""

    def __init__(self, data: dict[str, Any]) -> None:
        argv, env, cwd, module = data.get("argv"), data.get("env"), data.get("cwd"), \
            data.get("module")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ValueError("argv must be a non-empty list of strings")
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in env.items())):
            raise ValueError("env must map strings to strings")
        if not isinstance(cwd, str) or not isinstance(module, bool):
            raise ValueError("cwd must be a string and module a bool")
        self.argv: list[str] = argv
        self.env: dict[str, str] = env
        self.cwd = cwd
        self.module = module


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _preload(modules: list[str]) -> str | None:
    """Import ``modules``; the reason they cannot be forked from, or None."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as error:  # any failure, SystemExit included, is the user's
            return f"cannot import {name!r}: {type(error).__name__}: {error}"
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        return (f"importing {', '.join(modules)} started {threads - 1} thread(s); a fork "
                "would copy only one of them (leave those modules out of --preload)")
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return f"importing {', '.join(modules)} initialised CUDA, which cannot cross a fork"
    return None


def _status(raw: int) -> int:
    """A wait status as ``subprocess`` reports it."""
    if os.WIFSIGNALED(raw):
        return -os.WTERMSIG(raw)
    return os.WEXITSTATUS(raw)


def serve(sock: socket.socket, modules: list[str]) -> _Request | None:
    """Answer spawn requests until the agent closes the socket. Returns only in a forked
    worker (with its request) or, for the server itself, None when it should exit."""
    started = time.monotonic()
    reason = _preload(modules)
    if reason is not None:
        _send(sock, {"ready": False, "error": reason})
        return None
    _send(sock, {"ready": True, "import_s": round(time.monotonic() - started, 3)})
    children: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    buffer = b""
    # poll, not select: select cannot watch a descriptor numbered above 1023, which the
    # socket is when the agent holds many (a multi-node agent raises its open-file limit)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        for pid in list(children):
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _send(sock, {"exit": pid, "status": _status(raw)})
        ready = {fd for fd, _events in poller.poll(1000)}
        if wake_r in ready:
            os.read(wake_r, 4096)
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 2)
        except OSError:
            return None  # the agent is gone (its end was reset)
        if not data:
            return None  # the agent is gone: so are we (its workers die with us)
        buffer += data
        if len(buffer) > _MAX_MESSAGE:
            _send(sock, {"error": "request too long"})
            return None
        if b"\n" not in buffer:
            for fd in fds:
                os.close(fd)
            continue
        line, buffer = buffer.split(b"\n", 1)
        try:
            request = _Request(json.loads(line)["spawn"])
            if len(fds) != 2:
                raise ValueError(f"expected 2 stream descriptors, got {len(fds)}")
        except (ValueError, KeyError, TypeError) as error:
            for fd in fds:
                os.close(fd)
            _send(sock, {"error": f"bad spawn request: {error}"})
            continue
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)
            _become_worker(sock, server, fds, request)
            return request
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(sock, {"pid": pid})


def _become_worker(sock: socket.socket, server: int, fds: list[int], request: _Request) -> None:
    """In the forked child: the process-level half of looking like ``python -u SCRIPT``."""
    os.setsid()
    _die_with_parent(server)
    sock.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 65536)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request.env)
    if request.env.get(SHIM_CONTROL_ENV):  # the agent gave this worker a shim page
        _attach_shim()
    if request.env.get("PYTHONFAULTHANDLER"):  # what a fresh interpreter would read at start
        faulthandler.enable()
    if request.env.get("FTRUN_EXIT_HOOK"):  # what its sitecustomize would do at start
        from ftrun.exithook import adopt

        adopt()
    os.chdir(request.cwd)


def _attach_shim() -> None:
    """Give this worker an NCCL shim of its own: the server preloads the library (inert there:
    it has no control page) and a fork copies none of its threads, so the child maps the page
    its environment names and starts its control thread, as a spawned worker's shim does at
    its start. A server started without the shim has no such symbol: nothing to do."""
    attach = getattr(ctypes.CDLL(None), "ftshim_attach", None)
    if attach is None:
        return
    attach.restype = ctypes.c_int
    if attach() == 0:  # FTSHIM_MODE_INERT
        reason = ctypes.CDLL(None).ftshim_inert_reason
        reason.restype = ctypes.c_char_p
        print(f"ftrun-shim[{os.getpid()}]: not attached in the forked worker: "
              f"{reason().decode(errors='replace')}", file=sys.stderr, flush=True)


def run_worker(request: _Request) -> None:
    """Run the script as ``__main__``; its exceptions reach the interpreter's top level."""
    sys.argv = list(request.argv)
    if request.module:
        sys.path[0] = os.getcwd()
        runpy.run_module(request.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(request.argv[0]))
        runpy.run_path(request.argv[0], run_name="__main__")


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python -m ftrun.agent.zygote FD PATH0 [MODULE ...] [-- COMMAND]",
              file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(argv[1]))
    sys.path[0] = argv[2]
    # after "--": the workers' command, only so that ps (and every tool that finds a job's
    # processes by their command line) shows it for the server and its forks
    modules = argv[3:argv.index("--")] if "--" in argv else argv[3:]
    request = serve(sock, modules)
    if request is None:
        return 0
    run_worker(request)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
