"""Fault records from events (ftrun.observe.faults) where member ids and epoch numbers start
again in each job generation, and the escalation's record: values, not presence."""

from __future__ import annotations

import pytest

from ftrun.observe.faults import FaultBook


def test_a_member_id_used_again_after_a_restart_is_a_new_fault() -> None:
    """Generation 1 numbers its members 0.0, 0.1, ... again: its 0.1's failure is a fault of
    its own, not 'the same member's second report' of generation 0's 0.1 (the soak found
    the later one without a record)."""
    book = FaultBook().replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 2.0, "event": "failure", "member": "0.1", "rank": 1, "generation": 0,
         "cause": "killed by SIGKILL", "detected": 2.0},
        {"ts": 2.1, "event": "epoch", "generation": 0, "epoch": 1, "world_size": 1,
         "joiners": [], "gone": [{"member": "0.1", "rank": 1}]},
        {"ts": 2.5, "event": "formed", "generation": 0, "epoch": 1, "world_size": 1,
         "step": 7},
        {"ts": 5.0, "event": "generation", "generation": 1, "world_size": 2},
        {"ts": 9.0, "event": "failure", "member": "0.1", "rank": 1, "generation": 1,
         "cause": "exit code 1", "detected": 9.0},
        {"ts": 9.1, "event": "epoch", "generation": 1, "epoch": 1, "world_size": 1,
         "joiners": [], "gone": [{"member": "0.1", "rank": 1}]},
        {"ts": 9.4, "event": "formed", "generation": 1, "epoch": 1, "world_size": 1,
         "step": 3},
    ])
    first, second = book.faults
    assert (first.generation, first.recovery_s, first.step) == (0, 0.5, 7)
    assert (second.generation, second.cause, second.path) == (1, "exit code 1", "regroup")
    assert second.recovery_s == pytest.approx(0.4) and second.step == 3


def test_a_lost_node_of_an_earlier_generation_does_not_take_a_later_member_s_fault() -> None:
    """Generation 0 lost node 1 (its record regrouped in epoch 1); in generation 1, member
    1.0 fails and epoch 1 of generation 1 leaves it out: a record of its own."""
    book = FaultBook().replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 3.0, "event": "node_lost", "node_rank": 1, "silent_s": 2.0, "generation": 0},
        {"ts": 3.1, "event": "epoch", "generation": 0, "epoch": 1, "world_size": 2,
         "joiners": [], "gone": [{"member": "1.0", "rank": 2}, {"member": "1.1", "rank": 3}]},
        {"ts": 3.5, "event": "formed", "generation": 0, "epoch": 1, "world_size": 2,
         "step": 20},
        {"ts": 8.0, "event": "generation", "generation": 1, "world_size": 4},
        {"ts": 9.1, "event": "epoch", "generation": 1, "epoch": 1, "world_size": 3,
         "joiners": [], "gone": [{"member": "1.0", "rank": 2, "cause": "killed by SIGKILL"}]},
        {"ts": 9.3, "event": "formed", "generation": 1, "epoch": 1, "world_size": 3,
         "step": 2},
    ])
    lost, worker = book.faults
    assert lost.ranks == [2, 3] and lost.recovery_s == 2.5
    assert (worker.generation, worker.member, worker.rank) == (1, "1.0", 2)
    assert worker.cause == "killed by SIGKILL" and worker.recovery_s == pytest.approx(0.2)


def test_an_escalation_is_a_record_of_its_own_and_the_restart_recovers_both() -> None:
    lines: list[str] = []
    book = FaultBook(on_line=lines.append).replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 2.0, "event": "progress", "step": 1, "steps": {"0": 1}},
        {"ts": 10.0, "event": "failure", "member": "0.1", "rank": 1, "generation": 0,
         "cause": "killed by SIGKILL", "detected": 10.0},
        {"ts": 40.0, "event": "escalate", "generation": 0, "epoch": 2, "happened": 10.0,
         "reason": "recovery deadline passed: no step committed 30.0s after member epoch 0 "
                   "ended (recovery deadline 30s); escalating: restarting all (1/1)"},
        {"ts": 40.5, "event": "restart", "generation": 0, "restart_count": 1},
        {"ts": 41.0, "event": "generation", "generation": 1, "world_size": 2},
    ])
    kill, escalate = book.faults
    assert (kill.path, kill.recovery_s, kill.recovered_how) == ("restart", 31.0, "restarted")
    assert (escalate.path, escalate.happened, escalate.detected) == ("escalate", 10.0, 40.0)
    assert escalate.recovery_s == 31.0 and escalate.detection_s == 30.0
    assert len(book.faults) == 2  # the restart event opened no third record
    assert lines[-1].endswith("every worker restarted in 31.00 s (generation 1) "
                              "(detected in 30.00 s)")


def test_a_hang_with_two_culprits_is_two_faults_recovered_by_one_restart() -> None:
    book = FaultBook().replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 5.0, "event": "failure", "generation": 0, "kind": "hung", "rank": 1, "pid": 11,
         "culprits": [1, 3], "waiting": [0, 2], "cause": "rank 1 stuck; rank 3 stuck",
         "detected": 5.0, "happened": 3.0},
        {"ts": 5.2, "event": "restart", "generation": 0, "restart_count": 1},
        {"ts": 5.3, "event": "generation", "generation": 1, "world_size": 4},
    ])
    assert [(f.rank, f.path, f.recovery_s) for f in book.faults] == [
        (1, "restart", 2.3), (3, "restart", 2.3)]


def test_a_casualty_of_a_recovery_is_part_of_its_record_not_a_fault_of_its_own() -> None:
    """Rank 1 dies; rank 2 never leaves the ended epoch (stuck in a collective nothing
    released: its stack said so) and is replaced: one record, naming the casualty. A stuck
    member in its own code is a fault of its own."""
    lines: list[str] = []
    book = FaultBook(on_line=lines.append).replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 2.0, "event": "failure", "member": "0.1", "rank": 1, "generation": 0,
         "cause": "killed by SIGKILL", "detected": 2.0},
        {"ts": 4.1, "event": "failure", "member": "0.2", "rank": 2, "generation": 0,
         "cause": "stuck in member epoch 0", "detected": 4.1, "casualty": True, "pid": 42},
        {"ts": 4.2, "event": "epoch", "generation": 0, "epoch": 1, "world_size": 2,
         "joiners": [], "gone": [{"member": "0.1", "rank": 1}, {"member": "0.2", "rank": 2}]},
        {"ts": 5.0, "event": "formed", "generation": 0, "epoch": 1, "world_size": 2,
         "step": 9},
        {"ts": 8.0, "event": "failure", "member": "0.3", "rank": 1, "generation": 0,
         "cause": "stuck in member epoch 1", "detected": 8.0},
    ])
    first, second = book.faults
    assert (first.rank, first.casualties, first.recovery_s) == (1, [2], 3.0)
    assert first.casualty_pids == [42]  # the soak's accounting: the process it replaced
    assert lines[0].endswith("(detected in 0.00 s; rank 2 replaced: stuck in a collective "
                             "of the ended epoch)")
    assert (second.rank, second.cause) == (1, "stuck in member epoch 1")


def test_a_worker_found_frozen_while_a_failed_generation_stops_is_a_fault_of_its_own() -> None:
    """The restart path: rank 1 is SIGKILLed and, 30 ms later, rank 2 is SIGSTOPped; the
    stop finds rank 2 frozen and kills it (launcher.stop_workers' failure event). One
    restart absorbs both, and each fault has its record (the soak found the freeze with
    none). The frozen culprit of a hang verdict, reported again by the same stop, stays one
    record (its pid)."""
    book = FaultBook().replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 2.0, "event": "failure", "rank": 1, "pid": 101, "generation": 1,
         "returncode": -9, "detected": 2.0},
        {"ts": 2.05, "event": "failure", "rank": 2, "pid": 102, "generation": 1,
         "cause": "frozen (stopped by a signal)", "detected": 2.05, "happened": 2.05},
        {"ts": 2.1, "event": "restart", "generation": 1, "rank": 1, "pid": 101,
         "returncode": -9},
        {"ts": 2.3, "event": "generation", "generation": 2, "world_size": 4},
        {"ts": 4.0, "event": "failure", "rank": 3, "pid": 203, "generation": 2,
         "cause": "frozen (stopped by a signal)", "detected": 4.0},
        {"ts": 4.01, "event": "failure", "rank": 3, "pid": 203, "generation": 2,
         "cause": "frozen (stopped by a signal)", "detected": 4.01},
        {"ts": 4.1, "event": "restart", "generation": 2, "rank": 3, "pid": 203},
        {"ts": 4.4, "event": "generation", "generation": 3, "world_size": 4},
    ])
    killed, frozen, culprit = book.faults
    assert (killed.rank, killed.cause, killed.path) == (1, "killed by SIGKILL", "restart")
    assert (frozen.rank, frozen.cause, frozen.path) == (2, "frozen (stopped by a signal)",
                                                       "restart")
    assert killed.recovered == frozen.recovered == 2.3
    assert frozen.recovery_s == pytest.approx(0.25)
    assert (culprit.rank, culprit.pid, culprit.recovered) == (3, 203, 4.4)


def test_a_regroup_that_falls_back_to_a_restart_keeps_every_faults_own_record() -> None:
    """Rank 3 froze (its record, regroup path); rank 1 then hung and was taken out as
    stuck; no survivor held the state, so the generation restarted, the restart event
    naming rank 3 (the generation's first failure) as its root. The pending record is rank
    1's, not rank 3's again: two records, each its own (the long soak's ddp run, seed
    52066046, had rank 1's record renamed into a duplicate of rank 3's)."""
    book = FaultBook().replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 2.0, "event": "failure", "member": "0.3", "rank": 3, "pid": 665,
         "generation": 0, "cause": "frozen (stopped by a signal)", "detected": 2.0},
        {"ts": 2.2, "event": "epoch", "generation": 0, "epoch": 1, "world_size": 3,
         "joiners": [], "gone": [{"member": "0.3", "rank": 3}]},
        {"ts": 2.4, "event": "formed", "generation": 0, "epoch": 1, "world_size": 3,
         "step": 30},
        {"ts": 7.0, "event": "failure", "member": "0.1", "rank": 1, "pid": 659,
         "generation": 0, "cause": "stuck in member epoch 0", "detected": 7.0},
        {"ts": 7.1, "event": "restart", "generation": 0, "rank": 3, "pid": 665,
         "returncode": -9, "message": "frozen (stopped by a signal)"},
        {"ts": 7.5, "event": "generation", "generation": 1, "world_size": 4},
    ])
    frozen, stuck = book.faults
    assert (frozen.pid, frozen.cause, frozen.path) == (665, "frozen (stopped by a signal)",
                                                       "regroup")
    assert (stuck.rank, stuck.pid, stuck.cause, stuck.path) == (
        1, 659, "stuck in member epoch 0", "restart")
    assert stuck.recovered == 7.5


def _restart_after(first: dict, root_rank: int, root_pid: int, message: str) -> FaultBook:
    return FaultBook().replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 2.0, "event": "failure", "generation": 2, **first, "detected": 2.0},
        {"ts": 2.04, "event": "restart", "generation": 2, "rank": root_rank, "pid": root_pid,
         "returncode": -15, "message": message},
        {"ts": 2.05, "event": "generation", "generation": 3, "world_size": 4},
    ])


def test_a_kill_and_another_ranks_raise_ended_by_one_restart_are_two_faults() -> None:
    """The soak (torchrun_ddp seed 724460321): rank 0 raised, and 63 ms later rank 2 was
    SIGKILLed; rank 2's exit was seen first and the agent named rank 0's error the root.
    Both are faults, each with its record, both recovered by the one restart. An error exit
    seen first stays the root's casualty: one record, renamed to the root."""
    raised = "RuntimeError: injected by ftrun: raise at step 49 on rank 0 (pid 81)"
    book = _restart_after({"rank": 2, "pid": 87, "returncode": -9}, 0, 81, raised)
    assert [(f.rank, f.pid, f.cause, f.path) for f in book.faults] == [
        (2, 87, "killed by SIGKILL", "restart"),
        (0, 81, f"killed by SIGTERM: {raised}", "restart")]
    assert all(f.recovered == 2.05 for f in book.faults)
    book = _restart_after({"rank": 2, "pid": 87, "returncode": 1}, 0, 81, raised)
    assert [(f.rank, f.pid, f.cause) for f in book.faults] == [
        (0, 81, f"killed by SIGTERM: {raised}")]


def test_an_injected_hang_happened_at_its_injection_not_at_the_spell_estimate() -> None:
    """A hang verdict dates the fault from the idle spell's start, known to a sample: here
    0.3 s before the injection (the rank sat idle in its step's sleep). The record says the
    injection, which is when the fault began, and its detection counts from there."""
    book = FaultBook().replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 10.0, "event": "inject", "spec": "hang rank=1", "rank": 1},
        {"ts": 12.5, "event": "failure", "member": "0.1", "rank": 1, "generation": 0,
         "cause": "hung in train.py:138 compute for 2.4s while rank 0 waited for it in a "
                  "collective", "detected": 12.4, "happened": 9.7},
        {"ts": 12.6, "event": "epoch", "generation": 0, "epoch": 1, "world_size": 1,
         "joiners": [], "gone": [{"member": "0.1", "rank": 1}]},
        {"ts": 12.9, "event": "formed", "generation": 0, "epoch": 1, "world_size": 1,
         "step": 30},
    ])
    (record,) = book.faults
    assert (record.happened, record.injected) == (10.0, "hang rank=1")
    assert record.detection_s == pytest.approx(2.4)
    assert record.recovery_s == pytest.approx(2.9)
