"""Hot spare nodes (``--standby-nodes``) and the health gate, on namespace hosts.

One job, five hosts, ``--nnodes 2 --standby-nodes 2``, one worker per node, in-process
regroup (scripts/train_elastic.py, the DDP ``run_step`` path):

* h5's agent runs with ``GLOO_SOCKET_IFNAME=bogus0`` (an interface that does not exist:
  every gloo group of its workers would fail): its health gate (the quick doctor checks,
  ftrun/doctor/gate.py) fails, it exits 3 with one line, and the leader says why in its
  console and in a ``refused`` event (``at: join``); the job forms without it;
* h2, h3 and h4 run gloo over a second interface of their own, ``gate0`` (a veth into the
  same bridge, its own address). Of them, the first to arrive is the active node 1; the
  other two stand by as nodes 2 and 3: their workers start (torch imported) and wait as
  spares, with no rank;
* the test deletes node 2's ``gate0`` (its workers' gloo interface is gone: promoted, they
  would fail), then SIGKILLs node 1 (agent and worker). The leader declares it lost through
  its presence connection, in well under 10 s with a 30 s heartbeat timeout (so not by the
  timeout). Both standbys run their health gate again after the member epoch ended: node
  2's fails, and the leader refuses it (its console, a ``refused`` event with ``at:
  promotion``; node 2 says it too); node 3's worker takes the lost rank and receives the
  state as a joiner does, and the world stays 2. tests/lines.py's regroup invariants hold
  (one checksum per member generation, consecutive steps for the survivor, a world of 2
  after the regroup), and the job finishes with both ranks done on one set of parameters;
  the refused standby ends with the job, exit 0.

It prints the time from the kill to the first step of the new world of 2. A second, cheap
test checks that the gate is ``ftrun doctor --quick``'s subset and what it reports.
"""

from __future__ import annotations

import json
import os
import re
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
#: ~0.2 s), the standbys' health gates, the regroup and the state sent to the joiner; a few
#: seconds here under load. 10x the issue's 3 s goal fails.
KILL_TO_STEP_S = 30.0
#: A heartbeat timeout no detection in this test may wait for: the SIGKILLed node is lost
#: through its presence connection (ftrun/control/presence.py), measured ~0.2 s; < 10 s
#: proves the timeout did not do it.
HB_TIMEOUT_S = 30.0
KILL_DETECT_S = 10.0
GATE_IF = "gate0"


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _add_gate_interface(net, host, number: int) -> str:  # type: ignore[no-untyped-def]
    """A second interface in ``host``, ``gate0``: a veth into the network's bridge with an
    address of its own on the /24 (the host's namespace owns it: deleting the namespace
    deletes it and its bridge end). Returns its address."""
    addr = f"{net.subnet}.{100 + number}"
    port = f"vg{number}"
    _ip("-n", net.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", GATE_IF,
        "netns", host.netns)
    _ip("-n", net.bridge_ns, "link", "set", port, "master", "br0")
    _ip("-n", net.bridge_ns, "link", "set", port, "up")
    _ip("-n", host.netns, "addr", "add", f"{addr}/24", "dev", GATE_IF)
    _ip("-n", host.netns, "link", "set", GATE_IF, "up")
    return addr


def _node_rank(node: HostLaunch) -> int:
    said = next(x for x in node.lines if re.search(r"joined generation \d+ as node \d+", x))
    return int(re.search(r"as node (\d+)", said)[1])  # type: ignore[index]


def test_a_standby_node_takes_a_lost_nodes_ranks_and_failing_nodes_are_refused(  # type: ignore[no-untyped-def]
        job_dir: Path, infra_leak_check, netns_factory) -> None:
    net = netns_factory(5)
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    nodes: dict[str, HostLaunch] = {}
    for number, host in enumerate(net, start=1):
        ifname = {"h1": "eth0", "h5": "bogus0"}.get(host.name, GATE_IF)
        if ifname == GATE_IF:
            _add_gate_interface(net, host, number)
        args = ["--nnodes", "2", "--standby-nodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net['h1'].addr}:29400",
                "--rdzv-id", "standby", "--rdzv-conf", "last_call_timeout=10",
                "--heartbeat-interval", "1", "--heartbeat-timeout", str(HB_TIMEOUT_S),
                "--recovery", "regroup", "--local-addr", host.addr,
                "--events-file", str(job_dir / f"events-{host.name}.jsonl"),
                str(script), "--steps", str(STEPS), "--hidden", "32", "--step-sleep", "0.05"]
        nodes[host.name] = HostLaunch(host, args, env={"GLOO_SOCKET_IFNAME": ifname,
                                                      "FTRUN_JOB_TOKEN": TOKEN}, cwd=job_dir)
    leader, refused = nodes["h1"], nodes["h5"]
    leader.wait_for(lambda lines: len(find(lines, ElasticStep)) >= 10, 180, "steps")
    standbys = sorted((n for n in ("h2", "h3", "h4") if any(
        "standing by" in x for x in nodes[n].lines)), key=lambda n: _node_rank(nodes[n]))
    assert len(standbys) == 2, {n: nodes[n].output[-2000:] for n in ("h2", "h3", "h4")}
    (active_name,) = {"h2", "h3", "h4"} - set(standbys)
    active, broken, standby = nodes[active_name], nodes[standbys[0]], nodes[standbys[1]]
    assert [_node_rank(active), _node_rank(broken), _node_rank(standby)] == [1, 2, 3]
    active.wait_for(lambda lines: len(find(lines, ElasticStep)) >= 10, 60, "steps on node 1")
    assert not find(standby.lines + broken.lines, ElasticStep), "a standby stepped before any loss"
    # Node 2, the standby the leader would promote first, loses its gloo interface.
    _ip("-n", broken.host.netns, "link", "del", GATE_IF)
    before = {s.pid: s.step for s in find(leader.lines, ElasticStep)}
    killed = time.time()
    active.kill()
    standby.wait_for(lambda lines: any(s.world == 2 for s in find(lines, ElasticStep)), 120,
                     "node 3's worker stepping in the world of 2")
    first = min(s.t for s in find(standby.lines, ElasticStep))
    print(f"node SIGKILLed to the standby's first step: {first - killed:.2f} s")
    assert first - killed < KILL_TO_STEP_S, first - killed
    assert leader.wait(180) == 0, leader.output[-3000:]
    assert standby.wait(60) == 0, standby.output[-3000:]
    assert broken.wait(60) == 0, broken.output[-3000:]
    assert not find(broken.lines, ElasticStep), broken.output[-3000:]
    records = [*parse(leader.lines, origin="leader"), *parse(standby.lines, origin="standby")]
    check_regroup_invariants(records, survivors=before, world=2, finished=STEPS)
    out = leader.output + standby.output + broken.output
    assert "restarting" not in out, out[-3000:]
    # The health gate at the join: h5 left with one line; the leader said why, once, in its
    # console and its event log (a namespace host's hostname is the machine's: told by
    # address).
    assert refused.wait(60) == 3, refused.output
    assert "failed its health gate, not joining: net.gloo_ifname" in refused.output
    (line,) = [x for x in leader.lines if "failed its health gate:" in x]
    assert f"({net['h5'].addr}) refused" in line and "bogus0" in line, line
    leader_events = _events(job_dir / "events-h1.jsonl")
    (gate,) = [e for e in leader_events if e["event"] == "refused" and e["at"] == "join"]
    assert gate["addr"] == net["h5"].addr and "bogus0" in gate["detail"], gate
    # The health gate at promotion: node 2 failed it after the member epoch ended, said so,
    # and the leader refused it once (console and event); node 3 took the rank.
    assert f"failed its health gate after member epoch 0 ended, so it takes no lost " \
        f"node's ranks: net.gloo_ifname: GLOO_SOCKET_IFNAME={GATE_IF}" in broken.output, \
        broken.output[-3000:]
    (line,) = [x for x in leader.lines if "health gate when promoted from standby" in x]
    assert f"({broken.host.addr}) refused" in line and GATE_IF in line, line
    (gate,) = [e for e in leader_events if e["event"] == "refused" and e["at"] == "promotion"]
    assert gate["node_rank"] == 2 and gate["addr"] == broken.host.addr, gate
    assert f"GLOO_SOCKET_IFNAME={GATE_IF}" in gate["detail"], gate
    (lost,) = [e for e in leader_events if e["event"] == "node_lost"]
    assert lost["via"] == "connection" and lost["node_rank"] == 1, lost
    print(f"SIGKILL to the leader's verdict: {lost['ts'] - killed:.2f} s "
          f"(heartbeat timeout {HB_TIMEOUT_S:.0f} s); to the refusal: "
          f"{gate['ts'] - killed:.2f} s")
    assert 0 < lost["ts"] - killed < KILL_DETECT_S, (lost, killed)
    epochs = [e for e in leader_events if e["event"] == "epoch"]
    assert [e["world_size"] for e in epochs] == [2, 2], epochs  # never a world of 1
    assert epochs[-1]["joiners"] and epochs[-1]["joiners"][0].startswith("3."), epochs


def test_each_spare_gets_a_local_rank_of_its_own() -> None:
    """Spares no longer all get LOCAL_RANK 0 (each would take cuda:0 on a GPU): a node
    starts its members at the lowest local rank its live members do not hold
    (ftrun/agent/regroup.py ``free_local_rank``): the initial workers 0..N-1, then the
    spares N, N+1; a standby node's spares 0, 1, ... (the ranks of the workers they stand
    in for on a node like it); a replacement the one its failed member freed."""
    from ftrun.agent.regroup import free_local_rank

    held: list[int] = []
    for _ in range(4):  # --nproc-per-node 2 --spares 2, or a standby with 4 spares
        held.append(free_local_rank(held))
    assert held == [0, 1, 2, 3]
    held.remove(1)  # local rank 1's worker failed: its replacement takes 1 again
    assert free_local_rank(held) == 1
    assert free_local_rank([]) == 0


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
