"""The control store on an etcd v3 cluster (``--rdzv-backend etcd-v3``).

Why: with the default backend the control store is a ``TCPStore`` served by one agent, so
losing that host ends the job. Sites that run jobs on many nodes already run etcd, a
replicated store with no single point of failure; torchrun's own etcd backend speaks the
deprecated v2 API. This module gives the agent the operations it already uses on a
``TCPStore`` client (``set``, ``get``, ``compare_set``, ``add``, ``append``, ``check``,
``multi_get``, ``multi_set``, ``wait``, ``delete_key``, ``timeout``/``set_timeout``), so
:class:`~ftrun.control.store.JsonStore` and everything above it (signed JSON records,
rendezvous, heartbeats, end watches) run unchanged on etcd:

* ``add`` and ``compare_set`` are etcd transactions guarded by the key's ``mod_revision``
  (retried when another writer got in between);
* ``append`` writes a part key of its own (the key, a NUL byte, a random id) in one
  request, never contended; a read of the key is its value and then its parts' in the
  order etcd created them (one range request over ``key`` .. ``key\x01``). A read-modify-
  write of one growing key made N concurrent appends cost O(N^2) retries and bytes (512
  agents offering their slots at once never finished);
* ``check`` and ``multi_get`` are one transaction each (one round trip for many keys);
* ``wait`` (and ``get`` of a missing key, which waits as torch's does) is a watch from the
  revision just after the read that found the key missing, so no write is missed, bounded
  by the timeout; the next wait of the key watches from there with no read (its slices);
* every key lives under the job's key prefix (``etcd_prefix`` in ``--rdzv-conf``).

The client is etcd3gw (etcd's v3 JSON gateway, ``/v3/`` on etcd 3.4+, its path found by
etcd3gw once per endpoint); a lease's renewals alone go on etcd's gRPC keepalive stream
(:mod:`ftrun.control.etcdkeepalive`, a fifth of the member's work). Failover: the client
talks to one endpoint at a time and moves to the next when a request to it fails (refused,
reset, timed out, a member without quorum); a request fails when every endpoint failed it.
The job's single writer is elected on this store: :mod:`ftrun.control.election`.

Timeouts and errors: every request is bounded by the client's timeout (connect and read);
one that no endpoint answered raises ``RuntimeError`` naming each endpoint and why, as
torch's store client does, so :class:`~ftrun.control.store.JsonStore` turns it into a
:class:`~ftrun.control.errors.StoreError` and applies its reconnection rules. A wait that
times out raises ``RuntimeError('wait timeout after ...')`` (torch's words: "not yet").
Bad options raise :class:`EtcdConfigError` with one line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from itertools import chain
from typing import Any, TypeVar

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client

from ftrun.control import etcdwire as wire
from ftrun.control.errors import StoreError
from ftrun.control.etcdheld import (
    BoundedSession,
    HeldWaits,
    freshest,
    note_answer,
    note_failure,
)
from ftrun.control.etcdkeepalive import KeepAliveStream

T = TypeVar("T")
DEFAULT_PREFIX = "/ftrun"
DEFAULT_ETCD_PORT = 2379
# What a key's prefix may hold: a path of printable ASCII without spaces.
_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/_-.:")
# Tries of a read-modify-write transaction before giving up (each lost try means another
# writer changed the key in between: a handful is already an unusual pile-up).
_CAS_TRIES = 200


class EtcdConfigError(ValueError):
    """An ``--rdzv-endpoint``/``--rdzv-conf`` value the etcd backend cannot use (one line)."""


@dataclass(frozen=True)
class EtcdOptions:
    """Where the cluster is and how to talk to it (torchrun's etcd options)."""

    endpoints: tuple[tuple[str, int], ...]
    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    prefix: str = DEFAULT_PREFIX

    @classmethod
    def parse(cls, endpoint: str, conf: Mapping[str, str]) -> EtcdOptions:
        """``host1:2379,host2:2379`` and ``protocol``, ``cacert``, ``cert``, ``key``,
        ``etcd_prefix`` from ``--rdzv-conf``; EtcdConfigError naming the bad value."""
        endpoints: list[tuple[str, int]] = []
        for part in (p.strip() for p in endpoint.split(",")):
            if not part:
                continue
            try:
                endpoints.append(wire.host_port(part, DEFAULT_ETCD_PORT))
            except ValueError as error:  # one line naming the value
                raise EtcdConfigError(str(error)) from None
        if not endpoints:
            raise EtcdConfigError("--rdzv-endpoint: the etcd-v3 backend needs HOST[:PORT],... "
                                  "(the etcd cluster's client endpoints)")
        protocol = conf.get("protocol", "http").strip().lower()
        if protocol not in ("http", "https"):
            raise EtcdConfigError(f"--rdzv-conf protocol={protocol!r}: expected http or https")
        files: dict[str, str | None] = {}
        for name in ("cacert", "cert", "key"):
            value = conf.get(name)
            if value is not None and not os.path.isfile(value):
                raise EtcdConfigError(f"--rdzv-conf {name}={value!r}: no such file")
            files[name] = value
        if (files["cert"] is None) != (files["key"] is None):
            raise EtcdConfigError("--rdzv-conf: cert and key go together (a client "
                                  "certificate and its private key)")
        if protocol == "http" and any(files.values()):
            raise EtcdConfigError("--rdzv-conf: cacert, cert and key need protocol=https")
        prefix = conf.get("etcd_prefix", DEFAULT_PREFIX).strip()
        if not prefix.startswith("/") or not set(prefix) <= _PREFIX_CHARS or "//" in prefix:
            raise EtcdConfigError(f"--rdzv-conf etcd_prefix={prefix!r}: expected a path such "
                                  "as /ftrun (letters, digits, / _ - . :)")
        return cls(tuple(endpoints), protocol, files["cacert"], files["cert"], files["key"],
                   prefix.rstrip("/") or "/")

    def describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)


class EtcdClient:
    """One connection's worth of the store, with ``TCPStore``'s client operations (see the
    module docstring). Like a ``TCPStore`` client it is used by one thread at a time: each
    thread that needs the store opens its own (:func:`connect_etcd`)."""

    #: heartbeats on this store are leases (ftrun/control/heartbeat.py asks; TCPStore has none)
    leases = True
    stream: requests.Response | None = None  # watch_prefix's last (LeaseView.stop ends it)

    def __init__(self, options: EtcdOptions, timeout_s: float, *,
                 connect_timeout_s: float | None = None) -> None:
        self.options = options
        self._timeout_s = timeout_s
        self._connect_s = min(timeout_s, connect_timeout_s or timeout_s)
        self._clients: list[Etcd3Client] = []
        for host, port in options.endpoints:
            session = BoundedSession((self._connect_s, timeout_s))
            if options.cacert is not None:
                session.verify = options.cacert
            if options.cert is not None and options.key is not None:
                session.cert = (options.cert, options.key)
            self._clients.append(Etcd3Client(host=host, port=port, protocol=options.protocol,
                                             timeout=(self._connect_s, timeout_s),  # type: ignore[arg-type]
                                             session=session))
        self._current = freshest([f"{h}:{p}" for h, p in options.endpoints])
        self._root = options.prefix.rstrip("/").encode() + b"/"
        self._appended = wire.AppendedReads()
        self._missed = wire.MissedAt()  # a renewed wait's watch needs no read first
        self._helpers: list[EtcdClient] = []  # multi_set's other connections
        self._held = HeldWaits(lambda: (self.endpoint, self._clients[self._current]),
                               self._txn, self._failed_over, self._connect_s)

    # --- torch's TCPStore surface ---------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: timedelta) -> None:
        """The bound on a ``get`` of a missing key, as torch's (requests keep their own)."""
        self._get_wait_s = timeout.total_seconds()

    _get_wait_s: float | None = None

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to now."""
        host, port = self.options.endpoints[self._current]
        return f"{host}:{port}"

    def set(self, key: str, value: str | bytes) -> None:
        """Replace the value (appended parts included: gone, as with torch's ``set``)."""
        ekey = self._root + key.encode()
        self._txn([], [{"request_delete_range": {"key": wire.b64(ekey + wire.PART),
                                                 "range_end": wire.b64(ekey + wire.PARTS_END)}},
                       {"request_put": {"key": wire.b64(ekey), "value": wire.b64(value)}}], [])

    def get(self, key: str) -> bytes:
        """The value; a missing key is waited for up to the timeout (as torch's ``get``)."""
        wait_s = self._get_wait_s if self._get_wait_s is not None else self._timeout_s
        return self._until_written(key, time.monotonic() + wait_s)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists (a value or an appended part), in one transaction per
        ``wire.TXN_OPS`` keys."""
        responses = self._reads([{**self._span(k), "count_only": True} for k in keys])
        counts = [int(r.get("response_range", {}).get("count", 0)) for r in responses]
        return len(counts) == len(keys) and all(counts)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of keys that exist, in one transaction per ``wire.TXN_OPS`` keys (a
        missing key: RuntimeError, callers check first, as with torch whose ``multi_get``
        would wait)."""
        values: list[bytes] = []
        for name, response in zip(keys, self._reads([self._span(k) for k in keys]), strict=False):
            kvs = response.get("response_range", {}).get("kvs") or []
            if not kvs:
                raise RuntimeError(f"etcd: key {name!r} does not exist")
            values.append(wire.joined(kvs))
        if len(values) != len(keys):
            raise RuntimeError("etcd: a transaction answered fewer reads than asked")
        return values

    #: A ``multi_set``'s transactions in flight at once, each on a connection of its own.
    PARALLEL_TXNS = 4

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """``set`` of each key, in transactions of at most ``wire.TXN_OPS`` keys, up to
        ``PARALLEL_TXNS`` at once (this client and helper clients of the same options, made
        on first use). Each request is bounded as the client's; RuntimeError (the first
        failure) when any transaction failed on every endpoint: some keys may be set."""
        pairs = list(zip(keys, values, strict=True))
        chunks = [[{"request_put": {"key": self._key(k), "value": wire.b64(v)}}
                   for k, v in pairs[start:start + wire.TXN_OPS]]
                  for start in range(0, len(pairs), wire.TXN_OPS)]
        while len(self._helpers) < min(len(chunks), self.PARALLEL_TXNS) - 1:
            self._helpers.append(EtcdClient(self.options, self._timeout_s,
                                            connect_timeout_s=self._connect_s))
        clients = [self, *self._helpers][:max(1, min(len(chunks), self.PARALLEL_TXNS))]
        failures: list[BaseException] = []

        def put(k: int) -> None:
            clients[k]._current = self._current  # start where this client is
            try:
                for chunk in chunks[k::len(clients)]:
                    clients[k]._txn([], chunk, [])
            except RuntimeError as error:
                failures.append(error)
        threads = [threading.Thread(target=put, args=(k,)) for k in range(1, len(clients))]
        for thread in threads:
            thread.start()
        put(0)
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """torch's semantics: write ``desired`` if the key holds ``expected`` (or, with an
        empty ``expected``, if it does not exist); return the value the key then holds."""
        ekey = self._key(key)
        expected_b = expected.encode() if isinstance(expected, str) else expected
        if expected_b:
            compare = [{"key": ekey, "target": "VALUE", "result": "EQUAL",
                        "value": wire.b64(expected_b)}]
        else:
            compare = [{"key": ekey, "target": "CREATE", "result": "EQUAL",
                        "create_revision": "0"}]
        result = self._txn(compare, [{"request_put": {"key": ekey, "value": wire.b64(desired)}}],
                           [{"request_range": {"key": ekey}}])
        if result.get("succeeded"):
            return desired.encode() if isinstance(desired, str) else desired
        kvs = (result.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        # torch returns ``expected`` when the key is missing and expected is not empty
        return wire.unb64(kvs[0].get("value", "")) if kvs else expected_b

    def add(self, key: str, amount: int) -> int:
        """Add to the integer the key holds (0 if missing); the new value."""
        def change(old: bytes | None) -> bytes:
            try:
                base = int(old) if old is not None else 0
            except ValueError:
                raise RuntimeError(f"etcd: key {key!r} does not hold an integer") from None
            return str(base + amount).encode()
        return int(self._read_modify_write(key, change))

    def append(self, key: str, value: str | bytes) -> None:
        """One part key of its own (see the module docstring): one request, no contention.
        The id is random: a retried request that had landed adds its part twice, which
        readers of appended records already tolerate (the first valid record wins)."""
        part = self._root + key.encode() + wire.PART + os.urandom(8).hex().encode()
        self._post("/kv/put", {"key": wire.b64(part), "value": wire.b64(value)})

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; RuntimeError('wait timeout after ...') on timeout."""
        deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None
                                       else self._timeout_s)
        for key in keys:
            self._until_written(key, deadline)

    def wait_any(self, keys: list[str], timeout_s: float) -> tuple[int, bytes | None] | None:
        """The first of ``keys`` that exists or is written within ``timeout_s``: (its index,
        its value, or None when only a read tells it); None when none was. One watch stream
        of every key, held across calls for the same keys (:mod:`ftrun.control.etcdheld`)."""
        return self._held.wait([self._root + key.encode() for key in keys], timeout_s)

    def close_waits(self) -> None:
        """End ``wait_any``'s held stream now (else it lasts until its first event or its
        hold): the caller's wait is over."""
        self._held.close()

    def delete_key(self, key: str) -> bool:
        result = self._post("/kv/deleterange", self._span(key))
        return int(result.get("deleted", 0)) > 0

    def list_keys(self) -> list[str]:
        """Every key under the job's prefix, without it (a key with appended parts once)."""
        result = self._post("/kv/range", {"key": wire.b64(self._root),
                                          "range_end": wire.b64(wire.next_key(self._root)),
                                          "keys_only": True})
        names = [wire.unb64(kv["key"])[len(self._root):].partition(wire.PART)[0]
                 .decode(errors="replace") for kv in result.get("kvs") or []]
        return list(dict.fromkeys(names))

    def read(self, key: str) -> bytes | None:
        """The value, or None when the key does not exist (never waits)."""
        return self._range(key)[0]

    # --- leases (the election and heartbeats) ---------------------------------------------

    def grant_ttl(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted: at least its minimum, 2 s with
        etcd's default election timeout, whatever was asked)."""
        result = self._post("/lease/grant", {"TTL": int(ttl_s), "ID": 0})
        return int(result["ID"]), int(result.get("TTL", ttl_s))

    def time_to_live(self, lease: int) -> int:
        """Whole seconds the lease has left (0: under one, alive), or -1 when etcd does not
        hold it (expired or revoked: the answer lacks ``grantedTTL``; the gateway omits a
        TTL of 0). One request; it reads the lease, it does not renew it."""
        result = self._post("/lease/timetolive", {"ID": lease})
        return max(0, int(result.get("TTL", 0))) if "grantedTTL" in result else -1

    def put_leased(self, key: str, value: str | bytes, lease: int) -> None:
        """Put ``value`` bound to ``lease``: etcd deletes the key when the lease ends."""
        self._post("/kv/put", {"key": self._key(key), "value": wire.b64(value),
                               "lease": str(lease)})

    def range_prefix(self, prefix: str) -> tuple[list[tuple[str, bytes, int]], int]:
        """Every key that starts with ``prefix`` (without the job's root): [(key, value,
        lease or 0)], and the store's revision at the read."""
        start = self._root + prefix.encode()
        result = self._post("/kv/range", {"key": wire.b64(start),
                                          "range_end": wire.b64(wire.next_key(start))})
        found = [(wire.unb64(kv["key"])[len(self._root):].decode(errors="replace"),
                  wire.unb64(kv.get("value", "")), int(kv.get("lease", 0)))
                 for kv in result.get("kvs") or []]
        return found, int(result.get("header", {}).get("revision", 0))

    def watch_prefix(self, prefix: str, start_revision: int, slice_s: float,
                     on_event: Callable[[str, bytes | None, int], None],
                     on_synced: Callable[[], None]) -> tuple[int, int]:
        """Stream the changes of the keys under ``prefix`` from ``start_revision`` for
        ``slice_s``: ``on_event(key, value or None for a delete, lease)`` for each,
        ``on_synced()`` when etcd confirmed the watch (its "created" answer) and after each
        batch of events. Returns the revision to watch from next and the store's revision
        when the watch was created. One request (one stream) per slice. RuntimeError when
        the endpoint failed (the next request goes to the next endpoint), its "created"
        answer never came (a frozen or cut-off member: its timeouts would otherwise pass
        for an idle slice), or the start revision was compacted: the caller reads again."""
        client = self._clients[self._current]
        start = self._root + prefix.encode()
        request = {"create_request": {"key": wire.b64(start),
                                      "range_end": wire.b64(wire.next_key(start)),
                                      "start_revision": start_revision}}
        deadline = time.monotonic() + slice_s
        following, created = start_revision, 0
        try:
            with client.session.post(client.get_url("/watch"), json=request, stream=True,
                                     timeout=(self._connect_s, min(slice_s, self._timeout_s))
                                     ) as response:
                self.stream = response  # LeaseView.stop ends its wait (urllib3's shutdown)
                if response.status_code != requests.codes["ok"]:
                    raise RuntimeError(f"HTTP {response.status_code} {response.reason}")
                for line in response.iter_lines():
                    result = (json.loads(line).get("result") or {}) if line.strip() else {}
                    if result.get("canceled"):
                        raise RuntimeError(f"watch canceled (compacted to revision "
                                           f"{result.get('compact_revision', '?')})")
                    for event in result.get("events") or []:
                        kv = event.get("kv") or {}
                        key = wire.unb64(kv.get("key", ""))[len(self._root):].decode(
                            errors="replace")
                        value = None if event.get("type") == "DELETE" else \
                            wire.unb64(kv.get("value", ""))
                        on_event(key, value, int(kv.get("lease", 0)))
                        following = max(following, int(kv.get("mod_revision", 0)) + 1)
                    if result.get("created"):
                        created = int((result.get("header") or {}).get("revision", 0)) or 1
                    if created and (result.get("created") or result.get("events")):
                        on_synced()
                    if time.monotonic() >= deadline:
                        break
                if not created:
                    raise RuntimeError("the stream ended before etcd said it was created")
        except (etcd_errors.Etcd3Exception, requests.RequestException, ValueError,
                RuntimeError) as error:
            # an idle stream ends by the read timeout at the slice's end (requests raises
            # it as a ConnectionError from inside a stream); sooner, or uncreated: failed
            if time.monotonic() < deadline - 0.05 or not created:
                failed = self.endpoint
                self._current = (self._current + 1) % len(self._clients)
                raise RuntimeError(f"etcd watch at {failed}: {wire.short(error)}") from None
        return following, created

    def keep_alive(self, lease: int, stream: KeepAliveStream) -> int:
        """Renew the lease on the caller's gRPC ``stream``, held across renewals and clients
        (:mod:`ftrun.control.etcdkeepalive`); its TTL left, or -1 when it has expired."""
        return self._on_each_endpoint(
            "a keepalive", lambda _: stream.renew(self.endpoint, lease, self._timeout_s))

    def revoke(self, lease: int) -> None:
        self._post("/kv/lease/revoke", {"ID": lease})

    def drop_idle(self) -> None:
        """Close the idle gateway connections (the next request makes one again)."""
        for client in self._clients:
            client.session.close()

    def create_with_lease(self, key: str, value: str | bytes, lease: int) -> bytes:
        """Put ``value`` bound to ``lease`` if the key does not exist; the value it holds."""
        ekey = self._key(key)
        result = self._txn([{"key": ekey, "target": "CREATE", "result": "EQUAL",
                             "create_revision": "0"}],
                           [{"request_put": {"key": ekey, "value": wire.b64(value),
                                             "lease": str(lease)}}],
                           [{"request_range": {"key": ekey}}])
        if result.get("succeeded"):
            return value.encode() if isinstance(value, str) else value
        kvs = (result.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        return wire.unb64(kvs[0].get("value", "")) if kvs else b""

    # --- plumbing -------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return wire.b64(self._root + key.encode())

    def _span(self, key: str) -> dict[str, Any]:
        """A range over ``key`` and its appended parts, oldest first."""
        return wire.span(self._root + key.encode())

    def _range(self, key: str) -> tuple[bytes | None, int]:
        """(value or None, the store's revision at the read): ``etcdwire.AppendedReads``."""
        ekey = self._root + key.encode()
        for _ in range(2):  # the second, if any, is a whole read
            result = self._post("/kv/range", self._appended.request(ekey))
            usable, value = self._appended.answer(ekey, result)
            if usable:
                return value, int(result.get("header", {}).get("revision", 0))
        raise RuntimeError(f"etcd: a range of {key!r} answered fewer keys than it counted")

    def _read_modify_write(self, key: str, change: Callable[[bytes | None], bytes]) -> bytes:
        ekey = self._key(key)
        for _ in range(_CAS_TRIES):
            result = self._post("/kv/range", {"key": ekey})
            kvs = result.get("kvs") or []
            old = wire.unb64(kvs[0].get("value", "")) if kvs else None
            new = change(old)
            guard = {"key": ekey, "result": "EQUAL", "target": "MOD" if kvs else "CREATE",
                     "mod_revision" if kvs else "create_revision":
                         str(kvs[0]["mod_revision"]) if kvs else "0"}
            done = self._txn([guard], [{"request_put": {"key": ekey, "value": wire.b64(new)}}], [])
            if done.get("succeeded"):
                return new
        raise RuntimeError(f"etcd: key {key!r} changed under {_CAS_TRIES} tries of an update")

    def _until_written(self, key: str, deadline: float) -> bytes:
        """The key's value once it exists: a read, and while it is missing a watch from the
        revision after it; no read where the last wait found it missing (``etcdwire.
        MissedAt``: a fact that no failure undoes). RuntimeError('wait timeout after ...')
        at the deadline; other RuntimeErrors as the requests'."""
        ekey = self._root + key.encode()
        while True:
            revision = self._missed.since(ekey, self._current, time.monotonic())
            stream = wire.WaitStream(ekey, replay=revision is not None)
            if revision is None:
                found, revision = self._range(key)
                if found is not None:
                    return found
                self._missed.hold(ekey, revision, self._current, time.monotonic())
            try:
                found = self._watch_create(key, revision, deadline, stream)
            except RuntimeError:  # a timeout: kept unless the store moved far on
                self._missed.moved(ekey, stream.created)
                raise
            self._missed.forget(ekey)  # written, canceled (compacted) or failed over: read
            if found is not None:
                return found

    def _watch_create(self, key: str, revision: int, deadline: float,
                      stream: wire.WaitStream) -> bytes | None:
        """Return once ``key`` is written after ``revision`` (or something else happened to
        it: the caller reads again): the key's value when the watch's event tells it whole
        (``stream``: ``etcdwire.WaitStream`` says when), else None;
        RuntimeError('wait timeout after ...') at the deadline.

        The watch stream (the gateway's ``/watch``, at the URL etcd3gw discovered) is read
        in the calling thread until its first event: one stream per waiting client and no
        thread. etcd3gw's own ``watch_once`` starts a thread pool and a thread for every
        wait (4.7 ms of client CPU each, measured), which starved hundreds of agents of a
        process (bench_multinode's light rendezvous on etcd failed at 128). The gateway ends
        the stream itself at the deadline (``Grpc-Timeout``), so the connection is reused."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"wait timeout after {int(left * 1000)}ms (etcd key {key!r})")
        client = self._clients[self._current]
        span = self._span(key)
        request = {"create_request": {"key": span["key"], "range_end": span["range_end"],
                                      "start_revision": revision + 1}}
        pending = b""
        try:
            with client.session.post(client.get_url("/watch"), json=request, stream=True,
                                     headers={"Grpc-Timeout": f"{max(1, int(left * 1000))}m"},
                                     timeout=(self._connect_s, left + 0.5)) as response:
                if response.status_code not in (200, 504):  # 504: the deadline, its body
                    self._failed_over(f"watch: HTTP {response.status_code} {response.reason}")
                    return None
                for chunk in chain(response.iter_content(chunk_size=None), [b"\n"]):
                    *lines, pending = (pending + chunk).split(b"\n")  # the last: no newline
                    for message in (json.loads(line) for line in lines if line.strip()):
                        over, value = stream.take(message)  # written or canceled: over
                        if over:
                            return value
                    if time.monotonic() >= deadline + 0.5:  # messages but no end: bounded
                        break
        except (etcd_errors.Etcd3Exception, requests.RequestException, ValueError) as error:
            # nothing written within the wait: a read timeout (requests raises it as a
            # ConnectionError from inside a stream) at the deadline; else the endpoint failed
            if time.monotonic() < deadline - 0.05:
                self._failed_over(f"watch: {wire.short(error)}")
                return None
        if not stream.ended and time.monotonic() < deadline:
            self._failed_over("watch: the stream ended")
            return None
        raise RuntimeError(f"wait timeout after {int(left * 1000)}ms (etcd key {key!r})")

    def _reads(self, ranges: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The responses of range requests, in transactions of at most ``wire.TXN_OPS`` (etcd's
        default ``--max-txn-ops``: a leader's read of 512 heartbeats in one was refused)."""
        responses: list[dict[str, Any]] = []
        for start in range(0, len(ranges), wire.TXN_OPS):
            part = ranges[start:start + wire.TXN_OPS]
            result = self._txn([], [{"request_range": r} for r in part], [])
            responses.extend(result.get("responses") or [])
        return responses

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]]) -> dict[str, Any]:
        return self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure})

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        return self._on_each_endpoint(path, lambda c: dict(c.post(c.get_url(path), json=payload)))

    def _on_each_endpoint(self, what: str, attempt: Callable[[Etcd3Client], T]) -> T:
        """One request, to each endpoint in turn from the current one until one answers
        (a ``RuntimeError`` of ``attempt`` is a failure in transport, as a keepalive's)."""
        failures: list[str] = []
        for _ in range(len(self._clients)):
            try:
                answer = attempt(self._clients[self._current])
                note_answer(self.endpoint)
                return answer
            except etcd_errors.PreconditionFailedError as error:
                raise RuntimeError(f"etcd refused {what}: {wire.short(error)}") from None
            except (etcd_errors.Etcd3Exception, requests.RequestException, ValueError,
                    RuntimeError) as error:
                failures.append(f"{self.endpoint}: {wire.short(error)}")
                note_failure(self.endpoint, None if isinstance(error, RuntimeError) else error)
                self._current = (self._current + 1) % len(self._clients)
        raise RuntimeError("no etcd endpoint answered (" + "; ".join(failures) + ")")

    def _failed_over(self, why: str) -> None:
        """A watch on the current endpoint failed: the next request goes to the next one (the
        caller reads again, so nothing is lost)."""
        note_failure(self.endpoint)
        self._current = (self._current + 1) % len(self._clients)
        if len(self._clients) == 1:
            raise RuntimeError(f"etcd {why}")


def connect_etcd(options: EtcdOptions, timeout_s: float, *, op_timeout_s: float | None = None,
                 interrupted: Callable[[], bool] = lambda: False) -> EtcdClient:
    """A client that has reached one endpoint: tried in turn until ``timeout_s`` has passed
    or ``interrupted()`` (then :class:`~ftrun.control.errors.StoreError` naming every
    endpoint and why, as :func:`~ftrun.control.tcpstore.connect_store` raises: this is also
    :class:`~ftrun.control.store.JsonStore`'s reconnect); each request is then bounded by
    ``op_timeout_s`` (default ``timeout_s``)."""
    op = op_timeout_s if op_timeout_s is not None else timeout_s
    client = EtcdClient(options, op, connect_timeout_s=min(op, 2.0))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client._post("/maintenance/status", {})
            return client
        except RuntimeError as error:
            if time.monotonic() >= deadline or interrupted():
                raise StoreError(f"cannot reach etcd at {options.describe()} within "
                                 f"{timeout_s:g} s: {error}") from None
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
