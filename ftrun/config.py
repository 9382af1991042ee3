"""One validated launch configuration, built from flags, environment and Slurm.

The command line (``ftrun.cli``) only collects raw strings; every rule about what a value
may be lives here, so that the CLI, ``ftrun doctor`` and tests all reject the same inputs
with the same one-line message. A :class:`ConfigError` is always a user error: the CLI
prints it on one line and exits 2 before anything is started.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Literal, cast

from ftrun.client.faultspec import Schedule
from ftrun.host.hostnet import port_bind_error

DEFAULT_MASTER_PORT = 29500
DEFAULT_RDZV_PORT = 29400


class ConfigError(ValueError):
    """A launch option is invalid; the message is one line a user can act on."""


class Recovery(str, Enum):
    """What the agents do when a generation ends with a failure."""

    AUTO = "auto"  # regroup when the script uses the worker API, else restart
    RESTART = "restart"  # stop every worker, start them all again (torchrun's behaviour)
    REGROUP = "regroup"  # survivors carry on in-process (needs the worker API)


class Std(int, Enum):
    """Which worker streams go to a file (torchrun's ``-r``/``-t`` values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @property
    def stdout(self) -> bool:
        return bool(self.value & Std.OUT.value)

    @property
    def stderr(self) -> bool:
        return bool(self.value & Std.ERR.value)


@dataclass(frozen=True)
class StreamSpec:
    """Per-local-rank stream choice, as torchrun spells it: ``3`` or ``0:1,1:2``."""

    default: Std = Std.NONE
    per_rank: Mapping[int, Std] = field(default_factory=dict)

    def for_rank(self, local_rank: int) -> Std:
        return self.per_rank.get(local_rank, self.default)


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one agent needs to run its share of a job. Immutable once validated."""

    # What to run.
    entrypoint: str
    args: tuple[str, ...]
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    # Shape of the job.
    nnodes_min: int = 1
    nnodes_max: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    role: str = "default"
    virtual_local_rank: bool = False
    # Rendezvous.
    rdzv_backend: str = "static"
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int = DEFAULT_MASTER_PORT
    rdzv_port_explicit: bool = False
    rdzv_id: str = "none"
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    rdzv_endpoint: str = ""  # --rdzv-endpoint as given (etcd-v3: every etcd endpoint)
    local_addr: str | None = None
    standalone: bool = False
    # Failure handling.
    max_restarts: int = 0
    monitor_interval_s: float = 0.1
    shutdown_timeout_s: float = 30.0
    signals_to_handle: tuple[signal.Signals, ...] = (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )
    signals_to_handle_text: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    recovery: Recovery = Recovery.AUTO
    on_failure: str = "replace"  # regroup: "replace" the failed worker or "shrink"
    spares: int = 0  # warm spare workers per node (regroup)
    standby_nodes: int = 0  # hot spare nodes beyond --nnodes MAX (regroup, c10d)
    min_workers: int = 1  # regroup: below this many workers the job stops
    liveness_timeout_s: float = 5.0  # regroup: silence of a worker's heartbeat
    stall_floor_s: float = 5.0  # regroup: least time without a step before a stall
    # regroup: a recovery that commits no step by then escalates to a restart
    # (ftrun.decide.deadline); None: auto, from the step time and the timeouts in play
    recovery_deadline_s: float | None = None
    # the same rank failing with the same error this many times in a row stops the job
    # (ftrun.decide.crashloop)
    max_repeats: int = 2
    hang_timeout_s: float | None = None  # restart: all workers idle this long; None: auto
    preload: tuple[str, ...] = ()  # modules a per-node fork server imports once (--preload)
    # chosen by --preload auto (the default): where the server cannot be used, workers are
    # spawned with one line saying why, instead of the job stopping
    preload_auto: bool = False
    abort_timeout_s: float = 5.0  # the shim's deadline to abort a worker's communicators
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    join_timeout_s: float = 600.0
    use_shim: bool = True
    # Logs and events.
    log_dir: Path | None = None
    redirects: StreamSpec = field(default_factory=StreamSpec)
    tee: StreamSpec = field(default_factory=StreamSpec)
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    events_file: Path | None = None
    event_log_console: bool = False
    start_method: str = "spawn"
    # Observing a job (issue 13): faults injected on purpose (ftrun.client.faultspec), the
    # Prometheus endpoint's port (None: off; 0: any free port).
    inject: Schedule | None = None
    metrics_port: int | None = None
    # Stragglers (ftrun.agent.stragglers, regroup only): off | warn | fault, how far above
    # the other ranks' median own time per step, and for how long.
    straggler_policy: str = "warn"
    straggler_factor: float = 2.0
    straggler_window_s: float = 30.0

    @property
    def nnodes(self) -> int:
        """The node count a static job waits for (elastic jobs start at the minimum)."""
        return self.nnodes_min

    @property
    def is_single_node(self) -> bool:
        return self.nnodes_max == 1

    @property
    def hosts_store(self) -> bool:
        """Whether this agent serves the job's store (static: node rank 0)."""
        flag = self.rdzv_conf.get("is_host")
        if flag is not None:
            return flag.lower() in ("1", "true", "yes")
        return self.is_single_node or self.node_rank == 0

    def worker_command(self) -> list[str]:
        """The argv of one worker, as torchrun builds it (unbuffered Python)."""
        if self.no_python:
            return [self.entrypoint, *self.args]
        python = os.environ.get("PYTHON_EXEC", _python())
        if self.module:
            return [python, "-u", "-m", self.entrypoint, *self.args]
        if self.run_path:
            runner = (
                "import runpy, sys; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')"
            )
            return [python, "-u", "-c", runner, self.entrypoint, *self.args]
        return [python, "-u", self.entrypoint, *self.args]


def _python() -> str:
    import sys

    return sys.executable


# --- parsers for torchrun's value syntaxes ---------------------------------------------


def parse_nnodes(value: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` with 0 < MIN <= MAX."""
    parts = value.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--nnodes={value!r}: expected N or MIN:MAX") from None
    if not 0 < low <= high:
        raise ConfigError(f"--nnodes={value!r}: need 0 < MIN <= MAX")
    return low, high


NprocSpec = int | Literal["auto", "cpu", "gpu"]


def parse_nproc_spec(value: str) -> NprocSpec:
    """The syntax of ``--nproc-per-node``: a count >= 1, or ``cpu``, ``gpu``, ``auto``
    (any case), not yet resolved to a number (``ftrun doctor`` keeps it symbolic)."""
    text = value.strip().lower()
    if text.isdigit():
        count = int(text)
        if count < 1:
            raise ConfigError(f"--nproc-per-node={value!r}: must be at least 1")
        return count
    if text in ("auto", "cpu", "gpu"):
        return cast(NprocSpec, text)
    raise ConfigError(f"--nproc-per-node={value!r}: expected a number, 'cpu', 'gpu' or 'auto'")


def parse_nproc_per_node(value: str, gpu_count: int | None = None) -> int:
    """``N``, ``cpu``, ``gpu`` or ``auto`` (GPUs if any, else CPUs), as torchrun reads it."""
    spec = parse_nproc_spec(value)
    if isinstance(spec, int):
        return spec
    cpus = len(os.sched_getaffinity(0))
    if spec == "cpu":
        return cpus
    gpus = visible_gpu_count() if gpu_count is None else gpu_count
    if gpus > 0:
        return gpus
    if spec == "gpu":
        raise ConfigError("--nproc-per-node=gpu: no GPU is visible on this node")
    return cpus


def visible_gpu_count() -> int:
    """GPUs this process may use, without initialising CUDA in the agent."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: a CPU node
        return 0


def parse_stream_spec(value: str, flag: str) -> StreamSpec:
    """torchrun's ``-r``/``-t`` syntax: ``3`` for every rank, or ``0:1,1:2`` per local rank."""
    text = value.strip()
    try:
        if ":" not in text:
            return StreamSpec(default=Std(int(text or "0")))
        per_rank: dict[int, Std] = {}
        for item in text.split(","):
            rank, std = item.split(":")
            per_rank[int(rank)] = Std(int(std))
        return StreamSpec(per_rank=per_rank)
    except ValueError:
        raise ConfigError(
            f"{flag}={value!r}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) "
            "or LOCAL_RANK:VALUE pairs such as 0:1,1:2"
        ) from None


def parse_local_ranks_filter(value: str) -> frozenset[int] | None:
    if not value.strip():
        return None
    try:
        ranks = frozenset(int(item) for item in value.split(","))
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter={value!r}: expected a comma-separated list of integers"
        ) from None
    if any(rank < 0 for rank in ranks):
        raise ConfigError(f"--local-ranks-filter={value!r}: ranks cannot be negative")
    return ranks


def parse_comma_list(value: str | list[str]) -> tuple[str, ...]:
    """torchrun's filter lists: comma separated, ``,,`` for a literal comma."""
    if isinstance(value, list):
        return tuple(value)
    placeholder = "\0"
    return tuple(
        item.replace(placeholder, ",")
        for item in value.replace(",,", placeholder).split(",")
        if item
    )


def parse_signals(value: str) -> tuple[signal.Signals, ...]:
    names = [item.strip().upper() for item in value.split(",") if item.strip()]
    result = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        try:
            sig = signal.Signals[full]
        except KeyError:
            raise ConfigError(f"--signals-to-handle: unknown signal {name!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise ConfigError(f"--signals-to-handle: {full} cannot be handled or forwarded")
        result.append(sig)
    return tuple(result)


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``key=value,key=value`` as torchrun's ``--rdzv-conf``."""
    conf: dict[str, str] = {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--rdzv-conf: {item!r} is not KEY=VALUE")
        conf[key.strip()] = val.strip()
    return conf


def split_endpoint(value: str) -> tuple[str, str]:
    """``host``, ``host:port`` or ``[v6]:port`` as (host, port text); the port text is ""
    when not given, and a bare IPv6 address is all host."""
    text = value.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if text.count(":") == 1:
        host, _, port_text = text.partition(":")
        return host, port_text
    return text, ""


def parse_endpoint(value: str, default_port: int) -> tuple[str, int | None]:
    """``host``, ``host:port`` or ``[v6]:port``; the port is None when not given."""
    host, port_text = split_endpoint(value)
    if not port_text:
        return host, None
    return host, parse_port(port_text, "--rdzv-endpoint")


def parse_port(value: str | int, flag: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise ConfigError(f"{flag}={value!r}: not a port number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag}={value!r}: port must be 0-65535")
    return port


def parse_seconds(value: str | float, flag: str, *, allow_zero: bool = False) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"{flag}={value!r}: not a number of seconds") from None
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigError(f"{flag}={value!r}: must be positive")
    return seconds


# --- checks on the world outside the process -------------------------------------------


def check_resolvable(host: str, flag: str) -> None:
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        raise ConfigError(f"{flag}={host!r}: cannot resolve this host name") from None


def check_port_free(port: int, flag: str) -> None:
    """Refuse early when a port the store must bind is taken (a clearer error than torch's).
    Taken means listened on, not merely lingering in TIME_WAIT after a job that just ended:
    the rule is ``ftrun.host.hostnet.port_bind_error``'s, which ``ftrun doctor`` shares."""
    error = port_bind_error(port)
    if error is not None:
        raise ConfigError(f"{flag}={port}: port is in use ({error.strerror})")


#: What ``--preload auto`` (the default) has the fork server import for a torch script: what
#: a torch job imports anyway (DDP's constructor and the optimizers import torch._dynamo;
#: FSDP2 and DTensor jobs the last two), once per node instead of at every worker's start.
AUTO_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp",
                "torch.distributed.tensor")
_IMPORTS_TORCH = re.compile(rb"^[ \t]*(?:import|from)[ \t]+torch\b", re.MULTILINE)
_SCAN_BYTES = 1 << 20


def parse_preload(text: str, entrypoint: str = "", module: bool = False
                  ) -> tuple[tuple[str, ...], bool]:
    """``--preload``: (the modules the fork server imports, whether ``auto`` chose them).

    ``auto`` (the default, also an empty value): :data:`AUTO_PRELOAD` unless the entrypoint
    is a Python script that imports no torch (a fork server would import for nothing);
    ``none``: no server; else module names, each a dotted Python identifier."""
    value = text.strip()
    if value.lower() in ("", "auto"):
        return (AUTO_PRELOAD if module or _may_import_torch(entrypoint) else ()), True
    if value.lower() == "none":
        return (), False
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(f"--preload: {name!r} is not a module name")
    return names, False


def _may_import_torch(entrypoint: str) -> bool:
    """Whether a script's own text imports torch (a file that cannot be read: assume so,
    the launch reports it)."""
    try:
        with open(entrypoint, "rb") as script:
            return _IMPORTS_TORCH.search(script.read(_SCAN_BYTES)) is not None
    except OSError:
        return True


def _check_interpreter(program: Path) -> None:
    """A script whose ``#!`` names a missing interpreter fails at exec (ENOENT) after the
    job has started and announced itself; saying so before anything runs keeps it one line
    of bad input. A ``#!`` that names a bare word (``#!python``) is left to exec."""
    try:
        with program.open("rb") as handle:
            first = handle.readline(256)
    except OSError:
        return
    if not first.startswith(b"#!"):
        return
    words = first[2:].split()
    if not words:
        return
    interpreter = Path(os.fsdecode(words[0]))
    if interpreter.is_absolute() and not os.access(interpreter, os.X_OK):
        raise ConfigError(f"cannot run {program}: its #! interpreter {interpreter} is not "
                          f"installed (or not executable)")


def check_entrypoint(entrypoint: str, *, module: bool, no_python: bool) -> None:
    if module:
        if not entrypoint.replace(".", "").replace("_", "").isalnum():
            raise ConfigError(f"-m {entrypoint!r}: not a module name")
        return
    if no_python:
        path = Path(entrypoint)
        if path.parent != Path() or path.exists():
            if not path.is_file():
                raise ConfigError(f"{entrypoint}: no such file")
            if not os.access(path, os.X_OK):
                raise ConfigError(f"{entrypoint}: not executable (--no-python runs it directly)")
            _check_interpreter(path)
        elif shutil.which(entrypoint) is None:
            raise ConfigError(f"{entrypoint}: command not found on PATH")
        return
    path = Path(entrypoint)
    if not path.exists():
        raise ConfigError(f"{entrypoint}: no such file")
    if path.is_dir():
        if not (path / "__main__.py").is_file():
            raise ConfigError(f"{entrypoint}: a directory without __main__.py")
        return
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{entrypoint}: not readable")
