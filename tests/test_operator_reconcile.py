"""The operator's reconciliation, pass by pass, against an in-memory world.

:func:`reconcile` is pure: a tiny world here applies its decisions (status, creations,
deletions) the way the handlers apply them to the API, and the tests play the kubelet
by moving pods through their phases.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from alpajob.api.names import LABEL_JOB, Role
from alpajob.api.runtime import TrainerRuntime
from alpajob.operator.pool import PoolNode
from alpajob.operator.reconcile import MESH_EXIT_GRACE, Observed, reconcile

EXAMPLES = Path(__file__).parent.parent / "manifests" / "examples"


def runtime_of(pod: dict[str, Any]) -> TrainerRuntime:
    """What the trainer in ``pod`` reads from its environment."""
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    return TrainerRuntime.from_env(env)


#: Children the operator asks for again with every pod it makes (a 409 keeps them).
ASKED_AGAIN = ("Secret", "ServiceAccount", "Role", "RoleBinding")


class World:
    """The API server's objects for one job, and a clock."""

    def __init__(self, spec_edits: dict[str, Any] | None = None, nodes: int = 1) -> None:
        doc = yaml.safe_load((EXAMPLES / "manual-gpt.yaml").read_text())
        doc["metadata"].update(namespace="ml", uid="uid-1", generation=1)
        doc["spec"].update(spec_edits or {})
        self.job = doc
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.now = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
        self.pool = [PoolNode(f"node-{i}", 8, None) for i in range(nodes)]
        self.ready = frozenset(n.name for n in self.pool)
        self.left_out: list[tuple[str, str]] = []  # nodes of the selector not in the pool, and why
        self.gang: str | None = None
        self.queue: str | None = None  # the Kueue LocalQueue that admits the job (operator/queueing.py)
        self.workload: dict[str, Any] | None = None  # Kueue's Workload of the current attempt
        self.annotated: list[tuple[str, dict[str, str]]] = []
        self.events: list[tuple[str, str, str]] = []
        self.deleted_job = False
        self.forced: list[str] = []
        #: Seconds a deleted pod stays, terminating, as a real kubelet keeps it for its
        #: grace period (None: deleted pods vanish at once, unless marked ``stuck``).
        self.grace: float | None = None
        self.uids = 0

    def pods(self) -> dict[str, dict[str, Any]]:
        return {name: obj for (kind, name), obj in self.objects.items() if kind == "Pod"}

    def running(self) -> dict[str, dict[str, Any]]:
        """The pods that have not finished (finished ones stay for their logs)."""
        return {n: p for n, p in self.pods().items()
                if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")}

    def step(self, seconds: float = 1.0):
        self.now += timedelta(seconds=seconds)
        seen = Observed(
            job=copy.deepcopy(self.job), now=self.now, manifest_yaml=yaml.safe_dump(self.job),
            pool=self.pool, left_out=self.left_out,
            configmaps={n: o for (k, n), o in self.objects.items() if k == "ConfigMap"},
            pods=self.pods(),
            services=frozenset(n for k, n in self.objects if k == "Service"),
            claims=frozenset(n for k, n in self.objects if k == "PersistentVolumeClaim"),
            pod_groups=frozenset(n for k, n in self.objects if k == "PodGroup"),
            gang=self.gang, ready_nodes=self.ready, queue=self.queue, kueue=self.queue is not None,
            workload=self.workload,
        )
        decision = reconcile(seen)
        self.job["status"] = decision.status.to_dict()
        for obj in decision.create:
            key = (obj["kind"], obj["metadata"]["name"])
            if obj["kind"] in ASKED_AGAIN and key in self.objects:
                continue  # the API's 409: the operator does not watch these, so it asks with every pod it makes
            assert key not in self.objects, f"{key} created twice"
            retained = obj["kind"] == "PersistentVolumeClaim" and "ownerReferences" not in obj["metadata"]
            assert retained or obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
            self.objects[key] = copy.deepcopy(obj)
            self.uids += 1
            self.objects[key]["metadata"]["uid"] = f"uid-{self.uids}"
            if obj["kind"] == "Pod":
                self.objects[key]["status"] = {"phase": "Pending"}
        for kind, name, grace in decision.delete:
            if grace == 0:
                self.forced.append(name)
            obj = self.objects.get((kind, name))
            if obj is None:
                continue
            running = (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            slow = running or obj["metadata"].get("stuck")  # a finished pod goes at once
            if grace != 0 and self.grace is not None and slow:
                obj["metadata"].setdefault(
                    "deletionTimestamp", (self.now + timedelta(seconds=self.grace)).strftime("%Y-%m-%dT%H:%M:%SZ"))
            elif grace == 0 or not obj["metadata"].get("stuck"):
                del self.objects[kind, name]
        for name, metadata in decision.pod_metadata:
            for key, extra in metadata.items():
                if key == "annotations":
                    self.annotated.append((name, extra))
                if ("Pod", name) in self.objects:
                    self.objects["Pod", name]["metadata"].setdefault(key, {}).update(extra)
        self.events += decision.events
        self.deleted_job |= decision.delete_job
        if decision.clear_plan:
            self.objects["ConfigMap", f"{self.job['metadata']['name']}-plan"]["data"] = {}
        return decision

    @property
    def status(self) -> dict[str, Any]:
        return self.job["status"]

    def set_pods(self, phase: str, role: str | None = None, **status: Any) -> None:
        """Move the pods of ``role`` (default: every head and mesh pod that has not
        finished) to ``phase``, as their kubelets would."""
        for pod in self.pods().values():
            mine = pod["metadata"]["labels"]["alpajob.io/role"]
            finished = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            if (role is None and mine != "planner" and not finished) or mine == role:
                pod["status"] = {"phase": phase, **status}

    def planned(self, plan_json: str) -> None:
        """Play the planner pod: write the plan, succeed."""
        self.objects["ConfigMap", "manual-gpt-plan"]["data"] = {"plan.json": plan_json}
        self.objects["Pod", "manual-gpt-planner"]["status"] = {"phase": "Succeeded"}

    def condition(self, kind: str) -> str:
        return next(c["status"] for c in self.status["conditions"] if c["type"] == kind)


def _running(world: World, plan_json: str) -> None:
    world.step()
    world.planned(plan_json)
    world.step()
    world.set_pods("Running")
    world.step()


def test_a_new_job_plans_in_a_pod_for_the_pool(plan_json: str) -> None:
    world = World()
    decision = world.step()
    kinds = [(o["kind"], o["metadata"]["name"]) for o in decision.create]
    identity = [("ServiceAccount", "manual-gpt-trainer"), ("Role", "manual-gpt-trainer"),
                ("RoleBinding", "manual-gpt-trainer")]
    assert kinds == [*identity, ("ConfigMap", "manual-gpt-config"), ("ConfigMap", "manual-gpt-plan"),
                     ("ConfigMap", "manual-gpt-progress"), ("Pod", "manual-gpt-planner")]
    # The planner runs as the job's own identity, whose Role reaches the job's plan and
    # progress only; its token is the pod's to ask for (the account mounts none).
    assert world.objects["Pod", "manual-gpt-planner"]["spec"]["serviceAccountName"] == "manual-gpt-trainer"
    assert world.objects["Pod", "manual-gpt-planner"]["spec"]["automountServiceAccountToken"] is True
    assert world.objects["ServiceAccount", "manual-gpt-trainer"]["automountServiceAccountToken"] is False
    assert world.objects["Role", "manual-gpt-trainer"]["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["manual-gpt-plan", "manual-gpt-progress"],
         "verbs": ["get", "patch"]}]
    assert world.objects["RoleBinding", "manual-gpt-trainer"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "manual-gpt-trainer", "namespace": "ml"}]
    planner = world.objects["Pod", "manual-gpt-planner"]
    assert planner["spec"]["containers"][0]["command"] == ["alpajob", "plan"]
    runtime = runtime_of(planner)
    assert runtime.role is Role.PLANNER and runtime.manifest == "/etc/alpajob/manifest.yaml"
    assert (runtime.gpu, runtime.nodes, runtime.gpus_per_node) == ("cpu", 1, 8)
    assert runtime.plan_configmap == "ml/manual-gpt-plan"
    assert world.status["phase"] == "Planning" and world.status["children"]["planner"] == "manual-gpt-planner"
    assert world.step().create == []  # nothing twice while planning


def test_after_planning_every_child_is_created_once_with_its_environment(plan_json: str) -> None:
    world = World()
    world.step()
    world.planned(plan_json)
    decision = world.step()
    created = [(o["kind"], o["metadata"]["name"]) for o in decision.create]
    assert created[:3] == [("ServiceAccount", "manual-gpt-trainer"), ("Role", "manual-gpt-trainer"),
                           ("RoleBinding", "manual-gpt-trainer")]  # asked again before pods: a 409 keeps them
    decision.create[:3], created[:3] = [], []
    assert created == [("Secret", "manual-gpt-0-ray"), ("NetworkPolicy", "manual-gpt-pods"),
                       ("Service", "manual-gpt-head"), ("Service", "manual-gpt-hosts"), ("Pod", "manual-gpt-0-head"),
                       ("Pod", "manual-gpt-0-m0-h0"), ("Pod", "manual-gpt-0-m1-h0")]
    # Ingress to the job's pods: from the job itself, the operator's pods, and the
    # metrics scraper on the metrics port only.
    policy = decision.create[1]["spec"]
    assert policy["podSelector"] == {"matchLabels": {LABEL_JOB: "manual-gpt"}} and policy["policyTypes"] == ["Ingress"]
    same_job, operator, scraper = policy["ingress"]
    assert same_job == {"from": [{"podSelector": {"matchLabels": {LABEL_JOB: "manual-gpt"}}}]}
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "alpajob-system"}
    assert scraper["ports"] == [{"protocol": "TCP", "port": 9090}]
    # The attempt's Ray token: random, owned by the job, mounted by the head and mesh
    # pods only, which Ray then authenticates; mesh pods get no API token at all.
    secret = decision.create[0]
    assert len(secret["stringData"]["token"]) >= 32 and secret["metadata"]["ownerReferences"][0]["kind"] == "AlpaJob"
    for name in ("manual-gpt-0-head", "manual-gpt-0-m0-h0"):
        spec = world.objects["Pod", name]["spec"]
        assert {"name": "ray-token", "secret": {"secretName": "manual-gpt-0-ray", "defaultMode": 0o400}} \
            in spec["volumes"]
        ray = {e["name"]: e["value"] for e in spec["containers"][0]["env"] if e["name"].startswith("RAY_AUTH")}
        assert ray == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/var/run/alpajob/ray/token"}
    assert world.objects["Pod", "manual-gpt-0-m0-h0"]["spec"]["automountServiceAccountToken"] is False
    assert "ray-token" not in str(world.objects["Pod", "manual-gpt-planner"]["spec"]["volumes"])
    assert world.status["children"]["meshPods"] == ["manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0"]
    assert world.status["plan"]["stages"] == 2 and world.status["plan"]["hash"]
    planner = world.objects["Pod", "manual-gpt-planner"]
    assert planner["status"]["phase"] == "Succeeded"  # done, kept for `kubectl logs` (cleanPodPolicy Running)
    pod = world.objects["Pod", "manual-gpt-0-m1-h0"]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["ALPAJOB_RAY_ADDRESS"] == "manual-gpt-head.ml.svc:6379"
    assert (env["ALPAJOB_MESH"], env["ALPAJOB_HOST"], env["ALPAJOB_PROCESS_COUNT"]) == ("1", "0", "1")
    assert env["ALPAJOB_DEVICES"] == "4"  # a cpu plan: forced devices, no GPU request
    assert pod["metadata"]["labels"][LABEL_JOB] == "manual-gpt"
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["node-0"]
    assert world.status["phase"] == "Starting"
    assert world.step().create == []


def test_running_then_succeeded_then_cleaned_up_and_deleted_after_ttl(plan_json: str) -> None:
    world = World({"runPolicy": {"ttlSecondsAfterFinished": 60}})
    _running(world, plan_json)
    assert world.status["phase"] == "Running"
    assert world.condition("Ready") == "True" and world.condition("MeshesReady") == "True"
    assert world.status["meshes"] == [{"name": "mesh-0", "nodes": 1, "readyPods": 1, "totalPods": 1},
                                      {"name": "mesh-1", "nodes": 1, "readyPods": 1, "totalPods": 1}]
    world.set_pods("Succeeded", role="head")
    world.step()
    assert world.status["phase"] == "Succeeded" and world.status["completionTime"]
    # The driver released its mesh hosts as it finished: their pods have a grace to end
    # on their own (Succeeded, with their logs), then what still runs is deleted.
    assert sorted(world.running()) == ["manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0"]
    assert world.step().wake_after == pytest.approx(MESH_EXIT_GRACE - 1, abs=0.01)
    world.objects["Pod", "manual-gpt-0-m0-h0"]["status"] = {"phase": "Succeeded"}  # it ended on its own
    world.step(MESH_EXIT_GRACE)
    assert not world.running()  # nothing left running: mesh 1's pod, still running, was deleted
    assert world.pods()["manual-gpt-0-m0-h0"]["status"]["phase"] == "Succeeded"  # kept for its logs
    assert not world.deleted_job
    world.step(61)
    assert world.deleted_job
    assert [e[1] for e in world.events if e[0] == "Normal"][-1] == "TrainingFinished"


def test_a_failed_pod_restarts_every_mesh_then_backoff_fails_the_job(plan_json: str) -> None:
    world = World({"runPolicy": {"backoffLimit": 1, "restartScope": "Job"}})
    _running(world, plan_json)
    world.objects["Pod", "manual-gpt-0-m1-h0"]["status"] = {
        "phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}
    decision = world.step()
    assert world.status["phase"] == "Restarting" and world.status["restarts"] == 1
    assert any("OOMKilled" in e[2] and e[1] == "PodFailed" for e in world.events)
    assert not [n for n in world.running() if n.startswith("manual-gpt-0-")]  # the whole attempt went
    assert ("Secret", "manual-gpt-0-ray", None) in decision.delete  # its Ray token with it
    assert [o["metadata"]["name"] for o in world.step().create if o["kind"] == "Secret"] == ["manual-gpt-1-ray"]
    assert sorted(world.running()) == ["manual-gpt-1-head", "manual-gpt-1-m0-h0", "manual-gpt-1-m1-h0"]
    world.set_pods("Running")
    world.step()
    assert world.status["phase"] == "Running"
    world.set_pods("Failed", role="head")
    world.step()
    assert world.status["phase"] == "Failed"
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and failed["status"] == "True"
    assert "the job restarted 1 time (backoffLimit 1)" in failed["message"], failed["message"]
    world.step()
    assert not world.running()


def test_a_pod_lost_with_its_node_restarts_the_job_and_never_hangs_it(plan_json: str) -> None:
    world = World()
    _running(world, plan_json)
    pod = world.objects["Pod", "manual-gpt-0-m0-h0"]
    pod["metadata"].update(deletionTimestamp="2026-11-21T12:00:05Z", stuck=True)
    pod["spec"]["nodeName"] = "node-0"
    pod["status"] = {"phase": "Failed", "reason": "NodeLost"}
    world.ready = frozenset()  # the node is gone
    world.step()
    assert world.status["phase"] == "Restarting"
    assert "manual-gpt-0-m0-h0" in world.forced  # stuck Terminating: force-deleted
    world.ready = frozenset({"node-0"})
    world.step()
    assert "manual-gpt-1-m0-h0" in world.pods()


def _fail(world: World, pod: str, code: int, **status: Any) -> None:
    world.objects["Pod", pod]["status"] = {
        "phase": "Failed", **status,
        "containerStatuses": [{"state": {"terminated": {"exitCode": code, "reason": "Error",
                                                        "message": f"exit {code}"}}}]}


def test_a_configuration_error_exit_code_fails_the_job_at_once(plan_json: str) -> None:
    """Every AlpaJob configuration error exits 2; restarting cannot fix one, so by
    default (no podFailurePolicy) the job fails at once, with no restart spent."""
    world = World({"runPolicy": {"backoffLimit": 5}})
    _running(world, plan_json)
    _fail(world, "manual-gpt-0-m1-h0", 2)
    world.step()
    assert world.status["phase"] == "Failed" and world.status["restarts"] == 0
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PodFailurePolicy"
    assert "manual-gpt-0-m1-h0 failed: exit 2" in failed["message"] and "rule 0 says FailJob" in failed["message"]
    world.step()
    assert not world.running()


def test_preemption_and_a_lost_node_restart_without_spending_the_backoff_limit(plan_json: str) -> None:
    """A pod Kubernetes disrupted (DisruptionTarget: preempted, evicted), one that
    vanished, and one on a node that is no longer Ready restart the job as
    disruptions; backoffLimit 0 is left for the job's own failures."""
    world = World({"runPolicy": {"backoffLimit": 0, "restartScope": "Job"}}, nodes=2)
    _running(world, plan_json)
    _fail(world, "manual-gpt-0-m0-h0", 137, conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])
    world.step()
    assert world.status["phase"] == "Restarting"
    assert (world.status["restarts"], world.status["disruptions"]) == (0, 1)
    assert ("Warning", "PodDisrupted") in [(k, r) for k, r, _ in world.events]
    world.step()
    world.set_pods("Running")
    world.step()
    del world.objects["Pod", "manual-gpt-1-m1-h0"]  # gone, with its node
    world.step()
    assert (world.status["restarts"], world.status["disruptions"]) == (0, 2)
    world.step()
    world.set_pods("Running")
    world.step()
    pod = world.objects["Pod", "manual-gpt-2-m0-h0"]
    pod["spec"]["nodeName"] = "node-1"
    world.ready = frozenset({"node-0"})  # node-1 went NotReady; the pod failed with it
    _fail(world, "manual-gpt-2-m0-h0", 1)
    world.step()
    assert (world.status["restarts"], world.status["disruptions"]) == (0, 3)
    world.ready = frozenset({"node-0", "node-1"})
    world.step()
    world.set_pods("Running")
    world.step()
    _fail(world, "manual-gpt-3-head", 1)  # the job's own failure: counted, and none is left
    world.step()
    assert world.status["phase"] == "Failed"
    assert next(c for c in world.status["conditions"] if c["type"] == "Failed")["reason"] == "BackoffLimitExceeded"


@pytest.mark.parametrize(("code", "phase", "restarts", "disruptions"), [
    (137, "Restarting", 0, 1),  # Ignore: an OOM kill here is the cluster's doing
    (3, "Restarting", 1, 0),  # matches no rule: Count
    (2, "Restarting", 1, 0),  # the defaults are replaced: exit 2 now counts
    (42, "Failed", 0, 0),  # NotIn [1, 2, 3, 137]: FailJob
])
def test_a_jobs_own_rules_replace_the_defaults_first_match_deciding(
        plan_json: str, code: int, phase: str, restarts: int, disruptions: int) -> None:
    rules = [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [137]}},
             {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [1, 2, 3, 137]}},
             {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [137]}}]  # never reached
    world = World({"runPolicy": {"podFailurePolicy": {"rules": rules}}})
    _running(world, plan_json)
    _fail(world, "manual-gpt-0-m0-h0", code)
    world.step()
    assert world.status["phase"] == phase
    assert (world.status["restarts"], world.status.get("disruptions", 0)) == (restarts, disruptions)


def test_of_several_failed_pods_failjob_beats_count_beats_ignore(plan_json: str) -> None:
    world = World()
    _running(world, plan_json)
    _fail(world, "manual-gpt-0-m0-h0", 1, conditions=[{"type": "DisruptionTarget", "status": "True"}])
    _fail(world, "manual-gpt-0-m1-h0", 1)
    world.step()
    assert (world.status["restarts"], world.status["disruptions"]) == (1, 0)


def test_with_restart_scope_failed_pods_only_the_failed_mesh_pod_is_replaced(plan_json: str) -> None:
    """restartScope FailedPods: a failed mesh pod is deleted and created again (same
    attempt, same name) while the head runs on (its driver restarts the stages from the
    checkpoint, up to backoffLimit times); a failed head restarts the whole job."""
    world = World({"runPolicy": {"restartScope": "FailedPods", "backoffLimit": 2}})
    _running(world, plan_json)
    head = world.objects["Pod", "manual-gpt-0-head"]
    assert head["spec"]["containers"][0]["command"][-2:] == ["--max-restarts", "2"]
    _fail(world, "manual-gpt-0-m1-h0", 137)
    world.step()
    assert world.status["phase"] == "Restarting" and world.status["restarts"] == 1
    assert world.status["children"]["attempt"] == 0
    assert sorted(world.running()) == ["manual-gpt-0-head", "manual-gpt-0-m0-h0"]  # only the failed one went
    assert ("Warning", "MeshPodReplaced") in [(k, r) for k, r, _ in world.events]
    world.step()
    assert sorted(world.running()) == ["manual-gpt-0-head", "manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0"]
    assert world.objects["Pod", "manual-gpt-0-head"] is head  # never restarted
    world.objects["Pod", "manual-gpt-0-m1-h0"]["status"] = {"phase": "Running"}
    world.step()
    assert world.status["phase"] == "Running"
    del world.objects["Pod", "manual-gpt-0-m0-h0"]  # vanished: simply made again
    world.step()
    assert "manual-gpt-0-m0-h0" in world.pods() and world.status["restarts"] == 1
    world.set_pods("Running")
    world.step()
    _fail(world, "manual-gpt-0-head", 1)  # the head: the whole job, as a new attempt
    world.step()
    assert world.status["children"]["attempt"] == 1 and world.status["restarts"] == 2


def test_with_restart_scope_job_the_driver_never_restarts_itself(plan_json: str) -> None:
    """restartScope Job: the operator restarts every pod, the driver never restarts
    in place; by default (FailedPods) it does, up to backoffLimit times."""
    world = World({"runPolicy": {"restartScope": "Job"}})
    _running(world, plan_json)
    assert world.objects["Pod", "manual-gpt-0-head"]["spec"]["containers"][0]["command"][-2:] == \
        ["--max-restarts", "0"]
    world = World()
    _running(world, plan_json)
    assert world.objects["Pod", "manual-gpt-0-head"]["spec"]["containers"][0]["command"][-2:] == \
        ["--max-restarts", "3"]


def test_by_default_a_failed_mesh_pod_is_replaced_alone_unless_its_node_is_lost(plan_json: str) -> None:
    """restartScope's default, FailedPods: a mesh pod that failed on a Ready node is
    replaced alone (same attempt); one whose node is no longer Ready restarts the job
    as a new attempt (its replacement, pinned to that node, could never start), a
    disruption."""
    world = World({"runPolicy": {"backoffLimit": 2}}, nodes=2)
    _running(world, plan_json)
    world.objects["Pod", "manual-gpt-0-m1-h0"]["spec"]["nodeName"] = "node-1"
    _fail(world, "manual-gpt-0-m1-h0", 137)
    world.step()
    assert (world.status["children"]["attempt"], world.status["restarts"]) == (0, 1)
    assert sorted(world.running()) == ["manual-gpt-0-head", "manual-gpt-0-m0-h0"]
    world.step()
    world.set_pods("Running")
    world.step()
    world.objects["Pod", "manual-gpt-0-m1-h0"]["spec"]["nodeName"] = "node-1"
    world.ready = frozenset({"node-0"})  # node-1 went NotReady; the pod failed with it
    _fail(world, "manual-gpt-0-m1-h0", 1)
    world.step()
    assert world.status["phase"] == "Restarting" and world.status["children"]["attempt"] == 1
    assert (world.status["restarts"], world.status["disruptions"]) == (1, 1)


def test_suspend_deletes_the_pods_and_resume_starts_a_new_attempt(plan_json: str) -> None:
    world = World()
    _running(world, plan_json)
    world.job["spec"]["runPolicy"] = {"suspend": True}
    world.step()
    assert world.status["phase"] == "Suspended" and world.condition("Suspended") == "True"
    assert not world.running()
    world.step()
    assert not world.running()
    world.job["spec"]["runPolicy"] = {"suspend": False}
    world.step()
    assert world.status["children"]["attempt"] == 1
    assert "manual-gpt-1-head" in world.pods() and world.status["restarts"] == 0


def test_the_deadline_fails_the_job(plan_json: str) -> None:
    world = World({"runPolicy": {"activeDeadlineSeconds": 30}})
    _running(world, plan_json)
    world.step(40)
    assert world.status["phase"] == "Failed"
    assert next(c for c in world.status["conditions"] if c["type"] == "Failed")["reason"] == "DeadlineExceeded"


@pytest.mark.parametrize(("policy", "fired"), [
    ({"activeDeadlineSeconds": 30}, lambda w: w.status["phase"] == "Failed"),
    ({"progressDeadlineSeconds": 45}, lambda w: w.status["phase"] == "Restarting"),
])
def test_a_rule_that_fires_with_time_alone_asks_for_its_pass(plan_json: str, policy: dict[str, Any],
                                                             fired: Any) -> None:
    """The operator runs passes on changes; a rule that needs none (a deadline) says
    when its pass is due (``wake_after``), and a pass then fires it, not a moment before."""
    world = World({"runPolicy": policy})
    _running(world, plan_json)
    due = world.step(0).wake_after
    assert due is not None and 0 < due <= 45
    world.step(due - 0.5)
    assert not fired(world)
    world.step(0.5)
    assert fired(world)


def test_a_finished_job_asks_for_its_ttl_pass_and_an_idle_job_for_none(plan_json: str) -> None:
    world = World({"runPolicy": {"ttlSecondsAfterFinished": 60}})
    _running(world, plan_json)
    assert world.step().wake_after is None  # running, no deadline: only a change matters
    world.set_pods("Succeeded", role="head")
    world.step()
    due = world.step(10).wake_after
    assert due == pytest.approx(50)
    world.step(due)
    assert world.deleted_job


def test_no_matching_nodes_fails_naming_the_selector() -> None:
    world = World()
    world.pool = []
    world.step()
    assert world.status["phase"] == "Failed"
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NoNodePool" and "spec.cluster.nodeSelector" in failed["message"]


def _nodes_available(world: World) -> dict[str, Any]:
    return next(c for c in world.status["conditions"] if c["type"] == "NodesAvailable")


def test_a_short_pool_is_planned_as_it_is_with_a_condition_and_an_event() -> None:
    """By default (``whenFewerNodes: Plan``) a pool short of ``spec.cluster.nodes`` is
    planned as it is; the condition and one Warning event name the nodes left out."""
    world = World({"cluster": {"gpu": "cpu", "nodes": 3, "gpusPerNode": 8}}, nodes=2)
    world.left_out = [("node-7", "cordoned"), ("node-8", "tainted dedicated=infer:NoSchedule, which "
                                              "spec.podTemplate.mesh.tolerations does not tolerate")]
    world.step()
    assert runtime_of(world.objects["Pod", "manual-gpt-planner"]).nodes == 2
    condition = _nodes_available(world)
    assert condition["status"] == "False" and condition["reason"] == "FewerNodes"
    assert condition["message"].startswith("the pool has 2 of the 3 nodes spec.cluster.nodes asks for (node-7 cordoned; "
                                           "node-8 tainted dedicated=infer:NoSchedule")
    assert "planning for 2" in condition["message"] and world.status["phase"] == "Planning"
    world.step()
    assert [e for e in world.events if e[1] == "FewerNodes"] == [("Warning", "FewerNodes", condition["message"])]


def test_with_when_fewer_nodes_wait_the_job_waits_for_the_pool_then_plans_for_all_of_it() -> None:
    world = World({"cluster": {"gpu": "cpu", "nodes": 2, "gpusPerNode": 8, "whenFewerNodes": "Wait"},
                   "runPolicy": {"schedulingTimeoutSeconds": 600}}, nodes=1)
    world.left_out = [("node-1", "not Ready")]
    decision = world.step()
    assert ("Pod", "manual-gpt-planner") not in world.objects
    assert world.status["phase"] == "Pending"
    reconciling = next(c for c in world.status["conditions"] if c["type"] == "Reconciling")
    assert reconciling["reason"] == "WaitingForNodes" and "node-1 not Ready" in reconciling["message"]
    assert "waiting for the rest (spec.cluster.whenFewerNodes: Wait)" in _nodes_available(world)["message"]
    assert decision.wake_after == pytest.approx(600)
    assert world.step(100).wake_after == pytest.approx(500)
    world.pool, world.left_out = [PoolNode("node-0", 8, None), PoolNode("node-1", 8, None)], []
    world.step()
    assert runtime_of(world.objects["Pod", "manual-gpt-planner"]).nodes == 2
    assert _nodes_available(world)["status"] == "True" and world.status["phase"] == "Planning"
    assert [e[:2] for e in world.events if e[1] in ("FewerNodes", "NodesAvailable")] == [
        ("Warning", "FewerNodes"), ("Normal", "NodesAvailable")]


def test_waiting_for_nodes_ends_at_the_scheduling_timeout() -> None:
    world = World({"cluster": {"gpu": "cpu", "nodes": 2, "gpusPerNode": 8, "whenFewerNodes": "Wait"},
                   "runPolicy": {"schedulingTimeoutSeconds": 60}}, nodes=0)
    world.step()
    assert world.status["phase"] == "Pending"  # an empty pool waits too
    world.step(61)
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert world.status["phase"] == "Failed" and failed["reason"] == "NodesTimeout"
    assert "the pool has 0 of the 2 nodes" in failed["message"] and "schedulingTimeoutSeconds 60" in failed["message"]


def test_a_failed_planner_fails_the_job_with_its_message() -> None:
    world = World()
    world.step()
    world.objects["Pod", "manual-gpt-planner"]["status"] = {"phase": "Failed", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 2, "message": "error: the model needs 80 GiB per device"}}}]}
    world.step()
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert world.status["phase"] == "Failed" and "80 GiB" in failed["message"]
    assert ("Warning", "PlanningFailed") in [(e[0], e[1]) for e in world.events]


def test_a_planner_that_exits_0_without_a_plan_fails_the_job_after_a_grace() -> None:
    """An entrypoint that calls sys.exit(0) ended the planner pod Succeeded with no plan,
    and the job stayed in Planning for ever."""
    world = World()
    world.step()
    ended = world.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    world.objects["Pod", "manual-gpt-planner"]["status"] = {"phase": "Succeeded", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 0, "finishedAt": ended}}}]}
    wait = world.step().wake_after
    assert world.status["phase"] == "Planning" and wait is not None and 0 < wait <= 30
    world.step(wait)
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert world.status["phase"] == "Failed" and failed["reason"] == "PlanningFailed"
    assert "exited 0 but wrote no plan" in failed["message"]


def test_with_volcano_the_pod_group_comes_first_and_pods_join_it(plan_json: str) -> None:
    world = World({"scheduling": {"queue": "research"}})
    world.gang = "volcano"
    world.step()
    world.planned(plan_json)
    decision = world.step()
    kinds = [o["kind"] for o in decision.create]
    assert kinds.index("PodGroup") < kinds.index("Pod")
    group = world.objects["PodGroup", "manual-gpt-0"]
    assert group["spec"]["minMember"] == 3 and group["spec"]["queue"] == "research"
    for pod in world.running().values():
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "manual-gpt-0"


def test_conditions_keep_their_transition_time_until_they_flip(plan_json: str) -> None:
    world = World()
    _running(world, plan_json)
    since = next(c for c in world.status["conditions"] if c["type"] == "Ready")["lastTransitionTime"]
    world.step(5)
    world.step(5)
    assert next(c for c in world.status["conditions"] if c["type"] == "Ready")["lastTransitionTime"] == since
    assert world.status["observedGeneration"] == 1


def test_a_restart_after_the_pool_grew_plans_again_for_the_new_pool(plan_json: str) -> None:
    """Planned on the one node there was (spec asks for 2); a node joins; the next
    failure restarts the job with a new plan for both nodes instead of the old one."""
    world = World({"cluster": {"gpu": "cpu", "nodes": 2, "gpusPerNode": 8}}, nodes=1)
    world.step()
    assert runtime_of(world.objects["Pod", "manual-gpt-planner"]).nodes == 1
    world.planned(plan_json)
    world.step()
    world.set_pods("Running")
    world.step()
    world.pool = [PoolNode("node-0", 8, None), PoolNode("node-1", 8, None)]
    world.ready = frozenset({"node-0", "node-1"})
    world.set_pods("Failed", role="head")
    world.step()
    assert world.status["phase"] == "Restarting" and world.status.get("plan") is None
    assert ("Normal", "Replanning") in [(e[0], e[1]) for e in world.events]
    world.step()
    assert runtime_of(world.objects["Pod", "manual-gpt-planner"]).nodes == 2
    assert world.status["phase"] == "Planning"


def test_jobs_without_an_image_get_the_operators_default(plan_json: str) -> None:
    world = World()
    world.job["spec"].pop("image", None)
    world.step()
    assert world.objects["Pod", "manual-gpt-planner"]["spec"]["containers"][0]["image"] == "ghcr.io/alpajob/alpajob:0.1.0"
    assert "image" not in world.job["spec"]  # the operator never writes spec


def test_the_checker_refuses_what_a_real_api_server_refused() -> None:
    """The Pod Security checker of the tests names the rules a real kube-apiserver named
    when it refused a plain pod in a ``restricted`` namespace."""
    import json

    from pod_security import restricted_violations

    observed = json.loads((Path(__file__).resolve().parent / "data" / "apiserver-observed"
                           / "pod-create-podsecurity-restricted.response.json").read_text())
    message = observed["body"]["message"].split(": violates PodSecurity \"restricted:latest\": ", 1)[1]
    rules = sorted(part.split(" (")[0] for part in message.split("), ") if part)
    ours = restricted_violations({"spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    assert sorted(line.split(" (")[0] for line in ours) == rules


def test_every_pod_the_operator_creates_passes_pod_security_restricted(plan_json: str) -> None:
    """Planner, head and mesh pods are admitted in a namespace that enforces Pod
    Security "restricted" (a real API server refuses them with 403 otherwise)."""
    from pod_security import restricted_violations

    world = World({"checkpoint": {"volume": "ckpt", "every": 2}})
    pods = [o for o in world.step().create if o["kind"] == "Pod"]
    world.planned(plan_json)
    pods += [o for o in world.step().create if o["kind"] == "Pod"]
    assert {p["metadata"]["name"] for p in pods} == {
        "manual-gpt-planner", "manual-gpt-0-head", "manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0"}
    for pod in pods:
        assert restricted_violations(pod) == [], pod["metadata"]["name"]


def test_a_job_without_progress_past_its_deadline_is_restarted_as_hung(plan_json: str) -> None:
    """progressDeadlineSeconds: reports keep a Running job alive; once none has come
    for the deadline (the driver hung), every mesh restarts, counted against
    backoffLimit, with the reason ProgressDeadlineExceeded and the quiet time."""
    from alpajob.api.names import PROGRESS_KEY
    from alpajob.api.progress import Progress, TrainerPhase

    world = World({"runPolicy": {"progressDeadlineSeconds": 60, "backoffLimit": 1}})
    _running(world, plan_json)

    def report(step: int, seconds_ago: float) -> None:
        progress = Progress(phase=TrainerPhase.RUNNING, step=step, steps=100,
                            updated=world.now.timestamp() - seconds_ago)
        world.objects["ConfigMap", "manual-gpt-progress"]["data"] = {PROGRESS_KEY: progress.to_json()}

    world.step(50)
    assert world.status["phase"] == "Running"  # 51 s since it started running: not yet
    report(7, seconds_ago=0)
    world.step(50)
    assert world.status["phase"] == "Running"  # 50 s since the last report
    world.step(15)
    assert world.status["phase"] == "Restarting" and world.status["restarts"] == 1
    message = next(c for c in world.status["conditions"] if c["type"] == "Ready")["message"]
    assert "no progress for 65 s (progressDeadlineSeconds 60; last step 7)" in message
    assert ("Warning", "ProgressDeadlineExceeded") in [(k, r) for k, r, _ in world.events]
    assert not [n for n in world.running() if n.startswith("manual-gpt-0-")]  # attempt 0's pods deleted
    world.step()
    world.set_pods("Running")
    world.step()
    assert world.status["phase"] == "Running" and world.status["children"]["attempt"] == 1
    world.step(61)  # the new attempt hangs too: backoffLimit 1 is spent
    assert world.status["phase"] == "Failed"
    assert next(c for c in world.status["conditions"] if c["type"] == "Failed")["reason"] == "BackoffLimitExceeded"


def test_the_status_accounts_the_jobs_time_by_phase(plan_json: str) -> None:
    """status.time: planning, waiting for pods, running and restarting, each from the
    phase changes (the World's clock moves a second per pass unless told), and the
    job's goodput from them; a pass that changes nothing changes none of it."""
    world = World()
    world.step()                      # Planning from now
    world.planned(plan_json)
    world.step(30)                    # 30 s planning; Starting
    world.step(20)
    world.set_pods("Running")
    world.step(20)                    # 40 s starting; Running
    unchanged = copy.deepcopy(world.status["time"])
    world.step(100)
    assert world.status["time"] == unchanged  # nothing changed: nothing written
    world.objects["Pod", "manual-gpt-0-head"]["status"] = {"phase": "Succeeded"}
    world.step(50)                    # 150 s running; Succeeded
    clock = world.status["time"]
    assert clock["planningSeconds"] == 30 and clock["startingSeconds"] == 40
    assert clock["runningSeconds"] == 150 and clock["restartingSeconds"] == 0
    from alpajob.api.status import Status

    assert Status.model_validate(world.status).time.goodput() == pytest.approx(150 / 220)


def test_a_deleted_mesh_pod_is_a_disruption_and_the_next_attempt_waits_for_the_old_pods(
        plan_json: str) -> None:
    """``kubectl delete pod`` of a running mesh pod: a disruption (not counted against
    backoffLimit), every pod of the attempt deleted, and the next attempt created only
    once the old pods are gone: the old head may still hold the checkpoint folder while
    it terminates for its grace period. A pod still there past its grace period is
    forced, at the time the pass asks for."""
    world = World({"runPolicy": {"backoffLimit": 0, "restartScope": "Job"}})
    world.grace = 30.0
    _running(world, plan_json)
    pod = world.objects["Pod", "manual-gpt-0-m1-h0"]
    pod["metadata"]["deletionTimestamp"] = "2026-11-21T12:00:33Z"  # kubectl delete pod: 30 s grace
    world.step()
    assert world.status["phase"] == "Restarting"
    assert (world.status["restarts"], world.status["disruptions"]) == (0, 1)
    assert any(r == "PodDisrupted" and "manual-gpt-0-m1-h0 was deleted" in m for _, r, m in world.events)
    assert world.status["children"]["attempt"] == 1
    for _ in range(5):  # the old pods terminate for their grace period: nothing new meanwhile
        decision = world.step(2)
        assert not [o for o in decision.create if o["kind"] == "Pod"]
        assert world.status["phase"] == "Restarting"
    ready = next(c for c in world.status["conditions"] if c["type"] == "Reconciling")
    assert ready["reason"] == "OldPodsTerminating" and "manual-gpt-0-head" in ready["message"]
    del world.objects["Pod", "manual-gpt-0-m0-h0"]  # two went in time; the head is slow
    del world.objects["Pod", "manual-gpt-0-m1-h0"]
    head = world.objects["Pod", "manual-gpt-0-head"]
    head["metadata"]["stuck"] = True
    due = world.step().wake_after
    assert due is not None and world.forced == []
    world.step(due)  # its grace period and FORCE_AFTER over: forced
    assert world.forced == ["manual-gpt-0-head"]
    world.step()
    assert sorted(world.running()) == ["manual-gpt-1-head", "manual-gpt-1-m0-h0", "manual-gpt-1-m1-h0"]
    world.set_pods("Running")
    world.step()
    assert world.status["phase"] == "Running"
    assert (world.status["restarts"], world.status["disruptions"]) == (0, 1)


def test_the_status_progress_counts_the_jobs_restarts_as_the_status_does(plan_json: str) -> None:
    """The driver of attempt 1 reports ``restarts: 0`` (it knows only its own); the
    job's status shows every restart: ``progress.restarts`` = restarts + disruptions."""
    from alpajob.api.names import PROGRESS_KEY
    from alpajob.api.progress import Progress, TrainerPhase

    world = World({"runPolicy": {"restartScope": "Job"}})
    _running(world, plan_json)
    _fail(world, "manual-gpt-0-m0-h0", 1)
    world.step()
    world.step()
    world.set_pods("Running")
    report = Progress(phase=TrainerPhase.RUNNING, step=12, steps=100, restarts=0)
    world.objects["ConfigMap", "manual-gpt-progress"]["data"] = {PROGRESS_KEY: report.to_json()}
    world.step()
    assert world.status["restarts"] == 1 and world.status["progress"]["restarts"] == 1
    world.objects["Pod", "manual-gpt-1-m0-h0"]["metadata"]["deletionTimestamp"] = "2026-11-21T12:00:40Z"
    world.step()
    assert (world.status["restarts"], world.status["disruptions"]) == (1, 1)
    assert world.status["progress"]["restarts"] == 2


def test_a_pod_replaced_in_place_is_judged_once_while_it_terminates(plan_json: str) -> None:
    """restartScope FailedPods: the failed mesh pod is deleted, and terminates for a
    while (its volumes unmount slowly); its replacement is made at once beside it
    (``-r1``: same mesh, host, node and hostname), as a Job replaces a terminating
    pod, and the passes meanwhile do not count it again. Once the old one is gone
    nothing more is made; the next replacement takes the usual name again."""
    world = World({"runPolicy": {"restartScope": "FailedPods", "backoffLimit": 3}})
    world.grace = 30.0
    _running(world, plan_json)
    _fail(world, "manual-gpt-0-m1-h0", 137)
    world.objects["Pod", "manual-gpt-0-m1-h0"]["metadata"]["stuck"] = True  # its volumes unmount slowly
    world.step()
    assert world.status["restarts"] == 1
    assert world.objects["Pod", "manual-gpt-0-m1-h0"]["metadata"]["deletionTimestamp"]
    world.step()
    new = world.objects["Pod", "manual-gpt-0-m1-h0-r1"]  # made while the old one terminates
    old = world.objects["Pod", "manual-gpt-0-m1-h0"]
    assert new["metadata"]["labels"] == old["metadata"]["labels"]
    assert (new["spec"]["hostname"], new["spec"]["affinity"]) == (old["spec"]["hostname"], old["spec"]["affinity"])
    for _ in range(3):
        world.step()
        assert (world.status["restarts"], world.status["disruptions"]) == (1, 0)
    world.set_pods("Running")
    world.step()
    assert world.status["phase"] == "Running" and world.status["children"]["attempt"] == 0
    del world.objects["Pod", "manual-gpt-0-m1-h0"]
    world.step()
    assert sorted(world.pods()) == ["manual-gpt-0-head", "manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0-r1",
                                    "manual-gpt-planner"]
    assert world.status["restarts"] == 1 and world.status["phase"] == "Running"
    assert world.status["children"]["meshPods"] == ["manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0-r1"]
    _fail(world, "manual-gpt-0-m1-h0-r1", 137)  # the replacement fails in turn
    world.step()
    world.step()
    assert world.status["restarts"] == 2 and "manual-gpt-0-m1-h0" in world.pods()


def test_the_failure_message_names_the_pod_that_failed_first(plan_json: str) -> None:
    """The head fails with the cause; the mesh pods fail after it (their Ray head is
    gone). The job's message names the head's error first, whatever the pods' order."""
    world = World({"runPolicy": {"backoffLimit": 0}})
    _running(world, plan_json)
    for name, at, message in [("manual-gpt-0-m0-h0", "2026-11-21T12:00:09Z", "ray: GCS unreachable"),
                              ("manual-gpt-0-m1-h0", "2026-11-21T12:00:08Z", "ray: GCS unreachable"),
                              ("manual-gpt-0-head", "2026-11-21T12:00:04Z",
                               "error: /checkpoints/manual-gpt is not writable by uid 1000")]:
        world.objects["Pod", name]["status"] = {"phase": "Failed", "containerStatuses": [{"state": {
            "terminated": {"exitCode": 1, "message": message, "finishedAt": at}}}]}
    world.step()
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert failed["message"].startswith("manual-gpt-0-head failed: error: /checkpoints/manual-gpt is not writable")


def _unschedulable(world: World, pod: str, since: str, message: str) -> None:
    """What the scheduler writes on a pod it cannot place (seen on a real node)."""
    world.objects["Pod", pod]["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
         "lastTransitionTime": since}]}


def test_an_unschedulable_planner_pod_is_explained_within_seconds() -> None:
    """The planner pod cannot be placed (as on a 2-CPU node): after a short grace the
    job says why (PodsScheduled=False and the phase's reason, with the scheduler's
    message, which Argo CD, Flux and kstatus show) and posts one Warning event; once
    the pod is placed the condition turns True."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from gitops_health import argocd_health, kstatus

    world = World()
    world.step()
    why = "0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes are available"
    _unschedulable(world, "manual-gpt-planner", "2026-11-21T12:00:01Z", why)
    decision = world.step(2)  # 2 s: within the grace
    assert "conditions" in world.status and not any(
        c["type"] == "PodsScheduled" for c in world.status["conditions"])
    assert decision.wake_after is not None and decision.wake_after <= 5
    world.step(decision.wake_after)
    condition = next(c for c in world.status["conditions"] if c["type"] == "PodsScheduled")
    assert condition["status"] == "False" and condition["reason"] == "Unschedulable"
    assert "pod manual-gpt-planner cannot be scheduled" in condition["message"]
    assert "Insufficient cpu" in condition["message"] and "spec.podTemplate.planner" in condition["message"]
    assert world.status["phase"] == "Planning"
    assert argocd_health(world.job) == {"status": "Progressing", "message": condition["message"]}
    assert kstatus(world.job) == "InProgress"
    world.step(10)
    assert [r for k, r, _ in world.events if r == "Unschedulable"] == ["Unschedulable"]  # once
    world.objects["Pod", "manual-gpt-planner"]["status"] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"}]}
    world.step()
    condition = next(c for c in world.status["conditions"] if c["type"] == "PodsScheduled")
    assert condition["status"] == "True"


def test_past_the_scheduling_timeout_the_job_fails(plan_json: str) -> None:
    world = World({"runPolicy": {"schedulingTimeoutSeconds": 60}})
    world.step()
    world.planned(plan_json)
    world.step()
    _unschedulable(world, "manual-gpt-0-m1-h0", "2026-11-21T12:00:02Z", "0/1 nodes are available: 1 Insufficient memory.")
    due = world.step(10).wake_after
    assert world.status["phase"] == "Starting" and due is not None
    world.step(due)
    assert world.status["phase"] == "Failed"
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "SchedulingTimeout" and "Insufficient memory" in failed["message"]
    assert "spec.podTemplate.mesh" in failed["message"]
    world.step()
    assert not world.running()


def _quantity(text: str) -> float:
    """A Kubernetes quantity as a number (cores, or bytes)."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


def test_pods_are_sized_from_the_plan_and_fit_a_two_cpu_node(plan_json: str) -> None:
    """No hard-coded 2 or 4 CPUs: the planner and head are small, a CPU plan's mesh pod
    asks for a tenth of a core per forced device and its devices' memory, and every Ray
    pod has a memory-backed /dev/shm counted in its memory. Head and meshes together
    fit a 2-CPU node with room for the cluster's own pods; the volumes are group 1000's."""
    world = World()
    planner = world.step().create[-1]
    assert planner["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "500m", "memory": "2Gi"}}
    world.planned(plan_json)
    pods = {o["metadata"]["name"]: o for o in world.step().create if o["kind"] == "Pod"}
    requests = {n: p["spec"]["containers"][0]["resources"]["requests"] for n, p in pods.items()}
    assert requests["manual-gpt-0-head"]["cpu"] == "250m"
    assert requests["manual-gpt-0-m0-h0"]["cpu"] == "400m"  # 4 forced devices
    assert sum(_quantity(r["cpu"]) for r in requests.values()) <= 1.5
    for name, pod in pods.items():
        spec = pod["spec"]
        assert "limits" not in spec["containers"][0]["resources"]  # a CPU plan: no GPU, no limits
        [shm] = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory" and _quantity(shm["emptyDir"]["sizeLimit"]) >= 256 * 2**20
        assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
        assert _quantity(requests[name]["memory"]) >= 2**30 + _quantity(shm["emptyDir"]["sizeLimit"])
        assert spec["securityContext"]["fsGroup"] == 1000


def test_a_gpu_mesh_pod_asks_a_core_per_gpu_and_keeps_its_gpu_limit(plan_json: str) -> None:
    from alpajob.api.plan import plan_from_json
    from alpajob.operator import sizing

    plan = plan_from_json(plan_json)
    size = sizing.mesh_size(plan, plan.stages[1], 4, cpu=False)
    assert size.cpu == "4" and _quantity(size.memory) >= 4 * 2**30 + size.shm


@pytest.mark.parametrize("own", [[], [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                                 [{"key": "dedicated", "value": "train", "effect": "NoSchedule"}]],
                         ids=["none", "gpu-already", "another"])
def test_a_gpu_mesh_pod_tolerates_the_gpu_taint_the_pool_counts_it_through(plan_json: str,
                                                                           own: list[dict[str, Any]]) -> None:
    """GPU node pools are often tainted ``nvidia.com/gpu:NoSchedule``; the pool keeps
    such nodes (operator/pool.py), so every GPU mesh pod tolerates that taint, once,
    beside the user's tolerations. The head, which asks for no GPU, does not."""
    world = World({"cluster": {"gpu": "v100-16gb", "nodes": 1, "gpusPerNode": 8},
                   "podTemplate": {"mesh": {"tolerations": own}}})
    world.step()
    plan = json.loads(plan_json)
    plan["cluster"]["preset"] = plan["cluster"]["device"]["name"] = "v100-16gb"  # a GPU plan
    del plan["hash"]
    world.planned(json.dumps(plan))
    pods = {o["metadata"]["name"]: o for o in world.step().create if o["kind"] == "Pod"}
    mesh, head = pods["manual-gpt-0-m1-h0"], pods["manual-gpt-0-head"]
    assert mesh["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert mesh["spec"]["tolerations"] == (own if own and own[0]["key"] == "nvidia.com/gpu" else [*own, gpu])
    assert "tolerations" not in head["spec"]


def test_pod_template_overrides_reach_each_roles_pods_and_pod_security_still_holds(plan_json: str) -> None:
    from pod_security import restricted_violations

    mesh = {"resources": {"requests": {"cpu": 3, "memory": "12Gi"}, "limits": {"memory": "16Gi"}},
            "nodeSelector": {"pool": "a3"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}},
            "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
            "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
            "metadata": {"labels": {"team": "nlp"}, "annotations": {"owner": "ada"}},
            "securityContext": {"fsGroup": 2000, "runAsUser": 1500},
            "priorityClassName": "training-high", "imagePullPolicy": "IfNotPresent",
            "imagePullSecrets": ["registry"], "shmSize": "1Gi", "terminationGracePeriodSeconds": 90}
    world = World({"podTemplate": {"mesh": mesh, "planner": {"resources": {"requests": {"cpu": "250m"}}}}})
    planner = world.step().create[-1]
    assert planner["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "250m", "memory": "2Gi"}
    world.planned(plan_json)
    pods = {o["metadata"]["name"]: o for o in world.step().create if o["kind"] == "Pod"}
    pod, head = pods["manual-gpt-0-m1-h0"], pods["manual-gpt-0-head"]
    container, spec = pod["spec"]["containers"][0], pod["spec"]
    assert container["resources"] == {"requests": {"cpu": "3", "memory": "12Gi"}, "limits": {"memory": "16Gi"}}
    assert spec["nodeSelector"] == {"pool": "a3"} and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    pin = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-0"]}
    assert [t["matchExpressions"] for t in terms] == [  # the plan's node ANDed into each term
        [{"key": "zone", "operator": "In", "values": ["a"]}, pin],
        [{"key": "zone", "operator": "In", "values": ["b"]}, pin]]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NCCL_DEBUG"] == "INFO" and env["ALPAJOB_MESH"] == "1"
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in container["volumeMounts"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}} in spec["volumes"]
    assert pod["metadata"]["labels"]["team"] == "nlp" and pod["metadata"]["labels"]["alpajob.io/job"] == "manual-gpt"
    assert pod["metadata"]["annotations"]["owner"] == "ada"
    assert spec["securityContext"]["fsGroup"] == 2000 and container["securityContext"]["runAsUser"] == 1500
    assert spec["priorityClassName"] == "training-high" and container["imagePullPolicy"] == "IfNotPresent"
    assert spec["imagePullSecrets"] == [{"name": "registry"}] and spec["terminationGracePeriodSeconds"] == 90
    assert next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "1Gi"
    assert "team" not in head["metadata"]["labels"] and head["spec"]["containers"][0]["resources"]["requests"][
        "cpu"] == "250m"  # another role: the defaults
    assert head["metadata"]["annotations"]["alpajob.io/pod-template-hash"] != \
        pod["metadata"]["annotations"]["alpajob.io/pod-template-hash"]
    for each in pods.values():
        assert restricted_violations(each) == [], each["metadata"]["name"]


def test_an_unschedulable_pod_is_made_again_when_its_template_changes(plan_json: str) -> None:
    """The planner pod asks for more than the node has; the user lowers
    spec.podTemplate.planner.resources: the waiting pod is deleted and made again
    with the new requests (a pod's spec cannot change in place)."""
    world = World({"podTemplate": {"planner": {"resources": {"requests": {"cpu": 8}}}}})
    world.step()
    _unschedulable(world, "manual-gpt-planner", "2026-11-21T12:00:01Z", "0/1 nodes are available: 1 Insufficient cpu.")
    world.step(10)
    assert world.status["phase"] == "Planning"
    world.job["spec"]["podTemplate"] = {"planner": {"resources": {"requests": {"cpu": 1}}}}
    world.step()
    assert ("Pod", "manual-gpt-planner") not in world.objects
    world.step()
    planner = world.objects["Pod", "manual-gpt-planner"]
    assert planner["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "1"


@pytest.mark.parametrize("scope", ["FailedPods", "Job"])
@pytest.mark.parametrize("pod", ["manual-gpt-0-m1-h0", "manual-gpt-0-head"])
def test_a_template_change_remakes_only_the_pods_that_wait(plan_json: str, scope: str, pod: str) -> None:
    """One pod of a running attempt cannot be placed; the user lowers its role's
    requests (as on the real node, where this remade the whole attempt and booked a
    disruption). Only that pod is made again (a mesh pod's beside the one that
    terminates for its grace period, the head's once it is gone): the other pods keep running, the attempt stays, nothing is counted, and
    the job goes back to Running once the new pod runs, under either restartScope."""
    role = "head" if pod.endswith("head") else "mesh"
    world = World({"runPolicy": {"restartScope": scope},
                   "podTemplate": {role: {"resources": {"requests": {"cpu": 8}}}}})
    world.grace = 5
    _running(world, plan_json)
    others = {n: p["metadata"]["uid"] for n, p in world.pods().items() if n not in (pod, "manual-gpt-planner")}
    _unschedulable(world, pod, "2026-11-21T12:00:02Z", "0/1 nodes are available: 1 Insufficient cpu.")
    world.step(10)
    world.job["spec"]["podTemplate"] = {role: {"resources": {"requests": {"cpu": 1}}}}
    world.step()
    assert world.objects["Pod", pod]["metadata"]["deletionTimestamp"]  # terminating, as a kubelet keeps it
    assert [m for _, r, m in world.events if r == "PodTemplateChanged"] == [
        f"pod {pod} cannot be scheduled and spec.podTemplate.{role} changed: making it again"]
    for _ in range(3):
        world.step()
    del world.objects["Pod", pod]  # its grace period is over
    world.step()
    world.step()
    # A mesh pod's replacement is made beside the one that terminates; the head's
    # once it is gone (one head per attempt).
    remade = world.objects["Pod", pod if role == "head" else f"{pod}-r1"]
    assert remade["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "1"
    world.set_pods("Running")
    world.step()
    assert world.status["phase"] == "Running", world.status
    assert (world.status["restarts"], world.status["disruptions"]) == (0, 0)
    assert {n: p["metadata"]["uid"] for n, p in world.pods().items()
            if n not in (pod, f"{pod}-r1", "manual-gpt-planner")} == others  # nothing else was made again
    assert not any(r in ("MeshPodReplaced", "PodDisrupted", "PodFailed") for _, r, _ in world.events)
    assert world.status["children"]["created"] == 0  # from now on a vanished pod is a loss again


def test_an_invalid_pod_template_without_the_webhook_fails_the_job_naming_it() -> None:
    world = World({"podTemplate": {"mesh": {"env": [{"name": "ALPAJOB_MESH", "value": "9"}]}}})
    world.step()
    failed = next(c for c in world.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidPodTemplate" and "spec.podTemplate.mesh.env" in failed["message"]


@pytest.mark.parametrize(("policy", "left"), [
    ("Running", {"manual-gpt-planner", "manual-gpt-0-head", "manual-gpt-0-m1-h0"}),
    ("All", set()),
    ("None", {"manual-gpt-planner", "manual-gpt-0-head", "manual-gpt-0-m0-h0", "manual-gpt-0-m1-h0"}),
])
def test_a_failed_jobs_pods_stay_for_their_logs_as_clean_pod_policy_says(
        plan_json: str, policy: str, left: set[str]) -> None:
    """The head fails with exit 2 (FailJob): with cleanPodPolicy Running (the default)
    the pods still running go and the finished ones stay, the planner's and the
    failed pods', for `kubectl logs`; All deletes every pod; None keeps every pod."""
    world = World({"runPolicy": {"cleanPodPolicy": policy}} if policy != "Running" else {})
    _running(world, plan_json)
    assert [m for k, r, m in world.events if r == "Planned"][0].startswith("2 stages on submeshes 1x4, 1x4")
    _fail(world, "manual-gpt-0-head", 2)
    world.objects["Pod", "manual-gpt-0-m1-h0"]["status"] = {"phase": "Failed"}
    world.step()
    world.step()
    assert world.status["phase"] == "Failed"
    assert set(world.pods()) == left


@pytest.mark.parametrize("retain", [False, True])
def test_a_volume_claim_template_makes_the_checkpoint_claim_that_every_pod_mounts(
        plan_json: str, retain: bool) -> None:
    """No claim made by hand: ``<job>-checkpoints`` is created with the planner's
    ConfigMaps, owned by the job (deleted with it) unless ``retain``; every pod mounts
    it with fsGroup 1000, so uid 1000 can write it, and the head is told its name."""
    template = {"size": "20Gi", "storageClassName": "fast", **({"retain": True} if retain else {})}
    world = World({"checkpoint": {"volumeClaimTemplate": template, "intervalSteps": 5}})
    created = [(o["kind"], o["metadata"]["name"]) for o in world.step().create]
    assert ("PersistentVolumeClaim", "manual-gpt-checkpoints") in created
    claim = world.objects["PersistentVolumeClaim", "manual-gpt-checkpoints"]
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "20Gi"}},
                             "storageClassName": "fast"}
    assert claim["metadata"]["labels"]["alpajob.io/job"] == "manual-gpt"
    assert ("ownerReferences" in claim["metadata"]) is not retain
    world.planned(plan_json)
    world.step()
    assert not [o for o in world.step().create if o["kind"] == "PersistentVolumeClaim"]  # once
    for name in ("manual-gpt-0-head", "manual-gpt-0-m0-h0"):
        spec = world.objects["Pod", name]["spec"]
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "manual-gpt-checkpoints"}} in spec["volumes"]
        assert spec["securityContext"]["fsGroup"] == 1000
    head = runtime_of(world.objects["Pod", "manual-gpt-0-head"])
    assert head.checkpoint_dir == "/checkpoints/manual-gpt"
    assert head.checkpoint_volume == "PersistentVolumeClaim manual-gpt-checkpoints at /checkpoints"


def test_a_head_that_succeeded_during_an_outage_ends_the_job_with_its_last_report(plan_json: str) -> None:
    """The driver's last ConfigMap write was lost (the API server was away), but the
    head's termination message holds its final report: the job ends at that step. A
    message that is not a report (cut, or an error line) leaves the ConfigMap's."""
    from alpajob.api.names import PROGRESS_KEY
    from alpajob.api.progress import Progress, TrainerPhase

    final = Progress(phase=TrainerPhase.SUCCEEDED, step=400, steps=400, loss=2.5)
    for message, step in ((final.to_json()[:-3], 33), ("done", 33), (final.to_json(), 400)):
        world = World({})
        _running(world, plan_json)
        stale = Progress(phase=TrainerPhase.RUNNING, step=33, steps=400, updated=world.now.timestamp())
        world.objects["ConfigMap", "manual-gpt-progress"]["data"] = {PROGRESS_KEY: stale.to_json()}
        world.step()
        assert world.status["progress"]["step"] == 33
        report = final.model_copy(update={"updated": world.now.timestamp() + 90}).to_json()
        world.set_pods("Succeeded", role="head", containerStatuses=[{"name": "head", "state": {
            "terminated": {"exitCode": 0, "reason": "Completed", "message": report if step == 400
                           else message}}}])
        world.step()
        assert world.status["phase"] == "Succeeded" and world.status["progress"]["step"] == step, message
    assert (world.status["progress"]["phase"], world.status["progress"]["loss"]) == ("Succeeded", 2.5)
