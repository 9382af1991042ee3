"""The leader's one-look view of a running job, for ``ftrun status``.

A :class:`StatusBoard` listens to the agent's events (like the fault records and the
metrics: no store request of its own) and keeps what a person asks first: the job
generation and member epoch, the world, each member's rank, process and state, the
committed step and each rank's step rate, the last faults with their recovery times, and
the ranks now judged stragglers (ftrun.agent.stragglers).
The leader's injector thread publishes :meth:`StatusBoard.snapshot` once a second in the
job's ``ftrun/job`` record (signed), where ``ftrun status`` reads it from any host that
reaches the store. On several nodes the members of other nodes show as ``in epoch``: only
their own agents see their processes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ftrun.observe.events import Event

#: Faults kept in the snapshot (the newest).
LAST_FAULTS = 5


class StatusBoard:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.generation = 0
        self.epoch: int | None = None
        self.world = 0
        self.nnodes = 1
        self.restarts = 0
        self.members: dict[str, dict[str, Any]] = {}  # member (or rank) -> facts
        self.order: list[str] = []  # the latest member epoch, in rank order
        self.step: int | None = None
        self.rates: dict[str, float] = {}
        self._last: dict[str, tuple[float, int]] = {}
        self.faults: list[dict[str, Any]] = []
        self.stragglers: dict[str, dict[str, Any]] = {}  # member -> its verdict's figures

    def observe(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        with self._lock:
            if kind == Event.GENERATION.value:
                self.generation = _int(ev.get("generation"), self.generation)
                self.world = _int(ev.get("world_size"), self.world)
                self.nnodes = _int(ev.get("nnodes"), self.nnodes)
                self.restarts = _int(ev.get("restart_count"), self.restarts)
            elif kind == Event.EPOCH.value:
                self.stragglers.clear()  # ranks move; the leader judges afresh
                self.epoch = _int(ev.get("epoch"), 0)
                self.world = _int(ev.get("world_size"), self.world)
                members = ev.get("members")
                if isinstance(members, list):
                    self.order = [m for m in members if isinstance(m, str)]
            elif kind == Event.SPAWN.value:
                name = ev.get("member") if isinstance(ev.get("member"), str) else \
                    f"rank{ev.get('rank')}"
                self.members[name] = {"pid": ev.get("pid"), "state": "starting",
                                      "rank": ev.get("rank"), "node": ev.get("node")}
            elif kind in (Event.READY.value, Event.EXIT.value, Event.FAILURE.value):
                pid = ev.get("pid")
                state = {"ready": "ready", "failure": "failed"}.get(
                    kind, "finished" if ev.get("returncode") == 0 else "failed")
                for facts in self.members.values():
                    if facts["pid"] == pid and facts["state"] != "failed":
                        facts["state"] = state
            elif kind == Event.PROGRESS.value:
                self._progress(ev)
            elif kind == Event.STRAGGLER.value and isinstance(ev.get("member"), str):
                if ev.get("flagged") is True:
                    self.stragglers[ev["member"]] = {k: ev.get(k) for k in (
                        "rank", "member", "straggler_node", "own_s", "others_s", "policy")}
                else:
                    self.stragglers.pop(ev["member"], None)
            elif kind == Event.FAULT.value:
                self.faults = [*self.faults, {k: ev.get(k) for k in (
                    "index", "rank", "cause", "path", "happened", "detection_s",
                    "recovery_s", "steps_lost", "world", "step", "injected")}][-LAST_FAULTS:]

    def _progress(self, ev: dict[str, Any]) -> None:
        ts, steps = ev.get("ts"), ev.get("steps")
        if isinstance(ev.get("step"), int):
            self.step = ev["step"]
        if not isinstance(ts, (int, float)) or not isinstance(steps, dict):
            return
        for rank, count in steps.items():
            if not isinstance(count, int):
                continue
            before = self._last.get(str(rank))
            self._last[str(rank)] = (ts, count)
            if before is not None and ts > before[0] and count >= before[1]:
                self.rates[str(rank)] = round((count - before[1]) / (ts - before[0]), 3)

    def snapshot(self) -> dict[str, Any]:
        """The view as one JSON-able dict."""
        with self._lock:
            members = []
            listed = set()
            for rank, member in enumerate(self.order):
                facts = self.members.get(member, {"pid": None, "state": "in epoch"})
                members.append({"member": member, "rank": rank, "pid": facts["pid"],
                                "state": facts["state"],
                                "step_rate": self.rates.get(str(rank))})
                listed.add(member)
            for member, facts in self.members.items():
                if member in listed or facts["state"] in ("failed", "finished"):
                    continue
                rank = facts["rank"] if not self.order else None  # spares wait for a rank
                members.append({"member": member, "rank": rank, "pid": facts["pid"],
                                "state": facts["state"] if self.order is None or
                                not self.order else f"{facts['state']} (not in the epoch)",
                                "step_rate": self.rates.get(str(rank)) if rank is not None
                                else None})
            return {"generation": self.generation, "epoch": self.epoch, "world_size": self.world,
                    "nnodes": self.nnodes, "restarts": self.restarts, "step": self.step,
                    "members": members, "faults": list(self.faults),
                    "stragglers": list(self.stragglers.values()), "updated": time.time()}


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
