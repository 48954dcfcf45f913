"""Where the end-to-end tests run: KMock (the default), or a real cluster.

``ALPAJOB_E2E_KUBECONFIG=/path/to/kubeconfig`` points the end-to-end tests
(``test_operator_e2e.py``, ``test_pods_train.py``) at a real kube-apiserver, as kopf's
and KubeRay's e2e suites run: the same tests, the same assertions. :func:`open_cluster`
gives either an :class:`~kube_emulator.Emulator` or a :class:`RealCluster`, which offer
what the tests use: ``kubeconfig``, ``api()``, ``cluster_of()``, ``claim()``, ``release()``
and ``stop()``. Every test runs in a namespace of its own (:func:`unique_namespace`),
released (deleted, and waited for) after it: a real namespace deletion takes time, and
a test that reused the name would be refused with 403 NamespaceTerminating.

On a real cluster :meth:`RealCluster.cluster_of` applies the CRD, labels the namespace
Pod Security ``restricted``, creates the trainer's ServiceAccount and registers fake
GPU nodes, which the test kubelet (``kubelet.Kubelet(nodes=...)``) keeps alive and
whose bound pods it runs. Use a throwaway cluster (kind, k3d) whose own nodes take no
pods from the test namespace (cordon them: ``kubectl cordon --all``), so that every
pod the operator creates lands on a fake node; the operator runs as a process with
the kubeconfig's credentials. Tests that read the emulator's own records (requests
counted, kmock resources declared) say so and are skipped there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

E2E_KUBECONFIG = "ALPAJOB_E2E_KUBECONFIG"
ROOT = Path(__file__).resolve().parent.parent


def real_kubeconfig() -> Path | None:
    """The kubeconfig of a real cluster to test against, if one is named."""
    path = os.environ.get(E2E_KUBECONFIG)
    return Path(path) if path else None


def open_cluster(root: Path, graceful_pods: bool = False) -> Any:
    """A started test cluster: the real one named by ``$ALPAJOB_E2E_KUBECONFIG``, else KMock
    (``graceful_pods``: pod deletions wait for the test kubelet, as a real cluster's do)."""
    real = real_kubeconfig()
    if real is not None:
        return RealCluster(real).start()
    from kube_emulator import Emulator

    return Emulator(root, graceful_pods=graceful_pods).start()


@contextlib.contextmanager
def operator_process(namespace: str, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """``alpajob operator`` watching ``namespace`` as a process (its output in ``log``),
    stopped with SIGTERM at the end (killed if it does not stop in 15 s)."""
    with open(log, "w") as out:
        operator = subprocess.Popen(
            [sys.executable, "-m", "alpajob", "operator", "--namespace", namespace, "--interval", "0.3",
             "--no-scanning"], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        yield operator
    finally:
        operator.send_signal(signal.SIGTERM)
        try:
            operator.wait(15)
        except subprocess.TimeoutExpired:
            operator.kill()


#: The operator's identity, as manifests/rbac.yaml makes it.
OPERATOR_NAMESPACE, OPERATOR_ACCOUNT = "alpajob-system", "alpajob-operator"


def shipped_rbac(name: str, namespace: str | None = None) -> list[dict[str, Any]]:
    """The RBAC documents of ``manifests/<name>``, with every namespaced one moved to
    ``namespace`` when given (the trainer's ServiceAccount and RoleBinding, as the chart
    makes them in each namespace of ``trainerNamespaces``)."""
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / name).read_text()) if d]
    for doc in docs:
        if namespace is not None and "namespace" in doc["metadata"]:
            doc["metadata"]["namespace"] = namespace
            for subject in doc.get("subjects") or []:
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace
    return docs


def apply_documents(api: client.ApiClient, docs: list[dict[str, Any]]) -> None:
    """Create each of ``docs``; one that exists already is made again from the
    document (a cluster that an earlier run left roles in gets the shipped ones)."""
    from kubernetes import utils

    for doc in docs:
        try:
            utils.create_from_dict(api, doc)
        except utils.FailToCreateError as failure:
            if any(error.status != 409 for error in failure.api_exceptions):
                raise
            if doc["kind"] == "ServiceAccount":
                continue  # its token stays valid; nothing in it to update
            _delete_document(api, doc)
            utils.create_from_dict(api, doc)


def _delete_document(api: client.ApiClient, doc: dict[str, Any]) -> None:
    rbac = client.RbacAuthorizationV1Api(api)
    name, namespace = doc["metadata"]["name"], doc["metadata"].get("namespace")
    delete = {"ClusterRole": lambda: rbac.delete_cluster_role(name),
              "ClusterRoleBinding": lambda: rbac.delete_cluster_role_binding(name),
              "Role": lambda: rbac.delete_namespaced_role(name, namespace),
              "RoleBinding": lambda: rbac.delete_namespaced_role_binding(name, namespace)}[doc["kind"]]
    _unless(404, delete)


def token_kubeconfig(kubeconfig: Path, token: str, path: Path) -> Path:
    """``kubeconfig`` with its current user's credentials replaced by ``token``."""
    doc = yaml.safe_load(kubeconfig.read_text())
    context = next(c for c in doc["contexts"] if c["name"] == doc["current-context"])["context"]
    for user in doc["users"]:
        if user["name"] == context["user"]:
            user["user"] = {"token": token}
    path.write_text(yaml.safe_dump(doc))
    return path


def account_token(api: client.ApiClient, namespace: str, account: str, seconds: int = 7200) -> str:
    """A token for ServiceAccount ``namespace/account`` (the TokenRequest API, as a
    kubelet asks for a pod's)."""
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
        audiences=[], expiration_seconds=seconds))
    return str(client.CoreV1Api(api).create_namespaced_service_account_token(account, namespace, request).status.token)


#: ``ALPAJOB_E2E_RBAC=namespaced`` runs the e2e's operator with the namespaced install's
#: RBAC (``manifests/rbac-namespaced.yaml``, bound in the test's namespace only).
E2E_RBAC = "ALPAJOB_E2E_RBAC"


def operator_kubeconfig(cluster: Any, root: Path, namespace: str | None = None, base: Path | None = None) -> Path:
    """A kubeconfig as the operator's ServiceAccount, with exactly the shipped RBAC
    (``manifests/rbac.yaml`` applied; with ``$ALPAJOB_E2E_RBAC=namespaced``,
    ``manifests/rbac-namespaced.yaml`` with its RoleBinding in ``namespace``): the e2e's
    operator runs with it, so a verb missing from its roles fails there as it would on
    a real cluster. ``base``: the kubeconfig whose server it reaches (default the
    cluster's; a gated one for an outage)."""
    api = cluster.api()
    cluster.ensure_namespace(OPERATOR_NAMESPACE)
    if os.environ.get(E2E_RBAC) == "namespaced" and namespace is not None:
        cluster.ensure_namespace(namespace)
        docs = shipped_rbac("rbac-namespaced.yaml")
        for doc in docs:
            if doc["kind"] == "RoleBinding":
                doc["metadata"]["namespace"] = namespace
        apply_documents(api, docs)
    else:
        apply_documents(api, shipped_rbac("rbac.yaml"))
    token = account_token(api, OPERATOR_NAMESPACE, OPERATOR_ACCOUNT)
    return token_kubeconfig(base or cluster.kubeconfig, token, root / "operator-kubeconfig")


def unique_namespace(prefix: str) -> str:
    """A namespace name no test used before: ``<prefix>-<6 hex digits>``."""
    import uuid

    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def emulator_only(cluster: Any, why: str) -> None:
    """Skip a test that reads the emulator's own records on a real cluster."""
    if isinstance(cluster, RealCluster):
        pytest.skip(f"reads the test API server's records ({why}); not available on a real cluster")


def _unless(status: int, call: Any, *args: Any) -> bool:
    """``call(*args)``; False instead of the API's error ``status`` (409: it exists
    already, 404: it is gone), which is then no failure."""
    try:
        call(*args)
    except client.ApiException as error:
        if error.status != status:
            raise
        return False
    return True


class RealCluster:
    """A real Kubernetes API, used the way the tests use the emulator."""

    real = True

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.nodes: list[str] = []
        self.namespaces: list[str] = []
        self.restricted: set[str] = set()
        self.volumes: list[str] = []

    def api(self) -> client.ApiClient:
        return config.new_client_from_config(str(self.kubeconfig))

    def ensure_namespace(self, namespace: str) -> None:
        """``namespace``, made if missing (and then removed by :meth:`stop`)."""
        core = client.CoreV1Api(self.api())
        if _unless(409, core.create_namespace, {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": namespace}}):
            self.namespaces.append(namespace)

    def start(self) -> RealCluster:
        """Apply the CRD (manifests/crd.yaml) and wait until it is served."""
        extensions = client.ApiextensionsV1Api(self.api())
        crd = yaml.safe_load((ROOT / "manifests" / "crd.yaml").read_text())
        name = crd["metadata"]["name"]
        try:
            current = extensions.read_custom_resource_definition(name)
            crd["metadata"]["resourceVersion"] = current.metadata.resource_version
            extensions.replace_custom_resource_definition(name, crd)
        except client.ApiException as error:
            if error.status != 404:
                raise
            extensions.create_custom_resource_definition(crd)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            conditions = extensions.read_custom_resource_definition(name).status.conditions or []
            if any(c.type == "Established" and c.status == "True" for c in conditions):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"CRD {name} not Established after 60 s")

    def cluster_of(self, namespace: str, nodes: int, gpus: int = 8) -> None:
        """As :meth:`kube_emulator.Emulator.cluster_of`: ``namespace`` enforcing Pod Security
        "restricted" (the jobs' identities are the operator's to make), and ``nodes`` fake Ready nodes
        ``node-<i>`` offering ``gpus`` GPUs (a test kubelet must keep them alive)."""
        from alpajob.api.names import GPU_RESOURCE

        core = client.CoreV1Api(self.api())
        labels = {"pod-security.kubernetes.io/enforce": "restricted"}
        if _unless(409, core.create_namespace, {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": namespace, "labels": labels}}):
            self.namespaces.append(namespace)
        else:
            core.patch_namespace(namespace, {"metadata": {"labels": labels}})
        self.restricted.add(namespace)
        for i in range(nodes):
            name = f"node-{i}"
            capacity = {GPU_RESOURCE: str(gpus), "cpu": "64", "memory": "512Gi", "pods": "110"}
            _unless(409, core.create_node, {"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": name, "labels": {"kubernetes.io/hostname": name, "alpajob.io/e2e": "fake"}}})
            core.patch_node_status(name, {"status": {"capacity": capacity, "allocatable": capacity,
                                                     "conditions": [{"type": "Ready", "status": "True",
                                                                     "reason": "KubeletReady"}]}})
            self.nodes.append(name)

    def release(self, namespace: str, timeout: float = 300.0) -> None:
        """Delete ``namespace`` and wait until it is gone: a real namespace deletion takes
        time (its content is deleted first; creations meanwhile are refused with 403
        NamespaceTerminating). The jobs' finalizers are released first (the operator
        that would release them may be stopped already)."""
        from alpajob.api.names import GROUP, PLURAL, VERSION

        api = self.api()
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        for job in custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]:
            _unless(404, custom.patch_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                    job["metadata"]["name"], {"metadata": {"finalizers": None}})
        _unless(404, core.delete_namespace, namespace)
        deadline = time.monotonic() + timeout
        while _unless(404, core.read_namespace, namespace):
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace {namespace} not gone after {timeout:.0f} s")
            time.sleep(1.0)
        if namespace in self.namespaces:
            self.namespaces.remove(namespace)

    def claim(self, namespace: str, name: str) -> None:
        """A ReadWriteMany PersistentVolumeClaim ``name``, bound to a volume made for it
        (the test kubelet gives every pod that mounts it one shared folder)."""
        core = client.CoreV1Api(self.api())
        volume = f"alpajob-e2e-{namespace}-{name}"
        core.create_persistent_volume({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
                                       "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                                                "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "",
                                                "hostPath": {"path": f"/tmp/{volume}"}}})
        core.create_namespaced_persistent_volume_claim(namespace, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": namespace},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume,
                     "resources": {"requests": {"storage": "1Gi"}}}})
        self.volumes.append(volume)

    def stop(self) -> None:
        """Remove what :meth:`cluster_of` made: the jobs first (their finalizers
        released, the operator being gone), then the namespaces and the fake nodes."""
        api = self.api()
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        from alpajob.api.names import GROUP, PLURAL, VERSION

        for namespace in self.namespaces:
            for job in custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]:
                name = job["metadata"]["name"]
                custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                      {"metadata": {"finalizers": None}})
            core.delete_namespace(namespace)
        for node in self.nodes:
            _unless(404, core.delete_node, node)
        for volume in self.volumes:
            _unless(404, core.delete_persistent_volume, volume)
