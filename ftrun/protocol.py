"""The regroup protocol between an agent and the workers that use ``import ftrun``.

One table of store keys, and the records both sides read, so that the agent
(:mod:`ftrun.agent.regroup`) and the worker API (:mod:`ftrun.worker`) cannot drift apart. All
keys live under one prefix per job generation (``FTRUN_REGROUP_PREFIX``, e.g.
``ftrun/<run id>/rg0``) in the control store. Every value is a record signed with the job's
secret (:mod:`ftrun.control.auth`; workers inherit it), never a pickle, and every reader checks it:
a process that reaches the store without the secret cannot end a member epoch, make a member
leave or abort its communicators, or decide a step. Write-once keys (ends, decisions,
``formed``, joins) are appended and the first valid record wins; others are overwritten and
checked on read. No decision rests on a counter, which anyone could bump; counters
only say when to look.

=========================  ======================  ==========================================
key                        written by              meaning
=========================  ======================  ==========================================
``status/<id>``            worker thread           :class:`Status`; its presence means the
                                                   member is ready (past imports, API in use)
``rgen/latest``            leader                  number of the newest member epoch
``rgen/<g>``               leader, once            :class:`MemberEpoch` record
``rgen/<g>/end``           agent, first wins       why member epoch g ended (failure, join)
``rgen/<g>/arrived/<id>``  worker                  the member reached member epoch g
``rgen/<g>/formed``        worker, first wins      ``formed`` (all arrived) or ``abandoned``
``rgen/<g>/vote/<s>/<id>`` worker                  the member's step s gradients are good
``rgen/<g>/votes/<s>``     workers (counter)       votes written so far: when to read them
``rgen/<g>/decision/<s>``  worker, first wins      ``commit``, ``commit-regroup`` or ``abort``
``rgen/<g>/join``          leader, once            a joiner waits: regroup at the next commit
=========================  ======================  ==========================================

Between agents (multi-node; on one node the agent is both sides). Members are named
``<node rank>.<n>``. The leader (the store host) alone publishes member epochs; every agent
watches its own members and reports what it sees. These records are signed with the job's
secret (:mod:`ftrun.control.auth`), so a process without it cannot remove or kill a member:

==============================  ================  ========================================
key                             written by        meaning
==============================  ================  ========================================
``changes``                     everyone          counter bumped after each write below:
                                                  one read per tick says whether to look
``pool/<node rank>``            that agent        :class:`Pool`: its live members
``faults``                      agents (counter)  number of fault records
``fault/<i>``                   agent or leader   :class:`Fault` (a member or a whole node)
``rgen/<g>/released/<node>``    agent             its survivors' communicators of g are
                                                  aborted: the leader may publish g + 1
``gate/<node rank>``            standby agent     its health gate's answer after member epoch
                                                  ``epoch`` ended: ``failures`` ("" passed);
                                                  the leader promotes only one that passed
``done``                        leader            every member finished: the job is over
==============================  ================  ========================================

The commit rule. After its gradient collective a member writes its vote and adds one to
``votes/<s>``; a member whose addition reaches the world size reads every member's vote
(one ``check`` and one ``multi_get``). A member that finds all of them valid appends
``commit`` (or ``commit-regroup`` when a joiner waits); a member that finds the member epoch
ended before that appends ``abort``. The first valid record of the one decision key wins,
so exactly one decision exists per step and every survivor applies it: the update is
applied everywhere or nowhere. ``formed`` is decided from the arrivals, each member
reading them all after writing its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftrun.control.errors import StoreValueError, require

# --- the worker's environment -----------------------------------------------------------------

# What a worker that must survive an abort needs from torch (NCCL-FACTS.md, "PyTorch's side").
# The agent keeps torchrun's values (scripts without the worker API expect them); a member
# switches to these in ``ftrun.init()``, except the ones the user set (``user_torch_env``).
SURVIVOR_TORCH_ENV: dict[str, str] = {
    # 2 = on a communicator error, abort the communicators and keep the process (torchrun
    # injects 1, which tears the process down; the C++ default 3 tears down without abort).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # The watchdog sleeps 4 x this before it handles an error (default 15 s -> 60 s).
    # 250 ms is a guess that has not been checked on a GPU yet.
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "250",
}


def regroup_prefix(run_id: str, generation: int) -> str:
    """The key space of job generation ``generation``'s regroup records (the member
    epochs, the votes, the snapshot records) in the control store."""
    return f"ftrun/{run_id}/rg{generation}"


@dataclass(frozen=True)
class MemberEnv:
    """What makes a worker a regroup member (absent under ``--recovery restart``)."""

    member_id: str  # ``<node rank>.<n>``: stable for the process's life, unlike its rank
    prefix: str  # the job generation's regroup key space in the control store
    initial: bool  # started with the job generation (holds the state) or a joiner/spare


@dataclass(frozen=True)
class WorkerEnv:
    """ftrun's own variables in a worker's environment, written by the agent and read by the
    worker API; torchrun's variables (``RANK``, ``MASTER_PORT``, ...) are set beside them
    with torchrun's values. One class so that the two sides cannot drift apart.

    Under torchrun (or a script run by hand) none of them exist: :meth:`from_env` returns
    None. A malformed value raises ``ValueError`` naming the variable.
    """

    generation: int  # the job generation this worker was started in (``gen/N``)
    agent_pid: int
    node_rank: int
    run_id: str
    control_addr: str  # ``host:port`` of the control store
    user_torch_env: frozenset[str]  # SURVIVOR_TORCH_ENV keys the user set: theirs win
    member: MemberEnv | None = None

    GENERATION = "FTRUN_GENERATION"
    AGENT_PID = "FTRUN_AGENT_PID"
    NODE_RANK = "FTRUN_NODE_RANK"
    RUN_ID = "FTRUN_RUN_ID"
    CONTROL_ADDR = "FTRUN_CONTROL_ADDR"
    USER_TORCH_ENV = "FTRUN_USER_TORCH_ENV"
    MEMBER_ID = "FTRUN_MEMBER_ID"
    REGROUP_PREFIX = "FTRUN_REGROUP_PREFIX"
    INITIAL = "FTRUN_INITIAL"

    def to_env(self) -> dict[str, str]:
        env = {
            self.GENERATION: str(self.generation),
            self.AGENT_PID: str(self.agent_pid),
            self.NODE_RANK: str(self.node_rank),
            self.RUN_ID: self.run_id,
            self.CONTROL_ADDR: self.control_addr,
            self.USER_TORCH_ENV: ",".join(sorted(self.user_torch_env)),
        }
        if self.member is not None:
            env[self.MEMBER_ID] = self.member.member_id
            env[self.REGROUP_PREFIX] = self.member.prefix
            env[self.INITIAL] = "1" if self.member.initial else "0"
        return env

    @property
    def control_endpoint(self) -> tuple[str, int]:
        host, _, port = self.control_addr.rpartition(":")
        return host, int(port)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerEnv | None:
        if cls.GENERATION not in env:
            return None

        def number(name: str) -> int:
            try:
                return int(env.get(name, ""))
            except ValueError:
                raise ValueError(f"{name}={env.get(name)!r} is not an integer") from None

        addr = env.get(cls.CONTROL_ADDR, "")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{cls.CONTROL_ADDR}={addr!r} is not host:port")
        member = None
        if env.get(cls.MEMBER_ID) and env.get(cls.REGROUP_PREFIX):
            member = MemberEnv(env[cls.MEMBER_ID], env[cls.REGROUP_PREFIX],
                               env.get(cls.INITIAL) == "1")
        return cls(
            generation=number(cls.GENERATION),
            agent_pid=number(cls.AGENT_PID),
            node_rank=number(cls.NODE_RANK),
            run_id=env.get(cls.RUN_ID, ""),
            control_addr=addr,
            user_torch_env=frozenset(k for k in env.get(cls.USER_TORCH_ENV, "").split(",") if k),
            member=member,
        )


COMMIT = "commit"
COMMIT_REGROUP = "commit-regroup"
ABORT = "abort"
DECISIONS = (COMMIT, COMMIT_REGROUP, ABORT)


def status_key(member: str) -> str:
    return f"status/{member}"


@dataclass(frozen=True)
class Status:
    """What a member's heartbeat thread reports: one record, so that the agent reads every
    member's state with a single ``multi_get`` per tick.

    ``epoch`` is the member epoch the member is inside now (it built that epoch's group and
    has not left it), -1 while it is between member epochs (it left an ended one and waits
    for the next) or before its first. The leader compares the progress of members inside
    the same epoch only, and takes a member still inside an epoch that ended long ago for
    the culprit (:mod:`ftrun.decide.progress`): before this field it compared members that
    waited for the next epoch with one stuck in the ended one, and killed the waiting ones.
    """

    beats: int  # goes up while the process runs: liveness
    steps: int  # committed steps
    collectives: int  # collectives issued in the current step: tells a stalled rank apart
    synced: bool  # holds the job's state (not a joiner waiting for it)
    finished: bool  # left its training loop
    epoch: int = -1  # the member epoch it is inside, -1 between epochs
    epoch_steps: int = 0  # steps committed inside ``epoch``

    def to_json(self) -> dict[str, Any]:
        return {"beats": self.beats, "steps": self.steps, "collectives": self.collectives,
                "synced": self.synced, "finished": self.finished, "epoch": self.epoch,
                "epoch_steps": self.epoch_steps}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Status:
        epoch = data.get("epoch", -1)
        epoch_steps = data.get("epoch_steps", 0)
        for name, value in (("epoch", epoch), ("epoch_steps", epoch_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise StoreValueError(f"status: {name!r} is not a count")
        return cls(require(data, "beats", int), require(data, "steps", int),
                   require(data, "collectives", int), require(data, "synced", bool),
                   require(data, "finished", bool), epoch, epoch_steps)


LATEST = "rgen/latest"


def generation_key(number: int) -> str:
    return f"rgen/{number}"


def end_key(number: int) -> str:
    return f"rgen/{number}/end"


def arrived_key(number: int, member: str) -> str:
    return f"rgen/{number}/arrived/{member}"


def vote_key(number: int, step: int, member: str) -> str:
    return f"rgen/{number}/vote/{step}/{member}"


def votes_key(number: int, step: int) -> str:
    return f"rgen/{number}/votes/{step}"


def decision_key(number: int, step: int) -> str:
    return f"rgen/{number}/decision/{step}"


def formed_key(number: int) -> str:
    return f"rgen/{number}/formed"


FORMED = "formed"
ABANDONED = "abandoned"


def outcome_of(record: dict[str, Any], allowed: tuple[str, ...]) -> str:
    """The value of a decision or ``formed`` record, checked against what may be there."""
    value = require(record, "value", str)
    if value not in allowed:
        raise StoreValueError(f"unexpected value {value!r}")
    return value


def join_key(number: int) -> str:
    return f"rgen/{number}/join"


def pg_prefix(prefix: str, number: int) -> str:
    """The key space of generation ``number``'s process group: stale members of an older
    generation can never read or overwrite a newer one's addresses."""
    return f"{prefix}/rgen/{number}/pg/"


@dataclass(frozen=True)
class Member:
    id: str
    rank: int
    joiner: bool  # has no state yet: receives it from a survivor


@dataclass(frozen=True)
class MemberEpoch:
    """Who computes in member epoch ``number``, with which ranks. (The store keys say
    ``rgen``: the member epochs of one job generation.)"""

    number: int
    members: tuple[Member, ...]  # ordered by rank 0..world_size-1

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member: str) -> int | None:
        return next((m.rank for m in self.members if m.id == member), None)

    @property
    def has_joiners(self) -> bool:
        return any(m.joiner for m in self.members)

    @property
    def source_rank(self) -> int | None:
        """The rank that sends state to joiners: the lowest-ranked survivor, which is never
        special otherwise (nothing in the job depends on rank 0's process)."""
        return next((m.rank for m in self.members if not m.joiner), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "members": [{"id": m.id, "rank": m.rank, "joiner": m.joiner} for m in self.members],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MemberEpoch:
        raw = require(data, "members", list)
        members = []
        for item in raw:
            if not isinstance(item, dict):
                raise StoreValueError("generation member is not an object")
            members.append(
                Member(require(item, "id", str), require(item, "rank", int),
                       require(item, "joiner", bool))
            )
        if [m.rank for m in members] != list(range(len(members))) or not members:
            raise StoreValueError("generation ranks are not 0..N-1 in order")
        if len({m.id for m in members}) != len(members):
            raise StoreValueError("generation lists a member twice")
        return cls(require(data, "number", int), tuple(members))


# --- between agents -------------------------------------------------------------------------

CHANGES = "changes"
FAULTS = "faults"
DONE = "done"


def member_id(node_rank: int, number: int) -> str:
    return f"{node_rank}.{number}"


def node_of(member: str) -> int:
    """The node rank in a member id (ids are only ever made by :func:`member_id`)."""
    return int(member.partition(".")[0])


def pool_key(node_rank: int) -> str:
    return f"pool/{node_rank}"


def fault_key(index: int) -> str:
    return f"fault/{index}"


def released_key(number: int, node_rank: int) -> str:
    return f"rgen/{number}/released/{node_rank}"


def gate_key(node_rank: int) -> str:
    """A standby node's health-gate answer (``{"epoch", "failures"}``): the quick doctor
    checks it ran after member epoch ``epoch`` ended, before the leader may give its
    spares a lost node's ranks (ftrun/agent/regroup.py, ftrun/agent/leader.py)."""
    return f"gate/{node_rank}"


def resync_key(number: int) -> str:
    """Written by an etcd-v3 writer that took over the job's store (a new, empty one) for
    the first member epoch it publishes: the survivors may have seen different decisions
    of their last step, so its members compare their committed steps when it forms."""
    return f"rgen/{number}/resync"


#: etcd-v3: the variable that names the file where a worker's agent keeps the address of
#: the generation's member-epoch store (a signed record: ``store_file_record``); when the
#: job's writer dies, the new writer's store replaces it and the worker reconnects there.
STORE_FILE_ENV = "FTRUN_STORE_FILE"


def store_file_key(run_id: str, generation: int) -> str:
    """The key a store-file record is signed under (binds it to the run and generation)."""
    return f"ftrun/{run_id}/rg{generation}/store-file"


@dataclass(frozen=True)
class Fault:
    """A member taken out (``member``), or every member of a lost node (``node``)."""

    cause: str
    member: str | None = None
    node: int | None = None
    kill: bool = False  # the member's agent must kill it (the leader's stall verdict)

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "member": self.member, "node": self.node,
                "kill": self.kill}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fault:
        member, node = data.get("member"), data.get("node")
        if (member is None) == (node is None):
            raise StoreValueError("a fault names exactly one of member and node")
        if member is not None and not (isinstance(member, str) and _valid_member(member)):
            raise StoreValueError("fault member is not a member id")
        if node is not None and (not isinstance(node, int) or isinstance(node, bool)
                                 or node < 0):
            raise StoreValueError("fault node is not a node rank")
        return cls(require(data, "cause", str), member, node, require(data, "kill", bool))


@dataclass(frozen=True)
class Pool:
    """One node's member processes: ``members`` are alive, ``ready`` ones of them have
    called ``ftrun.init()``; ``finished`` ones left the job with it done. A status record
    exists for every ready or finished member (the leader reads only those: torch's
    ``multi_get`` waits for a missing key)."""

    members: tuple[str, ...]
    ready: frozenset[str]
    finished: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, Any]:
        return {"members": list(self.members), "ready": sorted(self.ready),
                "finished": sorted(self.finished)}

    @classmethod
    def from_json(cls, data: dict[str, Any], node_rank: int) -> Pool:
        members, ready = require(data, "members", list), require(data, "ready", list)
        finished = require(data, "finished", list)
        for member in [*members, *ready, *finished]:
            if not (isinstance(member, str) and _valid_member(member)
                    and node_of(member) == node_rank):
                raise StoreValueError(f"pool of node {node_rank} lists {member!r}")
        if not set(ready) <= set(members):
            raise StoreValueError("pool lists a ready member it does not have")
        return cls(tuple(members), frozenset(ready), frozenset(finished))


def _valid_member(text: str) -> bool:
    node, dot, number = text.partition(".")
    return bool(dot) and node.isdigit() and number.isdigit()
