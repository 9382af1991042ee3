"""A member epoch's default group after a build that failed (ftrun.worker.reentry.
forget_group_names): a survivor whose last build failed and a fresh replacement meet under
the same group name. Two real processes, a real TCPStore, real gloo groups; the survivor
leaves the failed epoch as ``ftrun.restartable`` does (destroy, then the reset)."""

from __future__ import annotations

import subprocess
import sys

from tests.launch import REPO, free_port

PEER = r"""
import contextlib, sys, time
from datetime import timedelta
import torch.distributed as dist
from ftrun.worker.reentry import forget_group_names

rank, port, survivor, reset = int(sys.argv[1]), int(sys.argv[2]), *(a == "1" for a in sys.argv[3:5])
client = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
if survivor:  # its epoch 6 build failed: the peer it waited for died
    with contextlib.suppress(Exception):
        dist.init_process_group("gloo", store=dist.PrefixStore("rgen/6/pg", client), rank=0,
                                world_size=2, timeout=timedelta(seconds=1))
    with contextlib.suppress(RuntimeError, ValueError, AssertionError):
        dist.destroy_process_group()
    if reset:
        forget_group_names()
started = time.monotonic()
try:
    dist.init_process_group("gloo", store=dist.PrefixStore("rgen/8/pg", client), rank=rank,
                            world_size=2, timeout=timedelta(seconds=8))
    print(f"built in {time.monotonic() - started:.1f}s", flush=True)
    dist.destroy_process_group()
except Exception as error:
    print(f"failed after {time.monotonic() - started:.1f}s: {str(error)[:80]}", flush=True)
"""


def _pair(reset: bool) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", PEER, str(rank), str(port),
                               "1" if rank == 0 else "0", "1" if reset else "0"],
                              cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for rank in (0, 1)]
    try:
        return [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def test_a_survivor_of_a_failed_build_and_a_fresh_peer_meet_under_one_name() -> None:
    survivor, fresh = _pair(reset=True)
    assert "built in" in survivor and "built in" in fresh, (survivor, fresh)


def test_without_the_reset_they_wait_for_each_other_until_the_timeout() -> None:
    """The control: torch's own behaviour, what the reset is for (if a torch release
    numbered groups afresh by itself, this fails and the reset can go)."""
    survivor, fresh = _pair(reset=False)
    assert "failed after" in survivor and "failed after" in fresh, (survivor, fresh)
