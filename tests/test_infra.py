"""The test infrastructure works for real: namespace hosts talk TCP, faults bite and heal,
a private Slurm runs steps, and ftrun.host.slurm parses what real srun tasks see.

Every test checks that it left no namespace, daemon or process behind.  The fixtures come
from tests/infra/fixtures.py, registered by tests/conftest.py (``pytest_plugins``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.infra.netns import (
    NetnsHost,
    NetnsNetwork,
    ftrun_namespaces,
    tcp_connect,
    wait_tcp,
)
from tests.infra.slurm_cluster import SlurmCluster, marked_processes

REPO = Path(__file__).resolve().parent.parent
PORT = 7000

# A line-echo server: replies "<its hostname-ish tag> <line>" so the client knows who answered.
_ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    tag = sys.argv[1]
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", int(sys.argv[2])))
    srv.listen(512)
    def serve(c):
        with c:
            data = c.recv(1024)
            if data:
                c.sendall(tag.encode() + b" " + data)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
    """
)


def _start_echo(host: NetnsHost, port: int = PORT) -> subprocess.Popen[bytes]:
    return host.popen([sys.executable, "-c", _ECHO_SERVER, host.name, str(port)])


def _echo(host_from: NetnsHost, addr: str, port: int = PORT, timeout: float = 2.0) -> str:
    with host_from.socket() as s:
        s.settimeout(timeout)
        s.connect((addr, port))
        s.sendall(b"hello")
        return s.recv(1024).decode()


def _attempts(host_from: NetnsHost, addr: str, n: int, timeout: float) -> int:
    """n concurrent TCP connects; how many succeeded.  Concurrent to bound the time."""

    def one(_: int) -> bool:
        try:
            tcp_connect(host_from, addr, PORT, timeout)
        except OSError:
            return False
        return True

    with ThreadPoolExecutor(max_workers=n) as ex:
        return sum(ex.map(one, range(n)))


# ----------------------------------------------------------------------------- netns
def test_three_hosts_reach_each_other(infra_leak_check: None, netns_network: NetnsNetwork) -> None:
    net = netns_network
    assert [h.name for h in net] == ["h1", "h2", "h3"]
    assert len({h.addr for h in net}) == 3
    for h in net:
        _start_echo(h)
    for src in net:
        for dst in net:
            if src is dst:
                continue
            wait_tcp(src, dst.addr, PORT, timeout=10)
            assert _echo(src, dst.addr) == f"{dst.name} hello"
    # A subprocess client inside h1 (host.run) sees the same network.
    client = (
        "import socket,sys; s=socket.create_connection((sys.argv[1], 7000), timeout=5);"
        "s.sendall(b'x'); print(s.recv(64).decode())"
    )
    res = net["h1"].run([sys.executable, "-c", client, net["h3"].addr], timeout=20)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "h3 x"


def test_cut_link_and_restore(infra_leak_check: None, netns_network: NetnsNetwork) -> None:
    h1, h2, _ = netns_network
    _start_echo(h2)
    wait_tcp(h1, h2.addr, PORT, timeout=10)
    netns_network.cut_link(h2)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        wait_tcp(h1, h2.addr, PORT, timeout=0.5, attempt_timeout=0.25)
    assert time.monotonic() - start < 2.0  # bounded by the deadline, not a TCP timeout
    # The cut host still has its own address (a silent cable cut, not a missing device).
    assert h2.addr in h2.run(["ip", "-o", "addr", "show", "eth0"]).stdout
    netns_network.restore_link(h2)
    assert wait_tcp(h1, h2.addr, PORT, timeout=5) < 5
    assert _echo(h1, h2.addr) == "h2 hello"


def test_packet_loss_drops_a_fraction(infra_leak_check: None, netns_network: NetnsNetwork) -> None:
    h1, h2, _ = netns_network
    _start_echo(h2)
    wait_tcp(h1, h2.addr, PORT, timeout=10)
    n = 100
    start = time.monotonic()
    # Incoming only: a connect then fails iff its one SYN is dropped (p=0.5), as the
    # 0.3 s attempt timeout is below the 1 s SYN retransmit.
    netns_network.add_loss(h2, 0.5, direction="in")
    ok_half = _attempts(h1, h2.addr, n, timeout=0.3)
    netns_network.add_loss(h2, 1.0)
    ok_none = _attempts(h1, h2.addr, 20, timeout=0.3)
    netns_network.clear_loss(h2)
    ok_all = _attempts(h1, h2.addr, n, timeout=2.0)
    elapsed = time.monotonic() - start
    assert 20 <= ok_half <= 80, ok_half  # binomial(100, 0.5): 6 sigma either side
    assert ok_none == 0
    assert ok_all == n
    assert elapsed < 5.0, elapsed
    # Loss rules are in the host's namespace only: the root namespace has none.
    assert "FTRUN_LOSS" not in subprocess.run(
        ["iptables", "-S"], capture_output=True, text=True
    ).stdout


def test_netns_teardown_kills_everything_inside() -> None:
    """Also processes the test did not start through popen (a daemonized server)."""
    before = ftrun_namespaces()
    with NetnsNetwork(2) as net:
        tracked = net["h1"].popen(["sleep", "600"])
        # setsid + background: not our child, not in our process group.
        net["h2"].run("setsid sleep 600 >/dev/null 2>&1 < /dev/null &", timeout=10)
        deadline = time.monotonic() + 5
        while not net["h2"].pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        stray = net["h2"].pids()
        assert stray, "the daemonized sleep did not show up in h2"
        names = net.namespaces
        assert set(names) <= ftrun_namespaces()
    assert tracked.poll() is not None
    for pid in stray:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert ftrun_namespaces() == before
    assert not set(names) & ftrun_namespaces()


# ----------------------------------------------------------------------------- slurm
def _clean_env() -> dict[str, str]:
    """Task environment for srun: ftrun importable, no GPUs or port overrides leaking in."""
    return {
        "PYTHONPATH": str(REPO),
        "CUDA_VISIBLE_DEVICES": "",
        "FTRUN_RDZV_PORT": "",
    }


def test_srun_two_tasks(infra_leak_check: None, slurm_cluster: SlurmCluster) -> None:
    res = slurm_cluster.srun(
        ["-N1", "-n2", "bash", "-c", "echo $SLURM_PROCID $SLURM_NTASKS"], timeout=30
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.split("\n")[:-1]) == ["0 2", "1 2"]


_PRINT_DEFAULTS = textwrap.dedent(
    """
    import json, os
    from ftrun.host.slurm import SlurmEnvironment, slurm_launch_defaults
    for k in ("CUDA_VISIBLE_DEVICES", "FTRUN_RDZV_PORT"):
        if not os.environ.get(k):
            os.environ.pop(k, None)
    s = SlurmEnvironment()
    print(json.dumps({
        "in_slurm": s.in_slurm,
        "defaults": slurm_launch_defaults(),
        "procid": os.environ.get("SLURM_PROCID"),
        "jobid": os.environ.get("SLURM_JOB_ID"),
        "hosts": list(s.hostnames) if s.in_slurm else None,
        "tpn": list(s.ntasks_per_node) if s.in_slurm else None,
    }))
    """
)


def test_slurm_environment_of_real_srun_tasks(
    infra_leak_check: None, slurm_cluster: SlurmCluster
) -> None:
    res = slurm_cluster.srun(
        ["-N1", "-n2", sys.executable, "-c", _PRINT_DEFAULTS], env=_clean_env(), timeout=60
    )
    assert res.returncode == 0, res.stderr
    tasks = sorted((json.loads(line) for line in res.stdout.splitlines()),
                   key=lambda t: t["procid"])
    assert [t["procid"] for t in tasks] == ["0", "1"]
    node = slurm_cluster.node_name
    for rank, task in enumerate(tasks):
        assert task["in_slurm"] is True
        assert task["hosts"] == [node]
        assert task["tpn"] == [2]
        assert task["defaults"] == {
            "nnodes": "2",  # two agents share the one node: one rendezvous node per task
            "node_rank": str(rank),
            "rdzv_id": f"{task['jobid']}.0",
            "rdzv_backend": "c10d",
            "rdzv_endpoint": f"{node}:29400",
        }


def test_slurm_batch_script_and_its_steps(
    infra_leak_check: None, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A real sbatch job: the batch script (SLURM_PROCID=0 set, yet not a step) gets no
    defaults; its second srun step (step 1, two tasks) gets the step's values."""
    prog = tmp_path / "print_defaults.py"
    prog.write_text(_PRINT_DEFAULTS)
    batch_out, step_out = tmp_path / "batch.json", tmp_path / "step.json"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH -N1 -n2\nset -e\n"
        f"{sys.executable} {prog} > {batch_out}\n"
        "srun -n1 true\n"  # step 0; the one checked below is step 1
        f"srun -n2 {sys.executable} {prog} > {step_out}\n"
    )
    job = slurm_cluster.sbatch([f"--output={tmp_path / 'job.log'}", str(script)],
                               env=_clean_env())
    state = slurm_cluster.wait_job(job, timeout=60)
    log = (tmp_path / "job.log").read_text() if (tmp_path / "job.log").exists() else ""
    assert state == "COMPLETED", log
    batch = json.loads(batch_out.read_text())
    assert batch["procid"] == "0"
    assert batch["in_slurm"] is False
    assert batch["defaults"] == {}
    steps = sorted((json.loads(line) for line in step_out.read_text().splitlines()),
                   key=lambda t: t["procid"])
    assert [t["defaults"]["node_rank"] for t in steps] == ["0", "1"]
    assert {t["defaults"]["rdzv_id"] for t in steps} == {f"{job}.1"}
    assert {t["defaults"]["nnodes"] for t in steps} == {"2"}


def test_slurm_cluster_teardown_and_stale_reaping(infra_leak_check: None) -> None:
    """stop() kills a running step's tasks; a dead run's cluster is reaped by the next."""
    stale = SlurmCluster()
    stale.start()
    # A step still running, as a test killed mid-way would leave it.
    srun = subprocess.Popen(
        ["srun", "-N1", "-n1", "sleep", "600"], env=stale.env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if "R" in stale.run(["squeue", "-h", "-o", "%t"]).stdout:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the sleep step never ran")
    daemons = [int((stale.root / f).read_text()) for f in ("slurmctld.pid", "slurmd.pid")]
    # Pretend the owning test process died without teardown.
    dead = subprocess.Popen(["true"])
    dead.wait()
    (stale.root / "owner.pid").write_text(f"{dead.pid}\n")
    stale_root = stale.root
    assert len(marked_processes(stale_root)) >= 4  # munged, slurmctld, slurmd, stepd, sleep

    with SlurmCluster() as fresh:
        assert not stale_root.exists()
        assert marked_processes(stale_root) == []
        assert all(not Path(f"/proc/{p}").exists() or _zombie(p) for p in daemons)
        res = fresh.srun(["-n1", "hostname"], timeout=30)
        assert res.returncode == 0, res.stderr
        fresh_root = fresh.root
    assert not fresh_root.exists()
    assert marked_processes(fresh_root) == []
    srun.wait(timeout=10)  # it lost its controller: it must not outlive the test
    stale._started = False  # already reaped; nothing left to stop


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_two_clusters_coexist(infra_leak_check: None, slurm_cluster: SlurmCluster) -> None:
    """A second cluster of the same process neither reaps nor disturbs the first."""
    with SlurmCluster(cpus=2) as other:
        assert other.ctld_port != slurm_cluster.ctld_port
        for c in (slurm_cluster, other):
            res = c.srun(["-n1", "bash", "-c", "echo $SLURM_CONF"], timeout=30)
            assert res.returncode == 0, res.stderr
            assert res.stdout.strip() == str(c.conf)
    assert slurm_cluster.root.exists()


def test_stale_namespaces_of_a_dead_run_are_reaped(infra_leak_check: None) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"ftrun-h1-{dead.pid}-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        sleeper = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "600"],
                                   start_new_session=True)
        with NetnsNetwork(1):
            assert name not in ftrun_namespaces(any_owner=True)
        assert sleeper.wait(timeout=10) != 0  # killed by the reaper
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_skips_with_a_reason_when_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.infra.netns as netns_mod
    import tests.infra.slurm_cluster as cluster_mod

    monkeypatch.setattr(cluster_mod, "_which", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match=r"slurm-wlm not installed.*install_test"):
        SlurmCluster().start()
    monkeypatch.setattr(netns_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="need root"):
        NetnsNetwork(2).start()


def _script_module(name: str) -> Any:
    """scripts/``name``.py, imported by path (scripts/ is not a package); registered in
    ``sys.modules`` first, where its dataclasses look their module up."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_under_test",
                                                  REPO / f"scripts/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_an_etcd_members_cpu_profile_is_summed_by_function() -> None:
    """The source of the benchmark's ``--etcd-profile``: a loopback member started with
    profiling answers a CPU profile while it serves requests, scripts/goprofile.py sums it
    by function, with etcd's own functions among the costliest; what is not a profile is a
    ValueError, and a member started without profiling answers none."""
    import gzip
    import threading

    from ftrun.control.etcd import EtcdOptions, connect_etcd
    from tests.infra.etcd_cluster import etcd_missing_reason, loopback_etcd

    if reason := etcd_missing_reason():
        pytest.skip(reason)
    goprofile = _script_module("goprofile")
    with loopback_etcd(profiling=True) as endpoint:
        client = connect_etcd(EtcdOptions.parse(endpoint, {}), 10)
        stop = threading.Event()

        def serve_puts() -> None:
            while not stop.is_set():
                client.set("profiled", "v" * 256)

        loader = threading.Thread(target=serve_puts)
        loader.start()
        try:
            profile = goprofile.cpu_profile(endpoint, 1.0)
        finally:
            stop.set()
            loader.join(10)
            client.drop_idle()
    sampled_s, functions = goprofile.top(profile, 40)
    assert 0 < sampled_s < 10, sampled_s
    assert any(f.name.startswith("go.etcd.io/etcd/") for f in functions), functions[:5]
    assert all(f.cumulative_s >= f.flat_s >= 0 for f in functions)
    assert [f.cumulative_s for f in functions] == sorted(
        (f.cumulative_s for f in functions), reverse=True)
    with pytest.raises(ValueError):
        goprofile.top(gzip.compress(b"\x12\x05\x0a"))  # a sample that runs past its end
    with pytest.raises(ValueError):
        goprofile.top(b"<html>not found</html>")
    with loopback_etcd() as endpoint, pytest.raises(OSError):
        goprofile.cpu_profile(endpoint, 1.0)


def test_the_watch_cost_benchmark_confirms_and_fires_watches_both_ways() -> None:
    """scripts/etcd_watch_grpc.py against a real member: its hand-made ``WatchRequest``
    is confirmed, each watcher's event arrives, through the gateway and natively, and its
    reading of ``WatchResponse`` tells the kinds apart."""
    from tests.infra.etcd_cluster import etcd_missing_reason, loopback_etcd

    if reason := etcd_missing_reason():
        pytest.skip(reason)
    bench = _script_module("etcd_watch_grpc")
    assert bench.watch_response_kind(b"\x18\x01") == "created"
    assert bench.watch_response_kind(b"\x18\x01\x5a\x00") == "events"
    assert bench.watch_response_kind(b"\x20\x01") == "canceled"
    assert bench.watch_response_kind(b"\x10\x05") == "other"
    with loopback_etcd() as endpoint:
        for way in ("gateway", "native"):  # RuntimeError unless every watch fired
            bench.measure_round(endpoint, way, 3, 20.0, "test")
