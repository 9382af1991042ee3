"""Shutting down this process's TCP connections: how a worker fails a collective at once.

A collective blocked on a peer that died without a reset (a lost link), or on a peer that is
alive but left the member epoch, waits for its timeout (gloo: the group's, 30 minutes for a
device mesh's subgroups by default). Shutting the connection down makes the blocked read
return at once, and gloo fails the operation. Each socket is reached through a duplicate of
its descriptor: ``shutdown`` acts on the connection itself (its owner's blocked reads see
end-of-file), while closing the duplicate leaves the owner's descriptor as it was.

Only sockets are duplicated (``fstat`` first): a duplicate of any other descriptor would be
left open by the failed ``socket()`` call, and the next look would duplicate the duplicates
(a process that regrouped a dozen times ran out of descriptors).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Callable, Iterator

#: A connection's (own address, peer address) -> whether to shut it down.
Match = Callable[[tuple, tuple], bool]
#: A TCP connection: (own address, peer address), as ``getsockname``/``getpeername``.
Connection = tuple[tuple, tuple]


def _tcp_sockets() -> Iterator[socket.socket]:
    """Each TCP socket of this process, as a duplicate of its descriptor (closed once the
    caller moves on). Descriptors that close meanwhile are passed over."""
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            copy = os.dup(fd)
            try:
                sock = socket.socket(fileno=copy)
            except OSError:
                os.close(copy)
                raise
            with sock:
                if sock.type == socket.SOCK_STREAM and sock.family in (
                        socket.AF_INET, socket.AF_INET6):
                    yield sock


def connections() -> set[Connection]:
    """The (own address, peer address) of each connected TCP socket of this process now."""
    found: set[Connection] = set()
    for sock in _tcp_sockets():
        with contextlib.suppress(OSError):
            found.add((sock.getsockname(), sock.getpeername()))
    return found


@contextlib.contextmanager
def opened() -> Iterator[set[Connection]]:
    """The TCP connections this process opened inside the block: the set it yields is
    filled in as the block ends (also when it raises)."""
    before = connections()
    made: set[Connection] = set()
    try:
        yield made
    finally:
        made |= connections() - before


def shutdown_connections(match: Match) -> int:
    """Shut down every TCP connection of this process that ``match`` selects; returns how
    many. Descriptors that close meanwhile, or are not connected, are passed over."""
    count = 0
    for sock in _tcp_sockets():
        with contextlib.suppress(OSError):
            if match(sock.getsockname(), sock.getpeername()):
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
    return count


def shutdown_peer_connections(keep_port: int, also: frozenset[Connection] = frozenset()
                              ) -> int:
    """Shut down every TCP connection but those to port ``keep_port`` (the control
    store's), and the store connections in ``also`` (a member epoch's own, which its
    process groups wait on): a collective, or a group's build, blocked on a peer fails at
    once. Returns how many."""
    return shutdown_connections(
        lambda own, peer: peer[1] != keep_port or (own, peer) in also)


def shutdown_connections_to(host: str, port: int | None = None) -> int:
    """Shut down this process's TCP connections to ``host`` (to its ``port`` only, when
    given); returns how many."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return 0
    addresses |= {f"::ffff:{a}" for a in addresses if ":" not in a}  # v4-mapped peers
    return shutdown_connections(
        lambda own, peer: peer[0] in addresses and (port is None or peer[1] == port))
