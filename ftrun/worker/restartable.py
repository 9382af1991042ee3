"""In-process re-entry for sharded training: ``ftrun.restartable(train)``.

A training function written for torchrun (FSDP2, tensor parallel, both on a device mesh)
keeps a shard of the state on each rank that exists nowhere else, so the DDP path of
:mod:`ftrun.worker.api` (a survivor sends its replica to a joiner) cannot recover it.
Here every K committed steps each rank's registered state is snapshotted into its node's
agent-owned memory (:mod:`ftrun.snapshot`), and a fault is survived by leaving the
training function and entering it again, in the same process::

    @ftrun.restartable(snapshot_every=1)
    def train(ft):                        # ft: a Session, fresh at each (re-)entry
        mesh = init_device_mesh("cpu", (ft.world_size,))   # the default group is ready
        model = build(mesh)               # fully_shard / parallelize_module as usual
        optimizer = torch.optim.AdamW(model.parameters())
        ft.register("model", model)       # restores the newest complete snapshot, if any
        ft.register("optimizer", optimizer)
        while ft.step < total_steps:
            train_step(ft.step, ft.rank)
            ft.step_done()                # counts the step, snapshots every K steps

    train()

On each entry the wrapper joins the next member epoch of the agents' regroup protocol
(:mod:`ftrun.protocol`) of the job's full world size (sharded state needs it; a smaller
epoch is waited past until the replacement is ready), initialises the default process
group on a store prefix of that member epoch (rank and world size from it), agrees with
the other members on the snapshot to restore (:mod:`ftrun.snapshot.records`), and calls
``train``. ``register`` loads the object's state from that snapshot (the file of this rank
in the node's snapshot memory: survivors and a replacement on the same node alike; on
several nodes the buddy's replica held here, or fetched from the node that holds it:
:mod:`ftrun.snapshot.replica`).

Leaving: when the agent ends the member epoch (a member failed), a watcher thread sees it
within 20 ms and shuts down this process's connections to its peers (gloo's sockets: every
TCP connection but the control store's) and the epoch's own store connection, which its
process groups meet on, so a collective blocked on the dead rank, or a group's build
waiting for the dead rank's address (the world's, or a device mesh's subgroup), fails at
once; ``train`` leaves with that ``RuntimeError`` or, between collectives, with
:class:`EpochEnded` raised by ``step_done``/``snapshot``. The wrapper then stops the
snapshot thread, destroys every process group (and so the device mesh's), collects the
old objects, and enters again. The process, its imports and its CUDA context stay.

Error semantics, written down:

* absorbed (re-entry): :class:`EpochEnded`, and a ``RuntimeError`` out of ``train`` when
  the agent ended the member epoch within ``fault_grace_s`` of it;
* raised: every other exception (the script's own), at once; :class:`~ftrun.worker.errors.
  RegroupError` after ``max_regroups`` member epochs in a row fail to form;
* a snapshot that cannot be taken (a state leaf that is not a tensor or a JSON value,
  the snapshot memory too small): :meth:`Session.snapshot` raises
  :class:`~ftrun.snapshot.format.SnapshotValueError` or
  :class:`~ftrun.snapshot.memory.SnapshotMemoryError` (one line, naming the object's path
  or the sizes); the automatic snapshot of ``step_done`` prints that line on stderr and
  goes on: the last complete snapshot stays the one recovery uses.

Timeouts (arguments of :func:`restartable`): ``collective_timeout_s`` (60 s) bounds one
collective and each control-store request; ``fault_grace_s`` (10 s) how long a failed
collective waits for the agent's end before it counts as the script's own;
``regroup_timeout_s`` (as in :func:`ftrun.init`) each wait on other members: the next
member epoch, every member's arrival, the restore choice; past it
:class:`~ftrun.worker.errors.RegroupTimeoutError`. A capture waits at most
``collective_timeout_s`` for the previous snapshot to leave the staging buffer. Building
the default group waits on the store for every member's address (released at once when
the epoch ends, see Leaving); a member that died between publishing its address and the
others' connects leaves them retrying the refused connect until the collective timeout,
and the recovery deadline ends that recovery first (a restart, never worse).

Without ftrun's regroup environment (torchrun, ``--recovery restart``) the same function
runs once: the default group is initialised from ``env://`` if the script has not, and
``step_done`` only counts.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from ftrun import protocol as P
from ftrun.control.auth import Signer, TokenError, load_secret
from ftrun.control.store import JsonStore, StoreError
from ftrun.snapshot import format as fmt
from ftrun.snapshot import memory, records, replica
from ftrun.snapshot.writer import Held, SnapshotBusyError, SnapshotWriter, Where, complete
from ftrun.worker import group, settings, sockets
from ftrun.worker.errors import RegroupError
from ftrun.worker.membership import POLL_S, Membership
from ftrun.worker.reentry import forget_group_names, forget_meshes, warm_up

T = TypeVar("T")

LEAVE_WAIT_S = 5.0  # how long leaving waits for the snapshot thread (see _leave)
WATCH_S = 0.02  # how often the watcher thread looks for the end of the member epoch


class EpochEnded(Exception):
    """The agent ended this member epoch: leave the training function (the wrapper
    re-enters it). Raised by :meth:`Session.step_done` and :meth:`Session.snapshot`."""


class SnapshotRestoreError(RuntimeError):
    """The snapshot chosen for recovery does not fit the registered objects."""


class Session:
    """What ``train`` gets at each entry: its rank, the step to start from, registration
    and the step boundary."""

    def __init__(self, runner: _Runner, rank: int, world_size: int, epoch: int,
                 restore: fmt.Snapshot | None) -> None:
        self._runner = runner
        self.rank = rank
        self.world_size = world_size
        self.epoch = epoch  # the member epoch (-1 outside ftrun's regroup mode)
        self._restore = restore
        self.step = 0
        if restore is not None:
            node = restore.child("ftrun", "step")
            value = node.get("value") if isinstance(node, dict) else None
            if isinstance(value, bool) or not isinstance(value, int):
                raise SnapshotRestoreError(f"rank {rank}: the snapshot has no step")
            self.step = value
        self._registered: dict[str, Any] = {}
        self._meshes: dict[tuple[tuple[int, ...], tuple[str, ...] | None], Any] = {}

    def register(self, name: str, obj: Any) -> None:
        """Register state to snapshot (``state_dict``/``load_state_dict``); during a
        recovery its state is loaded from the chosen snapshot here. Register a model
        before its optimizer (the optimizer's DTensors are rebuilt on the model's mesh)."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name}: needs state_dict() and load_state_dict()")
        self._registered[name] = obj
        self._learn_meshes(obj)
        if self._restore is None:
            return
        node = self._restore.child("state", name)
        if node is None:
            raise SnapshotRestoreError(
                f"rank {self.rank}: the snapshot of step {self.step} has no state for "
                f"{name!r}")
        obj.load_state_dict(fmt.unflatten(self._restore, self._find_mesh, node))

    def step_done(self) -> None:
        """One step is committed: count it, leave if the member epoch ended, snapshot
        every ``snapshot_every`` steps (errors of that snapshot: one line on stderr)."""
        self.step += 1
        runner = self._runner
        runner.progress = self.step
        if runner.membership is not None:
            runner.membership.committed()
        runner.check_ended()
        every = runner.snapshot_every
        if every and self.step % every == 0:
            try:
                self.snapshot()
            except (fmt.SnapshotValueError, memory.SnapshotMemoryError,
                    SnapshotBusyError) as error:
                if str(error) != runner.last_error:  # once, not at every step
                    runner.last_error = str(error)
                    runner.warn(f"snapshot of step {self.step} not taken: {error} (the last "
                                "complete snapshot stays the one a recovery uses)")

    def snapshot(self) -> None:
        """Snapshot every registered object's state now (asynchronously: returns once the
        tensors are copied out). Raises :class:`EpochEnded` if the member epoch ended."""
        runner = self._runner
        runner.check_ended()
        if runner.writer is None:
            return
        tensors: list[Any] = []
        items = [[name, fmt.flatten(obj.state_dict(), root=f"registered {name!r}: state",
                                    tensors=tensors)[0]]
                 for name, obj in self._registered.items()]
        tree = {"dict": [["ftrun", {"dict": [["step", {"value": self.step}]]}],
                         ["state", {"dict": items}]]}
        runner.writer.capture(self.step, tree, tensors)

    # --- restoring ----------------------------------------------------------------------

    def _learn_meshes(self, obj: Any) -> None:
        from torch.distributed.tensor import DTensor

        with contextlib.suppress(Exception):
            for value in obj.state_dict().values():
                if isinstance(value, DTensor):
                    mesh = value.device_mesh
                    key = (tuple(mesh.shape), tuple(mesh.mesh_dim_names)
                           if mesh.mesh_dim_names else None)
                    self._meshes.setdefault(key, mesh)

    def _find_mesh(self, shape: tuple[int, ...], dims: tuple[str, ...] | None) -> Any:
        # The meshes are the registered objects' own (a model is registered first).
        mesh = self._meshes.get((shape, dims))
        if mesh is None:
            raise SnapshotRestoreError(
                f"rank {self.rank}: a DTensor of the snapshot was on a mesh of shape "
                f"{list(shape)} (dims {dims}) and no registered object has one")
        return mesh


class _Runner:
    """One worker process's life under ``restartable``: member epochs, entries, snapshots."""

    def __init__(self, *, snapshot_every: int, collective_timeout_s: float,
                 fault_grace_s: float, max_regroups: int,
                 regroup_timeout_s: float | None) -> None:
        self.snapshot_every = snapshot_every
        self.timeout = timedelta(seconds=collective_timeout_s)
        self.fault_grace_s = fault_grace_s
        self.max_regroups = max_regroups
        self.progress = 0
        self.last_error = ""  # the last snapshot error said (said once)
        self.rank = int(os.environ.get("RANK", "-1"))  # in the current member epoch
        self.writer: SnapshotWriter | None = None
        # snapshots held, (job generation, member epoch, step): published or restored
        self.history: list[Held] = []
        self.host = socket.gethostname()
        self._ended = threading.Event()
        self._stop = threading.Event()
        self._epoch = -1
        env = P.WorkerEnv.from_env(os.environ)
        self.env = env
        self.member = env.member if env is not None else None
        self.membership: Membership | None = None
        self.directory: Path | None = None
        if env is not None and self.member is not None:
            self.regroup_timeout_s = settings.regroup_timeout_s(
                regroup_timeout_s, collective_timeout_s=collective_timeout_s,
                fault_grace_s=fault_grace_s)
            self.world_size = int(os.environ.get("WORLD_SIZE", "0"))
            self.local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
            self.server = os.environ.get(replica.ENV, "")
            self.run_id = os.environ.get(replica.RUN_ENV, "")
            if nodes > 1 and not (self.server and self.run_id):
                raise SystemExit(
                    f"ftrun.restartable: a job on {nodes} nodes needs its agent's snapshot "
                    f"replica server ({replica.ENV} is not set: an ftrun older than this API, "
                    "or the agent could not serve; see its first lines)")
            try:
                self.signer = Signer(load_secret())
            except TokenError as error:
                raise SystemExit(f"ftrun.restartable: {error}") from None
            text = os.environ.get(memory.ENV, "")
            if not text or not Path(text).is_dir():
                raise SystemExit(f"ftrun.restartable: {memory.ENV}={text!r} is not the "
                                 "agent's snapshot directory (an ftrun older than this API?)")
            self.directory = Path(text)
            try:
                self.cap = memory.cap_bytes()
            except memory.SnapshotMemoryError as error:
                raise SystemExit(f"ftrun.restartable: {error}") from None

    def warn(self, text: str) -> None:
        """One line on stderr naming this worker: its rank, member id and node."""
        member = f" (member {self.membership.member_id})" if self.membership else ""
        print(f"ftrun: rank {self.rank}{member} on {self.host}: {text}", file=sys.stderr,
              flush=True)

    # --- the end of a member epoch ------------------------------------------------------

    def check_ended(self) -> None:
        if self._ended.is_set():
            raise EpochEnded(f"member epoch {self._epoch} ended")

    def _watch(self, membership: Membership, open_store: Callable[[], JsonStore],
               port: int) -> None:
        """A thread: see the current member epoch's end and cut the peers' connections.

        A failed look (the store slow past its 10 s bound on a loaded node) is retried, not
        the end of the watch: a watcher that returned left its process to learn of later
        ends only from a collective that fails, and one that waits on a peer that never
        fails it (a mesh subgroup's collective has gloo's 30-minute default) stays inside
        the ended epoch. A failed client is never used again (its late answer would be read
        as the next request's): the next look opens a new one. If the agent is gone, its
        death signal ends this process."""
        seen = -1
        failures = 0
        store: JsonStore | None = None
        with contextlib.suppress(StoreError, RuntimeError):
            store = open_store()  # now, before the first member epoch needs it
        while not self._stop.wait(WATCH_S if not failures else min(1.0, WATCH_S * 2 ** failures)):
            epoch = self._epoch
            if epoch < 0 or epoch == seen:
                continue
            try:
                store = store or open_store()
                ended = membership.ended(epoch, store)
            except (StoreError, RuntimeError) as error:
                store = None
                failures += 1
                if failures == 1:
                    self.warn(f"the watch on member epoch {epoch}'s end failed a look "
                              f"({error}); looking again")
                continue
            failures = 0
            if ended is not None and epoch == self._epoch:
                seen = epoch
                self._ended.set()
                # the epoch's own store connection too: its groups wait on it
                sockets.shutdown_peer_connections(port, membership.group_connections)

    # --- the life -----------------------------------------------------------------------

    def run(self, train: Callable[..., T], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> T:
        if self.env is None or self.member is None:
            return self._run_plain(train, args, kwargs)
        env, member = self.env, self.member
        group.survive_aborts(env.user_torch_env)
        self.membership = membership = Membership(
            env, member, op_timeout=self.timeout, regroup_timeout_s=self.regroup_timeout_s,
            heartbeat_s=settings.heartbeat_s(), progress=lambda: (self.progress, 0))
        host, port = env.control_endpoint
        threads = [
            threading.Thread(target=membership.heartbeat, args=(self._stop,),
                             name="ftrun-heartbeat", daemon=True),
            threading.Thread(target=self._watch, args=(
                membership, functools.partial(self._own_store, membership, host, port), port),
                name="ftrun-epoch-watch", daemon=True),
        ]
        # Everything alive now (torch's modules, the script's imports) lives as long as
        # the process: out of the collector's way, a re-entry's collection takes
        # milliseconds instead of most of a second.
        gc.freeze()
        if not member.initial:  # a replacement or spare: warm up while it waits
            try:
                warm_up()
            except (RuntimeError, ValueError, ImportError) as error:
                self.warn(f"warm-up skipped: {error}")
        # Sharded state needs every rank: the leader fills a lost node's ranks with spares.
        membership.store.set_record(records.WHOLE_WORLD_KEY, {"world_size": self.world_size})
        membership.report()  # ready: past the imports, using the API
        for thread in threads:
            thread.start()
        try:
            return self._enter_until_done(train, args, kwargs)
        except BaseException:
            # The script's own error leaves the process: the snapshot thread and every
            # process group go first, while the interpreter is whole (gloo's threads at
            # its teardown turned a ValueError's exit 1 into a SIGABRT).
            with contextlib.suppress(Exception):
                self._leave()
            raise
        finally:
            self._stop.set()
            with contextlib.suppress(StoreError, RuntimeError):
                membership.report()
            for thread in threads:
                thread.join(self.timeout.total_seconds())

    def _own_store(self, membership: Membership, host: str, port: int) -> JsonStore:
        client = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        client.set_timeout(timedelta(seconds=10))
        return membership.store.with_client(client)

    def _enter_until_done(self, train: Callable[..., T], args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> T:
        assert self.membership is not None
        membership = self.membership
        after, failures = -1, 0
        while True:
            epoch = membership.await_epoch(after)
            after = epoch.number
            if epoch.world_size != self.world_size:
                continue  # sharded state needs every rank: wait for the replacement
            if not membership.formed(epoch):
                if membership.ended(epoch.number) is not None:
                    failures += 1
                if failures >= self.max_regroups:
                    raise RegroupError(f"member {membership.member_id}: {failures} member "
                                       "epochs in a row failed to form")
                continue
            failures = 0
            try:
                result = self._enter(epoch, train, args, kwargs)
            except EpochEnded:
                pass
            except RuntimeError:
                if not (self._ended.is_set()
                        or membership.explains_fault(self.fault_grace_s)):
                    raise
            else:
                membership.finished = True
                membership.report()
                self._leave()
                return result
            # Between member epochs every survivor reports the same progress (-1): the
            # survivors of a fault may be a step apart (the ranks outside the victim's
            # groups finished it), and the leader would take the one behind for stalled
            # while they all wait for the replacement.
            self.progress = -1
            membership.left()
            with contextlib.suppress(StoreError, RuntimeError):
                membership.report()
            self._leave()
            self.warn(f"member epoch {epoch.number} ended: re-entering the training "
                      "function")

    def _enter(self, epoch: P.MemberEpoch, train: Callable[..., T], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> T:
        assert self.membership is not None and self.env is not None
        assert self.directory is not None
        membership = self.membership
        rank = epoch.rank_of(membership.member_id)
        assert rank is not None
        self.rank = rank
        membership.members = tuple(m.id for m in epoch.members)
        membership.epoch = self._epoch = epoch.number
        self._ended.clear()
        client = membership.group_client(epoch.number, self.timeout.total_seconds())
        # The watch shuts down what it finds recorded once it sets _ended: an end it saw
        # before the record is caught here instead.
        if self._ended.is_set() or membership.ended(epoch.number) is not None:
            raise EpochEnded(f"member epoch {epoch.number} ended before its group was built")
        store = dist.PrefixStore(P.pg_prefix(membership.prefix, epoch.number), client)
        forget_group_names()  # every member of the epoch meets under the same names
        try:
            dist.init_process_group(group.backend_name(), store=store, rank=rank,
                                    world_size=epoch.world_size, timeout=self.timeout)
        finally:  # built or failed: the heartbeat stops watching the build either way
            membership.built()
        membership.entered(epoch.number)
        if self.server:  # where this node's copies are, for the buddies and the restorers
            membership.store.set_record(records.server_key(epoch.number, self.env.node_rank),
                                        {"address": self.server})
        choice = self._restore_choice(epoch, rank)
        snapshot = None
        if choice.epoch >= 0:
            snapshot = self._read(choice, rank)
            self.history = [choice.held]
        membership.synced = True
        self.progress = choice.step
        membership.report()
        writer_store = self._own_store(membership, *self.env.control_endpoint)
        self.writer = SnapshotWriter(
            self.directory, writer_store,
            Where(epoch.number, rank, epoch.world_size, self.env.node_rank, self.host,
                  self.env.generation),
            kept=self.history[-1] if self.history else None,
            local_ranks=self.local_ranks, cap=self.cap,
            timeout_s=self.timeout.total_seconds(), say=self.warn,
            replicate=self._replicator(epoch, rank, writer_store), server=self.server)
        session = Session(self, rank, epoch.world_size, epoch.number, snapshot)
        if snapshot is not None:
            restart = f" from_generation={choice.generation}" \
                if choice.generation != self.env.generation else ""
            print(f"restored step={session.step} rank={rank} epoch={epoch.number} "
                  f"from={choice.epoch}{restart}", flush=True)
        result = train(session, *args, **kwargs)
        self.writer.idle(self.timeout.total_seconds())
        return result

    def _leave(self) -> None:
        """Stop the snapshot thread, drop every process group and the old objects."""
        writer, self.writer = self.writer, None
        if writer is not None:
            # A replication to a node that went silent must not hold the re-entry up.
            writer.stop(min(self.timeout.total_seconds(), LEAVE_WAIT_S))
            self.history = (self.history + writer.published)[-3:]
        self._epoch = -1
        with contextlib.suppress(RuntimeError, ValueError, AssertionError):
            dist.destroy_process_group()
        forget_group_names()  # also after a build that failed: no group to destroy then
        forget_meshes()
        gc.collect()

    def _restore_choice(self, epoch: P.MemberEpoch, rank: int) -> records.Restore:
        """One choice per member epoch: the lowest-ranked member that held state before
        names the newest snapshot it holds that is complete; every member reads it. In a
        restarted job generation nobody held state yet: it names the newest complete
        snapshot an earlier generation left in this node's snapshot memory (the escalation
        ladder's restart: README), if any."""
        assert self.membership is not None
        membership = self.membership
        key = records.restore_key(epoch.number)
        if rank == epoch.source_rank:
            candidates = list(reversed(self.history)) or self._earlier_snapshots()
            choice = next((records.Restore(*held) for held in candidates
                           if complete(self._store_of(held[0]), held, self.directory)),
                          records.NONE)
            membership.store.put_record(key, choice.to_json())
        deadline = time.monotonic() + self.regroup_timeout_s
        while True:
            found = membership.store.first_record(key)
            if found is not None:
                try:
                    return records.Restore.from_json(found)
                except ValueError as error:
                    raise RegroupError(f"invalid restore record: {error}") from None
            if membership.ended(epoch.number) is not None:
                raise EpochEnded(f"member epoch {epoch.number} ended before its restore")
            if time.monotonic() > deadline:
                raise membership._timed_out("the choice of the snapshot to restore")
            time.sleep(POLL_S)

    def _earlier_snapshots(self) -> list[Held]:
        """Snapshots of earlier job generations in this node's snapshot memory (its own
        files and the buddy's replicas), newest first."""
        assert self.directory is not None and self.env is not None
        found: set[Held] = set()
        for folder in (self.directory, self.directory / replica.REPLICAS):
            with contextlib.suppress(OSError):
                for entry in folder.iterdir():
                    parsed = memory.parse_name(entry.name)
                    if parsed is not None and parsed[0] < self.env.generation:
                        found.add(parsed[:3])
        return sorted(found, reverse=True)

    def _store_of(self, generation: int) -> JsonStore:
        """The control-store records of ``generation``'s member epochs (this one's, or an
        earlier one's, kept beside it under its own prefix)."""
        assert self.membership is not None and self.env is not None
        if generation == self.env.generation:
            return self.membership.store
        return self.membership.store.scoped(P.regroup_prefix(self.env.run_id, generation))

    def _replicator(self, epoch: P.MemberEpoch, rank: int,
                    store: JsonStore) -> Any:
        """The writer's phase 2 for this member epoch: None when every member is on this
        node (the local copy alone counts), else a function that has this node's agent
        send the published file to the buddy node (:mod:`ftrun.snapshot.replica`)."""
        assert self.env is not None
        nodes = set()
        for member in epoch.members:
            node_text = member.id.partition(".")[0]
            if not node_text.isdigit():
                raise RegroupError(f"member id {member.id!r} does not name its node")
            nodes.add(int(node_text))
        buddy = replica.buddy_node(self.env.node_rank, nodes)
        if buddy is None:
            return None
        own = replica.parse_address(self.server)
        timeout_s = self.timeout.total_seconds()
        found: list[str] = []

        def replicate(step: int, crc: int, keep: Held | None) -> records.Written:
            if not found:  # the buddy's workers publish its address as they enter
                deadline = time.monotonic() + timeout_s
                while (record := store.get_record(
                        records.server_key(epoch.number, buddy))) is None:
                    if time.monotonic() > deadline or self._stop.is_set():
                        raise replica.ReplicaError(
                            f"node {buddy} (the buddy) published no replica server in "
                            f"{timeout_s:g} s")
                    time.sleep(POLL_S)
                address = record.get("address")
                if not isinstance(address, str):
                    raise replica.ReplicaError(f"node {buddy}'s server record is malformed")
                replica.parse_address(address)
                found.append(address)
            answer, _ = replica.request(
                own, self.signer, self.run_id, "replicate",
                {"generation": self.env.generation, "epoch": epoch.number, "step": step,
                 "rank": rank, "to": found[0],
                 "crc32": crc, "keep": list(keep) if keep else None,
                 "timeout_s": int(timeout_s)}, timeout_s=timeout_s * 2)
            if answer.get("crc32") != crc:
                raise replica.ReplicaError(f"rank {rank} step {step}: the buddy verified "
                                           f"CRC32 {answer.get('crc32')!r}, not {crc:#x}")
            size = answer.get("bytes")
            return records.Written(buddy, "", crc, size if isinstance(size, int) else 0,
                                   epoch.world_size, True, found[0])

        return replicate

    def _blob(self, choice: records.Restore, rank: int,
              written: records.Written | None) -> bytes:
        """Snapshot (choice, rank)'s bytes: this node's copy or the buddy's replica held
        here, else fetched from the node holding the replica, else from the node that
        wrote it (each fetch is checked against the record by :meth:`_read`)."""
        assert self.directory is not None and self.membership is not None
        name = memory.file_name(*choice.held, rank)
        for path in (self.directory / name, self.directory / replica.REPLICAS / name):
            with contextlib.suppress(FileNotFoundError):
                return path.read_bytes()
        copy = self._store_of(choice.generation).get_record(
            records.replica_key(choice.epoch, choice.step, rank))
        servers = []
        with contextlib.suppress(ValueError):
            if copy is not None:
                servers.append(records.Written.from_json(copy).server)
        if written is not None:
            servers.append(written.server)
        errors = []
        for server in filter(None, servers):
            try:
                return replica.fetch(replica.parse_address(server), self.signer, self.run_id,
                                     choice.held, rank,
                                     timeout_s=self.timeout.total_seconds())
            except replica.ReplicaError as error:
                errors.append(str(error))
        raise SnapshotRestoreError(f"rank {rank}: snapshot {name} is on no node reachable "
                                   f"from {self.host} ({'; '.join(errors) or 'no copy'})")

    def _read(self, choice: records.Restore, rank: int) -> fmt.Snapshot:
        assert self.directory is not None and self.membership is not None
        name = memory.file_name(*choice.held, rank)
        record = self._store_of(choice.generation).get_record(
            records.local_key(choice.epoch, choice.step, rank))
        written = records.Written.from_json(record) if record else None
        blob = self._blob(choice, rank, written)
        snapshot = fmt.parse(blob)
        if written is None or written.size != len(blob) or written.crc32 != snapshot.crc32:
            raise SnapshotRestoreError(f"rank {rank}: snapshot file {name} does not match "
                                       "its record in the control store")
        return snapshot

    def _run_plain(self, train: Callable[..., T], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> T:
        """Under torchrun or ``--recovery restart``: one entry, no snapshots."""
        if not dist.is_initialized():
            dist.init_process_group(group.backend_name(), timeout=self.timeout)
        session = Session(self, dist.get_rank(), dist.get_world_size(), -1, None)
        return train(session, *args, **kwargs)


def restartable(
    train: Callable[..., T] | None = None,
    *,
    snapshot_every: int = 1,
    collective_timeout_s: float = 60.0,
    fault_grace_s: float = 10.0,
    max_regroups: int = 5,
    regroup_timeout_s: float | None = None,
) -> Any:
    """Wrap ``train(session, *args, **kwargs)`` so that it survives a fault in process (see
    the module). Use as ``restartable(train)``, ``@restartable`` or
    ``@restartable(snapshot_every=K)``; ``snapshot_every=0`` takes none automatically
    (call ``session.snapshot()`` yourself)."""
    if snapshot_every < 0:
        raise ValueError(f"snapshot_every={snapshot_every} must be >= 0")

    def wrap(function: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> T:
            runner = _Runner(snapshot_every=snapshot_every,
                             collective_timeout_s=collective_timeout_s,
                             fault_grace_s=fault_grace_s, max_regroups=max_regroups,
                             regroup_timeout_s=regroup_timeout_s)
            return runner.run(function, args, kwargs)
        return run

    return wrap(train) if train is not None else wrap


__all__ = ["EpochEnded", "Session", "SnapshotRestoreError", "restartable"]
