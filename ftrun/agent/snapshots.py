"""The agent's part of sharded recovery: owning the node's snapshot memory.

Workers of ``ftrun.restartable`` write their snapshots into one tmpfs directory per agent
(:mod:`ftrun.snapshot.memory`); the agent creates it before it starts any worker, gives its
path to every worker (``FTRUN_SNAPSHOT_DIR``), and removes it when it exits, so the memory
outlives any worker but not the job. Directories left by an agent that was killed
(SIGKILL: no clean-up) are removed by the next agent that starts on the node, once their
owner's pid is dead. Why the agent and not a worker: a worker that dies must not take its
shard with it, and a replacement must find it.

Not built yet: serving a lost node's shards from a buddy node (snapshots are kept on one
node; a sharded job spanning several nodes is refused by the worker API with one line).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from ftrun.snapshot import memory


class NodeSnapshots:
    """This agent's snapshot directory: created at start, removed at exit."""

    def __init__(self, run_id: str, host: str, root: Path = memory.ROOT) -> None:
        self.path: Path | None = None
        self.error: str | None = None
        memory.remove_stale(root)
        try:
            self.path = memory.create(run_id, host, root)
        except OSError as error:  # no /dev/shm: sharded recovery is unavailable, say why
            self.error = f"cannot create the snapshot memory in {root}: {error}"

    def env(self) -> dict[str, str]:
        """What the workers get: the directory's path (nothing when it could not be made)."""
        return {memory.ENV: str(self.path)} if self.path is not None else {}

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
