"""``--metrics-port PORT``: the job's health in Prometheus' text format, on every agent.

Served by the ``prometheus-client`` library (its own HTTP server thread, a registry of this
agent's metrics only: no process or platform collectors), and fed, like the fault records,
from the agent's own events (:meth:`EventLog.add_listener`), so serving metrics adds no
store request and no work to the agent's loop: an event updates a few numbers, a scrape
reads them. What a scrape shows:

==================================  =======================================================
``ftrun_job_generation``            the job generation (a restart or a re-form moves it)
``ftrun_member_epoch``              the member epoch (a regroup moves it; leader)
``ftrun_world_size``                ranks in the latest member epoch (or job generation)
``ftrun_members{state}``            this node's worker processes: starting, ready,
                                    finished, failed
``ftrun_restarts_total``            restarts of every worker
``ftrun_regroups_total``            member epochs published after a fault (leader)
``ftrun_escalations_total``         recoveries past their deadline, escalated to a restart
                                    (leader)
``ftrun_faults_total``              faults with a completed recovery
``ftrun_recovery_seconds_last``     the last fault's happening to progress again
``ftrun_recovery_seconds_total``    the same, summed over the job
``ftrun_detection_seconds_last``    the last fault's happening to its detection
``ftrun_steps_lost_total``          committed steps lost to faults
``ftrun_step``                      the job's committed steps (leader)
``ftrun_rank_steps{rank}``          each rank's committed steps (leader)
``ftrun_rank_step_rate{rank}``      each rank's steps per second over the last report
``ftrun_rank_step_seconds{rank}``   its inverse: seconds per step
``ftrun_heartbeat_age_seconds{node}``  seconds since a node's last heartbeat (leader,
                                    several nodes; from ``node_lost``: the silence seen)
``ftrun_straggler{rank,node}``      1 while the rank is a straggler, 0 once it keeps up
                                    (leader; ftrun.agent.stragglers)
``ftrun_straggler_own_seconds{rank,node}``  its own time per step when last judged
``ftrun_stragglers_total``          straggler verdicts
``ftrun_snapshot_age_seconds``      seconds since this node's newest snapshot was written
                                    (``ftrun.restartable``; NaN before the first one)
==================================  =======================================================

The step metrics come from the regroup leader's ``progress`` events (once a second), so
they exist for scripts that use the worker API. Errors: a port that cannot be bound is
reported by :func:`serve` as :class:`MetricsError` (one line), and the agent stops with
the usage code before starting workers.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from ftrun.observe.events import Event
from ftrun.snapshot import memory


class MetricsError(OSError):
    """The metrics endpoint cannot be served; one line."""


class Metrics:
    """This agent's metrics; :meth:`observe` takes each event (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.generation = Gauge("ftrun_job_generation", "The job generation.", registry=r)
        self.epoch = Gauge("ftrun_member_epoch", "The member epoch (regroup).", registry=r)
        self.world = Gauge("ftrun_world_size", "Ranks in the job now.", registry=r)
        self.members = Gauge("ftrun_members", "This node's worker processes by state.",
                             ["state"], registry=r)
        self.restarts = Counter("ftrun_restarts", "Restarts of every worker.", registry=r)
        self.regroups = Counter("ftrun_regroups", "Member epochs published after a fault.",
                                registry=r)
        self.escalations = Counter("ftrun_escalations",
                                   "Recoveries past their deadline, escalated to a restart.",
                                   registry=r)
        self.faults = Counter("ftrun_faults", "Faults with a completed recovery.", registry=r)
        self.recovery_last = Gauge("ftrun_recovery_seconds_last",
                                   "The last fault's happening to progress again.", registry=r)
        self.recovery_total = Counter("ftrun_recovery_seconds",
                                      "Fault to progress again, summed.", registry=r)
        self.detection_last = Gauge("ftrun_detection_seconds_last",
                                    "The last fault's happening to its detection.", registry=r)
        self.steps_lost = Counter("ftrun_steps_lost", "Committed steps lost to faults.",
                                  registry=r)
        self.step = Gauge("ftrun_step", "The job's committed steps.", registry=r)
        self.rank_steps = Gauge("ftrun_rank_steps", "A rank's committed steps.", ["rank"],
                                registry=r)
        self.rank_rate = Gauge("ftrun_rank_step_rate", "A rank's steps per second.",
                               ["rank"], registry=r)
        self.rank_seconds = Gauge("ftrun_rank_step_seconds", "A rank's seconds per step.",
                                  ["rank"], registry=r)
        self.heartbeat_age = Gauge("ftrun_heartbeat_age_seconds",
                                   "Seconds since a node's last heartbeat.", ["node"],
                                   registry=r)
        self.straggler = Gauge("ftrun_straggler", "1 while a rank is a straggler.",
                               ["rank", "node"], registry=r)
        self.straggler_own = Gauge("ftrun_straggler_own_seconds",
                                   "A straggler's own time per step when judged.",
                                   ["rank", "node"], registry=r)
        self.stragglers = Counter("ftrun_stragglers", "Straggler verdicts.", registry=r)
        for state in ("starting", "ready", "finished", "failed"):
            self.members.labels(state).set(0)
        self._lock = threading.Lock()
        self._states: dict[int, str] = {}  # pid -> state
        self._member_pid: dict[str, int] = {}
        self._last: dict[str, tuple[float, int]] = {}  # rank -> (ts, steps)
        self._server: Any = None

    def watch_snapshots(self, directory: Path) -> None:
        """Show the age of the newest snapshot in the node's snapshot memory, read at each
        scrape (a directory listing: nothing is added to the agent's loop)."""
        gauge = Gauge("ftrun_snapshot_age_seconds",
                      "Seconds since this node's newest snapshot was written.",
                      registry=self.registry)

        def age() -> float:
            seconds = memory.newest_age_s(directory)
            return math.nan if seconds is None else seconds

        gauge.set_function(age)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint; returns the port it listens on. Raises MetricsError."""
        try:
            server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as error:
            raise MetricsError(f"--metrics-port {port}: cannot listen on {addr}:{port}: "
                               f"{error.strerror or error}") from None
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # --- events --------------------------------------------------------------------------

    def observe(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        with self._lock:
            if kind == Event.GENERATION.value:
                self._set(self.generation, ev.get("generation"))
                self._set(self.world, ev.get("world_size"))
            elif kind == Event.EPOCH.value:
                self._set(self.epoch, ev.get("epoch"))
                self._set(self.world, ev.get("world_size"))
                if ev.get("gone"):
                    self.regroups.inc()
            elif kind == Event.RESTART.value:
                self.restarts.inc()
            elif kind == Event.ESCALATE.value:
                self.escalations.inc()
            elif kind == Event.SPAWN.value:
                self._state(ev.get("pid"), "starting")
                if isinstance(ev.get("member"), str) and isinstance(ev.get("pid"), int):
                    self._member_pid[ev["member"]] = ev["pid"]
                elif isinstance(ev.get("pid"), int):  # no worker API: ready once started
                    self._state(ev.get("pid"), "ready")
            elif kind == Event.READY.value:
                self._state(ev.get("pid"), "ready")
            elif kind == Event.EXIT.value:
                code = ev.get("returncode")
                self._state(ev.get("pid"), "finished" if code == 0 else "failed")
            elif kind == Event.FAILURE.value:
                self._state(ev.get("pid"), "failed")
            elif kind == Event.FAULT.value:
                self._fault(ev)
            elif kind == Event.PROGRESS.value:
                self._progress(ev)
            elif kind == Event.STRAGGLER.value:
                self._straggler(ev)
            elif kind == Event.NODE_LOST.value:
                node = ev.get("lost_node", ev.get("node_rank"))
                silent = ev.get("silent_s")
                if node is not None and isinstance(silent, (int, float)):
                    self.heartbeat_age.labels(str(node)).set(silent)

    def _straggler(self, ev: dict[str, Any]) -> None:
        rank, node = ev.get("rank"), ev.get("straggler_node")
        if not isinstance(rank, int) or not isinstance(node, str):
            return
        flagged = ev.get("flagged") is True
        self.straggler.labels(str(rank), node).set(1 if flagged else 0)
        self._set(self.straggler_own.labels(str(rank), node), ev.get("own_s"))
        if flagged:
            self.stragglers.inc()

    def _set(self, gauge: Gauge, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            gauge.set(value)

    def _state(self, pid: Any, state: str) -> None:
        if not isinstance(pid, int):
            return
        self._states[pid] = state
        counts = dict.fromkeys(("starting", "ready", "finished", "failed"), 0)
        for value in self._states.values():
            counts[value] += 1
        for name, count in counts.items():
            self.members.labels(name).set(count)

    def _fault(self, ev: dict[str, Any]) -> None:
        self.faults.inc()
        recovery, detection, lost = ev.get("recovery_s"), ev.get("detection_s"), \
            ev.get("steps_lost")
        if isinstance(recovery, (int, float)):
            self.recovery_last.set(recovery)
            self.recovery_total.inc(max(0.0, recovery))
        if isinstance(detection, (int, float)):
            self.detection_last.set(detection)
        if isinstance(lost, int) and lost > 0:
            self.steps_lost.inc(lost)

    def _progress(self, ev: dict[str, Any]) -> None:
        ts, steps = ev.get("ts"), ev.get("steps")
        self._set(self.step, ev.get("step"))
        self._set(self.world, ev.get("world_size"))
        if not isinstance(ts, (int, float)) or not isinstance(steps, dict):
            return
        for rank, count in steps.items():
            if not isinstance(count, int):
                continue
            self.rank_steps.labels(str(rank)).set(count)
            before = self._last.get(str(rank))
            self._last[str(rank)] = (ts, count)
            if before is None or ts <= before[0] or count < before[1]:
                continue
            rate = (count - before[1]) / (ts - before[0])
            self.rank_rate.labels(str(rank)).set(rate)
            if rate > 0:
                self.rank_seconds.labels(str(rank)).set(1.0 / rate)
