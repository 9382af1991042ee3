"""The worker API: ``import ftrun`` lets a training script survive a fault without a restart.

    ft = ftrun.init()                                   # join the job
    model = DistributedDataParallel(net, process_group=ft.process_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ft.register("model", model)                         # state a joiner must receive
    ft.register("optimizer", optimizer)
    while ft.step < total_steps:
        ft.run_step(lambda: train_step(ft.step, ft.rank, ft.world_size), optimizer.step)

What happens underneath. ``ft.process_group`` is one Python ``ProcessGroup`` object for the
whole job; each member epoch (the job's membership: who computes, with which ranks) swaps a
fresh backend into it (gloo on CPU, NCCL on GPU), built on a store prefix of its own, so a
DDP model built once keeps working. ``run_step`` runs ``compute`` (forward and backward:
the gradient collective happens inside), then the commit vote of :mod:`ftrun.protocol`:
``apply`` (the optimizer step) runs on every member or on none. When a member fails, the
agent ends the member epoch; the survivors' collective fails fast (a dead gloo peer closes
its sockets; the NCCL shim aborts hung communicators), the vote says ``abort``, and the
survivors join the next member epoch and repeat the step. A joiner (a replacement or a warm
spare) receives every registered object's state from the lowest-ranked survivor over the
new group: no disk.

Error semantics, written down:

* absorbed and retried: any ``RuntimeError`` raised by ``compute`` (torch's
  ``DistBackendError`` and gloo's connection errors are RuntimeErrors) *if* the agent ends
  the member epoch within ``fault_grace_s`` (default 10 s) of it: that is a fault elsewhere;
* raised: every other exception, at once, and a ``RuntimeError`` that no end of the member
  epoch explains within the grace: those are the script's own errors, and the process exits;
* after ``max_regroups`` consecutive member epochs that fail to form (default 5),
  :class:`RegroupError` is raised and the worker exits, so the agent falls back to stopping
  the job instead of looping forever;
* a wait of the regroup protocol that outlasts ``regroup_timeout_s`` raises
  :class:`RegroupTimeoutError` (a :class:`RegroupError`) naming the member, its member epoch
  and what it waited for, and the worker exits: no wait hangs.

Timeouts, each with what it bounds and what happens when it fires (arguments of
:func:`init`):

* ``collective_timeout_s`` (60 s): one collective of the process group, and the connection
  of a new member epoch's backend to its peers (gloo's timeout; NCCL keeps its own); also
  each request to the control store. Fires as the backend's ``RuntimeError`` inside
  ``compute``: absorbed if a fault explains it (above), raised otherwise.
* ``fault_grace_s`` (10 s): how long a failed collective waits for the agent to end the
  member epoch before the error counts as the script's own. Fires as that error, raised.
* ``regroup_timeout_s`` (default the larger of 600 s and twice the collective timeout plus
  the grace; ``FTRUN_REGROUP_TIMEOUT_S`` sets it for scripts that do not pass it): each
  wait on other members or on the agents' leader, namely

  - the wait of a member for the next member epoch that includes it (the leader publishes
    it seconds after a fault); a joiner or warm spare waiting to be *admitted* is not
    bounded: a spare may rightly wait for the whole job, and its agent ends it with the job;
  - the wait for every member of a member epoch to arrive, counted from when the joiners
    and the survivor that sends the state have arrived (before, the wait is on the script's
    own code: a joiner building its model, survivors finishing their step); when it fires
    the member first appends ``abandoned``, so that no one builds a group it has left;
  - the wait for a step's decision (the other members' votes); when it fires the member
    first appends ``abort``, so that no one applies a step it has not.

  Fires as :class:`RegroupTimeoutError` out of ``init`` or ``run_step``; the worker exits
  and its agent treats that as its failure. The default is never reached by a healthy job:
  after a fault the slowest survivor may spend a collective timeout in the failed collective
  plus the grace before it arrives, and the decision waits for the slowest member's own
  work after its last collective (keep long work such as checkpoints outside ``compute``,
  or raise the bound).

Without ftrun's regroup environment (under torchrun, or ``--recovery restart``) the same
script runs unchanged: ``init`` forms an ordinary static group from ``env://`` variables
and ``run_step`` simply computes and applies.

``compute`` must start from zeroed gradients (call ``optimizer.zero_grad()`` first): a
failed step leaves partial sums in them. Register objects with ``state_dict`` /
``load_state_dict``; state is sent with ``torch.save`` and read with
``torch.load(weights_only=True)``, which accepts tensors and plain containers only.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftrun import protocol as P
from ftrun.control.store import StoreError
from ftrun.worker import group, settings, sockets
from ftrun.worker.errors import RegroupError, RegroupTimeoutError
from ftrun.worker.group import ResilientProcessGroup
from ftrun.worker.membership import Membership
from ftrun.worker.transfer import share_state

__all__ = ["FaultTolerance", "RegroupError", "RegroupTimeoutError", "Stateful", "init"]

T = TypeVar("T")
#: :attr:`FaultTolerance.generation` said it is deprecated (once per process).
_GENERATION_WARNED = False


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class FaultTolerance:
    """One worker's membership in the job. Create it with :func:`init`."""

    def __init__(self, *, collective_timeout_s: float, fault_grace_s: float,
                 max_regroups: int, regroup_timeout_s: float | None = None) -> None:
        self._timeout = timedelta(seconds=collective_timeout_s)
        self._fault_grace_s = fault_grace_s
        self._max_regroups = max_regroups
        self._registered: dict[str, Stateful] = {}
        self._callbacks: list[Callable[[int, int], None]] = []
        self._step = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []  # heartbeat, retire: joined by close()
        self._let_go_done = False
        env = P.WorkerEnv.from_env(os.environ)
        member = env.member if env is not None else None
        self.member_id = member.member_id if member is not None else ""
        self.managed = member is not None
        self._membership: Membership | None = None
        # the TCP connections the current member epoch's backend made (see _retire_backend)
        self._epoch_connections: frozenset[sockets.Connection] = frozenset()
        if env is not None and member is not None:
            self._connect(env, member, settings.regroup_timeout_s(
                regroup_timeout_s, collective_timeout_s=collective_timeout_s,
                fault_grace_s=fault_grace_s))
        else:
            self.process_group = ResilientProcessGroup(group.static_backend(self._timeout))
            self._pending_join = False

    # --- public ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.process_group.rank()

    @property
    def world_size(self) -> int:
        return self.process_group.size()

    @property
    def epoch(self) -> int:
        """The member epoch this worker computes in (-1 before its first; outside ftrun's
        regroup mode always -1)."""
        return self._membership.epoch if self._membership is not None else -1

    @property
    def generation(self) -> int:
        """Deprecated: :attr:`epoch`. It named the member epoch while ``FTRUN_GENERATION``
        names the job generation (a restart): one word for two counters. Kept one release;
        the first use warns (a ``FutureWarning``, shown by default), once per process."""
        global _GENERATION_WARNED
        if not _GENERATION_WARNED:
            _GENERATION_WARNED = True
            warnings.warn("ftrun: FaultTolerance.generation is deprecated and will be "
                          "removed: use .epoch (the member epoch; FTRUN_GENERATION is the job "
                          "generation)", FutureWarning, stacklevel=2)
        return self.epoch

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
        Raises :class:`RegroupError` when the job cannot regroup (see the module).
        """
        membership = self._membership
        if membership is None:
            result = compute()
            apply()
            self._step += 1
            return result
        if self._pending_join:
            self._regroup(after=-1)
            return None
        epoch, step = membership.epoch, self._step
        self.process_group.issued = 0  # progress within this step (see the heartbeat)
        voted = True
        result: T | None = None
        membership.computing = epoch
        try:
            result = compute()
        except RuntimeError:
            if not membership.explains_fault(self._fault_grace_s):
                raise
            voted = False
        finally:
            membership.computing = -1
        decision = self._leave_on_error(membership.decide, epoch, step, voted)
        if decision == P.ABORT:
            self._regroup(after=epoch)
            return None
        apply()
        self._step += 1
        membership.committed()
        if decision == P.COMMIT_REGROUP:
            self._regroup(after=epoch)
        return result

    def close(self) -> None:
        """Say this member finished its training loop (no one joins a finished job), then
        stop this worker's threads and the backend's: call it last, the group has no peers
        afterwards. A script that never calls it still gets the second half at exit.

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
        membership = self._membership
        if membership is not None and not self._stop.is_set():
            self._stop.set()
            membership.finished = True
            with contextlib.suppress(StoreError, RuntimeError):
                membership.report()
        self._let_go()

    def _let_go(self) -> None:
        """Join this worker's threads and drop the backend, once: :meth:`close` does it, and
        an ``atexit`` hook for a script that never calls ``close`` (atexit runs before the
        interpreter finalizes; see :meth:`close` for why that matters). Without the hook such
        a script, ending while its heartbeat sat in a store request, aborted at exit (seen:
        2 of 6 runs with a 0.5 ms heartbeat, and once in CI at the default)."""
        if self._let_go_done:
            return
        self._let_go_done = True
        self._stop_threads()
        old = self.process_group.backend
        self.process_group.swap(group.solo_backend(self._timeout))  # idle: nothing is queued
        with contextlib.suppress(RuntimeError):
            old.shutdown()  # a no-op for gloo; what destroy_process_group does for NCCL
        del old  # the last reference: the destructor joins the backend's threads

    # --- set-up ---------------------------------------------------------------------------

    def _connect(self, env: P.WorkerEnv, member: P.MemberEnv, regroup_timeout_s: float) -> None:
        # A survivor must outlive an aborted communicator (see group.survive_aborts).
        group.survive_aborts(env.user_torch_env)
        self._membership = membership = Membership(
            env, member, op_timeout=self._timeout, regroup_timeout_s=regroup_timeout_s,
            heartbeat_s=settings.heartbeat_s(),
            progress=lambda: (self._step, self.process_group.issued),
        )
        # Every member starts alone; a joiner stays so until its first run_step, so that
        # building DDP on it (whose constructor runs collectives) stays local.
        self.process_group = ResilientProcessGroup(group.solo_backend(self._timeout))
        self._pending_join = not member.initial
        membership.report()  # the member is ready: past its imports, using this API
        self._start_thread(membership.heartbeat, (self._stop,), "ftrun-heartbeat")
        atexit.register(self._let_go)
        if member.initial:
            self._regroup(after=-1)

    def _start_thread(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        """A daemon thread (a worker that dies must not wait for it) that close() joins."""
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _stop_threads(self) -> None:
        """Stop and join this worker's threads, for at most a collective timeout (see
        :meth:`close` for why they must end before the interpreter does)."""
        self._stop.set()
        deadline = time.monotonic() + self._timeout.total_seconds()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]

    def _leave_on_error(self, wait: Callable[..., T], *args: Any) -> T:
        """Run a wait of the protocol; if it gives up (RegroupError), stop this worker's
        threads before the error leaves, so that the process exits on it cleanly."""
        try:
            return wait(*args)
        except RegroupError:
            self._stop_threads()
            raise

    # --- regroup --------------------------------------------------------------------------

    def _regroup(self, after: int) -> None:
        """Join the first member epoch newer than ``after`` that includes this member."""
        self._leave_on_error(self._join_next, after)

    def _join_next(self, after: int) -> None:
        assert self._membership is not None
        failures = 0
        # out of the ended epoch before its backend is retired: a new solo backend and
        # renewed DDP reducers took seconds on a loaded node, and meanwhile the status said
        # "inside the ended epoch" and the leader took the member for stuck (the long soak)
        self._membership.left()
        if after >= 0:
            self._retire_backend()
        while True:
            self._membership.left()
            epoch = self._membership.await_epoch(after)
            if self._enter(epoch):
                self._pending_join = False
                return
            if self._membership.ended(epoch.number) is not None:
                failures += 1  # a fault, not just a newer member epoch (that is progress)
            if failures >= self._max_regroups:
                raise RegroupError(
                    f"member {self.member_id}: {failures} member epochs in a row failed to "
                    "form")
            after = epoch.number

    def _retire_backend(self) -> None:
        """Drop the failed member epoch's backend so that its connections close.

        A survivor that gave up on a collective must not leave its sockets open: a peer
        still waiting on it inside that collective (in a ring, not every survivor is next
        to the dead member) only fails when they close, and gloo's ``abort`` does not
        release a waiting peer. The last reference is dropped on a helper thread because
        the backend's destructor joins its own threads.
        """
        # first, its connections, by hand: dropping the backend closes them only once the
        # reducers are renewed and its destructor joined its threads, seconds on a loaded
        # node, while a survivor waited on this one in the failed collective (bench_recovery:
        # one recovery in ten took 5.4 s, until the stuck rule took that survivor out)
        made, self._epoch_connections = self._epoch_connections, frozenset()
        sockets.shutdown_connections(lambda own, peer: (own, peer) in made)
        old = self.process_group.backend
        self.process_group.swap(group.solo_backend(self._timeout))
        self._renew_reducers()  # the old reducer holds the failed step's work
        self._start_thread(group.release, ([old],), "ftrun-retire")
        del old

    def _renew_reducers(self) -> None:
        for obj in self._registered.values():
            if isinstance(obj, DistributedDataParallel):
                group.renew_reducer(obj)

    def _enter(self, epoch: P.MemberEpoch) -> bool:
        """Meet the other members of ``epoch``, build its backend, share state.
        False when the member epoch ended before it formed."""
        assert self._membership is not None
        membership = self._membership
        number, size = epoch.number, epoch.world_size
        rank = epoch.rank_of(self.member_id)
        assert rank is not None
        if not membership.formed(epoch):
            return False
        membership.members = tuple(m.id for m in epoch.members)
        try:
            with sockets.opened() as made:
                try:
                    client = membership.group_client(number, self._timeout.total_seconds())
                    store = dist.PrefixStore(P.pg_prefix(membership.prefix, number), client)
                    backend = group.make_backend(store, rank, size, self._timeout)
                finally:  # built or failed: the heartbeat stops watching the build
                    membership.built()
            self._epoch_connections = frozenset(made)
            self.process_group.swap(backend)
            membership.epoch = number
            membership.entered(number)
            self._renew_reducers()
            if membership.store.exists(P.resync_key(number)):
                self._resync_steps(epoch, rank)
            if epoch.has_joiners:
                share_state(self.process_group.backend, epoch, rank, self.state_dict,
                            self.load_state_dict)
            if epoch.members[rank].joiner:
                membership.synced = True
                membership.report()
        except RuntimeError:
            # a peer that died while the epoch was entered (its state sent to a joiner, its
            # group built) fails the others at once, before its agent has seen the death:
            # the end is waited for as for a failed step (the soak: a joiner whose source
            # was SIGKILLed mid-broadcast raised the reset as its own error and exited)
            if membership.explains_fault(self._fault_grace_s, number):
                return False
            raise
        for callback in self._callbacks:
            callback(rank, size)
        return True

    def _resync_steps(self, epoch: P.MemberEpoch, rank: int) -> None:
        """The first member epoch in a store that replaced a dead one (etcd-v3: the job's
        writer died with the store of the step decisions): a survivor may have read its
        last step's ``commit`` just before the store died while another had not and
        aborted it. The members compare their committed steps (two small collectives); if
        they differ, the lowest rank among those furthest on sends its state to all the
        others, as to joiners, so every member goes on from the same step and state."""
        backend = self.process_group.backend
        bounds = torch.tensor([self._step, -self._step], dtype=torch.int64)
        _allreduce(backend, bounds, dist.ReduceOp.MAX)
        highest, lowest = int(bounds[0]), -int(bounds[1])
        if highest == lowest:
            return
        source = torch.tensor([rank if self._step == highest else epoch.world_size],
                              dtype=torch.int64)
        _allreduce(backend, source, dist.ReduceOp.MIN)
        ahead = int(source.item())
        members = tuple(P.Member(m.id, m.rank, m.rank != ahead) for m in epoch.members)
        behind = self._step
        share_state(backend, P.MemberEpoch(epoch.number, members), rank, self.state_dict,
                    self.load_state_dict)
        if behind != highest:  # said, as this process's committed steps skip one here
            print(f"ftrun: member {self.member_id} (pid {os.getpid()}) took the state after "
                  f"step {highest - 1} from rank {ahead}: the decision of its step {behind} "
                  "died with the job's store", file=sys.stderr, flush=True)


def _allreduce(backend: dist.ProcessGroup, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
    options = dist.AllreduceOptions()
    options.reduceOp = op
    backend.allreduce([tensor], options).wait()


def init(
    *,
    collective_timeout_s: float = 60.0,
    fault_grace_s: float = 10.0,
    max_regroups: int = 5,
    regroup_timeout_s: float | None = None,
) -> FaultTolerance:
    """Join the job: returns when this worker is a member of a working member epoch (a
    joiner returns at once and joins at its first ``run_step``).

    Args (see the module's "Timeouts" for each bound and what happens when it fires):
        collective_timeout_s: one collective, a new backend's connection, a store request.
        fault_grace_s: how long a failed collective waits for the agent to end the member
            epoch before its error is raised as the script's own.
        max_regroups: member epochs in a row that may fail to form before
            :class:`RegroupError`.
        regroup_timeout_s: each wait on the other members or the agents' leader (the next
            member epoch, all members' arrival, a step's decision); ``None``:
            ``FTRUN_REGROUP_TIMEOUT_S`` if set, else max(600, 2 x collective + grace).
            Past it: :class:`RegroupTimeoutError`.
    """
    return FaultTolerance(
        collective_timeout_s=collective_timeout_s,
        fault_grace_s=fault_grace_s,
        max_regroups=max_regroups,
        regroup_timeout_s=regroup_timeout_s,
    )
