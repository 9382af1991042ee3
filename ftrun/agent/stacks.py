"""A worker's Python stack, read from outside, to say what a hung rank is doing.

The agent reads the main thread's stack of a worker that stopped using CPU with ``py-spy
dump`` (a well-kept sampling profiler that reads another process's memory through ptrace;
it needs no cooperation from the script and does not stop it for long). A stack tells two
kinds of idle rank apart:

* **waiting**: its innermost Python frame is inside torch's communication or autograd code
  (a collective, a barrier, DDP's backward waiting for its gradient all-reduce): it waits
  for a peer;
* **elsewhere**: its innermost frame is the script's own (a sleep, a lock, a read that never
  returns): if its peers wait, it is the one they wait for. Among these, a rank whose
  innermost frame is Python's own network I/O (``socket``, ``ssl``, ``selectors``,
  ``asyncio``, ``http.client``: a read from object storage, a metrics server, a remote
  data service) **awaits a reply from another host**: the hang rules give it longer, since
  such a reply is late more often than it never comes.

Where py-spy cannot attach (not installed; not root, without CAP_SYS_PTRACE, under Yama's
``ptrace_scope`` >= 1 as on Ubuntu, where a process may trace only its own descendants and
the agent's py-spy is not an ancestor of the workers), the agent starts workers with
``PYTHONFAULTHANDLER=1`` instead: it decides a hang without stacks (after three timeouts),
then aborts the hung workers with SIGABRT, on which Python's fault handler writes every
thread's stack to stderr, and reads the main thread's stack from there
(:func:`stack_from_fault_dump`) to name the culprit after the fact. ``FTRUN_STACKS=py-spy``
or ``faulthandler`` overrides the choice (:func:`stack_source`).

Error semantics: :func:`read_stack` and :func:`stack_from_fault_dump` never raise; they
return None when the stack cannot be read (py-spy not installed, ptrace not allowed, the
process gone, the read timed out, no dump in the output), and callers then decide without
stacks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

STACKS_ENV = "FTRUN_STACKS"
_CAP_SYS_PTRACE = 1 << 19

# Frames in these parts of torch mean "waiting for a peer" when the process is idle. An idle
# process whose innermost frame is a C++ operator's call (torch/_ops.py) blocks inside it: a
# functional collective's wait (DTensor's redistributions: tensor parallelism), not its own
# code (it would use CPU).
_WAITING_IN = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/", "torch/cuda/",
               "torch/_ops.py")
# ... and in the worker API's protocol waits (the next member epoch, the other members'
# arrival, a step's decision): a member there waits for its peers, it does not hang.
_PROTOCOL_WAIT = "/ftrun/worker/"
# Python's network I/O: an idle frame here waits for a reply from another host (C-level
# reads such as ``socket.recv`` show the caller's frame instead: they count as its own code).
_NETWORK_IO = ("/socket.py", "/ssl.py", "/selectors.py", "/http/client.py")
# ... unless it is a local wait that multiplexes pipes the same way: a data loader's worker
# queue (multiprocessing's connection.wait selects), a child process (subprocess), a pool;
# looked for only in the chain of such library frames around the innermost one (a script's
# main under torch's elastic ``record`` decorator has torch/.../multiprocessing/ outside it).
_LOCAL_WAIT = ("/multiprocessing/", "/subprocess.py", "/concurrent/futures/")


@dataclass(frozen=True)
class Frame:
    function: str
    filename: str  # full path as the interpreter knows it
    short: str  # the path below its package or the script's name
    line: int

    @property
    def in_torch_wait(self) -> bool:
        return ("/torch/" in self.filename and any(p in self.filename for p in _WAITING_IN)) \
            or _PROTOCOL_WAIT in self.filename

    @property
    def in_network_io(self) -> bool:
        return self.filename.endswith(_NETWORK_IO) or "/asyncio/" in self.filename

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
    def awaits_network(self) -> bool:
        """Idle in Python's network I/O, outside torch: waiting for another host's reply
        (not a pipe to a local process: a data loader's queue, a child's output)."""
        if not self.frames or not self.frames[0].in_network_io:
            return False
        for frame in self.frames:
            if any(part in frame.filename for part in _LOCAL_WAIT):
                return False
            if not frame.in_network_io:
                return True  # the caller of the I/O library: no local pipe underneath
        return True

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
        if self.awaits_network:
            caller = next((f for f in self.frames if not f.in_network_io), None)
            return f"awaiting the network in {self.frames[0]}" + (f" ({caller})" if caller
                                                                  else "")
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


def ptrace_permitted() -> bool:
    """Can this process attach to a sibling of the same user (py-spy reading a worker)?"""
    if os.geteuid() == 0:
        return True
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:") and int(line.split()[1], 16) & _CAP_SYS_PTRACE:
                return True
    except (OSError, ValueError, IndexError):
        pass
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return True  # no Yama: a process may trace others of its user
    return scope == 0  # 1: descendants only; 2: admin only; 3: nobody


def stack_source() -> str:
    """How this host reads a hung worker's stack: "py-spy" or "faulthandler" (see the module
    docstring); ``FTRUN_STACKS`` overrides, any other value of it is ignored."""
    chosen = os.environ.get(STACKS_ENV, "")
    if chosen in ("py-spy", "faulthandler"):
        return chosen
    return "py-spy" if py_spy() is not None and ptrace_permitted() else "faulthandler"


_THREAD_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*most recent call first")
_DUMP_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<fn>.+)$')
_PREFIX = re.compile(r"^(\[(?:rank|default)\d+\]: ?)+")


def _short(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return os.path.basename(path)


def stack_from_fault_dump(pid: int, lines: list[str]) -> Stack | None:
    """The main thread's stack from the last dump Python's fault handler wrote in ``lines``
    (a worker's stderr): the thread whose outermost frame is not a ``threading`` thread's
    bootstrap; None when the lines hold no dump."""
    threads: list[list[Frame]] = []
    for raw in lines:
        line = _PREFIX.sub("", raw.rstrip("\n"))
        if line.startswith("Fatal Python error"):
            threads = []  # a later dump replaces an earlier one
        elif _THREAD_HEADER.match(line):
            threads.append([])
        elif threads and (m := _DUMP_FRAME.match(line)):
            threads[-1].append(Frame(m["fn"], m["file"], _short(m["file"]), int(m["line"])))
    main = [t for t in threads if t and not t[-1].filename.endswith("threading.py")]
    if not main:
        return None
    chosen = next((t for t in main if any(f.function == "<module>" for f in t)), main[0])
    return Stack(pid, tuple(chosen))
