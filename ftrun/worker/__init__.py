"""The worker API that training scripts use: ``ft = ftrun.init(); ft.run_step(...)``.

What it absorbs and what it raises, and each of its timeouts, are written down in
:mod:`ftrun.worker.api`. The package, one concept a module:

* :mod:`ftrun.worker.api`: :func:`init`, :class:`FaultTolerance` (a step, a regroup) and
  the public error types;
* :mod:`ftrun.worker.group`: :class:`ResilientProcessGroup`, the process group whose
  backend each member epoch swaps, and the backends;
* :mod:`ftrun.worker.membership`: the worker's side of :mod:`ftrun.protocol` (following
  member epochs, arrivals and ``formed``, the commit vote, the heartbeat thread);
* :mod:`ftrun.worker.transfer`: the job's state sent to joiners;
* :mod:`ftrun.worker.restartable`: :func:`restartable`, in-process re-entry of a sharded
  training function from in-memory snapshots (:mod:`ftrun.snapshot`);
* :mod:`ftrun.worker.errors` and :mod:`ftrun.worker.settings`: the errors raised, and the
  environment knobs that are not the agent's (the agent's are in :mod:`ftrun.protocol`).

The worker imports nothing of the agent's side but the contract (:mod:`ftrun.protocol`)
and the control store (:mod:`ftrun.control`).
"""

from __future__ import annotations

from ftrun.worker.api import FaultTolerance, Stateful, init
from ftrun.worker.errors import RegroupError, RegroupTimeoutError
from ftrun.worker.group import ResilientProcessGroup
from ftrun.worker.restartable import EpochEnded, Session, restartable

__all__ = [
    "EpochEnded",
    "FaultTolerance",
    "RegroupError",
    "RegroupTimeoutError",
    "ResilientProcessGroup",
    "Session",
    "Stateful",
    "init",
    "restartable",
]
