"""A real etcd cluster for tests: one member per network-namespace host (Debian's etcd-server).

Why: the etcd-v3 backend's promises (the job goes on when the member an agent talks to
dies; records stay signed; bad endpoints give one line) only mean something against a real
replicated cluster, with members on separate "hosts" that can be killed or cut off.

Everything a cluster makes is private to the test process that made it: the members run
inside that process's namespaces (whose names carry its pid, tests/infra/netns.py), listen
on their host's address only (ports 2379/2380 cannot collide across namespaces), keep their
data in a directory named with the pid under /dev/shm (a tmpfs: no fsync cost), and are
killed and waited for at :meth:`EtcdCluster.stop`, which also removes the directory.
:func:`loopback_etcd` is one member on 127.0.0.1 with free ports, for tests that talk to
etcd from the test process itself.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests.infra.netns import NetnsHost

__all__ = ["ETCD_BINARY_ENV", "EtcdCluster", "ServerTls", "etcd_binary", "etcd_missing_reason",
           "etcd_version", "loopback_etcd", "member_process", "suspend", "use_etcd_binary"]

_seq = itertools.count()


#: An etcd binary to run instead of the one on ``PATH`` (Debian's 3.4.23): the benchmarks'
#: ``--etcd-binary`` sets it, so that a figure can be measured on another etcd release
#: (docs/scale.md), and the tests can be run against one.
ETCD_BINARY_ENV = "FTRUN_TEST_ETCD"


def etcd_binary() -> str:
    """The etcd binary that members run: ``$FTRUN_TEST_ETCD``, else ``etcd`` on ``PATH``."""
    return os.environ.get(ETCD_BINARY_ENV) or shutil.which("etcd") or "/usr/bin/etcd"


def use_etcd_binary(path: str) -> None:
    """Members started from now on (in this process and its children) run ``path``: the
    benchmarks' ``--etcd-binary``. ValueError when it is no executable file."""
    binary = Path(path).resolve()
    if not _executable(str(binary)):
        raise ValueError(f"{binary} is not an executable file")
    os.environ[ETCD_BINARY_ENV] = str(binary)


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def etcd_missing_reason() -> str | None:
    """Why no etcd member can be started here (for a skip), or None. RuntimeError when
    ``$FTRUN_TEST_ETCD`` names no executable file: a run asked for that etcd, and skipping
    every etcd test would pass it without testing it."""
    binary = etcd_binary()
    if _executable(binary):
        return None
    if os.environ.get(ETCD_BINARY_ENV):
        raise RuntimeError(f"{ETCD_BINARY_ENV}={binary} is not an executable file")
    return "etcd-server is not installed: run scripts/install_test_services.sh"


def etcd_version() -> str:
    """The release of :func:`etcd_binary` (``etcd --version``'s first line), for a figure's
    record; ``"unknown"`` when it does not say."""
    try:
        out = subprocess.run([etcd_binary(), "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    first = out.splitlines()[0] if out else ""
    return first.split(":", 1)[1].strip() if first.startswith("etcd Version:") else "unknown"


def _health(sock: socket.socket, host: str, port: int, timeout: float,
            tls: ssl.SSLContext | None = None) -> bool:
    """One ``GET /health`` over ``sock`` (through ``tls`` when given): whether the member
    says it is healthy (it has a leader and can serve)."""
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        sock.sendall(f"GET /health HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
        return b'"health":"true"' in data
    except OSError:
        return False
    finally:
        sock.close()


class EtcdCluster:
    """One etcd member per host in ``hosts`` (member ``i`` on ``hosts[i]``)."""

    def __init__(self, hosts: Sequence[NetnsHost], *, client_port: int = 2379,
                 peer_port: int = 2380) -> None:
        self.hosts = list(hosts)
        self.client_port = client_port
        self.peer_port = peer_port
        self.root = Path(tempfile.mkdtemp(prefix=f"ftrun-etcd-{os.getpid()}-{next(_seq)}-",
                                          dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self.procs: list[subprocess.Popen[Any] | None] = [None] * len(self.hosts)

    @property
    def endpoints(self) -> str:
        """``--rdzv-endpoint`` for ftrun: every member's client address."""
        return ",".join(f"{h.addr}:{self.client_port}" for h in self.hosts)

    def start(self, timeout: float = 30.0) -> None:
        """Start every member; return when each says it is healthy (RuntimeError with the
        members' logs otherwise)."""
        for i in range(len(self.hosts)):
            self._launch(i, "new")
        deadline = time.monotonic() + timeout
        for i in range(len(self.hosts)):
            self._wait_healthy(i, deadline, timeout)

    def _launch(self, i: int, state: str) -> None:
        """Start member ``i`` (``state``: etcd's initial cluster state; a member that
        restarts on its data directory rejoins whatever it says)."""
        host = self.hosts[i]
        peers = ",".join(f"m{j}=http://{h.addr}:{self.peer_port}"
                         for j, h in enumerate(self.hosts))
        client = f"http://{host.addr}:{self.client_port}"
        peer = f"http://{host.addr}:{self.peer_port}"
        log = open(self.root / f"m{i}.log", "ab")  # noqa: SIM115 - the member owns it
        self.procs[i] = host.popen(
            [etcd_binary(), "--name", f"m{i}", "--data-dir", str(self.root / f"m{i}"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", peers, "--initial-cluster-state", state,
             "--initial-cluster-token", self.root.name, "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    def _wait_healthy(self, i: int, deadline: float, timeout: float) -> None:
        host = self.hosts[i]
        while not _health(host.socket(), host.addr, self.client_port, 2.0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member m{i} on {host} not healthy in {timeout} s:"
                                   f"\n{self.log(i)[-2000:]}")
            time.sleep(0.1)

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start member ``i`` again after :meth:`kill` (on its data directory: it rejoins
        the cluster); return once it says it is healthy."""
        self._launch(i, "existing")
        self._wait_healthy(i, time.monotonic() + timeout, timeout)

    def log(self, i: int) -> str:
        with contextlib.suppress(OSError):
            return (self.root / f"m{i}.log").read_text(errors="replace")
        return ""

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (the one on ``hosts[i]``) and wait for it."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        """Kill every member, wait for each, remove the data directory."""
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class ServerTls:
    """A member's client TLS: its certificate and key, and the CA whose certificates it
    accepts from clients (etcd's ``--client-cert-auth``); ``probe`` is a client context
    the health check uses (a certificate that CA signed)."""

    cert: Path
    key: Path
    client_ca: Path
    probe: ssl.SSLContext


@contextlib.contextmanager
def loopback_etcd(timeout: float = 30.0, *, tls: ServerTls | None = None,
                  profiling: bool = False) -> Iterator[str]:
    """One etcd member on 127.0.0.1 with ports free now (this process's own; killed and its
    data removed on exit); yields its client endpoint ``127.0.0.1:PORT``. With ``tls`` its
    clients speak https and must show a certificate of ``tls.client_ca``. ``profiling``:
    the member serves Go's ``/debug/pprof`` on its client URL (``--enable-pprof``)."""
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    client = f"{'https' if tls else 'http'}://127.0.0.1:{ports[0]}"
    peer = f"http://127.0.0.1:{ports[1]}"
    secure = [] if tls is None else [
        "--cert-file", str(tls.cert), "--key-file", str(tls.key),
        "--trusted-ca-file", str(tls.client_ca), "--client-cert-auth"]
    root = Path(tempfile.mkdtemp(prefix=f"ftrun-etcd-{os.getpid()}-{next(_seq)}-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    with open(root / "log", "wb") as log:
        proc = subprocess.Popen(
            [etcd_binary(), "--name", "solo", "--data-dir", str(root / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"solo={peer}", "--log-level", "warn", *secure,
             *(["--enable-pprof"] if profiling else [])],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not _health(socket.socket(), "127.0.0.1", ports[0], 2.0,
                          tls.probe if tls else None):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("etcd on 127.0.0.1 not healthy:\n"
                                   + (root / "log").read_text(errors="replace")[-2000:])
            time.sleep(0.1)
        yield f"127.0.0.1:{ports[0]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


class FreezableRelay:
    """A TCP relay to a loopback etcd; after :meth:`freeze` it neither relays nor answers,
    its connections stay open (an etcd member stopped by SIGSTOP, as its clients see it:
    the kernel still accepts)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.frozen = threading.Event()
        self.socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.socks.append(conn)
            if self.frozen.is_set():
                continue  # held open, never answered
            up = socket.create_connection(("127.0.0.1", self.target))
            self.socks.append(up)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        while True:
            try:
                data = a.recv(65536)
                if not data or self.frozen.is_set():
                    return
                b.sendall(data)
            except OSError:
                return

    def freeze(self) -> None:
        self.frozen.set()

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def member_process(endpoint: str) -> psutil.Process:
    """The loopback etcd member serving ``endpoint``."""
    return psutil.Process(next(c.pid for c in psutil.net_connections("tcp")
                               if c.status == psutil.CONN_LISTEN and c.pid
                               and f"127.0.0.1:{c.laddr.port}" == endpoint))


def suspend(member: psutil.Process) -> None:
    """SIGSTOP the member and wait until every thread of it has stopped. A thread that is
    running on the other core when the signal comes may first answer a request already
    sent (a CI run saw a keepalive answered right after ``suspend()``)."""
    member.suspend()

    def stopped() -> bool:
        for task in Path(f"/proc/{member.pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "Tt":
                    return False
        return True
    deadline = time.monotonic() + 10
    while not stopped():
        if time.monotonic() > deadline:
            raise AssertionError(f"etcd member {member.pid}: not every thread stopped in 10 s")
        time.sleep(0.01)
