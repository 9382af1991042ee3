"""The worker API: ``import ftrun`` lets a training script survive a fault without a restart.

    ft = ftrun.init()                                   # join the job
    model = DistributedDataParallel(net, process_group=ft.process_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ft.register("model", model)                         # state a joiner must receive
    ft.register("optimizer", optimizer)
    while ft.step < total_steps:
        ft.run_step(lambda: train_step(ft.step, ft.rank, ft.world_size), optimizer.step)

What happens underneath. ``ft.process_group`` is one Python ``ProcessGroup`` object for the
whole job; each generation swaps a fresh backend into it (gloo on CPU, NCCL on GPU), built
on a store prefix of its own, so a DDP model built once keeps working. ``run_step`` runs
``compute`` (forward and backward: the gradient collective happens inside), then the
commit vote of :mod:`ftrun.protocol`: ``apply`` (the optimizer step) runs on every member or
on none. When a member fails, the agent ends the generation; the survivors' collective
fails fast (a dead gloo peer closes its sockets; the NCCL shim aborts hung communicators),
the vote says ``abort``, and the survivors join the next generation and repeat the step.
A joiner (a replacement or a warm spare) receives every registered object's state from the
lowest-ranked survivor over the new group: no disk.

Error semantics, written down:

* absorbed and retried: any ``RuntimeError`` raised by ``compute`` (torch's
  ``DistBackendError`` and gloo's connection errors are RuntimeErrors) *if* the agent ends
  the generation within ``fault_grace_s`` (default 10 s) of it: that is a fault elsewhere;
* raised: every other exception, at once, and a ``RuntimeError`` that no generation end
  explains within the grace: those are the script's own errors, and the process exits;
* after ``max_regroups`` consecutive generations that fail to form (default 5),
  :class:`RegroupError` is raised and the worker exits, so the agent falls back to stopping
  the job instead of looping forever.

Without ftrun's regroup environment (under torchrun, or ``--recovery restart``) the same
script runs unchanged: ``init`` forms an ordinary static group from ``env://`` variables
and ``run_step`` simply computes and applies.

``compute`` must start from zeroed gradients (call ``optimizer.zero_grad()`` first): a
failed step leaves partial sums in them. Register objects with ``state_dict`` /
``load_state_dict``; state is sent with ``torch.save`` and read with
``torch.load(weights_only=True)``, which accepts tensors and plain containers only.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftrun import protocol as P
from ftrun.control.auth import Signer, load_secret
from ftrun.control.store import JsonStore, StoreError, StoreValueError
from ftrun.shim import SURVIVOR_TORCH_ENV

T = TypeVar("T")

HEARTBEAT_S = float(os.environ.get("FTRUN_WORKER_HEARTBEAT_S", "0.2"))
POLL_S = 0.005


class RegroupError(RuntimeError):
    """The job could not form a working generation; the worker gives up."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class ResilientProcessGroup(dist.ProcessGroup):
    """A process group whose backend is replaced at each regroup.

    torch calls ``getRank``/``getSize`` through virtual methods, so DDP and user code see
    the current generation's rank and size; every collective goes to the current backend.
    """

    def __init__(self, backend: dist.ProcessGroup) -> None:
        super().__init__(backend.rank(), backend.size())
        self._backend = backend
        self.issued = 0  # collectives started in this step: tells a stalled rank apart

    @property
    def backend(self) -> dist.ProcessGroup:
        return self._backend

    def swap(self, backend: dist.ProcessGroup) -> None:
        self._backend = backend

    def getRank(self) -> int:
        return self._backend.rank()

    def getSize(self) -> int:
        return self._backend.size()

    def getBackendName(self) -> str:
        return "ftrun"

    def allreduce(self, tensors: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.broadcast(tensors, opts)

    def allgather(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.allgather(outputs, inputs, opts)

    def _allgather_base(self, output: Any, inp: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend._allgather_base(output, inp, opts)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.reduce_scatter(outputs, inputs, opts)

    def barrier(self, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.barrier(opts)


def _renew_reducer(model: DistributedDataParallel) -> None:
    """Give a DDP model a fresh reducer, as its unpickling does.

    Survivors' reducers have rebuilt their buckets in gradient order and may hold state of
    the failed step, while a joiner's is new: gradients would be reduced in mismatched
    layouts. A fresh reducer on every member restores one layout, and the one-time bucket
    rebuild then happens on all members at the same step. (Comm hooks are not carried
    over: register them again in an ``on_regroup`` callback.)
    """
    parameters, sparse = model._build_params_for_reducer()
    names = model._build_debug_param_to_name_mapping(parameters)
    model._ddp_init_helper(parameters, sparse, names, model.static_graph)
    model._has_rebuilt_buckets = False
    if model.static_graph:
        model.reducer._set_static_graph()


def _release(holder: list[Any]) -> None:
    backend = holder.pop()
    with contextlib.suppress(RuntimeError):
        backend.abort()
    del backend  # the destructor closes the backend's connections


def _shutdown_connections_to(host: str) -> int:
    """Shut down this process's TCP connections to ``host``; returns how many.

    Each socket is reached through a duplicate of its descriptor: ``shutdown`` acts on the
    connection itself (its owner's blocked reads see end-of-file), while closing the
    duplicate leaves the owner's descriptor as it was.
    """
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return 0
    addresses |= {f"::ffff:{a}" for a in addresses if ":" not in a}  # v4-mapped peers
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            with socket.socket(fileno=os.dup(int(name))) as sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in (
                        socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.getpeername()[0] in addresses:
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
    return count


def _checked(record: dict[str, Any], allowed: tuple[str, ...]) -> str:
    try:
        return P.outcome_of(record, allowed)
    except StoreValueError as error:  # signed, so written by a member: a bug, not a fault
        raise RegroupError(f"invalid record in the store: {error}") from None


def _backend_name() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _make_backend(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    if _backend_name() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class FaultTolerance:
    """One worker's membership in the job. Create it with :func:`init`."""

    def __init__(self, *, collective_timeout_s: float, fault_grace_s: float,
                 max_regroups: int) -> None:
        self._timeout = timedelta(seconds=collective_timeout_s)
        self._fault_grace_s = fault_grace_s
        self._max_regroups = max_regroups
        self._registered: dict[str, Stateful] = {}
        self._callbacks: list[Callable[[int, int], None]] = []
        self._step = 0
        self._generation = -1
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []  # heartbeat, retire: joined by close()
        self.member_id = os.environ.get("FTRUN_MEMBER_ID", "")
        self.managed = bool(self.member_id and os.environ.get("FTRUN_REGROUP_PREFIX"))
        if self.managed:
            self._connect()
        else:
            self._static_group()

    # --- public ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.process_group.rank()

    @property
    def world_size(self) -> int:
        return self.process_group.size()

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def step(self) -> int:
        """The number of committed steps: the index of the next step to compute."""
        return self._step

    def register(self, name: str, obj: Stateful) -> None:
        """Register state that a joining worker must receive (model, optimizer, ...)."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name}: needs state_dict() and load_state_dict()")
        self._registered[name] = obj

    def state_dict(self) -> dict[str, Any]:
        """Every registered object's state and the step counter: a disk checkpoint."""
        return {"step": self._step,
                "state": {name: obj.state_dict() for name, obj in self._registered.items()}}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Restore a checkpoint written from :meth:`state_dict` (for a cold restart)."""
        for name, obj in self._registered.items():
            obj.load_state_dict(checkpoint["state"][name])
        self._step = int(checkpoint["step"])

    def on_regroup(self, callback: Callable[[int, int], None]) -> None:
        """Call ``callback(rank, world_size)`` after every regroup (to re-shard data)."""
        self._callbacks.append(callback)

    def run_step(self, compute: Callable[[], T], apply: Callable[[], Any]) -> T | None:
        """Compute one step and apply it if every member's gradients are good.

        Returns what ``compute`` returned when the step was committed, ``None`` when it was
        not (a fault or a join happened; ``step`` is unchanged, so the loop repeats it).
        """
        if not self.managed:
            result = compute()
            apply()
            self._step += 1
            return result
        if self._pending_join:
            self._regroup(after=-1)
            return None
        generation, step = self._generation, self._step
        self.process_group.issued = 0  # progress within this step (see _beat)
        voted = True
        result: T | None = None
        self._computing = generation
        try:
            result = compute()
        except RuntimeError as error:
            if not self._fault_explains(error):
                raise
            voted = False
        finally:
            self._computing = -1
        decision = self._decide(generation, step, voted)
        if decision == P.ABORT:
            self._regroup(after=generation)
            return None
        apply()
        self._step += 1
        if decision == P.COMMIT_REGROUP:
            self._regroup(after=generation)
        return result

    def close(self) -> None:
        """Say this member finished its training loop (no one joins a finished job), then
        stop this worker's threads and the backend's: call it last, the group has no peers
        afterwards.

        Nothing may take the GIL once the interpreter finalizes: a thread that asks for it
        then is ended with ``pthread_exit``, and that unwinding through a C++ destructor
        (noexcept) calls ``std::terminate`` ("terminate called without an active
        exception", SIGABRT; SIGSEGV when torch's error handler has enabled faulthandler).
        gloo's worker threads drop each finished work, and a work queued from inside
        backward (DDP's gradient allreduce) holds the thread-local state with the
        ``contextvars.Context`` that autograd stashes there: dropping it takes the GIL,
        whenever that thread gets to it. Our own threads release the GIL in store calls
        (heartbeat) and in a backend's destructor (retire). So they are joined here, and the
        backend is dropped here, while the interpreter is alive (its binding releases the
        GIL while the destructor joins gloo's threads).
        """
        if self.managed and not self._stop.is_set():
            self._stop.set()
            self._finished = True
            with contextlib.suppress(StoreError, RuntimeError):
                self._report()
        self._stop.set()
        deadline = time.monotonic() + self._timeout.total_seconds()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        old = self.process_group.backend
        self.process_group.swap(self._solo_backend())  # idle: nothing is ever queued on it
        with contextlib.suppress(RuntimeError):
            old.shutdown()  # a no-op for gloo; what destroy_process_group does for NCCL
        del old  # the last reference: the destructor joins the backend's threads

    # --- set-up ---------------------------------------------------------------------------

    def _static_group(self) -> None:
        """Outside ftrun's regroup mode: an ordinary group from torchrun's variables.

        torch's own env:// rendezvous decides who serves the store (the launcher's, or rank
        0's); the key prefix carries the restart count, so a restarted worker never reads
        an address that a worker of the previous attempt left in a store that outlived it.
        """
        store, rank, size = next(dist.rendezvous("env://", timeout=self._timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        backend = _make_backend(dist.PrefixStore(f"ftrun/static/{attempt}/", store), rank, size,
                                self._timeout)
        self.process_group = ResilientProcessGroup(backend)
        self._pending_join = False

    def _connect(self) -> None:
        # A survivor must outlive an aborted communicator: torch's defaults tear the process
        # down instead. The agent kept torchrun's values (scripts without this API expect
        # them) and names the ones the user set, which win.
        chosen = set(os.environ.get("FTRUN_USER_TORCH_ENV", "").split(","))
        for key, value in SURVIVOR_TORCH_ENV.items():
            if key not in chosen:
                os.environ[key] = value
        host, _, port = os.environ["FTRUN_CONTROL_ADDR"].rpartition(":")
        self._prefix = prefix = os.environ["FTRUN_REGROUP_PREFIX"]
        signer = Signer(load_secret())  # the job's secret, from the agent's environment
        raw = dist.TCPStore(host, int(port), is_master=False, timeout=self._timeout)
        self._store = JsonStore(raw, prefix, signer=signer)
        self._beat_store = JsonStore(
            dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10)),
            prefix, signer=signer,
        )
        self._members: tuple[str, ...] = ()  # of the current generation, in rank order
        initial = os.environ.get("FTRUN_INITIAL") == "1"
        self._synced, self._finished, self._beats = initial, False, 0
        self._computing = -1  # the generation whose step is being computed, or -1
        self._cut_off = -1  # the last generation whose connections to a lost node were cut
        # Every member starts alone; a joiner stays so until its first run_step, so that
        # building DDP on it (whose constructor runs collectives) stays local.
        self.process_group = ResilientProcessGroup(self._solo_backend())
        self._pending_join = not initial
        self._report()  # the member is ready: past its imports, using this API
        self._start_thread(self._beat, (), "ftrun-heartbeat")
        if initial:
            self._regroup(after=-1)

    def _start_thread(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        """A daemon thread (a worker that dies must not wait for it) that close() joins."""
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _solo_backend(self) -> Any:
        return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, self._timeout)

    def _report(self, store: JsonStore | None = None) -> None:
        self._beats += 1
        status = P.Status(self._beats, self._step, self.process_group.issued,
                          self._synced, self._finished)
        (store or self._store).set_record(P.status_key(self.member_id), status.to_json())

    def _beat(self) -> None:
        """Liveness and progress, off the main thread: a main thread that stops issuing
        collectives shows as progress that stands still while the beats go on."""
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._report(self._beat_store)
                self._release_from_lost_node()
            except (StoreError, RuntimeError):
                return  # the agent is gone; PDEATHSIG ends this process

    def _release_from_lost_node(self) -> None:
        """Fail a collective that waits on a node the leader declared lost.

        A peer on a node that lost its link sends no reset: gloo would wait for its
        timeout. Shutting down this process's connections to that node's address makes
        the collective fail now (the same role the NCCL shim's abort plays on GPUs); the
        main thread then finds the generation ended and regroups.
        """
        generation = self._computing
        if generation < 0 or generation == self._cut_off:
            return
        end = self._ended(generation, self._beat_store)
        addr = end.get("addr") if end else None
        if not isinstance(addr, str):
            return
        self._cut_off = generation
        _shutdown_connections_to(addr)

    # --- the vote -------------------------------------------------------------------------

    def _fault_explains(self, error: RuntimeError) -> bool:
        """A collective failed: is it a fault the agent declared (or is about to)?"""
        deadline = time.monotonic() + self._fault_grace_s
        while time.monotonic() < deadline:
            if self._ended(self._generation) is not None:
                return True
            time.sleep(POLL_S * 4)
        return False

    def _ended(self, number: int, store: JsonStore | None = None) -> dict[str, Any] | None:
        """Why generation ``number`` ended (a valid record only), or None."""
        return (store or self._store).first_record(P.end_key(number))

    def _all_valid(self, names: list[str]) -> bool:
        """Whether each of ``names`` holds a valid record: one ``check``, and one
        ``multi_get`` once all exist."""
        store = self._store
        return store.exist_all(names) and all(r is not None for r in store.read_records(names))

    def _decide(self, generation: int, step: int, voted: bool) -> str:
        key = P.decision_key(generation, step)
        if voted:
            self._store.set_record(P.vote_key(generation, step, self.member_id), {})
            # The counter only says when to look (anyone could bump it); the votes decide.
            counted = self._store.add(P.votes_key(generation, step), 1)
            if counted >= len(self._members) and self._all_valid(
                    [P.vote_key(generation, step, m) for m in self._members]):
                joiner_waits = self._store.first_record(P.join_key(generation)) is not None
                self._store.put_record(
                    key, {"value": P.COMMIT_REGROUP if joiner_waits else P.COMMIT})
        while True:
            present = self._store.wait_for(key, 0.05)  # returns as soon as it is written
            if present:
                record = self._store.first_record(key)
                if record is not None:
                    return _checked(record, P.DECISIONS)
            if self._ended(generation) is not None:
                self._store.put_record(key, {"value": P.ABORT})
                continue
            if present:  # it holds only records without the job's secret
                time.sleep(POLL_S)

    # --- regroup --------------------------------------------------------------------------

    def _regroup(self, after: int) -> None:
        """Join the first generation newer than ``after`` that includes this member."""
        failures = 0
        if after >= 0:
            self._retire_backend()
        while True:
            generation = self._await_generation(after)
            if self._enter(generation):
                self._pending_join = False
                return
            if self._ended(generation.number) is not None:
                failures += 1  # a fault, not just a newer generation (that is progress)
            if failures >= self._max_regroups:
                raise RegroupError(
                    f"member {self.member_id}: {failures} generations in a row failed to form"
                )
            after = generation.number

    def _retire_backend(self) -> None:
        """Drop the failed generation's backend so that its connections close.

        A survivor that gave up on a collective must not leave its sockets open: a peer
        still waiting on it inside that collective (in a ring, not every survivor is next
        to the dead member) only fails when they close, and gloo's ``abort`` does not
        release a waiting peer. The last reference is dropped on a helper thread because
        the backend's destructor joins its own threads.
        """
        old = self.process_group.backend
        self.process_group.swap(self._solo_backend())
        for obj in self._registered.values():
            if isinstance(obj, DistributedDataParallel):
                _renew_reducer(obj)  # the old reducer holds the failed step's work
        self._start_thread(_release, ([old],), "ftrun-retire")
        del old

    def _await_generation(self, after: int) -> P.MemberGeneration:
        while True:
            latest = self._store.get_record(P.LATEST)
            number = latest.get("number") if latest else None
            if isinstance(number, int) and number > after:
                record = self._store.get_record(P.generation_key(number))
                if record is not None:
                    generation = P.MemberGeneration.from_json(record)
                    if generation.rank_of(self.member_id) is not None:
                        return generation
                    after = number  # not in this one (a spare): wait for a later one
            time.sleep(POLL_S)

    def _enter(self, generation: P.MemberGeneration) -> bool:
        """Meet the other members of ``generation``, build its backend, share state.
        False when the generation ended before it formed."""
        number, size = generation.number, generation.world_size
        rank = generation.rank_of(self.member_id)
        assert rank is not None
        if not self._formed(generation):
            return False
        self._members = tuple(m.id for m in generation.members)
        try:
            store = dist.PrefixStore(P.pg_prefix(self._prefix, number), self._store.raw)
            backend = _make_backend(store, rank, size, self._timeout)
            self.process_group.swap(backend)
            self._generation = number
            for obj in self._registered.values():
                if isinstance(obj, DistributedDataParallel):
                    _renew_reducer(obj)
            if generation.has_joiners:
                self._share_state(generation, rank)
            if generation.members[rank].joiner:
                self._synced = True
                self._report()
        except RuntimeError:
            if self._ended(number) is not None:
                return False
            raise
        for callback in self._callbacks:
            callback(rank, size)
        return True

    def _formed(self, generation: P.MemberGeneration) -> bool:
        """Whether ``generation`` forms: one decision for all its members.

        A member that finds every member's arrival appends ``formed``; a member that sees
        the generation ended, or a newer one published (the leader admitted another joiner
        meanwhile), appends ``abandoned``. The first valid record of the one key wins, so
        no member builds a group that another has left.
        """
        number = generation.number
        key = P.formed_key(number)
        self._store.set_record(P.arrived_key(number, self.member_id), {})
        if self._all_valid([P.arrived_key(number, m.id) for m in generation.members]):
            self._store.put_record(key, {"value": P.FORMED})
        while True:
            record = self._store.first_record(key)
            if record is not None:
                return _checked(record, (P.FORMED, P.ABANDONED)) == P.FORMED
            latest = self._store.get_record(P.LATEST) or {}
            newer = isinstance(latest.get("number"), int) and latest["number"] > number
            if newer or self._ended(number) is not None:
                self._store.put_record(key, {"value": P.ABANDONED})
                continue
            time.sleep(POLL_S)

    def _share_state(self, generation: P.MemberGeneration, rank: int) -> None:
        source = generation.source_rank
        if source is None:
            raise RegroupError("a generation of joiners only has no state to start from")
        joiner = generation.members[rank].joiner
        if rank == source:
            buffer = io.BytesIO()
            torch.save(self.state_dict(), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length, source)
        if rank != source:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(payload, source)
        if joiner:
            self.load_state_dict(
                torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
            )

    def _broadcast(self, tensor: torch.Tensor, source: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = source
        options.rootTensor = 0
        self.process_group.backend.broadcast([tensor], options).wait()


def init(
    *,
    collective_timeout_s: float = 60.0,
    fault_grace_s: float = 10.0,
    max_regroups: int = 5,
) -> FaultTolerance:
    """Join the job: returns when this worker is a member of a working generation (a
    joiner returns at once and joins at its first ``run_step``)."""
    return FaultTolerance(
        collective_timeout_s=collective_timeout_s,
        fault_grace_s=fault_grace_s,
        max_regroups=max_regroups,
    )
