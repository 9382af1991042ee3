"""Every in-process recovery ends: its deadline, and the escalation when it passes.

A fault ends a member epoch; the recovery is over when training commits a step again,
inside a member epoch newer than the one that ended. :class:`RecoveryDeadline` starts at
the first fault of a recovery (a fault during a recovery joins it: the clock keeps its
start), and is over when any member reports a committed step inside a newer epoch
(:class:`~ftrun.protocol.Status` ``epoch``/``epoch_steps``). Past the deadline without
one, the regroup leader escalates instead of waiting (the ladder, README "When a recovery
does not end"):

    regroup in process -> restart of the job generation (every worker; a sharded job
    restores its newest complete in-memory snapshot) -> after --max-restarts: exit 1

The deadline is ``--recovery-deadline`` seconds, or by default (auto) derived from what is
in play when the recovery starts (:func:`auto_deadline_s`): the wait for every node's
abort, the stuck/stall limit in which a member that never leaves is taken out, a worker's
observed start (a replacement may be needed), a few steps, and a floor. Auto is generous on
purpose: it is the bound that makes a recovery never worse than torchrun's restart, not the
expected figure (about 0.1-0.5 s in process here).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ftrun.decide.progress import Observation

#: The least auto deadline: under it, a loaded 2-core node's healthy recoveries (a cold
#: replacement importing torch: 5.4 s measured) would escalate.
FLOOR_S = 30.0


def auto_deadline_s(*, peer_write_s: float, limit_s: float, start_s: float | None,
                    step_s: float | None) -> float:
    """The auto deadline: the abort confirmations' wait (``peer_write_s``, twice: a fault
    during the recovery waits again), the stuck/stall ``limit_s`` (in which a member that
    never leaves is taken out) and once more for the epoch after it, two worker starts
    (``start_s``, as observed at the job's start: a replacement, and one for a replacement
    that failed), ten steps, and :data:`FLOOR_S` at least."""
    need = 2 * peer_write_s + 2 * limit_s + 2 * (start_s or 0.0) + 10 * (step_s or 0.0)
    return max(FLOOR_S, need)


def describe_setting(setting_s: float | None, max_restarts: int) -> str:
    """The line said once a job's workers use the worker API: the deadline and what
    passing it does."""
    value = f"auto (>= {FLOOR_S:.0f} s)" if setting_s is None else f"{setting_s:g} s"
    then = "restarts every worker" if max_restarts > 0 else \
        "stops the job (--max-restarts 0)"
    return f"recovery deadline {value}: a recovery that commits no step by then {then}"


@dataclass(frozen=True)
class Overdue:
    """The recovery passed its deadline: escalate."""

    since: float  # when the recovery started (the first fault's end of a member epoch)
    ended_epoch: int  # the newest member epoch it ended
    deadline_s: float
    waited_s: float

    def describe(self) -> str:
        return (f"no step committed {self.waited_s:.1f}s after member epoch "
                f"{self.ended_epoch} ended (recovery deadline {self.deadline_s:.0f}s)")


class RecoveryDeadline:
    """The recovery in progress, if any; see the module. ``setting_s``: the
    ``--recovery-deadline`` value, None for auto."""

    def __init__(self, setting_s: float | None) -> None:
        self.setting_s = setting_s
        self.since: float | None = None
        self.ended_epoch = -1
        self.deadline_s = 0.0

    @property
    def running(self) -> bool:
        return self.since is not None

    def fault(self, now: float, ended_epoch: int, auto_s: float) -> None:
        """Member epoch ``ended_epoch`` ended: start the recovery, or (one is running) fold
        the fault into it (its start stays; the deadline may only grow)."""
        deadline = self.setting_s if self.setting_s is not None else auto_s
        if self.since is None:
            self.since, self.deadline_s = now, deadline
        else:
            self.deadline_s = max(self.deadline_s, deadline)
        self.ended_epoch = max(self.ended_epoch, ended_epoch)

    def observe(self, seen: Iterable[Observation]) -> bool:
        """Whether a member committed a step inside an epoch newer than the ended one (the
        recovery is then over, and forgotten)."""
        if self.since is None:
            return False
        if any(item.epoch > self.ended_epoch and item.epoch_steps >= 1 for item in seen):
            self.since = None
            return True
        return False

    def overdue(self, now: float) -> Overdue | None:
        if self.since is None or now - self.since <= self.deadline_s:
            return None
        return Overdue(self.since, self.ended_epoch, self.deadline_s, now - self.since)
