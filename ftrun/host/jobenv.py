"""The flag defaults a scheduler's environment implies: an ``srun`` step, or a Kubernetes
pod of a JobSet or an Indexed Job.

Why here and not in the parsers of :mod:`ftrun.host.slurm` and :mod:`ftrun.host.kubernetes`:
those read their variables into typed facts; this module maps the facts onto torchrun's
flags, which the command line applies as defaults (an explicit flag, then torchrun's
``PET_*`` variables, then these), and turns a malformed variable into the launcher's
one-line :class:`~ftrun.config.ConfigError` (exit 2).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from ftrun.config import DEFAULT_RDZV_PORT, ConfigError, parse_endpoint
from ftrun.host.hostnet import resolves

#: Slurm's warning signals (``--signal=USR1@90``) are forwarded too, so that a script can
#: checkpoint before a preemption or a time limit.
SLURM_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
#: How long, by default, a pod waits for the names it derived to resolve.
POD_DNS_WAIT_S = 300.0


def flag_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """An ``srun`` step's defaults, else a job pod's, else {}."""
    return slurm_defaults(environ) or pod_defaults(environ)


def slurm_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """Flag defaults from the srun step ftrun runs in ({} outside one).

    Slurm knows every node up front, so its job maps onto the static rendezvous: node rank
    from the step, the control store on the first host of the node list.
    """
    from ftrun.host.slurm import SlurmEnvironmentError, slurm_launch_defaults

    try:
        found = slurm_launch_defaults(environ)
    except SlurmEnvironmentError as error:
        raise ConfigError(f"Slurm environment: {error}") from None
    if not found:
        return {}
    defaults = {"signals_to_handle": SLURM_SIGNALS, "rdzv_id": found["rdzv_id"]}
    if "nproc_per_node" in found:
        defaults["nproc_per_node"] = found["nproc_per_node"]
    if int(found["nnodes"]) > 1:
        host, port = parse_endpoint(found["rdzv_endpoint"], DEFAULT_RDZV_PORT)
        defaults.update(
            nnodes=found["nnodes"], node_rank=found["node_rank"], master_addr=host,
            master_port=str(port or DEFAULT_RDZV_PORT),
        )
    return defaults


def pod_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """Flag defaults from the JobSet or Indexed Job pod ftrun runs in ({} outside one, and
    under an ``srun`` step, whose variables win; ftrun.host.kubernetes). A job of one pod
    needs no rendezvous."""
    from ftrun.host.kubernetes import KubernetesEnvironmentError, kubernetes_launch_defaults

    if slurm_defaults(environ):
        return {}
    try:
        found = kubernetes_launch_defaults(environ)
    except KubernetesEnvironmentError as error:
        raise ConfigError(f"Kubernetes pod environment: {error}") from None
    if not found or int(found["nnodes"]) + int(found["standby_nodes"]) < 2:
        return {}
    return found


def pod_nodes(pod: Mapping[str, str], *, nnodes: str, standby_nodes: str) -> str:
    """``--nnodes`` as parsed, where the pod gave it: its pods less the standing-by ones,
    and a ``--standby-nodes`` given on the command line (not FTRUN_STANDBY_NODES, which the
    pod read) changes how many of the pods that is."""
    if nnodes != pod["nnodes"] or standby_nodes == pod["standby_nodes"]:
        return nnodes
    pods = int(pod["nnodes"]) + int(pod["standby_nodes"])
    try:
        standby = int(standby_nodes)
    except ValueError:
        raise ConfigError(f"--standby-nodes={standby_nodes!r}: not an integer") from None
    if not 0 <= standby < pods:
        raise ConfigError(f"--standby-nodes={standby}: leaves no training pod of {pods}")
    return str(pods - standby)


def await_pod_names(pod: Mapping[str, str], used: Mapping[str, str | None],
                    environ: Mapping[str, str]) -> None:
    """The names a pod derived (the first pod's and its own, under the headless Service)
    resolve only once their pods have addresses, and pods start in any order: wait for the
    ones the command line kept (``used``: flag -> value as parsed), ``FTRUN_K8S_DNS_WAIT_S``
    (default 300 s) in all, saying so once. A name that never resolves is then the launcher's
    usual one-line error."""
    names = [host for flag, host in (
        ("rdzv_endpoint", parse_endpoint(pod.get("rdzv_endpoint", ""), 0)[0]),
        ("local_addr", pod.get("local_addr", "")))
        if host and used.get(flag) == pod.get(flag)]
    try:
        wait_s = float(environ.get("FTRUN_K8S_DNS_WAIT_S", str(POD_DNS_WAIT_S)))
    except ValueError:
        raise ConfigError("FTRUN_K8S_DNS_WAIT_S: not a number of seconds") from None
    deadline = time.monotonic() + wait_s
    said = False
    for name in names:
        while not resolves(name) and time.monotonic() < deadline:
            if not said:
                print(f"ftrun: waiting up to {wait_s:.0f} s for {name} to resolve (a pod of "
                      "this job without an address yet)", file=sys.stderr, flush=True)
                said = True
            time.sleep(1.0)
