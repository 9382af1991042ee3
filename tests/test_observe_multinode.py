"""Observing a live 2-node job on namespace hosts: ``cut-link``, ``kill-agent``, ``ftrun
status``, metrics.

One lean job (h1 the leader, h2 node 1, h3 an observer that runs no agent), one worker
per node, in-process regroup. ``--inject "cut-link node=1 ..."`` makes h2's own agent cut
its host off the network once the job committed some steps; the leader declares node 1
lost by its heartbeats and the survivor regroups in place. Checked on that one run:

* the metrics endpoint, scraped from h3 before and after: the member epoch moves, the
  world shrinks to 1, a regroup and a fault are counted, with their recovery seconds;
* ``ftrun status --json`` run on h3 while the job runs: the job, its world and members,
  and, after the regroup, the fault with the same recovery time as the leader's record;
* the leader's fault record: node 1 lost, its rank named, path regroup, detected within
  the heartbeat timeout (plus an interval and a tick) of the cut h2's agent announced;
* h2's agent said the cut, then exited 3 (it lost the store); the leader finishes, 0,
  and its output (agent and worker) holds none of torch's ``waitForInput`` warnings.

Without namespaces the cut is refused with one line: checked without a job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ftrun.agent.inject import cut_link_refusal
from tests.launch import REPO, launcher, wait_until
from tests.lines import ElasticStep, find
from tests.test_faults import parse_metrics
from tests.test_multinode import HostLaunch

HB_TIMEOUT_S = 3.0
TOKEN = "observe-test-token"
#: The leader's detection of a cut node: silence counts from the last beat (up to an
#: interval before the cut), then the leader looks once per monitor tick. Measured here:
#: see the test's printed figure; 10x what ftrun adds to the timeout fails.
CUT_DETECT_S = HB_TIMEOUT_S + 2.0


@pytest.fixture
def net(infra_leak_check, netns_network):  # type: ignore[no-untyped-def]
    if shutil.which("iptables") is None and not Path("/usr/sbin/iptables").exists():
        pytest.skip("iptables not installed: run scripts/install_test_services.sh")
    return netns_network


def _scrape(net, addr: str, port: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """One scrape of ``addr:port/metrics`` from h3 (a socket made in its namespace)."""
    with net["h3"].socket() as sock:
        sock.settimeout(10)
        sock.connect((addr, port))
        sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return parse_metrics(b"".join(chunks).decode().partition("\r\n\r\n")[2])


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _pair(net, job_dir: Path, spec: str, steps: int, *train: str,  # type: ignore[no-untyped-def]
          ) -> tuple[HostLaunch, HostLaunch]:
    """A regroup job of one worker on h1 (the leader, node 0) and one on h2 (node 1),
    with ``--inject spec`` on both agents; ``train``: more options of the script."""
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    env = {"GLOO_SOCKET_IFNAME": "eth0", "FTRUN_JOB_TOKEN": TOKEN}
    endpoint = f"{net['h1'].addr}:29400"
    nodes = []
    for host in (net["h1"], net["h2"]):
        events = job_dir / f"events-{host.name}.jsonl"
        args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", "observe",
                "--rdzv-conf", "last_call_timeout=5", "--heartbeat-interval", "0.5",
                "--heartbeat-timeout", str(HB_TIMEOUT_S), "--recovery", "regroup",
                "--metrics-port", "0", "--events-file",
                str(events), "--inject", spec, "--local-addr", host.addr, str(script),
                "--steps", str(steps), "--hidden", "32", "--step-sleep", "0.05", *train]
        nodes.append(HostLaunch(host, args, env=env, cwd=job_dir))
    return nodes[0], nodes[1]


def _node_1_lost(job_dir: Path, kind: str) -> tuple[dict, dict]:
    """h2's inject event of ``kind`` and the leader's one fault record against it: node 1
    lost, its rank named, path regroup, detected within the heartbeat timeout (plus an
    interval and a tick), the survivor alone with no step lost."""
    (inject,) = [e for e in _events(job_dir / "events-h2.jsonl") if e["event"] == "inject"]
    assert (inject["kind"], inject["node"]) == (kind, 1), inject
    records = [e for e in _events(job_dir / "events-h1.jsonl") if e["event"] == "fault"]
    assert len(records) == 1, records
    fault = records[0]
    assert fault["path"] == "regroup" and fault["ranks"] == [1] and fault["node"] == "1", fault
    detected = fault["detected"] - inject["ts"]
    print(f"{kind} to the leader's detection: {detected:.2f} s (timeout {HB_TIMEOUT_S} s)")
    assert 0 < detected < CUT_DETECT_S, (detected, fault)
    assert fault["world"] == 1 and fault["steps_lost"] == 0, fault
    return inject, fault


def test_a_cut_link_regroups_and_status_and_metrics_show_it_live(job_dir: Path, net) -> None:  # type: ignore[no-untyped-def]
    leader_host, observer = net["h1"], net["h3"]
    endpoint = f"{leader_host.addr}:29400"
    # The job holds at step 30 (before the cut) and the survivor at 150 until the test has
    # read the live job: under load the first `ftrun status` came after the cut, and the
    # last after the job had ended (no store left to read).
    holds = job_dir / "holds"
    holds.mkdir()
    leader, cut = _pair(net, job_dir, "cut-link node=1 step=40 for=20", 160,
                        "--hold-at-step", "30", "--hold-at-step", "150",
                        "--hold-dir", str(holds))
    port = int(leader.wait_for(lambda lines: next((m[1] for x in lines if (m := re.search(
        r"metrics: http://\S+:(\d+)/metrics", x))), None), 90, "the leader's metrics line"))
    leader.wait_for(lambda lines: any(s.world == 2 for s in find(lines, ElasticStep)), 120,
                    "a step in the world of 2")
    before = _scrape(net, leader_host.addr, port)
    assert before["ftrun_world_size"] == 2 and before["ftrun_regroups_total"] == 0, before
    epoch_before = before["ftrun_member_epoch"]

    def status() -> dict:
        done = observer.run([launcher(), "status", "--json", endpoint], timeout=60,
                            env={**os.environ, "FTRUN_JOB_TOKEN": TOKEN})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    view = status()
    assert view["run_id"] == "observe" and view["nnodes"] == 2 and view["world_size"] == 2
    assert [m["rank"] for m in view["members"]] == [0, 1], view
    (holds / "30").touch()
    # The cut: h2's agent says it, the leader loses node 1, the survivor goes on alone.
    cut.wait_for(lambda lines: any("injected: cut-link" in x for x in lines), 60,
                 "h2's agent cutting its link")
    leader_events = job_dir / "events-h1.jsonl"
    wait_until(lambda: any(e["event"] == "fault" for e in _events(leader_events)), 60,
               "the leader's fault record")
    after = _scrape(net, leader_host.addr, port)
    assert after["ftrun_member_epoch"] > epoch_before and after["ftrun_world_size"] == 1
    assert after["ftrun_regroups_total"] == 1 and after["ftrun_faults_total"] == 1, after
    wait_until(lambda: status()["faults"], 30, "the fault in ftrun status")
    view = status()
    assert view["world_size"] == 1 and [m["rank"] for m in view["members"]] == [0], view
    (holds / "150").touch()
    assert cut.wait(60) == 3, cut.output
    assert "lost the rendezvous store" in cut.output
    assert leader.wait(120) == 0, leader.output
    # A regroup reads clean: none of torch's socket-timeout warnings from ftrun's own store
    # waits, in the leader agent's output or its worker's (issue 13).
    assert "waitForInput" not in leader.output, leader.output
    # The fault record against what happened.
    inject, fault = _node_1_lost(job_dir, "cut-link")
    assert inject["for_s"] == 20.0, inject
    assert fault["cause"].startswith("lost: no heartbeat"), fault
    assert fault["happened"] <= fault["detected"] <= fault["recovered"]
    assert view["faults"][0]["recovery_s"] == fault["recovery_s"], (view, fault)
    assert after["ftrun_recovery_seconds_last"] == pytest.approx(fault["recovery_s"], abs=1e-5)


def test_a_killed_agent_is_one_lost_node_record(job_dir: Path, net) -> None:  # type: ignore[no-untyped-def]
    """``kill-agent node=1``: h2's agent SIGKILLs itself (its worker dies with it); the
    leader records node 1 lost, names its rank, regroups, and finishes alone."""
    leader, killed = _pair(net, job_dir, "kill-agent node=1 step=20", 80)
    assert killed.wait(120) == -9, killed.output  # SIGKILL, as injected
    assert "injected: kill-agent" in killed.output
    assert leader.wait(120) == 0, leader.output
    _, fault = _node_1_lost(job_dir, "kill-agent")
    assert fault["cause"].startswith("lost"), fault
    steps = find(leader.lines, ElasticStep)
    assert max(s.step for s in steps) == 80 and steps[-1].world == 1


def test_cut_link_is_refused_outside_a_namespace_host(job_dir: Path) -> None:
    """This test process runs in the machine's own network namespace: the agent's check
    refuses, and ``ftrun inject`` never gets as far as a job (no job by that name)."""
    refusal = cut_link_refusal()
    assert refusal is not None and "named network namespace" in refusal
    done = subprocess.run([launcher(), "inject", "--job", "no-such-job", "cut-link",
                           "node=0", "for=nope"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "for must be a number of seconds" in done.stderr
