"""A training job written with ftrun's worker API: it survives a failed worker in-process.

    ftrun --nproc-per-node 4 --recovery regroup scripts/train_elastic.py --steps 300

An MLP learns a synthetic regression task with DDP over gloo. Each step's global batch is
fixed by the step number and split evenly among the current ranks, so the gradient of a
step is the same whoever computes it and however many ranks there are: after a fault and
a replacement the final parameters match a fault-free run (to float tolerance; the sum
order of the reduction changes with the world size, so not bitwise).

Output, one line each, parsed by tests and benchmarks:
    step=N loss=L rank=R pid=P t=UNIX epoch=E world=W
    regroup epoch=E rank=R world=W step=S checksum=C
    resumed step=S rank=R
    done rank=R steps=N param_sum=C
Fault injection for tests: --raise-at-step, --sleep-at-step (the main thread stops making
progress while the process stays alive), each on --fault-rank, once per job
(--raise-every-time: the raise on whichever process holds --fault-rank at that step, every
time: a script's own bug, which ftrun must not absorb forever). For
``ftrun --inject`` / ``ftrun inject``: SIGUSR1 makes the process hang at its next step (the
main thread sleeps, the heartbeat goes on), SIGUSR2 makes it raise at its next step.

Disk checkpoints, for restart-based recovery (torchrun, ``ftrun --recovery restart``):
``--checkpoint-dir D --checkpoint-every K`` makes rank 0 save ``ft.state_dict()`` to
``D/checkpoint.pt`` (written to a temporary file, then renamed) after every K committed
steps, and every rank resume from it at start, printing ``resumed step=S rank=R``. Under
``--recovery regroup`` the flags are harmless: the initial workers resume from an existing
checkpoint the same way, a replacement skips the disk (it receives the state from a
survivor), and rank 0 of the current member epoch keeps saving.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ftrun

GLOBAL_BATCH = 96  # divisible by every world size from 1 to 4 (and 6, 8, 12)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--raise-at-step", type=int, default=-1)
    parser.add_argument("--sleep-at-step", type=int, default=-1)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--raise-every-time", action="store_true",
                        help="--raise-at-step raises on every process at --fault-rank, every "
                        "time it reaches that step")
    parser.add_argument("--slow-rank", type=int, default=-1,
                        help="this rank sleeps --slow-sleep before each backward, so the "
                        "others wait inside the gradient allreduce (for fault tests)")
    parser.add_argument("--slow-sleep", type=float, default=0.0)
    parser.add_argument("--slow-initial", action="store_true",
                        help="only the process that started as --slow-rank is slow (not a "
                        "replacement, nor a survivor renumbered to that rank)")
    parser.add_argument("--hold-at-step", type=int, action="append", default=[],
                        help="every rank waits at this step (repeatable) until a file named "
                             "for it exists in --hold-dir (a test holds the job while it "
                             "looks at it)")
    parser.add_argument("--hold-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=20,
                        help="committed steps between checkpoints (with --checkpoint-dir)")
    args = parser.parse_args()
    if args.hold_at_step and args.hold_dir is None:
        parser.error("--hold-at-step needs --hold-dir")
    return args


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
        nn.Linear(hidden, 1),
    )


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(GLOBAL_BATCH, 32, generator=generator)
    return inputs, (0.5 * inputs[:, :4].sum(dim=1, keepdim=True)).sin()


def checksum(model: nn.Module) -> str:
    return f"{sum(p.detach().double().sum().item() for p in model.parameters()):.12f}"


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a crash never leaves half a checkpoint


def main() -> None:
    args = parse_args()
    ft = ftrun.init()
    model = DistributedDataParallel(make_model(args.hidden), process_group=ft.process_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ft.register("model", model)
    ft.register("optimizer", optimizer)
    ft.on_regroup(lambda rank, world: print(
        f"regroup epoch={ft.epoch} rank={rank} world={world} step={ft.step} "
        f"checksum={checksum(model)}", flush=True))
    # Faults are injected into the process that started as --fault-rank, once: after a
    # regroup another process may hold that rank and must not fail again.
    faulty = os.environ.get("FTRUN_INITIAL", "1") == "1" and ft.rank == args.fault_rank
    slow_process = os.environ.get("FTRUN_INITIAL", "1") == "1" and ft.rank == args.slow_rank
    checkpoint = args.checkpoint_dir / "checkpoint.pt" if args.checkpoint_dir else None
    if checkpoint is not None:
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        # A replacement under regroup gets the state from a survivor, not from the disk.
        if checkpoint.exists() and os.environ.get("FTRUN_INITIAL", "1") == "1":
            ft.load_state_dict(torch.load(checkpoint, weights_only=True))
            print(f"resumed step={ft.step} rank={ft.rank}", flush=True)

    injected: list[str] = []  # ftrun's injected hang (SIGUSR1) or raise (SIGUSR2)
    signal.signal(signal.SIGUSR1, lambda *_: injected.append("hang"))
    signal.signal(signal.SIGUSR2, lambda *_: injected.append("raise"))

    def compute() -> float:
        step, rank, world = ft.step, ft.rank, ft.world_size
        if "raise" in injected:
            raise ValueError(f"injected by ftrun: raise at step {step} on rank {rank} "
                             f"(pid {os.getpid()})")
        while "hang" in injected:  # alive, beating, but no progress
            time.sleep(1)
        if step == args.raise_at_step and (
                (faulty and ft.epoch <= 0)
                or (args.raise_every_time and rank == args.fault_rank)):
            raise ValueError(f"injected error at step {step} on rank {rank}")
        if faulty and ft.epoch <= 0 and step == args.sleep_at_step:
            while True:  # alive, beating, but no progress: a stalled main thread
                time.sleep(1)
        if step in args.hold_at_step:
            while not (args.hold_dir / str(step)).exists():  # every rank waits: nobody lags
                time.sleep(0.05)
        inputs, target = global_batch(step)
        share = GLOBAL_BATCH // world
        rows = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs[rows]), target[rows])
        if (slow_process if args.slow_initial else rank == args.slow_rank):
            time.sleep(args.slow_sleep)
        loss.backward()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        return loss.item()

    while ft.step < args.steps:
        epoch, rank, world = ft.epoch, ft.rank, ft.world_size  # of this step
        loss = ft.run_step(compute, optimizer.step)
        if loss is not None:
            print(f"step={ft.step} loss={loss:.6f} rank={rank} pid={os.getpid()} "
                  f"t={time.time():.6f} epoch={epoch} world={world}", flush=True)
            if (checkpoint is not None and args.checkpoint_every > 0 and ft.rank == 0
                    and ft.step % args.checkpoint_every == 0):
                save_checkpoint(checkpoint, ft.state_dict())
    print(f"done rank={ft.rank} steps={ft.step} param_sum={checksum(model)}", flush=True)
    ft.close()


if __name__ == "__main__":
    main()
