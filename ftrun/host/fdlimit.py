"""The agent's open-file limit: raised for the stores it may serve, the workers' left alone.

The agent that serves a multi-node job's stores (the c10d leader, the etcd-v3 writer)
holds about ``PER_NODE_FDS`` descriptors for every other node (its control-store
clients, the presence connection) and one or two for each of that node's workers (the
process group's store client; under in-process recovery also the member beats). A soft
limit of 1024, the default of many distributions and of anything systemd starts, is spent
at a few dozen nodes of eight workers (about 40 under regroup, 24 each; 70 otherwise):
``accept`` fails with EMFILE, and the other agents see a store that refuses them or never
answers, which looks like a lost host. So a multi-node agent raises its own soft limit to
its hard limit at start, as servers do (etcd does; Go's runtime does it for every
program), and says so once when even the hard limit is below what the job at its largest
size needs.

Its workers start with the soft limit the agent was started with (:func:`restore_in_child`,
between fork and exec), as under torchrun: a program that sizes tables by the limit or
still uses ``select`` sees what it always saw; ``ftrun doctor``'s ``host.nofile`` judges
that limit too (:func:`workers_limit`). The one piece of module state, ``_INHERITED``, is
that limit, read once at import (before anything here changes it).
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable
from pathlib import Path

from ftrun.config import LaunchConfig, Recovery

#: Descriptors the store host holds for each other node, besides its workers': measured on
#: 2-node jobs of 2 workers each (the leader's sockets by peer process): 7 for the other
#: agent (4 control-store connections, its presence connection, 2 to its snapshot replica
#: server), rounded up for a reconnect in flight.
PER_NODE_FDS = 8
#: And for each of its workers: the process group's store client (a restart job's only
#: one), and under regroup the member beats' client as well (the same measurement).
PER_RESTART_WORKER_FDS = 1
PER_WORKER_FDS = 2
#: The agent's own descriptors, whatever the job's size (logs, pipes of its workers, the
#: event log, metrics, the fork server).
BASE_FDS = 256

_INHERITED: tuple[int, int] = resource.getrlimit(resource.RLIMIT_NOFILE)


def workers_limit() -> tuple[int, int]:
    """The (soft, hard) open-file limit this process was started with: its workers' limit."""
    return _INHERITED


def needed(config: LaunchConfig) -> int:
    """Descriptors the store host of this job needs at its largest size (standbys included)."""
    nodes = config.nnodes_max + config.standby_nodes
    per_worker = PER_RESTART_WORKER_FDS if config.recovery is Recovery.RESTART \
        else PER_WORKER_FDS
    return BASE_FDS + nodes * (PER_NODE_FDS + per_worker * config.nproc_per_node)


def raise_for(config: LaunchConfig, say: Callable[..., None]) -> None:
    """Raise this process's soft open-file limit to its hard limit (multi-node jobs only: a
    single node's stores serve its own workers), and ``say`` (one yellow line) when that
    limit is below :func:`needed` or could not be raised. Never raises."""
    if not config.is_single_node:
        note = _raise(config)
        if note:
            say(note, style="yellow")


def _ceiling() -> int:
    """What an unlimited hard limit allows a process to ask for: the kernel's
    ``fs.nr_open`` (1,048,576 unless changed)."""
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


def _raise(config: LaunchConfig) -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _ceiling() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as error:
            return (f"cannot raise the open-file limit from {soft} to {target} ({error}); "
                    "serving this job's stores may run out of descriptors")
    want = needed(config)
    if soft != resource.RLIM_INFINITY and soft < want:
        workers = f"{config.nproc_per_node} worker{'s' if config.nproc_per_node != 1 else ''}"
        return (f"the open-file limit ({soft}, the hard limit) is below the about {want} "
                f"that serving the stores of {config.nnodes_max + config.standby_nodes} "
                f"nodes with {workers} each needs: a store host would refuse connections "
                "(EMFILE); raise it (ulimit -Hn, limits.conf, or Slurm's "
                "PropagateResourceLimits)")
    return ""


def restore_in_child() -> None:
    """Between fork and exec of a worker (or the fork server): the soft open-file limit the
    agent was started with. One system call, errors ignored (the child then keeps the
    raised limit, which is harmless)."""
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NOFILE, _INHERITED)
