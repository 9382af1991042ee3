"""CPU burners for benchmarks and the soak: the machine busy, as a user's would be.

    with Burners(2):           # two processes spinning at the default priority
        run_the_benchmark()

Bugs that hide on an idle machine show on a loaded one: the convergence issue's stuck rank
showed only with every core busy. Each burner is a child process that spins in Python; all
of them are killed (SIGKILL) and reaped when the block ends, also on an exception, so none
is left behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from types import TracebackType


def _spin() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        pass


class Burners:
    """``count`` spinning processes while the block runs (0: none)."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError("the number of burners cannot be negative")
        self.count = count
        self._procs: list[multiprocessing.process.BaseProcess] = []

    def __enter__(self) -> Burners:
        context = multiprocessing.get_context("fork")
        for _ in range(self.count):
            proc = context.Process(target=_spin, daemon=True, name="cpu-burner")
            proc.start()
            self._procs.append(proc)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for proc in self._procs:
            if proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            proc.join(5)
        self._procs.clear()
