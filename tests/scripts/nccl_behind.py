"""A script written for torchrun (no worker API) that uses NCCL as torch does on a GPU, on CPU.

Each rank is its own process and calls NCCL through the preloaded shim (the shim's NCCL
test double, its ranks sharing a clique across processes: FAKE_NCCL_SHARED_DIR). Every step
queues one all-reduce on a stream and waits in the stream's synchronisation, which spins as
CUDA's does (FAKE_NCCL_SYNC=spin): a rank waiting for a peer looks busy and sits in its own
code, never in torch's communication.

* First attempt: rank 1 stops issuing collectives at step 5 (it sleeps in its own code);
  rank 0 issues all-reduce #5 and spins. Only the shim's per-communicator counts can say
  that rank 1 is the one rank 0 waits for.
* Restarted attempt: rank 0 computes alone for ``--eval-s`` at step 3 (an evaluation) while
  rank 1 already waits in all-reduce #3: slow, not hung. Both finish.

    nccl_behind.py [--eval-s S]     (with FTRUN_SHIM=1 on a node without GPUs)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

from ftrun.shim.fakenccl import UniqueId, load

os.environ.setdefault("FAKE_NCCL_SHARED_DIR", os.getcwd())
os.environ.setdefault("FAKE_NCCL_SYNC", "spin")
bound = load()
nccl, fake = bound.nccl, bound.double  # the shim's ncclX; the double's stream calls


def unique_id(rank: int, attempt: int, timeout_s: float = 60.0) -> UniqueId:
    """Rank 0 makes the id and leaves it in a file; the others read it (as a store would)."""
    path = Path(f"nccl-id-{attempt}")
    unique = UniqueId()
    if rank == 0:
        assert nccl.ncclGetUniqueId(ctypes.byref(unique)) == 0
        path.with_suffix(".tmp").write_bytes(bytes(unique))
        path.with_suffix(".tmp").rename(path)
        return unique
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: no NCCL unique id from rank 0 in {timeout_s} s")
        time.sleep(0.05)
    ctypes.memmove(ctypes.byref(unique), path.read_bytes(), ctypes.sizeof(unique))
    return unique


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--eval-s", type=float, default=4.0)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"start rank={rank} attempt={attempt} pid={os.getpid()}", flush=True)
    comm = ctypes.c_void_p()
    assert nccl.ncclCommInitRank(ctypes.byref(comm), world, unique_id(rank, attempt), rank) == 0
    stream = fake.fakeStreamCreate()
    buffer = (ctypes.c_float * 16)()
    for step in range(1, 9):
        if attempt == 0 and rank == 1 and step == 5:
            print(f"hanging rank={rank} pid={os.getpid()}", flush=True)
            while True:
                time.sleep(1)
        if attempt == 1 and rank == 0 and step == 3:
            print(f"evaluating rank={rank} for {args.eval_s} s", flush=True)
            end = time.monotonic() + args.eval_s
            while time.monotonic() < end:
                pass
        assert nccl.ncclAllReduce(buffer, buffer, 16, 7, 0, comm, stream) == 0
        stopped = fake.fakeStreamSynchronize(stream)
        print(f"step={step} rank={rank} attempt={attempt} stopped={stopped}", flush=True)
        if stopped:
            raise SystemExit(f"rank {rank}: all-reduce #{step} stopped by an abort")
    print(f"finished rank={rank} attempt={attempt}", flush=True)


if __name__ == "__main__":
    main()
