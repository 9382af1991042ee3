"""What the training scripts print, as typed records, and the invariants of a regroup.

The tests learn what happened inside a job from the lines its workers print
(``scripts/train_ddp.py``, ``scripts/train_elastic.py``, ``tests/scripts/*.py``). Those
formats are read here and nowhere else in the tests, so a format change breaks one parser
(and its test, tests/test_lines.py), not a dozen scattered regexes that would silently stop
matching and let a check pass on nothing. The benchmarks in scripts/ read the same lines
with their own copies: the formats themselves must not change.

A line reaches a test as the agent forwards it, ``[rank2]: step=...`` for a worker started
with the job or ``[member0.3]: ...`` for one that joined a regroup later; the label is kept
in :attr:`Line.source` because after a regroup it no longer equals the ``rank=`` field.
Unprefixed lines (torchrun's, log files) are read too. Only a whole line in one of the known
formats becomes a record: a fragment quoted inside another line (an agent's report) is not
a second step, which would look like a step applied twice.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from itertools import pairwise
from typing import ClassVar, TypeVar

_PREFIX = re.compile(r"\[([^\]\s]+)\]: ")  # the agent's (or torchrun's) label


@dataclass(frozen=True)
class Line:
    """Where a record was read: enough for a failure message to point at the line.

    Each subclass is one kind of line; its ``FORMAT`` is the script's f-string with the
    fields as placeholders, so the format, the fields and their types are written once.
    """

    FORMAT: ClassVar[str] = ""
    source: str | None  # the agent's label, "rank2" or "member0.3"; None if unprefixed
    origin: str  # which output it came from ("" for one job; a node's name, ...)
    index: int  # 0-based line number within that output
    text: str  # the whole line as printed

    def where(self) -> str:
        """``node h1, line 41: [rank2]: step=...``, for assertion messages."""
        place = f"{self.origin}, line {self.index}" if self.origin else f"line {self.index}"
        return f"{place}: {self.text}"


@dataclass(frozen=True)
class Step(Line):
    """A committed step of train_ddp.py (t: wall clock, for recovery times)."""

    FORMAT: ClassVar[str] = "step={step} loss={loss} rank={rank} pid={pid} t={t}"
    step: int
    loss: float
    rank: int
    pid: int
    t: float


@dataclass(frozen=True)
class ElasticStep(Step):
    """A committed step of train_elastic.py, with the generation and world size the step was
    computed in (epoch is -1 outside regroup); a :class:`Step` to code that waits for steps."""

    FORMAT: ClassVar[str] = Step.FORMAT + " epoch={epoch} world={world}"
    epoch: int
    world: int


@dataclass(frozen=True)
class Regroup(Line):
    """train_elastic.py's ``on_regroup`` callback. ``step`` is the last committed step;
    ``checksum`` stays text as printed: equal parameters print equal text, and that is what
    the invariants compare."""

    FORMAT: ClassVar[str] = "regroup epoch={epoch} rank={rank} world={world} step={step} " \
                            "checksum={checksum}"
    epoch: int
    rank: int
    world: int
    step: int
    checksum: str


@dataclass(frozen=True)
class Done(Line):
    """The last line of both training scripts: the final parameters, as text (see
    :class:`Regroup`)."""

    FORMAT: ClassVar[str] = "done rank={rank} steps={steps} param_sum={param_sum}"
    rank: int
    steps: int
    param_sum: str


@dataclass(frozen=True)
class Resumed(Line):
    """A worker loaded a checkpoint, at this step."""

    FORMAT: ClassVar[str] = "resumed step={step} rank={rank}"
    step: int
    rank: int


@dataclass(frozen=True)
class Start(Line):
    """train_ddp.py's first line: which restart of the job this process belongs to."""

    FORMAT: ClassVar[str] = "start rank={rank} world={world} restart={restart} pid={pid}"
    rank: int
    world: int
    restart: int
    pid: int


@dataclass(frozen=True)
class Finished(Line):
    """tests/scripts/nccl_survivor.py's last line: where the survivor ended."""

    FORMAT: ClassVar[str] = "finished generation={generation} world={world} step={step}"
    generation: int
    world: int
    step: int


@dataclass(frozen=True)
class Victim(Line):
    """nccl_survivor.py: the rank that will hang, to be killed by the test."""

    FORMAT: ClassVar[str] = "victim pid={pid}"
    pid: int


@dataclass(frozen=True)
class Blocking(Line):
    """nccl_survivor.py: a survivor entering the NCCL collective it must be released from."""

    FORMAT: ClassVar[str] = "blocking in ncclAllReduce pid={pid}"
    pid: int


@dataclass(frozen=True)
class Released(Line):
    """nccl_survivor.py: the collective returned (code 0 would be a result taken as valid)."""

    FORMAT: ClassVar[str] = "released code={code} after={after}"
    code: int
    after: float


@dataclass(frozen=True)
class Decision(Line):
    """tests/scripts/die_before_vote.py: the decision a member followed on the step its
    victim dies in, and the members whose valid votes it found in the store then (``-``:
    none). ``step`` is the step's index (``ft.step`` while it is computed), so a committed
    one prints ``step=`` one higher on its :class:`Step` line."""

    FORMAT: ClassVar[str] = "decision epoch={epoch} step={step} value={value} " \
                            "voters={voters} pid={pid}"
    epoch: int
    step: int
    value: str
    voters: str
    pid: int

    @property
    def voter_ids(self) -> set[str]:
        return set() if self.voters == "-" else set(self.voters.split(","))


@dataclass(frozen=True)
class Restored(Line):
    """scripts/train_fsdp.py under ``ftrun.restartable``: member epoch ``epoch`` restored,
    as ``rank``, the snapshot of step ``step`` taken in member epoch ``taken_in``."""

    FORMAT: ClassVar[str] = "restored step={step} rank={rank} epoch={epoch} from={taken_in}"
    step: int
    rank: int
    epoch: int
    taken_in: int


@dataclass(frozen=True)
class RestoredAfterRestart(Restored):
    """The same, in a restarted job generation: the snapshot was taken in member epoch
    ``taken_in`` of the earlier job generation ``generation`` (the escalation ladder's
    restart restores it)."""

    FORMAT: ClassVar[str] = Restored.FORMAT + " from_generation={generation}"
    generation: int


KINDS: tuple[type[Line], ...] = (
    Step, ElasticStep, Regroup, Done, Resumed, Start, Finished, Victim, Blocking, Released,
    Decision, Restored, RestoredAfterRestart)
_VALUE = {"int": r"-?\d+", "float": r"\S+", "str": r"\S+"}  # by the field's annotation
_CONVERT: dict[str, Callable[[str], object]] = {"int": int, "float": float, "str": str}
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class _Format:
    """One kind's ``FORMAT`` as a regex (a group per field, in order) and its converters."""

    kind: type[Line]
    pattern: re.Pattern[str]
    convert: tuple[Callable[[str], object], ...]

    @classmethod
    def of(cls, kind: type[Line]) -> _Format:
        types = {f.name: str(f.type) for f in fields(kind)}  # "int": annotations are strings
        parts = _PLACEHOLDER.split(kind.FORMAT)  # text, name, text, name, ..., text
        names = parts[1::2]
        regex = "".join(re.escape(part) if i % 2 == 0 else f"({_VALUE[types[part]]})"
                        for i, part in enumerate(parts))
        return cls(kind, re.compile(regex), tuple(_CONVERT[types[n]] for n in names))


def _first_word(body: str) -> str:
    """``regroup`` of ``regroup epoch=1 ...``, ``step`` of ``step=3 ...``."""
    return body.split(" ", 1)[0].split("=", 1)[0]


# Keyed by a line's first word (up to "=" for step lines): a line is matched against the
# few formats that start like it, not against all of them.
_BY_WORD: dict[str, list[_Format]] = defaultdict(list)
for _kind in KINDS:
    _BY_WORD[_first_word(_kind.FORMAT)].append(_Format.of(_kind))


@lru_cache(maxsize=1 << 16)
def parse_line(text: str, index: int = 0, origin: str = "") -> Line | None:
    """The record for one output line, or None for any other line (agent messages, torch
    warnings, tracebacks, a script's own lines).

    Cached (records are immutable): a test's wait predicate parses the whole output again
    at every new line, and parsing costs tens of times a dictionary lookup.
    """
    source = None
    body = text
    if prefix := _PREFIX.match(text):
        source, body = prefix[1], text[prefix.end():]
    for form in _BY_WORD.get(_first_word(body), ()):
        if match := form.pattern.fullmatch(body):
            try:
                values = [f(v) for f, v in zip(form.convert, match.groups(), strict=True)]
            except ValueError:  # "loss=abc": not a line of ours after all
                return None
            return form.kind(source, origin, index, text, *values)
    return None


def parse(lines: Iterable[str], origin: str = "") -> list[Line]:
    """Every record in a job's output, in output order; unrelated lines are skipped."""
    return [r for i, text in enumerate(lines) if (r := parse_line(text, i, origin))]


R = TypeVar("R", bound=Line)


def find(lines: Iterable[str], kind: type[R], origin: str = "") -> list[R]:
    """The records of one kind (its subclasses included: ``Step`` finds elastic steps too)
    in raw output lines."""
    return select(parse(lines, origin), kind)


def select(records: Iterable[Line], kind: type[R]) -> list[R]:
    """The records of one kind, in order, typed as that kind."""
    return [r for r in records if isinstance(r, kind)]


# --- invariants --------------------------------------------------------------------------


def reached(records: Iterable[Line], *, before: int | None = None) -> dict[int, int]:
    """pid -> the last step each worker started with the job committed (its lines are
    labelled ``[rankN]:``), counting only records of output lines before index ``before``
    (every record when None): given the index where a fault happened, what each survivor
    had reached then, for ``check_regroup_invariants(survivors=...)``."""
    last: dict[int, int] = {}
    for step in select(records, Step):
        if (step.source or "").startswith("rank") and (before is None or step.index < before):
            last[step.pid] = step.step
    return last


def assert_steps_consecutive(records: Iterable[Line], pids: Iterable[int]) -> None:
    """Each of these processes committed its steps one after the other: no step applied
    twice, none skipped. A process with no step at all fails too (it was supposed to run)."""
    per_pid: dict[int, list[Step]] = defaultdict(list)
    for step in select(records, Step):
        per_pid[step.pid].append(step)
    for pid in pids:
        steps = per_pid.get(pid)
        assert steps, f"pid {pid} committed no step"
        for before, after in pairwise(steps):
            assert after.step == before.step + 1, (
                f"pid {pid} (rank {after.rank}) went from step {before.step} to {after.step}:"
                f"\n  {before.where()}\n  {after.where()}")


def assert_went_on(records: Iterable[Line], survivors: Mapping[int, int]) -> None:
    """Each process of ``survivors`` (pid -> the step it had reached before a fault, as
    :func:`reached` gives it) committed a step past that one: it went on after the fault.
    Also for a run in which no regroup happens (a fault that must change nothing)."""
    steps = select(records, Step)
    for pid, before in survivors.items():
        mine = [s for s in steps if s.pid == pid]
        assert mine, f"pid {pid} committed no step"
        last = mine[-1]
        assert last.step > before, (
            f"pid {pid} (rank {last.rank}) committed no step after step {before}, the "
            f"one it had reached before the fault:\n  {last.where()}")


def check_regroup_invariants(
    records: Sequence[Line],
    *,
    survivors: Iterable[int] | Mapping[int, int] = (),
    world: int | None = None,
    finished: int | None = None,
    loss_falls: bool = False,
) -> None:
    """The invariants of in-process recovery, on the records of a run that regrouped.

    Always checked:
    * at least one regroup happened;
    * every member of a generation reports the same parameter checksum at its regroup;
    * the step counter a generation starts from is the last committed step: the first step
      committed in generation G is the ``step`` of G's regroup lines plus one (a joiner
      starts exactly where the survivors are);
    * each of ``survivors`` (pids) committed consecutive steps, none twice, none skipped;
      given as a mapping pid -> the step it had reached before the fault, each also
      committed a later step (it went on after the regroup).

    On request: ``world``, some generation formed with that many ranks; ``finished``, the
    job ran to that many steps and every rank of the final world (the last generation's,
    whether or not it committed a step) printed ``done`` with the same parameters;
    ``loss_falls``, the mean loss of the last 8 steps is below that of the first 8 (the
    recovery did not derail training).

    Raises AssertionError naming the member epoch, rank and line that break an invariant.
    """
    regroups = select(records, Regroup)
    steps = select(records, ElasticStep)
    assert regroups, "no regroup happened"
    by_epoch: dict[int, list[Regroup]] = defaultdict(list)
    for regroup in regroups:
        by_epoch[regroup.epoch].append(regroup)
    for epoch, members in by_epoch.items():
        first = members[0]
        for other in members[1:]:
            assert other.checksum == first.checksum, (
                f"member epoch {epoch}: rank {other.rank} has checksum {other.checksum}, "
                f"rank {first.rank} {first.checksum}:\n  {first.where()}\n  {other.where()}")
    for regroup in regroups:
        later = [s for s in steps if s.epoch == regroup.epoch]
        if later:
            earliest = min(later, key=lambda s: s.step)
            assert earliest.step == regroup.step + 1, (
                f"member epoch {regroup.epoch} regrouped at step {regroup.step} (rank "
                f"{regroup.rank}) but its first committed step is {earliest.step} (rank "
                f"{earliest.rank}):\n  {regroup.where()}\n  {earliest.where()}")
    assert_steps_consecutive(records, survivors)
    if isinstance(survivors, Mapping):
        assert_went_on(records, survivors)
    if world is not None:
        assert any(r.world == world for r in regroups), (
            f"no member epoch formed with {world} ranks: "
            f"{sorted({(r.epoch, r.world) for r in regroups})} (epoch, world)")
    if loss_falls:
        losses = [s.loss for s in steps]
        assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8, (
            f"the loss did not fall: first 8 {losses[:8]}, last 8 {losses[-8:]}")
    if finished is not None:
        done = select(records, Done)
        assert steps, "no step committed"
        # A replacement admitted at the last step boundary forms a member epoch that commits
        # no step: its regroup lines, not the last step, give the final world.
        last_formed = max(regroups, key=lambda r: r.epoch)
        final_world = (last_formed.world if last_formed.epoch > steps[-1].epoch
                       else steps[-1].world)
        assert len(done) == final_world, (
            f"{len(done)} ranks printed done, the final world has {final_world}:\n  "
            + "\n  ".join(d.where() for d in done))
        for line in done:
            assert line.param_sum == done[0].param_sum and line.steps == finished, (
                f"rank {line.rank} ended with steps={line.steps} param_sum={line.param_sum}, "
                f"expected steps={finished} param_sum={done[0].param_sum}:\n  {line.where()}")
