"""``ftrun doctor``: know before the job starts whether this node can train.

A job that lands on a node with a bad GPU, a tiny ``/dev/shm``, a wrong network interface or
a shim that does not interpose wastes hours; each check here looks at one of those things
in well under a second and says what to fix.

The package:

* ``core``: what the checks share: :class:`CheckResult`, :class:`Findings`, the
  :class:`Context` with its shared slow lookups (``import torch``, NVML), the ``@check``
  registry;
* ``options``: :class:`Options` and the parsers of the command line;
* the checks, one module per topic: ``python_torch`` (Python, torch, CUDA, NCCL, the shim),
  ``gpu`` (NVML), ``host`` (limits, hostname), ``network`` (interfaces, ports, rendezvous
  endpoint), ``slurm``, ``kubernetes``;
* ``runner``: runs the checks in parallel under a deadline, prints the report, and is the
  ``ftrun doctor`` command (:data:`app`, :func:`main`).
* ``gate``: the health gate, the quick subset a node passes before it joins a multi-node
  job (``ftrun doctor --quick`` runs it by hand).

Exit codes: 0 nothing failed, 1 something failed, 2 bad usage.
"""

from __future__ import annotations

from collections.abc import Callable

# isort: off
# The check modules register their checks as they are imported, so this order is the
# report's (and the JSON's "checks"). They import core and options, never one another:
# nothing but these lines decides which registers first.
from ftrun.doctor import python_torch  # noqa: F401  python, torch, cuda, nccl, shim
from ftrun.doctor import gpu  # noqa: F401  gpu, gpu.* (NVML)
from ftrun.doctor import host  # noqa: F401  host.shm, host.memlock, host.nofile, host.hostname
from ftrun.doctor import network  # noqa: F401  net.*, rdzv.endpoint
from ftrun.doctor import slurm  # noqa: F401  slurm
from ftrun.doctor import kubernetes  # noqa: F401  kubernetes
# isort: on

from ftrun.doctor import runner
from ftrun.doctor.core import (
    CHECKS,
    NVML_HANG_HINT,
    STATUSES,
    CheckResult,
    CheckSpec,
    Context,
    Findings,
    Lazy,
    Status,
    check,
    failed,
    group_gpu_texts,
    one_line,
    passed,
    skipped,
    warned,
    worst,
)
from ftrun.doctor.gpu import GPU_PROC_FAIL_BYTES, TEMP_MARGIN_C
from ftrun.doctor.host import NOFILE_WARN, SHM_FAIL_FREE, SHM_WARN_FREE
from ftrun.doctor.network import nccl_default_ifaces, nccl_select, parse_nccl_ifname
from ftrun.doctor.options import (
    DEFAULT_TIMEOUT_S,
    NprocSpec,
    Options,
    UsageError,
    parse_endpoint,
    parse_nproc,
    parse_port,
    parse_timeout,
)
from ftrun.doctor.python_torch import MIN_PYTHON, MIN_TORCH, elf_needed, loaded_libraries
from ftrun.doctor.runner import app, doctor, main, print_table, report
from ftrun.doctor.slurm import parse_tasks_per_node

__all__ = [
    "CHECKS",
    "DEFAULT_TIMEOUT_S",
    "GPU_PROC_FAIL_BYTES",
    "MIN_PYTHON",
    "MIN_TORCH",
    "NOFILE_WARN",
    "NVML_HANG_HINT",
    "SHM_FAIL_FREE",
    "SHM_WARN_FREE",
    "STATUSES",
    "TEMP_MARGIN_C",
    "CheckResult",
    "CheckSpec",
    "Context",
    "Findings",
    "Lazy",
    "NprocSpec",
    "Options",
    "Status",
    "UsageError",
    "app",
    "check",
    "doctor",
    "elf_needed",
    "failed",
    "group_gpu_texts",
    "loaded_libraries",
    "main",
    "nccl_default_ifaces",
    "nccl_select",
    "one_line",
    "parse_endpoint",
    "parse_nccl_ifname",
    "parse_nproc",
    "parse_port",
    "parse_tasks_per_node",
    "parse_timeout",
    "passed",
    "print_table",
    "report",
    "run_checks",
    "skipped",
    "warned",
    "worst",
]


def run_checks(options: Options | None = None,
               only: Callable[[str], bool] | None = None) -> list[CheckResult]:
    """Run the checks in :data:`CHECKS` (see ``runner.run_checks``).

    :data:`CHECKS` is read from this package when called, so that replacing
    ``ftrun.doctor.CHECKS`` (as tests do) changes what runs.
    """
    return runner.run_checks(options, only, checks=CHECKS)
