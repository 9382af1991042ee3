"""Buddy replication: a node's snapshots copied to another node's memory, agent to agent.

A sharded job on several nodes loses every shard of a node whose agent dies with its
memory, so each snapshot file is also kept by a *buddy*: the next node of the member
epoch in a ring over node ranks (node i -> the next node rank present, wrapping). A ring
puts each node's replicas on exactly one other node, spreads the receiving work evenly
(every node receives as much as it sends) and needs no coordination: every rank computes
its buddy from the member epoch alone. A node and its buddy failing together loses the job,
as any single-replica scheme does.

Every agent of a multi-node job runs a :class:`ReplicaServer` (a TCP listener on its node's
address, one thread per connection). Three requests, each a frame:

=============  ===================  ===================================================
``op``         sent by              what the server does
=============  ===================  ===================================================
``replicate``  a local worker       reads that worker's published snapshot file from its
                                    own memory and ``put``s it to the buddy named in the
                                    request; answers the buddy's verified acknowledgement
``put``        the buddy's agent    reads the file's bytes, verifies them (the whole file
                                    parses, its data CRC32 equals the one phase 1 of the
                                    record published), stores them under ``replicas/``
                                    (``.tmp`` then ``rename``), drops that rank's older
                                    replicas, answers ``ok`` with the CRC32 it checked
``get``        a restoring worker   answers the named snapshot's bytes (a replica, else
                                    its own node's file)
=============  ===================  ===================================================

The worker writes the ``replica`` phase of the two-phase record only after the buddy's
acknowledgement came back with the CRC32 it verified (:mod:`ftrun.snapshot.writer`).

Frame: 4 bytes (big endian) header length, the header (a control record of
:mod:`ftrun.control.auth`: ``{"body": {...}, "mac": ...}``, HMAC-SHA256 with the job token
over the body and the key ``snapshot-replica/<run id>/<op>``), then ``body["size"]`` bytes
of payload. Everything read is validated: the header's size (<= 64 KiB), its MAC, every
field's type, the payload's size against the memory cap, the file itself (no pickle:
:mod:`ftrun.snapshot.format`). A request that fails any check gets an ``ok: false`` answer
with the reason in one line, and nothing is stored.

Memory: per sending rank the buddy keeps the snapshot being received and the one the
sender still keeps (its newest complete), never more; a ``put`` larger than the file
system's free space is refused before its payload is read, and with
``FTRUN_SNAPSHOT_CAP_BYTES`` one that would take the node's snapshot memory (local files
and replicas) past the cap. The whole directory goes when the agent ends
(:mod:`ftrun.agent.snapshots`).

Timeouts: a connect is bounded by min(``timeout_s``, :data:`CONNECT_TIMEOUT_S`), every
other socket operation of a request by ``timeout_s`` (the caller's;
the server uses :data:`SERVER_TIMEOUT_S` per operation); past it the request fails with
:class:`ReplicaError` (client) or the connection is dropped with nothing stored (server).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import struct
import threading
from pathlib import Path
from typing import Any

from ftrun.control.auth import AuthError, Signer
from ftrun.snapshot import format as fmt
from ftrun.snapshot import memory

ENV = "FTRUN_SNAPSHOT_SERVER"  # host:port of this node's agent's server, for its workers
RUN_ENV = "FTRUN_SNAPSHOT_RUN_ID"  # the run id the requests' MACs are bound to
REPLICAS = "replicas"  # the subdirectory of the node's memory holding the buddy's files
SERVER_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0  # a connect's own bound (at most the request's)
MAX_HEADER = 64 * 1024
_LEN = struct.Struct(">I")
_CHUNK = 1 << 20


class ReplicaError(RuntimeError):
    """A replication or fetch failed (one line: which request, to whom, why)."""


# --- framing -------------------------------------------------------------------------------


def _key(run_id: str, op: str) -> str:
    return f"snapshot-replica/{run_id}/{op}"


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], min(size - got, _CHUNK))
        if n == 0:
            raise ReplicaError(f"connection closed after {got} of {size} bytes")
        got += n
    return buffer


def send_frame(sock: socket.socket, signer: Signer, run_id: str, op: str,
               body: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    body = {**body, "op": op, "size": len(payload)}
    head = json.dumps(signer.wrap(_key(run_id, op), body)).encode()
    sock.sendall(_LEN.pack(len(head)) + head)
    if len(payload):
        sock.sendall(payload)


def recv_header(sock: socket.socket, signer: Signer, run_id: str,
                ops: tuple[str, ...]) -> dict[str, Any]:
    """The checked body of the next frame's header (its payload is not read yet)."""
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > MAX_HEADER:
        raise ReplicaError(f"header of {length} bytes (at most {MAX_HEADER})")
    try:
        record = json.loads(bytes(_recv_exact(sock, length)))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ReplicaError(f"header is not JSON: {error}") from None
    op = record.get("body", {}).get("op") if isinstance(record, dict) and isinstance(
        record.get("body"), dict) else None
    if op not in ops:
        raise ReplicaError(f"unexpected request {op!r} (expected one of {list(ops)})")
    try:
        body = signer.unwrap(_key(run_id, op), record)
    except AuthError as error:
        raise ReplicaError(str(error)) from None
    _field(body, "size", int)
    return body


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ReplicaError(f"field {name!r} is not a non-negative integer")
    if not isinstance(value, kind):
        raise ReplicaError(f"field {name!r} is not a {kind.__name__}")
    return value


def _ident(body: dict[str, Any]) -> tuple[int, int, int, int]:
    """(job generation, member epoch, step, rank) of the snapshot a request names."""
    return (_field(body, "generation", int), _field(body, "epoch", int),
            _field(body, "step", int), _field(body, "rank", int))


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ReplicaError(f"{text!r} is not host:port")
    return host.strip("[]"), int(port)


def request(address: tuple[str, int], signer: Signer, run_id: str, op: str,
            body: dict[str, Any], payload: bytes | memoryview = b"", *,
            timeout_s: float) -> tuple[dict[str, Any], bytearray]:
    """One request to a :class:`ReplicaServer`: its checked answer and payload. Raises
    :class:`ReplicaError` on any failure (connection, timeout, refusal, bad answer)."""
    what = f"{op} to {address[0]}:{address[1]}"
    try:
        # A node that is gone (its link cut: no reset comes back) fails the connect soon.
        with socket.create_connection(address, timeout=min(timeout_s, CONNECT_TIMEOUT_S)
                                      ) as sock:
            sock.settimeout(timeout_s)
            # A refusal before the payload was read breaks the send: its answer says why.
            with contextlib.suppress(OSError):
                send_frame(sock, signer, run_id, op, body, payload)
            answer = recv_header(sock, signer, run_id, ("answer",))
            data = _recv_exact(sock, answer["size"]) if answer["size"] else bytearray()
    except (OSError, ReplicaError) as error:
        raise ReplicaError(f"{what}: {error}") from None
    if answer.get("ok") is not True:
        raise ReplicaError(f"{what}: refused: {answer.get('error', 'no reason given')}")
    return answer, data


# --- the server ----------------------------------------------------------------------------


class ReplicaServer:
    """This node's end of buddy replication (see the module); ``close`` stops it."""

    def __init__(self, directory: Path, run_id: str, signer: Signer, host: str = "",
                 cap: int | None = None) -> None:
        self.directory = directory
        self.replicas = directory / REPLICAS
        self.replicas.mkdir(mode=0o700, exist_ok=True)
        self.run_id = run_id
        self.signer = signer
        self.cap = cap
        self._lock = threading.Lock()  # the cap check and the store of one put at a time
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._server = Server((host, 0), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.2,),
                                        name="ftrun-replica-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(SERVER_TIMEOUT_S)
        try:
            body = recv_header(sock, self.signer, self.run_id, ("put", "get", "replicate"))
            op = body["op"]
            if op == "put":
                answer, payload = self._put(sock, body), b""
            elif op == "get":
                answer, payload = self._get(body)
            else:
                answer, payload = self._replicate(body), b""
        except (ReplicaError, fmt.SnapshotFormatError, OSError) as error:
            answer, payload = {"ok": False, "error": str(error)}, b""
        with contextlib.suppress(OSError):
            send_frame(sock, self.signer, self.run_id, "answer", answer, payload)

    def _put(self, sock: socket.socket, body: dict[str, Any]) -> dict[str, Any]:
        generation, epoch, step, rank = _ident(body)
        crc = _field(body, "crc32", int)
        size = body["size"]
        keep = body.get("keep")
        if keep is not None and not (isinstance(keep, list) and len(keep) == 3 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in keep)):
            raise ReplicaError("field 'keep' is not [generation, epoch, step] or null")
        free = memory.free_bytes(self.directory)
        if size > free:
            raise ReplicaError(f"replica of rank {rank} step {step} ({size} bytes) does not "
                               f"fit: {self.directory.parent} has {free} bytes free")
        if self.cap is not None:
            used = memory.used_bytes(self.directory) + memory.used_bytes(self.replicas)
            if used + size > self.cap:
                raise ReplicaError(
                    f"replica of rank {rank} step {step} ({size} bytes) would take this "
                    f"node's snapshot memory to {used + size} bytes, more than the cap "
                    f"{self.cap} bytes ({memory.CAP_ENV})")
        blob = _recv_exact(sock, size)
        snapshot = fmt.parse(blob)  # the whole file checks, data CRC32 included
        if snapshot.crc32 != crc:
            raise ReplicaError(f"replica of rank {rank} step {step}: CRC32 {snapshot.crc32:#x}"
                               f" is not the published {crc:#x}")
        name = memory.file_name(generation, epoch, step, rank)
        tmp = self.replicas / f".{name}.{threading.get_ident()}.tmp"
        try:
            with self._lock:
                tmp.write_bytes(blob)
                os.rename(tmp, self.replicas / name)
                kept = {(generation, epoch, step)} | (
                    {tuple(keep)} if keep is not None else set())
                for entry in self.replicas.iterdir():
                    parsed = memory.parse_name(entry.name)
                    if parsed is not None and parsed[3] == rank and parsed[:3] not in kept:
                        with contextlib.suppress(OSError):
                            entry.unlink()
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return {"ok": True, "crc32": crc, "bytes": size}

    def _get(self, body: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        name = memory.file_name(*_ident(body))
        for path in (self.replicas / name, self.directory / name):
            with contextlib.suppress(FileNotFoundError):
                return {"ok": True}, path.read_bytes()
        raise ReplicaError(f"no snapshot {name} on this node")

    def _replicate(self, body: dict[str, Any]) -> dict[str, Any]:
        generation, epoch, step, rank = _ident(body)
        to = parse_address(_field(body, "to", str))
        timeout_s = float(_field(body, "timeout_s", int) or SERVER_TIMEOUT_S)
        blob = (self.directory / memory.file_name(generation, epoch, step, rank)).read_bytes()
        put = {"generation": generation, "epoch": epoch, "step": step, "rank": rank,
               "crc32": _field(body, "crc32", int), "keep": body.get("keep")}
        answer, _ = request(to, self.signer, self.run_id, "put", put, blob,
                            timeout_s=timeout_s)
        crc = answer.get("crc32")
        if crc != put["crc32"]:
            raise ReplicaError(f"the buddy acknowledged CRC32 {crc!r}, not {put['crc32']:#x}")
        return {"ok": True, "crc32": crc, "bytes": len(blob)}


def fetch(address: tuple[str, int], signer: Signer, run_id: str, held: tuple[int, int, int],
          rank: int, *, timeout_s: float) -> bytes:
    """The bytes of snapshot ``held`` (generation, epoch, step) of ``rank``, held by the
    node at ``address``."""
    generation, epoch, step = held
    _, data = request(address, signer, run_id, "get",
                      {"generation": generation, "epoch": epoch, "step": step, "rank": rank},
                      timeout_s=timeout_s)
    return bytes(data)


def buddy_node(node: int, nodes: set[int] | list[int]) -> int | None:
    """The next node rank after ``node`` among ``nodes`` (a ring), or None when alone."""
    ring = sorted(set(nodes))
    if len(ring) < 2 or node not in ring:
        return None
    return ring[(ring.index(node) + 1) % len(ring)]
