"""ftrun: a fault-tolerant, drop-in replacement for torchrun.

The launcher lives in :mod:`ftrun.cli` and :mod:`ftrun.agent`. Training scripts that
``import ftrun`` get the worker API of :mod:`ftrun.worker` (loaded on first use, so the
launcher itself does not import torch.distributed before it needs to).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ftrun.worker import FaultTolerance, RegroupError, init, restartable

__all__ = ["FaultTolerance", "RegroupError", "__version__", "init", "restartable"]


def __getattr__(name: str) -> Any:
    if name in ("init", "FaultTolerance", "RegroupError", "restartable"):
        from ftrun import worker

        return getattr(worker, name)
    raise AttributeError(name)
