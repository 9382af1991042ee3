"""Starting and stopping this node's workers for a supervisor.

:class:`Launcher` is the one place that turns a job generation into worker processes: the
environment (torchrun's variables with torchrun's values, plus :class:`ftrun.protocol.WorkerEnv`),
torchrun's log layout, the NCCL shim's control page, the ``spawn`` event; and the one place
that stops them (SIGTERM, SIGKILL after the grace, a frozen worker killed at once) and turns
their ends into cause records. Both supervisors (restart and regroup) use it; it knows
nothing of either.

Each worker process gets a fresh shim page, so its communicator epochs start at 0 whatever
the job generation or member epoch: an abort is expressed only as "every communicator made
so far" (:meth:`ftrun.shim.ShimControl.abort`), never in another counter's numbers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ftrun import exithook
from ftrun.agent import processes as local
from ftrun.agent.forkserver import (
    ForkServer,
    ForkServerError,
    preload_unsupported,
    start_fork_server,
)
from ftrun.config import LaunchConfig, Std
from ftrun.control.rendezvous import Generation
from ftrun.observe.events import Event, EventLog, WorkerExit, read_error_file
from ftrun.protocol import SURVIVOR_TORCH_ENV, MemberEnv, WorkerEnv
from ftrun.shim import ShimControl, ShimError


class WorkerStartError(RuntimeError):
    """The worker program could not be executed at all (the user's input, not a fault of
    the job: the agent stops what it started and exits with the usage code)."""


class Launcher:
    """Spawns, stops and describes this node's worker processes (main thread only)."""

    def __init__(
        self,
        config: LaunchConfig,
        *,
        hostname: str,
        run_log_dir: Path,
        events: EventLog,
        say: Callable[..., None],
        fork_server: ForkServer | None = None,
    ) -> None:
        """``fork_server``: the ``--preload`` server the CLI already started (see
        :func:`~ftrun.agent.forkserver.start_fork_server`); else it starts here."""
        self.config = config
        self.hostname = hostname
        self.run_log_dir = run_log_dir
        self.events = events
        self.say = say
        self.node_rank = config.node_rank  # this node's rank in the current job generation
        self.control_addr = f"{config.rdzv_host}:{config.rdzv_port}"
        self._shim_unavailable = False
        self._fork_server: ForkServer | None = None
        self._notes: list[tuple[str, str]] = []  # said at the first spawn (the agent's
        # console is not ready while it constructs its launcher)
        self.start_preload(fork_server)  # now, so that the imports overlap the rendezvous

    # -- --preload ---------------------------------------------------------------------
    def start_preload(self, started: ForkServer | None = None) -> None:
        """Start the fork server for ``--preload`` (its imports overlap the rendezvous)
        unless ``started`` already, or say why this job's workers cannot be forked and
        start them the normal way."""
        config = self.config
        if not config.preload:
            return
        reason = preload_unsupported(config)
        if reason is not None:
            if config.preload_auto:
                self._notes.append((f"preload off: {reason}; workers start the normal way",
                                    "dim"))
            else:
                self._notes.append((f"--preload ignored: {reason}; workers start the normal "
                                    "way", "yellow"))
            return
        self._fork_server = started or start_fork_server(config)

    def _forked(self, launch: local.WorkerLaunch) -> local.Child:
        assert self._fork_server is not None
        config = self.config
        return self._fork_server.spawn([config.entrypoint, *config.args],
                                       module=bool(config.module), env=launch.env,
                                       cwd=os.getcwd())

    def _fork_server_ready(self) -> ForkServer | None:
        while self._notes:
            text, style = self._notes.pop(0)
            self.say(text, style=style)
        server = self._fork_server
        if server is None or server.import_s is not None:
            return server
        try:
            import_s = server.wait_ready(timeout_s=max(self.config.join_timeout_s, 60.0))
        except ForkServerError as error:
            self.close()
            if not self.config.preload_auto:
                raise WorkerStartError(str(error)) from None
            # the default's choice, not the user's: start workers the normal way instead
            reason = str(error).removeprefix("--preload: ")
            self.say(f"preload off: {reason}; workers start the normal way", style="yellow")
            return None
        self.say(f"preload: imported {', '.join(server.modules)} once in {import_s:.2f} s; "
                 f"workers are forked from pid {server.pid}")
        return server

    def close(self) -> None:
        """Stop the fork server, if any (call once every worker is stopped; an agent that
        exits without it still leaves nothing: the server dies with it by PDEATHSIG)."""
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = None

    def spawn_worker(
        self,
        generation: Generation,
        local_rank: int,
        *,
        member: MemberEnv | None = None,
        prefix: str | None = None,
        log_name: str | None = None,
    ) -> local.WorkerProcess:
        """Start one local worker of ``generation``."""
        config = self.config
        attempt_dir = self.run_log_dir / f"attempt_{generation.restart_count}"
        rank = generation.rank_offset(self.node_rank) + local_rank
        rank_dir = attempt_dir / (log_name or str(local_rank))
        rank_dir.mkdir(parents=True, exist_ok=True)
        env = self._worker_env(generation, local_rank, rank, rank_dir / "error.json", member)
        server = self._fork_server_ready()
        # a forked worker attaches to its page itself, if its server preloads the shim
        shim = self._shim_control(f"rank{rank}") \
            if server is None or server.has_shim else None
        if shim is not None:
            env = shim.worker_env(env)
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
        try:
            worker = local.spawn(launch, self._forked) if server is not None else \
                local.spawn(launch)
        except OSError as error:
            program = launch.argv[0]
            hint = " (is the interpreter in its #! line installed?)" if (
                Path(program).is_file() and error.errno == 2) else ""
            raise WorkerStartError(f"cannot run {program}: {error.strerror or error}{hint}") \
                from None
        if shim is not None:
            shim.bind(worker.pid)
            worker.shim = shim
        self.events.emit(
            Event.SPAWN,
            generation=generation.number,
            rank=rank,
            local_rank=local_rank,
            pid=worker.pid,
            member=member.member_id if member is not None else None,
        )
        return worker

    def _shim_control(self, label: str) -> ShimControl | None:
        """The NCCL shim's control page for one worker, or None (disabled, or not built:
        then said once, and the job runs without it)."""
        if not self.config.use_shim or self._shim_unavailable:
            return None
        try:
            return ShimControl(label=label)
        except ShimError as error:
            self._shim_unavailable = True
            self.say(f"NCCL shim not used: {error}", style="yellow")
            return None

    def _worker_env(
        self, generation: Generation, local_rank: int, rank: int, error_file: Path,
        member: MemberEnv | None,
    ) -> dict[str, str]:
        """torchrun's worker variables with torchrun's values, plus ftrun's own."""
        config = self.config
        env = local.shared_worker_env(config)
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
                "TORCHELASTIC_RUN_ID": config.rdzv_id,
                "TORCHELASTIC_USE_AGENT_STORE": str(True),
                "TORCHELASTIC_ERROR_FILE": str(error_file),
                "TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle_text,
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
                ),
            }
        )
        # torchrun's torch settings stay; a member switches to the survivor settings itself
        # (ftrun.init), except those the user chose.
        env.update(WorkerEnv(
            generation=generation.number,
            agent_pid=os.getpid(),
            node_rank=self.node_rank,
            run_id=config.rdzv_id,
            control_addr=self.control_addr,
            user_torch_env=frozenset(k for k in SURVIVOR_TORCH_ENV if k in os.environ),
            member=member,
        ).to_env())
        if not config.no_python and "PYTHON_EXEC" not in os.environ:
            exithook.point_at(env)  # a clean exit on an uncaught exception (ftrun/exithook.py)
        if config.virtual_local_rank:
            env["LOCAL_RANK"] = "0"
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(local_rank + 1)]
            env["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)].strip()
        return env

    def stop_workers(self, group: Sequence[local.WorkerProcess], sig: int, why: str, *,
                     failed_generation: int | None = None) -> None:
        """Stop workers (see processes.stop) and say which frozen ones were killed at once.
        ``failed_generation``: the workers are stopped because that job generation failed;
        a worker found frozen then is a fault of its own that the same restart absorbs (two
        faults close together), so it gets a ``failure`` event and its own fault record."""
        live = [w for w in group if w.poll() is None]
        if live:
            name = signal.Signals(sig).name
            self.events.emit(Event.STOP, reason=why, signal=name, ranks=[w.rank for w in live])
        local.stop(group, sig, self.config.shutdown_timeout_s)
        for worker in group:
            if worker.killed_frozen:
                self.say(f"rank {worker.rank} (pid {worker.pid}) was frozen; killed it at once")
                if failed_generation is not None:
                    now = time.time()
                    self.events.emit(Event.FAILURE, generation=failed_generation,
                                     rank=worker.rank, local_rank=worker.local_rank,
                                     pid=worker.pid, cause="frozen (stopped by a signal)",
                                     returncode=worker.returncode, detected=now, happened=now)

    def worker_exit(
        self, worker: local.WorkerProcess, generation: int, *, first: bool,
        verdict: str | None = None,
    ) -> WorkerExit:
        """The cause record of one ended worker: its error file's message, or the
        supervisor's ``verdict`` for one it took out."""
        error_file = Path(worker.launch.env["TORCHELASTIC_ERROR_FILE"])
        message, traceback = read_error_file(error_file)
        if message is None and worker.returncode not in (0, None) and not verdict:
            # no @record in the script: its own last words, from its stderr
            local.join_pumps([worker], timeout_s=0.2)
            message = local.last_error(list(worker.stderr_tail))
        try:
            error_at: float | None = error_file.stat().st_mtime
        except OSError:
            error_at = None
        return WorkerExit(
            rank=worker.rank,
            local_rank=worker.local_rank,
            node=self.hostname,
            pid=worker.pid,
            generation=generation,
            returncode=worker.returncode if worker.returncode is not None else -9,
            time=worker.ended or time.time(),
            stopped_by_agent=worker.stopped_by_agent,
            first=first,
            message=verdict or message,
            traceback=traceback,
            error_at=error_at,
        )
