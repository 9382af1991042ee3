"""The agent's part of sharded recovery: owning the node's snapshot memory and serving it.

Workers of ``ftrun.restartable`` write their snapshots into one tmpfs directory per agent
(:mod:`ftrun.snapshot.memory`); the agent creates it before it starts any worker, gives its
path to every worker (``FTRUN_SNAPSHOT_DIR``), and removes it when it exits, so the memory
outlives any worker but not the job. Directories left by an agent that was killed
(SIGKILL: no clean-up) are removed by the next agent that starts on the node, once their
owner's pid is dead. Why the agent and not a worker: a worker that dies must not take its
shard with it, and a replacement must find it.

On several nodes the agent also runs the node's :class:`~ftrun.snapshot.replica.
ReplicaServer` (agent-to-agent buddy replication, authenticated with the job token), whose
address its workers get in ``FTRUN_SNAPSHOT_SERVER``: it sends its workers' snapshots to
the buddy node, keeps the buddy's in ``replicas/`` of the same directory, and serves either
to a restoring worker. It stops, and the directory goes, on every exit path the agent
survives.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from ftrun.control.auth import Signer, TokenError, load_secret
from ftrun.hostnet import store_bind_address
from ftrun.snapshot import memory, replica


class NodeSnapshots:
    """This agent's snapshot directory (created at start, removed at exit) and, with
    ``serve``, the replica server. It is reached by ``advertise`` (``--local-addr``; else
    ``host``, the host name) and listens on the address that name resolves to here, as the
    stores do (``ftrun.hostnet.store_bind_address``): on every interface only when that is
    loopback or not an address of this node (a Debian ``127.0.1.1 hostname`` line: the
    others resolve the name to another address)."""

    def __init__(self, run_id: str, host: str, root: Path = memory.ROOT, *,
                 serve: bool = False, advertise: str | None = None) -> None:
        self.path: Path | None = None
        self.error: str | None = None
        self.server: replica.ReplicaServer | None = None
        self.run_id = run_id
        self._advertise = advertise or host
        memory.remove_stale(root)
        try:
            self.path = memory.create(run_id, host, root)
        except OSError as error:  # no /dev/shm: sharded recovery is unavailable, say why
            self.error = f"cannot create the snapshot memory in {root}: {error}"
            return
        if not serve:
            return
        serve_on = store_bind_address(single_node=False, rdzv_host=self._advertise,
                                      local_addr=advertise) or ""
        try:
            self.server = replica.ReplicaServer(self.path, run_id, Signer(load_secret()),
                                                serve_on, cap=memory.cap_bytes())
        except (OSError, TokenError, memory.SnapshotMemoryError) as error:
            self.error = f"cannot serve snapshot replicas on {serve_on or '*'}: {error}"

    def env(self) -> dict[str, str]:
        """What the workers get: the directory's path (nothing when it could not be made)
        and the replica server's address (when serving)."""
        env = {memory.ENV: str(self.path)} if self.path is not None else {}
        if self.server is not None:
            env[replica.ENV] = f"{self._advertise}:{self.server.port}"
            env[replica.RUN_ENV] = self.run_id
        return env

    def close(self) -> None:
        if self.server is not None:
            with contextlib.suppress(OSError):
                self.server.close()
            self.server = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
