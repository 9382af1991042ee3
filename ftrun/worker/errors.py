"""The errors the worker API raises to a training script.

A leaf module (nothing of the worker imports into it) so that every part of the worker can
raise them without an import cycle; :mod:`ftrun.worker.api` and the package re-export them.
"""

from __future__ import annotations


class RegroupError(RuntimeError):
    """The job could not form a working member epoch; the worker gives up.

    The worker process is meant to exit on it: its agent then treats the exit as this
    member's failure (the job goes on without it, or stops when too few are left).
    """


class RegroupTimeoutError(RegroupError):
    """A wait of the regroup protocol outlasted ``regroup_timeout_s`` (see :func:`ftrun.init`).

    ``member`` is this worker's member id, ``epoch`` the member epoch it was in (or, waiting
    for the next one, the last one it was in; -1 before the first), ``waited_for`` what it
    waited for, in words, with the members it still lacked where that is known.
    """

    def __init__(self, member: str, epoch: int, waited_for: str, timeout_s: float) -> None:
        where = f"member epoch {epoch}" if epoch >= 0 else "no member epoch yet"
        super().__init__(
            f"member {member} ({where}): waited {timeout_s:g} s for {waited_for}; giving up "
            "(regroup_timeout_s of ftrun.init bounds this wait)"
        )
        self.member = member
        self.epoch = epoch
        self.waited_for = waited_for
        self.timeout_s = timeout_s
