"""This host's addresses and ports: does a host name point at this machine, and is a port
free for a server to bind here.

Two parts of ftrun ask these questions and must get the same answers. The agent decides
from them whether it hosts the job's c10d store (``ftrun.agent.loop``) and, through
``ftrun.config.check_port_free``, refuses a taken store port before it starts anything.
``ftrun doctor`` predicts both ahead of the job (its ``net.ports`` and ``rdzv.endpoint``
checks); a prediction made by a second implementation would drift from what the agent
really does, so both use this one.
"""

from __future__ import annotations

import socket

__all__ = ["is_local_address", "port_bind_error"]


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine: one of the addresses it resolves
    to can be bound here. A name that does not resolve is not local.

    With c10d rendezvous the agent on such a node hosts the store, unless another agent
    here already does.
    """
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


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
