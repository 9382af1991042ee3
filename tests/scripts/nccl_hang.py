"""A script written for torchrun (no worker API) whose NCCL collective hangs, on CPU.

Each rank calls NCCL the way torch does (the shim's NCCL test double, through the
preloaded shim). In the job's first attempt, rank 1 stops calling collectives (it sleeps in
its own code) while rank 0 blocks inside ``ncclAllReduce`` waiting for it: the agent must
name rank 1 and release rank 0 through the shim. The restarted attempt just finishes.

    nccl_hang.py        (with FTRUN_SHIM=1 on a node without GPUs)
"""

from __future__ import annotations

import ctypes
import os
import time

from ftrun.shim.fakenccl import UniqueId, load

os.environ.setdefault("FAKE_NCCL_BLOCK", "host")
nccl = load().nccl  # the shim's ncclX, which forwards to the test double
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"start rank={rank} attempt={attempt} pid={os.getpid()}", flush=True)
if attempt > 0:
    print(f"finished rank={rank} attempt={attempt}", flush=True)
    raise SystemExit(0)
if rank == 1:
    print(f"hanging rank={rank} pid={os.getpid()}", flush=True)
    while True:
        time.sleep(1)
unique, comm = UniqueId(), ctypes.c_void_p()
assert nccl.ncclGetUniqueId(ctypes.byref(unique)) == 0
assert nccl.ncclCommInitRank(ctypes.byref(comm), 2, unique, 0) == 0  # the peer never comes
buffer = (ctypes.c_float * 16)()
print(f"blocking in ncclAllReduce rank={rank} pid={os.getpid()}", flush=True)
code = nccl.ncclAllReduce(buffer, buffer, ctypes.c_size_t(16), 7, 0, comm, None)
print(f"released code={code} rank={rank}", flush=True)
raise SystemExit(1 if code != 0 else 0)
