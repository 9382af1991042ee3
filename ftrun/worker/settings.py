"""The worker's own knobs: each environment variable it reads beyond :mod:`ftrun.protocol`.

ftrun's variables written by the agent are read through
:class:`ftrun.protocol.WorkerEnv` alone; the few here are set by people (or tests), never by
the agent, so they are named once, here, with their defaults and the reason for each.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Seconds between two status records of a member's heartbeat thread (tests shorten it).
HEARTBEAT_ENV = "FTRUN_WORKER_HEARTBEAT_S"
HEARTBEAT_DEFAULT_S = 0.2

#: ``regroup_timeout_s`` for a script that does not pass it to :func:`ftrun.init`.
REGROUP_TIMEOUT_ENV = "FTRUN_REGROUP_TIMEOUT_S"
#: The least default bound of a regroup wait. Besides ftrun's own latencies (see
#: :func:`regroup_timeout_s`), a step's decision waits for the slowest member's work after
#: its last collective (logging, metrics): user code, which ten minutes leaves room for.
REGROUP_TIMEOUT_FLOOR_S = 600.0


def _seconds(environ: Mapping[str, str], name: str) -> float | None:
    text = environ.get(name)
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={text!r} must be positive")
    return value


def heartbeat_s(environ: Mapping[str, str] = os.environ) -> float:
    return _seconds(environ, HEARTBEAT_ENV) or HEARTBEAT_DEFAULT_S


def regroup_timeout_s(chosen: float | None, *, collective_timeout_s: float,
                      fault_grace_s: float, environ: Mapping[str, str] = os.environ) -> float:
    """The bound of each regroup wait: ``chosen`` (``init``'s argument), else the
    environment's, else the default.

    The default is the larger of :data:`REGROUP_TIMEOUT_FLOOR_S` and twice the collective
    timeout plus the fault grace: after a fault the slowest survivor may sit in the failed
    collective for a whole collective timeout, then take up to the grace to see the end,
    before it arrives in the next member epoch; the agent publishes that epoch within its
    own abort and heartbeat timeouts (seconds). Twice the collective timeout covers the
    straggler with as much again to spare, so a healthy job, however slow, never sees it.
    """
    if chosen is not None:
        if not chosen > 0:
            raise ValueError(f"regroup_timeout_s={chosen!r} must be positive")
        return float(chosen)
    from_env = _seconds(environ, REGROUP_TIMEOUT_ENV)
    if from_env is not None:
        return from_env
    return max(REGROUP_TIMEOUT_FLOOR_S, 2 * collective_timeout_s + fault_grace_s)
