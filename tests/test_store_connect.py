"""Connects to a torch ``TCPStore`` (ftrun/control/tcpstore.py) when its host is gone or
frozen: a reconnect gives up on a store that refuses, and a connect stuck on one address
does not hold up a connect to another (a worker following its dead writer's store to the
new one). Real torch clients and servers on loopback; the dead and frozen hosts are plain
listening sockets, which is what the kernel shows of them."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from ftrun.control.errors import StoreError
from ftrun.control.sockbounds import connected_to, socket_fds
from ftrun.control.tcpstore import (
    connect_still_running,
    connect_store,
    reconnect_store,
    serve_store,
    tcpstore_class,
)


def _wait(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_reconnect_to_a_store_gone_after_its_plain_connect_gives_up_at_the_refusal() -> None:
    # the store's host accepts the plain connect, then its listener closes (its agent
    # killed): torch's client would try the refused connect again for its whole second
    tcpstore_class()  # torch imported, as in a worker (its first import takes a second)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def close_at_first_connect() -> None:
        conn, _ = listener.accept()
        conn.close()
        listener.close()

    closer = threading.Thread(target=close_at_first_connect, daemon=True)
    closer.start()
    started = time.monotonic()
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
        reconnect_store("127.0.0.1", port, 5.0, op_timeout_s=1.0)
    took = time.monotonic() - started
    closer.join(5.0)
    assert took < 0.8, f"the reconnect took {took:.2f} s (torch's connect: 1 s)"
    _wait(lambda: not connect_still_running(), 5.0, "the abandoned connect to end")


def test_a_connect_does_not_wait_for_one_stuck_on_a_frozen_host() -> None:
    # a frozen host: its kernel accepts the connection, nothing ever answers torch's hello
    frozen = socket.create_server(("127.0.0.1", 0))
    live = serve_store(0, 10.0)
    stuck_error: list[str] = []

    def connect_frozen() -> None:
        try:
            connect_store("127.0.0.1", frozen.getsockname()[1], 3.0, op_timeout_s=1.0)
        except StoreError as error:
            stuck_error.append(str(error))

    stuck = threading.Thread(target=connect_frozen, daemon=True)
    try:
        stuck.start()
        _wait(connect_still_running, 5.0, "the connect to the frozen host to start")
        before = socket_fds()
        started = time.monotonic()
        client = connect_store("127.0.0.1", live.port, 5.0, op_timeout_s=0.5)
        took = time.monotonic() - started
        assert took < 1.5, f"the connect to a live store took {took:.2f} s"
        assert connect_still_running(), "the frozen host's connect was expected to still wait"
        client.set("k", b"v")
        assert live.get("k") == b"v"
        # the request bound went on this client's socket (found by its peer's address)
        mine = connected_to(socket_fds() - before, "127.0.0.1", live.port)
        assert mine, "no socket of this process is connected to the live store"
        timeouts = set()
        for fd in mine:
            with socket.socket(fileno=fd) as sock:
                try:
                    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
                finally:
                    sock.detach()
            seconds, micros = struct.unpack("ll", raw)
            timeouts.add(seconds + micros / 1e6)
        assert timeouts == {0.5}, timeouts
    finally:
        frozen.close()  # the stuck hello fails, and its thread ends
        stuck.join(10.0)
    assert not stuck.is_alive()
    assert stuck_error and "127.0.0.1" in stuck_error[0], stuck_error
    _wait(lambda: not connect_still_running(), 5.0, "the frozen host's connect to end")


def test_only_sockets_connected_to_the_store_get_its_bounds() -> None:
    # another thread's sockets opened while a client connects (a gloo pair, a connect to
    # another store) must not be taken for the client's
    with socket.create_server(("127.0.0.1", 0)) as store, \
            socket.create_server(("127.0.0.1", 0)) as other:
        before = socket_fds()
        to_store = socket.create_connection(store.getsockname())
        to_other = socket.create_connection(other.getsockname())
        unconnected = socket.socket()
        with to_store, to_other, unconnected:
            found = connected_to(socket_fds() - before, "127.0.0.1", store.getsockname()[1])
            assert found == {to_store.fileno()}
            assert connected_to({to_store.fileno()}, "no-such-host.invalid", 1) == set()
