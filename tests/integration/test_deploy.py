"""The Kubernetes manifests in ``deploy/`` are valid for Kubernetes and mean something to pdps.

Each YAML document is validated offline by kubernetes-validate against the bundled
schemas of one Kubernetes version, strictly (an unknown field is an error). The
other tests check what a schema cannot: every ``PDPS_*`` variable and every key of
the ConfigMap's ``pdps.toml`` is a setting pdps knows, serving containers are probed
and sized, selectors select, and the counts in ``pdps.toml`` match the workloads.
"""

from __future__ import annotations

import posixpath
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdps.shell import settings
from pdps.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

#: Validated against this version's schemas only: recent, and new enough for the
#: pod-index label (1.28) and native gRPC probes (1.24).
KUBERNETES_VERSION = "1.34.0"

POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
WORKLOADS = ("Deployment", "StatefulSet", "Job")
SERVING = ("master", "pserver")


def _load() -> list[tuple[str, int, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        with path.open() as f:  # a YAML error then names the file and line
            loaded = [d for d in yaml.safe_load_all(f) if d is not None]
        docs.extend((path.name, i, doc) for i, doc in enumerate(loaded))
    return docs


DOCS = _load()


def _id(entry: tuple[str, int, dict[str, Any]]) -> str:
    name, i, doc = entry
    return f"{name}#{i}-{doc.get('kind')}"


def _one(kind: str) -> dict[str, Any]:
    found = [doc for _, _, doc in DOCS if doc.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/, found {len(found)}"
    return found[0]


def _workloads() -> list[dict[str, Any]]:
    return [doc for _, _, doc in DOCS if doc.get("kind") in WORKLOADS]


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = _pod(workload)
    return [*pod.get("initContainers", []), *pod["containers"]]


def _role(container: dict[str, Any]) -> str:
    argv = [*container.get("command", []), *container.get("args", [])]
    roles = [a for a in argv if a in settings.ROLES]
    assert roles, f"container {container['name']} runs no pdps role: {argv}"
    return roles[0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _toml_text() -> str:
    return _one("ConfigMap")["data"]["pdps.toml"]


def _toml() -> dict[str, Any]:
    return tomllib.loads(_toml_text())


def _resolved(tmp_path: Path, command: str) -> dict[str, Any]:
    path = tmp_path / "pdps.toml"
    path.write_text(_toml_text())
    return settings.resolve(command, {}, env={"PDPS_CONFIG": str(path)})


workload_ids = pytest.mark.parametrize("workload", _workloads(), ids=lambda w: f"{w['kind']}/{w['metadata']['name']}")


def test_deploy_holds_every_resource():
    kinds = sorted((name, doc["kind"]) for name, _, doc in DOCS)
    assert kinds == [
        ("configmap.yaml", "ConfigMap"),
        ("master.yaml", "Deployment"),
        ("master.yaml", "Service"),
        ("pserver.yaml", "Service"),
        ("pserver.yaml", "StatefulSet"),
        ("secret.yaml", "Secret"),
        ("trainer.yaml", "Job"),
    ]


@pytest.mark.parametrize("entry", DOCS, ids=_id)
def test_document_is_valid_kubernetes(entry):
    name, i, doc = entry
    problem = None
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        problem = f"{'.'.join(str(p) for p in exc.path) or '(top)'}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:  # an unknown kind or apiVersion
        problem = exc.message
    if problem:
        pytest.fail(f"deploy/{name} document {i} is not valid Kubernetes {KUBERNETES_VERSION}: {problem}", pytrace=False)
    meta = doc["metadata"]
    assert "namespace" not in meta, f"deploy/{name} document {i} names a namespace; apply with -n instead"
    assert meta.get("labels", {}).get("app.kubernetes.io/name") == "pdps"


def test_strict_validation_rejects_an_unknown_field():
    # the check above is worth something only if a misspelt field fails it
    doc = yaml.safe_load(yaml.safe_dump(_one("StatefulSet")))
    doc["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@workload_ids
def test_selectors_select_the_pods(workload):
    labels = workload["spec"]["template"]["metadata"]["labels"]
    component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
    assert labels.get("app.kubernetes.io/name") == "pdps"
    assert labels.get("app.kubernetes.io/component") == component
    assert all(_role(c) == component for c in _containers(workload))
    selector = workload["spec"].get("selector", {}).get("matchLabels", {})
    assert selector.items() <= labels.items()
    for service in (doc for _, _, doc in DOCS if doc["kind"] == "Service" and doc["metadata"]["labels"]["app.kubernetes.io/component"] == component):
        assert service["spec"]["selector"].items() <= labels.items(), f"Service {service['metadata']['name']} selects no {component} pod"


@workload_ids
def test_pdps_env_vars_are_settings_of_the_role(workload):
    known = {s.env: s for s in settings.SETTINGS}
    for container in _containers(workload):
        role = _role(container)
        for name in _env(container):
            if not name.startswith(settings.ENV_PREFIX) or name == "PDPS_CONFIG":
                continue
            assert name in known, f"{container['name']} sets {name}, which is no pdps setting"
            assert role in known[name].commands, f"{container['name']} sets {name}, which pdps {role} does not take"


@workload_ids
def test_every_container_reads_the_configmap_and_the_token(workload):
    configmap, secret = _one("ConfigMap"), _one("Secret")
    pod = _pod(workload)
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in _containers(workload):
        env = _env(container)
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
        config = env["PDPS_CONFIG"]["value"]
        assert mounts[posixpath.dirname(config)]["configMap"]["name"] == configmap["metadata"]["name"]
        assert posixpath.basename(config) in configmap["data"]
        token = env["PDPS_TOKEN_FILE"]["value"]
        assert mounts[posixpath.dirname(token)]["secret"]["secretName"] == secret["metadata"]["name"]
        assert posixpath.basename(token) in {**secret.get("data", {}), **secret.get("stringData", {})}


def test_configmap_settings_are_known_and_resolve(tmp_path):
    values = _toml()
    unknown = sorted(set(values) - set(settings.BY_NAME))
    assert not unknown, f"pdps.toml sets unknown settings: {unknown}"
    for command in settings.ROLES:
        _resolved(tmp_path, command)  # raises ConfigError on a bad value
    master = _resolved(tmp_path, "master")
    assert master["store"].startswith("etcd://")
    config = settings.job_config(master)  # the job the first master creates
    assert config.dataset.startswith("s3://")


def test_a_bad_configmap_value_would_fail(tmp_path):
    path = tmp_path / "pdps.toml"
    path.write_text(_toml_text().replace('mode = "sync"', 'mode = "bulk"'))
    with pytest.raises(ConfigError, match="mode"):
        settings.resolve("master", {}, env={"PDPS_CONFIG": str(path)})


def test_no_container_hard_codes_the_store():
    for workload in _workloads():
        for container in _containers(workload):
            words = [*container.get("command", []), *container.get("args", [])]
            words += [str(e.get("value", "")) for e in container.get("env", [])]
            assert not [w for w in words if "://" in w or w.startswith("--store")], f"{container['name']}: the store comes from pdps.toml"


@workload_ids
def test_containers_are_sized_probed_and_unprivileged(workload):
    pod = _pod(workload)
    assert pod.get("securityContext", {}).get("runAsNonRoot") is True
    for container in _containers(workload):
        name = container["name"]
        requests = container.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= requests.keys(), f"{name} has no cpu/memory requests"
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        if _role(container) not in SERVING:
            continue
        ports = {p["containerPort"] for p in container["ports"]}
        listen = container["args"][container["args"].index("--listen") + 1]
        assert listen.startswith("0.0.0.0:") and int(listen.rsplit(":", 1)[1]) in ports, f"{name} listens on {listen}"
        probe = container.get("readinessProbe")
        assert probe is not None, f"serving container {name} has no readiness probe"
        assert probe["grpc"]["port"] in ports
        assert "PDPS_ADVERTISE" in _env(container), f"{name} must advertise an address others can reach"


def test_pserver_index_comes_from_the_pod_index_label():
    statefulset = _one("StatefulSet")
    (container,) = _pod(statefulset)["containers"]
    env = _env(container)
    assert env["PDPS_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
    assert env["PDPS_ADVERTISE"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert container["livenessProbe"]["grpc"]["port"] == 50051
    headless = [doc for name, _, doc in DOCS if name == "pserver.yaml" and doc["kind"] == "Service"]
    assert [s["metadata"]["name"] for s in headless] == [statefulset["spec"]["serviceName"]]
    assert headless[0]["spec"]["clusterIP"] == "None"


def test_workload_sizes_match_the_job():
    job = _toml()
    assert _one("StatefulSet")["spec"]["replicas"] == job["pservers"]
    trainers = _one("Job")["spec"]
    assert trainers["completions"] == trainers["parallelism"] == job["trainers"]
    assert _pod(_one("Job"))["restartPolicy"] == "OnFailure"
    assert _one("Deployment")["spec"]["replicas"] in (1, 2)


@workload_ids
def test_termination_grace_exceeds_the_grace_setting(workload, tmp_path):
    grace = _resolved(tmp_path, _role(_pod(workload)["containers"][0]))["grace"]
    assert _pod(workload)["terminationGracePeriodSeconds"] > grace


@workload_ids
def test_every_pod_exposes_its_metrics_to_prometheus(workload, tmp_path):
    """The role serves /metrics on ``metrics_port`` on every interface of the pod, the
    container declares that port, and the pod's annotations tell Prometheus to scrape it."""
    role = _role(_pod(workload)["containers"][0])
    values = _resolved(tmp_path, role)
    port = values["metrics_port"]
    assert port, "pdps.toml must set metrics_port: a free port changes at every start, and Prometheus cannot find it"
    assert values["metrics_host"] == "0.0.0.0", "a role listening on 127.0.0.1 cannot be scraped from outside its pod"
    annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/port") == str(port)
    assert annotations.get("prometheus.io/path") == "/metrics"
    for container in _pod(workload)["containers"]:
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        assert ports.get("metrics") == port, f"{container['name']} declares no containerPort named metrics = {port}"
