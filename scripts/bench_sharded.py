"""Recovery of a sharded (FSDP2) job: torchrun + disk checkpoints, ftrun restart + the same
checkpoints, ftrun in-memory snapshots with in-process re-entry, with tuned flags and with
ftrun's defaults.

The same job (``scripts/train_fsdp.py``: FSDP2 over gloo, 4 workers, a model sized so that
a step takes >= 100 ms here) and the same fault (rank ``--victim-rank`` SIGKILLs itself
inside the backward of step ``--kill-step``, once per job) under four recoveries, run one
after the other in each repeat, their order rotating (and reversed every other repeat):

* ``torchrun_dcp``: ``torchrun --max-restarts 1``, ``torch.distributed.checkpoint`` to disk
  every ``--ckpt-every`` steps, the restarted job loads the newest one
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it torchrun 2.13's restarts hang here,
  pytorch/pytorch#135712);
* ``ftrun_restart``: ``ftrun --recovery restart --max-restarts 1``, the same checkpoints;
* ``ftrun_snapshot``: ``ftrun --recovery regroup`` with ``ftrun.restartable``: snapshots of
  every step (K = ``--snapshot-every``) in the agent's shared memory, the survivors re-enter
  the training function in process, a replacement restores from memory. With
  ``--spares`` (default 1) a warm spare takes the failed rank at once; the replacement then
  becomes the next spare;
* ``ftrun_defaults``: ``ftrun --nproc-per-node N --recovery regroup`` and no other ftrun
  flag (no ``--spares``: the replacement is started after the fault), the same job and
  snapshots (``--snapshot-every`` is the job's own argument), measured like
  ``ftrun_snapshot``: what a user gets who asks for regroup and nothing else. The
  ``FTRUN_*`` and ``PET_*`` variables that would stand in for flags are taken out of its
  environment (``settings.defaults_env_dropped`` names any that were set).

Figures of one faulty run (the workers' own ``t=`` stamps and the victim's marker time):

* ``recovery_s``: from the SIGKILL to the first step the recovered job commits (the same
  for every variant);
* ``steps_lost``: the last step committed before the fault minus the step the recovered job
  resumed from (0: only the interrupted step is computed again);
* ``snapshot_overhead`` (ftrun_snapshot only): fault-free median step time with snapshots
  every step divided by the same job without snapshots (``--snapshot-every 0``), runs
  alternated, ratio of medians over ``--repeats`` pairs.

The overhead runs are interleaved in ABBA order (pair i runs with-then-without when i is
even, without-then-with when odd), so a load that drifts over the run weighs on both
sides alike. Because the machine is shared, the benchmark also measures what load does
not change: ``snapshot_cpu``, the CPU seconds per committed step and rank of the workers
(every thread, from ``train_fsdp.py --cpu-from-step``; its ``ftrun-snapshot`` thread
apart) and of the agent (its process, sampled with psutil and read at the first and last
measured step), with snapshots and without; ``delta_*`` is the difference of the medians,
the cost of snapshotting itself.

``ftrun_snapshot_node_loss`` (``--node-loss-repeats``, needs root and iproute2 for two
network-namespace hosts, tests/infra/netns.py): the same FSDP2 job on two hosts, two
workers each, two warm spares on h1, snapshots every step copied to the other node (the
buddy); once every rank has committed ``--kill-step`` steps, h2's agent and workers are
SIGKILLed and its snapshot memory removed. ``recovery_s``: the SIGKILL to the first step
after it (h1's workers, the spares restoring the lost shards from the replicas h1 holds);
``steps_lost`` as above; ``stages``: from the leader's own fault record (``--events-file``)
and the time each line reached the benchmark: ``detect_s`` (the SIGKILL to the leader's
verdict; the heartbeat timeout is ``--node-heartbeat-timeout``, a killed agent's closed
presence connection is seen sooner), ``regroup_restore_s`` (the verdict to the last
``restored`` line: the next member epoch formed with the spares, its process groups, the
snapshot chosen and read), ``rebuild_first_step_s`` (to the first step: the training
function builds and shards the model again, loads the state, computes a step on the new
groups).

Prints a table, judged by the worst run, then (``--json``) one JSON object last:
``{"torchrun_dcp": {"recovery_s": [...], "steps_lost": [...], "recovery_s_max": x},
"ftrun_restart": {...}, "ftrun_snapshot": {"recovery_s": [...], "steps_lost": [...],
"snapshot_overhead": r, "recovery_s_max": x}, "ftrun_defaults": {"recovery_s": [...],
"steps_lost": [...], "recovery_s_max": x}}``,
plus ``step_s`` (the median step times behind the overhead), ``snapshot_cpu``,
``ftrun_snapshot_node_loss``, ``load_avg`` (1-minute load before and after), ``settings``
and ``errors``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_fsdp.py"
BIN = Path(sys.executable).parent
STEP = re.compile(r"step=(\d+) loss=\S+ rank=(\d+) pid=(\d+) t=([\d.]+)")
CPU = re.compile(r"cpu rank=(\d+) steps=(\d+) process_s=([\d.]+) threads=(\{.*\})")
VARIANTS = ("torchrun_dcp", "ftrun_restart", "ftrun_snapshot", "ftrun_defaults")
#: Environment variables that stand in for flags (ftrun's FTRUN_*, torchrun's PET_*): taken
#: out of ftrun_defaults' environment, so that its defaults are ftrun's own.
FLAG_ENV_PREFIXES = ("FTRUN_", "PET_")


def launcher(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name) or name


def flag_env(environ: dict[str, str]) -> list[str]:
    """The names in ``environ`` that would stand in for a launcher flag."""
    return sorted(name for name in environ if name.startswith(FLAG_ENV_PREFIXES))


def run(cmd: list[str], timeout: float, env: dict[str, str | None] | None = None,
        agent_cpu: list[tuple[float, float]] | None = None) -> tuple[int, str]:
    """Run ``cmd`` to its end (killed past ``timeout``) with our environment changed by
    ``env`` (a None value takes the variable out); with ``agent_cpu``, append (wall time,
    CPU seconds) of the launched process itself (ftrun's agent) every 0.2 s."""
    full = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full, start_new_session=True)
    stop = threading.Event()

    def sample() -> None:
        assert agent_cpu is not None
        with contextlib.suppress(psutil.Error):
            agent = psutil.Process(proc.pid)
            while not stop.wait(0.2):
                times = agent.cpu_times()
                agent_cpu.append((time.time(), times.user + times.system))

    sampler = threading.Thread(target=sample, daemon=True)
    if agent_cpu is not None:
        sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return -9, out
    finally:
        stop.set()
    return proc.returncode, out


def steps_of(output: str) -> list[tuple[int, int, int, float]]:
    """(step, rank, pid, t) of every step line."""
    return [(int(m[1]), int(m[2]), int(m[3]), float(m[4])) for m in STEP.finditer(output)]


def job_args(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--dim", str(args.dim), "--layers", str(args.layers),
            "--batch", str(args.batch)]


def command(variant: str, args: argparse.Namespace, work: Path, *, fault: bool,
            snapshot_every: int | None = None) -> tuple[list[str], dict[str, str | None]]:
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
    if variant == "ftrun_defaults":  # regroup and nothing else: no --spares
        return ([launcher("ftrun"), *nproc, "--recovery", "regroup", str(SCRIPT), *job,
                 "--snapshot-every", str(every)],
                dict.fromkeys(flag_env(dict(os.environ))))
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
    got = recovery(out, float(marker.read_text().split()[1]))
    if got is None:
        return {"error": f"{variant} run {repeat}: no step after the fault"}
    got.pop("first_t")
    return got


def recovery(output: str, killed: float) -> dict[str, Any] | None:
    """recovery_s, steps_lost and the first step after the fault (None without one)."""
    steps = steps_of(output)
    before = [s for s in steps if s[3] < killed]
    after = [s for s in steps if s[3] > killed]
    if not after:
        return None
    first = min(after, key=lambda s: s[3])
    last_before = max(s[0] for s in before) if before else 0
    return {"recovery_s": round(first[3] - killed, 3),
            "steps_lost": last_before - (first[0] - 1), "first_t": first[3]}


def median_step_s(output: str, warmup: int) -> float | None:
    """Median interval between rank 0's consecutive steps after ``warmup`` steps."""
    times = sorted((s[0], s[3]) for s in steps_of(output) if s[1] == 0 and s[0] > warmup)
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(times) if b[0] == a[0] + 1]
    return statistics.median(gaps) if gaps else None


def _cpu_at(samples: list[tuple[float, float]], when: float) -> float | None:
    """The agent's CPU seconds at wall time ``when``, between the samples around it."""
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t0 <= when <= t1:
            return c0 + (c1 - c0) * ((when - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return None


def cpu_figures(output: str, agent_cpu: list[tuple[float, float]], warmup: int
                ) -> dict[str, float | None] | None:
    """Per committed step after ``warmup``: CPU seconds of a worker (mean over ranks, every
    thread), of its snapshot thread, and of the agent process (between rank 0's step
    ``warmup`` and its last step); None without the workers' ``cpu`` lines."""
    worker: list[float] = []
    writer: list[float] = []
    for match in CPU.finditer(output):
        steps = int(match[2])
        try:
            threads = json.loads(match[4])
        except json.JSONDecodeError:
            continue
        if steps <= 0 or not isinstance(threads, dict):
            continue
        worker.append(float(match[3]) / steps)
        snapshot = threads.get("ftrun-snapshot", 0.0)
        writer.append(float(snapshot) / steps if isinstance(snapshot, int | float) else 0.0)
    if not worker:
        return None
    rank0 = sorted((s[0], s[3]) for s in steps_of(output) if s[1] == 0 and s[0] >= warmup)
    agent = None
    if len(rank0) >= 2:
        (first, t_first), (last, t_last) = rank0[0], rank0[-1]
        a, b = _cpu_at(agent_cpu, t_first), _cpu_at(agent_cpu, t_last)
        if a is not None and b is not None and last > first:
            agent = (b - a) / (last - first)
    return {"worker": statistics.mean(worker), "writer": statistics.mean(writer),
            "agent": agent}


def overhead(args: argparse.Namespace, base: Path) -> tuple[float | None, dict[str, Any],
                                                               dict[str, Any], list[str]]:
    """Fault-free pairs in ABBA order: the step-time ratio (the contract's
    ``snapshot_overhead``), the median step times and the CPU figures (see the module)."""
    with_s: list[float] = []
    without_s: list[float] = []
    pair_ratios: list[float] = []
    cpu: dict[str, dict[str, list[float]]] = {
        side: {"worker_s_per_step_rank": [], "writer_thread_s_per_step_rank": [],
               "agent_s_per_step": []} for side in ("with", "without")}
    errors: list[str] = []
    pairs = args.repeats if args.overhead_repeats is None else args.overhead_repeats
    extra = ["--steps", str(args.overhead_steps), "--cpu-from-step", str(args.warmup)]
    for repeat in range(pairs):
        order = [(args.snapshot_every, "with"), (0, "without")]
        if repeat % 2:
            order.reverse()
        got: dict[str, float] = {}
        for every, side in order:
            work = base / f"overhead-{every}-{repeat}"
            work.mkdir(parents=True)
            cmd, env = command("ftrun_snapshot", args, work, fault=False, snapshot_every=every)
            samples: list[tuple[float, float]] = []
            code, out = run([*cmd, *extra], args.timeout, env, agent_cpu=samples)
            value = median_step_s(out, args.warmup) if code == 0 else None
            figures = cpu_figures(out, samples, args.warmup) if code == 0 else None
            if value is None or figures is None:
                errors.append(f"overhead run K={every} #{repeat}: exit {code}: "
                              + " | ".join(out.strip().splitlines()[-3:]))
                continue
            got[side] = value
            (with_s if side == "with" else without_s).append(value)
            into = cpu[side]
            into["worker_s_per_step_rank"].append(round(figures["worker"] or 0.0, 5))
            into["writer_thread_s_per_step_rank"].append(round(figures["writer"] or 0.0, 5))
            if figures["agent"] is not None:
                into["agent_s_per_step"].append(round(figures["agent"], 5))
        if len(got) == 2:
            pair_ratios.append(round(got["with"] / got["without"], 4))
    ratio = None
    if with_s and without_s:
        ratio = round(statistics.median(with_s) / statistics.median(without_s), 4)

    def delta(key: str) -> float | None:
        a, b = cpu["with"][key], cpu["without"][key]
        return round(statistics.median(a) - statistics.median(b), 5) if a and b else None

    snapshot_cpu: dict[str, Any] = dict(cpu)
    snapshot_cpu["delta_worker_s_per_step_rank"] = delta("worker_s_per_step_rank")
    snapshot_cpu["delta_agent_s_per_step"] = delta("agent_s_per_step")
    base_cpu = cpu["without"]["worker_s_per_step_rank"]
    worker_delta = snapshot_cpu["delta_worker_s_per_step_rank"]
    snapshot_cpu["cpu_ratio"] = None if worker_delta is None or not base_cpu else round(
        1 + worker_delta / statistics.median(base_cpu), 4)
    step_s = {"with_snapshots": [round(v, 4) for v in with_s],
              "without": [round(v, 4) for v in without_s], "pair_ratios": pair_ratios,
              "pair_ratio_median": round(statistics.median(pair_ratios), 4)
              if pair_ratios else None}
    return ratio, step_s, snapshot_cpu, errors


class _Reader:
    """A launcher's output lines, each with the time it arrived, read by a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in list(self.lines))


def _fault_record(events: Path) -> dict[str, Any] | None:
    """The leader's one fault record (the first) from its JSON-lines events file."""
    with contextlib.suppress(OSError):
        for line in events.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("event") == "fault":
                    return event
    return None


def node_loss_once(args: argparse.Namespace, base: Path, repeat: int) -> dict[str, Any]:
    """One node-loss run on two namespace hosts (see the module): its recovery_s,
    steps_lost and stages, or {"error": ...} / {"skipped": why}."""
    sys.path.insert(0, str(REPO))
    from ftrun.snapshot import memory
    from tests.infra.netns import NetnsNetwork, netns_missing_reason

    why = netns_missing_reason()
    if why:
        return {"skipped": why}
    work = base / f"node-loss-{repeat}"
    work.mkdir(parents=True)
    script = work / "train_fsdp.py"
    shutil.copy(SCRIPT, script)
    events = work / "events-h1.jsonl"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", FTRUN_JOB_TOKEN="bench-token")
    job = [str(script), *job_args(args), "--steps", str(args.node_loss_steps),
           "--snapshot-every", str(args.snapshot_every)]
    with NetnsNetwork(2) as net:
        h1, h2 = net["h1"], net["h2"]
        common = [launcher("ftrun"), "--nnodes", "1:2", "--nproc-per-node",
                  str(args.nproc // 2), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  f"{h1.addr}:29400", "--rdzv-id", f"benchsharded{repeat}", "--rdzv-conf",
                  "last_call_timeout=15", "--heartbeat-interval", "0.5",
                  "--heartbeat-timeout", str(args.node_heartbeat_timeout),
                  "--recovery", "regroup"]
        popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True,
                 "errors": "replace", "env": env, "cwd": work}
        leader = _Reader(h1.popen([*common, "--spares", str(args.nproc // 2), "--local-addr",
                                   h1.addr, "--events-file", str(events), *job], **popen))
        other = _Reader(h2.popen([*common, "--local-addr", h2.addr, *job], **popen))
        deadline = time.time() + args.timeout
        while True:
            steps = steps_of(leader.text() + "\n" + other.text())
            ranks = {s[1] for s in steps if s[0] >= args.kill_step}
            if len(ranks) == args.nproc:
                break
            if time.time() > deadline or leader.proc.poll() is not None \
                    or other.proc.poll() is not None:
                tail = " | ".join(leader.text().splitlines()[-5:])
                return {"error": f"node loss run {repeat}: not every rank reached step "
                                 f"{args.kill_step}: {tail}"}
            time.sleep(0.05)
        os.killpg(other.proc.pid, signal.SIGKILL)  # h2's agent and its workers
        killed = time.time()
        other.proc.wait(10)
        memory.remove_stale()  # the lost node's RAM: its snapshot memory goes with it
        try:
            code = leader.proc.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(leader.proc.pid, signal.SIGKILL)
            code = -9
    output = leader.text() + "\n" + other.text()
    if code != 0:
        return {"error": f"node loss run {repeat}: h1 exit {code}: "
                         + " | ".join(leader.text().splitlines()[-5:])}
    result = recovery(output, killed)
    if result is None:
        return {"error": f"node loss run {repeat}: no step after the fault"}
    first_t = result.pop("first_t")
    restored = [t for t, line in leader.lines if "restored step=" in line and t > killed]
    fault = _fault_record(events)
    if fault is not None and isinstance(fault.get("detected"), int | float):
        stages = {"detect_s": fault["detected"] - killed}
        if restored:
            stages["regroup_restore_s"] = max(restored) - fault["detected"]
        stages["rebuild_first_step_s"] = first_t - (max(restored) if restored else killed)
        result["stages"] = {k: round(v, 3) for k, v in stages.items()}
        result["fault"] = {k: fault.get(k) for k in ("cause", "path", "ranks", "node",
                                                       "world", "steps_lost", "recovery_s")}
    return result


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
    parser.add_argument("--overhead-steps", type=int, default=80,
                        help="steps of each fault-free overhead run")
    parser.add_argument("--node-loss-repeats", type=int, default=1,
                        help="node-loss runs on two namespace hosts (0: none)")
    parser.add_argument("--node-loss-steps", type=int, default=40)
    parser.add_argument("--node-heartbeat-timeout", type=float, default=3.0,
                        help="the node-loss runs' --heartbeat-timeout (interval 0.5 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    if args.repeats < 0 or args.nproc < 2 or not 0 < args.kill_step < args.steps:
        parser.error("need --repeats >= 0, --nproc >= 2 and 0 < --kill-step < --steps")
    if args.overhead_steps <= args.warmup + 1 or args.node_loss_repeats < 0 \
            or not args.kill_step < args.node_loss_steps or args.nproc % 2:
        parser.error("need --overhead-steps > --warmup + 1, --node-loss-repeats >= 0, "
                     "--kill-step < --node-loss-steps and an even --nproc")

    variants = VARIANTS
    result: dict[str, Any] = {v: {"recovery_s": [], "steps_lost": []} for v in variants}
    errors: list[str] = []
    node_loss: dict[str, Any] = {"recovery_s": [], "steps_lost": [], "stages": []}
    load_before = os.getloadavg()[0]
    base = Path(tempfile.mkdtemp(prefix="bench_sharded_"))
    try:
        for repeat in range(args.repeats):
            # The order rotates (and reverses every other repeat) so that no variant always
            # runs first, or always right after the same other one, while the load drifts.
            shift = repeat % len(variants)
            order = variants[shift:] + variants[:shift]
            for variant in reversed(order) if repeat % 2 else order:
                got = faulty(variant, args, base, repeat)
                if "error" in got:
                    errors.append(got["error"])
                    continue
                result[variant]["recovery_s"].append(got["recovery_s"])
                result[variant]["steps_lost"].append(got["steps_lost"])
        for repeat in range(args.node_loss_repeats):
            got = node_loss_once(args, base, repeat)
            if "skipped" in got:
                node_loss["skipped"] = got["skipped"]
                break
            if "error" in got:
                errors.append(got["error"])
                continue
            for key in ("recovery_s", "steps_lost", "stages"):
                node_loss[key].append(got.get(key))
            node_loss.setdefault("faults", []).append(got.get("fault"))
        ratio, step_s, snapshot_cpu, more = overhead(args, base)
        errors += more
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["ftrun_snapshot"]["snapshot_overhead"] = ratio
    result["step_s"] = step_s
    result["snapshot_cpu"] = snapshot_cpu
    result["ftrun_snapshot_node_loss"] = node_loss
    result["load_avg"] = {"before": round(load_before, 2),
                          "after": round(os.getloadavg()[0], 2)}
    result["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    result["settings"]["defaults_env_dropped"] = flag_env(dict(os.environ))
    result["errors"] = errors

    # judged by the worst run: a median hides the one recovery in three that hangs
    print(f"{'variant':<16} {'worst recovery_s':<18} {'recovery_s (runs)':<34} "
          f"{'steps_lost':<16}")
    for variant in variants:
        rec = result[variant]["recovery_s"]
        result[variant]["recovery_s_max"] = max(rec) if rec else None
        worst = f"{max(rec):.3f}" if rec else "-"
        print(f"{variant:<16} {worst:<18} {rec!s:<34} {result[variant]['steps_lost']!s:<16}")
    rec = node_loss["recovery_s"]
    node_loss["recovery_s_max"] = max(rec) if rec else None
    print(f"{'node loss':<16} {(f'{max(rec):.3f}' if rec else '-'):<18} {rec!s:<34} "
          f"{node_loss['steps_lost']!s:<16} {node_loss.get('skipped', '')}")
    for stages in node_loss["stages"]:
        print(f"  node loss stages (s): {stages}")
    print(f"snapshot_overhead (K={args.snapshot_every}, ABBA pairs): {ratio} "
          f"(median step with / without: {step_s})")
    print(f"snapshot CPU per step and rank (s): with {snapshot_cpu['with']}, without "
          f"{snapshot_cpu['without']}; worker delta "
          f"{snapshot_cpu['delta_worker_s_per_step_rank']}, agent delta "
          f"{snapshot_cpu['delta_agent_s_per_step']}, CPU ratio {snapshot_cpu['cpu_ratio']}")
    print(f"load average (1 min): {result['load_avg']}")
    for error in errors:
        print(f"error: {error}")
    if args.json:
        print(json.dumps(result))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
