"""Drive real ``ftrun`` (and ``torchrun``) processes from tests.

A :class:`Launch` runs the launcher as a subprocess, collects its output lines in a
thread, and lets a test wait for a condition on them with a deadline. Nothing here sleeps
and hopes: every wait names what it waits for and fails with the output when it times out.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from tests.lines import Step, find, parse_line

REPO = Path(__file__).resolve().parent.parent


#: For a test about what happens around starts, faults and restarts, not about cold starts:
#: its workers fork from a per-node fork server that imported torch and torch._dynamo (DDP's
#: and the optimizer's constructors import it) once. A fresh worker costs about 4 s of CPU
#: on a 2-core machine at every start, restart and replacement, and the suite starts
#: hundreds; cold starts are covered by the launcher's and preload's own tests.
PRELOADED = ("torch", "torch._dynamo")
PRELOAD = ("--preload", ",".join(PRELOADED))
TRAIN_SCRIPT = REPO / "scripts" / "train_ddp.py"
BIN = Path(sys.executable).parent


def launcher(name: str = "ftrun") -> str:
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name) or name


class Launch:
    """One launcher process and its combined output."""

    running: list[Launch] = []  # killed by the conftest fixture if a test leaves one

    def __init__(
        self,
        args: Sequence[str],
        *,
        program: str = "ftrun",
        env: dict[str, str | None] | None = None,
        cwd: Path | None = None,
    ) -> None:
        full_env = dict(os.environ)
        for name, value in (env or {}).items():  # None: unset (the launcher's default)
            if value is None:
                full_env.pop(name, None)
            else:
                full_env[name] = value
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.started = time.time()
        self.proc = subprocess.Popen(
            [launcher(program), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            text=True,
            errors="replace",
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        Launch.running.append(self)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for(self, predicate: Callable[[list[str]], object], timeout_s: float, what: str):
        """Wait until ``predicate(lines)`` is truthy; return its value."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                value = predicate(self.lines)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"timed out waiting for {what}; output:\n" + "\n".join(self.lines[-60:])
                    )
                self._cond.wait(min(left, 0.5))

    def wait_step(self, step: int, timeout_s: float, rank: int | None = None) -> Step:
        """The first committed step at or past ``step`` (of ``rank``, if given)."""
        def seen(lines: list[str]) -> Step | None:
            for line in lines:
                parsed = parse_line(line)
                if (isinstance(parsed, Step) and parsed.step >= step
                        and (rank is None or parsed.rank == rank)):
                    return parsed
            return None

        return self.wait_for(seen, timeout_s, f"step {step}")

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"launcher still running after {timeout_s}s; output:\n{self.output[-5000:]}"
            ) from None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def steps(self) -> list[Step]:
        """Every committed step printed so far (tests/lines.py reads the other lines)."""
        with self._cond:
            return find(self.lines, Step)


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(text in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return [p for p in found if p.pid != os.getpid()]


def assert_no_processes_mention(text: str, timeout_s: float) -> None:
    """Fail if processes mentioning ``text`` outlive ``timeout_s``; kill them either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in processes_mentioning(text) if _alive(p)]
        if not left:
            return
        if time.monotonic() >= deadline:
            described = [f"{p.pid}: {' '.join(p.cmdline())[:120]}" for p in left if _alive(p)]
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            raise AssertionError(f"processes left behind: {described}")
        time.sleep(0.1)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def running(pid: int) -> bool:
    """Whether process ``pid`` has not ended yet (a zombie has: only its parent has not read
    its status)."""
    try:
        return _alive(psutil.Process(pid))
    except psutil.Error:
        return False


def free_port() -> int:
    """A TCP port free on loopback now (a small race with other binders is accepted: a test
    that must not collide passes port 0 where the code under test allows it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Wait for a fact outside a launcher's output (a process gone, a file written), polling
    every 10 ms, and fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def copy_train_script(directory: Path) -> Path:
    """A private copy of the training script, so leftover checks can find its processes."""
    target = directory / "train_ddp.py"
    shutil.copy(TRAIN_SCRIPT, target)
    return target
