"""The example manifests in ``scripts/kubernetes/`` against the Kubernetes API schema.

Why: no cluster runs these manifests in CI, so a misspelled key (which an API server may
drop or only warn about) or a wrong type would first be met by a user. Every document is
walked against the models of the ``kubernetes`` Python client, which are generated from the
API's OpenAPI schema: each key must be a field of its model, each value of the field's
type, and each model is then built by the client itself so that its own required-field
checks run. The JobSet is a custom resource the client does not know: its own fields are
checked against a small schema copied from JobSet's ``api/jobset/v1alpha2/jobset_types.go``,
and each of its Job templates with the client's models again.

Beyond the schema, the tests hold the manifests to ftrun's contract with the pod
(``ftrun/host/kubernetes.py``): the downward-API variables ftrun reads, the /dev/shm its
snapshots need, the metrics annotations, and the failure policies that match ftrun's exit
codes (``ftrun/exitcodes.py``). The negative tests break a manifest on purpose, to show the
checks can fail.
"""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.client.models
import pytest
import yaml

MANIFESTS = Path(__file__).resolve().parent.parent / "scripts" / "kubernetes"


class SchemaError(Exception):
    """A document does not fit the schema; the message starts with the path of the value."""


# --- the Kubernetes client's models ------------------------------------------------------

# Type strings of both generations of the client: 'list[V1Container]' and 'dict(str, str)'
# (up to 35.x), 'List[V1Container]' and 'Dict[str, str]' (36 and later, pydantic models).
_LIST = re.compile(r"^[Ll]ist\[(.+)\]$")
_DICT = re.compile(r"^(?:dict\(str, (.+)\)|Dict\[str, (.+)\])$")

#: Fields of type Quantity. The client types them 'str', but the API takes a number as well
#: (``nvidia.com/gpu: 8``, ``cpu: 2``) and so do manifests everywhere.
QUANTITIES = {
    ("V1ResourceRequirements", "limits"),
    ("V1ResourceRequirements", "requests"),
    ("V1VolumeResourceRequirements", "limits"),
    ("V1VolumeResourceRequirements", "requests"),
    ("V1EmptyDirVolumeSource", "size_limit"),
    ("V1PodSpec", "overhead"),
}


def _fail(path: str, message: str) -> SchemaError:
    return SchemaError(f"{path}: {message}")


def _scalar(value: Any, type_name: str, path: str) -> Any:
    """A leaf value of the client's scalar types. bool is not an int here (YAML's ``true``
    where a count belongs is a mistake), nor an int a string (``"true"`` unquoted)."""
    if type_name == "object":  # IntOrString, RawExtension: the client takes any JSON value
        return value
    ok = {
        "str": isinstance(value, str),
        "bytes": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "datetime": isinstance(value, (str, datetime.date)),
        "date": isinstance(value, (str, datetime.date)),
    }.get(type_name)
    if ok is None:
        raise _fail(path, f"the client's type {type_name!r} is unknown to this test")
    if not ok:
        raise _fail(path, f"{value!r} is not of type {type_name}")
    return value


def build(value: Any, type_name: str, path: str, quantity: bool = False) -> Any:
    """``value`` checked against the client's type string ``type_name``, returned as the
    client's model constructors take it (nested models built)."""
    if value is None:
        raise _fail(path, f"null where a {type_name} belongs (an empty YAML key?)")
    if match := _LIST.match(type_name):
        if not isinstance(value, list):
            raise _fail(path, f"expected a list of {match[1]}, got {type(value).__name__}")
        return [build(item, match[1], f"{path}[{i}]", quantity)
                for i, item in enumerate(value)]
    if match := _DICT.match(type_name):
        inner = match[1] or match[2]
        if not isinstance(value, dict):
            raise _fail(path, f"expected a map of {inner}, got {type(value).__name__}")
        built = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _fail(path, f"map key {key!r} is not a string")
            built[key] = build(item, inner, f"{path}[{key!r}]", quantity)
        return built
    if quantity:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise _fail(path, f"{value!r} is not a quantity")
        return str(value)
    model = getattr(kubernetes.client.models, type_name, None)
    if isinstance(model, type) and hasattr(model, "openapi_types"):
        return build_model(value, model, path)
    return _scalar(value, type_name, path)


def build_model(value: Any, model: type, path: str) -> Any:
    """The client's ``model`` built from a manifest's mapping: unknown keys and wrong types
    fail here, naming the path; a missing required field fails in the model's constructor
    (the client's ``client_side_validation``)."""
    if not isinstance(value, dict):
        raise _fail(path, f"expected a {model.__name__} mapping, got {type(value).__name__}")
    by_key = {key: attr for attr, key in model.attribute_map.items()}
    kwargs = {}
    for key, item in value.items():
        attr = by_key.get(key)
        if attr is None:
            raise _fail(f"{path}.{key}", f"unknown field of {model.__name__} (its fields: "
                        f"{', '.join(sorted(by_key))})")
        kwargs[attr] = build(item, model.openapi_types[attr], f"{path}.{key}",
                             (model.__name__, attr) in QUANTITIES)
    try:
        return model(**kwargs)
    except (ValueError, TypeError) as error:  # pydantic's ValidationError is a ValueError
        raise _fail(path, f"{model.__name__} refused it: {' '.join(str(error).split())}") from None


def api_model(api_version: str, kind: str) -> type | None:
    """The client's model of a built-in kind, where ``api_version`` is the group it is
    served from (the client has an API class with a create call for it)."""
    group, _, version = api_version.rpartition("/")
    model = getattr(kubernetes.client.models, f"{version.capitalize()}{kind}", None)
    api_name = "".join(part.capitalize()
                       for part in group.removesuffix(".k8s.io").split(".")) or "Core"
    api = getattr(kubernetes.client, f"{api_name}{version.capitalize()}Api", None)
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()
    if model is None or api is None or not (hasattr(api, f"create_namespaced_{snake}")
                                            or hasattr(api, f"create_{snake}")):
        return None
    return model


# --- the JobSet --------------------------------------------------------------------------

@dataclass(frozen=True)
class Obj:
    """A JobSet object's fields: JSON key -> a client type string, an enum (a frozenset of
    strings), a nested Obj, or a one-item list of those (a list of it)."""

    fields: dict[str, Any]
    required: frozenset[str] = field(default_factory=frozenset)


def _enum(*values: str) -> frozenset[str]:
    return frozenset(values)


_FAILURE_RULE = Obj({
    "name": "str",
    "action": _enum("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts",
                    "RestartJob", "RestartJobAndIgnoreMaxRestarts"),
    "onJobFailureReasons": "List[str]",
    "onJobFailureMessagePatterns": "List[str]",
    "targetReplicatedJobs": "List[str]",
}, frozenset({"action"}))

_REPLICATED_JOB = Obj({
    "name": "str",
    "groupName": "str",
    "template": "V1JobTemplateSpec",
    "replicas": "int",
    "dependsOn": [Obj({"name": "str", "status": _enum("Ready", "Complete")},
                      frozenset({"name", "status"}))],
}, frozenset({"name", "replicas", "template"}))

_JOBSET_SPEC = Obj({
    "replicatedJobs": [_REPLICATED_JOB],
    "network": Obj({"enableDNSHostnames": "bool", "subdomain": "str",
                    "publishNotReadyAddresses": "bool"}),
    "successPolicy": Obj({"operator": _enum("All", "Any"), "targetReplicatedJobs": "List[str]"},
                         frozenset({"operator"})),
    "failurePolicy": Obj({"maxRestarts": "int",
                          "restartStrategy": _enum("Recreate", "BlockingRecreate",
                                                   "InPlaceRestart"),
                          "rules": [_FAILURE_RULE]}),
    "startupPolicy": Obj({"startupPolicyOrder": _enum("AnyOrder", "InOrder")},
                         frozenset({"startupPolicyOrder"})),
    "suspend": "bool",
    "coordinator": Obj({"replicatedJob": "str", "jobIndex": "int", "podIndex": "int"},
                       frozenset({"replicatedJob"})),
    "managedBy": "str",
    "ttlSecondsAfterFinished": "int",
    "volumeClaimPolicies": [Obj({
        "templates": "List[V1PersistentVolumeClaim]",
        "retentionPolicy": Obj({"whenDeleted": _enum("Delete", "Retain")}),
    })],
}, frozenset({"replicatedJobs"}))

JOBSET = Obj({
    "apiVersion": _enum("jobset.x-k8s.io/v1alpha2"),
    "kind": _enum("JobSet"),
    "metadata": "V1ObjectMeta",
    "spec": _JOBSET_SPEC,
}, frozenset({"apiVersion", "kind", "metadata", "spec"}))


def check_shape(value: Any, shape: Any, path: str) -> None:
    """``value`` against a JobSet schema node (see :class:`Obj`); client types (the Job
    template, metadata) go through :func:`build`."""
    if isinstance(shape, str):
        build(value, shape, path)
    elif isinstance(shape, frozenset):
        if value not in shape:
            raise _fail(path, f"{value!r} is not one of {sorted(shape)}")
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise _fail(path, f"expected a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            check_shape(item, shape[0], f"{path}[{i}]")
    else:
        if not isinstance(value, dict):
            raise _fail(path, f"expected a mapping, got {type(value).__name__}")
        missing = sorted(shape.required - value.keys())
        if missing:
            raise _fail(f"{path}.{missing[0]}", "required field missing")
        for key, item in value.items():
            if key not in shape.fields:
                raise _fail(f"{path}.{key}", f"unknown field (known: {', '.join(shape.fields)})")
            check_shape(item, shape.fields[key], f"{path}.{key}")


def validate(doc: Any) -> None:
    """One manifest document, strictly; raises :class:`SchemaError`."""
    if not isinstance(doc, dict):
        raise _fail("<document>", f"expected a mapping, got {type(doc).__name__}")
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if not isinstance(kind, str) or not isinstance(api_version, str):
        raise _fail("<document>", "apiVersion and kind must be strings")
    if kind == "JobSet":
        check_shape(doc, JOBSET, kind)
    else:
        model = api_model(api_version, kind)
        if model is None:
            raise _fail(kind, f"no schema for {api_version} {kind} (not a kind the client "
                        "knows in that group, and not a JobSet)")
        build_model(doc, model, kind)
    name = (doc.get("metadata") or {}).get("name")
    if not name:
        raise _fail(f"{kind}.metadata.name", "required field missing")


# --- the manifests -----------------------------------------------------------------------

def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


FILES = sorted(MANIFESTS.glob("*.yaml"))
DOCUMENTS = [(path, doc) for path in FILES for doc in load(path)]


def _doc_id(entry: tuple[Path, dict[str, Any]]) -> str:
    path, doc = entry
    return f"{path.stem}:{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc.get("kind") == kind]


def jobsets() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path, doc in DOCUMENTS if doc.get("kind") == "JobSet"]


def trainers(jobset: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any],
                                                       dict[str, Any]]]:
    """(job spec, pod template, container) of each ``trainer`` container of a JobSet."""
    for rjob in jobset["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        for container in job["template"]["spec"]["containers"]:
            if container["name"] == "trainer":
                yield job, job["template"], container


def flag(command: list[str], name: str) -> str:
    """The value of ``name`` in a command line (``--x V`` or ``--x=V``)."""
    for i, arg in enumerate(command):
        if arg == name:
            return command[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} is not in {command}")


def test_the_examples_are_there() -> None:
    """Both examples exist with a JobSet each: a glob that matched nothing would make every
    test below pass vacuously."""
    assert {path.name for path in FILES} >= {"jobset-c10d.yaml", "jobset-etcd.yaml"}
    assert {path.name for path, _ in jobsets()} >= {"jobset-c10d.yaml", "jobset-etcd.yaml"}
    assert all(any(trainers(doc)) for _, doc in jobsets())


@pytest.mark.parametrize("entry", DOCUMENTS, ids=[_doc_id(entry) for entry in DOCUMENTS])
def test_document_fits_the_schema(entry: tuple[Path, dict[str, Any]]) -> None:
    validate(entry[1])


# --- ftrun's contract with the pod -------------------------------------------------------

#: The downward-API variables ftrun/host/kubernetes.py reads, and the label each comes from.
JOBSET_ENV = {
    "JOBSET_NAME": "jobset.sigs.k8s.io/jobset-name",
    "JOBSET_REPLICATED_JOB": "jobset.sigs.k8s.io/replicatedjob-name",
    "JOBSET_REPLICAS": "jobset.sigs.k8s.io/replicatedjob-replicas",
    "JOBSET_JOB_INDEX": "jobset.sigs.k8s.io/job-index",
    "JOBSET_RESTART_ATTEMPT": "jobset.sigs.k8s.io/restart-attempt",
}


def check_env(jobset: dict[str, Any]) -> None:
    """Each trainer gets every JOBSET_* variable from its label: ftrun derives the node
    count, the run id and the rendezvous endpoint from them, and a wrong label path leaves
    a variable empty (the pod starts, ftrun then refuses the environment)."""
    for rjob in jobset["spec"]["replicatedJobs"]:
        for container in rjob["template"]["spec"]["template"]["spec"]["containers"]:
            if container["name"] != "trainer":
                continue
            env = {var["name"]: var for var in container.get("env", [])}
            for name, label in JOBSET_ENV.items():
                assert name in env, f"{name} is not set"
                assert "value" not in env[name], f"{name} has a literal value"
                path = env[name]["valueFrom"]["fieldRef"]["fieldPath"]
                assert path == f"metadata.labels['{label}']", f"{name} <- {path}"
            standby = int(env["FTRUN_STANDBY_NODES"]["value"])
            assert 0 < standby < rjob["replicas"] - 1, "leaves fewer than 2 training pods"


def check_shm(jobset: dict[str, Any]) -> None:
    """/dev/shm is a memory-backed emptyDir with a size: ftrun keeps in-memory snapshots
    there, and the container runtime's default /dev/shm is 64 MiB."""
    for _, pod, container in trainers(jobset):
        mount = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        assert len(mount) == 1, "no /dev/shm mount"
        volume = {v["name"]: v for v in pod["spec"].get("volumes", [])}[mount[0]["name"]]
        assert volume["emptyDir"].get("medium") == "Memory"
        assert volume["emptyDir"].get("sizeLimit"), "an unbounded tmpfs"


def check_metrics(jobset: dict[str, Any]) -> None:
    """Prometheus scrapes the port ftrun serves (--metrics-port), which the container
    declares."""
    for _, pod, container in trainers(jobset):
        port = flag(container["command"] + container.get("args", []), "--metrics-port")
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == port
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(port) in [p["containerPort"] for p in container["ports"]]


def check_failure_policies(jobset: dict[str, Any]) -> None:
    """The Jobs' podFailurePolicy follows ftrun's exit codes (ftrun/exitcodes.py): 1, 2
    and 4 are the job's own failures (FailJob), an eviction or preemption is the
    platform's (Ignore, before any exit code rule can see the pod), 3 is never terminal.
    The JobSet fails on a Job failed by that policy: its default would restart everything
    up to maxRestarts times, repeating the same failure."""
    for job, pod, _ in trainers(jobset):
        assert pod["spec"]["restartPolicy"] == "Never"  # the API requires it for the policy
        assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (1, 1, 3)
        rules = job["podFailurePolicy"]["rules"]
        ignore = [i for i, rule in enumerate(rules) if rule["action"] == "Ignore"
                  and {"type": "DisruptionTarget", "status": "True"}
                  in rule.get("onPodConditions", [])]
        fail_job = [i for i, rule in enumerate(rules) if rule["action"] == "FailJob"]
        assert ignore, "no Ignore rule on the DisruptionTarget condition"
        assert [rules[i]["onExitCodes"] for i in fail_job] == [
            {"containerName": "trainer", "operator": "In", "values": [1, 2, 4]}]
        assert ignore[0] < fail_job[0], "an evicted pod's exit code is judged first"
    assert {"name": "ftrunGaveUp", "action": "FailJobSet",
            "onJobFailureReasons": ["PodFailurePolicy"]} \
        in jobset["spec"]["failurePolicy"]["rules"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3


CONTRACT: list[Callable[[dict[str, Any]], None]] = [
    check_env, check_shm, check_metrics, check_failure_policies]


@pytest.mark.parametrize("check", CONTRACT, ids=[c.__name__ for c in CONTRACT])
@pytest.mark.parametrize("path", ["jobset-c10d.yaml", "jobset-etcd.yaml"])
def test_trainer_contract(path: str, check: Callable[[dict[str, Any]], None]) -> None:
    (jobset,) = of_kind(load(MANIFESTS / path), "JobSet")
    check(jobset)


def test_c10d_service_is_the_jobsets_subdomain() -> None:
    """The Service the pods are named under (network.subdomain): headless, selecting this
    JobSet's pods, publishing them before they are ready (the rendezvous comes before any
    readiness), with the rendezvous port the trainer declares. ftrun's derived endpoint is
    the first pod under it: ftrun-demo-workers-0-0.ftrun-demo:29400."""
    docs = load(MANIFESTS / "jobset-c10d.yaml")
    (jobset,), (service,) = of_kind(docs, "JobSet"), of_kind(docs, "Service")
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "ftrun-demo"}
    assert service["metadata"]["name"] == jobset["spec"]["network"]["subdomain"]
    spec = service["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    assert spec["selector"] == {"jobset.sigs.k8s.io/jobset-name": jobset["metadata"]["name"]}
    assert {"name": "rdzv", "port": 29400}.items() <= spec["ports"][0].items()
    for _, _, container in trainers(jobset):
        assert {"name": "rdzv", "containerPort": 29400}.items() <= container["ports"][0].items()
        assert "--rdzv-endpoint" not in container["command"]  # derived from the pod


def test_etcd_names_agree() -> None:
    """The etcd members' names in --initial-cluster, their peer and client URLs and the
    trainers' --rdzv-endpoint are all the StatefulSet's stable names under its headless
    Service: one name off and a member (or the rendezvous) waits on a host that never
    resolves."""
    docs = load(MANIFESTS / "jobset-etcd.yaml")
    (service,), (sts,), (jobset,) = (of_kind(docs, k) for k in ("Service", "StatefulSet",
                                                                "JobSet"))
    name, svc = sts["metadata"]["name"], service["metadata"]["name"]
    assert sts["spec"]["serviceName"] == svc
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    members = [f"{name}-{i}.{svc}" for i in range(sts["spec"]["replicas"])]
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    command = etcd["command"] + etcd.get("args", [])
    assert flag(command, "--initial-cluster") == ",".join(
        f"{member.split('.')[0]}=http://{member}:2380" for member in members)
    assert flag(command, "--initial-advertise-peer-urls") == f"http://$(POD_NAME).{svc}:2380"
    assert flag(command, "--advertise-client-urls") == f"http://$(POD_NAME).{svc}:2379"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} \
        in etcd["env"]
    data_dir = flag(command, "--data-dir")
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert any(data_dir.startswith(m["mountPath"]) and m["name"] in claims
               for m in etcd["volumeMounts"]), "--data-dir is not on a claimed volume"
    for _, _, container in trainers(jobset):
        assert flag(container["command"], "--rdzv-backend") == "etcd-v3"
        assert flag(container["command"], "--rdzv-endpoint") == ",".join(
            f"{member}:2379" for member in members)


# --- the checks can fail -----------------------------------------------------------------

def _c10d_jobset() -> dict[str, Any]:
    (jobset,) = of_kind(load(MANIFESTS / "jobset-c10d.yaml"), "JobSet")
    return copy.deepcopy(jobset)


def _pod_spec(jobset: dict[str, Any]) -> dict[str, Any]:
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _trainer(jobset: dict[str, Any]) -> dict[str, Any]:
    return _pod_spec(jobset)["containers"][0]


def _misspell_containers(doc: dict[str, Any]) -> None:
    _pod_spec(doc)["containrs"] = _pod_spec(doc).pop("containers")


def _replicas_three(doc: dict[str, Any]) -> None:
    doc["spec"]["replicatedJobs"][0]["replicas"] = "three"


def _parallelism_three(doc: dict[str, Any]) -> None:
    doc["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] = "three"


def _scrape_unquoted(doc: dict[str, Any]) -> None:
    template = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    template["metadata"]["annotations"]["prometheus.io/scrape"] = True


def _no_container_name(doc: dict[str, Any]) -> None:
    del _trainer(doc)["name"]


def _misspell_network(doc: dict[str, Any]) -> None:
    doc["spec"]["network"]["enableDnsHostnames"] = doc["spec"]["network"].pop(
        "enableDNSHostnames")


def _unknown_action(doc: dict[str, Any]) -> None:
    doc["spec"]["failurePolicy"]["rules"][0]["action"] = "FailJob"


def _env_typo(doc: dict[str, Any]) -> None:
    _trainer(doc)["env"][1]["valueFrom"]["fieldRef"]["fieldpath"] = "metadata.name"


BROKEN: list[tuple[Callable[[dict[str, Any]], None], str]] = [
    (_misspell_containers, r"template\.spec\.containrs: unknown field of V1PodSpec"),
    (_replicas_three, r"replicatedJobs\[0\]\.replicas: 'three' is not of type int"),
    (_parallelism_three, r"spec\.parallelism: 'three' is not of type int"),
    (_scrape_unquoted, r"\['prometheus\.io/scrape'\]: True is not of type str"),
    (_no_container_name, r"containers\[0\]: V1Container refused it: .*name"),
    (_misspell_network, r"network\.enableDnsHostnames: unknown field"),
    (_unknown_action, r"rules\[0\]\.action: 'FailJob' is not one of"),
    (_env_typo, r"fieldRef\.fieldpath: unknown field of V1ObjectFieldSelector"),
]


@pytest.mark.parametrize(("breakage", "error"), BROKEN, ids=[b.__name__[1:] for b, _ in BROKEN])
def test_a_broken_jobset_is_refused(breakage: Callable[[dict[str, Any]], None],
                                    error: str) -> None:
    """Each breakage of the c10d JobSet fails validation at the place it was made; the
    unbroken copy passes, so the failure is the breakage's."""
    jobset = _c10d_jobset()
    validate(jobset)
    breakage(jobset)
    with pytest.raises(SchemaError, match=error):
        validate(jobset)


def test_a_broken_statefulset_is_refused() -> None:
    """The built-in kinds go through the same walker: a string count and an unknown key in
    the etcd StatefulSet, a Service with a port missing its required number."""
    docs = load(MANIFESTS / "jobset-etcd.yaml")
    (sts,), (service,) = of_kind(docs, "StatefulSet"), of_kind(docs, "Service")
    broken = copy.deepcopy(sts)
    broken["spec"]["replicas"] = "three"
    with pytest.raises(SchemaError, match=r"StatefulSet\.spec\.replicas: 'three' is not"):
        validate(broken)
    broken = copy.deepcopy(sts)
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(SchemaError, match=r"containers\[0\]\.volumeMount: unknown field"):
        validate(broken)
    broken = copy.deepcopy(service)
    del broken["spec"]["ports"][0]["port"]
    with pytest.raises(SchemaError, match=r"ports\[0\]: V1ServicePort refused it"):
        validate(broken)
    broken = copy.deepcopy(sts)
    broken["apiVersion"] = "v1"  # StatefulSet is served by apps/v1 only
    with pytest.raises(SchemaError, match=r"no schema for v1 StatefulSet"):
        validate(broken)


def _wrong_label(doc: dict[str, Any]) -> None:
    env = {var["name"]: var for var in _trainer(doc)["env"]}
    env["JOBSET_JOB_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] = \
        "metadata.labels['jobset.sigs.k8s.io/job-global-index']"


def _shm_on_disk(doc: dict[str, Any]) -> None:
    del _pod_spec(doc)["volumes"][0]["emptyDir"]["medium"]


def _scrape_other_port(doc: dict[str, Any]) -> None:
    command = _trainer(doc)["command"]
    command[command.index("--metrics-port") + 1] = "9465"


def _fail_job_on_3(doc: dict[str, Any]) -> None:
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    fail_job = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    fail_job[0]["onExitCodes"]["values"].append(3)


def _ignore_last(doc: dict[str, Any]) -> None:
    rules = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    rules.append(rules.pop(0))


BREACHES: list[tuple[Callable[[dict[str, Any]], None], Callable[[dict[str, Any]], None]]] = [
    (_wrong_label, check_env),
    (_shm_on_disk, check_shm),
    (_scrape_other_port, check_metrics),
    (_fail_job_on_3, check_failure_policies),
    (_ignore_last, check_failure_policies),
]


@pytest.mark.parametrize(("breach", "check"), BREACHES, ids=[b.__name__[1:] for b, _ in BREACHES])
def test_a_contract_breach_is_caught(breach: Callable[[dict[str, Any]], None],
                                     check: Callable[[dict[str, Any]], None]) -> None:
    """Schema-valid changes that break ftrun's contract fail its check (and the schema
    still passes them, so only the contract check can catch them)."""
    jobset = _c10d_jobset()
    breach(jobset)
    validate(jobset)
    with pytest.raises(AssertionError):
        check(jobset)
