"""Hot spare nodes (``--standby-nodes``) on the etcd-v3 backend, on namespace hosts.

A 3-member etcd cluster (one member on each of h1..h3) and four ftrun nodes, one per host,
``--nnodes 2 --standby-nodes 2``, one worker each, in-process regroup
(scripts/train_elastic.py). Two of the nodes are active (ranks 0 and 1), two stand by
(nodes 2 and 3: their workers started, torch imported, no rank). Two faults in one run:

1. the active node whose agent is not the job's writer is SIGKILLed (agent and worker):
   the writer declares it lost through its presence connection, standby node 2 passes its
   health gate and its worker takes the lost rank, receiving the state as a joiner does;
   the world stays 2;
2. the writer's own node is SIGKILLed: no store host is left, so a survivor revokes the
   dead writer's lease, one agent takes the writer's key and serves a new member-epoch
   store, and standby node 3's worker takes the second lost rank from that new writer;
   the world stays 2 again.

tests/lines.py's regroup invariants hold across the nodes that stepped (one checksum per
member epoch, consecutive steps, no restart), and the job finishes with every survivor
exiting 0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from tests.infra.etcd_cluster import etcd_missing_reason
from tests.infra.netns import NetnsHost
from tests.launch import REPO, launcher
from tests.lines import ElasticStep, check_regroup_invariants, find, parse
from tests.test_multinode import HostLaunch

pytestmark = pytest.mark.skipif(etcd_missing_reason() is not None,
                                reason=etcd_missing_reason() or "")

TOKEN = "etcd-standby-test-token"
RUN_ID = "etcdstandby"
STEPS = 150
#: The job holds at these steps (scripts/train_elastic.py --hold-at-step) until the test has
#: made the fault that comes before them: under CI load the job once reached step 150 before
#: the writer's node was killed. A fault made while the others hold is seen when they are let
#: go: the lost rank's peer then meets the loss in its next collective.
HOLD_BEFORE_FAULT_1, HOLD_BEFORE_FAULT_2 = 30, 140
HB_TIMEOUT_S = 5.0
#: From a kill to the promoted standby's first step in the world of 2: detection (~0.2 s by
#: the presence connection), the standbys' health gates, a writer takeover for the second
#: fault, the regroup and the state sent; seconds here under load. 10x the issue's 3 s.
KILL_TO_STEP_S = 30.0


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _node_rank(node: HostLaunch) -> int:
    said = next(x for x in node.lines if re.search(r"joined generation \d+ as node \d+", x))
    return int(re.search(r"as node (\d+)", said)[1])  # type: ignore[index]


def _reached(nodes: Iterable[HostLaunch]) -> dict[int, int]:
    """pid -> the last step each stepping worker of ``nodes`` printed so far."""
    return {s.pid: s.step for n in nodes for s in find(n.lines, ElasticStep)}


def _wait_promoted(standby: HostLaunch, killed: float, what: str) -> None:
    """Wait for ``standby``'s worker to step in a world of 2; print and bound the time from
    the kill (``time.time()``) to its first step."""
    standby.wait_for(lambda lines: any(s.world == 2 for s in find(lines, ElasticStep)), 120,
                     f"{standby.host.name}'s promoted worker stepping in the world of 2")
    first = min(s.t for s in find(standby.lines, ElasticStep))
    print(f"{what} node SIGKILLed to {standby.host.name}'s promoted worker's first step: "
          f"{first - killed:.2f} s")
    assert first - killed < KILL_TO_STEP_S, first - killed


def _ftrun(host: NetnsHost, *args: str) -> subprocess.CompletedProcess[str]:
    """``ftrun ARGS`` inside ``host`` with the job's token (a command of a person there)."""
    return host.run([launcher(), *args], timeout=60,
                    env={**os.environ, "FTRUN_JOB_TOKEN": TOKEN})


def _status(host: NetnsHost, job: str, until: Callable[[dict], bool]) -> dict:
    """``ftrun status --json JOB`` from ``host`` until ``until(record)`` (30 s)."""
    deadline = time.monotonic() + 30
    while True:
        done = _ftrun(host, "status", "--json", job)
        assert done.returncode == 0, (done.stdout, done.stderr)
        record = json.loads(done.stdout)
        if until(record):
            return record
        assert time.monotonic() < deadline, record
        time.sleep(0.2)


def test_standbys_take_a_lost_nodes_ranks_and_the_lost_writers_on_etcd(  # type: ignore[no-untyped-def]
        job_dir: Path, etcd_net) -> None:
    net, cluster = etcd_net
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    holds = job_dir / "holds"
    holds.mkdir()
    nodes: dict[str, HostLaunch] = {}
    try:
        for host in net:
            args = ["--nnodes", "2", "--standby-nodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", cluster.endpoints,
                    "--rdzv-id", RUN_ID, "--rdzv-conf", "last_call_timeout=10",
                    "--heartbeat-interval", "0.5", "--heartbeat-timeout", str(HB_TIMEOUT_S),
                    "--recovery", "regroup", "--local-addr", host.addr,
                    "--events-file", str(job_dir / f"events-{host.name}.jsonl"),
                    str(script), "--steps", str(STEPS), "--hidden", "32", "--step-sleep", "0.05",
                    "--hold-at-step", str(HOLD_BEFORE_FAULT_1),
                    "--hold-at-step", str(HOLD_BEFORE_FAULT_2), "--hold-dir", str(holds)]
            nodes[host.name] = HostLaunch(host, args, env={"GLOO_SOCKET_IFNAME": "eth0",
                                                          "FTRUN_JOB_TOKEN": TOKEN}, cwd=job_dir)
        for node in nodes.values():
            node.wait_for(lambda lines: any(re.search(r"joined generation \d+ as node", x)
                                            for x in lines), 180, "every node in the generation")
        by_rank = {_node_rank(n): n for n in nodes.values()}
        assert sorted(by_rank) == [0, 1, 2, 3], {k: v.host.name for k, v in by_rank.items()}
        for rank in (0, 1):
            by_rank[rank].wait_for(lambda lines: len(find(lines, ElasticStep)) >= 10, 180,
                                   f"steps on node {rank}")
        assert not find(by_rank[2].lines + by_rank[3].lines, ElasticStep), \
            "a standby stepped before any loss"
        writer, victim = by_rank[0], by_rank[1]  # the writer forms generations as node 0
        assert any("job's writer (elected" in x for x in writer.lines), writer.output[-2000:]
        # Fault 1: the active node that is not the writer's, its agent SIGKILLed by `ftrun
        # inject` (its worker dies with it), named by its run id on a node's host
        reached_at = _reached([writer])
        sent = _ftrun(by_rank[3].host, "inject", "--job", RUN_ID, "kill-agent", "node=1")
        assert sent.returncode == 0 and "sent: kill-agent node=1" in sent.stdout, sent
        victim.wait_for(lambda lines: any("injected: kill-agent" in x for x in lines), 60,
                        "node 1's agent executing the request")
        (holds / str(HOLD_BEFORE_FAULT_1)).touch()
        (injected,) = [e for e in _events(job_dir / f"events-{victim.host.name}.jsonl")
                       if e["event"] == "inject"]
        _wait_promoted(by_rank[2], injected["ts"], "non-writer")
        url = f"etcd-v3://{cluster.endpoints}/{RUN_ID}"  # the same job, named by its cluster
        job = _status(by_rank[3].host, url, lambda job: job["epoch"] >= 1)
        assert job["backend"] == "etcd-v3" and job["host"] == writer.host.addr, job
        assert job["endpoint"] == f"etcd at {cluster.endpoints} (run id {RUN_ID})", job
        assert job["world_size"] == 2, job
        for node in (writer, by_rank[2]):  # both go on in the new world before the next fault
            node.wait_for(lambda lines: sum(s.world == 2 and s.epoch > 0
                                            for s in find(lines, ElasticStep)) >= 3, 60,
                          f"{node.host.name} stepping after the first fault")
        # Fault 2: the writer's node, with the store of the member epochs.
        live = [n for n in nodes.values() if n is not victim]
        marks = {n.host.name: len(n.lines) for n in live}
        reached_at = {**_reached([by_rank[2]]), **reached_at}
        killed = time.time()
        writer.kill()
        (holds / str(HOLD_BEFORE_FAULT_2)).touch()
        _wait_promoted(by_rank[3], killed, "writer")
        survivors = [by_rank[2], by_rank[3]]
        took = [n for n in survivors if any("took over" in x
                                            for x in n.lines[marks[n.host.name]:])]
        assert len(took) == 1, {n.host.name: n.output[-2000:] for n in survivors}
        # ftrun status: the new writer keeps the job's record now (from the run id's
        # registration, on a live node's host: the dead writer's entry names nothing)
        job = _status(by_rank[2].host, RUN_ID, lambda job: job["host"] == took[0].host.addr)
        assert job["world_size"] == 2 and job["age_s"] < 5, job
        for node in survivors:
            assert node.wait(180) == 0, node.output[-3000:]
        records = [r for n in nodes.values() for r in parse(n.lines, origin=n.host.name)]
        check_regroup_invariants(records, survivors=reached_at, world=2, finished=STEPS)
        out = "\n".join(n.output for n in survivors)
        assert "restarting" not in out, out[-3000:]
        worlds = [e["world_size"] for n in nodes.values()
                  for e in _events(job_dir / f"events-{n.host.name}.jsonl")
                  if e["event"] == "epoch"]
        assert worlds and set(worlds) == {2}, worlds  # never a world of 1
    finally:
        for node in nodes.values():
            node.kill()
