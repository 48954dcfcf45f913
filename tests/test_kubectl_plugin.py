"""``kubectl alpajob`` (alpajob/cli/kubectl.py) against the test API server: a job in
Running with its plan ConfigMap, pods of two attempts, a head serving the trainer's
real metrics (read through the API server's pod proxy) and pods' logs (pods/log).
The pods e2e (tests/test_pods_train.py) runs it on a job the operator's pods train."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")
sys.path.insert(0, str(Path(__file__).parent))
from kube_emulator import Emulator  # noqa: E402
from kubernetes import client  # noqa: E402

from alpajob.api.names import LABEL_ATTEMPT, LABEL_JOB, LABEL_ROLE, PLAN_KEY  # noqa: E402
from alpajob.api.plan import plan_from_json  # noqa: E402
from alpajob.api.progress import Progress  # noqa: E402
from alpajob.cli.kubectl import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GROUP, VERSION, PLURAL = "alpajob.io", "v1alpha1", "alpajobs"
NS = "ml"


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    from alpajob.cli.main import main as alpajob

    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert alpajob(["plan", str(ROOT / "manifests/examples/manual-gpt.yaml"), "--output", str(out)]) == 0
    return out.read_text()


class Cluster:
    def __init__(self, emu: Emulator, root: Path) -> None:
        self.emu, self.root = emu, root
        self.api = emu.api()
        self.core, self.custom = client.CoreV1Api(self.api), client.CustomObjectsApi(self.api)
        self.kubeconfig = root / "kubeconfig-ns"
        config = yaml.safe_load(emu.kubeconfig.read_text())
        config["contexts"][0]["context"]["namespace"] = NS  # as `kubectl config set-context --current --namespace`
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.logs = root / "logs"
        self.logs.mkdir()
        emu.pod_logs = lambda namespace, name: self.logs / f"{name}.log"

    def pod(self, name: str, role: str, attempt: int, phase: str, port: int | None = None,
            log: str | None = None) -> None:
        container: dict[str, Any] = {"name": "driver" if role == "head" else role, "image": "x"}
        if port is not None:
            container["ports"] = [{"name": "metrics", "containerPort": port}]
        self.core.create_namespaced_pod(NS, {"metadata": {"name": name, "labels": {
            LABEL_JOB: "demo", LABEL_ROLE: role, LABEL_ATTEMPT: str(attempt)}},
            "spec": {"nodeName": f"node-{attempt}", "containers": [container]}})
        self.core.patch_namespaced_pod_status(name, NS, {"status": {"phase": phase, "podIP": "127.0.0.1"}})
        if log is not None:
            (self.logs / f"{name}.log").write_text(log)

    def run(self, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
        code = main(["--kubeconfig", str(self.kubeconfig), *argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err


@pytest.fixture(scope="module")
def metrics_port(plan_text: str) -> Iterator[int]:
    """The head's /metrics as the driver serves it (trainer_image/metrics.py), after one step."""
    from alpajob.trainer_image.distributed.loopback import free_port
    from alpajob.trainer_image.metrics import TrainingMetrics

    metrics = TrainingMetrics("demo")
    metrics.plan(plan_from_json(plan_text))
    stage = types.SimpleNamespace
    metrics.record(Progress(step=7, loss=2.5, tokens_per_second=1234.0), 0.5,
                   [stage(compute=0.3, idle=0.15, communication=0.05), stage(compute=0.4, idle=0.05, communication=0.05)])
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    yield port
    metrics.close()


@pytest.fixture
def cluster(tmp_path: Path, plan_text: str, metrics_port: int) -> Iterator[Cluster]:
    emu = Emulator(tmp_path).start()
    try:
        emu.create_namespace(NS, restricted=False)
        world = Cluster(emu, tmp_path)
        doc = yaml.safe_load((ROOT / "manifests/examples/manual-gpt.yaml").read_text())
        doc["metadata"] = {"name": "demo", "namespace": NS}
        world.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, doc)
        world.core.create_namespaced_config_map(NS, {"metadata": {"name": "demo-plan"}, "data": {PLAN_KEY: plan_text}})
        plan = plan_from_json(plan_text)
        world.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, "demo", {"status": {
            "phase": "Running", "restarts": 1, "disruptions": 0,
            "plan": {"configMap": "demo-plan", "hash": plan.content_hash(), "stages": 2, "meshes": 2},
            "children": {"attempt": 1, "planner": "demo-planner", "head": "demo-1-head",
                         "meshPods": ["demo-1-m0-h0", "demo-1-m1-h0"]}}})
        world.pod("demo-planner", "planner", 0, "Succeeded", log="planned\n")
        world.pod("demo-0-head", "head", 0, "Failed")
        world.pod("demo-1-head", "head", 1, "Running", port=metrics_port, log="step 6/24 loss 2.6\nstep 7/24 loss 2.5\n")
        world.pod("demo-1-m0-h0", "mesh", 1, "Succeeded", log="mesh 0 joined\n")
        world.pod("demo-1-m1-h0", "mesh", 1, "Succeeded", log="mesh 1 joined\nmesh 1 done")
        yield world
    finally:
        emu.stop()


def test_plan_shows_the_plan_table_from_the_plan_configmap(cluster: Cluster, capsys: pytest.CaptureFixture[str],
                                                           plan_text: str, tmp_path: Path) -> None:
    svg = tmp_path / "plan.svg"
    code, out, err = cluster.run(capsys, "plan", "demo", "--svg", str(svg))
    assert code == 0, err
    plan = plan_from_json(plan_text)
    assert "[0, 2)" in out and "[2, 4)" in out and "predicted step time" in out
    assert f"plan hash {plan.content_hash()}, ConfigMap ml/demo-plan" in out
    assert "<svg" in svg.read_text() and svg.read_text().rstrip().endswith("</svg>")


def test_pods_shows_the_attempts_and_every_pod(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cluster.run(capsys, "pods", "demo")
    assert code == 0, err
    assert out.startswith("ml/demo: Running, attempt 1, restarts 1, disruptions 0")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("demo-")}
    assert rows["demo-1-head"][1:5] == ["*", "head", "1", "Running"]
    assert rows["demo-0-head"][1:4] == ["head", "0", "Failed"]  # the old attempt's, not starred
    assert set(rows) == {"demo-planner", "demo-0-head", "demo-1-head", "demo-1-m0-h0", "demo-1-m1-h0"}


def test_top_reads_the_heads_metrics_through_the_api_servers_pod_proxy(
        cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cluster.run(capsys, "top", "demo")
    assert code == 0, err
    assert "ml/demo (head demo-1-head): step 7, loss 2.5, step seconds 0.5" in out and "tokens/s 1234" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in "01"}
    assert rows["0"][1:5] == ["0.3", "0.15", "0.05", "30.0%"] and rows["1"][4] == "10.0%"
    assert cluster.emu.requests("GET", "/proxy/metrics") >= 1  # through the API server, no port-forward


def test_logs_interleave_every_pod_of_the_attempt_after_its_name(cluster: Cluster,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cluster.core.patch_namespaced_pod_status("demo-1-head", NS, {"status": {"phase": "Succeeded"}})
    code, out, err = cluster.run(capsys, "logs", "demo", "-f")
    assert code == 0, err
    lines = out.splitlines()
    assert "demo-1-head  | step 7/24 loss 2.5" in lines and "demo-1-m1-h0 | mesh 1 done" in lines
    assert not any(line.startswith(("demo-planner", "demo-0-head")) for line in lines)  # not this attempt
    code, out, _ = cluster.run(capsys, "logs", "demo", "--tail", "1")
    assert code == 0 and "demo-1-head  | step 6/24 loss 2.6" not in out.splitlines()


def test_suspend_and_resume_patch_the_run_policy(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    def suspended() -> bool:
        job = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "demo")
        return bool(job["spec"].get("runPolicy", {}).get("suspend"))

    assert cluster.run(capsys, "suspend", "demo")[:2] == (0, "alpajob.io/demo suspended\n") and suspended()
    assert cluster.run(capsys, "resume", "demo")[:2] == (0, "alpajob.io/demo resumed\n") and not suspended()


@pytest.mark.parametrize(("argv", "message"), [
    (["pods", "nosuch"], "AlpaJob ml/nosuch not found (kubectl get aj -n ml)"),
    (["-n", "other", "plan", "demo"], "AlpaJob other/demo not found (kubectl get aj -n other)"),
])
def test_a_missing_job_is_one_line(cluster: Cluster, capsys: pytest.CaptureFixture[str], argv: list[str],
                                   message: str) -> None:
    code, out, err = cluster.run(capsys, *argv)
    assert code == 1 and err == f"kubectl alpajob: {message}\n" and out == ""


def test_an_unreachable_api_server_and_a_bad_command_are_one_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    assert main(["--kubeconfig", str(config), "pods", "demo"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kubectl alpajob: cannot reach the API server") and err.count("\n") == 1
    with pytest.raises(SystemExit) as usage:
        main(["pods"])
    assert usage.value.code == 2


def test_kubectl_finds_the_plugin_on_the_path() -> None:
    """The package installs ``kubectl-alpajob`` next to ``alpajob``: kubectl lists it
    as a plugin and runs it as ``kubectl alpajob``."""
    plugin = Path(sys.executable).parent / "kubectl-alpajob"
    assert plugin.exists(), "pip install -e . installs the kubectl-alpajob script"
    kubectl = subprocess.run(["which", "kubectl"], capture_output=True, text=True)
    if kubectl.returncode != 0:
        pytest.skip("no kubectl on this machine")
    env = {"PATH": f"{plugin.parent}:/usr/bin:/bin", "HOME": str(Path(sys.executable).parent)}
    listed = subprocess.run(["kubectl", "plugin", "list"], capture_output=True, text=True, env=env, timeout=60)
    assert str(plugin) in listed.stdout, listed.stdout + listed.stderr
    helped = subprocess.run(["kubectl", "alpajob", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert helped.returncode == 0 and "usage: kubectl alpajob" in helped.stdout, helped.stderr
