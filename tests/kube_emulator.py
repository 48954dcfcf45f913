"""KMock's Kubernetes emulator on a background thread, for tests that run the real
operator process against it.

The emulator serves HTTP on a free local port from its own event loop, so the test
(and the operator subprocess, through a kubeconfig file) use it like an API server.
Known gaps of kmock 0.8 are worked around here, never in the operator: the AlpaJob
resource is declared (kmock learns a custom resource's kind only that way), objects
get the uid and generation an API server would set, and label
selectors are ignored by kmock (the operator filters by label itself), and the core
resources the operator and kopf use are declared up front (kopf waits for
namespaces to be discoverable). kmock cannot list namespaces, so the operator runs
with ``--no-scanning`` (only the namespaces named).

Writes pass an admission step in front of kmock's storage (:class:`_Admitting`), as
they do in a real API server, so a refused write is never stored nor announced to
watchers, and watchers see only what was kept (with the messages in
``data/apiserver-observed``): a pod whose ServiceAccount does not exist is refused
with 403 (``default`` always exists, as the ServiceAccount controller makes it), and
so is a pod that breaks Pod Security "restricted" in a namespace of
:attr:`Emulator.restricted`. kmock cannot store namespaces, so they live here
(:attr:`Emulator.namespaces`, with their ``enforce=restricted`` label): a creation in
a namespace that does not exist is refused with 404, and one in a namespace being
deleted with 403 ``NamespaceTerminating``; a namespace deletion takes
``namespace_seconds``, then everything in it goes, as on a real API server. Every AlpaJob
written (created, patched or replaced, status included) is pruned by the CRD's
structural schema, as the API server prunes it. A Secret's ``stringData`` is stored
as ``data`` (base64), as the API server stores it. A pod's ``log`` (from :attr:`Emulator.pod_logs`, e.g. the
test kubelet's files; ``follow`` streams it until the pod ends) and its ``proxy`` (to
its ``podIP``) are served as the API server serves them from the node.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal.k8s import KubernetesError  # kmock's API-error response
from kubernetes import client
from rbac import ADMIN_TOKEN, Ask, Tokens, allowed, escalation, forbidden_message, verb_of


@attrs.define(kw_only=True)
class _Admitting(kmock.KubernetesEmulator):
    """kmock's emulator made closer to the API server where the operator relies on it.

    - **Admission before storage**: ``admit(request)`` may change the request's body
      in place (pruning) or return the error to answer instead; a refused write is
      never stored nor announced to watchers.
    - A creation is answered ``201 Created`` (kmock says 200, and the kubernetes
      client then returns None for a custom object), and the server sets the new
      object's ``uid``, ``generation`` and ``creationTimestamp`` (a client's
      ``resourceVersion`` is refused); an update that changes ``spec`` adds one to
      ``generation``. A JSON patch whose ``test`` fails is answered 422, as the
      API server answers it (kmock says 500, which kopf retries with the stale patch).
    - **Resource versions**: every write stamps the object with the next version; a
      list answers the current one; a watch that continues from a version (as kopf's
      does when a watch times out and reconnects) is sent only what changed since,
      then the live events. kmock sends every object again as ADDED on every watch,
      so a watcher sees a burst of changes that never happened each time it
      reconnects. A deletion gets a version too, and a continued watch is sent the
      deletions since its version, as the API server's watch cache sends them.
    - **Updates are conditional**, as on kube-apiserver: a PUT must carry the
      ``resourceVersion`` it replaces (422 without one, 409 when another write came
      first) and replaces the object whole; a merge patch that names a version is
      refused with 409 when it is not the current one. (kmock serves no PUT at all.)
    """

    admit: Any = None
    authorize: Any = None  # who may do what (``Emulator._authorize``): the error to answer, or None
    access_review: Any = None  # a SubjectAccessReview's answer (``Emulator._access_review``)
    graceful_pods: bool = False  # a kubelet confirms pod deletions (module docstring of Emulator)
    pod_logs: Any = None  # (namespace, pod) -> the file holding its log, or None (``pods/log``)
    version: int = 0  # the last resource version given
    deletions: list[tuple[int, Any, dict[str, Any]]] = attrs.field(factory=list)  # version, resource, last state
    tokens: Tokens = attrs.field(factory=Tokens)  # who each bearer token is (:mod:`rbac`)
    sent: collections.Counter[str] = attrs.field(factory=collections.Counter)  # list and watch bytes, by kind

    async def _handle(self, request: Any) -> Any:
        denied = self.authorize(request) if self.authorize is not None else None
        if denied is not None:
            return await self._render_error(denied)
        if request.method == kmock.method.GET and request.resource is not None and request.resource.plural == "pods" \
                and request.resource.group == "" and request.name and request.subresource:
            if request.subresource == "log":
                return await self._pod_log(request)
            if request.subresource.split("/")[0] == "proxy":
                return await self._pod_proxy(request)
        if request.subresource == "token" and request.method == kmock.method.POST and request.resource is not None \
                and request.resource.plural == "serviceaccounts":
            return await self._token_request(request)
        if request.resource is not None and request.resource.plural == "subjectaccessreviews" \
                and request.method == kmock.method.POST and self.access_review is not None:
            return aiohttp.web.json_response(self.access_review(request.data or {}), status=201)
        refusal = await self.admit(request) if self.admit is not None and request.resource is not None else None
        if refusal is not None:
            return await self._render_error(refusal)
        if request.method == kmock.method.PUT and request.name is not None and isinstance(request.data, dict):
            return await self._replace(request)
        if request.action == kmock.action.UPDATE and isinstance(request.data, dict):
            stale = self._stale(request, (request.data.get("metadata") or {}).get("resourceVersion"))
            if stale is not None:  # a merge patch that names a version is conditional on it
                return await self._render_error(stale)
        if request.action == kmock.action.DELETE and request.name is not None \
                and request.resource.plural == "pods" and request.resource.group == "":
            if self.graceful_pods:
                await self._graceful_delete(request)
            await self._finalized_delete(request)
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE) and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.action == kmock.action.CREATE:
                if meta.get("resourceVersion"):
                    return await self._render_error(KubernetesError(
                        status=500, reason="InternalError",
                        message="resourceVersion should not be set on objects to be created"))
                meta.update(uid=str(uuid.uuid4()), generation=1,
                            creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            elif request.subresource is None and "spec" in request.data:
                meta["generation"] = self._generation(request)
            self.version += 1
            meta["resourceVersion"] = str(self.version)
        key = (request.resource, request.namespace, request.name)
        if request.action == kmock.action.UPDATE and isinstance(request.data, list):  # a JSON patch
            failed = self._failed_test(key, request.data)
            if failed is not None:
                return await self._render_error(KubernetesError(
                    status=422, reason="Invalid",
                    message=f"the server rejected our request due to an error in our request: {failed}"))
            self.version += 1
            request.data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": str(self.version)})
        existed = request.name is not None and key in self._objects and not self._objects[key].deleted
        before = _plain(self._objects[key].raw) if existed else None
        response = await super()._handle(request)
        if request.action == kmock.action.CREATE and response.status == 200 and not response.prepared:
            response.set_status(201)
        if existed and self._objects[key].deleted:  # a delete, or the last finalizer removed
            self.version += 1
            before["metadata"]["resourceVersion"] = str(self.version)
            self.deletions = [*self.deletions[-9999:], (self.version, request.resource, before)]
        return response

    def _pod(self, namespace: str | None, name: str) -> dict[str, Any] | None:
        for (resource, ns, key), obj in list(self._objects.items()):
            if resource.plural == "pods" and resource.group == "" and ns == namespace and key == name \
                    and not obj.deleted:
                return dict(obj.raw)
        return None

    async def _pod_log(self, request: Any) -> Any:
        """``pods/log``, as the API server serves it from the pod's kubelet: the whole log
        (``tailLines``: its end), or with ``follow=true`` a stream of what the pod writes
        until it ends. The text comes from :attr:`pod_logs` (the test kubelet's files)."""
        pod = self._pod(request.namespace, request.name)
        if pod is None:
            return await self._render_error(KubernetesError(
                status=404, reason="NotFound", message=f'pods "{request.name}" not found'))
        path = self.pod_logs(request.namespace, request.name) if self.pod_logs is not None else None
        if path is None or not Path(path).exists():
            container = ((pod.get("spec") or {}).get("containers") or [{}])[0].get("name", "")
            return await self._render_error(KubernetesError(status=400, reason="BadRequest", message=(
                f'container "{container}" in pod "{request.name}" is waiting to start: ContainerCreating')))
        text = Path(path).read_bytes()
        tail = request.params.get("tailLines")
        if tail is not None:
            text = b"".join(text.splitlines(keepends=True)[-int(tail):]) if int(tail) > 0 else b""
        if request.params.get("follow") != "true":
            return aiohttp.web.Response(body=text, content_type="text/plain")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request._raw_request)
        await response.write(text)
        offset = Path(path).stat().st_size
        while True:
            await asyncio.sleep(0.2)
            size = Path(path).stat().st_size
            if size > offset:
                with open(path, "rb") as file:
                    file.seek(offset)
                    await response.write(file.read(size - offset))
                offset = size
                continue
            now = self._pod(request.namespace, request.name)
            if now is None or ((now.get("status") or {}).get("phase")) in ("Succeeded", "Failed"):
                break
        await response.write_eof()
        return response

    async def _pod_proxy(self, request: Any) -> Any:
        """``pods/<name>:<port>/proxy/<path>``: the API server's proxy to the pod's IP (the
        test kubelet's pods all have 127.0.0.1), answered with what the pod answered."""
        name, _, port = request.name.partition(":")
        pod = self._pod(request.namespace, name)
        ip = ((pod or {}).get("status") or {}).get("podIP")
        if pod is None or not ip:
            return await self._render_error(KubernetesError(
                status=404 if pod is None else 503, reason="NotFound" if pod is None else "ServiceUnavailable",
                message=f'pods "{name}" not found' if pod is None else f'pod "{name}" has no IP yet'))
        rest = request.subresource.split("/", 1)[1] if "/" in request.subresource else ""
        try:
            async with aiohttp.ClientSession() as session, \
                    session.get(f"http://{ip}:{port or 80}/{rest}", params=request.params) as answer:
                body = await answer.read()
                return aiohttp.web.Response(body=body, status=answer.status,
                                            content_type=answer.content_type or "text/plain")
        except aiohttp.ClientError as error:
            return await self._render_error(KubernetesError(status=503, reason="ServiceUnavailable", message=(
                f"error trying to reach service: {error}")))

    async def _replace(self, request: Any) -> Any:
        """An update (PUT) as the API server answers it: the object must exist (404),
        name the version it replaces (422 without one: "must be specified for an
        update"), and that version must be the current one (409: someone wrote since).
        The body replaces the stored object whole, but for what the server owns (uid,
        creationTimestamp; generation, one more when ``spec`` changes), and watchers are
        told MODIFIED."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return await self._render_error(KubernetesError(
                status=404, reason="NotFound", message=f'{request.resource.plural} "{request.name}" not found',
                details={"name": request.name, "kind": request.resource.plural}))
        body = request.data
        meta = body.setdefault("metadata", {})
        if not meta.get("resourceVersion"):
            return await self._render_error(KubernetesError(
                status=422, reason="Invalid",
                message=(f'{request.resource.plural} "{request.name}" is invalid: metadata.resourceVersion: '
                         "Invalid value: 0x0: must be specified for an update"),
                details={"name": request.name, "kind": request.resource.plural, "causes": [{
                    "reason": "FieldValueInvalid", "field": "metadata.resourceVersion",
                    "message": "Invalid value: 0x0: must be specified for an update"}]}))
        stale = self._stale(request, meta["resourceVersion"])
        if stale is not None:
            return await self._render_error(stale)
        async with self._lock:
            stored = self._objects[key].raw
            kept = stored.get("metadata", {})
            generation = int(kept.get("generation") or 1)
            if request.subresource is None and body.get("spec") != stored.get("spec"):
                generation += 1
            self.version += 1
            meta.update(uid=kept.get("uid"), creationTimestamp=kept.get("creationTimestamp"),
                        generation=generation, resourceVersion=str(self.version))
            self._objects[key].create(body)  # a new version of the whole object
            raw = self._objects[key].raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(raw)

    def _stale(self, request: Any, version: Any) -> KubernetesError | None:
        """409 Conflict when ``version`` is given and is not the stored object's."""
        key = (request.resource, request.namespace, request.name)
        if not version or key not in self._objects or self._objects[key].deleted:
            return None
        current = self._objects[key].raw.get("metadata", {}).get("resourceVersion")
        if str(version) == str(current):
            return None
        kind = request.resource.plural if not request.resource.group else \
            f"{request.resource.plural}.{request.resource.group}"
        return KubernetesError(
            status=409, reason="Conflict",
            message=(f'Operation cannot be fulfilled on {kind} "{request.name}": the object has been modified; '
                     "please apply your changes to the latest version and try again"),
            details={"name": request.name, "kind": request.resource.plural})

    async def _graceful_delete(self, request: Any) -> None:
        """A pod's deletion as the API server does it once a kubelet runs the pod: a
        DELETE with a grace period only marks it (``deletionTimestamp`` = now + grace,
        ``deletionGracePeriodSeconds``); the pod stays, terminating, until its kubelet
        (or a force delete) sends a DELETE with grace period 0. A pod no kubelet
        started, or one that finished, goes at once. (kmock keeps an object marked for
        deletion while it has finalizers, so one is held for the kubelet meanwhile.)"""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return
        stored = self._objects[key].raw
        meta, status = stored.get("metadata", {}), stored.get("status") or {}
        options = request.data if isinstance(request.data, dict) else {}
        grace = options.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
        if grace is None:
            grace = (stored.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        grace = int(grace)
        if meta.get("deletionTimestamp"):
            if grace == 0:  # the kubelet's confirmation, or a force delete: now it goes
                async with self._lock:
                    self._objects[key].patch({"metadata": {"finalizers": [
                        f for f in meta.get("finalizers", []) if f != KUBELET_FINALIZER]}})
            return
        started = status.get("phase") == "Running" or bool(status.get("hostIP"))
        if grace == 0 or not started or status.get("phase") in ("Succeeded", "Failed"):
            return
        due = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + grace))
        self.version += 1
        async with self._lock:
            self._objects[key].patch({"metadata": {
                "deletionTimestamp": due, "deletionGracePeriodSeconds": grace, "resourceVersion": str(self.version),
                "finalizers": [*meta.get("finalizers", []), KUBELET_FINALIZER]}})
            await self._buses[request.resource].put({"type": "MODIFIED", "object": self._objects[key].raw})

    async def _finalized_delete(self, request: Any) -> None:
        """A pod's deletion that only finalizers hold (Kueue's, on the pods it
        manages), as the API server records it: ``deletionTimestamp`` now (RFC 3339)
        and ``deletionGracePeriodSeconds`` 0 once no kubelet has to confirm (none runs
        it, or it confirmed: :meth:`_graceful_delete`), or a force delete asked it;
        the pod stays until its last finalizer goes."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return
        meta = self._objects[key].raw.get("metadata", {})
        others = [f for f in meta.get("finalizers", []) if f != KUBELET_FINALIZER]
        if not others or KUBELET_FINALIZER in meta.get("finalizers", []):
            return  # nothing holds it but a kubelet (or nothing at all: kmock deletes it)
        options = request.data if isinstance(request.data, dict) else {}
        grace = options.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
        if meta.get("deletionTimestamp") and (grace is None or int(grace) != 0):
            return
        if meta.get("deletionGracePeriodSeconds") == 0:
            return
        self.version += 1
        async with self._lock:
            self._objects[key].patch({"metadata": {
                "deletionTimestamp": meta.get("deletionTimestamp") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "deletionGracePeriodSeconds": 0, "resourceVersion": str(self.version)}})
            await self._buses[request.resource].put({"type": "MODIFIED", "object": self._objects[key].raw})

    def _failed_test(self, key: Any, ops: list[Any]) -> str | None:
        """The first ``test`` operation of a JSON patch that the stored object fails,
        as the API server says it (it answers 422, and kopf, testing the resource
        version, then waits for the newer object instead of retrying)."""
        if key not in self._objects or self._objects[key].deleted:
            return None
        stored = self._objects[key].raw
        for op in ops:
            if not isinstance(op, dict) or op.get("op") != "test":
                continue
            value: Any = stored
            for part in str(op.get("path", "")).split("/")[1:]:
                value = value.get(part) if isinstance(value, dict) else None
            if value != op.get("value"):
                return f"testing value {op.get('path')} failed"
        return None

    def _generation(self, request: Any) -> int:
        """The generation after an update of ``spec``: one more when it changes it."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return 1
        stored = self._objects[key].raw
        old = stored.get("metadata", {}).get("generation") or 1
        changed = any(stored.get("spec", {}).get(k) != v for k, v in (request.data.get("spec") or {}).items())
        return int(old) + (1 if changed else 0)

    async def _token_request(self, request: Any) -> Any:
        """The TokenRequest API: a token for an existing ServiceAccount (404 otherwise),
        which this server then authenticates as that account (:mod:`rbac`)."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return await self._render_error(KubernetesError(
                status=404, reason="NotFound", message=f'serviceaccounts "{request.name}" not found',
                details={"name": request.name, "kind": "serviceaccounts"}))
        token = self.tokens.issue(request.namespace, request.name)
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "metadata": {"name": request.name, "namespace": request.namespace},
                "spec": (request.data or {}).get("spec") or {},
                "status": {"token": token, "expirationTimestamp": expires}}
        return aiohttp.web.json_response(body, status=201)

    async def _serve_list(self, request: Any) -> Any:
        listed = await super()._serve_list(request)
        listed["metadata"]["resourceVersion"] = str(self.version)
        selector = label_selector(request.params.get("labelSelector"))
        listed["items"] = [item for item in listed["items"] if selector(item)]
        self.sent[_kind(str(request.url))] += len(json.dumps(listed))
        return listed

    async def _serve_watch(self, request: Any) -> Any:
        """A watch, sent only what matches its ``labelSelector`` (as the API server
        filters it; kmock ignores selectors), with the bytes sent counted by kind."""
        selector = label_selector(request.params.get("labelSelector"))
        kind = _kind(str(request.url))
        async for event in self._watch_events(request):
            if isinstance(event, dict):
                if not selector(event.get("object") or {}):
                    continue
                self.sent[kind] += len(json.dumps(event))
            yield event

    async def _watch_events(self, request: Any) -> Any:
        """The events of a watch: from the start (no ``resourceVersion``) every object as
        ADDED, else every change after that version; then each change as it is made.
        The bus position is taken under the same lock as the snapshot, so a write made
        while the snapshot is sent is streamed after it, never lost (as kmock's own
        watch, which subscribes after sending the snapshot, may lose it)."""
        since = _version(request.params.get("resourceVersion"))
        yield b""  # the headers: the stream is open
        objects = self._KubernetesEmulator__get_objs  # kmock's own selection of the request's objects
        matches = self._KubernetesEmulator__check
        bus = self._buses[request.resource]
        async with self._lock:
            position = await bus.mark()
            current = [obj.raw for obj in objects(request, strict=False) if not obj.deleted]
        if since is None:
            changed = [{"type": "ADDED", "object": raw} for raw in current]
        else:
            changed = [{"type": "MODIFIED", "object": raw} for raw in current
                       if (_version(raw.get("metadata", {}).get("resourceVersion")) or 0) > since]
            changed += [{"type": "DELETED", "object": last} for version, resource, last in list(self.deletions)
                        if version > since and resource == request.resource
                        and matches(request, resource, last["metadata"].get("namespace"),
                                    last["metadata"].get("name"), strict=False)]
        for event in changed:
            yield event
        async for event in position:
            meta = event.get("object", {}).get("metadata", {})
            if matches(request, request.resource, meta.get("namespace"), meta.get("name"), strict=False):
                yield event


RBAC = "rbac.authorization.k8s.io"

#: A namespace's states (``Emulator.namespaces``).
ACTIVE, TERMINATING = "Active", "Terminating"

#: Held on a pod marked for deletion until its kubelet confirms it (``_graceful_delete``).
KUBELET_FINALIZER = "kmock.test/kubelet"


_REQUIREMENT = re.compile(r"\s*(!?)\s*([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*")


def label_selector(text: str | None) -> Any:
    """A predicate on objects for a label selector as the API server reads it
    (``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``,
    ``key in (a,b)``, ``key notin (a,b)``, joined by commas: all must hold)."""
    checks = []
    rest = (text or "").strip()
    while rest:
        found = _REQUIREMENT.match(rest)
        if found is None or found.end() == 0:
            raise ValueError(f"unable to parse requirement: {rest!r}")
        negated, key, op, value, set_op, values = found.groups()
        checks.append((negated, key, op, value, set_op, {v.strip() for v in (values or "").split(",") if v.strip()}))
        rest = rest[found.end():].lstrip(",")

    def matches(obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for negated, key, op, value, set_op, values in checks:
            has = key in labels
            ok = (not has if negated else has) if op is None and set_op is None else \
                (labels.get(key) == value if op in ("=", "==") else
                 labels.get(key) != value if op == "!=" else
                 has and labels[key] in values if set_op == "in" else labels.get(key) not in values)
            if not ok:
                return False
        return True

    return matches


def _version(text: str | None) -> int | None:
    """A resource version as a number (None: absent, or not one this server gave)."""
    return int(text) if text and text.isdigit() and text != "0" else None


class Emulator:
    """A running KubernetesEmulator; ``url``, ``kubeconfig`` and a configured client."""

    def __init__(self, root: Path, keep_history: bool = True, graceful_pods: bool = False) -> None:
        """``keep_history=False``: forget served requests (kmock matches every new
        request against its whole history, so a long run slows down quadratically;
        benchmarks turn it off, tests that count requests keep it).
        ``graceful_pods=True``: pod deletions wait for a kubelet's confirmation, as on a
        real cluster (for tests that run a kubelet, ``kubelet.Kubelet``)."""
        self.root = root
        self.keep_history = keep_history
        self.graceful_pods = graceful_pods
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.kmock: Any = None
        self.url = ""
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self.restricted: set[str] = set()  # namespaces labelled enforce=restricted
        #: The namespaces that exist (kmock cannot store them), each ACTIVE or
        #: TERMINATING; the ones every cluster has are there from the start.
        self.namespaces: dict[str, str] = {n: ACTIVE for n in ("default", "kube-system", "kube-public",
                                                               "kube-node-lease")}
        self.namespace_seconds = 3.0  # how long a namespace deletion takes
        #: The URL of a validating webhook for AlpaJob creates and updates (plain HTTP),
        #: called as the API server calls it: with the whole new object and the old one.
        self.webhook: str | None = None
        self._schema: dict[str, Any] | None = None
        #: Requests served, by method and what they addressed (``_kind``); counted
        #: twice a second, so read it after a pause.
        self.served: collections.Counter[tuple[str, str]] = collections.Counter()
        self._counted = 0
        #: Every request that RBAC refused, as its 403 message (:mod:`rbac`).
        self.forbidden: list[str] = []
        #: ``(namespace, pod) -> Path | None``: where a pod's log is (the test kubelet's
        #: ``log.txt``), for ``pods/log``; None: no pod has a log.
        self.pod_logs: Any = None
        #: Mutating admission webhooks for pod creations (Kueue's: ``kueue.Kueue``), each
        #: ``(pod, namespace) -> KubernetesError | None``: it may change the pod in place,
        #: or refuse it; called before Pod Security judges the pod, as the API server
        #: runs mutating admission before validating admission.
        self.pod_mutators: list[Any] = []
        #: The structural schema of each custom resource served besides AlpaJob (by
        #: ``(group, plural)``): its writes are pruned by it, as the API server prunes them.
        self.schemas: dict[tuple[str, str], dict[str, Any]] = {}

    def _stored_rbac(self, plural: str) -> list[dict[str, Any]]:
        """The stored objects of one RBAC kind (``clusterroles``, ``rolebindings``, ...)."""
        return [_plain(obj.raw) for (kind, _, _), obj in list(self.kmock._objects.items())
                if kind.group == RBAC and kind.plural == plural and not obj.deleted]

    def _access_review(self, body: dict[str, Any]) -> dict[str, Any]:
        """The SubjectAccessReview API: may the user of ``body.spec`` do what its
        ``resourceAttributes`` say, by the stored roles (:mod:`rbac`)?"""
        from rbac import User

        spec = body.get("spec") or {}
        attributes = spec.get("resourceAttributes") or {}
        user = User(str(spec.get("user") or ""), tuple(spec.get("groups") or ()))
        resource = str(attributes.get("resource") or "") + \
            (f"/{attributes['subresource']}" if attributes.get("subresource") else "")
        ask = Ask(str(attributes.get("verb") or ""), str(attributes.get("group") or ""), resource,
                  attributes.get("namespace"), attributes.get("name"))
        verdict = allowed(user, ask, self._stored_rbac)
        return {**body, "status": {"allowed": verdict, **({} if verdict else {"reason": forbidden_message(user, ask)})}}

    def _authorize(self, request: Any) -> KubernetesError | None:
        """Authentication, then RBAC (:mod:`rbac`): 401 for a missing or unknown token,
        403 for a request no role of its user grants; None to go on."""
        user = self.kmock.tokens.user(request.headers)
        if user is None:
            return KubernetesError(status=401, reason="Unauthorized", message="Unauthorized")
        if request.resource is None or request.resource.plural is None or user.admin:
            return None  # discovery: open to every authenticated user
        sub = (request.subresource or "").split("/")[0]  # pods/proxy/metrics asks for pods/proxy
        resource = request.resource.plural + (f"/{sub}" if sub else "")
        ask = Ask(verb_of(request.method.upper(), request.name, request.params), request.resource.group or "",
                  resource, request.namespace, request.name)

        if allowed(user, ask, self._stored_rbac):
            body = request.data if isinstance(request.data, dict) else {}
            message = escalation(user, ask, body, self._stored_rbac)
            if message is None:
                return None
        else:
            message = forbidden_message(user, ask)
        self.forbidden.append(message)
        return KubernetesError(status=403, reason="Forbidden", message=message,
                               details={"name": request.name, "group": ask.group, "kind": request.resource.plural})

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with _Admitting(admit=self._admit, authorize=self._authorize, access_review=self._access_review,
                              graceful_pods=self.graceful_pods,
                              pod_logs=lambda ns, name: self.pod_logs(ns, name) if self.pod_logs else None) as emulator, \
                kmock.Server(emulator) as server:
            emulator.resources["alpajob.io/v1alpha1/alpajobs"] = kmock.ResourceInfo(
                kind="AlpaJob", singular="alpajob", namespaced=True, shortnames={"aj"},
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                subresources={"status"})
            for key, kind, namespaced in [("v1/pods", "Pod", True), ("v1/configmaps", "ConfigMap", True),
                                          ("v1/serviceaccounts", "ServiceAccount", True),
                                          ("v1/persistentvolumeclaims", "PersistentVolumeClaim", True),
                                          ("v1/services", "Service", True), ("v1/events", "Event", True),
                                          ("v1/secrets", "Secret", True),
                                          ("kopf.dev/v1/kopfpeerings", "KopfPeering", True),
                                          ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False),
                                          ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True),
                                          *[(f"{RBAC}/v1/{plural}", kind, namespaced) for plural, kind, namespaced in (
                                              ("clusterroles", "ClusterRole", False),
                                              ("clusterrolebindings", "ClusterRoleBinding", False),
                                              ("roles", "Role", True), ("rolebindings", "RoleBinding", True))],
                                          ("v1/nodes", "Node", False), ("v1/namespaces", "Namespace", False),
                                          ("scheduling.k8s.io/v1/priorityclasses", "PriorityClass", False),
                                          ("apiextensions.k8s.io/v1/customresourcedefinitions",
                                           "CustomResourceDefinition", False)]:
                emulator.resources[key] = kmock.ResourceInfo(  # kopf's peering CRDs declare no status subresource
                    kind=kind, namespaced=namespaced, subresources=set() if key.startswith("kopf.dev/") else {"status"},
                    verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
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

    async def _admit(self, request: Any) -> KubernetesError | None:
        """The API server's admission of a write (module docstring): the error to
        answer with, or None to store the request's (possibly pruned) body."""
        resource, action = request.resource, request.action
        if action == kmock.action.CREATE:
            data = request.data if isinstance(request.data, dict) else {}
            namespace = request.namespace or (data.get("metadata") or {}).get("namespace")
            if namespace:
                refusal = self._namespace_refusal(namespace, resource.plural, (data.get("metadata") or {}).get("name"))
                if refusal is not None:
                    return refusal
        if resource.plural == "pods" and resource.group == "" and action == kmock.action.CREATE:
            pod = request.data if isinstance(request.data, dict) else {}
            name = (pod.get("metadata") or {}).get("name", "")
            namespace = request.namespace or (pod.get("metadata") or {}).get("namespace") or "default"
            account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
            for mutate in self.pod_mutators:
                denied = mutate(pod, namespace)
                if denied is not None:
                    return denied
            refusal = self._priority(pod, name)
            if refusal is not None:
                return refusal
            refusal = self._refusal(namespace, name, account, pod)
            if refusal is not None:
                return KubernetesError(status=403, reason="Forbidden", message=refusal,
                                       details={"name": name, "kind": "pods"})
        if resource.plural == "secrets" and resource.group == "" and isinstance(request.data, dict) \
                and action in (kmock.action.CREATE, kmock.action.UPDATE) and request.data.get("stringData"):
            # What the API server stores of a Secret's stringData: its keys, base64, in data.
            plain = request.data.pop("stringData")
            request.data["data"] = {**(request.data.get("data") or {}),
                                    **{k: base64.b64encode(str(v).encode()).decode() for k, v in plain.items()}}
        if (resource.group, resource.plural) in self.schemas and isinstance(request.data, dict) \
                and action in (kmock.action.CREATE, kmock.action.UPDATE):
            self._prune(request.data, self.schemas[resource.group, resource.plural])
        if resource.plural == "alpajobs" and action in (kmock.action.CREATE, kmock.action.UPDATE):
            self._prune_job(request.data)
            if self.webhook is not None:
                return await self._review(request)
        return None

    def _namespace_refusal(self, namespace: str, plural: str, name: str | None) -> KubernetesError | None:
        """The API server's answer to a creation in ``namespace`` when it is being
        deleted (403, cause NamespaceTerminating: seen on kube-apiserver 1.36) or does
        not exist (404)."""
        state = self.namespaces.get(namespace)
        if state is None:
            return KubernetesError(status=404, reason="NotFound", message=f'namespaces "{namespace}" not found',
                                   details={"name": namespace, "kind": "namespaces"})
        if state == TERMINATING:
            return KubernetesError(
                status=403, reason="Forbidden",
                message=(f'{plural} "{name}" is forbidden: unable to create new content in namespace '
                         f"{namespace} because it is being terminated"),
                details={"name": name, "kind": plural, "causes": [{
                    "reason": "NamespaceTerminating", "message": f"namespace {namespace} is being terminated",
                    "field": "metadata.namespace"}]})
        return None

    def create_namespace(self, namespace: str, restricted: bool = True) -> None:
        """Make ``namespace`` (kmock cannot store Namespace objects: they live here), with
        Pod Security "restricted" enforced unless told otherwise; one being deleted
        cannot be made again until it is gone (the API server answers 409)."""
        if self.namespaces.get(namespace) == TERMINATING:
            raise client.ApiException(status=409, reason=f'object is being deleted: namespaces "{namespace}" '
                                                         "already exists")
        self.namespaces[namespace] = ACTIVE
        if restricted:
            self.restricted.add(namespace)

    def delete_namespace(self, namespace: str) -> None:
        """Delete ``namespace`` as the API server does: it is Terminating at once (new
        content refused) and gone, with everything in it, ``namespace_seconds`` later."""
        if self.namespaces.get(namespace) != ACTIVE or self.loop is None:
            return
        self.namespaces[namespace] = TERMINATING
        asyncio.run_coroutine_threadsafe(self._finish_namespace(namespace), self.loop)

    async def _finish_namespace(self, namespace: str) -> None:
        await asyncio.sleep(self.namespace_seconds)
        emulator = self.kmock
        async with emulator._lock:
            for key, obj in list(emulator._objects.items()):
                if key[1] == namespace and not obj.deleted:
                    raw = obj.raw
                    obj.delete()
                    await emulator._buses[key[0]].put({"type": "DELETED", "object": raw})
        self.namespaces.pop(namespace, None)
        self.restricted.discard(namespace)

    def ensure_namespace(self, namespace: str) -> None:
        """``namespace``, made if missing (not Pod Security restricted: a system namespace)."""
        if namespace not in self.namespaces:
            self.create_namespace(namespace, restricted=False)

    def namespace_gone(self, namespace: str) -> bool:
        return namespace not in self.namespaces

    def release(self, namespace: str, timeout: float = 60.0) -> None:
        """Delete ``namespace`` and wait until it is gone (as on a real cluster, where the
        next test could not create it meanwhile)."""
        self.delete_namespace(namespace)
        deadline = time.monotonic() + timeout
        while not self.namespace_gone(namespace):
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace {namespace} not gone after {timeout:.0f} s")
            time.sleep(0.2)

    def _user_info(self, request: Any) -> dict[str, Any]:
        """The requester as an AdmissionReview names it (``userInfo``)."""
        user = self.kmock.tokens.user(request.headers)
        return {"username": user.name, "groups": list(user.groups)} if user is not None else {}

    async def _review(self, request: Any) -> KubernetesError | None:
        """Ask :attr:`webhook` about an AlpaJob write, as the API server asks a
        validating webhook: the object as it would be stored (a patch applied to the
        stored one: status and finalizers included) and, on UPDATE, the stored one.
        A denial is the API server's 4xx naming the webhook; an unreachable webhook
        fails the request (``failurePolicy: Fail``)."""
        import aiohttp

        data = request.data if isinstance(request.data, dict) else {}
        name = request.name or (data.get("metadata") or {}).get("name")
        namespace = request.namespace or (data.get("metadata") or {}).get("namespace")
        key = (kmock.resource("alpajob.io", "v1alpha1", "alpajobs"), namespace, name)
        old = _plain(self.kmock.objects[key]) if key in self.kmock.objects and not self.kmock.objects[key].deleted else None
        update = request.action == kmock.action.UPDATE
        if update and old is None:
            return None  # kmock answers 404
        new = _merged(old, data) if update else data
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": f"review-{self.kmock.version}", "name": name, "namespace": namespace,
            "kind": {"group": "alpajob.io", "version": "v1alpha1", "kind": "AlpaJob"},
            "resource": {"group": "alpajob.io", "version": "v1alpha1", "resource": "alpajobs"},
            **({"subResource": request.subresource} if request.subresource else {}),
            "operation": "UPDATE" if update else "CREATE", "object": new,
            "oldObject": old if update else None, "userInfo": self._user_info(request), "dryRun": False}}
        webhook = 'admission webhook "validate-alpajob.alpajobs.alpajob.io"'
        try:
            async with aiohttp.ClientSession() as session, session.post(self.webhook, json=review,
                                                                          timeout=aiohttp.ClientTimeout(10)) as reply:
                answer = (await reply.json())["response"]
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as error:
            return KubernetesError(status=500, reason="InternalError",
                                   message=f"Internal error occurred: failed calling webhook {webhook}: {error}")
        if answer.get("allowed"):
            return None
        status = answer.get("status") or {}
        return KubernetesError(status=int(status.get("code") or 400), reason=str(status.get("reason") or "Invalid"),
                               message=f"{webhook} denied the request: {status.get('message', '')}")

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

    def _prune_job(self, body: Any) -> None:
        """Prune an AlpaJob written (a whole object, or a merge patch of one; status
        too) by the CRD's structural schema, in place, before it is stored. Pruning a
        merge patch is pruning its result: what is stored was pruned already."""
        if isinstance(body, dict):
            self._prune(body, self.schema)

    @staticmethod
    def _prune(body: dict[str, Any], schema: dict[str, Any]) -> None:
        """``body`` (an object, or a merge patch of one) pruned in place by ``schema``,
        its fields but ``apiVersion``, ``kind`` and ``metadata``."""
        from kube_schema import prune

        root = schema.get("properties") or {}
        kept = {k: prune(v, root[k]) if k not in ("apiVersion", "kind", "metadata") and k in root else v
                for k, v in body.items()}
        body.clear()
        body.update(kept)

    def _priority(self, pod: dict[str, Any], name: str) -> KubernetesError | None:
        """The Priority admission plugin: a pod's ``priorityClassName`` becomes its
        ``spec.priority`` (the PriorityClass's value); a class that does not exist is
        refused with 403, as the API server refuses it."""
        spec = pod.setdefault("spec", {})
        wanted = spec.get("priorityClassName")
        if not wanted:
            return None
        key = (kmock.resource("scheduling.k8s.io", "v1", "priorityclasses"), None, wanted)
        stored = self.kmock.objects[key] if key in self.kmock.objects else None  # noqa: SIM401 (no .get)
        if stored is None or stored.deleted:
            return KubernetesError(status=403, reason="Forbidden",
                                   message=f'pods "{name}" is forbidden: no PriorityClass with name {wanted} was found',
                                   details={"name": name, "kind": "pods"})
        spec["priority"] = int(_plain(stored).get("value") or 0)
        return None

    @property
    def schema(self) -> dict[str, Any]:
        """The AlpaJob CRD's openAPIV3Schema (manifests/crd.yaml)."""
        if self._schema is None:
            crd = yaml.safe_load((Path(__file__).resolve().parent.parent / "manifests" / "crd.yaml").read_text())
            self._schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        return self._schema

    def cluster_of(self, namespace: str, nodes: int, gpus: int = 8) -> None:
        """What the chart and the nodes give a real cluster: ``namespace`` enforcing Pod
        Security "restricted" (no ServiceAccount or role for the jobs' pods: the
        operator makes each job's own), and ``nodes`` Ready nodes ``node-<i>`` of
        ``gpus`` allocatable GPUs."""
        from alpajob.api.names import GPU_RESOURCE

        self.create_namespace(namespace)
        core = client.CoreV1Api(self.api())
        for i in range(nodes):
            try:
                core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {
                    "name": f"node-{i}", "labels": {"kubernetes.io/hostname": f"node-{i}"}},
                    "status": {"allocatable": {GPU_RESOURCE: str(gpus)},
                               "conditions": [{"type": "Ready", "status": "True"}]}})
            except client.ApiException as error:
                if error.status != 409:  # a namespace before this one made them
                    raise

    def claim(self, namespace: str, name: str) -> None:
        """A PersistentVolumeClaim ``name``, as a user makes one for the checkpoints
        (kmock binds nothing: the test kubelet gives its mounts one shared folder)."""
        client.CoreV1Api(self.api()).create_namespaced_persistent_volume_claim(namespace, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": namespace},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})

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

    def api(self, token: str = ADMIN_TOKEN) -> client.ApiClient:
        """A client of this server, as the administrator (else as ``token``'s user)."""
        config = client.Configuration()
        config.host = self.url
        config.api_key = {"authorization": f"Bearer {token}"}
        return client.ApiClient(config)

    def requests(self, method: str, path_part: str) -> int:
        """How many ``method`` requests whose path contains ``path_part`` were served."""
        return sum(1 for r in list(self.kmock) if r.method.upper() == method.upper() and path_part in str(r.url))


def _plain(value: Any) -> Any:
    """kmock's stored object (its mappings are its own types) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _merged(old: Any, patch: Any) -> Any:
    """``patch`` applied to ``old`` as a JSON merge patch (RFC 7386: None removes)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(out.get(key), value)
    return out


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
