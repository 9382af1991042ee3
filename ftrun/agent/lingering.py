"""A member that stays inside a member epoch that ended, idle in its own code: hung.

Two rules already look for a member that keeps the others waiting, and neither is quick for
this one. The hang rule (:mod:`ftrun.agent.hangs`) compares the members of the latest
member epoch, and this member never entered it. The stuck rule
(:mod:`ftrun.decide.progress`) takes out a member still inside an ended epoch after
max(5 s, 3 steps), a bound set for a member that *is* leaving: on a loaded node the
exception out of a released collective took over 2 s to unwind. A member asleep in its own
code is unwinding nothing, and the whole bound is the others' wait (the soak: a hang that
began just before another rank's kill held that recovery 5.8 s).

So each agent watches its own lingering members with the hang rule's means and timeout: the
process tree's CPU (a member that works, or waits for a CPU, is leaving) and its Python
stack, read once the member has been idle for the timeout. Only a stack in the job's own
code is named: one inside torch's communication, the network, group formation or ftrun's
own code is left to the stuck rule, which knows what releases those.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import ftrun
from ftrun.agent.hangs import IDLE_CPU_FRACTION, SAMPLE_S, tree_cpu
from ftrun.agent.processes import WorkerProcess
from ftrun.agent.stacks import Stack, read_stack, stack_source
from ftrun.shim import ShimError

#: Frames under this directory are ftrun's own machinery: a member idle there is the stuck
#: rule's.
_FTRUN_DIR = os.path.dirname(ftrun.__file__) + os.sep


@dataclass
class _Linger:
    epoch: int  # the ended member epoch it is inside
    cpu_s: float  # its tree's CPU seconds at the last sample
    busy_at: float  # when it last used CPU (or was first seen lingering)


@dataclass(frozen=True)
class Lingering:
    """The verdict: ``member`` has been idle in its own code for ``idle_s`` inside ended
    member epoch ``epoch``; ``stack`` says where."""

    member: str
    epoch: int
    idle_s: float
    stack: Stack

    def describe(self) -> str:
        return (f"hung {self.stack.where} for {self.idle_s:.1f}s inside member epoch "
                f"{self.epoch}, which ended: the others wait for it in the next one")


class LingerWatch:
    """This node's members inside ended member epochs; :meth:`observe` once per tick."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 stack_of: Callable[[int], Stack | None] | None = None,
                 cpu_of: Callable[[int], tuple[float, bool, bool]] = tree_cpu,
                 in_nccl: Callable[[WorkerProcess], bool] | None = None) -> None:
        self.clock = clock
        self.in_nccl = in_nccl or inside_nccl
        if stack_of is None:  # where py-spy cannot attach, the stuck rule decides
            stack_of = read_stack if stack_source() == "py-spy" else (lambda pid: None)
        self.stack_of = stack_of
        self.cpu_of = cpu_of
        self._lingering: dict[str, _Linger] = {}
        self._next_sample = 0.0
        self._looked: set[tuple[str, int]] = set()  # (member, epoch) whose stack said no

    def observe(self, lingering: Mapping[str, tuple[WorkerProcess, int]],
                timeout_s: float) -> Lingering | None:
        """``lingering``: member -> (its process, the ended member epoch it is inside),
        every member of this node that a later epoch left behind. Returns one that has used
        no CPU for ``timeout_s`` and whose stack is in its own code, else None. Never
        raises for a process that is gone (it counts as idle; its exit is another rule's)."""
        now = self.clock()
        for gone in self._lingering.keys() - lingering.keys():
            del self._lingering[gone]
        if now < self._next_sample:
            return None
        self._next_sample = now + SAMPLE_S
        for member, (process, epoch) in lingering.items():
            cpu, in_io, running = self.cpu_of(process.pid)
            seen = self._lingering.get(member)
            if seen is None or seen.epoch != epoch:
                self._lingering[member] = _Linger(epoch, cpu, now)
                continue
            if in_io or running or cpu - seen.cpu_s > IDLE_CPU_FRACTION * SAMPLE_S:
                seen.busy_at = now
            seen.cpu_s = cpu
        for member, seen in self._lingering.items():
            process = lingering[member][0]
            idle_s = now - seen.busy_at
            if idle_s < timeout_s or (member, seen.epoch) in self._looked \
                    or process.is_frozen() or process.poll() is not None:
                continue
            if self.in_nccl(process):
                # blocked in an NCCL call (its Python stack shows the script's line that
                # made it): the agent's abort releases it, and a late one is the stuck
                # rule's; named here, it took a survivor out while its node was still
                # waiting for another node's abort (test_regroup_nccl, under load)
                continue
            stack = self.stack_of(process.pid)
            if stack is None or not _in_own_code(stack):
                self._looked.add((member, seen.epoch))  # the stuck rule's: not read again
                continue
            return Lingering(member, seen.epoch, idle_s, stack)
        return None


def _in_own_code(stack: Stack) -> bool:
    """Idle in the job's code: not in torch's communication, a network read, a group's
    formation, or ftrun's machinery (its innermost Python frame)."""
    if not stack.frames or stack.waiting or stack.awaits_network or stack.forming_group:
        return False
    return not stack.frames[0].filename.startswith(_FTRUN_DIR)


def inside_nccl(process: WorkerProcess) -> bool:
    """Whether a thread of ``process`` is inside an NCCL call, by its shim page (any
    communicator, aborted ones too: a call can still be unwinding); False without a shim."""
    shim = process.shim
    if shim is None:
        return False
    try:
        return any(c.inflight > 0 for c in shim.communicators())
    except (ShimError, OSError, ValueError):
        return False
