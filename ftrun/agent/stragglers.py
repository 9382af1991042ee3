"""Straggler detection: a rank that keeps every other rank waiting, named with its node.

In synchronous data-parallel training every rank commits the same steps at the same rate: a
slow rank slows the whole job, and the committed step counts cannot say which rank it is.
What differs is where each rank spends a step. A rank does its own work (data, forward,
the start of backward) until it issues the step's first collective, then waits in that
collective for the slowest peer. The worker API's status beat (every 0.2 s, read by the
regroup leader for every member of every node in one ``multi_get`` per tick, so no record
of its own is needed across nodes) carries the collectives issued in the current step; a
beat with none issued yet is a sample of the rank's own work.

So, per rank over the last ``window`` seconds: ``share`` = its beats with no collective
issued / its beats, and its *own time per step* = ``share`` x the job's median step time.
A rank is a straggler when its own time stays above ``factor`` x the median own time of
the other ranks for a whole window (and by at least :data:`MIN_EXCESS_S`, so that
milliseconds of noise never count): it is reported once (a ``straggler`` event, the
``ftrun_straggler{rank,node}`` metric, one console line naming the rank, its member and
its node), and cleared the same way when it recovers. With ``--straggler-policy fault``
the leader then takes it out like any failed member (its record's cause says
``straggler: ...``, the path is the regroup's or replacement's).

Needs the worker API (``--recovery regroup``): a script without it reports no status.
Cost: arithmetic on statuses the leader reads anyway; no store request.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ftrun.observe.events import Event, EventLog

POLICIES = ("off", "warn", "fault")
DEFAULT_FACTOR = 2.0
DEFAULT_WINDOW_S = 30.0
#: The least own time per step above the others' median that counts (seconds).
MIN_EXCESS_S = 0.02
#: The least beats of a rank in a window before it is judged.
MIN_BEATS = 8


@dataclass
class _Rank:
    samples: deque[tuple[float, bool]] = field(default_factory=deque)  # (time, own work)
    beats: int = -1  # the last beat counter seen
    above_since: float | None = None  # when its own time first stood above the limit
    flagged: bool = False


@dataclass(frozen=True)
class Verdict:
    """A straggler found: who, and the figures that made it one."""

    member: str
    rank: int
    node: str
    own_s: float | None  # own time per step (None: no step time known yet)
    others_s: float | None
    share: float
    others_share: float
    window_s: float

    @property
    def ratio(self) -> float:
        return self.share / self.others_share if self.others_share > 0 else float("inf")

    def figures(self) -> str:
        """'0.377 s of own work per step vs 0.012 s (the others' median), 31.4x over 3 s'"""
        if self.own_s is not None and self.others_s is not None:
            figures = (f"{self.own_s:.3f} s of own work per step vs {self.others_s:.3f} s "
                       "(the others' median)")
        else:
            figures = (f"own work in {self.share:.0%} of its beats vs "
                       f"{self.others_share:.0%} (the others' median)")
        ratio = "" if self.ratio == float("inf") else f", {self.ratio:.1f}x"
        return f"{figures}{ratio} over {self.window_s:g} s"

    def describe(self) -> str:
        return (f"rank {self.rank} (member {self.member}) on node {self.node} is a straggler: "
                f"{self.figures()}")


class StragglerWatch:
    """See the module docstring. The regroup leader calls :meth:`observe` once per tick
    with each member's latest status beat and :meth:`reset` when a member epoch changes
    (ranks move). ``node_name(node_rank)`` says a node as people know it."""

    def __init__(self, *, policy: str, factor: float, window_s: float, events: EventLog,
                 say: Callable[..., None], node_name: Callable[[int], str]) -> None:
        if policy not in POLICIES:
            raise ValueError(f"straggler policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy, self.factor, self.window_s = policy, factor, window_s
        self.events, self.say, self.node_name = events, say, node_name
        self.ranks: dict[str, _Rank] = {}

    def reset(self) -> None:
        """A new member epoch: ranks may move; judge afresh (flags are cleared quietly:
        the regroup said what changed)."""
        self.ranks.clear()

    def observe(self, now: float, beats: dict[str, tuple[int, int, int]],
                step_s: float | None) -> list[Verdict]:
        """``beats``: member -> (rank, beat counter, collectives issued in its step), the
        members that train now; ``step_s``: the job's median seconds per committed step.
        Returns the stragglers to take out (policy ``fault``), each once."""
        if self.policy == "off":
            return []
        for member, (_rank, beat, collectives) in beats.items():
            state = self.ranks.setdefault(member, _Rank())
            if beat != state.beats:
                if state.beats >= 0:  # the first beat seen may be an old one
                    state.samples.append((now, collectives == 0))
                state.beats = beat
            while state.samples and state.samples[0][0] < now - self.window_s:
                state.samples.popleft()
        for member in set(self.ranks) - set(beats):
            del self.ranks[member]
        shares = {m: sum(own for _, own in s.samples) / len(s.samples)
                  for m, s in self.ranks.items() if len(s.samples) >= MIN_BEATS}
        if len(shares) < 2:
            return []
        faults = []
        for member, share in shares.items():
            others = statistics.median(v for m, v in shares.items() if m != member)
            verdict = Verdict(member, beats[member][0], self._node(member),
                              None if step_s is None else share * step_s,
                              None if step_s is None else others * step_s,
                              share, others, self.window_s)
            above = share > self.factor * others and (
                step_s is None or (share - others) * step_s >= MIN_EXCESS_S)
            state = self.ranks[member]
            if not above:
                state.above_since = None
                if state.flagged:
                    state.flagged = False
                    self._said(verdict, flagged=False)
                continue
            if state.above_since is None:
                state.above_since = now
            if state.flagged or now - state.above_since < self.window_s:
                continue
            state.flagged = True
            self._said(verdict, flagged=True)
            if self.policy == "fault":
                faults.append(verdict)
        return faults

    def _node(self, member: str) -> str:
        node_rank = int(member.partition(".")[0]) if member.partition(".")[0].isdigit() else -1
        name = self.node_name(node_rank)
        return f"{node_rank} ({name})" if name else str(node_rank)

    def _said(self, verdict: Verdict, *, flagged: bool) -> None:
        self.events.emit(Event.STRAGGLER, flagged=flagged, rank=verdict.rank,
                         member=verdict.member, straggler_node=verdict.node,
                         own_s=_round(verdict.own_s), others_s=_round(verdict.others_s),
                         share=round(verdict.share, 3),
                         others_share=round(verdict.others_share, 3),
                         factor=self.factor, window_s=self.window_s, policy=self.policy)
        if flagged:
            then = "; taken out (--straggler-policy fault)" if self.policy == "fault" else ""
            self.say(verdict.describe() + then, style="yellow")
        else:
            self.say(f"rank {verdict.rank} (member {verdict.member}) on node {verdict.node} "
                     "keeps up again", style="green")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
