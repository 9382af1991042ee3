"""The etcd v3 JSON gateway's wire details for :mod:`ftrun.control.etcd`: base64 keys and
values, how an appended key is laid out, error lines, and the two reads that keep a
rendezvous of thousands of agents cheap for etcd (split out of ``etcd.py``, which holds the
client's operations).

Why the two reads (measured with ``scripts/bench_multinode.py --only rendezvous-light-etcd
--light-harness events``, docs/scale.md):

* :class:`AppendedReads`: the leader reads a generation's slots list (one appended key:
  its value and a part key per agent) every poll while agents offer. A full read returned
  every part each time, so 4,096 offers cost the gateway O(N^2) bytes of JSON. A reader
  that keeps what it read asks only for the key's parts modified after the revision of its
  last read (``min_mod_revision``) and appends them, when etcd's count of the whole range
  shows that nothing it holds was deleted and none of what came back is an older part
  that changed; otherwise it reads the whole key again.
* :func:`watched_value`: an agent waiting for its assignment reads the key, finds it
  missing, and watches it from the revision after that read. The watch's event holds the
  value the leader wrote; when the first change is a single put of the key itself, that
  value is the key's whole value at that revision (the range was empty before it), so the
  wait needs no second read on a new connection (a stream is ended only by closing its
  connection).
* :class:`MissedAt` and :class:`WaitStream`: a wait in slices (the rendezvous's, 2 s) read
  the key and made a watch every slice. The client keeps the revision at which its read
  found the key missing, and the next slice's watch starts after it with no read: etcd
  replays a write made between two slices as the watch's first event (which is then read:
  it may have been undone since).
* :class:`AnyStream`: a joining agent waits for any of three keys (its assignment, the
  generation's record, the job's shutdown). One stream with a watch of each, held across
  its slices, costs etcd nothing per slice; a watch and two reads a slice from 4,095 agents
  were more requests than one member served. Its watches start at the store's revision
  when etcd makes them, and a read follows etcd's confirmation (``etcdheld``).

No I/O here: the client (``etcd.py``) sends the requests these build and passes back what
etcd answered.
"""

from __future__ import annotations

import base64
import re
from collections import OrderedDict
from typing import Any

#: An appended part's key is the key, this byte and a random id; the range of a key and its
#: parts ends before ``PARTS_END`` (no other key of the job has a byte below 0x20).
PART = b"\x00"
PARTS_END = b"\x01"
TXN_OPS = 128  # etcd's default --max-txn-ops


def b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def joined(kvs: list[dict[str, Any]]) -> bytes:
    """A key's value then its appended parts', in the order of ``kvs`` (etcd's creation
    order: a span's range sorts by create revision)."""
    return b"".join(unb64(kv.get("value", "")) for kv in kvs)


def next_key(key: bytes) -> bytes:
    """The first key after every key that starts with ``key`` (a range's end)."""
    return key[:-1] + bytes([key[-1] + 1]) if key and key[-1] < 0xFF else key + b"\0"


def span(ekey: bytes) -> dict[str, Any]:
    """A range over the (job-prefixed) key ``ekey`` and its appended parts, oldest first."""
    return {"key": b64(ekey), "range_end": b64(ekey + PARTS_END),
            "sort_order": "ASCEND", "sort_target": "CREATE"}


def watched_value(ekey: bytes, events: list[dict[str, Any]]) -> bytes | None:
    """The value of ``ekey``'s span after the first revision in ``events`` (a watch of the
    span from the revision after a read that found it empty), when that revision holds
    one event, a put of the key itself; None when it cannot be told from the events (a
    part, a delete, several changes at once): the caller reads the key."""
    if not events:
        return None
    first = (events[0].get("kv") or {}).get("mod_revision")
    at_first = [e for e in events if (e.get("kv") or {}).get("mod_revision") == first]
    if len(at_first) != 1 or at_first[0].get("type", "PUT") != "PUT":
        return None
    kv = at_first[0].get("kv") or {}
    if unb64(kv.get("key", "")) != ekey:
        return None
    return unb64(kv.get("value", ""))


class WaitStream:
    """One wait's watch stream, as its messages come (``EtcdClient._watch_create`` feeds it):
    the watch of ``ekey``'s span from the revision
    after one that found it missing. With ``replay`` that revision is one an earlier wait
    kept (:class:`MissedAt`): an event at or before the store's revision when etcd made the
    watch (its "created" answer) may predate this wait and have been undone since."""

    def __init__(self, ekey: bytes, replay: bool) -> None:
        self.ekey, self.replay = ekey, replay
        self.created = 0  # the store's revision in the "created" answer (0: none yet)
        self.ended = False  # the gateway ended the stream at its Grpc-Timeout

    def take(self, message: dict[str, Any]) -> tuple[bool, bytes | None]:
        """(over, value): over once the key was written or the watch canceled (a compacted
        revision); value: the key's whole value when the event tells it
        (:func:`watched_value`) and is not a replayed one, else None: the caller reads."""
        result = message.get("result") or {}
        if result.get("created"):
            self.created = int((result.get("header") or {}).get("revision", 0))
        events = result.get("events") or []
        if events:
            first = int((events[0].get("kv") or {}).get("mod_revision", 0))
            if self.replay and (not self.created or first <= self.created):
                return True, None
            return True, watched_value(self.ekey, events)
        if result.get("canceled"):
            return True, None
        self.ended = self.ended or deadline_error(message)
        return False, None


class AnyStream:
    """A held wait's one watch stream on several keys (``etcd.EtcdClient.wait_any`` and
    scripts/loadgen.py's etcd agents read it): a create request per key's span, in one
    gateway request (from the store's revision when etcd makes them, for a held wait: see
    ``etcdheld``). etcd answers the creates in their order, each "created" message with
    the new watch's id (0 is left out of the JSON), and tags each event with its watch id:
    that maps an event back to its key."""

    def __init__(self, ekeys: list[bytes]) -> None:
        self.ekeys = ekeys
        self._index: dict[int, int] = {}  # watch id -> its key's index in ekeys
        self.ended = False  # the gateway ended the stream at its Grpc-Timeout

    @property
    def confirmed(self) -> bool:
        """Whether etcd made every watch (a frozen member never answers)."""
        return len(self._index) == len(self.ekeys)

    def requests(self, revision: int | None = None) -> list[dict[str, Any]]:
        """The create requests, one per key, to send as one body (JSON objects in a row):
        from ``revision`` + 1, or with None from the store's revision when etcd makes them."""
        start = {} if revision is None else {"start_revision": revision + 1}
        return [{"create_request": {"key": s["key"], "range_end": s["range_end"], **start}}
                for s in (span(k) for k in self.ekeys)]

    def take(self, message: dict[str, Any]) -> tuple[int, bytes | None] | None:
        """None: nothing yet; else (index of the key written first, its whole value when
        the event tells it (:func:`watched_value`), else None: the caller reads it); index
        -1 for a watch etcd canceled (a compacted revision) or an event of an unknown
        watch: the caller reads every key again. A message that is not etcd's (not
        objects where etcd sends them) raises AttributeError, TypeError or ValueError."""
        result = message.get("result") or {}
        watch = int(result.get("watch_id", 0))
        if result.get("canceled"):  # also a create etcd refused ("created" and "canceled")
            return -1, None
        if result.get("created"):
            self._index.setdefault(watch, len(self._index))
            return None
        events = result.get("events") or []
        if events:
            index = self._index.get(watch)
            if index is None:
                return -1, None
            return index, watched_value(self.ekeys[index], events)
        self.ended = self.ended or deadline_error(message)
        return None


class MissedAt:
    """Where a client's waits last found each key missing: the store's revision at that read
    and the endpoint it was read from (at most ``keys`` keys, each for ``horizon_s``). The
    next wait's watch starts from that revision + 1 without a read: etcd replays a write
    made since, also one made while no watch was open (between two slices), as its first
    event. A wait of a rendezvous costs etcd a watch per slice, not a read and a watch.

    Why the bounds: etcd replays a watch from an old revision by scanning every write
    since, holding its watch lock, which its writes take too (3.4's ``syncWatchers``; the
    likely cause, not profiled, of what was seen without the lag bound: with 2,048 agents
    renewing from the revisions of their offers, the leader's record came 6.7 and 7.9 s
    after the last join in 2 of 3 runs, 1.8-3.5 s otherwise). So a key is read again once
    a slice's watch saw the store ``max_lag`` revisions past it (a busy store: as without
    this), or ``horizon_s`` after its read; a compacted revision cancels the watch (the
    caller reads again). A revision is the whole cluster's, so it stays valid on another
    member, but a failover also reads again (one read; a member of another cluster would
    mislead the watch). Used by one thread, as the client."""

    def __init__(self, horizon_s: float = 30.0, max_lag: int = 256, keys: int = 64) -> None:
        self._held: OrderedDict[bytes, tuple[int, int, float]] = OrderedDict()
        self._horizon_s, self._max_lag, self._keys = horizon_s, max_lag, keys

    def since(self, ekey: bytes, endpoint: int, now: float) -> int | None:
        """The revision ``ekey`` was missing at, read from ``endpoint`` within the horizon
        before ``now``; None: read the key."""
        held = self._held.get(ekey)
        if held is None or held[1] != endpoint or now - held[2] > self._horizon_s:
            self._held.pop(ekey, None)
            return None
        return held[0]

    def hold(self, ekey: bytes, revision: int, endpoint: int, now: float) -> None:
        self._held.pop(ekey, None)
        self._held[ekey] = (revision, endpoint, now)
        while len(self._held) > self._keys:
            self._held.popitem(last=False)

    def moved(self, ekey: bytes, revision: int) -> None:
        """A slice's watch of ``ekey`` ended with no event, etcd's revision ``revision`` when
        it made it (0: not known): read the key next time if that is past ``max_lag``."""
        held = self._held.get(ekey)
        if held is not None and (not revision or revision - held[0] > self._max_lag):
            del self._held[ekey]

    def forget(self, ekey: bytes) -> None:
        self._held.pop(ekey, None)


def deadline_error(message: dict[str, Any]) -> bool:
    """Whether a watch stream's message is the gateway ending it at the request's
    ``Grpc-Timeout``: DEADLINE_EXCEEDED (4), or the same cause as UNKNOWN (2), which etcd
    3.4's gateway also sends ("context deadline exceeded"); in a stream's last message
    (``{"error": {"grpc_code", "message", ...}}``) or as the body of a 504 answer, when the
    deadline came before the stream began (``{"error": text, "code", "message"}``)."""
    error = message.get("error")
    if isinstance(error, dict):
        code, text = error.get("grpc_code"), error.get("message", "")
    else:
        code, text = message.get("code"), message.get("message", error)
    return code == 4 or "context deadline exceeded" in str(text)


class AppendedReads:
    """What a client last read of appended keys (at most ``keys`` of them, the least
    recently read dropped first), so that the next read of such a key asks etcd only for
    what changed since (see the module docstring). Used by one thread, as the client."""

    def __init__(self, keys: int = 32) -> None:
        self._held: OrderedDict[bytes, tuple[int, int, int, bytes]] = OrderedDict()
        self._keys = keys  # held: ekey -> (revision read at, kvs, last create, value)

    def request(self, ekey: bytes) -> dict[str, Any]:
        """The range to send for ``ekey``: only what was modified after the last read."""
        held = self._held.get(ekey)
        request = span(ekey)
        if held is not None:
            request["min_mod_revision"] = str(held[0] + 1)
        return request

    def answer(self, ekey: bytes, result: dict[str, Any]) -> tuple[bool, bytes | None]:
        """(usable, the key's value or None when missing) from etcd's answer to
        :meth:`request`; not usable: the key changed otherwise than by appends since the
        last read, and the caller sends :meth:`request` again (a whole read)."""
        revision = int((result.get("header") or {}).get("revision", 0))
        count = int(result.get("count", 0))
        kvs = result.get("kvs") or []
        held = self._held.pop(ekey, None)
        if held is not None:
            _, had, last_create, value = held
            if count != had + len(kvs) or any(
                    int(kv.get("create_revision", 0)) <= last_create for kv in kvs):
                return False, None  # a part deleted or changed, the key set: read it all
            total, value = had + len(kvs), value + joined(kvs)
        else:
            if len(kvs) != count:
                return False, None
            if not kvs:
                return True, None
            total, value = len(kvs), joined(kvs)
            if total == 1 and unb64(kvs[0].get("key", "")) == ekey:
                return True, value  # a plain key, no parts: nothing to hold
        if kvs:
            last_create = int(kvs[-1].get("create_revision", 0))
        self._held[ekey] = (revision, total, last_create, value)
        while len(self._held) > self._keys:
            self._held.popitem(last=False)
        return True, value

    def forget(self, ekey: bytes) -> None:
        self._held.pop(ekey, None)


def host_port(part: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` as (host, port); ValueError naming ``part``
    (``--rdzv-endpoint``'s words) when it has no host or a port out of 1..65535."""
    if part.startswith("["):  # [v6]:port
        host, _, rest = part[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif part.count(":") == 1:
        host, port_text = part.split(":")
    else:
        host, port_text = part, ""
    if not host:
        raise ValueError(f"--rdzv-endpoint {part!r}: no host")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"--rdzv-endpoint {part!r}: the port is not in 1..65535")
    return host, int(port_text)


def short(error: BaseException) -> str:
    """The first line of an error, trimmed (requests' messages nest the whole chain;
    etcd3gw keeps requests' in ``detail_text``); a TLS failure as OpenSSL's reason
    ("TLS: certificate verify failed: unable to get local issuer certificate")."""
    whole = str(error).strip() or str(getattr(error, "detail_text", "") or "").strip()
    text = whole.splitlines()[0] if whole else type(error).__name__
    tls = re.search(r"\[SSL: [A-Z0-9_]+\] ([^(]+?)\s*\(_ssl", text)
    if tls is not None:
        return f"TLS: {tls[1]}"
    if "SSLError" in text or "SSL" in type(error).__name__:
        return f"TLS: {text[:160]}"
    for marker in ("Connection refused", "timed out", "Name or service not known",
                   "No route to host", "certificate verify failed", "Connection reset"):
        if marker in text:
            return marker.lower()
    return text[:160]
