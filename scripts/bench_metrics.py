"""What ``--metrics-port`` costs a job: throughput with the metrics endpoint on vs off.

The fault-free benchmark job (scripts/train_elastic.py under ``--recovery regroup``, the
same job as bench_recovery's throughput rounds) runs back to back with and without
``--metrics-port 0``; while metrics are on, a scraper reads the endpoint every
``--scrape-every`` seconds (1 s: fifteen times Prometheus' default rate). Throughput is
committed steps per second from step ``--warmup`` to the last step, read from the workers'
own step lines (each line's ``t=``).

Robust to a loaded machine: the runs are interleaved pairs in ABBA order (off-on, on-off,
off-on, ...), so that a load that drifts during the benchmark touches both variants alike,
and the figure is the median of the per-pair on/off ratios (a pair hit by a burst of
someone else's work is one outlier among many, not a shifted mean), with the quartiles of
the ratios. Each run's 1-minute load average is recorded at its start (say it next to the
figure). On a shared machine that ratio's noise can exceed 1%, so the agent's own CPU time
(user + system of the ftrun process, sampled every 0.2 s until it exits) is reported
beside it: what serving and scraping the metrics costs the node, per second of the run.
Run it alone: ``flock /tmp/ftrun-bench.lock .venv/bin/python scripts/bench_metrics.py``.

    .venv/bin/python scripts/bench_metrics.py --rounds 8 --steps 300

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
FTRUN = REPO / ".venv" / "bin" / "ftrun"
STEP = re.compile(r"step=(\d+) loss=\S+ rank=(\d+) pid=\d+ t=([\d.]+)")
PORT = re.compile(r"metrics: http://\S+:(\d+)/metrics")


def run_job(args: argparse.Namespace, metrics: bool) -> dict[str, float] | None:
    """One run's throughput; None when the job failed (said on stderr, counted)."""
    command = [str(FTRUN), "--nproc-per-node", str(args.nproc), "--recovery", "regroup"]
    if metrics:
        command += ["--metrics-port", "0"]
    command += [str(REPO / "scripts" / "train_elastic.py"), "--steps", str(args.steps),
                "--hidden", str(args.hidden)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO)
    times: dict[int, float] = {}
    scrapes = {"count": 0, "failed": 0}
    stop = threading.Event()
    cpu = {"s": 0.0}

    def sample_cpu() -> None:
        agent = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                times = agent.cpu_times()
                cpu["s"] = times.user + times.system
            except psutil.Error:
                return
            stop.wait(0.2)

    def scrape(port: int) -> None:
        while not stop.wait(args.scrape_every):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=5) as answer:
                    answer.read()
                scrapes["count"] += 1
            except OSError:
                scrapes["failed"] += 1

    assert proc.stdout is not None
    load = os.getloadavg()[0]
    started = time.monotonic()
    threading.Thread(target=sample_cpu, daemon=True).start()
    scraper = None
    for line in proc.stdout:
        if scraper is None and (found := PORT.search(line)):
            scraper = threading.Thread(target=scrape, args=(int(found[1]),), daemon=True)
            scraper.start()
        if (step := STEP.search(line)) and int(step[2]) == 0:
            times[int(step[1])] = float(step[3])
    code = proc.wait()
    stop.set()
    wall = time.monotonic() - started
    if code != 0 or len(times) <= args.warmup:
        print(f"bench_metrics: a {'metrics-on' if metrics else 'metrics-off'} run exited "
              f"{code}; the round is dropped", file=sys.stderr, flush=True)
        return None
    last = max(times)
    span = times[last] - times[args.warmup]
    return {"steps_per_s": (last - args.warmup) / span, "scrapes": scrapes["count"],
            "scrape_failures": scrapes["failed"], "agent_cpu_s": cpu["s"], "wall_s": wall,
            "agent_cpu_per_s": cpu["s"] / wall, "load_1m": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="interleaved on/off pairs")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--scrape-every", type=float, default=1.0)
    args = parser.parse_args()
    if not 0 < args.warmup < args.steps - 10:
        parser.error("--warmup must leave at least 10 measured steps")
    rounds = []
    dropped = 0
    for index in range(args.rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        runs = {metrics: run_job(args, metrics) for metrics in order}
        result = {k: v for k, v in runs.items() if v is not None}
        if len(result) < 2:
            dropped += 1
            continue
        ratio = result[True]["steps_per_s"] / result[False]["steps_per_s"]
        rounds.append({"off": result[False], "on": result[True], "ratio": ratio})
        print(f"round {index}: off {result[False]['steps_per_s']:.2f} steps/s, on "
              f"{result[True]['steps_per_s']:.2f} steps/s ({result[True]['scrapes']} "
              f"scrapes), on/off {ratio:.4f}, load {result[False]['load_1m']:.1f}/"
              f"{result[True]['load_1m']:.1f}", file=sys.stderr, flush=True)
    if not rounds:
        raise SystemExit("bench_metrics: every round failed")
    ratios = [r["ratio"] for r in rounds]
    median = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [median] * 3
    loads = [r[k]["load_1m"] for r in rounds for k in ("off", "on")]
    print(f"{'variant':<10} {'median steps/s':>15} {'min':>8} {'max':>8}")
    for name in ("off", "on"):
        values = [r[name]["steps_per_s"] for r in rounds]
        print(f"{name:<10} {statistics.median(values):>15.2f} {min(values):>8.2f} "
              f"{max(values):>8.2f}")
    cpu_off = statistics.median(r["off"]["agent_cpu_per_s"] for r in rounds)
    cpu_on = statistics.median(r["on"]["agent_cpu_per_s"] for r in rounds)
    print(f"agent CPU per second of run: off {cpu_off:.4f} s, on {cpu_on:.4f} s "
          f"(+{cpu_on - cpu_off:.4f} cores)")
    print(f"on/off ratio: median {median:.4f}, quartiles {quartiles[0]:.4f}-"
          f"{quartiles[2]:.4f}, range {min(ratios):.4f}-{max(ratios):.4f} over {len(ratios)} "
          f"interleaved pairs (overhead {100 * (1 - median):.2f}%); load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print(json.dumps({"bench": "metrics", "rounds": rounds, "ratio_median": median,
                      "ratio_min": min(ratios), "ratio_max": max(ratios),
                      "ratio_q1": quartiles[0], "ratio_q3": quartiles[2],
                      "load_1m_min": min(loads), "load_1m_max": max(loads),
                      "overhead_pct": 100 * (1 - median), "dropped_rounds": dropped,
                      "agent_cpu_per_s_off": cpu_off, "agent_cpu_per_s_on": cpu_on,
                      "args": vars(args),
                      "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))


if __name__ == "__main__":
    main()
