"""End to end: the real operator process against KMock's Kubernetes emulator.

The test creates AlpaJobs through the kubernetes client and plays the kubelet: it
runs the planning pod's command for real (``alpajob plan ... --output-configmap``,
writing the plan into the emulator) and moves pods through Pending, Running,
Succeeded and Failed. The operator (``alpajob operator``, a subprocess) does the rest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")
pytest.importorskip("kopf")

from kubernetes import client  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from kube_emulator import Emulator  # noqa: E402

NS = "ml"
EXAMPLES = Path(__file__).parent.parent / "manifests" / "examples"
GROUP, VERSION, PLURAL = "alpajob.io", "v1alpha1", "alpajobs"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = Emulator(Path(str(tmp_path_factory.mktemp("kmock")))).start()
    core = client.CoreV1Api(emu.api())
    for i in range(2):
        core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": f"node-{i}", "labels": {"kubernetes.io/hostname": f"node-{i}"}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": "True"}]}})
    yield emu
    emu.stop()


class Operator:
    """``alpajob operator`` as a process; restartable."""

    def __init__(self, emu: Emulator, log: Path) -> None:
        self.emu, self.log = emu, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.emu.kubeconfig)}
        out = open(self.log, "a")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "alpajob.cli", "operator", "--namespace", NS, "--interval", "0.3",
             "--no-scanning"],
            stdout=out, stderr=subprocess.STDOUT, env=env)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def operator(emulator: Emulator, tmp_path: Path) -> Iterator[Operator]:
    op = Operator(emulator, tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()


def _wait(what: str, check: Callable[[], Any], timeout: float = 60, op: Operator | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    log = op.log.read_text()[-4000:] if op is not None and op.log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{log}")


class Cluster:
    """The test's hands on the emulator: jobs, pods, and the kubelet's part."""

    def __init__(self, emu: Emulator) -> None:
        self.api = emu.api()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.emu = emu

    def create_job(self, name: str, **spec: Any) -> dict[str, Any]:
        doc = yaml.safe_load((EXAMPLES / "manual-gpt.yaml").read_text())
        doc["metadata"] = {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1,
                           "resourceVersion": "1"}
        doc["spec"].update(spec)
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, doc)

    def job(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)

    def phase(self, name: str) -> str | None:
        return (self.job(name).get("status") or {}).get("phase")

    def pods(self, job: str) -> dict[str, Any]:
        items = self.core.list_namespaced_pod(NS).items
        return {p.metadata.name: p for p in items if (p.metadata.labels or {}).get("alpajob.io/job") == job}

    def set_phase(self, pod: str, phase: str, **extra: Any) -> None:
        self.core.patch_namespaced_pod_status(pod, NS, {"status": {"phase": phase, **extra}})

    def run_planner(self, job: str, tmp: Path) -> None:
        """Play the kubelet for the planning pod: run its command, for real."""
        pod = _wait("the planner pod", lambda: self.pods(job).get(f"{job}-planner"))
        manifest = self.core.read_namespaced_config_map(f"{job}-config", NS).data["manifest.yaml"]
        (tmp / "manifest.yaml").write_text(manifest)
        command = [tmp.as_posix() + "/manifest.yaml" if a == "/etc/alpajob/manifest.yaml" else a
                   for a in pod.spec.containers[0].command]
        assert command[:2] == ["alpajob", "plan"]
        self.set_phase(f"{job}-planner", "Running")
        done = subprocess.run([sys.executable, "-m", "alpajob.cli", *command[1:]], capture_output=True, text=True,
                              env={**os.environ, "KUBECONFIG": str(self.emu.kubeconfig)}, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        self.set_phase(f"{job}-planner", "Succeeded")


@pytest.fixture
def cluster(emulator: Emulator) -> Cluster:
    return Cluster(emulator)


def test_a_job_goes_from_planning_to_running_to_succeeded(cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    cluster.create_job("gpt-a")
    _wait("phase Planning", lambda: cluster.phase("gpt-a") == "Planning", op=operator)
    cluster.run_planner("gpt-a", tmp_path)
    expected = {"gpt-a-0-head", "gpt-a-0-m0-h0", "gpt-a-0-m1-h0"}
    pods = _wait("the head and mesh pods", lambda: expected <= set(cluster.pods("gpt-a")) and cluster.pods("gpt-a"),
                 op=operator)
    job = cluster.job("gpt-a")
    assert job["status"]["plan"]["stages"] == 2
    assert job["status"]["children"]["meshPods"] == ["gpt-a-0-m0-h0", "gpt-a-0-m1-h0"]
    assert cluster.core.read_namespaced_service("gpt-a-head", NS).spec.ports[0].port == 6379
    env = {e.name: e.value for e in pods["gpt-a-0-m1-h0"].spec.containers[0].env}
    assert env["ALPAJOB_MESH"] == "1" and env["ALPAJOB_RAY_ADDRESS"] == "gpt-a-head.ml.svc:6379"
    for pod in pods.values():
        assert pod.metadata.owner_references[0].uid == "uid-gpt-a"
    for name in expected:
        cluster.set_phase(name, "Running")
    _wait("phase Running", lambda: cluster.phase("gpt-a") == "Running", op=operator)
    ready = {c["type"]: c["status"] for c in cluster.job("gpt-a")["status"]["conditions"]}
    assert ready["Ready"] == "True" and ready["MeshesReady"] == "True"
    cluster.set_phase("gpt-a-0-head", "Succeeded")
    _wait("phase Succeeded", lambda: cluster.phase("gpt-a") == "Succeeded", op=operator)
    _wait("the pods cleaned up", lambda: not cluster.pods("gpt-a"), op=operator)
    reasons = [e.reason for e in cluster.core.list_namespaced_event(NS).items
               if e.involved_object.name == "gpt-a"]
    assert {"Planning", "PodsStarting", "Training", "TrainingFinished"} <= set(reasons)
