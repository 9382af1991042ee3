"""The snapshot writer on its own: a real writer thread, a real TCPStore, a real tmpfs directory.

One rank (world 1) snapshots a changing state several times; checked after each snapshot:

* the published file parses (:mod:`ftrun.snapshot.format`) to exactly the captured bytes:
  the tensors were copied straight into the mapped file, at the offsets its header says,
  and the header's room (a manifest padded with spaces) ends on a page;
* its checksum is zlib's CRC-32 (ISA-L computes it: replicas and records from any node
  must agree on it);
* the directory holds two files of the rank, never more: the newest complete snapshot and
  the spare that the next capture copies into, which is the previous snapshot's file
  renamed (same inode: its pages are reused, not allocated again);
* a snapshot whose replication fails is marked failed, never counts, and its file turns
  back into the spare (no third file); the one kept stays the newest complete;
* a state that grows (a new tensor; a value whose JSON outgrows the header's room reserved
  at capture, so the writer moves the data) is written whole;
* ``stop`` ends the thread and removes the spare; the published file stays.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import torch

from ftrun.control.auth import Signer
from ftrun.control.store import JsonStore
from ftrun.control.tcpstore import serve_store
from ftrun.snapshot import format as fmt
from ftrun.snapshot import memory, records
from ftrun.snapshot.writer import SnapshotWriter, Where, complete

TIMEOUT_S = 30.0


def _state(step: int, grown: bool) -> dict[str, object]:
    state: dict[str, object] = {"w": torch.arange(3000, dtype=torch.float32) * step,
                                "ids": torch.full((7,), step, dtype=torch.int64),
                                "loader": {"seen": step}}
    if grown:
        state["m"] = torch.full((5, 5), float(step), dtype=torch.bfloat16)
    if step == 6:  # a value grows past the header's reserved room: the data is moved
        state["loader"] = {"seen": step, "recent": "x" * 6000}
    return state


def _files(directory: Path) -> dict[str, int]:
    """Name -> inode of every file in the directory."""
    return {p.name: p.stat().st_ino for p in directory.iterdir() if p.is_file()}


def test_the_writer_publishes_what_it_copied_and_holds_two_files(tmp_path: Path) -> None:
    host = serve_store(0, TIMEOUT_S)
    store = JsonStore(host, "ftrun/writer-test", signer=Signer(b"writer-test-token"))
    directory = tmp_path / "snap"
    directory.mkdir()
    fail_at = {4}

    def replicate(step: int, crc: int, keep: tuple[int, int] | None) -> records.Written:
        if step in fail_at:
            raise RuntimeError(f"buddy gone at step {step}")
        return records.Written(1, "", crc, 0, 1, True, "127.0.0.1:1")

    writer = SnapshotWriter(directory, store, Where(0, 0, 1, 0, "h1"), kept=None,
                            local_ranks=1, cap=None, timeout_s=TIMEOUT_S,
                            say=lambda text: None, replicate=replicate, server="")
    previous_inode = None
    try:
        for step in range(1, 8):
            state = _state(step, grown=step >= 5)
            tree, tensors = fmt.flatten(state)
            writer.capture(step, tree, tensors)
            assert writer.idle(TIMEOUT_S)
            files = _files(directory)
            spares = [n for n in files if n.endswith(".spare")]
            published = {n for n in files if memory.parse_name(n)}
            if step == 4:  # the replication failed: marked, never counts, nothing added
                assert isinstance(writer.error, RuntimeError), writer.error
                assert store.get_record(records.failed_key(0, 4)) is not None
                assert not complete(store, (0, 0, 4), None)
                assert writer.kept == (0, 0, 3) and published == {"g0-e0-s3-r0.snap"}, files
                assert len(spares) == 1 and len(files) == 2, files
                writer.error = None
                continue
            name = memory.file_name(0, 0, step, 0)
            assert published == {name}, files
            assert writer.kept == (0, 0, step) and complete(store, (0, 0, step), None)
            # Two files from the second snapshot on: the newest complete and the spare,
            # which is the previous one's file (its inode).
            if previous_inode is None:
                assert len(files) == 1, files
            else:
                assert len(files) == 2 and len(spares) == 1, files
                assert files[spares[0]] == previous_inode, (files, previous_inode)
            previous_inode = files[name]
            blob = (directory / name).read_bytes()
            snapshot = fmt.parse(blob)
            back = fmt.unflatten(snapshot, lambda shape, dims: None)
            assert back["loader"] == state["loader"]
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(back[key], value), (step, key)
            (length,) = struct.unpack("<Q", blob[len(fmt.MAGIC):len(fmt.MAGIC) + 8])
            start = len(fmt.MAGIC) + 8 + length
            assert start % fmt.HEADER_ALIGN == 0
            assert json.loads(blob[len(fmt.MAGIC) + 8:start])["crc32"] == \
                zlib.crc32(blob[start:]) == snapshot.crc32
            record = records.Written.from_json(
                store.get_record(records.local_key(0, step, 0)) or {})
            assert (record.crc32, record.size) == (snapshot.crc32, len(blob))
    finally:
        writer.stop()
    assert not writer._thread.is_alive()
    assert set(_files(directory)) == {"g0-e0-s7-r0.snap"}  # the spare went, the snapshot stays
    del host
