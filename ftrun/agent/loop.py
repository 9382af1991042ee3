"""The agent: one per node, it runs the job's state machine for its local workers.

    connect store -> join generation N -> spawn workers -> watch -> (done | recover | stop)

Watching is event driven: the agent sleeps in ``select`` on the workers' pidfds and on a
self-pipe that receives signals, and only wakes on a timer to read the control store for
faults that other nodes declared. A worker that exits non-zero or by a signal ends the
generation at once; the agent then stops the other local workers (SIGTERM, SIGKILL after
the grace; a frozen worker is killed at once since it cannot act on SIGTERM) and, while
``--max-restarts`` allows, every node starts generation N+1 with a fresh worker store.

Error semantics: :func:`run_agent` never raises for anything a job can do; it returns the
exit code from :mod:`ftrun.exitcodes` after printing one summary. Only bugs in ftrun
itself escape as exceptions.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ftrun.agent import processes as local
from ftrun.agent.events import EventLog, WorkerExit, read_error_file
from ftrun.agent.outcome import GenerationResult, Outcome, describe_cause
from ftrun.agent.regroup import RegroupSupervisor
from ftrun.agent.report import print_failure_summary
from ftrun.config import LaunchConfig, Recovery, Std, parse_seconds
from ftrun.control.auth import Signer, load_secret
from ftrun.control.endwatch import EndWatcher, ReadEnd
from ftrun.control.heartbeat import HeartbeatMonitor, HeartbeatSender
from ftrun.control.rendezvous import (
    DynamicRendezvous,
    Generation,
    NodeSlot,
    Rendezvous,
    RendezvousError,
    StaticRendezvous,
    StoreLostError,
)
from ftrun.control.store import JsonStore, StoreError, connect_store, serve_store
from ftrun.exitcodes import ExitCode, for_signal
from ftrun.shim import SURVIVOR_TORCH_ENV, ShimControl, ShimError


class SignalInbox:
    """Turns the signals ftrun forwards into a readable fd and a 'first signal' value."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.received: signal.Signals | None = None
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    @property
    def fd(self) -> int:
        return self._read_fd

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read_fd, 512):
                pass

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._read_fd)
        os.close(self._write_fd)


class Agent:
    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.hostname = socket.gethostname()
        # A log file or a pipe is read later, in a wider window than rich's 80-column default.
        width = None if sys.stderr.isatty() else 160
        self.console = Console(stderr=True, highlight=False, width=width)
        self.run_id = config.rdzv_id
        self.inbox = SignalInbox(config.signals_to_handle)
        base_log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="ftrun_"))
        base_log_dir.mkdir(parents=True, exist_ok=True)
        self.run_log_dir = Path(tempfile.mkdtemp(prefix=f"{self.run_id}_", dir=base_log_dir))
        events_path = config.events_file
        if events_path is None and config.log_dir is not None:
            events_path = self.run_log_dir / "events.jsonl"
        self.events = EventLog.open(self.hostname, events_path, config.event_log_console)
        self.control_server: Any = None
        self.worker_stores: list[Any] = []
        self.history: list[WorkerExit] = []
        self._shim_unavailable = False
        # Multi-node: this agent's identity in the store, its node rank in the current
        # generation (c10d: given by the leader), heartbeats sent or (leader) watched.
        self.node_id = f"{self.hostname}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.node_rank = config.node_rank if config.rdzv_backend == "static" or \
            config.is_single_node else -1
        self.heartbeat: HeartbeatSender | None = None
        self.monitor: HeartbeatMonitor | None = None
        self._finished_nodes: set[str] = set()
        self.dropped_nodes: set[str] = set()  # lost, and left out by a regroup
        self._next_scan = 0.0
        self.store_lost = False
        self.control_endpoint: tuple[str, int] = (config.rdzv_host, config.rdzv_port)
        # Non-leaders: how a thread opens a store client of its own, and the bound on one
        # store request.
        self._open_client: Callable[[], Any] | None = None
        self._op_timeout = 1.0

    # --- messages ------------------------------------------------------------------------

    def say(self, message: str, style: str = "") -> None:
        rank = self.node_rank if self.node_rank >= 0 else "?"
        prefix = escape(f"[ftrun {self.hostname}:{rank}]")
        self.console.print(f"[bold]{prefix}[/bold] {escape(message)}", style=style)

    # --- the state machine ---------------------------------------------------------------

    def run(self) -> int:
        try:
            return self._run()
        except (RendezvousError, StoreError) as error:
            lost = self._lost_reason()
            if lost is not None or isinstance(error, StoreLostError):
                self.say(f"lost the rendezvous store: {lost or error}; stopped this node's "
                         f"workers, exiting {int(ExitCode.RENDEZVOUS_FAILED)}", style="red")
                self.events.emit("stop", reason="store lost", detail=str(lost or error))
                self.store_lost = True
                return ExitCode.RENDEZVOUS_FAILED
            self.say(f"rendezvous failed: {error}", style="red")
            self.events.emit("stop", reason="rendezvous", detail=str(error))
            return ExitCode.RENDEZVOUS_FAILED
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop(0.0 if self.store_lost else 2.0 * self._op_timeout)
            self.inbox.close()
            self.events.close()

    def _run(self) -> int:
        rdzv = self._connect()
        if rdzv is None:
            return for_signal(self._signal())
        dynamic = isinstance(rdzv, DynamicRendezvous)
        number = 0 if self.config.is_single_node else rdzv.first_number()
        restart_count = 0
        expected: tuple[str, ...] = ()
        while True:
            slot = NodeSlot(
                node_rank=-1 if dynamic else self.config.node_rank,
                local_world_size=self.config.nproc_per_node,
                addr=self.config.local_addr or self.hostname,
                hostname=self.hostname,
                pid=os.getpid(),
                node_id=self.node_id,
            )
            generation = rdzv.join(
                number, slot, self.config.join_timeout_s, self._open_worker_store,
                restart_count=restart_count, expected=expected,
            )
            member = generation.node(self.node_id)
            assert member is not None
            # Per generation: a node dropped from (or done in) the last one is back in this.
            self.dropped_nodes.clear()
            self._finished_nodes.clear()
            self.node_rank = member.node_rank
            restart_count = generation.restart_count
            if number != generation.number or (dynamic and generation.number == 0):
                self.say(f"joined generation {generation.number} as node {self.node_rank} of "
                         f"{generation.nnodes} ({generation.world_size} workers)")
            self.events.emit(
                "generation",
                generation=generation.number,
                world_size=generation.world_size,
                nnodes=generation.nnodes,
                node_rank=self.node_rank,
                restart_count=restart_count,
            )
            result = self._run_generation(rdzv, generation)
            self.history.extend(result.exits)
            if result.outcome is Outcome.SUCCEEDED:
                return self._finish(rdzv, generation)
            if result.outcome is Outcome.SIGNALED:
                sig = self._signal()
                with contextlib.suppress(StoreError):
                    rdzv.shut_down({"reason": f"signal {sig.name}", "node_rank": self.node_rank})
                self.events.emit("stop", reason="signal", signal=sig.name)
                return for_signal(sig)
            why = result.cause or {}
            # A join, or this node left out while alive: membership changed, nothing failed.
            joining = (result.outcome is Outcome.REMOTE_FAILED
                       and why.get("kind") in ("join", "dropped"))
            lost = why.get("node_id") if why.get("kind") == "node lost" else None
            expected = tuple(n.node_id for n in generation.nodes if n.node_id != lost)
            number = generation.number + 1
            self._drop_old_worker_stores()
            if joining:
                self.say(f"generation {generation.number} ended: {describe_cause(why)}; "
                         "re-forming (not counted as a restart)", style="yellow")
                self.events.emit("regenerate", generation=generation.number, cause=why["kind"])
                continue
            if restart_count >= self.config.max_restarts:
                return self._give_up(rdzv, result)
            restart_count += 1
            first = _first_failure(result.exits)
            cause = (
                f"rank {first.rank} ({first.reason})"
                if first is not None
                else describe_cause(result.cause)
            )
            self.say(
                f"generation {generation.number} ended: {cause}; restarting "
                f"({restart_count}/{self.config.max_restarts})",
                style="yellow",
            )
            self.events.emit("restart", generation=generation.number, restart_count=restart_count)

    def _connect(self) -> Rendezvous | None:
        config = self.config
        interrupted = lambda: self.inbox.received is not None  # noqa: E731
        multi = not config.is_single_node
        dynamic = multi and config.rdzv_backend == "c10d"
        explicit_host = "is_host" in config.rdzv_conf
        hosting = config.hosts_store if (explicit_host or not dynamic) else _is_local_address(
            config.rdzv_host)
        op_timeout = max(1.0, config.heartbeat_timeout_s / 3)
        self._op_timeout = op_timeout
        store: Any = None
        if hosting:
            try:
                self.control_server = serve_store(config.rdzv_port, config.join_timeout_s)
            except StoreError:
                if not dynamic or explicit_host:
                    raise
                hosting = False  # another agent on this host serves it (torchrun's rule)
        if hosting:
            store = self.control_server
            self.control_endpoint = (config.rdzv_host, int(self.control_server.port))
        else:
            store = connect_store(
                config.rdzv_host, config.rdzv_port, config.join_timeout_s, interrupted=interrupted,
                op_timeout_s=op_timeout,
            )
            self.control_endpoint = (config.rdzv_host, config.rdzv_port)
        if interrupted():
            return None
        host, port = self.control_endpoint
        signer = Signer(load_secret())
        reconnect = lambda: connect_store(host, port, op_timeout, op_timeout_s=op_timeout)  # noqa: E731
        if multi and not hosting:
            self._open_client = reconnect
        jstore = JsonStore(
            store, f"ftrun/{self.run_id}", signer=signer,
            reconnect=None if hosting else reconnect,
            retry_s=config.heartbeat_timeout_s * 3,
            lost=lambda: self._lost_reason() is not None,
            on_reject=self._rejected_record,
        )
        if multi and not signer.enabled and hosting:
            self.say("control records are unauthenticated: anyone who reaches "
                     f"{host}:{port} can steer this job (set FTRUN_JOB_TOKEN on every node)",
                     style="yellow")
        if multi and not hosting:
            self.heartbeat = HeartbeatSender(
                reconnect, jstore, self.node_id,
                config.heartbeat_interval_s, config.heartbeat_timeout_s,
            )
            self.heartbeat.start()
        monitor = HeartbeatMonitor(jstore, config.heartbeat_timeout_s) if multi and hosting \
            else None
        self.monitor = monitor
        common: dict[str, Any] = dict(
            is_leader=hosting,
            poll_s=min(config.monitor_interval_s, 0.05),
            interrupted=interrupted,
            lost=self._lost_reason,
            monitor=monitor,
            on_wait=lambda text: self.say(text, style="yellow"),
        )
        if dynamic:
            last_call = parse_seconds(config.rdzv_conf.get("last_call_timeout", "30"),
                                      "last_call_timeout", allow_zero=True)
            return DynamicRendezvous(jstore, min_nodes=config.nnodes_min,
                                     max_nodes=config.nnodes_max, last_call_s=last_call, **common)
        return StaticRendezvous(jstore, node_rank=config.node_rank, nnodes=config.nnodes,
                                **common)

    def _lost_reason(self) -> str | None:
        """Why the store host counts as lost (this agent's heartbeats fail), or None."""
        beat = self.heartbeat
        if beat is None or not beat.lost():
            return None
        host, port = self.control_endpoint
        detail = f" ({beat.last_error})" if beat.last_error else ""
        return f"no answer from the store at {host}:{port} for {beat.silent_s():.1f} s{detail}"

    def _rejected_record(self, message: str) -> None:
        self.say(message, style="yellow")
        self.events.emit("rejected", detail=message)

    def _open_worker_store(self) -> tuple[str, int]:
        server = serve_store(0, self.config.join_timeout_s)
        self.worker_stores.append(server)
        return self.config.rdzv_host, int(server.port)

    def _drop_old_worker_stores(self) -> None:
        # The previous generation's workers are all gone; its store keeps no one waiting.
        del self.worker_stores[:-1]

    def _signal(self) -> signal.Signals:
        assert self.inbox.received is not None
        return self.inbox.received

    # --- one generation ------------------------------------------------------------------

    def _run_generation(self, rdzv: Rendezvous, generation: Generation) -> GenerationResult:
        if self._survivors_continue:
            return RegroupSupervisor(self, generation, rdzv).run()
        group = [
            self.spawn_worker(generation, local_rank)
            for local_rank in range(self.config.nproc_per_node)
        ]
        try:
            return self._watch(rdzv, generation, group)
        finally:
            local.join_pumps(group)

    def spawn_worker(
        self,
        generation: Generation,
        local_rank: int,
        *,
        extra_env: dict[str, str] | None = None,
        prefix: str | None = None,
        log_name: str | None = None,
    ) -> local.WorkerProcess:
        """Start one local worker of ``generation`` (must run on the main thread)."""
        config = self.config
        attempt_dir = self.run_log_dir / f"attempt_{generation.restart_count}"
        rank = generation.rank_offset(self.node_rank) + local_rank
        rank_dir = attempt_dir / (log_name or str(local_rank))
        rank_dir.mkdir(parents=True, exist_ok=True)
        env = self._worker_env(generation, local_rank, rank, rank_dir / "error.json")
        env.update(extra_env or {})
        shim = self._shim_control(f"rank{rank}", generation.number)
        if shim is not None:
            env = shim.worker_env(env)
        # torchrun's values stay; a worker that joins a regroup (ftrun.init) switches to the
        # survivor settings itself, except those the user chose.
        env["FTRUN_USER_TORCH_ENV"] = ",".join(k for k in SURVIVOR_TORCH_ENV if k in os.environ)
        redirect, tee = config.redirects.for_rank(local_rank), config.tee.for_rank(local_rank)
        shown = config.local_ranks_filter is None or local_rank in config.local_ranks_filter
        console = Std(Std.ALL.value & ~redirect.value) if shown else Std.NONE
        launch = local.WorkerLaunch(
            local_rank=local_rank,
            rank=rank,
            argv=config.worker_command(),
            env=env,
            console=console,
            files=Std(redirect.value | tee.value),
            log_dir=rank_dir,
            prefix=prefix or f"[rank{rank}]:",
            duplicate_dir=attempt_dir,
            duplicate_stdout=config.duplicate_stdout_filters,
            duplicate_stderr=config.duplicate_stderr_filters,
        )
        worker = local.spawn(launch)
        if shim is not None:
            shim.bind(worker.pid)
            worker.shim = shim
        self.events.emit(
            "spawn",
            generation=generation.number,
            rank=rank,
            local_rank=local_rank,
            pid=worker.pid,
            member=(extra_env or {}).get("FTRUN_MEMBER_ID"),
        )
        return worker

    @property
    def _survivors_continue(self) -> bool:
        """Whether a failure leaves the other workers running (in-process regroup)."""
        return self.config.recovery is not Recovery.RESTART

    def _shim_control(self, label: str, generation: int) -> ShimControl | None:
        """The NCCL shim's control page for one worker, or None (disabled, or not built:
        then said once, and the job runs without it)."""
        if not self.config.use_shim or self._shim_unavailable:
            return None
        try:
            return ShimControl(label=label, generation=generation)
        except ShimError as error:
            self._shim_unavailable = True
            self.say(f"NCCL shim not used: {error}", style="yellow")
            return None

    def _worker_env(
        self, generation: Generation, local_rank: int, rank: int, error_file: Path
    ) -> dict[str, str]:
        """torchrun's worker variables with torchrun's values, plus ftrun's own."""
        config = self.config
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "GROUP_RANK": str(self.node_rank),
                "ROLE_RANK": str(rank),
                "ROLE_NAME": config.role,
                "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
                "WORLD_SIZE": str(generation.world_size),
                "GROUP_WORLD_SIZE": str(generation.nnodes),
                "ROLE_WORLD_SIZE": str(generation.world_size),
                "MASTER_ADDR": generation.worker_store_host,
                "MASTER_PORT": str(generation.worker_store_port),
                "TORCHELASTIC_RESTART_COUNT": str(generation.restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
                "TORCHELASTIC_RUN_ID": self.run_id,
                "TORCHELASTIC_USE_AGENT_STORE": str(True),
                "TORCHELASTIC_ERROR_FILE": str(error_file),
                "TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle_text,
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
                ),
                "FTRUN_GENERATION": str(generation.number),
                "FTRUN_AGENT_PID": str(os.getpid()),
                "FTRUN_NODE_RANK": str(self.node_rank),
                "FTRUN_CONTROL_ADDR": f"{self.control_endpoint[0]}:{self.control_endpoint[1]}",
                "FTRUN_RUN_ID": self.run_id,
            }
        )
        if "OMP_NUM_THREADS" not in os.environ and config.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"
        if config.virtual_local_rank:
            env["LOCAL_RANK"] = "0"
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(local_rank + 1)]
            env["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)].strip()
        return env

    def _watch(
        self, rdzv: Rendezvous, generation: Generation, group: list[local.WorkerProcess]
    ) -> GenerationResult:
        watcher = self.end_watcher(rdzv, generation)
        try:
            return self._watch_generation(rdzv, generation, group, watcher)
        finally:
            self.stop_end_watcher(watcher)

    def end_watcher(self, rdzv: Rendezvous, generation: Generation) -> EndWatcher | ReadEnd:
        """A started watcher of ``generation``'s end (see ftrun.control.endwatch); the leader and a
        single node read the end directly (in-process: it costs no network)."""
        if self._open_client is None:
            return ReadEnd()
        # A wait slice under the request timeout (or the socket gives up first), and short
        # for a prompt stop().
        slice_s = min(1.0, self._op_timeout / 2)
        return EndWatcher(self._open_client, rdzv.store, f"gen/{generation.number}/end",
                          slice_s).start()

    def stop_end_watcher(self, watcher: EndWatcher | ReadEnd) -> None:
        """Without a store (the agent exits at once, by ``os._exit``) there is nothing to
        wait for."""
        watcher.stop(0.0 if self._lost_reason() is not None else 5.0)

    def _watch_generation(
        self, rdzv: Rendezvous, generation: Generation, group: list[local.WorkerProcess],
        watcher: EndWatcher | ReadEnd,
    ) -> GenerationResult:
        config = self.config
        reported: set[int] = set()
        remote = not config.is_single_node
        next_poll = time.monotonic() + config.monitor_interval_s
        while True:
            if self.inbox.received is not None:
                self.stop_workers(group, self.inbox.received, "signal")
                return GenerationResult(Outcome.SIGNALED, self._exits(generation, group, None))
            finished = [w for w in group if w.poll() is not None and w.pid not in reported]
            for worker in sorted(finished, key=lambda w: w.ended or 0.0):
                reported.add(worker.pid)
                self.events.emit(
                    "exit",
                    generation=generation.number,
                    rank=worker.rank,
                    local_rank=worker.local_rank,
                    pid=worker.pid,
                    returncode=worker.returncode,
                )
                if worker.returncode != 0:
                    return self._local_failure(rdzv, generation, group, worker)
            if all(w.returncode is not None for w in group):
                local.reap_leftovers(group)
                return GenerationResult(Outcome.SUCCEEDED, self._exits(generation, group, None))
            if remote and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + config.monitor_interval_s
                try:
                    cause = self._remote_cause(rdzv, generation, watcher.end_may_exist)
                except StoreError as error:
                    self.stop_workers(group, signal.SIGTERM, "store lost")
                    raise StoreLostError(self._lost_reason() or str(error)) from None
                if cause is not None:
                    self.say(f"generation {generation.number} ended by node "
                             f"{cause.get('by', cause.get('node_rank'))}: "
                             f"{describe_cause(cause)}")
                    self.stop_workers(group, signal.SIGTERM, "remote failure")
                    exits = self._exits(generation, group, None)
                    return GenerationResult(Outcome.REMOTE_FAILED, exits, cause)
            timeout = max(0.0, next_poll - time.monotonic()) if remote else 3600.0
            woke = local.wait_any(group, timeout, [self.inbox.fd, *watcher.wake_fds()])
            if self.inbox.fd in woke:
                self.inbox.drain()
            if set(woke) - {self.inbox.fd}:
                next_poll = time.monotonic()  # the end was written: read it now

    def _remote_cause(self, rdzv: Rendezvous, generation: Generation,
                      read_end: bool = True) -> dict[str, Any] | None:
        """Why another node (or, on the leader, a heartbeat or a newcomer) ended this
        generation; None while it runs. ``read_end``: whether to read the end record (an
        EndWatcher says when it exists). Raises StoreError/StoreLostError when this agent
        has lost the store."""
        lost = self._lost_reason()
        if lost is not None:
            raise StoreLostError(lost)
        cause = rdzv.ended(generation.number) if read_end else None
        if cause is not None or self.monitor is None:
            return cause
        lost, join = self.watch_other_nodes(rdzv, generation)
        for _node, cause in lost:
            return rdzv.end(generation.number, cause)
        return rdzv.end(generation.number, join) if join is not None else None

    def watch_other_nodes(
        self, rdzv: Rendezvous, generation: Generation
    ) -> tuple[list[tuple[NodeSlot, dict[str, Any]]], dict[str, Any] | None]:
        """Leader, at most every half heartbeat interval: the other nodes of ``generation``
        whose heartbeats stopped (and that are not done), each with the cause that would
        end the generation for it, and a newcomer's join cause if one waits. Each is said
        and logged once; ending anything is the caller's choice (restart ends the
        generation, regroup drops the lost node's workers)."""
        assert self.monitor is not None
        now = time.monotonic()
        if now < self._next_scan:
            return [], None
        self._next_scan = now + self.config.heartbeat_interval_s / 2
        members = {n.node_id for n in generation.nodes} - {self.node_id}
        self.monitor.watch(members - self._finished_nodes - self.dropped_nodes)
        lost = []
        for node_id in self.monitor.scan():
            if rdzv.store.get_record(f"gen/{generation.number}/done/{node_id}") is not None:
                self._finished_nodes.add(node_id)  # done and gone: not lost
                continue
            node = generation.node(node_id)
            assert node is not None
            silent = self.monitor.silent_s(node_id)
            self.say(f"node {node.node_rank} ({node.hostname}, {node.addr}) lost: no heartbeat "
                     f"for {silent:.1f} s", style="yellow")
            self.events.emit("node_lost", generation=generation.number, node=node.hostname,
                             node_rank=node.node_rank, node_id=node_id, silent_s=silent)
            lost.append((node, {
                "kind": "node lost", "node_id": node.node_id, "node_rank": node.node_rank,
                "node": node.hostname, "addr": node.addr, "silent_s": round(silent, 2),
                "by": self.node_rank, "time": time.time(),
            }))
        newcomer = rdzv.pending_join(generation, self.dropped_nodes)
        join = None
        if newcomer is not None:
            self.say(f"node {newcomer.hostname} ({newcomer.addr}) asks to join: re-forming "
                     "the job with it")
            join = {"kind": "join", "node_id": newcomer.node_id, "node": newcomer.hostname,
                    "addr": newcomer.addr, "by": self.node_rank, "time": time.time()}
        return lost, join

    def _local_failure(
        self,
        rdzv: Rendezvous,
        generation: Generation,
        group: list[local.WorkerProcess],
        failed: local.WorkerProcess,
    ) -> GenerationResult:
        detected = time.time()
        cause = {
            "kind": "worker",
            "node_rank": self.node_rank,
            "node_id": self.node_id,
            "node": self.hostname,
            "rank": failed.rank,
            "pid": failed.pid,
            "returncode": failed.returncode,
            "time": failed.ended,
        }
        if not self.config.is_single_node:
            try:
                cause = rdzv.end(generation.number, cause)
            except StoreError as error:
                self.stop_workers(group, signal.SIGTERM, "store lost")
                raise StoreLostError(self._lost_reason() or str(error)) from None
        self.events.emit(
            "failure",
            generation=generation.number,
            rank=failed.rank,
            local_rank=failed.local_rank,
            pid=failed.pid,
            returncode=failed.returncode,
            detected=detected,
        )
        self.stop_workers(group, signal.SIGTERM, f"rank {failed.rank} failed")
        return GenerationResult(Outcome.FAILED, self._exits(generation, group, failed), cause)

    def stop_workers(self, group: list[local.WorkerProcess], sig: int, why: str) -> None:
        """Stop workers (see workers.stop) and say which frozen ones were killed at once."""
        live = [w for w in group if w.poll() is None]
        if live:
            name = signal.Signals(sig).name
            self.events.emit("stop", reason=why, signal=name, ranks=[w.rank for w in live])
        local.stop(group, sig, self.config.shutdown_timeout_s)
        for worker in group:
            if worker.killed_frozen:
                self.say(f"rank {worker.rank} (pid {worker.pid}) was frozen; killed it at once")

    def _exits(
        self,
        generation: Generation,
        group: list[local.WorkerProcess],
        first: local.WorkerProcess | None,
    ) -> list[WorkerExit]:
        exits = []
        for worker in group:
            error_file = Path(worker.launch.env["TORCHELASTIC_ERROR_FILE"])
            message, traceback = read_error_file(error_file)
            exits.append(
                WorkerExit(
                    rank=worker.rank,
                    local_rank=worker.local_rank,
                    node=self.hostname,
                    pid=worker.pid,
                    generation=generation.number,
                    returncode=worker.returncode if worker.returncode is not None else -9,
                    time=worker.ended or time.time(),
                    stopped_by_agent=worker.stopped_by_agent,
                    first=worker is first,
                    message=message,
                    traceback=traceback,
                )
            )
        return exits

    # --- endings -------------------------------------------------------------------------

    def _finish(self, rdzv: Rendezvous, generation: Generation) -> int:
        self.events.emit("done", generation=generation.number)
        if self.config.is_single_node:
            return ExitCode.SUCCESS
        with contextlib.suppress(StoreError):  # our workers are done: nothing left to stop
            rdzv.store.set_record(f"gen/{generation.number}/done/{self.node_id}", {})
            rdzv.mark_done(generation.number)
        if rdzv.is_leader:
            # Keep serving the store until every node is done, or the job ends otherwise
            # (a node that stops beating without being done ends the wait too).
            deadline = time.monotonic() + self.config.join_timeout_s
            others = {n.node_id for n in generation.nodes} - {self.node_id} - self.dropped_nodes
            while time.monotonic() < deadline and self.inbox.received is None:
                if rdzv.done_count(generation.number) >= generation.nnodes:
                    break
                if rdzv.shutdown_reason() is not None or rdzv.ended(generation.number):
                    break
                if self.monitor is not None:
                    done = {n for n in others if rdzv.store.get_record(
                        f"gen/{generation.number}/done/{n}") is not None}
                    if not others - done:
                        break  # the nodes a regroup dropped are never done: not waited for
                    self.monitor.watch(others - done)
                    if set(self.monitor.scan()) >= others - done:
                        self.say("every node that is not done has stopped beating; exiting",
                                 style="yellow")
                        break
                time.sleep(max(self.config.monitor_interval_s, 0.2))
        return ExitCode.SUCCESS

    def _give_up(self, rdzv: Rendezvous, result: GenerationResult) -> int:
        failures = [e for e in result.exits if not e.ok]
        restarts = self.config.max_restarts
        with contextlib.suppress(StoreError):
            rdzv.shut_down({"reason": "max restarts exhausted", "node_rank": self.node_rank})
        self.events.emit("stop", reason="failed", restarts=restarts)
        print_failure_summary(
            self.console,
            failures,
            remote_cause=result.cause if result.outcome is Outcome.REMOTE_FAILED else None,
            max_restarts=restarts,
        )
        return ExitCode.WORKER_FAILED


def _first_failure(exits: list[WorkerExit]) -> WorkerExit | None:
    return next((e for e in exits if e.first), None)


def _is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (c10d: then this agent hosts the
    store, unless another agent here already does)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def format_time(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]


def run_agent(config: LaunchConfig) -> int:
    """Run one node's share of the job; returns the process exit code."""
    agent = Agent(config)
    code = agent.run()
    if agent.store_lost or not config.is_single_node:
        # A store client thread (heartbeat, end watch, a connect to a frozen host) may still
        # be inside torch: one that takes the GIL back once the interpreter finalizes aborts
        # the process ("terminate called without an active exception", seen when the store
        # host left first). Everything is said and every worker is stopped: leave now, with
        # the documented code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
