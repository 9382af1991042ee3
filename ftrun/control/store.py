"""The job's key-value store: torch's ``TCPStore``, served by one agent, read by all.

Two kinds of store exist in a job:

* the **control store**, hosted by the agent on the rendezvous host for the whole job: the
  generation records, joins, ends and shutdown of :mod:`ftrun.control.rendezvous`;
* one **worker store** per generation, hosted by the same agent on a fresh port, which the
  workers of that generation reach through ``MASTER_ADDR``/``MASTER_PORT`` with
  ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch then connects as a client and never hosts a
  store in rank 0). A fresh key space per generation is what makes a restart always work:
  the workers of generation N+1 can never read an address that a dead worker of generation
  N left behind (the failure mode of pytorch/pytorch#135712).

Both are served and reached with :mod:`ftrun.control.tcpstore`; this module reads and writes
them. Values in the control store are JSON objects, validated by their readers, never pickled.
Every call has an explicit timeout. Errors: connection problems raise :class:`StoreError`;
a value that is not the JSON object a reader expects, :class:`StoreValueError` naming it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ftrun.control.auth import AuthError, Signer
from ftrun.control.errors import StoreError, StoreValueError
from ftrun.control.tcpstore import first_line

if TYPE_CHECKING:
    from torch.distributed import TCPStore


class JsonStore:
    """Namespaced JSON records on a TCPStore, for the control plane.

    ``signer`` (see :mod:`ftrun.control.auth`) authenticates the control records written with
    :meth:`put_record`/:meth:`set_record` and read with :meth:`first_record`/
    :meth:`get_record`. ``reconnect``, given to clients of a remote store, replaces the
    connection after a failed request and retries it until ``retry_s`` has passed or
    ``lost()`` says the store host is gone. A TCPStore client whose request failed is
    never used again, even when the reconnect fails: its request may have timed out with
    the answer on its way, which the client would read as its next request's answer, and
    every answer after as another's: a ``check`` reads a wait's reply, a ``get`` reads a
    length from the middle of a value and torch allocates that much (``std::bad_alloc``,
    which ended agents at 512 nodes under load when the retry reused a failed client).
    :meth:`scoped` stores share one connection, so a reconnect in one is seen by all."""

    def __init__(
        self,
        store: TCPStore,
        prefix: str,
        *,
        signer: Signer | None = None,
        reconnect: Callable[[], TCPStore] | None = None,
        retry_s: float = 0.0,
        lost: Callable[[], bool] = lambda: False,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self._conn = _Connection(store)
        self.prefix = prefix.rstrip("/") + "/"
        self.signer = signer or Signer(None)
        self.reconnect = reconnect
        self.retry_s = retry_s
        self.lost = lost
        self.on_reject = on_reject
        self._rejected: set[str] = set()

    @property
    def raw(self) -> TCPStore:
        """The current client (after a failure: the failed one until a reconnect works)."""
        return self._conn.client

    @raw.setter
    def raw(self, client: TCPStore) -> None:
        self._conn.client = client
        self._conn.failed = False

    def key(self, name: str) -> str:
        return self.prefix + name

    def scoped(self, prefix: str) -> JsonStore:
        """The same store, secret and reconnection rules under another key prefix, on the
        same connection (a reconnect in either replaces it for both)."""
        child = JsonStore(self.raw, prefix, signer=self.signer, reconnect=self.reconnect,
                          retry_s=self.retry_s, lost=self.lost, on_reject=self.on_reject)
        child._conn = self._conn
        return child

    def with_client(self, client: TCPStore) -> JsonStore:
        """The same prefix and secret on another client, without reconnection: for a
        thread with a connection of its own, which reconnects itself."""
        return JsonStore(client, self.prefix, signer=self.signer, on_reject=self.on_reject)

    def set(self, name: str, value: dict[str, Any]) -> None:
        self._call("set", self.key(name), json.dumps(value, separators=(",", ":")))

    def set_first(self, name: str, value: dict[str, Any]) -> dict[str, Any]:
        """Write ``value`` unless the key exists; return whichever value won."""
        won = self._call(
            "compare_set", self.key(name), "", json.dumps(value, separators=(",", ":"))
        )
        return self._decode(name, won)

    def get(self, name: str) -> dict[str, Any] | None:
        """The record, or None when the key does not exist (never blocks)."""
        values = self._read_present([self.key(name)])
        return None if values is None else self._decode(name, values[0])

    def exists(self, name: str) -> bool:
        return bool(self._call("check", [self.key(name)]))

    def add(self, name: str, amount: int) -> int:
        return int(self._call("add", self.key(name), amount))

    # --- authenticated control records ----------------------------------------------------

    def put_record(self, name: str, body: dict[str, Any]) -> None:
        """Append a signed record to ``name``: the first valid record of a key wins.

        Appending (never overwriting) means a writer without the job's secret cannot
        replace or pre-empt a valid record: what it appends is skipped by every reader.
        """
        line = self.signer.line(self.key(name), body)
        self._call("append", self.key(name), "\n" + line)

    def first_record(self, name: str) -> dict[str, Any] | None:
        """The body of the first valid record appended to ``name``, or None."""
        values = self._read_present([self.key(name)])
        return None if values is None else self._first_valid(name, values[0])

    def set_record(self, name: str, body: dict[str, Any]) -> None:
        """Overwrite ``name`` with a signed record (heartbeats, slots, the latest pointer)."""
        line = self.signer.line(self.key(name), body)
        self._call("set", self.key(name), line)

    def get_record(self, name: str) -> dict[str, Any] | None:
        """The body of a record written with :meth:`set_record`; None if absent or invalid."""
        values = self._read_present([self.key(name)])
        return None if values is None else self.check_record(name, values[0])

    def set_records(self, bodies: dict[str, dict[str, Any]]) -> None:
        """Overwrite several keys with signed records in one request (torch's
        ``multi_set``): a generation's per-node assignments."""
        if not bodies:
            return
        keys = [self.key(name) for name in bodies]
        lines = [self.signer.line(key, body)
                 for key, body in zip(keys, bodies.values(), strict=True)]
        self._call("multi_set", keys, lines)

    def records_after(self, name: str, offset: int) -> tuple[list[dict[str, Any] | None], int]:
        """The records appended (:meth:`put_record`) to ``name`` past byte ``offset``, in
        order, and the offset after them: a reader that keeps the offset parses each record
        once (a ``check`` and a ``get``; None for a line that is not a valid record)."""
        values = self._read_present([self.key(name)])
        if values is None:
            return [], offset
        raw = values[0]
        lines = raw[offset:].split(b"\n")
        return [self.check_record(name, line) for line in lines if line.strip()], len(raw)

    def get_records(self, names: list[str],
                    seen: dict[str, tuple[bytes, dict[str, Any] | None]] | None = None
                    ) -> list[dict[str, Any] | None]:
        """Several :meth:`set_record` records in one round trip when all exist.

        ``seen``: the caller's cache between calls (name -> the bytes last read and their
        record, filled here): unchanged bytes are not parsed and verified again. A leader
        reads each node's beat 4 times a second (each changes once) and each member's
        status twice for each change; at 5,000 agents the beat scan took 133-305 ms of its
        250 ms before this. Cached records are the same objects each time: keep them."""
        if not names:
            return []
        values = self._read_present([self.key(n) for n in names])
        if values is not None:
            return self._checked(names, values, seen)
        return [self.get_record(n) for n in names]

    def _checked(self, names: list[str], values: list[bytes],
                 seen: dict[str, tuple[bytes, dict[str, Any] | None]] | None
                 ) -> list[dict[str, Any] | None]:
        if seen is None:
            return [self.check_record(n, v) for n, v in zip(names, values, strict=True)]
        found: list[dict[str, Any] | None] = []
        for name, value in zip(names, values, strict=True):
            last = seen.get(name)
            if last is None or last[0] != value:
                last = seen[name] = (value, self.check_record(name, value))
            found.append(last[1])
        return found

    def exist_all(self, names: list[str]) -> bool:
        """Whether every one of these keys exists (one round trip)."""
        return self._check([self.key(n) for n in names])

    def read_records(self, names: list[str],
                     seen: dict[str, tuple[bytes, dict[str, Any] | None]] | None = None
                     ) -> list[dict[str, Any] | None]:
        """:meth:`set_record` records of keys known to exist (torch's ``multi_get`` waits
        for a missing key: callers check first); ``seen`` as for :meth:`get_records`."""
        if not names:
            return []
        return self._checked(names, self._multi_get([self.key(n) for n in names]), seen)

    #: Keys per ``check`` or ``multi_get`` request. torch's TCPStore answers one request of
    #: n keys in time that grows faster than n: 4,096 keys took 0.136 s in one request and
    #: 0.011 s in requests of 512, 32,768 keys 2.7 s against 0.12 s (status records of
    #: 140 bytes on loopback); a leader reads every node's heartbeat and every member's
    #: status each tick (scripts/bench_member_statuses.py).
    KEYS_PER_REQUEST = 512

    def _check(self, keys: list[str]) -> bool:
        step = self.KEYS_PER_REQUEST
        return all(self._call("check", keys[i:i + step]) for i in range(0, len(keys), step))

    def _read_present(self, keys: list[str]) -> list[bytes] | None:
        """The values of ``keys`` when every one exists, else None.

        torch's ``get`` and ``multi_get`` wait for a missing key (the store's timeout,
        60 s in a job), so a read is made only where a ``check`` found the keys: on the
        connection that answered it. A read through :meth:`_call` could reconnect in
        between, and on etcd-v3 the new connection may reach the store that replaced the
        job's dead writer's, which holds none of them: a worker's read of a vote waited
        60 s there (5 steps lost), then of a step's decision (68.7 s). So when the
        connection changes between the check and the read, or the read fails, the check
        is made again on the new connection: a moved store answers None at once, the same
        store after a transient failure the values. StoreError as for any request: no
        reconnect, or none that holds for ``retry_s``."""
        again_until: float | None = None
        changes = 0
        while True:
            client = self.raw
            if not self._check(keys):
                return None
            if self.raw is not client:  # a reconnect during the check: look again there
                changes += 1
                if changes > 3:
                    raise StoreError("store request failed: the connection kept failing")
                continue
            try:
                return self._multi_get(keys, client)
            except (RuntimeError, ValueError) as error:  # torch's DistStoreError too
                detail = first_line(error)
                if self.reconnect is None:
                    raise StoreError(f"store request failed: {detail}") from None
                self._conn.failed = True
            now = time.monotonic()
            again_until = now + self.retry_s if again_until is None else again_until
            if now >= again_until:
                raise StoreError(f"store request failed: {detail}")

    def _multi_get(self, keys: list[str], client: TCPStore | None = None) -> list[bytes]:
        """Values of keys that exist; with ``client``, read there alone (no reconnect)."""
        parts = [keys[i:i + self.KEYS_PER_REQUEST]
                 for i in range(0, len(keys), self.KEYS_PER_REQUEST)]
        if client is None:
            return [value for part in parts for value in self._call("multi_get", part)]
        return [value for part in parts for value in client.multi_get(part)]

    def all_valid(self, names: list[str]) -> bool:
        """Whether each of ``names`` holds a valid record (votes, arrivals)."""
        values = self._read_present([self.key(n) for n in names])
        return values is not None and all(
            self.check_record(n, v) is not None for n, v in zip(names, values, strict=True))

    def present_records(self, names: list[str]) -> dict[str, dict[str, Any] | None]:
        """Name -> record (None when invalid) for those of ``names`` that exist.

        One ``check`` and one ``multi_get`` when all exist (the usual case); each missing
        key costs a binary search (``check`` answers for a whole list) for the longest run
        of existing keys before it."""
        found: dict[str, dict[str, Any] | None] = {}
        start = 0
        while start < len(names):
            end = len(names)
            if not self.exist_all(names[start:end]):
                good, bad = start, end  # names[start:good] all exist, [start:bad] do not
                while bad - good > 1:
                    mid = (good + bad) // 2
                    if self.exist_all(names[start:mid]):
                        good = mid
                    else:
                        bad = mid
                end = good  # names[end] does not exist
            chunk = names[start:end]
            values = self._read_present([self.key(n) for n in chunk])
            if values is None:
                continue  # not all there on the connection now (it moved): look again
            found.update(zip(chunk, self._checked(chunk, values, None), strict=True))
            start = end + 1
        return found

    def wait_for(self, name: str, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until ``name`` exists, in one server-side wait; False
        on timeout (torch's client cancels a timed-out wait in-protocol: the connection
        stays in step). Any other failure replaces the connection and returns False too,
        also when no new one can be made yet: the caller's loop, with its deadline and
        lost-store check, decides when to give up. StoreError only without ``reconnect``
        or once ``lost()``."""
        if not self._usable(timeout_s):
            return False
        try:
            self.raw.wait([self.key(name)], timedelta(seconds=max(timeout_s, 0.001)))
            return True
        except (RuntimeError, ValueError) as error:
            if "wait timeout after" not in str(error):
                self._wait_failed(error)
            return False

    def _wait_failed(self, error: BaseException) -> None:
        """A wait's request failed: StoreError without ``reconnect`` or once ``lost()``;
        else the connection is replaced (never used again, even if this reconnect fails)
        and the wait reads as a slice without news."""
        if self.reconnect is None or self.lost():
            raise StoreError(f"store request failed: {first_line(error)}") from None
        self._conn.failed = True
        self._usable(0.0)

    def wait_record(self, name: str, timeout_s: float) -> tuple[bool, dict[str, Any] | None]:
        """Block up to ``timeout_s`` until ``name`` exists, then read it, in one call
        (torch's ``get`` waits for its key with the client's timeout, here ``timeout_s``):
        (False, None) on timeout; (True, its first valid record, or None if none is: a
        :meth:`set_record` key holds one, an appended key several). One wake-up instead of
        two (a wait, then a get), which is what thousands of agents woken at once by their
        assignments pay. Errors as :meth:`wait_for`."""
        if not self._usable(timeout_s):
            return False, None
        client = self.raw
        bound = client.timeout
        client.set_timeout(timedelta(seconds=max(timeout_s, 0.001)))
        try:
            raw = client.get(self.key(name))
        except (RuntimeError, ValueError) as error:
            if "wait timeout after" not in str(error):
                self._wait_failed(error)
            return False, None
        finally:
            if not self._conn.failed and client is self.raw:
                client.set_timeout(bound)
        return True, self._first_valid(name, raw)

    def wait_any(self, names: list[str], timeout_s: float
                 ) -> tuple[str, dict[str, Any] | None] | None:
        """The first of ``names`` that exists or is written within ``timeout_s``, with its
        first valid record (None: none valid yet); None when none was. On etcd-v3 one
        watch of every name, held across calls (``EtcdClient.wait_any``: a slice costs etcd
        no request); on a TCPStore a wait for the first name, then a check of each other.
        Errors as :meth:`wait_for`: a failed request is a slice without news."""
        if not hasattr(self.raw, "wait_any"):
            found, body = self.wait_record(names[0], timeout_s)
            if found:
                return names[0], body
            present = next((n for n in names[1:] if self.exists(n)), None)
            return None if present is None else (present, self.first_record(present))
        if not self._usable(timeout_s):
            return None
        try:
            hit = self.raw.wait_any([self.key(n) for n in names], timeout_s)
        except (RuntimeError, ValueError) as error:
            self._wait_failed(error)
            return None
        if hit is None:
            return None
        name = names[hit[0]]
        if hit[1] is not None:
            return name, self._first_valid(name, hit[1])
        try:
            return name, self.first_record(name)
        except StoreError:
            if self.reconnect is None or self.lost():
                raise
            return None

    def arm_wait(self, names: list[str]) -> None:
        """Begin :meth:`wait_any` of ``names`` before the write it waits on an answer to (a
        join's offer), on etcd-v3: its watch and read done, etcd has only the answer to send."""
        if hasattr(self.raw, "wait_any"):
            self.wait_any(names, 0.0)

    def close_waits(self) -> None:
        """End a held :meth:`wait_any` (etcd-v3: its stream) whose caller is done waiting."""
        getattr(self.raw, "close_waits", lambda: None)()

    def check_record(self, name: str, raw: bytes) -> dict[str, Any] | None:
        try:
            return self.signer.unwrap_line(self.key(name), raw)
        except (AuthError, UnicodeDecodeError, json.JSONDecodeError) as error:
            self._reject(name, str(error))
            return None

    def _first_valid(self, name: str, raw: bytes) -> dict[str, Any] | None:
        for line in raw.split(b"\n"):
            if not line.strip():
                continue
            body = self.check_record(name, line)
            if body is not None:
                return body
        return None

    def _reject(self, name: str, why: str) -> None:
        if self.on_reject is not None and name not in self._rejected:
            self._rejected.add(name)
            self.on_reject(f"ignored a control record: {why}")

    # --- plumbing -------------------------------------------------------------------------

    def _decode(self, name: str, raw: bytes) -> dict[str, Any]:
        try:
            value = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise StoreValueError(f"store key {self.key(name)!r} is not JSON") from None
        if not isinstance(value, dict):
            raise StoreValueError(f"store key {self.key(name)!r} is not a JSON object")
        return value

    def _usable(self, pause_s: float) -> bool:
        """Whether the connection can be used, replacing a failed one first; a reconnect
        that fails is not an error here (see :meth:`wait_for`): False after a pause of up
        to ``pause_s`` (a waiting loop does not spin), StoreError once ``lost()``."""
        if not self._conn.failed:
            return True
        if self.reconnect is None or self.lost():
            raise StoreError("store request failed: the store host is lost")
        try:
            self._replace_client()
            return True
        except StoreError:
            time.sleep(min(max(pause_s, 0.0), 0.5))
            return False

    def _replace_client(self) -> None:
        """A new connection in place of a failed one; StoreError if it cannot be made (the
        failed one stays marked, so the next request tries again instead of using it)."""
        assert self.reconnect is not None
        failed, self.raw = self.raw, self.reconnect()
        getattr(failed, "close_waits", lambda: None)()  # a held wait's stream with it

    def _call(self, method: str, *args: Any) -> Any:
        first_failure: float | None = None
        detail = "the last request failed and no new connection could be made yet"
        while True:
            if not self._conn.failed:
                try:
                    return getattr(self.raw, method)(*args)
                except (RuntimeError, ValueError) as error:  # torch's DistStoreError too
                    detail = first_line(error)
                    if self.reconnect is not None:
                        self._conn.failed = True
            now = time.monotonic()
            first_failure = first_failure if first_failure is not None else now
            if self.reconnect is None or self.lost() or now - first_failure >= self.retry_s:
                raise StoreError(f"store request failed: {detail}") from None
            try:
                self._replace_client()
            except StoreError as error:
                detail = str(error)
                time.sleep(0.05)


class _Connection:
    """One store client shared by a JsonStore and its :meth:`~JsonStore.scoped` views;
    ``failed``: its last request failed, so it must not be used again."""

    __slots__ = ("client", "failed")

    def __init__(self, client: TCPStore) -> None:
        self.client = client
        self.failed = False
