"""The Ray runtime on a real Ray cluster on loopback, started by the test.

``alpajob ray-head`` and one ``alpajob mesh-worker`` per mesh host run as processes of
this machine (each worker with its own forced CPU devices and its mesh's custom
resource); the driver trains through them, and the results must equal the
single-device run.
"""

from __future__ import annotations

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
#: The meshes the cluster offers: (mesh index, devices of its one host).
MESHES = [(0, 2), (1, 4), (2, 2)]


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
        self.tracked: set[int] = set()

    def _start(self, args: list[str], log: str, ready: str, timeout: float = 90) -> None:
        out = open(self.root / log, "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(ALPAJOB + args, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout
        while ready not in (self.root / log).read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{log} did not start:\n{(self.root / log).read_text()[-3000:]}")
            time.sleep(0.5)

    def start(self) -> None:
        ready = "block forever"
        self._start(["ray-head", "--port", str(self.port), "--temp-dir", str(self.root / "ray")],
                     "head.log", ready)
        for mesh, devices in MESHES:  # one at a time: raylets started together time out
            self._start(["mesh-worker", "--address", self.address, "--mesh", str(mesh),
                         "--devices", str(devices)], f"mesh{mesh}.log", ready)

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
              layers: int | None = None) -> dict[str, Any]:
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
            "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
            "parallelism": parallelism,
        },
    }


def _plan_and_serial(doc: dict[str, Any], tmp_path: Path) -> tuple[Any, Any]:
    from alpajob.cli import plan_options
    from alpajob.planner.manifest import parse_manifest
    from alpajob.trainer.local_run import RunOptions, run

    class _Args:
        method = None
        ilp_time_limit = 5.0
        baselines = False

    manifest = parse_manifest(doc)
    options = RunOptions(steps=1, plan_options=plan_options(manifest, _Args()))
    plan = run(manifest, options).plan
    write_plan(plan, tmp_path / "plan.json")
    serial = run(manifest, RunOptions(steps=STEPS, serial=True))
    return plan, serial


@pytest.mark.parametrize(
    "stages",
    [
        [{"layers": [0, 1], "submeshShape": [1, 2]}, {"layers": [1, 2], "submeshShape": [1, 4]}],
        [{"layers": [0, 1], "submeshShape": [1, 2]}, {"layers": [1, 3], "submeshShape": [1, 4]},
         {"layers": [3, 4], "submeshShape": [1, 2]}],
    ],
    ids=["2-meshes", "3-meshes-uneven"],
)
def test_ray_pipeline_equals_single_device(cluster: LoopbackCluster, tmp_path: Path, stages) -> None:
    doc = _manifest(stages, layers=4 if len(stages) == 3 else None)
    plan, serial = _plan_and_serial(doc, tmp_path)
    result = drive(yaml.safe_dump(doc), plan,
                   DriverOptions(address=cluster.address, steps=STEPS, join_timeout=60))
    np.testing.assert_allclose(result.losses, serial.losses, rtol=1e-5)
    assert set(result.params) == set(serial.params)
    for name, value in serial.params.items():
        np.testing.assert_allclose(result.params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert all(b > 0 for b in result.sent_bytes)  # activations really crossed meshes


def test_a_mesh_host_that_never_joins_is_named(cluster: LoopbackCluster, tmp_path: Path) -> None:
    stages = [{"layers": [k, k + 1], "submeshShape": [1, 2]} for k in range(4)]
    doc = _manifest(stages, layers=4)
    plan, _ = _plan_and_serial(doc, tmp_path)
    began = time.monotonic()
    with pytest.raises(JoinTimeoutError, match=r"mesh 3 host 0 \(alpajob-mesh-3-host-0\)"):
        drive(yaml.safe_dump(doc), plan, DriverOptions(address=cluster.address, steps=1, join_timeout=3))
    assert time.monotonic() - began < 30


def test_shutdown_leaves_no_ray_process(cluster: LoopbackCluster) -> None:
    """Runs last in this module: stops the cluster and checks every process is gone."""
    assert cluster.procs, "the cluster should be running before this test"
    assert not cluster.stop()
