"""`kubectl apply` to a trained model: the operator's own pods train an AlpaJob.

The operator runs as a process against the test's Kubernetes API (KMock, with the
admission and pruning of a real API server: ``kube_emulator``; or a real cluster
named by ``ALPAJOB_E2E_KUBECONFIG``: ``e2e_cluster``); the test's kubelet
(``kubelet``) runs every pod the operator creates from the pod's own command and
environment: the planner pod plans into the plan ConfigMap, the head pod starts the
Ray head and the driver, each mesh pod joins as a Ray worker with its forced CPU
devices. Nothing is played by hand: the job goes Planning -> Starting -> Running ->
Succeeded, and its status shows the trainer's progress, a real text's loss falling.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_cluster import open_cluster, operator_kubeconfig, operator_process, unique_namespace
from kube_emulator import Emulator
from kubelet import Kubelet
from kubernetes import client, config
from outage import Gate, gated_kubeconfig

pytest.importorskip("ray")
#: Minutes each (Ray's processes start one after another on 2 cores): behind the slow
#: marker, run by .ci/run on its own.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
GROUP, VERSION, PLURAL = "alpajob.io", "v1alpha1", "alpajobs"


@contextlib.contextmanager
def _world(tmp_path: Path, gate: bool = False) -> Iterator[tuple[Emulator, Kubelet, Path, str, Gate | None]]:
    """The test API server (or $ALPAJOB_E2E_KUBECONFIG's cluster), a namespace of four
    nodes, the test kubelet and the operator. With ``gate``, everything but the test
    reaches the API server through a :class:`~outage.Gate` (the test reads it directly)."""
    (tmp_path / "kmock").mkdir()
    emu = open_cluster(tmp_path / "kmock", graceful_pods=True)  # KMock, or $ALPAJOB_E2E_KUBECONFIG's cluster
    ns = unique_namespace("ml")  # each test its own, released after it
    emu.cluster_of(ns, nodes=4)
    door = Gate(int(emu.url.rsplit(":", 1)[1])) if gate else None
    kubeconfig = gated_kubeconfig(emu.kubeconfig, door, tmp_path / "gated") if door else emu.kubeconfig
    env = {"KUBECONFIG": str(kubeconfig)}
    fake_nodes = frozenset(emu.nodes) if getattr(emu, "real", False) else None  # a real scheduler binds pods
    # Deleted pods stay 10 s after their process ends, as on a slow node: a new attempt
    # must never start beside them.
    api = config.new_client_from_config(str(kubeconfig))
    kubelet = Kubelet(api, ns, tmp_path / "kubelet", env=env, stagger=6.0, nodes=fake_nodes, linger=10.0)
    kubelet.env.pop("XLA_FLAGS", None)  # each pod forces its own device count (ALPAJOB_DEVICES)
    kubelet.start()
    if isinstance(emu, Emulator):  # pods/log, as an API server serves it from the node's kubelet
        emu.pod_logs = lambda namespace, name: kubelet.root / "pods" / name / "log.txt"
    log = tmp_path / "operator.log"
    # The operator as its own ServiceAccount, with the shipped RBAC (a missing verb: a 403).
    as_operator = {"KUBECONFIG": str(operator_kubeconfig(emu, tmp_path, ns, base=kubeconfig))}
    try:
        with operator_process(ns, as_operator, log):
            yield emu, kubelet, log, ns, door
        assert getattr(emu, "forbidden", []) == [], "the shipped RBAC refused what the operator or a pod asked"
    finally:
        kubelet.stop()
        if door is not None:
            door.down()
        if getattr(emu, "real", False):
            emu.release(ns)
        emu.stop()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Emulator, Kubelet, Path, str]]:
    with _world(tmp_path) as (emu, kubelet, log, ns, _):
        yield emu, kubelet, log, ns


_STEP = re.compile(r"^step (\d+)/", re.M)


def _seconds_to_next_step(kubelet: Kubelet, head: str, began: float, timeout: float = 400) -> float:
    """Seconds from ``began`` until ``head``'s log shows a step after its last restore
    from a checkpoint (the driver prints one line per step): what a restart cost."""
    deadline = time.monotonic() + timeout
    marker = "restoring every mesh from the checkpoint of step"
    while time.monotonic() < deadline:
        text = kubelet.log(head) if head in kubelet.started else ""
        if marker in text and _STEP.search(text, text.rindex(marker)):
            return time.monotonic() - began
        time.sleep(0.25)
    raise AssertionError(f"{head} never stepped after restoring:\n{kubelet.log(head)[-3000:]}\n"
                         f"{_after_the_stop(kubelet, head.removesuffix('head'))}")


def _job(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "manifests" / "examples" / "manual-gpt.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": ns}
    doc["spec"]["data"] = {"train": str(ROOT / "planner" / "**" / "*.py"), "eval": str(ROOT / "operator" / "*.py")}
    doc["spec"]["training"] = {"globalBatchSize": 16, "steps": 24, "evalEvery": 12, "evalSteps": 2,
                               "optimizer": {"name": "adamw", "learningRate": 3e-3, "warmupSteps": 4}}
    doc["spec"].update(spec)
    return doc


def _wait(what: str, check: Callable[[], Any], kubelet: Kubelet, log: Path, timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    folder = kubelet.root / "pods"
    names = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    pods = "\n".join(f"--- {name}\n{kubelet.log(name)[-2500:]}" for name in names)
    raise AssertionError(f"timed out waiting for {what}\nkubelet errors: {kubelet.errors}\n"
                         f"operator:\n{log.read_text()[-2000:]}\n{pods}")


def test_kubectl_apply_trains_a_gpt_on_real_text_in_the_operators_pods(
        world: tuple[Emulator, Kubelet, Path, str]) -> None:
    emu, kubelet, log, ns = world
    custom = client.CustomObjectsApi(emu.api())
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, _job("gpt-real", ns))

    def status() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "gpt-real").get("status") or {}

    phases: list[str] = []

    def done() -> bool:
        phase = status().get("phase")
        if phase and (not phases or phases[-1] != phase):
            phases.append(phase)
        return phase in ("Succeeded", "Failed")

    _wait("the job to finish", done, kubelet, log, timeout=600)
    final = status()
    assert final["phase"] == "Succeeded", (final, phases)
    assert phases[0] in ("Pending", "Planning") and "Running" in phases, phases
    progress = final["progress"]
    assert progress["step"] == 24 and progress["phase"] == "Succeeded"
    assert progress["loss"] < math.log(256) - 0.5, progress  # chance is ln 256 = 5.55 nats per byte
    assert progress["evalLoss"] < math.log(256) - 0.5, progress
    assert kubelet.finished["gpt-real-0-head"] == 0


def test_with_restart_scope_failed_pods_only_the_killed_mesh_pod_is_replaced(
        world: tuple[Emulator, Kubelet, Path, str]) -> None:
    """restartScope FailedPods: a killed mesh pod is replaced alone (same attempt); the
    head pod's driver keeps its Ray cluster, waits for the new pod's host and restarts
    every stage from the last checkpoint; the job succeeds with one restart and its
    head pod and the other mesh pod never restarted."""
    emu, kubelet, log, ns = world
    custom = client.CustomObjectsApi(emu.api())
    emu.claim(ns, "ckpt")
    doc = _job("gpt-swap", ns, checkpoint={"volume": "ckpt", "intervalSteps": 5},
               runPolicy={"restartScope": "FailedPods", "backoffLimit": 2})
    steps = 150  # long enough that the kill lands mid-run (progress is reported every 5 s)
    doc["spec"]["training"].update(steps=steps)
    doc["spec"]["training"].pop("evalEvery")
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)

    def status() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "gpt-swap").get("status") or {}

    def saved() -> dict[str, Any] | None:
        progress = status().get("progress") or {}
        return progress if (progress.get("lastCheckpointStep") or 0) >= 5 else None

    at_kill = _wait("a checkpoint", saved, kubelet, log, timeout=400)
    killed = time.monotonic()
    kubelet.kill("gpt-swap-0-m1-h0")
    assert at_kill["step"] < steps - 20, at_kill  # mid-run
    print(f"\nfrom the kill to the next step: {_seconds_to_next_step(kubelet, 'gpt-swap-0-head', killed):.1f} s")
    _wait("the job to finish", lambda: status().get("phase") in ("Succeeded", "Failed"), kubelet, log, timeout=500)
    final = status()
    print(f"\nstatus.time: {final.get('time')}")  # the restart's cost, for RESULTS.md
    assert final["phase"] == "Succeeded", final
    assert final["children"]["attempt"] == 0 and final["restarts"] == 1
    assert final["progress"]["step"] == steps
    # Replaced once (its own name, or "-r1" when the failed one was still there).
    assert len([n for n in kubelet.started if n.startswith("gpt-swap-0-m1-h0")]) == 2
    assert kubelet.started.count("gpt-swap-0-head") == 1 and kubelet.started.count("gpt-swap-0-m0-h0") == 1
    assert not [n for n in kubelet.started if n.startswith("gpt-swap-1-")]
    assert "restart 1/2" in kubelet.log("gpt-swap-0-head")


def test_a_killed_mesh_pod_restarts_every_mesh_from_the_last_checkpoint(
        world: tuple[Emulator, Kubelet, Path, str]) -> None:
    """restartScope Job: a mesh pod's processes are killed mid-run: the driver fails,
    the operator restarts every mesh as attempt 1, which resumes from the newest
    checkpoint on the job's volume (so at most the checkpoint interval is lost), and
    the job still succeeds."""
    emu, kubelet, log, ns = world
    custom = client.CustomObjectsApi(emu.api())
    emu.claim(ns, "ckpt")  # the job's checkpoint volume, as a user makes it
    doc = _job("gpt-kill", ns, checkpoint={"volume": "ckpt", "intervalSteps": 5}, runPolicy={"restartScope": "Job"})
    doc["spec"]["training"].update(steps=40, evalEvery=None)
    doc["spec"]["training"].pop("evalEvery")
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)

    def status() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "gpt-kill").get("status") or {}

    def saved() -> int | None:
        step = (status().get("progress") or {}).get("lastCheckpointStep")
        return step if step and step >= 10 else None

    before = _wait("a checkpoint of step 10 or later", saved, kubelet, log, timeout=400)
    kubelet.kill("gpt-kill-0-m1-h0")
    _wait("the job to finish", lambda: status().get("phase") in ("Succeeded", "Failed"), kubelet, log, timeout=400)
    final = status()
    print(f"\nstatus.time: {final.get('time')}")  # the restart's cost, for RESULTS.md
    assert final["phase"] == "Succeeded", final
    assert final["restarts"] == 1 and final["children"]["attempt"] == 1
    assert final["progress"]["step"] == 40
    resumed = [line for line in kubelet.log("gpt-kill-1-head").splitlines()
               if "restoring every mesh from the checkpoint of step" in line]
    assert resumed, kubelet.log("gpt-kill-1-head")[-3000:]
    step = int(resumed[0].rsplit(" ", 1)[1])
    assert step >= before  # the checkpoint there when the pod died, or a newer one
    assert (kubelet.root / "claims" / "ckpt" / "gpt-kill").is_dir()


def test_a_mesh_on_two_hosts_forms_its_process_group_at_the_contracts_coordinator(
        world: tuple[Emulator, Kubelet, Path, str]) -> None:
    """Mesh 1 spans two pods (nodes): its hosts join one JAX process group at the
    coordinator the operator wrote into their environment (``ALPAJOB_COORDINATOR``,
    host 0's name under the headless Service), and the job trains to Succeeded."""
    emu, kubelet, log, ns = world
    custom = client.CustomObjectsApi(emu.api())
    doc = _job("gpt-wide", ns)
    doc["spec"]["cluster"] = {"gpu": "cpu", "nodes": 4, "gpusPerNode": 2}
    doc["spec"]["parallelism"]["stages"] = [{"layers": [0, 2], "submeshShape": [1, 2]},
                                            {"layers": [2, 4], "submeshShape": [2, 2]}]
    doc["spec"]["training"].update(steps=8)
    doc["spec"]["training"].pop("evalEvery")
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)

    def status() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "gpt-wide").get("status") or {}

    _wait("the job to finish", lambda: status().get("phase") in ("Succeeded", "Failed"), kubelet, log, timeout=600)
    final = status()
    assert final["phase"] == "Succeeded" and final["restarts"] == 0, final
    assert final["progress"]["step"] == 8
    for host in (0, 1):  # both hosts were told host 0's name under the headless Service
        env = kubelet.envs[f"gpt-wide-0-m1-h{host}"]
        assert env["ALPAJOB_COORDINATOR"] == f"m1-h0.gpt-wide-hosts.{ns}.svc:8476", env
        assert (env["ALPAJOB_PROCESS_ID"], env["ALPAJOB_PROCESS_COUNT"]) == (str(host), "2")


def test_deleting_a_mesh_pod_mid_run_never_fails_the_job(world: tuple[Emulator, Kubelet, Path, str]) -> None:
    """``kubectl delete pod`` of a mesh pod mid-run, by default (restartScope
    FailedPods): a disruption, not a failure. The pod terminates (the kubelet keeps it
    10 s after its process ended) while its replacement, ``-r1``, starts, and its host joins the
    head's Ray cluster; the driver replaces mesh 1's actors alone (mesh 0 keeps its
    process and compiled stages), every mesh goes back to the last checkpoint and the
    job succeeds in its first attempt, its evaluation included, with restarts 0,
    disruptions 1 and progress.restarts 1. The time from the deletion to the next step
    is printed for RESULTS.md."""
    emu, kubelet, log, ns = world
    custom = client.CustomObjectsApi(emu.api())
    core = client.CoreV1Api(emu.api())
    doc = _job("gpt-del", ns, checkpoint={"volumeClaimTemplate": {"size": "1Gi"}, "intervalSteps": 5})
    steps = 200  # the deletion lands mid-run (progress is reported every 5 s), the plugin's look after it
    doc["spec"]["training"].update(steps=steps)
    doc["spec"]["training"].pop("evalEvery")  # one evaluation, after the last step
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)

    def status() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "gpt-del").get("status") or {}

    def saved() -> dict[str, Any] | None:
        progress = status().get("progress") or {}
        return progress if (progress.get("lastCheckpointStep") or 0) >= 5 else None

    at_deletion = _wait("a checkpoint", saved, kubelet, log, timeout=400)
    assert at_deletion["step"] < steps - 20, at_deletion  # mid-run
    deleted = time.monotonic()
    core.delete_namespaced_pod("gpt-del-0-m1-h0", ns)  # as kubectl does: the pod's grace period
    print(f"\nfrom kubectl delete pod to the next step: {_seconds_to_next_step(kubelet, 'gpt-del-0-head', deleted):.1f} s")
    if isinstance(emu, Emulator):  # while it trains on, from the last checkpoint (seen here on a quick machine)
        _the_plugin_shows_the_running_job(emu, ns, "gpt-del", "gpt-del-0-m1-h0-r1")
    _wait("the job to finish", lambda: status().get("phase") in ("Succeeded", "Failed"), kubelet, log, timeout=500)
    final = status()
    print(f"status.time: {final.get('time')}")
    assert final["phase"] == "Succeeded", final
    assert (final["restarts"], final["disruptions"], final["progress"]["restarts"]) == (0, 1, 1), final
    assert final["children"]["attempt"] == 0 and final["progress"]["step"] == steps
    assert final["progress"].get("evalLoss"), final["progress"]  # the evaluation ran across the repaired meshes
    # Replaced once, beside the deleted pod while it terminated (as a Job replaces one).
    assert (kubelet.started.count("gpt-del-0-m1-h0"), kubelet.started.count("gpt-del-0-m1-h0-r1")) == (1, 1), \
        kubelet.started
    assert kubelet.started.count("gpt-del-0-head") == 1 and kubelet.started.count("gpt-del-0-m0-h0") == 1
    assert not [n for n in kubelet.started if n.startswith("gpt-del-1-")]  # no second attempt
    head = kubelet.log("gpt-del-0-head")
    assert "replaced mesh 1; the other meshes kept their processes and compiled stages" in head, head[-3000:]
    assert "Draining for up to" not in kubelet.log("gpt-del-0-m1-h0")  # the deleted pod's node stopped at once
    assert "Unhandled error" not in head, head[-3000:]  # the survivor's failed step was fetched, not logged
    assert (kubelet.root / "claims" / "gpt-del-checkpoints" / "gpt-del").is_dir()  # the claim the operator made
    assert list((kubelet.root / "claims" / "gpt-del-checkpoints" / ".alpajob" / "xla").iterdir())  # executables kept
    # The driver released its mesh hosts at the end: their pods exited 0 and stay,
    # Succeeded, with their logs (cleanPodPolicy Running deletes only running pods).
    for mesh_pod in ("gpt-del-0-m0-h0", "gpt-del-0-m1-h0-r1"):
        _wait(f"{mesh_pod} to end", lambda name=mesh_pod: name in kubelet.finished, kubelet, log, timeout=60)
        assert kubelet.finished[mesh_pod] == 0, kubelet.log(mesh_pod)[-2000:]
        assert "released by the driver" in kubelet.log(mesh_pod)
        assert core.read_namespaced_pod(mesh_pod, ns).status.phase == "Succeeded"


def _one_job_queue(emu: Emulator, ns: str) -> dict[str, str]:
    """Kueue's objects for two jobs that take turns: a ClusterQueue that admits three
    pods (one job's head and two mesh pods) and preempts for priority, its LocalQueue
    ``team`` in ``ns``, and PriorityClasses ``low-<ns>`` and ``high-<ns>``."""
    from kueue import GROUP as KUEUE
    from kueue import VERSION as V

    api = emu.api()
    custom = client.CustomObjectsApi(api)
    names = {"flavor": f"any-{ns}", "cq": f"cq-{ns}", "low": f"low-{ns}", "high": f"high-{ns}"}
    custom.create_cluster_custom_object(KUEUE, V, "resourceflavors", {
        "apiVersion": f"{KUEUE}/{V}", "kind": "ResourceFlavor", "metadata": {"name": names["flavor"]}, "spec": {}})
    custom.create_cluster_custom_object(KUEUE, V, "clusterqueues", {
        "apiVersion": f"{KUEUE}/{V}", "kind": "ClusterQueue", "metadata": {"name": names["cq"]},
        "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                 "resourceGroups": [{"coveredResources": ["cpu", "memory", "pods"], "flavors": [
                     {"name": names["flavor"], "resources": [{"name": "cpu", "nominalQuota": "64"},
                                                             {"name": "memory", "nominalQuota": "512Gi"},
                                                             {"name": "pods", "nominalQuota": "3"}]}]}]}})
    custom.create_namespaced_custom_object(KUEUE, V, ns, "localqueues", {
        "apiVersion": f"{KUEUE}/{V}", "kind": "LocalQueue", "metadata": {"name": "team", "namespace": ns},
        "spec": {"clusterQueue": names["cq"]}})
    for name, value in ((names["low"], 10), (names["high"], 1000)):
        client.SchedulingV1Api(api).create_priority_class({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name}, "value": value})
    return names


def test_under_kueue_a_job_of_higher_priority_preempts_one_that_checkpoints_and_resumes_to_succeeded(
        tmp_path: Path) -> None:
    """Two jobs in one ClusterQueue whose quota fits one: the low-priority job trains in
    the operator's pods; a high-priority job queues, and Kueue preempts the first. Its
    head's driver gets SIGTERM, saves a checkpoint of the step it was at and exits 143;
    the job counts a disruption (no restart spent), queues again as attempt 1 while the
    second job trains to Succeeded, then is admitted again, restores that very
    checkpoint and trains to Succeeded. Kueue's part is ``kueue.py``'s."""
    with _world(tmp_path) as (emu, kubelet, log, ns, _):
        if not isinstance(emu, Emulator):
            pytest.skip("plays Kueue on the test API server (a real cluster brings its own Kueue)")
        from kueue import Kueue

        kueue = Kueue(emu).install()
        kueue.manage(ns)
        kueue.start()
        try:
            names = _one_job_queue(emu, ns)
            custom = client.CustomObjectsApi(emu.api())
            emu.claim(ns, "ckpt")
            low = _job("kq-low", ns, checkpoint={"volume": "ckpt", "intervalSteps": 5},
                       scheduling={"queue": "team", "priorityClassName": names["low"]})
            steps = 400  # long enough that the preemption lands mid-run (it did at step 165 of 600)
            low["spec"]["training"].update(steps=steps)
            low["spec"]["training"].pop("evalEvery")
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, low)

            def status(job: str) -> dict[str, Any]:
                return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job).get("status") or {}

            def saved() -> dict[str, Any] | None:
                progress = status("kq-low").get("progress") or {}
                return progress if (progress.get("lastCheckpointStep") or 0) >= 5 else None

            _wait("kq-low's first checkpoint", saved, kubelet, log, timeout=400)
            high = _job("kq-high", ns, scheduling={"queue": "team", "priorityClassName": names["high"]})
            high["spec"]["training"].update(steps=12)
            high["spec"]["training"].pop("evalEvery")
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, high)
            _wait("kq-low preempted", lambda: status("kq-low").get("disruptions") == 1, kubelet, log, timeout=300)
            _wait("kq-low queued again", lambda: status("kq-low").get("phase") == "Queued", kubelet, log, timeout=120)
            _wait("kq-high to finish", lambda: status("kq-high").get("phase") in ("Succeeded", "Failed"),
                  kubelet, log, timeout=400)
            assert status("kq-high")["phase"] == "Succeeded", status("kq-high")
            _wait("kq-low to finish", lambda: status("kq-low").get("phase") in ("Succeeded", "Failed"),
                  kubelet, log, timeout=500)
            final = status("kq-low")
            print(f"\nkq-low status.time: {final.get('time')}")
            assert final["phase"] == "Succeeded", final
            assert (final["restarts"], final["disruptions"], final["children"]["attempt"]) == (0, 1, 1), final
            assert final["progress"]["step"] == steps
            # The preempted head saved the step it was at, and the next attempt went on from there.
            stopped = re.search(r"SIGTERM after step (\d+): stopping", kubelet.log("kq-low-0-head"))
            assert stopped, kubelet.log("kq-low-0-head")[-3000:]
            assert kubelet.finished["kq-low-0-head"] == 143
            resumed = re.search(r"restoring every mesh from the checkpoint of step (\d+)", kubelet.log("kq-low-1-head"))
            assert resumed and resumed.group(1) == stopped.group(1), _after_the_stop(kubelet, "kq-low-0-")
            assert not [n for n in kubelet.started if n.startswith("kq-low-1-")
                        and kubelet.started.index(n) < kubelet.started.index("kq-high-0-head")]
            assert kueue.errors == []
        finally:
            kueue.stop()


def _after_the_stop(kubelet: Kubelet, prefix: str) -> str:
    """What each pod named ``prefix...`` printed from its stop on (the driver's and every
    mesh worker's word about the stop and the save)."""
    names = sorted(n for n in kubelet.finished if n.startswith(prefix))
    first = min((kubelet.signalled[n] for n in names if n in kubelet.signalled), default=0.0)
    out = []
    for name in names:
        # Ray's own lines (a raylet's whole command line) would crowd ours out
        text = "\n".join(line for line in kubelet.log(name).splitlines() if len(line) < 400)
        at = text.find("SIGTERM")
        when = f"SIGTERM at +{kubelet.signalled[name] - first:.1f} s" if name in kubelet.signalled else "no SIGTERM"
        out.append(f"--- {name} ({when}, exit {kubelet.finished[name]}):\n"
                   f"{text[at:][:6000] if at >= 0 else text[-3000:]}")
    return "\n".join(out)


def _the_plugin_shows_the_running_job(emu: Emulator, ns: str, job: str, mesh_1: str) -> None:
    """``kubectl alpajob`` (the installed ``kubectl-alpajob``) on a job the operator's pods
    train: its plan, its pods (mesh 1's host: ``mesh_1``), each stage's times from the
    head's metrics through the API server's pod proxy, and the logs of every pod of the
    attempt."""
    import subprocess
    import sys

    plugin = [str(Path(sys.executable).parent / "kubectl-alpajob"), "--kubeconfig", str(emu.kubeconfig), "-n", ns]

    def run(*argv: str) -> str:
        done = subprocess.run([*plugin, *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"kubectl alpajob {' '.join(argv)}: {done.stderr}"
        return done.stdout

    assert "predicted step time" in run("plan", job)
    pods = run("pods", job)
    # (a replacement is starred, as the attempt's, once the pod it replaces is gone)
    assert f"{ns}/{job}: Running" in pods and f"{job}-0-head *" in pods and f"{mesh_1}" in pods, pods
    top = run("top", job)
    stages = [line.split() for line in top.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(stages) == 2 and all(float(row[1]) > 0 for row in stages), top  # each stage computed
    assert "step " in top.splitlines()[0], top
    logs = run("logs", job, "--tail", "50").splitlines()
    assert any(line.startswith(f"{job}-0-head ") and "step " in line for line in logs), logs[-20:]
    assert any(line.startswith(f"{job}-0-m0-h0 ") for line in logs), logs[-20:]


#: Seconds the API server is away mid-run (a managed control plane's restart took 90 s
#: on the real node); ``ALPAJOB_E2E_OUTAGE`` sets another.
OUTAGE = float(os.environ.get("ALPAJOB_E2E_OUTAGE", "120"))


def test_a_job_trains_through_an_api_server_outage(tmp_path: Path) -> None:
    """The API server is unreachable for :data:`OUTAGE` seconds mid-run (less where the
    job would finish sooner: the outage ends while it trains) (every client
    but the test gets Connection refused, as from a restarting kube-apiserver; the
    server keeps its state, as etcd does): the trainer keeps training (its progress
    writes wait in their own thread), the kubelet keeps its pods, the operator lists
    again when the server is back; the progress catches up within seconds and the job
    Succeeds with no restart and no disruption."""
    from e2e_cluster import real_kubeconfig

    if real_kubeconfig() is not None:
        pytest.skip("gates the test API server's port; a real cluster's outage is its own")
    with _world(tmp_path, gate=True) as (emu, kubelet, log, ns, gate):
        assert gate is not None
        custom = client.CustomObjectsApi(emu.api())  # the test's own view, not through the gate
        doc = _job("gpt-out", ns)
        steps = int(OUTAGE * 6)  # 720: on a busy hour (about 2.5 steps/s) it trains for minutes after
        doc["spec"]["training"].update(steps=steps)
        doc["spec"]["training"].pop("evalEvery")
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)

        def progress() -> dict[str, Any]:
            status = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "gpt-out").get("status")
            return dict((status or {}).get("progress") or {}, jobPhase=(status or {}).get("phase"))

        first = _wait("training", lambda: progress().get("step", 0) >= 5 and progress()["step"], kubelet, log,
                      timeout=400)
        began = time.monotonic()
        time.sleep(15)
        before = progress()["step"]
        rate = max(before - first, 1) / (time.monotonic() - began)
        # The outage ends while the job still trains: on a quiet machine the job is faster
        # than the outage is long, and the outage is cut to 60% of the training still to do.
        away = min(OUTAGE, 0.6 * (steps - before) / rate)
        gate.down()
        time.sleep(away)
        during = progress()["step"]  # what got through before the gate closed
        gate.up()
        back = time.monotonic()
        after = _wait("the progress to catch up", lambda: progress().get("step", 0) > during + 10 and
                      progress()["step"], kubelet, log, timeout=120)
        caught_up = time.monotonic() - back
        print(f"\nthe API server was away {away:.0f} s from step {before} (training {rate:.1f} steps/s); "
              f"progress at step {after} {caught_up:.1f} s after it came back")
        _wait("the job to finish", lambda: progress()["jobPhase"] in ("Succeeded", "Failed"), kubelet, log,
              timeout=900)
        final = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "gpt-out")["status"]
        assert final["phase"] == "Succeeded", final
        assert (final["restarts"], final.get("disruptions", 0), final["progress"]["restarts"]) == (0, 0, 0), final
        assert final["children"]["attempt"] == 0 and final["progress"]["step"] == steps
        assert not [n for n in kubelet.started if n.startswith("gpt-out-1-")]  # no second attempt
        head = kubelet.log("gpt-out-0-head")
        assert "the API server is unreachable" in head and "the API server is back after" in head, head[-3000:]
        assert caught_up < 60, caught_up  # the publisher's longest pause is 30 s
