"""Fault specifications: ``ftrun --inject SPEC`` and ``ftrun inject KIND key=value ...``.

A spec is a schedule of faults to inject into one's own job on purpose, to see what a fault
costs (every injected fault gets the same record as a real one: ftrun.observe.faults).
Items are separated by ``;``; each is a kind followed by ``key=value`` words::

    --inject "kill rank=1 step=20; freeze rank=2 step=60..80; raise rank=random after=30; seed=7"

kinds:
  ``kill``        SIGKILL the worker
  ``freeze``      SIGSTOP the worker (a frozen process)
  ``hang``        the worker's main thread stops stepping while the process lives (the
                  script handles SIGUSR1 by sleeping: scripts/train_elastic.py does)
  ``raise``       the worker raises at its next step (the script handles SIGUSR2)
  ``kill-agent``  SIGKILL the agent of ``node`` (its workers die with it)
  ``cut-link``    the agent of ``node`` cuts its own host off the network for ``for``
                  seconds (default 10): iptables drops every packet in and out but
                  loopback. Only on a host in a named network namespace (``ip netns``:
                  the namespace test hosts, tests/infra/netns.py): anywhere else the
                  agent refuses it with one line, so a real machine never loses its
                  network
keys:
  ``rank=N|random``   the worker (by its global rank when the fault fires); ``random``
                      picks one with the seed
  ``node=N``          the node of ``kill-agent`` or ``cut-link`` (default 0)
  ``for=S``           how long ``cut-link`` lasts (0.1 to 3600 s)
  ``step=N|A..B``     fire once the job committed N steps (a range: picked with the seed)
  ``after=S|A..B``    fire S seconds after the job's first committed step
  ``seed=N``          (an item of its own) makes the random choices repeatable; default 0

Without ``step`` or ``after`` a fault fires at once (what ``ftrun inject`` sends). Parsing
errors are :class:`FaultSpecError` with one line that names the bad word.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

KINDS = ("kill", "freeze", "hang", "raise", "kill-agent", "cut-link")
NODE_KINDS = ("kill-agent", "cut-link")
WORKER_KINDS = ("kill", "freeze", "hang", "raise")
MAX_STEP = 10**9
MAX_AFTER_S = 7 * 24 * 3600.0
MAX_CUT_S = 3600.0
DEFAULT_CUT_S = 10.0


class FaultSpecError(ValueError):
    """A fault spec that cannot be used; the message is one line."""


@dataclass(frozen=True)
class Fault:
    """One fault to inject: what, on whom, when (``step`` or ``after_s``; neither: now)."""

    kind: str
    rank: int | None = None  # None with a random choice still to make (see ``random_rank``)
    random_rank: bool = False
    node: int | None = None
    step: int | None = None
    after_s: float | None = None
    text: str = ""  # the item as written, for records and messages
    for_s: float | None = None  # cut-link: how long the host stays cut off

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "random_rank": self.random_rank,
                "node": self.node, "step": self.step, "after_s": self.after_s,
                "text": self.text, "for_s": self.for_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fault:
        """A fault read from the store (already signature-checked): every field checked."""
        kind = data.get("kind")
        if kind not in KINDS:
            raise FaultSpecError(f"unknown fault kind {kind!r}")
        rank, node, text = data.get("rank"), data.get("node"), data.get("text", "")
        for name, value in (("rank", rank), ("node", node)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value < 1_000_000):
                raise FaultSpecError(f"bad {name} {value!r}")
        if not isinstance(text, str):
            raise FaultSpecError("bad text")
        for_s = data.get("for_s")
        if for_s is not None and (not isinstance(for_s, (int, float)) or isinstance(
                for_s, bool) or not 0.1 <= for_s <= MAX_CUT_S):
            raise FaultSpecError(f"bad for_s {for_s!r}")
        return cls(kind=kind, rank=rank, node=node, random_rank=data.get("random_rank") is True,
                   text=text[:200], for_s=None if for_s is None else float(for_s))


@dataclass(frozen=True)
class Schedule:
    """The faults of one ``--inject`` spec, with its seed."""

    faults: tuple[Fault, ...]
    seed: int = 0
    text: str = ""

    def pick_rank(self, fault: Fault, index: int, world_size: int) -> int | None:
        """The rank a ``rank=random`` fault hits in a job of ``world_size`` ranks: the same
        for the same seed, index and world size."""
        if world_size <= 0:
            return None
        return random.Random(f"{self.seed}:{index}:{world_size}").randrange(world_size)


def _number(word: str, key: str, value: str, *, integer: bool, top: float,
            rng: random.Random) -> float:
    low_text, dots, high_text = value.partition("..")
    try:
        low = int(low_text) if integer else float(low_text)
        high = (int(high_text) if integer else float(high_text)) if dots else low
    except ValueError:
        kind = "a whole number" if integer else "a number of seconds"
        raise FaultSpecError(f"{word!r}: {key} must be {kind} or a range A..B") from None
    if not 0 <= low <= high <= top:
        raise FaultSpecError(f"{word!r}: {key} out of range (0..{top:g}, low <= high)")
    if low == high:
        return low
    return rng.randint(int(low), int(high)) if integer else round(rng.uniform(low, high), 3)


def parse_item(text: str, rng: random.Random | None = None) -> Fault:
    """One fault: ``KIND key=value ...``. Raises :class:`FaultSpecError`."""
    rng = rng or random.Random(0)
    words = text.split()
    if not words:
        raise FaultSpecError("an empty fault")
    kind = words[0].lower()
    if kind not in KINDS:
        raise FaultSpecError(f"unknown fault kind {words[0]!r} (one of: {', '.join(KINDS)})")
    fault = Fault(kind=kind, text=" ".join(words))
    seen: set[str] = set()
    for word in words[1:]:
        key, eq, value = word.partition("=")
        key = key.lower()
        if not eq or not value:
            raise FaultSpecError(f"{word!r}: expected key=value (rank, node, step, after, "
                                 "for)")
        if key in seen:
            raise FaultSpecError(f"{word!r}: {key} given twice")
        seen.add(key)
        if key == "rank":
            if value.lower() == "random":
                fault = replace(fault, random_rank=True)
            else:
                rank = _number(word, key, value, integer=True, top=999_999, rng=rng)
                fault = replace(fault, rank=int(rank))
        elif key == "node":
            fault = replace(fault, node=int(_number(word, key, value, integer=True,
                                                    top=999_999, rng=rng)))
        elif key == "step":
            fault = replace(fault, step=int(_number(word, key, value, integer=True,
                                                    top=MAX_STEP, rng=rng)))
        elif key == "after":
            fault = replace(fault, after_s=float(_number(word, key, value, integer=False,
                                                         top=MAX_AFTER_S, rng=rng)))
        elif key == "for":
            seconds = float(_number(word, key, value, integer=False, top=MAX_CUT_S, rng=rng))
            if seconds < 0.1:
                raise FaultSpecError(f"{word!r}: for must be at least 0.1 s")
            fault = replace(fault, for_s=seconds)
        else:
            raise FaultSpecError(f"{word!r}: unknown key {key!r} (rank, node, step, after, "
                                 "for)")
    if fault.step is not None and fault.after_s is not None:
        raise FaultSpecError(f"{text.strip()!r}: give step or after, not both")
    if kind in WORKER_KINDS and fault.rank is None and not fault.random_rank:
        raise FaultSpecError(f"{text.strip()!r}: {kind} needs rank=N or rank=random")
    if kind in NODE_KINDS:
        if fault.rank is not None or fault.random_rank:
            raise FaultSpecError(f"{text.strip()!r}: {kind} takes node=N, not a rank")
        fault = replace(fault, node=fault.node or 0)
    if fault.for_s is not None and kind != "cut-link":
        raise FaultSpecError(f"{text.strip()!r}: for= is for cut-link only")
    if kind == "cut-link" and fault.for_s is None:
        fault = replace(fault, for_s=DEFAULT_CUT_S)
    return fault


def parse_schedule(text: str) -> Schedule:
    """An ``--inject`` spec. Raises :class:`FaultSpecError`."""
    items = [item.strip() for item in text.split(";") if item.strip()]
    seed = 0
    rest: list[str] = []
    for item in items:
        key, eq, value = item.partition("=")
        if key.strip().lower() == "seed" and eq and " " not in item.strip():
            try:
                seed = int(value)
            except ValueError:
                raise FaultSpecError(f"{item!r}: the seed is a whole number") from None
        else:
            rest.append(item)
    if not rest:
        raise FaultSpecError(f"{text!r}: no fault in it")
    rng = random.Random(seed)
    return Schedule(tuple(parse_item(item, rng) for item in rest), seed, text)
