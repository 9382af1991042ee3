"""A sharded training job (FSDP2, or FSDP2 + tensor parallel on a 2-D mesh) that survives a
fault in process with ``ftrun.restartable``: the example, the tests' job and the benchmark's.

    ftrun --nproc-per-node 4 --recovery regroup scripts/train_fsdp.py --steps 200
    ftrun --nproc-per-node 4 --recovery regroup scripts/train_fsdp.py --tp 2   # 2x2 mesh
    torchrun --nproc-per-node 4 scripts/train_fsdp.py --steps 200              # no API

Each step's data is a function of (seed, step, rank) only, so a replay after a recovery
computes exactly what the fault-free run computed: with the same world size and mesh the
final parameters are bitwise equal. Lines printed (read by tests/lines.py): ``step=...`` per
committed step, ``done rank=R steps=S param_sum=HEX`` at the end (HEX: a SHA-256 of every
parameter shard's bytes gathered on rank 0, equal text for equal parameters); with
``--cpu-from-step N``, ``cpu rank=R steps=S process_s=X threads={...}`` before it: this
process's CPU seconds (every thread, and per thread name) over the last S steps, from the
end of step N (the benchmark's load-independent cost of snapshots).

Fault injection for tests: ``--kill-rank R --kill-step S`` SIGKILLs rank R inside the
backward of step S, once per job (a marker file in ``--kill-dir`` says it happened);
``--kill R:S:WHERE`` (repeatable, each once per job, marker ``killed-<i>``) also kills rank
R ``backward`` of step S, while the snapshot of step S is being ``capture``d (inside the
registered loader's ``state_dict``: before that rank's file exists), or while the snapshot
of step S is being ``restore``d (inside its ``load_state_dict``: during a recovery), or
just before it builds its device ``mesh`` at an entry that starts from step S (the other
members wait in the mesh's group build for its address), or just before its ``group``
build, the default process group's (S counts this process's builds, 1 its first; the
others fail their build, which leaves torch's group numbering one up);
``--hang R:S:WHERE`` (repeatable, once per job, marker ``hung-<i>``) makes rank R sleep
forever there instead (alive, its heartbeat beating: a member that never commits);
with ``--hang-until-restart`` every process that reaches a ``--hang`` (a replacement too)
hangs there until the job generation restarts (a recovery that cannot commit in process);
``--bad-state-step S`` makes a registered object's state hold a ``set`` at step S (a leaf a
snapshot cannot keep). For ``ftrun --inject`` / ``ftrun inject``: SIGUSR1 makes the process
hang at its next step (it sleeps in its own code, its heartbeat beating), SIGUSR2 makes it
raise at its next step. ``--ckpt-dir D --ckpt-every N`` writes torch.distributed.checkpoint
to disk instead (the benchmark's torchrun baseline), resuming from the newest one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ftrun


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (2-D mesh)")
    parser.add_argument("--snapshot-every", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-dir", type=Path, default=None)
    parser.add_argument("--kill", action="append", default=[], metavar="R:S:WHERE",
                        help="WHERE: backward, capture, restore, mesh or group")
    parser.add_argument("--hang", action="append", default=[], metavar="R:S:WHERE",
                        help="as --kill, but the rank sleeps forever")
    parser.add_argument("--hang-until-restart", action="store_true",
                        help="a --hang catches every process that reaches it (replacements "
                             "too) until the job generation restarts")
    parser.add_argument("--bad-state-step", type=int, default=-1)
    parser.add_argument("--ckpt-dir", type=Path, default=None)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--cpu-from-step", type=int, default=-1,
                        help="print a cpu line: this process's CPU from this step to the end")
    return parser.parse_args()


class CpuMeter:
    """CPU seconds of this process from one committed step to the end, per thread: the
    benchmark's load-independent cost of snapshots (the writer thread, the step's own)."""

    def __init__(self, from_step: int) -> None:
        self.from_step = from_step
        self.start: tuple[int, dict[str, float]] | None = None

    @staticmethod
    def _threads() -> dict[str, float]:
        names = {t.native_id: t.name for t in threading.enumerate()}
        out: dict[str, float] = {}
        for thread in psutil.Process().threads():
            name = names.get(thread.id, "other")
            out[name] = out.get(name, 0.0) + thread.user_time + thread.system_time
        return out

    def at(self, step: int) -> None:
        if step == self.from_step and self.start is None:
            self.start = (step, self._threads())

    def report(self, rank: int, step: int) -> None:
        if self.start is None:
            return
        first, before = self.start
        now = self._threads()
        spent = {k: round(v - before.get(k, 0.0), 4) for k, v in now.items()}
        print(f"cpu rank={rank} steps={step - first} process_s={sum(spent.values()):.4f} "
              f"threads={json.dumps(spent, separators=(',', ':'))}", flush=True)


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def die(marker: Path) -> None:
    """Leave a marker (pid, time), say so, and SIGKILL this process."""
    marker.write_text(f"{os.getpid()} {time.time()}\n")
    print(f"victim pid={os.getpid()}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def hang(marker: Path) -> None:
    """Leave a marker (pid, time), say so, and never return (the process stays alive)."""
    marker.write_text(f"{os.getpid()} {time.time()}\n")
    print(f"hanging pid={os.getpid()}", flush=True)
    while True:
        time.sleep(1)


def due_kill(args: argparse.Namespace, rank: int, step: int, where: str) -> Path | None:
    """The marker of a ``--kill`` due here that has not happened yet, or None; a ``--hang``
    due here hangs at once."""
    if args.kill_dir is None:
        return None
    for option, name in (("hang", "hung"), ("kill", "killed")):
        for index, spec in enumerate(getattr(args, option)):
            r, s, w = spec.split(":")
            marker = args.kill_dir / f"{name}-{index}"
            again = option == "hang" and args.hang_until_restart and \
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if (int(r), int(s), w) == (rank, step, where) and (again or not marker.exists()):
                if option == "hang":
                    hang(marker)
                return marker
    return None


class Loader:
    """The data position, as a registered Stateful (a JSON-able state)."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.seen = 0
        self.args = args
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"seen": self.seen}
        if self.seen == self.args.bad_state_step:
            state["recent"] = {self.seen}  # a set: not a JSON value
        marker = due_kill(self.args, self.rank, self.seen, "capture")
        if marker is not None:
            die(marker)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state["seen"])
        marker = due_kill(self.args, self.rank, self.seen, "restore")
        if marker is not None:
            die(marker)


def build(args: argparse.Namespace, world: int) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(*[Block(args.dim) for _ in range(args.layers)])
    if args.tp > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        for block in model:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                                   "down": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        mesh = dp = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, mesh


def batch(args: argparse.Namespace, step: int, dp_rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + dp_rank)
    return torch.randn(args.batch, args.dim, generator=gen)


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's full value (gathered), the same text on every rank."""
    sha = hashlib.sha256()
    for name, param in model.state_dict().items():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        sha.update(name.encode())
        sha.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:32]


def kill_in_backward(args: argparse.Namespace, step: int, rank: int,
                     model: torch.nn.Module) -> None:
    marker: Path | None = None
    if (rank, step) == (args.kill_rank, args.kill_step) and args.kill_dir is not None:
        marker = args.kill_dir / "killed"
        marker = None if marker.exists() else marker
    marker = marker or due_kill(args, rank, step, "backward")
    if marker is None:
        return

    def hook(grad: torch.Tensor) -> torch.Tensor:
        assert marker is not None
        die(marker)
        return grad

    def on_output(module: Any, inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(hook)  # runs in backward, after the later blocks' gradients
        handle.remove()

    handle = model[0].register_forward_hook(on_output)


def dp_rank_of(args: argparse.Namespace, rank: int) -> int:
    return rank // args.tp


def disk_checkpoint(args: argparse.Namespace, model: torch.nn.Module, optimizer: Any,
                    step: int | None) -> int:
    """torch.distributed.checkpoint to ``--ckpt-dir``: save at ``step``, or (None) load
    the newest complete one and return its step (0 when there is none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    assert args.ckpt_dir is not None
    if step is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd},
                 checkpoint_id=str(args.ckpt_dir / f"step{step}"))
        if dist.get_rank() == 0:  # complete once every rank saved (dcp.save is collective)
            (args.ckpt_dir / f"step{step}" / "complete").touch()
        return step
    done = [int(p.parent.name[4:]) for p in args.ckpt_dir.glob("step*/complete")]
    if not done:
        return 0
    newest = max(done)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(args.ckpt_dir / f"step{newest}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return newest


INJECTED: list[str] = []  # ftrun's injected hang (SIGUSR1) or raise (SIGUSR2)


def injected_fault(step: int, rank: int) -> None:
    if "raise" in INJECTED:
        raise ValueError(f"injected by ftrun: raise at step {step} on rank {rank} "
                         f"(pid {os.getpid()})")
    while "hang" in INJECTED:  # alive, beating, in its own code: no progress
        time.sleep(1)


def train(ft: Any, args: argparse.Namespace) -> None:
    world, rank = ft.world_size, ft.rank
    marker = due_kill(args, rank, ft.step, "mesh")
    if marker is not None:
        die(marker)
    model, _mesh = build(args, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = Loader(args, rank)
    ft.register("model", model)
    ft.register("optimizer", optimizer)
    ft.register("loader", loader)
    if args.ckpt_dir is not None:
        ft.step = disk_checkpoint(args, model, optimizer, None)
        if ft.step:
            print(f"resumed step={ft.step} rank={rank}", flush=True)
    meter = CpuMeter(args.cpu_from_step)
    while ft.step < args.steps:
        meter.at(ft.step)
        step = ft.step
        injected_fault(step, rank)
        optimizer.zero_grad()
        kill_in_backward(args, step, rank, model)
        loss = model(batch(args, step, dp_rank_of(args, rank))).pow(2).mean()
        loss.backward()
        optimizer.step()
        loader.seen = step + 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        print(f"step={step + 1} loss={loss.item():.6f} rank={rank} pid={os.getpid()} "
              f"t={time.time():.3f}", flush=True)
        ft.step_done()
        if args.ckpt_every and ft.step % args.ckpt_every == 0:
            disk_checkpoint(args, model, optimizer, ft.step)
    meter.report(rank, ft.step)
    print(f"done rank={rank} steps={ft.step} param_sum={digest(model)}", flush=True)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGUSR1, lambda *_: INJECTED.append("hang"))
    signal.signal(signal.SIGUSR2, lambda *_: INJECTED.append("raise"))
    builds = [0]
    build = dist.init_process_group

    def init_process_group(*pargs: Any, **kwargs: Any) -> Any:  # --kill R:S:group
        builds[0] += 1
        marker = due_kill(args, int(kwargs.get("rank", -1)), builds[0], "group")
        if marker is not None:
            die(marker)
        return build(*pargs, **kwargs)

    dist.init_process_group = init_process_group
    ftrun.restartable(train, snapshot_every=args.snapshot_every)(args)


if __name__ == "__main__":
    main()
