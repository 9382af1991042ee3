"""Presence: one long-lived TCP connection from every agent to the leader's agent, so that
an agent whose process dies is noticed at once rather than after the heartbeat timeout.

Why: the heartbeat timeout (:mod:`ftrun.control.heartbeat`) must be long enough that a
slow or briefly paused agent is not declared lost, so it is seconds. But most node losses
are not silent: when an agent's process is killed (SIGKILL, OOM killer, a crash) or its host
resets, the kernel on that host closes its sockets, and the leader's end of a connection
reads end-of-file or a reset within a round trip. That is a verdict no timeout has to wait
for. A host that goes silent without closing anything (SIGSTOP, a frozen VM, a cut link)
keeps its connection open and quiet: that case is the heartbeat timeout's. To see that
silence at sub-second granularity without a store request per beat, the client pings: one
empty line every :data:`PING_S` (or an eighth of the heartbeat timeout, if less), and the
server keeps when it last heard from each connection (:meth:`PresenceServer.silent`). The
verdict on silence stays with :class:`ftrun.control.heartbeat.HeartbeatMonitor`, which
counts a node silent only when neither its store heartbeat nor its pings were heard.

Roles:

* :class:`PresenceServer` runs in the leader (the agent that hosts the control store), on
  the address the stores are bound to, on a port of its own; the leader publishes it in
  the control store as the signed record ``presence`` (``{"host", "port"}``).
* :class:`PresenceClient` is held by every other agent (its heartbeat thread connects it,
  :class:`ftrun.control.heartbeat.HeartbeatSender`). Once connected, nothing more is sent
  until the agent ends: the open socket itself is the signal, and the client needs no thread.

Protocol (newline-terminated JSON lines, each at most :data:`MAX_LINE` bytes):

1. server -> client: ``{"nonce": "<32 hex>"}``, fresh per connection;
2. client -> server: a control record (:mod:`ftrun.control.auth`) ``{"body": {"node_id",
   "nonce"}, "mac"}`` signed with the job token over the key ``ftrun/<run id>/presence``;
   binding the server's nonce means a recorded hello cannot be replayed on another
   connection (and so nobody without the token can open, then drop, a connection in
   another agent's name to fake its loss); ``"ping_s"`` (optional, 0 < x <= 60) says the
   client pings that often;
3. server -> client: ``{"ok": true}`` (or ``{"ok": false, "error": ...}`` and a close);
4. client -> server, every ``ping_s``: an empty line (a ping; the connection is already
   authenticated, and nobody off the path can inject into it);
5. client -> server, when its agent ends on purpose: ``{"body": {"bye": "<node id>",
   "nonce"}, "mac"}``, same key. A connection that ends after a goodbye is a clean exit,
   never a loss: the leader then learns of the end as before (a done record, an end, or
   the heartbeat timeout).

A connection that ends (EOF, reset) after a valid hello and without a goodbye is a loss
verdict for its node id (:meth:`PresenceServer.gone`). A hello for a node id that was
declared gone withdraws the verdict: that agent is alive. Anything else read (a bad MAC,
a wrong nonce, garbage, an over-long line, no hello within :data:`HELLO_TIMEOUT_S`) closes
the connection without a verdict and is reported once through ``on_reject``. Without a job
token the hello is unsigned and accepted as the store's records are.

Limits: a middlebox that resets idle connections would read as a loss; none sits between
the namespace hosts of the tests, and the connection carries TCP keep-alives so that an
idle-connection timeout sees traffic. On the etcd-v3 backend the job's elected writer
serves it and publishes the record in etcd; an agent that takes the writer's place serves
a new one and overwrites the record, and the others connect to it once their connection
to the dead writer has ended (ftrun/agent/etcdwriter.py).

Timeouts: the client's connect and its wait for ``ok`` are bounded by ``timeout_s``
(:class:`PresenceError` past it); a goodbye is one non-blocking-bounded send
(``timeout_s``), best effort; a ping is a non-blocking send, skipped when the socket's
buffer is full (a cut link). The server never blocks on a client: its one thread polls
every socket with a 0.2 s tick, and measures silence at its own last look, so a starved
server thread never reports a silence it did not see.

Cost: a ping is one ``send`` of one byte on the client and one ``recv`` on the server:
4 per second per agent by default.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ftrun.control.auth import AuthError, Signer

MAX_LINE = 4096
HELLO_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16384
RECORD = "presence"  # the control-store record that names the leader's server
PING_S = 0.25  # a client's ping period (at most; an eighth of the heartbeat timeout if less)
MAX_PING_S = 60.0
_TICK_S = 0.2


class PresenceError(RuntimeError):
    """A presence connection could not be made (one line: to where, why)."""


def presence_key(run_id: str) -> str:
    return f"ftrun/{run_id}/presence"


def parse_record(body: dict[str, Any] | None) -> tuple[str, int] | None:
    """The server's ``(host, port)`` from the ``presence`` record's body, or None when it is
    missing or malformed (validated: a host string, a port in 1..65535)."""
    if not isinstance(body, dict):
        return None
    host, port = body.get("host"), body.get("port")
    if not isinstance(host, str) or not host or len(host) > 255:
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    return host, port


def record_node(body: dict[str, Any] | None) -> str:
    """The node id of the agent serving the ``presence`` record's server (the job's
    writer on etcd-v3), or "" when the record names none or a malformed one."""
    node_id = body.get("node_id") if isinstance(body, dict) else None
    return node_id if isinstance(node_id, str) and 0 < len(node_id) <= 255 else ""


class _Conn:
    __slots__ = ("buf", "bye", "deadline", "heard", "node_id", "nonce", "ping_s", "sock")

    def __init__(self, sock: socket.socket, nonce: str, deadline: float) -> None:
        self.sock = sock
        self.buf = b""
        self.nonce = nonce
        self.node_id: str | None = None
        self.bye = False
        self.deadline = deadline
        self.heard = 0.0  # when the server last read anything from it (its clock)
        self.ping_s = 0.0  # the client's ping period (0: it does not ping)


class PresenceServer:
    """The leader's end: which agents' connections ended without a goodbye."""

    def __init__(self, signer: Signer, run_id: str, host: str | None, port: int = 0, *,
                 on_reject: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._signer = signer
        self._key = presence_key(run_id)
        self._clock = clock
        self._on_reject = on_reject
        self._lock = threading.Lock()
        self._gone: dict[str, float] = {}
        self._left: set[str] = set()
        self._current: dict[str, _Conn] = {}  # node id -> its live connection
        self._looked = clock()  # when the server thread last returned from select
        self._conns: dict[int, _Conn] = {}
        self._listener = socket.create_server((host or "", port), backlog=1024)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-presence", daemon=True)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> PresenceServer:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop serving; wait up to ``timeout_s`` for the thread, then close every socket."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.sock.close()
        with contextlib.suppress(OSError):
            self._listener.close()

    def gone(self) -> dict[str, float]:
        """Node id -> the time (this server's clock) its connection ended without a goodbye."""
        with self._lock:
            return dict(self._gone)

    def connected(self) -> set[str]:
        with self._lock:
            return set(self._current)

    def left(self) -> set[str]:
        """Node ids that said goodbye (clean exits)."""
        with self._lock:
            return set(self._left)

    def silent(self) -> dict[str, float]:
        """Node id -> seconds its live connection had sent nothing (no ping) when the
        server thread last looked, for the clients that ping; measured at that look, so a
        server thread that could not run adds no silence of its own."""
        with self._lock:
            looked = self._looked
            return {node_id: max(0.0, looked - conn.heard)
                    for node_id, conn in self._current.items() if conn.ping_s > 0}

    # --- the server's thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve_once()
            except Exception as error:  # never end unseen: verdicts would silently stop
                self._say(f"presence: server error: {type(error).__name__}: {error}")
                self._stop.wait(_TICK_S)

    def _serve_once(self) -> None:
        ready = self._sel.select(timeout=_TICK_S)
        looked = self._clock()  # what arrived before this is in ``ready``
        for key, _ in ready:
            if key.data is None:
                self._accept()
            else:
                self._readable(key.data)
        with self._lock:  # only now: silence is measured after what was heard is counted
            self._looked = looked
        now = self._clock()
        for conn in [c for c in self._conns.values() if c.node_id is None]:
            if now > conn.deadline:
                self._reject(conn, f"no hello within {HELLO_TIMEOUT_S:.0f} s")

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                self._say(f"presence: accept failed: {error}")
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                sock.close()
                self._say(f"presence: refused a connection: {MAX_CONNECTIONS} open already")
                continue
            nonce = secrets.token_hex(16)
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            conn = _Conn(sock, nonce, self._clock() + HELLO_TIMEOUT_S)
            try:
                sock.send(json.dumps({"nonce": nonce}).encode() + b"\n")
            except OSError:
                sock.close()
                continue
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(MAX_LINE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # a reset: the peer's kernel dropped the connection
        if not data:
            self._ended(conn)
            return
        conn.heard = self._clock()
        conn.buf += data
        while b"\n" in conn.buf:
            line, _, conn.buf = conn.buf.partition(b"\n")
            if not self._line(conn, line):
                return
        if len(conn.buf) > MAX_LINE:
            self._reject(conn, f"a line over {MAX_LINE} bytes")

    def _line(self, conn: _Conn, line: bytes) -> bool:
        """Handle one line; False when the connection was closed."""
        if not line and conn.node_id is not None:
            return True  # a ping: its arrival was the point
        try:
            record = json.loads(line)
            body = self._signer.unwrap(self._key, record)
        except (ValueError, AuthError) as error:  # JSONDecodeError is a ValueError
            self._reject(conn, f"{error}".splitlines()[0][:200] or "not JSON")
            return False
        if body.get("nonce") != conn.nonce:
            self._reject(conn, "a record for another connection (wrong nonce)")
            return False
        if conn.node_id is None:
            node_id = body.get("node_id")
            if not isinstance(node_id, str) or not 0 < len(node_id) <= 256:
                self._reject(conn, "a hello without a valid node_id")
                return False
            ping_s = body.get("ping_s", 0.0)
            if isinstance(ping_s, bool) or not isinstance(ping_s, int | float) \
                    or not 0 <= ping_s <= MAX_PING_S:
                self._reject(conn, f"a hello with a bad ping_s (0 to {MAX_PING_S:g} s)")
                return False
            conn.node_id, conn.ping_s, conn.heard = node_id, float(ping_s), self._clock()
            with self._lock:
                old = self._current.get(node_id)
                self._current[node_id] = conn
                self._gone.pop(node_id, None)  # it is alive after all
                self._left.discard(node_id)
            if old is not None:
                self._drop(old)
            with contextlib.suppress(OSError):
                conn.sock.send(b'{"ok":true}\n')
            return True
        if body.get("bye") != conn.node_id:
            self._reject(conn, f"node {conn.node_id}: an unexpected record")
            return False
        conn.bye = True
        self._ended(conn)
        return False

    def _ended(self, conn: _Conn) -> None:
        node_id = conn.node_id
        with self._lock:
            if node_id is not None and self._current.get(node_id) is conn:
                del self._current[node_id]
                if conn.bye:
                    self._left.add(node_id)
                else:
                    self._gone[node_id] = self._clock()
        self._drop(conn)

    def _reject(self, conn: _Conn, why: str) -> None:
        with contextlib.suppress(OSError):
            conn.sock.send(json.dumps({"ok": False, "error": why}).encode() + b"\n")
        who = f" from node {conn.node_id}" if conn.node_id else ""
        with self._lock:  # a rejected connection is no verdict: left to the heartbeats
            if conn.node_id is not None and self._current.get(conn.node_id) is conn:
                del self._current[conn.node_id]
        self._drop(conn)
        self._say(f"presence: refused a connection{who}: {why}")

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0 and self._conns.get(fd) is conn:
            del self._conns[fd]
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _say(self, message: str) -> None:
        if self._on_reject is not None:
            self._on_reject(message)


class PresenceClient:
    """An agent's end: connect once, hold the socket open, ping every ``ping_s`` (0: never;
    from a daemon thread of its own, started at the first connect), say goodbye when
    ending."""

    def __init__(self, signer: Signer, run_id: str, node_id: str, timeout_s: float,
                 ping_s: float = 0.0) -> None:
        if not 0 <= ping_s <= MAX_PING_S:
            raise ValueError(f"ping_s={ping_s}: 0 to {MAX_PING_S:g} s")
        self._signer = signer
        self._key = presence_key(run_id)
        self.node_id = node_id
        self.timeout_s = timeout_s
        self.ping_s = ping_s
        self._sock: socket.socket | None = None
        self._nonce = ""
        self._lock = threading.Lock()
        self._pinger: threading.Thread | None = None
        self._stop = threading.Event()
        self.closed = False  # goodbye said: never connect again

    @property
    def connected(self) -> bool:
        """Connected, and the server has not closed its end (a non-blocking look)."""
        with self._lock:
            sock = self._sock
            if sock is None:
                return False
            try:
                data = sock.recv(MAX_LINE, socket.MSG_DONTWAIT | socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError, TimeoutError):
                return True
            except OSError:
                data = b""
            if data:
                # The server sends nothing after "ok": drop what came (an error line).
                with contextlib.suppress(OSError):
                    sock.recv(MAX_LINE, socket.MSG_DONTWAIT)
                return True
            self._sock = None
            with contextlib.suppress(OSError):
                sock.close()
            return False

    def connect(self, host: str, port: int) -> None:
        """Open the connection and say hello; PresenceError (naming ``host:port``) when it
        cannot be done within ``timeout_s``."""
        where = f"{host}:{port}"
        if self.closed:
            raise PresenceError(f"presence {where}: this agent already said goodbye")
        deadline = time.monotonic() + self.timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout_s)
        except OSError as error:
            raise PresenceError(f"presence {where}: connect failed: {error}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            reader = _LineReader(sock, deadline)
            hello = json.loads(reader.line())
            nonce = hello.get("nonce") if isinstance(hello, dict) else None
            if not isinstance(nonce, str) or len(nonce) != 32:
                raise PresenceError(f"presence {where}: not a presence server (no nonce)")
            body: dict[str, Any] = {"node_id": self.node_id, "nonce": nonce}
            if self.ping_s > 0:
                body["ping_s"] = self.ping_s
            sock.sendall(self._signer.line(self._key, body).encode() + b"\n")
            answer = json.loads(reader.line())
            if not isinstance(answer, dict) or answer.get("ok") is not True:
                why = answer.get("error") if isinstance(answer, dict) else None
                raise PresenceError(f"presence {where}: refused: {str(why)[:200]}")
        except (OSError, ValueError, PresenceError) as error:
            sock.close()
            if isinstance(error, PresenceError):
                raise
            raise PresenceError(f"presence {where}: {error or type(error).__name__}") from None
        sock.settimeout(None)  # blocking: connected's MSG_DONTWAIT look never waits
        with self._lock:
            late = self.closed  # goodbye was said while this connect ran
            old, self._sock, self._nonce = self._sock, sock, nonce
        if old is not None:
            old.close()
        if late:
            self.goodbye()
        elif self.ping_s > 0 and self._pinger is None:
            self._pinger = threading.Thread(target=self._ping, name="ftrun-presence-ping",
                                             daemon=True)
            self._pinger.start()

    def _ping(self) -> None:
        """Send an empty line every ``ping_s`` while connected; never block: a full socket
        buffer (a cut link) skips the ping, a broken socket is left for :attr:`connected`
        to find (the heartbeat thread then connects again)."""
        while not self._stop.wait(self.ping_s):
            with self._lock:
                sock = self._sock
                if sock is None:
                    continue
                with contextlib.suppress(OSError):  # BlockingIOError included
                    sock.send(b"\n", socket.MSG_DONTWAIT)

    def goodbye(self) -> None:
        """Say this agent ends on purpose, then close (best effort, bounded by
        ``timeout_s``); the server then never counts the close as a loss."""
        self._stop.set()
        with self._lock:
            self.closed = True
            sock, self._sock = self._sock, None
            nonce = self._nonce
        if sock is None:
            return
        try:
            sock.settimeout(self.timeout_s)
            body = {"bye": self.node_id, "nonce": nonce}
            sock.sendall(self._signer.line(self._key, body).encode() + b"\n")
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            sock.close()


class _LineReader:
    """Reads newline-terminated lines of at most MAX_LINE bytes before ``deadline``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self._buf = b""

    def line(self) -> bytes:
        while b"\n" not in self._buf:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise PresenceError("no answer in time")
            self._sock.settimeout(left)
            chunk = self._sock.recv(MAX_LINE)
            if not chunk:
                raise PresenceError("the server closed the connection")
            self._buf += chunk
            if len(self._buf) > MAX_LINE:
                raise PresenceError(f"a line over {MAX_LINE} bytes")
        line, _, self._buf = self._buf.partition(b"\n")
        return line
