"""ftrun's exit codes, one table for the CLI, the man page and scripts that call ftrun.

Shell scripts and Slurm requeue logic read these, so they never change meaning:

====  =========================================================================
0     every worker finished successfully
1     a worker failed and no restart was left (the summary names the first failure)
2     bad usage: an invalid flag or value; nothing was started
3     the rendezvous or the store failed (join timeout, store host lost)
4     a crash loop: the same rank failed with the same error --max-repeats times in a
      row (or every rank at once), the script's own bug; ftrun stopped absorbing it
70    an internal error in ftrun itself (the traceback is saved to a file it names)
128+N ftrun was stopped by signal N, which it forwarded to the workers first
====  =========================================================================
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from enum import IntEnum
from typing import NoReturn


class ExitCode(IntEnum):
    SUCCESS = 0
    WORKER_FAILED = 1
    USAGE = 2
    RENDEZVOUS_FAILED = 3
    CRASH_LOOP = 4
    INTERNAL_ERROR = 70  # EX_SOFTWARE


def for_signal(signum: int) -> int:
    """The shell's convention for a process ended by a signal."""
    return 128 + int(signal.Signals(signum))


def exit_at_once(code: int) -> NoReturn:
    """End the process with ``code`` now, without interpreter teardown: for a process that
    may still have a thread inside torch (a store client's heartbeat, end watch, or a connect
    given up on) or in a blocking call. Such a thread taking the GIL back while the
    interpreter finalizes aborts the process ("terminate called without an active
    exception", -6 instead of the documented code). What was printed is flushed first (a
    stream the program closed is skipped)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
