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
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import torch

import ftrun
from ftrun.shim import fake_nccl_dir

os.environ.setdefault("FAKE_NCCL_BLOCK", "host")
ctypes.CDLL(str(fake_nccl_dir() / "libnccl.so.2"), mode=os.RTLD_LOCAL | os.RTLD_NOW)
nccl = ctypes.CDLL(None)  # global scope: the shim's ncclX, which forwards to pncclX



class UniqueId(ctypes.Structure):  # ncclUniqueId: 128 bytes, passed by value
    _fields_ = [("internal", ctypes.c_char * 128)]


nccl.ncclCommInitRank.argtypes = [ctypes.c_void_p, ctypes.c_int, UniqueId, ctypes.c_int]
nccl.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
victim = int(sys.argv[1])
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


def compute() -> None:
    if ft.generation == 0 and ft.rank == victim:
        print(f"victim pid={os.getpid()}", flush=True)
        while True:
            time.sleep(1)
    if ft.generation == 0:
        print(f"blocking in ncclAllReduce pid={os.getpid()}", flush=True)
        started = time.monotonic()
        code = nccl.ncclAllReduce(ctypes.c_void_p(buffer.data_ptr()),
                                  ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(16),
                                  7, 0, comm, None)  # ncclFloat32, ncclSum, no stream
        print(f"released code={code} after={time.monotonic() - started:.3f}", flush=True)
        if code != 0:
            raise RuntimeError(f"NCCL error {code}")  # what torch raises for a failed call


while ft.step < 3:
    ft.run_step(compute, lambda: None)
print(f"finished generation={ft.generation} world={ft.world_size} step={ft.step}", flush=True)
