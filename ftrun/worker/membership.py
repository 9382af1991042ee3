"""A worker's membership in the job: the member epochs it follows, one decision per step.

The agents' leader publishes member epochs (who computes, with which ranks: ``rgen/<n>``
in :mod:`ftrun.protocol`); the agents end one when a member fails. This module is the
worker's side of that contract, and all of the worker's traffic with the control store:

* following the member epochs: the first newer one that includes this member;
* meeting its other members: each writes its arrival, and one ``formed`` (or
  ``abandoned``) decision per epoch says whether they build a group together;
* the commit vote of each step, so that a step is applied on every member or on none;
* the heartbeat thread: this member's status (liveness and progress) for its agent, and
  cutting this process's connections to a node the leader declared lost.

It is apart from :mod:`ftrun.worker.api` because none of it touches the model, the
optimizer or the process group: it only reads and writes signed records.

Every wait here ends: for the records it waits on, for the member epoch to be ended or
superseded (the agents' signal that a fault happened), or at ``regroup_timeout_s``
(:class:`~ftrun.worker.errors.RegroupTimeoutError`), with one exception stated where it is:
a worker without the job's state waits to be admitted for as long as the job runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ftrun import protocol as P
from ftrun.control.auth import Signer, load_secret
from ftrun.control.store import JsonStore, StoreError, StoreValueError
from ftrun.control.tcpstore import connect_store, reconnect_store
from ftrun.worker import sockets
from ftrun.worker.errors import RegroupError, RegroupTimeoutError
from ftrun.worker.sockets import shutdown_connections_to

POLL_S = 0.005  # between two looks at a record that a peer or the leader writes
#: etcd-v3: between two looks at the agent's store file (an ``os.stat``) for a moved store
FOLLOW_S = 0.1


def store_file_address(path: str, signer: Signer, key: str, generation: int
                       ) -> tuple[str, int]:
    """etcd-v3: where the agent says the generation's member-epoch store is now (the file
    of ``protocol.STORE_FILE_ENV``, a record signed under ``key``); StoreError when the
    file cannot be read, is not signed with the job's secret or names another generation
    (a request then retries, as for any failed connect)."""
    try:
        body = signer.unwrap(key, json.loads(Path(path).read_text()))
    except (OSError, ValueError) as error:  # AuthError and JSONDecodeError are ValueErrors
        raise StoreError(f"the store file {path}: {error}") from None
    host, port = body.get("host"), body.get("port")
    if body.get("generation") != generation or not isinstance(host, str) or not host \
            or not isinstance(port, int) or not 0 < port < 65536:
        raise StoreError(f"the store file {path} names no store of generation {generation}")
    return host, port


def checked(record: dict[str, Any], allowed: tuple[str, ...]) -> str:
    try:
        return P.outcome_of(record, allowed)
    except StoreValueError as error:  # signed, so written by a member: a bug, not a fault
        raise RegroupError(f"invalid record in the store: {error}") from None


class _Bound:
    """The deadline of one wait, counted from when it is made."""

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s

    def passed(self) -> bool:
        return time.monotonic() >= self.deadline


class _StoreFollower:
    """etcd-v3: releases this process's requests to a member-epoch store that moved.

    When the job's writer dies its store goes with it, and the agent writes the new
    store's address to its store file. A request already sent to the dead store would wait
    out its bound (10 s for a beat, a collective timeout for the main thread) when the dead
    host drops packets instead of resetting: the link cut in ``tests/test_etcd.py`` stepped
    again 10.3 s after the cut, 2.2 s after the new writer served its store. So this looks
    at the file every ``FOLLOW_S`` and, when it names another store, shuts down this
    process's connections to the old one's address and port: each blocked request fails
    at once, and :class:`~ftrun.control.store.JsonStore` reconnects to the new store (its
    ``reconnect`` reads the same file). Only ``os.stat`` while the file is unchanged."""

    def __init__(self, env: P.WorkerEnv, signer: Signer) -> None:
        self._path = os.environ[P.STORE_FILE_ENV]
        self._signer = signer
        self._key = P.store_file_key(env.run_id, env.generation)
        self._generation = env.generation
        self._seen: tuple[int, int, int] | None = None
        self.serving = env.control_endpoint  # the store this process connected to first

    def _read(self) -> tuple[str, int] | None:
        """The address the file names now, when it changed since the last look and is a
        valid record of this generation (a record being replaced is read on the next look)."""
        try:
            info = os.stat(self._path)
        except OSError:
            return None
        mark = (info.st_ino, info.st_mtime_ns, info.st_size)
        if mark == self._seen:
            return None
        try:
            found = store_file_address(self._path, self._signer, self._key, self._generation)
        except StoreError:
            return None
        self._seen = mark
        return found

    def run(self, stop: threading.Event, done: threading.Event) -> None:
        """Until ``stop`` or ``done`` is set (a thread's target)."""
        while not done.wait(FOLLOW_S) and not stop.is_set():
            found = self._read()
            if found is not None and found != self.serving:
                shutdown_connections_to(*self.serving)
                self.serving = found


class Membership:
    """This worker's side of the regroup protocol, on two connections to the control store
    (one for the main thread, one for the heartbeat thread)."""

    def __init__(self, env: P.WorkerEnv, member: P.MemberEnv, *, op_timeout: timedelta,
                 regroup_timeout_s: float, heartbeat_s: float,
                 progress: Callable[[], tuple[int, int]]) -> None:
        host, port = env.control_endpoint
        signer = Signer(load_secret())  # the job's secret, from the agent's environment
        self.member_id = member.member_id
        self.prefix = member.prefix
        # etcd-v3: the store may move (the job's writer died and a new one took over); a
        # failed request then reconnects to where the agent's store file says it is now,
        # for up to a collective timeout (op_timeout), and fails with StoreError after it.
        # There the bounds are also put on the clients' sockets (control/tcpstore.py
        # connect_store): a request to a writer whose link is cut fails within its bound
        # instead of waiting for TCP to give up.
        moved = self._moved_store(env, signer, op_timeout)
        bound_s = op_timeout.total_seconds()
        retry_s = bound_s if moved is not None else 0.0

        def first_client(request_s: float) -> dist.TCPStore:
            if moved is None:
                client = dist.TCPStore(host, port, is_master=False, timeout=op_timeout)
                client.set_timeout(timedelta(seconds=request_s))
                return client
            return connect_store(host, port, bound_s, op_timeout_s=request_s)
        self._connect = first_client if moved is None else moved
        self.store = JsonStore(first_client(bound_s), member.prefix, signer=signer,
                               reconnect=moved, retry_s=retry_s)
        # The heartbeat's own connection: connected with the main bound (a loaded node can
        # take over 10 s to accept it), then each beat bounded by 10 s so a slow store
        # cannot stall the thread that says this member is alive.
        beat_client = first_client(10.0)

        def beat_reconnect() -> dist.TCPStore:
            assert moved is not None
            return moved(10.0)
        self._beat_store = JsonStore(beat_client, member.prefix, signer=signer,
                                     reconnect=None if moved is None else beat_reconnect,
                                     retry_s=retry_s)
        self.epoch = -1  # the member epoch this member computes in; -1 before the first
        self.members: tuple[str, ...] = ()  # of the current member epoch, in rank order
        self.synced = member.initial  # holds the job's state (a joiner once it received it)
        self.finished = False
        self.computing = -1  # the member epoch whose step is being computed, or -1
        # The member epoch this member is inside (built its group, has not left it), -1
        # between epochs, and the steps it committed inside it: the leader's stuck and
        # stall rules and the recovery deadline read them (protocol.Status).
        self.inside = -1
        self.epoch_steps = 0
        self._cut_off = -1  # the last member epoch whose connections to a lost node were cut
        # The store connection of the member epoch whose groups are being built, and that
        # epoch (-1 when none is): see group_client.
        self.group_connections: frozenset[sockets.Connection] = frozenset()
        self._building = -1
        self._beats = 0
        self._progress = progress  # (committed steps, collectives issued in this step)
        self._heartbeat_s = heartbeat_s
        self.regroup_timeout_s = regroup_timeout_s
        self._follow = None if moved is None else _StoreFollower(env, signer)

    @staticmethod
    def _moved_store(env: P.WorkerEnv, signer: Signer, op_timeout: timedelta
                     ) -> Callable[..., dist.TCPStore] | None:
        """etcd-v3 jobs (the agent set ``STORE_FILE_ENV``): a connect to the store the
        agent's file names now, each attempt bounded by 2 s so that a new address written
        meanwhile is read on the next one, its requests by ``request_s`` (default: the
        collective timeout); None for the other backends (the store never moves there:
        losing its host ends the job generation)."""
        path = os.environ.get(P.STORE_FILE_ENV)
        if not path:
            return None
        key = P.store_file_key(env.run_id, env.generation)
        bound_s = op_timeout.total_seconds()

        def connect(request_s: float = bound_s) -> dist.TCPStore:
            host, port = store_file_address(path, signer, key, env.generation)
            # refused at once (torch would retry, and log, every failed connect to a dead
            # store), and the next attempt reads the file again
            return reconnect_store(host, port, min(2.0, bound_s), op_timeout_s=request_s)
        return connect

    def group_client(self, number: int, request_s: float) -> dist.TCPStore:
        """A new connection to the control store (where it is now) for member epoch
        ``number``'s process groups, each request bounded by ``request_s``.

        The groups wait on it for their peers' addresses, and nothing else uses it, so the
        epoch's end can shut it down (:mod:`ftrun.worker.sockets`) without touching the
        connections the protocol goes on using: a member that died after it arrived
        otherwise holds every other member in the build until its timeout. The heartbeat
        does that while the group is being built (:meth:`built` ends that); the
        ``restartable`` watch, for the whole epoch, through :attr:`group_connections`."""
        with sockets.opened() as made:
            client = self._connect(request_s)
        self.group_connections = frozenset(made)
        self._building = number
        return client

    def built(self) -> None:
        """The member epoch's groups are built: the heartbeat stops watching the build."""
        self._building = -1

    # --- status and the heartbeat thread --------------------------------------------------

    def report(self, store: JsonStore | None = None) -> None:
        self._beats += 1
        steps, collectives = self._progress()
        status = P.Status(self._beats, steps, collectives, self.synced, self.finished,
                          self.inside, self.epoch_steps)
        (store or self.store).set_record(P.status_key(self.member_id), status.to_json())

    def heartbeat(self, stop: threading.Event) -> None:
        """Liveness and progress, off the main thread (a thread's target, until ``stop``): a
        main thread that stops issuing collectives shows as progress that stands still while
        the beats go on."""
        follower = done = None
        if self._follow is not None:  # etcd-v3: the store may move (see _StoreFollower)
            done = threading.Event()
            follower = threading.Thread(target=self._follow.run, args=(stop, done),
                                        name="ftrun-store-follow", daemon=True)
            follower.start()
        try:
            while not stop.wait(self._heartbeat_s):
                try:
                    self.report(self._beat_store)
                    self._release_from_lost_node()
                    self._release_group_build()
                except (StoreError, RuntimeError):
                    return  # the agent is gone; PDEATHSIG ends this process
        finally:
            if follower is not None and done is not None:
                done.set()
                follower.join(2 * FOLLOW_S)

    def _release_from_lost_node(self) -> None:
        """Fail a collective that waits on a node the leader declared lost.

        A peer on a node that lost its link sends no reset: gloo would wait for its
        timeout. Shutting down this process's connections to that node's address makes
        the collective fail now (the same role the NCCL shim's abort plays on GPUs); the
        main thread then finds the member epoch ended and regroups.
        """
        epoch = self.computing
        if epoch < 0 or epoch == self._cut_off:
            return
        end = self.ended(epoch, self._beat_store)
        addr = end.get("addr") if end else None
        if not isinstance(addr, str):
            return
        self._cut_off = epoch
        shutdown_connections_to(addr)

    def _release_group_build(self) -> None:
        """Fail a group build that waits for a member of an epoch that ended meanwhile."""
        number, connections = self._building, self.group_connections
        if number < 0 or self.ended(number, self._beat_store) is None:
            return
        if number == self._building:
            self._building = -1
            sockets.shutdown_connections(lambda own, peer: (own, peer) in connections)

    def entered(self, number: int) -> None:
        """This member is now inside member epoch ``number`` (its group is built)."""
        self.inside, self.epoch_steps = number, 0

    def left(self) -> None:
        """This member left its member epoch: it waits for the next one."""
        self.inside = -1

    def committed(self) -> None:
        """A step was committed inside the current member epoch."""
        self.epoch_steps += 1

    # --- faults and the vote --------------------------------------------------------------

    def ended(self, number: int, store: JsonStore | None = None) -> dict[str, Any] | None:
        """Why member epoch ``number`` ended (a valid record only), or None."""
        return (store or self.store).first_record(P.end_key(number))

    def explains_fault(self, grace_s: float, epoch: int | None = None) -> bool:
        """A collective failed: did the agents end member epoch ``epoch`` (default: the
        current one), or do they within ``grace_s``? Otherwise the error is the script's
        own."""
        number = self.epoch if epoch is None else epoch
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self.ended(number) is not None:
                return True
            time.sleep(POLL_S * 4)
        return False

    def decide(self, epoch: int, step: int, voted: bool) -> str:
        """Vote on ``step`` (when ``voted``: this member's gradients are good) and return the
        step's one decision. Past ``regroup_timeout_s`` without one, this member appends
        ``abort`` (no member may apply a step it does not) and, unless a decision won
        before it, raises :class:`RegroupTimeoutError`."""
        key = P.decision_key(epoch, step)
        votes = {m: P.vote_key(epoch, step, m) for m in self.members}
        if voted:
            self.store.set_record(P.vote_key(epoch, step, self.member_id), {})
            # The counter only says when to look (anyone could bump it); the votes decide.
            counted = self.store.add(P.votes_key(epoch, step), 1)
            if counted >= len(self.members) and self._all_valid(list(votes.values())):
                joiner_waits = self.store.first_record(P.join_key(epoch)) is not None
                self.store.put_record(
                    key, {"value": P.COMMIT_REGROUP if joiner_waits else P.COMMIT})
        else:  # without this member's vote the step cannot commit: abort it now
            self.store.put_record(key, {"value": P.ABORT})
        bound, late = _Bound(self.regroup_timeout_s), False
        pause, look_at_end = POLL_S / 25, time.monotonic() + 0.05
        while True:
            # check(), not a server-side wait: torch's client prints two "[c10d]
            # waitForInput ... timed out" warnings for every wait that times out, which
            # looked like errors in every rank's output, every step, on a loaded machine.
            # The pause grows from 0.2 ms to POLL_S: a decision written at once is seen at once.
            present = self.store.exists(key)
            if not present:
                time.sleep(pause)
                pause = min(2 * pause, POLL_S)
            if present:
                record = self.store.first_record(key)
                if record is not None:
                    decision = checked(record, P.DECISIONS)
                    if late and decision == P.ABORT and self.ended(epoch) is None:
                        raise self._timed_out(
                            f"the decision on step {step} (no valid vote yet from: "
                            f"{self._lacking(votes)})")
                    return decision
                time.sleep(POLL_S)  # it holds only records without the job's secret
            if time.monotonic() < look_at_end:
                continue
            look_at_end = time.monotonic() + 0.05  # as often as the 50 ms waits before
            if self.ended(epoch) is not None:
                self.store.put_record(key, {"value": P.ABORT})
                continue
            if not late and bound.passed():
                late = True
                self.store.put_record(key, {"value": P.ABORT})

    # --- member epochs --------------------------------------------------------------------

    def await_epoch(self, after: int) -> P.MemberEpoch:
        """The first member epoch newer than ``after`` that includes this member.

        Bounded by ``regroup_timeout_s`` while this worker holds the job's state (it was a
        member: the leader publishes the next epoch seconds after a fault). A joiner or a
        warm spare is not: it waits to be admitted for as long as the job runs, which may be
        the whole job (its agent stops it with the job)."""
        bound = _Bound(self.regroup_timeout_s) if self.synced else None
        newer_than = after
        while True:
            latest = self.store.get_record(P.LATEST)
            number = latest.get("number") if latest else None
            if isinstance(number, int) and number > after:
                record = self.store.get_record(P.generation_key(number))
                if record is not None:
                    epoch = P.MemberEpoch.from_json(record)
                    if epoch.rank_of(self.member_id) is not None:
                        return epoch
                    after = number  # not in this one (a spare): wait for a later one
            if bound is not None and bound.passed():
                raise self._timed_out(
                    "its first member epoch" if newer_than < 0 else
                    f"a member epoch after {newer_than} with it as a member (the agents' "
                    "leader publishes them)")
            time.sleep(POLL_S)

    def formed(self, epoch: P.MemberEpoch) -> bool:
        """Whether ``epoch`` forms: one decision for all its members.

        A member that finds every member's arrival appends ``formed``; a member that sees
        the epoch ended, or a newer one published (the leader admitted another joiner
        meanwhile), appends ``abandoned``. The first valid record of the one key wins, so
        no member builds a group that another has left.

        The bound counts from when every joiner and the survivor that sends the state have
        arrived: until then the wait is on the script's own code (a joiner builds its
        model before its first ``run_step``; survivors finish the step they are in, and
        leave it together). Past it, this member appends ``abandoned`` and, unless
        ``formed`` won before, raises :class:`RegroupTimeoutError`.
        """
        number = epoch.number
        key = P.formed_key(number)
        arrivals = {m.id: P.arrived_key(number, m.id) for m in epoch.members}
        self.store.set_record(arrivals[self.member_id], {})
        if self._all_valid(list(arrivals.values())):
            self.store.put_record(key, {"value": P.FORMED})
        first = [arrivals[m.id] for m in epoch.members
                 if m.joiner or m.rank == epoch.source_rank]
        bound: _Bound | None = None
        late, look_at = False, 0.0
        while True:
            record = self.store.first_record(key)
            if record is not None:
                outcome = checked(record, (P.FORMED, P.ABANDONED))
                if late and outcome == P.ABANDONED and not self._superseded(number):
                    raise self._timed_out(f"every member of member epoch {number} to arrive "
                                          f"(missing: {self._lacking(arrivals)})")
                return outcome == P.FORMED
            if self._superseded(number):
                self.store.put_record(key, {"value": P.ABANDONED})
                continue
            if bound is None:
                if time.monotonic() >= look_at:  # a tenth of a second is precise enough
                    look_at = time.monotonic() + POLL_S * 20
                    if self._all_valid(first):
                        bound = _Bound(self.regroup_timeout_s)
            elif not late and bound.passed():
                late = True
                self.store.put_record(key, {"value": P.ABANDONED})
                continue
            time.sleep(POLL_S)

    def _superseded(self, number: int) -> bool:
        """Member epoch ``number`` ended, or a newer one is published."""
        latest = self.store.get_record(P.LATEST) or {}
        newer = isinstance(latest.get("number"), int) and latest["number"] > number
        return newer or self.ended(number) is not None

    # --- reading records ------------------------------------------------------------------

    def _all_valid(self, names: list[str]) -> bool:
        return self.store.all_valid(names)

    def _lacking(self, keys: dict[str, str]) -> str:
        """The members (of member id -> key) without a valid record yet: for an error."""
        try:
            present = self.store.present_records(list(keys.values()))
        except StoreError as error:
            return f"unknown ({error})"
        return ", ".join(m for m, k in keys.items() if present.get(k) is None) or "none"

    def _timed_out(self, waited_for: str) -> RegroupTimeoutError:
        return RegroupTimeoutError(self.member_id, self.epoch, waited_for,
                                   self.regroup_timeout_s)
