"""End to end: the real operator process against KMock's Kubernetes emulator (or a
real cluster: ``ALPAJOB_E2E_KUBECONFIG``, see ``e2e_cluster.py``).

The test creates AlpaJobs through the kubernetes client and plays the kubelet: it
runs the planning pod's command for real (``alpajob plan``, with the pod's environment: it
writes the plan into the emulator's ConfigMap) and moves pods through Pending, Running,
Succeeded and Failed. The operator (``alpajob operator``, a subprocess) does the rest.
"""

from __future__ import annotations

import copy
import json
import os
import re
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
from e2e_cluster import (  # noqa: E402
    account_token,
    emulator_only,
    open_cluster,
    operator_kubeconfig,
    token_kubeconfig,
    unique_namespace,
)
from gitops_health import ARGOCD, VERDICTS, argocd_health, flux_health, kstatus  # noqa: E402
from kube_emulator import Emulator  # noqa: E402

from alpajob.api.names import FINALIZER, LABEL_JOB, MANIFEST_KEY, PLAN_KEY  # noqa: E402
from alpajob.api.progress import Progress, TrainerPhase  # noqa: E402
from alpajob.api.runtime import MANIFEST_PATH, TrainerRuntime  # noqa: E402

#: The namespace of AdmissionReviews sent straight to the webhook (nothing is created there).
REVIEW_NS = "ml"
EXAMPLES = Path(__file__).parent.parent / "manifests" / "examples"
GROUP, VERSION, PLURAL = "alpajob.io", "v1alpha1", "alpajobs"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = open_cluster(Path(str(tmp_path_factory.mktemp("kmock"))))
    yield emu
    emu.stop()


@pytest.fixture
def ns(emulator: Emulator) -> Iterator[str]:
    """A namespace of the test's own (Pod Security restricted, the trainer's account, two
    nodes), deleted after it and waited for, as a real cluster needs."""
    name = unique_namespace("ml")
    emulator.cluster_of(name, nodes=2)
    yield name
    emulator.release(name)


@pytest.fixture(scope="module")
def slim_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Python of a virtual environment made as the operator's image makes it
    (trainer_image/Dockerfile, --target operator): requirements/operator.txt with its hashes checked, then the
    project with ``--no-deps``; so no JAX, Ray or NumPy, and an operator that imports
    one fails here."""
    root = Path(__file__).resolve().parents[1]
    venv = Path(str(tmp_path_factory.mktemp("operator-venv")))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--require-hashes", "--no-deps", "-r", str(root / "requirements" / "operator.txt")],
                   check=True)
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", "--no-index", str(root)], check=True)
    absent = subprocess.run([str(venv / "bin" / "python"), "-c", "import jax"], capture_output=True)
    assert absent.returncode != 0, "the operator's environment holds JAX"
    return str(venv / "bin" / "python")


class Operator:
    """``alpajob operator`` as a process, watching namespace ``ns``; restartable. It runs
    on ``python`` (this one, or :func:`slim_python`'s)."""

    def __init__(self, emu: Emulator, log: Path, ns: str, python: str = sys.executable) -> None:
        self.emu, self.log, self.ns, self.python = emu, log, ns, python
        #: As the operator's ServiceAccount, with the shipped RBAC: a verb its
        #: ClusterRole lacks is refused, as on a real cluster.
        self.kubeconfig = operator_kubeconfig(emu, log.parent, ns)
        self.proc: subprocess.Popen | None = None
        self.args: list[str] = []
        self.metrics_port = self.liveness_port = 0

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        out = open(self.log, "a")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen(
            [self.python, "-m", "alpajob", "operator", "--namespace", self.ns, "--interval", "0.3",
             "--no-scanning", *self.args],
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
def operator(request: pytest.FixtureRequest, emulator: Emulator, tmp_path: Path, ns: str) -> Iterator[Operator]:
    """The operator, as its ServiceAccount; on :func:`slim_python` for a test marked
    ``slim_operator`` (the operator's image: no JAX, Ray or NumPy)."""
    from alpajob.trainer_image.distributed.loopback import free_port

    slim = request.node.get_closest_marker("slim_operator") is not None
    python = request.getfixturevalue("slim_python") if slim else sys.executable
    op = Operator(emulator, tmp_path / "operator.log", ns, python)
    refused = getattr(emulator, "forbidden", [])
    refused.clear()
    op.metrics_port, op.liveness_port = free_port(), free_port()
    op.args = ["--metrics-port", str(op.metrics_port),
               "--liveness", f"http://127.0.0.1:{op.liveness_port}/healthz"]
    op.start()
    yield op
    op.stop()
    assert refused == [], "the shipped RBAC refused what the operator or a pod asked"


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

    def __init__(self, emu: Emulator, ns: str, seen: dict[tuple[str, str], dict[str, Any]] | None = None) -> None:
        self.ns = ns
        self.seen = seen if seen is not None else {}
        self.api = emu.api()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.emu = emu

    def create_job(self, name: str, **spec: Any) -> dict[str, Any]:
        doc = yaml.safe_load((EXAMPLES / "manual-gpt.yaml").read_text())
        doc["metadata"] = {"name": name, "namespace": self.ns}
        doc["spec"].update(spec)
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, doc)

    def job(self, name: str) -> dict[str, Any]:
        """The job as the API returns it; the first read of each (job, phase) is kept
        in ``seen`` for the GitOps checks at the end of the module."""
        job = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        phase = (job.get("status") or {}).get("phase", "(no status)")
        self.seen.setdefault((name, phase), copy.deepcopy(job))
        return job

    def phase(self, name: str) -> str | None:
        return (self.job(name).get("status") or {}).get("phase")

    def pods(self, job: str) -> dict[str, Any]:
        items = self.core.list_namespaced_pod(self.ns).items
        return {p.metadata.name: p for p in items if (p.metadata.labels or {}).get(LABEL_JOB) == job}

    def running(self, job: str) -> set[str]:
        """The job's pods that have not finished."""
        return {n for n, p in self.pods(job).items() if (p.status and p.status.phase) not in ("Succeeded", "Failed")}

    def set_phase(self, pod: str, phase: str, **extra: Any) -> None:
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": {"phase": phase, **extra}})

    def run_planner(self, job: str, tmp: Path, succeeds: bool = True) -> None:
        """Play the kubelet for the planning pod: run its command, for real; a failed
        command fails the pod with its log's tail as the termination message (the pod's
        terminationMessagePolicy is FallbackToLogsOnError)."""
        pod = _wait("the planner pod", lambda: self.pods(job).get(f"{job}-planner"))
        manifest = self.core.read_namespaced_config_map(f"{job}-config", self.ns).data[MANIFEST_KEY]
        (tmp / "manifest.yaml").write_text(manifest)
        [container] = pod.spec.containers
        command = container.command
        assert command[:2] == ["alpajob", "plan"]
        # The pod's environment, with the ConfigMap's mount path mapped to a local file.
        env = {e.name: e.value for e in container.env}
        assert env["ALPAJOB_MANIFEST"] == MANIFEST_PATH
        env["ALPAJOB_MANIFEST"] = str(tmp / "manifest.yaml")
        self.set_phase(f"{job}-planner", "Running")
        # As the pod's ServiceAccount, with the shipped trainer RBAC (a kubelet's token).
        kubeconfig = token_kubeconfig(self.emu.kubeconfig, account_token(self.api, self.ns, pod.spec.service_account_name),
                                      tmp / "pod-kubeconfig")
        done = subprocess.run([sys.executable, "-m", "alpajob", *command[1:]], capture_output=True, text=True,
                              env={**os.environ, **env, "KUBECONFIG": str(kubeconfig)}, timeout=300)
        if succeeds:
            assert done.returncode == 0, done.stderr[-3000:]
            self.set_phase(f"{job}-planner", "Succeeded")
            return
        assert done.returncode == 2, done.stderr[-3000:]
        self.set_phase(f"{job}-planner", "Failed", containerStatuses=[
            {"name": "planner", "ready": False, "restartCount": 0, "image": "x", "imageID": "x",
             "state": {"terminated": {"exitCode": 2, "reason": "Error", "message": done.stderr[-1500:]}}}])


@pytest.fixture(scope="module")
def seen() -> dict[tuple[str, str], dict[str, Any]]:
    """Every (job, phase) the module's tests read back, first read of each."""
    return {}


@pytest.fixture
def cluster(emulator: Emulator, ns: str, seen: dict[tuple[str, str], dict[str, Any]]) -> Cluster:
    return Cluster(emulator, ns, seen)


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
    assert cluster.core.read_namespaced_service("gpt-a-head", cluster.ns).spec.ports[0].port == 6379
    env = {e.name: e.value for e in pods["gpt-a-0-m1-h0"].spec.containers[0].env}
    assert env["ALPAJOB_MESH"] == "1" and env["ALPAJOB_RAY_ADDRESS"] == f"gpt-a-head.{cluster.ns}.svc:6379"
    for pod in pods.values():
        assert pod.metadata.owner_references[0].uid == job["metadata"]["uid"]
    for name in expected:
        cluster.set_phase(name, "Running")
    _wait("phase Running", lambda: cluster.phase("gpt-a") == "Running", op=operator)
    ready = {c["type"]: c["status"] for c in cluster.job("gpt-a")["status"]["conditions"]}
    assert ready["Ready"] == "True" and ready["MeshesReady"] == "True"
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=10) as page:
        metrics = page.read().decode()
    assert 'alpajob_operator_jobs{phase="Running"} 1.0' in metrics
    assert "alpajob_operator_reconcile_seconds_count" in metrics
    assert "alpajob_operator_planning_seconds_count 1.0" in metrics
    created = re.search(r'alpajob_operator_api_requests_total\{code="201",verb="POST"\} (\S+)', metrics)
    assert created and float(created.group(1)) >= 4  # its children: ConfigMaps, Services, pods
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.liveness_port}/healthz", timeout=10) as probe:
        assert probe.status == 200  # the Deployment's liveness and readiness probes
    head = cluster.pods("gpt-a")["gpt-a-0-head"].spec.containers[0]
    runtime = TrainerRuntime.from_env({e.name: e.value for e in head.env})
    assert runtime.progress_configmap == f"{cluster.ns}/gpt-a-progress"
    # Play the driver: its progress, as `alpajob driver` writes it there.
    from alpajob.trainer_image.publish import write_progress_configmap

    report = Progress(phase=TrainerPhase.RUNNING, step=40, steps=100, loss=2.5,
                      samples_per_second=812.5, last_checkpoint_step=40)
    write_progress_configmap(report, runtime.progress_configmap, api=cluster.api)
    progress = _wait("progress in the status",
                     lambda: (cluster.job("gpt-a")["status"].get("progress") or {}).get("step") == 40
                     and cluster.job("gpt-a")["status"]["progress"], op=operator)
    assert progress["lastCheckpointStep"] == 40 and progress["samplesPerSecond"] == 812.5
    # At rest (nothing changes): no status writes, though the fixture prunes every one
    # as the API server does (a controller writing undeclared fields would loop here),
    # and no reads either: passes run on changes, which the watches bring.
    if not getattr(cluster.emu, "real", False):  # the test API server counts what it serves
        time.sleep(1.0)
        writes = cluster.emu.requests("PATCH", "/alpajobs/gpt-a/status")
        reads = cluster.emu.requests("GET", "/alpajobs/gpt-a")
        lists = cluster.emu.requests("GET", f"/namespaces/{cluster.ns}/pods?")
        time.sleep(3.0)  # 10 passes of a polling operator (--interval 0.3)
        assert cluster.emu.requests("PATCH", "/alpajobs/gpt-a/status") == writes
        assert cluster.emu.requests("GET", "/alpajobs/gpt-a") == reads
        assert cluster.emu.requests("GET", f"/namespaces/{cluster.ns}/pods?") == lists
        # kopf's lists and watches of the children ask the API server for the job
        # label: no other pod, ConfigMap, Service or claim of the cluster comes back.
        kinds = ("pods", "configmaps", "services", "persistentvolumeclaims")
        kopf_reads = [r for r in list(cluster.emu.kmock) if r.resource is not None and r.resource.plural in kinds
                      and r.method.upper() == "GET" and r.name is None
                      and r.headers.get("User-Agent", "").startswith("kopf")]
        assert {r.resource.plural for r in kopf_reads} == set(kinds)
        assert {r.params.get("labelSelector") for r in kopf_reads} == {LABEL_JOB}
    cluster.set_phase("gpt-a-0-head", "Succeeded")
    _wait("phase Succeeded", lambda: cluster.phase("gpt-a") == "Succeeded", op=operator)
    # cleanPodPolicy Running: what still ran is deleted; the finished planner and head
    # stay for `kubectl logs` until the job goes.
    _wait("the running pods cleaned up", lambda: cluster.running("gpt-a") == set(), op=operator)
    assert set(cluster.pods("gpt-a")) == {"gpt-a-planner", "gpt-a-0-head"}
    def reasons() -> set[str]:
        return {e.reason for e in cluster.core.list_namespaced_event(cluster.ns).items if e.involved_object.name == "gpt-a"}

    _wait("an event per transition", lambda: {"Planning", "PodsStarting", "Training", "TrainingFinished"} <= reasons(),
          op=operator)


def _to_running(cluster: Cluster, operator: Operator, job: str, tmp: Path, attempt: int = 0) -> set[str]:
    expected = {f"{job}-{attempt}-head", f"{job}-{attempt}-m0-h0", f"{job}-{attempt}-m1-h0"}
    _wait(f"attempt {attempt}'s pods", lambda: expected <= set(cluster.pods(job)), op=operator)
    for name in expected:
        cluster.set_phase(name, "Running")
    _wait("phase Running", lambda: cluster.phase(job) == "Running", op=operator)
    return expected


def _condition(cluster: Cluster, job: str, kind: str) -> dict[str, Any]:
    return next(c for c in cluster.job(job)["status"]["conditions"] if c["type"] == kind)


def test_a_failed_pod_restarts_the_whole_job_until_the_backoff_limit(cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    cluster.create_job("gpt-b", runPolicy={"backoffLimit": 1, "restartScope": "Job"})
    cluster.run_planner("gpt-b", tmp_path)
    _to_running(cluster, operator, "gpt-b", tmp_path)
    cluster.set_phase("gpt-b-0-m1-h0", "Failed", containerStatuses=[
        {"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "x",
         "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}])
    _wait("attempt 1", lambda: "gpt-b-1-head" in cluster.pods("gpt-b"), op=operator)
    assert not {n for n in cluster.running("gpt-b") if n.startswith("gpt-b-0-")}  # every mesh restarted
    assert "gpt-b-0-m1-h0" in cluster.pods("gpt-b")  # the failed pod stays, stopped, for its logs
    assert cluster.job("gpt-b")["status"]["restarts"] == 1
    _to_running(cluster, operator, "gpt-b", tmp_path, attempt=1)
    cluster.set_phase("gpt-b-1-head", "Failed")
    _wait("phase Failed", lambda: cluster.phase("gpt-b") == "Failed", op=operator)
    failed = _condition(cluster, "gpt-b", "Failed")
    assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded"
    assert _condition(cluster, "gpt-b", "Ready")["status"] == "False"
    _wait("the running pods cleaned up", lambda: cluster.running("gpt-b") == set(), op=operator)
    assert {"gpt-b-1-head", "gpt-b-0-m1-h0"} <= set(cluster.pods("gpt-b"))  # the failed ones, for their logs
    def warnings() -> list[str]:  # events are posted right after the status patch
        return [e.reason for e in cluster.core.list_namespaced_event(cluster.ns).items
                if e.involved_object.name == "gpt-b" and e.type == "Warning"]

    _wait("the Warning events", lambda: {"PodFailed", "BackoffLimitExceeded"} <= set(warnings()), op=operator)


def test_a_smaller_pool_plans_the_job_again_under_the_shipped_rbac(
        emulator: Emulator, cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    """A node leaves the pool while the job runs on two: at the next restart the
    operator clears the plan in ``<job>-plan`` and plans again, as its own
    ServiceAccount with exactly the shipped ClusterRole (a verb it lacks is a 403)."""
    emulator_only(emulator, "makes a shared node NotReady")
    cluster.create_job("gpt-p", cluster={"gpu": "cpu", "nodes": 2, "gpusPerNode": 8},
                       runPolicy={"backoffLimit": 2, "restartScope": "Job"})
    cluster.run_planner("gpt-p", tmp_path)
    _to_running(cluster, operator, "gpt-p", tmp_path)
    core = cluster.core
    core.patch_node_status("node-1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    try:
        cluster.set_phase("gpt-p-0-m1-h0", "Failed")
        _wait("the planner pod made again", lambda: cluster.job("gpt-p")["status"].get("phase") == "Planning"
              and "gpt-p-planner" in cluster.pods("gpt-p")
                    and (cluster.pods("gpt-p")["gpt-p-planner"].status or client.V1PodStatus()).phase in (None, "Pending"),
              op=operator)
        plan = core.read_namespaced_config_map("gpt-p-plan", cluster.ns).data or {}
        assert PLAN_KEY not in plan  # the old plan was cleared (a patch of the ConfigMap)
        events = {e.reason for e in core.list_namespaced_event(cluster.ns).items if e.involved_object.name == "gpt-p"}
        assert "Replanning" in events
    finally:
        core.patch_node_status("node-1", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert emulator.forbidden == []


def test_the_pool_is_the_nodes_a_mesh_pod_may_use_and_a_short_one_waits_saying_why(
        cluster: Cluster, operator: Operator) -> None:
    """Of four nodes that match the job's selector one is cordoned, one NotReady and one
    tainted: with ``whenFewerNodes: Wait`` the job waits, no planner pod, the condition
    NodesAvailable=False names each node left out and why, and a Warning event says so;
    a toleration added to ``spec.podTemplate.mesh`` brings the tainted node back and the
    job is planned for the two nodes it asked for."""
    emulator_only(cluster.emu, "its nodes have no kubelet to keep them Ready")
    from alpajob.api.names import GPU_RESOURCE

    label = {"alpajob.io/test-pool": cluster.ns}
    ready = [{"type": "Ready", "status": "True"}]
    nodes = {"pool-ok": ({}, ready), "pool-cordoned": ({"unschedulable": True}, ready),
             "pool-down": ({}, [{"type": "Ready", "status": "False"}]),
             "pool-tainted": ({"taints": [{"key": "dedicated", "value": "infer", "effect": "NoSchedule"}]}, ready)}
    names = {name: f"{name}-{cluster.ns}" for name in nodes}
    for name, (spec, conditions) in nodes.items():
        cluster.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": names[name], "labels": label},
                                  "spec": spec, "status": {"allocatable": {GPU_RESOURCE: "8"}, "conditions": conditions}})
    try:
        cluster.create_job("gpt-n", cluster={"gpu": "cpu", "nodes": 2, "gpusPerNode": 8, "nodeSelector": label,
                                             "whenFewerNodes": "Wait"})

        def short() -> dict[str, Any] | None:
            conditions = (cluster.job("gpt-n").get("status") or {}).get("conditions") or []
            return next((c for c in conditions if c["type"] == "NodesAvailable" and c["status"] == "False"), None)

        condition = _wait("NodesAvailable=False", short, op=operator)
        assert condition["message"].startswith("the pool has 1 of the 2 nodes spec.cluster.nodes asks for")
        for name, why in (("pool-cordoned", "cordoned"), ("pool-down", "not Ready"),
                          ("pool-tainted", "tainted dedicated=infer:NoSchedule")):
            assert f"{names[name]} {why}" in condition["message"]
        assert cluster.phase("gpt-n") == "Pending" and "gpt-n-planner" not in cluster.pods("gpt-n")
        _wait("the Warning event", lambda: any(
            e.reason == "FewerNodes" and e.type == "Warning" for e in cluster.core.list_namespaced_event(cluster.ns).items
            if e.involved_object.name == "gpt-n"), op=operator)
        cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "gpt-n", {"spec": {
            "podTemplate": {"mesh": {"tolerations": [{"key": "dedicated", "operator": "Exists"}]}}}})
        _wait("the planner pod", lambda: "gpt-n-planner" in cluster.pods("gpt-n"), op=operator)
        assert _condition(cluster, "gpt-n", "NodesAvailable")["status"] == "True"
        assert "planning for 2 x 8 cpu" in _condition(cluster, "gpt-n", "Reconciling")["message"]
    finally:
        for name in names.values():
            cluster.core.delete_node(name)


def test_a_job_across_gpu_types_is_planned_for_each_types_nodes_and_each_stage_runs_on_its_type(
        cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    """``spec.cluster.pools`` of an H100 and two A100 nodes on a pool of nodes labelled
    by product (one A100 node cordoned, one V100 node of no type of the job's): the
    job is short one node and says so; the planner pod is told each type's usable nodes
    and plans across both, for real; each stage's mesh pod is pinned to a node of its
    stage's type and selects that product (so a Kueue flavor of that type admits it).
    Once the cordoned node is back, the next attempt is planned for the new mix."""
    emulator_only(cluster.emu, "its nodes have no kubelet to keep them Ready")
    from alpajob.api.names import GPU_PRODUCT_LABEL, GPU_RESOURCE
    from alpajob.api.plan import plan_from_json

    products = {"h100": "NVIDIA-H100-80GB-HBM3", "a100": "NVIDIA-A100-SXM4-80GB", "v100": "Tesla-V100-SXM2-16GB"}
    nodes = {"a100-x": ("a100", False), "a100-y": ("a100", True), "h100-x": ("h100", False), "v100-x": ("v100", False)}
    names = {name: f"{name}-{cluster.ns}" for name in nodes}
    for name, (kind, cordoned) in nodes.items():
        cluster.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": names[name], "labels": {
            GPU_PRODUCT_LABEL: products[kind], "kubernetes.io/hostname": names[name]}},
            "spec": {"unschedulable": True} if cordoned else {},
            "status": {"allocatable": {GPU_RESOURCE: "1"}, "conditions": [{"type": "Ready", "status": "True"}]}})
    try:
        cluster.create_job("gpt-mix", model={"zoo": "gpt", "config": "350m"},
                           training={"globalBatchSize": 64, "steps": 10, "dtype": "float32"},
                           cluster={"pools": [{"gpu": "h100-80gb", "nodes": 1, "gpusPerNode": 1},
                                              {"gpu": "a100-80gb", "nodes": 2, "gpusPerNode": 1}]},
                           parallelism={}, runPolicy={"backoffLimit": 2, "restartScope": "Job"})
        pod = _wait("the planner pod", lambda: cluster.pods("gpt-mix").get("gpt-mix-planner"), op=operator)
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert json.loads(env["ALPAJOB_POOLS"]) == [{"gpu": "h100-80gb", "nodes": 1, "gpusPerNode": 1},
                                                   {"gpu": "a100-80gb", "nodes": 1, "gpusPerNode": 1}]
        assert "ALPAJOB_GPU" not in env and "ALPAJOB_NODES" not in env
        short = _condition(cluster, "gpt-mix", "NodesAvailable")
        assert short["status"] == "False" and short["message"].startswith(
            "the pool has 2 of the 3 nodes spec.cluster.pools asks for") and f"{names['a100-y']} cordoned" in short["message"]
        assert "planning for 1 x 1 h100-80gb + 1 x 1 a100-80gb" in _condition(cluster, "gpt-mix", "Reconciling")["message"]
        cluster.run_planner("gpt-mix", tmp_path)
        plan = plan_from_json(cluster.core.read_namespaced_config_map("gpt-mix-plan", cluster.ns).data[PLAN_KEY])
        assert [p["preset"] for p in plan.pools] == ["h100-80gb", "a100-80gb"]
        meshes = {f"gpt-mix-0-m{s.index}-h0": s for s in plan.stages}
        assert sorted(s.pool for s in plan.stages) == [0, 1]
        _wait("the mesh pods", lambda: set(meshes) <= set(cluster.pods("gpt-mix")), op=operator)
        pods = cluster.pods("gpt-mix")
        for name, stage in meshes.items():
            kind = "h100" if plan.pools[stage.pool]["preset"] == "h100-80gb" else "a100"
            spec = pods[name].spec
            [term] = spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
            assert [e.values for e in term.match_expressions if e.key == "kubernetes.io/hostname"] == [
                [names[f"{kind}-x"]]], name
            assert spec.node_selector == {GPU_PRODUCT_LABEL: products[kind]}
            assert spec.containers[0].resources.limits[GPU_RESOURCE] == "1"
        # The mix changes (the A100 node is back): the next attempt is planned for it.
        _to_running(cluster, operator, "gpt-mix", tmp_path)
        cluster.core.patch_node(names["a100-y"], {"spec": {"unschedulable": False}})
        cluster.set_phase("gpt-mix-0-m0-h0", "Failed")
        pod = _wait("the planner pod made again", lambda: (p := cluster.pods("gpt-mix").get("gpt-mix-planner"))
                    and (p.status or client.V1PodStatus()).phase in (None, "Pending") and p, op=operator)
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert [p["nodes"] for p in json.loads(env["ALPAJOB_POOLS"])] == [1, 2]
        assert "Replanning" in {e.reason for e in cluster.core.list_namespaced_event(cluster.ns).items
                                if e.involved_object.name == "gpt-mix"}
    finally:
        for name in names.values():
            cluster.core.delete_node(name)


def test_each_job_runs_as_its_own_identity_that_reaches_only_its_own_configmaps(
        emulator: Emulator, cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    """With no ``spec.serviceAccountName``, the operator (under the shipped RBAC,
    whose escalation check the API server applies to every Role and RoleBinding it
    creates) makes the job's ServiceAccount, Role and RoleBinding ``<job>-trainer``,
    owned by the job, before its first pod. The planner plans as that account; the
    head gets its token, mesh pods none. The token may get and patch the job's plan
    and progress and nothing else: not the job's own manifest, not another job's
    plan, no list, no Secret, no pod."""
    cluster.create_job("gpt-i")
    cluster.create_job("gpt-j")
    _wait("both planner pods", lambda: "gpt-i-planner" in cluster.pods("gpt-i") and "gpt-j-planner" in cluster.pods("gpt-j"),
          op=operator)
    job = cluster.job("gpt-i")
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    account = cluster.core.read_namespaced_service_account("gpt-i-trainer", cluster.ns)
    role = rbac.read_namespaced_role("gpt-i-trainer", cluster.ns)
    binding = rbac.read_namespaced_role_binding("gpt-i-trainer", cluster.ns)
    for obj in (account, role, binding):
        assert [o.uid for o in obj.metadata.owner_references] == [job["metadata"]["uid"]]
    assert account.automount_service_account_token is False
    assert [(r.resources, r.resource_names, r.verbs) for r in role.rules] == \
        [(["configmaps"], ["gpt-i-plan", "gpt-i-progress"], ["get", "patch"])]
    assert binding.role_ref.kind == "Role" and [s.name for s in binding.subjects] == ["gpt-i-trainer"]
    assert cluster.pods("gpt-i")["gpt-i-planner"].spec.service_account_name == "gpt-i-trainer"
    cluster.run_planner("gpt-i", tmp_path)  # writes gpt-i-plan as gpt-i-trainer
    pods = _wait("the head and mesh pods", lambda: {"gpt-i-0-head", "gpt-i-0-m0-h0"} <= set(cluster.pods("gpt-i"))
                 and cluster.pods("gpt-i"), op=operator)
    assert pods["gpt-i-0-head"].spec.automount_service_account_token is True
    assert pods["gpt-i-0-m0-h0"].spec.automount_service_account_token is False
    assert {p.spec.service_account_name for p in pods.values()} == {"gpt-i-trainer"}

    token = account_token(cluster.api, cluster.ns, "gpt-i-trainer")
    from kubernetes import config

    core = client.CoreV1Api(config.new_client_from_config(
        str(token_kubeconfig(cluster.emu.kubeconfig, token, tmp_path / "trainer-kubeconfig"))))
    core.patch_namespaced_config_map("gpt-i-progress", cluster.ns, {"metadata": {"annotations": {"probe": "1"}}})
    assert core.read_namespaced_config_map("gpt-i-plan", cluster.ns).data[PLAN_KEY]
    refused_before = len(getattr(emulator, "forbidden", []))
    for what, call in [
            ("the job's manifest", lambda: core.read_namespaced_config_map("gpt-i-config", cluster.ns)),
            ("another job's plan", lambda: core.read_namespaced_config_map("gpt-j-plan", cluster.ns)),
            ("another job's plan, patched", lambda: core.patch_namespaced_config_map(
                "gpt-j-plan", cluster.ns, {"data": {PLAN_KEY: "{}"}})),
            ("every ConfigMap", lambda: core.list_namespaced_config_map(cluster.ns)),
            ("the Ray token", lambda: core.read_namespaced_secret("gpt-i-0-ray", cluster.ns)),
            ("a pod", lambda: core.create_namespaced_pod(cluster.ns, {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]}}))]:
        with pytest.raises(client.ApiException) as refused:
            call()
        assert refused.value.status == 403, what
    forbidden = getattr(emulator, "forbidden", None)
    if forbidden is not None:  # the probes' refusals are the test's, not a missing grant
        assert len(forbidden) == refused_before + 6
        assert all("system:serviceaccount:" + cluster.ns + ":gpt-i-trainer" in m for m in forbidden[refused_before:])
        del forbidden[refused_before:]


def test_of_two_replicas_one_reconciles_and_a_killed_leader_is_replaced_within_seconds(
        emulator: Emulator, cluster: Cluster, tmp_path: Path) -> None:
    """Two operators on one peering object (``--peering alpajob``): the one of the
    higher priority reconciles, the other waits (kopf's pause) and still answers the
    webhook; once the first is killed (SIGKILL: no goodbye) the second takes over within
    a peer's lifetime and restarts the job."""
    from e2e_cluster import apply_documents, shipped_rbac

    from alpajob.operator.main import PEER_LIFETIME
    from alpajob.trainer_image.distributed.loopback import free_port

    refused = getattr(emulator, "forbidden", [])
    refused.clear()
    apply_documents(cluster.api, [d for d in shipped_rbac("peering.yaml") if d["kind"] == "CustomResourceDefinition"])
    cluster.custom.create_namespaced_custom_object("kopf.dev", "v1", cluster.ns, "kopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "alpajob", "namespace": cluster.ns}})
    replicas = []
    for name, priority in (("leader", 200), ("follower", 100)):
        op = Operator(emulator, tmp_path / f"{name}.log", cluster.ns)
        op.args = ["--peering", "alpajob", "--priority", str(priority), "--webhook-port", str(free_port()),
                   "--webhook-insecure"]
        op.start()
        replicas.append(op)
    leader, follower = replicas
    try:
        cluster.create_job("gpt-l", runPolicy={"backoffLimit": 2, "restartScope": "Job"})
        cluster.run_planner("gpt-l", tmp_path)
        _to_running(cluster, leader, "gpt-l", tmp_path)
        # Both are on the peering object, and the follower is paused: kopf starts paused
        # under a peering and says "Resuming" once it may act (as the leader did at once);
        # a follower that started first resumed, then paused when the leader came.
        peering = lambda: cluster.custom.get_namespaced_custom_object(  # noqa: E731
            "kopf.dev", "v1", cluster.ns, "kopfpeerings", "alpajob").get("status") or {}
        _wait("both replicas on the peering object",
              lambda: sorted(p.get("priority") for p in peering().values()) == [100, 200], op=follower)
        assert "Resuming operations" in leader.log.read_text()
        states = re.findall(r"(Pausing|Resuming) operations", follower.log.read_text())
        assert states in ([], ["Resuming", "Pausing"]), f"the follower is not paused: {states}"
        from test_crd import BASE

        port = follower.args[follower.args.index("--webhook-port") + 1]
        assert _review(f"http://127.0.0.1:{port}/validate-alpajob", BASE)["allowed"] is True  # paused, yet serving
        leader.kill()
        killed = time.monotonic()
        cluster.set_phase("gpt-l-0-m1-h0", "Failed")
        _wait("the follower restarting the job", lambda: "gpt-l-1-head" in cluster.pods("gpt-l"),
              timeout=PEER_LIFETIME + 45, op=follower)
        taken_over = time.monotonic() - killed
        print(f"\nthe follower took over {taken_over:.1f} s after the leader was killed")
        assert "Resuming operations after the pause" in follower.log.read_text()
        assert taken_over < PEER_LIFETIME + 15, "the follower took over more than a peer's lifetime late"
    finally:
        for op in replicas:
            op.stop()
    assert refused == [], "the shipped RBAC refused what a replica asked"


def test_suspend_and_resume(cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    cluster.create_job("gpt-c")
    cluster.run_planner("gpt-c", tmp_path)
    _to_running(cluster, operator, "gpt-c", tmp_path)
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "gpt-c",
                                                  {"spec": {"runPolicy": {"suspend": True}}})
    _wait("phase Suspended", lambda: cluster.phase("gpt-c") == "Suspended", op=operator)
    _wait("no pods running while suspended", lambda: cluster.running("gpt-c") == set(), op=operator)
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "gpt-c",
                                                  {"spec": {"runPolicy": {"suspend": False}}})
    _to_running(cluster, operator, "gpt-c", tmp_path, attempt=1)
    assert cluster.job("gpt-c")["status"]["restarts"] == 0  # a resume is not a failure


@pytest.mark.slow
def test_deleting_the_job_stops_the_operator_acting_on_it(cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    uid = cluster.create_job("gpt-d")["metadata"]["uid"]
    cluster.run_planner("gpt-d", tmp_path)
    pods = _wait("the pods", lambda: len(cluster.pods("gpt-d")) == 4 and cluster.pods("gpt-d"), op=operator)  # the planner too
    children = [*pods.values(), cluster.core.read_namespaced_config_map("gpt-d-plan", cluster.ns),
                cluster.core.read_namespaced_config_map("gpt-d-config", cluster.ns),
                cluster.core.read_namespaced_service("gpt-d-head", cluster.ns)]
    for child in children:  # what makes the API server's garbage collector delete them
        ref = child.metadata.owner_references[0]
        assert (ref.kind, ref.name, ref.uid, ref.controller) == ("AlpaJob", "gpt-d", uid, True)
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "gpt-d")

    def gone() -> bool:
        try:
            cluster.job("gpt-d")
        except client.ApiException as error:
            return error.status == 404
        return False

    _wait("the job gone (kopf releases its finalizer once the daemon stops)", gone, op=operator)
    if getattr(cluster.emu, "real", False):
        return  # what follows counts the test API server's requests
    time.sleep(1.0)  # a pass that read the job just before it went may still be answered
    posts = cluster.emu.requests("POST", f"/namespaces/{cluster.ns}/pods")
    patches = cluster.emu.requests("PATCH", "/alpajobs/gpt-d")
    time.sleep(2.0)  # several reconcile intervals: nothing more may happen to it
    assert cluster.emu.requests("POST", f"/namespaces/{cluster.ns}/pods") == posts
    assert cluster.emu.requests("PATCH", "/alpajobs/gpt-d") == patches


@pytest.mark.slow
@pytest.mark.slim_operator
def test_an_operator_killed_mid_way_creates_no_duplicates(cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    """Killed (SIGKILL) after the planner pod and again while making the attempt's pods:
    each pod is created once. The operator runs as its image runs it: no JAX, Ray or
    NumPy installed (:func:`slim_python`)."""
    emulator_only(cluster.emu, "every pod creation it was asked")
    cluster.create_job("gpt-e")
    _wait("the planner pod", lambda: "gpt-e-planner" in cluster.pods("gpt-e"), op=operator)
    operator.kill()
    operator.start()
    cluster.run_planner("gpt-e", tmp_path)
    _wait("the head pod", lambda: "gpt-e-0-head" in cluster.pods("gpt-e"), op=operator)
    operator.kill()  # possibly half-way through creating the mesh pods
    operator.start()
    _to_running(cluster, operator, "gpt-e", tmp_path)
    created = [r.data["metadata"]["name"] for r in list(cluster.emu.kmock)
               if r.method.upper() == "POST" and "/pods" in str(r.url) and isinstance(r.data, dict)
               and r.data.get("metadata", {}).get("name", "").startswith("gpt-e-")]
    assert sorted(created) == sorted(set(created)), f"created twice: {created}"
    assert set(created) == {"gpt-e-planner", "gpt-e-0-head", "gpt-e-0-m0-h0", "gpt-e-0-m1-h0"}


#: A cluster administrator, as an AdmissionReview names the requester.
ADMIN_INFO = {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]}


def _review(url: str, body: dict[str, Any], old: dict[str, Any] | None = None,
            user: dict[str, Any] | None = None) -> dict[str, Any]:
    """Send one AdmissionReview, as the API server would, and return its response."""
    import json
    import urllib.request

    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "review-1", "kind": {"group": GROUP, "version": VERSION, "kind": "AlpaJob"},
        "resource": {"group": GROUP, "version": VERSION, "resource": PLURAL},
        "namespace": REVIEW_NS, "name": body["metadata"].get("name"),
        "operation": "UPDATE" if old else "CREATE", "object": body, "oldObject": old,
        "userInfo": user or ADMIN_INFO, "dryRun": False}}
    request = urllib.request.Request(url, json.dumps(review).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())["response"]


def test_the_webhook_refuses_bad_specs_naming_the_field(emulator: Emulator, tmp_path: Path) -> None:
    """Through kopf's webhook server (plain HTTP here): every bad spec the webhook can
    judge, the immutable fields on update, and a good spec admitted."""
    from test_crd import BASE, CRD_REFUSES, IMMUTABLE, WEBHOOK_REFUSES, changed

    from alpajob.trainer_image.distributed.loopback import free_port

    port = free_port()
    op = Operator(emulator, tmp_path / "operator.log", REVIEW_NS)
    op.args = ["--webhook-port", str(port), "--webhook-insecure"]
    op.start()
    try:
        url = f"http://127.0.0.1:{port}/validate-alpajob"

        def up() -> bool:
            try:
                return bool(_review(url, BASE)["allowed"])
            except OSError:
                return False

        _wait("the webhook serving", up, op=op)
        cases = [(f, p, v) for f, p, v, webhook in CRD_REFUSES if webhook] + WEBHOOK_REFUSES
        assert len(cases) >= 30
        for field, path, value in cases:
            answer = _review(url, changed(BASE, path, value))
            assert answer["allowed"] is False, (path, value)
            assert field in answer["status"]["message"], (field, answer["status"]["message"])
        for field, path, value in IMMUTABLE:
            answer = _review(url, changed(BASE, path, value), old=BASE)
            assert answer["allowed"] is False and field in answer["status"]["message"], (field, answer)
        # The largest AlpaJob etcd stores (about 1.5 MiB: here long env values in the pod
        # template, and kubectl's last-applied annotation): its updates, a change of spec
        # and a finalizer's removal (how it is deleted), are judged, not refused unread.
        env = [{"name": f"SETTING_{i}", "value": "x" * 9000} for i in range(110)]
        big = changed(BASE, "spec.podTemplate", {"mesh": {"env": env}})
        big["metadata"]["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": "y" * 250_000}
        assert len(json.dumps(big)) > 1_200_000
        grown = changed(big, "spec.podTemplate", {"mesh": {"env": [*env, {"name": "MORE", "value": "1"}]}})
        assert _review(url, grown, old=big)["allowed"] is True
        going = {**big, "metadata": {**big["metadata"], "finalizers": [], "deletionTimestamp": "2026-12-02T10:00:00Z"}}
        assert _review(url, going, old=big)["allowed"] is True
    finally:
        op.stop()


def test_with_the_webhook_called_as_the_api_server_calls_it_a_job_runs_suspends_and_deletes(
        emulator: Emulator, cluster: Cluster, tmp_path: Path) -> None:
    """F1 and F2 end to end: the test API server calls the operator's webhook on every
    AlpaJob write, with the whole object (status and finalizers) as kube-apiserver does.
    The job's status writes, kopf's finalizer, a suspend and the deletion all pass;
    a change of an immutable field is refused naming it."""
    emulator_only(emulator, "it calls the webhook by its URL; a real cluster calls it through its "
                            "registration: run the operator with --webhook-managed there")
    from alpajob.trainer_image.distributed.loopback import free_port

    port = free_port()
    op = Operator(emulator, tmp_path / "operator.log", cluster.ns)
    op.args = ["--webhook-port", str(port), "--webhook-insecure"]
    op.start()
    url = f"http://127.0.0.1:{port}/validate-alpajob"
    try:
        from test_crd import BASE

        _wait("the webhook serving", lambda: _serving(url, BASE), op=op)
        emulator.webhook = url
        with pytest.raises(client.ApiException) as refused:  # the webhook judges creations
            cluster.create_job("gpt-w0", model={"zoo": "gpt", "config": "no-such-size"})
        assert refused.value.status == 422 and "spec.model.config" in refused.value.body
        # Creating an AlpaJob is creating pods: a user who may create AlpaJobs but not
        # pods in the namespace is refused (the webhook asks the API server's RBAC).
        from e2e_cluster import apply_documents

        apply_documents(cluster.api, [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "alice", "namespace": cluster.ns}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "alpajob-author", "namespace": cluster.ns},
             "rules": [{"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["create", "get"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "alice", "namespace": cluster.ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "alpajob-author"},
             "subjects": [{"kind": "ServiceAccount", "name": "alice", "namespace": cluster.ns}]}])
        alice = client.CustomObjectsApi(emulator.api(account_token(cluster.api, cluster.ns, "alice")))
        job = yaml.safe_load((EXAMPLES / "manual-gpt.yaml").read_text())
        job["metadata"] = {"name": "gpt-alice", "namespace": cluster.ns}
        with pytest.raises(client.ApiException) as not_allowed:
            alice.create_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, job)
        assert not_allowed.value.status == 403
        assert f"system:serviceaccount:{cluster.ns}:alice may not create pods in namespace {cluster.ns}" \
            in not_allowed.value.body
        cluster.create_job("gpt-w")
        cluster.run_planner("gpt-w", tmp_path)
        _to_running(cluster, op, "gpt-w", tmp_path)
        _wait("kopf's finalizer, added through the webhook",
              lambda: FINALIZER in (cluster.job("gpt-w")["metadata"].get("finalizers") or []), op=op)
        with pytest.raises(client.ApiException) as immutable:
            cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "gpt-w",
                                                          {"spec": {"training": {"steps": 7}}})
        assert immutable.value.status == 422 and "spec.training" in immutable.value.body
        cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "gpt-w",
                                                      {"spec": {"runPolicy": {"suspend": True}}})
        _wait("phase Suspended", lambda: cluster.phase("gpt-w") == "Suspended", op=op)
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "gpt-w")

        def gone() -> bool:
            try:
                cluster.job("gpt-w")
            except client.ApiException as error:
                return error.status == 404
            return False

        _wait("the job gone: kopf removed its finalizer through the webhook", gone, op=op)
    finally:
        emulator.webhook = None
        op.stop()
    reviews = [r for r in emulator.kmock if "alpajobs/gpt-w" in str(r.url) and r.method.upper() == "PATCH"]
    assert any("status" in str(r.url) for r in reviews)  # status writes were reviewed too


def _serving(url: str, body: dict[str, Any]) -> bool:
    try:
        return bool(_review(url, body)["allowed"])
    except OSError:
        return False


@pytest.mark.slow
def test_a_model_that_cannot_fit_the_pool_fails_with_the_planners_message(
        cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    cluster.create_job("gpt-f", model={"zoo": "gpt", "config": "1.3b"},
                       training={"globalBatchSize": 1024, "dtype": "float16"},
                       cluster={"gpu": "v100-16gb", "nodes": 1, "gpusPerNode": 1},
                       parallelism={"method": "auto"})
    cluster.run_planner("gpt-f", tmp_path, succeeds=False)
    _wait("phase Failed", lambda: cluster.phase("gpt-f") == "Failed", op=operator)
    failed = _condition(cluster, "gpt-f", "Failed")
    assert failed["reason"] == "PlanningFailed" and "GiB per device" in failed["message"]
    events = [(e.type, e.reason, e.message) for e in cluster.core.list_namespaced_event(cluster.ns).items
              if e.involved_object.name == "gpt-f"]
    assert any(t == "Warning" and r == "PlanningFailed" and "GiB per device" in m for t, r, m in events)
    assert set(cluster.pods("gpt-f")) <= {"gpt-f-planner"}  # nothing else was started


def test_with_volcano_installed_the_pod_group_comes_before_the_pods(
        emulator: Emulator, cluster: Cluster, tmp_path: Path) -> None:
    """Volcano's PodGroup CRD installed: the attempt's PodGroup (every pod of the job as
    minMember) is created through the API before any pod, and the pods join it."""
    emulator_only(emulator, "declares Volcano's resource in kmock, and reads the order of its requests")
    import kmock

    emulator.kmock.resources["scheduling.volcano.sh/v1beta1/podgroups"] = kmock.ResourceInfo(
        kind="PodGroup", namespaced=True, verbs={"get", "list", "watch", "create", "delete"})
    extensions = client.ApiextensionsV1Api(cluster.api)
    extensions.create_custom_resource_definition({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "podgroups.scheduling.volcano.sh"},
        "spec": {"group": "scheduling.volcano.sh", "scope": "Namespaced",
                 "names": {"plural": "podgroups", "kind": "PodGroup"},
                 "versions": [{"name": "v1beta1", "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": {"type": "object"}}}]}})
    op = Operator(emulator, tmp_path / "operator.log", cluster.ns)
    op.start()
    try:
        cluster.create_job("gpt-g", scheduling={"queue": "research"})
        cluster.run_planner("gpt-g", tmp_path)
        attempt = {"gpt-g-0-head", "gpt-g-0-m0-h0", "gpt-g-0-m1-h0"}
        _wait("the pods", lambda: attempt <= set(cluster.pods("gpt-g")), op=op)
        group = cluster.custom.get_namespaced_custom_object(
            "scheduling.volcano.sh", "v1beta1", cluster.ns, "podgroups", "gpt-g-0")
        assert group["spec"]["minMember"] == 3 and group["spec"]["queue"] == "research"
        assert group["metadata"]["ownerReferences"][0]["uid"] == cluster.job("gpt-g")["metadata"]["uid"]
        order = [str(r.url) for r in list(emulator.kmock) if r.method.upper() == "POST"
                 and ("/podgroups" in str(r.url) or "/pods" in str(r.url))
                 and isinstance(r.data, dict) and r.data["metadata"]["name"].startswith("gpt-g-0")]
        assert "/podgroups" in order[0]
        for name, pod in cluster.pods("gpt-g").items():
            if name not in attempt:
                continue  # the planner pod is no member of the gang
            assert pod.spec.scheduler_name == "volcano"
            assert pod.metadata.annotations["scheduling.k8s.io/group-name"] == "gpt-g-0"
    finally:
        op.stop()
        extensions.delete_custom_resource_definition("podgroups.scheduling.volcano.sh")


def test_a_forbidden_pod_shows_as_a_condition_and_an_event_and_is_retried(
        cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    """The API server refuses the planner pod (its ServiceAccount does not exist: 403).
    The job says so, ChildrenCreated=False with the API's reason and message and a
    FailedCreate Warning event, instead of sitting in Planning; once the account
    exists, the next (backed-off) try creates the pod and the condition turns True."""
    cluster.create_job("gpt-sa", serviceAccountName="no-such-sa")

    def refused() -> dict[str, Any] | None:
        conditions = (cluster.job("gpt-sa").get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "ChildrenCreated" and c["status"] == "False"), None)

    condition = _wait("ChildrenCreated=False", refused, op=operator)
    assert condition["reason"] == "Forbidden"
    assert 'serviceaccount "no-such-sa" not found' in condition["message"]
    assert "gpt-sa-planner" in condition["message"]
    events = [e for e in cluster.core.list_namespaced_event(cluster.ns).items
              if e.involved_object.name == "gpt-sa" and e.reason == "FailedCreate"]
    assert events and events[0].type == "Warning" and "no-such-sa" in events[0].message
    assert "gpt-sa-planner" not in cluster.pods("gpt-sa")
    cluster.core.create_namespaced_service_account(cluster.ns, {"apiVersion": "v1", "kind": "ServiceAccount",
                                                        "metadata": {"name": "no-such-sa", "namespace": cluster.ns}})
    _wait("the planner pod", lambda: cluster.pods("gpt-sa").get("gpt-sa-planner"), op=operator)

    def created() -> bool:
        conditions = (cluster.job("gpt-sa").get("status") or {}).get("conditions") or []
        return any(c["type"] == "ChildrenCreated" and c["status"] == "True" for c in conditions)

    _wait("ChildrenCreated=True", created, op=operator)
    fails = [e for e in cluster.core.list_namespaced_event(cluster.ns).items
             if e.involved_object.name == "gpt-sa" and e.reason == "FailedCreate"]
    assert len(fails) <= 8  # backed off: 0.3 s doubling, not a try every 0.3 s


def test_the_test_api_server_refuses_what_a_real_one_refuses(cluster: Cluster) -> None:
    """The fixture's admission can fail: a plain pod in the restricted namespace, and a
    pod of a missing ServiceAccount, are refused with 403 and not stored."""
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": cluster.ns},
             "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    with pytest.raises(client.ApiException) as refused:
        cluster.core.create_namespaced_pod(cluster.ns, plain)
    assert refused.value.status == 403
    assert 'violates PodSecurity "restricted:latest"' in json.loads(refused.value.body)["message"]
    orphan = {**plain, "metadata": {"name": "orphan", "namespace": cluster.ns},
              "spec": {**plain["spec"], "serviceAccountName": "nobody"}}
    with pytest.raises(client.ApiException) as missing:
        cluster.core.create_namespaced_pod(cluster.ns, orphan)
    assert missing.value.status == 403
    assert 'serviceaccount "nobody" not found' in json.loads(missing.value.body)["message"]
    unknown = {**plain, "metadata": {"name": "unranked", "namespace": cluster.ns},
               "spec": {**plain["spec"], "priorityClassName": "no-such-class"}}
    with pytest.raises(client.ApiException) as unranked:  # the Priority admission plugin
        cluster.core.create_namespaced_pod(cluster.ns, unknown)
    assert unranked.value.status == 403
    assert "no PriorityClass with name no-such-class was found" in json.loads(unranked.value.body)["message"]
    names = {p.metadata.name for p in cluster.core.list_namespaced_pod(cluster.ns).items}
    assert not names & {"plain", "orphan", "unranked"}


def test_a_pod_held_by_a_finalizer_is_deleted_as_a_real_api_server_records_it(cluster: Cluster) -> None:
    """A pod with a finalizer (Kueue's, on the pods it manages) is not removed by a
    delete: it gets ``deletionTimestamp`` (RFC 3339) and, with no kubelet to wait for,
    ``deletionGracePeriodSeconds`` 0, and goes once its last finalizer is removed."""
    emulator_only(cluster.emu, "a real API server needs no proof of its own deletions")
    held = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "held", "namespace": cluster.ns, "finalizers": ["example.com/hold"]},
            "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {
                "runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}}]}}
    cluster.core.create_namespaced_pod(cluster.ns, held)
    cluster.core.delete_namespaced_pod("held", cluster.ns)
    meta = json.loads(cluster.core.read_namespaced_pod("held", cluster.ns, _preload_content=False).data)["metadata"]
    assert meta["deletionGracePeriodSeconds"] == 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["deletionTimestamp"]), meta
    cluster.core.patch_namespaced_pod("held", cluster.ns, {"metadata": {"finalizers": None}})
    _wait("the pod gone", lambda: "held" not in {p.metadata.name for p in cluster.core.list_namespaced_pod(cluster.ns).items})


def test_the_test_api_server_prunes_undeclared_fields_as_a_real_one_does(cluster: Cluster) -> None:
    """Observed on kube-apiserver 1.36: a status PATCH with fields the CRD does not
    declare answers 200 and keeps only the declared ones (then ``progress.steps``, now
    declared, was dropped and ``progress.step`` kept); so does the fixture."""
    created = cluster.create_job("gpt-prune", undeclaredSpecField=True)
    assert "undeclaredSpecField" not in created["spec"]
    answer = cluster.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, cluster.ns, PLURAL, "gpt-prune",
        {"status": {"undeclaredField": 1, "progress": {"step": 3, "undeclaredToo": 9}}})
    assert answer["status"] == {"progress": {"step": 3}}
    assert cluster.job("gpt-prune")["status"] == {"progress": {"step": 3}}
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "gpt-prune")


def test_the_test_api_server_refuses_updates_a_real_one_refuses(cluster: Cluster) -> None:
    """Seen on kube-apiserver: a PUT without resourceVersion is 422 ("must be specified
    for an update"), one with an old version 409, one with the current version
    replaces the object whole (a key it leaves out is gone) under a new version; a
    merge patch naming an old version is 409 too."""
    made = cluster.core.create_namespaced_config_map(
        cluster.ns, {"metadata": {"name": "cm"}, "data": {"a": "1", "b": "2"}})
    first = made.metadata.resource_version
    with pytest.raises(client.ApiException) as unversioned:
        cluster.core.replace_namespaced_config_map("cm", cluster.ns, {"metadata": {"name": "cm"}, "data": {"a": "3"}})
    assert unversioned.value.status == 422
    assert "must be specified for an update" in json.loads(unversioned.value.body)["message"]
    replaced = cluster.core.replace_namespaced_config_map(
        "cm", cluster.ns, {"metadata": {"name": "cm", "resourceVersion": first}, "data": {"a": "3"}})
    assert replaced.data == {"a": "3"} and replaced.metadata.resource_version != first
    assert replaced.metadata.uid == made.metadata.uid
    for stale in (lambda: cluster.core.replace_namespaced_config_map(
            "cm", cluster.ns, {"metadata": {"name": "cm", "resourceVersion": first}, "data": {"a": "4"}}),
                  lambda: cluster.core.patch_namespaced_config_map(
            "cm", cluster.ns, {"metadata": {"resourceVersion": first}, "data": {"a": "5"}})):
        with pytest.raises(client.ApiException) as conflict:
            stale()
        assert conflict.value.status == 409
        assert "the object has been modified" in json.loads(conflict.value.body)["message"]
    assert cluster.core.read_namespaced_config_map("cm", cluster.ns).data == {"a": "3"}
    with pytest.raises(client.ApiException) as missing:
        cluster.core.replace_namespaced_config_map(
            "gone", cluster.ns, {"metadata": {"name": "gone", "resourceVersion": first}, "data": {}})
    assert missing.value.status == 404




def test_the_test_kubelet_renews_node_leases_as_a_real_kubelet_does(
        emulator: Emulator, cluster: Cluster, tmp_path: Path) -> None:
    """The tests' kubelet keeps its nodes' Leases as a real kubelet does (read, then
    update at the version read), so a real API server, which refuses an update
    without a version, keeps the fake nodes Ready: every beat moves renewTime on."""
    from kubelet import Kubelet

    nodes = frozenset(getattr(emulator, "nodes", None) or ["node-0", "node-1"])
    kubelet = Kubelet(emulator.api(), cluster.ns, tmp_path / "kubelet", nodes=nodes)
    leases = client.CoordinationV1Api(emulator.api())
    renewed = []
    for _ in range(3):
        kubelet._heartbeat()
        renewed.append({n: leases.read_namespaced_lease(n, "kube-node-lease").spec.renew_time for n in nodes})
        time.sleep(0.01)
    for node in nodes:
        assert renewed[0][node] < renewed[1][node] < renewed[2][node], renewed


def test_gitops_tools_read_every_status_the_operator_wrote(seen: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Runs last: every (job, phase) the tests above read back from the operator's own
    run is judged by Argo CD's Lua check (real Lua), Flux's CEL expressions and
    kstatus's rules. ``ALPAJOB_CAPTURE_GITOPS=1`` also writes them into the Argo CD
    check's testdata (``e2e-*.yaml``), where ``health_test.yaml`` lists them."""
    phases = {phase for _, phase in seen}
    assert {"Planning", "Running", "Succeeded", "Failed", "Suspended"} <= phases, phases
    for (name, phase), job in sorted(seen.items()):
        if phase == "(no status)":
            continue
        status = job["status"]
        if status.get("observedGeneration") != job["metadata"]["generation"]:
            argo, flux = "Progressing", "InProgress"  # a spec edit the operator has not seen yet
        else:
            argo, flux = VERDICTS[phase]
        health = argocd_health(job)
        assert health["status"] == argo, (name, phase, health)
        deleting = bool(job["metadata"].get("deletionTimestamp"))  # read while being deleted
        assert (flux_health(job), kstatus(job)) == (flux, "Terminating" if deleting else flux), (name, phase)
        if phase == "Failed":
            failed = next(c for c in status["conditions"] if c["type"] == "Failed")
            assert health["message"] == failed["message"] != ""
        if os.environ.get("ALPAJOB_CAPTURE_GITOPS"):
            job["metadata"].pop("managedFields", None)
            out = ARGOCD / "testdata" / f"e2e-{name}-{phase.lower()}.yaml"
            out.write_text(yaml.safe_dump(job, sort_keys=False))


def test_liveness_fails_once_the_api_server_is_gone(tmp_path: Path) -> None:
    """``/healthz`` answers 200 while the API server answers, and 500 once it has been
    silent for ``--liveness-api-timeout`` (kopf alone kept answering 200 on a real
    cluster while it could not connect); the Deployment's probe then restarts it."""
    import urllib.error
    import urllib.request

    from alpajob.trainer_image.distributed.loopback import free_port

    emu = Emulator(tmp_path / "api")
    (tmp_path / "api").mkdir()
    emu.start()
    op = Operator(emu, tmp_path / "operator.log", "default")
    port = free_port()
    op.args = ["--liveness", f"http://127.0.0.1:{port}/healthz", "--liveness-api-timeout", "2"]
    op.start()

    def status() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
                return answer.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return 0

    try:
        assert _wait("a healthy probe", lambda: status() == 200, op=op)
        emu.stop()  # the API server is gone
        _wait("the probe failing", lambda: status() == 500, timeout=60, op=op)
        assert op.proc is not None and op.proc.poll() is None  # alive, but says it is not well
    finally:
        op.stop()


def test_an_unschedulable_planner_pod_shows_why_within_seconds(cluster: Cluster, operator: Operator) -> None:
    """The scheduler's verdict on a pod (``PodScheduled=False``, reason Unschedulable,
    as a real scheduler writes it; here the test plays the scheduler) reaches the job
    within seconds: the condition PodsScheduled=False with the scheduler's message, the
    phase's reason, and a Warning event; not a silent Planning."""
    emulator_only(cluster.emu, "a real scheduler places the pod on the fake nodes")
    cluster.create_job("gpt-u")
    _wait("the planner pod", lambda: "gpt-u-planner" in cluster.pods("gpt-u"), op=operator)
    why = "0/2 nodes are available: 2 Insufficient cpu. preemption: 0/2 nodes are available"
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cluster.set_phase("gpt-u-planner", "Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why,
         "lastTransitionTime": since}])
    began = time.monotonic()

    def explained() -> dict[str, Any] | None:
        conditions = (cluster.job("gpt-u").get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "PodsScheduled" and c["status"] == "False"), None)

    condition = _wait("PodsScheduled=False", explained, timeout=30, op=operator)
    assert time.monotonic() - began < 15  # the 5 s grace, then the next pass
    assert "Insufficient cpu" in condition["message"] and "spec.podTemplate.planner" in condition["message"]
    reconciling = _condition(cluster, "gpt-u", "Reconciling")
    assert reconciling["reason"] == "Unschedulable" and "Insufficient cpu" in reconciling["message"]
    _wait("the Warning event", lambda: any(
        e.reason == "Unschedulable" and e.type == "Warning" for e in cluster.core.list_namespaced_event(cluster.ns).items
        if e.involved_object.name == "gpt-u"), op=operator)
