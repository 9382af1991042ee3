"""The node's snapshot memory: one directory on tmpfs that outlives every worker.

The agent (:mod:`ftrun.agent.snapshots`) creates ``/dev/shm/ftrun-snap-<run id>-<host>-<agent
pid>/`` (mode 0700) when it starts, gives its path to its workers in ``FTRUN_SNAPSHOT_DIR``
and removes it when it ends, by any exit path it survives; at start it also removes the
directories of agents whose pid is dead (an agent killed with SIGKILL cannot clean up).
POSIX shared memory *is* tmpfs files, so a snapshot written here is in RAM, readable by a
replacement worker after the writer died, and gone with the node's agent.

Files: ``g<job generation>-e<member epoch>-s<step>-r<rank>.snap`` (see
:mod:`ftrun.snapshot.format`; the job generation keeps the files of a restarted generation
apart from the one before, whose newest complete snapshot the restart restores),
written as ``.tmp`` and published by ``rename`` (atomic within one file system), so a
reader never sees half a snapshot. Memory is bounded: each rank keeps at most two (the
newest complete snapshot and the one being written); :func:`check_capacity` says at start,
in one line with the sizes, when the file system cannot hold that.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from pathlib import Path

import psutil

ENV = "FTRUN_SNAPSHOT_DIR"  # the directory, set by the agent for its workers
CAP_ENV = "FTRUN_SNAPSHOT_CAP_BYTES"  # optional cap on this node's snapshot memory
ROOT = Path("/dev/shm")
PREFIX = "ftrun-snap-"
_NAME = re.compile(r"^g(\d+)-e(\d+)-s(\d+)-r(\d+)\.snap$")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class SnapshotMemoryError(RuntimeError):
    """The node's snapshot memory cannot hold what the job needs (one line, with sizes)."""


def node_dir_name(run_id: str, host: str, pid: int) -> str:
    return f"{PREFIX}{_SAFE.sub('_', run_id)}-{_SAFE.sub('_', host)}-{pid}"


def remove_stale(root: Path = ROOT) -> list[Path]:
    """Remove snapshot directories whose agent (the pid at the end of the name) is dead."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if not entry.name.startswith(PREFIX):
                continue
            pid_text = entry.name.rpartition("-")[2]
            if pid_text.isdigit() and not psutil.pid_exists(int(pid_text)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def create(run_id: str, host: str, root: Path = ROOT) -> Path:
    """This agent's directory, made fresh (mode 0700)."""
    path = root / node_dir_name(run_id, host, os.getpid())
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=False)
    return path


def file_name(generation: int, epoch: int, step: int, rank: int) -> str:
    return f"g{generation}-e{epoch}-s{step}-r{rank}.snap"


def parse_name(name: str) -> tuple[int, int, int, int] | None:
    """(job generation, member epoch, step, rank) of a snapshot file name, or None."""
    match = _NAME.match(name)
    return (int(match[1]), int(match[2]), int(match[3]), int(match[4])) if match else None


def newest_age_s(path: Path) -> float | None:
    """Seconds since the newest snapshot file in ``path`` was written; None without one."""
    newest = None
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            if _NAME.match(entry.name):
                with contextlib.suppress(OSError):
                    mtime = entry.stat().st_mtime
                    newest = mtime if newest is None else max(newest, mtime)
    return None if newest is None else max(0.0, time.time() - newest)


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def used_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for entry in path.iterdir():
            with contextlib.suppress(OSError):
                total += entry.stat().st_size
    return total


def cap_bytes(environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    text = environ.get(CAP_ENV, "")
    if not text:
        return None
    if not text.isdigit() or int(text) <= 0:
        raise SnapshotMemoryError(f"{CAP_ENV}={text!r} is not a positive number of bytes")
    return int(text)


def check_capacity(path: Path, *, per_rank_bytes: int, local_ranks: int, rank: int,
                   node: str, cap: int | None, replicas: bool = False) -> None:
    """Raise :class:`SnapshotMemoryError` when this node cannot hold two snapshots of every
    local rank (the complete one and the one being written), and with ``replicas`` as many
    of its buddy's ranks (assumed as many as its own: every node runs the same number of
    workers), or when that exceeds ``cap``.

    ``free`` counts what the file system has left plus what the job's own directory holds
    already (its files are replaced, not added to).
    """
    copies = 2 if replicas else 1
    need = 2 * per_rank_bytes * local_ranks * copies
    what = f"{local_ranks} local ranks x 2 x {per_rank_bytes} bytes" + (
        ", and as much for the buddy's replicas" if replicas else "")
    have = free_bytes(path) + used_bytes(path)
    if cap is not None and need > cap:
        raise SnapshotMemoryError(
            f"rank {rank} on {node}: snapshots need {need} bytes ({what}), more than the "
            f"cap {cap} bytes ({CAP_ENV})")
    if need > have:
        raise SnapshotMemoryError(
            f"rank {rank} on {node}: snapshots need {need} bytes ({what}) but {path.parent} "
            f"has {have} bytes free")
