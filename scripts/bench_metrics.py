"""What ``--metrics-port`` costs a job: throughput with the metrics endpoint on vs off.

The fault-free benchmark job (scripts/train_elastic.py under ``--recovery regroup``, the
same job as bench_recovery's throughput rounds) runs back to back with and without
``--metrics-port 0``; while metrics are on, a scraper reads the endpoint every
``--scrape-every`` seconds (1 s: fifteen times Prometheus' default rate). Throughput is
committed steps per second from step ``--warmup`` to the last step, read from the workers'
own step lines (each line's ``t=``). Each round runs both variants in an alternating
order; the figure is the median of the per-round on/off ratios, with its spread.

    .venv/bin/python scripts/bench_metrics.py --rounds 4 --steps 400

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

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
    scraper = None
    for line in proc.stdout:
        if scraper is None and (found := PORT.search(line)):
            scraper = threading.Thread(target=scrape, args=(int(found[1]),), daemon=True)
            scraper.start()
        if (step := STEP.search(line)) and int(step[2]) == 0:
            times[int(step[1])] = float(step[3])
    stop.set()
    code = proc.wait()
    if code != 0 or len(times) <= args.warmup:
        print(f"bench_metrics: a {'metrics-on' if metrics else 'metrics-off'} run exited "
              f"{code}; the round is dropped", file=sys.stderr, flush=True)
        return None
    last = max(times)
    span = times[last] - times[args.warmup]
    return {"steps_per_s": (last - args.warmup) / span, "scrapes": scrapes["count"],
            "scrape_failures": scrapes["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
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
              f"scrapes), on/off {ratio:.4f}", file=sys.stderr, flush=True)
    if not rounds:
        raise SystemExit("bench_metrics: every round failed")
    ratios = [r["ratio"] for r in rounds]
    median = statistics.median(ratios)
    print(f"{'variant':<10} {'median steps/s':>15} {'min':>8} {'max':>8}")
    for name in ("off", "on"):
        values = [r[name]["steps_per_s"] for r in rounds]
        print(f"{name:<10} {statistics.median(values):>15.2f} {min(values):>8.2f} "
              f"{max(values):>8.2f}")
    print(f"on/off ratio: median {median:.4f}, range {min(ratios):.4f}-{max(ratios):.4f} "
          f"over {len(ratios)} paired rounds (overhead {100 * (1 - median):.2f}%)")
    print(json.dumps({"bench": "metrics", "rounds": rounds, "ratio_median": median,
                      "ratio_min": min(ratios), "ratio_max": max(ratios),
                      "overhead_pct": 100 * (1 - median), "dropped_rounds": dropped,
                      "args": vars(args),
                      "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))


if __name__ == "__main__":
    main()
