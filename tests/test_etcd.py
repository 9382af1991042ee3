"""The etcd-v3 backend (ftrun/control/etcd.py) against real etcd (Debian's etcd-server).

Store semantics and bad input run against one member on loopback; the job runs across three
network-namespace hosts with a 3-member cluster (tests/infra/etcd_cluster.py), one member
per host. Skipped only when etcd-server (or, for the job, iproute2/iptables) is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from ftrun.control.auth import Signer
from ftrun.control.etcd import EtcdOptions, connect_etcd
from ftrun.control.store import JsonStore
from tests.infra.etcd_cluster import etcd_missing_reason, loopback_etcd
from tests.launch import REPO, Launch, launcher
from tests.lines import ElasticStep, find
from tests.test_multinode import TOKEN, HostLaunch, _stop_all

pytestmark = pytest.mark.skipif(etcd_missing_reason() is not None,
                                reason=etcd_missing_reason() or "")

HB_TIMEOUT_S = 5.0  # etcd elects a new leader in about a second: well inside it


def test_etcd_store_operations_signed_records_and_failover() -> None:
    """On a real etcd: compare_set keeps the first value, concurrent adds from several
    clients all count (transactions), appends keep their order, a wait wakes on another
    client's write and times out within its bound; unsigned or forged records and another
    prefix's keys are ignored; a dead first endpoint is skipped."""
    with loopback_etcd() as endpoint:
        # the first endpoint refuses connections: every request fails over to the second
        options = EtcdOptions.parse(f"127.0.0.1:1,{endpoint}", {"etcd_prefix": "/ftrun"})
        client = connect_etcd(options, 10, op_timeout_s=2)
        assert client.endpoint == endpoint
        assert client.compare_set("cs", "", "first") == b"first"
        assert client.compare_set("cs", "", "second") == b"first"
        assert client.compare_set("cs", "first", "third") == b"third"

        def adder() -> None:
            mine = connect_etcd(options, 10, op_timeout_s=5)
            for _ in range(20):
                mine.add("count", 1)
        threads = [threading.Thread(target=adder) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert client.add("count", 0) == 80
        for part in ("a", "b", "c"):
            client.append("log", part)
        assert client.get("log") == b"abc"

        started = time.monotonic()
        with pytest.raises(RuntimeError, match="wait timeout"):
            client.wait(["nothing"], timedelta(seconds=0.5))
        assert 0.4 < time.monotonic() - started < 5.0
        writer = connect_etcd(options, 10, op_timeout_s=2)
        timer = threading.Timer(0.3, lambda: writer.set("later", "x"))
        timer.start()
        started = time.monotonic()
        client.wait(["later"], timedelta(seconds=10))  # a watch, woken by the write
        assert time.monotonic() - started < 5.0
        timer.join()

        rejected: list[str] = []
        job = JsonStore(client, "ftrun/job", signer=Signer(TOKEN.encode()),
                        on_reject=rejected.append)
        rogue = JsonStore(writer, "ftrun/job")  # no secret
        rogue.put_record("gen/0/end", {"kind": "forged"})
        job.put_record("gen/0/end", {"kind": "real"})
        assert job.first_record("gen/0/end") == {"kind": "real"}
        rogue.set_record("hb/n1", {"seq": 99})
        assert job.get_record("hb/n1") is None and rejected
        # the same key names under another prefix are another job's: never seen here
        other = JsonStore(connect_etcd(EtcdOptions.parse(endpoint, {"etcd_prefix": "/other"}),
                                       10, op_timeout_s=2),
                          "ftrun/job", signer=Signer(TOKEN.encode()))
        other.set_record("latest", {"number": 7})
        assert job.get_record("latest") is None
        assert other.get_record("latest") == {"number": 7}


def _ftrun(args: list[str], script: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([launcher(), *args, str(script)], capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin",
                                                "FTRUN_JOB_TOKEN": TOKEN})


def test_etcd_bad_input_is_one_line(tmp_path: Path) -> None:
    """Unreachable endpoints: one line naming them, a non-zero exit, within the bound given
    (read_timeout) plus start-up; bad options: one line and exit 2; never a traceback."""
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    base = ["--nnodes", "2", "--rdzv-backend", "etcd-v3", "--rdzv-id", "bad"]
    started = time.monotonic()
    done = _ftrun([*base, "--rdzv-endpoint", "127.0.0.1:1,127.0.0.1:2",
                   "--rdzv-conf", "read_timeout=2"], script, 60)
    took = time.monotonic() - started
    assert done.returncode not in (0, 2), done
    assert "Traceback" not in done.stderr, done.stderr
    failure = [x for x in done.stderr.splitlines() if "cannot reach etcd" in x]
    assert len(failure) == 1 and "127.0.0.1:1" in failure[0] and "127.0.0.1:2" in failure[0], \
        done.stderr
    assert took < 30, took  # 2 s of tries + the interpreter and torch import on 2 cores
    for extra, says in [
        (["--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf", "protocol=ftp"], "protocol"),
        (["--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf", "protocol=https,cacert=/no/ca"],
         "cacert"),
        (["--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf", "etcd_prefix=no slash"],
         "etcd_prefix"),
        (["--rdzv-endpoint", "h1:99999"], "port"),
    ]:
        done = _ftrun([*base, *extra], script, 60)
        assert done.returncode == 2, (extra, done)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, lines
    done = _ftrun(["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379"],
                  script, 60)
    assert done.returncode == 2 and "etcd-v3" in done.stderr, done


# --- a job across three namespace hosts ----------------------------------------------------


@pytest.fixture
def etcd_net(infra_leak_check, netns_network, etcd_cluster):  # type: ignore[no-untyped-def]
    if subprocess.run(["sh", "-c", "command -v iptables || test -x /usr/sbin/iptables"],
                      capture_output=True).returncode != 0:
        pytest.skip("iptables not installed: run scripts/install_test_services.sh")
    return netns_network, etcd_cluster


def _etcd_job(net, cluster, job_dir: Path, steps: int = 100000) -> list[Launch]:  # type: ignore[no-untyped-def]
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    args = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
            "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", "etcdjob",
            "--rdzv-conf", "last_call_timeout=5", "--heartbeat-interval", "0.5",
            "--heartbeat-timeout", str(HB_TIMEOUT_S), "--recovery", "regroup"]
    train = [str(script), "--steps", str(steps), "--hidden", "64", "--step-sleep", "0.05"]
    env = {"GLOO_SOCKET_IFNAME": "eth0", "FTRUN_JOB_TOKEN": TOKEN}
    return [HostLaunch(host, [*args, "--local-addr", host.addr, *train], env=env, cwd=job_dir)
            for host in net]


def test_netns_etcd_member_killed_job_goes_on(job_dir: Path, etcd_net) -> None:  # type: ignore[no-untyped-def]
    """Three ftrun nodes on a 3-member etcd cluster, in-process regroup: the member every
    agent talks to first (h1's, the first endpoint) is SIGKILLed. The agents move to the
    next member; no node is declared lost, no generation ends, nothing restarts, and every
    worker goes on committing consecutive steps in the same process."""
    net, cluster = etcd_net
    nodes = _etcd_job(net, cluster, job_dir)
    try:
        for node in nodes:
            node.wait_for(lambda lines: len(find(lines, ElasticStep)) >= 10, 180,
                          "steps everywhere")
        before = [len(find(node.lines, ElasticStep)) for node in nodes]
        cluster.kill(0)
        killed = time.monotonic()
        # past the heartbeat timeout (a node whose beats stopped would be declared lost by
        # then) and 15 more committed steps on every node
        for node, count in zip(nodes, before, strict=True):
            node.wait_for(lambda lines, count=count: len(find(lines, ElasticStep)) >= count + 15,
                          120, "15 steps after the etcd member died")
        while time.monotonic() - killed < HB_TIMEOUT_S + 2.0:
            time.sleep(0.2)
        for node in nodes:
            steps = find(node.lines, ElasticStep)
            by_pid: dict[int, list[int]] = {}
            for step in steps:
                by_pid.setdefault(step.pid, []).append(step.step)
            assert len(by_pid) == 1, by_pid.keys()  # one worker process throughout
            (numbers,) = by_pid.values()
            assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
            assert len({s.gen for s in steps}) == 1 and steps[-1].world == 3, steps[-1]
            own = "\n".join(x for x in node.lines if "step=" not in x)
            for sign in ("lost", "ended", "restarting", "failed", "Traceback"):
                assert sign not in own, own[-3000:]
    finally:
        _stop_all(nodes)
