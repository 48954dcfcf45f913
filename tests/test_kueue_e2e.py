"""End to end under Kueue: the real operator process, the test API server serving
Kueue's CRDs, and Kueue's pod webhook and controller played as Kueue specifies them
(``kueue.py``); the test plays the kubelet (pod phases), as ``test_operator_e2e`` does.

One ClusterQueue whose GPU quota fits one job: the first job is admitted as one pod
group (its planner pod never queued), the flavor Kueue assigns reaching its mesh pods;
a second waits ``Queued`` with Kueue's message until the first ends; a third of
higher priority preempts the second, which counts a disruption (not a failure),
queues again as its next attempt; the third is deleted while it runs, its group is
ended, Kueue frees its quota, and the second, admitted again, succeeds.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")
pytest.importorskip("kopf")

from kubernetes import client  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from e2e_cluster import unique_namespace  # noqa: E402
from kube_emulator import Emulator  # noqa: E402
from kueue import GATE, GROUP, VERSION, Kueue  # noqa: E402
from test_operator_e2e import Cluster, Operator, _wait  # noqa: E402

from alpajob.api.names import GPU_RESOURCE  # noqa: E402
from alpajob.cli.kubectl import main as kubectl_alpajob  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Emulator, Kueue]]:
    emu = Emulator(Path(str(tmp_path_factory.mktemp("kmock")))).start()
    kueue = Kueue(emu).install().start()
    yield emu, kueue
    kueue.stop()
    emu.stop()


def _queues(emu: Emulator, ns: str) -> dict[str, str]:
    """Two nodes of the job's pool, two GPU flavors (the first of other nodes, the
    second of these, with a toleration), a ClusterQueue whose quota fits one job's
    8 GPUs and preempts for priority, its LocalQueue ``team``, two PriorityClasses."""
    api = emu.api()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    pool = {"alpajob.io/e2e-pool": f"kueue-{ns}"}
    fast = {**pool, "alpajob.io/e2e-flavor": "fast"}
    for i in range(2):
        core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": f"kq-{ns}-{i}", "labels": {"kubernetes.io/hostname": f"kq-{ns}-{i}", **fast}},
            "status": {"allocatable": {GPU_RESOURCE: "8"}, "conditions": [{"type": "Ready", "status": "True"}]}})
    names = {"default": f"default-{ns}", "slow": f"slow-{ns}", "fast": f"fast-{ns}", "cq": f"cq-{ns}",
             "low": f"low-{ns}", "high": f"high-{ns}"}
    spot = {"key": "alpajob.io/spot", "operator": "Exists", "effect": "NoSchedule"}
    for name, spec in ((names["default"], {}), (names["slow"], {"nodeLabels": {"alpajob.io/e2e-pool": "elsewhere"}}),
                       (names["fast"], {"nodeLabels": fast, "tolerations": [spot]})):
        custom.create_cluster_custom_object(GROUP, VERSION, "resourceflavors", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor", "metadata": {"name": name}, "spec": spec})
    custom.create_cluster_custom_object(GROUP, VERSION, "clusterqueues", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterQueue", "metadata": {"name": names["cq"]},
        "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                 "resourceGroups": [
                     {"coveredResources": ["cpu", "memory"], "flavors": [
                         {"name": names["default"], "resources": [{"name": "cpu", "nominalQuota": "100"},
                                                                  {"name": "memory", "nominalQuota": "1000Gi"}]}]},
                     {"coveredResources": [GPU_RESOURCE], "flavors": [
                         {"name": names["slow"], "resources": [{"name": GPU_RESOURCE, "nominalQuota": "64"}]},
                         {"name": names["fast"], "resources": [{"name": GPU_RESOURCE, "nominalQuota": "8"}]}]}]}})
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, "localqueues", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "LocalQueue", "metadata": {"name": "team", "namespace": ns},
        "spec": {"clusterQueue": names["cq"]}})
    scheduling = client.SchedulingV1Api(api)
    for name, value in ((names["low"], 10), (names["high"], 1000)):
        scheduling.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                          "metadata": {"name": name}, "value": value})
    return names


def _gpu_job(cluster: Cluster, name: str, priority: str) -> None:
    """The manual two-stage GPT on one node of 8 GPUs (two mesh pods of 4), in ``team``."""
    cluster.create_job(name, cluster={"gpu": "v100-16gb", "nodes": 1, "gpusPerNode": 8,
                                      "nodeSelector": {"alpajob.io/e2e-pool": f"kueue-{cluster.ns}"}},
                       scheduling={"queue": "team", "priorityClassName": priority})


def _workload(cluster: Cluster, name: str) -> dict[str, Any] | None:
    try:
        return cluster.custom.get_namespaced_custom_object(GROUP, VERSION, cluster.ns, "workloads", name)
    except client.ApiException as error:
        if error.status == 404:
            return None
        raise


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def _attempt(cluster: Cluster, job: str, attempt: int) -> dict[str, Any]:
    return {n: p for n, p in cluster.pods(job).items() if n.startswith(f"{job}-{attempt}-")}


def _set_all(cluster: Cluster, job: str, attempt: int, phase: str, **extra: Any) -> None:
    for name in _attempt(cluster, job, attempt):
        cluster.set_phase(name, phase, **extra)


def test_kueue_admits_a_job_as_one_group_queues_the_next_and_preempts_for_priority(
        world: tuple[Emulator, Kueue], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    emu, kueue = world
    ns = unique_namespace("kq")
    emu.create_namespace(ns)
    kueue.manage(ns)
    names = _queues(emu, ns)
    cluster = Cluster(emu, ns)
    op = Operator(emu, tmp_path / "operator.log", ns)
    emu.forbidden.clear()
    op.start()
    try:
        # The first job: planned unqueued, then admitted as one group of three pods.
        _gpu_job(cluster, "kq-a", names["low"])
        planner = _wait("kq-a's planner", lambda: cluster.pods("kq-a").get("kq-a-planner"), op=op)
        assert not planner.spec.scheduling_gates and "kueue.x-k8s.io/queue-name" not in planner.metadata.labels
        cluster.run_planner("kq-a", tmp_path)
        workload = _wait("kq-a's Workload admitted", lambda: (w := _workload(cluster, "kq-a-0"))
                         and _condition(w, "Admitted").get("status") == "True" and w, op=op)
        # A pod set per shape (the head; each stage's mesh pods, sized by the plan), all three pods counted.
        counts = {ps["name"]: ps["count"] for ps in workload["spec"]["podSets"]}
        assert counts.pop("head") == 1 and sum(counts.values()) == 2 and all(n.startswith("mesh-") for n in counts)
        assignments = workload["status"]["admission"]["podSetAssignments"]
        meshes = [a for a in assignments if a["name"] != "head"]
        assert {a["flavors"][GPU_RESOURCE] for a in meshes} == {names["fast"]}  # slow's nodes are not the pool
        assert sum(int(a["resourceUsage"][GPU_RESOURCE]) for a in meshes) == 8  # the plan's 2 x 4 GPUs
        assert GPU_RESOURCE not in next(a for a in assignments if a["name"] == "head")["flavors"]
        pods = _wait("kq-a's pods started by Kueue", lambda: (p := _attempt(cluster, "kq-a", 0)) and len(p) == 3
                     and not any(pod.spec.scheduling_gates for pod in p.values()) and p, op=op)
        for name, pod in pods.items():
            assert pod.metadata.labels["kueue.x-k8s.io/pod-group-name"] == "kq-a-0"
            assert pod.metadata.annotations["kueue.x-k8s.io/pod-group-total-count"] == "3"
            if "-m" in name:  # the flavor's node labels and toleration reached the mesh pods
                assert pod.spec.node_selector["alpajob.io/e2e-flavor"] == "fast"
                assert any(t.key == "alpajob.io/spot" for t in pod.spec.tolerations or [])
                assert pod.spec.priority == 10
        _set_all(cluster, "kq-a", 0, "Running")
        _wait("kq-a Running", lambda: cluster.phase("kq-a") == "Running", op=op)
        admitted = _condition(cluster.job("kq-a"), "Admitted")
        assert admitted["status"] == "True" and names["cq"] in admitted["message"] and names["fast"] in admitted["message"]

        # The second waits, Queued with Kueue's reason, until the first ends.
        _gpu_job(cluster, "kq-b", names["low"])
        cluster.run_planner("kq-b", tmp_path)
        _wait("kq-b Queued", lambda: cluster.phase("kq-b") == "Queued"
              and _condition(cluster.job("kq-b"), "Admitted").get("reason") == "Pending", op=op)
        queued = _condition(cluster.job("kq-b"), "Admitted")
        assert queued["status"] == "False", queued
        # Kueue's words, pod set by pod set: the first mesh pod set's 4 GPUs do not fit.
        assert f"flavor {names['slow']} doesn't match node affinity, insufficient unused quota for {GPU_RESOURCE} " \
            f"in flavor {names['fast']}, 4 more needed" in queued["message"], queued
        assert all(pod.spec.scheduling_gates[0].name == GATE for pod in _attempt(cluster, "kq-b", 0).values())
        assert kubectl_alpajob(["--kubeconfig", str(emu.kubeconfig), "-n", ns, "pods", "kq-b"]) == 0
        shown = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("kq-b-")}
        assert shown["kq-b-0-head"][1:5] == ["*", "head", "0", "Queued"], shown  # Kueue's gate, said as such
        # Moved to a queue that does not exist, it says so in Kueue's words; moved back, it waits again.
        patch = {"spec": {"scheduling": {"queue": "nowhere"}}}
        cluster.custom.patch_namespaced_custom_object("alpajob.io", "v1alpha1", ns, "alpajobs", "kq-b", patch)
        _wait("kq-b Inadmissible", lambda: _condition(cluster.job("kq-b"), "Admitted").get("message")
              == "LocalQueue nowhere doesn't exist", timeout=30, op=op)
        assert _condition(cluster.job("kq-b"), "Admitted")["reason"] == "Inadmissible"
        patch["spec"]["scheduling"]["queue"] = "team"
        cluster.custom.patch_namespaced_custom_object("alpajob.io", "v1alpha1", ns, "alpajobs", "kq-b", patch)
        _wait("kq-b's Workload back in team", lambda: (_workload(cluster, "kq-b-0") or {}).get("spec", {})
              .get("queueName") == "team", timeout=30, op=op)
        assert cluster.phase("kq-b") == "Queued"  # still: the quota is kq-a's
        for name in _attempt(cluster, "kq-a", 0):  # the head first, then the meshes end on their own
            cluster.set_phase(name, "Succeeded")
        _wait("kq-a Succeeded", lambda: cluster.phase("kq-a") == "Succeeded", op=op)
        ended = cluster.job("kq-a")["status"]["completionTime"]
        _wait("kq-b admitted", lambda: cluster.phase("kq-b") == "Starting", op=op)
        assert _condition(cluster.job("kq-b"), "Admitted")["lastTransitionTime"] >= ended
        _set_all(cluster, "kq-b", 0, "Running")
        _wait("kq-b Running", lambda: cluster.phase("kq-b") == "Running", op=op)

        # A job of higher priority preempts it: a disruption, and kq-b queues again.
        _gpu_job(cluster, "kq-c", names["high"])
        cluster.run_planner("kq-c", tmp_path)
        _wait("kq-b preempted", lambda: cluster.job("kq-b")["status"].get("disruptions") == 1, op=op)
        job = cluster.job("kq-b")
        assert job["status"]["restarts"] == 0 and job["status"]["phase"] in ("Restarting", "Queued"), job["status"]
        stopped = [p for p in _attempt(cluster, "kq-b", 0).values()
                   if any(c.type == "TerminationTarget" for c in p.status.conditions or [])]
        assert len(stopped) == 3 and all(p.metadata.deletion_timestamp for p in stopped)
        _set_all(cluster, "kq-b", 0, "Failed")  # the kubelet stops them (SIGTERM: the head saves a checkpoint)
        _wait("kq-c admitted", lambda: cluster.phase("kq-c") == "Starting", op=op)
        _wait("kq-b's next attempt Queued", lambda: cluster.phase("kq-b") == "Queued"
              and len(_attempt(cluster, "kq-b", 1)) == 3, op=op)
        # Its first attempt's group ended (retriable-in-group=false): Kueue released its pods.
        _wait("kq-b's first attempt gone", lambda: not _attempt(cluster, "kq-b", 0), op=op)
        assert _workload(cluster, "kq-b-0") is None
        events = {e.reason for e in cluster.core.list_namespaced_event(ns).items if e.involved_object.name == "kq-b"}
        assert {"Preempted", "Queued", "Admitted"} <= events, events

        # kq-c is deleted while it runs: the operator ends its group first, so once the
        # garbage collector's deletes have stopped its pods Kueue frees the quota, and
        # kq-b is admitted again.
        _set_all(cluster, "kq-c", 0, "Running")
        _wait("kq-c Running", lambda: cluster.phase("kq-c") == "Running", op=op)
        cluster.custom.delete_namespaced_custom_object("alpajob.io", "v1alpha1", ns, "alpajobs", "kq-c")
        _wait("kq-c's group ended", lambda: (pods := _attempt(cluster, "kq-c", 0)) and all(
            (p.metadata.annotations or {}).get("kueue.x-k8s.io/retriable-in-group") == "false"
            for p in pods.values()), op=op)
        for name in _attempt(cluster, "kq-c", 0):  # the garbage collector, then the kubelet
            cluster.core.delete_namespaced_pod(name, ns)
            cluster.set_phase(name, "Failed")
        _wait("kq-c's pods released by Kueue", lambda: not _attempt(cluster, "kq-c", 0), op=op)
        _wait("kq-b admitted again", lambda: cluster.phase("kq-b") == "Starting", op=op)
        _set_all(cluster, "kq-b", 1, "Running")
        _wait("kq-b Running again", lambda: cluster.phase("kq-b") == "Running", op=op)
        _set_all(cluster, "kq-b", 1, "Succeeded")
        _wait("kq-b Succeeded", lambda: cluster.phase("kq-b") == "Succeeded", op=op)
        final = cluster.job("kq-b")["status"]
        assert (final["restarts"], final["disruptions"], final["children"]["attempt"]) == (0, 1, 1), final
        assert final["time"]["queuedSeconds"] > 0
        assert kueue.errors == []
    finally:
        op.stop()
        kueue.managed.discard(ns)
    assert emu.forbidden == [], "the shipped RBAC refused what the operator asked"
