"""The restart supervisor: torchrun's recovery, made faster and better explained.

Every local worker of the job generation runs until all succeed or one fails. A failure
(exit non-zero or by a signal) ends the job generation at once: on several nodes the end is
written first (so the others learn the cause), then this node's workers are stopped
(SIGTERM, SIGKILL after the grace; a frozen worker is killed at once). The agent then starts
the next job generation, or gives up.

Watching is event driven: the loop sleeps in ``select`` on the workers' pidfds, the signal
inbox and the end watcher, and wakes on a timer (``--monitor-interval``) only to read what
other nodes (or, on the leader, the heartbeats) say, and every half second to ask the
:class:`~ftrun.agent.hangs.HangWatch` whether a worker froze or every worker hangs. A hang
is a failure like an exit: its culprit is named with its stack, the workers' NCCL
communicators are aborted through the shim (so none stays blocked in a collective), and
the job restarts.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import replace
from typing import Any

from ftrun.agent import processes as local
from ftrun.agent.hangs import (
    Hang,
    HangWatch,
    JobHang,
    NodeView,
    announce_hang,
    judge_job,
    name_after_abort,
    release_nccl,
)
from ftrun.agent.launcher import WorkerStartError
from ftrun.agent.outcome import GenerationResult, Outcome, describe_cause, mark_root_cause
from ftrun.agent.services import AgentServices
from ftrun.control.endwatch import EndWatcher, ReadEnd
from ftrun.control.errors import StoreError, StoreValueError
from ftrun.control.rendezvous import Generation, StoreLostError
from ftrun.decide.crashloop import Failure, signature
from ftrun.observe.events import Event, WorkerExit, describe_returncode


class RestartSupervisor:
    """Runs a job generation whose failure restarts every worker; see the module docstring."""

    def __init__(self, services: AgentServices) -> None:
        self.services = services

    def run(self, generation: Generation) -> GenerationResult:
        launcher = self.services.launcher
        group: list[local.WorkerProcess] = []
        try:
            for local_rank in range(self.services.config.nproc_per_node):
                group.append(launcher.spawn_worker(generation, local_rank))
        except WorkerStartError:
            self._stop(group, signal.SIGTERM, "a worker could not start")
            local.join_pumps(group)
            raise
        try:
            with self.services.end_watch(generation) as watcher:
                return self._watch(generation, group, watcher)
        finally:
            local.join_pumps(group)

    def _watch(
        self, generation: Generation, group: list[local.WorkerProcess],
        watcher: EndWatcher | ReadEnd,
    ) -> GenerationResult:
        services = self.services
        config, inbox = services.config, services.inbox
        reported: set[int] = set()
        remote = services.multi_node
        next_poll = time.monotonic() + config.monitor_interval_s
        hangs = None if config.hang_timeout_s == 0 else HangWatch(
            timeout_s=config.hang_timeout_s, multi_node=remote)
        if hangs is not None:
            hangs.node_rank, hangs.node = services.node_rank, services.hostname
        shared_view: float | None = None  # when the view last published was taken
        while True:
            if inbox.received is not None:
                self._stop(group, inbox.received, "signal")
                return GenerationResult(Outcome.SIGNALED, self._exits(generation, group, None))
            finished = [w for w in group if w.poll() is not None and w.pid not in reported]
            for worker in sorted(finished, key=lambda w: w.ended or 0.0):
                reported.add(worker.pid)
                services.events.emit(
                    Event.EXIT,
                    generation=generation.number,
                    rank=worker.rank,
                    local_rank=worker.local_rank,
                    pid=worker.pid,
                    returncode=worker.returncode,
                )
                if worker.returncode != 0:
                    return self._local_failure(generation, group, worker)
            if all(w.returncode is not None for w in group):
                local.reap_leftovers(group)
                return GenerationResult(Outcome.SUCCEEDED, self._exits(generation, group, None))
            if remote and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + config.monitor_interval_s
                try:
                    cause = self._remote_cause(generation, watcher.end_may_exist)
                except StoreError as error:
                    self._stop(group, signal.SIGTERM, "store lost")
                    raise StoreLostError(services.store_lost() or str(error)) from None
                if cause is not None:
                    services.say(f"generation {generation.number} ended by node "
                                 f"{cause.get('by', cause.get('node_rank'))}: "
                                 f"{describe_cause(cause)}")
                    self._stop(group, signal.SIGTERM, "remote failure", generation)
                    exits = self._exits(generation, group, None)
                    return GenerationResult(Outcome.REMOTE_FAILED, exits, cause)
            hang = hangs.sample(group) if hangs is not None else None
            if hang is not None:
                return self._hung(generation, group, hang)
            if hangs is not None and hangs.view is not None and remote:
                if hangs.view.at != shared_view:
                    shared_view = hangs.view.at
                    self._publish_view(generation, hangs.view)
                job_hang = self._judge_job(generation, hangs)
                if job_hang is not None:
                    return self._job_hung(generation, group, job_hang)
            timeout = max(0.0, next_poll - time.monotonic()) if remote else 3600.0
            if hangs is not None:
                timeout = min(timeout, hangs.due_in())
            woke = local.wait_any(group, timeout, [inbox.fd, *watcher.wake_fds()])
            if inbox.fd in woke:
                inbox.drain()
            if set(woke) - {inbox.fd}:
                next_poll = time.monotonic()  # the end was written: read it now

    def _remote_cause(self, generation: Generation, read_end: bool) -> dict | None:
        """Why another node (or, on the leader, a heartbeat or a newcomer) ended this
        generation; None while it runs. ``read_end``: whether to read the end record (an
        EndWatcher says when it exists). Raises StoreError/StoreLostError when this agent
        has lost the store."""
        services = self.services
        lost = services.store_lost()
        if lost is not None:
            raise StoreLostError(lost)
        rdzv = services.rdzv
        cause = rdzv.ended(generation.number) if read_end else None
        if cause is not None or services.nodes is None:
            return cause
        lost_nodes, join = services.nodes.scan(rdzv, generation)
        for _node, node_cause in lost_nodes:
            return rdzv.end(generation.number, node_cause)
        return rdzv.end(generation.number, join) if join is not None else None

    def _local_failure(
        self, generation: Generation, group: list[local.WorkerProcess],
        failed: local.WorkerProcess,
    ) -> GenerationResult:
        services = self.services
        detected = time.time()
        cause = {
            "kind": "worker",
            "node_rank": services.node_rank,
            "node_id": services.node_id,
            "node": services.hostname,
            "rank": failed.rank,
            "pid": failed.pid,
            "returncode": failed.returncode,
            "time": failed.ended,
        }
        loop = self._crash_loop(generation, [failed])
        if loop is not None:
            cause.update(loop)
        cause = self._end(generation, group, cause)
        services.events.emit(
            Event.FAILURE,
            generation=generation.number,
            rank=failed.rank,
            local_rank=failed.local_rank,
            pid=failed.pid,
            returncode=failed.returncode,
            detected=detected,
        )
        self._stop(group, signal.SIGTERM, f"rank {failed.rank} failed", generation)
        exits = mark_root_cause(self._exits(generation, group, failed))
        if loop is None:  # every rank failing alike is seen once they all ended
            others = [w for w in group if w is not failed and w.returncode not in (0, None)
                      and not w.stopped_by_agent]
            loop = self._crash_loop(generation, others)
            if loop is not None:
                cause = {**cause, **loop}
        return GenerationResult(Outcome.FAILED, exits, cause)

    def _crash_loop(self, generation: Generation,
                    failed: list[local.WorkerProcess]) -> dict[str, Any] | None:
        """Workers that failed on their own: the same error again is the script's bug
        (ftrun.decide.crashloop). Returns the end cause's fields that say so, once said in
        one line and a ``crash_loop`` event."""
        services = self.services
        for worker in failed:
            assert worker.returncode is not None
            message = services.launcher.worker_exit(worker, generation.number,
                                                    first=False).message
            verdict = services.crash_loop.observe(Failure(
                worker.rank, signature(describe_returncode(worker.returncode), message),
                world=generation.world_size, epoch=generation.number))
            if verdict is not None:
                services.events.emit(Event.CRASH_LOOP, rank=verdict.rank, pid=worker.pid,
                                     signature=verdict.signature, count=verdict.count,
                                     everyone=verdict.everyone)
                services.say(f"stopping: {verdict.describe()}", style="red")
                return {"kind": "crash loop", "rank": verdict.rank,
                        "signature": verdict.signature}
        return None

    def _hung(self, generation: Generation, group: list[local.WorkerProcess],
              hang: Hang) -> GenerationResult:
        """A frozen or hung worker: end the generation like a failure, naming the culprit
        with its stack, after releasing every worker blocked in NCCL."""
        services = self.services
        detected = time.time()
        hang = name_after_abort(hang, group)
        first = hang.culprits[0] if hang.culprits else None
        detail = hang.describe()
        cause = {
            "kind": "hang" if hang.kind == "hung" else "frozen",
            "node_rank": services.node_rank,
            "node_id": services.node_id,
            "node": services.hostname,
            "rank": first.rank if first else None,
            "pid": first.pid if first else None,
            "culprits": [w.rank for w in hang.culprits],
            "waiting": [w.rank for w in hang.waiting],
            "detail": detail,
            "time": detected,
        }
        cause = self._end(generation, group, cause)
        announce_hang(services, generation, hang, group, detected)
        self._stop(group, signal.SIGTERM, f"rank {first.rank} hung" if first else "hang",
                   generation)
        exits = self._exits(generation, group, first)
        if first is not None:  # the cause record names the hang, not the SIGTERM
            stack = hang.stacks.get(first.pid)
            exits = [replace(e, message=f"hung: {detail}",
                             traceback=stack.text() if stack else e.traceback)
                     if e.first else e for e in exits]
        return GenerationResult(Outcome.FAILED, exits, cause)

    def _end(self, generation: Generation, group: list[local.WorkerProcess],
             cause: dict) -> dict:
        """On several nodes, end the job generation with ``cause`` (the first end written
        wins and is returned); a lost store stops the workers and raises StoreLostError."""
        services = self.services
        if not services.multi_node:
            return cause
        try:
            return services.rdzv.end(generation.number, cause)
        except StoreError as error:
            self._stop(group, signal.SIGTERM, "store lost")
            raise StoreLostError(services.store_lost() or str(error)) from None

    # -- hangs across nodes (see ftrun.agent.hangs) --------------------------------------
    def _publish_view(self, generation: Generation, view: NodeView) -> None:
        # a lost store is seen and acted on by the loop's own store reads
        with contextlib.suppress(StoreError):
            self.services.rdzv.store.set_record(
                f"hang/{generation.number}/{self.services.node_rank}", view.to_json())

    def _judge_job(self, generation: Generation, hangs: HangWatch) -> JobHang | None:
        """On the leader, with every local worker idle: every node's view, judged."""
        if not self.services.rdzv.is_leader:
            return None
        names = [f"hang/{generation.number}/{rank}" for rank in range(generation.nnodes)]
        try:
            records = self.services.rdzv.store.get_records(names)
        except StoreError:
            return None
        views = []
        for record in records:
            if record is None:
                return None
            try:
                views.append(NodeView.from_json(record))
            except StoreValueError:
                return None  # a record that is not a view: no verdict on it
        return judge_job(views, generation.nnodes, hangs.timeout_s, time.time())

    def _job_hung(self, generation: Generation, group: list[local.WorkerProcess],
                  hang: JobHang) -> GenerationResult:
        """A hang judged from every node's view: end the job generation naming the culprits
        (with their node and stack), release and stop this node's workers."""
        services = self.services
        detected = time.time()
        detail = hang.describe()
        first = hang.culprits[0][0] if hang.culprits else None
        cause = {
            "kind": "hang", "node_rank": services.node_rank, "node_id": services.node_id,
            "node": services.hostname, "rank": first.rank if first else None,
            "pid": first.pid if first else None,
            "culprits": [w.rank for w, _ in hang.culprits],
            "waiting": [w.rank for w in hang.waiting], "detail": detail, "time": detected,
        }
        cause = self._end(generation, group, cause)
        services.say(f"{detail}: stopping every worker", style="yellow")
        for worker, node in hang.culprits:
            if worker.stack:
                services.say(f"rank {worker.rank} (node {node}) stack (most recent call "
                             f"last):\n{worker.stack}")
        services.events.emit(
            Event.FAILURE, generation=generation.number, cause=detail, kind="hung",
            rank=first.rank if first else None, pid=first.pid if first else None,
            culprits=[w.rank for w, _ in hang.culprits],
            waiting=[w.rank for w in hang.waiting], idle_s=round(hang.idle_s, 2),
            detected=detected, stacks={w.rank: w.stack for w, _ in hang.culprits if w.stack},
        )
        release_nccl(services, group)
        local_first = next((w for w in group if first is not None and w.pid == first.pid
                            and w.rank == first.rank), None)
        self._stop(group, signal.SIGTERM, f"rank {first.rank} hung" if first else "hang",
                   generation)
        exits = self._exits(generation, group, local_first)
        exits = [replace(e, message=f"hung: {detail}",
                         traceback=first.stack if first and first.stack else e.traceback)
                 if e.first else e for e in exits]
        outcome = Outcome.FAILED if local_first is not None else Outcome.REMOTE_FAILED
        return GenerationResult(outcome, exits, cause)

    def _stop(self, group: list[local.WorkerProcess], sig: int, why: str,
              failed: Generation | None = None) -> None:
        """``failed``: the generation whose failure stops them (a worker found frozen is
        then a fault of its own, recorded)."""
        self.services.launcher.stop_workers(
            group, sig, why, failed_generation=failed.number if failed is not None else None)

    def _exits(
        self, generation: Generation, group: list[local.WorkerProcess],
        first: local.WorkerProcess | None,
    ) -> list[WorkerExit]:
        return [self.services.launcher.worker_exit(w, generation.number, first=w is first)
                for w in group]
