#!/usr/bin/env python3
"""Per-call overhead of the NCCL shim, measured against the NCCL test double (no GPU needed).

A C loop (tests/shim_helpers/scenario.c, "bench") calls ncclCommCount -- a cheap intercepted
function -- N times in blocks of 1,000 and reports the fastest block (the call's cost without
the scheduler's preemptions), then launches N/10 all-reduces, in three set-ups:
  direct   no shim
  inert    shim preloaded, no control page (what a child process of a worker pays)
  active   shim preloaded and attached; the communicator is in its registry
Each set-up runs --repeat times; the table shows the median and the best run.

    python scripts/bench_shim.py [--iters 2000000] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.shim_helpers import bench_once, build_all, cc_version  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iters", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-") as tmp:
        build = build_all(Path(tmp), asan=False)
        results: dict[str, dict[str, float]] = {}
        for mode in ("direct", "inert", "active"):
            runs = [bench_once(build, mode, args.iters) for _ in range(args.repeat)]
            count = [r[0] for r in runs]
            coll = [r[1] for r in runs]
            results[mode] = {
                "count_ns_median": statistics.median(count),
                "count_ns_best": min(count),
                "allreduce_ns_median": statistics.median(coll),
                "allreduce_ns_best": min(coll),
            }
    base = results["direct"]
    for mode in ("inert", "active"):
        r = results[mode]
        r["count_overhead_ns"] = r["count_ns_median"] - base["count_ns_median"]
        r["allreduce_overhead_ns"] = r["allreduce_ns_median"] - base["allreduce_ns_median"]
    summary = {
        "iters": args.iters,
        "repeat": args.repeat,
        "cc": cc_version(),
        "cpu": _cpu_model(),
        "results": results,
        "goal_ns": 50,
        "ok": results["active"]["count_overhead_ns"] < 50,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"shim per-call overhead, {args.iters} calls x {args.repeat} runs ({summary['cpu']})")
    print(f"{'set-up':<8} {'ncclCommCount ns':>18} {'best':>8} {'overhead':>9}   "
          f"{'all-reduce ns':>14} {'best':>8} {'overhead':>9}")  # fmt: skip
    for mode, r in results.items():
        over_c = r.get("count_overhead_ns")
        over_a = r.get("allreduce_overhead_ns")
        oc = "" if over_c is None else f"{over_c:+.2f}"
        oa = "" if over_a is None else f"{over_a:+.1f}"
        print(
            f"{mode:<8} {r['count_ns_median']:>18.2f} {r['count_ns_best']:>8.2f} {oc:>9}   "
            f"{r['allreduce_ns_median']:>14.1f} {r['allreduce_ns_best']:>8.1f} {oa:>9}"
        )
    print(f"goal: active overhead < 50 ns per call: {'PASS' if summary['ok'] else 'FAIL'}")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown cpu"


if __name__ == "__main__":
    raise SystemExit(main())
