"""Straggler detection (ftrun/agent/stragglers.py) and its policies.

End to end (one real job, three gloo workers, in-process regroup): the process that
started as rank 1 sleeps 0.3 s before each backward, so the other two wait for it in the
gradient allreduce. With ``--straggler-policy fault`` and a 3 s window the regroup leader
names rank 1 and its node in one console line and a ``straggler`` event, never ranks 0
or 2, then takes it out: the fault record says why (``straggler on node ...``), the path
(regroup) and the rank; the two survivors finish the job.

Without processes: the verdict's arithmetic on beats fed in (a uniform job is never
flagged; a slow rank is flagged only after a whole window above the factor, once; it is
cleared when it keeps up again; ``warn`` reports without asking for a fault) and the
metrics and ``ftrun status`` view that the events feed.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

from ftrun.agent.stragglers import StragglerWatch
from ftrun.observe.events import EventLog
from ftrun.observe.metrics import Metrics
from ftrun.observe.statusboard import StatusBoard
from tests.launch import PRELOAD, REPO, Launch
from tests.lines import ElasticStep, find

LINE = re.compile(r"rank (?P<rank>\d+) \(member (?P<member>[\d.]+)\) on node "
                  r"(?P<node>\d+) \((?P<host>[^)]+)\) is a straggler: (?P<own>[\d.]+) s of own "
                  r"work per step")


def test_a_slow_rank_is_named_with_its_node_and_taken_out_as_a_fault(job_dir: Path) -> None:
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    events = job_dir / "events.jsonl"
    run = Launch(["--nproc-per-node", "3", "--recovery", "regroup", *PRELOAD, "--on-failure",
                  "shrink", "--straggler-policy", "fault", "--straggler-window", "3",
                  "--events-file",
                  str(events), str(script), "--steps", "60", "--hidden", "32",
                  "--step-sleep", "0.02", "--slow-rank", "1", "--slow-sleep", "0.3",
                  "--slow-initial"], cwd=job_dir)
    assert run.wait(240) == 0, run.output
    evs = [json.loads(x) for x in events.read_text().splitlines()]
    said = [m for x in run.lines if (m := LINE.search(x))]
    assert len(said) == 1, run.output  # once, and only rank 1: no false positive
    line = said[0]
    assert (line["rank"], line["member"], line["node"]) == ("1", "0.1", "0"), line
    assert line["host"] == evs[0]["node"]  # the host name the agent writes in its events
    flagged = [e for e in evs if e["event"] == "straggler"]
    assert [(e["rank"], e["flagged"], e["policy"]) for e in flagged] == [(1, True, "fault")]
    verdict = flagged[0]
    # 0.3 s of sleep per step is its own work; the others' is a few ms of forward.
    assert verdict["own_s"] >= 0.15 and verdict["own_s"] > 2 * verdict["others_s"], verdict
    slow_pid = next(s.pid for s in find(run.lines, ElasticStep) if s.rank == 1)
    (fault,) = [e for e in evs if e["event"] == "fault"]
    assert fault["cause"].startswith(f"straggler on node 0 ({line['host']}): "), fault
    assert (fault["rank"], fault["pid"], fault["path"], fault["ranks"], fault["world"]) == \
        (1, slow_pid, "regroup", [1], 2), fault
    assert verdict["ts"] <= fault["detected"] <= fault["recovered"]
    done = [x for x in run.lines if x.startswith("[rank") and "done rank=" in x]
    assert len(done) == 2, run.output  # the two survivors finished the steps
    assert "waitForInput" not in run.output  # ftrun's own store waits print no warnings


def _feed(watch: StragglerWatch, seconds: float, start: float, shares: dict[str, float],
          step_s: float = 0.4) -> list:
    """Beats every 0.2 s for ``seconds``: member m's beat shows no collective issued in a
    fraction ``shares[m]`` of them (evenly spread)."""
    verdicts = []
    beats = int(seconds / 0.2)
    for n in range(beats):
        now = start + n * 0.2
        status = {m: (rank, round(now * 5), 0 if (n * share) % 1 + share >= 1 else 1)
                  for rank, (m, share) in enumerate(shares.items())}
        verdicts += watch.observe(now, status, step_s)
    return verdicts


def _watch(policy: str) -> tuple[StragglerWatch, io.StringIO, list[str]]:
    sink = io.StringIO()
    said: list[str] = []
    watch = StragglerWatch(policy=policy, factor=2.0, window_s=3.0,
                           events=EventLog("h0", [sink]),
                           say=lambda text, style="": said.append(text),
                           node_name=lambda rank: f"host{rank}")
    return watch, sink, said


def test_the_verdict_needs_a_whole_window_and_is_said_once_then_cleared() -> None:
    watch, sink, said = _watch("warn")
    even = {"0.0": 0.2, "0.1": 0.2, "1.0": 0.2}
    assert _feed(watch, 10, 0.0, even) == [] and said == []  # a uniform job: nothing
    slow = {"0.0": 0.1, "0.1": 0.9, "1.0": 0.1}
    _feed(watch, 2.5, 10.0, slow)
    assert said == []  # above the factor, not yet for a whole window
    assert _feed(watch, 6, 12.5, slow) == []  # warn: reported, never a fault
    assert len(said) == 1 and said[0].startswith(
        "rank 1 (member 0.1) on node 0 (host0) is a straggler: "), said
    _feed(watch, 8, 18.5, even)
    assert said[1:] == ["rank 1 (member 0.1) on node 0 (host0) keeps up again"], said
    records = [json.loads(x) for x in sink.getvalue().splitlines()]
    assert [(r["rank"], r["flagged"]) for r in records] == [(1, True), (1, False)]
    metrics = Metrics()
    for record in records[:1]:
        metrics.observe(record)
    value = metrics.registry.get_sample_value
    assert value("ftrun_straggler", {"rank": "1", "node": "0 (host0)"}) == 1
    assert value("ftrun_stragglers_total") == 1
    assert value("ftrun_straggler_own_seconds", {"rank": "1", "node": "0 (host0)"}) == \
        records[0]["own_s"]
    metrics.observe(records[1])
    assert value("ftrun_straggler", {"rank": "1", "node": "0 (host0)"}) == 0
    # ftrun status's view (the leader's StatusBoard) lists it while it is flagged.
    board = StatusBoard()
    board.observe(records[0])
    (listed,) = board.snapshot()["stragglers"]
    assert (listed["rank"], listed["member"], listed["straggler_node"]) == (1, "0.1",
                                                                             "0 (host0)")
    board.observe(records[1])
    assert board.snapshot()["stragglers"] == []


def test_policy_fault_asks_for_the_straggler_once_and_off_sees_nothing() -> None:
    watch, _, said = _watch("fault")
    slow = {"0.0": 0.1, "0.1": 0.1, "1.0": 0.8}
    verdicts = _feed(watch, 12, 0.0, slow)
    assert [(v.member, v.rank, v.node) for v in verdicts] == [("1.0", 2, "1 (host1)")]
    assert verdicts[0].own_s is not None and verdicts[0].own_s > 0.2
    assert len(said) == 1 and said[0].endswith("taken out (--straggler-policy fault)")
    off, _, quiet = _watch("off")
    assert _feed(off, 12, 0.0, slow) == [] and quiet == []
