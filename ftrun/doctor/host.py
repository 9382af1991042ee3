"""Checks of the host's limits and name: /dev/shm, memlock, open files, the hostname.

These are the failures that surface hours into a job, far from their cause: a 64 MiB
``/dev/shm`` (a container's default) crashes NCCL and DataLoader workers, a small memlock
limit breaks RDMA, 1024 open files runs out, and a hostname that resolves only to loopback
makes other nodes unable to reach this one by name.
"""

from __future__ import annotations

import ipaddress
import os
import resource
import shutil
import socket

from ftrun.doctor.core import CheckResult, Context, check, failed, one_line, passed, warned
from ftrun.host.fdlimit import workers_limit

# Thresholds (documented in docs/doctor.md).
SHM_FAIL_FREE = 512 << 20  # NCCL's intra-node transport and DataLoader workers live here
SHM_WARN_FREE = 2 << 30
NOFILE_WARN = 4096  # each worker holds sockets, shm segments, DataLoader fds


@check("host.shm")
def check_shm(ctx: Context) -> CheckResult:
    """NCCL's intra-node transport and DataLoader workers use /dev/shm; containers default
    to 64 MiB, which crashes them ("Bus error", "unhandled system error").
    """
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError as exc:
        return failed(f"/dev/shm unusable: {one_line(exc)}", "mount a tmpfs on /dev/shm")
    gib = 1 << 30
    detail = f"/dev/shm {usage.total / gib:.1f} GiB, {usage.free / gib:.1f} GiB free"
    hint = ("enlarge it: docker run --shm-size=16g (or --ipc=host), "
            "or mount -o remount,size=16G /dev/shm")
    if usage.free < SHM_FAIL_FREE:
        return failed(detail, hint)
    if usage.free < SHM_WARN_FREE:
        return warned(detail, hint)
    return passed(detail)


def _rlimit_str(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


@check("host.memlock")
def check_memlock(ctx: Context) -> CheckResult:
    """RDMA (InfiniBand/RoCE) registers pinned memory; a small memlock limit makes NCCL fail
    with "ibv_reg_mr failed" or fall back to slow sockets.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    ib = "/sys/class/infiniband"
    rdma = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
    if soft == resource.RLIM_INFINITY:
        return passed("memlock unlimited")
    detail = f"memlock {soft >> 10} KiB (hard {_rlimit_str(hard)})"
    if rdma:
        return warned(f"{detail} with RDMA devices {', '.join(rdma)}",
                      "set `ulimit -l unlimited` (limits.conf / slurm PropagateResourceLimits)")
    return passed(f"{detail}; no RDMA devices, so it does not matter")


@check("host.nofile")
def check_nofile(ctx: Context) -> CheckResult:
    """Workers hold many sockets and shared-memory fds (DataLoader's file_descriptor
    strategy); a 1024 limit surfaces as "Too many open files" hours in. The limit judged is
    the one this process started with, which is what workers get: a multi-node agent raises
    its own for the stores it serves (ftrun.host.fdlimit) before its health gate runs this.
    """
    soft, hard = workers_limit()
    detail = f"open files {_rlimit_str(soft)} (hard {_rlimit_str(hard)})"
    if soft != resource.RLIM_INFINITY and soft < NOFILE_WARN:
        target = hard if hard != resource.RLIM_INFINITY else 65536
        return warned(detail, f"raise it: ulimit -n {target}")
    return passed(detail)


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def _resolve(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return sorted({str(i[4][0]) for i in infos})


@check("host.hostname", "resolving the hostname hung: DNS or /etc/nsswitch.conf is broken")
def check_hostname(ctx: Context) -> CheckResult:
    """Rendezvous and Gloo advertise this node by hostname: it must resolve, and to an
    address other nodes can reach (not only loopback).
    """
    name = socket.gethostname()
    try:
        addrs = _resolve(name)
    except OSError as exc:
        return failed(f"hostname {name!r} does not resolve: {exc}",
                      "add it to /etc/hosts or DNS")
    if all(_is_loopback(a) for a in addrs):
        return warned(f"hostname {name!r} resolves only to loopback ({', '.join(addrs)}): "
                      "fine on one node, other nodes cannot reach it by name",
                      "map the hostname to a routable address in /etc/hosts or DNS, or set "
                      "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME")
    return passed(f"hostname {name!r} resolves to {', '.join(addrs)}")
