"""The snapshot file and the node's snapshot memory, without a job (milliseconds each).

The file is read back from bytes other processes could write: these tests show a damaged or
forged file is refused with one line, and that what is written comes back exactly (dtypes,
0-dim tensors, int dict keys, tuples, non-finite floats, a DTensor's placements).
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftrun.snapshot import format as fmt
from ftrun.snapshot import memory


def _write(state: object) -> bytes:
    tree, tensors = fmt.flatten(state)
    entries, locals_, size = fmt.layout(tensors)
    data = bytearray(size)
    for entry, local in zip(entries, locals_, strict=True):
        data[entry.offset:entry.offset + entry.nbytes] = \
            local.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    view = memoryview(bytes(data))
    head = fmt.header(fmt.manifest(tree, entries, meta={"step": 3}, data_bytes=size,
                                   crc32=fmt.crc32(view)))
    return head + bytes(view)


def _no_mesh(shape: tuple[int, ...], dims: tuple[str, ...] | None) -> None:
    raise AssertionError("no DTensor expected")


def test_round_trip_is_exact() -> None:
    state = {
        "w": torch.randn(5, 3),
        "half": torch.randn(4, dtype=torch.bfloat16),
        "step": torch.tensor(7.0),  # 0-dim, like Adam's step
        "mask": torch.tensor([True, False]),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, 1:],  # not contiguous
        "state": {0: {"lr": 0.1, "betas": (0.9, 0.999), "none": None, "big": math.inf}},
        "names": ["a", "b"],
    }
    snapshot = fmt.parse(_write(state))
    back = fmt.unflatten(snapshot, _no_mesh)
    assert snapshot.meta == {"step": 3}
    for key in ("w", "half", "step", "mask", "ids"):
        assert back[key].dtype == state[key].dtype
        assert torch.equal(back[key], state[key]), key
    assert back["state"] == {0: {"lr": 0.1, "betas": (0.9, 0.999), "none": None,
                                 "big": math.inf}}
    assert isinstance(next(iter(back["state"])), int)  # int keys stay ints (optimizer state)
    assert back["names"] == ["a", "b"]


def test_a_leaf_that_is_not_state_is_named_by_its_path() -> None:
    with pytest.raises(fmt.SnapshotValueError, match=r"state\['loader'\]\[2\] is a "
                                                     r"builtins.set"):
        fmt.flatten({"loader": [1, 2, {3}]})
    with pytest.raises(fmt.SnapshotValueError, match=r"has a key \(1, 2\) of type tuple"):
        fmt.flatten({(1, 2): 3})


def test_damage_is_refused_in_one_line() -> None:
    blob = bytearray(_write({"w": torch.ones(64)}))
    blob[-1] ^= 0xFF
    with pytest.raises(fmt.SnapshotFormatError, match="checksum mismatch"):
        fmt.parse(bytes(blob))
    with pytest.raises(fmt.SnapshotFormatError, match="bad magic"):
        fmt.parse(b"PICKLE\x80" + bytes(blob))
    with pytest.raises(fmt.SnapshotFormatError, match="data is"):
        fmt.parse(bytes(blob[:-8]))


def test_a_forged_manifest_is_refused() -> None:
    good = _write({"w": torch.ones(4)})
    start = len(fmt.MAGIC) + 8
    (length,) = struct.unpack("<Q", good[len(fmt.MAGIC):start])
    body = json.loads(good[start:start + length])
    data = good[start + length:]
    cases = [
        ("tensors", [{**body["tensors"][0], "dtype": "object"}], "unknown dtype"),
        ("tensors", [{**body["tensors"][0], "nbytes": 1 << 40}], "byte range"),
        ("tree", {"pickle": "x"}, "unknown tree node"),
        ("tree", {"tensor": 5}, "out of range"),
    ]
    for field, value, message in cases:
        forged = json.dumps({**body, field: value}).encode()
        with pytest.raises(fmt.SnapshotFormatError, match=message):
            fmt.parse(fmt.header(forged) + data)


def test_dtensor_keeps_its_placements(tmp_path: Path) -> None:
    """A DTensor on a 1-rank mesh (a real gloo group in this process) comes back as a
    DTensor with the same placements, global shape and local bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        value = distribute_tensor(torch.randn(6, 2), mesh, [Shard(0)])
        snapshot = fmt.parse(_write({"p": value}))
        back = fmt.unflatten(snapshot, lambda shape, dims: mesh)["p"]
        assert isinstance(back, DTensor)
        assert back.placements == (Shard(0),)
        assert back.shape == value.shape
        assert torch.equal(back.to_local(), value.to_local())
    finally:
        dist.destroy_process_group()


def test_capacity_says_the_sizes(tmp_path: Path) -> None:
    with pytest.raises(memory.SnapshotMemoryError,
                       match=r"rank 2 on h1: snapshots need 4000 bytes \(4 local ranks x 2 x "
                             r"500 bytes\), more than the cap 3000 bytes"):
        memory.check_capacity(tmp_path, per_rank_bytes=500, local_ranks=4, rank=2,
                              node="h1", cap=3000)
    free = memory.free_bytes(tmp_path)
    with pytest.raises(memory.SnapshotMemoryError, match="bytes free"):
        memory.check_capacity(tmp_path, per_rank_bytes=free, local_ranks=1, rank=0,
                              node="h1", cap=None)
    memory.check_capacity(tmp_path, per_rank_bytes=1, local_ranks=4, rank=0, node="h1",
                          cap=None)


def test_stale_directories_of_dead_agents_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / memory.node_dir_name("run", "h1", int(dead.stdout))
    live = tmp_path / memory.node_dir_name("run", "h1", os.getpid())
    other = tmp_path / "unrelated-1"
    for path in (stale, live, other):
        path.mkdir()
    assert memory.remove_stale(tmp_path) == [stale]
    assert live.exists() and other.exists() and not stale.exists()
    made = memory.create("run/x", "h 1", tmp_path)
    assert made.stat().st_mode & 0o777 == 0o700
    assert made.name == f"ftrun-snap-run_x-h_1-{os.getpid()}"
