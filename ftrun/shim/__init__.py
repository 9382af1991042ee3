"""The agent's side of the native NCCL shim (csrc/, docs/shim.md).

One :class:`ShimControl` per worker process: it creates the shared-memory control page, gives
the environment that puts the shim into the worker (``LD_PRELOAD``), and drives it: liveness,
per-communicator progress, and "abort every communicator made before generation G".

The page layout is defined in ``csrc/ftshim_abi.h``; the ctypes structures below mirror it and
``tests/test_shim.py`` checks them against the offsets the built library exports. Nothing is
pickled: the page is plain C structs.

Usable on its own (tests, tools, doctor)::

    with ShimControl(label="rank0") as ctl:
        proc = subprocess.Popen(cmd, env=ctl.worker_env(os.environ))
        ctl.bind(proc.pid)
        ...
        report = ctl.abort(generation=1, timeout_s=5.0)
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import re
import secrets
import selectors
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftrun.protocol import SURVIVOR_TORCH_ENV

__all__ = [
    "SURVIVOR_TORCH_ENV",
    "AbortEntry",
    "AbortReport",
    "CommunicatorInfo",
    "SelfTestResult",
    "ShimControl",
    "ShimError",
    "ShimNotBuiltError",
    "ShimTimeoutError",
    "fake_nccl_dir",
    "self_test",
    "shim_library_path",
    "torch_env_for_survivors",
]

# ---- constants mirrored from csrc/ftshim_abi.h ---------------------------------------------
MAGIC = 0x314D494853544655
ABI_VERSION = 1
MAX_COMMS = 256
ENV_CONTROL = "FTRUN_SHIM_CONTROL"
ENV_DEBUG = "FTRUN_SHIM_DEBUG"
EXIT_AGENT_LOST = 86
GEN_ALL = 2**64 - 1
AGENT_CLOSED = 0x1

SLOT_STATES = ("empty", "live", "aborting", "revoked", "aborted", "releasing", "released")
SHIM_STATES = ("none", "waiting", "active", "detached", "agent_lost")
MECHANISMS = ("none", "revoke", "group_abort", "abort", "unavailable")
ENTRY_FLAGS = {
    0x1: "unsafe_inflight",
    0x2: "drain_timeout",
    0x4: "call_failed",
    0x8: "skipped_releasing",
}
CAPS = {0x1: "revoke", 0x2: "abort", 0x4: "group"}

# Function ids of the shim's table (csrc/ftshim_table.h), by position. Checked against the
# library's own ftshim_function_name() by the tests.
FUNCTION_NAMES = (
    "ncclGetVersion", "ncclGetUniqueId", "ncclGetErrorString", "ncclGroupStart",
    "ncclGroupEnd", "ncclGroupSimulateEnd", "ncclCommInitRank", "ncclCommInitRankConfig",
    "ncclCommInitRankScalable", "ncclCommInitAll", "ncclCommSplit", "ncclCommShrink",
    "ncclCommGrow", "ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort", "ncclCommRevoke",
    "ncclCommGetUniqueId", "ncclGetLastError", "ncclCommGetAsyncError", "ncclCommCount",
    "ncclCommCuDevice", "ncclCommUserRank", "ncclCommRegister", "ncclCommDeregister",
    "ncclCommSuspend", "ncclCommResume", "ncclCommMemStats", "ncclCommWindowRegister",
    "ncclCommWindowDeregister", "ncclWinGetUserPtr", "ncclRedOpCreatePreMulSum",
    "ncclRedOpDestroy", "ncclReduce", "ncclBcast", "ncclBroadcast", "ncclAllReduce",
    "ncclReduceScatter", "ncclAllGather", "ncclAlltoAll", "ncclGather", "ncclScatter",
    "ncclSend", "ncclRecv", "ncclPutSignal", "ncclSignal", "ncclWaitSignal",
    "ncclAllReduceConfig", "ncclBroadcastConfig", "ncclReduceConfig", "ncclAllGatherConfig",
    "ncclReduceScatterConfig", "ncclAlltoAllConfig", "ncclGatherConfig", "ncclScatterConfig",
    "ncclCommQueryProperties", "ncclDevCommCreate", "ncclDevCommDestroy",
)  # fmt: skip

def torch_env_for_survivors(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with the torch settings a surviving worker needs (user values win)."""
    out = dict(env)
    for key, value in SURVIVOR_TORCH_ENV.items():
        out.setdefault(key, value)
    return out


# ---- errors ---------------------------------------------------------------------------------
class ShimError(RuntimeError):
    """The shim or its control page is not usable."""


class ShimNotBuiltError(ShimError):
    """The native library was not built (package installed without its build step)."""


class ShimTimeoutError(ShimError, TimeoutError):
    """The shim did not finish an abort in time; `report` holds how far it got."""

    def __init__(self, message: str, report: AbortReport | None = None) -> None:
        super().__init__(message)
        self.report = report


# ---- locating the built library -------------------------------------------------------------
_NATIVE = Path(__file__).resolve().parent.parent / "_native"


def shim_library_path() -> Path:
    """Path of the built ``libftrun_shim.so``."""
    path = _NATIVE / "libftrun_shim.so"
    if not path.is_file():
        raise ShimNotBuiltError(
            f"the ftrun NCCL shim is not built ({path} is missing): reinstall with "
            "`pip install -e .` or `pip install .` (needs a C compiler: apt-get install gcc)"
        )
    return path


def fake_nccl_dir(revoke: bool = True) -> Path:
    """Directory holding the shipped NCCL test double ``libnccl.so.2`` (new: has revoke)."""
    path = _NATIVE / "fake_nccl" / ("new" if revoke else "old")
    if not (path / "libnccl.so.2").is_file():
        raise ShimNotBuiltError(
            f"the NCCL test double is not built ({path}): reinstall with `pip install -e .`"
        )
    return path


# ---- ctypes mirror of csrc/ftshim_abi.h -----------------------------------------------------
class CommSlot(ctypes.Structure):
    _fields_ = [
        ("addr", ctypes.c_uint64),
        ("state", ctypes.c_uint32),
        ("inflight", ctypes.c_uint32),
        ("seq", ctypes.c_uint64),
        ("last_op", ctypes.c_uint32),
        ("change", ctypes.c_uint32),
        ("serial", ctypes.c_uint64),
        ("generation", ctypes.c_uint64),
        ("rank", ctypes.c_int32),
        ("size", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("creator", ctypes.c_uint32),
        ("parent_serial", ctypes.c_uint64),
        ("parent_addr", ctypes.c_uint64),
        ("created_ns", ctypes.c_uint64),
        ("ended_ns", ctypes.c_uint64),
        ("reserved", ctypes.c_uint8 * 32),
    ]


class ReportEntry(ctypes.Structure):
    _fields_ = [
        ("addr", ctypes.c_uint64),
        ("serial", ctypes.c_uint64),
        ("generation", ctypes.c_uint64),
        ("state_before", ctypes.c_uint32),
        ("state_after", ctypes.c_uint32),
        ("mechanism", ctypes.c_uint32),
        ("result", ctypes.c_int32),
        ("inflight_before", ctypes.c_uint32),
        ("inflight_after", ctypes.c_uint32),
        ("elapsed_ns", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("rank", ctypes.c_int32),
    ]


class Report(ctypes.Structure):
    _fields_ = [
        ("generation", ctypes.c_uint64),
        ("request", ctypes.c_uint64),
        ("started_ns", ctypes.c_uint64),
        ("finished_ns", ctypes.c_uint64),
        ("mechanism", ctypes.c_uint32),
        ("group_result", ctypes.c_int32),
        ("n_entries", ctypes.c_uint32),
        ("n_unsafe", ctypes.c_uint32),
        ("nccl_version", ctypes.c_uint32),
        ("phase", ctypes.c_uint32),
        ("current_index", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("entries", ReportEntry * MAX_COMMS),
    ]


class Page(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("max_comms", ctypes.c_uint32),
        ("agent_pid", ctypes.c_int32),
        ("bound_pid", ctypes.c_int32),
        ("tick_ms", ctypes.c_uint32),
        ("drain_ms", ctypes.c_uint32),
        ("agent_flags", ctypes.c_uint32),
        ("current_generation", ctypes.c_uint64),
        ("abort_generation", ctypes.c_uint64),
        ("abort_request", ctypes.c_uint64),
        ("doorbell", ctypes.c_uint32),
        ("report_seq", ctypes.c_uint32),
        ("owner_pid", ctypes.c_int32),
        ("shim_state", ctypes.c_uint32),
        ("liveness", ctypes.c_uint64),
        ("ack_generation", ctypes.c_uint64),
        ("ack_request", ctypes.c_uint64),
        ("nccl_version", ctypes.c_uint32),
        ("caps", ctypes.c_uint32),
        ("attach_count", ctypes.c_uint64),
        ("next_serial", ctypes.c_uint64),
        ("overflow", ctypes.c_uint64),
        ("owner_has_nccl", ctypes.c_uint32),
        ("abi_shim_version", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 14),
        ("report", Report),
        ("comms", CommSlot * MAX_COMMS),
    ]


MIRRORS: dict[str, type[ctypes.Structure]] = {
    "ftshim_page": Page,
    "ftshim_report": Report,
    "ftshim_report_entry": ReportEntry,
    "ftshim_comm_slot": CommSlot,
}


def library_layout(lib_path: Path | None = None) -> dict[str, tuple[int, int]]:
    """{"struct.field": (offset, size), "struct": (0, sizeof)} as compiled into the library."""

    class _FieldInfo(ctypes.Structure):
        _fields_ = [("name", ctypes.c_char_p), ("offset", ctypes.c_uint32),
                    ("size", ctypes.c_uint32)]  # fmt: skip

    lib = ctypes.CDLL(str(lib_path or shim_library_path()))
    table = ctypes.cast(lib.ftshim_layout_fields, ctypes.POINTER(_FieldInfo))
    out: dict[str, tuple[int, int]] = {}
    i = 0
    while table[i].name is not None:
        out[table[i].name.decode()] = (table[i].offset, table[i].size)
        i += 1
    return out


def mirror_layout() -> dict[str, tuple[int, int]]:
    """The same description, computed from the ctypes mirror."""
    out: dict[str, tuple[int, int]] = {}
    for cname, struct in MIRRORS.items():
        out[cname] = (0, ctypes.sizeof(struct))
        for fname, *_ in struct._fields_:
            if fname == "reserved":
                continue
            desc = getattr(struct, fname)
            out[f"{cname}.{fname}"] = (desc.offset, desc.size)
    return out


def _version_str(code: int) -> str:
    if code <= 0:
        return "unknown"
    if code < 10000:
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def _fn_name(fid: int) -> str:
    return FUNCTION_NAMES[fid] if 0 <= fid < len(FUNCTION_NAMES) else f"#{fid}"


def _state(table: tuple[str, ...], value: int) -> str:
    return table[value] if 0 <= value < len(table) else f"#{value}"


# ---- futex (the page's wake-up words) -------------------------------------------------------
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221}.get(platform.machine(), 202)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wake(addr: int) -> None:
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                  ctypes.c_int(2**31 - 1), None, None, ctypes.c_int(0))  # fmt: skip


def _futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Wait while *addr == expected, at most timeout_s (ctypes drops the GIL meanwhile)."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
                  ctypes.c_uint32(expected), ctypes.byref(ts), None, ctypes.c_int(0))  # fmt: skip


# ---- results --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommunicatorInfo:
    """One communicator of the worker, as the shim's registry sees it."""

    address: int
    serial: int
    generation: int
    state: str  # live, aborting, revoked, aborted, releasing, released
    rank: int  # -1 when unknown
    size: int  # -1 when unknown
    device: int  # -1 when unknown
    seq: int  # communication operations issued so far (progress)
    last_op: str  # NCCL function of the last operation
    inflight: int  # threads inside an NCCL call on it right now
    creator: str
    parent_serial: int
    parent_address: int
    created_ns: int  # CLOCK_MONOTONIC (same clock as time.monotonic_ns())
    ended_ns: int


@dataclass(frozen=True)
class AbortEntry:
    """What the shim did to one communicator."""

    address: int
    serial: int
    generation: int
    rank: int
    state_before: str
    state_after: str
    mechanism: str
    result: int  # ncclResult_t of the revoke/abort call
    inflight_before: int
    inflight_after: int
    elapsed_s: float
    flags: tuple[str, ...]

    @property
    def unsafe(self) -> bool:
        """A thread was inside NCCL on this communicator when NCCL freed it."""
        return "unsafe_inflight" in self.flags


@dataclass(frozen=True)
class AbortReport:
    """The shim's answer to :meth:`ShimControl.abort`."""

    generation: int
    attached: bool  # False: no shim owned the page (nothing to abort in that process)
    mechanism: str
    entries: tuple[AbortEntry, ...]
    elapsed_s: float  # time the shim spent (first comm to last)
    round_trip_s: float  # command written -> report read, as the agent saw it
    nccl_version: str
    group_result: int
    complete: bool = True  # False only inside ShimTimeoutError.report
    note: str = ""

    @property
    def unsafe(self) -> bool:
        return any(e.unsafe for e in self.entries)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["unsafe"] = self.unsafe
        return d


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


# ---- the control channel --------------------------------------------------------------------
def _default_directory() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


class ShimControl:
    """The agent's handle on the shim inside one worker process."""

    def __init__(
        self,
        *,
        label: str,
        generation: int = 0,
        directory: Path | None = None,
        tick_ms: int = 10,
        drain_ms: int = 20,
        library: Path | None = None,
    ) -> None:
        """Create the control page (a file in /dev/shm by default, mode 0600).

        tick_ms: the shim's liveness period; drain_ms: how long an abort waits for NCCL calls in
        flight to come back before freeing their communicator (see docs/shim.md);
        library: another build of the shim (tests use an AddressSanitizer build).
        """
        self._lib = Path(library) if library is not None else shim_library_path()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:64] or "worker"
        directory = Path(directory) if directory is not None else _default_directory()
        self.path = directory / f"ftrun-shim-{safe}-{os.getpid()}-{secrets.token_hex(4)}"
        size = ctypes.sizeof(Page)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        page = Page.from_buffer(self._mm)
        self._page: Page | None = page
        self._base = ctypes.addressof(page)
        page.version = ABI_VERSION
        page.size = size
        page.max_comms = MAX_COMMS
        page.agent_pid = os.getpid()
        page.tick_ms = max(1, min(1000, int(tick_ms)))
        page.drain_ms = max(0, min(10000, int(drain_ms)))
        page.current_generation = int(generation)
        page.magic = MAGIC  # last: a shim never sees a half-written header
        self.label = label
        self.tick_s = page.tick_ms / 1000.0
        # a forgotten close() still removes the file at garbage collection / interpreter exit
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)

    # -- context manager --
    def __enter__(self) -> ShimControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _p(self) -> Page:
        if self._page is None:
            raise ShimError(f"shim control {self.label!r} is closed")
        return self._page

    def _ring(self) -> None:
        page = self._p()
        page.doorbell = (page.doorbell + 1) & 0xFFFFFFFF
        _futex_wake(self._base + Page.doorbell.offset)

    # -- the API the agent uses --
    def worker_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """A copy of `env` plus what the worker needs: the control path, and the shim appended
        to LD_PRELOAD (':'-separated, after whatever the user preloads)."""
        self._p()
        out = dict(env)
        lib = str(self._lib)
        pre = [p for p in out.get("LD_PRELOAD", "").split(":") if p]
        if lib not in pre:
            pre.append(lib)
        out["LD_PRELOAD"] = ":".join(pre)
        out[ENV_CONTROL] = str(self.path)
        return out

    def bind(self, pid: int) -> None:
        """Name the worker process: it owns the page from its start (liveness before NCCL is
        loaded). Without bind, the first process of the worker's tree that loads NCCL owns it."""
        self._p().bound_pid = int(pid)
        self._ring()

    def set_generation(self, generation: int) -> None:
        """Communicators created from now on belong to `generation`."""
        self._p().current_generation = int(generation)

    def abort(self, generation: int, timeout_s: float) -> AbortReport:
        """Stop every communicator made before `generation` and return the shim's report.

        Also moves the current generation to at least `generation`. Raises ShimTimeoutError
        (with the partial report) when the shim has not finished after timeout_s: NCCL's abort
        itself can hang, and the caller should then kill the worker.
        """
        page = self._p()
        t0 = time.monotonic()
        if page.current_generation < generation:
            page.current_generation = int(generation)
        page.abort_generation = int(generation)
        request = page.abort_request + 1
        page.abort_request = request
        seq_addr = self._base + Page.report_seq.offset
        self._ring()
        deadline = t0 + timeout_s
        while True:
            if page.ack_request >= request:
                return self._read_report(generation, t0, complete=True)
            state = _state(SHIM_STATES, page.shim_state)
            owner = page.owner_pid
            if state in ("none", "waiting", "detached") or (owner and not _pid_alive(owner)):
                # No process serves the page: nothing in this worker holds a communicator yet
                # (a process that claims later aborts comms of older generations by itself).
                note = f"no shim attached (state {state}, owner pid {owner})"
                return AbortReport(generation, False, "none", (), 0.0, time.monotonic() - t0,
                                   "unknown", 0, True, note)  # fmt: skip
            left = deadline - time.monotonic()
            if left <= 0:
                partial = self._read_report(generation, t0, complete=False)
                raise ShimTimeoutError(
                    f"shim of {self.label!r} did not finish aborting generation {generation} "
                    f"within {timeout_s:.3f} s (phase {page.report.phase}, entry "
                    f"{page.report.current_index}): kill the worker",
                    partial,
                )
            seen = page.report_seq
            if page.ack_request >= request:
                continue
            _futex_wait(seq_addr, seen, min(left, 0.05))

    def liveness(self) -> int:
        """The shim thread's counter: +1 every tick_ms; stops when the process is frozen."""
        return int(self._p().liveness)

    def communicators(self) -> list[CommunicatorInfo]:
        """Every communicator the worker created (live, stopped and released ones)."""
        page = self._p()
        out = []
        for i in range(MAX_COMMS):
            slot = page.comms[i]
            if not slot.addr:
                continue
            for _ in range(100):  # seqlock: retry while the shim rewrites the slot
                before = slot.change
                snap = CommSlot.from_buffer_copy(slot)
                if before % 2 == 0 and slot.change == before:
                    break
            else:
                continue
            out.append(CommunicatorInfo(
                address=snap.addr, serial=snap.serial, generation=snap.generation,
                state=_state(SLOT_STATES, snap.state), rank=snap.rank, size=snap.size,
                device=snap.device, seq=snap.seq, last_op=_fn_name(snap.last_op),
                inflight=snap.inflight, creator=_fn_name(snap.creator),
                parent_serial=snap.parent_serial, parent_address=snap.parent_addr,
                created_ns=snap.created_ns, ended_ns=snap.ended_ns,
            ))  # fmt: skip
        out.sort(key=lambda c: c.serial)
        return out

    def status(self) -> dict[str, Any]:
        """The page's header, decoded (for logs and doctor)."""
        page = self._p()
        return {
            "path": str(self.path),
            "state": _state(SHIM_STATES, page.shim_state),
            "owner_pid": page.owner_pid,
            "bound_pid": page.bound_pid,
            "liveness": page.liveness,
            "current_generation": page.current_generation,
            "ack_generation": page.ack_generation,
            "nccl_version": _version_str(page.nccl_version),
            "caps": [name for bit, name in CAPS.items() if page.caps & bit],
            "attach_count": page.attach_count,
            "untracked_communicators": page.overflow,
        }

    @property
    def closed(self) -> bool:
        return self._page is None

    def close(self) -> None:
        """Tell the shim to detach (it keeps answering stopped handles safely, aborts nothing)
        and remove the page. Idempotent."""
        if self._page is None:
            return
        try:
            self._page.agent_flags |= AGENT_CLOSED
            self._ring()
        finally:
            self._page = None
            if self._mm is not None:
                with contextlib.suppress(BufferError):  # a caller still holds a view: GC unmaps
                    self._mm.close()
                self._mm = None
            self._finalizer()

    # -- helpers --
    def _read_report(self, generation: int, t0: float, *, complete: bool) -> AbortReport:
        rep = self._p().report
        n = min(rep.n_entries, MAX_COMMS)
        entries = []
        for i in range(n):
            e = rep.entries[i]
            entries.append(AbortEntry(
                address=e.addr, serial=e.serial, generation=e.generation, rank=e.rank,
                state_before=_state(SLOT_STATES, e.state_before),
                state_after=_state(SLOT_STATES, e.state_after),
                mechanism=_state(MECHANISMS, e.mechanism), result=e.result,
                inflight_before=e.inflight_before, inflight_after=e.inflight_after,
                elapsed_s=e.elapsed_ns / 1e9,
                flags=tuple(name for bit, name in ENTRY_FLAGS.items() if e.flags & bit),
            ))  # fmt: skip
        finished = rep.finished_ns or time.monotonic_ns()
        return AbortReport(
            generation=generation,
            attached=True,
            mechanism=_state(MECHANISMS, rep.mechanism),
            entries=tuple(entries),
            elapsed_s=max(0, finished - rep.started_ns) / 1e9 if rep.started_ns else 0.0,
            round_trip_s=time.monotonic() - t0,
            nccl_version=_version_str(rep.nccl_version),
            group_result=rep.group_result,
            complete=complete,
        )


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_page(path: Path) -> Page:
    """A copy of a control page file (e.g. left behind by an agent that died)."""
    data = Path(path).read_bytes()
    if len(data) < ctypes.sizeof(Page):
        raise ShimError(f"{path}: not a shim control page ({len(data)} bytes)")
    return Page.from_buffer_copy(data)


# ---- self test (doctor) ---------------------------------------------------------------------
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
        report = ctl.abort(1, timeout_s=max(0.1, deadline - time.monotonic()))
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
