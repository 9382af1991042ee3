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
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable

from ftrun.control.errors import StoreError
from ftrun.control.etcd import EtcdClient, EtcdOptions, connect_etcd


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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def campaign(self) -> bool:
        client = self._connect()
        lease = client.grant(self.ttl_s)
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
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                client = client or self._connect()
                if client.keep_alive(lease) < 0:
                    self.lost_at = time.monotonic()
                    return
                last_ok = time.monotonic()
            except RuntimeError:
                client = None  # the next renewal reconnects (another endpoint)
                if time.monotonic() - last_ok >= self.ttl_s:
                    self.lost_at = time.monotonic()
                    return


def join_etcd(options: EtcdOptions, *, run_id: str, node_id: str, op_timeout_s: float,
              connect_s: float, lease_s: float, interrupted: Callable[[], bool] = lambda: False,
              ) -> tuple[EtcdClient, Election | None]:
    """An agent's start on the etcd-v3 backend: reach the cluster within ``connect_s`` and
    run for the job's writer (key ``ftrun/<run id>/writer``, a lease of ``lease_s``).
    Returns the client and, when this agent won, its :class:`Election` (to resign at exit).
    Errors: :class:`~ftrun.control.errors.StoreError` with one line naming every endpoint."""
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
    when etcd counts as lost."""

    def __init__(self, connect: Callable[[], EtcdClient], key: str, value: str,
                 ttl_s: int, interval_s: float, on_won: Callable[[Election], None]) -> None:
        self._connect = connect
        self.key = key
        self.value = value
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self._on_won = on_won
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-writer-watch",
                                        daemon=True)

    def start(self) -> WriterWatch:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        client: EtcdClient | None = None
        held_at: float | None = None
        while not self._stop.wait(self.interval_s):
            try:
                client = client or self._connect()
                held, _ = client._range(self.key)
                if held is not None:
                    held_at = time.time()
                    continue
                election = Election(self._connect, self.key, self.value, self.ttl_s)
                election.vacated_at, election.held_at = time.time(), held_at
                if election.campaign():
                    self._on_won(election)
                    return
            except RuntimeError:
                client = None  # another endpoint at the next interval
