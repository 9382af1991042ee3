"""Several "hosts" on one machine: Linux network namespaces joined by a private bridge.

Why: ftrun's interesting failures are between nodes (a node whose link drops, a lossy
network, a rendezvous host that vanishes).  One machine cannot lose a cable, but a
network namespace per host, with its own interface, address, routes and firewall, can:
taking its bridge port down is a cut cable, an iptables ``statistic`` rule is packet loss
(this kernel has no ``netem``).

Layout for ``NetnsNetwork(3)`` in test process ``PID``::

    ftrun-br-PID-K  (namespace)          br0 bridge, ports vh1 vh2 vh3
       |vh1              |vh2              |vh3           (veth pairs)
    ftrun-h1-PID-K    ftrun-h2-PID-K    ftrun-h3-PID-K    eth0 10.213.X.2/.3/.4, lo up

The bridge lives in a namespace of its own, so the machine's root namespace gains no
interface, route or rule, and traffic never leaves the namespaces the test made.  ``K``
counts networks within one process; ``PID`` lets a later run find and delete what a
killed run left behind (:func:`reap_stale_namespaces`).

Teardown (also when the test fails) kills every process still inside the namespaces
(``ip netns pids``) and deletes the namespaces; deleting a namespace destroys its veth
ends and their peers.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.infra.procs import kill_and_wait, pid_alive

__all__ = [
    "NetnsError",
    "NetnsHost",
    "NetnsNetwork",
    "NetnsUnavailable",
    "ftrun_namespaces",
    "netns_hosts",
    "netns_missing_reason",
    "reap_stale_namespaces",
]

PREFIX = "ftrun"
_NAME_RE = re.compile(rf"^{PREFIX}-(?:h\d+|br)-(\d+)-(\d+)$")
_CLONE_NEWNET = 0x40000000
_LOSS_CHAIN = "FTRUN_LOSS"
_seq = 0
_seq_lock = threading.Lock()


class NetnsError(RuntimeError):
    """Setting up or changing the namespace network failed; the message has ip's stderr."""


class NetnsUnavailable(NetnsError):
    """Namespaces cannot be made here (not root, no iproute2): tests should skip."""


def _unavailable(reason: str) -> None:
    """Skip the running test when under pytest, else raise NetnsUnavailable."""
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(reason)
    raise NetnsUnavailable(reason)


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None
    )


def netns_missing_reason() -> str | None:
    """Why namespaces cannot be used here, or None (a cheap check, no namespace made)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if _which("ip") is None:
        return "iproute2 not installed: run scripts/install_test_services.sh"
    return None


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [_which("ip") or "ip", *args], capture_output=True, text=True, timeout=timeout
    )
    if check and res.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res


def _netns_pids(netns: str) -> list[int]:
    res = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _list_netns() -> list[str]:
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def ftrun_namespaces(*, any_owner: bool = False) -> set[str]:
    """The namespaces this process made (``any_owner``: any run's): what leak checks compare.
    Only this process's own, so that a concurrent test process (a pytest-xdist worker) and
    its networks never show up as another test's leak."""
    me = str(os.getpid())
    return {n for n in _list_netns()
            if (m := _NAME_RE.match(n)) and (any_owner or m.group(1) == me)}


def _delete_netns(names: Sequence[str], timeout: float) -> list[str]:
    """Kill processes inside, then delete; returns names that could not be deleted."""
    pids = sorted({p for n in names for p in _netns_pids(n)})
    kill_and_wait(pids, timeout)
    failed = []
    for name in names:
        res = _ip("netns", "del", name, check=False)
        if res.returncode != 0 and name in _list_netns():
            failed.append(name)
    return failed


def reap_stale_namespaces(timeout: float = 5.0) -> list[str]:
    """Delete ``ftrun-*-PID-K`` namespaces whose creating process is dead.

    A test process killed hard skips teardown; its namespaces (and any servers still
    running in them) would otherwise stay until reboot.
    """
    stale = []
    for name in _list_netns():
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            stale.append(name)
    if stale:
        _delete_netns(stale, timeout)
    return stale


_libc: Any = None


def _setns_thread(netns: str) -> None:
    """Move the *calling thread* into ``netns`` (network namespaces are per thread)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(eq=False)
class NetnsHost:
    """One namespace "host": an address on the private subnet and a way to run things."""

    name: str  # logical name: "h1"
    netns: str  # namespace name: "ftrun-h1-1234-0"
    addr: str  # "10.213.X.2"
    port_if: str  # its bridge port (veth end in the bridge namespace): "vh1"
    network: NetnsNetwork = field(repr=False)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    def argv(self, cmd: Sequence[str] | str) -> list[str]:
        """``ip netns exec`` argv for ``cmd`` (a string runs through ``bash -c``)."""
        inner = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return [_which("ip") or "ip", "netns", "exec", self.netns, *inner]

    def run(
        self, cmd: Sequence[str] | str, *, timeout: float = 30.0, check: bool = False,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run to completion inside this host; output captured as text by default."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(cmd), timeout=timeout, check=check, **kwargs)

    def popen(self, cmd: Sequence[str] | str, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start inside this host, in a new session; teardown kills it if still running."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(cmd), **kwargs)
        self._procs.append(proc)
        return proc

    def socket(
        self, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM
    ) -> socket.socket:
        """A socket created inside this host's namespace, usable from the test process.

        Cheaper than a subprocess per probe (``wait_tcp``, loss statistics): a short-lived
        thread enters the namespace, creates the socket and exits; the socket stays in
        the namespace it was made in.
        """
        box: dict[str, Any] = {}

        def make() -> None:
            try:
                _setns_thread(self.netns)
                box["sock"] = socket.socket(family, type)
            except BaseException as exc:
                box["exc"] = exc

        t = threading.Thread(target=make, name=f"netns-{self.name}")
        t.start()
        t.join()
        if "exc" in box:
            raise box["exc"]
        return box["sock"]

    def pids(self) -> list[int]:
        """Processes now inside this namespace."""
        return _netns_pids(self.netns)

    def cut_link(self) -> None:
        """Shortcut for ``network.cut_link(host)``."""
        self.network.cut_link(self)

    def restore_link(self) -> None:
        """Shortcut for ``network.restore_link(host)``."""
        self.network.restore_link(self)

    def __str__(self) -> str:
        return f"{self.name}({self.addr})"


@dataclass
class NetnsNetwork:
    """N namespace hosts on one private /24.  Use as a context manager."""

    n: int = 3
    subnet: str | None = None  # "10.213.X" (first three octets); default derives X from pid
    hosts: list[NetnsHost] = field(init=False, default_factory=list)
    bridge_ns: str = field(init=False, default="")
    _made: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.n <= 250:
            raise ValueError(f"n={self.n}: between 1 and 250 hosts fit a /24")
        if self.subnet is None:
            self.subnet = f"10.213.{os.getpid() % 250 + 1}"

    def __getitem__(self, key: int | str) -> NetnsHost:
        """``net[0]`` or ``net["h1"]``."""
        if isinstance(key, int):
            return self.hosts[key]
        for h in self.hosts:
            if h.name == key:
                return h
        raise KeyError(key)

    def __iter__(self) -> Iterator[NetnsHost]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this network made (hosts and bridge)."""
        return list(self._made)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> NetnsNetwork:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 10.0) -> None:
        """Make the namespaces, bridge and links; return when every eth0 is up."""
        global _seq
        reason = netns_missing_reason()
        if reason:
            _unavailable(reason)
        reap_stale_namespaces()
        with _seq_lock:
            seq, _seq = _seq, _seq + 1
        tag = f"{os.getpid()}-{seq}"
        self.bridge_ns = f"{PREFIX}-br-{tag}"
        try:
            res = _ip("netns", "add", self.bridge_ns, check=False)
            if res.returncode != 0:
                _unavailable(f"ip netns add failed here: {res.stderr.strip()}")
            self._made.append(self.bridge_ns)
            br = ("-n", self.bridge_ns)
            _ip(*br, "link", "set", "lo", "up")
            _ip(*br, "link", "add", "br0", "type", "bridge")
            _ip(*br, "link", "set", "br0", "up")
            for i in range(1, self.n + 1):
                host = NetnsHost(
                    name=f"h{i}", netns=f"{PREFIX}-h{i}-{tag}",
                    addr=f"{self.subnet}.{i + 1}", port_if=f"vh{i}", network=self,
                )
                _ip("netns", "add", host.netns)
                self._made.append(host.netns)
                hn = ("-n", host.netns)
                # Created from inside the bridge namespace: the root namespace never sees it.
                _ip(*br, "link", "add", host.port_if, "type", "veth",
                    "peer", "name", "eth0", "netns", host.netns)
                _ip(*br, "link", "set", host.port_if, "master", "br0")
                _ip(*br, "link", "set", host.port_if, "up")
                _ip(*hn, "link", "set", "lo", "up")
                _ip(*hn, "addr", "add", f"{host.addr}/24", "dev", "eth0")
                _ip(*hn, "link", "set", "eth0", "up")
                self.hosts.append(host)
            deadline = time.monotonic() + timeout
            for host in self.hosts:
                self._wait_oper_up(("-n", host.netns), "eth0", deadline)
        except BaseException:
            self.close()
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Kill what runs inside, delete every namespace made; idempotent.

        Raises NetnsError if something could not be deleted, so a leak fails loudly.
        """
        for host in self.hosts:
            for proc in host._procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
            for proc in host._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2)
            host._procs.clear()
        made, self._made = self._made, []
        failed = _delete_netns(list(reversed(made)), timeout) if made else []
        self.hosts = []
        if failed:
            raise NetnsError(f"could not delete namespaces {failed}")

    # ------------------------------------------------------------------ faults
    def cut_link(self, host: NetnsHost) -> None:
        """Cut the host's cable at the bridge: its packets vanish, in and out.

        The bridge port goes down, not the host's eth0: the host keeps its address and
        routes, so its programs see what a failed switch port or cable gives them -
        connects and sends that time out - not an instant "network unreachable".
        """
        _ip("-n", self.bridge_ns, "link", "set", host.port_if, "down")

    def restore_link(self, host: NetnsHost, timeout: float = 5.0) -> None:
        """Undo :meth:`cut_link`; return once the bridge port forwards again."""
        _ip("-n", self.bridge_ns, "link", "set", host.port_if, "up")
        self._wait_oper_up(("-n", self.bridge_ns), host.port_if, time.monotonic() + timeout)

    def add_loss(self, host: NetnsHost, probability: float, direction: str = "both") -> None:
        """Drop each packet to (``in``), from (``out``) or both ways of ``host`` with ``p``.

        iptables ``statistic --mode random`` in the host's namespace (the kernel has no
        netem).  Loopback traffic inside the host is exempt.  Rules live in a chain of
        their own so :meth:`clear_loss` removes exactly them; calling again replaces them.
        """
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability={probability} not in [0, 1]")
        if direction not in ("in", "out", "both"):
            raise ValueError(f"direction={direction!r}: 'in', 'out' or 'both'")
        self.clear_loss(host)
        ipt = self._iptables(host)
        ipt("-N", _LOSS_CHAIN)
        ipt("-A", _LOSS_CHAIN, "-m", "statistic", "--mode", "random",
            "--probability", f"{probability:.6f}", "-j", "DROP")
        if direction in ("in", "both"):
            ipt("-I", "INPUT", "!", "-i", "lo", "-j", _LOSS_CHAIN)
        if direction in ("out", "both"):
            ipt("-I", "OUTPUT", "!", "-o", "lo", "-j", _LOSS_CHAIN)

    def clear_loss(self, host: NetnsHost) -> None:
        """Remove the rules of :meth:`add_loss` (no-op when there are none)."""
        ipt = self._iptables(host, check=False)
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            while ipt("-D", chain, "!", flag, "lo", "-j", _LOSS_CHAIN).returncode == 0:
                pass
        ipt("-F", _LOSS_CHAIN)
        ipt("-X", _LOSS_CHAIN)

    def _iptables(self, host: NetnsHost, check: bool = True) -> Any:
        exe = _which("iptables")
        if exe is None:
            _unavailable("iptables not installed: run scripts/install_test_services.sh")

        def ipt(*args: str) -> subprocess.CompletedProcess[str]:
            res = subprocess.run(host.argv([exe or "iptables", "-w", *args]),
                                 capture_output=True, text=True, timeout=10)
            if check and res.returncode != 0:
                raise NetnsError(f"iptables {shlex.join(args)} in {host}: {res.stderr.strip()}")
            return res

        return ipt

    # ------------------------------------------------------------------ waiting
    @staticmethod
    def _wait_oper_up(where: tuple[str, str], dev: str, deadline: float) -> None:
        while True:
            out = _ip(*where, "-o", "link", "show", "dev", dev).stdout
            if "state UP" in out or ("LOWER_UP" in out and ",UP" in out):
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"{dev} in {where[1]} not up: {out.strip()}")
            time.sleep(0.02)


def tcp_connect(host_from: NetnsHost, addr: str, port: int, timeout: float) -> float:
    """One TCP connect from ``host_from``; seconds it took, or raise the OSError/timeout."""
    start = time.monotonic()
    with host_from.socket() as s:
        s.settimeout(timeout)
        s.connect((addr, port))
    return time.monotonic() - start


def wait_tcp(
    host_from: NetnsHost, addr: str, port: int, timeout: float, attempt_timeout: float = 1.0
) -> float:
    """Wait until a TCP connect from ``host_from`` to ``addr:port`` succeeds.

    Returns the seconds waited; raises TimeoutError (with the last error) at the deadline.
    This is the reachability check here: there is no ping, and a listening port is what
    the code under test needs anyway.
    """
    start = time.monotonic()
    deadline = start + timeout
    last: BaseException | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"{host_from} could not connect to {addr}:{port} within {timeout:.1f}s: {last!r}"
            )
        try:
            tcp_connect(host_from, addr, port, min(attempt_timeout, left))
            return time.monotonic() - start
        except OSError as exc:  # includes socket.timeout / ConnectionRefusedError
            last = exc
            if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def netns_hosts(n: int = 3, subnet: str | None = None) -> Iterator[NetnsNetwork]:
    """``with netns_hosts(3) as net: net["h1"].run(...)`` - deleted on exit, always."""
    net = NetnsNetwork(n=n, subnet=subnet)
    with net:
        yield net
