"""Simulated agents for the control plane's scale benchmarks: thousands per process, each
speaking the real protocols over connections of its own, driven by one event loop.

Why: the benchmark's light agents (scripts/bench_multinode.py) run ftrun's own
HeartbeatSender and EndWatcher threads on torch's C++ store client. That is the real code,
but two threads per simulated agent on a 2-core machine measure the threads: at 10,000
agents 19,000 threads never all started beating (load average 2,114). Here one thread per
process drives every simulated agent with non-blocking sockets (``selectors``, epoll), so
the agents' own cost is a few system calls per request, and the figure is the leader's.

What each simulated agent does, as a non-leader ftrun agent does it (ftrun/agent/loop.py):

* **heartbeat connection** (:class:`ftrun.control.heartbeat.HeartbeatSender`): every
  ``interval`` a ``set`` of ``hb/<node id>`` with a signed ``{"seq": n}``
  (:class:`ftrun.control.auth.Signer`, so the leader's real HeartbeatMonitor verifies it)
  and a ``check`` of that key, whose reply proves the set arrived; one request in flight,
  as on a blocking client; a reply missing for the request timeout is a failure, and the
  connection is replaced (as :func:`ftrun.control.tcpstore.connect_store`'s bound makes it).
* **end-watch connection** (:class:`ftrun.control.endwatch.EndWatcher`): a server-side
  ``wait`` on ``gen/<N>/end`` held for the wait slice, then cancelled in-protocol and held
  again; once it fires, the agent reads the end record as its loop does (``check``, then
  torch's ``get``: a ``wait`` and a ``get``) and verifies its signature: the end is *seen*
  when the verified record is in hand. (A real agent reads it on its main connection; here
  on the watch connection, idle by then, to save the store host a descriptor per agent.)
* **presence connection** (:mod:`ftrun.control.presence`): the authenticated hello (the
  server's nonce, a signed ``{"node_id", "nonce", "ping_s"}``), then an empty line every
  ``ping_s``, and a signed goodbye when the run ends.
* **etcd-v3** (mode ``etcd``, :class:`ftrun.control.election.LeaseBeat`): at its first beat,
  over an HTTP/1.1 connection to etcd's v3 JSON gateway made for them and closed once they
  are answered (LeaseBeat drops its idle gateway connection), a lease of the heartbeat
  timeout (``/v3/lease/grant``) and the signed liveness record naming it put bound to it
  (``/v3/kv/put``); then a renewal at the first beat (every ``interval``) a third of the
  lease's TTL after the last answered one (LeaseBeat's), as a message on etcd's gRPC
  ``LeaseKeepAlive`` stream, held on an HTTP/2 connection of its own (:class:`GrpcConn`,
  as ``ftrun.control.etcdkeepalive.KeepAliveStream`` holds it; one in flight, and one more
  on the same stream once it went unanswered for the request timeout; a stream etcd
  ended is a new connection and stream; a lease found expired is granted and put again);
  plus the presence connection, and (unless
  ``end_watch`` is off, for agents below ``end_watch_below``) the EndWatcher's client as
  ``EtcdClient.wait_any`` holds it: one watch stream (``/v3/watch``) of ``gen/<N>/end``
  from the store's revision when etcd makes it, on a connection of its own, and once etcd
  confirmed it one read of the key (on a connection made for that read), the stream held
  across the watcher's slices with no request until the gateway ends it at ``HOLD_S``
  (then a stream and a read again); an event ends the wait and the appended end record is
  read and verified.
* **rendezvous** (``join`` command, :class:`ftrun.control.rendezvous.DynamicRendezvous`):
  the signed slot appended to ``gen/<N>/slots`` (one ``append``), then torch's ``get`` of
  the node's own assignment ``gen/<N>/as/<node id>`` (a ``wait`` in slices of
  ``WAIT_SLICE_S``, then the ``get``), verified (signature, ``Assignment.from_json``,
  generation and node id). With ``etcd_port`` (the etcd-v3 backend), as
  ``ftrun.control.etcd.EtcdClient`` does it: the held wait of ``EtcdClient.wait_any``
  (ftrun/control/etcdheld.py) armed first (``JsonStore.arm_wait``): one watch stream of
  the assignment, ``gen/<N>`` and the shutdown record from the store's revision when etcd
  makes it (``etcdwire.AnyStream``), on a connection made for it, and once etcd confirmed
  it one transaction reading the three ranges on the agent's main HTTP connection; then
  the slot as a part key of its own (one put, on the main connection). The stream is held
  with no request per slice until an event (the value from it when whole, else a read on
  the main connection; the stream ends with its connection, a new one for the next) or
  the gateway's end at ``HOLD_S`` (a stream and a read again); plus the lease beat on a
  third connection unless ``heartbeats`` is off. Not modelled: the real wait's read from a member no
  client of its process has heard from for ``UNHEARD_S`` (5 s; a failover aid). With
  beats, the beat hears the one member and no such read happens; without them a real
  agent waiting longer than 5 s would add one read per 5 s.

The wire protocol is torch 2.13's TCPStore protocol, read from torch's client for the
design and checked here by capturing what torch's own client sends (tests/
test_rendezvous_scale.py runs this generator against the real store): a connection opens
with VALIDATE and its magic number, then PING with a nonce that the server echoes; every
request is a one-byte query type, strings and values as a little-endian uint64 length and
the bytes; keys carry torch's ``/`` prefix; ``set`` and ``append`` have no reply, ``check``
and ``wait`` answer one byte, ``get`` a length and the bytes. Nothing here is torch's code.

Run by the harness, one process per share of the agents: ``python scripts/loadgen.py
[--tag LABEL]``; the first line on stdin is the JSON configuration (it holds the job token,
so it is not on the command line), later lines are commands (``window``, ``freeze``,
``kill``, ``join``, ``finish``); stdout carries one JSON object per line (``connected``,
``ready``, ``report``, ``error``). End of stdin ends the process at once. Timeouts: every
request has the agents' request timeout (``op_timeout``); connects are retried until
``setup_timeout``; ``finish`` waits for the end until its ``end_by``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import heapq
import json
import os
import random
import resource
import selectors
import socket
import struct
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftrun.control.assignments import Assignment, NodeSlot
from ftrun.control.auth import Signer
from ftrun.control.etcdheld import CONFIRM_S, HOLD_S
from ftrun.control.etcdkeepalive import LEASE_KEEPALIVE, decode_keepalive, encode_keepalive
from ftrun.control.etcdwire import (
    PART,
    AnyStream,
    b64,
    deadline_error,
    span,
)
from ftrun.control.etcdwire import joined as joined_value
from ftrun.control.presence import presence_key

# torch 2.13's TCPStore query types and answers (see the module docstring)
VALIDATE, SET, GET, CHECK, WAIT, APPEND, CANCEL_WAIT, PING = 0, 1, 3, 5, 6, 9, 12, 13
MAGIC = 0x3C85F7CE
READY, STOP_WAITING, WAIT_CANCELED = 0, 0, 1
#: a wait slice of the rendezvous (ftrun.control.rendezvous.Rendezvous.WAIT_SLICE_S)
WAIT_SLICE_S = 2.0
#: connects in flight per process (the listeners' backlogs are bounded)
CONNECTS_IN_FLIGHT = 256
_LEN = struct.Struct("<Q")


def _string(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


def msg_set(key: bytes, value: bytes) -> bytes:
    return bytes([SET]) + _string(key) + _string(value)


def msg_append(key: bytes, value: bytes) -> bytes:
    return bytes([APPEND]) + _string(key) + _string(value)


def msg_keys(query: int, keys: list[bytes]) -> bytes:
    """``check`` or ``wait`` of ``keys``."""
    return bytes([query]) + _LEN.pack(len(keys)) + b"".join(_string(k) for k in keys)


def msg_get(key: bytes) -> bytes:
    return bytes([GET]) + _string(key)


def msg_hello(nonce: int) -> bytes:
    """What torch's client sends on a new connection: VALIDATE, then a PING it checks."""
    return bytes([VALIDATE]) + struct.pack("<I", MAGIC) + bytes([PING]) + \
        struct.pack("<I", nonce)


# --- the event loop -------------------------------------------------------------------------


class Loop:
    """Timers (a heap) and readiness (epoll) on one thread."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._count = 0
        self.now = time.time()

    def at(self, due: float, fn: Callable[..., None], *args: Any) -> None:
        self._count += 1
        heapq.heappush(self._heap, (due, self._count, fn, args))

    def every(self, period: float, buckets: int, fn: Callable[[int], None]) -> None:
        """``fn(bucket)`` for each of ``buckets`` phases, every ``period``, spread evenly."""
        start = time.time()

        def tick(bucket: int, due: float) -> None:
            fn(bucket)
            # behind (an overloaded machine): the missed ticks are skipped, as a blocked
            # client's beats are, and the phase is kept; never a tick again at once, which
            # would send every bucket on every pass and feed the overload
            later = due + period
            if later <= self.now:
                later += period * (int((self.now - later) / period) + 1)
            self.at(later, tick, bucket, later)

        for b in range(buckets):
            due = start + period * b / buckets
            self.at(due, tick, b, due)

    def run_once(self, max_wait: float = 0.05) -> None:
        self.now = now = time.time()
        heap = self._heap
        due = len(heap)  # only what was due at the start: sockets are read every pass
        while due and heap and heap[0][0] <= now:
            due -= 1
            _, _, fn, args = heapq.heappop(heap)
            fn(*args)
        wait = min(max_wait, heap[0][0] - time.time()) if heap else max_wait
        registered = self.sel.get_map()
        for key, mask in self.sel.select(max(0.0, wait)):
            if registered.get(key.fd) is not key:
                continue  # closed by an earlier callback of this pass (its fd maybe reused)
            self.now = time.time()
            key.data(mask)


# --- connections ------------------------------------------------------------------------------


class _Conn:
    """What both connection kinds share: a non-blocking connect to ``port`` through the
    generator's bounded connect queue, and a close that leaves the selector."""

    sock: socket.socket | None
    closed: bool
    live: bool

    def __init__(self, gen: Generator, port: int) -> None:
        self.gen, self.port = gen, port
        self.sock, self.closed, self.live = None, False, False

    def open(self) -> None:
        self.gen.connect_later(self)

    def start_connect(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex((self.gen.host, self.port))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self.gen.connect_done(self, f"connect: {os.strerror(code)}")
            return
        self.sock = sock
        self.connecting(sock)

    def connecting(self, sock: socket.socket) -> None:
        raise NotImplementedError

    def _connected(self) -> bool:
        """A non-blocking connect to etcd finished: whether it succeeded (then the socket
        is watched for reading); a failure is given to the connect queue to try again."""
        assert self.sock is not None
        if self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.close()
            self.gen.connect_done(self, "etcd connect failed")
            return False
        self.gen.loop.sel.modify(self.sock, selectors.EVENT_READ, self._on_read)
        return True

    def reset(self) -> None:
        raise NotImplementedError

    out: bytearray | None = None  # what the socket did not take yet

    def send(self, data: bytes) -> None:
        """Send ``data`` without blocking: what the socket does not take now is kept and
        sent when it is writable again (a blocking send to one slow peer would stall every
        agent of the process)."""
        if self.sock is None:  # closed: its agent's replacement sends instead
            return
        if self.out:
            self.out += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as error:
            self.send_failed(f"send: {error.strerror or error}")
            return
        if sent < len(data):
            self.out = bytearray(data[sent:])
            self.gen.loop.sel.modify(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                                     self._on_io)

    def _on_io(self, mask: int) -> None:
        """Readiness while output is pending: send more; read what came."""
        if mask & selectors.EVENT_WRITE and self.sock is not None and self.out:
            try:
                sent = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as error:
                self.send_failed(f"send: {error.strerror or error}")
                return
            del self.out[:sent]
            if not self.out:
                self.gen.loop.sel.modify(self.sock, selectors.EVENT_READ, self._on_read)
        if mask & selectors.EVENT_READ and self.sock is not None:
            self._on_read(mask)

    def _on_read(self, mask: int) -> None:
        raise NotImplementedError

    def send_failed(self, why: str) -> None:
        self.gen.count_error(why)
        self.close()

    def receive(self, size: int) -> bytes | None:
        """What arrived (b"": the peer closed or reset; None: nothing yet, or this end was
        closed by a callback earlier in the same pass: at 10,000 agents on etcd 3.5.1 a
        generator process failed on an assertion here)."""
        if self.sock is None:
            return None
        try:
            return self.sock.recv(size)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""

    def close(self) -> None:
        self.closed, self.live, self.out = True, False, None
        if self.sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.gen.loop.sel.unregister(self.sock)
            self.sock.close()
            self.sock = None


# --- one TCPStore connection ----------------------------------------------------------------


class StoreConn(_Conn):
    """A non-blocking connection speaking torch's store protocol; replies are parsed in
    order: ``1`` one byte, ``4`` the ping's nonce, ``0`` a length and that many bytes."""

    def __init__(self, gen: Generator, agent: Agent, kind: str) -> None:
        super().__init__(gen, gen.store_port)
        self.agent, self.kind = agent, kind
        self.buf = bytearray()
        self.want: deque[tuple[int, Callable[[StoreConn, Any], None]]] = deque()
        self.sent_at = 0.0

    def connecting(self, sock: socket.socket) -> None:
        self.gen.loop.sel.register(sock, selectors.EVENT_WRITE, self._on_connect)
        self.gen.loop.at(time.time() + self.gen.op_timeout * 5, self._connect_due, sock)

    def _connect_due(self, sock: socket.socket) -> None:
        if self.sock is sock and not self.live:
            self.fail("connect timed out")

    def _on_connect(self, mask: int) -> None:
        assert self.sock is not None
        code = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self.fail(f"connect: {os.strerror(code)}")
            return
        nonce = (os.getpid() + id(self)) & 0x7FFFFFFF
        self.gen.loop.sel.modify(self.sock, selectors.EVENT_READ, self._on_read)
        self.want.append((4, lambda conn, got, n=nonce: self._validated(got == n)))
        self._send(msg_hello(nonce))

    def _validated(self, ok: bool) -> None:
        if not ok:
            self.fail("the store did not echo the ping")
            return
        self.live = True
        self.gen.connect_done(self, "")
        self.agent.conn_live(self)

    def request(self, data: bytes, *replies: tuple[int, Callable[[StoreConn, Any], None]]
                ) -> None:
        self.sent_at = self.gen.loop.now
        self.want.extend(replies)
        self._send(data)

    def _send(self, data: bytes) -> None:
        self.send(data)

    def send_failed(self, why: str) -> None:
        self.fail(why)

    def _on_read(self, mask: int) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self.fail(f"recv: {error.strerror or error}")
            return
        if not data:
            self.fail("the store closed the connection")
            return
        buf = self.buf
        buf += data
        want = self.want
        while want:
            size, callback = want[0]
            if size == 1:
                if not buf:
                    break
                value: Any = buf[0]
                del buf[:1]
            elif size == 4:
                if len(buf) < 4:
                    break
                value = struct.unpack_from("<I", buf)[0]
                del buf[:4]
            else:
                if len(buf) < 8:
                    break
                length = _LEN.unpack_from(buf)[0]
                if len(buf) < 8 + length:
                    break
                value = bytes(buf[8:8 + length])
                del buf[:8 + length]
            want.popleft()
            callback(self, value)
            if self.closed:
                return
        if buf and not want:
            self.fail(f"{len(buf)} unexpected bytes from the store")

    def fail(self, why: str) -> None:
        """Close this connection; a live one is replaced (a failed client is never
        reused), a connect that failed is made again."""
        if self.closed:
            return
        was_live = self.live
        self.close()
        self.gen.count_error(f"{self.kind}.{why}")
        if was_live:
            self.agent.conn_failed(self)
        else:
            self.gen.connect_done(self, why)

    def reset(self) -> None:
        self.buf.clear()
        self.want.clear()
        self.sock, self.closed, self.live = None, False, False


# --- one presence connection ----------------------------------------------------------------


class PresenceConn(_Conn):
    """The presence client's protocol (ftrun/control/presence.py), non-blocking."""

    def __init__(self, gen: Generator, agent: Agent) -> None:
        super().__init__(gen, gen.presence_port)
        self.agent = agent
        self.buf = b""
        self.nonce = ""

    def connecting(self, sock: socket.socket) -> None:
        self.gen.loop.sel.register(sock, selectors.EVENT_READ, self._on_read)

    def _on_read(self, mask: int) -> None:
        data = self.receive(4096)
        if data is None:
            return
        if not data:
            self.gen.count_error("presence.closed by the server")
            if not self.live:
                self.gen.connect_done(self, "presence closed")
            self.close()
            return
        self.buf += data
        while b"\n" in self.buf:
            line, _, self.buf = self.buf.partition(b"\n")
            try:
                answer = json.loads(line)
                if not isinstance(answer, dict):
                    raise ValueError("not an object")
            except ValueError:
                self.gen.count_error("presence.not JSON from the server")
                continue
            if not self.nonce:
                self.nonce = str(answer["nonce"])
                body = {"node_id": self.agent.node_id, "nonce": self.nonce,
                        "ping_s": self.gen.ping_s}
                self.send(self.gen.signer.line(self.gen.presence_key, body).encode() + b"\n")
            elif answer.get("ok") is True and not self.live:
                self.live = True
                self.gen.connect_done(self, "")
            else:
                self.gen.count_error(f"presence.refused: {str(answer)[:100]}")

    def reset(self) -> None:
        self.buf, self.nonce, self.sock, self.closed, self.live = b"", "", None, False, False

    def ping(self) -> None:
        if self.live and self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.send(b"\n", socket.MSG_DONTWAIT)

    def goodbye(self) -> None:
        if self.live and self.sock is not None:
            body = {"bye": self.agent.node_id, "nonce": self.nonce}
            with contextlib.suppress(OSError):
                self.sock.send(self.gen.signer.line(self.gen.presence_key, body).encode()
                               + b"\n", socket.MSG_DONTWAIT)
        self.close()


# --- one HTTP/1.1 connection to etcd's v3 JSON gateway -----------------------------------------


class HttpConn(_Conn):
    """A keep-alive HTTP/1.1 connection to etcd's v3 gateway, one request in flight; the
    answer's body (``Content-Length`` or chunked, as the gateway sends a stream's single
    message) is parsed as JSON for the callback. :meth:`stream` opens a watch instead: its
    chunked answer never ends by itself, and each JSON message is given to the callback as
    it comes (the connection then serves nothing else: closing it ends the watch, as the
    real client's does). ``on_live``: called once the connection is made (default: the
    agent's lease grant); ``on_failed(why)``: a request that was not answered with 200 or a
    connection the gateway closed (default: counted only)."""

    def __init__(self, gen: Generator, agent: Agent,
                 on_live: Callable[[], None] | None = None,
                 on_failed: Callable[[str], None] | None = None) -> None:
        super().__init__(gen, gen.etcd_port)
        self.agent = agent
        self.on_live = on_live or agent.http_live
        self.on_failed = on_failed
        self.buf = b""
        self.callback: Callable[[dict[str, Any]], None] | None = None
        self.streaming = False
        self.stream_head = False  # the stream's HTTP head was read
        self.on_deadline: Callable[[], None] = lambda: None
        self.deadline_seen = False  # the stream's deadline message came
        self.deadline_answer = False  # the stream was answered 504 (its deadline)
        self.deadline_at = 0.0
        self.last_message = b""
        self.lines = b""
        self.sent_at = 0.0

    def connecting(self, sock: socket.socket) -> None:
        self.gen.loop.sel.register(sock, selectors.EVENT_WRITE, self._on_connect)

    def _on_connect(self, mask: int) -> None:
        if self._connected():
            self.live = True
            self.gen.connect_done(self, "")
        self.on_live()

    def reset(self) -> None:
        self.buf, self.callback, self.sock, self.closed, self.live = b"", None, None, \
            False, False
        self.streaming, self.stream_head, self.lines = False, False, b""
        self.deadline_answer = False

    def post(self, path: str, body: dict[str, Any] | list[dict[str, Any]],
             callback: Callable[[dict[str, Any]], None], deadline_s: float = 0.0) -> None:
        """``body``: one JSON object, or several in a row (a watch stream's requests)."""
        data = "".join(json.dumps(b) for b in (body if isinstance(body, list) else [body])
                       ).encode()
        self.callback, self.sent_at = callback, self.gen.loop.now
        timeout = f"Grpc-Timeout: {max(1, int(deadline_s * 1000))}m\r\n" if deadline_s else ""
        head = (f"POST /v3{path} HTTP/1.1\r\nHost: {self.gen.host}\r\n{timeout}"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        self.send(head.encode() + data)

    def stream(self, path: str, body: dict[str, Any] | list[dict[str, Any]],
               on_message: Callable[[dict[str, Any]], None], deadline_s: float,
               on_deadline: Callable[[], None]) -> None:
        """A streamed request (``/watch``): ``on_message(result)`` for each message; the
        gateway ends it at ``deadline_s`` (``Grpc-Timeout``, as ``EtcdClient`` asks), and
        then ``on_deadline()`` runs with the connection ready for the next request."""
        self.post(path, body, on_message, deadline_s)
        self.streaming, self.stream_head, self.lines = True, False, b""
        self.on_deadline, self.deadline_seen = on_deadline, False
        self.deadline_at = self.sent_at + deadline_s

    def send_failed(self, why: str) -> None:
        self.close()
        self.failed(why)

    def failed(self, why: str) -> None:
        self.gen.count_error(f"etcd.{why}")
        if self.on_failed is not None:
            self.on_failed(why)

    def _on_read(self, mask: int) -> None:
        data = self.receive(65536)
        if data is None:
            return
        if not data:
            self.close()
            self.failed("closed the connection")
            return
        self.buf += data
        if self.streaming:
            self._stream_read()
            return
        self._answer()

    def _answer(self) -> None:
        """A whole answer in ``buf`` so far: its JSON to the callback."""
        head, sep, rest = self.buf.partition(b"\r\n\r\n")
        if not sep:
            return
        headers = head.decode("latin-1").lower()
        if "transfer-encoding: chunked" in headers:
            if not rest.endswith(b"0\r\n\r\n"):
                return
            body, pos = b"", 0
            while True:
                line_end = rest.index(b"\r\n", pos)
                size = int(rest[pos:line_end], 16)
                if size == 0:
                    break
                body += rest[line_end + 2:line_end + 2 + size]
                pos = line_end + 2 + size + 2
        else:
            length = next((int(h.split(":")[1]) for h in headers.split("\r\n")
                           if h.startswith("content-length:")), 0)
            if len(rest) < length:
                return
            body = rest[:length]
        self.buf = b""
        callback, self.callback = self.callback, None
        status = head.split(b"\r\n", 1)[0].decode("latin-1")
        if self.deadline_answer:  # a watch's 504: its deadline came before the stream
            self.deadline_answer = False
            if deadline_error(json.loads(body or b"{}")):
                self.on_deadline()
                return
        if not status.startswith("HTTP/1.1 200"):
            self.failed(status[:60])
            return
        if callback is not None:
            answer = json.loads(body)
            callback(answer.get("result", answer) if isinstance(answer, dict) else {})

    def _stream_read(self) -> None:
        """The chunks of a streamed answer so far: each newline-ended JSON message in them
        to the callback (a message may span chunks)."""
        if not self.stream_head:
            head, sep, rest = self.buf.partition(b"\r\n\r\n")
            if not sep:
                return
            status = head.split(b"\r\n", 1)[0].decode("latin-1")
            if status.startswith("HTTP/1.1 504"):  # its deadline came before the stream began
                self.streaming, self.deadline_answer = False, True
                self._answer()  # an ordinary answer: its body says why
                return
            if not status.startswith("HTTP/1.1 200"):
                self.close()
                self.failed(f"watch: {status[:60]}")
                return
            self.stream_head, self.buf = True, rest
        buf, ended = self.buf, False
        while True:
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                break
            size = int(buf[:line_end], 16)
            if len(buf) < line_end + 2 + size + 2:
                break
            self.lines += buf[line_end + 2:line_end + 2 + size]
            buf = buf[line_end + 4 + size:]
            if size == 0:  # the gateway ended the stream
                ended = True
                break
        self.buf = buf
        if ended:  # the last message (the deadline's error) has no newline
            self.lines += b"\n"
        while b"\n" in self.lines and self.callback is not None and not self.closed:
            line, _, self.lines = self.lines.partition(b"\n")
            if line.strip():
                answer = json.loads(line)
                self.last_message = line[:80]
                if not isinstance(answer, dict):
                    continue
                if deadline_error(answer):  # the gateway ended it at the deadline
                    self.deadline_seen = True
                    continue
                self.callback(answer.get("result") or {})
        if ended and not self.closed:
            # a clean end at its deadline (the gateway at times ends it without its deadline
            # message; as the client, an end past the deadline is the wait's timeout)
            if self.deadline_seen or self.gen.loop.now >= self.deadline_at:
                self.streaming, self.callback, self.lines = False, None, b""
                self.on_deadline()
                return
            self.buf = b""
            self.close()
            self.failed(f"watch: the stream ended after {self.last_message!r}")


class GrpcConn(_Conn):
    """One HTTP/2 connection to etcd's client port holding one ``LeaseKeepAlive`` stream,
    as the agent's ``KeepAliveStream`` (ftrun/control/etcdkeepalive.py) holds a grpcio
    channel: each renewal is a gRPC message (a zero byte, a big-endian length, the
    request ``etcdkeepalive.encode_keepalive`` writes) in a DATA frame, each answer one
    back. The HTTP/2 framing, HPACK and flow control are the ``h2`` library's; one renewal
    in flight, or one more once it went unanswered for the request timeout (counted as a
    failed beat; the stream is kept, as the real one is, and any answer then counts). A
    stream etcd ends or resets, or a closed connection, is a failure: the agent makes a new
    connection, as the real stream is made again."""

    def __init__(self, gen: Generator, agent: Agent) -> None:
        super().__init__(gen, gen.etcd_port)
        self.agent = agent
        self.h2: Any = None
        self.stream_id = 0
        self.buf = b""
        self.waiting = False
        self.sent_at = 0.0

    def connecting(self, sock: socket.socket) -> None:
        self.gen.loop.sel.register(sock, selectors.EVENT_WRITE, self._on_connect)

    def _on_connect(self, mask: int) -> None:
        if not self._connected():
            return
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None))
        self.h2.initiate_connection()
        self.stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(self.stream_id, [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", LEASE_KEEPALIVE.encode()),
            (b":authority", f"{self.gen.host}:{self.port}".encode()),
            (b"content-type", b"application/grpc"), (b"te", b"trailers")])
        self.send(self.h2.data_to_send())
        self.live = True
        self.gen.connect_done(self, "")

    def reset(self) -> None:
        self.sock, self.closed, self.live, self.h2, self.buf = None, False, False, None, b""
        self.waiting = False

    def renew(self, lease: int) -> None:
        message = encode_keepalive(lease)
        self.h2.send_data(self.stream_id, b"\x00" + len(message).to_bytes(4, "big") + message)
        self.send(self.h2.data_to_send())
        self.waiting, self.sent_at = True, self.gen.loop.now

    def send_failed(self, why: str) -> None:
        self.failed(why)

    def failed(self, why: str) -> None:
        self.close()
        self.gen.count_error(f"etcd.keepalive stream: {why}")
        self.agent.grpc_failed(self)

    def _on_read(self, mask: int) -> None:
        data = self.receive(65536)
        if data is None:
            return
        if not data:
            self.failed("closed the connection")
            return
        try:
            events = self.h2.receive_data(data)
        except Exception as error:  # h2.exceptions.ProtocolError
            self.failed(f"HTTP/2: {error}")
            return
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length,
                                                  event.stream_id)
                self.buf += event.data
            elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset,
                                    h2.events.ConnectionTerminated,
                                    h2.events.TrailersReceived)):
                said = dict(getattr(event, "headers", None) or [])
                status = said.get(b"grpc-message", said.get(b"grpc-status", b"")).decode(
                    errors="replace")[:60]
                self.failed(f"etcd ended the stream ({type(event).__name__} {status})".strip())
                return
        pending = self.h2.data_to_send()
        if pending:
            self.send(pending)
        while len(self.buf) >= 5:
            size = int.from_bytes(self.buf[1:5], "big")
            if len(self.buf) < 5 + size:
                break
            message, self.buf = self.buf[5:5 + size], self.buf[5 + size:]
            self.waiting = False
            self.agent.renewed(decode_keepalive(message)[1])


# --- one simulated agent --------------------------------------------------------------------


class Agent:
    """One simulated agent's state; see the module docstring for what it sends."""

    def __init__(self, gen: Generator, index: int) -> None:
        self.gen, self.index = gen, index
        self.node_id = f"{gen.id_prefix}{index}"
        self.hb_name = f"hb/{self.node_id}"
        self.hb_wire = gen.wire(self.hb_name)
        self.hb: StoreConn | None = StoreConn(gen, self, "heartbeat") if gen.heartbeats \
            else None
        self.ew: StoreConn | None = StoreConn(gen, self, "endwatch") if (
            gen.end_watch and index < gen.end_watch_below) or gen.mode == "rdzv" else None
        self.pres: PresenceConn | None = PresenceConn(gen, self) if gen.presence_port \
            else None
        on_etcd = gen.mode == "etcd" or (gen.mode == "rdzv" and gen.etcd_port > 0)
        # the beat's grant and put (LeaseBeat's store client): a connection made for them,
        # closed once the key is put, as LeaseBeat drops its idle gateway connection
        self.http: HttpConn | None = HttpConn(gen, self, on_failed=self._attempt_failed) \
            if on_etcd and gen.heartbeats else None
        # the lease's renewals: LeaseBeat's KeepAliveStream
        self.grpc: GrpcConn | None = GrpcConn(gen, self) if self.http is not None else None
        # etcd-v3 rendezvous: the agent's main client (its offer and reads), and its held
        # wait's stream (HeldWatch: a connection made for each stream, not at set-up)
        self.jc: HttpConn | None = HttpConn(gen, self, self._join_conn_live,
                                            self._join_failed) \
            if on_etcd and gen.mode == "rdzv" else None
        self.wc: HttpConn | None = HttpConn(gen, self, self._watch_conn_live,
                                            self._watch_failed) if self.jc else None
        self.offer_due = False  # the held wait is armed first, then the offer is made
        self.read_sent = False  # the held wait's read, once etcd confirmed its watches
        # etcd-v3 store load: the EndWatcher's client (a read, then a watch per slice)
        self.ewc: HttpConn | None = HttpConn(gen, self, self._ew_live, self._ew_failed) \
            if gen.mode == "etcd" and gen.end_watch and index < gen.end_watch_below else None
        self.ewr: HttpConn | None = HttpConn(gen, self, self._ewr_live, self._ewr_failed) \
            if self.ewc is not None else None  # the end watch's reads
        self.ew_read_sent = self.ew_reading = self.ew_read_again = False
        self.next_step: Callable[[], None] | None = None  # once jc is (re)connected
        self.step: Callable[[], None] | None = None  # jc's request now (again if it fails)
        self.lease = 0
        self.placed = self.granting = False
        self.grant_failures = 0  # failed grants in a row (LeaseBeat's back-off)
        self.grant_after = 0.0
        self.lease_ttl = float(gen.ttl_s)  # as granted
        self.renewed_at = 0.0  # when the last answered renewal (or the grant) was asked
        if on_etcd:
            self.hb = self.ew = None
        self.seq = 0
        self.beats = 0  # beats acknowledged
        self.frozen = False
        self.wait_no = 0
        self.waiting = False  # an end wait (or an assignment wait) is held
        self.end_stream = AnyStream([])  # etcd-v3: the end watch's held wait
        self.any_stream = AnyStream([])  # the rendezvous's held wait
        self.cancelling = False
        self.fired = 0.0  # when the end wait came back with the key
        self.end_seen = 0.0  # when the verified end record was in hand
        self.offered = 0.0
        self.read_due = False
        self.joined: list[Any] | str | None = None

    def conns(self) -> list[_Conn]:
        """The connections held from the set-up on (not the beat's gateway connection,
        made for each grant and put)."""
        return [c for c in (self.hb, self.ew, self.pres, self.grpc, self.jc, self.ewc)
                if c is not None]

    def watches_end(self) -> bool:
        return (self.ew is not None or self.ewc is not None) and not self.frozen

    # etcd-v3: the beat is a lease kept alive (ftrun.control.election.LeaseBeat)
    def http_live(self) -> None:
        """The beat's gateway connection, made at a beat that needs a lease (the first
        beat, or one that found the lease expired; made at the set-up, a lease could expire
        before the harness starts every agent's beats, once the last of thousands
        connected), is up: grant the lease (or put the key, when only the put failed)."""
        if self.http is not None and self.http.live and self.granting and not self.frozen:
            if self.lease:
                self._put()
            else:
                self._grant()

    def _attempt(self) -> None:
        """Grant and put at this beat, on a gateway connection made for them (never while
        that connection waits to be made: it would be queued twice)."""
        assert self.http is not None and not self.granting
        self.granting, self.placed = True, False
        self.http.close()
        self.http.open()  # then http_live grants

    def _attempt_failed(self, why: str = "") -> None:
        """A grant or put failed (unanswered within the request timeout, or an error, both
        counted): the next beat tries again on a new connection, after a failed grant only
        once its back-off is over (LeaseBeat._grant: a random wait of up to 2, 4 ... s)."""
        assert self.http is not None
        self.http.close()
        self.granting = False
        if not self.lease:
            self.grant_failures += 1
            ceiling = min(float(self.gen.ttl_s), 2.0 ** self.grant_failures)
            self.grant_after = self.gen.loop.now + random.uniform(0.0, ceiling)

    def _grant(self) -> None:
        """Grant the lease, then put the signed liveness key bound to it."""
        assert self.http is not None
        self.http.post("/lease/grant", {"TTL": self.gen.ttl_s, "ID": 0}, self._granted)

    def _granted(self, answer: dict[str, Any]) -> None:
        assert self.http is not None
        self.lease = int(answer.get("ID", 0))
        self.lease_ttl = float(answer.get("TTL", self.gen.ttl_s))
        self.renewed_at, self.grant_failures = self.http.sent_at, 0
        self._put()

    def _put(self) -> None:
        gen = self.gen
        key = gen.prefix + self.hb_name
        line = gen.signer.line(key, {"lease": self.lease, "ttl": int(self.lease_ttl)})
        assert self.http is not None
        self.http.post("/kv/put", {"key": b64(gen.etcd_root + key.encode()),
                                   "value": b64(line.encode()), "lease": str(self.lease)},
                       self._placed)

    def _placed(self, answer: dict[str, Any]) -> None:
        self.placed, self.granting = True, False
        assert self.http is not None
        self.http.close()  # the renewals go on the stream

    def beat_etcd(self) -> None:
        conn, gen = self.grpc, self.gen
        if self.frozen or self.http is None:
            return
        if not self.placed:
            if self.granting:
                if self.http.live and gen.loop.now - self.http.sent_at > gen.op_timeout \
                        and self.http.callback is not None:  # the request's bound
                    gen.count_error("etcd.lease grant or put: no answer within the request "
                                    "timeout")
                    self._attempt_failed()
                return
            if gen.loop.now < self.grant_after:
                return  # LeaseBeat's BeatDeferred
            if self.lease and gen.loop.now - self.renewed_at >= self.lease_ttl:
                self.lease = 0  # the put failed for a TTL: the lease is gone, grant again
            self._attempt()
            return
        if conn is None or not conn.live:
            return
        if conn.waiting:  # the last renewal is unanswered
            if gen.loop.now - conn.sent_at <= gen.op_timeout:
                return
            # given up, as a failed beat; the stream is kept and the next renewal sent
            gen.count_error("etcd.keepalive stream: no answer within the request timeout")
        elif gen.loop.now - self.renewed_at < self.lease_ttl / 3:
            return  # renewed a third of its TTL ago (LeaseBeat's schedule)
        conn.renew(self.lease)

    def renewed(self, ttl: int) -> None:
        gen, conn = self.gen, self.grpc
        assert conn is not None
        self.beats += 1
        if gen.in_window(gen.loop.now):
            gen.count("etcd.keepalive", 1)
            gen.heartbeat_s.append(gen.loop.now - conn.sent_at)
        if ttl > 0:
            self.renewed_at = conn.sent_at
        elif self.placed:  # expired: grant and put again now, as LeaseBeat does (once: a
            gen.count_error("etcd.lease expired")  # second renewal may say it again)
            self.lease, self.placed = 0, False
            if not self.granting and gen.loop.now >= self.grant_after:
                self._attempt()

    def grpc_failed(self, conn: GrpcConn) -> None:
        if self.frozen or conn is not self.grpc:
            return
        self.gen.reconnects["keepalive"] = self.gen.reconnects.get("keepalive", 0) + 1
        self.grpc = GrpcConn(self.gen, self)
        self.grpc.open()

    # connections
    def conn_live(self, conn: StoreConn) -> None:
        if conn is self.ew and self.gen.mode == "load" and not self.fired:
            self.hold_end()
        elif conn is self.ew and self.gen.mode == "rdzv" and self.offered and \
                self.joined is None:
            self.wait_assignment()

    def conn_failed(self, conn: StoreConn) -> None:
        if self.frozen:
            return
        self.gen.reconnects[conn.kind] = self.gen.reconnects.get(conn.kind, 0) + 1
        fresh = StoreConn(self.gen, self, conn.kind)
        if conn is self.hb:
            self.hb = fresh
        else:
            self.ew = fresh
            self.waiting = self.cancelling = False
        fresh.open()

    # heartbeats
    def beat(self) -> None:
        if self.http is not None:
            self.beat_etcd()
            return
        conn, gen = self.hb, self.gen
        if conn is None or not conn.live or self.frozen:
            return
        if conn.want:  # the last beat is unanswered: a blocking client is still in it
            if gen.loop.now - conn.sent_at > gen.op_timeout:
                conn.fail("request timed out")
            return
        self.seq += 1
        value = gen.signer.line(gen.prefix + self.hb_name, {"seq": self.seq}).encode()
        conn.request(msg_set(self.hb_wire, value) + msg_keys(CHECK, [self.hb_wire]),
                     (1, self._beat_done))

    def _beat_done(self, conn: StoreConn, answer: int) -> None:
        gen = self.gen
        if answer != READY:  # the check did not find the key just set: not a beat
            gen.count_error(f"heartbeat.check answered {answer}")
            return
        self.beats += 1
        if gen.in_window(gen.loop.now):
            gen.count("heartbeat.set", 1)
            gen.count("heartbeat.check", 1)
            gen.heartbeat_s.append(gen.loop.now - conn.sent_at)

    # the end watch
    def hold_end(self) -> None:
        conn, gen = self.ew, self.gen
        if conn is None or not conn.live or self.frozen or self.fired:
            return
        self.wait_no += 1
        self.waiting, self.cancelling = True, False
        conn.request(msg_keys(WAIT, [gen.end_wire]), (1, self._end_answer))
        gen.loop.at(conn.sent_at + gen.slice_s, self._end_due, conn, self.wait_no)

    def _end_due(self, conn: StoreConn, number: int) -> None:
        if conn is not self.ew or number != self.wait_no or not self.waiting or \
                self.cancelling or conn.closed:
            return
        if self.frozen:
            return  # a stopped agent cancels nothing; its wait stays held
        self.cancelling = True
        conn._send(bytes([CANCEL_WAIT]))
        self.gen.loop.at(self.gen.loop.now + self.gen.op_timeout, self._cancel_due, conn,
                         number)

    def _cancel_due(self, conn: StoreConn, number: int) -> None:
        if conn is self.ew and number == self.wait_no and self.cancelling and not conn.closed:
            conn.fail("cancel unanswered")

    def _end_answer(self, conn: StoreConn, answer: int) -> None:
        gen, now = self.gen, self.gen.loop.now
        self.waiting = False
        if self.frozen:
            return  # a stopped agent reads nothing
        if answer == STOP_WAITING:
            if self.cancelling:  # the key came just before the cancel: its answer follows
                conn.want.append((1, lambda c, a: None))
            self.cancelling = False
            self.fired = now
            if gen.in_window(now):
                gen.count("endwatch.wait", 1)
            self.read_end(conn)
            return
        if self.cancelling:  # WAIT_CANCELED: the slice passed without the key
            self.cancelling = False
            if gen.in_window(now):
                gen.count("endwatch.wait.timeout", 2)
                gen.wait_overrun_s.append(now - conn.sent_at - gen.slice_s)
            self.hold_end()
            return
        conn.fail(f"unexpected wait answer {answer}")

    def read_end(self, conn: StoreConn) -> None:
        """As the agent's loop reads an end: ``check``, then torch's ``get``."""
        key = self.gen.end_wire
        conn.request(msg_keys(CHECK, [key]), (1, self._end_checked))

    def _end_checked(self, conn: StoreConn, answer: int) -> None:
        key = self.gen.end_wire
        conn.request(msg_keys(WAIT, [key]) + msg_get(key), (1, lambda c, a: None),
                     (0, self._end_read))

    def _end_read(self, conn: StoreConn | None, raw: bytes) -> bool:
        """The end is seen when the record's first valid line verifies; False if none."""
        gen = self.gen
        for line in raw.split(b"\n"):
            if line.strip():
                with contextlib.suppress(ValueError):
                    gen.signer.unwrap_line(gen.prefix + gen.end_name, line)
                    self.end_seen = gen.loop.now
                    return True
        gen.count_error("endwatch.end record not valid")
        return False

    # the end watch on etcd-v3 (EndWatcher over EtcdClient.wait_any: ftrun/control/endwatch.py)
    def _ew_live(self) -> None:
        """A held wait (ftrun/control/etcdheld.py): one watch of the end key from the
        store's revision now, held across the watcher's slices until the gateway ends it at
        ``HOLD_S``; once etcd confirmed it, one read of the key (on a connection made for
        it: the real client reads on its main connection and streams on one made for each
        stream; the same requests, one connection fewer held here)."""
        if self.frozen or self.end_seen or self.ewc is None:
            return
        gen, conn = self.gen, self.ewc
        self.wait_no += 1
        self.ew_read_sent = False
        self.end_stream = AnyStream([self._ekey(gen.end_name)])  # etcdheld.HeldWatch's wire
        conn.stream("/watch", self.end_stream.requests(), self._ew_event, HOLD_S,
                    self._ew_ended)
        if gen.in_window(conn.sent_at):
            gen.count("endwatch.watch", 1)
        # the client's own bound (its read timeout), should the gateway not end the stream
        gen.loop.at(conn.sent_at + HOLD_S + 1.0, self._ew_due, self.wait_no)

    def _ew_read(self) -> None:
        """The held wait's read of the end key, on a connection of its own (once more
        after the one in flight, if any: an event came meanwhile)."""
        assert self.ewr is not None
        if self.ew_reading:
            self.ew_read_again = True
            return
        self.ew_reading = True
        self.ewr.open()  # then _ewr_live

    def _ewr_live(self) -> None:
        assert self.ewr is not None
        self.ewr.post("/kv/range", span(self._ekey(self.gen.end_name)), self._ew_range)

    def _ewr_failed(self, why: str) -> None:
        assert self.ewr is not None
        self.ewr.close()
        self.ew_reading = self.ew_read_again = False
        self._ew_failed(why)

    def _ew_range(self, answer: dict[str, Any]) -> None:
        gen, reader = self.gen, self.ewr
        assert reader is not None and self.ewc is not None
        if gen.in_window(reader.sent_at):
            gen.count("endwatch.range", 1)
        reader.close()
        self.ew_reading = False
        if self.frozen or self.end_seen:
            return
        kvs = answer.get("kvs") or []
        if kvs:
            self.wait_no += 1
            self.fired = self.fired or gen.loop.now
            self.ewc.close()  # the stream ends with its connection
            if not self._end_read(None, joined_value(kvs)):
                gen.loop.at(gen.loop.now + gen.slice_s, self.ewc.open)  # a forged end only
        elif self.ew_read_again:
            self.ew_read_again = False
            self._ew_read()
        elif self.ewc.closed:  # a read after an event: canceled (compacted), watch again
            self.ewc.open()

    def _ew_ended(self) -> None:
        """The gateway ended the held stream at its deadline: the wait armed again, on
        the same connection."""
        gen = self.gen
        if self.frozen or self.end_seen:
            return
        self.wait_no += 1
        if gen.in_window(gen.loop.now) and self.ewc is not None:
            gen.count("endwatch.watch.timeout", 0)
            gen.wait_overrun_s.append(gen.loop.now - self.ewc.sent_at - HOLD_S)
        self._ew_live()

    def _ew_event(self, result: dict[str, Any]) -> None:
        if self.frozen:
            return
        hit = self.end_stream.take({"result": result})
        if hit is None:
            if self.end_stream.confirmed and not self.ew_read_sent:
                self.ew_read_sent = True
                self._ew_read()
            return
        assert self.ewc is not None
        self.wait_no += 1  # this wait is over: written (or canceled: compacted), read it
        if result.get("events"):
            self.fired = self.fired or self.gen.loop.now
        self.ewc.close()  # the stream ends with its connection
        self._ew_read()  # the end record is appended: read it

    def _ew_due(self, number: int) -> None:
        conn = self.ewc
        if conn is None or number != self.wait_no or self.frozen or self.end_seen:
            return
        self.wait_no += 1
        if self.gen.in_window(self.gen.loop.now):
            self.gen.count("endwatch.watch.timeout", 0)
            self.gen.wait_overrun_s.append(self.gen.loop.now - conn.sent_at - HOLD_S)
        conn.close()
        conn.open()

    def _ew_failed(self, why: str) -> None:
        """As the EndWatcher after a failed request: a new connection (a new client, which
        watches, then reads) a slice later."""
        conn = self.ewc
        if conn is None or self.frozen or self.end_seen:
            return
        self.wait_no += 1
        conn.close()
        self.gen.loop.at(self.gen.loop.now + self.gen.slice_s, conn.open)

    # the rendezvous
    def join(self) -> None:
        if self.jc is not None:
            self.join_etcd()
            return
        conn, gen = self.ew, self.gen
        assert conn is not None
        slot = NodeSlot(-1, 1, "127.0.0.1", f"sim{self.index}", os.getpid(), self.node_id)
        name = f"gen/{gen.number}/slots"
        line = gen.signer.line(gen.prefix + name, slot.to_json())
        conn.request(msg_append(gen.wire(name), b"\n" + line.encode()))
        self.offered = time.time()
        self.wait_assignment()

    # the rendezvous on etcd-v3 (ftrun.control.etcd.EtcdClient under DynamicRendezvous)
    def join_etcd(self) -> None:
        """``Rendezvous.join`` on etcd-v3: the held wait armed (``JsonStore.arm_wait``),
        then the offer."""
        self.offer_due = True
        self._arm()

    def _offer_etcd(self) -> None:
        """The offer: the signed slot as an ``append`` part key of its own, one put."""
        gen = self.gen
        slot = NodeSlot(-1, 1, "127.0.0.1", f"sim{self.index}", os.getpid(), self.node_id)
        key = gen.prefix + f"gen/{gen.number}/slots"
        line = "\n" + gen.signer.line(key, slot.to_json())
        part = gen.etcd_root + key.encode() + PART + os.urandom(8).hex().encode()
        self._request("/kv/put", {"key": b64(part), "value": b64(line.encode())},
                      self._etcd_offered)

    def _request(self, path: str, body: dict[str, Any],
                 callback: Callable[[dict[str, Any]], None]) -> None:
        """One request on the main client; made again a poll later if it fails."""
        def step() -> None:
            assert self.jc is not None
            if not self.jc.live:  # closed meanwhile: made again once reconnected
                self._reconnect(step)
                return
            self.jc.post(path, body, callback)

        self.step = step
        step()

    def _etcd_offered(self, answer: dict[str, Any]) -> None:
        self.offered = self.offered or time.time()  # the assignment's event may come first
        self.step = None
        if self.read_due:  # a read asked for while the offer was in flight
            self.read_due = False
            self.read_assignment_etcd()

    def _held_keys(self) -> list[bytes]:
        """What the agent's wait watches (``Rendezvous._wait_assignment``): its assignment,
        the generation's record, the job's shutdown record."""
        number = self.gen.number
        return [self._ekey(f"gen/{number}/as/{self.node_id}"), self._ekey(f"gen/{number}"),
                self._ekey("shutdown")]

    def _arm(self) -> None:
        """``HeldWaits.wait`` with no stream held: the watch stream of the three keys from
        the store's revision now, and once etcd confirmed it, one read of them."""
        if self.joined is not None:
            return
        if time.time() > self.gen.deadline:
            self.joined = "timed out waiting for the assignment"
            return
        assert self.wc is not None
        self.wait_no += 1
        self.waiting, self.read_sent = True, False
        self.any_stream = AnyStream(self._held_keys())
        if self.wc.live:
            self._stream_watch()
        else:
            self.wc.open()  # then _watch_conn_live
        # the client's own bounds: the arm's wait for etcd's confirmation (CONFIRM_S), and
        # the stream's end (its read timeout), should the gateway not end it
        self.gen.loop.at(self.gen.loop.now + CONFIRM_S, self._arm_due, self.wait_no)
        self.gen.loop.at(self.gen.loop.now + HOLD_S + 1.0, self._etcd_hold_due, self.wait_no)

    def _arm_due(self, number: int) -> None:
        """etcd did not confirm the watches within ``CONFIRM_S``: as ``HeldWaits``, the arm
        returns (the offer is made) and the stream is kept; the read follows its
        confirmation."""
        if number == self.wait_no and self.waiting and not self.any_stream.confirmed:
            self.gen.count("rdzv.watch not confirmed within CONFIRM_S", 0)
            if self.offer_due:
                self.offer_due = False
                self._offer_etcd()

    def read_assignment_etcd(self) -> None:
        """One transaction reading the three ranges."""
        if self.joined is not None:
            return
        self._request("/kv/txn", {"compare": [], "failure": [], "success": [
            {"request_range": span(k)} for k in self._held_keys()]}, self._etcd_read)

    def _etcd_read(self, answer: dict[str, Any]) -> None:
        """The read's answer: the first key found ends the wait; none found, the held
        stream waits (and a wait without one is armed again). The first read of a join
        is followed by the offer whatever it found, as ``arm_wait`` ignores what it finds."""
        self.step = None
        found = next(((index, kvs) for index, kvs in enumerate(
            (r.get("response_range") or {}).get("kvs") or []
            for r in answer.get("responses") or []) if kvs), None)
        if self.offer_due:
            self.offer_due = False
            self._offer_etcd()
        if found is None:
            if not self.waiting:  # a read after an event found nothing: wait again
                self._arm()
            return
        if self.waiting:
            self._end_watch()
        index, kvs = found
        if index == 0:
            self._take_assignment(joined_value(kvs), self._arm)
        else:  # the record without this node's assignment, or a shutdown: over
            self.joined = f"{self._held_keys()[index]!r} came before the assignment"

    def _stream_watch(self) -> None:
        assert self.wc is not None
        self.wc.stream("/watch", self.any_stream.requests(), self._etcd_watched, HOLD_S,
                       self._etcd_hold_ended)

    def _watch_conn_live(self) -> None:
        if self.waiting and self.joined is None:
            self._stream_watch()

    def _watch_failed(self, why: str) -> None:
        """The stream failed: as ``HeldWaits``, a slice without news (a join's offer is
        made all the same), then the wait armed again."""
        if not self.waiting or self.joined is not None:
            return
        self._end_watch()
        if self.offer_due and not self.read_sent:
            self.offer_due = False
            self._offer_etcd()
        self.gen.loop.at(self.gen.loop.now + 0.05, self._arm)

    def _read_when_idle(self) -> None:
        """A read on the main connection, now or once its request in flight is answered."""
        if self.step is not None:  # the offer (or its retry) in flight
            self.read_due = True
        else:
            self.read_assignment_etcd()

    def _etcd_watched(self, result: dict[str, Any]) -> None:
        """A message of the stream: "created" (once every watch is, the wait's read); an
        event ends the wait and the connection with it. The assignment is taken from the
        event when it tells it whole, else read (also when the record's event came first:
        etcd orders the events of one watch, not those of a stream's watches)."""
        if not self.waiting:
            return
        hit = self.any_stream.take({"result": result})
        if hit is None:
            if self.any_stream.confirmed and not self.read_sent:
                self.read_sent = True
                self._read_when_idle()
            return
        self._end_watch()
        index, value = hit
        self.gen.count("rdzv.held wait ended by an event", 0)
        if index == 0 and value is not None:  # the leader's put, whole in the event
            self.gen.count("rdzv.assignment from the watch event", 0)
            self._take_assignment(value, self._arm)
            return
        self._read_when_idle()

    def _etcd_hold_ended(self) -> None:
        """The gateway ended the held stream at its deadline: the wait armed again
        (``HeldWatch`` closes its session: a new connection)."""
        if not self.waiting or self.joined is not None:
            return
        self._end_watch()
        self._arm()

    def _etcd_hold_due(self, number: int) -> None:
        """The held stream outlived its deadline: the read timeout closes the connection;
        the wait armed again on a new one."""
        if number != self.wait_no or not self.waiting or self.joined is not None:
            return
        self._end_watch()
        self._arm()

    def _ekey(self, name: str) -> bytes:
        """The etcd key of the job's key ``name`` (``EtcdClient``'s root and the prefix)."""
        return self.gen.etcd_root + (self.gen.prefix + name).encode()

    def _end_watch(self) -> None:
        """The wait is over: its stream ends with its connection."""
        self.waiting = False
        assert self.wc is not None
        self.wc.close()

    def _reconnect(self, then: Callable[[], None]) -> None:
        gen = self.gen
        gen.reconnects["etcd.main"] = gen.reconnects.get("etcd.main", 0) + 1
        self.next_step = then
        assert self.jc is not None
        self.jc.open()

    def _join_conn_live(self) -> None:
        step, self.next_step = self.next_step, None
        if step is not None:
            step()

    def _join_failed(self, why: str) -> None:
        """A request of the main client failed (an HTTP error, a closed connection): as
        ``JsonStore``'s retries, the same step again a poll later, on a new connection when
        this one is closed."""
        if self.joined is not None or self.frozen:
            return
        if self.step is None and self.waiting:
            return  # the idle main connection closed: the next request makes it again
        step = self.step if self.step is not None else self._arm
        if time.time() > self.gen.deadline:
            self.joined = f"etcd request failed: {why}"[:200]
            return
        self.gen.loop.at(self.gen.loop.now + 0.05, step)

    def wait_assignment(self) -> None:
        """torch's ``get``: a wait for the key with the slice as its timeout, then GET."""
        conn, gen = self.ew, self.gen
        if conn is None or not conn.live or self.joined is not None:
            return
        self.wait_no += 1
        self.waiting, self.cancelling = True, False
        key = gen.wire(f"gen/{gen.number}/as/{self.node_id}")
        conn.request(msg_keys(WAIT, [key]), (1, self._assigned))
        gen.loop.at(conn.sent_at + WAIT_SLICE_S, self._end_due, conn, self.wait_no)

    def _assigned(self, conn: StoreConn, answer: int) -> None:
        self.waiting = False
        if answer != STOP_WAITING:  # a slice without it: wait again (the rendezvous loop)
            self.cancelling = False
            if time.time() > self.gen.deadline:
                self.joined = "timed out waiting for the assignment"
                return
            self.wait_assignment()
            return
        if self.cancelling:
            conn.want.append((1, lambda c, a: None))
            self.cancelling = False
        key = self.gen.wire(f"gen/{self.gen.number}/as/{self.node_id}")
        conn.request(msg_get(key), (0, self._assignment))

    def _assignment(self, conn: StoreConn, raw: bytes) -> None:
        self._take_assignment(raw, self.wait_assignment)

    def _take_assignment(self, raw: bytes, again: Callable[[], None]) -> None:
        """Verify the assignment as the agent does (signature, ``Assignment.from_json``,
        generation and node); a record that does not verify is ignored and read again a
        poll later (``again``), as the agent does (the leader's write replaces it)."""
        gen = self.gen
        name = f"gen/{gen.number}/as/{self.node_id}"
        try:
            own = Assignment.from_json(gen.signer.unwrap_line(gen.prefix + name, raw))
        except ValueError as error:  # AuthError, StoreValueError, JSONDecodeError
            gen.count_error(f"rdzv.ignored an assignment: {str(error)[:80]}")
            if time.time() > gen.deadline:
                self.joined = f"{name}: {error}"[:200]
            else:
                gen.loop.at(gen.loop.now + 0.05, again)
            return
        if own.number != gen.number or own.node.node_id != self.node_id:
            self.joined = f"{name} names generation {own.number}, node {own.node.node_id}"
            return
        self.joined = [self.offered, time.time(), own.node.node_rank, own.rank_offset,
                       own.world_size, own.nnodes, own.worker_store_port]


# --- one generator process --------------------------------------------------------------------


class Generator:
    """The agents of one process, their schedule, and what they counted."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.loop = Loop()
        self.host: str = cfg.get("host", "127.0.0.1")
        self.store_port: int = int(cfg["store_port"])
        self.presence_port: int = int(cfg.get("presence_port") or 0)
        self.etcd_port: int = int(cfg.get("etcd_port") or 0)  # mode "etcd"
        self.etcd_root: bytes = str(cfg.get("etcd_root", "")).encode()
        self.ttl_s: int = int(cfg.get("ttl_s", 5))
        self.signer = Signer(str(cfg["token"]).encode() if cfg.get("token") else None)
        self.prefix = str(cfg["prefix"]).rstrip("/") + "/"
        self.presence_key = presence_key(str(cfg.get("run_id", "")))
        self.mode: str = cfg.get("mode", "load")
        self.number: int = int(cfg.get("number", 0))
        self.end_name = f"gen/{self.number}/end"
        self.end_wire = self.wire(self.end_name)
        self.id_prefix: str = cfg.get("id_prefix", "sim-")
        self.interval = float(cfg.get("interval", 1.0))
        self.op_timeout = float(cfg.get("op_timeout", 1.0))
        self.slice_s = float(cfg.get("slice", 0.5))
        self.ping_s = float(cfg.get("ping_s", 0.25))
        self.heartbeats = bool(cfg.get("heartbeats", True)) or self.mode == "etcd"
        self.end_watch = bool(cfg.get("end_watch", True))
        # only the agents below this index hold an end watch (the store host's descriptors)
        below = cfg.get("end_watch_below")  # None: every agent (0 is none of them)
        self.end_watch_below = 1 << 62 if below is None else int(below)
        self.setup_timeout = float(cfg.get("setup_timeout", 600.0))
        # how long, once connected, the agents may take to beat once before "ready" (an
        # overloaded store may never let every one through; "beaten" says how many did)
        self.cfg_ready_s = float(cfg.get("ready_s", 60.0))
        self.deadline = float("inf")
        self.window = (float("inf"), float("inf"))
        self.calls: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.reconnects: dict[str, int] = {}
        self.requests = 0
        self.heartbeat_s: list[float] = []
        self.wait_overrun_s: list[float] = []
        self._queue: deque[_Conn] = deque()
        self._in_flight = 0
        self.connect_errors = 0
        self.agents = [Agent(self, i) for i in cfg["ids"]]
        self.stdin_buf = b""
        self.commands: deque[dict[str, Any]] = deque()

    def wire(self, name: str) -> bytes:
        return ("/" + self.prefix + name).encode()

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t < self.window[1]

    def count(self, name: str, wire_requests: int) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.requests += wire_requests

    def count_error(self, name: str) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1

    # connects, a bounded number in flight
    def connect_later(self, conn: _Conn) -> None:
        self._queue.append(conn)
        self._pump()

    def connect_done(self, conn: _Conn, error: str) -> None:
        self._in_flight -= 1
        if error:
            self.connect_errors += 1
            self.loop.at(time.time() + 0.2, self.connect_later, conn)  # again, later
        self._pump()

    def _pump(self) -> None:
        while self._queue and self._in_flight < CONNECTS_IN_FLIGHT:
            conn = self._queue.popleft()
            self._in_flight += 1
            conn.reset()
            conn.start_connect()

    def all_live(self) -> bool:
        return all(c.live for a in self.agents for c in a.conns())

    # the harness's commands
    def _on_stdin(self, mask: int) -> None:
        data = os.read(sys.stdin.fileno(), 65536)
        if not data:
            os._exit(0)  # the harness is gone
        self.stdin_buf += data
        self._take_lines()

    def _take_lines(self) -> None:
        while b"\n" in self.stdin_buf:
            line, _, self.stdin_buf = self.stdin_buf.partition(b"\n")
            if line.strip():
                self.commands.append(json.loads(line))

    def run(self) -> None:
        loop = self.loop
        os.set_blocking(sys.stdin.fileno(), False)
        loop.sel.register(sys.stdin.fileno(), selectors.EVENT_READ, self._on_stdin)
        self._take_lines()
        began = time.time()
        for agent in self.agents:
            for conn in agent.conns():
                conn.open()
        said = began
        while not self.all_live():
            loop.run_once()
            if time.time() - said > 10:  # progress, on the harness's stderr
                said = time.time()
                live = sum(c.live for a in self.agents for c in a.conns())
                total = sum(len(a.conns()) for a in self.agents)
                print(f"  loadgen {os.getpid()}: {live} of {total} connections made "
                      f"({self.connect_errors} connects retried)", file=sys.stderr, flush=True)
            if time.time() - began > self.setup_timeout:
                raise RuntimeError(f"connections not made within {self.setup_timeout:.0f} s "
                                   f"({self.connect_errors} failed connects)")
        say({"event": "connected", "setup_s": round(time.time() - began, 2),
             "connect_errors": self.connect_errors})
        if self.heartbeats:
            buckets = max(1, min(len(self.agents), int(self.interval / 0.01)))
            self._schedule(self.interval, buckets, Agent.beat)
        if self.presence_port:
            buckets = max(1, min(len(self.agents), int(self.ping_s / 0.01)))
            self._schedule(self.ping_s, buckets, lambda a: a.pres.ping() if a.pres and
                           not a.frozen else None)
        beat_by = time.time() + float(self.cfg_ready_s)
        beating = self.mode in ("load", "etcd") or (self.mode == "rdzv" and self.etcd_port > 0)
        while beating and self.heartbeats and time.time() < beat_by and \
                not all(a.beats for a in self.agents):  # an overloaded store may not let all
            loop.run_once()
            if time.time() - said > 10:
                said = time.time()
                print(f"  loadgen {os.getpid()}: {sum(1 for a in self.agents if a.beats)} of "
                      f"{len(self.agents)} agents beat once; errors {self.errors}",
                      file=sys.stderr, flush=True)
        say({"event": "ready", "setup_s": round(time.time() - began, 2),
             "beaten": sum(1 for a in self.agents if a.beats), "agents": len(self.agents)})
        while True:
            while self.commands:
                if self._command(self.commands.popleft()):
                    return
            loop.run_once()
            if self.mode == "rdzv" and self.deadline < float("inf"):
                if all(a.joined is not None for a in self.agents):
                    self._report()
                    return
                if time.time() - said > 5:  # a join that lasts: progress on stderr
                    said = time.time()
                    print(f"  loadgen {os.getpid()}: {sum(1 for a in self.agents if a.offered)}"
                          f" offered, {sum(1 for a in self.agents if a.joined is not None)} "
                          f"of {len(self.agents)} joined; errors {self.errors}",
                          file=sys.stderr, flush=True)

    def _schedule(self, period: float, buckets: int, fn: Callable[[Agent], None]) -> None:
        groups = [self.agents[b::buckets] for b in range(buckets)]

        def tick(bucket: int) -> None:
            for agent in groups[bucket]:
                fn(agent)

        self.loop.every(period, buckets, tick)

    def _command(self, cmd: dict[str, Any]) -> bool:
        """Carry out one command; True when this process is done."""
        what = cmd.get("cmd")
        chosen = set(cmd.get("agents", []))
        if what == "window":
            self.window = (float(cmd["start"]), float(cmd["stop"]))
            self._cpu_at_start = resource.getrusage(resource.RUSAGE_SELF)
            self._beats_before: list[int] = []
            self.loop.at(self.window[0], self._mark_beats)
            self.loop.at(self.window[1], self._mark_beats)
        elif what == "freeze":  # as SIGSTOP: nothing more is sent, the sockets stay open
            for agent in self.agents:
                agent.frozen = agent.frozen or agent.index in chosen
        elif what == "kill":  # as SIGKILL: the kernel closes every socket, no goodbye
            for agent in self.agents:
                if agent.index in chosen:
                    agent.frozen = True
                    for conn in [*agent.conns(), *([agent.http] if agent.http else [])]:
                        conn.close()
        elif what == "join":
            self.deadline = time.time() + float(cmd.get("timeout", 120.0))
            for agent in self.agents:
                agent.join()
        elif what == "finish":
            end_by = float(cmd["end_by"])
            watched = [a for a in self.agents if a.watches_end()]
            while time.time() < end_by and not all(a.end_seen for a in watched):
                self.loop.run_once(0.01)
            for agent in self.agents:
                if agent.pres is not None and not agent.frozen:
                    agent.pres.goodbye()
            self._report()
            return True
        return False

    def _mark_beats(self) -> None:
        self._beats_before.append([a.beats for a in self.agents])  # type: ignore[arg-type]

    def _report(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start = getattr(self, "_cpu_at_start", None)
        marks: list[list[int]] = getattr(self, "_beats_before", [])
        window = self.window[1] - self.window[0]
        beats = [b - a for a, b in zip(marks[0], marks[1], strict=True)] if len(marks) == 2 \
            else []
        say({"event": "report", "ids": [a.index for a in self.agents][:1],
             "calls": self.calls, "errors": self.errors, "requests": self.requests,
             "reconnects": self.reconnects,
             "heartbeat_s": [round(x, 6) for x in self.heartbeat_s],
             "wait_overrun_s": [round(x, 6) for x in self.wait_overrun_s],
             "beats_per_s": [round(b / window, 3) for b in beats] if window > 0 else [],
             "fired": sorted(a.fired for a in self.agents if a.fired),
             "end_seen": sorted(a.end_seen for a in self.agents if a.end_seen),
             "watchers": sum(1 for a in self.agents if a.watches_end()),
             "joined": [a.joined for a in self.agents if isinstance(a.joined, list)],
             "join_errors": sorted({a.joined for a in self.agents
                                    if isinstance(a.joined, str)})[:3],
             "join_failed": sum(1 for a in self.agents if not isinstance(a.joined, list)),
             "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
             "cpu_s_in_window": round(usage.ru_utime + usage.ru_stime - (
                 start.ru_utime + start.ru_stime), 3) if start is not None else None})


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="", help="a label (for finding the process)")
    parser.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for limit in (max(hard, 65536), hard):  # more than the hard limit only as root
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            break
    fd, got = sys.stdin.fileno(), b""
    while b"\n" not in got:  # the configuration, read unbuffered (commands follow)
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        got += chunk
    line, _, rest = got.partition(b"\n")
    try:
        generator = Generator(json.loads(line))
        generator.stdin_buf = rest
        generator.run()
    except Exception as error:  # reported to the harness in one line, naming where
        frame = traceback.extract_tb(error.__traceback__)[-1]
        say({"event": "error", "error": f"{type(error).__name__}: {error} (loadgen.py:"
             f"{frame.lineno}, in {frame.name})"[:300]})
        sys.exit(1)


if __name__ == "__main__":
    main()


# --- the harness's end ----------------------------------------------------------------------


class TooMany(RuntimeError):
    """The generator processes could not set their agents up in time (connections not made,
    or an event not said by its deadline): a harness may try fewer agents. Any other
    RuntimeError from :class:`Fleet` is a failure to report, not a size to shrink."""


class Fleet:
    """Generator processes for a share of agent ids each (round robin), started with
    ``cfg`` (plus their ``ids``); commands go to all of them, events come back per process.

    Errors: :meth:`wait_for` raises :class:`TooMany` when a process did not say the event
    by its deadline or could not make its connections, and RuntimeError naming the first
    process that reported another error or exited first. An event that comes while
    another is waited for is kept for a later wait. :meth:`close` ends every process (end
    of stdin, then SIGKILL after ``timeout_s``) and waits for each.
    """

    def __init__(self, cfg: dict[str, Any], ids: list[int], procs: int, tag: str = "") -> None:
        import queue
        import subprocess
        import threading

        procs = max(1, min(procs, len(ids)))
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._early: list[tuple[int, dict[str, Any]]] = []
        for k in range(procs):
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                     "--tag", tag or "ftrun-loadgen"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({**cfg, "ids": ids[k::procs]}).encode() + b"\n")
            proc.stdin.flush()
            threading.Thread(target=self._read, args=(k, proc), daemon=True).start()

    def _read(self, k: int, proc: Any) -> None:
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                self.events.put((k, json.loads(line)))
        self.events.put((k, {"event": "exited", "code": proc.wait()}))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, cmd: dict[str, Any]) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                proc.stdin.write(json.dumps(cmd).encode() + b"\n")
                proc.stdin.flush()

    def wait_for(self, event: str, timeout_s: float) -> list[dict[str, Any]]:
        """One ``event`` from every process, in process order."""
        import queue

        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        early, self._early = self._early, []  # what came while waiting for something else
        while len(got) < len(self.procs):
            if early:
                k, obj = early.pop(0)
            else:
                try:
                    k, obj = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    raise TooMany(f"generator processes: {len(got)} of {len(self.procs)} "
                                  f"said {event!r} within {timeout_s:.0f} s") from None
            if obj.get("event") == event and k in got:
                self._early.append((k, obj))  # a process's next one: for a later wait
            elif obj.get("event") == event:
                got[k] = obj
            elif obj.get("event") == "exited" and k in got:
                self._early.append((k, obj))  # it said what was asked, then ended: a later
                # wait for that process fails at once instead of at its deadline
            elif obj.get("event") in ("error", "exited"):
                error = RuntimeError if "connections not made" not in str(obj.get("error")) \
                    else TooMany
                raise error(f"generator process {k}: {obj.get('error') or obj}")
            else:
                self._early.append((k, obj))
        self._early.extend(early)
        return [got[k] for k in range(len(self.procs))]

    def close(self, timeout_s: float = 5.0) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.01, deadline - time.monotonic()))
            except Exception:  # subprocess.TimeoutExpired: it did not end by itself
                proc.kill()
                proc.wait()
