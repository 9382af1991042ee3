"""Which member keeps the others waiting: the stuck and stalled verdicts.

The regroup leader reads every member's status once per tick (:class:`~ftrun.protocol.
Status`: the member epoch it is inside, its committed steps, the collectives it issued in
the current step) and hands them to :class:`ProgressWatch` with the member epochs that
ended; the watch returns the members to take out. Two rules:

* **stuck**: a member still inside a member epoch more than
  :meth:`ProgressWatch.stuck_limit_s` (max(:data:`STUCK_FLOOR_S`, 3 x the median step
  interval): the end reaches a member within a beat and its next collective fails at once,
  so the step it was computing is all it may still finish) after a later epoch was
  published never left it: a wait with no bound, a collective nothing released, a hang that
  began as its epoch ended. It is the culprit, whatever the others do: they wait for it in
  the next epoch. The clock runs from the next epoch's publication, not from the end: the
  leader publishes only once every node confirmed its NCCL abort (or that wait's bound
  passed), and a member blocked in NCCL cannot leave before its node's abort; counted from
  the end, a node whose agent was late to abort (held, loaded) lost healthy members.
* **stalled**: among the members inside one live member epoch, when none of them has moved
  for :meth:`ProgressWatch.limit_s` (max(``--stall-floor``, 20 x the median step
  interval)) and their progress differs, the ones furthest behind are the culprits: the
  others issued more collectives and wait for them. A hang every member shares (all at the
  same point) is nobody's: it is left to the collective timeout and the NCCL shim.

Members between member epochs (they left an ended one and wait for the next) are never
compared with anyone: they wait, they do not lag. Comparing them with a member stuck in the
ended epoch is what took healthy members for stalled and killed them, while the stuck one
stayed (the convergence issue's case, ``tests/unit/test_progress.py``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Step intervals kept for the median (a window: a job's step time may change).
INTERVALS_KEPT = 64
#: The stall limit in step intervals: a member this many median steps behind is not slow.
STALL_STEPS = 20
#: The stuck limit in step intervals: the step a member was computing when its epoch ended,
#: and margin.
STUCK_STEPS = 3
#: The least stuck limit: a member leaves an ended epoch within a beat (0.2 s) of its
#: collective failing, but on a loaded 2-core node the exception's way out of a released
#: collective took over 2 s (CI: healthy survivors taken out, a job below its minimum nodes
#: failed). 5 s, the default ``--stall-floor``: a false verdict costs a member, a late one
#: seconds.
STUCK_FLOOR_S = 5.0


@dataclass(frozen=True)
class Observation:
    """One member's status as the leader read it this tick."""

    member: str
    epoch: int  # the member epoch it is inside; -1 between epochs
    steps: int  # committed steps
    collectives: int  # collectives issued in the current step
    epoch_steps: int = 0  # steps committed inside ``epoch``


@dataclass(frozen=True)
class Verdict:
    """Take ``member`` out: ``cause`` says why, in a line for people."""

    member: str
    cause: str


@dataclass
class _Track:
    value: tuple[int, int, int]  # (epoch, steps, collectives) as last seen
    changed_at: float  # when ``value`` last changed
    step_at: float  # when ``steps`` last changed inside the same epoch


class ProgressWatch:
    """The leader's view of every member's progress; :meth:`observe` once per tick."""

    def __init__(self, stall_floor_s: float) -> None:
        self.stall_floor_s = stall_floor_s
        self.intervals: deque[float] = deque(maxlen=INTERVALS_KEPT)
        self._tracks: dict[str, _Track] = {}

    @property
    def median_step_s(self) -> float | None:
        """The median interval between two committed steps of one member (None before one
        is known)."""
        return statistics.median(self.intervals) if self.intervals else None

    def limit_s(self) -> float:
        """How long the members inside one epoch may all stand still while one is behind
        before it counts as stalled: max(``--stall-floor``, 20 x the median step)."""
        return self._limit(STALL_STEPS)

    def stuck_limit_s(self) -> float:
        """How long a member may stay inside an epoch after it ended."""
        return self._limit(STUCK_STEPS, STUCK_FLOOR_S)

    def _limit(self, steps: int, floor: float | None = None) -> float:
        floor = self.stall_floor_s if floor is None else floor
        step = self.median_step_s
        return floor if step is None else max(floor, steps * step)

    def restart_clocks(self, now: float) -> None:
        """A member epoch was published: nobody has been waiting since before it (a
        regroup is not a stall)."""
        for track in self._tracks.values():
            track.changed_at = now

    def forget(self, members: Iterable[str]) -> None:
        for member in members:
            self._tracks.pop(member, None)

    def observe(self, now: float, seen: Iterable[Observation],
                ended: Mapping[int, float], *, judge_stalls: bool = True,
                superseded: Mapping[int, float] | None = None) -> list[Verdict]:
        """Take this tick's observations (members of the latest member epoch that hold the
        job's state and have not finished), ``ended`` (member epoch -> when the leader saw
        it end) and ``superseded`` (ended member epoch -> when a later one was published;
        None: the ends stand for it); return the members to take out, each once."""
        seen = list(seen)
        for item in seen:
            self._track(now, item)
        stuck_limit = self.stuck_limit_s()
        since_of = ended if superseded is None else superseded
        verdicts = []
        for item in seen:
            since = since_of.get(item.epoch)
            if item.epoch >= 0 and since is not None and now - since > stuck_limit:
                verdicts.append(Verdict(item.member, (
                    f"stuck in member epoch {item.epoch}, which ended and was followed "
                    f"{now - since:.1f}s ago (limit {stuck_limit:.1f}s): the others wait for "
                    "it in the next one")))
        if judge_stalls and self.intervals:
            stuck = {v.member for v in verdicts}
            by_epoch: dict[int, list[Observation]] = {}
            for item in seen:
                if item.epoch >= 0 and item.epoch not in ended and item.member not in stuck:
                    by_epoch.setdefault(item.epoch, []).append(item)
            for group in by_epoch.values():
                verdicts += self._stalled(now, group, self.limit_s())
        return verdicts

    def _track(self, now: float, item: Observation) -> None:
        value = (item.epoch, item.steps, item.collectives)
        track = self._tracks.get(item.member)
        if track is None:
            self._tracks[item.member] = _Track(value, now, now)
            return
        if value == track.value:
            return
        same_epoch = value[0] == track.value[0]
        if same_epoch and track.value[1] >= 0 and value[1] != track.value[1]:
            self.intervals.append(now - track.step_at)
        if not same_epoch or value[1] != track.value[1]:
            track.step_at = now
        track.value, track.changed_at = value, now

    def _stalled(self, now: float, group: list[Observation], limit: float) -> list[Verdict]:
        if len(group) < 2:
            return []
        tracks = {item.member: self._tracks[item.member] for item in group}
        if now - max(t.changed_at for t in tracks.values()) < limit:
            return []
        progress = {m: t.value[1:] for m, t in tracks.items()}
        lowest = min(progress.values())
        if lowest == max(progress.values()):
            return []  # everyone waits at the same point: not attributable to one member
        return [Verdict(member, f"stalled: no progress for {now - tracks[member].changed_at:.1f}s "
                                f"(limit {limit:.1f}s) while the others issued more "
                                "collectives")
                for member, value in progress.items() if value == lowest]
