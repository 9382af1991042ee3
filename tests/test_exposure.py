"""Who can reach a job's stores: a single node's only from that host, a multi-node job's on
the address the other nodes use.

torch's ``TCPStore`` server binds the wildcard address whatever host name it is given, so a
single-node job's control store and worker store used to listen on every interface: anyone
who could reach the host could write the peer addresses torch's process-group bootstrap
reads, or delete keys. ftrun now binds the listening socket itself and hands it to the
store (``ftrun.control.tcpstore.serve_store``). Checked here on namespace hosts (a host with
an address of its own on a private network, tests/infra/netns.py), with real jobs: the
kernel's socket tables of the agents' processes, and real connects from another host.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import shutil
import signal
import struct
import sys
from pathlib import Path

import pytest

from ftrun.control.errors import StoreError
from ftrun.control.tcpstore import serve_store
from ftrun.host.hostnet import store_bind_address
from tests.infra.netns import tcp_connect
from tests.launch import copy_train_script
from tests.test_multinode import TOKEN, HostLaunch, _wait_all_succeed

_LISTEN = "0A"


def _listening(pid: int) -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket in ``pid``'s network
    namespace (the kernel's tables, /proc/PID/net/tcp and tcp6)."""
    found: dict[int, tuple[str, int]] = {}
    for table, size in (("tcp", 4), ("tcp6", 16)):
        try:
            text = Path(f"/proc/{pid}/net/{table}").read_text()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # the kernel prints each 32-bit word in host order
            words = struct.unpack(f"<{size // 4}I", raw)
            packed = struct.pack(f">{size // 4}I", *words)
            found[int(fields[9])] = (str(ipaddress.ip_address(packed)), int(hex_port, 16))
    return found


def _owned_listeners(pid: int) -> list[tuple[str, int]]:
    """The listening TCP sockets process ``pid`` holds (its fds' socket inodes)."""
    table = _listening(pid)
    owned = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in table:
                owned.append(table[inode])
    return sorted(owned)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def test_serve_store_listens_on_the_address_it_is_given() -> None:
    """The store's own listening socket is on loopback by default, on a given address when
    asked, and a connect to this host's other addresses is refused."""
    store = serve_store(0, 10)
    mine = _owned_listeners(os.getpid())
    assert ("127.0.0.1", int(store.port)) in mine, mine
    assert not [a for a in mine if a[1] == store.port and a[0] != "127.0.0.1"], mine
    with pytest.raises(StoreError, match="does not resolve"):
        serve_store(0, 10, host="no-such-host.invalid")
    assert store_bind_address(single_node=True, rdzv_host="10.1.2.3", local_addr=None) \
        == "127.0.0.1"
    assert store_bind_address(single_node=False, rdzv_host="127.0.0.1", local_addr=None) \
        == "127.0.0.1"
    # a name that is not this host's and no --local-addr: every interface (the agent warns)
    assert store_bind_address(single_node=False, rdzv_host="192.0.2.254",
                              local_addr=None) is None


_REPLICA_SERVER = """\
import sys
from pathlib import Path
from ftrun.agent.snapshots import NodeSnapshots
snapshots = NodeSnapshots("exposure", sys.argv[1], Path(sys.argv[2]), serve=True)
assert snapshots.server is not None, snapshots.warning
print(*snapshots.server._server.server_address[:2], flush=True)
print(snapshots.warning, flush=True)
snapshots.close()
"""


def test_netns_replica_server_listens_on_the_nodes_address(
        tmp_path: Path, infra_leak_check, netns_network) -> None:  # type: ignore[no-untyped-def]
    """A multi-node regroup job's snapshot replica server, with no ``--local-addr``,
    listens where the node's host name resolves (before: on every interface), each a real
    server in a namespace host whose own hosts file names it (``ip netns exec`` mounts
    /etc/netns/NAME/hosts over /etc/hosts): a name for h1's address listens there; a name
    on a Debian-style 127.0.1.1 line listens on every interface, and says so (the other
    nodes resolve that name elsewhere); a loopback literal listens on loopback."""
    h1 = netns_network["h1"]
    etc = Path("/etc/netns") / h1.netns
    etc.mkdir(parents=True, exist_ok=True)
    try:
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{h1.addr} node-h1\n"
                                   "127.0.1.1 node-deb\n")
        for name, expected, warned in (("node-h1", h1.addr, False),
                                       ("node-deb", "0.0.0.0", True),
                                       ("127.0.0.1", "127.0.0.1", False)):
            done = h1.run([sys.executable, "-c", _REPLICA_SERVER, name, str(tmp_path)],
                          env={**os.environ, "FTRUN_JOB_TOKEN": TOKEN}, timeout=60)
            assert done.returncode == 0, done.stderr
            address, port = done.stdout.split()[:2]
            assert address == expected and int(port) > 0, (name, done.stdout)
            said = "served on every interface" in done.stdout
            assert said == warned, (name, done.stdout)
    finally:
        shutil.rmtree(etc, ignore_errors=True)


def test_netns_single_node_stores_are_loopback_only_while_a_multinode_job_works(
        job_dir: Path, infra_leak_check, netns_network) -> None:  # type: ignore[no-untyped-def]
    """On h3, a single-node job (2 workers): every socket its agent and workers listen on is
    on 127.0.0.1, and a connect from h1 to h3's address on each of those ports is refused
    (with the old wildcard bind it connected). At the same time a 2-node job on h1 and h2
    forms and finishes; its leader's stores listen on h1's address, and no other."""
    net = netns_network
    script = copy_train_script(job_dir)
    h1, h2, h3 = net["h1"], net["h2"], net["h3"]
    env = {"GLOO_SOCKET_IFNAME": "eth0", "FTRUN_JOB_TOKEN": TOKEN}
    # gloo's own sockets follow GLOO_SOCKET_IFNAME (the multi-node job needs eth0); without
    # it the single node's workers use the host name's address, loopback here
    single = HostLaunch(h3, ["--nproc-per-node", "2", str(script), "--steps", "100000",
                             "--step-sleep", "0.05"], env={"FTRUN_JOB_TOKEN": TOKEN},
                        cwd=job_dir)
    steps = 30
    multi = [HostLaunch(host, ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
                               "c10d", "--rdzv-endpoint", f"{h1.addr}:29400", "--rdzv-id",
                               "exposure", "--local-addr", host.addr, str(script),
                               "--steps", str(steps), "--step-sleep", "0.05"],
                        env=env, cwd=job_dir)
             for host in (h1, h2)]
    try:
        single.wait_step(3, 150)
        agent = single.proc.pid
        own = _owned_listeners(agent)
        assert len(own) >= 2, f"the single-node agent should serve a control and a worker " \
                              f"store: {own}"
        everyone = [agent, *_children(agent)]
        listening = sorted({a for pid in everyone for a in _owned_listeners(pid)})
        exposed = [a for a in listening if a[0] != "127.0.0.1"]
        assert not exposed, f"single-node job listens beyond loopback: {exposed}"
        for _, port in own:
            tcp_connect(h3, "127.0.0.1", port, 5.0)  # the store is there, on loopback
            with pytest.raises(OSError) as refused:
                tcp_connect(h1, h3.addr, port, 5.0)
            assert refused.value.errno == errno.ECONNREFUSED, (port, refused.value)

        for node in multi:
            node.wait_step(3, 150)
        leader_own = _owned_listeners(multi[0].proc.pid)
        assert (h1.addr, 29400) in leader_own, leader_own
        assert all(addr == h1.addr for addr, _ in leader_own), leader_own
        _wait_all_succeed(multi, 180)
    finally:
        for node in multi:
            node.kill()
        if single.proc.poll() is None:
            single.proc.send_signal(signal.SIGTERM)
        code = single.wait(60)
    assert code == 128 + signal.SIGTERM, single.output

