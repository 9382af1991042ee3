"""A worker's Python stack, read from outside, to say what a hung rank is doing.

The agent reads the main thread's stack of a worker that stopped using CPU with ``py-spy
dump`` (a well-kept sampling profiler that reads another process's memory through ptrace;
it needs no cooperation from the script and does not stop it for long). A stack tells two
kinds of idle rank apart:

* **waiting**: its innermost Python frame is inside torch's communication or autograd code
  (a collective, a barrier, DDP's backward waiting for its gradient all-reduce): it waits
  for a peer;
* **elsewhere**: its innermost frame is the script's own (a sleep, a lock, a read that never
  returns): if its peers wait, it is the one they wait for.

Error semantics: :func:`read_stack` never raises; it returns None when the stack cannot be
read (py-spy not installed, ptrace not allowed, the process gone, the read timed out), and
callers then decide without stacks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Frames in these parts of torch mean "waiting for a peer" when the process is idle.
_WAITING_IN = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/", "torch/cuda/")


@dataclass(frozen=True)
class Frame:
    function: str
    filename: str  # full path as the interpreter knows it
    short: str  # the path below its package or the script's name
    line: int

    @property
    def in_torch_wait(self) -> bool:
        return "/torch/" in self.filename and any(p in self.filename for p in _WAITING_IN)

    def __str__(self) -> str:
        return f"{self.short}:{self.line} {self.function}"


@dataclass(frozen=True)
class Stack:
    """One process's main-thread stack, innermost frame first."""

    pid: int
    frames: tuple[Frame, ...]

    @property
    def waiting(self) -> bool:
        """Idle inside torch's communication: waiting for a peer."""
        return bool(self.frames) and self.frames[0].in_torch_wait

    @property
    def forming_group(self) -> bool:
        """Still in ``init_process_group`` (waiting for peers that import torch)."""
        return any(f.function == "init_process_group" or "torch/distributed/rendezvous" in
                   f.filename for f in self.frames)

    @property
    def caller(self) -> Frame | None:
        """The innermost frame of the script's own code (outside torch)."""
        return next((f for f in self.frames if "/torch/" not in f.filename), None)

    @property
    def where(self) -> str:
        """One phrase: 'in train.py:95 main' or 'waiting in all_reduce (train.py:88 step)'."""
        if not self.frames:
            return "no Python frame"
        if self.waiting:
            caller = self.caller
            inner = self.frames[0]
            what = "backward" if "torch/autograd/" in inner.filename else inner.function
            return f"waiting in {what}" + (f" ({caller})" if caller else "")
        return f"in {self.frames[0]}"

    def text(self, limit: int = 12) -> str:
        """The stack as people read it: outermost call first."""
        lines = [f"  {f}" for f in reversed(self.frames[:limit])]
        return "\n".join(lines)


def py_spy() -> str | None:
    """The py-spy program beside this interpreter, or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def read_stack(pid: int, timeout_s: float = 5.0) -> Stack | None:
    """The main thread's stack of ``pid``, or None when it cannot be read."""
    program = py_spy()
    if program is None:
        return None
    try:
        out = subprocess.run([program, "dump", "--json", "--pid", str(pid)],
                             capture_output=True, text=True, timeout=timeout_s, check=False)
        threads = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return None
    if not isinstance(threads, list):
        return None
    main = next((t for t in threads if isinstance(t, dict) and t.get("os_thread_id") == pid),
                None) or next((t for t in threads if isinstance(t, dict)), None)
    if main is None or not isinstance(main.get("frames"), list):
        return None
    frames = tuple(
        Frame(str(f.get("name", "?")), str(f.get("filename", "?")),
              str(f.get("short_filename") or f.get("filename", "?")), int(f.get("line") or 0))
        for f in main["frames"] if isinstance(f, dict)
    )
    return Stack(pid, frames)
