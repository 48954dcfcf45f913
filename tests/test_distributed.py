"""The Ray runtime on a real Ray cluster on loopback, started by the test.

``alpajob ray-head`` and one ``alpajob mesh-worker`` per mesh host run as processes of
this machine (each worker with its own forced CPU devices and its mesh's custom
resource); the driver trains through them, and the results must equal the
single-device run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

pytest.importorskip("ray")

from alpajob.planner.plan import write_plan  # noqa: E402
from alpajob.trainer.distributed.cluster import JoinTimeoutError  # noqa: E402
from alpajob.trainer.distributed.driver import DriverOptions, drive  # noqa: E402

ALPAJOB = [sys.executable, "-m", "alpajob.cli"]
STEPS = 3
#: The mesh hosts the cluster offers: (mesh, host, devices). Mesh 1 has two hosts: a
#: plan whose stage 1 is 1 x 4 uses host 0 alone; one whose stage 1 is 2 x 2 spans
#: both (host 0 then uses its first 2 devices).
MESHES = [(0, 0, 2), (1, 0, 4), (1, 1, 2), (2, 0, 2)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pids: list[int]) -> set[int]:
    """Every live process below ``pids`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    stack = list(pids)
    while stack:
        pid = stack.pop()
        for child in children.get(pid, []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class LoopbackCluster:
    """A Ray head and mesh workers as processes of this machine."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        self.env.pop("XLA_FLAGS", None)  # each worker forces its own device count
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[tuple[int, int], subprocess.Popen] = {}
        self.tracked: set[int] = set()

    def _start(self, args: list[str], log: str, ready: str = "block forever", timeout: float = 90) -> subprocess.Popen:
        out = open(self.root / log, "a")  # noqa: SIM115 (closed with the process)
        begin = (self.root / log).stat().st_size
        proc = subprocess.Popen(ALPAJOB + args, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout
        while ready not in (self.root / log).read_text()[begin:]:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{log} did not start:\n{(self.root / log).read_text()[-3000:]}")
            time.sleep(0.5)
        return proc

    def start_worker(self, mesh: int, host: int, devices: int) -> None:
        self.workers[mesh, host] = self._start(
            ["mesh-worker", "--address", self.address, "--mesh", str(mesh), "--host", str(host),
             "--devices", str(devices)], f"mesh{mesh}-host{host}.log")

    def start(self) -> None:
        self._start(["ray-head", "--port", str(self.port), "--temp-dir", str(self.root / "ray")], "head.log")
        for mesh, host, devices in MESHES:  # one at a time: raylets started together time out
            self.start_worker(mesh, host, devices)

    def kill_worker(self, mesh: int, host: int) -> None:
        """SIGKILL a mesh worker and everything below it (the node is lost)."""
        proc = self.workers.pop((mesh, host))
        tree = _descendants([proc.pid]) | {proc.pid}
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.procs.remove(proc)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> set[int]:
        """Stop every process; return those still alive afterwards."""
        self.tracked |= _descendants([p.pid for p in self.procs]) | {p.pid for p in self.procs}
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        while time.monotonic() < deadline and any(_alive(p) for p in self.tracked):
            time.sleep(0.5)
        self.procs = []
        return {p for p in self.tracked if _alive(p)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    loop = LoopbackCluster(Path(str(tmp_path_factory.mktemp("ray", numbered=True))))
    try:
        loop.start()
        yield loop
    finally:
        leftover = loop.stop()
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)


def _manifest(stages: list[dict[str, Any]], micro_batches: int = 4, schedule: str = "1f1b",
              layers: int | None = None, nodes: int = 1) -> dict[str, Any]:
    parallelism: dict[str, Any] = {"method": "manual", "numMicroBatches": micro_batches,
                                   "schedule": schedule, "stages": stages}
    if layers:
        parallelism["numLayers"] = layers
    return {
        "apiVersion": "alpajob.io/v1alpha1",
        "kind": "AlpaJob",
        "metadata": {"name": "ray-gpt"},
        "spec": {
            "model": {"zoo": "gpt", "config": "tiny"},
            "training": {"globalBatchSize": 16, "dtype": "float32", "optimizer": "sgd",
                         "learningRate": 0.05},
            "cluster": {"gpu": "cpu", "nodes": nodes, "gpusPerNode": 8 // nodes},
            "parallelism": parallelism,
        },
    }


def _plan_and_serial(doc: dict[str, Any], tmp_path: Path, steps: int = STEPS) -> tuple[Any, Any]:
    """The plan for the manifest's cluster (as `alpajob plan` makes it) and the
    single-device run of the same job."""
    from alpajob.cli import cluster_for, plan_options
    from alpajob.planner.extract import extract_model
    from alpajob.planner.manifest import parse_manifest
    from alpajob.planner.planning import make_plan
    from alpajob.trainer.entrypoint import load_model
    from alpajob.trainer.local_run import RunOptions, run

    class _Args:
        method = None
        ilp_time_limit = 5.0
        baselines = False
        nodes = gpus_per_node = gpu = None

    manifest = parse_manifest(doc)
    training = manifest.spec.training
    model = load_model(manifest.spec.model, training.dtype)
    graph = extract_model(model, training.global_batch_size, optimizer=training.optimizer,
                          learning_rate=training.learning_rate)
    plan = make_plan(graph, cluster_for(manifest, _Args()), plan_options(manifest, _Args())).plan
    write_plan(plan, tmp_path / "plan.json")
    serial = run(manifest, RunOptions(steps=steps, serial=True))
    return plan, serial


def _assert_equal(result: Any, serial: Any) -> None:
    np.testing.assert_allclose(result.losses, serial.losses, rtol=1e-5)
    assert set(result.params) == set(serial.params)
    for name, value in serial.params.items():
        np.testing.assert_allclose(result.params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


TWO_MESHES = [{"layers": [0, 1], "submeshShape": [1, 2]}, {"layers": [1, 2], "submeshShape": [1, 4]}]
#: On 4 nodes of 2 devices, stage 1 spans two whole nodes (one JAX process group of
#: 2 processes x 2 devices).
THREE_MESHES_ONE_WIDE = [{"layers": [0, 1], "submeshShape": [1, 2]},
                         {"layers": [1, 3], "submeshShape": [2, 2]},
                         {"layers": [3, 4], "submeshShape": [1, 2]}]


@pytest.mark.parametrize(
    ("stages", "layers", "nodes"),
    [(TWO_MESHES, None, 1), (THREE_MESHES_ONE_WIDE, 4, 4)],
    ids=["2-meshes", "3-meshes-one-on-2-hosts"],
)
def test_ray_pipeline_equals_single_device(cluster: LoopbackCluster, tmp_path: Path, stages, layers, nodes) -> None:
    doc = _manifest(stages, layers=layers, nodes=nodes)
    plan, serial = _plan_and_serial(doc, tmp_path)
    assert [list(s.submesh_shape) for s in plan.stages] == [x["submeshShape"] for x in stages]
    result = drive(yaml.safe_dump(doc), plan,
                   DriverOptions(address=cluster.address, steps=STEPS, join_timeout=60))
    _assert_equal(result, serial)
    assert all(b > 0 for b in result.sent_bytes)  # activations really crossed meshes


def test_a_killed_mesh_worker_resumes_from_the_last_complete_checkpoint(cluster: LoopbackCluster, tmp_path: Path) -> None:
    """Mesh 1's worker (its node) is killed after step 3, checkpoints every 2 steps: the
    driver restarts every mesh once the worker is back (as its pod would be), resumes
    from step 2 and ends where an uninterrupted run ends. Progress is published all
    along: Prometheus metrics of every stage, and the status file."""
    import threading
    import urllib.request

    steps = 5
    doc = _manifest(TWO_MESHES)
    plan, serial = _plan_and_serial(doc, tmp_path, steps=steps)
    port = _free_port()
    scraped: list[str] = []
    restarted: list[threading.Thread] = []

    def on_step(step: int, _loss: float, _seconds: float) -> None:
        if step == 3 and not restarted:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
                scraped.append(page.read().decode())
            cluster.kill_worker(1, 0)
            back = threading.Thread(target=cluster.start_worker, args=(1, 0, 4))
            back.start()
            restarted.append(back)

    options = DriverOptions(address=cluster.address, steps=steps, join_timeout=120, step_timeout=120,
                            checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2,
                            metrics_port=port, status_file=str(tmp_path / "status.json"))
    try:
        result = drive(yaml.safe_dump(doc), plan, options, on_step=on_step)
    finally:
        for thread in restarted:
            thread.join()
    assert result.restarts == 1
    assert result.resumed_from == [0, 2]  # step 3 was lost, as the interval allows
    _assert_equal(result, serial)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step_00000002", "step_00000004", "step_00000005"]
    metrics = scraped[0]
    for stage in ("0", "1"):
        assert f'alpajob_stage_step_compute_seconds{{job="ray-gpt",stage="{stage}"}}' in metrics
    assert 'alpajob_step{job="ray-gpt"} 3.0' in metrics
    assert 'alpajob_checkpoint_step{job="ray-gpt"} 2.0' in metrics
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["step"] == steps
    assert status["restarts"] == 1 and status["checkpoint_step"] == steps
    assert status["samples_per_second"] > 0


def test_a_mesh_host_that_never_joins_is_named(cluster: LoopbackCluster, tmp_path: Path) -> None:
    stages = [{"layers": [k, k + 1], "submeshShape": [1, 2]} for k in range(4)]
    doc = _manifest(stages, layers=4)
    plan, _ = _plan_and_serial(doc, tmp_path, steps=1)
    began = time.monotonic()
    with pytest.raises(JoinTimeoutError, match=r"mesh 3 host 0 \(alpajob-mesh-3-host-0\)"):
        drive(yaml.safe_dump(doc), plan, DriverOptions(address=cluster.address, steps=1, join_timeout=3))
    assert time.monotonic() - began < 30


def test_shutdown_leaves_no_ray_process(cluster: LoopbackCluster) -> None:
    """Runs last in this module: stops the cluster and checks every process is gone."""
    assert cluster.procs, "the cluster should be running before this test"
    assert not cluster.stop()
