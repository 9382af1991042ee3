"""This host's addresses and ports: does a host name point at this machine, and is a port
free for a server to bind here.

Two parts of ftrun ask these questions and must get the same answers. The agent decides
from them whether it hosts the job's c10d store (``ftrun.agent.loop``) and, through
``ftrun.config.check_port_free``, refuses a taken store port before it starts anything.
``ftrun doctor`` predicts both ahead of the job (its ``net.ports`` and ``rdzv.endpoint``
checks); a prediction made by a second implementation would drift from what the agent
really does, so both use this one. :func:`store_bind_address` says which address the
agent's stores listen on (loopback for a single node: no other host may reach them).
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["is_local_address", "local_bind_address", "port_bind_error", "resolves",
           "store_bind_address"]


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine: one of the addresses it resolves
    to can be bound here. A name that does not resolve is not local.

    With c10d rendezvous the agent on such a node hosts the store, unless another agent
    here already does.
    """
    return local_bind_address(host) is not None


def resolves(host: str) -> bool:
    """Whether ``host`` resolves to any address (a pod's name resolves only once the pod
    has one)."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def port_bind_error(port: int) -> OSError | None:
    """Why a server could not bind ``port`` on all IPv4 addresses, or None when it can.

    The probe binds as the store does, with SO_REUSEADDR: the connections of a job that
    just ended linger in TIME_WAIT on the port for a minute, and the store binds over them,
    so they do not count as in use. A socket listening on the port does (EADDRINUSE); a
    port below 1024 without the privilege fails too (EACCES).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            return error
    return None


LOOPBACK = "127.0.0.1"


def local_bind_address(host: str, family: int = socket.AF_UNSPEC) -> str | None:
    """The first address ``host`` resolves to (of ``family``, any by default) that can be
    bound on this machine, or None (not an address of this machine, or a name that does
    not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, family, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return None
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return str(address[0])
    return None


def _names_loopback(host: str) -> bool:
    """Whether ``host`` means loopback everywhere (a loopback literal or ``localhost``), as
    opposed to a host name that only this machine maps to loopback (Debian's
    ``127.0.1.1 hostname`` line), which other nodes resolve to a real address."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def store_bind_address(*, single_node: bool, rdzv_host: str, local_addr: str | None
                       ) -> str | None:
    """The address this agent's stores (control and worker stores) listen on; None means
    every interface, returned only when no single address fits (the caller warns).

    * A single-node job: loopback. Its workers and its agent are the only clients.
    * A multi-node job: the address ``rdzv_host`` (``--master-addr``, the host of
      ``--rdzv-endpoint``) resolves to here, which is what the other nodes connect to; when
      that name resolves here to loopback but means a real host to the others (a host name
      on a ``127.0.1.1`` line), the address ``--local-addr`` resolves to.
    """
    if single_node:
        return LOOPBACK
    for name in (rdzv_host, local_addr):
        if not name:
            continue
        address = local_bind_address(name)
        if address is None:
            continue
        if not ipaddress.ip_address(address.split("%")[0]).is_loopback or _names_loopback(name):
            return address
    return None
