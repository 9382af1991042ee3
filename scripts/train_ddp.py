"""A real data-parallel training job for CPU: DDP over gloo, an MLP on a synthetic task.

It is an ordinary torchrun script (nothing ftrun-specific), used as ftrun's main job, by the
tests and by the launch benchmark. It resumes from its own checkpoint, so a job restarted
by ``--max-restarts`` continues where the last checkpoint left it.

    ftrun --nproc-per-node 4 scripts/train_ddp.py --steps 200

Each step prints one line, ``step=N loss=L rank=R pid=P t=UNIX``, which tests and
benchmarks parse. ``--fail-at-step`` makes one rank raise (to exercise error files). For
``ftrun --inject`` / ``ftrun inject`` (plain signal handlers, still nothing ftrun-specific):
SIGUSR1 makes the process hang at its next step, SIGUSR2 makes it raise there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # before init_process_group: see the end of main()
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--fail-at-step", type=int, default=-1)
    parser.add_argument("--fail-rank", type=int, default=0)
    parser.add_argument("--fail-once-marker", type=Path, default=None,
                        help="fail only if this file does not exist yet (then create it)")
    parser.add_argument("--fail-mode", choices=("raise", "hang", "block"), default="raise",
                        help="hang: --fail-rank sleeps forever at --fail-at-step (a wedged "
                        "rank; its peers block in the next collective); block: it waits "
                        "inside a receive no peer sends (every rank inside communication)")
    parser.add_argument("--slow-step-at", type=int, default=-1,
                        help="every rank sleeps --slow-step-s before this step (slow, healthy)")
    parser.add_argument("--slow-step-s", type=float, default=0.0)
    parser.add_argument("--write-at", type=int, default=-1,
                        help="rank 0 writes to --write-dir for --write-s seconds before this "
                        "step (a long checkpoint write: busy in I/O, its peers wait)")
    parser.add_argument("--write-s", type=float, default=0.0)
    parser.add_argument("--net-wait-at", type=int, default=-1,
                        help="rank 0 awaits a reply over a socket for --net-wait-s seconds "
                        "before this step (a slow remote read: idle, its peers wait)")
    parser.add_argument("--net-wait-s", type=float, default=0.0)
    parser.add_argument("--pg-timeout", type=float, default=None,
                        help="seconds before a collective times out (torch's default if unset)")
    parser.add_argument("--write-dir", type=Path, default=None)
    return parser.parse_args()


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)  # identical initial parameters on every rank
    return nn.Sequential(
        nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )


def batch_for(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data: the same (step, rank) always yields the same batch."""
    generator = torch.Generator().manual_seed(step * 1_000 + rank)
    inputs = torch.randn(size, 32, generator=generator)
    target = (inputs[:, :8].sum(dim=1, keepdim=True)).sin()
    return inputs, target


@record
def main() -> None:
    args = parse_args()
    timeout = None if args.pg_timeout is None else datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_model(args.hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    checkpoint = args.checkpoint_dir / "checkpoint.pt" if args.checkpoint_dir else None
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        print(f"resumed step={start} rank={rank}", flush=True)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"start rank={rank} world={world} restart={restart} pid={os.getpid()}", flush=True)

    injected: list[str] = []
    signal.signal(signal.SIGUSR1, lambda *_: injected.append("hang"))
    signal.signal(signal.SIGUSR2, lambda *_: injected.append("raise"))
    for step in range(start, args.steps):
        if "raise" in injected:
            raise RuntimeError(f"injected by ftrun: raise at step {step} on rank {rank} "
                               f"(pid {os.getpid()})")
        while "hang" in injected:
            time.sleep(1)
        if step == args.fail_at_step and rank == args.fail_rank:
            marker = args.fail_once_marker
            if marker is None or not marker.exists():
                if marker is not None:
                    marker.touch()
                if args.fail_mode == "hang":
                    print(f"hanging at step={step} rank={rank} pid={os.getpid()}", flush=True)
                    while True:
                        time.sleep(3600)
                if args.fail_mode == "block":
                    print(f"blocking at step={step} rank={rank} pid={os.getpid()}", flush=True)
                    dist.recv(torch.zeros(1), src=(rank + 1) % world)
                raise RuntimeError(f"injected failure at step {step} on rank {rank}")
        if step == args.slow_step_at:
            time.sleep(args.slow_step_s)
        if step == args.write_at and rank == 0 and args.write_dir is not None:
            block, until = os.urandom(1 << 20), time.monotonic() + args.write_s
            with open(args.write_dir / "large.bin", "wb") as out:
                while time.monotonic() < until:
                    out.write(block)
                    out.flush()
                    os.fsync(out.fileno())
                    if out.tell() > 2 << 30:  # keep the file under 2 GiB
                        out.seek(0)
        if step == args.net_wait_at and rank == 0:
            ours, theirs = socket.socketpair()
            reply = threading.Timer(args.net_wait_s, theirs.sendall, (b"x",))
            reply.start()
            with ours, theirs, ours.makefile("rb") as stream:
                stream.read(1)  # through socket.py, as a remote read from a library is
            reply.join()
        inputs, target = batch_for(step, rank, args.batch)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        optimizer.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        print(
            f"step={step + 1} loss={loss.item():.5f} rank={rank} pid={os.getpid()} "
            f"t={time.time():.6f}",
            flush=True,
        )
        if checkpoint is not None and rank == 0 and (step + 1) % args.checkpoint_every == 0:
            tmp = checkpoint.with_suffix(".tmp")
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "step": step + 1}
            torch.save(state, tmp)
            tmp.replace(checkpoint)  # atomic: a crash never leaves half a checkpoint
    digest = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"done rank={rank} steps={args.steps} param_sum={digest:.10f}", flush=True)
    # Join gloo's worker threads now, while the interpreter can still hand them the GIL.
    # Each gradient allreduce is queued from inside backward, so its work object holds
    # the thread-local state, which holds the contextvars.Context that autograd stashes
    # there; the gloo thread that ran it drops it after the main thread has moved on, and
    # dropping it takes the GIL. If that happens once Py_FinalizeEx has begun, take_gil
    # ends the thread with pthread_exit, whose unwinding hits the noexcept work destructor:
    # "terminate called without an active exception", SIGABRT (then a SIGSEGV from the
    # fault handler). destroy_process_group() joins the threads only if it drops the last
    # reference to the group: DDP's reducer holds one (so the model goes first), and
    # torch.distributed.nn's default arguments capture the default group if that module
    # is first imported after init_process_group (DDP imports it): hence the early import.
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
