"""The agent: one per node (or ``srun`` task), it runs the job for its local workers.

:func:`run_agent` is the whole entry point. The package is layered; each module depends only
on those above it in this list:

* :mod:`~ftrun.agent.outcome`: how a generation ended, its cause records (what is said
  about a job, events, fault records, metrics and the summary, is :mod:`ftrun.observe`'s);
* :mod:`~ftrun.agent.processes`: spawning, signalling and reaping local processes;
* :mod:`~ftrun.agent.regroup` and its leader: the in-process recovery supervisor;
* :mod:`~ftrun.agent.loop`: the outer loop (connect, join a generation, run a supervisor,
  then finish, restart or give up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftrun.agent.loop import run_agent

__all__ = ["run_agent"]


def __getattr__(name: str) -> Any:
    # Lazy: the loop imports torch (~2 s of CPU). ``ftrun --preload`` starts its fork server
    # from ftrun.agent.forkserver before that, so that both imports run at once.
    if name == "run_agent":
        from ftrun.agent.loop import run_agent

        return run_agent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
