"""Recovery of a sharded (FSDP2) job: torchrun + disk checkpoints, ftrun restart + the same
checkpoints, ftrun in-memory snapshots with in-process re-entry.

The same job (``scripts/train_fsdp.py``: FSDP2 over gloo, 4 workers, a model sized so that
a step takes >= 100 ms here) and the same fault (rank ``--victim-rank`` SIGKILLs itself
inside the backward of step ``--kill-step``, once per job) under three recoveries:

* ``torchrun_dcp``: ``torchrun --max-restarts 1``, ``torch.distributed.checkpoint`` to disk
  every ``--ckpt-every`` steps, the restarted job loads the newest one
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it torchrun 2.13's restarts hang here,
  pytorch/pytorch#135712);
* ``ftrun_restart``: ``ftrun --recovery restart --max-restarts 1``, the same checkpoints;
* ``ftrun_snapshot``: ``ftrun --recovery regroup`` with ``ftrun.restartable``: snapshots of
  every step (K = ``--snapshot-every``) in the agent's shared memory, the survivors re-enter
  the training function in process, a replacement restores from memory. With
  ``--spares`` (default 1) a warm spare takes the failed rank at once; the replacement then
  becomes the next spare.

Figures of one faulty run (the workers' own ``t=`` stamps and the victim's marker time):

* ``recovery_s``: from the SIGKILL to the first step the recovered job commits;
* ``steps_lost``: the last step committed before the fault minus the step the recovered job
  resumed from (0: only the interrupted step is computed again);
* ``snapshot_overhead`` (ftrun_snapshot only): fault-free median step time with snapshots
  every step divided by the same job without snapshots (``--snapshot-every 0``), runs
  alternated, ratio of medians over ``--repeats`` pairs.

Prints a table, then (``--json``) one JSON object last:
``{"torchrun_dcp": {"recovery_s": [...], "steps_lost": [...]}, "ftrun_restart": {...},
"ftrun_snapshot": {"recovery_s": [...], "steps_lost": [...], "snapshot_overhead": r}}``,
plus ``step_s`` (the median step times behind the overhead), ``settings`` and ``errors``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_fsdp.py"
BIN = Path(sys.executable).parent
STEP = re.compile(r"step=(\d+) loss=\S+ rank=(\d+) pid=(\d+) t=([\d.]+)")


def launcher(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name) or name


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    full = dict(os.environ)
    full.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return -9, out
    return proc.returncode, out


def steps_of(output: str) -> list[tuple[int, int, int, float]]:
    """(step, rank, pid, t) of every step line."""
    return [(int(m[1]), int(m[2]), int(m[3]), float(m[4])) for m in STEP.finditer(output)]


def job_args(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--dim", str(args.dim), "--layers", str(args.layers),
            "--batch", str(args.batch)]


def command(variant: str, args: argparse.Namespace, work: Path, *, fault: bool,
            snapshot_every: int | None = None) -> tuple[list[str], dict[str, str]]:
    job = job_args(args)
    if fault:
        job += ["--kill-rank", str(args.victim_rank), "--kill-step", str(args.kill_step),
                "--kill-dir", str(work)]
    nproc = ["--nproc-per-node", str(args.nproc)]
    if variant == "torchrun_dcp":
        return ([launcher("torchrun"), *nproc, "--max-restarts", "1", str(SCRIPT), *job,
                 "--snapshot-every", "0", "--ckpt-dir", str(work / "ckpt"),
                 "--ckpt-every", str(args.ckpt_every)],
                {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    if variant == "ftrun_restart":
        return ([launcher("ftrun"), *nproc, "--recovery", "restart", "--max-restarts", "1",
                 str(SCRIPT), *job, "--snapshot-every", "0", "--ckpt-dir", str(work / "ckpt"),
                 "--ckpt-every", str(args.ckpt_every)], {})
    every = args.snapshot_every if snapshot_every is None else snapshot_every
    return ([launcher("ftrun"), *nproc, "--recovery", "regroup", "--spares",
             str(args.spares), str(SCRIPT), *job, "--snapshot-every", str(every)], {})


def faulty(variant: str, args: argparse.Namespace, base: Path, repeat: int
           ) -> dict[str, Any]:
    work = base / f"{variant}-{repeat}"
    (work / "ckpt").mkdir(parents=True)
    cmd, env = command(variant, args, work, fault=True)
    code, out = run(cmd, args.timeout, env)
    marker = work / "killed"
    if code != 0 or not marker.exists():
        return {"error": f"{variant} run {repeat}: exit {code}, killed={marker.exists()}: "
                         + " | ".join(out.strip().splitlines()[-5:])}
    killed_at = float(marker.read_text().split()[1])
    steps = steps_of(out)
    before = [s for s in steps if s[3] < killed_at]
    after = [s for s in steps if s[3] > killed_at]
    if not after:
        return {"error": f"{variant} run {repeat}: no step after the fault"}
    first = min(after, key=lambda s: s[3])
    last_before = max(s[0] for s in before) if before else 0
    return {"recovery_s": round(first[3] - killed_at, 3),
            "steps_lost": last_before - (first[0] - 1)}


def median_step_s(output: str, warmup: int) -> float | None:
    """Median interval between rank 0's consecutive steps after ``warmup`` steps."""
    times = sorted((s[0], s[3]) for s in steps_of(output) if s[1] == 0 and s[0] > warmup)
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(times) if b[0] == a[0] + 1]
    return statistics.median(gaps) if gaps else None


def overhead(args: argparse.Namespace, base: Path) -> tuple[float | None, dict[str, Any],
                                                               list[str]]:
    with_s: list[float] = []
    without_s: list[float] = []
    errors: list[str] = []
    pairs = args.repeats if args.overhead_repeats is None else args.overhead_repeats
    for repeat in range(pairs):
        for every, into in ((args.snapshot_every, with_s), (0, without_s)):
            work = base / f"overhead-{every}-{repeat}"
            work.mkdir(parents=True)
            cmd, env = command("ftrun_snapshot", args, work, fault=False, snapshot_every=every)
            code, out = run(cmd, args.timeout, env)
            value = median_step_s(out, args.warmup) if code == 0 else None
            if value is None:
                errors.append(f"overhead run K={every} #{repeat}: exit {code}")
            else:
                into.append(value)
    ratio = None
    if with_s and without_s:
        ratio = round(statistics.median(with_s) / statistics.median(without_s), 4)
    return ratio, {"with_snapshots": [round(v, 4) for v in with_s],
                   "without": [round(v, 4) for v in without_s]}, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--kill-step", type=int, default=17)
    parser.add_argument("--victim-rank", type=int, default=1)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--snapshot-every", type=int, default=1)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of step times")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--overhead-repeats", type=int, default=None,
                        help="pairs of fault-free runs for snapshot_overhead (default: "
                             "--repeats; 0: none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    if args.repeats < 0 or args.nproc < 2 or not 0 < args.kill_step < args.steps:
        parser.error("need --repeats >= 0, --nproc >= 2 and 0 < --kill-step < --steps")

    variants = ("torchrun_dcp", "ftrun_restart", "ftrun_snapshot")
    result: dict[str, Any] = {v: {"recovery_s": [], "steps_lost": []} for v in variants}
    errors: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="bench_sharded_"))
    try:
        for repeat in range(args.repeats):
            for variant in variants:
                got = faulty(variant, args, base, repeat)
                if "error" in got:
                    errors.append(got["error"])
                    continue
                result[variant]["recovery_s"].append(got["recovery_s"])
                result[variant]["steps_lost"].append(got["steps_lost"])
        ratio, step_s, more = overhead(args, base)
        errors += more
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["ftrun_snapshot"]["snapshot_overhead"] = ratio
    result["step_s"] = step_s
    result["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    result["errors"] = errors

    print(f"{'variant':<16} {'recovery_s (median, runs)':<34} {'steps_lost':<16}")
    for variant in variants:
        rec = result[variant]["recovery_s"]
        med = f"{statistics.median(rec):.3f}" if rec else "-"
        print(f"{variant:<16} {med + ' ' + str(rec):<34} {result[variant]['steps_lost']!s:<16}")
    print(f"snapshot_overhead (K={args.snapshot_every}): {ratio} "
          f"(median step with / without: {step_s})")
    for error in errors:
        print(f"error: {error}")
    if args.json:
        print(json.dumps(result))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
