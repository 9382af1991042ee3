"""What a Kubernetes pod of a JobSet or an Indexed Job tells ftrun about its job.

Why: under Slurm, ``srun ftrun train.py`` needs no rendezvous flag because Slurm's variables
describe the job (:mod:`ftrun.host.slurm`). A pod of a JobSet (or of a plain Indexed Job)
can know as much: the Job controller sets ``JOB_COMPLETION_INDEX`` and the pod's stable
hostname (``HOSTNAME``), and the JobSet's labels reach the container through the downward
API under the names below. From them ftrun derives the node count, the run id and the
rendezvous endpoint, the stable name of the first pod. Explicit flags (and torchrun's
``PET_*`` variables, and Slurm's) win over everything here.

The rendezvous is c10d's: node ranks come from the order of arrival, so a pod that
Kubernetes recreates (same index, new IP) joins as a newcomer, and the pods beyond the
training nodes (``FTRUN_STANDBY_NODES``) stand by. Its store runs on the first pod.

Environment (the downward-API names are this module's contract; ``scripts/kubernetes/``
has manifests that set them)::

    HOSTNAME                  set by Kubernetes: <jobset>-<replicated job>-<job index>-<pod
                              index> in a JobSet, <job>-<pod index> in an Indexed Job
    JOB_COMPLETION_INDEX      set by the Job controller (Indexed completion mode)
    JOBSET_NAME               metadata.labels['jobset.sigs.k8s.io/jobset-name']
    JOBSET_REPLICATED_JOB     metadata.labels['jobset.sigs.k8s.io/replicatedjob-name']
    JOBSET_REPLICAS           metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']
    JOBSET_JOB_INDEX          metadata.labels['jobset.sigs.k8s.io/job-index']
    JOBSET_RESTART_ATTEMPT    metadata.labels['jobset.sigs.k8s.io/restart-attempt']
    FTRUN_K8S_SUBDOMAIN       the headless Service of the pods (default: the JobSet's name,
                              as JobSet's ``network.subdomain`` defaults to it)
    FTRUN_K8S_PODS            the pod count of an Indexed Job (its ``completions``)
    FTRUN_STANDBY_NODES       pods beyond the training nodes, standing by
    FTRUN_RDZV_PORT           the rendezvous port (default 29400)

A JobSet is read as one pod per Job (``parallelism: 1``, the usual shape for training):
its node count is ``JOBSET_REPLICAS``. Parsing is strict: a malformed or inconsistent value
raises :class:`KubernetesEnvironmentError` naming the variable, since a guessed node count
turns into a rendezvous that waits for a pod that never comes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["KubernetesEnvironment", "KubernetesEnvironmentError", "kubernetes_launch_defaults"]

#: torchrun's default c10d port, as under Slurm.
DEFAULT_RDZV_PORT = 29400
#: RFC 1123 labels: what a hostname and a Service name are made of.
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class KubernetesEnvironmentError(ValueError):
    """A pod variable is missing, malformed or inconsistent; the message names it."""


@dataclass(frozen=True)
class KubernetesEnvironment:
    """The job facts of one pod, read from its environment (``os.environ`` by default)."""

    environ: Mapping[str, str]

    @classmethod
    def current(cls) -> KubernetesEnvironment:
        return cls(os.environ)

    # --- what kind of pod ---------------------------------------------------------------

    @property
    def in_jobset(self) -> bool:
        return bool(self.environ.get("JOBSET_NAME"))

    @property
    def in_indexed_job(self) -> bool:
        return self.environ.get("JOB_COMPLETION_INDEX", "").strip() != ""

    @property
    def in_pod(self) -> bool:
        """A pod of a JobSet or an Indexed Job: ftrun derives the job's shape. A plain pod
        (``KUBERNETES_SERVICE_HOST`` alone) says nothing about other nodes."""
        return self.in_jobset or self.in_indexed_job

    # --- facts --------------------------------------------------------------------------

    def _int(self, name: str, default: int | None = None) -> int:
        value = self.environ.get(name, "").strip()
        if not value:
            if default is not None:
                return default
            raise KubernetesEnvironmentError(f"{name} is not set")
        if not value.isdigit():
            raise KubernetesEnvironmentError(f"{name}={value!r} is not a non-negative integer")
        return int(value)

    @property
    def hostname(self) -> str:
        name = self.environ.get("HOSTNAME", "").strip().lower()
        if not name:
            raise KubernetesEnvironmentError("HOSTNAME is not set (Kubernetes sets it to the "
                                             "pod's hostname)")
        return name.split(".", 1)[0]

    @property
    def pod_index(self) -> int:
        """The pod's index within its Job (0 where the Job has one pod)."""
        return self._int("JOB_COMPLETION_INDEX", default=0)

    @property
    def job_index(self) -> int:
        return self._int("JOBSET_JOB_INDEX")

    @property
    def pods(self) -> int:
        """Every pod of the job: the JobSet's Jobs (one pod each), or the Indexed Job's
        completions."""
        if self.in_jobset:
            count = self._int("JOBSET_REPLICAS")
            if self.pod_index != 0:
                raise KubernetesEnvironmentError(
                    f"JOB_COMPLETION_INDEX={self.pod_index} in a JobSet: ftrun reads a "
                    "JobSet as one pod per Job (parallelism 1); pass --nnodes for others")
            if self.job_index >= count:
                raise KubernetesEnvironmentError(
                    f"JOBSET_JOB_INDEX={self.job_index} is not below "
                    f"JOBSET_REPLICAS={count}")
        else:
            count = self._int("FTRUN_K8S_PODS")
            if self.pod_index >= count:
                raise KubernetesEnvironmentError(
                    f"JOB_COMPLETION_INDEX={self.pod_index} is not below "
                    f"FTRUN_K8S_PODS={count}")
        if count < 1:
            raise KubernetesEnvironmentError("the job has no pod (a count of 0)")
        return count

    @property
    def standby(self) -> int:
        return self._int("FTRUN_STANDBY_NODES", default=0)

    @property
    def nodes(self) -> int:
        """Training nodes: the pods, less those that stand by."""
        nodes = self.pods - self.standby
        if nodes < 1:
            raise KubernetesEnvironmentError(
                f"FTRUN_STANDBY_NODES={self.standby} leaves no training pod of {self.pods}")
        return nodes

    @property
    def first_pod(self) -> str:
        """The hostname of index 0 (job 0's pod 0 in a JobSet), where the store runs: this
        pod's own name with its indices set to 0."""
        name = self.hostname
        if self.in_jobset:
            suffix = f"-{self.job_index}-{self.pod_index}"
            first = "-0-0"
        else:
            suffix, first = f"-{self.pod_index}", "-0"
        if not name.endswith(suffix):
            raise KubernetesEnvironmentError(
                f"HOSTNAME={name!r} does not end in {suffix!r}, as a pod of "
                f"{'a JobSet' if self.in_jobset else 'an Indexed Job'} is named: set "
                "the pod's hostname, or pass --rdzv-endpoint")
        return name[: -len(suffix)] + first

    @property
    def subdomain(self) -> str | None:
        """The headless Service the pods are named under (None: the first pod's bare
        name, resolvable where the search path holds it)."""
        name = self.environ.get("FTRUN_K8S_SUBDOMAIN", "").strip().lower()
        if not name and self.in_jobset:
            name = self.environ["JOBSET_NAME"].strip().lower()
        if name and not _LABEL.match(name):
            raise KubernetesEnvironmentError(f"subdomain {name!r} is not a DNS label")
        return name or None

    @property
    def rdzv_port(self) -> int:
        port = self._int("FTRUN_RDZV_PORT", default=DEFAULT_RDZV_PORT)
        if not 0 < port < 65536:
            raise KubernetesEnvironmentError(f"FTRUN_RDZV_PORT={port} is not a port")
        return port

    @property
    def rdzv_id(self) -> str:
        """The job's name, and the JobSet's restart attempt: a JobSet restarted as a whole
        is a new job for the rendezvous, not the old one's leftovers."""
        if self.in_jobset:
            attempt = self._int("JOBSET_RESTART_ATTEMPT", default=0)
            return f"{self.environ['JOBSET_NAME'].strip()}-{attempt}"
        return self.first_pod[: -len("-0")]

    def _stable(self, hostname: str) -> str:
        """A pod's name as the other pods resolve it: under the headless Service."""
        return hostname if self.subdomain is None else f"{hostname}.{self.subdomain}"

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self._stable(self.first_pod)}:{self.rdzv_port}"

    @property
    def local_addr(self) -> str:
        """This pod's stable name, which the others reach it by (a bare hostname is not
        resolvable from another pod)."""
        return self._stable(self.hostname)

    def why(self) -> list[str]:
        """Where each derived value came from, a line each (``ftrun doctor``)."""
        kind = "a JobSet pod" if self.in_jobset else "an Indexed Job pod"
        count_from = "JOBSET_REPLICAS" if self.in_jobset else "FTRUN_K8S_PODS"
        lines = [f"{kind}: {self.hostname}",
                 f"nodes {self.nodes}: {self.pods} pod(s) ({count_from}) less "
                 f"{self.standby} standing by (FTRUN_STANDBY_NODES)",
                 f"rendezvous c10d at {self.rdzv_endpoint}: the first pod's stable name"
                 + (f" under the Service {self.subdomain}" if self.subdomain else ""),
                 f"this pod is reached at {self.local_addr}"]
        lines.append(f"run id {self.rdzv_id}: "
                     + ("JOBSET_NAME and JOBSET_RESTART_ATTEMPT" if self.in_jobset
                        else "the Job's name"))
        return lines


def kubernetes_launch_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun-flag defaults implied by the pod; ``{}`` outside a JobSet or Indexed Job.

    Keys are flag names with underscores (``nnodes``, ``rdzv_backend``, ``rdzv_endpoint``,
    ``rdzv_id``, ``standby_nodes``, ``local_addr``), values strings as typed on a command
    line.

    Raises KubernetesEnvironmentError on a malformed or inconsistent variable.
    """
    pod = KubernetesEnvironment(os.environ if environ is None else environ)
    if not pod.in_pod:
        return {}
    return {
        "nnodes": str(pod.nodes),
        "rdzv_backend": "c10d",
        "rdzv_endpoint": pod.rdzv_endpoint,
        "rdzv_id": pod.rdzv_id,
        "standby_nodes": str(pod.standby),
        "local_addr": pod.local_addr,
    }
