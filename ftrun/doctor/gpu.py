"""Checks of the GPUs through NVML: count, ECC, memory, thermals, PCIe, NVLink, persistence,
MIG, leftover processes.

One bad GPU drags a whole job down: collectives run at the speed of the slowest member, a
GPU with pending memory repairs corrupts results, a straggler from the last job makes the
new one run out of memory. Each check here looks at one aspect on every visible GPU and
reports per GPU; "GPU 0: x" findings that repeat are merged into "GPUs 0-7: x". NVML is
queried once, in the background (``Context.nvml``), and a hung driver fails the checks
that wait for it instead of hanging the doctor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType

from ftrun.doctor.core import (
    NVML_HANG_HINT,
    CheckResult,
    Context,
    Findings,
    Status,
    check,
    failed,
    nvml_hint,
    one_line,
    process_name,
    skipped,
    warned,
)
from ftrun.host import gpu as gpumod

GPU_PROC_FAIL_BYTES = 1 << 30  # another process holding >= 1 GiB will cost us an OOM
TEMP_MARGIN_C = 5  # warn this close to the slowdown threshold


def _gpus_or_result(ctx: Context) -> list[gpumod.Gpu] | CheckResult:
    """The visible, healthy-enough-to-query GPUs, or the skip/fail to report instead.

    Per-aspect GPU checks (ECC, thermals...) skip when there are no GPUs: the ``gpu``
    check already reports why.
    """
    if ctx.options.nproc_per_node == "cpu":
        return skipped("--nproc-per-node cpu: GPUs not used")
    try:
        info = ctx.nvml.get()
    except Exception as exc:
        nvml = sys.modules.get("pynvml")
        not_found = nvml is not None and isinstance(
            exc, (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded))
        if isinstance(exc, ImportError) or not_found:
            return skipped("no GPU")
        return failed(f"NVML: {exc}", "see the gpu check")
    gpus = [g for g in info.visible_gpus() if g.handle is not None]
    if not gpus:
        return skipped("no GPU")
    return gpus


def _per_gpu(ctx: Context, fn: Callable[[gpumod.Gpu, ModuleType, Findings], None],
             summary: Callable[[list[gpumod.Gpu]], str]) -> CheckResult:
    """Run ``fn`` for each visible GPU; an NVML error on one GPU is a finding, not a crash."""
    gpus = _gpus_or_result(ctx)
    if isinstance(gpus, CheckResult):
        return gpus
    nvml = ctx.nvml.get().nvml
    findings = Findings()
    for g in gpus:
        try:
            fn(g, nvml, findings)
            findings.add("pass", "")
        except nvml.NVMLError_NotSupported:
            findings.add("skip", f"GPU {g.index}: not supported")
        except nvml.NVMLError as exc:
            findings.add("fail", f"GPU {g.index}: NVML: {exc}", nvml_hint(nvml, exc))
    return findings.result(summary(gpus))


def _names(gpus: list[gpumod.Gpu]) -> str:
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.name] = counts.get(g.name, 0) + 1
    return ", ".join(f"{n} x {name}" for name, n in counts.items())


@check("gpu", NVML_HANG_HINT)
def check_gpu(ctx: Context) -> CheckResult:
    """How many GPUs this node has against what --nproc-per-node will start, and the driver.

    No driver at all is a finding ("CPU only"), not a failure, unless the job asks for GPUs.
    """
    nproc = ctx.options.nproc_per_node
    if nproc == "cpu":
        return skipped("--nproc-per-node cpu: GPUs not used")
    try:
        info = ctx.nvml.get()
    except ImportError as exc:
        status = failed if ctx.wants_gpu else skipped
        return status(f"no GPU: CPU only (pynvml not importable: {one_line(exc)})",
                      "pip install nvidia-ml-py")
    except Exception as exc:
        nvml = sys.modules.get("pynvml")
        if nvml is None or not isinstance(exc, nvml.NVMLError):
            raise
        hint = nvml_hint(nvml, exc)
        if isinstance(exc, nvml.NVMLError_LibraryNotFound):
            if ctx.wants_gpu:
                return failed(f"no NVIDIA driver ({exc}) but --nproc-per-node gpu asks for GPUs",
                              hint)
            return skipped(f"no GPU: CPU only (no NVIDIA driver: {exc})")
        if isinstance(exc, nvml.NVMLError_DriverNotLoaded) and not ctx.wants_gpu:
            return warned(f"NVIDIA driver installed but not loaded ({exc}): CPU only", hint)
        return failed(f"NVML: {exc}", hint)
    visible = info.visible_gpus()
    findings = Findings()
    if info.visible_note:
        findings.add("warn", info.visible_note, "fix CUDA_VISIBLE_DEVICES")
    for g in visible:
        if g.error:
            findings.add("fail", f"GPU {g.index}: {g.error}", _nvml_hint_by_text(info, g))
    n = len(visible)
    hidden = len(info.gpus) - n
    summary = (f"{n} GPU(s): {_names(visible)}; driver {info.driver_version}, "
               f"CUDA {gpumod.cuda_version_str(info.cuda_driver_version)}")
    if hidden:
        summary += f" ({hidden} more hidden by CUDA_VISIBLE_DEVICES)"
    if n == 0:
        if ctx.wants_gpu or (isinstance(nproc, int) and info.gpus):
            findings.add("fail", f"no GPU visible ({len(info.gpus)} on the node) but "
                         f"--nproc-per-node {nproc}", "check CUDA_VISIBLE_DEVICES")
        else:
            return skipped(f"no GPU: CPU only (driver {info.driver_version}, 0 GPUs)")
    elif isinstance(nproc, int):
        if nproc > n:
            findings.add("fail", f"--nproc-per-node {nproc} but only {n} GPU(s) visible",
                         f"use --nproc-per-node {n} (or gpu), or fix CUDA_VISIBLE_DEVICES")
        elif nproc < n:
            findings.add("pass", f"--nproc-per-node {nproc} uses {nproc} of {n}")
    return findings.result(summary)


def _nvml_hint_by_text(info: gpumod.NvmlInfo, g: gpumod.Gpu) -> str:
    if "lost" in (g.error or "").lower():
        return "a GPU fell off the bus: drain the node, reset or RMA the GPU"
    return "check `nvidia-smi` and dmesg for Xid errors"


@check("gpu.ecc", NVML_HANG_HINT)
def check_gpu_ecc(ctx: Context) -> CheckResult:
    """Uncorrected ECC errors: volatile ones (since the last driver load) mean the GPU's
    memory is corrupt now; aggregate ones (lifetime) mean it has a history.
    """
    def one(g: gpumod.Gpu, nvml: ModuleType, f: Findings) -> None:
        current, _pending = nvml.nvmlDeviceGetEccMode(g.handle)
        if current != nvml.NVML_FEATURE_ENABLED:
            f.add("warn", f"GPU {g.index}: ECC disabled",
                  "enable ECC (nvidia-smi -i N -e 1, then reset) so corruption is detected")
            return
        unc = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        vol = nvml.nvmlDeviceGetTotalEccErrors(g.handle, unc, nvml.NVML_VOLATILE_ECC)
        agg = nvml.nvmlDeviceGetTotalEccErrors(g.handle, unc, nvml.NVML_AGGREGATE_ECC)
        if vol:
            f.add("fail", f"GPU {g.index}: {vol} uncorrected ECC error(s) since driver load "
                  f"({agg} lifetime)", "drain the node and reset the GPU; RMA if it recurs")
        elif agg:
            f.add("warn", f"GPU {g.index}: {agg} uncorrected ECC error(s) in its lifetime",
                  "watch this GPU; RMA if errors recur")

    return _per_gpu(ctx, one, lambda gs: f"{len(gs)} GPU(s): no uncorrected ECC errors")


@check("gpu.memory", NVML_HANG_HINT)
def check_gpu_memory_health(ctx: Context) -> CheckResult:
    """Pending page retirement (pre-Ampere) or row remapping (Ampere+) only takes effect
    after a GPU reset: until then the bad memory is still in use.
    """
    def one(g: gpumod.Gpu, nvml: ModuleType, f: Findings) -> None:
        try:
            _corr, unc, pending, failure = nvml.nvmlDeviceGetRemappedRows(g.handle)
        except nvml.NVMLError_NotSupported:
            pass  # pre-Ampere: page retirement instead
        else:
            if failure:
                f.add("fail", f"GPU {g.index}: row remapping failed (no spare rows left)",
                      "drain the node and RMA the GPU")
            elif pending:
                f.add("fail", f"GPU {g.index}: row remap pending", "reset the GPU "
                      "(nvidia-smi -r -i N) or reboot so the remap takes effect")
            elif unc:
                f.add("pass", f"GPU {g.index}: {unc} row(s) remapped for uncorrectable errors")
            return
        pending_pages = nvml.nvmlDeviceGetRetiredPagesPendingStatus(g.handle)
        cause = nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        dbe = len(nvml.nvmlDeviceGetRetiredPages(g.handle, cause))
        if pending_pages == nvml.NVML_FEATURE_ENABLED:
            f.add("fail", f"GPU {g.index}: page retirement pending ({dbe} retired for "
                  "double-bit errors)", "reset the GPU (nvidia-smi -r -i N) or reboot")
        elif dbe:
            f.add("warn", f"GPU {g.index}: {dbe} page(s) retired for double-bit ECC errors",
                  "RMA the GPU if the count keeps growing (NVIDIA's threshold is 60)")

    return _per_gpu(ctx, one, lambda gs: f"{len(gs)} GPU(s): nothing pending retirement or remap")


# Clock-event (throttle) reasons, by how bad they are. Idle and power capping are normal.
_THROTTLE_FAIL = {
    "HwSlowdown": "HW slowdown",
    "HwThermalSlowdown": "HW thermal slowdown",
    "HwPowerBrakeSlowdown": "HW power brake",
}
_THROTTLE_WARN = {"SwThermalSlowdown": "SW thermal slowdown"}


def _reasons(nvml: ModuleType, mask: int, table: dict[str, str]) -> list[str]:
    return [label for key, label in table.items()
            if mask & getattr(nvml, f"nvmlClocksThrottleReason{key}", 0)]


@check("gpu.thermal", NVML_HANG_HINT)
def check_gpu_thermal(ctx: Context) -> CheckResult:
    """Temperature, throttle reasons and clocks: one throttled GPU slows every collective,
    so the whole job runs at the speed of the hottest GPU.
    """
    temps: list[int] = []

    def one(g: gpumod.Gpu, nvml: ModuleType, f: Findings) -> None:
        temp = nvml.nvmlDeviceGetTemperature(g.handle, nvml.NVML_TEMPERATURE_GPU)
        temps.append(temp)
        get_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = get_reasons(g.handle)
        sm = nvml.nvmlDeviceGetClockInfo(g.handle, nvml.NVML_CLOCK_SM)
        sm_max = nvml.nvmlDeviceGetMaxClockInfo(g.handle, nvml.NVML_CLOCK_SM)
        where = f"GPU {g.index}: {temp} °C, SM {sm}/{sm_max} MHz"
        hard = _reasons(nvml, mask, _THROTTLE_FAIL)
        soft = _reasons(nvml, mask, _THROTTLE_WARN)
        if hard:
            f.add("fail", f"{where}, throttled: {', '.join(hard + soft)}",
                  "check cooling, power supply and `nvidia-smi -q -d PERFORMANCE`; drain the node")
            return
        if soft:
            f.add("warn", f"{where}, throttled: {', '.join(soft)}", "check cooling and airflow")
            return
        try:
            slowdown = nvml.nvmlDeviceGetTemperatureThreshold(
                g.handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        except nvml.NVMLError:
            slowdown = 0
        if slowdown and temp >= slowdown - TEMP_MARGIN_C:
            f.add("warn", f"{where}, near its slowdown temperature ({slowdown} °C)",
                  "check cooling before a long job")

    def summary(gs: list[gpumod.Gpu]) -> str:
        span = f"{min(temps)}-{max(temps)} °C" if temps else "?"
        return f"{len(gs)} GPU(s) at {span}, no thermal or HW throttling"

    return _per_gpu(ctx, one, summary)


@check("gpu.pcie", NVML_HANG_HINT)
def check_gpu_pcie(ctx: Context) -> CheckResult:
    """A PCIe link trained at fewer lanes than it can (x8 instead of x16) halves host
    bandwidth; a lower generation is normal while the GPU idles (power saving).
    """
    def one(g: gpumod.Gpu, nvml: ModuleType, f: Findings) -> None:
        gen = nvml.nvmlDeviceGetCurrPcieLinkGeneration(g.handle)
        gen_max = nvml.nvmlDeviceGetMaxPcieLinkGeneration(g.handle)
        width = nvml.nvmlDeviceGetCurrPcieLinkWidth(g.handle)
        width_max = nvml.nvmlDeviceGetMaxPcieLinkWidth(g.handle)
        if width < width_max:
            f.add("warn", f"GPU {g.index}: PCIe link degraded to x{width} (max x{width_max}), "
                  f"gen {gen}/{gen_max}", "reseat the GPU or riser; check `lspci -vv` LnkSta")
        elif gen < gen_max:
            f.add("pass", f"GPU {g.index} at gen {gen}/{gen_max} (normal when idle)")

    return _per_gpu(ctx, one, lambda gs: f"{len(gs)} GPU(s): PCIe links at full width")


@check("gpu.nvlink", NVML_HANG_HINT)
def check_gpu_nvlink(ctx: Context) -> CheckResult:
    """A GPU with fewer NVLinks up than its peers drags every all-reduce down to the speed
    of its remaining links (or PCIe). Links no GPU uses (unwired) are not a finding.
    """
    gpus = _gpus_or_result(ctx)
    if isinstance(gpus, CheckResult):
        return gpus
    nvml = ctx.nvml.get().nvml
    up: dict[int, int] = {}
    down: dict[int, list[int]] = {}
    for g in gpus:
        up[g.index], down[g.index] = 0, []
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(g.handle, link)
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
                break  # past the last link (or no NVLink at all)
            if state == nvml.NVML_FEATURE_ENABLED:
                up[g.index] += 1
            else:
                down[g.index].append(link)
    most = max(up.values(), default=0)
    if most == 0:
        return skipped(f"{len(gpus)} GPU(s): no NVLink (PCIe only)")
    findings = Findings()
    for idx, n in up.items():
        if n < most:
            findings.add("fail", f"GPU {idx}: {n} NVLink(s) up, peers have {most} "
                         f"(down: {', '.join(map(str, down[idx])) or '?'})",
                         "check `nvidia-smi nvlink -s`; reset the GPU or drain the node")
    return findings.result(f"{len(gpus)} GPU(s) with {most} NVLinks up each")


@check("gpu.persistence", NVML_HANG_HINT)
def check_gpu_persistence(ctx: Context) -> CheckResult:
    """Without persistence mode the driver tears GPUs down between processes: the first
    CUDA call of every worker (and every restart) pays seconds of re-initialisation.
    """
    def one(g: gpumod.Gpu, nvml: ModuleType, f: Findings) -> None:
        if nvml.nvmlDeviceGetPersistenceMode(g.handle) != nvml.NVML_FEATURE_ENABLED:
            f.add("warn", f"GPU {g.index}: persistence mode off",
                  "enable it: nvidia-smi -pm 1 (or run nvidia-persistenced)")

    return _per_gpu(ctx, one, lambda gs: f"{len(gs)} GPU(s): persistence mode on")


@check("gpu.mig", NVML_HANG_HINT)
def check_gpu_mig(ctx: Context) -> CheckResult:
    """With MIG on, a process sees one GPU slice and NCCL cannot span slices: a multi-GPU
    job on this node would not start or would run on a fraction of each GPU.
    """
    nproc = ctx.options.nproc_per_node

    def one(g: gpumod.Gpu, nvml: ModuleType, f: Findings) -> None:
        current, pending = nvml.nvmlDeviceGetMigMode(g.handle)
        if current == nvml.NVML_DEVICE_MIG_ENABLE:
            status: Status = "warn" if nproc == 1 else "fail"
            f.add(status, f"GPU {g.index}: MIG enabled",
                  "disable MIG: nvidia-smi -i N -mig 0 (then reset the GPU)")
        elif pending == nvml.NVML_DEVICE_MIG_ENABLE:
            f.add("warn", f"GPU {g.index}: MIG will be enabled at the next reset",
                  "nvidia-smi -i N -mig 0 to cancel")

    return _per_gpu(ctx, one, lambda gs: f"{len(gs)} GPU(s): MIG off")


@check("gpu.processes", NVML_HANG_HINT)
def check_gpu_processes(ctx: Context) -> CheckResult:
    """A leftover process (a previous job's straggler) holding GPU memory makes the new job
    run out of memory or share the GPU.
    """
    def one(g: gpumod.Gpu, nvml: ModuleType, f: Findings) -> None:
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(g.handle):
            used = p.usedGpuMemory
            size = "? GiB" if used is None else f"{used / (1 << 30):.1f} GiB"
            status: Status = "fail" if used is None or used >= GPU_PROC_FAIL_BYTES else "warn"
            f.add(status, f"GPU {g.index}: pid {p.pid} ({process_name(p.pid)}) holds {size}",
                  "stop the leftover process (kill PID) or drain the node")

    return _per_gpu(ctx, one, lambda gs: f"{len(gs)} GPU(s): no other process holds GPU memory")
