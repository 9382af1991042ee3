"""What ftrun derives from a Kubernetes pod's environment (ftrun.host.kubernetes) and how it
meets the command line (ftrun.cli): the values, their precedence, and one-line errors."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from ftrun.cli import config_from_args
from ftrun.config import ConfigError
from ftrun.host.kubernetes import (
    KubernetesEnvironment,
    KubernetesEnvironmentError,
    kubernetes_launch_defaults,
)


def jobset_pod(job_index: int, replicas: int = 3, **extra: str) -> dict[str, str]:
    return {"HOSTNAME": f"llama-workers-{job_index}-0", "JOBSET_NAME": "llama",
            "JOBSET_REPLICATED_JOB": "workers", "JOBSET_REPLICAS": str(replicas),
            "JOBSET_JOB_INDEX": str(job_index), "JOBSET_RESTART_ATTEMPT": "2",
            "JOB_COMPLETION_INDEX": "0", "KUBERNETES_SERVICE_HOST": "10.0.0.1", **extra}


def indexed_pod(index: int, pods: int = 4, **extra: str) -> dict[str, str]:
    return {"HOSTNAME": f"train-{index}", "JOB_COMPLETION_INDEX": str(index),
            "FTRUN_K8S_PODS": str(pods), "FTRUN_K8S_SUBDOMAIN": "train-svc", **extra}


def test_a_jobset_pod_gives_the_shape_and_index_zeros_stable_name() -> None:
    assert kubernetes_launch_defaults(jobset_pod(2)) == {
        "nnodes": "3", "rdzv_backend": "c10d",
        "rdzv_endpoint": "llama-workers-0-0.llama:29400", "rdzv_id": "llama-2",
        "standby_nodes": "0", "local_addr": "llama-workers-2-0.llama"}


def test_standby_pods_are_not_training_nodes() -> None:
    found = kubernetes_launch_defaults(jobset_pod(0, FTRUN_STANDBY_NODES="1"))
    assert (found["nnodes"], found["standby_nodes"]) == ("2", "1")


def test_an_indexed_job_pod_and_the_knobs() -> None:
    found = kubernetes_launch_defaults(indexed_pod(3, FTRUN_RDZV_PORT="29555"))
    assert found["nnodes"] == "4"
    assert found["rdzv_endpoint"] == "train-0.train-svc:29555"
    assert found["rdzv_id"] == "train"
    assert found["local_addr"] == "train-3.train-svc"


def test_outside_a_job_pod_nothing_is_derived() -> None:
    assert kubernetes_launch_defaults({"KUBERNETES_SERVICE_HOST": "10.0.0.1",
                                       "HOSTNAME": "web-7d9f"}) == {}
    assert kubernetes_launch_defaults({}) == {}


@pytest.mark.parametrize(("env", "named"), [
    (jobset_pod(3), "JOBSET_JOB_INDEX=3 is not below JOBSET_REPLICAS=3"),
    (jobset_pod(1, JOBSET_REPLICAS="three"), "JOBSET_REPLICAS='three'"),
    (jobset_pod(1, JOB_COMPLETION_INDEX="1", HOSTNAME="llama-workers-1-1"),
     "one pod per Job"),
    (jobset_pod(1, HOSTNAME="some-other-name"), "does not end in '-1-0'"),
    (jobset_pod(1, FTRUN_STANDBY_NODES="3"), "leaves no training pod"),
    (jobset_pod(1, FTRUN_K8S_SUBDOMAIN="Bad_Name"), "is not a DNS label"),
    (jobset_pod(1, FTRUN_RDZV_PORT="70000"), "is not a port"),
    ({k: v for k, v in jobset_pod(1).items() if k != "HOSTNAME"}, "HOSTNAME is not set"),
    (indexed_pod(4), "JOB_COMPLETION_INDEX=4 is not below FTRUN_K8S_PODS=4"),
    ({"HOSTNAME": "train-1", "JOB_COMPLETION_INDEX": "1"}, "FTRUN_K8S_PODS is not set"),
])
def test_a_bad_variable_is_named(env: dict[str, str], named: str) -> None:
    with pytest.raises(KubernetesEnvironmentError, match=named.replace("(", r"\(")):
        kubernetes_launch_defaults(env)


def test_doctor_lines_say_where_each_value_came_from() -> None:
    why = "\n".join(KubernetesEnvironment(jobset_pod(1, FTRUN_STANDBY_NODES="1")).why())
    assert "nodes 2: 3 pod(s) (JOBSET_REPLICAS) less 1 standing by" in why
    assert "llama-workers-0-0.llama:29400" in why and "run id llama-2" in why


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def config(argv: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
    return config_from_args(argv, {**env, "FTRUN_PRELOAD": "none",
                                   "FTRUN_K8S_DNS_WAIT_S": env.get("FTRUN_K8S_DNS_WAIT_S",
                                                                   "0")})


@pytest.fixture
def pod_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The headless Service's names (``*.llama``) resolve, to loopback: the cluster DNS
    this machine has not got."""
    real = socket.getaddrinfo

    def getaddrinfo(host: object, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.endswith(".llama"):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_the_cli_takes_the_pods_shape_and_flags_win(script: str, pod_dns: None) -> None:
    pod = jobset_pod(1, FTRUN_STANDBY_NODES="1")
    derived = config(["--recovery", "regroup", script], pod)
    assert (derived.nnodes_min, derived.nnodes_max, derived.standby_nodes) == (2, 2, 1)
    assert (derived.rdzv_backend, derived.rdzv_id) == ("c10d", "llama-2")
    assert derived.rdzv_endpoint == "llama-workers-0-0.llama:29400"
    # one --standby-nodes on the command line: the pods less that many train
    flagged = config(["--recovery", "regroup", "--standby-nodes", "0", script], pod)
    assert (flagged.nnodes_max, flagged.standby_nodes) == (3, 0)
    # torchrun's PET_* variables and explicit flags win over the pod's
    assert config(["--recovery", "regroup", script],
                  {**pod, "PET_RDZV_ID": "mine"}).rdzv_id == "mine"
    static = config(["--nnodes", "2", "--rdzv-backend", "static", "--master-addr",
                     "127.0.0.1", "--node-rank", "1", script], jobset_pod(1))
    assert (static.nnodes_max, static.rdzv_backend) == (2, "static")
    assert derived.local_addr == "llama-workers-1-0.llama"


def test_the_pods_names_are_waited_for_then_checked_like_flags(script: str) -> None:
    """Pods start in any order: a name without its pod's address yet is waited for, up to
    FTRUN_K8S_DNS_WAIT_S, then it is the usual one-line error."""
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"llama-workers-0-0\.llama"):
        config([script], {**jobset_pod(1), "FTRUN_K8S_DNS_WAIT_S": "1.5"})
    assert time.monotonic() - started >= 1.5


def test_a_malformed_pod_variable_is_one_config_error(script: str) -> None:
    with pytest.raises(ConfigError, match=r"^Kubernetes pod environment: JOBSET_REPLICAS"):
        config([script], jobset_pod(1, JOBSET_REPLICAS="x"))
