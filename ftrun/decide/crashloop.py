"""The same error right after a recovery is the script's own bug, not a fault to absorb.

A fault-tolerant launcher that absorbs every failure turns a bug (an exception at step 10,
every time) into a job that never ends: replace, replay to step 10, fail, replace... or
``--max-restarts`` full restarts before it gives up. :class:`CrashLoop` tells such a
failure from a fault, from the failures the agents see:

* **repeat**: the same rank fails with the same error (:func:`signature`: the exception's
  type and message, or the exit status) at the same step (within one: the agents' view of
  a rank's steps lags a beat; unknown steps match) ``limit`` times in a row
  (``--max-repeats``, default 2: the first is absorbed, the second stops the job). The same
  error at a later step, after training went past the last one, starts a new count;
* **everyone**: every rank of the world fails with the same error at the same step (in the
  same member epoch or job generation; a script without the worker API reports no steps:
  the same generation): the script's, on its first occurrence.

Failures that say nothing of the script are not counted and break no run: a worker
killed from outside (SIGKILL, SIGTERM, ...), or taken out by ftrun (frozen, hung,
stalled, heartbeat lost), or failing inside ftrun's own regroup waits. The verdict ends
the job with :data:`ftrun.exitcodes.ExitCode.CRASH_LOOP` and one line naming the rank and
the error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Signals a worker's own code raises (a crash), as opposed to one sent from outside.
CRASH_SIGNALS = ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL")
#: Errors of ftrun's own worker API (its bounded waits): a recovery's trouble, not the
#: script's; the recovery deadline escalates those.
OWN_ERRORS = re.compile(r"^(ftrun\.[\w.]*)?(RegroupError|RegroupTimeoutError)\b")
DEFAULT_REPEATS = 2


def signature(cause: str, message: str | None) -> str | None:
    """What a failure says of itself, or None when it says nothing of the script.

    ``cause``: how the process ended, as the agent describes it ('exit code 1', 'killed by
    SIGSEGV', or ftrun's verdict such as 'stalled: ...'); ``message``: the error the script
    left (its error file, or its traceback's last line), if any.
    """
    if message:
        text = message.strip().splitlines()[0].strip() if message.strip() else ""
        if text and not OWN_ERRORS.match(text):
            return text[:300]
        if text:
            return None
    if cause.startswith("exit code ") and cause != "exit code 0":
        return cause
    if cause.startswith("killed by ") and cause.removeprefix("killed by ") in CRASH_SIGNALS:
        return cause
    return None


@dataclass(frozen=True)
class Failure:
    """One worker's failure as its agent saw it."""

    rank: int | None  # its rank when it failed (None: it held none, e.g. a spare)
    signature: str | None  # :func:`signature`
    step: int | None = None  # committed steps when it failed, if known
    world: int | None = None  # the world size it failed in, if known
    epoch: int | None = None  # the member epoch (or job generation) it failed in


@dataclass(frozen=True)
class Verdict:
    rank: int | None
    signature: str
    count: int  # occurrences in a row (the world size for 'everyone')
    everyone: bool

    def describe(self) -> str:
        if self.everyone:
            return (f"every rank ({self.count}) failed with the same error at the same step: "
                    f"{self.signature!r}: the script's own error, not a fault")
        return (f"rank {self.rank} failed {self.count} times in a row with the same error: "
                f"{self.signature!r}: a crash loop (the script's own error), not a fault")


class CrashLoop:
    """Failures seen so far; :meth:`observe` each (see the module)."""

    def __init__(self, limit: int = DEFAULT_REPEATS) -> None:
        if limit < 1:
            raise ValueError("the crash-loop limit is at least 1")
        self.limit = limit
        # rank -> (signature, step, times in a row)
        self._last: dict[int, tuple[str, int | None, int]] = {}
        # (epoch, step, signature) -> ranks that failed so
        self._together: dict[tuple[int | None, int | None, str], set[int]] = {}

    def observe(self, failure: Failure) -> Verdict | None:
        sig, rank = failure.signature, failure.rank
        if sig is None or rank is None:
            return None
        last = self._last.get(rank)
        again = last is not None and last[0] == sig and (
            last[1] is None or failure.step is None or abs(failure.step - last[1]) <= 1)
        count = last[2] + 1 if again and last is not None else 1
        self._last[rank] = (sig, failure.step, count)
        if failure.world is not None and failure.world > 1 and failure.epoch is not None:
            ranks = self._together.setdefault((failure.epoch, failure.step, sig), set())
            ranks.add(rank)
            if len(ranks) >= failure.world:
                return Verdict(None, sig, failure.world, everyone=True)
        if count >= self.limit:
            return Verdict(rank, sig, count, everyone=False)
        return None
