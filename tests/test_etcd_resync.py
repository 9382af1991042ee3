"""The step resync of the first member epoch on a store that replaced a dead one
(ftrun/worker/api.py ``_resync_steps``; etcd-v3: the job's writer died with the store of
the step decisions).

Why a test of its own: in a job the resync only matters when the writer dies between a
step's ``commit`` and the slowest survivor reading it, a window of milliseconds that a job
test cannot aim at. Here two real worker processes on a real gloo group start the resync
from different committed steps and different parameters, as such survivors would.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

from tests.launch import free_port


def _member(rank: int, port: int, step: int, results: Any) -> None:
    """One survivor: ``step`` committed steps and parameters of its own, then the resync."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": "2"})
    import torch

    from ftrun import protocol as P
    from ftrun.worker.api import FaultTolerance

    torch.manual_seed(rank)
    ft = FaultTolerance(collective_timeout_s=30, fault_grace_s=1, max_regroups=1)
    model = torch.nn.Linear(8, 8)
    ft.register("model", model)
    ft._step = step
    ft.member_id = f"{rank}.0"
    epoch = P.MemberEpoch(4, (P.Member("0.0", 0, False), P.Member("1.0", 1, False)))
    ft._resync_steps(epoch, 0 if rank == 0 else 1)
    total = float(sum(p.detach().double().sum() for p in model.parameters()))
    results.put((rank, ft.step, round(total, 9)))
    ft.close()


def test_resync_gives_every_member_the_state_of_the_member_furthest_on() -> None:
    """Members at steps 7 and 8 (rank 0 read its last step's decision too late), each with
    parameters of its own: both end at step 8 with the same parameters, rank 1's (the
    lowest rank furthest on, not rank 0)."""
    steps = (7, 8)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_member, args=(rank, port, steps[rank], results))
             for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        got = dict((rank, (step, total)) for rank, step, total in
                   (results.get(timeout=120) for _ in procs))
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    assert [p.exitcode for p in procs] == [0, 0]
    assert got[0] == got[1] and got[0][0] == 8, got
