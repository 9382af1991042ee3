"""Build and drive the shim's native test programs (tests/test_shim*.py, scripts/bench_shim.py).

Everything is compiled from the source tree with `cc` into a caller-given directory:
  shim/libftrun_shim.so, shim-asan/libftrun_shim.so         the shim, plain and ASan
  nccl-{new,old}[-asan]/libnccl.so.2                        the NCCL test double builds
  worker_main[-asan], libscenario[-asan].so                 the test worker (see worker_main.c)
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
HERE = Path(__file__).resolve().parent
CFLAGS = ["-O2", "-g", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fPIC"]
ASAN = ["-fsanitize=address", "-fno-omit-frame-pointer"]


def have_cc() -> bool:
    return shutil.which("cc") is not None


def _cc(args: list[str]) -> None:
    proc = subprocess.run(["cc", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cc {' '.join(args)} failed:\n{proc.stderr}")


@dataclass(frozen=True)
class Build:
    """One flavour of the native test programs (plain or ASan)."""

    root: Path
    asan: bool

    @property
    def shim(self) -> Path:
        return self.root / ("shim-asan" if self.asan else "shim") / "libftrun_shim.so"

    def nccl_dir(self, revoke: bool = True) -> Path:
        return self.root / (("nccl-new" if revoke else "nccl-old") + ("-asan" if self.asan else ""))

    @property
    def worker(self) -> Path:
        return self.root / ("worker_main-asan" if self.asan else "worker_main")

    @property
    def scenario(self) -> Path:
        return self.root / ("libscenario-asan.so" if self.asan else "libscenario.so")

    def preload(self) -> list[str]:
        """LD_PRELOAD entries needed before the shim: the ASan runtime must come first."""
        if not self.asan:
            return []
        out = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
        return [str(Path(out).resolve())]


def build_all(root: Path, asan: bool) -> Build:
    b = Build(root, asan)
    flags = CFLAGS + (ASAN if asan else [])
    b.shim.parent.mkdir(parents=True, exist_ok=True)
    _cc([*flags, "-fvisibility=hidden", "-shared", "-o", str(b.shim), str(CSRC / "ftshim.c"),
         "-ldl", "-lpthread"])  # fmt: skip
    for revoke in (True, False):
        d = b.nccl_dir(revoke)
        d.mkdir(parents=True, exist_ok=True)
        _cc([*flags, *([] if revoke else ["-DFAKE_OLD"]), "-fvisibility=hidden", "-shared",
             "-Wl,-soname,libnccl.so.2", "-o", str(d / "libnccl.so.2"),
             str(CSRC / "fake_nccl" / "fake_nccl.c"), "-lpthread"])  # fmt: skip
    _cc([*flags, "-shared", f"-I{CSRC}", "-o", str(b.scenario), str(HERE / "scenario.c"),
         f"-L{b.nccl_dir(True)}", "-l:libnccl.so.2", "-ldl"])  # fmt: skip
    _cc([*flags, "-o", str(b.worker), str(HERE / "worker_main.c"), "-ldl"])
    return b


class Proc:
    """A test process whose stdout is read line by line with deadlines."""

    def __init__(self, argv: list[str], env: dict[str, str], *, stdin: bool = False) -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            start_new_session=True,  # kill() reaches what it forks (a wrapper shell's worker)
        )  # fmt: skip
        self.pid = self.popen.pid
        self.lines: list[str] = []
        self._buf = b""
        self._eof = False
        assert self.popen.stdout is not None
        self._fd = self.popen.stdout.fileno()

    def _next_line(self, deadline: float) -> str | None:
        """Raw reads (no Python buffering, which would hide lines from select)."""
        while b"\n" not in self._buf:
            if self._eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            with selectors.DefaultSelector() as sel:
                sel.register(self._fd, selectors.EVENT_READ)
                if not sel.select(timeout=min(left, 0.2)):
                    continue
            chunk = os.read(self._fd, 65536)
            if not chunk:
                self._eof = True
                if self._buf:
                    self._buf += b"\n"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def expect(self, word: str, timeout: float = 10.0) -> list[str]:
        """Wait for the next line starting with `word`; return its fields after the word."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._next_line(deadline)
            except TimeoutError:
                raise AssertionError(f"no {word!r} within {timeout} s; got {self.lines}") from None
            if line is None:
                self.popen.wait(timeout=10)
                raise AssertionError(
                    f"EOF before {word!r}; got {self.lines}; rc {self.popen.returncode}; "
                    f"stderr: {self.stderr()}"
                )
            self.lines.append(line)
            if line.startswith(word):
                return line.split()[1:]

    def send(self, text: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(text.encode())
        self.popen.stdin.flush()

    def wait(self, timeout: float = 10.0) -> int:
        return self.popen.wait(timeout=timeout)

    def stderr(self) -> str:
        if self.popen.poll() is None:
            return "(running)"
        assert self.popen.stderr is not None
        return self.popen.stderr.read().decode(errors="replace")

    def finish(self, timeout: float = 10.0) -> tuple[int, str, str]:
        """Wait for exit; return (status, remaining stdout, stderr)."""
        out, err = self.popen.communicate(timeout=timeout)
        text = (self._buf + out).decode(errors="replace")
        self._buf = b""
        self.lines.extend(text.splitlines())
        return self.popen.returncode, text, err.decode(errors="replace")

    def kill(self) -> None:
        """Kill the process and everything it started (its own process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)
        for f in (self.popen.stdout, self.popen.stderr, self.popen.stdin):
            if f:
                f.close()


def wait_until(cond, timeout: float, what: str, interval: float = 0.001):
    """Poll cond() until it returns something truthy, or fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def worker_env(build: Build, base: dict[str, str], *, revoke: bool = True,
               extra: Iterable[tuple[str, str]] = ()) -> dict[str, str]:  # fmt: skip
    """Environment for a worker that loads the NCCL test double (no shim yet)."""
    env = {k: v for k, v in base.items() if not k.startswith(("FTRUN_SHIM", "FAKE_NCCL"))}
    env.pop("LD_PRELOAD", None)
    env["LD_LIBRARY_PATH"] = str(build.nccl_dir(revoke))
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:exitcode=66"
    env.update(dict(extra))
    if build.asan:
        env["LD_PRELOAD"] = ":".join(build.preload())
    return env


def bench_once(build: Build, mode: str, iters: int) -> tuple[float, float]:
    """(ns per ncclCommCount, ns per all-reduce launch) of one bench run.

    mode: "direct" (no shim), "inert" (preloaded, no control page), "active" (attached)."""
    from ftrun.shim import ShimControl

    env = worker_env(build, dict(os.environ))
    ctl = None
    if mode == "inert":
        env["LD_PRELOAD"] = str(build.shim)
    elif mode == "active":
        ctl = ShimControl(label="bench", library=build.shim)
        env = ctl.worker_env(env)
    try:
        p = Proc([str(build.worker), str(build.scenario), "bench", str(iters)], env)
        if ctl is not None:
            ctl.bind(p.pid)
        try:
            count_ns, coll_ns, status = p.expect("BENCH", timeout=300)
            rc, _, err = p.finish()
        finally:
            p.kill()
        if rc != 0:
            raise RuntimeError(f"bench worker failed ({rc}): {err}")
        want = {"direct": "-1", "inert": "0", "active": "2"}[mode]
        if status != want:
            raise RuntimeError(f"{mode}: shim status {status}, expected {want}")
        return float(count_ns), float(coll_ns)
    finally:
        if ctl is not None:
            ctl.close()


def cc_version() -> str:
    return subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.split("\n")[0]


__all__ = ["CSRC", "REPO", "Build", "Proc", "bench_once", "build_all", "cc_version", "have_cc",
           "wait_until", "worker_env"]  # fmt: skip

os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=0")
