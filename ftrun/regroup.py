"""The agent's side of in-process regroup: keep the survivors, replace the failed.

When the workers use the worker API (:mod:`ftrun.worker`), a fault does not stop the job.
The supervisor owns a pool of member processes for one job attempt and publishes their
generations in the control store (:mod:`ftrun.protocol`):

* a member that exits non-zero or by a signal, that is stopped (SIGSTOP, a tracer), whose
  heartbeat stops (a wedged process), or that stops reporting steps while the others wait
  for it (its main thread sleeps) is a fault: the supervisor writes the generation's end
  *first* (so the survivors' failing collective is explained), kills the member, and
  publishes the next generation of survivors at once, topped up with warm spares;
* with ``--on-failure replace`` a new process is started; the survivors do not wait for it
  (importing torch takes seconds): it joins at a later step boundary, when it is ready, and
  receives the state from a survivor; with ``shrink`` the job continues with fewer ranks
  down to ``--min-workers``;
* scripts that never called ``ftrun.init()`` cannot regroup: with ``--recovery auto`` the
  supervisor then stops every worker and the agent restarts them (torchrun's behaviour).

Detection bounds (defaults): exit at once; SIGSTOP within one monitor interval (0.1 s);
a stopped heartbeat after ``--liveness-timeout`` (5 s, counted from the worker's
``ftrun.init()``: an import can starve a process for over a second on a busy node); a
stalled rank after max(``--stall-floor`` 5 s, 20 x the median step time). Progress is
(committed steps, collectives issued), reported by the worker's heartbeat thread: a member
is attributed a stall only when the others have reported more than it has; a hang
that every rank shares (inside one collective) is left to the collective timeout on gloo
and to the shim on NCCL.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftrun import protocol as P
from ftrun import workers as local
from ftrun.shim import ShimError, ShimTimeoutError
from ftrun.store import JsonStore, StoreError

if TYPE_CHECKING:
    from ftrun.agent import Agent, GenerationResult
    from ftrun.rendezvous import Generation


@dataclass
class Slot:
    """One member process and what the supervisor knows of it."""

    member: str
    process: local.WorkerProcess
    initial: bool
    heartbeat: int = 0
    native_liveness: int = -1
    heartbeat_at: float = field(default_factory=time.monotonic)
    progress: tuple[int, int] = (-1, -1)  # (committed steps, collectives issued)
    progress_at: float = field(default_factory=time.monotonic)
    step_at: float = field(default_factory=time.monotonic)
    ready: bool = False
    synced: bool = False
    finished: bool = False
    removed: str | None = None  # why the supervisor took it out


class RegroupSupervisor:
    """Runs one job attempt with in-process regroup; see the module docstring."""

    def __init__(self, agent: Agent, generation: Generation, store: JsonStore,
                 attempt: int) -> None:
        self.agent = agent
        self.config = agent.config
        self.generation = generation
        self.prefix = f"ftrun/{agent.run_id}/a{attempt}"
        self.store = JsonStore(store.raw, self.prefix)
        self.slots: dict[str, Slot] = {}
        self.latest: P.MemberGeneration | None = None
        self.ended: set[int] = set()
        self.next_member = 0
        self.step_intervals: deque[float] = deque(maxlen=64)
        self.failures: list[Any] = []
        self.first_failure: local.WorkerProcess | None = None
        self.target = self.config.nproc_per_node
        self.replacement_failures = 0
        self.finishing = False

    # --- lifecycle -----------------------------------------------------------------------

    def run(self) -> GenerationResult:
        from ftrun.agent import GenerationResult, Outcome

        initial = [self._spawn(initial=True) for _ in range(self.target)]
        for _ in range(self.config.spares):
            self._spawn(initial=False)
        self._publish([P.Member(s.member, rank, False) for rank, s in enumerate(initial)])
        try:
            while True:
                if self.agent.inbox.received is not None:
                    self._stop_all(self.agent.inbox.received, "signal")
                    return GenerationResult(Outcome.SIGNALED, self._exits())
                outcome = self._tick()
                if outcome is not None:
                    return GenerationResult(outcome, self._exits())
                procs = [s.process for s in self.slots.values() if s.removed is None]
                woke = local.wait_any(procs, self.config.monitor_interval_s,
                                      [self.agent.inbox.fd])
                if self.agent.inbox.fd in woke:
                    self.agent.inbox.drain()
        finally:
            local.join_pumps([s.process for s in self.slots.values()])

    def _tick(self) -> Any:
        from ftrun.agent import Outcome

        for slot in list(self.slots.values()):
            code = slot.process.poll()
            if code is None or slot.removed is not None or slot.finished:
                continue
            if code == 0 and self._is_active(slot):
                slot.finished = True
                self.finishing = True  # the job is done: no more joiners
                self.agent.events.emit("exit", member=slot.member, pid=slot.process.pid,
                                       returncode=0)
                continue
            cause = f"exit code {code}" if code > 0 else f"killed by {_signame(-code)}"
            if self._fail(slot, cause) is Outcome.FAILED:
                return Outcome.FAILED
        # Joiners still waiting for their first generation are not part of the finish.
        active = [s for s in self.slots.values() if self._is_active(s) and not self._waiting(s)]
        if active and all(s.finished for s in active):
            self._stop_all(signal.SIGTERM, "job finished")
            return Outcome.SUCCEEDED
        try:
            verdict = self._watch_liveness()
            if verdict is not None:
                return verdict
            self._admit_ready_joiners()
        except StoreError as error:
            self.agent.say(f"control store failed: {error}", style="red")
            self._stop_all(signal.SIGTERM, "store failed")
            return Outcome.FAILED
        return None

    # --- members -------------------------------------------------------------------------

    def _spawn(self, *, initial: bool) -> Slot:
        member = str(self.next_member)
        self.next_member += 1
        local_rank = int(member) if initial else self.target + (int(member) % 1000)
        extra = {
            "FTRUN_MEMBER_ID": member,
            "FTRUN_REGROUP_PREFIX": self.prefix,
            "FTRUN_INITIAL": "1" if initial else "0",
        }
        prefix = f"[rank{member}]:" if initial else f"[member{member}]:"
        process = self.agent.spawn_worker(
            self.generation, local_rank if initial else 0, extra_env=extra, prefix=prefix,
            log_name=str(local_rank) if initial else f"member_{member}",  # torchrun's layout
        )
        slot = Slot(member, process, initial)
        self.slots[member] = slot
        return slot

    def _waiting(self, slot: Slot) -> bool:
        """A joiner that has not received the job's state yet."""
        assert self.latest is not None
        member = next(m for m in self.latest.members if m.id == slot.member)
        return member.joiner and not slot.synced

    def _is_active(self, slot: Slot) -> bool:
        return (self.latest is not None and slot.removed is None
                and self.latest.rank_of(slot.member) is not None)

    def _publish(self, members: list[P.Member]) -> None:
        number = 0 if self.latest is None else self.latest.number + 1
        generation = P.MemberGeneration(number, tuple(members))
        self.store.set(P.generation_key(number), generation.to_json())
        self.store.set(P.LATEST, {"number": number})
        self.latest = generation
        now = time.monotonic()
        for slot in self.slots.values():  # a regroup is not a stall: count from here
            slot.progress_at = now
        self.agent.events.emit(
            "generation", generation=number, world_size=generation.world_size,
            members=[m.id for m in members], joiners=[m.id for m in members if m.joiner],
        )

    def _end(self, number: int, cause: dict[str, Any]) -> None:
        if number not in self.ended:
            self.ended.add(number)
            self.store.set_first(P.end_key(number), cause)

    def _fail(self, slot: Slot, cause: str, kill: bool = False) -> Any:
        """Take a failed member out and publish the next generation of survivors."""
        from ftrun.agent import Outcome

        detected = time.time()
        in_generation = self._is_active(slot)
        assert self.latest is not None
        if in_generation:
            self._end(self.latest.number, {"member": slot.member, "cause": cause})
        slot.removed = cause
        if kill:  # after the end is written: survivors that fail next find it explained
            slot.process.signal_group(signal.SIGKILL)
        if self.first_failure is None:
            self.first_failure = slot.process
        self.failures.append(slot)
        self.agent.events.emit(
            "failure", member=slot.member, pid=slot.process.pid, cause=cause,
            generation=self.latest.number, detected=detected,
            rank=self.latest.rank_of(slot.member), local_rank=slot.process.local_rank,
            returncode=slot.process.returncode,
        )
        label = (f"rank {self.latest.rank_of(slot.member)}" if in_generation
                 else f"member {slot.member}")
        if cause.startswith("frozen"):
            self.agent.say(f"{label} (pid {slot.process.pid}) was frozen; killed it at once",
                           style="yellow")
        else:
            self.agent.say(f"{label} (pid {slot.process.pid}) failed: {cause}", style="yellow")
        if not slot.ready:  # the cached flag may be a tick old: ask the store
            slot.ready = self.store.exists(P.status_key(slot.member))
        if not slot.ready and slot.initial and in_generation:
            self.agent.say("the failed worker never called ftrun.init(): restarting all")
            self._stop_all(signal.SIGTERM, "restart fallback")
            return Outcome.FAILED
        if not in_generation:
            self.replacement_failures += 1
            self._replace()
            return None
        survivors = [m for m in self.latest.members if m.id != slot.member
                     and self.slots[m.id].removed is None]
        if not any(not m.joiner or self.slots[m.id].synced for m in survivors):
            self.agent.say("no surviving member holds the job's state", style="red")
            self._stop_all(signal.SIGTERM, "no state left")
            return Outcome.FAILED
        self._replace()
        members = [P.Member(m.id, rank, not (not m.joiner or self.slots[m.id].synced))
                   for rank, m in enumerate(survivors)]
        members = self._top_up(members)
        if len(members) < self.config.min_workers:
            self.agent.say(
                f"{len(members)} workers left, fewer than --min-workers "
                f"{self.config.min_workers}", style="red")
            self._stop_all(signal.SIGTERM, "below minimum")
            return Outcome.FAILED
        self._abort_communicators(survivors, self.latest.number + 1)
        self._publish(members)
        return None

    def _abort_communicators(self, survivors: list[P.Member], generation: int) -> None:
        """Release survivors stuck in an NCCL collective with the failed member.

        Done before the next generation is published, so that no communicator of the new
        generation can be created under the old number and be aborted with the old ones.
        A shim that cannot finish in time means a worker wedged in NCCL: it is killed.
        """
        for member in survivors:
            slot = self.slots[member.id]
            shim = slot.process.shim
            if shim is None or slot.process.poll() is not None:
                continue
            try:
                report = shim.abort(generation, timeout_s=self.config.abort_timeout_s)
            except ShimTimeoutError:
                self.agent.say(f"member {member.id}: NCCL abort timed out; killing it")
                slot.process.signal_group(signal.SIGKILL)
                continue
            except ShimError:
                continue
            if report.entries:
                self.agent.events.emit("abort", member=member.id, generation=generation,
                                       report=report.to_dict())

    def _replace(self) -> None:
        if self.config.on_failure != "replace" or self.replacement_failures > 3:
            return
        self._spawn(initial=False)

    def _top_up(self, members: list[P.Member]) -> list[P.Member]:
        """Fill free ranks with ready, idle members (spares, replacements)."""
        idle = [s for s in self.slots.values() if s.removed is None and s.ready
                and not any(m.id == s.member for m in members) and not s.finished]
        for slot in idle:
            if len(members) >= self.target:
                break
            members.append(P.Member(slot.member, len(members), True))
        return members

    def _admit_ready_joiners(self) -> None:
        """A replacement that became ready joins at the survivors' next step boundary."""
        assert self.latest is not None
        if self.latest.world_size >= self.target or self.finishing:
            return
        before = self.latest.world_size
        members = self._top_up(list(self.latest.members))
        if len(members) == before:
            return
        self.store.set(P.join_key(self.latest.number), {"members": len(members)})
        self.agent.say(f"a new member is ready: it joins at the next step ({len(members)} ranks)")
        self._publish(members)

    # --- detection -----------------------------------------------------------------------

    def _watch_liveness(self) -> Any:
        live = [s for s in self.slots.values() if s.removed is None and not s.finished]
        if not live:
            return None
        now = time.monotonic()
        for slot in live:  # a member is ready once its status exists: one check each
            if not slot.ready and self.store.exists(P.status_key(slot.member)):
                slot.ready = True
                self.agent.events.emit("ready", member=slot.member, pid=slot.process.pid)
        ready = [s for s in live if s.ready]
        raw = self.store.raw.multi_get(
            [self.store.key(P.status_key(s.member)) for s in ready]) if ready else []
        for slot, value in zip(ready, raw, strict=True):
            status = P.Status.decode(value)
            if status is None:
                continue
            if status.beats != slot.heartbeat and slot.process.shim is None:
                slot.heartbeat, slot.heartbeat_at = status.beats, now
            reported = (status.steps, status.collectives)
            if reported != slot.progress:
                if slot.progress[0] >= 0 and reported[0] != slot.progress[0]:
                    self.step_intervals.append(now - slot.step_at)
                    slot.step_at = now
                slot.progress, slot.progress_at = reported, now
            slot.synced = slot.synced or status.synced
            if status.finished and self._is_active(slot):
                self.finishing = True  # a member left its loop: the job ends, admit no one
        for slot in live:
            shim = slot.process.shim
            if shim is not None:  # native: keeps counting while the GIL is held elsewhere
                with contextlib.suppress(ShimError, OSError, ValueError):
                    ticks = shim.liveness()
                    if ticks != slot.native_liveness:
                        slot.native_liveness, slot.heartbeat_at = ticks, now
        for slot in live:
            if slot.process.is_frozen():
                verdict = self._fail(slot, "frozen (stopped by a signal)", kill=True)
                if verdict is not None:
                    return verdict
            elif slot.ready and now - slot.heartbeat_at > self.config.liveness_timeout_s:
                verdict = self._fail(slot, "heartbeat lost", kill=True)
                if verdict is not None:
                    return verdict
        return self._watch_progress(now)

    def _watch_progress(self, now: float) -> Any:
        active = [s for s in self.slots.values() if self._is_active(s) and not s.finished
                  and not self._waiting(s) and s.progress[0] >= 0]
        if len(active) < 2 or not self.step_intervals or self.finishing:
            return None
        limit = max(self.config.stall_floor_s, 20 * statistics.median(self.step_intervals))
        if now - max(s.progress_at for s in active) < limit:
            return None
        lowest = min(s.progress for s in active)
        if lowest == max(s.progress for s in active):
            return None  # everyone waits at the same step: not attributable to one rank
        for slot in [s for s in active if s.progress == lowest]:
            verdict = self._fail(
                slot, f"stalled: no progress for {now - slot.progress_at:.1f}s "
                f"(limit {limit:.1f}s) while the others issued more collectives", kill=True)
            if verdict is not None:
                return verdict
        return None

    # --- endings -------------------------------------------------------------------------

    def _stop_all(self, sig: int, why: str) -> None:
        procs = [s.process for s in self.slots.values() if s.process.poll() is None]
        self.agent.stop_workers(procs, sig, why)
        local.reap_leftovers([s.process for s in self.slots.values()])

    def _exits(self) -> list[Any]:
        """Cause records in the agent's vocabulary: the error file's message for a worker
        that failed on its own, the supervisor's verdict for one it took out."""
        from ftrun.events import WorkerExit, read_error_file

        exits = []
        for slot in self.slots.values():
            proc = slot.process
            if proc.returncode is None:
                continue
            message, traceback = read_error_file(Path(proc.launch.env["TORCHELASTIC_ERROR_FILE"]))
            verdict = slot.removed if slot.removed and not slot.removed.startswith(
                ("exit code", "killed by")) else None
            exits.append(WorkerExit(
                rank=proc.rank, local_rank=proc.local_rank, node=self.agent.hostname,
                pid=proc.pid, generation=self.latest.number if self.latest else 0,
                returncode=proc.returncode, time=proc.ended or time.time(),
                stopped_by_agent=proc.stopped_by_agent, first=proc is self.first_failure,
                message=verdict or message, traceback=traceback,
            ))
        return exits


def _signame(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
