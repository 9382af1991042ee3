"""The agent's side of the native NCCL shim (csrc/, docs/shim.md).

One :class:`ShimControl` per worker process: it creates the shared-memory control page, gives
the environment that puts the shim into the worker (``LD_PRELOAD``), and drives it: liveness,
per-communicator progress, and "abort every communicator made so far".

The shim counts in *comm epochs*, private to one control page: it is neither the job
generation (``gen/N``) nor the member epoch (``rgen/N``), and a caller never needs to map
those onto it: :meth:`ShimControl.abort_all` stops every communicator created so far.

Modules: :mod:`ftrun.shim.abi` (the ctypes mirror of ``csrc/ftshim_abi.h``, its enums, and
the checks against the built library), :mod:`ftrun.shim.control` (``ShimControl``, reports,
errors, where the library is), :mod:`ftrun.shim.selftest` (doctor's round trip). Nothing is
pickled: the page is plain C structs.

Usable on its own (tests, tools, doctor)::

    with ShimControl(label="rank0") as ctl:
        proc = subprocess.Popen(cmd, env=ctl.worker_env(os.environ))
        ctl.bind(proc.pid)
        ...
        report = ctl.abort_all(timeout_s=5.0)
"""

from __future__ import annotations

from ftrun.protocol import SURVIVOR_TORCH_ENV
from ftrun.shim.abi import (
    ABI_VERSION,
    AGENT_CLOSED,
    CAPS,
    ENTRY_FLAGS,
    ENUMS,
    ENV_CONTROL,
    ENV_DEBUG,
    EPOCH_ALL,
    EXIT_AGENT_LOST,
    FUNCTION_NAMES,
    MAGIC,
    MAX_COMMS,
    MECHANISMS,
    MIRRORS,
    SHIM_STATES,
    SLOT_STATES,
    AgentFlag,
    Capability,
    CommSlot,
    CommState,
    EntryFlag,
    Mechanism,
    Page,
    Report,
    ReportEntry,
    ReportPhase,
    ShimMode,
    ShimState,
    library_enum_name,
    library_enums,
    library_layout,
    mirror_enums,
    mirror_layout,
)
from ftrun.shim.control import (
    AbortEntry,
    AbortReport,
    CommunicatorInfo,
    ShimControl,
    ShimTimeoutError,
    read_page,
    torch_env_for_survivors,
)
from ftrun.shim.control import (
    _version_str as _version_str,  # tests/test_shim_nccl_real.py
)
from ftrun.shim.native import ShimError, ShimNotBuiltError, fake_nccl_dir, shim_library_path
from ftrun.shim.selftest import SelfTestResult, self_test

__all__ = [
    "ABI_VERSION",
    "AGENT_CLOSED",
    "CAPS",
    "ENTRY_FLAGS",
    "ENUMS",
    "ENV_CONTROL",
    "ENV_DEBUG",
    "EPOCH_ALL",
    "EXIT_AGENT_LOST",
    "FUNCTION_NAMES",
    "MAGIC",
    "MAX_COMMS",
    "MECHANISMS",
    "MIRRORS",
    "SHIM_STATES",
    "SLOT_STATES",
    "SURVIVOR_TORCH_ENV",
    "AbortEntry",
    "AbortReport",
    "AgentFlag",
    "Capability",
    "CommSlot",
    "CommState",
    "CommunicatorInfo",
    "EntryFlag",
    "Mechanism",
    "Page",
    "Report",
    "ReportEntry",
    "ReportPhase",
    "SelfTestResult",
    "ShimControl",
    "ShimError",
    "ShimMode",
    "ShimNotBuiltError",
    "ShimState",
    "ShimTimeoutError",
    "fake_nccl_dir",
    "library_enum_name",
    "library_enums",
    "library_layout",
    "mirror_enums",
    "mirror_layout",
    "read_page",
    "self_test",
    "shim_library_path",
    "torch_env_for_survivors",
]
