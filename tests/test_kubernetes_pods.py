"""A JobSet on namespace hosts: each host is a pod, with the environment and stable names a
JobSet gives it, and ``ftrun`` runs in it with no rendezvous flag (ftrun.host.kubernetes).

Three hosts are the three pods of JobSet ``demo``, replicated job ``workers``
(``JOBSET_REPLICAS=3``, one pod per Job), with ``FTRUN_STANDBY_NODES=1``: two train and one
stands by. Each pod's ``HOSTNAME`` is ``demo-workers-<index>-0``; the headless Service's
names (``demo-workers-<index>-0.demo``) resolve through a hosts file of each namespace
(``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``: the cluster
DNS of this simulation). The test kills one training pod (its agent and workers, as a node
failure takes a pod): the standby pod's worker takes the lost rank in process, the job goes
on; then Kubernetes' replacement, a pod with the same index on the same host, joins; and
every pod exits 0 when the job ends.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch import REPO
from tests.lines import ElasticStep, find
from tests.test_multinode import HostLaunch

TOKEN = "kubernetes-test-token"
STEPS = 400
#: From the kill to the standby's first step: detection through the presence connection, the
#: regroup and the state sent to the joiner; seconds here. 10x the goal fails.
KILL_TO_STEP_S = 30.0


def pod_env(index: int) -> dict[str, str]:
    """What the JobSet manifests in scripts/kubernetes/ give a pod's container."""
    return {"HOSTNAME": f"demo-workers-{index}-0", "JOBSET_NAME": "demo",
            "JOBSET_REPLICATED_JOB": "workers", "JOBSET_REPLICAS": "3",
            "JOBSET_JOB_INDEX": str(index), "JOBSET_RESTART_ATTEMPT": "0",
            "JOB_COMPLETION_INDEX": "0", "FTRUN_STANDBY_NODES": "1",
            "GLOO_SOCKET_IFNAME": "eth0", "FTRUN_JOB_TOKEN": TOKEN}


@contextlib.contextmanager
def _named_as_pods(hosts: list) -> Iterator[None]:  # type: ignore[type-arg]
    """Hosts files that name ``hosts`` as the JobSet's pods 0, 1, ... in every namespace of
    the network (the cluster DNS of this simulation)."""
    lines = ["127.0.0.1 localhost"] + [
        f"{host.addr} demo-workers-{i}-0.demo demo-workers-{i}-0"
        for i, host in enumerate(hosts)]
    made = []
    try:
        for host in hosts[0].network:
            folder = Path("/etc/netns") / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            made.append(folder)
            (folder / "hosts").write_text("\n".join(lines) + "\n")
        yield
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def pods(infra_leak_check, netns_factory) -> Iterator:  # type: ignore[no-untyped-def]
    """Three namespace hosts that are the JobSet's three pods."""
    net = netns_factory(3)
    with _named_as_pods(list(net)):
        yield list(net)


@pytest.fixture
def etcd_pods(etcd_net) -> Iterator:  # type: ignore[no-untyped-def]
    """h2..h4 are the pods; the etcd cluster's members run on h1..h3 (a StatefulSet)."""
    net, cluster = etcd_net
    with _named_as_pods(list(net)[1:]):
        yield list(net)[1:], cluster


def _start(host, index: int, job_dir: Path, *flags: str) -> HostLaunch:  # type: ignore[no-untyped-def]
    script = job_dir / "train_elastic.py"
    if not script.exists():
        shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    args = ["--nproc-per-node", "1", "--recovery", "regroup", "--preload", "none",
            "--heartbeat-interval", "1", "--heartbeat-timeout", "30", *flags,
            str(script), "--steps", str(STEPS), "--hidden", "32", "--step-sleep", "0.05"]
    return HostLaunch(host, args, env=pod_env(index), cwd=job_dir)


def _lose_a_training_pod_and_recreate_it(pods: list, job_dir: Path,  # type: ignore[type-arg]
                                         *flags: str) -> None:
    """Start the three pods, kill one that trains (agent and workers, as a node failure
    takes a pod), check the standby pod's worker takes its rank in process, start the
    recreated pod, and check every pod ends with exit 0."""
    nodes = {i: _start(host, i, job_dir, *flags) for i, host in enumerate(pods)}
    nodes[0].wait_for(lambda lines: bool(find(lines, ElasticStep)) or any(
        "standing by" in x for x in lines), 180, "pod 0 training or standing by")
    standing: list[int] = []
    deadline = time.monotonic() + 120
    while len(standing) != 1 and time.monotonic() < deadline:
        standing = [i for i, n in nodes.items() if any("standing by" in x for x in n.lines)]
        time.sleep(0.2)
    assert len(standing) == 1, {i: n.output[-2000:] for i, n in nodes.items()}
    training = sorted(set(nodes) - set(standing))
    for i in training:
        nodes[i].wait_for(lambda lines: len(find(lines, ElasticStep)) >= 10, 180,
                          f"steps on pod {i}")
    standby = nodes[standing[0]]
    assert not find(standby.lines, ElasticStep), "the standby pod stepped before any loss"
    # the pod that does not host a c10d store (pod 0's agent does; under etcd, any)
    victim = training[-1]
    survivor = nodes[training[0]]
    nodes[victim].kill()
    killed = time.time()
    standby.wait_for(lambda lines: any(s.world == 2 for s in find(lines, ElasticStep)), 120,
                     "the standby pod's worker stepping in the world of 2")
    taken = min(s.t for s in find(standby.lines, ElasticStep))
    print(f"pod killed to the standby's first step: {taken - killed:.2f} s")
    assert taken - killed < KILL_TO_STEP_S, taken - killed
    out = survivor.output + standby.output
    assert "restarting" not in out, out[-3000:]
    # Kubernetes recreates the pod: same index, same name, same host here.
    replacement = _start(pods[victim], victim, job_dir, *flags)
    for name, node in ((f"pod {training[0]}", survivor), ("the promoted standby", standby),
                       ("the recreated pod", replacement)):
        assert node.wait(300) == 0, f"{name}: {node.output[-3000:]}"


def test_a_jobset_pod_needs_no_rendezvous_flag_and_a_lost_pod_is_absorbed(
        job_dir: Path, pods) -> None:  # type: ignore[no-untyped-def]
    """c10d: the store on the first pod, every other fact from the pods' environment."""
    _lose_a_training_pod_and_recreate_it(pods, job_dir)


@pytest.mark.long  # the c10d test above takes this path; test_etcd_standby.py the backend's
def test_the_same_with_an_etcd_statefulset(job_dir: Path, etcd_pods) -> None:  # type: ignore[no-untyped-def]
    """etcd-v3: the manifest names the etcd members (scripts/kubernetes/jobset-etcd.yaml);
    the node count, run id, standby count and each pod's address still come from the pod."""
    hosts, cluster = etcd_pods
    _lose_a_training_pod_and_recreate_it(
        hosts, job_dir, "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", cluster.endpoints)
