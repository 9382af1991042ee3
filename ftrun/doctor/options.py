"""What the job will ask of this node: ``ftrun doctor``'s options and their parsers.

The flags mirror ftrun's own (``--nproc-per-node``, ``--rdzv-endpoint``, ``--master-port``),
so their values are read by ``ftrun.config``'s parsers: doctor and the launcher must not
disagree about what a flag means. Doctor only reports errors its own way (one line, exit
code 2, through :class:`UsageError`) and is stricter in two places, said where they are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ftrun import config
from ftrun.config import DEFAULT_RDZV_PORT, ConfigError, NprocSpec

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "NprocSpec",
    "Options",
    "UsageError",
    "parse_endpoint",
    "parse_nproc",
    "parse_port",
    "parse_timeout",
]

DEFAULT_TIMEOUT_S = 4.0
#: A doctor allowed to wait longer than this is no longer a quick check before a job.
MAX_TIMEOUT_S = 600.0


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit code 2."""


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
    """torchrun's --nproc-per-node: auto, cpu, gpu or a positive integer.

    ftrun.config's grammar, left unresolved: ``parse_nproc_per_node`` turns auto and gpu
    into a GPU count by asking NVML, which must not happen while parsing the command line
    here (a wedged driver hangs NVML; the checks query it under ``--timeout``), and the
    checks need to know whether GPUs were demanded ("gpu") more than how many there are.
    """
    try:
        return config.parse_nproc_spec(str(value))
    except ConfigError:
        raise UsageError(
            f"--nproc-per-node must be auto, cpu, gpu or a positive integer, not {value!r}"
        ) from None


def parse_port(value: str | int, flag: str) -> int:
    """A port this node must be able to listen on: ftrun.config's rule, minus port 0.

    ftrun accepts 0 (let the store pick a free port, on a single node); doctor refuses it,
    as it would check a port the job will not use (binding port 0 always succeeds).
    """
    try:
        port = config.parse_port(str(value).strip(), flag)
    except ConfigError:
        port = 0
    if port == 0:
        raise UsageError(f"{flag} must be a port number (1-65535), not {value!r}")
    return port


def parse_endpoint(value: str) -> tuple[str, int]:
    """``host[:port]`` (``[v6addr]:port`` too) with torchrun's default port 29400.

    Split as ftrun splits ``--rdzv-endpoint`` (``ftrun.config.split_endpoint``), so doctor
    checks the host and port the job will use.
    """
    host, port = config.split_endpoint(value)
    if not host:
        raise UsageError(f"--rdzv-endpoint must be host[:port], not {value!r}")
    return host, parse_port(port, "--rdzv-endpoint port") if port else DEFAULT_RDZV_PORT


def parse_timeout(value: str | float) -> float:
    """--timeout: seconds as ftrun.config reads them, more than 0 and at most 600."""
    try:
        timeout = config.parse_seconds(value, "--timeout")
    except ConfigError:
        timeout = -1.0
    if not 0 < timeout <= MAX_TIMEOUT_S:  # also false for nan
        raise UsageError(f"--timeout must be a number of seconds in (0, 600], not {value!r}")
    return timeout
