"""Faster node-loss detection (ftrun/control/presence.py): a killed agent is lost at once,
a silent one only after the heartbeat timeout, a clean exit never.

* The presence layer with real processes, real sockets and real signals: a client process
  SIGKILLed is a verdict within a second; one SIGSTOPped keeps its connection and is not
  (then SIGKILLed while stopped, it is); one that says goodbye is a clean exit; a forged
  hello (wrong token), a replayed one (another connection's nonce), garbage and an
  over-long line are refused with one reason each and make no verdict.
* End to end on two namespace hosts with a 30 s heartbeat timeout: h2's agent SIGKILLs
  itself at step 20 (``--inject kill-agent``); the leader declares node 1 lost through its
  connection well under the timeout (< 10 s: the timeout cannot have done it), regroups
  and finishes alone. The silent case end to end (a cut link, a stopped host) is the
  heartbeat timeout's, unchanged and tested in test_observe_multinode.py and
  test_regroup_nccl.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrun.control.auth import Signer
from ftrun.control.presence import MAX_LINE, PresenceClient, PresenceError, PresenceServer
from tests.launch import REPO, wait_until
from tests.lines import ElasticStep, find
from tests.test_multinode import HostLaunch

TOKEN = b"detect-test-token"
HB_TIMEOUT_S = 30.0
#: Detection of a killed agent: its connection's end plus one leader scan (half a 1 s
#: interval) and a tick; measured well under a second. Under the timeout by 3x.
KILL_DETECT_S = 10.0

_CLIENT = """
import sys, time
from ftrun.control.auth import Signer
from ftrun.control.presence import PresenceClient
client = PresenceClient(Signer(sys.argv[1].encode()), "run", sys.argv[2], 5.0)
client.connect("127.0.0.1", int(sys.argv[3]))
print("connected", flush=True)
if sys.argv[4] == "bye":
    client.goodbye()
    print("said goodbye", flush=True)
else:
    time.sleep(120)
"""


def _client(port: int, node_id: str, mode: str = "hold") -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _CLIENT, TOKEN.decode(), node_id, str(port),
                             mode], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None and proc.stdout.readline() == "connected\n"
    return proc


def _raw_hello(port: int) -> socket.socket:
    """A raw connection past the server's nonce line."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert len(json.loads(sock.recv(MAX_LINE).split(b"\n")[0])["nonce"]) == 32
    return sock


def test_presence_verdicts_kill_stop_goodbye_and_refusals() -> None:
    refused: list[str] = []
    server = PresenceServer(Signer(TOKEN), "run", "127.0.0.1", on_reject=refused.append).start()
    procs: list[subprocess.Popen[str]] = []
    try:
        killed, stopped = _client(server.port, "killed"), _client(server.port, "stopped")
        procs += [killed, stopped]
        leaver = _client(server.port, "leaver", "bye")
        procs.append(leaver)
        assert leaver.wait(10) == 0
        wait_until(lambda: "leaver" in server.left(), 5, "the goodbye")
        assert server.connected() == {"killed", "stopped"}
        # SIGKILL: the kernel closes the socket; the verdict comes at once.
        t0 = time.monotonic()
        killed.kill()
        wait_until(lambda: "killed" in server.gone(), 5, "the killed client's verdict")
        print(f"SIGKILL to verdict: {time.monotonic() - t0:.3f} s")
        # SIGSTOP: the connection stays open and quiet: no verdict (that is the heartbeat
        # timeout's). Then SIGKILL while stopped: the kernel closes it all the same.
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert "stopped" not in server.gone(), server.gone()
            time.sleep(0.05)
        stopped.kill()
        wait_until(lambda: "stopped" in server.gone(), 5, "the stopped-then-killed verdict")
        assert "leaver" not in server.gone() and server.left() == {"leaver"}

        # Refusals: none is a verdict, each says why in one line.
        forged = PresenceClient(Signer(b"not-the-token"), "run", "victim", 5.0)
        with pytest.raises(PresenceError, match="bad MAC"):
            forged.connect("127.0.0.1", server.port)
        sock = _raw_hello(server.port)  # a hello signed for another connection
        replay = Signer(TOKEN).line("ftrun/run/presence", {"node_id": "victim", "nonce": "0" * 32})
        sock.sendall(replay.encode() + b"\n")
        assert b"wrong nonce" in sock.recv(MAX_LINE)
        sock.close()
        for junk in (b"{not json\n", b"x" * (MAX_LINE + 10)):
            sock = _raw_hello(server.port)
            sock.sendall(junk)
            assert b'"ok": false' in sock.recv(MAX_LINE)
            sock.close()
        # A valid hello for another run's key is refused too.
        other = PresenceClient(Signer(TOKEN), "another-run", "victim", 5.0)
        with pytest.raises(PresenceError, match="refused"):
            other.connect("127.0.0.1", server.port)
        wait_until(lambda: len(refused) >= 5, 5, "five refusals")
        assert all("\n" not in r and r.startswith("presence: refused") for r in refused), refused
        assert "victim" not in server.gone() and "victim" not in server.connected()
        assert set(server.gone()) == {"killed", "stopped"}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        server.close()


@pytest.fixture
def net(infra_leak_check, netns_network):  # type: ignore[no-untyped-def]
    return netns_network


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_killed_agent_is_lost_well_before_the_heartbeat_timeout(job_dir: Path, net) -> None:  # type: ignore[no-untyped-def]
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    env = {"GLOO_SOCKET_IFNAME": "eth0", "FTRUN_JOB_TOKEN": TOKEN.decode()}
    nodes = []
    for host in (net["h1"], net["h2"]):
        args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{net['h1'].addr}:29400", "--rdzv-id", "detect",
                "--rdzv-conf", "last_call_timeout=5", "--heartbeat-interval", "1",
                "--heartbeat-timeout", str(HB_TIMEOUT_S), "--recovery", "regroup",
                "--events-file", str(job_dir / f"events-{host.name}.jsonl"),
                "--inject", "kill-agent node=1 step=20", "--local-addr", host.addr,
                str(script), "--steps", "60", "--hidden", "32", "--step-sleep", "0.05"]
        nodes.append(HostLaunch(host, args, env=env, cwd=job_dir))
    leader, killed = nodes
    assert killed.wait(120) == -9, killed.output
    assert leader.wait(120) == 0, leader.output
    (inject,) = [e for e in _events(job_dir / "events-h2.jsonl") if e["event"] == "inject"]
    leader_events = _events(job_dir / "events-h1.jsonl")
    (lost,) = [e for e in leader_events if e["event"] == "node_lost"]
    (fault,) = [e for e in leader_events if e["event"] == "fault"]
    detected = fault["detected"] - inject["ts"]
    print(f"kill-agent to the leader's verdict: {detected:.2f} s "
          f"(heartbeat timeout {HB_TIMEOUT_S:.0f} s)")
    assert lost["via"] == "connection" and lost["node_rank"] == 1, lost
    assert 0 < detected < KILL_DETECT_S, (detected, fault)
    assert fault["path"] == "regroup" and fault["ranks"] == [1] and fault["world"] == 1, fault
    assert "connection closed without a goodbye" in leader.output
    steps = find(leader.lines, ElasticStep)
    assert max(s.step for s in steps) == 60 and steps[-1].world == 1
