"""The job's single writer on the etcd-v3 backend, chosen by etcd and taken over by etcd.

Why: on etcd no agent is the store, so one must be chosen to form the generations and host
their worker stores, and another must take its place when it dies, never two at once.
:class:`Election` puts a key bound to a lease in a transaction that succeeds only if the
key does not exist; the agent that wins keeps the lease alive from a thread and stops being
the writer (its agent exits) once it could not renew for a whole TTL. The other agents'
:class:`WriterWatch` runs for the key when the writer's lease has expired.

Timeouts and errors: every etcd request is bounded by its client's timeout; requests that
no endpoint answered raise ``RuntimeError`` (see :mod:`ftrun.control.etcd`), which the
lease keeper and the watch retry at their next interval and :func:`join_etcd` turns into
one :class:`~ftrun.control.errors.StoreError`.

Every agent's liveness is a lease too (:class:`LeaseBeat`, :class:`LeaseView`; see their
docstrings): a lost node is a lease that expired.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftrun.control.errors import BeatDeferred, StoreError
from ftrun.control.etcd import EtcdClient, EtcdOptions, connect_etcd
from ftrun.control.etcdkeepalive import KeepAliveStream, load_grpc

if TYPE_CHECKING:
    from ftrun.control.store import JsonStore


class Election:
    """The job's single writer, chosen by a transaction on a key bound to a lease.

    ``campaign()`` puts ``value`` at ``key`` if the key does not exist and says whether
    this agent won. The winner keeps the lease alive from a thread every third of its TTL;
    when the winner dies its lease expires after ``ttl_s`` and etcd deletes the key, so a
    later campaign can win. ``holder()`` reads who holds it now."""

    def __init__(self, connect: Callable[[], EtcdClient], key: str, value: str,
                 ttl_s: int) -> None:
        self._connect = connect
        self.key = key
        self.value = value
        self.ttl_s = max(2, int(ttl_s))
        self.lease: int | None = None
        self.lost_at: float | None = None  # when a renewal found the lease expired
        # a campaign after the last holder's lease expired: when (time.time()) this agent
        # saw the key free, and the last time it saw it held (WriterWatch)
        self.vacated_at: float | None = None
        self.held_at: float | None = None
        # ...or, when a survivor found the last holder's agent dead and revoked its lease
        # (WriterWatch.nudge): when (time.time()) its death was seen
        self.gone_at: float | None = None
        # ...and the last holder's value (its node id) as this agent last saw it, if it did
        self.previous: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def campaign(self) -> bool:
        client = self._connect()
        lease = client.grant_ttl(self.ttl_s)[0]
        won = client.create_with_lease(self.key, self.value, lease) == self.value.encode()
        if not won:
            client.revoke(lease)
            return False
        self.lease = lease
        self._thread = threading.Thread(target=self._keep, args=(lease,),
                                        name="ftrun-etcd-lease", daemon=True)
        self._thread.start()
        return True

    def holder(self) -> bytes | None:
        found, _ = self._connect()._range(self.key)
        return found

    def resign(self, timeout_s: float = 2.0) -> None:
        """Stop renewing and revoke the lease (the key goes at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.lease is not None:
            with contextlib.suppress(RuntimeError):  # else it expires within its TTL
                self._connect().revoke(self.lease)

    def _keep(self, lease: int) -> None:
        """Renew every third of the TTL. The lease counts as lost (``lost_at``) when etcd
        says it expired, or when no renewal succeeded for a whole TTL: by then etcd may
        have let it expire and another agent may hold the key, so this writer must stop
        writing (the agent stops: ``Agent._lost_reason``), never run alongside a new one."""
        client: EtcdClient | None = None
        stream: KeepAliveStream | None = None
        last_ok = time.monotonic()
        try:
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    client = client or self._connect()
                    stream = stream or KeepAliveStream.for_options(client.options)
                    if client.keep_alive(lease, stream) < 0:
                        self.lost_at = time.monotonic()
                        return
                    last_ok = time.monotonic()
                except RuntimeError:
                    client = None  # the next renewal reconnects (another endpoint)
                    if time.monotonic() - last_ok >= self.ttl_s:
                        self.lost_at = time.monotonic()
                        return
        finally:
            if stream is not None:
                stream.close()


def join_etcd(options: EtcdOptions, *, run_id: str, node_id: str, op_timeout_s: float,
              connect_s: float, lease_s: float, interrupted: Callable[[], bool] = lambda: False,
              ) -> tuple[EtcdClient, Election | None]:
    """An agent's start on the etcd-v3 backend: reach the cluster within ``connect_s`` and
    run for the job's writer (key ``ftrun/<run id>/writer``, a lease of ``lease_s``).
    Returns the client and, when this agent won, its :class:`Election` (to resign at exit).
    Errors: :class:`~ftrun.control.errors.StoreError` with one line naming every endpoint.

    grpcio (the leases' keepalive streams) is loaded here, in the agent's main thread
    before its election, heartbeat and workers start (see ``etcdkeepalive.load_grpc``)."""
    load_grpc()
    try:
        client = connect_etcd(options, connect_s, op_timeout_s=op_timeout_s,
                              interrupted=interrupted)
        election = Election(lambda: connect_etcd(options, op_timeout_s, op_timeout_s=op_timeout_s),
                            f"ftrun/{run_id}/writer", node_id, ttl_s=math.ceil(lease_s))
        won = election.campaign()
    except RuntimeError as error:
        raise StoreError(str(error)) from None
    return client, (election if won else None)


class WriterWatch:
    """A non-writer agent's watch on the job's writer key: when the writer's lease expires
    (its agent died or lost etcd: nothing renews it), the key is gone and this agent runs
    for it; the winner's ``on_won(election)`` is called from the watch's thread, once.

    Reads the key every ``interval_s`` on a client of its own (a poll, not a watch: one
    small read per agent per interval; the election itself is one transaction); the
    winner's election carries when the key was seen free (``vacated_at``) and last seen
    held (``held_at``), which date the last writer's last renewal. Errors
    (etcd unreachable) are retried at the next interval: the agent's heartbeats decide
    when etcd counts as lost.

    A writer whose agent died need not be waited out for a whole TTL: :meth:`nudge` says
    that node's agent is dead (its presence connection ended without a goodbye and its port
    then refused a connection: ``HeartbeatSender``), and the watch revokes the lease that
    holds the key if, and only if, the key still names that node, read with the lease in
    the same request; a new writer's lease is never touched. A writer that is alive but
    cut off is not refused (a connect to it times out): its lease runs out as before. A
    false verdict costs what a lost writer does: a writer whose lease is revoked stops
    (``Election`` sees the lease gone at its next renewal)."""

    def __init__(self, connect: Callable[[], EtcdClient], key: str, value: str,
                 ttl_s: int, interval_s: float, on_won: Callable[[Election], None]) -> None:
        self._connect = connect
        self.key = key
        self.value = value
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self._on_won = on_won
        self._stop = threading.Event()
        self._wake = threading.Event()  # stop() or nudge(): look now
        self._dead: tuple[str, float] | None = None  # nudge(): node id, when seen dead
        self.revoked = 0  # leases this watch revoked
        self.looks = 0  # reads of the key done (a nudge's answer is in by the next one)
        self._thread = threading.Thread(target=self._run, name="ftrun-writer-watch",
                                        daemon=True)

    def start(self) -> WriterWatch:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def nudge(self, node_id: str) -> None:
        """``node_id``'s agent is dead (see the class docstring): if it holds the key,
        revoke its lease now rather than wait for it to expire. From any thread."""
        self._dead = (node_id, time.time())
        self._wake.set()

    def _run(self) -> None:
        client: EtcdClient | None = None
        held_at: float | None = None
        holder: bytes | None = None  # the value last seen at the key
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                client = client or self._connect()
                dead, self._dead = self._dead, None
                if dead is not None and self._revoke_if_held(client, dead[0]):
                    holder = dead[0].encode()
                held, _ = client._range(self.key)
                self.looks += 1
                if held is not None:
                    held_at, holder = time.time(), held
                    continue
                election = Election(self._connect, self.key, self.value, self.ttl_s)
                election.vacated_at, election.held_at = time.time(), held_at
                election.previous = holder.decode(errors="replace") if holder else None
                if dead is not None and holder == dead[0].encode():
                    election.gone_at = dead[1]
                if election.campaign():
                    self._on_won(election)
                    return
            except RuntimeError:
                client = None  # another endpoint at the next interval

    def _revoke_if_held(self, client: EtcdClient, node_id: str) -> bool:
        """Revoke the lease of the key if the key names ``node_id`` (the value and its
        lease from one read); whether it did."""
        found, _ = client.range_prefix(self.key)
        lease = next((lease for key, value, lease in found
                      if key == self.key and value == node_id.encode()), 0)
        if not lease:
            return False
        client.revoke(lease)
        self.revoked += 1
        return True


# --- every agent's liveness: a lease ---------------------------------------------------------


class LeaseBeat:
    """An etcd-v3 agent's heartbeat (ftrun/control/heartbeat.py's sender calls it every
    interval, on its own client): a lease of the heartbeat timeout and the agent's liveness
    key bound to it, a record signed with the job's secret that names the lease
    (``{"lease": id, "ttl": s}``); from then on a keepalive at the first beat a third of
    the TTL after the last answered renewal (as etcd's own client renews: every 2 s for the
    default 5 s TTL and 1 s beats; a beat in between sends nothing), a message on etcd's
    gRPC keepalive stream that this beat holds across its clients (:meth:`close` ends it
    when the sender stops). Why not every beat: the keepalives are what one etcd member
    serving thousands of agents spends most on; renewing once a third of the TTL passed
    still leaves two thirds of it (three beats at the defaults) to get a renewal through
    before the lease could expire. The gateway connection of the grant and put is closed
    once the key is put: in the steady state the stream is the one connection the beat
    holds to the member (whose descriptors bound how many agents it serves).

    Why a lease: etcd deletes the key itself a TTL after the last renewal, so a lost node is
    a lease that expired, and the writer learns it from a watch (:class:`LeaseView`) with
    no per-scan read of N keys. A keepalive is not a raft proposal (etcd's leader renews
    leases in memory), so it is cheaper for etcd than the signed put it replaces
    (``scripts/bench_etcd.py`` measures both).

    TTLs are whole seconds: the heartbeat timeout is rounded up (``math.ceil``), so a
    silent node is found up to a second later than the timeout says (1.5 s -> 2 s), and
    etcd grants at least its minimum TTL (2 s with its default election timeout); the
    grant's TTL is what the record says. The lease expires a TTL after its last renewal,
    and etcd's expiry check runs every half second: detection of a silent node is the TTL
    plus up to 0.5 s after the last renewal, which came at most a third of the TTL (rounded
    up to a beat) before the silence: no later than with a renewal at every beat.

    A renewal that finds the lease gone (this agent was paused, or cut off, for a whole
    TTL: :attr:`expired` counts them) grants a new lease and puts the key again; it does
    not fail. The agent learns what happened meanwhile from the store as after any pause
    (the writer may have ended the generation: the agent then joins the next one).
    Errors: the requests' ``RuntimeError`` (no endpoint answered), which the sender counts
    as a failed beat; a put that failed is made again at the next beat."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = max(1, math.ceil(timeout_s))
        self.lease: int | None = None
        self.granted_s = self.ttl_s
        self.placed = False  # the key is put, bound to the current lease
        self.expired = 0
        self.renewed_at = -math.inf  # the last renewal (or grant) etcd answered
        self.grant_failures = 0  # in a row
        self.grant_after = -math.inf  # the back-off of the last failed grant ends
        self.clock = clock
        self.stream: KeepAliveStream | None = None

    def __call__(self, store: JsonStore, name: str) -> None:
        client = store.raw
        if self.stream is None:
            self.stream = KeepAliveStream.for_options(client.options)
        if self.lease is not None and self.placed \
                and self.clock() - self.renewed_at < self.granted_s / 3:
            return  # renewed a third of its TTL ago: still alive, as the beat is
        if self.lease is not None:
            asked = self.clock()
            if client.keep_alive(self.lease, self.stream) < 0:
                self.expired += 1
                self.lease = None
            else:
                self.renewed_at = asked
        if self.lease is None:
            self._grant(client)
        if not self.placed:
            body = {"lease": self.lease, "ttl": self.granted_s}
            client.put_leased(store.key(name), store.signer.line(store.key(name), body),
                              self.lease)
            self.placed = True
            client.drop_idle()  # the renewals go on the stream: no idle gateway connection

    def _grant(self, client: EtcdClient) -> None:
        """A new lease, or BeatDeferred while the last failed grant's back-off lasts: a
        random wait of up to 2, 4, 8 ... seconds (at most the TTL) after each failure in a
        row. Why: a grant is a raft write, and one not answered within the request timeout
        may still be applied, a lease that then expires unused (another write); thousands
        of agents granting again at every beat kept one member from ever catching up
        (10,000 simulated agents took 74 s to hold their leases)."""
        asked = self.clock()
        if asked < self.grant_after:
            raise BeatDeferred(f"lease grant held back {self.grant_after - asked:.1f} s more "
                               f"after {self.grant_failures} failed")
        try:
            self.lease, self.granted_s = client.grant_ttl(self.ttl_s)
        except RuntimeError:
            self.grant_failures += 1
            ceiling = min(float(self.ttl_s), 2.0 ** self.grant_failures)
            self.grant_after = self.clock() + random.uniform(0.0, ceiling)
            raise
        self.renewed_at, self.placed, self.grant_failures = asked, False, 0

    def close(self) -> None:
        """End the keepalive stream (the sender stopped; from its thread or after it)."""
        if self.stream is not None:
            self.stream.close()


@dataclass
class _Liveness:
    lease: int  # from the node's last valid record
    ttl_s: int
    at: float  # alive: when last confirmed; expired: when its lease was found expired
    state: str  # "live" (its key holds its record), "kept" (key gone, lease alive), "expired"


class LeaseView:
    """The writer's view of every agent's liveness lease: a watch on the liveness keys
    (``prefix``, e.g. ``hb/``), renewed every ``slice_s`` from a thread with a client of
    its own; :meth:`heard` answers from memory (no request per scan).

    What it can tell apart: etcd's delete event does not say why a key went, so a key that
    is deleted, or overwritten with anything but a record signed with the job's secret,
    makes the view read its last valid lease's time to live (``/lease/timetolive``). A
    lease that still lives means a foreign client deleted the key: the node stays alive
    (state "kept", the lease read again every slice), never a lost node. A lease that is
    gone expired (or its own agent revoked it: the two cannot be told apart, and only a
    holder of the lease id can revoke). What it cannot tell: a foreign client that knows
    the job's secret, or replays an old record of the same lease, is taken for the agent
    (the threat model: etcd's TLS client certificates keep such clients out).

    :meth:`heard` gives, per node id, when it was last heard on this channel (the view's
    clock): a live key, as of the view's last confirmation by etcd (the watch created, or
    events, at most a slice plus a request apart), counted at the thread's own last look
    (as the presence server counts silence at its last ``select``): a view that runs but
    stopped hearing from etcd cannot hide a silence, and a thread that could not run adds
    none of its own up to a slice and one request (``request_s``) past its last look, what
    a request may take: time beyond that counts as silence (a thread stuck in requests to
    frozen endpoints hides none); an expired lease, a TTL before the expiry was seen (its
    last renewal); no record seen, nothing (the monitor's full timeout from when it began
    watching applies). Errors: a failed watch or read (a watch whose "created" answer never came
    included: a frozen or cut-off member) makes the thread read the whole prefix again on
    the next endpoint after a pause; it never raises. Every request is bounded (the
    client's timeouts), so the thread looks at least every slice plus a request.

    Keepalives make no store revision, so while ``hb/`` is quiet the watch's start revision
    would stay where the last read left it, and etcd would scan all history since for each
    slice's new watch: once the store's revision (the watch's created answer) is more than
    ``max_lag`` (or twice the nodes known) ahead, the thread reads the prefix again (one
    range of N keys instead of scans of ever more revisions)."""

    def __init__(self, connect: Callable[[], EtcdClient], store: JsonStore, prefix: str,
                 slice_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._connect = connect
        self._store = store
        self._prefix = prefix
        self.slice_s = slice_s
        self.clock = clock
        self.synced_at: float | None = None
        self.looked_at: float | None = None  # the thread's last look (a slice's end, a sync)
        self.requests = 0  # made by the thread (watches, reads, lease checks)
        self.request_s = 5.0  # one request's bound on one endpoint (its client's timeout)
        self.revision = 0  # the watch's start revision (0: read the prefix again first)
        self.max_lag = 1000
        self._client: EtcdClient | None = None  # the thread's (stop() ends its watch)
        self._nodes: dict[str, _Liveness] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-lease-view",
                                        daemon=True)

    def start(self) -> LeaseView:
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop the thread; wait up to ``timeout_s`` (default: a slice plus one request to
        one endpoint, what the thread may be inside). False when it is still alive then
        (stuck in a longer request: a daemon thread, it ends with the process)."""
        self._stop.set()
        stream = getattr(self._client, "stream", None)  # a watch's wait ends at once
        with contextlib.suppress(Exception):  # none, or over (its connection released)
            stream.raw.shutdown()  # type: ignore[union-attr]
        self._thread.join(self.slice_s + self.request_s if timeout_s is None else timeout_s)
        return not self._thread.is_alive()

    def heard(self, node_ids: Iterable[str]) -> dict[str, float]:
        """Node id -> when it was last heard (see the class docstring), for those known."""
        with self._lock:
            synced, now = self.synced_at, self.clock()
            if synced is not None and self.looked_at is not None:  # silence seen, stuck
                stuck = max(0.0, now - self.looked_at - self.slice_s - self.request_s)
                synced = now - max(0.0, self.looked_at - synced) - stuck
            found: dict[str, float] = {}
            for node_id in node_ids:
                node = self._nodes.get(node_id)
                if node is None:
                    continue
                if node.state == "expired":
                    found[node_id] = node.at - node.ttl_s
                elif node.state == "kept":
                    found[node_id] = node.at
                elif synced is not None:
                    found[node_id] = synced
            return found

    def prune(self, watched: Iterable[str]) -> None:
        """Forget expired nodes not in ``watched`` (a live one stays known: its key, which
        only a new put would announce again, still holds its lease)."""
        keep = set(watched)
        with self._lock:
            for node_id in [i for i, n in self._nodes.items()
                            if n.state == "expired" and i not in keep]:
                del self._nodes[node_id]

    def state(self, node_id: str) -> str | None:
        with self._lock:
            node = self._nodes.get(node_id)
            return node.state if node is not None else None

    # --- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        client: EtcdClient | None = None
        while not self._stop.is_set():
            try:
                client = self._client = client or self._connect()
                self.request_s = client.timeout.total_seconds()
                if self.revision == 0:
                    self.revision = self._resync(client)
                self.requests += 1
                self.revision, current = client.watch_prefix(
                    self._store.key(self._prefix), self.revision, self.slice_s,
                    functools.partial(self._event, client), self._synced)
                self._looked()
                if current - self.revision >= max(self.max_lag, 2 * len(self._nodes)):
                    self.revision = 0  # read again (see the class docstring)
                self._recheck(client)
            except Exception:  # RuntimeError, StoreError, a malformed answer: never unseen
                self.revision = 0  # read everything again (the client moved to the next
                self._looked()  # endpoint on a failed watch, as a failed read does)
                self._stop.wait(min(self.slice_s, 0.5))

    def _synced(self) -> None:
        with self._lock:
            self.synced_at = self.looked_at = self.clock()

    def _looked(self) -> None:
        with self._lock:
            self.looked_at = self.clock()

    def _resync(self, client: EtcdClient) -> int:
        """Read every liveness key (a start, or after a failed watch); a node seen before
        whose key is gone or replaced has its lease checked. The revision to watch from."""
        self.requests += 1
        found, revision = client.range_prefix(self._store.key(self._prefix))
        seen = set()
        for key, value, lease in found:
            seen.add(key)
            self._event(client, key, value, lease)
        with self._lock:
            gone = [k for k in self._nodes if self._store.key(self._prefix + k) not in seen]
        for node_id in gone:
            self._event(client, self._store.key(self._prefix + node_id), None, 0)
        self._synced()
        return revision + 1

    def _event(self, client: EtcdClient, key: str, value: bytes | None, lease: int) -> None:
        full = self._store.key(self._prefix)
        if not key.startswith(full):
            return
        node_id = key[len(full):]
        body = self._store.check_record(self._prefix + node_id, value) \
            if value is not None else None
        now = self.clock()
        if body is not None and type(body.get("lease")) is int and body["lease"] == lease \
                and lease and type(body.get("ttl")) is int and 0 < body["ttl"] <= 3600:
            with self._lock:
                self._nodes[node_id] = _Liveness(lease, body["ttl"], now, "live")
            return
        with self._lock:  # deleted, or not the agent's record: its lease decides
            node = self._nodes.get(node_id)
        if node is not None and node.state != "expired":
            self._check(client, node_id, node)

    def _check(self, client: EtcdClient, node_id: str, node: _Liveness) -> None:
        """Read the lease's time to live: alive (kept) or expired, as of now."""
        self.requests += 1
        left = client.time_to_live(node.lease)
        with self._lock:
            node.state = "kept" if left >= 0 else "expired"
            node.at = self.looked_at = self.clock()  # a look too (see heard())

    def _recheck(self, client: EtcdClient) -> None:
        """Once a slice: the leases of keys that a foreign client deleted."""
        with self._lock:
            kept = [(i, n) for i, n in self._nodes.items() if n.state == "kept"]
        for node_id, node in kept:
            self._check(client, node_id, node)
