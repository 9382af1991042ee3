"""Serving and reaching torch's ``TCPStore``: bound to one address, every connect and
request bounded.

Why a module of its own: torch's store is served and reached in ways torch's defaults get
wrong for a launcher (the wildcard address, connects and requests with no bound, a C++ log
line for every failed connect); these functions are what every store of a job is made
with, and :class:`~ftrun.control.store.JsonStore` is what is read and written through them.
Errors: :class:`~ftrun.control.errors.StoreError`, naming the address and why.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from ftrun.control.errors import StoreError
from ftrun.control.sockbounds import bound_requests, connected_to, socket_fds

if TYPE_CHECKING:
    from torch.distributed import TCPStore


def tcpstore_class() -> type[TCPStore]:
    """torch's ``TCPStore``, imported at the first store served or reached: ``JsonStore``
    also wraps etcd-v3 clients (``ftrun inject`` of an etcd job), which need no torch.

    torch's C++ client logs every failed connect and timed-out request (tens of lines while
    a store host is down); the agent says one line of its own instead, so torch is imported
    with its C++ log at FATAL unless the user chose a level, restored at once for the
    workers: only at that first import (torch reads it then), never again, when the
    agent's threads may be spawning workers. ``ftrun``'s command line calls this before it
    imports the agent (whose snapshot modules import torch), connects before their thread
    starts."""
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        from torch.distributed import TCPStore
    finally:
        if quiet:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    return TCPStore


# Bounds each blocking connect so that a signal to the agent is acted on promptly.
_CONNECT_SLICE_S = 2.0
_CONNECT_THREAD = "ftrun-store-connect"
#: How often a reconnect checks that its store still listens (see :func:`connect_store`).
_REFUSED_PROBE_S = 0.1


def serve_store(port: int, timeout_s: float, *, host: str | None = "127.0.0.1") -> TCPStore:
    """Host a store on ``host``'s address only; ``port=0`` takes a free port (see ``.port``).

    ``host``: loopback (the default) for a store only this machine uses, the address
    other nodes reach this node at for a multi-node job; ``None``: every interface (no
    single address is known to be right: the caller says so to the user).

    Why not torch's ``host_name``: a master ``TCPStore`` ignores it and binds the wildcard
    address (TCPStoreLibUvBackend.cpp, ``makeWithPort``), which left single-node jobs'
    stores open to the network. So a socket is bound here to the one address and handed
    over (``master_listen_fd``; the store owns and closes it), with ``SO_REUSEADDR`` as
    torch sets it (a port whose connections linger in TIME_WAIT is served again at once).

    Errors: :class:`StoreError` naming the address and port (taken, not this machine's, a
    name that does not resolve)."""
    where = f"{host}:{port}" if host is not None else f"port {port}"
    tcpstore = tcpstore_class()
    if host is None:
        try:
            return tcpstore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as error:
            raise StoreError(f"cannot serve the store on {where}: {first_line(error)}"
                             ) from None
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise StoreError(f"cannot serve the store on {where}: {host!r} does not resolve "
                         f"({error})") from None
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError as error:
        listener.close()
        raise StoreError(f"cannot serve the store on {where}: "
                         f"{error.strerror or error}") from None
    bound_port = int(listener.getsockname()[1])
    fd = listener.detach()  # from here the store owns the socket (and closes it)
    try:
        return tcpstore(address[0], bound_port, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)
    except (RuntimeError, ValueError) as error:
        # torch closed the socket if it had taken it; a second close could hit a reused fd
        raise StoreError(f"cannot serve the store on {where}: {first_line(error)}") from None


def connect_store(host: str, port: int, timeout_s: float, *,
                  interrupted: Callable[[], bool] = lambda: False,
                  op_timeout_s: float | None = None, give_up_if_refused: bool = False
                  ) -> TCPStore:
    """Connect to a store that may not be up yet, retrying until ``timeout_s``.

    With ``op_timeout_s``, every later request of this client fails after that long
    without an answer. torch's client has no such bound: on a cut link its ``recv``
    waits for TCP to give up (many minutes), so an agent would hang instead of noticing
    that its store host is gone. The bound is put on the client's socket (receive and send
    timeouts, ``TCP_USER_TIMEOUT``); ``timeout_s`` still bounds server-side waits.

    One gap is inside torch: the constructor's first exchange with the server has no
    timeout, so a connect to a *frozen* host (SIGSTOP, a stalled VM: its kernel still
    accepts connections) blocks until it resumes. So each attempt runs in a thread, and
    the caller stops waiting for it at the deadline (its client is dropped if the host
    resumes); it holds the lock of its address (one connect at a time to one address, so
    that the new sockets are attributed to the right client), which other connects to
    that address give up on at their deadline; a connect elsewhere does not wait for it.
    Nothing that calls this hangs on a frozen host.

    ``give_up_if_refused``: torch's client tries a refused connect again until its
    timeout, as for a store still starting. For a store that was up (a reconnect), a
    refused connect means it is gone, so the wait is also given up (StoreError, at once)
    when a plain connect, tried every ``_REFUSED_PROBE_S`` meanwhile, is refused."""
    tcpstore_class()  # torch's first import here, not in a thread racing the deadline
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    while True:
        slice_s = min(_CONNECT_SLICE_S, max(deadline - time.monotonic(), 0.1))
        attempt = _ConnectAttempt(host, port, slice_s, op_timeout_s)
        attempt.thread.start()
        give_up = max(deadline, time.monotonic() + slice_s) + 0.5
        while attempt.thread.is_alive() and time.monotonic() < give_up and not interrupted():
            attempt.thread.join(_REFUSED_PROBE_S if give_up_if_refused else 0.25)
            if give_up_if_refused and attempt.thread.is_alive() \
                    and connect_refused(host, port, _REFUSED_PROBE_S):
                raise StoreError(f"cannot reach the store at {host}:{port}: connection "
                                 "refused (nothing listens there now)")
        if attempt.thread.is_alive():
            raise StoreError(f"cannot reach the store at {host}:{port}: no answer to the "
                             "connect (a frozen store host?)")
        if attempt.store is not None:
            attempt.store.set_timeout(timedelta(seconds=op_timeout_s or timeout_s))
            return attempt.store
        last_error = attempt.error
        if interrupted() or time.monotonic() >= deadline:
            raise StoreError(f"cannot reach the store at {host}:{port}: {last_error}")


def reconnect_store(host: str, port: int, timeout_s: float, *,
                    op_timeout_s: float | None = None) -> TCPStore:
    """:func:`connect_store` to a store that was up and may have died with its host's
    agent. A plain connect first: a refused one (nothing listens there now) fails at once
    with :class:`~ftrun.control.errors.StoreError`, where torch's client retries it until
    ``timeout_s`` as for a store still starting; so a retrying caller (``JsonStore``'s
    reconnect) asks its ``lost()`` again after its pause. Then the client's own connect is
    bounded by a second (seen: a worker held 3 s connecting to its dead writer's store),
    and given up as soon as a connect is refused: a store whose host's agent is being
    killed may still accept the plain connect and be gone for torch's (seen: a worker's
    connect to its dead writer's store took its whole second, retrying refused connects,
    while the new store's address was known)."""
    try:
        socket.create_connection((host, port), timeout=min(2.0, timeout_s)).close()
    except OSError as error:
        raise StoreError(f"cannot reach the store at {host}:{port}: "
                         f"{error.strerror or error}") from None
    return connect_store(host, port, min(1.0, timeout_s), op_timeout_s=op_timeout_s,
                         give_up_if_refused=True)


def connect_refused(host: str, port: int, timeout_s: float) -> bool:
    """Whether a plain TCP connect to ``host:port`` is refused now: nothing listens there
    (its process is gone). A timeout says nothing (a frozen or cut-off host)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


class _ConnectAttempt:
    """One TCPStore client construction, in a daemon thread (see :func:`connect_store`)."""

    def __init__(self, host: str, port: int, slice_s: float, op_timeout_s: float | None
                 ) -> None:
        self.store: TCPStore | None = None
        self.error = "no attempt"
        self.thread = threading.Thread(target=self._run, args=(host, port, slice_s,
                                                               op_timeout_s),
                                       name=_CONNECT_THREAD, daemon=True)

    def _run(self, host: str, port: int, slice_s: float, op_timeout_s: float | None) -> None:
        lock = _address_lock(host, port)
        if not lock.acquire(timeout=slice_s + 0.5):
            self.error = "another connect to it has not returned (a frozen store host?)"
            return
        try:
            before = socket_fds()
            store = tcpstore_class()(host, port, is_master=False,
                                     timeout=timedelta(seconds=slice_s))
            if op_timeout_s is not None:
                bound_requests(connected_to(socket_fds() - before, host, port), op_timeout_s)
            self.store = store
        except (RuntimeError, ValueError) as error:
            self.error = first_line(error)
        finally:
            lock.release()


def _address_lock(host: str, port: int) -> threading.Lock:
    """The lock of connects to ``host:port`` (see :func:`connect_store`): one entry per
    store address this process ever reached, a handful in a job's life."""
    with _ADDRESS_LOCKS_GUARD:
        return _ADDRESS_LOCKS.setdefault((host, port), threading.Lock())


_ADDRESS_LOCKS: dict[tuple[str, int], threading.Lock] = {}
_ADDRESS_LOCKS_GUARD = threading.Lock()


def connect_still_running() -> bool:
    """Whether a connect this process gave up on is still inside torch's client: a short
    command then leaves with ``os._exit`` (see ``ftrun.cli``), as the agent does."""
    return any(t.name == _CONNECT_THREAD and t.is_alive() for t in threading.enumerate())


def first_line(error: BaseException) -> str:
    """torch's store errors carry a C++ trace after the first line."""
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__
