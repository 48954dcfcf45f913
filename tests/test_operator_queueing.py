"""Kueue's part of the reconciliation (``operator/queueing.py``), pass by pass, in the
in-memory world of ``test_operator_reconcile``: the pods' group fields, Queued with
Kueue's words, admission, preemption as a disruption, and the groups the job leaves
ended so that Kueue frees their quota. (``test_kueue_e2e`` runs the same against the
test API server with Kueue's webhook and controller played.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_operator_reconcile import World  # noqa: E402

from alpajob.operator.queueing import QUEUE_REFRESH, WORKLOAD_GRACE, queue_of, role_of  # noqa: E402

GROUP = "kueue.x-k8s.io/pod-group-name"
RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
GATE = [{"name": "kueue.x-k8s.io/admission"}]


def _job(labels: dict[str, str] | None = None, **scheduling: Any) -> dict[str, Any]:
    return {"metadata": {"labels": labels or {}}, "spec": {"scheduling": scheduling}}


def test_the_queue_is_the_label_else_spec_scheduling_queue_where_kueue_takes_it() -> None:
    label = {"kueue.x-k8s.io/queue-name": "team-a"}
    assert queue_of(_job(label, queue="other"), kueue=False, gang=None) == "team-a"  # Kueue's own convention
    assert queue_of(_job(queue="team-b"), kueue=True, gang=None) == "team-b"
    assert queue_of(_job(queue="team-b"), kueue=True, gang="coscheduling") == "team-b"
    assert queue_of(_job(queue="research"), kueue=True, gang="volcano") is None  # Volcano's PodGroup queue
    assert queue_of(_job(queue="team-b"), kueue=False, gang=None) is None
    assert queue_of(_job(), kueue=True, gang=None) is None


def _queued_world(plan_json: str, **spec: Any) -> World:
    world = World({"cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8, "nodeSelector": {"pool": "a"}}, **spec})
    world.job["metadata"]["labels"] = {"kueue.x-k8s.io/priority-class": "low"}
    world.queue = "team"
    world.step()
    world.planned(plan_json)
    world.step()
    return world


def _gate(world: World) -> None:
    """Kueue's webhook: every head and mesh pod of the group gated."""
    for pod in world.pods().values():
        if GROUP in pod["metadata"]["labels"]:
            pod["spec"]["schedulingGates"] = list(GATE)


def _workload(reserved: dict[str, str] | None = None, admitted: bool = False) -> dict[str, Any]:
    conditions = [{"type": "QuotaReserved", **reserved}] if reserved else []
    if admitted:
        conditions = [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                      {"type": "Admitted", "status": "True", "reason": "Admitted"}]
    status: dict[str, Any] = {"conditions": conditions}
    if admitted:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "head", "flavors": {"cpu": "default"}}, {"name": "mesh-x", "flavors": {"nvidia.com/gpu": "h100"}}]}
    return {"metadata": {"name": "manual-gpt-0"}, "status": status}


def test_the_head_and_mesh_pods_are_one_group_of_the_attempt_and_the_planner_is_not_queued(plan_json: str) -> None:
    world = _queued_world(plan_json)
    planner = world.objects["Pod", "manual-gpt-planner"]
    assert not {k for k in planner["metadata"]["labels"] if k.startswith("kueue.x-k8s.io/")}
    pods = {n: p for n, p in world.pods().items() if n != "manual-gpt-planner"}
    assert sorted(pods) == ["manual-gpt-0-head", "manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0"]
    for pod in pods.values():
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team" and labels[GROUP] == "manual-gpt-0"
        assert labels["kueue.x-k8s.io/priority-class"] == "low"  # the job's WorkloadPriorityClass
        assert annotations["kueue.x-k8s.io/pod-group-total-count"] == "3"
        assert annotations["kueue.x-k8s.io/role-hash"] == role_of(pod)
    assert pods["manual-gpt-0-head"]["metadata"]["annotations"]["kueue.x-k8s.io/role-hash"] == "head"
    for name in ("manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0"):
        mesh = pods[name]
        assert mesh["spec"]["nodeSelector"] == {"pool": "a"}  # the pool's selector: Kueue's flavors judged by it
        assert mesh["metadata"]["annotations"]["kueue.x-k8s.io/role-hash"].startswith("mesh-")
    # The role is the pod's admission shape, not its node pin: the same stage on another
    # node is the same pod set.
    other = {**pods["manual-gpt-0-m0-h0"], "spec": {**pods["manual-gpt-0-m0-h0"]["spec"], "affinity": {}}}
    assert role_of(other) == role_of(pods["manual-gpt-0-m0-h0"])


def test_a_gated_attempt_is_queued_with_kueues_reason_then_admitted(plan_json: str) -> None:
    world = _queued_world(plan_json)
    _gate(world)
    decision = world.step()
    assert world.status["phase"] == "Queued"
    admitted = next(c for c in world.status["conditions"] if c["type"] == "Admitted")
    assert (admitted["status"], admitted["reason"]) == ("False", "WorkloadPending")
    assert decision.wake_after is not None and decision.wake_after <= 1.0  # Kueue makes it in a moment
    message = "couldn't assign flavors to pod set mesh-x: insufficient unused quota for nvidia.com/gpu in flavor h100, 8 more needed"
    world.workload = _workload({"status": "False", "reason": "Pending", "message": message})
    decision = world.step()
    admitted = next(c for c in world.status["conditions"] if c["type"] == "Admitted")
    assert (admitted["status"], admitted["reason"], admitted["message"]) == ("False", "Pending", message)
    reconciling = next(c for c in world.status["conditions"] if c["type"] == "Reconciling")
    assert reconciling["status"] == "True" and message in reconciling["message"] and "LocalQueue team" in reconciling["message"]
    assert decision.wake_after == QUEUE_REFRESH  # the message is read again while it waits
    assert ("Normal", "Queued") in [(k, r) for k, r, _ in world.events]
    # Admitted: Kueue removed the gates; the job starts, and says by whom.
    for pod in world.pods().values():
        pod["spec"].pop("schedulingGates", None)
    world.workload = _workload(admitted=True)
    world.step()
    assert world.status["phase"] == "Starting"
    admitted = next(c for c in world.status["conditions"] if c["type"] == "Admitted")
    assert admitted["status"] == "True" and admitted["message"] == "admitted by ClusterQueue cq (flavors default, h100)"
    assert ("Normal", "Admitted") in [(k, r) for k, r, _ in world.events]
    world.set_pods("Running")
    world.step()
    assert world.status["phase"] == "Running" and world.annotated == []  # the live group is left alone


def test_gated_pods_without_a_workload_say_kueues_pod_integration_may_be_off(plan_json: str) -> None:
    world = _queued_world(plan_json)
    for pod in world.pods().values():
        pod["metadata"]["creationTimestamp"] = world.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    _gate(world)
    world.step(WORKLOAD_GRACE + 1)
    admitted = next(c for c in world.status["conditions"] if c["type"] == "Admitted")
    assert admitted["reason"] == "NoWorkload" and "integrations.frameworks: pod" in admitted["message"]


def test_preemption_is_a_disruption_and_the_left_group_is_ended_for_kueue(plan_json: str) -> None:
    """Kueue stops every pod of a preempted group (TerminationTarget, then a delete): the
    whole job restarts as its next attempt (not in place, whatever restartScope says),
    counted as a disruption; the old attempt's pods get retriable-in-group=false, so
    Kueue ends that group and frees its quota; the new attempt is a new group."""
    world = _queued_world(plan_json, runPolicy={"restartScope": "FailedPods"})
    world.grace = 30.0  # deleted pods terminate for a while, as on a node
    world.workload = _workload(admitted=True)
    world.set_pods("Running")
    world.step()
    assert world.status["phase"] == "Running"
    stop = {"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvictedDueToPreempted",
            "message": "Preempted to accommodate a workload (UID: u, JobUID: UNKNOWN) due to prioritization in the ClusterQueue"}
    mesh = world.objects["Pod", "manual-gpt-0-m1-h0"]  # Kueue got to a mesh pod first
    mesh["status"]["conditions"] = [stop]
    mesh["metadata"]["deletionTimestamp"] = world.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    world.workload = None
    world.step()
    assert world.status["phase"] == "Restarting" and world.status["children"]["attempt"] == 1
    assert (world.status["restarts"], world.status["disruptions"]) == (0, 1)
    reason, message = next((r, m) for _, r, m in world.events if r == "Preempted")
    assert "manual-gpt-0-m1-h0 was stopped by Kueue: Preempted to accommodate a workload" in message
    ended = {name for name, annotations in world.annotated if annotations == {RETRIABLE: "false"}}
    assert ended == {"manual-gpt-0-head", "manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0"}
    world.set_pods("Failed")  # the kubelet stopped them; Kueue's finalizer keeps them a while
    for name in ended:
        world.objects["Pod", name]["metadata"].update(deletionTimestamp=world.now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                                      deletionGracePeriodSeconds=0, stuck=True)
    world.forced.clear()
    world.step()
    new = {n: p for n, p in world.pods().items() if n.startswith("manual-gpt-1-")}
    assert sorted(new) == ["manual-gpt-1-head", "manual-gpt-1-m0-h0", "manual-gpt-1-m1-h0"]
    assert {p["metadata"]["labels"][GROUP] for p in new.values()} == {"manual-gpt-1"}
    assert world.forced == []  # held by Kueue's finalizer only: never deleted again
    assert len(world.annotated) == len(ended)  # each annotated once


def test_a_finished_jobs_group_is_ended_and_a_replacement_waits_for_the_pod_it_replaces(plan_json: str) -> None:
    world = _queued_world(plan_json, runPolicy={"restartScope": "FailedPods", "backoffLimit": 2})
    world.grace = 30.0
    world.set_pods("Running")
    world.step()
    world.objects["Pod", "manual-gpt-0-m1-h0"]["status"] = {"phase": "Failed", "containerStatuses": [
        {"name": "worker", "state": {"terminated": {"exitCode": 137}}}]}
    world.objects["Pod", "manual-gpt-0-m1-h0"]["metadata"]["deletionTimestamp"] = "2026-11-21T12:10:00Z"
    world.objects["Pod", "manual-gpt-0-m1-h0"]["status"]["phase"] = "Running"  # still stopping
    world.step()
    assert world.status["phase"] == "Restarting" and world.status["children"]["attempt"] == 0
    world.step()
    # Kueue counts a pod that still runs: its replacement would be an excess pod it deletes.
    assert not any(n.startswith("manual-gpt-0-m1-h0-r") for n in world.pods())
    world.objects["Pod", "manual-gpt-0-m1-h0"]["status"]["phase"] = "Failed"
    world.step()
    assert "manual-gpt-0-m1-h0-r1" in world.pods()
    replacement = world.objects["Pod", "manual-gpt-0-m1-h0-r1"]["metadata"]
    assert replacement["labels"][GROUP] == "manual-gpt-0" and replacement["annotations"][
        "kueue.x-k8s.io/role-hash"] == world.objects["Pod", "manual-gpt-0-m1-h0"]["metadata"]["annotations"][
        "kueue.x-k8s.io/role-hash"]
    assert world.annotated == []
    world.set_pods("Succeeded")
    world.step()
    assert world.status["phase"] == "Succeeded"
    assert {n for n, _ in world.annotated} == {n for n in world.pods() if GROUP in world.pods()[n]["metadata"]["labels"]}


def test_a_suspended_jobs_group_is_ended_and_resuming_queues_a_new_one(plan_json: str) -> None:
    world = _queued_world(plan_json)
    world.set_pods("Running")
    world.step()
    world.job["spec"]["runPolicy"] = {"suspend": True}
    world.step()
    assert world.status["phase"] == "Suspended"
    assert {n for n, _ in world.annotated} == {"manual-gpt-0-head", "manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0"}
    world.job["spec"]["runPolicy"] = {"suspend": False}
    world.step()
    world.step()
    assert {p["metadata"]["labels"][GROUP] for n, p in world.pods().items() if n.startswith("manual-gpt-1-")} \
        == {"manual-gpt-1"}


def test_a_queue_no_installed_system_takes_is_said_once_and_the_job_runs(plan_json: str) -> None:
    world = World({"scheduling": {"queue": "team"}})
    world.step()
    admitted = next(c for c in world.status["conditions"] if c["type"] == "Admitted")
    assert admitted["reason"] == "NoQueueing" and "neither Kueue" in admitted["message"]
    world.planned(plan_json)
    world.step()
    world.set_pods("Running")
    world.step()
    assert world.status["phase"] == "Running"
    assert [r for _, r, _ in world.events].count("NoQueueing") == 1
    assert not any("kueue.x-k8s.io/pod-group-name" in p["metadata"]["labels"] for p in world.pods().values())


def test_more_pod_sets_than_kueue_admits_fails_the_job_saying_how_to_fix_it(
        plan_json: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import alpajob.operator.queueing as queueing

    monkeypatch.setattr(queueing, "MAX_POD_SETS", 2)  # the head and the example's two mesh shapes make 3
    world = _queued_world(plan_json)
    assert world.status["phase"] == "Failed"
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "TooManyPodSets" and "spec.podTemplate.mesh.resources" in failed["message"]
    assert not [n for n in world.pods() if n.startswith("manual-gpt-0-")]  # no partial group


def test_a_queued_attempt_moves_with_spec_scheduling_queue(plan_json: str) -> None:
    world = World({"scheduling": {"queue": "team"}})
    world.queue = "team"
    world.step()
    world.planned(plan_json)
    world.step()
    _gate(world)
    world.step()
    world.queue = "other"  # spec.scheduling.queue changed (it may), the pods still wait
    world.job["spec"]["scheduling"]["queue"] = "other"
    world.step()
    queues = {p["metadata"]["labels"].get("kueue.x-k8s.io/queue-name") for n, p in world.pods().items()
              if n != "manual-gpt-planner"}
    assert queues == {"other"}


def test_pods_kueue_did_not_take_say_its_pod_integration_is_off(plan_json: str) -> None:
    """Kueue installed, the job names a queue, but its webhook left the pods alone (its
    pod integration is off for the namespace): said once, and the job runs."""
    world = _queued_world(plan_json)
    world.set_pods("Running")
    world.step()
    admitted = next(c for c in world.status["conditions"] if c["type"] == "Admitted")
    assert admitted["reason"] == "NotManaged" and "integrations.frameworks: pod" in admitted["message"]
    assert world.status["phase"] == "Running"
    world.step()
    assert [r for _, r, _ in world.events].count("NotManaged") == 1
