"""What the operator keeps of the watched world (alpajob/operator/world.py).

The watches themselves run in the operator process against the test API server
(tests/test_operator_e2e.py: a job reacts to its pods' changes, and costs nothing at
rest); here, the parts that decide what a change means.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from alpajob.api.names import GPU_RESOURCE
from alpajob.api.pod_template import Toleration
from alpajob.operator.pool import read_pool, tolerates
from alpajob.operator.world import NODES, Wakers, World, node_signature, slim_node

NODE: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Node",
    "metadata": {"name": "gpu-1", "labels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
                 "resourceVersion": "41", "managedFields": [{"manager": "kubelet"}]},
    "spec": {"podCIDR": "10.0.1.0/24"},
    "status": {"allocatable": {GPU_RESOURCE: "8", "cpu": "96"},
               "conditions": [{"type": "MemoryPressure", "status": "False"},
                              {"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-11-26T10:00:00Z"}],
               "images": [{"names": ["trainer:1"], "sizeBytes": 10**10}]},
}


def test_a_slim_node_keeps_what_the_pool_is_made_of() -> None:
    slim = slim_node(NODE)
    tainted = copy.deepcopy(NODE)
    tainted["spec"]["taints"] = [{"key": "dedicated", "value": "infer", "effect": "NoSchedule",
                                  "timeAdded": "2026-11-26T10:00:00Z"}]
    for node in (NODE, tainted):
        assert read_pool([slim_node(node)], {}) == read_pool([node], {})
    assert "images" not in slim["status"] and "managedFields" not in slim["metadata"]


def _node(name: str, **changes: Any) -> dict[str, Any]:
    node = copy.deepcopy(NODE)
    node["metadata"]["name"] = name
    node["metadata"]["labels"]["pool"] = "a"
    for part, fields in changes.items():
        node[part].update(fields)
    return node


NOT_READY = {"conditions": [{"type": "Ready", "status": "False"}], "allocatable": {GPU_RESOURCE: "8"}}


def test_the_pool_leaves_out_cordoned_not_ready_and_tainted_nodes_and_says_why() -> None:
    """The pool is the nodes the scheduler would give a mesh pod; each node of the
    selector left out is named with its reason."""
    nodes = [_node("a-ok"), _node("b-cordoned", spec={"unschedulable": True}), _node("c-down", status=NOT_READY),
             _node("d-tainted", spec={"taints": [{"key": "dedicated", "value": "infer", "effect": "NoSchedule"}]}),
             _node("e-evicting", spec={"taints": [{"key": "maintenance", "effect": "NoExecute"}]}),
             _node("f-prefer", spec={"taints": [{"key": "spot", "effect": "PreferNoSchedule"}]}),
             _node("g-gpu-tainted", spec={"taints": [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]}),
             _node("h-no-gpu", status={"allocatable": {"cpu": "8"}})]
    other = copy.deepcopy(NODE)
    other["metadata"]["labels"]["pool"] = "b"
    pool = read_pool([*nodes, other], {"pool": "a"})
    assert [n.name for n in pool.nodes] == ["a-ok", "f-prefer", "g-gpu-tainted"]
    assert dict(pool.left_out) == {
        "b-cordoned": "cordoned", "c-down": "not Ready",
        "d-tainted": "tainted dedicated=infer:NoSchedule, which spec.podTemplate.mesh.tolerations does not tolerate",
        "e-evicting": "tainted maintenance:NoExecute, which spec.podTemplate.mesh.tolerations does not tolerate",
        "h-no-gpu": f"no {GPU_RESOURCE}"}
    tolerating = read_pool(nodes, {"pool": "a"}, [Toleration(key="dedicated", operator="Equal", value="infer"),
                                                  Toleration(key="maintenance", operator="Exists", effect="NoExecute")])
    assert {"d-tainted", "e-evicting"} <= {n.name for n in tolerating.nodes}
    # a CPU pool's pods request no GPUs, so a GPU taint keeps them off (and no GPUs are needed)
    cpu = read_pool(nodes, {"pool": "a"}, cpu=True)
    assert "g-gpu-tainted" in dict(cpu.left_out) and "h-no-gpu" in {n.name for n in cpu.nodes}


@pytest.mark.parametrize(("toleration", "taint", "matches"), [
    ({"operator": "Exists"}, {"key": "a", "value": "x", "effect": "NoSchedule"}, True),
    ({"key": "a", "operator": "Exists"}, {"key": "a", "value": "x", "effect": "NoExecute"}, True),
    ({"key": "a", "operator": "Exists", "effect": "NoSchedule"}, {"key": "a", "effect": "NoExecute"}, False),
    ({"key": "a", "value": "x"}, {"key": "a", "value": "x", "effect": "NoSchedule"}, True),
    ({"key": "a", "value": "y"}, {"key": "a", "value": "x", "effect": "NoSchedule"}, False),
    ({"key": "a"}, {"key": "a", "effect": "NoSchedule"}, True),  # Equal, both values empty
    ({"key": "b", "operator": "Exists"}, {"key": "a", "effect": "NoSchedule"}, False),
])
def test_a_toleration_matches_a_taint_as_kubernetes_matches_it(toleration: dict[str, Any], taint: dict[str, Any],
                                                               matches: bool) -> None:
    assert tolerates(Toleration.model_validate(toleration), taint) is matches


def test_a_heartbeat_wakes_no_job_but_readiness_gpus_labels_cordoning_and_taints_do() -> None:
    before = node_signature(slim_node(NODE))
    beat = copy.deepcopy(NODE)
    beat["metadata"]["resourceVersion"] = "42"
    beat["status"]["conditions"][1]["lastHeartbeatTime"] = "2026-11-26T10:05:00Z"
    assert node_signature(slim_node(beat)) == before
    for change in ({"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
                   {"status": {"allocatable": {GPU_RESOURCE: "7"}}},
                   {"metadata": {"labels": {"pool": "b"}}},
                   {"spec": {"unschedulable": True}},
                   {"spec": {"taints": [{"key": "dedicated", "effect": "NoSchedule"}]}}):
        changed = copy.deepcopy(NODE)
        for part, fields in change.items():
            changed[part].update(fields)
        assert node_signature(slim_node(changed)) != before, change


def test_the_snapshot_is_the_jobs_own_children_and_every_node() -> None:
    pod = {"metadata": {"name": "a-0-head"}}
    indexes = {"pods": {("ml", "a"): [pod], ("ml", "b"): [{"metadata": {"name": "b-0-head"}}]},
               "configmaps": {}, "services": {}, "persistentvolumeclaims": {}, NODES: {NODES: [slim_node(NODE)]}}
    world = World.of(indexes, "ml", "a")
    assert world.pods == (pod,) and world.configmaps == () and len(world.nodes) == 1
    assert World.of(indexes, "other", "a").pods == ()


def test_objects_an_audit_found_gone_leave_the_snapshot() -> None:
    """kopf's index keeps an object deleted while its watch was down; the snapshot
    leaves out the uids an audit found gone (a new object under the same name stays)."""
    stale = {"metadata": {"name": "a-0-m0-h0", "uid": "u1"}}
    again = {"metadata": {"name": "a-0-m0-h0", "uid": "u2"}}
    indexes = {"pods": {("ml", "a"): [stale, again]}, "configmaps": {("ml", "a"): [{"metadata": {"uid": "c"}}]},
               "services": {}, "persistentvolumeclaims": {}, NODES: {}}
    world = World.of(indexes, "ml", "a", gone={"u1"})
    assert world.pods == (again,) and len(world.configmaps) == 1


def test_an_audit_names_the_children_deleted_during_a_gap(tmp_path: Any) -> None:
    """Against the test API server: a child deleted meanwhile, and one deleted and made
    again under its name, are gone; one still there, and one made after the list (not
    in the snapshot), are not."""
    pytest.importorskip("kmock")
    from kube_emulator import Emulator
    from kubernetes import client

    from alpajob.api.names import LABEL_JOB
    from alpajob.operator.kube import Kube

    emu = Emulator(tmp_path).start()
    try:
        emu.create_namespace("ml", restricted=False)
        core = client.CoreV1Api(emu.api())

        def pod(name: str) -> dict[str, Any]:
            body = {"metadata": {"name": name, "labels": {LABEL_JOB: "a"}},
                    "spec": {"containers": [{"name": "c", "image": "x"}]}}
            return core.api_client.sanitize_for_serialization(core.create_namespaced_pod("ml", body))

        def config_map(name: str) -> dict[str, Any]:
            body = {"metadata": {"name": name, "labels": {LABEL_JOB: "a"}}, "data": {}}
            return core.api_client.sanitize_for_serialization(core.create_namespaced_config_map("ml", body))

        kept, deleted, remade, plan = pod("a-0-head"), pod("a-0-m0-h0"), pod("a-0-m1-h0"), config_map("a-plan")
        snapshot = World(pods=(kept, deleted, remade), configmaps=(plan,))
        core.delete_namespaced_pod("a-0-m0-h0", "ml", grace_period_seconds=0)
        core.delete_namespaced_pod("a-0-m1-h0", "ml", grace_period_seconds=0)
        pod("a-0-m1-h0")
        core.delete_namespaced_config_map("a-plan", "ml")
        pod("a-0-m2-h0")  # made after the snapshot: the audit leaves it to the watch
        gone = Kube(emu.api()).vanished("ml", "a", snapshot)
        assert gone == {deleted["metadata"]["uid"], remade["metadata"]["uid"], plan["metadata"]["uid"]}
    finally:
        emu.stop()


def test_the_api_contact_counts_each_return_of_the_server() -> None:
    from alpajob.operator.health import ApiContact

    up = [True]

    def ask() -> None:
        if not up[0]:
            raise ConnectionRefusedError("refused")

    contact = ApiContact(ask)
    contact.ping()
    up[0] = False
    contact.ping()
    contact.ping()
    assert contact.gaps == 0
    up[0] = True
    contact.ping()
    contact.ping()
    assert contact.gaps == 1


def test_a_change_wakes_its_job_only_and_a_forgotten_job_is_not_woken() -> None:
    async def scenario() -> None:
        wakers = Wakers()
        a, b = wakers.of("ml", "a"), wakers.of("ml", "b")
        wakers.wake("ml", "a")
        wakers.wake("ml", "unknown")  # a job without a daemon (yet): nothing to wake
        assert a.is_set() and not b.is_set()
        wakers.wake_all()
        assert b.is_set()
        wakers.forget("ml", "a")
        assert list(wakers.jobs()) == [("ml", "b")]

    asyncio.run(scenario())


def test_the_api_contact_fails_only_after_its_threshold_of_silence() -> None:
    from alpajob.operator.health import ApiContact, LostApiServer

    now = [0.0]
    up = [True]

    def ask() -> None:
        if not up[0]:
            raise ConnectionRefusedError("Connect call failed ('10.96.0.1', 443)")

    contact = ApiContact(ask, threshold=60.0, clock=lambda: now[0])
    contact.ping()
    assert contact.state() == {"apiServerSilentSeconds": 0.0}
    up[0] = False
    now[0] = 45.0
    contact.ping()
    assert contact.state() == {"apiServerSilentSeconds": 45.0}  # a blip: still alive
    now[0] = 61.0
    with pytest.raises(LostApiServer, match=r"for 61 s .*Connect call failed"):
        contact.state()
    up[0] = True
    contact.ping()
    assert contact.state() == {"apiServerSilentSeconds": 0.0}


def test_the_probe_answers_at_once_while_the_api_server_hangs() -> None:
    """A call to an API server that hangs (a dropped connection waits for its timeout
    and retries) blocks the contact's thread, never the probe: its answer is what the
    thread last saw, and silence past the threshold fails it at once."""
    import threading
    import time

    from alpajob.operator.health import ApiContact, LostApiServer

    hang = threading.Event()
    answered = []

    def ask() -> None:
        if hang.is_set():
            time.sleep(30)  # the daemon thread is left behind
        answered.append(1)

    contact = ApiContact(ask, threshold=0.5, period=0.05).start()
    try:
        deadline = time.monotonic() + 5
        while not answered and time.monotonic() < deadline:
            time.sleep(0.01)
        assert contact.state()["apiServerSilentSeconds"] < 0.5
        hang.set()
        time.sleep(0.7)
        began = time.monotonic()
        with pytest.raises(LostApiServer, match="no answer from the API server"):
            contact.state()
        assert time.monotonic() - began < 0.1
    finally:
        contact.stop()
