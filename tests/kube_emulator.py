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
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
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
                                          ("v1/services", "Service", True), ("v1/events", "Event", True),
                                          ("v1/nodes", "Node", False), ("v1/namespaces", "Namespace", False),
                                          ("apiextensions.k8s.io/v1/customresourcedefinitions",
                                           "CustomResourceDefinition", False)]:
                emulator.resources[key] = kmock.ResourceInfo(
                    kind=kind, namespaced=namespaced, subresources={"status"},
                    verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
            self.kmock = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            while not self._stop.is_set():
                if not self.keep_history:
                    del emulator._requests[:-16]  # kmock internals: its request log
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.5)

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
