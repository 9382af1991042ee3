"""What every doctor check shares: results, the ``@check`` registry, the context.

A check is a small function ``(Context) -> CheckResult`` registered with ``@check``; the
runner (``ftrun.doctor.runner``) calls them all at once, each in its own thread. This
module is what they have in common and nothing else, so that the check modules never need
one another (the order in which ``ftrun.doctor`` imports them is the report's order):

* :class:`CheckResult` and the status helpers, and :class:`Findings`, which folds many
  per-item findings (per GPU, per port) into one result;
* :class:`Context`: the options, and the slow lookups the checks share (``import torch``,
  NVML), each computed once in the background by a :class:`Lazy`;
* the registry (:data:`CHECKS`, :func:`check`);
* wording shared by several checks: an exception as one line, NVML's errors as hints.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Generic, Literal, TypeVar

from ftrun.doctor.options import Options
from ftrun.host import gpu as gpumod

Status = Literal["pass", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("pass", "skip", "warn", "fail")  # in order of severity


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
    """A registered check: its report name, its function, its timeout hint."""

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


# --------------------------------------------------------------------------- shared wording


def one_line(exc: BaseException) -> str:
    """An exception as a one-line summary: ``Type: first line of message``."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


NVML_HANG_HINT = (
    "NVML did not answer: the driver or a GPU is wedged. Check `nvidia-smi` and `dmesg` "
    "for Xid errors; reset the GPU or drain the node"
)


def nvml_or_error(ctx: Context) -> tuple[gpumod.NvmlInfo | None, str]:
    """NVML's view of the node, or None with a one-line reason (no driver, error...)."""
    try:
        return ctx.nvml.get(), ""
    except ImportError as exc:
        return None, f"pynvml not installed ({one_line(exc)})"
    except Exception as exc:
        return None, str(exc) or type(exc).__name__


def nvml_hint(nvml: ModuleType, exc: BaseException) -> str:
    """What to do about an NVML error, by its class."""
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


def process_name(pid: int) -> str:
    """The name of process ``pid`` for a message (who holds a GPU, a port), or "?"."""
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:
        return "?"  # another PID namespace (container), or already gone
