"""The Slurm check: is the environment ftrun derives ranks and world size from consistent?

Under ``srun`` ftrun reads the job's shape from Slurm's variables (``ftrun.host.slurm``). When
they disagree with one another (a node list of 3 hosts with ``SLURM_NNODES=4``, a task id
past the task count) or with the GPUs this process really sees, the job waits for agents
that never come or gives workers GPUs they cannot use. This check says so up front, with
every inconsistency at once rather than the first one.
"""

from __future__ import annotations

from ftrun.doctor.core import NVML_HANG_HINT, CheckResult, Context, Findings, check, skipped


def parse_tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE, e.g. ``2(x3),1`` -> [2, 2, 2, 1]: ``ftrun.host.slurm``'s parser.

    Imported here, not at the top: ``ftrun.host.slurm`` needs python-hostlist, and a node
    without it must still get every other check (the slurm check warns that it is missing).
    """
    from ftrun.host.slurm import parse_tasks_per_node as expand

    return list(expand(value))


def _count_list(value: str | None) -> int | None:
    """How many comma-separated ids ``value`` lists, or None when unset.

    Not ``ftrun.host.slurm.SlurmEnvironment.gpus``: that picks one variable by trust and reads
    "NoDevFiles" as none, to size the job; this check counts each variable on its own, to
    compare them.
    """
    if value is None:
        return None
    return len([x for x in value.split(",") if x.strip()])


@check("slurm", NVML_HANG_HINT)
def check_slurm(ctx: Context) -> CheckResult:
    """Under Slurm, the environment ftrun derives ranks and world size from must be
    self-consistent, and the GPUs Slurm granted must be the ones this process sees.
    """
    env = ctx.env
    if not env.get("SLURM_JOB_ID"):
        return skipped("not under Slurm (SLURM_JOB_ID unset)")
    f = Findings()
    fix = "run inside the allocation (srun/sbatch) with consistent --nodes/--ntasks-per-node"

    def as_int(var: str) -> int | None:
        value = env.get(var)
        if value is None or not value.strip().isdigit():
            if value is not None:
                f.add("fail", f"{var}={value!r} is not a number", fix)
            return None
        return int(value)

    nodelist_var = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in env else "SLURM_NODELIST"
    nodes: list[str] | None = None
    if nodelist_var in env:
        try:
            import hostlist

            nodes = hostlist.expand_hostlist(env[nodelist_var])
        except ImportError:
            f.add("warn", "python-hostlist not installed: node list not checked",
                  "pip install python-hostlist")
        except Exception as exc:
            f.add("fail", f"{nodelist_var}={env[nodelist_var]!r} does not expand: {exc}", fix)
    else:
        f.add("fail", "SLURM_JOB_NODELIST unset", fix)
    nnodes = as_int("SLURM_NNODES") or as_int("SLURM_JOB_NUM_NODES")
    if nodes is not None:
        if nnodes is not None and len(nodes) != nnodes:
            f.add("fail", f"{nodelist_var} has {len(nodes)} node(s), SLURM_NNODES={nnodes}", fix)
        me = env.get("SLURMD_NODENAME")
        if me is None:
            f.add("warn", "SLURMD_NODENAME unset", fix)
        elif me not in nodes:
            f.add("fail", f"this node {me!r} is not in {nodelist_var}={env[nodelist_var]}", fix)
    ntasks = as_int("SLURM_NTASKS") or as_int("SLURM_NPROCS")
    per_node: list[int] | None = None
    tpn = as_int("SLURM_NTASKS_PER_NODE")
    if tpn is not None and nnodes is not None:
        per_node = [tpn] * nnodes
    elif "SLURM_TASKS_PER_NODE" in env:
        try:
            per_node = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        except ValueError as exc:
            f.add("fail", str(exc), fix)
        except ImportError:  # ftrun.host.slurm needs python-hostlist, whose absence is warned above
            pass
    if per_node is not None and ntasks is not None and sum(per_node) != ntasks:
        f.add("fail", f"SLURM_NTASKS={ntasks} but nodes x tasks per node = {sum(per_node)}", fix)
    procid = as_int("SLURM_PROCID")
    if procid is not None and ntasks is not None and procid >= ntasks:
        f.add("fail", f"SLURM_PROCID={procid} >= SLURM_NTASKS={ntasks}", fix)
    gpu_var = next((v for v in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS") if v in env), None)
    granted = _count_list(env.get(gpu_var)) if gpu_var else None
    cvd = _count_list(env.get("CUDA_VISIBLE_DEVICES"))
    if granted is not None:
        if cvd is not None and cvd != granted:
            f.add("warn", f"{gpu_var} has {granted} GPU(s), CUDA_VISIBLE_DEVICES {cvd}",
                  "let Slurm set CUDA_VISIBLE_DEVICES (do not override it in the job script)")
        seen = ctx.visible_gpu_count() if ctx.options.nproc_per_node != "cpu" else None
        if seen is not None and seen < granted:
            f.add("fail", f"Slurm granted {granted} GPU(s) ({gpu_var}) but only {seen} visible",
                  "check CUDA_VISIBLE_DEVICES and the node's GPUs (nvidia-smi)")
    summary = f"job {env['SLURM_JOB_ID']}: {nnodes or '?'} node(s), {ntasks or '?'} task(s)"
    if procid is not None:
        summary += f", this is task {procid}"
    if granted is not None:
        summary += f", {granted} GPU(s) granted"
    return f.result(summary + ", consistent")
