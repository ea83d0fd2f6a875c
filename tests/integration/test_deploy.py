"""The Kubernetes manifests in ``deploy/`` are valid for Kubernetes and mean something to pdps.

Each YAML document is validated offline by kubernetes-validate against the bundled
schemas of one Kubernetes version, strictly (an unknown field is an error). The
other tests check what a schema cannot: every ``PDPS_*`` variable and every key of
the ConfigMap's ``pdps.toml`` is a setting pdps knows, every container runs a command
line the pdps CLI accepts, serving containers are probed and sized, selectors select,
the counts in ``pdps.toml`` match the workloads, and the CronJob's schedule is a cron
expression whose runs never overlap, each a pdps job of its own.
"""

from __future__ import annotations

import posixpath
import re
import sys
import zoneinfo
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdps.shell import settings
from pdps.shell.cli import build_parser
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
WORKLOADS = ("Deployment", "StatefulSet", "Job", "CronJob")
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


def _template(workload: dict[str, Any]) -> dict[str, Any]:
    """The workload's pod template (a CronJob's is that of the Jobs it creates)."""
    spec = workload["spec"]
    return spec["jobTemplate"]["spec"]["template"] if workload["kind"] == "CronJob" else spec["template"]


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    return _template(workload)["spec"]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = _pod(workload)
    return [*pod.get("initContainers", []), *pod["containers"]]


def _role(container: dict[str, Any]) -> str:
    argv = [*container.get("command", []), *container.get("args", [])]
    roles = [a for a in argv if a in settings.ALL]
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
        ("cronjob.yaml", "CronJob"),
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
    labels = _template(workload)["metadata"]["labels"]
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
            # a scheduled run's checkpoints go to a folder of its own, a URL made from its job name
            words += [str(e.get("value", "")) for e in container.get("env", []) if e["name"] != "PDPS_CHECKPOINT_URL"]
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
    annotations = _template(workload)["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/port") == str(port)
    assert annotations.get("prometheus.io/path") == "/metrics"
    for container in _pod(workload)["containers"]:
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        assert ports.get("metrics") == port, f"{container['name']} declares no containerPort named metrics = {port}"


# --- what Kubernetes hands a container --------------------------------------------------

#: Downward-API answers for one pod: its name, IP and StatefulSet ordinal.
POD_FIELDS = {"metadata.name": "pdps-pod-0", "status.podIP": "10.0.0.7", POD_INDEX: "0"}


def _expand(text: str, env: dict[str, str]) -> str:
    """``$(NAME)`` expanded as Kubernetes does: from the variables in ``env``, a reference
    to any other left as written, ``$$`` an escaped ``$``."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _kubernetes_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """The environment Kubernetes gives ``container``, ``fields`` answering its fieldRefs: a
    value may refer only to variables defined above it."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"{container['name']} sets {e['name']} from {path}, which this test does not provide"
            env[e["name"]] = fields[path]
        else:
            env[e["name"]] = _expand(str(e.get("value", "")), env)
    return env


def _mount(tmp_path: Path, workload: dict[str, Any], container: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """``env`` with its paths under the container's ConfigMap and Secret mounts moved to
    copies of those files under ``tmp_path`` (the Secret's as text: its ``stringData``)."""
    files = {doc["metadata"]["name"]: doc.get("data", {}) for _, _, doc in DOCS if doc["kind"] == "ConfigMap"}
    files.update({doc["metadata"]["name"]: doc["stringData"] for _, _, doc in DOCS if doc["kind"] == "Secret"})
    volumes = {v["name"]: v for v in _pod(workload)["volumes"]}
    moved = dict(env)
    for m in container.get("volumeMounts", []):
        volume = volumes[m["name"]]
        source = volume.get("configMap", {}).get("name") or volume.get("secret", {}).get("secretName")
        if source is None:
            continue  # an emptyDir
        here = tmp_path / container["name"] / m["name"]
        here.mkdir(parents=True)
        for key, text in files[source].items():
            (here / key).write_text(text)
        prefix = m["mountPath"].rstrip("/") + "/"
        moved = {k: str(here / v[len(prefix) :]) if v.startswith(prefix) else v for k, v in moved.items()}
    return moved


def _invocation(tmp_path: Path, workload: dict[str, Any], container: dict[str, Any], fields: dict[str, str] = POD_FIELDS) -> tuple[Any, dict[str, Any]]:
    """The container's command line as the pdps CLI parses it in the container's
    environment, and the settings it resolves from that environment and the mounted files."""
    env = _mount(tmp_path, workload, container, _kubernetes_env(container, fields))
    argv = [_expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
    assert argv[:1] == ["pdps"], f"{container['name']} runs {argv}, not the pdps console script"
    try:
        args = build_parser(argv[1:], env).parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(f"the pdps CLI does not accept {container['name']}'s command line {argv} (its error is above)") from None
    given = {k: v for k, v in vars(args).items() if k in settings.BY_NAME or k == "config"}
    return args, settings.resolve(args.command, given, env=env)


@workload_ids
def test_every_container_runs_a_command_line_the_cli_accepts(workload, tmp_path):
    token = _one("Secret")["stringData"]["token"]
    for container in _containers(workload):
        args, values = _invocation(tmp_path, workload, container)
        assert args.command == _role(container)
        assert values["token"] == token, f"{container['name']} does not read the Secret's token"
        if args.command == "launch":
            settings.job_config(values)  # the job it creates: raises ConfigError on a bad one


def test_a_flag_the_cli_does_not_know_would_fail(tmp_path):
    # the check above is worth something only if a misspelt flag fails it
    master = yaml.safe_load(yaml.safe_dump(_one("Deployment")))
    (container,) = _pod(master)["containers"]
    container["args"] = [a.replace("--listen", "--listn") for a in container["args"]]
    with pytest.raises(AssertionError, match="does not accept"):
        _invocation(tmp_path, master, container)


# --- the scheduled run (CronJob) -------------------------------------------------------

_CRON_MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}
_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
_DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")
#: Each field of a cron expression: its bounds and the names it takes for numbers.
_CRON_FIELDS = ((0, 59, ()), (0, 23, ()), (1, 31, ()), (1, 12, _MONTHS), (0, 7, _DAYS))


def _cron_number(text: str, low: int, names: tuple[str, ...]) -> int:
    if text.upper() in names:
        return names.index(text.upper()) + low
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a number{' or a name' if names else ''}")
    return int(text)


def _cron_field(text: str, low: int, high: int, names: tuple[str, ...], day: bool) -> set[int]:
    """The values one field matches: a list of ``*``, ``N`` or ``N-M``, each with an optional ``/STEP``."""
    values: set[int] = set()
    for part in text.split(","):
        spec, slash, step = part.partition("/")
        if spec == "*" or (day and spec == "?"):
            first, last = low, high
        else:
            a, dash, b = spec.partition("-")
            first = _cron_number(a, low, names)
            last = _cron_number(b, low, names) if dash else high if slash else first
        every = _cron_number(step, 1, ()) if slash else 1
        if not low <= first <= last <= high or every < 1:
            raise ValueError(f"{part!r} is outside {low}-{high}, or runs backwards, or steps by 0")
        values.update(range(first, last + 1, every))
    return values


def _cron_times(schedule: str, years: int = 2) -> list[datetime]:
    """The times a Kubernetes CronJob ``schedule`` fires in ``years`` from 2027-01-01
    (five fields, or a macro such as ``@hourly``); ValueError for any other text."""
    fields = _CRON_MACROS.get(schedule, schedule).split()
    if len(fields) != 5:
        raise ValueError(f"{schedule!r} is not five fields (minute hour day-of-month month day-of-week) nor a macro")
    minutes, hours, days, months, weekdays = (_cron_field(f, *bounds, day=i in (2, 4)) for i, (f, bounds) in enumerate(zip(fields, _CRON_FIELDS)))
    weekdays = {d % 7 for d in weekdays}  # 7 is Sunday too
    either = not fields[2].startswith(("*", "?")) and not fields[4].startswith(("*", "?"))  # both restricted: either matches
    start = datetime(2027, 1, 1)
    times = []
    for n in range(366 * years):
        date = start + timedelta(days=n)
        by_month_day, by_weekday = date.day in days, (date.weekday() + 1) % 7 in weekdays
        if date.month in months and ((by_month_day or by_weekday) if either else (by_month_day and by_weekday)):
            times += [date.replace(hour=h, minute=m) for h in sorted(hours) for m in sorted(minutes)]
    return times


def _shortest_gap(schedule: str) -> float:
    times = _cron_times(schedule)
    assert len(times) >= 2, f"{schedule!r} fires less than twice in two years"
    return min((b - a).total_seconds() for a, b in zip(times, times[1:]))


def _scheduled() -> tuple[dict[str, Any], dict[str, Any]]:
    cronjob = _one("CronJob")
    (container,) = _pod(cronjob)["containers"]
    return cronjob, container


def test_the_cron_reader_reads_schedules_as_kubernetes_does():
    # the schedule checks below are worth something only if this reader is right
    assert _shortest_gap("*/15 9-17 * * MON-FRI") == 15 * 60
    assert _shortest_gap("@daily") == _shortest_gap("0 0 * * *") == 24 * 3600
    assert _shortest_gap("30 2 * * 0,7") == 7 * 24 * 3600
    # both day fields restricted: either matches. 2027 has 53 Fridays and 12 thirteenths, one a Friday (August)
    assert len(_cron_times("0 0 13 * FRI", years=1)) == 53 + 12 - 1
    for bad in ("61 * * * *", "* * * *", "0 * * * * *", "CRON_TZ=UTC 0 * * * *", "0 * * * MON-FOO", "*/0 * * * *", "5-1 * * * *", "0 24 * * *"):
        with pytest.raises(ValueError):
            _cron_times(bad)


def test_the_schedule_is_a_cron_expression_in_a_known_time_zone():
    spec = _one("CronJob")["spec"]
    _cron_times(spec["schedule"])  # raises ValueError on a bad one
    zoneinfo.ZoneInfo(spec["timeZone"])  # raises on an unknown zone


def test_scheduled_runs_never_overlap(tmp_path):
    cronjob, container = _scheduled()
    spec = cronjob["spec"]
    job = spec["jobTemplate"]["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    values = _invocation(tmp_path, cronjob, container)[1]
    stop = 2 * (values["grace"] + 5)  # launch stops the trainers, then the pservers and the master, each within grace + 5 s
    assert _pod(cronjob)["terminationGracePeriodSeconds"] > stop
    assert values["timeout"] + stop < job["activeDeadlineSeconds"], "the launcher's timeout must end a run, its roles stopped in order, before Kubernetes kills it"
    late = spec["startingDeadlineSeconds"]
    assert 0 < late and late + job["activeDeadlineSeconds"] <= _shortest_gap(spec["schedule"]), "a run started late and stopped at its deadline must be over before the next is due"
    assert spec["successfulJobsHistoryLimit"] >= 1 and spec["failedJobsHistoryLimit"] >= 1, "keep the last runs' pods: their logs"


def test_each_scheduled_run_is_a_job_of_its_own(tmp_path):
    """``pdps launch`` refuses a job that already exists: every run, and every retry of one
    (a new pod), is the pdps job named after its pod, with its own checkpoint folder."""
    cronjob, container = _scheduled()
    job = cronjob["spec"]["jobTemplate"]["spec"]
    assert _pod(cronjob)["restartPolicy"] == "Never", "a container restarted in place keeps its pod's name, and launch refuses the job it created"
    assert 1 <= job["backoffLimit"] <= 3
    first = job["podFailurePolicy"]["rules"][0]
    assert first["action"] == "Ignore" and {"type": "DisruptionTarget", "status": "True"} in first["onPodConditions"], "an evicted run is retried without using up backoffLimit"
    toml = _toml()
    pods = ["pdps-scheduled-29450880-x7k2p", "pdps-scheduled-29450880-9qzvb", "pdps-scheduled-29450940-bb4tn"]
    runs = [_invocation(tmp_path / pod, cronjob, container, {**POD_FIELDS, "metadata.name": pod})[1] for pod in pods]
    assert [v["job"] for v in runs] == pods
    root = posixpath.dirname(toml["checkpoint_url"].rstrip("/"))  # checkpoints/<job>/, as for the job pdps.toml names
    assert [v["checkpoint_url"] for v in runs] == [f"{root}/{pod}/" for pod in pods]
    assert {v["store"] for v in runs} == {toml["store"]}


_QUANTITY = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _quantity(text: Any) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(text))
    assert m and m.group(2) in _QUANTITY, f"{text!r} is not a Kubernetes quantity this test reads"
    return float(m.group(1)) * _QUANTITY[m.group(2)]


def test_the_scheduled_pod_has_the_resources_of_the_roles_it_runs():
    """One pod runs the master, every pserver and every trainer: it asks for what
    their own pods ask for in the other manifests, times the counts in pdps.toml."""
    toml = _toml()
    count = {"master": 1, "pserver": toml["pservers"], "trainer": toml["trainers"]}
    need = {("requests", "cpu"): 0.0, ("requests", "memory"): 0.0, ("limits", "memory"): 0.0}
    for workload in _workloads():
        (container,) = _pod(workload)["containers"]
        role = _role(container)
        if role in count:
            for kind, resource in need:
                need[kind, resource] += count[role] * _quantity(container["resources"][kind][resource])
    _, scheduled = _scheduled()
    for (kind, resource), total in need.items():
        assert _quantity(scheduled["resources"][kind][resource]) >= total, f"the scheduled pod's {kind}.{resource} is below its roles' {total:g}"
