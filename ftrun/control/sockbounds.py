"""Bounds on the sockets a torch ``TCPStore`` client opens (:func:`ftrun.control.tcpstore.
connect_store`): torch gives a client's requests no timeout of their own, so a store host
that stops answering (frozen, cut off) would block a request forever. The sockets the
client opened are found by comparing this process's socket descriptors before and after
its construction (made under one lock, so no other client opens one meanwhile)."""

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
