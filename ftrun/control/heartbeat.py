"""Agent heartbeats: every agent proves it is alive; the leader notices one that is not.

* :class:`HeartbeatSender` is a thread in every agent that does not host the store. It has
  its own TCPStore connection (a client is not thread safe) and overwrites ``hb/<node id>``
  with a signed ``{"seq": n}`` every ``interval``, then makes one request that has a reply:
  torch's ``set`` has none, and a store host that is frozen (SIGSTOP, a stalled VM) goes on
  accepting sends into its socket buffer. When its requests have failed for ``timeout`` it
  reports the store host as lost (:meth:`HeartbeatSender.lost`): the agent then stops its
  workers and exits 3. Silence alone is not loss: an agent that was paused is silent for as
  long as the pause, and must learn from the store what happened meanwhile rather than
  give up before its thread has tried again.
* :class:`HeartbeatMonitor` runs in the leader (the store host). It reads the heartbeat
  keys of the agents it waits for in one ``multi_get`` and declares an agent lost when its
  sequence number has not grown for ``timeout`` by the *leader's* clock: no clock on
  another host is trusted, and a replayed older value does not count as a beat.

A heartbeat timeout is the verdict for a *silent* agent. An agent whose process died is
noticed sooner through its presence connection (:mod:`ftrun.control.presence`): the sender
holds one to the leader (connected from its own thread once the leader's ``presence``
record is readable, re-tried every few intervals, said goodbye to on :meth:`stop`), and the
monitor counts a connection that ended without a goodbye as lost at its next scan.

Silence is heard on both channels: the presence connection also carries a ping every
quarter second, so the monitor counts an agent silent only for as long as neither its
store heartbeat nor its pings were heard, and declares it lost past ``timeout`` (the
TCPStore default, 2 s, rests on those pings: ftrun/cli.py). An agent without a pinging
connection (a site that opens only the store port) is judged on its store heartbeats
alone, and then never before three of them were missed (``3 x interval``).

The sender's own verdict, the store host lost, waits for ``timeout`` but at least
``min_grace_s`` (the agent passes three request timeouts): with a short heartbeat timeout,
one slow request on a loaded machine must not make an agent give up on a live store.

Cost at N agents: N ``set`` per interval on the store plus one N-key ``multi_get`` per
leader scan; ``scripts/bench_multinode.py --store-load`` measures it.

On etcd-v3 (a store client with ``leases``) the same sender and monitor beat and judge
through leases instead (ftrun/control/election.py): each agent's beat is one keepalive
of a lease of the heartbeat timeout (whole seconds, rounded up) that holds its signed
``hb/<node id>`` key, and the writer's monitor learns from a watch on ``hb/`` when a
lease expired (the node's last sign on that channel is then a TTL back), with no
per-scan read; the presence pings and the both-channels rule are the same.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from ftrun.control.auth import Signer
from ftrun.control.errors import BeatDeferred
from ftrun.control.presence import (
    RECORD,
    PresenceClient,
    PresenceError,
    PresenceServer,
    parse_record,
    record_node,
)
from ftrun.control.store import JsonStore
from ftrun.control.tcpstore import connect_refused

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from ftrun.control.election import LeaseBeat, LeaseView


def heartbeat_key(node_id: str) -> str:
    return f"hb/{node_id}"


class HeartbeatSender:
    """Beats ``hb/<node_id>`` from a thread of its own; see the module docstring."""

    def __init__(
        self,
        connect: Callable[[], TCPStore],
        template: JsonStore,
        node_id: str,
        interval_s: float,
        timeout_s: float,
        presence: PresenceClient | None = None,
        min_grace_s: float = 0.0,
        on_server_gone: Callable[[str], None] | None = None,
    ) -> None:
        self._connect = connect
        self.presence = presence
        self.presence_error = ""  # why the last presence connect failed
        self._presence_next = 0.0
        # etcd-v3: the presence server's agent is dead (see _hold_presence), with its node id
        self.on_server_gone = on_server_gone
        self._presence_at: tuple[str, int, str] | None = None  # host, port, node id
        self._template = template
        self.node_id = node_id
        self.interval_s = interval_s
        self.timeout_s = max(timeout_s, min_grace_s)  # of failing requests: see lost()
        self.last_ok = time.monotonic()
        self.last_error = ""
        self.failing_since: float | None = None  # start of the first failed attempt in a row
        self.seq = 0
        # etcd-v3 (a client with leases): the beat is a lease kept alive (control/election.py)
        self.lease: LeaseBeat | None = None
        if getattr(template.raw, "leases", False):
            from ftrun.control.election import LeaseBeat
            self.lease = LeaseBeat(timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 0.5) -> None:
        """Stop beating; wait up to ``timeout_s`` for a request in flight (a daemon
        thread: never wait long for one stuck on a dead host), then say goodbye on the
        presence connection: this agent ends on purpose."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        if self.presence is not None:
            self.presence.goodbye()

    def silent_s(self) -> float:
        """Seconds since the last heartbeat the store accepted."""
        return time.monotonic() - self.last_ok

    def lost(self) -> bool:
        """Requests have failed, and none succeeded for ``timeout``. A pause alone does not
        count (see the module docstring): after one, the failures count from an interval
        before the first failed attempt, not from the last success before the pause."""
        since = self.failing_since
        if since is None:
            return False
        return time.monotonic() - max(self.last_ok, since - self.interval_s) > self.timeout_s

    def _run(self) -> None:
        try:
            self._beat()
        finally:
            if self.lease is not None:
                self.lease.close()  # here: the beat's thread is the one that uses it

    def _beat(self) -> None:
        store: JsonStore | None = None
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if store is None:
                    store = self._template.with_client(self._connect())
                self.seq += 1
                if self.lease is not None:
                    self.lease(store, heartbeat_key(self.node_id))  # a keepalive, replied
                else:
                    store.set_record(heartbeat_key(self.node_id), {"seq": self.seq})
                    store.exists(heartbeat_key(self.node_id))  # the reply proves it arrived
                self.last_ok = time.monotonic()
                self.failing_since = None
                self._hold_presence(store)
            except Exception as error:  # StoreError; nothing may end the thread unseen
                self.last_error = str(error) or type(error).__name__
                if self.failing_since is None:
                    self.failing_since = started
                if not isinstance(error, BeatDeferred):
                    store = None  # a timed-out client may be out of step: reconnect
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _hold_presence(self, store: JsonStore) -> None:
        """Connect the presence client when it is not (at most every 3 intervals).

        When the connection was up and the server's end closed without a word (its process
        died: the kernel closed its sockets), and a new connection to the same port is
        refused (nothing listens there any more: the agent serving it is gone, not a
        network fault, where a connect times out), ``on_server_gone`` is told the server's
        node id (etcd-v3: the job's writer, whose lease need not be waited out)."""
        presence = self.presence
        if presence is None or presence.closed or presence.connected:
            return
        gone, self._presence_at = self._presence_at, None
        if gone is not None and gone[2] and self.on_server_gone is not None \
                and connect_refused(gone[0], gone[1], min(1.0, self.interval_s)):
            self.on_server_gone(gone[2])
        now = time.monotonic()
        if now < self._presence_next:
            return
        self._presence_next = now + 3 * self.interval_s
        body = store.get_record(RECORD)
        target = parse_record(body)
        if target is None:
            self.presence_error = "no presence record yet"
            return
        try:
            presence.connect(*target)
            self.presence_error = ""
            self._presence_at = (*target, record_node(body))
        except PresenceError as error:
            self.presence_error = str(error)


def serve_presence(store: JsonStore, signer: Signer, run_id: str, bind: str | None,
                   host: str, on_reject: Callable[[str], None], node_id: str = ""
                   ) -> PresenceServer:
    """The leader's presence server, started on ``bind`` (None: every interface, as the
    stores) and published as the signed ``presence`` record with the ``host`` other nodes
    reach this node at and this agent's ``node_id``."""
    server = PresenceServer(signer, run_id, bind, on_reject=on_reject).start()
    record: dict[str, Any] = {"host": host, "port": server.port}
    if node_id:
        record["node_id"] = node_id
    store.set_record(RECORD, record)
    return server


class BeatView(Protocol):
    """The store channel of the agents' liveness, as the monitor reads it: one per
    backend (:class:`StoreBeats` on the TCPStore, ``election.LeaseView`` on etcd-v3)."""

    def heard(self, node_ids: Iterable[str]) -> dict[str, float]:
        """Node id -> when (the leader's clock) this channel last heard it, for those
        heard since the last call (or known: a view may repeat a time)."""
        ...

    def prune(self, watched: Iterable[str]) -> None:
        """Forget what is kept about nodes no longer ``watched``."""
        ...

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop any thread of the view, waiting up to ``timeout_s``; False when one is
        still alive then."""
        ...


class StoreBeats:
    """TCPStore heartbeats: each agent's signed ``hb/<node id>`` ``{"seq": n}``, all read
    in one ``multi_get`` per call. A node is heard when its sequence number grew since the
    last read, by the leader's clock (a replayed older value is not a beat); bytes that did
    not change are not verified again (``JsonStore.get_records``' cache)."""

    def __init__(self, store: JsonStore, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        self._seq: dict[str, int] = {}
        self._read: dict[str, tuple[bytes, dict[str, Any] | None]] = {}  # see get_records

    def heard(self, node_ids: Iterable[str]) -> dict[str, float]:
        ids = list(node_ids)
        records = self.store.get_records([heartbeat_key(i) for i in ids], self._read)
        now = self.clock()
        found: dict[str, float] = {}
        for node_id, body in zip(ids, records, strict=True):
            seq = body.get("seq") if body else None
            if isinstance(seq, int) and not isinstance(seq, bool) and \
                    seq > self._seq.get(node_id, -1):
                self._seq[node_id] = seq
                found[node_id] = now
        return found

    def prune(self, watched: Iterable[str]) -> None:
        keep = set(watched)
        for node_id in set(self._seq) - keep:
            del self._seq[node_id]
        for name in [n for n in self._read if n.removeprefix("hb/") not in keep]:
            del self._read[name]

    def stop(self, timeout_s: float | None = None) -> bool:
        return True  # no thread: the reads are the monitor's own


class HeartbeatMonitor:
    """The leader's view of the other agents' liveness: the store channel (a
    :class:`BeatView` of the backend) and the presence connections, judged together."""

    def __init__(self, store: JsonStore, timeout_s: float,
                 presence: PresenceServer | None = None, interval_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.clock = clock
        # its gone(): node id -> when its connection ended without a goodbye; its silent():
        # node id -> seconds its pinging connection was quiet (ftrun/control/presence.py)
        self.presence = presence
        # without pings, a verdict on store heartbeats alone waits for three missed beats
        self.beats_timeout_s = max(timeout_s, 3 * interval_s)
        self.closed: set[str] = set()  # the last scan's agents lost by their connection
        self.beats: BeatView = StoreBeats(store, clock)
        if getattr(store.raw, "leases", False) and store.reconnect is not None:
            # etcd-v3 (a client with leases): heartbeats are leases, seen through a watch
            from ftrun.control.election import LeaseView
            self.beats = LeaseView(store.reconnect, store, "hb/", min(1.0, timeout_s / 4),
                                   clock).start()
        self._changed: dict[str, float] = {}  # node id -> when last heard on the store channel
        self._silent: dict[str, float] = {}  # the last scan's silence of each agent

    def watch(self, node_ids: Iterable[str]) -> None:
        """Track these agents (a newly watched one gets a full timeout from now)."""
        now = self.clock()
        wanted = set(node_ids)
        for node_id in wanted - self._changed.keys():
            self._changed[node_id] = now
        for node_id in set(self._changed) - wanted:
            del self._changed[node_id]
        self.beats.prune(wanted)

    @property
    def leases(self) -> LeaseView | None:
        """The etcd-v3 lease view, when the heartbeats are leases."""
        from ftrun.control.election import LeaseView
        return self.beats if isinstance(self.beats, LeaseView) else None

    def close(self, timeout_s: float | None = None) -> str:
        """Stop the beat view's thread (etcd-v3's lease watch; the TCPStore's has none),
        waiting up to ``timeout_s`` (default: a slice and a request); what to say when it
        is still alive then (a daemon thread stuck in a request: it ends with the
        process), else ""."""
        if self.beats.stop(timeout_s):
            return ""
        return "the etcd lease view's thread is still in a request (left to end by itself)"

    def silent_s(self, node_id: str) -> float:
        """Seconds the agent was silent at the last scan (neither its store heartbeat nor
        its pings heard)."""
        if node_id in self._silent:
            return self._silent[node_id]
        return self.clock() - self._changed.get(node_id, self.clock())

    def scan(self) -> list[str]:
        """Read every watched heartbeat; return the agents silent for longer than the
        timeout (see the module docstring: both channels) and those whose presence
        connection ended without a goodbye (kept in :attr:`closed`); they stay watched
        until :meth:`watch` drops them."""
        ids = sorted(self._changed)
        # (on etcd-v3 a lease's expiry moves its node's time back by a TTL: its last renewal)
        self._changed.update(self.beats.heard(ids))
        now = self.clock()
        gone = self.presence.gone() if self.presence is not None else {}
        quiet = self.presence.silent() if self.presence is not None else {}
        self.closed = {i for i in ids if i in gone}
        self._silent.clear()
        lost = []
        for node_id in ids:
            silent = now - self._changed[node_id]
            limit = self.beats_timeout_s
            if node_id in quiet:  # it pings: heard on either channel is alive
                silent, limit = min(silent, quiet[node_id]), self.timeout_s
            self._silent[node_id] = silent
            if silent > limit or node_id in gone:
                lost.append(node_id)
        return lost

