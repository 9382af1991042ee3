"""The lingering rule at its edges (ftrun.agent.lingering): a fake clock, CPU readings and
stacks made by hand, so a wrong bound or a wrong reading of the stack fails here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ftrun
from ftrun.agent.hangs import IDLE_CPU_FRACTION, SAMPLE_S
from ftrun.agent.lingering import LingerWatch
from ftrun.agent.stacks import Frame, Stack

TORCH = "/venv/lib/python3.11/site-packages/torch"
FTRUN = ftrun.__file__.rsplit("/", 1)[0]


@dataclass
class FakeProcess:
    pid: int
    frozen: bool = False
    exited: int | None = None
    shim: None = None  # no NCCL shim: never inside an NCCL call

    def poll(self) -> int | None:
        return self.exited

    def is_frozen(self) -> bool:
        return self.frozen


def own(pid: int) -> Stack:
    return Stack(pid, (Frame("injected_fault", "/job/train.py", "train.py", 282),
                       Frame("_enter", f"{FTRUN}/worker/restartable.py",
                             "ftrun/worker/restartable.py", 458)))


def in_collective(pid: int) -> Stack:
    return Stack(pid, (Frame("all_reduce", f"{TORCH}/distributed/distributed_c10d.py",
                             "torch/distributed/distributed_c10d.py", 3252),
                       Frame("main", "/job/train.py", "train.py", 88)))


def in_ftrun(pid: int) -> Stack:
    return Stack(pid, (Frame("wait", "/usr/lib/python3.11/threading.py", "threading.py", 1),
                       Frame("_leave", f"{FTRUN}/worker/restartable.py",
                             "ftrun/worker/restartable.py", 400))[1:])


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Cpu:
    seconds: dict[int, float] = field(default_factory=dict)
    running: set[int] = field(default_factory=set)

    def __call__(self, pid: int) -> tuple[float, bool, bool]:
        return self.seconds.get(pid, 0.0), False, pid in self.running


def watch_for(stack_of: Callable[[int], Stack] = own
              ) -> tuple[LingerWatch, Clock, Cpu, list[int]]:
    clock, cpu, reads = Clock(), Cpu(), []

    def read(pid: int) -> Stack:
        reads.append(pid)
        return stack_of(pid)

    return LingerWatch(clock=clock, stack_of=read, cpu_of=cpu), clock, cpu, reads


def run(watch: LingerWatch, clock: Clock, lingering: dict[str, Any], until: float,
        timeout_s: float = 2.0, each: Callable[[float], None] | None = None
        ) -> tuple[Any, float | None]:
    """Observe every SAMPLE_S until ``until`` seconds passed; the first verdict and when."""
    start = clock.now
    while clock.now - start <= until + 1e-9:
        if each is not None:
            each(clock.now - start)
        found = watch.observe(lingering, timeout_s)
        if found is not None:
            return found, clock.now - start
        clock.now += SAMPLE_S
    return None, None


def test_a_member_asleep_in_its_code_is_named_once_idle_for_the_timeout() -> None:
    watch, clock, _, reads = watch_for()
    member = FakeProcess(11)
    found, at = run(watch, clock, {"0.1": (member, 3)}, until=10)
    assert found is not None and found.member == "0.1" and found.epoch == 3
    assert 2.0 <= at <= 2.0 + SAMPLE_S  # the timeout, counted from when it was first seen
    assert 2.0 <= found.idle_s <= 2.0 + SAMPLE_S
    assert reads == [11]  # the stack is read once, at the verdict
    assert "hung in train.py:282 injected_fault" in found.describe()
    assert "inside member epoch 3, which ended" in found.describe()


def test_cpu_used_or_waited_for_restarts_the_idle_clock() -> None:
    watch, clock, cpu, _ = watch_for()
    member = FakeProcess(11)

    def work_until_3s(elapsed: float) -> None:
        if elapsed <= 3.0:  # unwinding: a little more than the idle share each sample
            cpu.seconds[11] = cpu.seconds.get(11, 0.0) + 2 * IDLE_CPU_FRACTION * SAMPLE_S

    found, at = run(watch, clock, {"0.1": (member, 3)}, until=10, each=work_until_3s)
    assert found is not None and 5.0 <= at <= 5.0 + SAMPLE_S
    watch, clock, cpu, _ = watch_for()
    cpu.running.add(11)  # on the run queue of a loaded node: leaving, not hung
    assert run(watch, clock, {"0.1": (member, 3)}, until=10)[0] is None


def test_cpu_below_the_idle_share_is_idle() -> None:
    watch, clock, cpu, _ = watch_for()

    def trickle(elapsed: float) -> None:
        cpu.seconds[11] = cpu.seconds.get(11, 0.0) + 0.5 * IDLE_CPU_FRACTION * SAMPLE_S

    found, at = run(watch, clock, {"0.1": (FakeProcess(11), 3)}, until=10, each=trickle)
    assert found is not None and at <= 2.0 + SAMPLE_S


def test_only_the_jobs_own_code_is_named_and_a_stack_said_no_is_not_read_again() -> None:
    for stack_of in (in_collective, in_ftrun):
        watch, clock, _, reads = watch_for(stack_of)
        assert run(watch, clock, {"0.1": (FakeProcess(11), 3)}, until=10)[0] is None
        assert reads == [11]


def test_a_new_ended_epoch_or_leaving_starts_afresh() -> None:
    watch, clock, _, _ = watch_for()
    member = FakeProcess(11)
    assert run(watch, clock, {"0.1": (member, 3)}, until=1.5)[0] is None
    assert watch.observe({}, 2.0) is None  # it left: forgotten
    clock.now += SAMPLE_S
    found, at = run(watch, clock, {"0.1": (member, 5)}, until=10)
    assert found is not None and found.epoch == 5 and at >= 2.0


def test_frozen_or_exited_members_are_other_rules() -> None:
    for member in (FakeProcess(11, frozen=True), FakeProcess(11, exited=-9)):
        watch, clock, _, reads = watch_for()
        assert run(watch, clock, {"0.1": (member, 3)}, until=10)[0] is None
        assert reads == []


def test_the_timeout_is_the_callers() -> None:
    watch, clock, _, _ = watch_for()
    found, at = run(watch, clock, {"0.1": (FakeProcess(11), 3)}, until=20, timeout_s=6.0)
    assert found is not None and 6.0 <= at <= 6.0 + SAMPLE_S


def test_a_member_blocked_in_an_nccl_call_is_left_to_the_abort() -> None:
    """Its Python stack shows the script's line that made the call, so only the shim page
    tells it from a sleep: while a call is in flight it is not named; once the call has
    returned and it stays idle in its code, it is."""
    member = FakeProcess(11)
    blocked = [True]
    clock, cpu = Clock(), Cpu()
    watch = LingerWatch(clock=clock, stack_of=own, cpu_of=cpu,
                        in_nccl=lambda process: blocked[0])
    assert run(watch, clock, {"0.1": (member, 3)}, until=6)[0] is None
    blocked[0] = False
    found, _ = run(watch, clock, {"0.1": (member, 3)}, until=1)
    assert found is not None and found.member == "0.1"
