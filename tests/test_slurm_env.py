"""ftrun.host.slurm over recorded Slurm 22.05 environments.

The single-node recordings (``SRUN_N1_N2``, ``BATCH_N1``) were taken from real srun/sbatch
runs of the private test cluster (tests/infra/slurm_cluster.py); the multi-node ones are
what Slurm 22.05 sets for those commands (same variables, values for the shape asked for).
Noise variables (SLURM_TASK_PID, ports, UMASK...) are kept so the parser is tested against
the whole environment, not a hand-picked subset.
"""

from __future__ import annotations

import os

import pytest

from ftrun.host.slurm import (
    SlurmEnvironment,
    SlurmEnvironmentError,
    parse_tasks_per_node,
    slurm_launch_defaults,
)

_COMMON = {
    "SLURM_CLUSTER_NAME": "hpc",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_JOB_UID": "1000",
    "SLURM_JOB_GID": "1000",
    "SLURM_JOB_USER": "alice",
    "SLURM_SUBMIT_DIR": "/home/alice/run",
    "SLURM_SUBMIT_HOST": "login1",
    "SLURM_PRIO_PROCESS": "0",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
    "SLURM_WORKING_CLUSTER": "hpc:ctl1:6817:9728:109",
}

# sbatch -N2 --ntasks-per-node=1 job.sh: the batch script on the first node.
BATCH_N2 = {
    **_COMMON,
    "ENVIRONMENT": "BATCH",
    "SLURMD_NODENAME": "node01",
    "SLURM_CPUS_ON_NODE": "64",
    "SLURM_GTIDS": "0",
    "SLURM_JOBID": "4242",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_CPUS_PER_NODE": "64(x2)",
    "SLURM_JOB_NAME": "job.sh",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "node[01-02]",
    "SLURM_NODE_ALIASES": "(null)",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PROCID": "0",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASK_PID": "81234",
    "SLURM_TOPOLOGY_ADDR": "node01",
}

# Recorded on the test cluster: sbatch -N1 -n2 job.sh, the batch script itself.
BATCH_N1 = {
    "ENVIRONMENT": "BATCH",
    "SLURMD_NODENAME": "vm",
    "SLURM_CLUSTER_NAME": "ftrun-test",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_GTIDS": "0",
    "SLURM_JOBID": "2",
    "SLURM_JOB_CPUS_PER_NODE": "2",
    "SLURM_JOB_ID": "2",
    "SLURM_JOB_NAME": "job.sh",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "vm",
    "SLURM_NODE_ALIASES": "(null)",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_TASK_PID": "4403",
    "SLURM_TOPOLOGY_ADDR": "vm",
}


def _step(job: dict[str, str], **over: str) -> dict[str, str]:
    """A step task's environment: what srun adds on top of a job's."""
    env = {k: v for k, v in job.items() if k != "ENVIRONMENT"}
    env.update(over)
    return env


# Recorded on the test cluster: srun -N1 -n2 (outside sbatch), task 1.
SRUN_N1_N2 = {
    "SLURMD_NODENAME": "vm",
    "SLURM_CLUSTER_NAME": "ftrun-test",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_GTIDS": "0,1",
    "SLURM_JOBID": "1",
    "SLURM_JOB_CPUS_PER_NODE": "2",
    "SLURM_JOB_GID": "0",
    "SLURM_JOB_ID": "1",
    "SLURM_JOB_NAME": "bash",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_JOB_UID": "0",
    "SLURM_JOB_USER": "root",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
    "SLURM_LOCALID": "1",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "vm",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_PRIO_PROCESS": "0",
    "SLURM_PROCID": "1",
    "SLURM_SRUN_COMM_HOST": "127.0.0.1",
    "SLURM_SRUN_COMM_PORT": "44731",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_LAUNCHER_PORT": "44731",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_SUBMIT_DIR": "/work/main",
    "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_TASK_PID": "4362",
    "SLURM_TOPOLOGY_ADDR": "vm",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
    "SLURM_UMASK": "0022",
    "SLURM_WORKING_CLUSTER": "ftrun-test:127.0.0.1:56939:9728:109",
}

# srun -N2 -n2 inside the BATCH_N2 job (step 0), task 1 on node02.
SRUN_N2_N2 = _step(
    BATCH_N2,
    SLURMD_NODENAME="node02",
    SLURM_GTIDS="1",
    SLURM_LAUNCH_NODE_IPADDR="10.1.0.11",
    SLURM_LOCALID="0",
    SLURM_NODEID="1",
    SLURM_PROCID="1",
    SLURM_SRUN_COMM_HOST="10.1.0.11",
    SLURM_SRUN_COMM_PORT="40123",
    SLURM_STEPID="0",
    SLURM_STEP_ID="0",
    SLURM_STEP_LAUNCHER_PORT="40123",
    SLURM_STEP_NODELIST="node[01-02]",
    SLURM_STEP_NUM_NODES="2",
    SLURM_STEP_NUM_TASKS="2",
    SLURM_STEP_TASKS_PER_NODE="1(x2)",
    SLURM_TASK_PID="90210",
    SLURM_TOPOLOGY_ADDR="node02",
    SLURM_UMASK="0022",
)

# sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8; srun (step 3, the 4th srun of
# the job) task on gpu03: Slurm binds all 8 GPUs of the node to the one task.
_GPU8 = ",".join(str(i) for i in range(8))
SRUN_N4_GPU8 = {
    **_COMMON,
    "SLURMD_NODENAME": "gpu03",
    "SLURM_CPUS_ON_NODE": "96",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_GPUS_PER_NODE": "8",
    "SLURM_GTIDS": "2",
    "SLURM_JOBID": "77001",
    "SLURM_JOB_ID": "77001",
    "SLURM_JOB_CPUS_PER_NODE": "96(x4)",
    "SLURM_JOB_GPUS": _GPU8,
    "SLURM_JOB_NAME": "ftrun.sbatch",
    "SLURM_JOB_NODELIST": "gpu[01-04]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_LAUNCH_NODE_IPADDR": "10.2.0.1",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_NODELIST": "gpu[01-04]",
    "SLURM_NPROCS": "4",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PROCID": "2",
    "SLURM_SRUN_COMM_HOST": "10.2.0.1",
    "SLURM_SRUN_COMM_PORT": "35555",
    "SLURM_STEPID": "3",
    "SLURM_STEP_ID": "3",
    "SLURM_STEP_GPUS": _GPU8,
    "SLURM_STEP_LAUNCHER_PORT": "35555",
    "SLURM_STEP_NODELIST": "gpu[01-04]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    "SLURM_TASKS_PER_NODE": "1(x4)",
    "SLURM_TASK_PID": "5150",
    "SLURM_TOPOLOGY_ADDR": "gpu03",
    "CUDA_VISIBLE_DEVICES": _GPU8,
    "GPU_DEVICE_ORDINAL": _GPU8,
}

# srun -N3 -n7 (block distribution: 3 tasks on cn1, 2 on cn2, 2 on cn5); task 4 on cn2.
SRUN_HETERO = {
    **_COMMON,
    "SLURMD_NODENAME": "cn2",
    "SLURM_GTIDS": "3,4",
    "SLURM_JOBID": "555",
    "SLURM_JOB_ID": "555",
    "SLURM_JOB_NODELIST": "cn[1-2,5]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "cn[1-2,5]",
    "SLURM_NPROCS": "7",
    "SLURM_NTASKS": "7",
    "SLURM_PROCID": "4",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "cn[1-2,5]",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)",
    "SLURM_TASKS_PER_NODE": "3,2(x2)",
}


# ----------------------------------------------------------------------------- batch
@pytest.mark.parametrize("env", [BATCH_N2, BATCH_N1], ids=["N2", "N1-recorded"])
def test_batch_script_is_not_a_step(env: dict[str, str]) -> None:
    s = SlurmEnvironment(env)
    assert s.in_job
    assert not s.in_slurm  # SLURM_PROCID=0 is set, SLURM_STEP_ID is not
    assert slurm_launch_defaults(env) == {}


def test_batch_step_id_sentinel_is_not_a_step() -> None:
    env = {**BATCH_N2, "SLURM_STEP_ID": "4294967291"}
    assert not SlurmEnvironment(env).in_slurm


def test_not_in_slurm() -> None:
    s = SlurmEnvironment({"PATH": "/usr/bin"})
    assert not s.in_job and not s.in_slurm
    assert s.gpus == ()
    assert slurm_launch_defaults({}) == {}
    with pytest.raises(SlurmEnvironmentError, match="SLURM_JOB_ID is not set"):
        _ = s.job_id


def test_default_mapping_is_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ("CUDA_VISIBLE_DEVICES", "FTRUN_RDZV_PORT"):
            monkeypatch.delenv(k)
    for k, v in SRUN_N2_N2.items():
        monkeypatch.setenv(k, v)
    assert SlurmEnvironment().proc_id == 1
    assert slurm_launch_defaults()["node_rank"] == "1"


# ----------------------------------------------------------------------------- steps
def test_srun_n2_n2_one_agent_per_node() -> None:
    s = SlurmEnvironment(SRUN_N2_N2)
    assert s.in_slurm
    assert (s.job_id, s.step_id, s.proc_id, s.node_id, s.local_id) == ("4242", 0, 1, 1, 0)
    assert (s.ntasks, s.nnodes, s.ntasks_per_node) == (2, 2, (1, 1))
    assert s.hostnames == ("node01", "node02")
    assert s.first_host == "node01"
    assert s.gpus == ()
    assert not s.agent_per_task
    assert slurm_launch_defaults(SRUN_N2_N2) == {
        "nnodes": "2",
        "node_rank": "1",
        "rdzv_id": "4242.0",
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "node01:29400",
    }


def test_srun_n1_n2_recorded_one_agent_per_task() -> None:
    s = SlurmEnvironment(SRUN_N1_N2)
    assert s.in_slurm and s.agent_per_task
    assert (s.ntasks, s.nnodes, s.ntasks_per_node, s.local_id) == (2, 1, (2,), 1)
    assert slurm_launch_defaults(SRUN_N1_N2) == {
        "nnodes": "2",  # two agents share the node: each is a rendezvous node
        "node_rank": "1",  # SLURM_PROCID, not SLURM_NODEID (0 for both)
        "rdzv_id": "1.0",
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "vm:29400",
    }


def test_srun_n4_gpus_per_node_8() -> None:
    s = SlurmEnvironment(SRUN_N4_GPU8)
    assert s.hostnames == ("gpu01", "gpu02", "gpu03", "gpu04")
    assert s.gpus == tuple(str(i) for i in range(8))
    assert s.ntasks_per_node == (1, 1, 1, 1)
    assert slurm_launch_defaults(SRUN_N4_GPU8) == {
        "nnodes": "4",
        "node_rank": "2",
        "rdzv_id": "77001.3",
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "gpu01:29400",
        "nproc_per_node": "8",
    }


def test_heterogeneous_tasks_per_node() -> None:
    s = SlurmEnvironment(SRUN_HETERO)
    assert s.ntasks_per_node == (3, 2, 2)
    assert s.hostnames == ("cn1", "cn2", "cn5")
    d = slurm_launch_defaults(SRUN_HETERO)
    assert (d["nnodes"], d["node_rank"], d["rdzv_endpoint"]) == ("7", "4", "cn1:29400")


def test_step_on_a_subset_of_the_job() -> None:
    """srun -N2 -r2 inside a 4-node job: the step's nodes, not the job's, define node 0."""
    env = {
        **SRUN_N4_GPU8,
        "SLURM_NODELIST": "gpu[03-04]",
        "SLURM_STEP_NODELIST": "gpu[03-04]",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
    }
    d = slurm_launch_defaults(env)
    assert (d["nnodes"], d["node_rank"], d["rdzv_endpoint"]) == ("2", "0", "gpu03:29400")


# ----------------------------------------------------------------------------- details
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", (1,)),
        ("2(x3),1", (2, 2, 2, 1)),
        ("3,2(x2)", (3, 2, 2)),
        ("8(x128)", (8,) * 128),
    ],
)
def test_parse_tasks_per_node(text: str, expected: tuple[int, ...]) -> None:
    assert parse_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", ["", "2(x)", "x3", "2(3)", "2,,1", "-1", "2(x0)"])
def test_parse_tasks_per_node_malformed(text: str) -> None:
    with pytest.raises(SlurmEnvironmentError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node(text)


def test_nodelist_expansion() -> None:
    env = {**SRUN_N2_N2, "SLURM_STEP_NODELIST": "gpu[01-04,07],cpu3"}
    assert SlurmEnvironment(env).hostnames == (
        "gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3",
    )


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu[3-1]", ""])
def test_malformed_nodelist(bad: str) -> None:
    env = {**SRUN_N2_N2, "SLURM_STEP_NODELIST": bad}
    with pytest.raises(SlurmEnvironmentError, match="SLURM_STEP_NODELIST") as info:
        slurm_launch_defaults(env)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("var", "value"),
    [("SLURM_PROCID", "one"), ("SLURM_STEP_NUM_NODES", "-2"), ("SLURM_NODEID", "")],
)
def test_malformed_integer_names_variable(var: str, value: str) -> None:
    with pytest.raises(SlurmEnvironmentError, match=var):
        slurm_launch_defaults({**SRUN_N2_N2, var: value})


@pytest.mark.parametrize(
    ("over", "pattern"),
    [
        ({"SLURM_STEP_NODELIST": "node[01-03]"}, "3 hosts but the step has 2 nodes"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, "SLURM_TASKS_PER_NODE gives"),
        ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2 >= ntasks=2"),
        ({"SLURM_NODEID": "5"}, "SLURM_NODEID=5"),
    ],
)
def test_inconsistent_step(over: dict[str, str], pattern: str) -> None:
    with pytest.raises(SlurmEnvironmentError, match=pattern):
        slurm_launch_defaults({**SRUN_N2_N2, **over})


def test_rdzv_id_after_requeue_and_port_override() -> None:
    env = {**SRUN_N2_N2, "SLURM_RESTART_COUNT": "2", "FTRUN_RDZV_PORT": "31000"}
    d = slurm_launch_defaults(env)
    assert d["rdzv_id"] == "4242.0.r2"
    assert d["rdzv_endpoint"] == "node01:31000"
    with pytest.raises(SlurmEnvironmentError, match="FTRUN_RDZV_PORT"):
        slurm_launch_defaults({**SRUN_N2_N2, "FTRUN_RDZV_PORT": "70000"})


@pytest.mark.parametrize(
    ("over", "expected"),
    [
        ({"SLURM_STEP_GPUS": "4,5", "CUDA_VISIBLE_DEVICES": "0,1"}, ("4", "5")),
        ({"SLURM_JOB_GPUS": "2"}, ("2",)),
        ({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}, ("GPU-1a2b", "GPU-3c4d")),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, ()),
        ({"SLURM_GPUS_ON_NODE": "4"}, ("0", "1", "2", "3")),
        ({"SLURM_GPUS_ON_NODE": "0"}, ()),
    ],
)
def test_gpus_sources(over: dict[str, str], expected: tuple[str, ...]) -> None:
    s = SlurmEnvironment({**SRUN_N2_N2, **over})
    assert s.gpus == expected
    d = slurm_launch_defaults(s)
    assert d.get("nproc_per_node") == (str(len(expected)) if expected else None)


def test_gpus_per_task_with_agents_sharing_a_node() -> None:
    """--ntasks-per-node=8 --gpus-per-task=1: each agent sees (and launches for) one GPU."""
    env = {
        **SRUN_N1_N2,
        "SLURM_STEP_GPUS": "1",
        "CUDA_VISIBLE_DEVICES": "1",
        "SLURM_GPUS_PER_TASK": "1",
    }
    d = slurm_launch_defaults(env)
    assert (d["nnodes"], d["node_rank"], d["nproc_per_node"]) == ("2", "1", "1")
