"""Faster node-loss detection (ftrun/control/presence.py): a killed agent is lost at once,
a silent one only after the heartbeat timeout, a clean exit never.

* The presence layer with real processes, real sockets and real signals: a client process
  SIGKILLed is a verdict within a second; one SIGSTOPped keeps its connection and is not
  (then SIGKILLed while stopped, it is); one that says goodbye is a clean exit; a forged
  hello (wrong token), a replayed one (another connection's nonce), garbage and an
  over-long line are refused with one reason each and make no verdict.
* End to end (tests/test_standby.py, one job for both features): with a 30 s heartbeat
  timeout, a SIGKILLed node is declared lost through its connection in well under 10 s.
  The silent case end to end (a cut link, a stopped host) is the heartbeat timeout's,
  unchanged and tested in test_observe_multinode.py and test_regroup_nccl.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ftrun.control.auth import Signer
from ftrun.control.presence import MAX_LINE, PresenceClient, PresenceError, PresenceServer
from tests.launch import REPO, wait_until

TOKEN = b"detect-test-token"
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
