"""Buddy replication without a job: real replica servers, real sockets, a real TCPStore.

Two agents' :class:`~ftrun.snapshot.replica.ReplicaServer` run in this process, each on its
own directory (its node's memory). The tests show what the buddy promises: a copy is stored
only after it parsed and its CRC32 equals the published one; a request not signed with the
job token, a damaged or half-sent file and one past the memory cap are refused with one
line and leave nothing behind; a rank's replicas are bounded to the one being received and
the one its sender keeps; and, through two real snapshot writers on two "nodes", a
replication that fails (the buddy's agent gone) leaves that snapshot incomplete, marks it
failed so no rank waits for it, and the previous complete snapshot is the one a recovery
finds, with every rank's bytes as they were captured (nothing mixed). Each test takes well
under a second of its own.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ftrun.control.auth import Signer
from ftrun.control.store import JsonStore
from ftrun.control.tcpstore import serve_store
from ftrun.snapshot import format as fmt
from ftrun.snapshot import memory, records, replica
from ftrun.snapshot.writer import SnapshotWriter, Where, complete
from tests.test_sharded_format import _write as write_snapshot

TOKEN = b"replica-test-token"
RUN = "replica-run"
TIMEOUT_S = 10.0


def _file(state: dict[str, torch.Tensor]) -> tuple[bytes, int]:
    """A snapshot file's bytes (as a writer makes them) and its data CRC32."""
    blob = write_snapshot(state)
    return blob, fmt.parse(blob).crc32


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_file())


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[replica.ReplicaServer]]:
    servers = []
    for name in ("node0", "node1"):
        directory = tmp_path / name
        directory.mkdir()
        servers.append(replica.ReplicaServer(directory, RUN, Signer(TOKEN), "127.0.0.1"))
    yield servers
    for server in servers:
        server.close()


def _address(server: replica.ReplicaServer) -> tuple[str, int]:
    return ("127.0.0.1", server.port)


def _replicate(source: replica.ReplicaServer, buddy: replica.ReplicaServer, step: int,
               crc: int, keep: list[int] | None = None,
               signer: Signer | None = None) -> dict[str, object]:
    body = {"generation": 0, "epoch": 0, "step": step, "rank": 0, "to": f"127.0.0.1:{buddy.port}",
            "crc32": crc, "keep": keep, "timeout_s": int(TIMEOUT_S)}
    answer, _ = replica.request(_address(source), signer or Signer(TOKEN), RUN, "replicate",
                                body, timeout_s=TIMEOUT_S)
    return answer


def test_buddy_stores_only_verified_copies_bounded_and_refuses_bad_requests(
        nodes: list[replica.ReplicaServer]) -> None:
    node0, node1 = nodes
    blobs = {}
    for step in (1, 2, 3):
        blob, crc = _file({"w": torch.full((256,), float(step))})
        (node0.directory / memory.file_name(0, 0, step, 0)).write_bytes(blob)
        blobs[step] = (blob, crc)
    # Relayed agent to agent, verified, acknowledged with the CRC32 the buddy checked.
    answer = _replicate(node0, node1, 1, blobs[1][1])
    assert answer["crc32"] == blobs[1][1] and answer["bytes"] == len(blobs[1][0])
    stored = node1.replicas / memory.file_name(0, 0, 1, 0)
    assert stored.read_bytes() == blobs[1][0]
    # Bounded: per rank the one received and the one its sender keeps, never more.
    _replicate(node0, node1, 2, blobs[2][1], keep=[0, 0, 1])
    _replicate(node0, node1, 3, blobs[3][1], keep=[0, 0, 2])
    assert _leftovers(node1.replicas) == ["g0-e0-s2-r0.snap", "g0-e0-s3-r0.snap"]
    # Served back to a restoring worker of any node, byte for byte.
    got = replica.fetch(_address(node1), Signer(TOKEN), RUN, (0, 0, 3), 0, timeout_s=TIMEOUT_S)
    assert got == blobs[3][0]
    with pytest.raises(replica.ReplicaError, match=r"no snapshot g0-e0-s9-r0\.snap"):
        replica.fetch(_address(node1), Signer(TOKEN), RUN, (0, 0, 9), 0, timeout_s=TIMEOUT_S)
    before = _leftovers(node1.directory)
    # Not the job's token, or no token: refused, in one line, before anything is read.
    with pytest.raises(replica.ReplicaError, match="bad MAC"):
        _replicate(node0, node1, 1, blobs[1][1], signer=Signer(b"guess"))
    with pytest.raises(replica.ReplicaError, match="unsigned record"):
        replica.request(_address(node1), Signer(None), RUN, "put",
                        {"generation": 0, "epoch": 0, "step": 5, "rank": 0, "crc32": 1,
                         "keep": None},
                        blobs[1][0], timeout_s=TIMEOUT_S)
    # A MAC bound to another run's key does not verify here.
    with pytest.raises(replica.ReplicaError, match="bad MAC"):
        replica.fetch(_address(node1), Signer(TOKEN), "other-run", (0, 0, 3), 0,
                      timeout_s=TIMEOUT_S)
    # A copy whose CRC32 is not the published one, or whose bytes are damaged.
    put = {"generation": 0, "epoch": 0, "step": 5, "rank": 0, "crc32": blobs[1][1] ^ 1,
           "keep": None}
    with pytest.raises(replica.ReplicaError, match="is not the published"):
        replica.request(_address(node1), Signer(TOKEN), RUN, "put", put, blobs[1][0],
                        timeout_s=TIMEOUT_S)
    damaged = bytearray(blobs[1][0])
    damaged[-1] ^= 0xFF
    put["crc32"] = blobs[1][1]
    with pytest.raises(replica.ReplicaError, match="checksum mismatch"):
        replica.request(_address(node1), Signer(TOKEN), RUN, "put", put, damaged,
                        timeout_s=TIMEOUT_S)
    # A sender that dies mid-transfer (its node lost): nothing stored, no temporary file.
    with socket.create_connection(_address(node1), timeout=TIMEOUT_S) as sock:
        body = {**put, "op": "put", "size": len(blobs[1][0])}
        head = json.dumps(Signer(TOKEN).wrap(f"snapshot-replica/{RUN}/put", body)).encode()
        sock.sendall(struct.pack(">I", len(head)) + head + blobs[1][0][:100])
    # Garbage where a header belongs: an answer, not a crash of the server.
    with socket.create_connection(_address(node1), timeout=TIMEOUT_S) as sock:
        sock.sendall(struct.pack(">I", 10) + b"not json!!")
        assert sock.recv(4096), "no answer to a malformed header"
    # The server is still there, and the refused requests left nothing.
    assert replica.fetch(_address(node1), Signer(TOKEN), RUN, (0, 0, 3), 0,
                         timeout_s=TIMEOUT_S) == blobs[3][0]
    assert _leftovers(node1.directory) == before
    # The buddy's agent gone: the relay fails in one line naming the buddy's address.
    node1.close()
    with pytest.raises(replica.ReplicaError, match=f"put to 127.0.0.1:{node1.port}"):
        _replicate(node0, node1, 3, blobs[3][1])
    nodes.remove(node1)


def test_cap_refuses_a_replica_that_does_not_fit(tmp_path: Path) -> None:
    server = replica.ReplicaServer(tmp_path, RUN, Signer(TOKEN), "127.0.0.1", cap=1000)
    try:
        blob, crc = _file({"w": torch.zeros(1024)})
        with pytest.raises(replica.ReplicaError,
                           match=r"rank 0 step 1 \(\d+ bytes\).*more than the cap 1000 bytes"):
            replica.request(_address(server), Signer(TOKEN), RUN, "put",
                            {"generation": 0, "epoch": 0, "step": 1, "rank": 0, "crc32": crc,
                             "keep": None},
                            blob, timeout_s=TIMEOUT_S)
        assert _leftovers(tmp_path) == []
    finally:
        server.close()


def test_a_failed_replication_keeps_the_previous_complete_snapshot_and_mixes_nothing(
        nodes: list[replica.ReplicaServer]) -> None:
    """Rank 0 on node 0 and rank 1 on node 1 (buddies of each other), snapshotting through
    real writers: step 1 completes; for step 2 node 0's agent (rank 1's buddy) is gone
    mid-job, so rank 1's replica fails; step 2 never counts, no writer hangs on it, and
    step 1 is what a recovery finds, with each rank's copy and replica as captured."""
    host = serve_store(0, TIMEOUT_S)
    store = JsonStore(host, "ftrun/replica-test", signer=Signer(TOKEN))
    writers = []
    for rank, (own, buddy) in enumerate([(nodes[0], nodes[1]), (nodes[1], nodes[0])]):

        def replicate(step: int, crc: int, keep: tuple[int, int, int] | None, rank: int = rank,
                      own: replica.ReplicaServer = own,
                      buddy: replica.ReplicaServer = buddy) -> records.Written:
            body = {"generation": 0, "epoch": 0, "step": step, "rank": rank,
                    "to": f"127.0.0.1:{buddy.port}",
                    "crc32": crc, "keep": list(keep) if keep else None,
                    "timeout_s": int(TIMEOUT_S)}
            answer, _ = replica.request(_address(own), Signer(TOKEN), RUN, "replicate", body,
                                        timeout_s=TIMEOUT_S)
            return records.Written(1 - rank, "", crc, int(answer["bytes"]), 2, True,  # type: ignore[call-overload]
                                   f"127.0.0.1:{buddy.port}")

        said: list[str] = []
        writers.append(SnapshotWriter(
            own.directory, store, Where(0, rank, 2, rank, f"node{rank}"), kept=None,
            local_ranks=1, cap=None, timeout_s=TIMEOUT_S, say=said.append,
            replicate=replicate, server=f"127.0.0.1:{own.port}"))

    def capture(step: int) -> None:
        for rank, writer in enumerate(writers):
            tree, tensors = fmt.flatten({"w": torch.full((64,), 10.0 * step + rank)})
            writer.capture(step, tree, tensors)
        for writer in writers:
            assert writer.idle(TIMEOUT_S)

    try:
        capture(1)
        assert complete(store, (0, 0, 1), None)
        nodes[0].close()  # node 0's agent gone: rank 1's buddy (and rank 0's relay) too
        capture(2)
        assert not complete(store, (0, 0, 2), None)
        assert store.get_record(records.failed_key(0, 2)) is not None
        assert all(isinstance(w.error, replica.ReplicaError) for w in writers), \
            [w.error for w in writers]
        # No writer waits on step 2: step 3's capture goes through at once, and each rank
        # still keeps step 1 (the newest complete) for a recovery.
        capture(3)
        assert [w.kept for w in writers] == [(0, 0, 1), (0, 0, 1)]
        # What a recovery finds: step 1, every rank's bytes exactly as captured, from the
        # node that wrote them and from the buddy's replica alike.
        assert max(s for s in (1, 2, 3) if complete(store, (0, 0, s), None)) == 1
        for rank, (own, buddy) in enumerate([(nodes[0], nodes[1]), (nodes[1], nodes[0])]):
            name = memory.file_name(0, 0, 1, rank)
            for path in (own.directory / name, buddy.replicas / name):
                snapshot = fmt.parse(path.read_bytes())
                assert torch.equal(snapshot.tensors[0], torch.full((64,), 10.0 + rank)), path
    finally:
        for writer in writers:
            writer.stop()
        del host
