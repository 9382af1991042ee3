"""Naming a running job from another shell: ``ENDPOINT`` (HOST:PORT of its control store),
``etcd-v3://HOST:PORT[,HOST:PORT...]/RUN_ID[?protocol=https&cacert=...]`` (an etcd-v3 job:
its cluster's endpoints, its run id and ``--rdzv-conf``'s etcd options), or ``RUN_ID``
(looked up in this host's run registry).

The agents register the run id in a per-user directory (``$XDG_RUNTIME_DIR/ftrun`` or
``<tmp>/ftrun-<uid>``, mode 0700) while the job runs: a TCPStore job's leader its control
endpoint (``<run id>.json``), every agent of an etcd-v3 job the cluster's endpoints and
options (``<run id>@<pid>.json``: the writer moves, so any live agent's entry names the
job). ``ftrun status RUN_ID`` and ``ftrun inject --job RUN_ID`` so work on the leader's host,
and on any node of an etcd-v3 job; from elsewhere give the endpoint or the etcd-v3 URL.
An entry names its agent by pid and start time: an agent that was SIGKILLed leaves its entry
behind, and a pid alone, reused by a later process, would make it look alive.
Nothing secret is stored: the job token stays in the environment (certificate paths are
paths). Errors are :class:`JobRefError`, one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import psutil

_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


#: ``--rdzv-conf`` keys an etcd-v3 job reference may carry (ftrun.control.etcd.EtcdOptions)
ETCD_OPTIONS = ("protocol", "cacert", "cert", "key", "etcd_prefix")
ETCD_SCHEME = "etcd-v3"


class JobRefError(ValueError):
    """The job cannot be named this way; the message is one line."""


@dataclass(frozen=True)
class JobRef:
    """Where a running job's control records are: a TCPStore (``host``, ``port``: the job
    owns the store, its record is ``ftrun/job``) or etcd (``etcd``: the endpoints, with
    ``options``; many jobs share it, so the record is under the run id)."""

    host: str = ""
    port: int = 0
    etcd: str = ""
    options: dict[str, str] = field(default_factory=dict)
    run_id: str = ""

    @property
    def job_key(self) -> str:
        return f"ftrun/{self.run_id}/job" if self.etcd else "ftrun/job"

    def describe(self) -> str:
        return f"etcd at {self.etcd} (run id {self.run_id})" if self.etcd \
            else f"{self.host}:{self.port}"

    def connect(self, timeout_s: float) -> Any:
        """A client of the job's store, reached within ``timeout_s`` (each request bounded
        by it too). Raises StoreError (unreachable) or JobRefError (bad etcd options)."""
        if not self.etcd:
            from ftrun.control.tcpstore import connect_store

            return connect_store(self.host, self.port, timeout_s, op_timeout_s=timeout_s)
        from ftrun.control.etcd import EtcdConfigError, EtcdOptions, connect_etcd

        try:
            options = EtcdOptions.parse(self.etcd, self.options)
        except EtcdConfigError as error:
            raise JobRefError(str(error)) from None
        return connect_etcd(options, timeout_s, op_timeout_s=timeout_s)


def registry_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "ftrun" if runtime else \
        Path(tempfile.gettempdir()) / f"ftrun-{os.getuid()}"
    return base


def register(run_id: str, host: str, port: int) -> Path | None:
    """Note that ``run_id`` is served at HOST:PORT; None when it cannot be written (the
    job runs anyway: the registry is a convenience). Entries of agents that are gone go
    first (a killed job never unregisters)."""
    if not _RUN_ID.match(run_id):
        return None
    prune()
    directory = registry_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / f"{run_id}.json"
        path.write_text(json.dumps({"host": host, "port": port, **_this_process()}))
    except OSError:
        return None
    return path


def register_etcd(run_id: str, endpoint: str, conf: dict[str, str]) -> Path | None:
    """Note that ``run_id`` is an etcd-v3 job at ``endpoint`` with ``conf``'s etcd options,
    as this agent (one file per agent: any live one names the job); None as for
    :func:`register`."""
    if not _RUN_ID.match(run_id):
        return None
    options = {k: v for k, v in conf.items() if k in ETCD_OPTIONS}
    prune()
    try:
        directory = registry_dir()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / f"{run_id}@{os.getpid()}.json"
        path.write_text(json.dumps({"etcd": endpoint, "options": options,
                                    **_this_process()}))
    except OSError:
        return None
    return path


@dataclass(frozen=True)
class LiveJob:
    """A job registered on this host whose agent runs."""

    run_id: str
    ref: JobRef
    pid: int
    started: float | None


def _entries() -> list[tuple[Path, str]]:
    """(entry, run id) of every registry entry on this host."""
    try:
        paths = sorted(registry_dir().glob("*.json"))
    except OSError:
        return []
    return [(path, path.stem.split("@", 1)[0]) for path in paths
            if _RUN_ID.match(path.stem.split("@", 1)[0])]


def prune() -> list[Path]:
    """Remove the entries whose agent is gone (a SIGKILLed agent cannot unregister);
    returns them. Half-written entries of an agent starting now are left."""
    removed = []
    for path, run_id in _entries():
        ref, pid, started = _registered(path, run_id)
        if ref is not None and not _alive(pid, started):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


def live_jobs() -> list[LiveJob]:
    """The jobs registered on this host whose agent runs, one per run id, oldest first
    (dead entries are pruned on the way)."""
    prune()
    found: dict[str, LiveJob] = {}
    for path, run_id in _entries():
        ref, pid, started = _registered(path, run_id)
        if ref is not None and run_id not in found and _alive(pid, started):
            found[run_id] = LiveJob(run_id, ref, pid, started)
    return sorted(found.values(), key=lambda job: job.started or 0.0)


def unregister(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def resolve(text: str) -> JobRef:
    """The job named by ``HOST:PORT``, an etcd-v3 URL or a registered run id. Raises
    :class:`JobRefError`."""
    if text.startswith(f"{ETCD_SCHEME}://"):
        return _etcd_url(text)
    host, colon, port = text.rpartition(":")
    if colon and port.isdigit():
        number = int(port)
        if not 0 < number < 65536:
            raise JobRefError(f"{text!r}: port out of range")
        return JobRef(host=host.strip("[]") or "127.0.0.1", port=number)
    if not _RUN_ID.match(text):
        raise JobRefError(f"{text!r}: expected HOST:PORT, {ETCD_SCHEME}://HOST:PORT,.../RUN_ID "
                          "or a run id")
    entries = [registry_dir() / f"{text}.json",
               *sorted(registry_dir().glob(f"{text}@*.json"))]  # '@' is in no run id
    ended: int | None = None
    for path in entries:
        ref, pid, started = _registered(path, text)
        if ref is None:
            continue
        if _alive(pid, started):
            return ref
        ended = pid
    if ended is not None:
        raise JobRefError(f"the job with run id {text!r} has ended (its agent, pid {ended}, "
                          "is gone)")
    raise JobRefError(f"no job with run id {text!r} is registered on this host (give "
                      f"HOST:PORT of its control store, or {ETCD_SCHEME}://HOST:PORT/RUN_ID)")


def _registered(path: Path, run_id: str) -> tuple[JobRef | None, int, float | None]:
    """One registry entry: (where the job is, the registering agent's pid and start time);
    (None, 0, None) when it is missing or not an entry (a half-written file of an agent
    starting now). An entry written before start times were recorded has None."""
    try:
        data = json.loads(path.read_text())
        pid = int(data["pid"])
        started = float(data["started"]) if "started" in data else None
        if "etcd" in data:
            options = data["options"]
            if not isinstance(data["etcd"], str) or not isinstance(options, dict) or \
                    not all(isinstance(v, str) and k in ETCD_OPTIONS for k, v in options.items()):
                return None, 0, None
            return JobRef(etcd=data["etcd"], options=options, run_id=run_id), pid, started
        host, number = data["host"], int(data["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0, None
    if not isinstance(host, str) or not 0 < number < 65536:
        return None, 0, None
    return JobRef(host=host, port=number), pid, started


#: Two reads of one process's start time differ by less (they are clock ticks from boot).
_SAME_START_S = 0.5


def _this_process() -> dict[str, Any]:
    """This agent's pid and start time, as an entry records them."""
    return {"pid": os.getpid(), "started": psutil.Process().create_time()}


def _alive(pid: int, started: float | None) -> bool:
    """Whether the entry's agent still runs: its pid names a process that started when the
    agent did (not a later one that reuses the pid)."""
    try:
        process = psutil.Process(pid)
        return started is None or abs(process.create_time() - started) < _SAME_START_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: the pid is taken, the start unknown
        return started is None


def _etcd_url(text: str) -> JobRef:
    """``etcd-v3://HOST:PORT[,HOST:PORT...]/RUN_ID[?KEY=VALUE&...]``, the keys those of
    ``--rdzv-conf`` that say how to reach etcd (:data:`ETCD_OPTIONS`)."""
    parts = urlsplit(text)
    run_id = parts.path.strip("/")
    if not parts.netloc or not _RUN_ID.match(run_id):
        raise JobRefError(f"{text!r}: expected {ETCD_SCHEME}://HOST:PORT[,HOST:PORT...]/RUN_ID")
    options: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in ETCD_OPTIONS:
            raise JobRefError(f"{text!r}: unknown option {key!r} (expected one of "
                              f"{', '.join(ETCD_OPTIONS)})")
        options[key] = value
    return JobRef(etcd=parts.netloc, options=options, run_id=run_id)
