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
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ftrun import workers as local
from ftrun.config import LaunchConfig, Recovery, Std
from ftrun.events import EventLog, WorkerExit, read_error_file
from ftrun.exitcodes import ExitCode, for_signal
from ftrun.regroup import RegroupSupervisor
from ftrun.rendezvous import Generation, NodeSlot, RendezvousError, StaticRendezvous
from ftrun.report import print_failure_summary
from ftrun.shim import SURVIVOR_TORCH_ENV, ShimControl, ShimError
from ftrun.store import JsonStore, StoreError, connect_store, serve_store


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


class Outcome(Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a local worker failed
    REMOTE_FAILED = "remote_failed"  # another node ended the generation
    SIGNALED = "signaled"


@dataclass
class GenerationResult:
    outcome: Outcome
    exits: list[WorkerExit]
    cause: dict[str, Any] | None = None


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

    # --- messages ------------------------------------------------------------------------

    def say(self, message: str, style: str = "") -> None:
        prefix = escape(f"[ftrun {self.hostname}:{self.config.node_rank}]")
        self.console.print(f"[bold]{prefix}[/bold] {escape(message)}", style=style)

    # --- the state machine ---------------------------------------------------------------

    def run(self) -> int:
        try:
            return self._run()
        except (RendezvousError, StoreError) as error:
            self.say(f"rendezvous failed: {error}", style="red")
            self.events.emit("stop", reason="rendezvous", detail=str(error))
            return ExitCode.RENDEZVOUS_FAILED
        finally:
            self.inbox.close()
            self.events.close()

    def _run(self) -> int:
        rdzv = self._connect()
        if rdzv is None:
            return for_signal(self._signal())
        restart_count = 0
        while True:
            slot = NodeSlot(
                node_rank=self.config.node_rank,
                local_world_size=self.config.nproc_per_node,
                addr=self.config.local_addr or self.hostname,
                hostname=self.hostname,
                pid=os.getpid(),
            )
            generation = rdzv.join(
                restart_count, slot, self.config.join_timeout_s, self._open_worker_store
            )
            self.events.emit(
                "generation",
                generation=generation.number,
                world_size=generation.world_size,
                nnodes=generation.nnodes,
                restart_count=restart_count,
            )
            result = self._run_generation(rdzv, generation)
            self.history.extend(result.exits)
            if result.outcome is Outcome.SUCCEEDED:
                return self._finish(rdzv, generation)
            if result.outcome is Outcome.SIGNALED:
                sig = self._signal()
                rdzv.shut_down({"reason": f"signal {sig.name}", "node_rank": self.config.node_rank})
                self.events.emit("stop", reason="signal", signal=sig.name)
                return for_signal(sig)
            if restart_count >= self.config.max_restarts:
                return self._give_up(rdzv, result)
            restart_count += 1
            first = _first_failure(result.exits)
            cause = (
                f"rank {first.rank} ({first.reason})"
                if first is not None
                else _describe_cause(result.cause)
            )
            self.say(
                f"generation {generation.number} ended: {cause}; restarting "
                f"({restart_count}/{self.config.max_restarts})",
                style="yellow",
            )
            self.events.emit("restart", generation=generation.number, restart_count=restart_count)
            self._drop_old_worker_stores()

    def _connect(self) -> StaticRendezvous | None:
        config = self.config
        interrupted = lambda: self.inbox.received is not None  # noqa: E731
        if config.hosts_store:
            self.control_server = serve_store(config.rdzv_port, config.join_timeout_s)
            port = self.control_server.port
            store = self.control_server
            self.control_endpoint = (config.rdzv_host, port)
        else:
            store = connect_store(
                config.rdzv_host, config.rdzv_port, config.join_timeout_s, interrupted=interrupted
            )
            self.control_endpoint = (config.rdzv_host, config.rdzv_port)
        if interrupted():
            return None
        return StaticRendezvous(
            JsonStore(store, f"ftrun/{self.run_id}"),
            node_rank=config.node_rank,
            nnodes=config.nnodes,
            is_leader=config.hosts_store,
            poll_s=min(config.monitor_interval_s, 0.05),
            interrupted=interrupted,
        )

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

    def _run_generation(self, rdzv: StaticRendezvous, generation: Generation) -> GenerationResult:
        if self._survivors_continue:
            supervisor = RegroupSupervisor(self, generation, rdzv.store, generation.restart_count)
            return supervisor.run()
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
        rank = generation.rank_offset(config.node_rank) + local_rank
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
        return self.config.recovery is not Recovery.RESTART and self.config.is_single_node

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
                "GROUP_RANK": str(config.node_rank),
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
                "FTRUN_NODE_RANK": str(config.node_rank),
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
        self, rdzv: StaticRendezvous, generation: Generation, group: list[local.WorkerProcess]
    ) -> GenerationResult:
        config = self.config
        reported: set[int] = set()
        remote = not config.is_single_node
        next_poll = time.monotonic() + config.monitor_interval_s
        while True:
            if self.inbox.received is not None:
                self._stop(group, self.inbox.received, "signal")
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
                cause = rdzv.ended(generation.number)
                if cause is not None:
                    self.say(f"generation {generation.number} ended by node "
                             f"{cause.get('node_rank')}: {_describe_cause(cause)}")
                    self._stop(group, signal.SIGTERM, "remote failure")
                    exits = self._exits(generation, group, None)
                    return GenerationResult(Outcome.REMOTE_FAILED, exits, cause)
            timeout = max(0.0, next_poll - time.monotonic()) if remote else 3600.0
            if self.inbox.fd in local.wait_any(group, timeout, [self.inbox.fd]):
                self.inbox.drain()

    def _local_failure(
        self,
        rdzv: StaticRendezvous,
        generation: Generation,
        group: list[local.WorkerProcess],
        failed: local.WorkerProcess,
    ) -> GenerationResult:
        detected = time.time()
        cause = {
            "node_rank": self.config.node_rank,
            "node": self.hostname,
            "rank": failed.rank,
            "pid": failed.pid,
            "returncode": failed.returncode,
            "time": failed.ended,
        }
        if not self.config.is_single_node:
            cause = rdzv.end(generation.number, cause)
        self.events.emit(
            "failure",
            generation=generation.number,
            rank=failed.rank,
            local_rank=failed.local_rank,
            pid=failed.pid,
            returncode=failed.returncode,
            detected=detected,
        )
        self._stop(group, signal.SIGTERM, f"rank {failed.rank} failed")
        return GenerationResult(Outcome.FAILED, self._exits(generation, group, failed), cause)

    def _stop(self, group: list[local.WorkerProcess], sig: int, why: str) -> None:
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

    def _finish(self, rdzv: StaticRendezvous, generation: Generation) -> int:
        self.events.emit("done", generation=generation.number)
        if self.config.is_single_node:
            return ExitCode.SUCCESS
        rdzv.mark_done(generation.number)
        if self.config.hosts_store:
            # Keep serving the store until every node is done, or the job ends otherwise.
            deadline = time.monotonic() + self.config.join_timeout_s
            while time.monotonic() < deadline and self.inbox.received is None:
                if rdzv.done_count(generation.number) >= generation.nnodes:
                    break
                if rdzv.shutdown_reason() is not None or rdzv.ended(generation.number):
                    break
                time.sleep(self.config.monitor_interval_s)
        return ExitCode.SUCCESS

    def _give_up(self, rdzv: StaticRendezvous, result: GenerationResult) -> int:
        failures = [e for e in result.exits if not e.ok]
        restarts = self.config.max_restarts
        with contextlib.suppress(StoreError):
            rdzv.shut_down({"reason": "max restarts exhausted", "node_rank": self.config.node_rank})
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


def _describe_cause(cause: dict[str, Any] | None) -> str:
    if not cause:
        return "unknown cause"
    code = cause.get("returncode")
    what = (
        f"killed by {signal.Signals(-code).name}"
        if isinstance(code, int) and code < 0 and -code in signal.valid_signals()
        else f"exit code {code}"
    )
    return f"rank {cause.get('rank')} on {cause.get('node')} ({what})"


def format_time(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]


def run_agent(config: LaunchConfig) -> int:
    """Run one node's share of the job; returns the process exit code."""
    return Agent(config).run()
