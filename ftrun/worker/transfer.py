"""State transfer to joiners: the lowest-ranked survivor sends every registered object's
state over the new member epoch's group, so a replacement or a warm spare starts from the
job's state without a disk.

One broadcast of the length, one of the bytes (``torch.save``, read back with
``torch.load(weights_only=True)``, which accepts tensors and plain containers only). Apart
from :mod:`ftrun.worker.api` because it is the one place that serializes user state.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ftrun import protocol as P
from ftrun.worker.errors import RegroupError


def share_state(backend: dist.ProcessGroup, epoch: P.MemberEpoch, rank: int,
                state: Callable[[], dict[str, Any]],
                load: Callable[[dict[str, Any]], None]) -> None:
    """Send ``state()`` from the epoch's source rank to every member of ``backend``; a
    joiner passes what it receives to ``load``. Every member of the epoch calls it."""
    source = epoch.source_rank
    if source is None:
        raise RegroupError("a member epoch of joiners only has no state to start from")
    if rank == source:
        buffer = io.BytesIO()
        torch.save(state(), buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    _broadcast(backend, length, source)
    if rank != source:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    _broadcast(backend, payload, source)
    if epoch.members[rank].joiner:
        load(torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True))


def _broadcast(backend: dist.ProcessGroup, tensor: torch.Tensor, source: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = source
    options.rootTensor = 0
    backend.broadcast([tensor], options).wait()
