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
import ipaddress
import shutil
import socket
from pathlib import Path

from ftrun.control.auth import Signer, TokenError, load_secret
from ftrun.host.hostnet import local_bind_address, store_bind_address
from ftrun.snapshot import memory, replica


def _bind_address(name: str, local_addr: str | None) -> str:
    """Where the replica server listens ("": every interface); see :class:`NodeSnapshots`."""
    address = store_bind_address(single_node=False, rdzv_host=name, local_addr=local_addr)
    if address is not None and ":" in address:
        ipv4 = local_bind_address(name, socket.AF_INET)
        if ipv4 is not None and not ipaddress.ip_address(ipv4).is_loopback:
            return ipv4
    return address or ""


class NodeSnapshots:
    """This agent's snapshot directory (created at start, removed at exit) and, with
    ``serve``, the replica server; ``warning``: what to tell the user at start, or None.

    The server is reached by ``advertise`` (``--local-addr``; else ``host``, the host name)
    and listens on the address that name resolves to here, as the stores do
    (``ftrun.host.hostnet.store_bind_address``), its IPv4 address when it has both (the server
    listened on IPv4 only before, and a peer's connect falls back from an IPv6 address to
    an IPv4 one, not the other way); on every interface only when that name is loopback
    here or not this node's (a Debian ``127.0.1.1 hostname`` line: the others resolve it
    to another address), which the warning says."""

    def __init__(self, run_id: str, host: str, root: Path = memory.ROOT, *,
                 serve: bool = False, advertise: str | None = None) -> None:
        self.path: Path | None = None
        self.warning: str | None = None
        self.server: replica.ReplicaServer | None = None
        self.run_id = run_id
        self._advertise = advertise or host
        memory.remove_stale(root)
        try:
            self.path = memory.create(run_id, host, root)
        except OSError as error:  # no /dev/shm: sharded recovery is unavailable, say why
            self.warning = f"cannot create the snapshot memory in {root}: {error}"
            return
        if not serve:
            return
        serve_on = _bind_address(self._advertise, advertise)
        if not serve_on:
            self.warning = (f"snapshot replicas are served on every interface: "
                            f"{self._advertise!r} is not an address of this node other nodes "
                            "can reach (set --local-addr to listen on that one only)")
        try:
            self.server = replica.ReplicaServer(self.path, run_id, Signer(load_secret()),
                                                serve_on, cap=memory.cap_bytes())
        except (OSError, TokenError, memory.SnapshotMemoryError) as error:
            self.warning = f"cannot serve snapshot replicas on {serve_on or '*'}: {error}"

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
