"""Every reported number and every decision's inputs at their edges: a wrong value fails a
test, not only a missing one (issue 37: an audit of ten plausible breakages found eight the
suite did not notice; each has its test here, named after what it guards)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ftrun.client.faultspec import MAX_AFTER_S, MAX_CUT_S, MAX_STEP, FaultSpecError, parse_item
from ftrun.control.heartbeat import HeartbeatMonitor
from ftrun.observe.faults import FaultBook
from ftrun.observe.metrics import Metrics


def test_steps_lost_are_the_last_step_seen_less_the_step_resumed_from() -> None:
    book = FaultBook().replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 2.0, "event": "progress", "step": 1, "steps": {"0": 1}},
        {"ts": 9.0, "event": "progress", "step": 40, "steps": {"0": 40, "1": 39}},
        {"ts": 9.5, "event": "failure", "member": "0.1", "rank": 1, "generation": 0,
         "cause": "killed by SIGKILL", "detected": 9.5},
        {"ts": 9.6, "event": "epoch", "generation": 0, "epoch": 1, "world_size": 1,
         "joiners": [], "gone": [{"member": "0.1", "rank": 1}]},
        {"ts": 10.0, "event": "formed", "generation": 0, "epoch": 1, "world_size": 1,
         "step": 37},
    ])
    (record,) = book.faults
    assert record.steps_lost == 3 and record.step == 37
    assert record.recovery_s == pytest.approx(0.5)


def test_productive_time_starts_at_the_first_committed_step_not_at_step_zero() -> None:
    book = FaultBook().replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 5.0, "event": "progress", "step": 0, "steps": {"0": 0}},  # not a step yet
        {"ts": 7.0, "event": "progress", "step": 1, "steps": {"0": 1}},
        {"ts": 17.0, "event": "done"},
    ])
    summary = book.summary()
    assert summary.first_step == 7.0 and summary.productive_s == 10.0
    assert summary.wall_s == 16.0 and summary.goodput == pytest.approx(10.0 / 16.0)


def test_the_metrics_show_each_figure_of_the_fault_record_as_it_is() -> None:
    metrics = Metrics()
    metrics.observe({"event": "fault", "recovery_s": 1.5, "detection_s": 0.25,
                     "steps_lost": 3})
    metrics.observe({"event": "fault", "recovery_s": 0.5, "detection_s": 0.125,
                     "steps_lost": 0})
    metrics.observe({"event": "escalate"})
    value = metrics.registry.get_sample_value
    assert value("ftrun_faults_total") == 2.0
    assert value("ftrun_recovery_seconds_last") == 0.5
    assert value("ftrun_recovery_seconds_total") == 2.0
    assert value("ftrun_detection_seconds_last") == 0.125
    assert value("ftrun_steps_lost_total") == 3.0
    assert value("ftrun_escalations_total") == 1.0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _NoBeats:
    """A store channel that hears nothing (the agent under judgement is silent)."""

    def heard(self, ids: list[str]) -> dict[str, float]:
        return {}

    def prune(self, wanted: set[str]) -> None:
        pass

    def stop(self, timeout_s: float | None) -> bool:
        return True


def test_without_presence_pings_a_node_is_lost_after_three_missed_beats_not_the_timeout() -> None:
    """Timeout 2 s, beats every 1 s, no presence connection: a verdict on store heartbeats
    alone waits max(2, 3 x 1) = 3 s of silence; with pings the timeout itself counts."""
    import torch.distributed as dist

    from ftrun.control.store import JsonStore

    clock = _Clock()
    monitor = HeartbeatMonitor(JsonStore(dist.HashStore(), "ftrun/t"), 2.0, None, 1.0,
                               clock=clock)
    monitor.beats = _NoBeats()  # type: ignore[assignment]
    monitor.watch(["n1"])
    clock.now += 2.9
    assert monitor.scan() == []
    clock.now += 0.2
    assert monitor.scan() == ["n1"] and monitor.silent_s("n1") == pytest.approx(3.1)


@pytest.mark.parametrize(("text", "ok"), [
    ("cut-link node=1 for=0.1", True), ("cut-link node=1 for=0.09", False),
    (f"cut-link node=1 for={MAX_CUT_S:g}", True), (f"cut-link node=1 for={MAX_CUT_S + 1:g}", False),
    (f"kill rank=1 step={MAX_STEP}", True), (f"kill rank=1 step={MAX_STEP + 1}", False),
    (f"kill rank=1 after={MAX_AFTER_S:g}", True), (f"kill rank=1 after={MAX_AFTER_S + 1:g}", False),
    ("kill rank=999999", True), ("kill rank=1000000", False),
    ("kill rank=1 step=5..4", False), ("kill rank=1 step=-1", False),
])
def test_the_fault_spec_bounds_are_where_the_docs_say(text: str, ok: bool) -> None:
    if ok:
        parse_item(text)
    else:
        with pytest.raises(FaultSpecError):
            parse_item(text)


def test_the_exit_hook_exits_1_when_the_destroy_of_the_groups_hangs() -> None:
    """torch's destroy (a stand-in whose destroy never returns, as an NCCL destroy waiting
    for a peer) is bounded: the process ends with status 1, the status of an uncaught
    exception, after the bound, with what it printed flushed."""
    script = textwrap.dedent("""
        import sys, threading, time, types
        from ftrun import exithook
        dist = types.ModuleType("torch.distributed")
        dist.is_available = lambda: True
        dist.is_initialized = lambda: True
        dist.destroy_process_group = lambda: threading.Event().wait()
        sys.modules["torch.distributed"] = dist
        print("destroying", flush=False)
        started = time.monotonic()
        exithook.destroy_process_groups(0.3)
        print("returned", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done
    assert done.stdout.strip() == "destroying"  # flushed before the exit, nothing after
