"""The ``ftrun`` command line.

``ftrun [torchrun flags] script [script args]`` launches a job; ``ftrun doctor`` checks a
node; ``ftrun --version`` prints the version. Subcommands are recognised only as the first
argument, so a script that happens to be called ``doctor`` runs as ``ftrun ./doctor`` (or
``ftrun -- doctor``, or with any flag first).

The launch command is parsed with :mod:`argparse` on purpose: torchrun compatibility means
argparse's own behaviour (unambiguous prefixes such as ``--nproc-per 8``, everything after
the script passed through untouched), which click and typer do not reproduce. The doctor,
a plain command, is a typer app.

Errors are one line on stderr and exit code 2, before anything starts.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ftrun import __version__
from ftrun.client.faultspec import FaultSpecError, Schedule, parse_schedule
from ftrun.config import (
    DEFAULT_MASTER_PORT,
    DEFAULT_RDZV_PORT,
    ConfigError,
    LaunchConfig,
    Recovery,
    check_entrypoint,
    check_port_free,
    check_resolvable,
    parse_comma_list,
    parse_endpoint,
    parse_local_ranks_filter,
    parse_nnodes,
    parse_nproc_per_node,
    parse_port,
    parse_preload,
    parse_rdzv_conf,
    parse_seconds,
    parse_signals,
    parse_stream_spec,
    visible_gpu_count,
)
from ftrun.control.auth import TokenError, load_secret
from ftrun.exitcodes import ExitCode, exit_at_once
from ftrun.host import jobenv

SUBCOMMANDS = ("doctor", "report", "inject", "status")


class _Parser(argparse.ArgumentParser):
    """argparse with torchrun's spellings: each flag in dash and snake case, prefixes
    matched once per flag, and errors as one line instead of usage plus message."""

    def _get_option_tuples(self, option_string: str):  # type: ignore[no-untyped-def]
        # Both spellings of one flag share a prefix ("--nproc" matches --nproc-per-node and
        # --nproc_per_node); that is not an ambiguity, so keep one match per action.
        seen: set[int] = set()
        unique = []
        for item in super()._get_option_tuples(option_string):
            if id(item[0]) not in seen:
                seen.add(id(item[0]))
                unique.append(item)
        return unique

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


# (flags, env-fallback dest, default, help). One table: torchrun's flags in its order.
def _torchrun_flags(parser: argparse.ArgumentParser) -> None:
    def flag(*names: str, default: object = None, help: str, **kwargs: object) -> None:
        spelled: list[str] = []
        for name in names:
            spelled.append(name)
            if name.startswith("--") and "-" in name[2:]:
                spelled.append("--" + name[2:].replace("-", "_"))
        parser.add_argument(*spelled, default=default, help=help, **kwargs)  # type: ignore[arg-type]

    flag("--nnodes", default="1:1", help="Number of nodes, N or MIN:MAX.")
    flag("--nproc-per-node", default="1", help="Workers per node: N, cpu, gpu or auto.")
    flag("--rdzv-backend", default="static", help="Rendezvous backend: static, c10d or etcd-v3.")
    flag("--rdzv-endpoint", default="", help="Rendezvous endpoint HOST[:PORT].")
    flag("--rdzv-id", default="none", help="Job id shared by every node.")
    flag("--rdzv-conf", default="", help="Rendezvous options KEY=VALUE,...")
    flag("--standalone", action="store_true", help="Single node with its own store.")
    flag("--max-restarts", default="0", help="Restarts allowed before the job fails.")
    flag("--monitor-interval", default="0.1", help="Seconds between checks of remote state.")
    flag("--start-method", default="spawn", help="spawn, fork or forkserver (scripts: no effect).")
    flag("--event-log-handler", default="null", help="null, or console for JSON events.")
    flag("--role", default="default", help="Worker role name.")
    flag("-m", "--module", action="store_true", help="Run the entrypoint as python -m.")
    flag("--no-python", action="store_true", help="Run the entrypoint without python.")
    flag("--run-path", action="store_true", help="Run the script with runpy.run_path.")
    flag("--log-dir", help="Directory for per-attempt, per-rank log files.")
    flag("-r", "--redirects", default="0", help="Streams to files only: 0-3 or RANK:N,...")
    flag("-t", "--tee", default="0", help="Streams to files and console: 0-3 or RANK:N,...")
    flag("--local-ranks-filter", default="", help="Local ranks shown on the console.")
    flag("--duplicate-stdout-filters", default="", help="Copy matching stdout lines to a file.")
    flag("--duplicate-stderr-filters", default="", help="Copy matching stderr lines to a file.")
    flag("--node-rank", default="0", help="This node's rank (static rendezvous).")
    flag("--master-addr", default="127.0.0.1", help="Store host (static rendezvous).")
    flag("--master-port", help=f"Store port (static; default {DEFAULT_MASTER_PORT}).")
    flag("--local-addr", help="This node's address as others reach it.")
    flag("--logs-specs", help="torchrun LogsSpecs plugin (not supported).")
    flag("--numa-binding", help="NUMA binding mode (not supported yet).")
    flag(
        "--signals-to-handle",
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="Signals forwarded to the workers.",
    )
    flag("--shutdown-timeout", help="Seconds from the forwarded signal to SIGKILL.")
    flag("--virtual-local-rank", action="store_true", help="LOCAL_RANK=0, one GPU per worker.")


# ftrun's own options: (flag, dest, environment variable, default, help).
FTRUN_OPTIONS: tuple[tuple[str, str, str, str, str], ...] = (
    ("--heartbeat-interval", "heartbeat_interval", "FTRUN_HEARTBEAT_INTERVAL", "1.0",
     "Seconds between an agent's heartbeats."),
    ("--heartbeat-timeout", "heartbeat_timeout", "FTRUN_HEARTBEAT_TIMEOUT", "auto",
     "Seconds an agent may be silent (no heartbeat, no presence ping) before it is declared "
     "lost (auto: 2 s, or 5 s with etcd-v3, whose writer's lease it also sets; at least 2 "
     "intervals)."),
    ("--stop-grace", "stop_grace", "FTRUN_STOP_GRACE", "",
     "Seconds from SIGTERM to SIGKILL when stopping workers (same as --shutdown-timeout)."),
    ("--recovery", "recovery", "FTRUN_RECOVERY", "auto",
     "auto, restart or regroup."),
    ("--events-file", "events_file", "FTRUN_EVENTS_FILE", "",
     "Write one JSON line per event to this file."),
    ("--on-failure", "on_failure", "FTRUN_ON_FAILURE", "replace",
     "Regroup: replace the failed worker, or shrink the job."),
    ("--spares", "spares", "FTRUN_SPARES", "0",
     "Regroup: warm spare workers per node."),
    ("--standby-nodes", "standby_nodes", "FTRUN_STANDBY_NODES", "0",
     "Regroup, c10d: up to this many nodes beyond --nnodes MAX stand by, their workers "
     "started and waiting, and take a lost node's ranks."),
    ("--min-workers", "min_workers", "FTRUN_MIN_WORKERS", "1",
     "Regroup: stop the job below this many workers."),
    ("--liveness-timeout", "liveness_timeout", "FTRUN_LIVENESS_TIMEOUT", "5.0",
     "Regroup: seconds without a worker heartbeat before it is declared hung."),
    ("--stall-floor", "stall_floor", "FTRUN_STALL_FLOOR", "5.0",
     "Regroup: least seconds without a step before a lagging worker is declared stalled."),
    ("--recovery-deadline", "recovery_deadline", "FTRUN_RECOVERY_DEADLINE", "auto",
     "Regroup: seconds an in-process recovery may take to commit a step before ftrun "
     "restarts the job instead (auto: at least 30 s, longer with slow steps and starts)."),
    ("--max-repeats", "max_repeats", "FTRUN_MAX_REPEATS", "2",
     "The same rank failing with the same error this many times in a row is the script's "
     "own bug: the job stops (exit code 4) instead of recovering again."),
    ("--hang-timeout", "hang_timeout", "FTRUN_HANG_TIMEOUT", "auto",
     "Restart: seconds every worker may sit idle before their stacks are read for a hang "
     "(auto: at least 2 s, more after slow steps; 0: off)."),
    ("--inject", "inject", "FTRUN_INJECT", "",
     "Inject faults on a schedule, e.g. 'kill rank=1 step=20; freeze rank=2 after=30; seed=7' "
     "(kinds: kill, freeze, hang, raise, kill-agent, cut-link; see ftrun/client/faultspec.py)."),
    ("--metrics-port", "metrics_port", "FTRUN_METRICS_PORT", "",
     "Serve Prometheus metrics on this port (0: any free port; unset: off)."),
    ("--straggler-policy", "straggler_policy", "FTRUN_STRAGGLER_POLICY", "warn",
     "Regroup: a rank whose own time per step stays above the others' median: off, warn "
     "(an event, a metric, a line), fault (also taken out like a failed worker)."),
    ("--straggler-factor", "straggler_factor", "FTRUN_STRAGGLER_FACTOR", "2.0",
     "Regroup: how many times the others' median own time per step makes a straggler."),
    ("--straggler-window", "straggler_window", "FTRUN_STRAGGLER_WINDOW", "30",
     "Regroup: seconds a rank must stay that slow before it counts as a straggler."),
    ("--preload", "preload", "FTRUN_PRELOAD", "auto",
     "Modules (comma-separated, e.g. torch) a per-node fork server imports once; every "
     "worker of every generation is forked from it instead of starting Python again. auto: "
     "torch and its distributed modules when the script imports torch; none: off."),
)


def build_parser(environ: Mapping[str, str]) -> _Parser:
    parser = _Parser(
        prog="ftrun",
        description="Fault-tolerant launcher for distributed PyTorch; accepts torchrun's flags.",
        allow_abbrev=True,
    )
    parser.add_argument("--version", action="version", version=f"ftrun {__version__}")
    _torchrun_flags(parser)
    for name, dest, env_name, default, text in FTRUN_OPTIONS:
        parser.add_argument(
            name, name.replace("-", "_").replace("__", "--", 1), dest=dest,
            default=environ.get(env_name, default), help=f"{text} [{env_name}]",
        )
    parser.add_argument(
        "--no-shim", "--no_shim", action="store_true",
        default=False,
        help="Do not put the NCCL shim into workers. [FTRUN_SHIM=0; =1 forces it on]",
    )
    parser.add_argument("training_script", help="The script (or module, or program) to run.")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    # Precedence: an explicit flag, then PET_<DEST> (torchrun's fallback), then Slurm's or
    # a Kubernetes pod's.
    derived = jobenv.flag_defaults(environ)
    for action in parser._actions:
        if action.dest in derived:
            action.default = derived[action.dest]
    for action in parser._actions:
        pet = environ.get(f"PET_{action.dest.upper()}")
        if pet is None or action.dest in ("help", "version", "training_script"):
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = pet.strip().lower() in ("1", "true", "yes")
        else:
            action.default = pet
    return parser


def config_from_args(argv: Sequence[str], environ: Mapping[str, str]) -> LaunchConfig:
    """Parse and validate a launch command line. Raises ConfigError on any bad input."""
    ns = build_parser(environ).parse_args(list(argv))
    _refuse_unsupported(ns)
    pod = jobenv.pod_defaults(environ)
    if pod:
        ns.nnodes = jobenv.pod_nodes(pod, nnodes=ns.nnodes, standby_nodes=ns.standby_nodes)
        jobenv.await_pod_names(pod, {"rdzv_endpoint": ns.rdzv_endpoint,
                                     "local_addr": ns.local_addr}, environ)

    nnodes_min, nnodes_max = parse_nnodes(ns.nnodes)
    nproc = parse_nproc_per_node(ns.nproc_per_node)
    if ns.no_python and ns.module:
        raise ConfigError("--no-python and -m cannot be used together")
    check_entrypoint(ns.training_script, module=ns.module, no_python=ns.no_python)
    preload, preload_auto = parse_preload(ns.preload, ns.training_script, bool(ns.module))

    backend = ns.rdzv_backend.strip().lower()
    if backend in ("etcd", "etcd-v2"):
        raise ConfigError(f"--rdzv-backend={ns.rdzv_backend!r}: etcd's v2 API is deprecated; "
                          "ftrun supports static and c10d, and etcd v3 as etcd-v3")
    if backend not in ("static", "c10d", "etcd-v3"):
        raise ConfigError(f"--rdzv-backend={ns.rdzv_backend!r}: ftrun supports static and "
                          "c10d, and etcd v3 as etcd-v3")
    try:
        node_rank = int(ns.node_rank)
    except ValueError:
        raise ConfigError(f"--node-rank={ns.node_rank!r}: not an integer") from None
    if not 0 <= node_rank < nnodes_max:
        raise ConfigError(f"--node-rank={node_rank}: must be in [0, {nnodes_max})")
    try:
        max_restarts = int(ns.max_restarts)
    except ValueError:
        raise ConfigError(f"--max-restarts={ns.max_restarts!r}: not an integer") from None
    if max_restarts < 0:
        raise ConfigError("--max-restarts: cannot be negative")

    rdzv_conf = parse_rdzv_conf(ns.rdzv_conf)
    rdzv_id = ns.rdzv_id
    single_static = backend == "static" and not ns.rdzv_endpoint and ns.master_port is None
    if ns.standalone or (single_static and nnodes_max == 1):
        # torchrun's own rewrite: one node needs no well-known port, so take a free one (two
        # single-node jobs on one machine do not collide on 29500).
        backend, rdzv_id, rdzv_host, rdzv_port = "c10d", str(uuid.uuid4()), "localhost", 0
        explicit = False
        if nnodes_max != 1:
            raise ConfigError("--standalone runs one node: drop --nnodes or set it to 1")
    elif backend == "etcd-v3":  # the endpoints are etcd's; no agent serves a store
        from ftrun.control.etcd import EtcdConfigError, EtcdOptions
        try:
            (rdzv_host, rdzv_port), explicit = EtcdOptions.parse(
                ns.rdzv_endpoint or "", rdzv_conf).endpoints[0], False
        except EtcdConfigError as error:
            raise ConfigError(str(error)) from None
        if nnodes_max == 1:  # one node needs no external store: its own, on a free port
            rdzv_host, rdzv_port = "localhost", 0
    elif backend == "static" or not ns.rdzv_endpoint:
        rdzv_host = ns.master_addr if backend == "static" else "127.0.0.1"
        explicit = ns.master_port is not None
        rdzv_port = parse_port(ns.master_port, "--master-port") if explicit else DEFAULT_MASTER_PORT
        if backend == "c10d":
            rdzv_host, port = parse_endpoint(ns.rdzv_endpoint, DEFAULT_RDZV_PORT)
            rdzv_host = rdzv_host or "127.0.0.1"
            explicit, rdzv_port = port is not None, port if port is not None else DEFAULT_RDZV_PORT
    else:
        rdzv_host, port = parse_endpoint(ns.rdzv_endpoint, DEFAULT_RDZV_PORT)
        explicit, rdzv_port = port is not None, port if port is not None else DEFAULT_RDZV_PORT
    if nnodes_min != nnodes_max and backend == "static":
        raise ConfigError(
            f"--nnodes={ns.nnodes}: an elastic MIN:MAX job needs --rdzv-backend c10d "
            "(the static backend waits for a fixed set of node ranks)"
        )
    if backend == "c10d" and nnodes_max > 1 and not ns.rdzv_endpoint:
        raise ConfigError("--rdzv-backend c10d with several nodes needs --rdzv-endpoint "
                          "HOST[:PORT] (the host whose agent serves the store)")
    _check_rdzv_conf(rdzv_conf)
    if backend != "etcd-v3" and (etcd_keys := sorted(set(rdzv_conf) & set(ETCD_CONF_KEYS))):
        raise ConfigError(f"--rdzv-conf: {', '.join(etcd_keys)} only apply to "
                          "--rdzv-backend etcd-v3")
    try:
        load_secret(environ)
    except TokenError as error:
        raise ConfigError(str(error)) from None
    check_resolvable(rdzv_host, "--master-addr" if backend == "static" else "--rdzv-endpoint")
    if ns.local_addr:
        check_resolvable(ns.local_addr, "--local-addr")

    grace_text = ns.stop_grace or ns.shutdown_timeout or environ.get(
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"
    )
    try:
        recovery = Recovery(ns.recovery.strip().lower())
    except ValueError:
        raise ConfigError(
            f"--recovery={ns.recovery!r}: expected auto, restart or regroup"
        ) from None
    on_failure = ns.on_failure.strip().lower()
    if on_failure not in ("replace", "shrink"):
        raise ConfigError(f"--on-failure={ns.on_failure!r}: expected replace or shrink")
    spares = _count(ns.spares, "--spares", minimum=0)
    if spares and recovery is not Recovery.REGROUP:
        raise ConfigError("--spares needs --recovery regroup (spares run the worker API)")
    standby_nodes = _count(ns.standby_nodes, "--standby-nodes", minimum=0)
    if standby_nodes and (recovery is not Recovery.REGROUP
                          or backend not in ("c10d", "etcd-v3") or nnodes_max < 2):
        raise ConfigError("--standby-nodes needs --recovery regroup, --rdzv-backend c10d or "
                          "etcd-v3 and --nnodes MAX of at least 2 (a standby node's workers "
                          "are spares)")
    min_workers = _count(ns.min_workers, "--min-workers", minimum=1)
    if min_workers > nproc * nnodes_max:
        raise ConfigError(f"--min-workers={min_workers}: more than the job's "
                          f"{nproc * nnodes_max} workers (--nproc-per-node x nodes)")
    handler = ns.event_log_handler.strip().lower()
    if handler not in ("null", "console"):
        raise ConfigError(f"--event-log-handler={ns.event_log_handler!r}: expected null or console")
    start_method = ns.start_method.strip().lower()
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ConfigError(f"--start-method={ns.start_method!r}: expected spawn, fork or forkserver")
    heartbeat_interval = parse_seconds(ns.heartbeat_interval, "--heartbeat-interval")
    heartbeat_timeout = max(5.0 if backend == "etcd-v3" else 2.0, 2 * heartbeat_interval) \
        if ns.heartbeat_timeout.strip().lower() == "auto" \
        else parse_seconds(ns.heartbeat_timeout, "--heartbeat-timeout")
    if heartbeat_timeout <= heartbeat_interval:
        raise ConfigError("--heartbeat-timeout must be longer than --heartbeat-interval")

    config = LaunchConfig(
        entrypoint=ns.training_script,
        args=tuple(ns.training_script_args),
        module=ns.module,
        no_python=ns.no_python,
        run_path=ns.run_path,
        nnodes_min=nnodes_min,
        nnodes_max=nnodes_max,
        nproc_per_node=nproc,
        node_rank=node_rank,
        role=ns.role,
        virtual_local_rank=ns.virtual_local_rank,
        rdzv_backend=backend,
        rdzv_host=rdzv_host,
        rdzv_port=rdzv_port,
        rdzv_port_explicit=explicit,
        rdzv_id=rdzv_id,
        rdzv_conf=rdzv_conf,
        rdzv_endpoint=ns.rdzv_endpoint or "",
        local_addr=ns.local_addr,
        standalone=ns.standalone,
        max_restarts=max_restarts,
        monitor_interval_s=parse_seconds(ns.monitor_interval, "--monitor-interval"),
        shutdown_timeout_s=parse_seconds(grace_text, "--shutdown-timeout", allow_zero=True),
        signals_to_handle=parse_signals(ns.signals_to_handle),
        signals_to_handle_text=ns.signals_to_handle,
        recovery=recovery,
        on_failure=on_failure,
        spares=spares,
        standby_nodes=standby_nodes,
        min_workers=min_workers,
        liveness_timeout_s=parse_seconds(ns.liveness_timeout, "--liveness-timeout"),
        stall_floor_s=parse_seconds(ns.stall_floor, "--stall-floor"),
        recovery_deadline_s=None if ns.recovery_deadline.strip().lower() == "auto"
        else parse_seconds(ns.recovery_deadline, "--recovery-deadline"),
        max_repeats=_count(ns.max_repeats, "--max-repeats", minimum=1),
        hang_timeout_s=None if ns.hang_timeout == "auto" else parse_seconds(
            ns.hang_timeout, "--hang-timeout", allow_zero=True),
        preload=preload,
        preload_auto=preload_auto,
        heartbeat_interval_s=heartbeat_interval,
        heartbeat_timeout_s=heartbeat_timeout,
        join_timeout_s=parse_seconds(rdzv_conf.get("join_timeout", "600"), "join_timeout"),
        use_shim=_use_shim(ns.no_shim, environ),
        log_dir=Path(ns.log_dir) if ns.log_dir else None,
        redirects=parse_stream_spec(ns.redirects, "--redirects"),
        tee=parse_stream_spec(ns.tee, "--tee"),
        local_ranks_filter=parse_local_ranks_filter(ns.local_ranks_filter),
        duplicate_stdout_filters=parse_comma_list(ns.duplicate_stdout_filters),
        duplicate_stderr_filters=parse_comma_list(ns.duplicate_stderr_filters),
        events_file=Path(ns.events_file) if ns.events_file else None,
        event_log_console=handler == "console",
        start_method=start_method,
        inject=_inject_schedule(ns.inject),
        metrics_port=_metrics_port(ns.metrics_port),
        **_stragglers(ns),
    )
    # A c10d agent whose address merely matches the endpoint takes the store only if the
    # port is free (another agent on this host may already serve it), as torchrun does.
    inferred_host = backend == "c10d" and nnodes_max > 1 and "is_host" not in rdzv_conf
    if config.hosts_store and config.rdzv_port != 0 and not inferred_host \
            and backend != "etcd-v3":
        flag = "--master-port" if backend == "static" else "--rdzv-endpoint"
        check_port_free(config.rdzv_port, flag)
    return config


# torchrun's --rdzv-conf keys; ftrun acts on the first four and accepts the others.
RDZV_CONF_KEYS = ("is_host", "join_timeout", "last_call_timeout", "read_timeout",
                  "close_timeout", "timeout", "keep_alive_interval", "keep_alive_max_attempt",
                  "use_libuv", "protocol", "cacert", "cert", "key", "etcd_prefix")
# the etcd-v3 backend's (torchrun's etcd options): ftrun.control.etcd.EtcdOptions
ETCD_CONF_KEYS = ("protocol", "cacert", "cert", "key", "etcd_prefix")


def _check_rdzv_conf(conf: Mapping[str, str]) -> None:
    for key, value in conf.items():
        if key not in RDZV_CONF_KEYS:
            raise ConfigError(f"--rdzv-conf: unknown key {key!r} (known: "
                              f"{', '.join(RDZV_CONF_KEYS)})")
        if key == "is_host" and value.lower() not in ("0", "1", "true", "false", "yes", "no"):
            raise ConfigError(f"--rdzv-conf: is_host={value!r}: expected true or false")
        if key.endswith("timeout") and key != "timeout":
            parse_seconds(value, key, allow_zero=key == "last_call_timeout")


def _use_shim(disabled: bool, environ: Mapping[str, str]) -> bool:
    """The shim exists to abort NCCL communicators: by default it goes into the workers of
    a node with GPUs only: on a CPU-only node there is nothing for it to abort, and its
    native thread is one more thing running at a worker's exit. FTRUN_SHIM=1 forces it on,
    FTRUN_SHIM=0 or --no-shim off."""
    choice = environ.get("FTRUN_SHIM", "").strip()
    if disabled or choice == "0":
        return False
    return choice == "1" or visible_gpu_count() > 0


def _count(value: str, flag: str, *, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{flag}={value!r}: not an integer") from None
    if number < minimum:
        raise ConfigError(f"{flag}={value!r}: must be at least {minimum}")
    return number


def _refuse_unsupported(ns: argparse.Namespace) -> None:
    """Flags torchrun has and ftrun cannot honour yet: refuse rather than ignore them."""
    if ns.logs_specs:
        raise ConfigError(
            "--logs-specs: torchrun LogsSpecs plugins are not supported; ftrun writes "
            "torchrun's default layout under --log-dir"
        )
    if ns.numa_binding:
        raise ConfigError(
            "--numa-binding is not supported yet; wrap the script in numactl with --no-python"
        )


def _inject_schedule(text: str) -> Schedule | None:
    if not text.strip():
        return None
    try:
        return parse_schedule(text)
    except FaultSpecError as error:
        raise ConfigError(f"--inject: {error}") from None


def _stragglers(ns: argparse.Namespace) -> dict[str, Any]:
    policy = ns.straggler_policy.strip().lower()
    if policy not in ("off", "warn", "fault"):
        raise ConfigError(f"--straggler-policy={ns.straggler_policy!r}: expected off, warn "
                          "or fault")
    try:
        factor = float(ns.straggler_factor)
    except ValueError:
        factor = 0.0
    if not 1.0 < factor < 1000.0:
        raise ConfigError(f"--straggler-factor={ns.straggler_factor!r}: expected a number "
                          "above 1 (e.g. 2: twice the others' median)")
    return {"straggler_policy": policy, "straggler_factor": factor,
            "straggler_window_s": parse_seconds(ns.straggler_window, "--straggler-window")}


def _metrics_port(text: str) -> int | None:
    if not text.strip():
        return None
    if not text.strip().isdigit() or int(text) > 65535:
        raise ConfigError(f"--metrics-port={text!r}: expected a port number (0: any free port)")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return _leave_if_a_connect_hangs(_run_subcommand(args[0], args[1:]))
    try:
        config = config_from_args(args, os.environ)
    except ConfigError as error:
        print(f"ftrun: error: {error}", file=sys.stderr)
        return ExitCode.USAGE
    # --preload: the fork server starts importing now, beside the agent's own import of
    # torch (ftrun.agent.forkserver is light), not after it.
    from ftrun.agent.forkserver import start_fork_server

    try:
        fork_server = start_fork_server(config)
        from ftrun.control.tcpstore import tcpstore_class

        tcpstore_class()  # torch, with its C++ log quiet: before the agent's modules import it
        from ftrun.agent import run_agent

        # torch's modules and ftrun's live as long as the agent: out of the collector's way,
        # the first rendezvous does not pay for a full collection over them (the leader's
        # CPU in a first join of 512 agents: 0.039 s with, 0.103 s without; docs/scale.md).
        gc.freeze()
        return run_agent(config, fork_server)
    except Exception as error:  # a bug in ftrun: one line for the user, the trace in a file
        import tempfile
        import traceback

        with tempfile.NamedTemporaryFile("w", prefix="ftrun-crash-", delete=False) as dump:
            traceback.print_exc(file=dump)
        print(
            f"ftrun: internal error: {type(error).__name__}: {error} "
            f"(traceback in {dump.name}; please report it)",
            file=sys.stderr,
        )
        return ExitCode.INTERNAL_ERROR


def _run_subcommand(name: str, args: list[str]) -> int:
    if name == "doctor":
        from ftrun.doctor import app

        try:
            app(args=args, prog_name="ftrun doctor")
        except SystemExit as done:
            return int(done.code or 0) if not isinstance(done.code, str) else ExitCode.USAGE
        return 0
    if name == "report":  # a job's faults and a timeline picture from its event log
        from ftrun.report.command import main as report

        return report(args)
    if name == "inject":  # a fault, now, in a running job (through its control store)
        from ftrun.client.inject import main as inject

        return inject(args)
    if name == "status":  # one look at a running job (its leader's record in the store)
        from ftrun.client.status import main as status

        return status(args)
    raise AssertionError(name)


def _leave_if_a_connect_hangs(code: int) -> int:
    """``code``, or an exit with it now when a store connect that a subcommand gave up on (a
    frozen or vanished store host) still runs inside torch (see ``exit_at_once``; seen with
    ``ftrun status`` against a job that had just ended: -6 instead of 3)."""
    if "ftrun.control.tcpstore" in sys.modules:  # only a command that used a store can have one
        from ftrun.control.tcpstore import connect_still_running

        if connect_still_running():
            exit_at_once(code)
    return code
