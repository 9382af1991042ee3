"""The crash-loop rule (ftrun.decide.crashloop) at its edges."""

from __future__ import annotations

import pytest

from ftrun.decide.crashloop import CrashLoop, Failure, signature

ERROR = "ValueError: bad sample at step 10"


def test_a_signature_is_the_script_s_own_words_or_its_crash() -> None:
    assert signature("exit code 1", f"{ERROR}\nmore") == ERROR
    assert signature("exit code 3", None) == "exit code 3"
    assert signature("killed by SIGSEGV", None) == "killed by SIGSEGV"
    assert signature("killed by SIGABRT", "") == "killed by SIGABRT"
    # sent from outside, or ftrun's own verdicts and waits: not the script's
    for cause in ("killed by SIGKILL", "killed by SIGTERM", "exit code 0",
                  "stalled: no progress", "heartbeat lost", "frozen (stopped by a signal)"):
        assert signature(cause, None) is None, cause
    assert signature("exit code 1", "RegroupTimeoutError: member 0.1 waited") is None
    assert signature("exit code 1", "ftrun.worker.errors.RegroupError: 5 epochs") is None


def test_the_same_rank_and_error_twice_in_a_row_is_a_crash_loop() -> None:
    loop = CrashLoop(2)
    assert loop.observe(Failure(1, ERROR, step=10)) is None
    verdict = loop.observe(Failure(1, ERROR, step=10))
    assert verdict is not None and verdict.rank == 1 and verdict.count == 2
    assert "rank 1 failed 2 times in a row" in verdict.describe()


def test_a_limit_of_three_absorbs_two() -> None:
    loop = CrashLoop(3)
    assert loop.observe(Failure(0, ERROR)) is None
    assert loop.observe(Failure(0, ERROR)) is None
    assert loop.observe(Failure(0, ERROR)) is not None


def test_what_breaks_a_run() -> None:
    loop = CrashLoop(2)
    assert loop.observe(Failure(1, ERROR, step=10)) is None
    assert loop.observe(Failure(2, ERROR, step=10)) is None  # another rank: its own count
    assert loop.observe(Failure(1, "KeyError: 'x'", step=10)) is None  # another error
    assert loop.observe(Failure(1, ERROR, step=10)) is None  # counts from 1 again
    assert loop.observe(Failure(1, ERROR, step=40)) is None  # went past it: a new count
    # unknown steps (a script without the worker API) match
    assert loop.observe(Failure(1, ERROR, step=None)) is not None


def test_kills_from_outside_neither_count_nor_break_a_run() -> None:
    loop = CrashLoop(2)
    assert loop.observe(Failure(1, ERROR, step=10)) is None
    assert loop.observe(Failure(1, None, step=10)) is None  # SIGKILL: no signature
    assert loop.observe(Failure(1, ERROR, step=11)) is not None  # within one step


def test_every_rank_failing_alike_at_one_step_stops_at_once() -> None:
    loop = CrashLoop(5)
    for rank in range(3):
        assert loop.observe(Failure(rank, ERROR, step=10, world=4, epoch=0)) is None
    verdict = loop.observe(Failure(3, ERROR, step=10, world=4, epoch=0))
    assert verdict is not None and verdict.everyone and verdict.count == 4
    # three of four, or at different steps, is not everyone
    loop = CrashLoop(5)
    for rank, step in ((0, 10), (1, 10), (2, 10), (3, 12)):
        assert loop.observe(Failure(rank, ERROR, step=step, world=4, epoch=0)) is None


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        CrashLoop(0)


def test_every_rank_of_one_generation_without_steps_is_everyone() -> None:
    loop = CrashLoop(5)
    assert loop.observe(Failure(0, ERROR, world=2, epoch=3)) is None
    verdict = loop.observe(Failure(1, ERROR, world=2, epoch=3))
    assert verdict is not None and verdict.everyone
    loop = CrashLoop(5)  # the same two failures in two generations: not everyone
    assert loop.observe(Failure(0, ERROR, world=2, epoch=3)) is None
    assert loop.observe(Failure(1, ERROR, world=2, epoch=4)) is None
