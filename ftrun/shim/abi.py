"""The ctypes mirror of ``csrc/ftshim_abi.h``: the control page, its constants and enums.

The header is the one definition; ``tests/test_shim.py`` checks this mirror against what the
built library exports: the struct layout (:func:`library_layout` vs :func:`mirror_layout`),
every enum value and name (:func:`library_enums` vs :func:`mirror_enums`) and the function
table (:data:`FUNCTION_NAMES`).

The shim counts in *comm epochs*: private to one control page, unrelated to the job
generation and to the member epoch (see the header's comment).
"""

from __future__ import annotations

import ctypes
import enum
from pathlib import Path

from ftrun.shim.native import shim_library_path

# ---- constants ------------------------------------------------------------------------------
MAGIC = 0x314D494853544655
ABI_VERSION = 3
MAX_COMMS = 256
ENV_CONTROL = "FTRUN_SHIM_CONTROL"
ENV_DEBUG = "FTRUN_SHIM_DEBUG"
EXIT_AGENT_LOST = 86
EPOCH_ALL = 2**64 - 1  # abort epoch meaning "every communicator"


# ---- enums: one per X-list of the header; the member name is the C name in upper case ----------
class CommState(enum.IntEnum):
    """slot.state, entry.state_before/after: one communicator in the registry."""

    EMPTY = 0  # never used (ends a probe chain)
    LIVE = 1  # usable; calls are forwarded
    ABORTING = 2  # the shim is stopping it; callers are turned away
    REVOKED = 3  # stopped with ncclCommRevoke: its memory is still valid
    ABORTED = 4  # stopped with ncclCommAbort: freed by NCCL
    RELEASING = 5  # the application is destroying/aborting it right now
    RELEASED = 6  # the application released it (a tombstone)


class ShimState(enum.IntEnum):
    """page.shim_state: the page, as the agent sees it."""

    NONE = 0  # no shim has looked at the page yet
    WAITING = 1  # a candidate waits for NCCL or bind() before it claims the page
    ACTIVE = 2  # owner_pid owns the page and serves commands
    DETACHED = 3  # the agent closed the channel; the shim only forwards
    AGENT_LOST = 4  # the agent died: everything was aborted and the worker exits


class Mechanism(enum.IntEnum):
    """report.mechanism, entry.mechanism: how communicators were stopped."""

    NONE = 0  # nothing to do
    REVOKE = 1  # ncclCommRevoke on each: frees nothing (NCCL 2.28.7+)
    GROUP_ABORT = 2  # ncclCommAbort on each inside one group (NCCL 2.22.3+)
    ABORT = 3  # ncclCommAbort one by one
    UNAVAILABLE = 4  # the loaded NCCL offers no abort at all


class ReportPhase(enum.IntEnum):
    """report.phase: how far the last abort got (read when an abort times out)."""

    IDLE = 0  # no abort has run on this page yet
    SELECTING = 1  # picking the communicators older than the abort epoch
    STOPPING = 2  # revoking/aborting them, draining calls in flight (report.current_index)
    DONE = 3  # the report is complete


class ShimMode(enum.IntEnum):
    """ftshim_status(): what the shim does in one process (not in the page)."""

    INERT = 0  # forwards every call, tracks nothing (ftshim_inert_reason says why)
    CANDIDATE = 1  # may claim the page at its first NCCL call or when bound
    ACTIVE = 2  # owns the page: tracks communicators, serves aborts
    DETACHED = 3  # the agent closed the channel; stopped handles are still answered


class EntryFlag(enum.IntFlag):
    """entry.flags: what went wrong, or was left alone, for one communicator."""

    UNSAFE_INFLIGHT = 0x1  # a thread was inside NCCL on it when NCCL freed it
    DRAIN_TIMEOUT = 0x2  # calls in flight did not come back within drain_ms
    CALL_FAILED = 0x4  # the revoke/abort call returned an error
    SKIPPED_RELEASING = 0x8  # the application was destroying it: left alone


class Capability(enum.IntFlag):
    """page.caps: what the loaded NCCL offers."""

    REVOKE = 0x1
    ABORT = 0x2
    GROUP = 0x4  # several aborts may go inside one group (NCCL 2.22.3+)


class AgentFlag(enum.IntFlag):
    """page.agent_flags."""

    CLOSED = 0x1  # the channel was closed normally: detach, do not abort


# family name in the library (ftshim_<family>_name, ftshim_enum_values) -> mirror
ENUMS: dict[str, type[enum.IntEnum] | type[enum.IntFlag]] = {
    "comm_state": CommState,
    "shim_state": ShimState,
    "mechanism": Mechanism,
    "report_phase": ReportPhase,
    "mode": ShimMode,
    "entry_flag": EntryFlag,
    "cap": Capability,
    "agent_flag": AgentFlag,
}


def enum_name(family: type[enum.IntEnum] | type[enum.IntFlag], value: int) -> str:
    """The library's name of `value` ("live", "group_abort"), or "#value" when unknown."""
    try:
        member = family(value)
    except ValueError:
        return f"#{value}"
    return member.name.lower() if member.name else f"#{value}"


def flag_names(family: type[enum.IntFlag], bits: int) -> tuple[str, ...]:
    """The names of the bits set in `bits`, lowest first."""
    return tuple(enum_name(family, m.value) for m in family if bits & m.value)


# Tables of names by value, as earlier versions of this module had them.
SLOT_STATES = tuple(enum_name(CommState, m) for m in CommState)
SHIM_STATES = tuple(enum_name(ShimState, m) for m in ShimState)
MECHANISMS = tuple(enum_name(Mechanism, m) for m in Mechanism)
ENTRY_FLAGS = {m.value: enum_name(EntryFlag, m) for m in EntryFlag}
CAPS = {m.value: enum_name(Capability, m) for m in Capability}
AGENT_CLOSED = int(AgentFlag.CLOSED)

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


def function_name(fid: int) -> str:
    return FUNCTION_NAMES[fid] if 0 <= fid < len(FUNCTION_NAMES) else f"#{fid}"


# ---- the structs ----------------------------------------------------------------------------
class CommSlot(ctypes.Structure):
    _fields_ = [
        ("addr", ctypes.c_uint64),
        ("state", ctypes.c_uint32),
        ("inflight", ctypes.c_uint32),
        ("seq", ctypes.c_uint64),
        ("last_op", ctypes.c_uint32),
        ("change", ctypes.c_uint32),
        ("serial", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
        ("rank", ctypes.c_int32),
        ("size", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("creator", ctypes.c_uint32),
        ("parent_serial", ctypes.c_uint64),
        ("parent_addr", ctypes.c_uint64),
        ("created_ns", ctypes.c_uint64),
        ("ended_ns", ctypes.c_uint64),
        ("comm_id", ctypes.c_uint64),
        ("coll_seq", ctypes.c_uint64),
        ("derived", ctypes.c_uint32),
        ("reserved", ctypes.c_uint8 * 12),
    ]


class ReportEntry(ctypes.Structure):
    _fields_ = [
        ("addr", ctypes.c_uint64),
        ("serial", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
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
        ("epoch", ctypes.c_uint64),
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
        ("current_epoch", ctypes.c_uint64),
        ("abort_epoch", ctypes.c_uint64),
        ("abort_request", ctypes.c_uint64),
        ("doorbell", ctypes.c_uint32),
        ("report_seq", ctypes.c_uint32),
        ("owner_pid", ctypes.c_int32),
        ("shim_state", ctypes.c_uint32),
        ("liveness", ctypes.c_uint64),
        ("ack_epoch", ctypes.c_uint64),
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


# ---- the mirror against the built library ---------------------------------------------------
def _library(lib_path: Path | None) -> ctypes.CDLL:
    if lib_path is None:
        lib_path = shim_library_path()
    return ctypes.CDLL(str(lib_path))


def library_layout(lib_path: Path | None = None) -> dict[str, tuple[int, int]]:
    """{"struct.field": (offset, size), "struct": (0, sizeof)} as compiled into the library."""

    class _FieldInfo(ctypes.Structure):
        _fields_ = [("name", ctypes.c_char_p), ("offset", ctypes.c_uint32),
                    ("size", ctypes.c_uint32)]  # fmt: skip

    table = ctypes.cast(_library(lib_path).ftshim_layout_fields, ctypes.POINTER(_FieldInfo))
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


def library_enums(lib_path: Path | None = None) -> dict[tuple[str, int], str]:
    """{(family, value): name} for every value the library knows (ftshim_enum_values)."""

    class _EnumValue(ctypes.Structure):
        _fields_ = [("family", ctypes.c_char_p), ("value", ctypes.c_uint32),
                    ("name", ctypes.c_char_p)]  # fmt: skip

    table = ctypes.cast(_library(lib_path).ftshim_enum_values, ctypes.POINTER(_EnumValue))
    out: dict[tuple[str, int], str] = {}
    i = 0
    while table[i].family is not None:
        out[(table[i].family.decode(), table[i].value)] = table[i].name.decode()
        i += 1
    return out


def mirror_enums() -> dict[tuple[str, int], str]:
    """The same, from the Python enums."""
    return {(family, m.value): enum_name(cls, m.value)
            for family, cls in ENUMS.items() for m in cls}  # fmt: skip


def library_enum_name(lib: ctypes.CDLL, family: str, value: int) -> str | None:
    """What the library's ftshim_<family>_name(value) answers (None for NULL)."""
    fn = getattr(lib, f"ftshim_{family}_name")
    fn.argtypes = [ctypes.c_uint32]
    fn.restype = ctypes.c_char_p
    name = fn(value)
    return name.decode() if name is not None else None
