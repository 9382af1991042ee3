"""A member epoch's backend connections, recorded as it is built and shut down by hand
(ftrun.worker.sockets.opened, the worker API's _retire_backend): a peer blocked in a
collective on this process fails at once, while this process still holds the backend (its
destructor, which would close them, comes seconds later on a loaded node). Two real
processes, a real TCPStore and real gloo groups."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.launch import REPO, free_port

PEER = r"""
import sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from ftrun.worker import group, sockets

rank, port, cut = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "cut"
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
with sockets.opened() as made:
    backend = group.make_backend(dist.PrefixStore("epoch3", store), rank, 2,
                                 timedelta(seconds=60))
if rank == 1:
    store.wait(["waiting"], timedelta(seconds=30))
    if cut:
        shut = sockets.shutdown_connections(lambda own, peer: (own, peer) in made)
        print(f"shut {shut} of {len(made)}", flush=True)
    store.wait(["done"], timedelta(seconds=90))  # holds the backend until rank 0 is done
else:
    store.set("waiting", "1")
    started = time.monotonic()
    try:
        backend.allreduce([torch.ones(1)]).wait()
        print("completed", flush=True)
    except RuntimeError:
        print(f"failed after {time.monotonic() - started:.1f}s", flush=True)
    store.set("done", "1")
"""


def _run_pair(cut: bool, timeout_s: float) -> tuple[str, str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", PEER, str(rank), str(port),
                               "cut" if cut else "keep"], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    return outputs[0], outputs[1]


def test_shutting_the_recorded_connections_releases_a_peer_in_a_collective() -> None:
    started = time.monotonic()
    try:
        waiter, cutter = _run_pair(cut=True, timeout_s=45)
    except subprocess.TimeoutExpired:
        raise AssertionError("the peer in the collective was not released within 45 s "
                             "(its collective timeout is 60 s)") from None
    assert "failed after" in waiter, waiter
    assert cutter.startswith("shut ") and not cutter.startswith("shut 0 "), cutter
    # released at once, not at the collective's 60 s timeout
    assert time.monotonic() - started < 30, (waiter, cutter)


def test_without_the_cut_the_peer_waits() -> None:
    """The control: the same pair without the cut does not fail within 8 s (the peer holds
    its backend): what releases the waiter above is the cut, nothing else."""
    try:
        _run_pair(cut=False, timeout_s=8)
    except subprocess.TimeoutExpired:
        return
    raise AssertionError("the waiter finished without the cut")
