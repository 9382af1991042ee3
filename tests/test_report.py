"""``ftrun report``: the fault table and the timeline picture from a recorded job.

tests/data/events_two_faults.jsonl is the event log of a real job (3 workers of
scripts/train_elastic.py under --recovery regroup, 150 steps): rank 1 SIGKILLed at step 20,
later rank 2 SIGSTOPped at step 80; both replaced. It holds the agent's own live ``fault``
records, so the report (a replay of the raw events) must agree with what the agent said.
Each picture must hold every fault; bad input is one line and exit 2.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from ftrun import cli
from tests.launch import REPO, launcher

RECORDED = REPO / "tests" / "data" / "events_two_faults.jsonl"


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([launcher(), "report", *args], capture_output=True, text=True,
                          timeout=120)


def _live_records() -> list[dict]:
    return [json.loads(x) for x in RECORDED.read_text().splitlines()
            if json.loads(x)["event"] == "fault"]


def test_report_agrees_with_the_agent_and_the_html_holds_every_fault(tmp_path: Path) -> None:
    picture = tmp_path / "timeline.html"
    done = _report(str(RECORDED), "-o", str(picture))
    assert done.returncode == 0, done.stderr
    live = _live_records()
    assert len(live) == 2
    # The table: one row per fault with the live record's latencies, then the summary.
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"^\d+\s", line)]
    assert [row[2:4] for row in rows] == [["rank", "1"], ["rank", "2"]], done.stdout
    for row, record in zip(rows, live, strict=True):
        assert f"{record['recovery_s']:.2f}" in row and f"{record['detection_s']:.2f}" in row
    assert re.search(r"wall [\d.]+ s, productive [\d.]+ s, goodput [\d.]+%, 2 faults",
                     done.stdout), done.stdout
    # The picture: every fault is a named trace with its three moments.
    html = picture.read_text()
    assert "<html>" in html and "plotly" in html.lower()
    for record in live:
        name = f"fault {record['index']}: rank {record['rank']} {record['cause']}"
        assert json.dumps(name) in html, name
    assert len(re.findall(r'"name":"fault \d+: ', html)) == len(live)
    assert html.count('"name":"join after fault') == 2  # both replacements joined


def test_report_json_is_the_agents_own_record(tmp_path: Path) -> None:
    done = _report(str(RECORDED), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    replayed = summary["faults"]
    for record, live in zip(replayed, _live_records(), strict=True):
        # The live record was emitted when the recovery completed (before the join).
        for key in ("rank", "pid", "cause", "path", "happened", "detected", "recovered",
                    "step", "steps_lost", "world", "recovery_s"):
            assert record[key] == live[key], key
        assert record["joined"] is not None and record["joined_world"] == 3
    assert summary["succeeded"] is True
    assert 0 < summary["productive_s"] < summary["wall_s"]


def test_png_holds_every_fault(tmp_path: Path) -> None:
    picture = tmp_path / "timeline.png"
    done = _report(str(RECORDED), "-o", str(picture))
    assert done.returncode == 0, done.stderr
    with Image.open(picture) as image:
        assert image.format == "PNG" and image.size[0] > 500
        described = image.info["Description"]
    for record in _live_records():
        assert f"fault {record['index']}: rank {record['rank']} {record['cause']}" in described


def test_bad_events_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("not json at all\n")
    done = _report(str(path), "-o", str(tmp_path / "t.html"))  # the real command
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "line 1 is not JSON" in done.stderr, done.stderr
    assert not (tmp_path / "t.html").exists()


@pytest.mark.parametrize("content, says", [
    ('{"ts": 1, "event": "started"}\n[1, 2]\n', "line 2 is not an ftrun event"),
    ('{"ts": 1, "event": "started"}\n{"ts": 2}\n', "line 2 is not an ftrun event"),
    ("", "holds no events"),
])
def test_bad_events_in_process(tmp_path: Path, content: str, says: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(content)
    assert cli.main(["report", str(path), "-o", str(tmp_path / "t.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "t.html").exists()


def test_bad_command_lines_are_one_line_and_exit_2(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for args, says in (([], "required: events"),
                       ([str(tmp_path / "missing.jsonl")], "cannot read"),
                       ([str(RECORDED), "-o", str(tmp_path / "t.svg")], ".html or .png"),
                       ([str(RECORDED), "--bogus"], "unrecognized arguments")):
        assert cli.main(["report", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
