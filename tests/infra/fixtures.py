"""pytest fixtures for the real test infrastructure; registered by tests/conftest.py with
``pytest_plugins = ["tests.infra.fixtures"]``.

Fixtures (all function-scoped: a private Slurm starts in well under a second here and a
namespace network in about 0.1 s, so every test gets fresh ones and a fault injected by
one test cannot leak into the next):

- ``slurm_cluster``: a started :class:`SlurmCluster` (one node, 8 declared CPUs).
- ``netns_network``: a :class:`NetnsNetwork` of 3 hosts ``h1..h3``.
- ``netns_factory``: ``make(n) -> NetnsNetwork`` for other sizes; all closed at teardown.
- ``etcd_cluster``: a healthy 3-member etcd cluster, one member on each of
  ``netns_network``'s hosts (:class:`EtcdCluster`; skipped when etcd-server is missing).
- ``etcd_net``: ``(net, cluster)``, four namespace hosts with such a cluster on h1..h3.
- ``infra_leak_check``: fails the test if it leaves ftrun namespaces or cluster processes;
  request it first (before the fixtures it watches) so its check runs after their teardown.

Each skips with a stated reason when the machine cannot provide it (not root, slurm-wlm or
iproute2 missing: ``scripts/install_test_services.sh``).  Teardown also checks that
nothing was left behind and errors the test if something was.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator

import pytest

from tests.infra.etcd_cluster import EtcdCluster, etcd_missing_reason
from tests.infra.netns import NetnsHost, NetnsNetwork, ftrun_namespaces
from tests.infra.procs import pid_alive
from tests.infra.slurm_cluster import SlurmCluster, marked_processes

__all__ = ["etcd_cluster", "etcd_net", "infra_leak_check", "netns_factory", "netns_network",
           "slurm_cluster"]


@pytest.fixture
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A private one-node Slurm cluster; ``slurm_cluster.srun([...])`` runs a step on it."""
    cluster = SlurmCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        root = cluster.root
        cluster.stop()
        left = marked_processes(root)
        assert not left, f"slurm cluster {root} left processes {left}"
        assert not root.exists(), f"slurm cluster dir {root} not removed"


@pytest.fixture
def netns_factory() -> Iterator[Callable[..., NetnsNetwork]]:
    """``make(n=3, subnet=None)`` -> a started network; every one is torn down after the test."""
    made: list[NetnsNetwork] = []

    def make(n: int = 3, subnet: str | None = None) -> NetnsNetwork:
        net = NetnsNetwork(n=n, subnet=subnet)
        net.start()
        made.append(net)
        return net

    try:
        yield make
    finally:
        names = [name for net in made for name in net.namespaces]
        errors = []
        for net in reversed(made):
            try:
                net.close()
            except Exception as exc:  # keep closing the others
                errors.append(exc)
        left = set(names) & ftrun_namespaces()
        assert not errors and not left, f"namespaces left behind: {left or errors}"


@pytest.fixture
def netns_network(netns_factory: Callable[..., NetnsNetwork]) -> NetnsNetwork:
    """Three namespace hosts h1..h3 on a private /24 (``net["h1"].addr``, ``.run``...)."""
    return netns_factory(3)


@pytest.fixture
def infra_leak_check() -> Iterator[None]:
    """Fail a test that leaves ftrun namespaces or test-cluster processes it did not find."""
    ns_before = ftrun_namespaces()
    procs_before = set(marked_processes())
    yield
    ns_left = ftrun_namespaces() - ns_before
    procs_left = set(marked_processes()) - procs_before
    assert not ns_left, f"namespaces left behind: {sorted(ns_left)}"
    assert not procs_left, f"test-cluster processes left behind: {sorted(procs_left)}"


@contextlib.contextmanager
def _running_etcd(hosts: list[NetnsHost]) -> Iterator[EtcdCluster]:
    """An etcd cluster with one member on each of ``hosts``: every member killed and waited
    for, and its data removed, on the way out."""
    reason = etcd_missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = EtcdCluster(hosts)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        left = [p.pid for p in cluster.procs if p is not None and pid_alive(p.pid)]
        assert not left, f"etcd members left running: {left}"
        assert not cluster.root.exists(), f"etcd data {cluster.root} not removed"


@pytest.fixture
def etcd_cluster(netns_network: NetnsNetwork) -> Iterator[EtcdCluster]:
    """A 3-member etcd cluster on the namespace hosts h1..h3 (``.endpoints``, ``.kill(i)``)."""
    with _running_etcd(list(netns_network)) as cluster:
        yield cluster


@pytest.fixture
def etcd_net(infra_leak_check: None, netns_factory: Callable[..., NetnsNetwork]
             ) -> Iterator[tuple[NetnsNetwork, EtcdCluster]]:
    """Four namespace hosts and a 3-member etcd cluster on h1..h3: ftrun nodes on all four,
    so that a job can lose a node that serves no member (iptables needed: link cuts)."""
    if subprocess.run(["sh", "-c", "command -v iptables || test -x /usr/sbin/iptables"],
                      capture_output=True).returncode != 0:
        pytest.skip("iptables not installed: run scripts/install_test_services.sh")
    net = netns_factory(4)
    with _running_etcd(list(net)[:3]) as cluster:
        yield net, cluster
