"""Checks of the network as the job will use it: NCCL's and Gloo's interfaces, the ports
this node must listen on, and the rendezvous endpoint.

Each of these otherwise fails late and obscurely: an ``NCCL_SOCKET_IFNAME`` that matches
no interface at the first collective, a taken port when the store starts, an unreachable
``--rdzv-endpoint`` after a 15-minute rendezvous timeout. Whether this node hosts the store,
and whether a port is free, are decided by ``ftrun.host.hostnet``, the code the agent itself
uses, so that doctor predicts what the job will do.
"""

from __future__ import annotations

import errno
import socket
import time

from ftrun.config import DEFAULT_MASTER_PORT, DEFAULT_RDZV_PORT
from ftrun.doctor.core import (
    CheckResult,
    Context,
    Findings,
    check,
    failed,
    passed,
    process_name,
    skipped,
    warned,
)
from ftrun.doctor.options import parse_endpoint
from ftrun.host.hostnet import is_local_address, port_bind_error


def _local_addresses() -> dict[str, list[str]]:
    """Interface name -> IP addresses, for interfaces that are up."""
    import psutil

    stats = psutil.net_if_stats()
    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        inet = (socket.AF_INET, socket.AF_INET6)
        ips = [a.address.split("%")[0] for a in addrs if a.family in inet]
        if ips:
            out[name] = ips
    return out


def parse_nccl_ifname(spec: str) -> tuple[bool, bool, list[str]]:
    """NCCL_SOCKET_IFNAME syntax: a comma list of name prefixes; a leading ``^`` excludes
    them instead, and ``=`` (after any ``^``) makes them exact names.

    Returns (exclude, exact, names).
    """
    exclude = spec.startswith("^")
    rest = spec[1:] if exclude else spec
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    return exclude, exact, [p.strip() for p in rest.split(",") if p.strip()]


def nccl_select(spec: str, interfaces: list[str]) -> list[str]:
    """The interfaces NCCL would consider for ``spec``, in the given order."""
    exclude, exact, names = parse_nccl_ifname(spec)

    def hit(iface: str) -> bool:
        return any(iface == n if exact else iface.startswith(n) for n in names)

    return [i for i in interfaces if hit(i) != exclude]


def nccl_default_ifaces(interfaces: list[str]) -> list[str]:
    """NCCL's choice when NCCL_SOCKET_IFNAME is unset: IB first, then anything but
    docker/lo/virbr, then docker, then loopback."""
    for spec in ("ib", "^docker,lo,virbr", "docker", "lo"):
        picked = nccl_select(spec, interfaces)
        if picked:
            return picked
    return []


def _describe(ifaces: list[str], addrs: dict[str, list[str]]) -> str:
    return ", ".join(f"{i} ({addrs[i][0]})" for i in ifaces)


@check("net.nccl_ifname")
def check_nccl_ifname(ctx: Context) -> CheckResult:
    """NCCL_SOCKET_IFNAME that matches no usable interface makes NCCL fail at init
    ("no socket interface found"); unset, report which interface NCCL will pick.
    """
    addrs = _local_addresses()
    names = list(addrs)
    spec = ctx.env.get("NCCL_SOCKET_IFNAME")
    have = _describe(names, addrs) or "none"
    if spec:
        picked = nccl_select(spec, names)
        if not picked:
            return failed(f"NCCL_SOCKET_IFNAME={spec} matches no interface that is up with an "
                          f"address (up: {have})",
                          f"set NCCL_SOCKET_IFNAME to one of {', '.join(names) or '?'} "
                          "or unset it")
        return passed(f"NCCL_SOCKET_IFNAME={spec}: {_describe(picked, addrs)}")
    picked = nccl_default_ifaces(names)
    if not picked:
        return failed("no network interface is up with an address", "bring up an interface")
    detail = f"NCCL_SOCKET_IFNAME unset: NCCL would use {_describe(picked, addrs)}"
    if all(i == "lo" or i.startswith("lo") for i in picked):
        return warned(detail + ": single node only", "bring up a routable interface")
    return passed(detail)


@check("net.gloo_ifname")
def check_gloo_ifname(ctx: Context) -> CheckResult:
    """GLOO_SOCKET_IFNAME is a comma list of exact interface names; one that does not exist
    or has no address makes every Gloo process group (and the c10d store barrier) fail.
    """
    spec = ctx.env.get("GLOO_SOCKET_IFNAME")
    if not spec:
        return passed("GLOO_SOCKET_IFNAME unset: Gloo binds the address the hostname resolves to")
    addrs = _local_addresses()
    wanted = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in wanted if n not in addrs]
    if bad or not wanted:
        return failed(f"GLOO_SOCKET_IFNAME={spec}: {', '.join(bad) or spec!r} not up with an "
                      f"address (up: {', '.join(addrs) or 'none'})",
                      f"set GLOO_SOCKET_IFNAME to one of {', '.join(addrs) or '?'}, or unset it")
    return passed(f"GLOO_SOCKET_IFNAME={spec}: {_describe(wanted, addrs)}")


def _port_holder(port: int) -> str:
    """Who listens on ``port`` ("pid N (name)"), for the message; "another process" when
    that cannot be seen (another user's process, another network namespace)."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            listening = conn.status == psutil.CONN_LISTEN
            if conn.laddr and conn.laddr.port == port and listening and conn.pid:
                return f"pid {conn.pid} ({process_name(conn.pid)})"
    except Exception:
        pass
    return "another process"


@check("net.ports")
def check_ports(ctx: Context) -> CheckResult:
    """The ports this node will have to listen on must be free: the master port (static
    rendezvous) and, when this node hosts it, the c10d rendezvous store port.

    A port you chose explicitly being taken is a failure; a default one only a warning
    (the job may not use it).
    """
    opts = ctx.options
    ports: list[tuple[int, str, bool]] = []  # (port, role, explicit)
    if opts.rdzv_endpoint:
        host, port = parse_endpoint(opts.rdzv_endpoint)
        if is_local_address(host):
            ports.append((port, "rendezvous store (this node hosts it)", False))
    else:
        ports.append((DEFAULT_RDZV_PORT, "default rendezvous port", False))
    if opts.master_port is not None:
        ports.append((opts.master_port, "--master-port", True))
    elif not opts.rdzv_endpoint:
        ports.append((DEFAULT_MASTER_PORT, "default master port", False))
    if not ports:
        return skipped("rendezvous store is on another host: no port to listen on here")
    findings = Findings()
    for port, role, explicit in ports:
        err = port_bind_error(port)
        if err is None:
            findings.add("pass", "")
            continue
        if err.errno == errno.EADDRINUSE:
            what = f"port {port} ({role}) in use by {_port_holder(port)}"
            if role.startswith("rendezvous store"):
                findings.add("warn", what + ": fine only if that is this job's store",
                             "stop the process or pick another port")
            else:
                findings.add("fail" if explicit else "warn", what,
                             "stop the process holding it or pick another --master-port")
        else:
            findings.add("fail", f"port {port} ({role}) cannot be bound: {err.strerror}",
                         "pick a port above 1024 that is free")
    listed = ", ".join(f"{p} ({r})" for p, r, _ in ports)
    return findings.result(f"free: {listed}")


@check("rdzv.endpoint", "connecting to the rendezvous endpoint hung (DNS?)")
def check_rdzv(ctx: Context) -> CheckResult:
    """Every node must reach the c10d store at --rdzv-endpoint; find out now, not after a
    15-minute rendezvous timeout.
    """
    if not ctx.options.rdzv_endpoint:
        return skipped("no --rdzv-endpoint given")
    host, port = parse_endpoint(ctx.options.rdzv_endpoint)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return failed(f"{host} does not resolve: {exc}", "fix the host name or DNS")
    connect_timeout = min(2.0, max(0.2, ctx.remaining() - 0.3))
    last: OSError | None = None
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(connect_timeout)
        t = time.monotonic()
        try:
            sock.connect(addr)
            return passed(f"{host}:{port} reachable ({addr[0]}, "
                          f"{(time.monotonic() - t) * 1000:.1f} ms)")
        except OSError as exc:
            last = exc
        finally:
            sock.close()
    if isinstance(last, ConnectionRefusedError):
        if is_local_address(host):
            return passed(f"{host}:{port} is this node and nothing listens yet: the agent "
                          "will host the store here")
        return warned(f"{host}:{port}: host up but nothing listening (fine if the store's "
                      "node has not started yet)", "start the job on that node first, or "
                      "check the port")
    why = "timed out" if isinstance(last, TimeoutError) else (last.strerror if last else "?")
    return failed(f"{host}:{port} unreachable: {why}",
                  "check the endpoint, firewalls/security groups and routing between nodes")
