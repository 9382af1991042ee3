"""Checks of the software the workers will run: Python, torch, CUDA, NCCL and the shim.

A node can have healthy GPUs and still not train: a CPU build of torch, a driver too old
for torch's CUDA, NCCL settings that quietly make every collective slower, or a torch with
NCCL built in, which the shim cannot interpose (fault tolerance then silently does not
work). These checks find each of those before the job starts; the last one builds, loads
and exercises the shim itself.
"""

from __future__ import annotations

import os
import platform
import re
import struct
import sys
import time
from pathlib import Path

from ftrun.doctor.core import (
    NVML_HANG_HINT,
    CheckResult,
    Context,
    Findings,
    check,
    failed,
    nvml_or_error,
    one_line,
    passed,
    skipped,
    warned,
)
from ftrun.host import gpu as gpumod

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 4)


@check("python")
def check_python(ctx: Context) -> CheckResult:
    """ftrun supports Python 3.10+; report which interpreter the workers will run."""
    version = platform.python_version()
    detail = f"Python {version} ({sys.executable})"
    if sys.version_info[:2] < MIN_PYTHON:
        return failed(detail, f"ftrun needs Python {'.'.join(map(str, MIN_PYTHON))}+")
    return passed(detail)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


@check("torch", "`import torch` took too long: slow or hung filesystem (NFS?) under site-packages")
def check_torch(ctx: Context) -> CheckResult:
    """The workers need torch >= 2.4 with torch.distributed; say which build it is."""
    try:
        torch = ctx.torch.get()
    except ImportError as exc:
        return failed(f"torch does not import: {one_line(exc)}", "pip install torch")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    detail = f"torch {torch.__version__} ({build}) from {Path(torch.__file__).parent}"
    if _version_tuple(torch.__version__) < MIN_TORCH:
        return failed(detail, f"ftrun needs torch {'.'.join(map(str, MIN_TORCH))}+")
    if not torch.distributed.is_available():
        return failed(detail + ", without torch.distributed",
                      "install a torch build with distributed support")
    return passed(detail)


@check("cuda", NVML_HANG_HINT)
def check_cuda(ctx: Context) -> CheckResult:
    """torch's CUDA must be usable by the installed driver, and see the GPUs NVML sees."""
    torch = ctx.torch.get()
    nvml, nvml_error = nvml_or_error(ctx)
    n_nvml = len(nvml.visible) if nvml else 0
    if not torch.version.cuda:
        if n_nvml and ctx.options.nproc_per_node != "cpu":
            return failed(
                f"torch is a CPU build but {n_nvml} GPU(s) are present: the job would run on CPU",
                "install a CUDA build of torch (pip install torch --index-url "
                "https://download.pytorch.org/whl/cu124)",
            )
        if ctx.wants_gpu:
            return failed("torch is a CPU build but --nproc-per-node gpu asks for GPUs",
                          "install a CUDA build of torch")
        return skipped("CPU build of torch: no CUDA")
    detail = f"torch built for CUDA {torch.version.cuda}"
    if nvml is None:
        if ctx.wants_gpu:
            return failed(f"{detail}, but no usable GPU driver ({nvml_error})",
                          "install the NVIDIA driver or run on a GPU node")
        return skipped(f"{detail}; no GPU driver, so no CUDA ({nvml_error})")
    drv = nvml.cuda_driver_version
    if drv is not None:
        detail += f", driver supports CUDA {gpumod.cuda_version_str(drv)}"
        need = _version_tuple(torch.version.cuda)
        have = (drv // 1000, (drv % 1000) // 10)
        if have[0] < need[0]:
            return failed(detail + ": driver too old for this torch",
                          f"upgrade the NVIDIA driver to one for CUDA {torch.version.cuda}+, "
                          "or install a torch built for an older CUDA")
        if have < need[:2]:
            return warned(detail + ": older minor version (minor-version compatibility, "
                          "PTX JIT may fail)", "upgrade the NVIDIA driver")
    if not torch.cuda.is_available():
        status = failed if (ctx.wants_gpu or n_nvml) else warned
        return status(detail + ", but torch.cuda.is_available() is False",
                      "check `nvidia-smi`, /dev/nvidia* permissions and CUDA_VISIBLE_DEVICES")
    n_torch = torch.cuda.device_count()
    detail += f", {n_torch} device(s) visible to torch"
    if n_torch != n_nvml:
        return warned(detail + f" but NVML sees {n_nvml} visible GPU(s)",
                      "check CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER=PCI_BUS_ID")
    return passed(detail)


NCCL_DEGRADING_VARS = {
    "NCCL_P2P_DISABLE": "GPU peer-to-peer (NVLink/PCIe) disabled",
    "NCCL_SHM_DISABLE": "shared-memory transport disabled",
    "NCCL_IB_DISABLE": "InfiniBand/RoCE disabled: inter-node traffic over TCP sockets",
}


@check("nccl")
def check_nccl(ctx: Context) -> CheckResult:
    """NCCL version torch uses, and NCCL_* settings that silently make training slower."""
    torch = ctx.torch.get()
    import torch.distributed as dist

    if not dist.is_nccl_available():
        if ctx.wants_gpu:
            return failed("torch has no NCCL backend but GPUs are requested",
                          "install a CUDA build of torch")
        return skipped("torch built without NCCL (CPU build): only the gloo backend")
    try:
        version = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # older torch returns an int; broken ones raise
        version = f"? ({one_line(exc)})"
    findings = Findings()
    for var, what in NCCL_DEGRADING_VARS.items():
        if ctx.env.get(var, "0") not in ("", "0"):
            findings.add("warn", f"{var}={ctx.env[var]}: {what}", f"unset {var} unless needed")
    return findings.result(f"NCCL {version}")


# ELF constants for reading DT_NEEDED without running ldd (which may execute code).
_SHT_DYNAMIC, _DT_NEEDED, _DT_NULL = 6, 1, 0


def elf_needed(path: str | os.PathLike[str]) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object.

    Reads only the section headers, .dynamic and its string table, so it is fast even on
    the ~1 GB libtorch_cuda.so. Raises ValueError for anything else.
    """
    with open(path, "rb") as f:
        ident = f.read(64)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
        shoff, = struct.unpack_from("<Q", ident, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", ident, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        for _name, sh_type, _fl, _addr, offset, size, link, *_ in sections:
            if sh_type != _SHT_DYNAMIC:
                continue
            f.seek(offset)
            dyn = f.read(size)
            str_off, str_size = sections[link][4], sections[link][5]
            f.seek(str_off)
            strtab = f.read(str_size)
            needed = []
            for tag, val in struct.iter_unpack("<qQ", dyn):
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    needed.append(strtab[val : strtab.index(b"\0", val)].decode())
            return needed
    return []


def loaded_libraries(pattern: str) -> list[str]:
    """Paths of shared objects matching ``pattern`` mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = {line.split()[-1] for line in maps.splitlines() if re.search(pattern, line)}
    return sorted(p for p in found if p.startswith("/"))


@check("nccl.dynamic")
def check_nccl_dynamic(ctx: Context) -> CheckResult:
    """The shim interposes NCCL, which only works if torch loads libnccl.so.2 dynamically.

    A torch with NCCL linked in statically calls its private copy; no shim can get between
    it and the network, so aborts and fault tolerance would silently not work.
    """
    torch = ctx.torch.get()
    libdir = Path(torch.__file__).parent / "lib"
    cuda_libs = sorted(libdir.glob("libtorch_cuda*.so"))
    if not cuda_libs:
        return skipped("CPU build of torch: no libtorch_cuda.so, no NCCL for the shim to interpose")
    needed = {lib.name: elf_needed(lib) for lib in cuda_libs}
    dynamic = [n for deps in needed.values() for n in deps if n.startswith("libnccl")]
    loaded = loaded_libraries(r"libnccl")
    if dynamic:
        where = f", loaded from {', '.join(loaded)}" if loaded else ""
        return passed(f"{cuda_libs[0].name} links {dynamic[0]} dynamically{where}")
    return failed(
        f"{', '.join(needed)} do not link libnccl dynamically: NCCL is built into torch, "
        "the shim cannot interpose it",
        "use a torch wheel that links libnccl.so.2 (PyPI/download.pytorch.org wheels do)",
    )


@check("shim", "the shim self-test did not finish: NCCL abort round trip hung (shim or driver bug)")
def check_shim(ctx: Context) -> CheckResult:
    """The NCCL shim is what makes ftrun fault tolerant; prove it builds, loads, interposes
    and completes an abort round trip (against the NCCL test double) before the job starts.
    """
    try:
        from ftrun import shim  # written alongside this module; may not exist yet
    except ImportError as exc:
        if exc.name == "ftrun.shim" or (exc.name == "ftrun" and "'shim'" in str(exc)):
            return skipped("shim module not available yet")
        raise  # the shim module exists but is broken: a fail with the one-line reason
    library_path = getattr(shim, "shim_library_path", None)
    self_test = getattr(shim, "self_test", None)
    if library_path is None or self_test is None:
        return skipped("shim module not available yet (no shim_library_path/self_test)")
    not_built = getattr(shim, "ShimNotBuiltError", ())
    try:
        path = library_path()
    except not_built as exc:  # type: ignore[misc]
        gpu_job = ctx.options.nproc_per_node != "cpu" and bool(ctx.visible_gpu_count())
        status = failed if (gpu_job or ctx.wants_gpu) else warned
        return status(f"shim not built: {exc}",
                      "build it: pip install -e . (compiles csrc/ into ftrun/_native/)")
    t = time.monotonic()
    outcome = self_test(timeout_s=max(0.1, ctx.remaining() - 0.3))
    took = time.monotonic() - t
    why = str(getattr(outcome, "detail", "") or "")
    if not getattr(outcome, "ok", False):
        return failed(f"{path}: self-test failed after {took * 1000:.0f} ms: {why}",
                      "rebuild the shim (pip install -e .); docs/shim.md explains the self-test")
    trip = getattr(outcome, "abort_round_trip_s", None)
    release = getattr(outcome, "release_latency_s", None)
    timing = f"abort round trip {trip * 1000:.1f} ms" if trip is not None else "abort round trip ok"
    if release is not None:
        timing += f", collective released in {release * 1000:.1f} ms"
    mechanism = getattr(outcome, "mechanism", None)
    nccl = getattr(outcome, "nccl", None)
    extra = "".join([f" via {mechanism}" if mechanism else "",
                     f" (NCCL test double {nccl})" if nccl else ""])
    return passed(f"{path.name} loads and interposes; {timing}{extra}; "
                  f"self-test {took * 1000:.0f} ms")
