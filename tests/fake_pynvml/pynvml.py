"""A stand-in for ``pynvml`` that answers like NVML on a chosen (broken) node.

Put this directory first on ``PYTHONPATH`` of a subprocess and ``import pynvml`` gets this
module. It loads the *real* pynvml (nvidia-ml-py) under another name and re-exports all of
it, so the constants, structs and ``NVMLError`` subclasses (``NVMLError_LibraryNotFound``,
``NVMLError_Timeout``...) are the real ones, raised with the real ``NVML_ERROR_*`` codes.
Only the functions ftrun's doctor calls are replaced, by ones reading a simulated node;
any other NVML function falls through to the real one, which (no library loaded) raises
``NVMLError_Uninitialized`` just as real NVML does when called out of turn.

Environment:

- ``FAKE_NVML_SCENARIO``: one of :data:`SCENARIOS` (default ``healthy``);
- ``FAKE_NVML_GPUS``: number of GPUs (default 8);
- ``FAKE_NVML_HANG_S``: how long a hanging call blocks (default 30 s).

Values are those of a DGX H100 (driver 550.54.15, CUDA 12.4) as ``nvidia-smi -q`` reports
them; the ``retired`` scenario is a V100 (page retirement, no row remapping).
"""

# ruff: noqa: F403, F405  (re-exports the real pynvml, whose names are used unqualified)
from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _load_real():
    for entry in sys.path:
        candidate = Path(entry or ".").resolve() / "pynvml.py"
        if candidate.is_file() and candidate.parent != _HERE:
            spec = importlib.util.spec_from_file_location("_real_pynvml", candidate)
            module = importlib.util.module_from_spec(spec)
            sys.modules["_real_pynvml"] = module  # its error-class factory looks itself up
            spec.loader.exec_module(module)
            return module
    raise ImportError("fake pynvml: the real pynvml (nvidia-ml-py) is not installed")


_real = _load_real()
from _real_pynvml import *  # noqa: E402  (constants, structs, NVMLError classes)
from _real_pynvml import _nvmlGetFunctionPointer  # noqa: E402, F401

SCENARIO = os.environ.get("FAKE_NVML_SCENARIO", "healthy")
SCENARIOS = (
    "healthy", "notfound", "driver_not_loaded", "hang", "hang_init", "timeout", "ecc",
    "ecc_aggregate", "throttle", "remap", "retired", "pcie", "procs", "mig", "nvlink",
    "gpu_lost", "nopersist",
)
if SCENARIO not in SCENARIOS:
    raise ImportError(f"fake pynvml: unknown FAKE_NVML_SCENARIO={SCENARIO!r}")
N_GPUS = int(os.environ.get("FAKE_NVML_GPUS", "8"))
HANG_S = float(os.environ.get("FAKE_NVML_HANG_S", "30"))
GIB = 1 << 30

_state = {"init": 0}
_lock = threading.Lock()


def _raise(code: int):
    raise _real.NVMLError(code)  # NVMLError.__new__ picks the subclass for the code


def _hang(fn_name: str) -> None:
    hangs = {"hang": "nvmlDeviceGetTotalEccErrors", "hang_init": "nvmlInit"}
    if hangs.get(SCENARIO) == fn_name:
        time.sleep(HANG_S)


class _Handle:
    """What nvmlDeviceGetHandleByIndex returns (real NVML: an opaque pointer)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.index}>"


def _gpu(i: int) -> dict:
    g = {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-6b3c8a2e-1f0d-4c1e-9a8b-{i:012x}",
        "ecc_mode": [NVML_FEATURE_ENABLED, NVML_FEATURE_ENABLED],
        "ecc_volatile": 0,
        "ecc_aggregate": 0,
        "remapped": (0, 0, 0, 0),  # corrRows, uncRows, isPending, failureOccurred
        "retired_pending": None,  # None: not supported (Ampere+ remaps rows instead)
        "retired_dbe": [],
        "temp": 31 + i % 4,
        "slowdown": 87,
        "reasons": nvmlClocksEventReasonGpuIdle,
        "sm_clock": 345,
        "sm_max": 1980,
        "pcie": (5, 5, 16, 16),  # cur gen, max gen, cur width, max width
        "nvlinks": [NVML_FEATURE_ENABLED] * 18,
        "persistence": NVML_FEATURE_ENABLED,
        "mig": [NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_DISABLE],
        "procs": [],
        "memory": (85520809984, 84974239744, 546570240),  # total, free, used
    }
    if SCENARIO == "ecc" and i == 3:
        g.update(ecc_volatile=2, ecc_aggregate=2)
    elif SCENARIO == "ecc_aggregate" and i == 3:
        g.update(ecc_aggregate=5)
    elif SCENARIO == "throttle" and i == 5:
        g.update(temp=92, sm_clock=1095, reasons=(nvmlClocksEventReasonHwSlowdown
                                                  | nvmlClocksEventReasonHwThermalSlowdown
                                                  | nvmlClocksEventReasonSwThermalSlowdown))
    elif SCENARIO == "remap" and i == 2:
        g.update(remapped=(0, 1, 1, 0))
    elif SCENARIO == "retired":
        g.update(name="Tesla V100-SXM2-32GB", remapped=None, retired_pending=0,
                 nvlinks=[NVML_FEATURE_ENABLED] * 6, pcie=(3, 3, 16, 16))
        if i == 1:
            g.update(retired_pending=1, retired_dbe=[0x3F2A1000, 0x3F2A2000])
    elif SCENARIO == "pcie" and i == 6:
        g.update(pcie=(5, 5, 8, 16))
    elif SCENARIO == "procs" and i == 0:
        proc = c_nvmlProcessInfo_v3_t(pid=4242, usedGpuMemory=30 * GIB,
                                      gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
        g.update(procs=[proc])
    elif SCENARIO == "mig" and i == 1:
        g.update(mig=[NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE])
    elif SCENARIO == "nvlink" and i == 4:
        g["nvlinks"][:4] = [NVML_FEATURE_DISABLED] * 4
    elif SCENARIO == "nopersist":
        g.update(persistence=NVML_FEATURE_DISABLED)
    return g


_GPUS = [_gpu(i) for i in range(N_GPUS)]


def _dev(handle) -> dict:
    if _state["init"] <= 0:
        _raise(NVML_ERROR_UNINITIALIZED)
    if not isinstance(handle, _Handle):
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    return _GPUS[handle.index]


# ---------------------------------------------------------------- library / system


def nvmlInitWithFlags(flags):
    _hang("nvmlInit")
    if SCENARIO == "notfound":
        _raise(NVML_ERROR_LIBRARY_NOT_FOUND)
    if SCENARIO == "driver_not_loaded":
        _raise(NVML_ERROR_DRIVER_NOT_LOADED)
    with _lock:
        _state["init"] += 1


def nvmlInit():
    nvmlInitWithFlags(0)


def nvmlShutdown():
    with _lock:
        if _state["init"] <= 0:
            _raise(NVML_ERROR_UNINITIALIZED)
        _state["init"] -= 1


def _initialized():
    if _state["init"] <= 0:
        _raise(NVML_ERROR_UNINITIALIZED)


def nvmlSystemGetDriverVersion():
    _initialized()
    return "550.54.15"


def nvmlSystemGetCudaDriverVersion():
    _initialized()
    return 12040


def nvmlSystemGetCudaDriverVersion_v2():
    return nvmlSystemGetCudaDriverVersion()


def nvmlDeviceGetCount():
    _initialized()
    return N_GPUS


def nvmlDeviceGetHandleByIndex(index):
    _initialized()
    if not 0 <= index < N_GPUS:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    if SCENARIO == "gpu_lost" and index == N_GPUS - 1:
        _raise(NVML_ERROR_GPU_IS_LOST)
    return _Handle(index)


def nvmlDeviceGetName(handle):
    return _dev(handle)["name"]


def nvmlDeviceGetUUID(handle):
    return _dev(handle)["uuid"]


def nvmlDeviceGetIndex(handle):
    _dev(handle)
    return handle.index


# ---------------------------------------------------------------- memory health


def nvmlDeviceGetEccMode(handle):
    return list(_dev(handle)["ecc_mode"])


def nvmlDeviceGetTotalEccErrors(handle, errorType, counterType):
    g = _dev(handle)
    _hang("nvmlDeviceGetTotalEccErrors")
    if errorType == NVML_MEMORY_ERROR_TYPE_CORRECTED:
        return 0
    if errorType != NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    if counterType == NVML_VOLATILE_ECC:
        return g["ecc_volatile"]
    if counterType == NVML_AGGREGATE_ECC:
        return g["ecc_aggregate"]
    _raise(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceGetRemappedRows(handle):
    g = _dev(handle)
    if g["remapped"] is None:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return tuple(g["remapped"])


def nvmlDeviceGetRetiredPagesPendingStatus(handle):
    g = _dev(handle)
    if g["retired_pending"] is None:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return int(g["retired_pending"])


def nvmlDeviceGetRetiredPages(handle, sourceFilter):
    g = _dev(handle)
    if g["retired_pending"] is None:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    if sourceFilter == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
        return list(g["retired_dbe"])
    if sourceFilter == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
        return []
    _raise(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceGetMemoryInfo(handle, version=None):
    total, free, used = _dev(handle)["memory"]
    return c_nvmlMemory_t(total=total, free=free, used=used)


# ---------------------------------------------------------------- thermals and clocks


def nvmlDeviceGetTemperature(handle, sensor):
    g = _dev(handle)
    if SCENARIO == "timeout":
        _raise(NVML_ERROR_TIMEOUT)
    if sensor != NVML_TEMPERATURE_GPU:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return g["temp"]


def nvmlDeviceGetTemperatureThreshold(handle, threshold):
    g = _dev(handle)
    if threshold == NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
        return g["slowdown"]
    if threshold == NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
        return g["slowdown"] + 5
    _raise(NVML_ERROR_NOT_SUPPORTED)


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    return _dev(handle)["reasons"]


def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
    return _dev(handle)["reasons"]


def nvmlDeviceGetClockInfo(handle, type):
    g = _dev(handle)
    return g["sm_clock"] if type == NVML_CLOCK_SM else 2619


def nvmlDeviceGetMaxClockInfo(handle, type):
    g = _dev(handle)
    return g["sm_max"] if type == NVML_CLOCK_SM else 2619


# ---------------------------------------------------------------- links


def nvmlDeviceGetCurrPcieLinkGeneration(handle):
    return _dev(handle)["pcie"][0]


def nvmlDeviceGetMaxPcieLinkGeneration(handle):
    return _dev(handle)["pcie"][1]


def nvmlDeviceGetCurrPcieLinkWidth(handle):
    return _dev(handle)["pcie"][2]


def nvmlDeviceGetMaxPcieLinkWidth(handle):
    return _dev(handle)["pcie"][3]


def nvmlDeviceGetNvLinkState(handle, link):
    links = _dev(handle)["nvlinks"]
    if not links:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    if not 0 <= link < len(links):
        _raise(NVML_ERROR_INVALID_ARGUMENT)  # what NVML answers past the last link
    return links[link]


# ---------------------------------------------------------------- modes and processes


def nvmlDeviceGetPersistenceMode(handle):
    return _dev(handle)["persistence"]


def nvmlDeviceGetMigMode(handle):
    return list(_dev(handle)["mig"])


def nvmlDeviceGetComputeRunningProcesses(handle):
    return [nvmlStructToFriendlyObject(p) for p in _dev(handle)["procs"]]


nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses
