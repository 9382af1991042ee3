"""Taking a snapshot without making the training loop wait for it.

The training thread pays for one copy: each tensor's local bytes into a reusable staging
buffer (CPU memory; for GPU tensors a pinned buffer filled by a device-to-host copy on a
side stream). A background thread then checksums the buffer, writes the file into the
node's snapshot memory (:mod:`ftrun.snapshot.memory`), publishes it by ``rename`` and
writes phase 1 of the two-phase record (:mod:`ftrun.snapshot.records`), overlapped with
the next step's compute. On several nodes it then has the node's agent copy the file to
the buddy node (:mod:`ftrun.snapshot.replica`) and writes phase 2 once the buddy verified
it; a copy that fails marks the snapshot failed (it never counts; no rank waits for it).

Bounded memory, per rank: before writing snapshot ``s`` the thread waits until the
previous one it published is complete on every rank (or failed, or ``timeout_s`` passed:
then it is given up), then deletes this rank's older files; so a rank holds the newest
complete snapshot and the one being written, never more.
The staging buffer is one: a capture while the previous is still being written waits for
it (that wait is the loop's only other cost, and on a healthy job it is zero).

Timeouts: :meth:`SnapshotWriter.capture` waits at most ``timeout_s`` for the previous
snapshot to leave the staging buffer, then raises :class:`SnapshotBusyError` (the caller
skips this snapshot; the last complete one stays); :meth:`SnapshotWriter.stop` waits at
most ``timeout_s`` for the thread to end.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftrun.control.store import JsonStore, StoreError
from ftrun.snapshot import format as fmt
from ftrun.snapshot import memory, records

POLL_S = 0.005
WRITER_NICE = 10  # the background thread's nice value (Linux: per thread)

#: Sends this rank's published snapshot (step, CRC32, the (epoch, step) it keeps) to the
#: buddy node and returns the replica's record, once the buddy verified it; raises
#: :class:`~ftrun.snapshot.replica.ReplicaError` (a RuntimeError) when it could not.
Replicate = Callable[[int, int, "tuple[int, int] | None"], records.Written]


class SnapshotBusyError(RuntimeError):
    """The previous snapshot still holds the staging buffer after ``timeout_s``."""


@dataclass(frozen=True)
class Where:
    """Who writes: the rank in its member epoch and the node."""

    epoch: int
    rank: int
    world_size: int
    node: int
    host: str


@dataclass
class _Job:
    step: int
    tree: Any
    entries: list[fmt.TensorEntry]
    size: int
    ready: Any  # a CUDA event, or None


def complete(store: JsonStore, epoch: int, step: int, directory: Path | None) -> bool:
    """Whether snapshot (``epoch``, ``step``) holds every rank's phase 1, and phase 2 when
    it was taken on several nodes (its records say so); with ``directory`` and one node,
    also that each rank's file is there."""
    first = store.get_record(records.local_key(epoch, step, 0))
    if first is None:
        return False
    try:
        written = records.Written.from_json(first)
    except ValueError:
        return False
    world, replicas = written.world_size, written.replicas
    keys = [records.local_key(epoch, step, r) for r in range(world)]
    if replicas:
        keys += [records.replica_key(epoch, step, r) for r in range(world)]
    if not store.exist_all(keys):
        return False
    found = store.read_records(keys)
    if any(r is None for r in found):
        return False
    if directory is not None and not replicas:
        return all((directory / memory.file_name(epoch, step, r)).exists()
                   for r in range(world))
    return True


class SnapshotWriter:
    """One rank's snapshots of one member epoch (see the module)."""

    def __init__(self, directory: Path, store: JsonStore, where: Where, *,
                 kept: tuple[int, int] | None, local_ranks: int,
                 cap: int | None, timeout_s: float,
                 say: Callable[[str], None],
                 replicate: Replicate | None = None, server: str = "") -> None:
        self.directory = directory
        self.store = store
        self.where = where
        self.kept = kept  # (epoch, step) of the newest complete snapshot this rank holds
        self.replicate = replicate  # None: one node, the local copy alone counts
        self.replicas = replicate is not None
        self.server = server
        self.local_ranks = local_ranks
        self.cap = cap
        self.timeout_s = timeout_s
        self.say = say
        self.published: list[tuple[int, int]] = []  # (epoch, step), oldest first
        self.error: BaseException | None = None
        self._staging: torch.Tensor | None = None
        self._stream: Any = None
        self._free = threading.Event()
        self._free.set()
        self._stop = threading.Event()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._checked_size = -1
        self._recycled: Path | None = None  # an old file of this rank, to write over
        self._thread = threading.Thread(target=self._run, name="ftrun-snapshot", daemon=True)
        self._thread.start()

    # --- the training thread ------------------------------------------------------------

    def capture(self, step: int, tree: Any, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` out and queue snapshot ``step`` (see the module for the wait)."""
        entries, locals_, size = fmt.layout(tensors)
        if size != self._checked_size:  # the first, and when the state grows (optimizer)
            memory.check_capacity(self.directory, per_rank_bytes=size + 4096 + 512 * len(entries),
                                  local_ranks=self.local_ranks, rank=self.where.rank,
                                  node=self.where.host, cap=self.cap,
                                  replicas=self.replicas)
            self._checked_size = size
        if not self._free.wait(self.timeout_s):
            raise SnapshotBusyError(f"rank {self.where.rank}: the previous snapshot is still "
                                    f"being written after {self.timeout_s:g} s")
        if self.error is not None:
            error, self.error = self.error, None
            self.say(f"snapshot writer failed: {error}")
        on_gpu = any(t.is_cuda for t in locals_)
        staging = self._staging
        if staging is None or staging.numel() < size:
            staging = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=on_gpu)
            self._staging = staging
        ready = None
        if on_gpu:
            self._stream = self._stream or torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._copy(staging, entries, locals_, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._stream)
        else:
            self._copy(staging, entries, locals_, non_blocking=False)
        self._free.clear()
        self._jobs.put(_Job(step, tree, entries, size, ready))

    @staticmethod
    def _copy(staging: torch.Tensor, entries: list[fmt.TensorEntry],
              locals_: list[torch.Tensor], *, non_blocking: bool) -> None:
        for entry, local in zip(entries, locals_, strict=True):
            if entry.nbytes:
                flat = local.reshape(-1).view(torch.uint8)
                staging[entry.offset:entry.offset + entry.nbytes].copy_(
                    flat, non_blocking=non_blocking)

    def idle(self, timeout_s: float) -> bool:
        """Wait until the last captured snapshot is written (or dropped)."""
        return self._free.wait(timeout_s)

    def stop(self, wait_s: float | None = None) -> None:
        """End the thread: a snapshot being written is finished, one waiting for the
        previous to complete is dropped. Waits at most ``wait_s`` (default ``timeout_s``)
        for the thread; one still inside a replication then finishes it alone (its
        records name its own member epoch: a later one never reads them as its own)."""
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(self.timeout_s if wait_s is None else wait_s)
        if not self._thread.is_alive() and self._recycled is not None:
            with contextlib.suppress(OSError):
                self._recycled.unlink()
            self._recycled = None

    # --- the background thread ----------------------------------------------------------

    def _run(self) -> None:
        # Below the training threads: on a busy node the copy waits for idle CPU (the
        # collectives' waits) instead of taking it from compute (best effort).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self._wait_previous_complete():
                    self._write(job)
            except (OSError, StoreError, RuntimeError, ValueError) as error:
                self.error = error
                with contextlib.suppress(StoreError, RuntimeError, ValueError):
                    self.store.set_record(records.failed_key(self.where.epoch, job.step),
                                          {"rank": self.where.rank, "error": str(error)})
            finally:
                self._free.set()

    def _wait_previous_complete(self) -> bool:
        """Wait until the snapshot this rank published last is complete on every rank,
        then delete this rank's older files. False when stopped first. A snapshot that a
        rank said failed, or that is not complete within ``timeout_s``, is given up (the
        one kept stays the newest complete)."""
        if self.published:
            epoch, step = self.published[-1]
            deadline = time.monotonic() + self.timeout_s
            while not complete(self.store, epoch, step, None):
                if self._stop.wait(POLL_S):
                    return False
                if (self.store.get_record(records.failed_key(epoch, step)) is not None
                        or time.monotonic() > deadline):
                    self.published.pop()
                    break
            else:
                self.kept = (epoch, step)
        self._remove_old()
        return not self._stop.is_set()

    def _remove_old(self) -> None:
        """Delete this rank's files other than the kept one; the first is not deleted but
        renamed for :meth:`_write` to write the next snapshot over (its tmpfs pages are
        reused: a new file's pages cost the kernel an allocation and zeroing, about as
        much CPU again as the copy)."""
        rank = self.where.rank
        keep = {self.kept} if self.kept is not None else set()
        with contextlib.suppress(OSError):
            for entry in self.directory.iterdir():
                parsed = memory.parse_name(entry.name)
                if parsed is not None and parsed[2] == rank and parsed[:2] not in keep:
                    with contextlib.suppress(OSError):
                        if self._recycled is None:
                            recycled = self.directory / f".r{rank}.{os.getpid()}.recycled"
                            os.rename(entry, recycled)
                            self._recycled = recycled
                        else:
                            entry.unlink()

    def _write(self, job: _Job) -> None:
        where = self.where
        if job.ready is not None:
            job.ready.synchronize()
        assert self._staging is not None
        data = memoryview(self._staging.numpy()).cast("B")[:job.size]
        crc = fmt.crc32(data)
        meta = {"epoch": where.epoch, "step": job.step, "rank": where.rank,
                "world_size": where.world_size, "host": where.host, "time": time.time()}
        head = fmt.header(fmt.manifest(job.tree, job.entries, meta=meta, data_bytes=job.size,
                                       crc32=crc))
        name = memory.file_name(where.epoch, job.step, where.rank)
        tmp = self.directory / f".{name}.{os.getpid()}.tmp"
        recycled, self._recycled = self._recycled, None
        if recycled is not None:
            os.rename(recycled, tmp)
        with open(tmp, "r+b" if recycled is not None else "wb") as out:
            out.write(head)
            out.write(data)
            out.truncate()
        os.rename(tmp, self.directory / name)
        written = records.Written(where.node, where.host, crc, len(head) + job.size,
                                  where.world_size, self.replicas, self.server)
        self.store.set_record(records.local_key(where.epoch, job.step, where.rank),
                              written.to_json())
        if self.replicate is not None:  # phase 2: only once the buddy verified its copy
            copy = self.replicate(job.step, crc, self.kept)
            self.store.set_record(records.replica_key(where.epoch, job.step, where.rank),
                                  copy.to_json())
        self.published.append((where.epoch, job.step))
        del self.published[:-2]
