"""The Helm chart charts/alpajob, rendered offline by Helm's own Go SDK.

helm-python-sdk (import name ``helm_python``) binds ``libhelm_c``, a C ABI over the
Helm v4 SDK shipped inside the wheel: no ``helm`` binary, cluster or network. Each
rendering, at default values and with every optional part enabled, is linted, every
object is validated against the Kubernetes 1.32 OpenAPI schemas (kubernetes-validate,
strict: unknown fields refused) and checked to stay in sync with manifests/ (the CRD
byte for byte, the RBAC rules, the operator's container) and with the code that the
chart wires together (the operator's CLI, the job pods' labels and ports, the metric
names the dashboard queries). The dashboard's PromQL is checked by ``promtool`` (the
Debian package ``prometheus``) when it is installed: every expression parses, and the
per-stage utilization is evaluated on synthetic counters.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "alpajob"
MANIFESTS = ROOT / "manifests"
RELEASE = "alpajob"
NAMESPACE = "alpajob-system"
KUBE_VERSION = "1.32"
#: Kinds kubernetes-validate has no schema for: checked by hand below.
PROMETHEUS_OPERATOR = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

FULL_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example.com/ml/alpajob", "tag": "0.1.0-rc1",
              "pullPolicy": "Always"},
    "trainerImage": {"repository": "registry.example.com/ml/alpajob-trainer", "tag": "0.1.0-rc1-cpu"},
    "resync": 300,
    "livenessApiTimeout": 90,
    "verbose": True,
    "extraArgs": ["--metrics-bind-address", "0.0.0.0"],
    "imagePullSecrets": [{"name": "regcred"}],
    "watchNamespaces": ["ml", "research"],
    "interval": 0.5,
    "resources": {"requests": {"cpu": "200m", "memory": "300Mi"},
                  "limits": {"cpu": "2", "memory": "1Gi"}},
    "nodeSelector": {"kubernetes.io/os": "linux", "node-role/system": "true"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system",
                     "effect": "NoSchedule"}],
    "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 2000, "runAsGroup": 2000,
                           "fsGroup": 2000, "seccompProfile": {"type": "RuntimeDefault"}},
    "trainerNamespaces": ["ml", "research"],
    "serviceMonitor": {"enabled": True, "interval": "15s",
                       "labels": {"release": "kube-prometheus-stack"}},
    "podMonitor": {"enabled": True, "interval": "10s", "namespaces": ["ml"],
                   "labels": {"release": "kube-prometheus-stack"}},
    "grafanaDashboard": {"enabled": True, "namespace": "monitoring",
                         "annotations": {"grafana_folder": "AlpaJob"}},
    "webhook": {"enabled": True, "port": 10443, "certSecret": "alpajob-webhook-tls", "checkCreator": False},
    "argocd": {"healthCheck": {"enabled": True, "namespace": "argocd", "configMapName": "argocd-cm"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                       "stalledMinutes": 20, "restartsPerHour": 5, "stageIdleShare": 0.6},
}


# --- rendering -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def helm() -> ModuleType:
    return pytest.importorskip("helm_python")


def render(helm: ModuleType, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart installs: its CRDs, then its rendered templates."""
    with helm.Chart.load(CHART) as chart:
        objects = [doc for crd in chart.crds for doc in yaml.safe_load_all(crd["data"]) if doc]
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


@pytest.fixture(scope="module")
def default(helm: ModuleType) -> list[dict[str, Any]]:
    return render(helm)


@pytest.fixture(scope="module")
def full(helm: ModuleType) -> list[dict[str, Any]]:
    return render(helm, copy.deepcopy(FULL_VALUES))


def find(objects: list[dict[str, Any]], kind: str, name: str,
         namespace: str | None = None) -> dict[str, Any]:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name
            and o["metadata"].get("namespace") == namespace]
    assert len(hits) == 1, f"{kind} {namespace}/{name}: {len(hits)} rendered"
    return hits[0]


def manifest(name: str, kind: str, named: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and name ``named``, if given) in manifests/``name``."""
    docs = [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]
    (hit,) = [d for d in docs if d["kind"] == kind and named in (None, d["metadata"]["name"])]
    return hit


def identity(objects: list[dict[str, Any]]) -> set[tuple[str, str, str | None]]:
    return {(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objects}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def operator_args(command: list[str]) -> argparse.Namespace:
    """``command`` (alpajob operator ...) parsed by the real ``alpajob operator`` parser."""
    from alpajob.cli import operator as operator_main

    parser = argparse.ArgumentParser(prog="alpajob")
    operator_main.add_parser(parser.add_subparsers(dest="command", required=True))
    assert command[0] == "alpajob"
    return parser.parse_args(command[1:])


# --- the chart as a whole --------------------------------------------------------------

def test_chart_metadata_matches_the_package(helm: ModuleType) -> None:
    from alpajob.api.release import OPERATOR_IMAGE, VERSION

    with helm.Chart.load(CHART) as chart:
        meta, values = chart.metadata, chart.values
    assert meta["apiVersion"] == "v2"
    assert (meta["name"], meta["version"], meta["appVersion"]) == ("alpajob", VERSION, VERSION)
    # The chart installs the operator's image of the same release (trainer_image/Dockerfile, --target operator).
    assert f"{values['image']['repository']}:{meta['appVersion']}" == OPERATOR_IMAGE


@pytest.mark.parametrize("values", [None, FULL_VALUES], ids=["default", "full"])
def test_lint_is_clean(helm: ModuleType, values: dict[str, Any] | None) -> None:
    report = helm.lint(CHART, copy.deepcopy(values), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}.0")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); 2 warnings, 3 errors.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_crd_is_byte_identical_to_the_manifest(helm: ModuleType) -> None:
    source = (MANIFESTS / "crd.yaml").read_bytes()
    with helm.Chart.load(CHART) as chart:
        crds = chart.crds
    assert [c["name"] for c in crds] == ["crds/alpajob.io_alpajobs.yaml", "crds/kopf.dev_peerings.yaml"]
    assert crds[0]["data"].encode() == source
    assert (CHART / "crds" / "alpajob.io_alpajobs.yaml").read_bytes() == source
    # kopf's peering kinds, as manifests/peering.yaml defines them.
    peering = [d for d in yaml.safe_load_all((MANIFESTS / "peering.yaml").read_text())
               if d and d["kind"] == "CustomResourceDefinition"]
    assert [d for d in yaml.safe_load_all(crds[1]["data"]) if d] == peering


def test_the_packaged_chart_carries_everything(helm: ModuleType, tmp_path: Path) -> None:
    archive = helm.package(CHART, destination=tmp_path)
    assert Path(archive).name == "alpajob-0.1.0.tgz"
    with helm.Chart.load(CHART) as directory, helm.Chart.load(archive) as packaged:
        assert packaged.crds == directory.crds
        values = copy.deepcopy(FULL_VALUES)
        assert packaged.render(values, name=RELEASE, namespace=NAMESPACE) == \
            directory.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("which", ["default", "full"])
def test_every_object_passes_the_kubernetes_schemas(which: str, request: pytest.FixtureRequest) -> None:
    validate = pytest.importorskip("kubernetes_validate")
    objects = request.getfixturevalue(which)
    unchecked = set()
    for obj in objects:
        try:
            validate.validate(obj, KUBE_VERSION, strict=True)
        except validate.SchemaNotFoundError:
            unchecked.add(obj["kind"])
        except validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {path}: {error.message}")
    assert unchecked == (PROMETHEUS_OPERATOR | {"KopfPeering"} if which == "full" else {"ClusterKopfPeering"})


def test_defaults_install_the_operator_and_the_shared_trainer_role_only(default: list[dict[str, Any]]) -> None:
    """No ServiceAccount for the jobs: each job runs as its own, which the operator makes."""
    assert identity(default) == {
        ("CustomResourceDefinition", "alpajobs.alpajob.io", None),
        ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev", None),
        ("CustomResourceDefinition", "kopfpeerings.kopf.dev", None),
        ("ClusterKopfPeering", "alpajob", None),
        ("PodDisruptionBudget", "alpajob-operator", NAMESPACE),
        ("ServiceAccount", "alpajob-operator", NAMESPACE),
        ("ClusterRole", "alpajob-operator", None),
        ("ClusterRoleBinding", "alpajob-operator", None),
        ("Deployment", "alpajob-operator", NAMESPACE),
        ("Service", "alpajob-operator-metrics", NAMESPACE),
        ("Service", "alpajob-operator-webhook", NAMESPACE),
        ("NetworkPolicy", "alpajob-operator", NAMESPACE),
        ("ClusterRole", "alpajob-trainer", None),
    }


def test_every_object_is_labelled_with_the_release(full: list[dict[str, Any]]) -> None:
    for obj in full:
        if obj["kind"] == "CustomResourceDefinition":
            continue  # crds/ is installed verbatim, never templated
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE, obj["kind"]
        # Argo CD reads only an argocd-cm that is part of Argo CD.
        part_of = "argocd" if obj["metadata"]["name"] == "argocd-cm" else "alpajob"
        assert labels["app.kubernetes.io/part-of"] == part_of, obj["kind"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", obj["kind"]


# --- in sync with manifests/ -----------------------------------------------------------

def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    """Every (group, resource, verb, name) a list of RBAC rules grants."""
    return {(group, resource, verb, name) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"] for name in rule.get("resourceNames") or ["*"]}


def test_operator_rbac_equals_the_manifest(default: list[dict[str, Any]]) -> None:
    role = find(default, "ClusterRole", "alpajob-operator")
    assert _grants(role["rules"]) == _grants(manifest("rbac.yaml", "ClusterRole")["rules"])
    binding = find(default, "ClusterRoleBinding", "alpajob-operator")
    expected = manifest("rbac.yaml", "ClusterRoleBinding")
    assert binding["roleRef"] == expected["roleRef"]
    assert binding["subjects"] == expected["subjects"]  # released into alpajob-system
    find(default, "ServiceAccount", "alpajob-operator", NAMESPACE)


def test_operator_deployment_equals_the_manifest_at_defaults(default: list[dict[str, Any]]) -> None:
    chart = find(default, "Deployment", "alpajob-operator", NAMESPACE)
    source = manifest("operator.yaml", "Deployment")
    # The whole container: image, command, env, ports, probes, resources, securityContext.
    assert container(chart) == container(source)
    pod, source_pod = chart["spec"]["template"]["spec"], source["spec"]["template"]["spec"]
    assert {k: v for k, v in pod.items() if k != "containers"} == \
        {k: v for k, v in source_pod.items() if k != "containers"}
    assert (chart["spec"]["replicas"], chart["spec"]["strategy"]) == \
        (source["spec"]["replicas"], source["spec"]["strategy"])
    selector = chart["spec"]["selector"]["matchLabels"]
    assert selector.items() <= chart["spec"]["template"]["metadata"]["labels"].items()
    assert source["spec"]["selector"]["matchLabels"].items() <= selector.items()


@pytest.mark.parametrize("name", ["alpajob-operator-metrics", "alpajob-operator-webhook"])
def test_service_equals_the_manifest_and_selects_the_operator(default: list[dict[str, Any]], name: str) -> None:
    service = find(default, "Service", name, NAMESPACE)
    assert service["spec"]["ports"] == manifest("operator.yaml", "Service", name)["spec"]["ports"]
    pod = find(default, "Deployment", "alpajob-operator", NAMESPACE)["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for p in container({"spec": {"template": pod}})["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_trainer_rbac_equals_the_manifest(helm: ModuleType) -> None:
    objects = render(helm, {"trainerNamespaces": ["default"]})
    role = find(objects, "ClusterRole", "alpajob-trainer")
    assert role["rules"] == manifest("trainer-rbac.yaml", "ClusterRole")["rules"]
    binding = find(objects, "RoleBinding", "alpajob-trainer", "default")
    expected = manifest("trainer-rbac.yaml", "RoleBinding")
    assert (binding["roleRef"], binding["subjects"]) == (expected["roleRef"], expected["subjects"])
    account = find(objects, "ServiceAccount", "alpajob-trainer", "default")
    assert account["metadata"]["name"] == manifest("trainer-rbac.yaml", "ServiceAccount")["metadata"]["name"]


def test_a_job_naming_the_shared_account_runs_as_it_and_others_as_their_own(helm: ModuleType) -> None:
    from alpajob.operator.children import head_pod, identity
    from alpajob.operator.names import ChildNames

    objects = render(helm, {"trainerNamespaces": ["default"]})
    job = {"metadata": {"name": "demo", "namespace": "default", "uid": "u-1"},
           "spec": {"model": {"zoo": "gpt"}, "serviceAccountName": "alpajob-trainer"}}
    pod = head_pod(job, ChildNames("demo", 0), None)
    find(objects, "ServiceAccount", pod["spec"]["serviceAccountName"], "default")
    assert identity(job, ChildNames("demo", 0)) == []
    del job["spec"]["serviceAccountName"]
    assert head_pod(job, ChildNames("demo", 0), None)["spec"]["serviceAccountName"] == "demo-trainer"
    assert [o["kind"] for o in identity(job, ChildNames("demo", 0))] == ["ServiceAccount", "Role", "RoleBinding"]


# --- values ----------------------------------------------------------------------------

def test_default_command_watches_every_namespace() -> None:
    args = operator_args(container(manifest("operator.yaml", "Deployment"))["command"])
    assert args.all_namespaces and args.namespace is None and not args.no_scanning


def test_values_reach_the_operator_deployment(full: list[dict[str, Any]]) -> None:
    deployment = find(full, "Deployment", "alpajob-operator", NAMESPACE)
    pod = deployment["spec"]["template"]["spec"]
    operator = container(deployment)
    args = operator_args(operator["command"])
    assert args.namespace == ["ml", "research"] and not args.all_namespaces
    assert args.no_scanning  # the ClusterRole grants no list on namespaces
    assert args.interval == 0.5
    assert (args.resync, args.liveness_api_timeout, args.verbose) == (300.0, 90.0, True)
    assert args.default_image == "registry.example.com/ml/alpajob-trainer:0.1.0-rc1-cpu"
    assert args.check_creator is False
    assert operator["command"][-2:] == ["--metrics-bind-address", "0.0.0.0"]  # extraArgs, last
    assert (args.liveness, args.metrics_port) == ("http://0.0.0.0:8080/healthz", 9090)
    assert operator["image"] == "registry.example.com/ml/alpajob:0.1.0-rc1"
    assert operator["imagePullPolicy"] == "Always"
    assert operator["resources"] == FULL_VALUES["resources"]
    assert pod["imagePullSecrets"] == FULL_VALUES["imagePullSecrets"]
    assert pod["nodeSelector"] == FULL_VALUES["nodeSelector"]
    assert pod["tolerations"] == FULL_VALUES["tolerations"]
    assert pod["securityContext"] == FULL_VALUES["podSecurityContext"]
    # Whatever the values, the container stays locked down.
    assert operator["securityContext"] == container(manifest("operator.yaml", "Deployment"))["securityContext"]
    # The webhook on its own port, with the certificate of webhook.certSecret.
    assert (args.webhook_port, args.webhook_managed) == (10443, True)
    assert args.webhook_host == f"alpajob-operator-webhook.{NAMESPACE}.svc"
    assert (args.webhook_cert, args.webhook_key) == ("/etc/alpajob/webhook-tls/tls.crt",
                                                     "/etc/alpajob/webhook-tls/tls.key")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "webhook-tls"]
    assert volume == {"name": "webhook-tls", "secret": {"secretName": "alpajob-webhook-tls"}}
    assert {"name": "webhook-tls", "mountPath": "/etc/alpajob/webhook-tls", "readOnly": True} in \
        operator["volumeMounts"]
    service = find(full, "Service", "alpajob-operator-webhook", NAMESPACE)
    assert service["spec"]["ports"] == [{"name": "webhook", "port": 10443, "targetPort": "webhook"}]


def test_the_trainer_image_is_this_release_s_unless_named(helm: ModuleType) -> None:
    """Unset, the operator keeps its built-in default (this release's trainer image, no
    flag); a repository alone is tagged with the chart's appVersion; a tag alone is
    refused naming the missing value."""
    from alpajob.api.release import TRAINER_IMAGE, VERSION

    def default_image(values: dict[str, Any] | None) -> str | None:
        deployment = find(render(helm, values), "Deployment", "alpajob-operator", NAMESPACE)
        return operator_args(container(deployment)["command"]).default_image

    from alpajob.operator.children import DEFAULT_IMAGE

    assert default_image(None) is None and DEFAULT_IMAGE == TRAINER_IMAGE
    assert default_image({"trainerImage": {"repository": "registry.example.com/ml/alpajob"}}) == \
        f"registry.example.com/ml/alpajob:{VERSION}"
    with pytest.raises(Exception, match="trainerImage.repository is empty"):
        render(helm, {"trainerImage": {"tag": "1.0"}})


def test_disabling_the_webhook_drops_its_flags_port_service_and_rules(helm: ModuleType) -> None:
    objects = render(helm, {"webhook": {"enabled": False, "certSecret": "ignored"}})
    deployment = find(objects, "Deployment", "alpajob-operator", NAMESPACE)
    operator = container(deployment)
    args = operator_args(operator["command"])
    assert args.webhook_port is None and not args.webhook_managed and args.webhook_host is None
    assert args.webhook_cert is None
    assert [p["name"] for p in operator["ports"]] == ["health", "metrics"]
    assert [v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]] == ["tmp"]
    assert {k for k in identity(objects) if k[0] == "Service"} == \
        {("Service", "alpajob-operator-metrics", NAMESPACE)}
    rules = find(objects, "ClusterRole", "alpajob-operator")["rules"]
    with_webhook = manifest("rbac.yaml", "ClusterRole")["rules"]
    webhook_groups = {"admissionregistration.k8s.io", "authorization.k8s.io"}
    assert _grants(rules) == {g for g in _grants(with_webhook) if g[0] not in webhook_groups}


def test_network_policies_follow_the_values(helm: ModuleType, default: list[dict[str, Any]]) -> None:
    """On by default: the operator's namespace policy equals the manifest's, and the
    operator makes the jobs' (no flag); a metrics namespace and data schemes reach it
    as flags; off: no policy, and --no-network-policy."""
    policy = find(default, "NetworkPolicy", "alpajob-operator", NAMESPACE)
    assert policy["spec"] == manifest("operator.yaml", "NetworkPolicy")["spec"]
    args = operator_args(container(find(default, "Deployment", "alpajob-operator", NAMESPACE))["command"])
    assert args.network_policy and args.metrics_scraper_namespace is None and args.data_schemes == "file,s3,gs"
    objects = render(helm, {"networkPolicy": {"metricsNamespace": "monitoring"}, "dataSchemes": ["s3", "https"]})
    args = operator_args(container(find(objects, "Deployment", "alpajob-operator", NAMESPACE))["command"])
    assert args.metrics_scraper_namespace == "monitoring" and args.data_schemes == "s3,https"
    objects = render(helm, {"networkPolicy": {"enabled": False}})
    assert not any(kind == "NetworkPolicy" for kind, _, _ in identity(objects))
    args = operator_args(container(find(objects, "Deployment", "alpajob-operator", NAMESPACE))["command"])
    assert args.network_policy is False


def test_a_namespaced_install_binds_the_operator_in_the_watched_namespaces_only(helm: ModuleType) -> None:
    """rbac.namespaced: manifests/rbac-namespaced.yaml's two roles, the namespaced one
    bound in each watched namespace (and its KopfPeering there), nothing cluster-wide
    on pods, ConfigMaps or Secrets; without watchNamespaces the chart refuses."""
    objects = render(helm, {"rbac": {"namespaced": True}, "watchNamespaces": ["ml", "research"]})
    for name in ("alpajob-operator-namespaced", "alpajob-operator-cluster"):
        source = manifest("rbac-namespaced.yaml", "ClusterRole", name)
        assert _grants(find(objects, "ClusterRole", name)["rules"]) == _grants(source["rules"]), name
    assert not any(k == ("ClusterRole", "alpajob-operator", None) for k in identity(objects))
    bindings = {k[2] for k in identity(objects) if k[0] == "RoleBinding" and k[1] == "alpajob-operator"}
    assert bindings == {"ml", "research"}
    assert {k[2] for k in identity(objects) if k[0] == "KopfPeering"} == {"ml", "research"}
    with pytest.raises(Exception, match="rbac.namespaced needs watchNamespaces"):
        render(helm, {"rbac": {"namespaced": True}})


def test_interval_accepts_whole_numbers(helm: ModuleType) -> None:
    objects = render(helm, {"interval": 3})
    command = container(find(objects, "Deployment", "alpajob-operator", NAMESPACE))["command"]
    assert operator_args(command).interval == 3.0


def test_each_trainer_namespace_gets_the_account_and_binding(full: list[dict[str, Any]]) -> None:
    for namespace in FULL_VALUES["trainerNamespaces"]:
        find(full, "ServiceAccount", "alpajob-trainer", namespace)
        binding = find(full, "RoleBinding", "alpajob-trainer", namespace)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "alpajob-trainer",
                                        "namespace": namespace}]
        assert binding["roleRef"]["name"] == "alpajob-trainer"
    assert not [o for o in full if o["metadata"].get("namespace") == "default"]


def test_no_trainer_namespaces_leaves_the_cluster_role_alone(helm: ModuleType) -> None:
    objects = render(helm, {"trainerNamespaces": []})
    assert {k for k in identity(objects) if "alpajob-trainer" in k} == \
        {("ClusterRole", "alpajob-trainer", None)}


@pytest.mark.parametrize(("values", "named"), [
    ({"watchNamespace": ["ml"]}, "watchNamespace"),
    ({"watchNamespaces": "ml"}, "/watchNamespaces"),
    ({"interval": 0}, "/interval"),
    ({"trainerNamespaces": ["ML_team"]}, "/trainerNamespaces/0"),
    ({"serviceMonitor": {"enable": True}}, "enable"),
    ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"webhook": {"enable": True}}, "enable"),
    ({"webhook": {"port": 9090}}, "/webhook/port"),
    ({"webhook": {"port": 443}}, "/webhook/port"),
    ({"webhook": {"certSecret": "My_Secret"}}, "/webhook/certSecret"),
])
def test_the_values_schema_refuses_bad_values(helm: ModuleType, values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(named)):
        render(helm, values)


# --- monitoring ------------------------------------------------------------------------

def test_service_monitor_scrapes_the_operator_metrics(full: list[dict[str, Any]]) -> None:
    monitor = find(full, "ServiceMonitor", "alpajob-operator", NAMESPACE)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    service = find(full, "Service", "alpajob-operator-metrics", NAMESPACE)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s", "honorLabels": True}
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_pod_monitor_scrapes_every_head_pod(full: list[dict[str, Any]]) -> None:
    from alpajob.api.runtime import TrainerRuntime
    from alpajob.operator.children import head_pod
    from alpajob.operator.names import ChildNames

    monitor = find(full, "PodMonitor", "alpajob-trainer", NAMESPACE)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    job = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}, "spec": {"model": {"zoo": "gpt"}}}
    head = head_pod(job, ChildNames("demo", 2), "volcano")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= head["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (driver,) = head["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in driver["ports"]}
    runtime = TrainerRuntime.from_env({e["name"]: e["value"] for e in driver["env"]})
    assert ports[endpoint["port"]] == runtime.metrics_port  # where the driver serves /metrics
    # The trainer labels its series with job=<AlpaJob>; keep it rather than exported_job.
    assert endpoint["honorLabels"] is True and endpoint["path"] == "/metrics"


def test_pod_monitor_defaults_to_every_namespace(helm: ModuleType) -> None:
    objects = render(helm, {"podMonitor": {"enabled": True}})
    monitor = find(objects, "PodMonitor", "alpajob-trainer", NAMESPACE)
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert {o["kind"] for o in objects} & {"ServiceMonitor", "ConfigMap"} == set()


# --- the Grafana dashboard -------------------------------------------------------------

DASHBOARD = CHART / "files" / "grafana-dashboard.json"


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def targets() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard."""
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


def grafana_to_promql(expr: str) -> str:
    """Grafana's template variables replaced as 'All' selects them."""
    return expr.replace("$namespace", ".*").replace("$job", ".*")


def exposed_metric_names() -> set[str]:
    """The sample names the trainer's and the operator's registries expose."""
    from prometheus_client import generate_latest

    from alpajob.api.progress import Progress
    from alpajob.api.status import JobTime, Phase
    from alpajob.operator.metrics import OperatorMetrics
    from alpajob.trainer_image.metrics import TrainingMetrics

    trainer = TrainingMetrics("demo", predicted_step_seconds=0.5)
    report = Progress(step=10, loss=2.5, eval_loss=2.7, samples_per_second=80.0, tokens_per_second=10240.0,
                      mfu=0.31, last_checkpoint_step=10)
    trainer.record(report, 0.4, [SimpleNamespace(compute=0.3, idle=0.08, communication=0.02)])
    trainer.predicted_idle.labels("demo", "0").set(0.1)
    trainer.books({"goodput": 0.8, "wall_seconds": 10.0, "productive_seconds": 8.0, "compile_seconds": 2.0})
    trainer.data({("0", "0"): 4096}, {"train": 32})
    operator = OperatorMetrics()
    operator.phase("ml/demo", "Running")
    operator.job_time("ml", "demo", Phase.RUNNING, JobTime(phase_since="2026-11-26T10:00:00Z", planning_seconds=5.0))
    operator.reconcile.observe(0.01)
    operator.planning.observe(12.0)
    operator.restarts.inc()
    operator.errors.inc()
    operator.api_requests.labels("GET", "200").inc()
    names = set()
    for registry in (trainer.registry, operator.registry):
        for line in generate_latest(registry).decode().splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_argocd_health_check_is_the_gitops_script(helm: ModuleType, full: list[dict[str, Any]],
                                                  default: list[dict[str, Any]]) -> None:
    """Behind its toggle, the chart renders Argo CD's health check, byte for byte the
    script of gitops/argocd/ (whose tests run it in Lua), under argocd-cm's key."""
    script = (CHART.parent.parent / "gitops" / "argocd" / "alpajob.io" / "AlpaJob" / "health.lua").read_text()
    assert (CHART / "files" / "argocd-health.lua").read_text() == script
    config_map = find(full, "ConfigMap", "argocd-cm", "argocd")
    assert config_map["data"]["resource.customizations.health.alpajob.io_AlpaJob"] == script.rstrip("\n")
    assert not [o for o in default if o["kind"] == "ConfigMap"]
    # Under its own name (the default), it carries the chart's labels.
    own = find(render(helm, {"argocd": {"healthCheck": {"enabled": True}}}),
               "ConfigMap", "alpajob-argocd-health", "argocd")
    assert own["metadata"]["labels"]["app.kubernetes.io/part-of"] == "alpajob"


def test_dashboard_config_map_carries_the_dashboard(full: list[dict[str, Any]]) -> None:
    config_map = find(full, "ConfigMap", "alpajob-grafana-dashboard", "monitoring")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "AlpaJob"}
    assert json.loads(config_map["data"]["alpajob.json"]) == dashboard()
    # Small enough for a ConfigMap, and for kubectl's last-applied annotation (256 KiB).
    assert len(config_map["data"]["alpajob.json"].encode()) < 256 * 1024


def test_dashboard_json_is_the_one_the_code_builds() -> None:
    """The chart's dashboard is generated (``alpajob dashboard -o ...``) from
    ``alpajob.operator.dashboard``, which builds it with Grafana's typed builders:
    hand edits to the JSON, or code changes not regenerated, fail here."""
    from alpajob.operator.dashboard import dashboard_json

    assert DASHBOARD.read_text() == dashboard_json(), (
        "regenerate: alpajob dashboard -o charts/alpajob/files/grafana-dashboard.json")


def test_dashboard_panels_are_well_formed() -> None:
    board = dashboard()
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["allValue"] == variables["job"]["allValue"] == ".*"


def test_dashboard_has_the_panels_users_look_for() -> None:
    by_title: dict[str, list[str]] = {}
    for title, expr in targets():
        by_title.setdefault(title, []).append(expr)
    (utilization,) = by_title["Per-stage utilization"]
    compute = 'rate(alpajob_stage_compute_seconds_total{namespace=~"$namespace", job=~"$job"}[5m])'
    numerator, _, denominator = utilization.partition("\n/\n")
    assert compute in numerator
    for part in ("compute", "idle", "communication"):
        assert f"rate(alpajob_stage_{part}_seconds_total" in denominator
    wanted = {
        "Step seconds, measured and predicted": "alpajob_predicted_step_seconds",
        "Throughput": "alpajob_tokens_per_second",
        "Tokens / s": "alpajob_tokens_per_second",
        "MFU": "alpajob_mfu",
        "Loss": "alpajob_eval_loss",
        "Checkpoint age": "alpajob_last_checkpoint_timestamp_seconds",
        "Step and last checkpoint step": "alpajob_checkpoint_step",
        "Restarts": "alpajob_job_restarts",
        "AlpaJobs by phase": "alpajob_operator_jobs",
        "API requests": "alpajob_operator_api_requests_total",
        "Reconcile and planning seconds": "alpajob_operator_reconcile_seconds_bucket",
        "Goodput": "alpajob_job_goodput",
        "Badput by bucket": "alpajob_badput_seconds",
        "Data wait": "alpajob_badput_seconds",
        "Bubble share per stage, measured and predicted": "alpajob_stage_predicted_idle_share",
    }
    for title, metric in wanted.items():
        assert any(re.search(rf"\b{metric}\b", e) for e in by_title[title]), title


def test_dashboard_queries_only_metrics_that_exist() -> None:
    exposed = exposed_metric_names()
    board = dashboard()
    queries = [expr for _, expr in targets()]
    queries += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    used = {name for q in queries for name in re.findall(r"\balpajob_[a-z_]+\b", q)}
    assert used and used <= exposed, sorted(used - exposed)


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    return path


def test_every_dashboard_query_is_valid_promql(promtool: str, tmp_path: Path) -> None:
    rules = [{"record": f"alpajob_dashboard:query_{i}", "expr": grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(targets())]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _stage_counters(per_minute: dict[str, tuple[int, int, int]]) -> list[dict[str, str]]:
    """promtool input series: each stage's compute, idle and communication seconds
    counters, growing by the given seconds every minute for 10 minutes."""
    series = []
    for stage, seconds in per_minute.items():
        for part, step in zip(("compute", "idle", "communication"), seconds, strict=True):
            series.append({
                "series": f'alpajob_stage_{part}_seconds_total{{namespace="ml", job="gpt", stage="{stage}"}}',
                "values": f"0+{step}x10",
            })
    return series


def _by_stage(values: tuple[float, float]) -> list[dict[str, Any]]:
    return [{"labels": f'{{namespace="ml", job="gpt", stage="{stage}"}}', "value": value}
            for stage, value in enumerate(values)]


def _promtool_test(promtool: str, path: Path, series: list[dict[str, str]],
                   expected: list[tuple[str, tuple[float, float]]]) -> None:
    """Evaluate each (query, per-stage values) at 10 minutes on ``series`` with promtool."""
    test = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": grafana_to_promql(expr), "eval_time": "10m", "exp_samples": _by_stage(values)}
                             for expr, values in expected],
    }]}
    path.write_text(yaml.safe_dump(test))
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_per_stage_utilization_on_synthetic_counters(promtool: str, tmp_path: Path) -> None:
    """Stage 0 computes 48 s a minute, idles 9 and communicates 3: 80% busy; stage 1
    computes 30, idles 24 (the pipeline bubble) and communicates 6: 50%."""
    (utilization,) = [e for t, e in targets() if t == "Per-stage utilization"]
    series = _stage_counters({"0": (48, 9, 3), "1": (30, 24, 6)})
    _promtool_test(promtool, tmp_path / "utilization_test.yaml", series, [(utilization, (0.8, 0.5))])


def test_bubble_share_per_stage_on_synthetic_counters(promtool: str, tmp_path: Path) -> None:
    """Stage 1 idles 24 s of every 60 (the bubble: 40%), stage 0 idles 15 (25%); the
    measured query gives those shares, the predicted one the plan's gauge."""
    measured, predicted = [e for t, e in targets() if t == "Bubble share per stage, measured and predicted"]
    series = [{"series": f'alpajob_stage_predicted_idle_share{{namespace="ml", job="gpt", stage="{stage}"}}',
               "values": f"{share}x10"} for stage, share in (("0", 0.1), ("1", 0.35))]
    series += _stage_counters({"0": (42, 15, 3), "1": (30, 24, 6)})
    _promtool_test(promtool, tmp_path / "bubble_test.yaml", series,
                   [(measured, (0.25, 0.4)), (predicted, (0.1, 0.35))])
