"""Which member of this node hangs: the worker API's two hang rules, as one watch.

A member of the worker API (``ftrun.init()``, ``ftrun.restartable``) that hangs in its own
code is taken out and replaced in process. Two rules name it, each for where it hangs:

* **inside the latest member epoch** (:class:`~ftrun.agent.hangs.HangWatch`): every member
  idle for the hang timeout, the stacks show it in its own code while the others wait for
  it in a collective. The stall rule needs collective counts, which a sharded job's process
  groups (torch's own) do not report; this rule needs none. Only members inside the latest
  epoch (it formed: they built its group) are watched, each epoch afresh: the waits of a
  recovery are not spells that make the hang timeout grow (carried over, it doubled at
  every recovery of a soak). ftrun's own waits count as waiting (agent/stacks.py), so a
  member waiting for its peers is never named, and every member idle in its own code is,
  at once (two ranks that hang together cost one verdict, not one after the other). A
  member whose status moved (a step, a collective) within the timeout is slow, not hung:
  the verdict is set aside and looked at again when that lapses;
* **inside a member epoch that ended** (:class:`~ftrun.agent.lingering.LingerWatch`): a
  member a later epoch left behind, using no CPU, its stack in its own code.

A hang nobody on this node can be named for is left to the leader's stuck and stall rules,
the recovery deadline and the collective timeout. The watch decides; the caller (the
regroup run) takes the member out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from ftrun import protocol as P
from ftrun.agent.hangs import HANG_FLOOR_S, HangWatch
from ftrun.agent.lingering import LingerWatch
from ftrun.agent.processes import WorkerProcess


@dataclass(frozen=True)
class Seen:
    """One live member of this node with a status, as the regroup run sees it this tick."""

    process: WorkerProcess
    status: P.Status
    active: bool  # a member of the latest member epoch that holds the job's state


@dataclass(frozen=True)
class HungMember:
    """The verdict: take ``member`` out for ``cause``; it has been idle ``idle_s``."""

    member: str
    cause: str
    idle_s: float


class MemberHangs:
    """This node's hang rules for the worker API's members; :meth:`look` once per tick."""

    def __init__(self, *, hang_timeout_s: float | None, multi_node: bool) -> None:
        self.hang_timeout_s = hang_timeout_s  # None: auto; 0: off
        self.multi_node = multi_node
        self.watch: HangWatch | None = None  # the latest member epoch's
        self.watch_epoch = -1
        self.lingering = LingerWatch()
        # member -> ((steps, collectives), when they last changed): a member whose counts
        # moved within the hang timeout is slow, not hung, however little CPU it uses
        self.moved: dict[str, tuple[tuple[int, int], float]] = {}

    def look(self, latest: P.MemberEpoch | None,
             members: Mapping[str, Seen]) -> list[HungMember]:
        """``members``: every live member of this node with a status. The members that
        hang (most often none); never raises for a process that is gone."""
        if latest is None or self.hang_timeout_s == 0:
            return []
        if self.watch_epoch != latest.number:
            self.watch_epoch = latest.number
            self.watch = HangWatch(timeout_s=self.hang_timeout_s, multi_node=self.multi_node)
        lingering = self._lingering(latest, members)
        return [lingering] if lingering is not None else self._in_latest(latest, members)

    def _lingering(self, latest: P.MemberEpoch,
                   members: Mapping[str, Seen]) -> HungMember | None:
        # an epoch followed by one that only admits a joiner goes on until its members'
        # next step boundary (the latest epoch's watch); any older one, or one followed by
        # an epoch that a fault made, ended
        ended_below = latest.number - 1 if latest.has_joiners else latest.number
        left_behind = {member: (seen.process, seen.status.epoch)
                       for member, seen in members.items()
                       if not seen.status.finished and 0 <= seen.status.epoch < ended_below}
        timeout_s = self.watch.timeout_s if self.watch is not None \
            else self.hang_timeout_s or HANG_FLOOR_S
        found = self.lingering.observe(left_behind, timeout_s)
        return None if found is None else HungMember(found.member, found.describe(),
                                                     found.idle_s)

    def _in_latest(self, latest: P.MemberEpoch,
                   members: Mapping[str, Seen]) -> list[HungMember]:
        # inside the latest epoch, or inside the one before while the latest only admits a
        # joiner (the members enter it at their next step boundary: one hung before it never
        # does, and was watched by nobody)
        current = {latest.number, latest.number - 1} if latest.has_joiners \
            else {latest.number}
        watched = {seen.process.pid: member for member, seen in members.items()
                   if seen.active and seen.status.epoch in current
                   and not seen.status.finished}
        for gone in self.moved.keys() - members.keys():
            del self.moved[gone]  # a failed member's clock: never read again
        if not watched or self.watch is None:
            return []
        now = time.monotonic()
        for member in watched.values():
            status = members[member].status
            counts = (status.steps, status.collectives)
            if self.moved.get(member, ((-1, -1), 0.0))[0] != counts:
                self.moved[member] = (counts, now)
        hang = self.watch.sample([members[m].process for m in watched.values()])
        if hang is None or hang.kind != "hung" or not hang.culprits:
            return []
        waiting = [str(latest.rank_of(watched[w.pid])) for w in hang.waiting
                   if w.pid in watched]
        ranks = f"rank{'s' if len(waiting) > 1 else ''} {','.join(waiting) or '?'}"
        hung, recheck_at = [], None
        for process in hang.culprits:  # two ranks hung at once are both named at once
            culprit = watched.get(process.pid)
            if culprit is None:
                continue
            moved_for = now - self.moved[culprit][1]
            if moved_for < self.watch.timeout_s:  # slow, not hung, unless it stays put
                at = now + self.watch.timeout_s - moved_for
                recheck_at = at if recheck_at is None else min(recheck_at, at)
                continue
            stack = hang.stacks.get(process.pid)
            where = stack.where if stack is not None else "in its own code"
            hung.append(HungMember(culprit, f"hung {where} for {hang.idle_s:.1f}s while "
                                            f"{ranks} waited for it in a collective",
                                   hang.idle_s))
        if not hung and recheck_at is not None:
            self.watch.look_again_at(recheck_at)
        return hung
