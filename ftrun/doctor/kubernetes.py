"""The Kubernetes check: what ftrun derives from this pod, and whether it can work.

In a pod of a JobSet or an Indexed Job, ftrun takes the job's shape from the pod's
environment (:mod:`ftrun.host.kubernetes`): node count, run id, rendezvous endpoint, this
pod's stable name. This check says what it derived and from which variable, and fails on
what would make the job wait for nothing: a malformed variable, or a derived name that does
not resolve (a missing headless Service, a subdomain that is not the Service's name).
"""

from __future__ import annotations

from ftrun.doctor.core import CheckResult, Context, check, failed, passed, skipped, warned
from ftrun.host.hostnet import resolves
from ftrun.host.kubernetes import KubernetesEnvironment, KubernetesEnvironmentError

FIX = ("expose the JobSet labels through the downward API as scripts/kubernetes/ does "
       "(docs/kubernetes.md), or pass the rendezvous flags")


@check("kubernetes")
def check_kubernetes(ctx: Context) -> CheckResult:
    """Derive the job's shape as the launcher would, say where each value came from, and
    check that the names the pods meet by resolve here."""
    pod = KubernetesEnvironment(ctx.env)
    if not pod.in_pod:
        return skipped("not in a JobSet or Indexed Job pod (JOBSET_NAME and "
                       "JOB_COMPLETION_INDEX unset)")
    try:
        why = pod.why()
        endpoint, local = pod.rdzv_endpoint.rsplit(":", 1)[0], pod.local_addr
    except KubernetesEnvironmentError as error:
        return failed(str(error), FIX)
    unresolved = [f"{name} ({what}) does not resolve yet" for name, what in (
        (endpoint, "the first pod, the rendezvous store"), (local, "this pod"))
        if not resolves(name)]
    if unresolved:  # a pod without an address yet resolves once it has one: not a failure
        return warned("; ".join([*why, *unresolved]),
                      "the pods' headless Service must exist, named as the subdomain "
                      "(FTRUN_K8S_SUBDOMAIN, default the JobSet's name)")
    return passed("; ".join(why))
