"""An agent with thousands of descriptors: what the store host of a large job holds.

The agent that serves a multi-node job's stores holds about eight descriptors per other
node plus one or two per remote worker (ftrun/host/fdlimit.py), so at a few dozen nodes of
eight workers its new descriptors are numbered above 1023. Two things must hold then, checked
here with real agents and workers:

* its watch loop still sees its workers: ``select`` refuses any descriptor numbered 1024
  or above, and the agent crashed ("filedescriptor out of range in select()", exit 70) as
  soon as a worker's pidfd got such a number; it now uses ``poll``;
* a multi-node agent raises its own soft open-file limit to the hard one, and says so
  when even that is too small for the job's largest size, while its workers keep the
  limit the agent was started with (as under torchrun).

A real store host with 1,100 connections is more than this machine spares for a test; the
agent is instead started with 1,100 inherited descriptors, which puts every descriptor it
opens after them above 1023, the same numbers a large job's store host gives out.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from ftrun.agent.forkserver import ForkServer
from tests.launch import free_port, launcher

_FILLER = 1100  # inherited descriptors: the agent's own are numbered above them
_WORKER = """\
import os, resource
from pathlib import Path
parent = Path(f"/proc/{os.getppid()}/limits").read_text()
line = next(x for x in parent.splitlines() if x.startswith("Max open files"))
print("nofile worker", *resource.getrlimit(resource.RLIMIT_NOFILE),
      "parent", *line.split()[3:5], flush=True)
command = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(bytes(1))
print("parent command", *(part.decode() for part in command[:4]), flush=True)
"""


@pytest.mark.parametrize("spawn", ["exec", "fork-server"])
def test_an_agent_with_descriptors_above_1023_watches_its_workers(
        job_dir: Path, spawn: str) -> None:
    """Both ways a worker is started (exec, or forked by the fork server of ``--preload``):
    the job ends 0 and the worker's line is printed, by a worker of the way asked for.
    Before ``poll``, both exited 70."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = _FILLER + 500
    if hard != resource.RLIM_INFINITY and hard < room:
        pytest.skip(f"the hard open-file limit here ({hard}) leaves no room for {_FILLER} more")
    script = job_dir / "worker.py"
    script.write_text(_WORKER)
    preload = ["--preload", "json"] if spawn == "fork-server" else []
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, room), hard))  # CI may give 1024
    filler = [open("/dev/null", "rb") for _ in range(_FILLER)]  # noqa: SIM115
    try:
        done = subprocess.run(
            [launcher(), "--nproc-per-node", "1", *preload, str(script)],
            pass_fds=[f.fileno() for f in filler], capture_output=True, text=True,
            cwd=job_dir, timeout=120)
    finally:
        for handle in filler:
            handle.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nofile worker" in done.stdout, done.stdout + done.stderr
    forked = "ftrun.agent.zygote" in done.stdout  # the worker's parent: the fork server
    assert forked == (spawn == "fork-server"), done.stdout + done.stderr


@pytest.mark.parametrize(("nnodes", "warned"), [("1:1000", True), ("1:2", False)])
def test_a_multinode_agent_raises_its_open_file_limit_but_not_its_workers(
        job_dir: Path, nnodes: str, warned: bool) -> None:
    """Started with a soft limit of 512 and a hard one of 4096: the agent (the worker's
    parent) runs with 4096, the worker with 512. A job that may grow to 1,000 nodes of one
    worker needs about 10,256 descriptors on its store host (2 per worker: ``auto`` may
    regroup), so the agent says the limit is too small; one of at most 2 nodes does not."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-file limit here ({hard}) is below the test's 4096")
    script = job_dir / "worker.py"
    script.write_text(_WORKER)
    done = subprocess.run(
        [launcher(), "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf",
         "last_call_timeout=1", str(script)],
        capture_output=True, text=True, cwd=job_dir, timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, 4096)))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "nofile worker 512 4096 parent 4096 4096" in done.stdout, output
    said = "the open-file limit (4096, the hard limit) is below" in output
    assert said == warned, output


def test_doctor_judges_the_limit_the_workers_get() -> None:
    """A multi-node agent runs its health gate (``host.nofile`` among the quick checks)
    after raising its own limit: the check reads the limit the process started with, the
    workers' (``ftrun.host.fdlimit.workers_limit``), not the one it runs with now."""
    from ftrun.doctor.host import check_nofile
    from ftrun.host.fdlimit import workers_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    started = workers_limit()
    now = 1000 if started[0] != 1000 else 1001
    resource.setrlimit(resource.RLIMIT_NOFILE, (now, hard))
    try:
        detail = check_nofile(None).detail  # type: ignore[arg-type]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert f"open files {started[0]} " in detail and f"open files {now} " not in detail, detail


def test_readable_answers_as_select_did_for_any_descriptor_number() -> None:
    """``processes.readable``: nothing within the timeout, a readable pipe, a pipe whose
    writer closed (hung up: readable, as ``select`` said), one numbered above 1023 (which
    ``select`` refused), and a closed descriptor raises (``select`` raised too)."""
    from ftrun.agent.processes import readable

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard open-file limit here ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    read_end, write_end = os.pipe()
    high = os.dup2(read_end, 1100)
    try:
        assert readable([read_end, high], 0.05) == []
        os.write(write_end, b"x")
        assert sorted(readable([read_end, high], 5.0)) == [read_end, high]
        os.read(read_end, 1)
        os.close(write_end)
        assert sorted(readable([read_end, high], 5.0)) == [read_end, high]  # hung up
        os.close(high)
        with pytest.raises(OSError):
            readable([high], 0.05)
    finally:
        for fd in (read_end, write_end, high):
            with contextlib.suppress(OSError):
                os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))



@contextlib.contextmanager
def _every_number_below_filler_taken() -> Iterator[None]:
    """This process holds descriptors numbered 3 to at least ``_FILLER`` (what a store
    host's agent holds), so the next one opened is numbered above 1023."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = _FILLER + 500
    if hard != resource.RLIM_INFINITY and hard < room:
        pytest.skip(f"the hard open-file limit here ({hard}) leaves no room for {_FILLER} more")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, room), hard))
    filler: list[IO[bytes]] = []
    try:
        while not filler or filler[-1].fileno() < _FILLER:  # the lowest free number each
            filler.append(open("/dev/null", "rb"))  # noqa: SIM115
        yield
    finally:
        for handle in filler:
            handle.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_agent_reads_a_fork_server_whose_socket_is_numbered_above_1023(
        job_dir: Path) -> None:
    """A fork server started by a process that already holds over 1,023 descriptors: its
    socket to the agent is numbered above 1023, and the agent still reads the server's
    readiness from it (``poll``, not ``select``, which refuses such a number). (The CLI
    starts its server before it opens anything else: this is the agent side's own promise.)"""
    server: ForkServer | None = None
    with _every_number_below_filler_taken():
        try:
            server = ForkServer(["json"], env=dict(os.environ), path0=str(job_dir))
            assert server._sock.fileno() > 1023, server._sock.fileno()
            assert server.wait_ready(60) >= 0.0
            assert server.import_s is not None
        finally:
            if server is not None:
                server.close()


def test_a_fork_server_whose_socket_is_numbered_above_1023_forks_and_reports(
        job_dir: Path) -> None:
    """The same fork server forks a worker, and the agent reads its pid, its output and its
    exit status. (ftrun/agent/zygote.py waited with select.select, which cannot watch a
    descriptor above 1023: the server exited 1 at its first wait, after its readiness.)"""
    script = job_dir / "forked.py"
    script.write_text("import sys\nprint('forked worker', flush=True)\nsys.exit(3)\n")
    server: ForkServer | None = None
    with _every_number_below_filler_taken():
        try:
            server = ForkServer(["json"], env=dict(os.environ), path0=str(job_dir))
            assert server._sock.fileno() > 1023, server._sock.fileno()
            server.wait_ready(60)
            child = server.spawn([str(script)], module=False, env=dict(os.environ),
                                 cwd=str(job_dir))
            deadline = time.monotonic() + 60
            while child.poll() is None:
                assert time.monotonic() < deadline, "the forked worker's exit was never seen"
                time.sleep(0.05)
            assert child.returncode == 3
            assert child.stdout.read() == b"forked worker\n"
            child.stdout.close()
            child.stderr.close()
        finally:
            if server is not None:
                server.close()
