"""Python bindings for calling NCCL the way torch does, on CPU, against the test double.

Test scripts run as ftrun workers with the shim preloaded: they load the shipped NCCL test
double (``fake_nccl_dir``) privately and then call the global ``ncclX`` symbols, which are
the shim's interposers forwarding to it, exactly as torch's ``ProcessGroupNCCL`` reaches a
real ``libnccl.so.2``. One set of bindings, so every such script calls the same prototypes.
Nothing here runs in a production job.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from ftrun.shim.native import fake_nccl_dir


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 bytes, passed by value."""

    _fields_ = [("internal", ctypes.c_char * 128)]


@dataclass(frozen=True)
class FakeNccl:
    nccl: ctypes.CDLL  # the global scope: the shim's ncclX
    double: ctypes.CDLL  # the test double itself: fakeStreamCreate, fakeStreamSynchronize


def load() -> FakeNccl:
    """Load the test double (its behaviour is set by the FAKE_NCCL_* environment variables
    read at each call; see csrc/fake_nccl/fake_nccl.c) and bind the calls the scripts use."""
    double = ctypes.CDLL(str(fake_nccl_dir() / "libnccl.so.2"), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    nccl = ctypes.CDLL(None)
    nccl.ncclCommInitRank.argtypes = [ctypes.c_void_p, ctypes.c_int, UniqueId, ctypes.c_int]
    nccl.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    double.fakeStreamCreate.restype = ctypes.c_void_p
    double.fakeStreamSynchronize.argtypes = [ctypes.c_void_p]
    return FakeNccl(nccl, double)
