"""``ftrun doctor``: know before the job starts whether this node can train.

A job that lands on a node with a bad GPU, a tiny ``/dev/shm``, a wrong network interface or
a shim that does not interpose wastes hours; each check here looks at one of those things
in well under a second and says what to fix.

Design:

* every check is a small function ``(Context) -> CheckResult`` registered with ``@check``;
* all checks start at once, each in a daemon thread, and the runner stops waiting for a
  check ``--timeout`` seconds after the start: a hung NVML call or DNS lookup becomes a
  ``fail`` for that check, never a hung doctor (the thread is abandoned, and the CLI exits
  with ``os._exit`` so that it cannot block interpreter shutdown either);
* shared, slow things (``import torch``, NVML initialisation) are computed once, in the
  background, and waited for by the checks that need them;
* a check that raises becomes a ``fail`` with the exception's one-line summary: no
  traceback ever reaches the user.

Exit codes: 0 nothing failed, 1 something failed, 2 bad usage.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import os
import platform
import re
import resource
import shutil
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, Literal, TypeVar

import typer

from ftrun import gpu as gpumod

Status = Literal["pass", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("pass", "skip", "warn", "fail")  # in order of severity

DEFAULT_TIMEOUT_S = 4.0
DEFAULT_MASTER_PORT = 29500
DEFAULT_RDZV_PORT = 29400
MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 4)

# Thresholds (documented in docs/doctor.md).
SHM_FAIL_FREE = 512 << 20  # NCCL's intra-node transport and DataLoader workers live here
SHM_WARN_FREE = 2 << 30
NOFILE_WARN = 4096  # each worker holds sockets, shm segments, DataLoader fds
GPU_PROC_FAIL_BYTES = 1 << 30  # another process holding >= 1 GiB will cost us an OOM
TEMP_MARGIN_C = 5  # warn this close to the slowdown threshold


# --------------------------------------------------------------------------- results


@dataclass
class CheckResult:
    """The outcome of one check: what was found and, unless it passed, how to fix it."""

    name: str
    status: Status
    detail: str
    hint: str = ""
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "hint": self.hint,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def passed(detail: str, hint: str = "") -> CheckResult:
    return CheckResult("", "pass", detail, hint)


def warned(detail: str, hint: str = "") -> CheckResult:
    return CheckResult("", "warn", detail, hint)


def failed(detail: str, hint: str = "") -> CheckResult:
    return CheckResult("", "fail", detail, hint)


def skipped(detail: str, hint: str = "") -> CheckResult:
    return CheckResult("", "skip", detail, hint)


def worst(statuses: list[Status]) -> Status:
    return max(statuses, key=STATUSES.index, default="pass")


class Findings:
    """Collects per-item findings (per GPU, per port...) into one CheckResult.

    The result has the worst status; its detail lists the findings at that status (or the
    summary when everything passed) and its hint is the first hint given at that status.
    """

    def __init__(self) -> None:
        self.items: list[tuple[Status, str, str]] = []

    def add(self, status: Status, text: str, hint: str = "") -> None:
        self.items.append((status, text, hint))

    def result(self, summary: str) -> CheckResult:
        if self.items and all(s == "skip" for s, _, _ in self.items):
            return skipped("; ".join(t for _, t, _ in self.items))
        status = worst([s for s, _, _ in self.items if s != "skip"])
        if status == "pass":
            notes = [t for s, t, _ in self.items if s in ("pass", "skip") and t]
            return passed("; ".join([summary, *notes]) if notes else summary)
        texts = group_gpu_texts([t for s, t, _ in self.items if s == status])
        hint = next((h for s, _, h in self.items if s == status and h), "")
        return CheckResult("", status, "; ".join(texts), hint)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for i in sorted(indices):
        if out and i == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def group_gpu_texts(texts: list[str]) -> list[str]:
    """Merge 'GPU 0: x', 'GPU 1: x' into 'GPUs 0-1: x' so 8 identical lines read as one."""
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for text in texts:
        m = re.fullmatch(r"GPU (\d+): (.*)", text, re.S)
        key = m.group(2) if m else text
        if key not in groups:
            groups[key] = []
            order.append(key)
        if m:
            groups[key].append(int(m.group(1)))
    out = []
    for key in order:
        idx = groups[key]
        if not idx:
            out.append(key)
        else:
            out.append(f"GPU{'s' if len(idx) > 1 else ''} {_ranges(idx)}: {key}")
    return out


# --------------------------------------------------------------------------- options


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit code 2."""


NprocSpec = int | Literal["auto", "cpu", "gpu"]


@dataclass
class Options:
    """What the job will ask of this node (mirrors the torchrun flags of the same name)."""

    nproc_per_node: NprocSpec = "auto"
    rdzv_endpoint: str | None = None
    #: None: not given, so the default port is only warned about, not failed on.
    master_port: int | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


def parse_nproc(value: str | int) -> NprocSpec:
    """torchrun's --nproc-per-node: auto, cpu, gpu or a positive integer."""
    text = str(value).strip().lower()
    if text in ("auto", "cpu", "gpu"):
        return text  # type: ignore[return-value]
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise UsageError(
        f"--nproc-per-node must be auto, cpu, gpu or a positive integer, not {value!r}")


def parse_port(value: str | int, flag: str) -> int:
    text = str(value).strip()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UsageError(f"{flag} must be a port number (1-65535), not {value!r}")
    return int(text)


def parse_endpoint(value: str) -> tuple[str, int]:
    """``host[:port]`` (``[v6addr]:port`` too) with torchrun's default port 29400."""
    text = value.strip()
    match = re.fullmatch(r"\[([^\]]+)\](?::(\w*))?", text)
    if match:
        host, port = match.group(1), match.group(2)
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:  # a bare host, or a bare IPv6 address
        host, port = text, None
    if not host:
        raise UsageError(f"--rdzv-endpoint must be host[:port], not {value!r}")
    return host, parse_port(port, "--rdzv-endpoint port") if port else DEFAULT_RDZV_PORT


def parse_timeout(value: str | float) -> float:
    try:
        timeout = float(value)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout <= 600:
        raise UsageError(f"--timeout must be a number of seconds in (0, 600], not {value!r}")
    return timeout


# --------------------------------------------------------------------------- shared state

T = TypeVar("T")


class Lazy(Generic[T]):
    """A value computed once in a daemon thread; ``get`` waits for it (or its exception)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> Lazy[T]:
        with self._lock:
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, daemon=True, name="doctor-lazy").start()
        return self

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # re-raised in get()
            self._error = exc
        finally:
            self._done.set()

    def get(self, timeout: float | None = None) -> T:
        self.start()
        if not self._done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout:.1f} s")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def _import_torch() -> ModuleType:
    import torch
    import torch.distributed  # loads the c10d bindings the checks report on

    return torch


class Context:
    """Everything the checks share: the options and the slow, shared lookups."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.env = options.environ
        self.t0 = time.monotonic()
        self.torch: Lazy[ModuleType] = Lazy(_import_torch)
        self.nvml: Lazy[gpumod.NvmlInfo] = Lazy(lambda: gpumod.query_nvml(self.env))

    @property
    def wants_gpu(self) -> bool:
        """Only ``--nproc-per-node gpu`` demands GPUs; auto and N run on CPU too."""
        return self.options.nproc_per_node == "gpu"

    def remaining(self) -> float:
        """Seconds left before the runner stops waiting for checks."""
        return max(0.05, self.options.timeout - (time.monotonic() - self.t0))

    def visible_gpu_count(self) -> int | None:
        """GPUs CUDA would see, or None when NVML cannot say (in time)."""
        try:
            return len(self.nvml.get(self.remaining() - 0.05).visible)
        except BaseException:
            return None


# --------------------------------------------------------------------------- registry


@dataclass
class CheckSpec:
    name: str
    fn: Callable[[Context], CheckResult]
    #: What to tell the user when this check does not answer in time.
    timeout_hint: str


CHECKS: list[CheckSpec] = []


def check(name: str, timeout_hint: str = "") -> Callable[[Callable[[Context], CheckResult]], Any]:
    """Register a check function under ``name`` (the order of registration is the report's)."""

    def register(fn: Callable[[Context], CheckResult]) -> Callable[[Context], CheckResult]:
        CHECKS.append(CheckSpec(name, fn, timeout_hint))
        return fn

    return register


def one_line(exc: BaseException) -> str:
    """An exception as a one-line summary: ``Type: first line of message``."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


NVML_HANG_HINT = (
    "NVML did not answer: the driver or a GPU is wedged. Check `nvidia-smi` and `dmesg` "
    "for Xid errors; reset the GPU or drain the node"
)


# --------------------------------------------------------------------------- software


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
    nvml, nvml_error = _nvml_or_error(ctx)
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


# --------------------------------------------------------------------------- GPUs


def _nvml_or_error(ctx: Context) -> tuple[gpumod.NvmlInfo | None, str]:
    """NVML's view of the node, or None with a one-line reason (no driver, error...)."""
    try:
        return ctx.nvml.get(), ""
    except ImportError as exc:
        return None, f"pynvml not installed ({one_line(exc)})"
    except Exception as exc:
        return None, str(exc) or type(exc).__name__


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
            findings.add("fail", f"GPU {g.index}: NVML: {exc}", _nvml_hint(nvml, exc))
    return findings.result(summary(gpus))


def _nvml_hint(nvml: ModuleType, exc: BaseException) -> str:
    hints = {
        "NVMLError_LibraryNotFound": "install the NVIDIA driver (libnvidia-ml.so.1)",
        "NVMLError_DriverNotLoaded": "load the kernel driver (modprobe nvidia); check dmesg",
        "NVMLError_LibRmVersionMismatch": "driver library and kernel module differ: reboot "
        "or reload the nvidia kernel module",
        "NVMLError_Timeout": NVML_HANG_HINT,
        "NVMLError_GpuIsLost": "a GPU fell off the bus: drain the node, reset or RMA the GPU",
        "NVMLError_NoPermission": "run as a user allowed to open /dev/nvidia*",
        "NVMLError_ResetRequired": "reset the GPU (nvidia-smi -r) or reboot",
        "NVMLError_CorruptedInforom": "corrupted infoROM: RMA the GPU",
    }
    return hints.get(type(exc).__name__, "check `nvidia-smi` and dmesg")


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
        hint = _nvml_hint(nvml, exc)
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


def _process_name(pid: int) -> str:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:
        return "?"  # another PID namespace (container), or already gone


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
            f.add(status, f"GPU {g.index}: pid {p.pid} ({_process_name(p.pid)}) holds {size}",
                  "stop the leftover process (kill PID) or drain the node")

    return _per_gpu(ctx, one, lambda gs: f"{len(gs)} GPU(s): no other process holds GPU memory")


# --------------------------------------------------------------------------- host


@check("host.shm")
def check_shm(ctx: Context) -> CheckResult:
    """NCCL's intra-node transport and DataLoader workers use /dev/shm; containers default
    to 64 MiB, which crashes them ("Bus error", "unhandled system error").
    """
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError as exc:
        return failed(f"/dev/shm unusable: {one_line(exc)}", "mount a tmpfs on /dev/shm")
    gib = 1 << 30
    detail = f"/dev/shm {usage.total / gib:.1f} GiB, {usage.free / gib:.1f} GiB free"
    hint = ("enlarge it: docker run --shm-size=16g (or --ipc=host), "
            "or mount -o remount,size=16G /dev/shm")
    if usage.free < SHM_FAIL_FREE:
        return failed(detail, hint)
    if usage.free < SHM_WARN_FREE:
        return warned(detail, hint)
    return passed(detail)


def _rlimit_str(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


@check("host.memlock")
def check_memlock(ctx: Context) -> CheckResult:
    """RDMA (InfiniBand/RoCE) registers pinned memory; a small memlock limit makes NCCL fail
    with "ibv_reg_mr failed" or fall back to slow sockets.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    ib = "/sys/class/infiniband"
    rdma = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
    if soft == resource.RLIM_INFINITY:
        return passed("memlock unlimited")
    detail = f"memlock {soft >> 10} KiB (hard {_rlimit_str(hard)})"
    if rdma:
        return warned(f"{detail} with RDMA devices {', '.join(rdma)}",
                      "set `ulimit -l unlimited` (limits.conf / slurm PropagateResourceLimits)")
    return passed(f"{detail}; no RDMA devices, so it does not matter")


@check("host.nofile")
def check_nofile(ctx: Context) -> CheckResult:
    """Workers hold many sockets and shared-memory fds (DataLoader's file_descriptor
    strategy); a 1024 limit surfaces as "Too many open files" hours in.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    detail = f"open files {_rlimit_str(soft)} (hard {_rlimit_str(hard)})"
    if soft != resource.RLIM_INFINITY and soft < NOFILE_WARN:
        target = hard if hard != resource.RLIM_INFINITY else 65536
        return warned(detail, f"raise it: ulimit -n {target}")
    return passed(detail)


def _local_addresses() -> dict[str, list[str]]:
    """Interface name -> IP addresses, for interfaces that are up."""
    import psutil

    stats = psutil.net_if_stats()
    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        inet = (socket.AF_INET, socket.AF_INET6)
        ips = [a.address.split("%")[0] for a in addrs if a.family in inet]
        if ips:
            out[name] = ips
    return out


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def _resolve(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return sorted({str(i[4][0]) for i in infos})


@check("host.hostname", "resolving the hostname hung: DNS or /etc/nsswitch.conf is broken")
def check_hostname(ctx: Context) -> CheckResult:
    """Rendezvous and Gloo advertise this node by hostname: it must resolve, and to an
    address other nodes can reach (not only loopback).
    """
    name = socket.gethostname()
    try:
        addrs = _resolve(name)
    except OSError as exc:
        return failed(f"hostname {name!r} does not resolve: {exc}",
                      "add it to /etc/hosts or DNS")
    if all(_is_loopback(a) for a in addrs):
        return warned(f"hostname {name!r} resolves only to loopback ({', '.join(addrs)}): "
                      "fine on one node, other nodes cannot reach it by name",
                      "map the hostname to a routable address in /etc/hosts or DNS, or set "
                      "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME")
    return passed(f"hostname {name!r} resolves to {', '.join(addrs)}")


def parse_nccl_ifname(spec: str) -> tuple[bool, bool, list[str]]:
    """NCCL_SOCKET_IFNAME syntax: a comma list of name prefixes; a leading ``^`` excludes
    them instead, and ``=`` (after any ``^``) makes them exact names.

    Returns (exclude, exact, names).
    """
    exclude = spec.startswith("^")
    rest = spec[1:] if exclude else spec
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    return exclude, exact, [p.strip() for p in rest.split(",") if p.strip()]


def nccl_select(spec: str, interfaces: list[str]) -> list[str]:
    """The interfaces NCCL would consider for ``spec``, in the given order."""
    exclude, exact, names = parse_nccl_ifname(spec)

    def hit(iface: str) -> bool:
        return any(iface == n if exact else iface.startswith(n) for n in names)

    return [i for i in interfaces if hit(i) != exclude]


def nccl_default_ifaces(interfaces: list[str]) -> list[str]:
    """NCCL's choice when NCCL_SOCKET_IFNAME is unset: IB first, then anything but
    docker/lo/virbr, then docker, then loopback."""
    for spec in ("ib", "^docker,lo,virbr", "docker", "lo"):
        picked = nccl_select(spec, interfaces)
        if picked:
            return picked
    return []


def _describe(ifaces: list[str], addrs: dict[str, list[str]]) -> str:
    return ", ".join(f"{i} ({addrs[i][0]})" for i in ifaces)


@check("net.nccl_ifname")
def check_nccl_ifname(ctx: Context) -> CheckResult:
    """NCCL_SOCKET_IFNAME that matches no usable interface makes NCCL fail at init
    ("no socket interface found"); unset, report which interface NCCL will pick.
    """
    addrs = _local_addresses()
    names = list(addrs)
    spec = ctx.env.get("NCCL_SOCKET_IFNAME")
    have = _describe(names, addrs) or "none"
    if spec:
        picked = nccl_select(spec, names)
        if not picked:
            return failed(f"NCCL_SOCKET_IFNAME={spec} matches no interface that is up with an "
                          f"address (up: {have})",
                          f"set NCCL_SOCKET_IFNAME to one of {', '.join(names) or '?'} "
                          "or unset it")
        return passed(f"NCCL_SOCKET_IFNAME={spec}: {_describe(picked, addrs)}")
    picked = nccl_default_ifaces(names)
    if not picked:
        return failed("no network interface is up with an address", "bring up an interface")
    detail = f"NCCL_SOCKET_IFNAME unset: NCCL would use {_describe(picked, addrs)}"
    if all(i == "lo" or i.startswith("lo") for i in picked):
        return warned(detail + ": single node only", "bring up a routable interface")
    return passed(detail)


@check("net.gloo_ifname")
def check_gloo_ifname(ctx: Context) -> CheckResult:
    """GLOO_SOCKET_IFNAME is a comma list of exact interface names; one that does not exist
    or has no address makes every Gloo process group (and the c10d store barrier) fail.
    """
    spec = ctx.env.get("GLOO_SOCKET_IFNAME")
    if not spec:
        return passed("GLOO_SOCKET_IFNAME unset: Gloo binds the address the hostname resolves to")
    addrs = _local_addresses()
    wanted = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in wanted if n not in addrs]
    if bad or not wanted:
        return failed(f"GLOO_SOCKET_IFNAME={spec}: {', '.join(bad) or spec!r} not up with an "
                      f"address (up: {', '.join(addrs) or 'none'})",
                      f"set GLOO_SOCKET_IFNAME to one of {', '.join(addrs) or '?'}, or unset it")
    return passed(f"GLOO_SOCKET_IFNAME={spec}: {_describe(wanted, addrs)}")


def _is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (so the rendezvous store would run here)."""
    if host in ("localhost", socket.gethostname()) or _is_loopback(host):
        return True
    try:
        resolved = _resolve(host)
    except OSError:
        return False
    mine = {a for ips in _local_addresses().values() for a in ips}
    return any(a in mine or _is_loopback(a) for a in resolved)


def _port_holder(port: int) -> str:
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            listening = conn.status == psutil.CONN_LISTEN
            if conn.laddr and conn.laddr.port == port and listening and conn.pid:
                return f"pid {conn.pid} ({_process_name(conn.pid)})"
    except Exception:
        pass
    return "another process"


def port_bindable(port: int) -> OSError | None:
    """Try to bind ``port`` the way the c10d TCPStore does (SO_REUSEADDR, all addresses)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", port))
        sock.listen(1)
        return None
    except OSError as exc:
        return exc
    finally:
        sock.close()


@check("net.ports")
def check_ports(ctx: Context) -> CheckResult:
    """The ports this node will have to listen on must be free: the master port (static
    rendezvous) and, when this node hosts it, the c10d rendezvous store port.

    A port you chose explicitly being taken is a failure; a default one only a warning
    (the job may not use it).
    """
    opts = ctx.options
    ports: list[tuple[int, str, bool]] = []  # (port, role, explicit)
    if opts.rdzv_endpoint:
        host, port = parse_endpoint(opts.rdzv_endpoint)
        if _is_local_host(host):
            ports.append((port, "rendezvous store (this node hosts it)", False))
    else:
        ports.append((DEFAULT_RDZV_PORT, "default rendezvous port", False))
    if opts.master_port is not None:
        ports.append((opts.master_port, "--master-port", True))
    elif not opts.rdzv_endpoint:
        ports.append((DEFAULT_MASTER_PORT, "default master port", False))
    if not ports:
        return skipped("rendezvous store is on another host: no port to listen on here")
    findings = Findings()
    for port, role, explicit in ports:
        err = port_bindable(port)
        if err is None:
            findings.add("pass", "")
            continue
        if err.errno == errno.EADDRINUSE:
            what = f"port {port} ({role}) in use by {_port_holder(port)}"
            if role.startswith("rendezvous store"):
                findings.add("warn", what + ": fine only if that is this job's store",
                             "stop the process or pick another port")
            else:
                findings.add("fail" if explicit else "warn", what,
                             "stop the process holding it or pick another --master-port")
        else:
            findings.add("fail", f"port {port} ({role}) cannot be bound: {err.strerror}",
                         "pick a port above 1024 that is free")
    listed = ", ".join(f"{p} ({r})" for p, r, _ in ports)
    return findings.result(f"free: {listed}")


@check("rdzv.endpoint", "connecting to the rendezvous endpoint hung (DNS?)")
def check_rdzv(ctx: Context) -> CheckResult:
    """Every node must reach the c10d store at --rdzv-endpoint; find out now, not after a
    15-minute rendezvous timeout.
    """
    if not ctx.options.rdzv_endpoint:
        return skipped("no --rdzv-endpoint given")
    host, port = parse_endpoint(ctx.options.rdzv_endpoint)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return failed(f"{host} does not resolve: {exc}", "fix the host name or DNS")
    connect_timeout = min(2.0, max(0.2, ctx.remaining() - 0.3))
    last: OSError | None = None
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(connect_timeout)
        t = time.monotonic()
        try:
            sock.connect(addr)
            return passed(f"{host}:{port} reachable ({addr[0]}, "
                          f"{(time.monotonic() - t) * 1000:.1f} ms)")
        except OSError as exc:
            last = exc
        finally:
            sock.close()
    if isinstance(last, ConnectionRefusedError):
        if _is_local_host(host):
            return passed(f"{host}:{port} is this node and nothing listens yet: the agent "
                          "will host the store here")
        return warned(f"{host}:{port}: host up but nothing listening (fine if the store's "
                      "node has not started yet)", "start the job on that node first, or "
                      "check the port")
    why = "timed out" if isinstance(last, TimeoutError) else (last.strerror if last else "?")
    return failed(f"{host}:{port} unreachable: {why}",
                  "check the endpoint, firewalls/security groups and routing between nodes")


# --------------------------------------------------------------------------- slurm


def parse_tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot parse SLURM_TASKS_PER_NODE={value!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _count_list(value: str | None) -> int | None:
    if value is None:
        return None
    return len([x for x in value.split(",") if x.strip()])


@check("slurm", NVML_HANG_HINT)
def check_slurm(ctx: Context) -> CheckResult:
    """Under Slurm, the environment ftrun derives ranks and world size from must be
    self-consistent, and the GPUs Slurm granted must be the ones this process sees.
    """
    env = ctx.env
    if not env.get("SLURM_JOB_ID"):
        return skipped("not under Slurm (SLURM_JOB_ID unset)")
    f = Findings()
    fix = "run inside the allocation (srun/sbatch) with consistent --nodes/--ntasks-per-node"

    def as_int(var: str) -> int | None:
        value = env.get(var)
        if value is None or not value.strip().isdigit():
            if value is not None:
                f.add("fail", f"{var}={value!r} is not a number", fix)
            return None
        return int(value)

    nodelist_var = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in env else "SLURM_NODELIST"
    nodes: list[str] | None = None
    if nodelist_var in env:
        try:
            import hostlist

            nodes = hostlist.expand_hostlist(env[nodelist_var])
        except ImportError:
            f.add("warn", "python-hostlist not installed: node list not checked",
                  "pip install python-hostlist")
        except Exception as exc:
            f.add("fail", f"{nodelist_var}={env[nodelist_var]!r} does not expand: {exc}", fix)
    else:
        f.add("fail", "SLURM_JOB_NODELIST unset", fix)
    nnodes = as_int("SLURM_NNODES") or as_int("SLURM_JOB_NUM_NODES")
    if nodes is not None:
        if nnodes is not None and len(nodes) != nnodes:
            f.add("fail", f"{nodelist_var} has {len(nodes)} node(s), SLURM_NNODES={nnodes}", fix)
        me = env.get("SLURMD_NODENAME")
        if me is None:
            f.add("warn", "SLURMD_NODENAME unset", fix)
        elif me not in nodes:
            f.add("fail", f"this node {me!r} is not in {nodelist_var}={env[nodelist_var]}", fix)
    ntasks = as_int("SLURM_NTASKS") or as_int("SLURM_NPROCS")
    per_node: list[int] | None = None
    tpn = as_int("SLURM_NTASKS_PER_NODE")
    if tpn is not None and nnodes is not None:
        per_node = [tpn] * nnodes
    elif "SLURM_TASKS_PER_NODE" in env:
        try:
            per_node = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        except ValueError as exc:
            f.add("fail", str(exc), fix)
    if per_node is not None and ntasks is not None and sum(per_node) != ntasks:
        f.add("fail", f"SLURM_NTASKS={ntasks} but nodes x tasks per node = {sum(per_node)}", fix)
    procid = as_int("SLURM_PROCID")
    if procid is not None and ntasks is not None and procid >= ntasks:
        f.add("fail", f"SLURM_PROCID={procid} >= SLURM_NTASKS={ntasks}", fix)
    gpu_var = next((v for v in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS") if v in env), None)
    granted = _count_list(env.get(gpu_var)) if gpu_var else None
    cvd = _count_list(env.get("CUDA_VISIBLE_DEVICES"))
    if granted is not None:
        if cvd is not None and cvd != granted:
            f.add("warn", f"{gpu_var} has {granted} GPU(s), CUDA_VISIBLE_DEVICES {cvd}",
                  "let Slurm set CUDA_VISIBLE_DEVICES (do not override it in the job script)")
        seen = ctx.visible_gpu_count() if ctx.options.nproc_per_node != "cpu" else None
        if seen is not None and seen < granted:
            f.add("fail", f"Slurm granted {granted} GPU(s) ({gpu_var}) but only {seen} visible",
                  "check CUDA_VISIBLE_DEVICES and the node's GPUs (nvidia-smi)")
    summary = f"job {env['SLURM_JOB_ID']}: {nnodes or '?'} node(s), {ntasks or '?'} task(s)"
    if procid is not None:
        summary += f", this is task {procid}"
    if granted is not None:
        summary += f", {granted} GPU(s) granted"
    return f.result(summary + ", consistent")


# --------------------------------------------------------------------------- runner


def _run_one(spec: CheckSpec, ctx: Context, slot: list[CheckResult]) -> None:
    t = time.monotonic()
    try:
        res = spec.fn(ctx)
    except Exception as exc:  # a check that raises is a failing check, not a traceback
        nvml = sys.modules.get("pynvml")
        if nvml is not None and isinstance(exc, nvml.NVMLError):
            res = failed(f"NVML: {exc}", _nvml_hint(nvml, exc))
        else:
            res = failed(one_line(exc), "this is a bug in the check or a very broken node")
    slot.append(dataclasses.replace(res, name=spec.name, elapsed_s=time.monotonic() - t))


def run_checks(options: Options | None = None,
               only: Callable[[str], bool] | None = None) -> list[CheckResult]:
    """Run every check (or those ``only`` selects) in parallel; return their results in
    report order. Never raises for a failing node and never waits much more than
    ``options.timeout`` seconds: a check still running then is reported as a timed-out fail
    (its daemon thread is abandoned).
    """
    import warnings

    warnings.filterwarnings("ignore", message=gpumod.PYNVML_DEPRECATION, category=FutureWarning)
    opts = options or Options()
    ctx = Context(opts)
    specs = [s for s in CHECKS if only is None or only(s.name)]
    ctx.torch.start()
    if opts.nproc_per_node != "cpu":
        ctx.nvml.start()
    running = []
    for spec in specs:
        slot: list[CheckResult] = []
        thread = threading.Thread(target=_run_one, args=(spec, ctx, slot), daemon=True,
                                  name=f"doctor-{spec.name}")
        thread.start()
        running.append((spec, thread, slot))
    deadline = ctx.t0 + opts.timeout
    results = []
    for spec, thread, slot in running:
        thread.join(max(0.0, deadline - time.monotonic()))
        if slot:
            results.append(slot[0])
        else:
            results.append(CheckResult(
                spec.name, "fail", f"timed out: no answer within {opts.timeout:g} s",
                spec.timeout_hint or "something on this node blocks; rerun with a longer --timeout",
                time.monotonic() - ctx.t0))
    return results


def report(results: list[CheckResult], elapsed_s: float) -> dict[str, Any]:
    """The ``--json`` document."""
    return {
        "checks": [r.to_dict() for r in results],
        "ok": all(r.status != "fail" for r in results),
        "elapsed_s": round(elapsed_s, 3),
    }


_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def print_table(results: list[CheckResult], elapsed_s: float) -> None:
    """The human report: one row per check, hints only where something is off."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=False)
    table = Table(title="ftrun doctor", title_justify="left", expand=False)
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("finding / [italic]fix[/]")
    for r in results:
        style = _STYLE[r.status]
        text = _escape(r.detail)
        if r.hint and r.status in ("warn", "fail"):
            text += f"\n[italic]fix: {_escape(r.hint)}[/]"
        table.add_row(f"[{style}]{r.status}[/]", r.name, text)
    console.print(table)
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    verdict = "[bold red]NOT READY[/]" if counts["fail"] else "[green]ready[/]"
    console.print(f"{verdict}: {counts['pass']} pass, {counts['warn']} warn, "
                  f"{counts['fail']} fail, {counts['skip']} skip in {elapsed_s:.2f} s")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


# --------------------------------------------------------------------------- CLI

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,  # plain click errors: no boxes, no tracebacks
    pretty_exceptions_enable=False,
    help="Check whether this node can train, before the job starts.",
)


def _usage_error(message: str) -> typer.Exit:
    typer.echo(f"ftrun doctor: error: {message}", err=True)
    return typer.Exit(2)


@app.command()
def doctor(
    nproc_per_node: str = typer.Option(
        "auto", "--nproc-per-node", "--nproc_per_node", envvar="PET_NPROC_PER_NODE",
        metavar="auto|cpu|gpu|N",
        help="auto, cpu, gpu or N workers, as for torchrun; 'gpu' makes a missing GPU a failure.",
    ),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", "--rdzv_endpoint", envvar="PET_RDZV_ENDPOINT",
        metavar="HOST[:PORT]",
        help="host[:port] of the c10d rendezvous store (default port 29400); "
        "checked for reachability.",
    ),
    master_port: str | None = typer.Option(
        None, "--master-port", "--master_port", envvar="PET_MASTER_PORT", metavar="PORT",
        help="Port this node must be able to listen on (default 29500, only warned about).",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
    timeout: str = typer.Option(
        str(DEFAULT_TIMEOUT_S), "--timeout", metavar="SECONDS",
        help="Seconds before a check that hangs is failed."),
) -> None:
    """Check this node (GPUs, drivers, NCCL, shim, host limits, network, Slurm) in seconds.

    Exit code 0 when nothing failed, 1 when something failed, 2 on bad usage.
    """
    try:
        options = Options(
            nproc_per_node=parse_nproc(nproc_per_node),
            rdzv_endpoint=rdzv_endpoint or None,
            master_port=parse_port(master_port, "--master-port") if master_port else None,
            timeout=parse_timeout(timeout),
        )
        if options.rdzv_endpoint:
            parse_endpoint(options.rdzv_endpoint)
    except UsageError as exc:
        raise _usage_error(str(exc)) from None
    t0 = time.monotonic()
    results = run_checks(options)
    elapsed = time.monotonic() - t0
    if as_json:
        sys.stdout.write(json.dumps(report(results, elapsed)) + "\n")
    else:
        print_table(results, elapsed)
    code = 1 if any(r.status == "fail" for r in results) else 0
    if any(t.name.startswith("doctor-") for t in threading.enumerate()):
        # A check is stuck in a blocking call (NVML, DNS...). Its daemon thread could still
        # hold the import lock or wedge interpreter teardown: leave without teardown, but
        # not without the processes checks started (the shim self-test's worker).
        sys.stdout.flush()
        sys.stderr.flush()
        _kill_children()
        os._exit(code)
    raise typer.Exit(code)


def _kill_children() -> None:
    """Kill and reap the processes this process started (only ever ours, by pid)."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
        for child in children:
            child.kill()
        psutil.wait_procs(children, timeout=2)
    except Exception:
        pass


def main(argv: list[str] | None = None) -> None:
    """``python -m ftrun.doctor ARGS``."""
    app(args=argv, prog_name="ftrun doctor")

