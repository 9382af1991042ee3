"""The agent's outer loop: one per node, it runs the job for its local workers.

    connect store -> join job generation N -> run a supervisor -> (done | re-form | restart
    | give up | stop)

The agent owns what lasts for the whole job on this node: the control store connection (or
the store itself, on the leader), the heartbeat sender or monitor, the signal inbox, the
event log and the console. Each job generation is handed to a supervisor
(:mod:`ftrun.agent.restart` or :mod:`ftrun.agent.regroup`) through the narrow services of
:mod:`ftrun.agent.services`; the supervisor returns a :class:`GenerationResult`, and this
loop alone decides what follows: finish, re-form without counting a restart (a join, a
node dropped while alive), restart while ``--max-restarts`` allows, or give up.

Error semantics: :func:`run_agent` never raises for anything a job can do; it returns the
exit code from :mod:`ftrun.exitcodes` after printing one summary. Only bugs in ftrun
itself escape as exceptions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from ftrun.agent import etcdwriter
from ftrun.agent.forkserver import ForkServer
from ftrun.agent.inject import Injector
from ftrun.agent.launcher import Launcher, WorkerStartError
from ftrun.agent.nodes import NodeWatch, passes_health_gate, say_refused, standby_config
from ftrun.agent.outcome import GenerationResult, Outcome, describe_cause, root_fields
from ftrun.agent.regroup import RegroupSupervisor
from ftrun.agent.restart import RestartSupervisor
from ftrun.agent.services import AgentServices, Supervisor
from ftrun.agent.signals import SignalInbox
from ftrun.agent.snapshots import NodeSnapshots
from ftrun.client.jobref import register, register_etcd, unregister
from ftrun.config import LaunchConfig, Recovery, parse_seconds
from ftrun.control.auth import Signer, load_secret
from ftrun.control.errors import StoreError
from ftrun.control.heartbeat import HeartbeatMonitor, HeartbeatSender, serve_presence
from ftrun.control.presence import PING_S, PresenceClient, PresenceServer
from ftrun.control.rendezvous import (
    DynamicRendezvous,
    Generation,
    NodeSlot,
    Rendezvous,
    RendezvousError,
    StaticRendezvous,
    StoreLostError,
)
from ftrun.control.store import JsonStore
from ftrun.control.tcpstore import connect_store, serve_store
from ftrun.decide.crashloop import CrashLoop
from ftrun.exitcodes import ExitCode, exit_at_once, for_signal
from ftrun.host import fdlimit
from ftrun.host.hostnet import LOOPBACK, is_local_address, store_bind_address
from ftrun.observe.events import Event, EventLog, WorkerExit
from ftrun.observe.faults import FaultBook, explain_exits
from ftrun.observe.metrics import Metrics, MetricsError
from ftrun.observe.statusboard import StatusBoard
from ftrun.observe.summary import print_failure_summary, print_job_summary

if TYPE_CHECKING:  # imported where used: requests and etcd3gw cost every agent's start
    from ftrun.control.election import Election, WriterWatch


class Agent:
    """One node's share of a job: the store connection, the generations, the ending.

    Jobs it does not do itself: running a generation (the supervisors), launching processes
    (:class:`~ftrun.agent.launcher.Launcher`), watching other nodes
    (:class:`~ftrun.agent.nodes.NodeWatch`), beating and watching heartbeats
    (:mod:`ftrun.control.heartbeat`).
    """

    def __init__(self, config: LaunchConfig, fork_server: ForkServer | None = None) -> None:
        self.config = config
        self.hostname = socket.gethostname()
        # A log file or a pipe is read later, in a wider window than rich's 80-column default.
        width = None if sys.stderr.isatty() else 160
        self.console = Console(stderr=True, highlight=False, width=width)
        self.run_id = config.rdzv_id
        self.inbox = SignalInbox(config.signals_to_handle)
        base_log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="ftrun_"))
        base_log_dir.mkdir(parents=True, exist_ok=True)
        run_log_dir = Path(tempfile.mkdtemp(prefix=f"{self.run_id}_", dir=base_log_dir))
        events_path = config.events_file
        if events_path is None and config.log_dir is not None:
            events_path = run_log_dir / "events.jsonl"
        self.events = EventLog.open(self.hostname, events_path, config.event_log_console)
        # One record per fault, from the events: a line per completed recovery, the
        # summary at the end (ftrun.observe.faults).
        self.faults = FaultBook(on_line=lambda text: self.say(text, style="green"),
                                on_record=lambda f: self.events.emit(Event.FAULT, **f.to_json()))
        self.events.add_listener(self.faults.observe)
        # Faults injected on purpose (--inject, ftrun inject), and the run's registration.
        self.injector = Injector(config.inject, self.events, self.say, lambda: self.node_rank)
        self._registration: Path | None = None
        self.board = StatusBoard()  # what ftrun status shows (the leader publishes it)
        self.events.add_listener(self.board.observe)
        self.metrics: Metrics | None = None
        if config.metrics_port is not None:  # served once the run starts (_run)
            self.metrics = Metrics()
            self.events.add_listener(self.metrics.observe)
        self.events.emit(Event.STARTED, run_id=self.run_id,
                         nproc_per_node=config.nproc_per_node)
        self.launcher = Launcher(config, hostname=self.hostname, run_log_dir=run_log_dir,
                                 events=self.events, say=self.say, fork_server=fork_server)
        # The node's snapshot memory (ftrun.restartable): every worker inherits its path;
        # on several nodes (in-process recovery) its replica server too (buddy copies).
        serve = not config.is_single_node and config.recovery is not Recovery.RESTART
        self.snapshots = NodeSnapshots(self.run_id, self.hostname,
                                       serve=serve, advertise=config.local_addr)
        if self.snapshots.warning:
            self.say(self.snapshots.warning, style="yellow")
        if self.metrics is not None and self.snapshots.path is not None:
            self.metrics.watch_snapshots(self.snapshots.path)
        os.environ.update(self.snapshots.env())
        self.control_server: Any = None
        self._control_raw: Any = None  # this agent's raw client of the control store
        self.worker_stores: list[Any] = []
        self.history: list[WorkerExit] = []
        # Multi-node: this agent's identity in the store; its node rank in the current
        # generation (c10d: given by the leader); heartbeats sent or (leader) watched.
        self.node_id = f"{self.hostname}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        if not (config.rdzv_backend == "static" or config.is_single_node):
            self.launcher.node_rank = -1
        self.heartbeat: HeartbeatSender | None = None
        self.presence: PresenceServer | None = None  # the leader's (control/presence.py)
        self.nodes: NodeWatch | None = None
        self.store_lost = False
        self.election: Election | None = None  # etcd-v3: won by this agent (the writer)
        self._writer_watch: WriterWatch | None = None  # etcd-v3: the other agents'
        self._services: AgentServices | None = None
        self._rdzv: Rendezvous | None = None
        # etcd-v3: generation -> the node id whose agent took its member-epoch store over
        # after its writer died (agent/etcdwriter.py); absent: the writer that formed it
        self.generation_writers: dict[int, str] = {}
        self.control_endpoint: tuple[str, int] = (config.rdzv_host, config.rdzv_port)
        # The stores this agent hosts: the address they listen on (None: every interface)
        # and the host name their clients are given (see _bind_stores).
        self.store_bind: str | None = LOOPBACK
        self.store_host = config.rdzv_host
        # Non-leaders: how a thread opens a store client of its own; one request's bound.
        self._open_client: Callable[[], Any] | None = None
        self._op_timeout = 1.0

    @property
    def node_rank(self) -> int:
        return self.launcher.node_rank

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
                self.events.emit(Event.STOP, reason="store lost", detail=str(lost or error))
                self.store_lost = True
                return ExitCode.RENDEZVOUS_FAILED
            final = self._shut_down_for()
            if final is not None:  # another node stopped the job for good (a crash loop)
                self.say(f"the job stopped: {error}", style="red")
                self.events.emit(Event.STOP, reason="failed", detail=str(error))
                return final
            self.say(f"rendezvous failed: {error}", style="red")
            self.events.emit(Event.STOP, reason="rendezvous", detail=str(error))
            return ExitCode.RENDEZVOUS_FAILED
        finally:
            self.snapshots.close()
            etcdwriter.stop_watches(self)  # the writer watch; the heartbeats' lease view
            if self.election is not None:
                self.election.resign(0.0 if self.store_lost else 2.0 * self._op_timeout)
            if self.heartbeat is not None:
                self.heartbeat.stop(0.0 if self.store_lost else 2.0 * self._op_timeout)
            if self.presence is not None:
                self.presence.close(0.0)
            self.injector.stop()
            if self.metrics is not None:
                self.metrics.close()
            unregister(self._registration)
            self.inbox.close()
            self.events.close()

    def _run(self) -> int:
        fdlimit.raise_for(self.config, self.say)  # before any store or worker starts
        if self.metrics is not None:
            assert self.config.metrics_port is not None
            try:
                port = self.metrics.serve(self.config.metrics_port)
            except MetricsError as error:  # bad input: one line, nothing started
                print(f"ftrun: error: {error}", file=sys.stderr)
                return ExitCode.USAGE
            self.say(f"metrics: http://{self.hostname}:{port}/metrics")
        rdzv = self._connect()
        if rdzv is None:
            return for_signal(self._signal())
        self._rdzv = rdzv
        supervisor = self._supervisor(rdzv)
        etcdwriter.watch_writer(self, rdzv)
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
            if dynamic and not rdzv.is_leader and not passes_health_gate(
                    rdzv, number, slot, self.events):  # the quick doctor checks (nodes.py)
                return ExitCode.RENDEZVOUS_FAILED
            generation = rdzv.join(
                number, slot, self.config.join_timeout_s, self._open_worker_store,
                restart_count=restart_count, expected=expected,
            )
            member = generation.node(self.node_id)
            assert member is not None
            self.launcher.node_rank = member.node_rank
            if self._services is not None:  # a standby runs its share as spares (nodes.py)
                self._services.config = standby_config(self.config, member.standby, self.say)
            if self.config.rdzv_backend == "etcd-v3" and not self.config.is_single_node:
                # the member epochs live in the generation's worker store (its writer's)
                etcdwriter.hand_down(self, generation, generation.worker_store_host,
                                     generation.worker_store_port)
            if self.nodes is not None:
                self.nodes.begin(member.node_rank)
            restart_count = generation.restart_count
            if number != generation.number or (dynamic and generation.number == 0):
                self.say(f"joined generation {generation.number} as node {self.node_rank} of "
                         f"{generation.nnodes} ({generation.world_size} workers)")
            self.events.emit(
                Event.GENERATION,
                generation=generation.number,
                world_size=generation.world_size,
                nnodes=generation.nnodes,
                node_rank=self.node_rank,
                restart_count=restart_count,
            )
            try:
                result = supervisor.run(generation)
            except WorkerStartError as error:  # bad input: one line, the usage code
                with contextlib.suppress(StoreError):
                    rdzv.shut_down({"reason": str(error), "node_rank": self.node_rank})
                self.events.emit(Event.STOP, reason="start failed", detail=str(error))
                print(f"ftrun: error: {error}", file=sys.stderr)
                return ExitCode.USAGE
            self.history.extend(result.exits)
            explain_exits(self.events, result.exits)  # the fault table names each error
            if result.outcome is Outcome.SUCCEEDED:
                return self._finish(rdzv, generation)
            if result.outcome is Outcome.SIGNALED:
                sig = self._signal()
                with contextlib.suppress(StoreError):
                    rdzv.shut_down({"reason": f"signal {sig.name}", "node_rank": self.node_rank})
                self.events.emit(Event.STOP, reason="signal", signal=sig.name)
                return for_signal(sig)
            why = result.cause or {}
            final = self._final_code(why)
            if final is not None:  # the job cannot go on by any restart
                return self._give_up(rdzv, result, final)
            # A join, or this node left out while alive: membership changed, nothing failed.
            joining = (result.outcome is Outcome.REMOTE_FAILED
                       and why.get("kind") in ("join", "dropped"))
            lost = why.get("node_id") if why.get("kind") == "node lost" else None
            # only the leader waits for the survivors (a non-leader's generation reads its
            # membership from the store when asked: control/rendezvous.py, LazyNodes); not
            # for a node a regroup dropped as lost (waiting for it cost a restart 30 s)
            dropped = self.nodes.dropped if self.nodes is not None else set()
            expected = tuple(n.node_id for n in generation.nodes
                             if n.node_id != lost and n.node_id not in dropped) \
                if rdzv.is_leader else ()
            number = generation.number + 1
            self._drop_old_worker_stores()
            if joining:
                self.say(f"generation {generation.number} ended: {describe_cause(why)}; "
                         "re-forming (not counted as a restart)", style="yellow")
                self.events.emit(Event.REGENERATE, generation=generation.number,
                                 cause=why["kind"])
                continue
            if restart_count >= self.config.max_restarts:
                return self._give_up(rdzv, result)
            restart_count += 1
            first = next((e for e in result.exits if e.first), None)
            cause = (
                f"rank {first.rank} ({first.reason})"
                if first is not None and why.get("kind") != "escalate"
                else describe_cause(result.cause)
            )
            self.say(
                f"generation {generation.number} ended: {cause}; restarting "
                f"({restart_count}/{self.config.max_restarts})",
                style="yellow",
            )
            self.events.emit(Event.RESTART, generation=generation.number,
                             restart_count=restart_count, cause=cause, **root_fields(first))

    def _supervisor(self, rdzv: Rendezvous) -> Supervisor:
        """Restart is torchrun's recovery; regroup (and auto, which falls back to a restart
        for scripts without the worker API) keeps the survivors running."""
        services = AgentServices(
            config=self.config, hostname=self.hostname, node_id=self.node_id, say=self.say,
            events=self.events, inbox=self.inbox, launcher=self.launcher, rdzv=rdzv,
            nodes=self.nodes, store_lost=self._lost_reason, open_client=self._open_client,
            op_timeout_s=self._op_timeout, crash_loop=CrashLoop(self.config.max_repeats),
        )
        if self.config.rdzv_backend == "etcd-v3" and not self.config.is_single_node:
            services.generation_store_of = functools.partial(etcdwriter.generation_store, self)
            services.writer_gone = functools.partial(etcdwriter.writer_gone, self)
            services.moved_store = functools.partial(etcdwriter.moved_store, self)
        self._services = services
        if self.config.recovery is Recovery.RESTART:
            return RestartSupervisor(services)
        return RegroupSupervisor(services)

    def _connect(self) -> Rendezvous | None:
        config = self.config
        interrupted = lambda: self.inbox.received is not None  # noqa: E731
        multi = not config.is_single_node
        dynamic = multi and config.rdzv_backend in ("c10d", "etcd-v3")
        explicit_host = "is_host" in config.rdzv_conf
        hosting = config.hosts_store if (explicit_host or not dynamic) else is_local_address(
            config.rdzv_host)
        # etcd-v3: no agent serves the control store; the job's writer is elected below
        etcd = None
        if multi and config.rdzv_backend == "etcd-v3":
            from ftrun.control.election import join_etcd
            from ftrun.control.etcd import EtcdOptions, connect_etcd
            etcd = EtcdOptions.parse(config.rdzv_endpoint, config.rdzv_conf)
        hosting = hosting and etcd is None
        op_timeout = max(1.0, config.heartbeat_timeout_s / 3)
        self._op_timeout = op_timeout
        store: Any = None
        if hosting:
            self._bind_stores()
            try:
                self.control_server = serve_store(config.rdzv_port, config.join_timeout_s,
                                                  host=self.store_bind)
            except StoreError:
                if not dynamic or explicit_host:
                    raise
                hosting = False  # another agent on this host serves it (torchrun's rule)
        if hosting:
            store = self.control_server
            self.control_endpoint = (self.store_host, int(self.control_server.port))
        elif etcd is not None:
            store, self.election = join_etcd(
                etcd, run_id=self.run_id, node_id=self.node_id, op_timeout_s=op_timeout,
                connect_s=min(config.join_timeout_s, parse_seconds(
                    config.rdzv_conf.get("read_timeout", "60"), "read_timeout")),
                lease_s=config.heartbeat_timeout_s, interrupted=interrupted)
            hosting = self.election is not None  # the writer: forms the generations
            if hosting:
                self._bind_stores()
                self.say(f"this agent is the job's writer (elected on etcd at {etcd.describe()})")
        else:
            store = connect_store(
                config.rdzv_host, config.rdzv_port, config.join_timeout_s, interrupted=interrupted,
                op_timeout_s=op_timeout,
            )
            self.control_endpoint = (config.rdzv_host, config.rdzv_port)
        if interrupted():
            return None
        self._control_raw = store
        host, port = self.control_endpoint
        self.launcher.control_addr = f"{host}:{port}"
        signer = Signer(load_secret())
        reconnect = lambda: connect_store(host, port, op_timeout, op_timeout_s=op_timeout)  # noqa: E731
        if etcd is not None:
            reconnect = lambda: connect_etcd(etcd, op_timeout, op_timeout_s=op_timeout)  # noqa: E731
        if multi and not hosting:
            self._open_client = reconnect
        jstore = JsonStore(
            store, f"ftrun/{self.run_id}", signer=signer,
            reconnect=None if hosting and etcd is None else reconnect,
            retry_s=config.heartbeat_timeout_s * 3,
            lost=lambda: self._lost_reason() is not None,
            on_reject=self._rejected_record,
        )
        self._start_injector(host, port, signer, hosting, op_timeout,
                             None if etcd is None else reconnect)
        if multi and not signer.enabled and hosting:
            self.say("control records are unauthenticated: anyone who reaches "
                     f"{host}:{port} can steer this job (set FTRUN_JOB_TOKEN on every node)",
                     style="yellow")
        if multi and hosting:  # a killed agent is lost at once (etcd-v3: the writer serves)
            self.presence = serve_presence(jstore, signer, self.run_id, self.store_bind,
                                           self.store_host, self._rejected_record, self.node_id)
        if multi and not hosting:
            self.heartbeat = HeartbeatSender(
                reconnect, jstore, self.node_id, config.heartbeat_interval_s,
                config.heartbeat_timeout_s, min_grace_s=3 * op_timeout,
                presence=PresenceClient(
                    signer, self.run_id, self.node_id, min(2.0, op_timeout),
                    ping_s=min(PING_S, config.heartbeat_timeout_s / 8)),
            )
            self.heartbeat.start()
        monitor = HeartbeatMonitor(jstore, config.heartbeat_timeout_s, self.presence,
                                   config.heartbeat_interval_s) if multi and hosting else None
        if monitor is not None:
            self.nodes = NodeWatch(monitor, node_id=self.node_id,
                                   heartbeat_interval_s=config.heartbeat_interval_s,
                                   events=self.events, say=self.say)
        common: dict[str, Any] = dict(
            is_leader=hosting,
            poll_s=min(config.monitor_interval_s, 0.05),
            interrupted=interrupted,
            lost=self._lost_reason,
            monitor=monitor,
            on_wait=lambda text: self.say(text, style="yellow"),
            on_refused=lambda slot: say_refused(slot, self.say, self.events),
        )
        if dynamic:
            last_call = parse_seconds(config.rdzv_conf.get("last_call_timeout", "30"),
                                      "last_call_timeout", allow_zero=True)
            return DynamicRendezvous(jstore, min_nodes=config.nnodes_min,
                                     max_nodes=config.nnodes_max, last_call_s=last_call,
                                     standby_nodes=config.standby_nodes, **common)
        return StaticRendezvous(jstore, node_rank=config.node_rank, nnodes=config.nnodes,
                                **common)

    def _start_injector(self, host: str, port: int, signer: Signer, hosting: bool,
                        op_timeout: float, connect: Callable[[], Any] | None = None) -> None:
        """The injector's thread on a store client of its own (ftrun inject's requests);
        the leader keeps the job's record and registers the run id here (ftrun.client.jobref).
        ``connect``: etcd-v3's clients: the writer keeps the record, every agent registers."""
        def open_store() -> JsonStore:
            client = connect() if connect is not None else connect_store(
                host, port, op_timeout, op_timeout_s=op_timeout)
            return JsonStore(client, f"ftrun/{self.run_id}", signer=signer,
                             on_reject=self._rejected_record)

        job = None
        if connect is not None:
            job = etcdwriter.job_record(self) if hosting else None
            self._registration = register_etcd(self.run_id, self.config.rdzv_endpoint,
                                               self.config.rdzv_conf)
        elif hosting:
            job = {"run_id": self.run_id, "host": host, "port": port, "started": time.time()}
            self._registration = register(self.run_id, host, port)
        self.injector.start(open_store, job, self.board.snapshot, job_in_run=connect is not None)
        if self._registration is not None:  # the job's first line: how to find it again
            self.say(f"run id {self.run_id}: `ftrun status {self.run_id}` shows this job")

    def _shut_down_for(self) -> ExitCode | None:
        """The exit code another agent's shutdown of the job carries for good (see
        :meth:`_final_code`), or None."""
        if self._rdzv is None:
            return None
        try:
            reason = self._rdzv.shutdown_reason()
        except (StoreError, RendezvousError):
            return None
        return self._final_code(reason) if reason else None

    def _lost_reason(self) -> str | None:
        """Why the store host counts as lost (this agent's heartbeats fail; etcd-v3: this
        writer's lease was not renewed, so another agent may write now), or None."""
        if self.election is not None and self.election.lost_at is not None:
            return (f"this agent's lease as the job's writer expired (not renewed for "
                    f"{self.election.ttl_s} s): another agent may have taken over")
        beat = self.heartbeat
        if beat is None or not beat.lost():
            return None
        host, port = self.control_endpoint
        detail = f" ({beat.last_error})" if beat.last_error else ""
        return f"no answer from the store at {host}:{port} for {beat.silent_s():.1f} s{detail}"

    def _rejected_record(self, message: str) -> None:
        self.say(message, style="yellow")
        self.events.emit(Event.REJECTED, detail=message)

    def _bind_stores(self) -> None:
        """Where this agent's stores listen (``ftrun.host.hostnet.store_bind_address``): a single
        node's on loopback only, a multi-node job's on the address the other nodes reach;
        every interface only when none fits, said once."""
        config = self.config
        # etcd-v3: the endpoints are etcd's; the writer's stores are on this node's address
        here = (config.local_addr or self.hostname) if self.election is not None \
            else config.rdzv_host
        self.store_bind = store_bind_address(single_node=config.is_single_node,
                                             rdzv_host=here,
                                             local_addr=config.local_addr)
        # A single node's workers are told the host name torchrun would tell them
        # ("localhost") when it reaches the loopback store, else the loopback address.
        self.store_host = here if not config.is_single_node or \
            _reaches_loopback(config.rdzv_host) else LOOPBACK
        if self.store_bind is None:
            self.say(f"the stores listen on every interface: {config.rdzv_host!r} is not an "
                     "address of this host other nodes can reach (set --local-addr to this "
                     "node's address to listen on that one only)", style="yellow")

    def _open_worker_store(self) -> tuple[str, int]:
        """Where the workers of the generation being formed find their store (called by the
        agent that forms it, once every worker of the previous one has stopped).

        With an explicit ``--master-port``/``--rdzv-endpoint`` port, torchrun's one-port
        contract: the workers are given that port (sites may open no other between nodes),
        and the store keeps no key of a dead generation, because every key outside ftrun's
        own ``ftrun/`` space is deleted first (pytorch#135712 was restarted workers reading
        a dead attempt's addresses from a shared store). Otherwise each generation gets a
        fresh store on a port of its own, which no stale worker can ever reach."""
        if self.config.rdzv_port_explicit and self._control_raw is not None:
            try:
                stale = [k for k in self._control_raw.list_keys() if not k.startswith("ftrun/")]
                for key in stale:
                    self._control_raw.delete_key(key)
            except (AttributeError, RuntimeError) as error:
                self.say(f"cannot clear the job store's worker keys ({error}); workers get a "
                         "port of their own instead of the one given", style="yellow")
            else:
                return self.control_endpoint
        server = serve_store(0, self.config.join_timeout_s, host=self.store_bind)
        self.worker_stores.append(server)
        return self.store_host, int(server.port)

    def _drop_old_worker_stores(self) -> None:
        # The previous generation's workers are all gone; its store keeps no one waiting.
        del self.worker_stores[:-1]

    def _signal(self) -> signal.Signals:
        assert self.inbox.received is not None
        return self.inbox.received

    # --- endings -------------------------------------------------------------------------

    def _finish(self, rdzv: Rendezvous, generation: Generation) -> int:
        self.events.emit(Event.DONE, generation=generation.number)
        print_job_summary(self.console, self.faults.summary())
        if self.config.is_single_node:
            return ExitCode.SUCCESS
        with contextlib.suppress(StoreError):  # our workers are done: nothing left to stop
            rdzv.store.set_record(f"gen/{generation.number}/done/{self.node_id}", {})
            rdzv.mark_done(generation.number)
        if rdzv.is_leader:
            # Keep serving the store until every node is done, or the job ends otherwise
            # (a node that stops beating without being done ends the wait too).
            deadline = time.monotonic() + self.config.join_timeout_s
            dropped = self.nodes.dropped if self.nodes is not None else set()
            others = {n.node_id for n in generation.nodes} - {self.node_id} - dropped
            while time.monotonic() < deadline and self.inbox.received is None:
                if rdzv.done_count(generation.number) >= generation.nnodes:
                    break
                if rdzv.shutdown_reason() is not None or rdzv.ended(generation.number):
                    break
                if self.nodes is not None:
                    monitor = self.nodes.monitor
                    done = {n for n in others if rdzv.store.get_record(
                        f"gen/{generation.number}/done/{n}") is not None}
                    if not others - done:
                        break  # the nodes a regroup dropped are never done: not waited for
                    monitor.watch(others - done)
                    if set(monitor.scan()) >= others - done:
                        self.say("every node that is not done has stopped beating; exiting",
                                 style="yellow")
                        break
                time.sleep(max(self.config.monitor_interval_s, 0.2))
        return ExitCode.SUCCESS

    @staticmethod
    def _final_code(cause: dict[str, Any]) -> ExitCode | None:
        """The exit code of a generation end that no restart can cure: a combination of
        flags refused once the script showed what it is (usage), or the script's own error
        repeating (ftrun.decide.crashloop); None for the others."""
        return {"refused": ExitCode.USAGE, "crash loop": ExitCode.CRASH_LOOP}.get(
            cause.get("kind"))

    def _give_up(self, rdzv: Rendezvous, result: GenerationResult,
                 code: ExitCode = ExitCode.WORKER_FAILED) -> int:
        failures = [e for e in result.exits if not e.ok]
        restarts = self.config.max_restarts
        kind = (result.cause or {}).get("kind")
        reason = kind if code is not ExitCode.WORKER_FAILED else "max restarts exhausted"
        with contextlib.suppress(StoreError):
            rdzv.shut_down({"reason": reason, "kind": kind, "node_rank": self.node_rank})
        self.events.emit(Event.STOP, reason="failed", restarts=restarts, code=int(code),
                         **root_fields(next((e for e in result.exits if e.first), None)))
        print_failure_summary(
            self.console,
            failures,
            remote_cause=result.cause if result.outcome is Outcome.REMOTE_FAILED else None,
            max_restarts=restarts,
        )
        print_job_summary(self.console, self.faults.summary())
        return code


def _reaches_loopback(host: str) -> bool:
    """Whether ``host`` resolves to the loopback address the single-node stores bind."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return any(info[4][0] == LOOPBACK for info in infos)


def run_agent(config: LaunchConfig, fork_server: ForkServer | None = None) -> int:
    """Run one node's share of the job; returns the process exit code. ``fork_server``:
    the ``--preload`` server, if the caller started it already."""
    agent = Agent(config, fork_server)
    code = agent.run()
    if agent.store_lost or not config.is_single_node:
        # A store client thread (heartbeat, end watch, a connect to a frozen host) may still
        # be inside torch: one that takes the GIL back once the interpreter finalizes aborts
        # the process ("terminate called without an active exception", seen when the store
        # host left first). Everything is said and every worker is stopped: leave now, with
        # the documented code.
        exit_at_once(code)
    return code
