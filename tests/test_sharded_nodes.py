"""Sharded training survives the loss of a whole node: the lost shards come from the buddy.

Two network-namespace hosts (tests/infra: root and iproute2 needed, else skipped with the
reason), one real ftrun agent each, FSDP2 (scripts/train_fsdp.py under
``ftrun.restartable``, K=1) with two workers per node and two warm spares on h1. Every
snapshot is copied by h1's and h2's agents to each other (a ring of two). h2's agent and
workers are SIGKILLed mid-run and its snapshot memory removed (a lost node's RAM is gone):
the leader declares h2 lost, the spares take the lost ranks and restore their shards from
the replicas h1's agent holds. One run checks:

* the job finishes (h1's agent exits 0) and its final parameters are bitwise equal to a
  fault-free run of the same world size on one host (each step's data depends on (seed,
  step, rank) only; gloo's collectives do the same arithmetic whatever the hosts);
* every rank of the new member epoch restored the same snapshot, and it is at most K steps
  behind the last step every rank had committed before the kill;
* the survivors re-entered in their own processes (same pids before and after), and two
  spares restored ranks (they were not members before the fault);
* h1's snapshot memory (its replicas included) is gone after the job, and no process or
  namespace is left behind (the conftest and infra fixtures).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ftrun.snapshot import memory
from tests.launch import PRELOAD, REPO, Launch
from tests.lines import Done, Restored, Step, find, parse
from tests.test_multinode import HB, TOKEN, HostLaunch

SCRIPT = REPO / "scripts" / "train_fsdp.py"
STEPS = 24
K = 1
JOB_TIMEOUT_S = 120.0


def _digest(launches: list[Launch]) -> str:
    done = [d for launch in launches for d in find(launch.lines, Done)]
    assert sorted(d.rank for d in done) == [0, 1, 2, 3], [d.where() for d in done]
    assert {d.steps for d in done} == {STEPS}, [d.where() for d in done]
    digests = {d.param_sum for d in done}
    assert len(digests) == 1, [d.where() for d in done]
    return digests.pop()


def _train(script: Path) -> list[str]:
    return [str(script), "--steps", str(STEPS), "--step-sleep", "0.1"]


def test_node_lost_shards_restored_from_buddy_bitwise(
        job_dir: Path, infra_leak_check: None,
        netns_factory: Callable[..., object]) -> None:
    script = job_dir / "train_fsdp.py"
    shutil.copy(SCRIPT, script)
    net = netns_factory(2)
    leader = net["h1"]  # type: ignore[index]
    common = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"{leader.addr}:29400", "--rdzv-id", "nssharded",
              "--rdzv-conf", "last_call_timeout=15", *HB, "--recovery", "regroup", *PRELOAD]
    env = {"GLOO_SOCKET_IFNAME": "eth0", "FTRUN_JOB_TOKEN": TOKEN}
    h1 = HostLaunch(leader, [*common, "--spares", "2", "--local-addr", leader.addr,
                             *_train(script)], env=env, cwd=job_dir)
    h2_host = net["h2"]  # type: ignore[index]
    h2 = HostLaunch(h2_host, [*common, "--local-addr", h2_host.addr, *_train(script)],
                    env=env, cwd=job_dir)
    Launch.running.extend([h1, h2])
    # Both nodes compute, and every rank has committed a few steps.
    for node in (h1, h2):
        node.wait_for(lambda lines: len({s.rank for s in find(lines, Step) if s.step >= 3})
                      == 2, 180, "every rank of this node past step 3")
    h1_dirs = [p for p in Path("/dev/shm").glob(f"{memory.PREFIX}nssharded-*")
               if p.name.endswith(f"-{h1.proc.pid}")]
    before = parse(h1.lines)
    survivors = {s.pid for s in before if isinstance(s, Step)}
    h2.kill()  # its agent, its workers, and (below) the node's memory
    killed = time.time()
    assert h2.proc.returncode == -9
    committed = min(max(s.step for s in find(node.lines, Step) if s.rank == rank)
                    for node, ranks in ((h1, (0, 1)), (h2, (2, 3))) for rank in ranks)
    gone = memory.remove_stale()
    assert any(p.name.endswith(f"-{h2.proc.pid}") for p in gone), gone
    # Done on every rank, or a restore that failed (said in one line; no waiting it out).
    h1.wait_for(lambda lines: len(find(lines, Done)) == 4 or any(
        "Traceback" in x or "SnapshotRestoreError" in x for x in lines), JOB_TIMEOUT_S,
        "every rank done")
    assert "Traceback" not in h1.output, h1.output[-4000:]
    assert h1.wait(60) == 0, h1.output[-4000:]
    print(f"job done {time.time() - killed:.1f} s after the kill")
    # Bitwise equal to a fault-free run: 4 workers on one host, the same world and seed.
    reference = Launch(["--nproc-per-node", "4", "--recovery", "regroup", *PRELOAD,
                        *_train(script)])
    assert reference.wait(JOB_TIMEOUT_S) == 0, reference.output[-3000:]
    assert not find(reference.lines, Restored)
    assert _digest([h1]) == _digest([reference])
    records = parse(h1.lines)
    restored = [r for r in records if isinstance(r, Restored)]
    assert sorted(r.rank for r in restored) == [0, 1, 2, 3], [r.where() for r in restored]
    assert len({(r.step, r.epoch, r.taken_in) for r in restored}) == 1, \
        [r.where() for r in restored]
    step = restored[0].step
    assert 0 <= committed - step <= K, f"restored step {step}; every rank had {committed}"
    # The lost ranks went to the spares (members that were never in the first epoch).
    newcomers = [r for r in restored if r.source and r.source.startswith("member")
                 and r.source.split("member")[1].split(".")[1] not in ("0", "1")]
    assert len(newcomers) == 2, [r.where() for r in restored]
    after = [s for s in records[len(before):] if isinstance(s, Step) and s.step > step]
    print(f"node SIGKILLed to the first step after: {min(s.t for s in after) - killed:.2f} s "
          f"(heartbeat timeout {HB[-1]} s); restored step {step}, {committed} committed")
    for pid in survivors:  # re-entered in the same process and went on
        assert any(s.pid == pid for s in after), f"survivor {pid} printed no step after"
    assert "Traceback" not in h1.output, h1.output[-4000:]
    assert h1_dirs and not any(p.exists() for p in h1_dirs), h1_dirs
