"""Driving the shim in one worker: :class:`ShimControl`, its reports and errors, and where the
built library is."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import re
import secrets
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ftrun.protocol import SURVIVOR_TORCH_ENV
from ftrun.shim.abi import (
    ABI_VERSION,
    ENV_CONTROL,
    MAGIC,
    MAX_COMMS,
    AgentFlag,
    Capability,
    CommSlot,
    CommState,
    EntryFlag,
    Mechanism,
    Page,
    ReportPhase,
    ShimState,
    enum_name,
    flag_names,
    function_name,
)
from ftrun.shim.native import (
    ShimError,
    shim_library_path,
)


def torch_env_for_survivors(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with the torch settings a surviving worker needs (user values win)."""
    out = dict(env)
    for key, value in SURVIVOR_TORCH_ENV.items():
        out.setdefault(key, value)
    return out


# ---- errors ---------------------------------------------------------------------------------
class ShimTimeoutError(ShimError, TimeoutError):
    """The shim did not finish an abort in time; `report` holds how far it got."""

    def __init__(self, message: str, report: AbortReport | None = None) -> None:
        super().__init__(message)
        self.report = report


def _version_str(code: int) -> str:
    if code <= 0:
        return "unknown"
    if code < 10000:
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


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
    epoch: int  # the comm epoch it was created in
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
    comm_id: int = 0  # the same on every rank of the communicator; 0 unknown
    coll_seq: int = 0  # collectives issued (seq without point-to-point calls)


@dataclass(frozen=True)
class AbortEntry:
    """What the shim did to one communicator."""

    address: int
    serial: int
    epoch: int  # the comm epoch it was created in
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
        return enum_name(EntryFlag, EntryFlag.UNSAFE_INFLIGHT) in self.flags


@dataclass(frozen=True)
class AbortReport:
    """The shim's answer to :meth:`ShimControl.abort`."""

    epoch: int  # the abort epoch: communicators of older comm epochs were stopped
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


# ---- the control channel --------------------------------------------------------------------
def _default_directory() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


_UNSERVED = (ShimState.NONE, ShimState.WAITING, ShimState.DETACHED)
_PAGE_NAME = re.compile(r"^ftrun-shim-.+-(\d+)-[0-9a-f]{8}$")
_swept: set[Path] = set()  # directories already swept by this process


def sweep_stale_pages(directory: Path) -> list[Path]:
    """Remove control pages whose agent is gone (killed with SIGKILL, it cannot unlink
    them: each is ~50 KB of tmpfs, i.e. memory, for good). The agent's pid is in the name;
    a page is stale when no process has that pid. Returns what was removed."""
    removed = []
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            match = _PAGE_NAME.match(path.name)
            if match is None or int(match[1]) == os.getpid():
                continue
            try:
                os.kill(int(match[1]), 0)
                continue  # its agent (or a process with its pid) is alive: keep it
            except ProcessLookupError:
                pass
            except PermissionError:
                continue  # someone else's process is alive there
            with contextlib.suppress(FileNotFoundError, PermissionError):
                path.unlink()
                removed.append(path)
    return removed


class ShimControl:
    """The agent's handle on the shim inside one worker process.

    The shim counts in comm epochs, private to this page: each communicator records the
    epoch current when it was created, and :meth:`abort` stops those of older epochs.
    :meth:`abort_all` stops everything created so far without naming an epoch.
    """

    def __init__(
        self,
        *,
        label: str,
        epoch: int = 0,
        directory: Path | None = None,
        tick_ms: int = 10,
        drain_ms: int = 20,
        library: Path | None = None,
    ) -> None:
        """Create the control page (a file in /dev/shm by default, mode 0600).

        epoch: the comm epoch of the worker's first communicators;
        tick_ms: the shim's liveness period; drain_ms: how long an abort waits for NCCL calls in
        flight to come back before freeing their communicator (see docs/shim.md);
        library: another build of the shim (tests use an AddressSanitizer build).
        """
        self._lib = Path(library) if library is not None else shim_library_path()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:64] or "worker"
        directory = Path(directory) if directory is not None else _default_directory()
        if directory not in _swept:
            _swept.add(directory)
            sweep_stale_pages(directory)
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
        page.current_epoch = int(epoch)
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

    @property
    def epoch(self) -> int:
        """The comm epoch given to communicators created from now on."""
        return int(self._p().current_epoch)

    def set_epoch(self, epoch: int) -> None:
        """Communicators created from now on belong to comm epoch `epoch`."""
        self._p().current_epoch = int(epoch)

    def abort_all(self, timeout_s: float) -> AbortReport:
        """Stop every communicator created so far on this page: ``abort(epoch + 1)``.

        Communicators created afterwards belong to the next epoch and are not affected."""
        return self.abort(self.epoch + 1, timeout_s)

    def abort(self, epoch: int, timeout_s: float) -> AbortReport:
        """Stop every communicator of a comm epoch older than `epoch`; return the shim's report.

        Also moves the current epoch to at least `epoch`. Raises ShimTimeoutError (with the
        partial report) when the shim has not finished after timeout_s: NCCL's abort itself can
        hang, and the caller should then kill the worker.
        """
        page = self._p()
        t0 = time.monotonic()
        if page.current_epoch < epoch:
            page.current_epoch = int(epoch)
        page.abort_epoch = int(epoch)
        request = page.abort_request + 1
        page.abort_request = request
        seq_addr = self._base + Page.report_seq.offset
        self._ring()
        deadline = t0 + timeout_s
        while True:
            if page.ack_request >= request:
                return self._read_report(epoch, t0, complete=True)
            state = enum_name(ShimState, page.shim_state)
            owner = page.owner_pid
            if page.shim_state in _UNSERVED or (owner and not _pid_alive(owner)):
                # No process serves the page: nothing in this worker holds a communicator yet
                # (a process that claims later aborts comms of older epochs by itself).
                note = f"no shim attached (state {state}, owner pid {owner})"
                return AbortReport(epoch, False, enum_name(Mechanism, Mechanism.NONE), (), 0.0,
                                   time.monotonic() - t0, "unknown", 0, True, note)  # fmt: skip
            left = deadline - time.monotonic()
            if left <= 0:
                partial = self._read_report(epoch, t0, complete=False)
                raise ShimTimeoutError(
                    f"shim of {self.label!r} did not finish aborting comm epoch {epoch} "
                    f"within {timeout_s:.3f} s (phase "
                    f"{enum_name(ReportPhase, page.report.phase)}, entry "
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
                address=snap.addr, serial=snap.serial, epoch=snap.epoch,
                state=enum_name(CommState, snap.state), rank=snap.rank, size=snap.size,
                device=snap.device, seq=snap.seq, last_op=function_name(snap.last_op),
                inflight=snap.inflight, creator=function_name(snap.creator),
                parent_serial=snap.parent_serial, parent_address=snap.parent_addr,
                created_ns=snap.created_ns, ended_ns=snap.ended_ns, comm_id=snap.comm_id,
                coll_seq=snap.coll_seq,
            ))  # fmt: skip
        out.sort(key=lambda c: c.serial)
        return out

    def status(self) -> dict[str, Any]:
        """The page's header, decoded (for logs and doctor)."""
        page = self._p()
        return {
            "path": str(self.path),
            "state": enum_name(ShimState, page.shim_state),
            "owner_pid": page.owner_pid,
            "bound_pid": page.bound_pid,
            "liveness": page.liveness,
            "current_epoch": page.current_epoch,
            "ack_epoch": page.ack_epoch,
            "nccl_version": _version_str(page.nccl_version),
            "caps": list(flag_names(Capability, page.caps)),
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
            self._page.agent_flags |= AgentFlag.CLOSED
            self._ring()
        finally:
            self._page = None
            if self._mm is not None:
                with contextlib.suppress(BufferError):  # a caller still holds a view: GC unmaps
                    self._mm.close()
                self._mm = None
            self._finalizer()

    # -- helpers --
    def _read_report(self, epoch: int, t0: float, *, complete: bool) -> AbortReport:
        rep = self._p().report
        n = min(rep.n_entries, MAX_COMMS)
        entries = []
        for i in range(n):
            e = rep.entries[i]
            entries.append(AbortEntry(
                address=e.addr, serial=e.serial, epoch=e.epoch, rank=e.rank,
                state_before=enum_name(CommState, e.state_before),
                state_after=enum_name(CommState, e.state_after),
                mechanism=enum_name(Mechanism, e.mechanism), result=e.result,
                inflight_before=e.inflight_before, inflight_after=e.inflight_after,
                elapsed_s=e.elapsed_ns / 1e9, flags=flag_names(EntryFlag, e.flags),
            ))  # fmt: skip
        finished = rep.finished_ns or time.monotonic_ns()
        return AbortReport(
            epoch=epoch,
            attached=True,
            mechanism=enum_name(Mechanism, rep.mechanism),
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
