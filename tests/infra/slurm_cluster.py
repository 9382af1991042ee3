"""A real, private, one-node Slurm cluster for tests: munged + slurmctld + slurmd.

Why a real one: ftrun reads the environment Slurm gives each ``srun`` task (see
:mod:`ftrun.host.slurm`), and recorded environments only prove the parser agrees with the
recording.  Running ``srun`` against a real controller proves it agrees with Slurm.

Everything lives in one temp directory (config, state, spool, logs, pid files, and a
private munge socket), so nothing global changes: no ``/etc/slurm/slurm.conf``, no system
munged, no fixed ports.  Clients find the cluster through ``SLURM_CONF`` in the environment
that :meth:`SlurmCluster.env` returns.  Several clusters (concurrent test runs) can coexist.

Every process the cluster starts (daemons, their ``slurmstepd`` children, and the job tasks
of ``srun`` calls made through :meth:`SlurmCluster.srun`) carries the environment variable
``FTRUN_TEST_SLURM=<root dir>``.  Teardown kills what carries it, which also catches
processes that escaped their daemon (a ``slurmstepd`` orphaned by a killed ``slurmd``).
Stale clusters of dead test runs under the same parent directory are reaped at start.

One host is one Slurm node: multi-node jobs are impossible here, so the cluster declares
more CPUs than the machine has (``SlurmdParameters=config_overrides``) to let one node
run several tasks, the way several ftrun agents share a node under ``srun -n``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.infra.procs import kill_and_wait, pid_alive
from tests.launch import free_port

__all__ = [
    "MARKER_VAR",
    "SlurmCluster",
    "SlurmClusterError",
    "SlurmUnavailable",
    "marked_processes",
    "reap_stale_clusters",
    "slurm_missing_reason",
]

#: Environment variable set on every process a cluster starts; its value is the root dir.
MARKER_VAR = "FTRUN_TEST_SLURM"
#: Parent of every cluster's temp dir: the layout stale-cluster reaping scans.
DEFAULT_PARENT = Path(tempfile.gettempdir()) / "ftrun-test-slurm"
INSTALL_HINT = "run scripts/install_test_services.sh"
_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "scontrol", "scancel", "sbatch")
_SBIN = ("/usr/sbin", "/sbin")
_FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
})


class SlurmClusterError(RuntimeError):
    """The cluster could not start or stop; the message carries the daemon log tail."""


class SlurmUnavailable(SlurmClusterError):
    """Slurm cannot run here (not installed, not root): tests should skip, not fail."""


def _unavailable(reason: str) -> None:
    """Skip the running test when under pytest (the fixture or a direct use alike), else
    raise SlurmUnavailable so scripts get an exception that says why."""
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(reason)
    raise SlurmUnavailable(reason)


def _which(name: str) -> str | None:
    """Find a binary, also in sbin dirs that a non-login PATH may lack."""
    found = shutil.which(name)
    if found:
        return found
    for d in _SBIN:
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def slurm_missing_reason() -> str | None:
    """Why a real cluster cannot start here, or None when it can.

    Checked up front so a fixture skips with a stated reason instead of failing deep in
    a daemon start.
    """
    missing = [b for b in _BINARIES if _which(b) is None]
    if missing:
        return f"slurm-wlm not installed (missing {', '.join(missing)}): {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (SlurmdUser=root, munged as munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return f"no 'munge' user: {INSTALL_HINT}"
    if not Path("/etc/munge/munge.key").is_file():
        return f"/etc/munge/munge.key missing: {INSTALL_HINT}"
    return None


def marked_processes(root: Path | str | None = None) -> list[int]:
    """Pids of live processes whose environment carries the cluster marker.

    With ``root``, only that cluster's; without, those of every cluster this process owns or
    whose directory is gone (a stopped cluster's leftovers); a concurrent test process's
    live clusters are its own business.  Reading another process's environ needs root (the
    clusters run as root, so the test does too).
    """
    prefix = f"{MARKER_VAR}=".encode()
    me = os.getpid()
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        marker = next((e[len(prefix):] for e in environ if e.startswith(prefix)), None)
        if marker is None:
            continue
        cluster = Path(os.fsdecode(marker))
        if root is None:
            ours = not cluster.exists() or _owner_pid(cluster / "owner.pid") == me
        else:
            ours = cluster == Path(root)
        if ours and pid_alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def reap_stale_clusters(parent: Path = DEFAULT_PARENT, timeout: float = 10.0) -> list[Path]:
    """Kill daemons and delete dirs of clusters whose owning test process is dead.

    A test run killed hard (SIGKILL, a lost session) skips teardown and leaves daemons
    holding ports and munge sockets.  Each cluster dir records its owner's pid; clusters of
    live owners (a concurrent test run) are left alone.
    """
    reaped: list[Path] = []
    if not parent.is_dir():
        return reaped
    for d in sorted(parent.glob("cluster-*")):
        if _owner_alive(d / "owner.pid"):
            continue
        pids = marked_processes(d)
        for name in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            pid = _read_pid(d / name)
            if pid is not None and pid not in pids and _is_our_daemon(pid, d):
                pids.append(pid)
        # A dead run's cluster needs no grace. A daemon killed mid-way may have started a
        # marked child (a step daemon) after the snapshot: look again until none is left.
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            kill_and_wait(pids, max(0.1, deadline - time.monotonic()), grace=0)
            pids = marked_processes(d)
        shutil.rmtree(d, ignore_errors=True)
        reaped.append(d)
    return reaped


def _start_time(pid: int) -> str:
    """The process start time in clock ticks since boot ('' if gone): with the pid, an
    identity that survives pid reuse."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _owner_pid(owner_file: Path) -> int | None:
    try:
        return int(owner_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _owner_alive(owner_file: Path) -> bool:
    """Is the test process that made a cluster still running (and not a reused pid)?"""
    try:
        fields = owner_file.read_text().split()
        pid = int(fields[0])
    except (OSError, ValueError, IndexError):
        return False  # no owner recorded: a start that died half-way
    if pid == os.getpid():
        return True  # another cluster of this very process
    if not pid_alive(pid):
        return False
    return len(fields) < 2 or _start_time(pid) == fields[1]


def _is_our_daemon(pid: int, root: Path) -> bool:
    """True when ``pid`` runs with a command line naming ``root`` (pid-reuse guard)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(root).encode() in cmdline


@dataclass
class SlurmCluster:
    """A private one-node Slurm cluster.  Use as a context manager or start()/stop().

    ``cpus`` is what the node declares, not what the machine has: more tasks than cores
    is the normal case for tests of several agents per node.
    """

    cpus: int = 8
    partition: str = "debug"
    start_timeout: float = 30.0
    parent: Path = DEFAULT_PARENT
    extra_conf: Sequence[str] = ()
    root: Path = field(init=False)
    node_name: str = field(init=False)
    ctld_port: int = field(init=False)
    slurmd_port: int = field(init=False)
    _started: bool = field(init=False, default=False)

    # ------------------------------------------------------------------ paths
    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a Slurm client (srun, sinfo...) talking to this cluster.

        The caller's own ``SLURM_*`` variables are dropped: a test run that is itself
        inside a Slurm job must not leak its job's ids into the private cluster's jobs.
        """
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        base["SLURM_CONF"] = str(self.conf)
        base[MARKER_VAR] = str(self.root)
        path = base.get("PATH", "/usr/bin:/bin")
        for d in _SBIN:
            if d not in path.split(":"):
                path += ":" + d
        base["PATH"] = path
        if extra:
            base.update(extra)
        return base

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start munged, slurmctld, slurmd; return once the node is idle.

        Skips the test (SlurmUnavailable outside pytest) when Slurm cannot run here,
        raises SlurmClusterError (with the
        daemon logs' tails) when it should but did not come up before the deadline.
        """
        reason = slurm_missing_reason()
        if reason:
            _unavailable(reason)
        self.parent.mkdir(parents=True, exist_ok=True)
        self.parent.chmod(0o755)
        reap_stale_clusters(self.parent)
        self.root = Path(tempfile.mkdtemp(prefix="cluster-", dir=self.parent))
        # munged runs as 'munge' and must traverse root to reach its socket dir.
        self.root.chmod(0o755)
        (self.root / "owner.pid").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        self.node_name = socket.gethostname().split(".")[0]
        self.ctld_port = free_port()
        self.slurmd_port = free_port()
        while self.slurmd_port == self.ctld_port:
            self.slurmd_port = free_port()
        self._started = True
        try:
            self._write_conf()
            deadline = time.monotonic() + self.start_timeout
            self._start_munged(deadline)
            self._start_daemon("slurmctld", deadline)
            self._wait_ctld(deadline)
            self._start_daemon("slurmd", deadline)
            self._wait_node_idle(deadline)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """Kill job steps, stop the daemons by their pid files, sweep, delete the files.

        Steps and their tasks get SIGKILL at once: a test cluster's jobs need no grace, and
        a slurmd asked to stop while it still tears down steps takes seconds to exit.  The
        daemons get SIGTERM (then SIGKILL after a short grace); munged goes last because
        slurmd talks to it while exiting.  Safe to call twice and after a failed start;
        raises SlurmClusterError if something survives SIGKILL.
        """
        if not self._started:
            return
        self._started = False
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.5, deadline - time.monotonic())

        daemons = {
            name: pid
            for name in ("slurmd", "slurmctld", "munge/munged")
            if (pid := _read_pid(self.root / f"{name}.pid")) is not None
            and _is_our_daemon(pid, self.root)
        }
        # Not slurmctld's own helper (slurmscriptd): killing it first stalls slurmctld's exit.
        ctld = daemons.get("slurmctld")
        steps = [
            p for p in marked_processes(self.root)
            if p not in daemons.values() and (ctld is None or _ppid(p) != ctld)
        ]
        kill_and_wait(steps, min(3.0, left()), grace=0)
        slurm = [pid for name, pid in daemons.items() if name != "munge/munged"]
        kill_and_wait(slurm, min(4.0, left()), grace=1.0)
        if "munge/munged" in daemons:
            kill_and_wait([daemons["munge/munged"]], min(2.0, left()), grace=0.5)
        # Anything slurmd launched after the first sweep, or that ignored the daemons' exit.
        survivors = kill_and_wait(marked_processes(self.root), min(2.0, left()), grace=0)
        # The parent dir stays: removing it races with a concurrent run's mkdtemp there.
        shutil.rmtree(self.root, ignore_errors=True)
        if survivors:
            raise SlurmClusterError(f"processes of {self.root} survived SIGKILL: {survivors}")

    def pids(self) -> list[int]:
        """Live processes belonging to this cluster (daemons, steps, tasks)."""
        return marked_processes(self.root)

    # ------------------------------------------------------------------ clients
    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (sinfo, scontrol, sbatch...) against this cluster."""
        return subprocess.run(
            list(argv), env=self.env(env), capture_output=True, text=True,
            timeout=timeout, check=check,
        )

    def srun(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """``srun ARGS`` on this cluster; stdout/stderr captured as text.

        On a timeout the job is cancelled before TimeoutExpired propagates, so a hung
        task does not outlive the test.  ``--kill-on-bad-exit`` is not added: tests of
        partial failure need Slurm's defaults.
        """
        argv = ["srun", f"--partition={self.partition}", *args]
        try:
            return self.run(argv, env=env, timeout=timeout, check=check)
        except subprocess.TimeoutExpired:
            self.run(["scancel", "--quiet", "--full", "--user", "root"], timeout=10)
            raise

    def sbatch(
        self, args: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 30.0
    ) -> str:
        """Submit a batch job (``sbatch --parsable ARGS``); returns its job id."""
        res = self.run(["sbatch", "--parsable", f"--partition={self.partition}", *args],
                       env=env, timeout=timeout)
        if res.returncode != 0:
            raise SlurmClusterError(f"sbatch {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout.strip().split(";")[0]

    def wait_job(self, job_id: str, timeout: float = 60.0) -> str:
        """Poll until the job is in a final state; returns it (e.g. ``COMPLETED``).

        Polls every 50 ms instead of ``sbatch --wait`` (whose poll interval starts at 2 s
        and grows).  A record purged after being seen (``MinJobAge``) returns ``PURGED``;
        one never seen raises, as the id was wrong.
        """
        deadline = time.monotonic() + timeout
        seen = False
        while True:
            res = self.run(["scontrol", "-o", "show", "job", job_id], timeout=10)
            m = re.search(r"\bJobState=(\S+)", res.stdout)
            if m:
                seen = True
                if m.group(1) in _FINAL_STATES:
                    return m.group(1)
            elif "Invalid job id" in res.stderr:
                if seen:
                    return "PURGED"
                raise SlurmClusterError(f"job {job_id}: {res.stderr.strip()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not finished after {timeout}s: {res.stdout}")
            time.sleep(0.05)

    # ------------------------------------------------------------------ internals
    def _write_conf(self) -> None:
        r = self.root
        for sub in ("state", "spool", "munge"):
            (r / sub).mkdir()
        munge_dir = r / "munge"
        pw = pwd.getpwnam("munge")
        os.chown(munge_dir, pw.pw_uid, pw.pw_gid)
        munge_dir.chmod(0o755)
        lines = [
            "# generated by tests/infra/slurm_cluster.py",
            "ClusterName=ftrun-test",
            f"SlurmctldHost={self.node_name}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=2",
            "MinJobAge=5",
            "MessageTimeout=5",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            *self.extra_conf,
            f"NodeName={self.node_name} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node_name} Default=YES "
            "MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]
        (r / "plugstack.conf").write_text("")
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon_env(self) -> dict[str, str]:
        return self.env()

    def _log_tails(self) -> str:
        out = []
        for name in ("munge/munged.log", "slurmctld.log", "slurmd.log"):
            p = self.root / name
            if p.exists():
                tail = p.read_text(errors="replace").splitlines()[-15:]
                out.append(f"--- {name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def _fail(self, what: str) -> SlurmClusterError:
        return SlurmClusterError(f"{what} (cluster dir {self.root})\n{self._log_tails()}")

    def _start_munged(self, deadline: float) -> None:
        """A private munged on its own socket, so the system one is never touched."""
        m = self.root / "munge"
        cmd = [
            "runuser", "-u", "munge", "--", _which("munged") or "munged",
            f"--socket={self.munge_socket}",
            f"--pid-file={m / 'munged.pid'}",
            f"--log-file={m / 'munged.log'}",
            f"--seed-file={m / 'munged.seed'}",
            "--num-threads=2",
        ]
        res = subprocess.run(cmd, env=self._daemon_env(), capture_output=True, text=True,
                             timeout=max(1.0, deadline - time.monotonic()))
        if res.returncode != 0:
            raise self._fail(f"munged failed to start: {res.stderr.strip()}")
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise self._fail("munged socket did not appear")
            time.sleep(0.02)

    def _start_daemon(self, name: str, deadline: float) -> None:
        """Start slurmctld/slurmd; they daemonize once their pid file is written."""
        cmd = [_which(name) or name, "-f", str(self.conf)]
        if name == "slurmd":
            cmd += ["-N", self.node_name]
        res = subprocess.run(cmd, env=self._daemon_env(), capture_output=True, text=True,
                             timeout=max(1.0, deadline - time.monotonic()))
        if res.returncode != 0:
            raise self._fail(f"{name} exited {res.returncode}: {res.stderr.strip()}")
        pidfile = self.root / f"{name}.pid"
        while True:
            pid = _read_pid(pidfile)
            if pid is not None and pid_alive(pid):
                return
            if time.monotonic() > deadline:
                raise self._fail(f"{name} wrote no live pid to {pidfile}")
            time.sleep(0.05)

    def _poll(self, deadline: float, what: str, probe: Callable[[], tuple[bool, str]]) -> None:
        last = ""
        while True:
            ok, last = probe()
            if ok:
                return
            for name in ("slurmctld", "slurmd"):
                pid = _read_pid(self.root / f"{name}.pid")
                if pid is not None and not pid_alive(pid):
                    raise self._fail(f"{name} died while waiting for {what}")
            if time.monotonic() > deadline:
                raise self._fail(f"timed out waiting for {what}; last: {last!r}")
            time.sleep(0.1)

    def _wait_ctld(self, deadline: float) -> None:
        def probe() -> tuple[bool, str]:
            r = self.run(["scontrol", "ping"], timeout=10)
            return ("UP" in r.stdout and "DOWN" not in r.stdout), (r.stdout + r.stderr).strip()

        self._poll(deadline, "slurmctld to answer 'scontrol ping'", probe)

    def _wait_node_idle(self, deadline: float) -> None:
        def probe() -> tuple[bool, str]:
            r = self.run(["sinfo", "-h", "-N", "-n", self.node_name, "-o", "%T"], timeout=10)
            state = r.stdout.strip().lower()
            return state.rstrip("*") == "idle", (state or r.stderr.strip())

        self._poll(deadline, f"node {self.node_name} to be idle", probe)



@contextlib.contextmanager
def slurm_cluster(**kwargs: object) -> Iterator[SlurmCluster]:
    """Context-manager form: ``with slurm_cluster(cpus=4) as c: c.srun([...])``."""
    cluster = SlurmCluster(**kwargs)  # type: ignore[arg-type]
    with cluster:
        yield cluster
