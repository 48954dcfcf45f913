"""`kubectl apply` to a trained model, every pod a real container of the project's image.

The closest thing to a real node this machine allows: the trainer image is built from
``trainer_image/Dockerfile`` (a CPU build on a local Debian base, by buildah:
``containers.py``), and the test kubelet runs each pod the operator makes as a runc
container of it, as uid 1000 with the pod's volumes, env, memory-backed /dev/shm and
memory limit, and its fsGroup on the volumes; all pods start at once, as a real
kubelet starts them (no stagger). The API server is the test's (KMock, with graceful
pod deletion and namespaces), the operator a process. Nothing is done by hand: no
claim made, no fix applied.

Slow (the first image build takes several minutes, each job a few): run with
``python -m pytest -m slow tests/test_pods_containers.py`` as root on a machine with
``runc``, ``buildah`` and ``debootstrap`` (``apt-get install runc buildah debootstrap``);
skipped elsewhere, saying why.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from containers import OPERATOR_IMAGE, Image, Runtime, available, build_image, run_in
from e2e_cluster import operator_kubeconfig, operator_process, unique_namespace
from kube_emulator import Emulator
from kubelet import Kubelet
from kubernetes import client
from packaging.utils import canonicalize_name

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=str(available()))]

ROOT = Path(__file__).resolve().parent.parent
GROUP, VERSION, PLURAL = "alpajob.io", "v1alpha1", "alpajobs"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    log = tmp_path_factory.mktemp("image") / "build.log"
    began = time.monotonic()
    built = build_image(log)
    print(f"\nimage built and mounted in {time.monotonic() - began:.0f} s")
    return built


def _world(image: Image, tmp_path: Path, fs_group: bool) -> Iterator[tuple[Emulator, Kubelet, Path, str]]:
    (tmp_path / "api").mkdir()
    emu = Emulator(tmp_path / "api", graceful_pods=True).start()
    ns = unique_namespace("ml")
    emu.cluster_of(ns, nodes=1)
    env = {"KUBECONFIG": str(emu.kubeconfig)}
    runtime = Runtime(image, Path("/var/tmp/alpajob-images/pods") / tmp_path.name)
    kubelet = Kubelet(emu.api(), ns, tmp_path / "kubelet", env=env, runtime=runtime, fs_group=fs_group).start()
    log = tmp_path / "operator.log"
    # The operator as its own ServiceAccount, with the shipped RBAC (a missing verb: a 403).
    as_operator = {"KUBECONFIG": str(operator_kubeconfig(emu, tmp_path, ns))}
    try:
        with operator_process(ns, as_operator, log):
            yield emu, kubelet, log, ns
        assert emu.forbidden == [], "the shipped RBAC refused what the operator or a pod asked"
    finally:
        kubelet.stop()
        emu.stop()


@pytest.fixture
def world(image: Image, tmp_path: Path) -> Iterator[tuple[Emulator, Kubelet, Path, str]]:
    yield from _world(image, tmp_path, fs_group=True)


@pytest.fixture
def root_owned_volumes(image: Image, tmp_path: Path) -> Iterator[tuple[Emulator, Kubelet, Path, str]]:
    """Volumes that ignore fsGroup (hostPath, NFS): owned by root, as on the real node."""
    yield from _world(image, tmp_path, fs_group=False)


def _readme_job(name: str, ns: str, steps: int) -> dict[str, Any]:
    """The README's job, as written (its data in the image's own standard library), with
    fewer steps and checkpoints on a claim the operator makes."""
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "text-gpt.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": ns}
    doc["spec"]["training"].update(steps=steps, evalEvery=steps // 2)
    doc["spec"]["checkpoint"] = {"volumeClaimTemplate": {"size": "1Gi"}, "intervalSteps": 10}
    return doc


def _wait(what: str, check: Callable[[], Any], kubelet: Kubelet, log: Path, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1.0)
    folder = kubelet.root / "pods"
    names = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    pods = "\n".join(f"--- {name}\n{kubelet.log(name)[-2500:]}" for name in names)
    raise AssertionError(f"timed out waiting for {what}\nkubelet errors: {kubelet.errors}\n"
                         f"operator:\n{log.read_text()[-2000:]}\n{pods}")


def _inside(kubelet: Kubelet, pod: str, command: str) -> str:
    """``command`` run inside pod ``pod``'s container (``runc exec``, as ``kubectl exec``)."""
    box = kubelet.pods[pod].boxed
    return subprocess.run(["runc", "exec", box.name, "sh", "-c", command], capture_output=True, text=True,
                          timeout=60, check=True).stdout


def ray_agent(token: str, timeout: float = 120.0) -> str:
    """``host:port`` of the head's dashboard agent, as the job's GCS tells it to a client
    with the job's token, once the head's node is up with its agent and its Ray Client
    server (a process the head starts after the node) listens."""
    import socket

    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", 10001), timeout=1).close()
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError("the head's Ray Client server never listened") from None
            time.sleep(1.0)
            continue
        with grpc.insecure_channel("127.0.0.1:6379") as channel:
            try:
                nodes = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetAllNodeInfo(
                    gcs_service_pb2.GetAllNodeInfoRequest(), timeout=10,
                    metadata=[("authorization", f"Bearer {token}")]).node_info_list
                head = next((n for n in nodes if n.is_head_node and n.dashboard_agent_listen_port), None)
                if head is not None:
                    return f"{head.node_manager_address}:{head.dashboard_agent_listen_port}"
            except grpc.RpcError:
                pass
        if time.monotonic() > deadline:
            raise AssertionError("the head's GCS never named its dashboard agent")
        time.sleep(1.0)


def ray_answers(token: str | None, agent: str | None) -> dict[str, str]:
    """What the job's Ray answers a client that reaches its ports with ``token`` (None:
    no token): the GCS (a gRPC call, as ``ray.init`` makes first), the head's dashboard
    agent at ``agent`` (the job-submission API that runs any command; None: not asked),
    Ray Client (its first call).
    The client is this test's process: every pod of the test shares the loopback
    address, so it stands where another job's pod stands on a real pod network."""
    import urllib.error
    import urllib.request

    import grpc
    from ray.core.generated import (
        gcs_service_pb2,
        gcs_service_pb2_grpc,
        ray_client_pb2,
        ray_client_pb2_grpc,
    )

    metadata = [("authorization", f"Bearer {token}")] if token else None
    answers: dict[str, str] = {}
    with grpc.insecure_channel("127.0.0.1:6379") as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=10, metadata=metadata)
            answers["gcs"] = "OK"
        except grpc.RpcError as error:
            answers["gcs"] = error.code().name
    with grpc.insecure_channel("127.0.0.1:10001") as channel:
        try:
            ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
                ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING), timeout=10,
                metadata=metadata)
            answers["client"] = "OK"
        except grpc.RpcError as error:
            answers["client"] = error.code().name
    if agent is None:
        return answers
    submit = urllib.request.Request(  # the exploit: a job whose entrypoint is any command
        f"http://{agent}/api/job_agent/jobs/", method="POST",
        data=json.dumps({"entrypoint": "touch /tmp/ran-by-a-stranger"}).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(submit, timeout=30) as reply:
            answers["job API"] = str(reply.status)
    except urllib.error.HTTPError as error:
        answers["job API"] = str(error.code)
    return answers


def test_the_readme_job_trains_in_containers_of_the_projects_image(world: tuple[Emulator, Kubelet, Path, str]) -> None:
    emu, kubelet, log, ns = world
    custom = client.CustomObjectsApi(emu.api())
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, _readme_job("text-gpt", ns, 30))

    def status() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "text-gpt").get("status") or {}

    head = "text-gpt-0-head"
    _wait("the job running", lambda: status().get("phase") == "Running" and head in kubelet.pods, kubelet, log, 600)
    user, shm, groups = _inside(kubelet, head, "id -u; df -B1 --output=size /dev/shm | tail -1; "
                                               "id -G").split("\n")[:3]
    assert user == "1000"
    pod = client.CoreV1Api(emu.api()).read_namespaced_pod(head, ns)
    [dshm] = [v for v in pod.spec.volumes if v.name == "dshm"]
    from kubernetes.utils import parse_quantity

    assert int(shm) == int(parse_quantity(dshm.empty_dir.size_limit))  # the plan's /dev/shm, not 64 MiB
    assert "1000" in groups.split()  # fsGroup among its groups
    # Ray is closed: without the attempt's token, or with another job's, every port
    # refuses (the job API's 401/403 before any command runs); the job's token is let in.
    import base64

    secret = client.CoreV1Api(emu.api()).read_namespaced_secret("text-gpt-0-ray", ns)
    token = base64.b64decode(secret.data["token"]).decode()
    agent = ray_agent(token)  # Ray up, its agent listening
    assert ray_answers(None, agent) == {"gcs": "UNAUTHENTICATED", "client": "UNAUTHENTICATED", "job API": "401"}
    assert ray_answers("another-jobs-token", agent) == {"gcs": "UNAUTHENTICATED", "client": "UNAUTHENTICATED",
                                                        "job API": "403"}
    assert ray_answers(token, None)["gcs"] == "OK"  # the check can pass: the job's own token is let in
    assert _inside(kubelet, head, "ls /tmp/ran-by-a-stranger 2>/dev/null; stat -c %a /var/run/alpajob/ray/token"
                   ).split() == ["440"]  # nothing ran; the token readable by the pod's user and group only
    began = time.monotonic()
    seen: dict[str, float] = {}

    def finished() -> bool:
        now = status()
        if (now.get("progress") or {}).get("step") == 30:
            seen.setdefault("last step", time.monotonic())
        return now.get("phase") in ("Succeeded", "Failed")

    _wait("the job to finish", finished, kubelet, log, 900)
    final = status()
    tail = time.monotonic() - seen.get("last step", began)
    print(f"\ntrained in containers for {time.monotonic() - began:.0f} s after Running; from the last step "
          f"to {final.get('phase')} {tail:.1f} s; status.time: {final.get('time')}; progress: {final.get('progress')}")
    assert final["phase"] == "Succeeded", final
    # tini, the head's PID 1, reaps the raylets Ray orphans: `ray stop` finds no zombie
    # to wait out its grace period for.
    assert "Stopped only" not in kubelet.log(head), kubelet.log(head)[-3000:]
    # The driver released the mesh hosts: each container stopped Ray and exited 0.
    meshes = [n for n in kubelet.started if n.startswith("text-gpt-0-m")]
    _wait("the mesh pods to end", lambda: all(n in kubelet.finished for n in meshes), kubelet, log, 60)
    assert meshes and {kubelet.finished[n] for n in meshes} == {0}, {n: kubelet.log(n)[-1500:] for n in meshes}
    progress = final["progress"]
    assert progress["step"] == 30 and progress["loss"] < math.log(256) - 0.5, progress
    assert progress["evalLoss"] < math.log(256) - 0.5, progress
    assert final["restarts"] == 0 and final["disruptions"] == 0
    checkpoints = kubelet.root / "claims" / "text-gpt-checkpoints" / "text-gpt"
    written = [p for p in checkpoints.rglob("*") if p.is_file()]
    assert written and {p.stat().st_uid for p in written} == {1000}  # written by the image's user
    assert {p.stat().st_gid for p in written} == {1000}  # the pod's fsGroup, through setgid folders


def test_a_volume_uid_1000_cannot_write_fails_the_job_in_one_line_naming_it(
        root_owned_volumes: tuple[Emulator, Kubelet, Path, str]) -> None:
    """The real node's checkpoint volume (hostPath, owned by root): the head fails at
    once with one line naming the folder, the claim and the uid; the job fails (exit 2:
    no restart helps) with the head's message first, and the head's log stays."""
    emu, kubelet, log, ns = root_owned_volumes
    custom = client.CustomObjectsApi(emu.api())
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, _readme_job("text-gpt-ro", ns, 20))

    def status() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "text-gpt-ro").get("status") or {}

    head = "text-gpt-ro-0-head"
    _wait("the head to start", lambda: head in kubelet.started, kubelet, log, 600)
    began = time.monotonic()
    _wait("the job to finish", lambda: status().get("phase") in ("Succeeded", "Failed"), kubelet, log, 900)
    print(f"\nfailed {time.monotonic() - began:.1f} s after the head started")
    final = status()
    failed = next(c for c in final["conditions"] if c["type"] == "Failed")
    assert final["phase"] == "Failed" and failed["reason"] == "PodFailurePolicy", final
    # The cause is the first line: the head wrote it to its termination log before
    # anything else ran on exit, and checked the folder before it started Ray.
    cause = "text-gpt-ro-0-head failed: error: checkpoint folder /checkpoints/text-gpt-ro"
    assert failed["message"].startswith(cause) and "\n" not in failed["message"], failed["message"]
    assert "is not writable by uid 1000" in failed["message"]
    assert "PersistentVolumeClaim text-gpt-ro-checkpoints at /checkpoints" in failed["message"]
    core = client.CoreV1Api(emu.api())
    events = [e.message for e in core.list_namespaced_event(ns).items
              if e.involved_object.name == "text-gpt-ro" and e.type == "Warning"]
    assert any(m.startswith(cause) for m in events), events
    [state] = core.read_namespaced_pod(head, ns).status.container_statuses
    assert state.state.terminated.message.startswith("error: checkpoint folder"), state.state.terminated.message
    assert "Ray runtime started" not in kubelet.log(head)  # it failed before Ray
    assert final["restarts"] == 0
    pods = {p.metadata.name for p in client.CoreV1Api(emu.api()).list_namespaced_pod(ns).items}
    assert "text-gpt-ro-0-head" in pods  # kept for `kubectl logs` (cleanPodPolicy Running)
    assert "not writable by uid 1000" in kubelet.log("text-gpt-ro-0-head")


def test_the_operator_target_runs_the_operator_without_jax_and_carries_its_sbom(tmp_path: Path) -> None:
    """``--target operator`` of the same Dockerfile, built from its lock with hashes
    checked: ``alpajob operator`` runs as uid 1000; JAX, Ray and NumPy are not there;
    its SBOM lists what its environment holds."""
    image = build_image(tmp_path / "build.log", target="operator")
    assert image.user == "1000:1000"
    assert "alpajob operator" in run_in(OPERATOR_IMAGE, ["alpajob", "operator", "--help"]).stdout
    for heavy in ("jax", "ray", "numpy"):
        missing = run_in(OPERATOR_IMAGE, ["python", "-c", f"import {heavy}"])
        assert missing.returncode == 1 and "ModuleNotFoundError" in missing.stderr, heavy
    sbom = json.loads((image.rootfs / "opt" / "alpajob" / "sbom.cdx.json").read_text())
    installed = run_in(OPERATOR_IMAGE, ["pip", "list", "--format", "json"])
    held = {canonicalize_name(p["name"]): p["version"] for p in json.loads(installed.stdout)}
    del held["alpajob"], held["pip"]  # the project itself, and the venv's own pip
    assert held == {canonicalize_name(c["name"]): c["version"] for c in sbom["components"]}

