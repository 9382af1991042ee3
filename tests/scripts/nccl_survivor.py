"""A regroup member whose gradient collective is an NCCL call (the shim's NCCL test double).

Each member makes a 2-rank NCCL communicator of which only its own rank exists in the
process: its collective waits for a peer that never comes, exactly as a collective on a
dead peer does. It is called the way torch calls NCCL: the library is loaded RTLD_LOCAL,
the symbols resolve through the global scope, where the preloaded shim interposes them.
Only the agent's abort (through the shim) can release it. Prints one line when released.

    nccl_survivor.py VICTIM_RANK [--restart-first]

--restart-first: in the job's first attempt (TORCHELASTIC_RESTART_COUNT=0) the victim rank
exits non-zero before ``ftrun.init()``; a worker without the worker API failed, so the whole
job restarts, and the scenario runs in job generation 1.

--twice (with 3 or more ranks): a second fault in the next member epoch. There the member of
rank 1 hangs (a second ``victim`` line), and every other member blocks in an NCCL collective
on a communicator made in that epoch, after the first abort, so it belongs to a later comm
epoch of the shim than the first: only an abort of everything made so far releases it.

For the invariant checks of tests/lines.py each member also prints train_elastic.py's lines:
``step=`` for each committed step (loss 0: nothing is trained) and ``regroup`` after each
regroup, whose checksum is the number of steps this process applied: equal on every member
of a member epoch unless some member applied a step that others did not.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable

import torch

import ftrun
from ftrun.shim.fakenccl import UniqueId, load

os.environ.setdefault("FAKE_NCCL_BLOCK", "host")
nccl = load().nccl  # the shim's ncclX, which forwards to the test double
victim = int(sys.argv[1])
twice = "--twice" in sys.argv[2:]
if ("--restart-first" in sys.argv[2:] and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        and int(os.environ["RANK"]) == victim):
    print(f"failing before ftrun.init() pid={os.getpid()}", flush=True)
    sys.exit(3)
ft = ftrun.init()
unique = UniqueId()
assert nccl.ncclGetUniqueId(ctypes.byref(unique)) == 0
comm = ctypes.c_void_p()
assert nccl.ncclCommInitRank(ctypes.byref(comm), 2, unique, 0) == 0
buffer = torch.zeros(16)
applied = torch.zeros(1)  # steps this process applied: the regroup line's checksum


def block_in_a_fresh_communicator() -> None:
    """--twice, in member epoch 1: the same blocking call on a communicator of this epoch."""
    fresh_id, fresh = UniqueId(), ctypes.c_void_p()
    assert nccl.ncclGetUniqueId(ctypes.byref(fresh_id)) == 0
    assert nccl.ncclCommInitRank(ctypes.byref(fresh), 2, fresh_id, 0) == 0
    print(f"blocking in ncclAllReduce pid={os.getpid()}", flush=True)
    started = time.monotonic()
    code = nccl.ncclAllReduce(ctypes.c_void_p(buffer.data_ptr()),
                              ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(16),
                              7, 0, fresh, None)
    print(f"released code={code} after={time.monotonic() - started:.3f}", flush=True)
    if code != 0:
        raise RuntimeError(f"NCCL error {code}")


def compute() -> None:
    if ft.epoch == 0 and ft.rank == victim:
        print(f"victim pid={os.getpid()}", flush=True)
        while True:
            time.sleep(1)
    if ft.epoch == 0:
        print(f"blocking in ncclAllReduce pid={os.getpid()}", flush=True)
        started = time.monotonic()
        code = nccl.ncclAllReduce(ctypes.c_void_p(buffer.data_ptr()),
                                  ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(16),
                                  7, 0, comm, None)  # ncclFloat32, ncclSum, no stream
        print(f"released code={code} after={time.monotonic() - started:.3f}", flush=True)
        if code != 0:
            raise RuntimeError(f"NCCL error {code}")  # what torch raises for a failed call
    if twice and ft.epoch == 1 and ft.rank == 1:
        print(f"victim pid={os.getpid()}", flush=True)
        while True:
            time.sleep(1)
    if twice and ft.epoch == 1:
        block_in_a_fresh_communicator()


def say_regroup(rank: int, world: int) -> None:
    print(f"regroup epoch={ft.epoch} rank={rank} world={world} step={ft.step} "
          f"checksum={applied.item():.0f}", flush=True)


commit_or_abort = ft.run_step


def run_step_and_say(compute_step: Callable[[], None], apply: Callable[[], None]) -> None:
    """ft.run_step, and a step line when the step was committed (counted in ``applied``)."""
    epoch, rank, world, before = ft.epoch, ft.rank, ft.world_size, ft.step

    def apply_and_count() -> None:
        apply()
        applied.add_(1)

    commit_or_abort(compute_step, apply_and_count)
    if ft.step > before:
        print(f"step={ft.step} loss=0.0 rank={rank} pid={os.getpid()} t={time.time():.6f} "
              f"epoch={epoch} world={world}", flush=True)


ft.on_regroup(say_regroup)
ft.run_step = run_step_and_say  # type: ignore[method-assign]

while ft.step < 3:
    ft.run_step(compute, lambda: None)
print(f"finished generation={ft.epoch} world={ft.world_size} step={ft.step}", flush=True)
