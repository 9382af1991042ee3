"""A worker that leaves evidence of how it was ended: the signal it got, or its own failure.

The launcher tests need to tell "ftrun forwarded SIGTERM" from "ftrun killed the worker":
a SIGKILLed process can say nothing, so on any signal ftrun forwards this worker writes a
file named after its rank and pid holding the signal's name, then exits 0. A file survives
what a console line may not (the agent's log pumps are torn down with it), so the file is
the witness; a line ``got SIGTERM rank=R pid=P`` goes to stdout too, for people.

    witness.py --report-dir D [--api] [--fail-rank R] [--stay]

* first line: ``start rank=R world=W restart=K pid=P`` (train_ddp.py's format, read by
  tests/lines.py's ``Start``), printed once the worker is running (after ``ftrun.init()``
  with ``--api``, so a test that waits for it knows every member is registered);
* ``--fail-rank R``: that rank exits at once with code 10 + K (K: the job's restart count),
  so a failure summary shows which attempt's failure it describes;
* every other rank waits until it is signalled: ``D/signal.rank<R>.pid<P>`` holds the name;
  it then exits 0, or with ``--stay`` runs on (a worker that ignores the request to stop,
  left to ftrun's SIGKILL after the grace).

No torch import without ``--api``: a job of these starts in well under a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

#: What ftrun forwards by default (TORCHELASTIC_SIGNALS_TO_HANDLE), plus Slurm's warning.
WATCHED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-dir", type=Path, required=True)
    parser.add_argument("--api", action="store_true", help="join the job with ftrun.init()")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--stay", action="store_true", help="run on after a signal")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def report(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        target = args.report_dir / f"signal.rank{rank}.pid{os.getpid()}"
        partial = target.with_suffix(".tmp")
        partial.write_text(name)
        partial.replace(target)  # a reader never sees half a name
        print(f"got {name} rank={rank} pid={os.getpid()}", flush=True)
        if not args.stay:
            os._exit(0)

    for sig in WATCHED:
        signal.signal(sig, report)
    world = int(os.environ["WORLD_SIZE"])
    if args.api:
        import ftrun

        ft = ftrun.init()
        world = ft.world_size
    print(f"start rank={rank} world={world} restart={restart} pid={os.getpid()}", flush=True)
    if rank == args.fail_rank:
        sys.exit(10 + restart)
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
