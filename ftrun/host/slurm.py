"""What Slurm tells an ``srun`` task about its job, and the launcher defaults it implies.

Why: under Slurm every torchrun flag that describes the job's shape (how many nodes,
which one am I, where is the rendezvous, which job is this) is already in the task's
environment.  ``srun ftrun train.py`` should just work, with no per-cluster wrapper script
computing ``--nnodes``/``--node-rank``/``--rdzv-endpoint`` by hand (the usual source of
hangs: one node with a wrong rank waits forever).

:class:`SlurmEnvironment` reads a mapping (``os.environ`` by default) and exposes typed
facts; :func:`slurm_launch_defaults` turns them into torchrun-flag defaults that the
launcher applies only where the user passed no flag.  Parsing is strict: a malformed
value raises :class:`SlurmEnvironmentError` naming the variable, because a guessed rank
or world size turns into a silent hang at rendezvous time.

Batch script versus step
------------------------
``sbatch`` runs the batch script on the first node with ``SLURM_JOB_ID`` and even
``SLURM_PROCID=0`` set, but no ``SLURM_STEP_ID`` (checked on Slurm 22.05).  An ftrun run
there is one process for the whole allocation: applying ``SLURM_NNODES=4`` to it would
make it wait for three agents that never start.  So :attr:`SlurmEnvironment.in_slurm` is
true only inside an ``srun`` step, and :func:`slurm_launch_defaults` gives nothing in a
batch script.  Inside a step, the step's variables (``SLURM_STEP_NODELIST``,
``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE``) win over
the job's: a step may use a subset of the allocation.

One agent per node, or one per task
-----------------------------------
``srun -N4 --ntasks-per-node=1 ftrun ...`` starts one agent per node: node rank is
``SLURM_NODEID`` and ``nnodes`` is the node count.  ``srun -N1 -n2 ftrun ...`` (or
``--ntasks-per-node=8 --gpus-per-task=1``) starts several agents per node: each agent is
then a rendezvous "node" of its own, with node rank ``SLURM_PROCID`` and ``nnodes`` the
task count.  The rule is ``ntasks > nnodes`` -> one agent per task.

Preemption, time limits and requeue (what Slurm does; the launcher acts on it)
-------------------------------------------------------------------------------
- At the time limit, on ``scancel``, or on preemption with ``PreemptMode=CANCEL`` or
  ``REQUEUE``, slurmd sends ``SIGCONT`` + ``SIGTERM`` to *every process of every step* of the
  job on each node - with ``proctrack/cgroup`` that includes the training workers, not
  only the ftrun agent - waits ``KillWait`` seconds (slurm.conf, default 30) and then sends
  ``SIGKILL``.  The launcher must therefore expect its workers to get SIGTERM at the same
  moment it does, and finish whatever it does on SIGTERM well within KillWait.
- ``sbatch --signal=USR1@90`` (or ``srun --signal``) asks Slurm to send ``SIGUSR1`` to the
  step tasks about 90 s before the time limit (the timer has a resolution of up to 60 s,
  so it may come earlier than asked).  ``--signal=B:USR1@90`` sends it to the batch shell
  only, which then must forward it itself (``trap`` + ``kill``).  This is the hook for a
  clean checkpoint before the hard SIGTERM.  srun forwards SIGUSR1/SIGTERM it receives
  to its tasks.
- Requeue is not an exit code by default: a job is requeued when it is preempted with
  ``PreemptMode=REQUEUE`` and is requeueable (``--requeue`` or ``JobRequeue=1``), when
  ``scontrol requeue $SLURM_JOB_ID`` is called (the common pattern: on SIGUSR1, checkpoint,
  requeue, exit), or when the job's exit code is listed in the cluster's ``RequeueExit``
  (or ``RequeueExitHold``) slurm.conf parameter - there is no portable "requeue me" code.
  A requeued job keeps its job id and gets ``SLURM_RESTART_COUNT`` incremented, which is
  why :attr:`SlurmEnvironment.rdzv_id` includes it.
- A task killed by a signal is reported as ``ExitCode=0:<sig>`` by sacct (shells show
  128+sig, e.g. 143 for SIGTERM); the job ends ``TIMEOUT``, ``PREEMPTED``, ``CANCELLED``
  or ``REQUEUED`` accordingly.  A launcher that exits on SIGTERM should exit 128+15 (or
  re-raise the signal) so the cause stays visible.
- Partial failure: by default (``KillOnBadExit=0``, ``srun --wait=0``) srun lets the other
  tasks run when one task exits, so one dead agent does not take the step down.  ``srun
  -K``/``--kill-on-bad-exit`` would defeat fault tolerance and should not be used with ftrun.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import hostlist

__all__ = [
    "DEFAULT_RDZV_PORT",
    "SlurmEnvironment",
    "SlurmEnvironmentError",
    "parse_tasks_per_node",
    "slurm_launch_defaults",
]

#: torchrun's default c10d rendezvous port; ``FTRUN_RDZV_PORT`` overrides it under Slurm.
DEFAULT_RDZV_PORT = 29400
#: Step ids that are not an ``srun`` step of tasks: the batch script (SLURM_BATCH_SCRIPT,
#: 0xfffffffb) and salloc's interactive shell step (SLURM_INTERACTIVE_STEP, 0xfffffffa), as
#: numbers or names.  Running ftrun there is one process for the allocation, like a batch script.
_BATCH_STEP_IDS = frozenset({"4294967291", "4294967290", "batch", "interactive"})
_TPN_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_NO_GPU = frozenset({"", "NoDevFiles", "none", "-1"})


class SlurmEnvironmentError(ValueError):
    """A Slurm variable is missing or malformed; the message names the variable."""


def _one_line(value: str) -> str:
    """A value for an error message: quoted, one line, not unbounded."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_tasks_per_node(value: str, var: str = "SLURM_TASKS_PER_NODE") -> tuple[int, ...]:
    """Expand Slurm's compressed tasks-per-node list: ``"2(x3),1"`` -> ``(2, 2, 2, 1)``.

    Slurm writes runs of equal counts as ``N(xM)``; the result has one entry per node in
    nodelist order.
    """
    counts: list[int] = []
    for item in value.split(","):
        m = _TPN_ITEM.match(item.strip())
        if not m:
            raise SlurmEnvironmentError(
                f"{var}={_one_line(value)} is malformed: expected items like 2 or 2(x3)"
            )
        n, repeat = int(m.group(1)), int(m.group(2) or 1)
        if repeat < 1:
            raise SlurmEnvironmentError(f"{var}={_one_line(value)} has a zero repeat count")
        counts.extend([n] * repeat)
    return tuple(counts)


class SlurmEnvironment:
    """Typed, validated view of the Slurm variables of one process.

    Each property reads the mapping on access (cheap; a launcher reads it once).  Integer
    properties raise :class:`SlurmEnvironmentError` when their variable is missing or not a
    non-negative integer; check :attr:`in_slurm` first.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._env: Mapping[str, str] = os.environ if environ is None else environ

    def __repr__(self) -> str:
        if not self.in_job:
            return "SlurmEnvironment(not in a Slurm job)"
        job, step = self._get("SLURM_JOB_ID", "SLURM_JOBID"), self._get("SLURM_STEP_ID")
        return f"SlurmEnvironment(job={job}, step={step})"

    # ------------------------------------------------------------------ raw access
    def _get(self, *names: str) -> str | None:
        """The first of ``names`` that is set (Slurm keeps old and new spellings)."""
        for name in names:
            value = self._env.get(name)
            if value is not None:
                return value
        return None

    def _first(self, *names: str) -> tuple[str, str]:
        """(name, value) of the first set variable, or raise naming the preferred one."""
        for name in names:
            value = self._env.get(name)
            if value is not None:
                return name, value
        raise SlurmEnvironmentError(f"{names[0]} is not set: not inside a Slurm job step")

    def _int(self, *names: str) -> int:
        name, value = self._first(*names)
        try:
            number = int(value.strip())
        except ValueError:
            number = -1
        if number < 0:
            raise SlurmEnvironmentError(
                f"{name}={_one_line(value)} is not a non-negative integer"
            )
        return number

    # ------------------------------------------------------------------ where am I
    @property
    def in_job(self) -> bool:
        """Inside some Slurm job (batch script, salloc shell, or step)."""
        return self._get("SLURM_JOB_ID", "SLURM_JOBID") is not None

    @property
    def in_slurm(self) -> bool:
        """Inside an ``srun`` step task, where the job-shape variables describe *this* task.

        A batch script also has ``SLURM_JOB_ID`` and ``SLURM_PROCID=0`` but no
        ``SLURM_STEP_ID``; launching there with the job's node count would wait for agents
        that are never started, so the batch script does not count.
        """
        if not self.in_job or self._get("SLURM_PROCID") is None:
            return False
        step = self._get("SLURM_STEP_ID", "SLURM_STEPID")
        return step is not None and step.strip() not in _BATCH_STEP_IDS

    @property
    def job_id(self) -> str:
        """The job id as Slurm prints it; a string because array/het jobs are not plain ints."""
        name, value = self._first("SLURM_JOB_ID", "SLURM_JOBID")
        if not value.strip() or any(c.isspace() or c == "/" for c in value.strip()):
            raise SlurmEnvironmentError(f"{name}={_one_line(value)} is not a job id")
        return value.strip()

    @property
    def step_id(self) -> int:
        """The step number inside the job: distinguishes two ``srun`` of the same job."""
        return self._int("SLURM_STEP_ID", "SLURM_STEPID")

    @property
    def restart_count(self) -> int:
        """How often the job was requeued; 0 when Slurm did not set SLURM_RESTART_COUNT."""
        if self._get("SLURM_RESTART_COUNT") is None:
            return 0
        return self._int("SLURM_RESTART_COUNT")

    @property
    def proc_id(self) -> int:
        """Global task rank in the step (0..ntasks-1): one ftrun agent per task."""
        return self._int("SLURM_PROCID")

    @property
    def node_id(self) -> int:
        """Index of this task's node in the step's node list (0..nnodes-1)."""
        return self._int("SLURM_NODEID")

    @property
    def local_id(self) -> int:
        """Rank of this task among the tasks of the step on the same node."""
        return self._int("SLURM_LOCALID")

    @property
    def ntasks(self) -> int:
        """Tasks in the step (the step's count wins over the job's inside a step)."""
        return self._int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")

    @property
    def nnodes(self) -> int:
        """Nodes in the step (a step may use fewer nodes than the job has)."""
        return self._int(
            "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"
        )

    @property
    def ntasks_per_node(self) -> tuple[int, ...]:
        """Tasks on each node of the step in nodelist order, from the ``2(x3),1`` format.

        Uneven counts are normal (``srun -N3 -n7`` gives ``3,2(x2)``), which is one reason
        ftrun makes one rendezvous participant per task when there are several per node.
        """
        name, value = self._first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        return parse_tasks_per_node(value, name)

    @property
    def hostnames(self) -> tuple[str, ...]:
        """The step's nodes in Slurm's order (node id i runs on hostnames[i]).

        Expanded from the compressed form (``gpu[01-04,07],cpu3``) with python-hostlist.
        """
        name, value = self._first("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
        try:
            hosts = hostlist.expand_hostlist(value)
        except hostlist.BadHostlist as exc:
            raise SlurmEnvironmentError(f"{name}={_one_line(value)} is malformed: {exc}") from None
        if not hosts:
            raise SlurmEnvironmentError(f"{name}={_one_line(value)} names no host")
        return tuple(hosts)

    @property
    def first_host(self) -> str:
        """Node 0 of the step: where node rank 0's agent runs, so where the store lives."""
        return self.hostnames[0]

    @property
    def gpus(self) -> tuple[str, ...]:
        """GPUs Slurm gave this task, as ids (physical indices, or UUIDs from CUDA).

        The count is what matters to a launcher (one worker per GPU); the ids are for
        messages.  Workers keep the ``CUDA_VISIBLE_DEVICES`` Slurm set: with device
        cgroups the ids inside are renumbered from 0, so physical ids from
        ``SLURM_STEP_GPUS`` must not be copied into it.  Order of trust: the step's
        binding, the job's, what CUDA was told, and last a bare count.
        """
        for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
            value = self._env.get(name)
            if value is None or value.strip() in _NO_GPU:
                continue
            ids = tuple(v.strip() for v in value.split(","))
            if any(not v for v in ids):
                raise SlurmEnvironmentError(f"{name}={_one_line(value)} has an empty GPU id")
            return ids
        if self._get("SLURM_GPUS_ON_NODE") is not None:
            return tuple(str(i) for i in range(self._int("SLURM_GPUS_ON_NODE")))
        return ()

    @property
    def rdzv_id(self) -> str:
        """A run id unique to this step: ``<job>.<step>``, plus ``.r<n>`` after a requeue.

        The step keeps two ``srun`` of one job apart; the restart count keeps a requeued
        job (same job id) from meeting an older incarnation's keys in an external store.
        """
        base = f"{self.job_id}.{self.step_id}"
        restarts = self.restart_count
        return f"{base}.r{restarts}" if restarts else base

    @property
    def rdzv_port(self) -> int:
        """The rendezvous port: ``FTRUN_RDZV_PORT`` when set, else torchrun's 29400.

        A fixed port collides when two jobs (or two concurrent steps of one job) share
        their first node; such jobs set ``FTRUN_RDZV_PORT`` (e.g. from the job id in the
        sbatch script) or pass ``--rdzv-endpoint``.
        """
        if self._get("FTRUN_RDZV_PORT") is None:
            return DEFAULT_RDZV_PORT
        port = self._int("FTRUN_RDZV_PORT")
        if not 0 < port < 65536:
            raise SlurmEnvironmentError(f"FTRUN_RDZV_PORT={port} is not a TCP port")
        return port

    @property
    def agent_per_task(self) -> bool:
        """True when several tasks share a node, so each task's agent joins on its own."""
        return self.ntasks > self.nnodes

    def validate(self) -> None:
        """Cross-check the step's variables; raise on the first inconsistency.

        Individually well-formed values that disagree (a nodelist of 3 hosts with
        ``SLURM_NNODES=4``) would otherwise surface as a rendezvous that never completes.
        """
        nnodes, ntasks = self.nnodes, self.ntasks
        hosts = self.hostnames
        if len(hosts) != nnodes:
            raise SlurmEnvironmentError(
                f"node list has {len(hosts)} hosts but the step has {nnodes} nodes "
                "(SLURM_STEP_NODELIST vs SLURM_STEP_NUM_NODES)"
            )
        if ntasks < nnodes:
            raise SlurmEnvironmentError(
                f"SLURM_NTASKS={ntasks} is less than SLURM_NNODES={nnodes}"
            )
        if self._get("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") is not None:
            per_node = self.ntasks_per_node
            if len(per_node) != nnodes or sum(per_node) != ntasks:
                raise SlurmEnvironmentError(
                    f"SLURM_TASKS_PER_NODE gives {list(per_node)} but the step has "
                    f"{ntasks} tasks on {nnodes} nodes"
                )
        if self.proc_id >= ntasks:
            raise SlurmEnvironmentError(f"SLURM_PROCID={self.proc_id} >= ntasks={ntasks}")
        if self.node_id >= nnodes:
            raise SlurmEnvironmentError(f"SLURM_NODEID={self.node_id} >= nnodes={nnodes}")


def slurm_launch_defaults(
    env: SlurmEnvironment | Mapping[str, str] | None = None,
) -> dict[str, str]:
    """torchrun-flag defaults implied by the Slurm step; ``{}`` outside an ``srun`` step.

    Keys are flag names with underscores (``nnodes``, ``node_rank``, ``rdzv_id``,
    ``rdzv_endpoint``, ``rdzv_backend``, and ``nproc_per_node`` when Slurm gave GPUs);
    values are strings, as if typed on the command line.  The launcher applies a key only
    where the user passed no flag.  With several tasks per node each task is its own
    rendezvous node (``nnodes`` = task count, ``node_rank`` = ``SLURM_PROCID``), and
    ``nproc_per_node`` is the GPU count *this task* sees - use ``--gpus-per-task`` then, or
    every agent on a node would claim all of its GPUs.

    Raises SlurmEnvironmentError when the step's variables are malformed or inconsistent.
    """
    senv = env if isinstance(env, SlurmEnvironment) else SlurmEnvironment(env)
    if not senv.in_slurm:
        return {}
    senv.validate()
    if senv.agent_per_task:
        nnodes, node_rank = senv.ntasks, senv.proc_id
    else:
        nnodes, node_rank = senv.nnodes, senv.node_id
    defaults = {
        "nnodes": str(nnodes),
        "node_rank": str(node_rank),
        "rdzv_id": senv.rdzv_id,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"{senv.first_host}:{senv.rdzv_port}",
    }
    gpus = senv.gpus
    if gpus:
        defaults["nproc_per_node"] = str(len(gpus))
    return defaults
