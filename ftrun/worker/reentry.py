"""What leaving a training function and entering it again needs of the process itself:
torch's DTensor caches of old meshes dropped, its group numbering started afresh, and a
spare's one-time warm-up (used by
:mod:`ftrun.worker.restartable`; the connections to peers are cut by
:mod:`ftrun.worker.sockets`).

Errors: :func:`forget_meshes` and :func:`forget_group_names` swallow what they cannot do
(a cache or counter this torch lacks);
:func:`warm_up` raises what torch raises, and its caller says it in one line.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist


def forget_meshes() -> None:
    """Drop torch's DTensor caches that hold device meshes of an earlier entry.

    A re-entered training function builds a new mesh equal (by torch's ``__eq__``: same
    ranks, dims and device) to the old one, so the sharding propagator and the
    redistribution planner would answer from their caches with specs that point at the old
    mesh, whose process groups were destroyed ("Could not resolve the process group"). These
    are private caches of torch 2.13: each is cleared if it exists.
    """
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    clears = [
        torch._C._clear_DTensor_sharding_propagator_cache,  # the C++ fast path's
        lambda: propagator.propagate_op_sharding.cache_clear(),
        lambda: propagator._propagate_tensor_meta_cached.cache_clear(),
        lambda: _redistribute._gen_transform_infos.cache_clear(),
        lambda: _redistribute.clear_redistribute_planner_cache(),
        lambda: _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear(),
    ]
    for clear in clears:
        with contextlib.suppress(AttributeError):
            clear()


def forget_group_names() -> None:
    """Number this process's next default group as a fresh process would.

    torch names every process group from a per-process counter
    (``distributed_c10d._world.group_count``) and meets its peers under that name in the
    store; it sets the counter back to 0 only when it destroys a default group that exists.
    A build that failed (a member died as the epoch formed) leaves the counter one up, so in
    the next member epoch the survivors met under group 1 and a fresh replacement under
    group 0, each waiting for keys the other never wrote until the collective timeout (the
    long soak: an FSDP2+TP epoch formed, then stood still 36 s until the recovery deadline).
    A private attribute of torch 2.13: left alone where it does not exist; never while a
    default group exists."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


def warm_up() -> None:
    """Run one tiny FSDP2 step on a group of this process alone, then drop it all.

    A warm spare waits anyway; the first sharded model a process builds pays about a
    second of one-time work (lazy imports, DTensor's operator tables), which would
    otherwise fall inside the recovery it is there to shorten. Best effort: a failure is
    said in one line and the spare goes on waiting."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        mesh = init_device_mesh("cpu", (1,))
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        optimizer = torch.optim.AdamW(net.parameters())
        net(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        del net, mesh, optimizer
    finally:
        dist.destroy_process_group()
        forget_meshes()
        gc.collect()
