"""The validating admission webhook as shipped: the operator's flags, its port, its
Service and RBAC, in manifests/ and in the chart (default and full values).

kopf (``--webhook-managed``) registers ``https://<--webhook-host>:<--webhook-port>/
validate-alpajob`` in the ValidatingWebhookConfiguration ``alpajobs.alpajob.io``: the
host must be the DNS name of a Service that selects the operator's pod and serves the
listening port itself (kopf puts it into the URL) on the container's port of that
number. The last test runs the real operator against KMock's emulator with those
flags and checks the configuration kopf writes and that every call it makes to the
webhook configurations is allowed by manifests/rbac.yaml.
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
CHART = ROOT / "charts" / "alpajob"
NAMESPACE = "alpajob-system"
ADMISSION = "admissionregistration.k8s.io"
CONFIGURATIONS = ("validatingwebhookconfigurations", "mutatingwebhookconfigurations")


def plain() -> list[dict[str, Any]]:
    return [d for name in ("operator.yaml", "rbac.yaml")
            for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def rendered(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(CHART) as chart:
        texts = chart.render(values, name="alpajob", namespace=NAMESPACE, is_install=True)
    return [d for path, text in texts.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


SOURCES: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "manifests": plain,
    "chart-default": lambda: rendered(None),
    "chart-port-and-cert": lambda: rendered({"webhook": {"port": 10443, "certSecret": "webhook-tls"}}),
}


@pytest.fixture(params=list(SOURCES))
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return SOURCES[request.param]()


def the(objects: list[dict[str, Any]], kind: str, name: str = "alpajob-operator") -> dict[str, Any]:
    (hit,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return hit


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = the(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def parse(command: list[str]) -> argparse.Namespace:
    """``command`` parsed by the real ``alpajob operator`` parser."""
    from alpajob.cli import operator as operator_main

    parser = argparse.ArgumentParser(prog="alpajob")
    operator_main.add_parser(parser.add_subparsers(dest="command", required=True))
    assert command[:2] == ["alpajob", "operator"]
    return parser.parse_args(command[1:])


def allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str, name: str | None) -> bool:
    """Whether a ClusterRole's ``rules`` allow ``verb`` on ``resource`` (named ``name``)."""
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
               and ("resourceNames" not in r or name in r["resourceNames"]) for r in rules)


# --- the shipped objects ---------------------------------------------------------------

def test_the_operator_command_serves_a_managed_webhook(objects: list[dict[str, Any]]) -> None:
    container = operator_container(objects)
    args = parse(container["command"])
    assert args.webhook_port is not None and args.webhook_managed and not args.webhook_insecure
    assert args.webhook_host and args.webhook_host.endswith(".svc")
    # A certificate is the pair of files, or none (kopf self-signs one for the host).
    assert (args.webhook_cert is None) == (args.webhook_key is None)
    if args.webhook_cert is not None:
        mounts = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
        assert {str(Path(args.webhook_cert).parent), str(Path(args.webhook_key).parent)} <= mounts


def test_the_webhook_service_reaches_the_port_kopf_registers(objects: list[dict[str, Any]]) -> None:
    args = parse(operator_container(objects)["command"])
    service_name, namespace, _ = args.webhook_host.split(".")
    (service,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == service_name]
    assert service["metadata"]["namespace"] == namespace == the(objects, "Deployment")["metadata"]["namespace"]
    pod = the(objects, "Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == args.webhook_port  # kopf's URL carries the listening port
    container_ports = {p["name"]: p["containerPort"] for p in operator_container(objects)["ports"]}
    assert container_ports[port["targetPort"]] == args.webhook_port


def test_the_cluster_role_lets_kopf_manage_the_configuration(objects: list[dict[str, Any]]) -> None:
    from alpajob.api.names import GROUP, PLURAL

    rules = the(objects, "ClusterRole")["rules"]
    for resource in CONFIGURATIONS:
        assert allows(rules, ADMISSION, resource, "create", None), resource
        assert allows(rules, ADMISSION, resource, "patch", f"{PLURAL}.{GROUP}"), resource
        assert not allows(rules, ADMISSION, resource, "patch", "someone-elses"), resource
        for verb in ("get", "list", "watch", "update", "delete"):
            assert not allows(rules, ADMISSION, resource, verb, f"{PLURAL}.{GROUP}"), (resource, verb)


# --- what kopf registers, for real ----------------------------------------------------

@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[Any]:
    kmock = pytest.importorskip("kmock")
    sys.path.insert(0, str(Path(__file__).parent))
    from kube_emulator import Emulator

    emu = Emulator(tmp_path).start()
    for resource, kind in zip(CONFIGURATIONS, ("ValidatingWebhookConfiguration",
                                               "MutatingWebhookConfiguration"), strict=True):
        emu.kmock.resources[f"{ADMISSION}/v1/{resource}"] = kmock.ResourceInfo(
            kind=kind, namespaced=False, verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
    yield emu
    emu.stop()


def kopf_calls(emu: Any) -> list[tuple[str, str, str | None]]:
    """(verb, resource, name) of each call kopf made to a webhook configuration."""
    verbs = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}
    calls = []
    for request in list(emu.kmock):
        path = urllib.parse.urlsplit(str(request.url)).path.split("/")
        if not str(request.headers.get("User-Agent", "")).startswith("kopf/") or len(path) < 5:
            continue
        if path[2] != ADMISSION:
            continue
        name = path[5] if len(path) > 5 else None
        method = str(getattr(request.method, "value", request.method)).upper()
        verb = verbs.get(method) or ("get" if name else "list")
        calls.append((verb, path[4], name))
    return calls


def test_kopf_registers_the_service_url_with_only_the_granted_verbs(emulator: Any, tmp_path: Path) -> None:
    """The shipped flags, but a free port: the operator self-signs a certificate for the
    host and registers the Service (not a URL: kube-apiserver cannot resolve cluster DNS
    in one) with that certificate as the CA bundle, for CREATE and UPDATE only."""
    from kubernetes import client

    from alpajob.api.names import GROUP, PLURAL, VERSION
    from alpajob.trainer_image.distributed.loopback import free_port

    shipped = parse(operator_container(plain())["command"])
    port = free_port()
    log = tmp_path / "operator.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "alpajob", "operator", "--namespace", "ml", "--no-scanning",
             "--webhook-port", str(port), "--webhook-managed", "--webhook-host", shipped.webhook_host],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": str(emulator.kubeconfig)})
    api = client.AdmissionregistrationV1Api(emulator.api())
    name = f"{PLURAL}.{GROUP}"
    try:
        deadline = time.monotonic() + 60
        while not [c for c in kopf_calls(emulator) if c[0] == "patch" and c[1] == CONFIGURATIONS[0]]:
            assert process.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        (webhook,) = api.read_validating_webhook_configuration(name).to_dict()["webhooks"]
        assert webhook["name"] == f"validate-alpajob.{name}"
        service_name, namespace, _ = shipped.webhook_host.split(".")
        assert webhook["client_config"]["url"] is None
        assert webhook["client_config"]["service"] == {
            "namespace": namespace, "name": service_name, "port": port, "path": "/validate-alpajob"}
        from cryptography import x509

        ca = x509.load_pem_x509_certificate(base64.b64decode(webhook["client_config"]["ca_bundle"]))
        sans = ca.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert shipped.webhook_host in sans.get_values_for_type(x509.DNSName)
        (rule,) = webhook["rules"]
        assert sorted(rule["operations"]) == ["CREATE", "UPDATE"]
        assert (rule["api_groups"], rule["api_versions"], rule["resources"]) == ([GROUP], [VERSION], [PLURAL])
        assert api.read_mutating_webhook_configuration(name).webhooks in (None, [])
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    # On a clean exit kopf empties the webhooks, so nothing calls a stopped operator.
    assert api.read_validating_webhook_configuration(name).webhooks in (None, [])
    calls = kopf_calls(emulator)
    assert {(verb, resource) for verb, resource, _ in calls} == \
        {(verb, resource) for verb in ("create", "patch") for resource in CONFIGURATIONS}
    rules = the(plain(), "ClusterRole")["rules"]
    for verb, resource, named in calls:
        assert allows(rules, ADMISSION, resource, verb, named), (verb, resource, named)
