"""KMock's Kubernetes emulator on a background thread, for tests that run the real
operator process against it.

The emulator serves HTTP on a free local port from its own event loop, so the test
(and the operator subprocess, through a kubeconfig file) use it like an API server.
Known gaps of kmock 0.8 are worked around here, never in the operator: the AlpaJob
resource is declared (kmock learns a custom resource's kind only that way), objects
created by the test carry the uid and generation an API server would set, and label
selectors are ignored by kmock (the operator filters by label itself), and the core
resources the operator and kopf use are declared up front (kopf waits for
namespaces to be discoverable). kmock cannot list namespaces, so the operator runs
with ``--no-scanning`` (only the namespaces named).

Pod creation is admitted as a real API server admits it (:meth:`Emulator._admit_pod`,
with the messages in ``data/apiserver-observed``): a pod whose ServiceAccount does not
exist is refused with 403 (``default`` always exists, as the ServiceAccount controller
makes it), and so is a pod that breaks Pod Security "restricted" in a namespace of
:attr:`Emulator.restricted` (kmock cannot store namespaces, so their
``pod-security.kubernetes.io/enforce=restricted`` label is kept here). Every AlpaJob
written (created, patched or replaced, status included) is pruned by the CRD's
structural schema, as the API server prunes it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kmock
import yaml
from kubernetes import client


class Emulator:
    """A running KubernetesEmulator; ``url``, ``kubeconfig`` and a configured client."""

    def __init__(self, root: Path, keep_history: bool = True) -> None:
        """``keep_history=False``: forget served requests (kmock matches every new
        request against its whole history, so a long run slows down quadratically;
        benchmarks turn it off, tests that count requests keep it)."""
        self.root = root
        self.keep_history = keep_history
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.kmock: Any = None
        self.url = ""
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self.restricted: set[str] = set()  # namespaces labelled enforce=restricted
        self._schema: dict[str, Any] | None = None
        #: Requests served, by method and what they addressed (``_kind``); counted
        #: twice a second, so read it after a pause.
        self.served: collections.Counter[tuple[str, str]] = collections.Counter()
        self._counted = 0

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources["alpajob.io/v1alpha1/alpajobs"] = kmock.ResourceInfo(
                kind="AlpaJob", singular="alpajob", namespaced=True, shortnames={"aj"},
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                subresources={"status"})
            for key, kind, namespaced in [("v1/pods", "Pod", True), ("v1/configmaps", "ConfigMap", True),
                                          ("v1/serviceaccounts", "ServiceAccount", True),
                                          ("v1/services", "Service", True), ("v1/events", "Event", True),
                                          ("v1/nodes", "Node", False), ("v1/namespaces", "Namespace", False),
                                          ("apiextensions.k8s.io/v1/customresourcedefinitions",
                                           "CustomResourceDefinition", False)]:
                emulator.resources[key] = kmock.ResourceInfo(
                    kind=kind, namespaced=namespaced, subresources={"status"},
                    verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
            emulator[kmock.method.POST, kmock.resource("v1", "pods")] << self._admit_pod
            for verb in (kmock.method.POST, kmock.method.PUT, kmock.method.PATCH):
                emulator[verb, kmock.resource("alpajob.io", "v1alpha1", "alpajobs")] << self._prune_job
            self.kmock = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            while not self._stop.is_set():
                log = emulator._requests  # kmock internals: its request log
                for request in log[self._counted:]:
                    self.served[request.method.upper(), _kind(str(request.url))] += 1
                if not self.keep_history:
                    del log[:-16]
                self._counted = len(log)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.5)

    def _admit_pod(self, request: Any) -> Any:
        """403 for a pod a real API server refuses (module docstring). An admitted pod
        raises ``NotImplementedError``: kmock then answers with its emulator's reaction
        and keeps this one for the next request (returning ``NotImplemented`` would
        retire it)."""
        pod = request.data if isinstance(request.data, dict) else {}
        parts = str(request.url).split("?")[0].split("/")
        namespace = parts[parts.index("namespaces") + 1] if "namespaces" in parts else "default"
        name = (pod.get("metadata") or {}).get("name", "")
        account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
        refusal = self._refusal(namespace, name, account, pod)
        if refusal is None:
            raise NotImplementedError
        # kmock has stored the pod before its reactions run: take it back out.
        with contextlib.suppress(KeyError):
            del self.kmock.objects[kmock.resource("v1", "pods"), namespace, name]
        return _forbidden(refusal)

    def _refusal(self, namespace: str, name: str, account: str, pod: dict[str, Any]) -> str | None:
        """The API server's message refusing ``pod``, or None if it is admitted."""
        from pod_security import restricted_violations

        if account != "default" and (kmock.resource("v1", "serviceaccounts"), namespace, account) not in self.kmock.objects:
            return (f'pods "{name}" is forbidden: error looking up service account '
                    f'{namespace}/{account}: serviceaccount "{account}" not found')
        problems = restricted_violations(pod) if namespace in self.restricted else []
        if problems:
            return f'pods "{name}" is forbidden: violates PodSecurity "restricted:latest": ' + ", ".join(problems)
        return None

    def _prune_job(self, request: Any) -> Any:
        """Prune the AlpaJob just written (its status too) by the CRD's structural
        schema, as the API server does, and answer with what is kept. kmock has
        stored the object before its reactions run, so the pruned one replaces it;
        when nothing was pruned, kmock's own answer stands (``NotImplementedError``)."""
        from kube_schema import prune

        parts = str(request.url).split("?")[0].split("/")
        if "namespaces" not in parts:
            raise NotImplementedError
        namespace = parts[parts.index("namespaces") + 1]
        if len(parts) > parts.index("alpajobs") + 1:
            name = parts[parts.index("alpajobs") + 1]
        elif isinstance(request.data, Mapping):  # a create: the name is in the body
            name = (request.data.get("metadata") or {}).get("name")
        else:
            raise NotImplementedError
        key = (kmock.resource("alpajob.io", "v1alpha1", "alpajobs"), namespace, name)
        try:
            stored = _plain(self.kmock.objects[key])
        except KeyError:
            raise NotImplementedError from None
        root = self.schema["properties"]
        kept = {k: prune(v, root[k]) if k in ("spec", "status") and k in root else v for k, v in stored.items()}
        if kept == stored:
            raise NotImplementedError
        self.kmock.objects[key] = kept
        return kmock.Response(status=201 if request.method.upper() == "POST" else 200, payload=kept)

    @property
    def schema(self) -> dict[str, Any]:
        """The AlpaJob CRD's openAPIV3Schema (manifests/crd.yaml)."""
        if self._schema is None:
            crd = yaml.safe_load((Path(__file__).resolve().parent.parent / "manifests" / "crd.yaml").read_text())
            self._schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        return self._schema

    def cluster_of(self, namespace: str, nodes: int, gpus: int = 8) -> None:
        """What the chart and the nodes give a real cluster: ``namespace`` enforcing Pod
        Security "restricted", with the trainer's ServiceAccount, and ``nodes`` Ready
        nodes ``node-<i>`` of ``gpus`` allocatable GPUs."""
        from alpajob.api.names import GPU_RESOURCE

        self.restricted.add(namespace)
        core = client.CoreV1Api(self.api())
        core.create_namespaced_service_account(namespace, {
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "alpajob-trainer", "namespace": namespace}})
        for i in range(nodes):
            core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": f"node-{i}", "labels": {"kubernetes.io/hostname": f"node-{i}"}},
                "status": {"allocatable": {GPU_RESOURCE: str(gpus)},
                           "conditions": [{"type": "Ready", "status": "True"}]}})

    def start(self) -> Emulator:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("kmock did not start")
        self.kubeconfig = self.root / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "test"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        }))
        return self

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def api(self) -> client.ApiClient:
        config = client.Configuration()
        config.host = self.url
        return client.ApiClient(config)

    def requests(self, method: str, path_part: str) -> int:
        """How many ``method`` requests whose path contains ``path_part`` were served."""
        return sum(1 for r in list(self.kmock) if r.method.upper() == method.upper() and path_part in str(r.url))


def _forbidden(message: str) -> Any:
    """The API server's 403 ``Status`` for a refused pod."""
    return kmock.Response(status=403, payload={
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
        "reason": "Forbidden", "details": {"kind": "pods"}, "code": 403})


def _plain(value: Any) -> Any:
    """kmock's stored object (its mappings are its own types) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _kind(url: str) -> str:
    """What a request addressed: ``alpajobs``, ``alpajobs/status``, ``pods (list)``, ...
    (the resource after the API group and version and the namespace; a subresource
    after the name; ``(list)`` when there is no name)."""
    from urllib.parse import urlparse

    path = urlparse(url).path.strip("/").split("/")
    rest = path[2:] if path[:1] == ["api"] else path[3:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    if not rest:
        return "discovery"
    if len(rest) == 1:
        return f"{rest[0]} (list)"
    return f"{rest[0]}/{rest[2]}" if len(rest) > 2 else rest[0]
