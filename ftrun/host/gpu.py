"""NVML access for ftrun: import pynvml quietly, take one snapshot of the node's GPUs.

Why a module of its own: NVML is the only way to look at a GPU without creating a CUDA
context (which costs seconds and memory, and which a hung GPU can block forever). Keeping
every pynvml call behind this small surface means callers never see pynvml's import-time
deprecation warning, and tests can swap in a stand-in ``pynvml`` module on ``PYTHONPATH``.

NVML calls can block (a GPU that fell off the bus, a wedged driver); this module does not
time them out itself. Callers run it in a worker thread and give up waiting (see
:mod:`ftrun.doctor`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

#: The warning the ``pynvml`` wrapper package prints on import (it now defers to nvidia-ml-py).
PYNVML_DEPRECATION = "The pynvml package is deprecated"


def import_pynvml() -> ModuleType:
    """Import ``pynvml`` without its FutureWarning reaching the user.

    Raises ImportError when neither nvidia-ml-py nor pynvml is installed.
    """
    warnings.filterwarnings("ignore", message=PYNVML_DEPRECATION, category=FutureWarning)
    import pynvml

    return pynvml


@dataclass
class Gpu:
    """One GPU as NVML enumerates it (NVML index order is PCI bus order)."""

    index: int
    handle: Any = None
    name: str = "?"
    uuid: str = ""
    #: Set when NVML could not even hand out a handle (e.g. "GPU is lost").
    error: str | None = None


@dataclass
class NvmlInfo:
    """What NVML says about the node, plus which GPUs this process would use."""

    nvml: ModuleType
    driver_version: str
    #: e.g. 12040 for CUDA 12.4; None when the driver does not say.
    cuda_driver_version: int | None
    gpus: list[Gpu]
    #: NVML indices of the GPUs CUDA_VISIBLE_DEVICES exposes (all of them when unset).
    visible: list[int] = field(default_factory=list)
    #: Why CUDA_VISIBLE_DEVICES was only partly understood, if it was.
    visible_note: str | None = None

    def visible_gpus(self) -> list[Gpu]:
        return [self.gpus[i] for i in self.visible]


def cuda_version_str(version: int | None) -> str:
    """NVML/CUDA encode versions as 1000*major + 10*minor: 12040 -> '12.4'."""
    if version is None:
        return "?"
    return f"{version // 1000}.{(version % 1000) // 10}"


def visible_indices(cvd: str | None, uuids: list[str]) -> tuple[list[int], str | None]:
    """Map CUDA_VISIBLE_DEVICES onto NVML indices, the way the CUDA runtime reads it.

    CUDA accepts indices and (prefixes of) GPU UUIDs, and silently ignores the first invalid
    entry *and everything after it*, so a typo can hide GPUs. Indices are taken as NVML
    (PCI bus) order, which matches CUDA when CUDA_DEVICE_ORDER=PCI_BUS_ID (what cluster
    schedulers set). MIG device UUIDs are not mapped.
    """
    if cvd is None:
        return list(range(len(uuids))), None
    out: list[int] = []
    for raw in cvd.split(","):
        tok = raw.strip()
        idx: int | None = None
        if tok.lstrip("-").isdigit():
            idx = int(tok)
            if not 0 <= idx < len(uuids):
                idx = None
        elif tok.startswith("GPU-"):
            hits = [i for i, u in enumerate(uuids) if u.startswith(tok)]
            idx = hits[0] if len(hits) == 1 else None
        if idx is None or idx in out:
            note = f"CUDA_VISIBLE_DEVICES entry {tok!r} matches no GPU"
            if idx is not None:
                note = f"CUDA_VISIBLE_DEVICES lists GPU {tok} twice"
            return out, note + ": CUDA ignores it and everything after it"
        out.append(idx)
    return out, None


def query_nvml(environ: Mapping[str, str] | None = None) -> NvmlInfo:
    """Initialise NVML and enumerate the GPUs.

    Raises ImportError (no pynvml) or ``pynvml.NVMLError`` (no driver, driver mismatch,
    timeout, ...): the caller decides what each means.
    """
    env = os.environ if environ is None else environ
    nvml = import_pynvml()
    nvml.nvmlInit()
    driver = nvml.nvmlSystemGetDriverVersion()
    try:
        cuda: int | None = nvml.nvmlSystemGetCudaDriverVersion()
    except nvml.NVMLError:
        cuda = None
    gpus: list[Gpu] = []
    for i in range(nvml.nvmlDeviceGetCount()):
        gpu = Gpu(index=i)
        try:
            gpu.handle = nvml.nvmlDeviceGetHandleByIndex(i)
            gpu.name = nvml.nvmlDeviceGetName(gpu.handle)
            gpu.uuid = nvml.nvmlDeviceGetUUID(gpu.handle)
        except nvml.NVMLError as exc:
            gpu.error = str(exc)
        gpus.append(gpu)
    visible, note = visible_indices(env.get("CUDA_VISIBLE_DEVICES"), [g.uuid for g in gpus])
    return NvmlInfo(nvml, str(driver), cuda, gpus, visible, note)
