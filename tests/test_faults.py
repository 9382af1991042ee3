"""Fault records, the recovery line and the end summary (ftrun/observe/faults.py).

End to end on real jobs (gloo workers, the real agent, real signals):
* regroup: a worker SIGKILLed by the test gets one fault record whose fields match what
  happened (the victim's rank and pid, the kill time, detection before recovery, the
  survivors' world and step from their own regroup lines, no step lost, the replacement's
  join), one console line when the survivors regrouped and one when the replacement
  joined, and a success summary with wall time, productive time and goodput; the
  ``--metrics-port`` endpoint scraped before the kill and during the run after it shows
  the member epoch change, the regroup, the failed member and the recovery's seconds;
* restart: a script without the worker API fails once: the record's path is restart, the
  line says how long the restart took, the cause (record, line, table row, first failure)
  names the rank's own exception from its stderr, and with no restart left the console
  never says "restarting all" before "job failed (no restart)".
Without processes: replaying events (the report's path) with malformed fields, injected
faults and overlapping faults.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftrun.observe.events import EventLog
from ftrun.observe.faults import FaultBook, ProgressReport
from tests.launch import PRELOAD, REPO, Launch, wait_until
from tests.lines import ElasticStep, Regroup, find

ELASTIC = REPO / "scripts" / "train_elastic.py"
DDP = REPO / "scripts" / "train_ddp.py"
# A SIGKILL to the survivors' regroup (the 'formed' record): 0.12 s measured here unloaded;
# a ten-fold regression fails.
KILL_TO_FORMED_S = 1.5
RECOVERY_LINE = re.compile(
    r"rank (?P<rank>\d+) (?P<cause>.+?)(?: at step (?P<step>\d+))?: survivors regrouped in "
    r"(?P<took>[\d.]+) s, world (?P<world>\d+) \(detected in (?P<detect>[\d.]+) s")
JOIN_LINE = re.compile(r"rank (?P<rank>\d+)'s replacement joined at step (?P<step>\d+), "
                       r"world (?P<world>\d+)")
SUMMARY = re.compile(r"ftrun: wall (?P<wall>[\d.]+) s, (?:productive (?P<prod>[\d.]+) s, "
                     r"goodput (?P<goodput>[\d.]+)%|goodput unknown[^,]*), (?P<n>\d+) faults?")


def _scrape(port: int) -> dict[str, float]:
    """One scrape of the agent's metrics endpoint: 'name{labels}' -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return parse_metrics(answer.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text (prometheus-client's own parser): 'name{labels}' -> value."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


# a raising rank stopped by ftrun in its teardown (its peer's exit seen first) may end by
# the SIGTERM: the record still names it, with its own error
ENDED = r"(exit code 1|killed by SIGABRT|killed by SIGTERM)"
ERROR = r"RuntimeError: injected failure at step 4 on rank 1"


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _copy(script: Path, job_dir: Path) -> Path:
    target = job_dir / script.name
    shutil.copy(script, target)
    return target


def test_a_killed_worker_gets_one_record_a_line_and_the_success_summary(job_dir: Path) -> None:
    events = job_dir / "events.jsonl"
    # Forked (tests.launch.PRELOAD): the replacement is often published before a leader
    # tick sees the survivors' epoch form; the record must still be the survivors' regroup.
    run = Launch(["--nproc-per-node", "3", "--recovery", "regroup", "--events-file",
                  str(events), "--metrics-port", "0", *PRELOAD, str(_copy(ELASTIC, job_dir)),
                  "--steps",
                  "90", "--hidden", "128", "--step-sleep", "0.05"], cwd=job_dir)
    victim = run.wait_for(lambda lines: next((s.pid for s in find(lines, ElasticStep)
                                              if s.step >= 12 and s.rank == 1), None),
                          120, "rank 1 at step 12")
    port = int(run.wait_for(lambda lines: next((m[1] for x in lines if (m := re.search(
        r"metrics: http://\S+:(\d+)/metrics", x))), None), 10, "the metrics line"))
    before = _scrape(port)
    assert (before["ftrun_world_size"], before["ftrun_member_epoch"]) == (3, 0), before
    assert before['ftrun_members{state="ready"}'] == 3 and before["ftrun_regroups_total"] == 0
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    run.wait_for(lambda _: any(e["event"] == "fault" for e in _events(events)) or None, 60,
                 "the fault record")
    after = _scrape(port)  # the job still runs: the regroup shows in the live metrics
    assert after["ftrun_member_epoch"] >= 1 and after["ftrun_regroups_total"] == 1, after
    assert after["ftrun_faults_total"] == 1 and after["ftrun_recovery_seconds_last"] > 0
    assert after['ftrun_members{state="failed"}'] == 1, after
    # the rate is over the last second of progress reports: right after a regroup it may
    # read 0 until the survivors' next steps are reported
    wait_until(lambda: _scrape(port).get('ftrun_rank_step_rate{rank="0"}', 0) > 0, 30,
               "rank 0's step rate in the metrics after the regroup")
    assert run.wait(240) == 0, run.output
    records = [e for e in _events(events) if e["event"] == "fault"]
    assert len(records) == 1, records
    fault = records[0]
    assert (fault["rank"], fault["pid"], fault["path"]) == (1, victim, "regroup")
    assert fault["cause"] == "killed by SIGKILL"
    assert killed - 0.05 <= fault["happened"] <= fault["detected"] <= fault["recovered"]
    assert fault["recovered"] - killed < KILL_TO_FORMED_S, fault
    assert fault["recovery_s"] == round(fault["recovered"] - fault["happened"], 6)
    assert after["ftrun_recovery_seconds_last"] == pytest.approx(fault["recovery_s"], abs=1e-5)
    # The survivors' own lines: they regrouped after committing step S, into world 2, or
    # straight into world 3 when the forked replacement was ready before their epoch of
    # two formed (its epoch is published then, and the survivors move to the newest).
    regroups = [r for r in find(run.lines, Regroup) if r.rank == 0]
    assert regroups, run.output
    step, world = regroups[0].step, regroups[0].world
    # Exactly the survivors' step: read from the ended epoch's commit decisions, not from
    # the status beats (every 0.2 s, they lag by a few steps).
    assert fault["step"] == step, (fault, step)
    assert fault["world"] == world in (2, 3) and fault["steps_lost"] == 0, (fault, world)
    # The console said the regroup and, later, the replacement's join, once each.
    lines = [m for line in run.lines if (m := RECOVERY_LINE.search(line))]
    assert len(lines) == 1, run.output
    said = lines[0]
    assert (int(said["rank"]), said["cause"], int(said["world"])) == \
        (1, "killed by SIGKILL", world)
    assert float(said["took"]) == round(fault["recovery_s"], 2)
    # The replacement's join is said once it formed (under load it may not be ready
    # before the job ends: then nothing is said).
    evs = _events(events)
    join_epochs = {e["epoch"] for e in evs if e["event"] == "epoch" and e["joiners"]}
    formed = [e for e in evs if e["event"] == "formed" and e["epoch"] in join_epochs]
    joins = [m for line in run.lines if (m := JOIN_LINE.search(line))]
    assert len(joins) == len(formed) <= 1, run.output
    if joins:
        assert (int(joins[0]["step"]), int(joins[0]["world"])) == (formed[0]["step"], 3)
        assert formed[0]["step"] >= step
    # The success summary: wall time, productive time below it, goodput, the one fault.
    summary = next(m for line in run.lines if (m := SUMMARY.search(line)))
    wall, productive = float(summary["wall"]), float(summary["prod"])
    assert 0 < productive < wall and int(summary["n"]) == 1
    # printed rounded (seconds to 0.01, the percentage to 0.1): up to ~0.16 apart
    assert abs(float(summary["goodput"]) - 100 * productive / wall) < 0.2
    assert "first failure: rank 1 killed by SIGKILL" in run.output


def test_a_restart_gets_its_record_and_line(job_dir: Path) -> None:
    script = _copy(DDP, job_dir)
    # One restart left: the failure restarts every worker and the record says how long.
    events = job_dir / "events.jsonl"
    run = Launch(["--nproc-per-node", "2", "--recovery", "auto", "--max-restarts", "1",
                  *PRELOAD, "--events-file", str(events), str(script), "--steps", "12",
                  "--fail-at-step", "4", "--fail-rank", "1",
                  "--fail-once-marker", str(job_dir / "failed-once")], cwd=job_dir)
    assert run.wait(240) == 0, run.output
    assert "restarting all (1/1)" in run.output
    records = [e for e in _events(events) if e["event"] == "fault"]
    assert [(r["rank"], r["path"], r["recovered_how"]) for r in records] == \
        [(1, "restart", "restarted")], records
    # The raising rank exits 1, or (torch tearing down a gloo group whose threads still
    # run) aborts at exit: its cause is the same exception either way, read from its own
    # stderr (train_ddp.py has no @record): the record, the line and the table say it.
    assert re.fullmatch(rf"{ENDED}: {ERROR}", records[0]["cause"]), records[0]
    assert re.search(rf"rank 1 {ENDED}: {ERROR}: every worker restarted in [\d.]+ s "
                     r"\(generation 1\)", run.output), run.output
    rows = [x for x in run.lines if re.match(r"\s*0\s+\S+\s+rank 1\s", x)]
    assert len(rows) == 1 and re.search(rf"{ENDED}: RuntimeError", rows[0]), run.output
    summary = next(m for line in run.lines if (m := SUMMARY.search(line)))
    assert summary["prod"] is None and int(summary["n"]) == 1  # no steps seen: no goodput


# Long tier: test_launcher.py::test_restarts_exhausted_prints_summary_with_root_cause and
# test_recovery_modes.py's max_restarts tests end jobs with no restart left in the default run.
@pytest.mark.long
def test_no_restarting_all_without_a_restart_left(job_dir: Path) -> None:
    script = _copy(DDP, job_dir)
    # No restart left: never "restarting all", then the failure summary and the record.
    events = job_dir / "events0.jsonl"
    run = Launch(["--nproc-per-node", "2", "--recovery", "auto", "--max-restarts", "0",
                  *PRELOAD, "--events-file", str(events), str(script), "--steps", "12",
                  "--fail-at-step", "4", "--fail-rank", "1"], cwd=job_dir)
    assert run.wait(240) == 1, run.output
    assert "restarting all" not in run.output
    assert "the job fails (no restart left)" in run.output
    assert "job failed (no restart)" in run.output
    summary = next(m for line in run.lines if (m := SUMMARY.search(line)))
    assert int(summary["n"]) == 1
    assert re.search(rf"first failure: rank 1 {ENDED}: {ERROR}", run.output), run.output


def test_replay_builds_records_from_events_and_ignores_malformed_ones() -> None:
    lines: list[str] = []
    book = FaultBook(on_line=lines.append)
    book.replay([
        {"ts": 100.0, "event": "started"},
        {"ts": "x", "event": "failure"},  # malformed: ignored
        {"ts": 101.0, "event": "progress", "step": 1, "steps": {"0": 1}},
        {"ts": 110.0, "event": "progress", "step": 40, "steps": {"0": 40}},
        {"ts": 110.5, "event": "inject", "spec": "kill rank=2", "rank": 2},
        {"ts": 110.6, "event": "failure", "member": "0.2", "rank": 2, "cause": "killed by "
         "SIGKILL", "detected": 110.7, "happened": "late"},
        {"ts": 110.8, "event": "epoch", "epoch": 1, "world_size": 3,
         "gone": [{"member": "0.2", "rank": 2}, "junk"], "joiners": []},
        {"ts": 111.5, "event": "formed", "epoch": 1, "world_size": 3, "step": 41},
        {"ts": 112.0, "event": "failure", "member": "0.5", "rank": None, "cause": "exit code 1",
         "detected": 112.0},  # a replacement that never joined: no training time lost
        {"ts": 120.0, "event": "done"},
    ])
    summary = book.summary()
    first, second = summary.faults
    assert (first.rank, first.path, first.injected, first.world) == (2, "regroup",
                                                                    "kill rank=2", 3)
    assert first.happened == 110.5  # the injection, not the detection
    assert first.detection_s == pytest.approx(0.2) and first.recovery_s == 1.0
    assert first.step == 41 and first.steps_lost == 0
    assert second.path == "none" and second.recovery_s == 0.0
    assert lines == ["rank 2 killed by SIGKILL at step 41 (injected: kill rank=2): survivors "
                     "regrouped in 1.00 s, world 3 (detected in 0.20 s)"]
    assert summary.wall_s == 20.0 and summary.succeeded is True
    assert summary.productive_s == 19.0 - 1.0  # from the first step, less the downtime
    assert summary.first_cause == "rank 2 killed by SIGKILL"


def test_a_replacement_ready_before_the_survivors_epoch_formed_is_said_with_the_recovery(
) -> None:
    """The forked replacement is admitted before the survivors' epoch of two forms: the one
    epoch that forms recovers the fault and admits the replacement. The record carries both,
    and the console says both, the recovery first (the join line was lost here once)."""
    lines: list[str] = []
    book = FaultBook(on_line=lines.append).replay([
        {"ts": 10.0, "event": "started"},
        {"ts": 11.0, "event": "progress", "step": 12, "steps": {"0": 12}},
        {"ts": 12.0, "event": "failure", "member": "0.1", "rank": 1,
         "cause": "killed by SIGKILL", "detected": 12.0, "happened": 12.0},
        {"ts": 12.01, "event": "epoch", "epoch": 1, "world_size": 2,
         "gone": [{"member": "0.1", "rank": 1}], "joiners": []},
        {"ts": 12.1, "event": "epoch", "epoch": 2, "world_size": 3, "gone": [],
         "joiners": ["0.3"]},
        {"ts": 12.2, "event": "formed", "epoch": 2, "world_size": 3, "step": 12},
        {"ts": 13.0, "event": "formed", "epoch": 3, "world_size": 3, "step": 20},
    ])
    (fault,) = book.summary().faults
    assert (fault.path, fault.world, fault.recovered, fault.step) == ("regroup", 3, 12.2, 12)
    assert (fault.joined, fault.joined_step, fault.joined_world) == (12.2, 12, 3)
    assert lines == ["rank 1 killed by SIGKILL at step 12: survivors regrouped in 0.20 s, "
                     "world 3 (detected in 0.00 s)",
                     "rank 1's replacement joined at step 12, world 3"]


def test_a_restart_names_the_root_cause_not_the_exit_seen_first() -> None:
    """Rank 1 raised, but rank 0, whose collective that broke, exited first: the agent's
    root cause (the restart event) is rank 1, and so is the record, with rank 1's error."""
    lines: list[str] = []
    book = FaultBook(on_line=lines.append).replay([
        {"ts": 0.0, "event": "started"},
        {"ts": 5.0, "event": "failure", "member": "0.0", "rank": 0, "pid": 10,
         "returncode": 1, "detected": 5.0},
        {"ts": 5.0, "event": "error", "rank": 0, "pid": 10,
         "message": "RuntimeError: Connection closed by peer [127.0.0.1]:1"},
        {"ts": 5.1, "event": "restart", "generation": 0, "restart_count": 1,
         "cause": "rank 1 (exit code 1 (stopped by ftrun): RuntimeError: boom)", "rank": 1,
         "pid": 11, "returncode": 1, "message": "RuntimeError: boom\nmore"},
        {"ts": 5.2, "event": "generation", "generation": 1, "world_size": 2},
    ])
    (record,) = book.summary().faults
    assert (record.rank, record.pid, record.cause) == (1, 11, "exit code 1: RuntimeError: boom")
    assert lines and lines[0].startswith("rank 1 exit code 1: RuntimeError: boom"), lines
    same = FaultBook().replay([  # the root is the exit seen first: nothing changes
        {"ts": 5.0, "event": "failure", "rank": 1, "pid": 11, "returncode": 1, "detected": 5.0},
        {"ts": 5.1, "event": "restart", "generation": 0, "rank": 1, "pid": 11, "returncode": 1,
         "message": "RuntimeError: boom"},
    ])
    assert [(f.rank, f.cause) for f in same.summary().faults] == [(1, "exit code 1")]


def test_a_job_without_a_restart_left_names_the_root_cause_too() -> None:
    """The same race when no restart is left: the ``stop`` event carries the root's fields
    and the record and the summary's first failure name rank 1, not rank 0 (seen in a
    clean-clone CI run: "first failure: rank 0 exit code 1: ... Connection closed by
    peer" while the root cause printed under it was rank 1)."""
    book = FaultBook().replay([
        {"ts": 0.0, "event": "started"},
        {"ts": 5.0, "event": "failure", "member": "0.0", "rank": 0, "pid": 10,
         "returncode": 1, "detected": 5.0},
        {"ts": 5.1, "event": "stop", "reason": "failed", "restarts": 0, "rank": 1,
         "pid": 11, "returncode": -15, "message": "RuntimeError: boom"},
    ])
    (record,) = book.summary().faults
    assert (record.rank, record.pid, record.path) == (1, 11, "none"), record
    assert book.summary().first_cause == "rank 1 killed by SIGTERM: RuntimeError: boom", \
        book.summary().first_cause
    plain = FaultBook().replay([  # a stop without root fields (a signal) changes nothing
        {"ts": 5.0, "event": "failure", "rank": 0, "pid": 10, "returncode": 1},
        {"ts": 5.1, "event": "stop", "reason": "signal", "signal": "SIGTERM"},
    ])
    assert [(f.rank, f.path) for f in plain.summary().faults] == [(0, "none")]


def test_overlapping_faults_count_their_downtime_once() -> None:
    book = FaultBook().replay([
        {"ts": 0.0, "event": "started"},
        {"ts": 1.0, "event": "progress", "step": 1},
        {"ts": 10.0, "event": "node_lost", "lost_node": 1, "silent_s": 2.0},  # from 8 s
        {"ts": 10.0, "event": "failure", "member": "0.1", "rank": 1, "detected": 9.0},
        {"ts": 10.5, "event": "epoch", "epoch": 1, "world_size": 2,
         "gone": [{"member": "0.1", "rank": 1}], "joiners": []},
        {"ts": 12.0, "event": "formed", "epoch": 1, "world_size": 2, "step": 5},
        {"ts": 20.0, "event": "stop", "reason": "failed"},
    ])
    summary = book.summary()
    node, worker = summary.faults
    assert node.path is None or node.path == "none"  # never recovered: counts to the end
    assert worker.recovery_s == 3.0
    assert summary.downtime_s == 12.0  # 8 -> 20, the worker's 9 -> 12 inside it
    assert summary.succeeded is False and summary.productive_s == 19.0 - 12.0


def test_a_lost_node_is_one_record_naming_its_ranks() -> None:
    """The leader's node_lost, then the member epoch without the node's two members: one
    record for the node (its silence is the detection), with both ranks and the regroup."""
    lines: list[str] = []
    book = FaultBook(on_line=lines.append).replay([
        {"ts": 1.0, "event": "started"},
        {"ts": 2.0, "event": "progress", "step": 1, "steps": {"0": 1}},
        {"ts": 10.0, "event": "node_lost", "node_rank": 1, "silent_s": 3.0},
        {"ts": 10.1, "event": "epoch", "epoch": 1, "world_size": 2, "members": ["0.0", "0.1"],
         "joiners": [], "gone": [{"member": "1.0", "rank": 2, "cause": "node lost"},
                                 {"member": "1.1", "rank": 3, "cause": "node lost"}]},
        {"ts": 10.5, "event": "formed", "epoch": 1, "world_size": 2, "step": 42},
    ])
    (record,) = book.summary().faults
    assert (record.node, record.ranks, record.path, record.world) == ("1", [2, 3], "regroup", 2)
    assert record.detection_s == 3.0 and record.recovery_s == 3.5
    assert lines == ["node 1 lost: no heartbeat for 3.0 s at step 42: survivors regrouped in "
                     "3.50 s, world 2 (detected in 3.00 s)"]


def test_snapshot_age_is_read_from_the_nodes_snapshot_memory_at_each_scrape(
    tmp_path: Path
) -> None:
    """The real registry and exposition format over a real directory: NaN before the first
    snapshot, then the newest file's age (other files in the directory do not count)."""
    from prometheus_client import generate_latest

    from ftrun.observe.metrics import Metrics

    metrics = Metrics()
    metrics.watch_snapshots(tmp_path)

    def age() -> float:
        return parse_metrics(generate_latest(metrics.registry).decode())[
            "ftrun_snapshot_age_seconds"]

    assert age() != age()  # NaN: no snapshot yet
    (tmp_path / "notes.txt").write_text("not a snapshot")
    old, new = tmp_path / "g0-e0-s3-r0.snap", tmp_path / "g0-e0-s4-r1.snap"
    for path, seconds_ago in ((old, 60.0), (new, 5.0)):
        path.write_bytes(b"x")
        then = time.time() - seconds_ago
        os.utime(path, (then, then))
    assert 5.0 <= age() < 30.0  # the newest one's age, read now


def test_an_epoch_followed_at_once_by_the_next_still_gets_its_own_formed_record() -> None:
    """A fault (epoch 1, world 2) and the replacement (epoch 2, world 3) published before a
    leader tick sees epoch 1 form: 'formed' for each, in order, epoch 1 with the step the
    survivors resumed from (epoch 0's last commit), not the later epoch's step or world;
    and the fault record is the survivors' regroup, the join the replacement's."""
    emitted: list[dict] = []
    log = EventLog("n0")
    log.add_listener(emitted.append)
    formed: set[int] = set()
    decided = {0: range(0, 12), 1: range(12, 15)}  # member epoch -> steps it committed

    def last_commit(epoch: int, step: int) -> int:  # as the leader counts decision keys
        while step in decided.get(epoch, ()):
            step += 1
        return step

    report = ProgressReport(log, 0, formed.__contains__, last_commit)
    report.published(0, 3)
    report.observe({0: 10, 1: 10, 2: 10})  # the beats lag: epoch 0 is at 12
    report.published(1, 2)  # rank 1 killed
    report.published(2, 3)  # its replacement, at once: the beats still say 10
    report.observe({0: 10, 1: 10})  # epoch 1 not formed yet: nothing
    assert [e for e in emitted if e["event"] == "formed"] == []
    formed.update({1, 2})  # both formed before the next tick; epoch 1 committed 12..14
    report.observe({0: 15, 1: 15, 2: 15})
    said = [(e["epoch"], e["world_size"], e["step"]) for e in emitted if e["event"] == "formed"]
    assert said == [(1, 2, 12), (2, 3, 15)]
    assert report.pending == []
    book = FaultBook()
    book.replay([
        {"ts": 100.0, "event": "failure", "member": "0.1", "rank": 1,
         "cause": "killed by SIGKILL", "detected": 100.1},
        {"ts": 100.2, "event": "epoch", "epoch": 1, "world_size": 2,
         "gone": [{"member": "0.1", "rank": 1}], "joiners": []},
        {"ts": 100.3, "event": "epoch", "epoch": 2, "world_size": 3, "gone": [],
         "joiners": ["0.3"]},
        *({"ts": 100.5 + i / 10, **e} for i, e in enumerate(
            e for e in emitted if e["event"] == "formed")),
    ])
    fault, = book.summary().faults
    assert (fault.path, fault.step, fault.world) == ("regroup", 12, 2)
    assert (fault.joined_step, fault.joined_world) == (15, 3)


def test_an_epoch_that_never_formed_is_dropped_once_a_later_one_has() -> None:
    emitted: list[dict] = []
    log = EventLog("n0")
    log.add_listener(emitted.append)
    formed = {2}

    def last_commit(epoch: int, step: int) -> int:  # epoch 0 committed steps 0..6
        return max(step, 7) if epoch == 0 else step

    report = ProgressReport(log, 0, formed.__contains__, last_commit)
    report.published(0, 3)
    report.observe({0: 5, 1: 5, 2: 5})
    report.published(1, 2)  # abandoned: a member died while it formed
    report.published(2, 1)
    report.observe({0: 7})
    said = [(e["epoch"], e["world_size"], e["step"]) for e in emitted if e["event"] == "formed"]
    assert said == [(2, 1, 7)]  # resumed after epoch 0's last commit: epoch 1 made none
    assert report.pending == []
