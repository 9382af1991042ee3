"""The recovery deadline (ftrun.decide.deadline) at its edges."""

from __future__ import annotations

from ftrun.decide.deadline import FLOOR_S, RecoveryDeadline, auto_deadline_s
from ftrun.decide.progress import Observation


def test_auto_is_the_floor_for_a_fast_job_and_grows_with_what_is_in_play() -> None:
    assert auto_deadline_s(peer_write_s=7.0, limit_s=5.0, start_s=1.0, step_s=0.1) == FLOOR_S
    # 2 x 10 + 2 x 20 + 2 x 8 + 10 x 1 = 86
    assert auto_deadline_s(peer_write_s=10.0, limit_s=20.0, start_s=8.0, step_s=1.0) == 86.0
    assert auto_deadline_s(peer_write_s=10.0, limit_s=20.0, start_s=None, step_s=None) == 60.0


def test_overdue_only_past_the_deadline_counted_from_the_first_fault() -> None:
    clock = RecoveryDeadline(None)
    assert clock.overdue(1e9) is None  # no recovery running
    clock.fault(100.0, ended_epoch=0, auto_s=30.0)
    assert clock.overdue(130.0) is None
    late = clock.overdue(130.5)
    assert late is not None and late.waited_s == 30.5 and late.ended_epoch == 0
    assert late.describe() == ("no step committed 30.5s after member epoch 0 ended "
                               "(recovery deadline 30s)")


def test_a_fault_during_the_recovery_keeps_its_start() -> None:
    clock = RecoveryDeadline(None)
    clock.fault(100.0, ended_epoch=0, auto_s=30.0)
    clock.fault(120.0, ended_epoch=1, auto_s=20.0)  # may not shorten it
    assert clock.overdue(130.0) is None
    late = clock.overdue(131.0)
    assert late is not None and late.ended_epoch == 1 and late.deadline_s == 30.0


def test_a_step_committed_inside_a_newer_epoch_ends_the_recovery() -> None:
    clock = RecoveryDeadline(None)
    clock.fault(0.0, ended_epoch=2, auto_s=30.0)
    # inside the ended epoch, or a newer one without a commit yet: not over
    assert not clock.observe([Observation("a", 2, 10, 0, epoch_steps=3),
                              Observation("b", 3, 9, 0, epoch_steps=0),
                              Observation("c", -1, 9, 0)])
    assert clock.overdue(31.0) is not None
    assert clock.observe([Observation("b", 3, 10, 0, epoch_steps=1)])
    assert not clock.running and clock.overdue(1000.0) is None


def test_the_flag_overrides_auto() -> None:
    clock = RecoveryDeadline(5.0)
    clock.fault(0.0, ended_epoch=0, auto_s=300.0)
    assert clock.overdue(5.0) is None and clock.overdue(5.01) is not None
