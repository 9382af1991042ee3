"""Bounds on the sockets a torch ``TCPStore`` client opens (:func:`ftrun.control.tcpstore.
connect_store`): torch gives a client's requests no timeout of their own, so a store host
that stops answering (frozen, cut off) would block a request forever. The sockets the
client opened are found by comparing this process's socket descriptors before and after
its construction, kept only if connected to the store's address: another thread may open
sockets meanwhile (a gloo pair, a connect to another store), and a bound put on one of
those would break it. Connects to one address are made one at a time by the caller."""

from __future__ import annotations

import contextlib
import os
import socket
import struct


def socket_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            continue
    return fds


def connected_to(fds: set[int], host: str, port: int) -> set[int]:
    """Those of ``fds`` that are TCP sockets whose peer is ``host:port`` (any address it
    resolves to); none if it does not resolve."""
    try:
        peers = {(info[4][0], port) for info in socket.getaddrinfo(host, port,
                                                                   type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return set()
    found = set()
    for fd in fds:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock, contextlib.suppress(OSError):
            if sock.type == socket.SOCK_STREAM and _unmapped(sock.getpeername()) in peers:
                found.add(fd)
    return found


def _unmapped(peer: tuple[str, int] | tuple[str, int, int, int]) -> tuple[str, int]:
    """(address, port), an IPv4 address as itself: torch's client connects an IPv6 socket
    to an IPv4 store, whose peer then reads ``::ffff:a.b.c.d``."""
    address, port = peer[0], peer[1]
    if address.startswith("::ffff:") and "." in address:
        address = address[len("::ffff:"):]
    return address, port


def bound_requests(fds: set[int], timeout_s: float) -> None:
    """Receive/send timeouts and TCP_USER_TIMEOUT on the sockets a client just opened."""
    seconds = int(timeout_s)
    timeval = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    for fd in fds:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM:
                continue
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                                int(timeout_s * 1000))
