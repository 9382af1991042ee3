"""Taking a snapshot without making the training loop wait for it.

The training thread pays for one copy: each tensor's local bytes straight into the file the
snapshot will be, mapped into memory (``mmap`` of a file in the node's snapshot memory,
:mod:`ftrun.snapshot.memory`), at offsets fixed at capture time (the header's room is
reserved up front: :func:`ftrun.snapshot.format.data_start`, the last manifest's size and
1 KiB more). No staging buffer and no ``write``: the bytes land in tmpfs pages once, and
the manifest's JSON is left to the background thread (a manifest whose values outgrew the
room has its data moved to a bigger file there: slower, rare, never wrong). For GPU
tensors the copy is a device-to-host copy on a side stream into a pinned buffer, which the
background thread moves into the file (not run here: no GPU). The background thread then
checksums the mapped data (CRC-32, ISA-L), writes the header into the file's first page,
publishes the file by ``rename`` and writes phase 1 of the two-phase record
(:mod:`ftrun.snapshot.records`), overlapped with the next step's compute. On several
nodes it then has the node's agent copy the file to the buddy node
(:mod:`ftrun.snapshot.replica`) and writes phase 2 once the buddy verified it; a copy
that fails marks the snapshot failed (it never counts; no rank waits for it).

Bounded memory, per rank: after publishing snapshot ``s`` the thread waits until it is
complete on every rank (or failed, or ``timeout_s`` passed: then it is given up), then
turns this rank's older file into the *spare* that the next capture copies into (renamed
out of the published names first, so nobody takes it for a snapshot; its pages and its
mapping are reused: fresh tmpfs pages cost an allocation, zeroing and a fault each, about
as much CPU again as the copy). So a rank holds the newest complete snapshot and the one
being written, never more. A capture waits until the previous snapshot is settled; on a
healthy job it is, long before the next step ends (every rank published it before that
step's first collective could finish).

Timeouts: :meth:`SnapshotWriter.capture` waits at most ``timeout_s`` for the previous
snapshot to be settled, then raises :class:`SnapshotBusyError` (the caller skips this
snapshot; the last complete one stays); :meth:`SnapshotWriter.stop` waits at most
``timeout_s`` for the thread to end.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
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
_FIRST_LOOK_S = 0.001  # the shortest pause before a look at completion
_LONGEST_PAUSE_S = 0.02  # pauses double from the first up to this
_FAILED_EVERY = 4  # a look at the failed record every 4th look (each look is a request)
_SPARES = itertools.count()  # spare file names unique within the process
_SLACK = 1024  # room beyond the last manifest's for this one's values to grow into
WRITER_NICE = 10  # the background thread's nice value (Linux: per thread)

#: A snapshot as this rank holds it: (job generation, member epoch, step).
Held = tuple[int, int, int]
#: Sends this rank's published snapshot (step, CRC32, the snapshot it keeps) to the buddy
#: node and returns the replica's record, once the buddy verified it; raises
#: :class:`~ftrun.snapshot.replica.ReplicaError` (a RuntimeError) when it could not.
Replicate = Callable[[int, int, "Held | None"], records.Written]


class SnapshotBusyError(RuntimeError):
    """The previous snapshot is still being written or settled after ``timeout_s``."""


@dataclass(frozen=True)
class Where:
    """Who writes: the rank in its member epoch (of job generation ``generation``) and the
    node."""

    epoch: int
    rank: int
    world_size: int
    node: int
    host: str
    generation: int = 0


class _Target:
    """One file of this rank mapped (shared) into memory: the spare that the next capture
    copies into, or a published snapshot kept for reuse. :meth:`close` drops the tensor
    view before the mapping (a view of unmapped memory would crash the process)."""

    def __init__(self, path: Path, length: int) -> None:
        self.path = path
        self.length = length
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != length:
                os.ftruncate(fd, length)
            self.map: mmap.mmap | None = mmap.mmap(fd, length, mmap.MAP_SHARED,
                                                   mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view: torch.Tensor | None = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        self.view = None
        if self.map is not None:
            with contextlib.suppress(BufferError, ValueError):
                self.map.close()
            self.map = None


_FAILURES = (OSError, StoreError, RuntimeError, ValueError)


@dataclass
class _Job:
    step: int
    tree: Any
    meta: dict[str, Any]
    tensors_json: str
    prefix: str | None  # the manifest's JSON up to its checksum, when capture made it
    start: int  # where the data starts in the file
    size: int  # data bytes
    target: _Target
    pinned: torch.Tensor | None  # GPU: the data, copied to host, still to move in
    ready: Any  # a CUDA event, or None


def complete(store: JsonStore, held: Held, directory: Path | None) -> bool:
    """Whether snapshot ``held`` (generation, epoch, step; ``store`` scoped to that
    generation's prefix) holds every rank's phase 1, and phase 2 when it was taken on
    several nodes (its records say so); with ``directory`` and one node, also that each
    rank's file is there."""
    generation, epoch, step = held
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
    if not store.all_valid(keys):
        return False
    if directory is not None and not replicas:
        return all((directory / memory.file_name(generation, epoch, step, r)).exists()
                   for r in range(world))
    return True


class SnapshotWriter:
    """One rank's snapshots of one member epoch (see the module)."""

    def __init__(self, directory: Path, store: JsonStore, where: Where, *,
                 kept: Held | None, local_ranks: int,
                 cap: int | None, timeout_s: float,
                 say: Callable[[str], None],
                 replicate: Replicate | None = None, server: str = "") -> None:
        self.directory = directory
        self.store = store
        self.where = where
        self.kept = kept  # the newest complete snapshot this rank holds
        self.replicate = replicate  # None: one node, the local copy alone counts
        self.replicas = replicate is not None
        self.server = server
        self.local_ranks = local_ranks
        self.cap = cap
        self.timeout_s = timeout_s
        self.say = say
        self.published: list[Held] = []  # oldest first
        self.error: BaseException | None = None
        self._infos: fmt.InfoCache = {}
        self._entries: list[fmt.TensorEntry] | None = None
        self._entries_json = ""
        self._pinned: torch.Tensor | None = None
        self._stream: Any = None
        self._spare_path = directory / f".r{where.rank}.{os.getpid()}.{next(_SPARES)}.spare"
        self._spare: _Target | None = None  # owned by the thread holding _free
        self._maps: dict[Path, _Target] = {}  # this writer's published files, mapped
        self._free = threading.Event()
        self._free.set()
        self._stop = threading.Event()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._checked_size = -1
        self._settle_s = _FIRST_LOOK_S  # how long the last completion took to be seen
        self._prefix_len = -1  # the last manifest prefix's length (-1: make it in capture)
        self._thread = threading.Thread(target=self._run, name="ftrun-snapshot", daemon=True)
        self._thread.start()

    # --- the training thread ------------------------------------------------------------

    def capture(self, step: int, tree: Any, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` into the spare file and queue snapshot ``step`` (see the module
        for the wait)."""
        with torch.no_grad():  # DTensor.to_local without autograd: no graph node per tensor
            entries, locals_, size = fmt.layout(tensors, self._infos)
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
        if entries != self._entries:
            self._entries, self._entries_json = entries, fmt.entries_json(entries)
            self._prefix_len = -1
        where = self.where
        meta = {"epoch": where.epoch, "step": step, "rank": where.rank,
                "world_size": where.world_size, "host": where.host, "time": time.time()}
        prefix = None
        if self._prefix_len < 0:  # the first snapshot, or new tensors: the exact room
            prefix = fmt.manifest_prefix(tree, self._entries_json, meta=meta, data_bytes=size)
            self._prefix_len = len(prefix)
        # Else the room the last manifest needed and _SLACK more: the writer thread writes
        # the JSON (and moves the data, rarely, when the state's values outgrew it).
        start = fmt.data_start(prefix if prefix is not None
                               else " " * (self._prefix_len + _SLACK))
        target = self._spare_of(start + size)
        self._spare = None
        pinned, ready = None, None
        if any(t.is_cuda for t in locals_):
            pinned = self._pinned
            if pinned is None or pinned.numel() < size:
                pinned = self._pinned = torch.empty(max(size, 1), dtype=torch.uint8,
                                                    pin_memory=True)
            self._stream = self._stream or torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._copy(pinned, 0, entries, locals_, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._stream)
        else:
            assert target.view is not None
            self._copy(target.view, start, entries, locals_, non_blocking=False)
        self._free.clear()
        self._jobs.put(_Job(step, tree, meta, self._entries_json, prefix, start, size, target,
                            pinned, ready))

    def _spare_of(self, length: int) -> _Target:
        """The spare file mapped at ``length`` bytes (made, or resized, when it is not)."""
        spare = self._spare
        if spare is not None and spare.length == length:
            return spare
        if spare is not None:
            spare.close()
        self._spare = _Target(self._spare_path, length)
        return self._spare

    @staticmethod
    def _copy(into: torch.Tensor, start: int, entries: list[fmt.TensorEntry],
              locals_: list[torch.Tensor], *, non_blocking: bool) -> None:
        for entry, local in zip(entries, locals_, strict=True):
            if entry.nbytes:
                flat = local.reshape(-1).view(torch.uint8)
                at = start + entry.offset
                into[at:at + entry.nbytes].copy_(flat, non_blocking=non_blocking)

    def idle(self, timeout_s: float) -> bool:
        """Wait until the last captured snapshot is written and settled (or dropped)."""
        return self._free.wait(timeout_s)

    def stop(self, wait_s: float | None = None) -> None:
        """End the thread: a snapshot being written is finished, one queued behind it is
        dropped, a wait for completion is cut short. Waits at most ``wait_s`` (default
        ``timeout_s``) for the thread; one still inside a replication then finishes it
        alone (its records name its own member epoch: a later one never reads them as its
        own) and unmaps its files when it ends."""
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(self.timeout_s if wait_s is None else wait_s)

    # --- the background thread ----------------------------------------------------------

    def _run(self) -> None:
        # Below the training threads: on a busy node the copy waits for idle CPU (the
        # collectives' waits) instead of taking it from compute (best effort).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            while (job := self._jobs.get()) is not None:
                try:
                    if self._stop.is_set():  # dropped: its file is the spare again
                        self._spare = job.target
                        continue
                    try:
                        self._publish(job)
                    except _FAILURES as error:
                        self.error = error
                        self._unpublish(job)
                        with contextlib.suppress(*_FAILURES):
                            self.store.set_record(
                                records.failed_key(self.where.epoch, job.step),
                                {"rank": self.where.rank, "error": str(error)})
                        continue
                    try:
                        self._settle()
                    except _FAILURES as error:  # the snapshot stands; retired next time
                        self.error = error
                finally:
                    self._free.set()
        finally:
            self._close()

    def _publish(self, job: _Job) -> None:
        """Header, ``rename`` to the published name, phase 1 (and on several nodes the
        buddy's copy and phase 2)."""
        where = self.where
        if job.ready is not None and job.pinned is not None:
            job.ready.synchronize()
            assert job.target.view is not None
            job.target.view[job.start:job.start + job.size].copy_(job.pinned[:job.size])
        prefix = job.prefix or fmt.manifest_prefix(job.tree, job.tensors_json, meta=job.meta,
                                                   data_bytes=job.size)
        self._prefix_len = len(prefix)
        if fmt.data_start(prefix) > job.start:
            self._move(job, fmt.data_start(prefix))
        target = job.target
        assert target.map is not None
        with memoryview(target.map) as whole:
            crc = fmt.crc32(whole[job.start:job.start + job.size])
            whole[:job.start] = fmt.finish_header(prefix, crc, job.start)
        final = self.directory / memory.file_name(where.generation, where.epoch, job.step,
                                                  where.rank)
        os.rename(target.path, final)
        target.path = final
        self._maps[final] = target
        written = records.Written(where.node, where.host, crc, job.start + job.size,
                                  where.world_size, self.replicas, self.server)
        self.store.set_record(records.local_key(where.epoch, job.step, where.rank),
                              written.to_json())
        if self.replicate is not None:  # phase 2: only once the buddy verified its copy
            copy = self.replicate(job.step, crc, self.kept)
            self.store.set_record(records.replica_key(where.epoch, job.step, where.rank),
                                  copy.to_json())
        self.published.append((where.generation, where.epoch, job.step))
        del self.published[:-2]

    def _move(self, job: _Job, start: int) -> None:
        """The manifest outgrew the room reserved at capture (a state's values grew by
        more than :data:`_SLACK` bytes of JSON in one step): copy the data into a new file
        with room enough; the old one goes (the next capture makes a spare again)."""
        old = job.target
        assert old.view is not None
        moved = _Target(self.directory / f".r{self.where.rank}.{os.getpid()}."
                        f"{next(_SPARES)}.moved", start + job.size)
        assert moved.view is not None
        moved.view[start:start + job.size].copy_(old.view[job.start:job.start + job.size])
        old.close()
        with contextlib.suppress(OSError):
            old.path.unlink()
        job.target, job.start = moved, start

    def _unpublish(self, job: _Job) -> None:
        """After a failed write or replication: the job's file never counts; it becomes
        the spare again (or goes), so no third file is ever held."""
        target = job.target
        self._maps.pop(target.path, None)
        if self._spare is None and target.map is not None:
            with contextlib.suppress(OSError):
                if target.path != self._spare_path:
                    os.rename(target.path, self._spare_path)
                    target.path = self._spare_path
                self._spare = target
                return
        target.close()
        if target.path != self._spare_path:
            with contextlib.suppress(OSError):
                target.path.unlink()

    def _settle(self) -> None:
        """Wait until the snapshot just published is complete on every rank (it is then
        the one kept) or given up (a rank said it failed, or ``timeout_s`` passed), then
        retire this rank's other files: the first becomes the spare, the rest go."""
        if not self.published:
            return
        held = self.published[-1]
        done = self._await_complete(held[1], held[2])
        if done is None:  # stopped
            return
        if done:
            self.kept = held
        else:
            self.published.pop()
        rank = self.where.rank
        with contextlib.suppress(OSError):
            for entry in list(self.directory.iterdir()):
                parsed = memory.parse_name(entry.name)
                if parsed is not None and parsed[3] == rank and parsed[:3] != self.kept:
                    self._retire(entry)

    def _await_complete(self, epoch: int, step: int) -> bool | None:
        """True once every rank's records of (epoch, step) exist and verify; False when a
        rank said it failed or ``timeout_s`` passed; None when stopped first.

        Every look is a request the agent's store serves, so they are few: the first comes
        after about as long as the last completion took (the other ranks publish at a
        steady offset from this one), then pauses double; a look is one ``check`` (the
        failed record too at every :data:`_FAILED_EVERY`-th), and the records are read and
        verified once, when all exist. About three requests a snapshot on a healthy job."""
        world = self.where.world_size
        keys = [records.local_key(epoch, step, r) for r in range(world)]
        if self.replicas:
            keys += [records.replica_key(epoch, step, r) for r in range(world)]
        started = time.monotonic()
        deadline = started + self.timeout_s
        pause = min(max(self._settle_s, _FIRST_LOOK_S), _LONGEST_PAUSE_S)
        looks = 0
        while True:
            if self._stop.wait(pause):
                return None
            if self.store.exist_all(keys):
                break
            looks += 1
            pause = min(2 * pause, _LONGEST_PAUSE_S)
            if time.monotonic() > deadline or (looks % _FAILED_EVERY == 0 and self.store.
                                                get_record(records.failed_key(epoch, step))):
                return False
        self._settle_s = 0.8 * (time.monotonic() - started)  # a little early next time
        return self.store.all_valid(keys)

    def _retire(self, path: Path) -> None:
        target = self._maps.pop(path, None)
        if self._spare is None:
            try:
                os.rename(path, self._spare_path)
            except OSError:
                if target is not None:
                    target.close()
                return
            if target is not None:
                target.path = self._spare_path
                self._spare = target
            else:  # a file this writer did not write (restored from): map it now
                self._spare = _Target(self._spare_path, self._spare_path.stat().st_size
                                      or fmt.HEADER_ALIGN)
            return
        if target is not None:
            target.close()
        with contextlib.suppress(OSError):
            path.unlink()

    def _close(self) -> None:
        """Unmap every file; the spare goes (the published files stay: they are the
        job's state until the agent removes the directory)."""
        for target in self._maps.values():
            target.close()
        self._maps.clear()
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        with contextlib.suppress(OSError):
            self._spare_path.unlink()
