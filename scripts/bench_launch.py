"""Launch and restart latency: the same DDP job under torchrun and ftrun, alternated.

For each repeat and launcher, one run of ``scripts/train_ddp.py`` on N workers measures:

* ``first_step_s``: from starting the launcher command to the first completed step;
* ``restart_s``: from SIGKILL of one worker (after step K and ``--soak-s`` seconds of
  fault-free training) to the first step completed by the restarted job;
* ``false_alarms``: ftrun's hang or frozen verdicts (from its ``--events-file``) where no
  worker hung: any in the fault-free soak, and any beyond the one hang of the hang case;
* ``hang_s``: from one rank hanging (it sleeps forever after step ``--hang-at-step``,
  printing ``hanging``; its peer blocks in DDP's next all-reduce) to the first step
  completed by the restarted job. Both launchers run the same script with a process-group
  timeout of ``--hang-pg-timeout`` seconds (torch's default is 10 minutes or more): torchrun
  learns of the hang only when that timeout fails the collective; ftrun sees every worker
  idle, reads their stacks and restarts (``--hang-timeout`` auto). ``--no-hang`` skips it.
  ``hang_verdict_s`` (ftrun only): the part of it until ftrun's hang verdict (the failure
  record's ``detected`` in its ``--events-file``); the rest is the restart.

The ftrun variants (every run also gets ``--nproc-per-node N --max-restarts 1``, as torchrun
does: without it neither launcher restarts this job, which does not use ftrun's worker API;
and ftrun ``--events-file``, the measurement's own, for the hang verdicts):

* ``ftrun``: ``ftrun --preload none``: every worker is spawned (a fresh Python that imports
  torch itself), what ``ftrun`` measured here before its default became ``--preload auto``;
  the flag keeps the historical figures comparable;
* ``ftrun_preload``: ``ftrun --preload torch,torch._dynamo`` (``--preload``): a per-node
  fork server imports them once, and every worker of every generation is forked from it.
  ``torch._dynamo`` is there because DDP's constructor imports it (about as long as torch
  itself here); ``--preload MODULES`` names others;
* ``ftrun_defaults``: ``ftrun`` with no ftrun flag, what a user gets (today ``--preload
  auto``, ``--recovery auto``, ``--hang-timeout auto``). The ``FTRUN_*`` and ``PET_*``
  variables that would stand in for flags are taken out of its environment
  (``config.defaults_env_dropped`` names any that were set).

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it its restarted
workers read the dead generation's addresses from the shared store and do not recover on
this machine (pytorch/pytorch#135712). A run that does not recover within the timeout
counts as a failure to recover and gives no figure.

    python scripts/bench_launch.py --repeats 5            # table
    python scripts/bench_launch.py --repeats 5 --json     # one JSON object

JSON: {"torchrun": {"first_step_s": [...], "restart_s": [...], "hang_s": [...],
"hang_verdict_s": [...], "failed_to_recover": n, "hang_failed_to_recover": n,
"false_alarms": n}, "ftrun": {...} (with --preload none), "ftrun_preload": {...},
"ftrun_defaults": {...} (no ftrun flag), "config": {...}} (``config.ftrun_flags``: each
variant's ftrun flags).
Note: on this sandbox about 3-8% of TCPStore connects stall exactly 5 s in a reverse-DNS
lookup inside torch (of ``::ffff:127.0.0.1``); an outlier of ~5 s is that quirk. The test
set-up (scripts/install_test_services.sh) adds that name to ``/etc/hosts``, which removes
it; ``config.hosts_v4_mapped_loopback`` says whether the line was there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ftrun.report.events import read_events

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "scripts" / "train_ddp.py"
STEP = re.compile(r"step=(\d+) loss=\S+ rank=(\d+) pid=(\d+)")
LAUNCHERS = ("torchrun", "ftrun", "ftrun_preload", "ftrun_defaults")
PRELOAD = "torch,torch._dynamo"  # DDP imports torch._dynamo when a model is wrapped
#: Environment variables that stand in for flags (ftrun's FTRUN_*, torchrun's PET_*): taken
#: out of ftrun_defaults' environment, so that its defaults are ftrun's own.
FLAG_ENV_PREFIXES = ("FTRUN_", "PET_")


def launcher_path(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def launcher_argv(name: str, preload: str) -> list[str]:
    """The launcher and the variant's own flags (see the module)."""
    if name == "ftrun":  # spawned workers, as before --preload auto became the default
        return [launcher_path("ftrun"), "--preload", "none"]
    if name == "ftrun_preload":
        return [launcher_path("ftrun"), "--preload", preload]
    if name == "ftrun_defaults":
        return [launcher_path("ftrun")]
    return [launcher_path(name)]


def flag_env(environ: dict[str, str]) -> list[str]:
    """The names in ``environ`` that would stand in for a launcher flag."""
    return sorted(name for name in environ if name.startswith(FLAG_ENV_PREFIXES))


def launcher_env(name: str) -> dict[str, str]:
    """The launcher's environment: ours, with torchrun's restart work-around
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE, set for every launcher alike), and without the
    flags' stand-ins for ftrun_defaults."""
    env = dict(os.environ)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if name == "ftrun_defaults":
        for variable in flag_env(env):
            del env[variable]
    return env


class Run:
    """One launcher process whose output lines are timestamped as they arrive."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.t0 = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            errors="replace",
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append((time.monotonic(), line))
                self.cond.notify_all()

    def wait_step(self, after: float, timeout: float, min_step: int = 1,
                  exclude_pids: frozenset[int] = frozenset()) -> tuple[float, int, int] | None:
        """First step line at or after time ``after``: (time, rank, pid)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for stamp, line in self.lines:
                    match = STEP.search(line)
                    if (match and stamp >= after and int(match[1]) >= min_step
                            and int(match[3]) not in exclude_pids):
                        return stamp, int(match[2]), int(match[3])
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    return None
                self.cond.wait(min(left, 0.2))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def hang_verdicts(events: Path) -> int:
    """ftrun's hang and frozen verdicts in an events file (0 where there is none)."""
    if not events.exists() or events.stat().st_size == 0:
        return 0
    count = 0
    for event in read_events(events):
        cause = str(event.get("cause", ""))
        if event.get("event") == "failure" and (
                event.get("kind") in ("hung", "frozen") or cause.startswith(("hung", "frozen"))):
            count += 1
    return count


def measure(name: str, nproc: int, kill_after: int, timeout: float,
            preload: str, soak_s: float) -> dict[str, float | None]:
    """First step, then ``soak_s`` of fault-free training (a hang verdict there is a false
    alarm), then a worker SIGKILLed: the restart's first step."""
    env = launcher_env(name)
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as ckpt:
        events = Path(ckpt) / "events.jsonl"
        argv = [*launcher_argv(name, preload), "--nproc-per-node", str(nproc),
                "--max-restarts", "1",
                str(TRAIN), "--steps", "1000000", "--step-sleep", "0.01",
                "--checkpoint-dir", ckpt, "--checkpoint-every", "1000000"]
        if name != "torchrun":
            argv[1:1] = ["--events-file", str(events)]
        run = Run(argv, env)
        try:
            first = run.wait_step(run.t0, timeout)
            if first is None:
                return {"first_step_s": None, "restart_s": None, "false_alarms": None}
            soaked = first[0] + soak_s
            while (left := soaked - time.monotonic()) > 0 and run.proc.poll() is None:
                time.sleep(min(left, 0.5))  # training, fault-free, for the soak
            victim = run.wait_step(run.t0, timeout, min_step=kill_after)
            if victim is None:
                return {"first_step_s": first[0] - run.t0, "restart_s": None,
                        "false_alarms": None}
            with run.cond:  # a rank that stepped last (after a false alarm: a new pid)
                victim_pid = next(int(m[3]) for _, line in reversed(run.lines)
                                  if (m := STEP.search(line)))
            old_pids = frozenset(
                int(m[3]) for _, line in list(run.lines) if (m := STEP.search(line))
            )
            killed_at = time.monotonic()
            os.kill(victim_pid, signal.SIGKILL)
            after = run.wait_step(killed_at, timeout, exclude_pids=old_pids)
            return {
                "first_step_s": first[0] - run.t0,
                "restart_s": None if after is None else after[0] - killed_at,
                "false_alarms": hang_verdicts(events),  # the fault was a SIGKILL
            }
        finally:
            run.stop()


def hang_detected(events: Path) -> float | None:
    """The wall-clock time of ftrun's first hang verdict in an events file, if any."""
    if not events.exists():
        return None
    for event in read_events(events):
        hung = event.get("kind") == "hung" or str(event.get("cause", "")).startswith("hung")
        if event.get("event") == "failure" and hung and isinstance(event.get("detected"), float):
            return float(event["detected"])
    return None


def measure_hang(name: str, nproc: int, hang_at: int, pg_timeout: float,
                 timeout: float, preload: str) -> tuple[float | None, int, float | None]:
    """Seconds from a rank's hang to the restarted job's first step (or None), the hang
    verdicts beyond the one hang (false alarms), and seconds from the hang to ftrun's
    verdict (None for torchrun)."""
    env = launcher_env(name)
    with tempfile.TemporaryDirectory(prefix="bench_hang_") as scratch:
        events = Path(scratch) / "events.jsonl"
        argv = [*launcher_argv(name, preload), "--nproc-per-node", str(nproc),
                "--max-restarts", "1",
                str(TRAIN), "--steps", "1000000", "--step-sleep", "0.01",
                "--fail-at-step", str(hang_at), "--fail-rank", "1", "--fail-mode", "hang",
                "--fail-once-marker", str(Path(scratch) / "hung-once"),
                "--pg-timeout", str(pg_timeout)]
        if name != "torchrun":
            argv[1:1] = ["--events-file", str(events)]
        run = Run(argv, env)
        wall_offset = time.time() - time.monotonic()  # the lines' times are monotonic
        try:
            deadline = time.monotonic() + timeout
            hung_at = None
            while hung_at is None and time.monotonic() < deadline and run.proc.poll() is None:
                with run.cond:
                    hung_at = next((t for t, line in run.lines if "hanging at step" in line),
                                   None)
                    if hung_at is None:
                        run.cond.wait(0.2)
            if hung_at is None:
                return None, hang_verdicts(events), None
            with run.cond:
                old_pids = frozenset(int(m[3]) for _, line in run.lines
                                     if (m := STEP.search(line)))
            after = run.wait_step(hung_at, timeout + pg_timeout, exclude_pids=old_pids)
            extra = max(0, hang_verdicts(events) - 1)
            detected = hang_detected(events)
            verdict = None if detected is None else detected - wall_offset - hung_at
            return (None if after is None else after[0] - hung_at), extra, verdict
        finally:
            run.stop()


def hosts_v4_mapped_loopback() -> bool:
    """Whether /etc/hosts names ::ffff:127.0.0.1 (the sandbox's DNS-stall workaround)."""
    try:
        lines = Path("/etc/hosts").read_text().splitlines()
    except OSError:
        return False
    return any(line.split()[:1] == ["::ffff:127.0.0.1"] for line in lines)


def summarize(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--kill-after-step", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--hang-at-step", type=int, default=20)
    parser.add_argument("--hang-pg-timeout", type=float, default=60.0,
                        help="the job's process-group timeout in the hang case (seconds)")
    parser.add_argument("--no-hang", action="store_true", help="skip the hang case")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--preload", default=PRELOAD,
                        help=f"modules ftrun_preload's fork server imports (default {PRELOAD})")
    parser.add_argument("--soak-s", type=float, default=10.0,
                        help="fault-free training before the kill (hang verdicts there are "
                        "false alarms)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help="a subset to run (a figure reported against torchrun needs both)")
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    if unknown := set(launchers) - set(LAUNCHERS):
        parser.error(f"--launchers: unknown {', '.join(sorted(unknown))}")

    results: dict[str, dict[str, list[float] | int]] = {
        name: {"first_step_s": [], "restart_s": [], "hang_s": [], "hang_verdict_s": [],
               "failed_to_recover": 0, "hang_failed_to_recover": 0, "false_alarms": 0}
        for name in LAUNCHERS
    }
    for repeat in range(args.repeats):
        shift = repeat % len(LAUNCHERS)
        order = LAUNCHERS[shift:] + LAUNCHERS[:shift]
        for name in order:
            if name not in launchers:
                continue
            figures = measure(name, args.nproc, args.kill_after_step, args.timeout,
                              args.preload, args.soak_s)
            entry = results[name]
            entry["false_alarms"] += figures["false_alarms"] or 0  # type: ignore[operator]
            if figures["first_step_s"] is not None:
                entry["first_step_s"].append(round(figures["first_step_s"], 3))  # type: ignore[union-attr]
            if figures["restart_s"] is None:
                entry["failed_to_recover"] += 1  # type: ignore[operator]
            else:
                entry["restart_s"].append(round(figures["restart_s"], 3))  # type: ignore[union-attr]
            print(f"# repeat {repeat + 1}/{args.repeats} {name}: {figures}", file=sys.stderr)
            if args.no_hang:
                continue
            hang, extra, verdict = measure_hang(name, args.nproc, args.hang_at_step,
                                                args.hang_pg_timeout, args.timeout,
                                                args.preload)
            if verdict is not None:
                entry["hang_verdict_s"].append(round(verdict, 3))  # type: ignore[union-attr]
            entry["false_alarms"] += extra  # type: ignore[operator]
            if hang is None:
                entry["hang_failed_to_recover"] += 1  # type: ignore[operator]
            else:
                entry["hang_s"].append(round(hang, 3))  # type: ignore[union-attr]
            print(f"# repeat {repeat + 1}/{args.repeats} {name}: hang_s={hang} "
                  f"verdict_s={verdict}", file=sys.stderr)

    results["config"] = {  # type: ignore[assignment]
        "nproc": args.nproc, "repeats": args.repeats, "kill_after_step": args.kill_after_step,
        "timeout_s": args.timeout, "torch_disable_share_rdzv_tcp_store": True,
        "hang_at_step": None if args.no_hang else args.hang_at_step,
        "hang_pg_timeout_s": None if args.no_hang else args.hang_pg_timeout,
        "cpus": os.cpu_count(), "preload": args.preload, "launchers": launchers,
        "soak_s": args.soak_s, "hosts_v4_mapped_loopback": hosts_v4_mapped_loopback(),
        "ftrun_flags": {name: launcher_argv(name, args.preload)[1:]
                        for name in LAUNCHERS if name != "torchrun"},
        "defaults_env_dropped": flag_env(dict(os.environ)),
    }
    if args.json:
        print(json.dumps(results))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"launch and restart latency, {args.nproc} gloo workers, seconds")
    for column in ("launcher", "first step: median (min, max)", "restart: median (min, max)",
                   "hang to training: median (min, max)", "of which to the verdict",
                   "failed to recover",
                   "false alarms"):
        table.add_column(column)
    for name in LAUNCHERS:
        entry = results[name]
        table.add_row(name, summarize(entry["first_step_s"]),  # type: ignore[arg-type]
                      summarize(entry["restart_s"]),  # type: ignore[arg-type]
                      summarize(entry["hang_s"]),  # type: ignore[arg-type]
                      summarize(entry["hang_verdict_s"]),  # type: ignore[arg-type]
                      f"{entry['failed_to_recover']}/{args.repeats} "
                      f"(hang {entry['hang_failed_to_recover']}/{args.repeats})",
                      str(entry["false_alarms"]))
    # Wide enough for every launcher's name and figures when the output is not a terminal
    # (rich's fallback there is 80 columns, which cut the names).
    Console(width=max(150, Console().width)).print(table)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
