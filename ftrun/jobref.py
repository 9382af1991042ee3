"""Naming a running job from another shell: ``ENDPOINT`` (HOST:PORT of its control store) or
``RUN_ID`` (looked up in this host's run registry).

The leader agent registers its run id and control endpoint in a per-user directory
(``$XDG_RUNTIME_DIR/ftrun`` or ``<tmp>/ftrun-<uid>``, mode 0700) while the job runs, so that
``ftrun status RUN_ID`` and ``ftrun inject --job RUN_ID`` work on the leader's host; from any
other host give HOST:PORT. Nothing secret is stored: the job token stays in the environment.
Errors are :class:`JobRefError`, one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class JobRefError(ValueError):
    """The job cannot be named this way; the message is one line."""


def registry_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "ftrun" if runtime else \
        Path(tempfile.gettempdir()) / f"ftrun-{os.getuid()}"
    return base


def register(run_id: str, host: str, port: int) -> Path | None:
    """Note that ``run_id`` is served at HOST:PORT; None when it cannot be written (the
    job runs anyway: the registry is a convenience)."""
    if not _RUN_ID.match(run_id):
        return None
    directory = registry_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / f"{run_id}.json"
        path.write_text(json.dumps({"host": host, "port": port, "pid": os.getpid()}))
    except OSError:
        return None
    return path


def unregister(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def resolve(text: str) -> tuple[str, int]:
    """(host, port) for ``HOST:PORT`` or a registered run id. Raises :class:`JobRefError`."""
    host, colon, port = text.rpartition(":")
    if colon and port.isdigit():
        number = int(port)
        if not 0 < number < 65536:
            raise JobRefError(f"{text!r}: port out of range")
        return host.strip("[]") or "127.0.0.1", number
    if not _RUN_ID.match(text):
        raise JobRefError(f"{text!r}: expected HOST:PORT or a run id")
    path = registry_dir() / f"{text}.json"
    try:
        data = json.loads(path.read_text())
        host, number, pid = data["host"], int(data["port"]), int(data["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        raise JobRefError(f"no job with run id {text!r} is registered on this host (give "
                          "HOST:PORT of its control store)") from None
    if not isinstance(host, str) or not 0 < number < 65536:
        raise JobRefError(f"{path}: not a run registration")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise JobRefError(f"the job with run id {text!r} has ended (its agent, pid {pid}, "
                          "is gone)") from None
    except PermissionError:
        pass
    return host, number
