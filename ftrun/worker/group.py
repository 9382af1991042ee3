"""The swappable process group and the backends that go into it.

A DDP model (and any user code) holds one :class:`ResilientProcessGroup` for the whole job;
each member epoch swaps a fresh backend into it (gloo on CPU, NCCL on GPU), so nothing built
on the group has to be rebuilt after a regroup. Also here: what a backend needs from the
process (the torch settings that let a survivor outlive an aborted communicator), the
static group used outside ftrun's regroup mode, and how a failed backend is let go of.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftrun import protocol as P


class ResilientProcessGroup(dist.ProcessGroup):
    """A process group whose backend is replaced at each regroup.

    torch calls ``getRank``/``getSize`` through virtual methods, so DDP and user code see
    the current member epoch's rank and size; every collective goes to the current backend.
    """

    def __init__(self, backend: dist.ProcessGroup) -> None:
        super().__init__(backend.rank(), backend.size())
        self._backend = backend
        self.issued = 0  # collectives started in this step: tells a stalled rank apart

    @property
    def backend(self) -> dist.ProcessGroup:
        return self._backend

    def swap(self, backend: dist.ProcessGroup) -> None:
        self._backend = backend

    def getRank(self) -> int:
        return self._backend.rank()

    def getSize(self) -> int:
        return self._backend.size()

    def getBackendName(self) -> str:
        return "ftrun"

    def allreduce(self, tensors: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.broadcast(tensors, opts)

    def allgather(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.allgather(outputs, inputs, opts)

    def _allgather_base(self, output: Any, inp: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend._allgather_base(output, inp, opts)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.reduce_scatter(outputs, inputs, opts)

    def barrier(self, opts: Any) -> dist.Work:
        self.issued += 1
        return self._backend.barrier(opts)


def survive_aborts(user_chosen: frozenset[str],
                   environ: MutableMapping[str, str] = os.environ) -> None:
    """Switch this process to the torch settings a survivor needs (:data:`ftrun.protocol.
    SURVIVOR_TORCH_ENV`): torch's defaults tear the process down when a communicator is
    aborted. The agent kept torchrun's values (scripts without this API expect them) and
    names the ones the user set, which win."""
    for key, value in P.SURVIVOR_TORCH_ENV.items():
        if key not in user_chosen:
            environ[key] = value


def backend_name() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def make_backend(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """A backend of ``size`` ranks that meets its peers through ``store``."""
    if backend_name() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def solo_backend(timeout: timedelta) -> Any:
    """A group of this process alone: what a member holds between member epochs."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout)


def static_backend(timeout: timedelta, environ: Mapping[str, str] = os.environ) -> Any:
    """Outside ftrun's regroup mode: an ordinary group from torchrun's variables.

    torch's own env:// rendezvous decides who serves the store (the launcher's, or rank
    0's); the key prefix carries the restart count, so a restarted worker never reads
    an address that a worker of the previous attempt left in a store that outlived it.
    """
    store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return make_backend(dist.PrefixStore(f"ftrun/static/{attempt}/", store), rank, size,
                        timeout)


def renew_reducer(model: DistributedDataParallel) -> None:
    """Give a DDP model a fresh reducer, as its unpickling does.

    Survivors' reducers have rebuilt their buckets in gradient order and may hold state of
    the failed step, while a joiner's is new: gradients would be reduced in mismatched
    layouts. A fresh reducer on every member restores one layout, and the one-time bucket
    rebuild then happens on all members at the same step. (Comm hooks are not carried
    over: register them again in an ``on_regroup`` callback.)
    """
    parameters, sparse = model._build_params_for_reducer()
    names = model._build_debug_param_to_name_mapping(parameters)
    model._ddp_init_helper(parameters, sparse, names, model.static_graph)
    model._has_rebuilt_buckets = False
    if model.static_graph:
        model.reducer._set_static_graph()


def release(holder: list[Any]) -> None:
    """Abort and drop the one backend in ``holder`` (a thread's target: the destructor
    joins the backend's threads, and the list lets the caller give up its reference)."""
    backend = holder.pop()
    with contextlib.suppress(RuntimeError):
        backend.abort()
    del backend  # the destructor closes the backend's connections
