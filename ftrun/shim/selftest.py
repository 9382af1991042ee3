"""The shim's self test (doctor's check): one abort round trip against the shipped NCCL test
double, in a Python child that holds it RTLD_LOCAL as torch holds libnccl. No GPU, no compiler."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ftrun.shim.control import ShimControl
from ftrun.shim.native import ShimError, fake_nccl_dir


@dataclass
class SelfTestResult:
    """Outcome of :func:`self_test` (doctor's shim check)."""

    ok: bool
    detail: str
    release_latency_s: float | None = None  # abort command -> blocked collective returned
    abort_round_trip_s: float | None = None
    mechanism: str | None = None
    nccl: str | None = None
    report: dict[str, Any] | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SELF_TEST_WORKER = r"""
import ctypes, os, sys, time
fake = ctypes.CDLL(os.path.join(sys.argv[1], "libnccl.so.2"))  # RTLD_LOCAL, as torch does
api = ctypes.CDLL(None)          # global scope: the shim's ncclX, as libtorch's PLT sees it
class UniqueId(ctypes.Structure):  # 128 bytes, passed BY VALUE to ncclCommInitRank
    _fields_ = [("internal", ctypes.c_char * 128)]
uid = UniqueId()
assert api.ncclGetUniqueId(ctypes.byref(uid)) == 0
comm = ctypes.c_void_p()
api.ncclCommInitRank.argtypes = [ctypes.c_void_p, ctypes.c_int, UniqueId, ctypes.c_int]
# two ranks, the peer never comes: the collective hangs like one on a dead peer
assert api.ncclCommInitRank(ctypes.byref(comm), 2, uid, 0) == 0
fake.fakeStreamCreate.restype = ctypes.c_void_p
stream = ctypes.c_void_p(fake.fakeStreamCreate())
assert api.ncclAllReduce(None, None, ctypes.c_size_t(1), 0, 0, comm, stream) == 0
print("BLOCKED", flush=True)
stopped = fake.fakeStreamSynchronize(stream)
t = time.monotonic_ns()
err = ctypes.c_int(0)
r1 = api.ncclCommGetAsyncError(comm, ctypes.byref(err))
r2 = api.ncclCommAbort(comm)
print("RELEASED", t, stopped, r1, err.value, r2, flush=True)
"""


def _read_line(proc: subprocess.Popen[str], deadline: float) -> str | None:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, min(0.1, deadline - time.monotonic()))):
                line = proc.stdout.readline()
                return line if line else None
    return None


def self_test(timeout_s: float = 10.0) -> SelfTestResult:
    """Load the shim into a Python child that holds the NCCL test double RTLD_LOCAL (as torch
    holds libnccl), block it in a collective on a missing peer, abort, and time the release.

    Needs no GPU and no compiler (the test double ships in ftrun/_native). Never raises for a
    failed check: the result says what went wrong.
    """
    deadline = time.monotonic() + timeout_s
    try:
        fake = fake_nccl_dir(revoke=True)
        ctl = ShimControl(label="self-test")
    except ShimError as exc:
        return SelfTestResult(False, str(exc))
    proc: subprocess.Popen[str] | None = None
    try:
        env = ctl.worker_env(os.environ)
        proc = subprocess.Popen(
            [sys.executable, "-c", _SELF_TEST_WORKER, str(fake)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        ctl.bind(proc.pid)
        line = _read_line(proc, deadline)
        if not line or not line.startswith("BLOCKED"):
            proc.kill()
            _, err = proc.communicate(timeout=5)
            return SelfTestResult(
                False, f"worker did not reach the collective: {line!r} {err[-500:]}"
            )
        t_cmd = time.monotonic_ns()
        report = ctl.abort_all(timeout_s=max(0.1, deadline - time.monotonic()))
        line = _read_line(proc, deadline)
        if not line or not line.startswith("RELEASED"):
            return SelfTestResult(False, f"worker was not released by the abort: {line!r}",
                                  report=report.to_dict())  # fmt: skip
        _, t_rel, stopped, r1, err_code, r2 = line.split()
        latency = (int(t_rel) - t_cmd) / 1e9
        problems = []
        if stopped != "1":
            problems.append("collective completed instead of being stopped")
        if r1 != "0" or err_code == "0":
            problems.append(f"ncclCommGetAsyncError after abort gave {r1}/{err_code}")
        if r2 != "0":
            problems.append(f"ncclCommAbort after the shim's abort returned {r2}")
        if not report.attached or len(report.entries) != 1:
            problems.append(f"report: attached={report.attached} entries={len(report.entries)}")
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        ok = not problems and proc.returncode == 0
        detail = "; ".join(problems) or (
            f"abort round trip ok: released in {latency * 1e3:.1f} ms via {report.mechanism}"
        )
        return SelfTestResult(ok, detail, latency, report.round_trip_s, report.mechanism,
                              report.nccl_version, report.to_dict())  # fmt: skip
    except (ShimError, OSError, subprocess.SubprocessError, ValueError) as exc:
        return SelfTestResult(False, f"{type(exc).__name__}: {exc}")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        ctl.close()
