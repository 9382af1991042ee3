"""``ftrun doctor`` as users run it: a real process, its JSON, its exit code, its run time.

Host checks run against this machine for real (its /dev/shm, ulimits, interfaces, a real
listening socket, a really occupied port, a really bad NCCL_SOCKET_IFNAME). GPU checks run
against ``tests/fake_pynvml`` (the real pynvml's constants and error classes, a simulated
node's answers), put first on PYTHONPATH of the doctor process; the no-driver case also
runs against the real pynvml when this machine has no NVIDIA driver.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftrun import doctor
from ftrun.doctor import CheckResult, CheckSpec, Options
from ftrun.doctor.options import UsageError
from ftrun.doctor.runner import check_selector
from tests.launch import free_port

REPO = Path(__file__).resolve().parents[1]
FAKE_NVML = REPO / "tests" / "fake_pynvml"
STATUSES = {"pass", "warn", "fail", "skip"}
#: The promise is < 5 s (docs/doctor.md: about 1.2 s on a quiet 2-core box). Measured here
#: while other test runs shared the 2 cores (load 4-8.6): 1.6-6.8 s wall on this node, 1.5-7.8
#: s with the fake 8-GPU NVML, median about 3 s (25 runs). 12 s passes the worst of those
#: with room and fails a 10x regression of every one (the fastest, 1.5 s, would take 15 s).
ELAPSED_BOUND_S = 12.0
#: ``--timeout``'s default, which the speed test keeps.
DEFAULT_TIMEOUT_S = 4.0
DEFAULT_TIMEOUT = ("--timeout", str(DEFAULT_TIMEOUT_S))
#: Every other run reads what the checks found, not how soon: it gets 30 s. Under CI load
#: (3 pytest workers on 2 cores) the torch check's child took more than the default 4 s to
#: import torch, and even a socket connect was cut ("timed out", official CI of 7fa697a).
#: A test's own --timeout comes later in the command line, and wins.
ROOMY_TIMEOUT = ("--timeout", "30")
#: Tests of one area run its checks only: the torch and shim checks (a child that imports
#: torch, about 3 s of CPU) would otherwise run in every one of them.
ONLY_GPU = ("--check", "gpu")
ONLY_NET = ("--check", "net", "--check", "rdzv.endpoint")
ONLY_SLURM = ("--check", "slurm")


def _has_real_nvml() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


HAS_NVML = _has_real_nvml()


def _torch_has_cuda() -> bool:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda)"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() not in ("", "None")


TORCH_CUDA = _torch_has_cuda()


def _clean_env(extra: dict[str, str] | None = None, fake: bool = False) -> dict[str, str]:
    drop = ("SLURM_", "SLURMD_", "PET_", "FAKE_NVML_", "NCCL_", "GLOO_SOCKET_IFNAME",
            "CUDA_VISIBLE_DEVICES", "MASTER_PORT", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_NVML), str(REPO)] if fake else [str(REPO)])
    env.update(extra or {})
    return env


class Run:
    """One finished doctor process."""

    def __init__(self, proc: subprocess.CompletedProcess[str], wall_s: float) -> None:
        self.rc = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.wall_s = wall_s
        self.doc: dict[str, Any] = {}
        if self.stdout.startswith("{"):
            self.doc = json.loads(self.stdout)
        self.checks = {c["name"]: c for c in self.doc.get("checks", [])}

    def status(self, name: str) -> str:
        return self.checks[name]["status"]

    def detail(self, name: str) -> str:
        return self.checks[name]["detail"]

    def __repr__(self) -> str:  # shown by pytest when an assertion fails
        rows = [f"{c['status']:4} {c['name']}: {c['detail']} | {c['hint']}"
                for c in self.checks.values()]
        return f"rc={self.rc} wall={self.wall_s:.2f}s\n" + "\n".join(rows) + \
            f"\nstderr: {self.stderr[-2000:]}"


def run_doctor(*args: str, env: dict[str, str] | None = None, scenario: str | None = None,
               as_json: bool = True, module: str = "ftrun.doctor", timeout: float = 60) -> Run:
    """Run ``python -m ftrun.doctor ARGS`` (with the fake NVML when ``scenario`` is given)."""
    extra = dict(env or {})
    if scenario:
        extra["FAKE_NVML_SCENARIO"] = scenario
    argv = [sys.executable, "-m", *module.split(), *ROOMY_TIMEOUT, *args,
            *(["--json"] if as_json else [])]
    t = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=_clean_env(extra, fake=scenario is not None),
                          capture_output=True, text=True, timeout=timeout)
    run = Run(proc, time.monotonic() - t)
    print(f"doctor {' '.join(args)} [{scenario or 'real NVML'}]: rc={run.rc}, "
          f"{run.wall_s:.2f} s wall, {run.doc.get('elapsed_s')} s in checks")
    assert "Traceback" not in run.stderr, run
    if as_json and run.rc != 2:
        assert set(run.doc) == {"checks", "ok", "elapsed_s"}, run
        assert run.doc["ok"] == (run.rc == 0), run
        assert all(c["status"] in STATUSES for c in run.doc["checks"]), run
    return run


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Every doctor process (and anything it started) is gone when a test ends."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def listener() -> Iterator[int]:
    """A real TCP server socket on an ephemeral port, all addresses."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    sock.listen(16)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# ------------------------------------------------------------------ this machine, for real


def test_real_node_json_is_fast_and_matches_the_machine() -> None:
    run = run_doctor(*DEFAULT_TIMEOUT)
    assert run.wall_s < ELAPSED_BOUND_S, run
    # The checks themselves end at the timeout whatever the load (a slow check is failed).
    assert run.doc["elapsed_s"] < DEFAULT_TIMEOUT_S + 1.0, run
    print(f"measured: doctor took {run.wall_s:.2f} s wall on this machine")
    expected = ["python", "torch", "cuda", "nccl", "nccl.dynamic", "shim", "gpu", "gpu.ecc",
                "gpu.memory", "gpu.thermal", "gpu.pcie", "gpu.nvlink", "gpu.persistence",
                "gpu.mig", "gpu.processes", "host.shm", "host.memlock", "host.nofile",
                "host.hostname", "net.nccl_ifname", "net.gloo_ifname", "net.ports",
                "rdzv.endpoint", "slurm", "kubernetes"]
    assert list(run.checks) == expected
    assert run.status("python") == "pass"
    # Under CI load the torch check's child may not have imported torch within the default
    # 4 s: that is the timeout working. test_fake_healthy_8_gpu_node gives it the time.
    assert run.status("torch") == "pass" or "timed out" in run.detail("torch"), run
    # /dev/shm and the limits, as this test sees them.
    shm = shutil.disk_usage("/dev/shm")
    want_shm = ("fail" if shm.free < doctor.SHM_FAIL_FREE
                else "warn" if shm.free < doctor.SHM_WARN_FREE else "pass")
    assert run.status("host.shm") == want_shm, run
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert str(soft) in run.detail("host.nofile")
    assert run.status("host.nofile") == ("warn" if soft < doctor.NOFILE_WARN else "pass")
    assert run.status("slurm") == "skip"
    assert run.status("kubernetes") == "skip"
    assert run.status("rdzv.endpoint") == "skip"
    if not HAS_NVML:  # this machine: no NVIDIA driver is a finding, not a failure
        assert run.status("gpu") == "skip"
        assert "no GPU: CPU only" in run.detail("gpu")
        assert all(run.status(n) == "skip" for n in expected if n.startswith("gpu."))
    if not TORCH_CUDA and run.status("torch") == "pass":
        assert run.status("nccl.dynamic") == "skip"
        assert "CPU build" in run.detail("nccl.dynamic")
    fails = [n for n, c in run.checks.items() if c["status"] == "fail"]
    assert run.rc == (1 if fails else 0)


def test_real_node_table_for_people() -> None:
    run = run_doctor(as_json=False)
    assert run.rc in (0, 1)
    assert "ftrun doctor" in run.stdout
    for name in ("host.shm", "net.ports", "gpu.ecc"):
        assert name in run.stdout
    assert ("NOT READY" in run.stdout) == (run.rc == 1)


@pytest.mark.skipif(HAS_NVML, reason="this machine has an NVIDIA driver")
def test_real_no_driver_fails_only_when_gpus_are_asked_for() -> None:
    run = run_doctor("--nproc-per-node", "gpu", *ONLY_GPU)
    assert run.rc == 1
    assert run.status("gpu") == "fail"
    assert "--nproc-per-node gpu" in run.detail("gpu")
    # torchrun's PET_* variables work the same way as the flags.
    run = run_doctor(*ONLY_GPU, env={"PET_NPROC_PER_NODE": "gpu"})
    assert run.status("gpu") == "fail"
    run = run_doctor("--nproc-per-node", "4", *ONLY_GPU)
    assert run.status("gpu") == "skip"


def test_cpu_mode_skips_gpu_checks() -> None:
    run = run_doctor("--nproc-per-node", "cpu", *ONLY_GPU, scenario="ecc")
    assert run.status("gpu") == "skip"
    assert run.status("gpu.ecc") == "skip"


@pytest.mark.parametrize("args, env, message", [
    (["--nproc-per-node", "abc"], {}, "--nproc-per-node"),
    (["--nproc-per-node", "0"], {}, "--nproc-per-node"),
    ([], {"PET_NPROC_PER_NODE": "many"}, "--nproc-per-node"),
    (["--timeout", "soon"], {}, "--timeout"),
    (["--master-port", "70000"], {}, "--master-port"),
    (["--rdzv-endpoint", "node1:http"], {}, "--rdzv-endpoint"),
    (["--check", "gpus"], {}, "--check 'gpus': no such check"),
])
def test_bad_usage_is_one_line_and_exit_2(args: list[str], env: dict[str, str],
                                          message: str) -> None:
    run = run_doctor(*args, env=env)
    assert run.rc == 2, run
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], run.stderr


def test_check_selects_a_check_with_those_under_it() -> None:
    run = run_doctor("--check", "gpu.ecc", "--check", "host", scenario="ecc")
    assert sorted(run.checks) == ["gpu.ecc", "host.hostname", "host.memlock", "host.nofile",
                                  "host.shm"], run
    assert run.status("gpu.ecc") == "fail" and run.rc == 1, run
    select = check_selector(["gpu", "host.shm"], within=lambda name: name != "gpu.mig")
    assert select is not None and select("gpu.ecc") and select("host.shm")
    assert not select("gpu.mig") and not select("host.nofile")  # --quick's and --check's
    assert check_selector([]) is None  # every check
    with pytest.raises(UsageError, match="no such check"):
        check_selector(["gpu.ec"])  # a name, not a prefix of one


def test_unknown_option_is_exit_2_without_traceback() -> None:
    run = run_doctor("--no-such-flag", as_json=False)
    assert run.rc == 2
    assert "No such option" in run.stderr


def test_broken_host_settings_fail(listener: int) -> None:
    """A bad NCCL/Gloo interface, an occupied port and an unresolvable store, all real."""
    run = run_doctor(
        *ONLY_NET, "--master-port", str(listener),
        "--rdzv-endpoint", "no-such-host.invalid:29400",
        env={"NCCL_SOCKET_IFNAME": "bogus0", "GLOO_SOCKET_IFNAME": "bogus1"},
    )
    assert run.rc == 1
    assert run.status("net.nccl_ifname") == "fail", run
    assert "bogus0" in run.detail("net.nccl_ifname")
    assert run.status("net.gloo_ifname") == "fail", run
    assert run.status("net.ports") == "fail", run
    assert f"port {listener}" in run.detail("net.ports")
    assert f"pid {os.getpid()}" in run.detail("net.ports")  # who holds it
    assert run.status("rdzv.endpoint") == "fail", run
    assert run.checks["net.ports"]["hint"]


def test_good_host_settings_pass(listener: int) -> None:
    """The store answers, the chosen port is free, the interface names match."""
    free = free_port()
    up = [n for n, s in psutil.net_if_stats().items() if s.isup]
    assert "lo" in up
    run = run_doctor(
        *ONLY_NET, "--master-port", str(free),
        env={"PET_RDZV_ENDPOINT": f"127.0.0.1:{listener}", "NCCL_SOCKET_IFNAME": "=lo",
             "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert run.status("rdzv.endpoint") == "pass", run
    assert "reachable" in run.detail("rdzv.endpoint")
    # The store's port is taken (by the store itself, as far as doctor can tell): a warning.
    assert run.status("net.ports") == "warn", run
    assert f"port {listener} (rendezvous store" in run.detail("net.ports")
    assert "fine only if that is this job's store" in run.detail("net.ports")
    assert run.status("net.nccl_ifname") == "pass", run
    assert "lo (127.0.0.1)" in run.detail("net.nccl_ifname")
    assert run.status("net.gloo_ifname") == "pass", run


def test_rdzv_endpoint_on_this_node_not_yet_listening_passes() -> None:
    port = free_port()
    run = run_doctor(*ONLY_NET, "--rdzv-endpoint", f"localhost:{port}")
    assert run.status("rdzv.endpoint") == "pass", run
    assert "host the store here" in run.detail("rdzv.endpoint")
    assert run.status("net.ports") == "pass", run
    assert str(port) in run.detail("net.ports")


def test_nccl_ifname_exclusion_and_down_interfaces() -> None:
    stats = psutil.net_if_stats()
    addrs = psutil.net_if_addrs()
    routable = [n for n, s in stats.items() if s.isup and n != "lo"
                and any(a.family == socket.AF_INET for a in addrs.get(n, []))]
    down = [n for n, s in stats.items() if not s.isup]
    run = run_doctor(*ONLY_NET, env={"NCCL_SOCKET_IFNAME": "^lo"})
    if routable:
        assert run.status("net.nccl_ifname") == "pass", run
        assert routable[0] in run.detail("net.nccl_ifname")
    if down:  # an interface that exists but is down is as good as none for NCCL
        run = run_doctor(*ONLY_NET, env={"NCCL_SOCKET_IFNAME": f"={down[0]}"})
        assert run.status("net.nccl_ifname") == "fail", run


def test_shim_self_test_round_trip_is_reported() -> None:
    from ftrun import shim

    # The suite builds the shim (pip install -e . in scripts/test.sh): a missing library is a
    # failure here, named by ShimNotBuiltError, not a reason to skip.
    shim.shim_library_path()
    shim.fake_nccl_dir()
    run = run_doctor()
    assert run.status("shim") == "pass", run
    assert "loads and interposes" in run.detail("shim")
    assert "abort round trip" in run.detail("shim") and " ms" in run.detail("shim")


def test_shim_not_built_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrun import shim

    def not_built() -> Path:
        raise shim.ShimNotBuiltError("libftrun_shim.so is missing")

    monkeypatch.setattr(shim, "shim_library_path", not_built)
    monkeypatch.setattr(doctor, "CHECKS", [s for s in doctor.CHECKS if s.name == "shim"])
    [res] = doctor.run_checks(Options(nproc_per_node="cpu", timeout=5.0))
    assert res.status == "warn"  # a CPU-only job does not need it; a GPU job would fail
    assert "shim not built" in res.detail and "pip install" in res.hint


# ------------------------------------------------------------------ GPUs, simulated


HEALTHY_GPU_CHECKS = ["gpu", "gpu.ecc", "gpu.memory", "gpu.thermal", "gpu.pcie", "gpu.nvlink",
                      "gpu.persistence", "gpu.mig", "gpu.processes"]


def _gpu_statuses(run: Run) -> dict[str, str]:
    return {n: run.status(n) for n in HEALTHY_GPU_CHECKS}


def test_fake_healthy_8_gpu_node() -> None:
    run = run_doctor(scenario="healthy")
    assert set(_gpu_statuses(run).values()) == {"pass"}, run
    assert "8 GPU(s): 8 x NVIDIA H100 80GB HBM3; driver 550.54.15, CUDA 12.4" in run.detail("gpu")
    assert "18 NVLinks" in run.detail("gpu.nvlink")
    if not TORCH_CUDA:  # a CPU torch on a GPU node would train on CPU: that is a failure
        assert run.status("cuda") == "fail", run
        assert "CPU build" in run.detail("cuda")
        assert run.status("nccl.dynamic") == "skip" and "CPU build" in run.detail("nccl.dynamic")
    assert run.status("torch") == "pass", run
    fails = {n for n, c in run.checks.items() if c["status"] == "fail"}
    assert fails <= {"cuda"}, run


@pytest.mark.parametrize("scenario, check, status, needle", [
    ("ecc", "gpu.ecc", "fail", "GPU 3: 2 uncorrected ECC error(s)"),
    ("ecc_aggregate", "gpu.ecc", "warn", "GPU 3: 5 uncorrected ECC error(s) in its lifetime"),
    ("throttle", "gpu.thermal", "fail", "GPU 5: 92 °C, SM 1095/1980 MHz, throttled: HW slowdown"),
    ("timeout", "gpu.thermal", "fail", "GPUs 0-7: NVML: Timeout"),
    ("remap", "gpu.memory", "fail", "GPU 2: row remap pending"),
    ("retired", "gpu.memory", "fail", "GPU 1: page retirement pending"),
    ("pcie", "gpu.pcie", "warn", "GPU 6: PCIe link degraded to x8 (max x16)"),
    ("procs", "gpu.processes", "fail", "GPU 0: pid 4242"),
    ("mig", "gpu.mig", "fail", "GPU 1: MIG enabled"),
    ("nvlink", "gpu.nvlink", "fail", "GPU 4: 14 NVLink(s) up, peers have 18"),
    ("nopersist", "gpu.persistence", "warn", "GPUs 0-7: persistence mode off"),
    ("gpu_lost", "gpu", "fail", "GPU 7: GPU is lost"),
])
def test_fake_gpu_faults(scenario: str, check: str, status: str, needle: str) -> None:
    run = run_doctor("--check", "gpu", scenario=scenario)
    assert run.status(check) == status, run
    assert needle in run.detail(check), run
    assert run.checks[check]["hint"], run
    others = {n: s for n, s in _gpu_statuses(run).items() if n != check and s != "pass"}
    assert not others, run  # one fault shows up in its own check only
    assert set(run.checks) == set(HEALTHY_GPU_CHECKS), run  # --check gpu: only those
    assert run.rc == (1 if status == "fail" else 0)


def test_fake_nvml_not_found_is_cpu_only_unless_gpus_requested() -> None:
    run = run_doctor("--check", "gpu", scenario="notfound")
    assert run.status("gpu") == "skip"
    assert "no GPU: CPU only" in run.detail("gpu")
    assert "NVML Shared Library Not Found" in run.detail("gpu")
    assert all(run.status(n) == "skip" for n in HEALTHY_GPU_CHECKS)
    assert run.rc == 0, run
    run = run_doctor("--nproc-per-node", "gpu", "--check", "gpu", scenario="notfound")
    assert run.status("gpu") == "fail"
    assert run.rc == 1


def test_fake_driver_not_loaded_warns() -> None:
    run = run_doctor("--check", "gpu", scenario="driver_not_loaded")
    assert run.status("gpu") == "warn", run
    assert run.rc == 0


@pytest.mark.parametrize("scenario, hung", [
    ("hang", ["gpu.ecc"]),
    ("hang_init", HEALTHY_GPU_CHECKS),
])
def test_fake_nvml_hang_is_a_fail_not_a_hang(scenario: str, hung: list[str]) -> None:
    timeout = 2.0
    run = run_doctor("--timeout", str(timeout), "--check", "gpu", "--check", "host.shm",
                     scenario=scenario, env={"FAKE_NVML_HANG_S": "60"})
    for name in hung:
        assert run.status(name) == "fail", run
        assert "timed out" in run.detail(name)
        assert "NVML did not answer" in run.checks[name]["hint"]
    assert run.status("host.shm") == "pass"
    assert run.doc["elapsed_s"] < timeout + 1.0, run
    assert run.wall_s < timeout + 8.0, run
    assert run.rc == 1


def test_fake_gpu_count_against_nproc() -> None:
    run = run_doctor("--nproc-per-node", "8", "--check", "gpu", scenario="healthy",
                     env={"FAKE_NVML_GPUS": "4"})
    assert run.status("gpu") == "fail"
    assert "--nproc-per-node 8 but only 4 GPU(s) visible" in run.detail("gpu")
    run = run_doctor("--nproc-per-node", "2", "--check", "gpu", scenario="healthy",
                     env={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert run.status("gpu") == "pass", run
    assert "2 GPU(s)" in run.detail("gpu") and "6 more hidden" in run.detail("gpu")
    run = run_doctor("--check", "gpu", scenario="healthy", env={"CUDA_VISIBLE_DEVICES": "0,9,1"})
    assert run.status("gpu") == "warn", run
    assert "'9' matches no GPU" in run.detail("gpu")


def test_fake_pynvml_uses_the_real_error_classes() -> None:
    code = (
        "import pynvml, _real_pynvml as real\n"
        "assert pynvml.NVMLError_Timeout is real.NVMLError_Timeout\n"
        "assert pynvml.NVML_ERROR_TIMEOUT == real.NVML_ERROR_TIMEOUT == 10\n"
        "try:\n    pynvml.nvmlInit()\nexcept real.NVMLError_LibraryNotFound as e:\n"
        "    print(type(e).__name__, e.value, e)\n"
    )
    env = _clean_env({"FAKE_NVML_SCENARIO": "notfound"}, fake=True)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "NVMLError_LibraryNotFound 12 NVML Shared Library Not Found"


# ------------------------------------------------------------------ Slurm


def _slurm_env(**over: str) -> dict[str, str]:
    """What Slurm 22.05 sets for ``srun -N3 --ntasks-per-node=2`` on the first node."""
    me = socket.gethostname()
    env = {
        "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NODELIST": f"{me},gpu[02-03]",
        "SLURM_NODELIST": f"{me},gpu[02-03]", "SLURM_NNODES": "3", "SLURM_JOB_NUM_NODES": "3",
        "SLURM_NTASKS": "6", "SLURM_NPROCS": "6", "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0", "SLURMD_NODENAME": me, "SLURM_STEP_GPUS": "0,1",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    env.update(over)
    return env


def test_slurm_consistent_environment_passes() -> None:
    run = run_doctor("--nproc-per-node", "2", *ONLY_SLURM, scenario="healthy",
                     env=_slurm_env())
    assert run.status("slurm") == "pass", run
    assert "3 node(s), 6 task(s), this is task 1, 2 GPU(s) granted" in run.detail("slurm")


def test_slurm_inconsistent_environment_fails() -> None:
    run = run_doctor(*ONLY_SLURM, scenario="healthy", env=_slurm_env(
        SLURM_NTASKS="5", SLURM_PROCID="7", SLURMD_NODENAME="gpu09",
        SLURM_STEP_GPUS="0,1,2,3", FAKE_NVML_GPUS="2", CUDA_VISIBLE_DEVICES="0,1"))
    assert run.status("slurm") == "fail", run
    detail = run.detail("slurm")
    assert "SLURM_NTASKS=5 but nodes x tasks per node = 6" in detail
    assert "SLURM_PROCID=7 >= SLURM_NTASKS=5" in detail
    assert "'gpu09' is not in SLURM_JOB_NODELIST" in detail
    assert "Slurm granted 4 GPU(s) (SLURM_STEP_GPUS) but only 2 visible" in detail
    run = run_doctor(*ONLY_SLURM, env=_slurm_env(SLURM_JOB_NODELIST="gpu[03-"))
    assert run.status("slurm") == "fail", run
    assert "does not expand" in run.detail("slurm")


def test_kubernetes_pod_says_what_it_derived_and_which_names_do_not_resolve() -> None:
    """A JobSet pod: the check derives the job's shape as the launcher does and says from
    which variable; the headless Service's names do not resolve on this machine (warn, not
    fail: a pod without an address yet resolves once it has one); a malformed variable
    fails, named; outside a job pod the check is skipped."""
    pod = {"JOBSET_NAME": "llama", "HOSTNAME": "llama-workers-1-0", "JOBSET_REPLICAS": "3",
           "JOBSET_JOB_INDEX": "1", "JOBSET_RESTART_ATTEMPT": "0", "FTRUN_STANDBY_NODES": "1"}
    run = run_doctor("--check", "kubernetes", env=pod)
    assert run.status("kubernetes") == "warn", run
    detail = run.detail("kubernetes")
    assert "nodes 2: 3 pod(s) (JOBSET_REPLICAS) less 1 standing by" in detail
    assert "rendezvous c10d at llama-workers-0-0.llama:29400" in detail
    assert "llama-workers-0-0.llama (the first pod, the rendezvous store) does not " \
           "resolve yet" in detail
    run = run_doctor("--check", "kubernetes", env={**pod, "JOBSET_JOB_INDEX": "3"})
    assert run.status("kubernetes") == "fail", run
    assert "JOBSET_JOB_INDEX=3 is not below JOBSET_REPLICAS=3" in run.detail("kubernetes")
    run = run_doctor("--check", "kubernetes", env={"HOSTNAME": "web-1"})
    assert run.status("kubernetes") == "skip", run


def test_slurm_real_srun(slurm_cluster: Any) -> None:
    """Doctor inside real ``srun`` steps on the private test cluster: the environment Slurm
    really sets must read as consistent."""
    env = _clean_env()
    env.pop("PYTHONPATH")
    result = slurm_cluster.srun(
        ["-n2", "--chdir", str(REPO), sys.executable, "-m", "ftrun.doctor", "--json",
         "--nproc-per-node", "cpu", "--timeout", "10"],
        env={**env, "PYTHONPATH": str(REPO)}, timeout=120)
    docs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(docs) == 2, (result.stdout, result.stderr)
    for doc in docs:
        slurm = next(c for c in doc["checks"] if c["name"] == "slurm")
        assert slurm["status"] == "pass", slurm
        assert "1 node(s), 2 task(s)" in slurm["detail"], slurm


# ------------------------------------------------------------------ the main CLI


def test_python_dash_m_ftrun_doctor() -> None:
    run = run_doctor("--check", "host", module="ftrun doctor")
    assert "host.shm" in run.checks
    run = run_doctor("--nproc-per-node", "abc", module="ftrun doctor")
    assert run.rc == 2


# ------------------------------------------------------------------ in-process units


def test_run_checks_turns_exceptions_and_hangs_into_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(ctx: doctor.Context) -> CheckResult:
        raise ValueError("bad value\nsecond line")

    def hang(ctx: doctor.Context) -> CheckResult:
        time.sleep(30)
        raise AssertionError("unreachable")

    monkeypatch.setattr(doctor, "CHECKS", [
        CheckSpec("t.boom", boom, ""), CheckSpec("t.hang", hang, "it hangs"),
        *[s for s in doctor.CHECKS if s.name == "host.shm"],
    ])
    t = time.monotonic()
    results = doctor.run_checks(Options(nproc_per_node="cpu", timeout=1.0))
    assert time.monotonic() - t < 5
    by = {r.name: r for r in results}
    assert (by["t.boom"].status, by["t.boom"].detail) == ("fail", "ValueError: bad value")
    assert by["t.hang"].status == "fail" and by["t.hang"].hint == "it hangs"
    assert by["host.shm"].status in STATUSES
    assert doctor.report(results, 1.0)["ok"] is False


def test_parsers() -> None:
    assert doctor.parse_nproc("auto") == "auto"
    assert doctor.parse_nproc("GPU") == "gpu"
    assert doctor.parse_nproc("8") == 8
    for bad in ("abc", "0", "-1", "1.5", ""):
        with pytest.raises(doctor.UsageError):
            doctor.parse_nproc(bad)
    assert doctor.parse_endpoint("node1") == ("node1", 29400)
    assert doctor.parse_endpoint("node1:1234") == ("node1", 1234)
    assert doctor.parse_endpoint("[::1]:5") == ("::1", 5)
    assert doctor.parse_endpoint("fe80::1") == ("fe80::1", 29400)
    assert doctor.parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert doctor.parse_tasks_per_node("4") == [4]


def test_nccl_ifname_syntax() -> None:
    ifaces = ["lo", "eth0", "eth1", "ib0", "docker0", "ens5"]
    assert doctor.nccl_select("eth", ifaces) == ["eth0", "eth1"]
    assert doctor.nccl_select("eth0,ib", ifaces) == ["eth0", "ib0"]
    assert doctor.nccl_select("^docker,lo", ifaces) == ["eth0", "eth1", "ib0", "ens5"]
    assert doctor.nccl_select("=eth", ifaces) == []
    assert doctor.nccl_select("=eth1", ifaces) == ["eth1"]
    assert doctor.nccl_select("^=eth0", ifaces) == ["lo", "eth1", "ib0", "docker0", "ens5"]
    assert doctor.nccl_default_ifaces(ifaces) == ["ib0"]
    assert doctor.nccl_default_ifaces(["lo", "docker0", "eth0"]) == ["eth0"]
    assert doctor.nccl_default_ifaces(["lo"]) == ["lo"]


def test_visible_devices_mapping() -> None:
    from ftrun.host.gpu import visible_indices

    uuids = ["GPU-aaa", "GPU-bbb", "GPU-ccc"]
    assert visible_indices(None, uuids) == ([0, 1, 2], None)
    assert visible_indices("2,0", uuids) == ([2, 0], None)
    assert visible_indices("GPU-bb", uuids) == ([1], None)
    assert visible_indices("", uuids)[0] == []
    got, note = visible_indices("0,7,1", uuids)
    assert got == [0] and "'7'" in (note or "")


def test_elf_needed_reads_real_libraries() -> None:
    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    assert "libc10.so" in doctor.elf_needed(lib)
    with pytest.raises(ValueError):
        doctor.elf_needed(__file__)


def test_gpu_text_grouping() -> None:
    texts = ["GPU 0: off", "GPU 1: off", "GPU 2: off", "GPU 5: off", "GPU 3: hot"]
    assert doctor.group_gpu_texts(texts) == ["GPUs 0-2, 5: off", "GPU 3: hot"]
