"""A lease's renewals over etcd's own gRPC stream, ``Lease/LeaseKeepAlive``.

Why: every etcd-v3 agent renews its liveness lease once a heartbeat interval
(:class:`~ftrun.control.election.LeaseBeat`), and the job's writer its election lease.
Sent through etcd's JSON gateway, as every other request of ftrun's is, a renewal is an
HTTP request that the member decodes, turns into a gRPC call to itself and encodes back:
about five times the member's work of one message on its native keepalive stream
(``scripts/etcd_keepalive_grpc.py`` measures both). With thousands of agents on one
cluster the renewals are most of what a member does, and they were what a loopback member
ran out of CPU on (docs/scale.md). A renewal is therefore one small
message on a stream that lasts as long as the heartbeat, to the endpoint the agent's
client talks to.

The two messages are protobufs of integer fields and are encoded here (an ``ID``; a
header, an ``ID`` and a ``TTL`` back), so neither generated code nor the protobuf package
is needed; grpcio carries them as bytes. The stream goes to the same client URL as the
gateway (etcd serves both on its client port), with the same TLS files.

Timeouts and errors: :meth:`KeepAliveStream.renew` waits at most its ``timeout_s`` for
the answer, and ``RuntimeError`` says why when none came or the stream failed.
``EtcdClient.keep_alive`` then names the endpoint and moves to the next one, as after a
failed request: a renewal there makes a new stream. A stream that broke, or that sent what
is not a keepalive answer, is closed; one that only answered late is kept. etcd makes a
renewal wait for its applied index to catch up, so under a burst of writes answers come
late from a member that is alive, and a new connection and stream for each late answer
(the first version) is more work for a member already behind: etcd's own client keeps its
stream too. (At 9,000 light agents on one member, an overload either way, single runs did
not show which is better: docs/scale.md, store load.) An answer that comes after its renewal
gave up is dropped unread by the next one; a late answer for a lease the beat no longer
holds is skipped. Nothing else is swallowed.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

#: etcd's keepalive method: a stream of requests, each answered in order on the response
#: stream (etcdserverpb/rpc.proto).
LEASE_KEEPALIVE = "/etcdserverpb.Lease/LeaseKeepAlive"


def encode_keepalive(lease: int) -> bytes:
    """``LeaseKeepAliveRequest{ID: lease}``: field 1, an int64 varint."""
    if lease < 0:
        raise ValueError(f"lease id {lease} is negative")
    return b"\x08" + encode_varint(lease)


def decode_keepalive(message: bytes) -> tuple[int, int]:
    """``(ID, TTL)`` of a ``LeaseKeepAliveResponse`` (fields 2 and 3; a field proto3 left
    out is 0, and etcd answers a TTL of 0 for a lease that no longer exists). The
    header (field 1) is skipped; ValueError for anything that is not such a message."""
    fields = {2: 0, 3: 0}
    for number, kind, value in protobuf_fields(message):
        if kind not in (0, 2):
            raise ValueError(f"unexpected protobuf wire type {kind}")
        if number in fields and isinstance(value, int):
            fields[number] = value - (1 << 64) if value >= 1 << 63 else value
    return fields[2], fields[3]


def protobuf_fields(message: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` of each field of a protobuf message, in order:
    an int for a varint (type 0), the bytes for the others (2: length-delimited; 1 and 5:
    fixed 8 and 4 bytes). ValueError for a truncated or overlong varint, a field that runs
    past the message's end, or any other wire type (3 and 4, groups, which no message
    here has; 6 and 7, which do not exist)."""
    at = 0
    while at < len(message):
        key, at = read_varint(message, at)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, at = read_varint(message, at)
            yield number, kind, value
            continue
        if kind == 2:
            size, at = read_varint(message, at)
        elif kind in (1, 5):
            size = 8 if kind == 1 else 4
        else:
            raise ValueError(f"unexpected protobuf wire type {kind}")
        if at + size > len(message):
            raise ValueError("a field runs past the message's end")
        yield number, kind, message[at:at + size]
        at += size


def encode_varint(value: int) -> bytes:
    """A non-negative integer as a protobuf varint."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | 0x80 if value else low)
        if not value:
            return bytes(out)


def read_varint(buf: bytes, at: int) -> tuple[int, int]:
    """A protobuf varint at ``buf[at:]``: ``(value, the index after it)``; ValueError for
    one truncated or longer than 64 bits."""
    value = shift = 0
    while True:
        if at >= len(buf) or shift > 63:
            raise ValueError("a truncated or overlong varint")
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


class TlsOptions(Protocol):
    """What a stream needs of a client's options (``EtcdOptions`` has it)."""

    @property
    def protocol(self) -> str: ...
    @property
    def cacert(self) -> str | None: ...
    @property
    def cert(self) -> str | None: ...
    @property
    def key(self) -> str | None: ...


class KeepAliveStream:
    """One keepalive stream at a time, to one endpoint, held across renewals.

    Used by one thread at a time (the heartbeat sender, the writer's renewal thread),
    like a store client; it outlives that thread's store clients, which are made again
    after a failure, and is closed by its owner when it stops (:meth:`close`)."""

    @classmethod
    def for_options(cls, options: TlsOptions) -> KeepAliveStream:
        """A stream with the TLS files of a client's ``--rdzv-conf``."""
        return cls(cacert=options.cacert, cert=options.cert, key=options.key,
                   tls=options.protocol == "https")

    def __init__(self, *, cacert: str | None = None, cert: str | None = None,
                 key: str | None = None, tls: bool = False) -> None:
        self._tls = tls
        self._files = (cacert, cert, key)
        self._endpoint: str | None = None
        self._channel: Any = None
        self._call: Any = None
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[bytes | BaseException] = queue.SimpleQueue()
        self.opened = 0  # streams made (the tests count them)

    def renew(self, endpoint: str, lease: int, timeout_s: float) -> int:
        """Renew ``lease`` at ``endpoint`` (``host:port``): the TTL etcd left it, or -1
        when it no longer exists. RuntimeError saying why when no answer came within
        ``timeout_s`` (the caller names the endpoint). A late answer is no failure of the
        stream: it stays, and the next renewal on it takes the first answer for the lease
        that comes after its own request was sent (etcd answers in order, each as it
        renews, so that answer is a renewal made since)."""
        deadline = time.monotonic() + timeout_s
        if endpoint != self._endpoint:
            self.close()
            self._open(endpoint)
        else:  # a new stream has no earlier answers, and its failure is this renewal's
            self._drain(endpoint)
        self._outbox.put(encode_keepalive(lease))
        while True:
            try:
                answer = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"keepalive stream: no answer within {timeout_s:g} s"
                                   ) from None
            try:
                if isinstance(answer, BaseException):
                    raise RuntimeError(_described(answer))
                answered, ttl = decode_keepalive(answer)
            except (RuntimeError, ValueError) as error:
                self.close()
                raise RuntimeError(f"keepalive stream: {error}") from None
            if answered == lease:
                return ttl if ttl > 0 else -1
            # a late answer for a lease this beat held before (it expired and was
            # granted again): no news of this one

    def _drain(self, endpoint: str) -> None:
        """Drop the answers that came after their renewal gave up on them: they are older
        than the one the caller waits for. A stream that broke meanwhile is made again."""
        while True:
            try:
                answer = self._answers.get_nowait()
            except queue.Empty:
                return
            if isinstance(answer, BaseException):
                self.close()
                self._open(endpoint)
                return

    def close(self) -> None:
        """End the stream and its channel (idempotent)."""
        if self._call is not None:
            self._outbox.put(None)  # ends grpcio's read of the request iterator
            self._call.cancel()
        if self._channel is not None:
            self._channel.close()
        self._endpoint = self._channel = self._call = None

    def _open(self, endpoint: str) -> None:
        grpc = load_grpc()
        host, _, port = endpoint.rpartition(":")
        target = f"[{host}]:{port}" if ":" in host else endpoint
        # no proxy from the environment: etcd is reached directly, as by the gateway client
        options = [("grpc.enable_http_proxy", 0)]
        if self._tls:
            cacert, cert, key = (Path(f).read_bytes() if f else None for f in self._files)
            credentials = grpc.ssl_channel_credentials(cacert, key, cert)
            channel = grpc.secure_channel(target, credentials, options=options)
        else:
            channel = grpc.insecure_channel(target, options=options)
        outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        answers: queue.SimpleQueue[bytes | BaseException] = queue.SimpleQueue()
        method = channel.stream_stream(LEASE_KEEPALIVE, request_serializer=as_is,
                                       response_deserializer=as_is)
        call = method(drained(outbox))
        threading.Thread(target=_relay, args=(call, answers), daemon=True,
                         name="ftrun-etcd-keepalive").start()
        self._endpoint, self._channel, self._call = endpoint, channel, call
        self._outbox, self._answers = outbox, answers
        self.opened += 1


def load_grpc() -> Any:
    """grpcio, imported (once) with its fork support off.

    Why: with it on (grpcio's default), a fork re-creates gRPC's poller thread in the
    child, and the agent forks every worker (``subprocess`` with a ``preexec_fn``) while
    its keepalive streams run. The child closes its descriptors before its ``exec``;
    now and then the poller runs in that window, finds its epoll descriptor gone and
    aborts the process ("Epoll1Poller ... epoll_wait error: Bad file descriptor"): a
    worker killed by SIGABRT before it started (CI, twice in about 70 runs of
    ``test_netns_etcd_writer_killed_while_the_others_wait_for_a_generation``; 2 of 1,000
    children with a live stream, 0 of 1,400 with it off). Nothing in the agent uses gRPC
    in a forked child. grpcio reads ``GRPC_ENABLE_FORK_SUPPORT`` at its import, so it is
    set for the import alone (a value the user set is kept) and taken out again: workers
    get the agent's environment. The agent calls this (``election.join_etcd``) from its
    main thread before any heartbeat or worker starts, so no worker's environment is built
    meanwhile; its C core
    starts threads only with its first channel, in agents that renew leases.

    Threads may call this at once (a process with several lease beats): one imports and
    the others wait for its import to finish, never handed a module still being made (the
    ``import`` statement waits for another thread's import of the same module; a look in
    ``sys.modules`` does not)."""
    with _IMPORTING:  # one import sets and takes out the variable
        ours = "grpc" not in sys.modules and _FORK_SUPPORT not in os.environ
        if ours:
            os.environ[_FORK_SUPPORT] = "false"
        try:
            import grpc
        finally:
            if ours:
                os.environ.pop(_FORK_SUPPORT, None)
    return grpc


_FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"
_IMPORTING = threading.Lock()


def as_is(message: bytes) -> bytes:
    """grpcio's (de)serializer for messages encoded by hand: the bytes as they are."""
    return message


def drained(outbox: queue.SimpleQueue[bytes | None]) -> Iterator[bytes]:
    """A request stream for grpcio: what is put in ``outbox``, until a None ends it."""
    while (message := outbox.get()) is not None:
        yield message


def _relay(call: Any, answers: queue.SimpleQueue[bytes | BaseException]) -> None:
    """Hand each answer of ``call`` to the renewal waiting for it, then how it ended."""
    try:
        for answer in call:
            answers.put(answer)
        answers.put(RuntimeError("etcd ended the stream"))
    except Exception as error:  # grpc.RpcError: the renewal names it
        answers.put(error)


def _described(error: BaseException) -> str:
    """A gRPC error's code and details in one line (``UNAVAILABLE: failed to connect``)."""
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):
        name = getattr(code(), "name", str(code()))
        return f"{name}: {' '.join(str(details() or '').split())[:200]}"
    return " ".join(str(error).split())[:200] or type(error).__name__
