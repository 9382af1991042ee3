"""Hot spare nodes (``--standby-nodes``) and the health gate, on namespace hosts.

One job, four hosts, ``--nnodes 2 --standby-nodes 1``, one worker per node, in-process
regroup (scripts/train_elastic.py, the DDP ``run_step`` path):

* h4's agent runs with ``GLOO_SOCKET_IFNAME=bogus0`` (an interface that does not exist:
  every gloo group of its workers would fail): its health gate (the quick doctor checks,
  ftrun/doctor/gate.py) fails, it exits 3 with one line, and the leader says why in its
  console and in a ``refused`` event; the job forms without it;
* of h2 and h3, the one that arrived second stands by: its worker starts (torch imported)
  and waits as a spare, with no rank;
* the active non-leader host is SIGKILLed (agent and worker): the leader declares it lost
  through its presence connection, in well under 10 s with a 30 s heartbeat timeout (so
  not by the timeout), the standby's worker takes its rank and receives the
  state as a joiner does, and the world stays 2; tests/lines.py's regroup invariants hold
  (one checksum per member generation, consecutive steps for the survivor, a world of 2
  after the regroup), and the job finishes with both ranks done on one set of parameters.

It prints the time from the kill to the first step of the new world of 2. A second, cheap
test checks that the gate is ``ftrun doctor --quick``'s subset and what it reports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from ftrun.doctor.gate import health_gate, quick_check_names
from tests.launch import REPO, launcher
from tests.lines import ElasticStep, check_regroup_invariants, find, parse
from tests.test_multinode import HostLaunch

TOKEN = "standby-test-token"
STEPS = 80
#: From the kill to the standby's first step in the world of 2: detection (its connection,
#: ~0.2 s), the regroup and the state sent to the joiner; a few seconds here under load.
#: 10x the issue's 3 s goal fails.
KILL_TO_STEP_S = 30.0
#: A heartbeat timeout no detection in this test may wait for: the SIGKILLed node is lost
#: through its presence connection (ftrun/control/presence.py), measured ~0.2 s; < 10 s
#: proves the timeout did not do it.
HB_TIMEOUT_S = 30.0
KILL_DETECT_S = 10.0


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_standby_node_takes_a_lost_nodes_ranks_and_a_failing_node_is_refused(  # type: ignore[no-untyped-def]
        job_dir: Path, infra_leak_check, netns_factory) -> None:
    net = netns_factory(4)
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    nodes: dict[str, HostLaunch] = {}
    for host in net:
        args = ["--nnodes", "2", "--standby-nodes", "1", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net['h1'].addr}:29400",
                "--rdzv-id", "standby", "--rdzv-conf", "last_call_timeout=5",
                "--heartbeat-interval", "1", "--heartbeat-timeout", str(HB_TIMEOUT_S),
                "--recovery", "regroup", "--local-addr", host.addr,
                "--events-file", str(job_dir / f"events-{host.name}.jsonl"),
                str(script), "--steps", str(STEPS), "--hidden", "32", "--step-sleep", "0.05"]
        ifname = "bogus0" if host.name == "h4" else "eth0"
        nodes[host.name] = HostLaunch(host, args, env={"GLOO_SOCKET_IFNAME": ifname,
                                                      "FTRUN_JOB_TOKEN": TOKEN}, cwd=job_dir)
    leader, refused = nodes["h1"], nodes["h4"]
    # Which of h2, h3 stands by: the one that says so.
    leader.wait_for(lambda lines: len(find(lines, ElasticStep)) >= 10, 180, "steps")
    standby_name = next(n for n in ("h2", "h3") if any(
        "standing by" in x for x in nodes[n].lines))
    active = nodes["h3" if standby_name == "h2" else "h2"]
    standby = nodes[standby_name]
    active.wait_for(lambda lines: len(find(lines, ElasticStep)) >= 10, 60, "steps on node 1")
    assert not find(standby.lines, ElasticStep), "the standby stepped before any loss"
    before = {s.pid: s.step for s in find(leader.lines, ElasticStep)}
    killed = time.time()
    active.kill()
    standby.wait_for(lambda lines: any(s.world == 2 for s in find(lines, ElasticStep)), 120,
                     "the standby's worker stepping in the world of 2")
    first = min(s.t for s in find(standby.lines, ElasticStep))
    print(f"node SIGKILLed to the standby's first step: {first - killed:.2f} s")
    assert first - killed < KILL_TO_STEP_S, first - killed
    assert leader.wait(180) == 0, leader.output[-3000:]
    assert standby.wait(60) == 0, standby.output[-3000:]
    records = [*parse(leader.lines, origin="leader"), *parse(standby.lines, origin="standby")]
    check_regroup_invariants(records, survivors=before, world=2, finished=STEPS)
    out = leader.output + standby.output
    assert "restarting" not in out, out[-3000:]
    # The health gate: h4 left with one line; the leader said why, once, in its console
    # and its event log (a namespace host's hostname is the machine's: told by address).
    assert refused.wait(60) == 3, refused.output
    assert "failed its health gate, not joining: net.gloo_ifname" in refused.output
    (line,) = [x for x in leader.lines if "failed its health gate" in x]
    assert f"({net['h4'].addr}) refused" in line and "bogus0" in line, line
    leader_events = _events(job_dir / "events-h1.jsonl")
    (gate,) = [e for e in leader_events if e["event"] == "refused"]
    assert gate["addr"] == net["h4"].addr and "bogus0" in gate["detail"], gate
    (lost,) = [e for e in leader_events if e["event"] == "node_lost"]
    assert lost["via"] == "connection" and lost["node_rank"] == 1, lost
    print(f"SIGKILL to the leader's verdict: {lost['ts'] - killed:.2f} s "
          f"(heartbeat timeout {HB_TIMEOUT_S:.0f} s)")
    assert 0 < lost["ts"] - killed < KILL_DETECT_S, (lost, killed)
    epochs = [e for e in leader_events if e["event"] == "epoch"]
    assert [e["world_size"] for e in epochs] == [2, 2], epochs  # never a world of 1
    assert epochs[-1]["joiners"] and epochs[-1]["joiners"][0].startswith("2."), epochs


def test_the_gate_is_doctors_quick_subset_and_names_what_failed() -> None:
    """``ftrun doctor --quick`` runs exactly the gate's checks (ftrun/doctor/gate.py), in
    well under its 1 s budget here, and a bogus GLOO_SOCKET_IFNAME fails it, exit 1; the
    agent's gate gives the same failure as one line per check."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "bogus0"}
    env.pop("NCCL_SOCKET_IFNAME", None)
    done = subprocess.run([launcher(), "doctor", "--quick", "--json"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 1, (done.stdout, done.stderr)
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == set(quick_check_names(env)), checks
    assert checks["net.gloo_ifname"]["status"] == "fail", checks
    assert [c for c in checks if checks[c]["status"] == "fail"] == ["net.gloo_ifname"]
    assert all(c["elapsed_s"] < 1.0 for c in checks.values()), checks
    (failure,) = health_gate(env)
    assert failure.startswith("net.gloo_ifname: GLOO_SOCKET_IFNAME=bogus0"), failure
    assert health_gate({**env, "GLOO_SOCKET_IFNAME": "lo"}) == []
