"""The Ray runtime on a real Ray cluster on loopback, started by the test.

``alpajob ray-head`` and one ``alpajob mesh-worker`` per mesh host run as processes of
this machine (each worker with its own forced CPU devices and its mesh's custom
resource); the driver trains through them, and the results must equal the
single-device run.

The whole module is in the slow set: its Ray cluster takes 40 s to start, and
`.ci/run` starts it once for the cases it runs.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

from alpajob.api.options import PlanOptions  # noqa: E402
from alpajob.api.plan import write_plan  # noqa: E402
from alpajob.api.progress import Progress  # noqa: E402
from alpajob.api.resource import parse_job  # noqa: E402
from alpajob.api.runtime import Transport  # noqa: E402
from alpajob.trainer_image.checkpoint.store import complete_steps  # noqa: E402
from alpajob.trainer_image.distributed.cluster import JoinTimeoutError  # noqa: E402
from alpajob.trainer_image.distributed.driver import DriverOptions, drive  # noqa: E402
from alpajob.trainer_image.distributed.loopback import (  # noqa: E402
    LoopbackCluster,
    alive,
    descendants,
    free_port,
)
from alpajob.trainer_image.planning import plan_job  # noqa: E402

STEPS = 3
#: The mesh hosts the cluster offers: (mesh, host, devices). Meshes 1 and 2 have two
#: hosts: a plan whose stage 1 is 1 x 4 uses host 0 alone; one whose stage 1 is 2 x 2
#: spans both (host 0 then uses its first 2 devices).
MESHES = [(0, 0, 2), (1, 0, 4), (1, 1, 2), (2, 0, 2), (2, 1, 2)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    loop = LoopbackCluster(Path(str(tmp_path_factory.mktemp("ray", numbered=True))), MESHES)
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
    from alpajob.api.options import PlanOptions, TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.local_run import run
    from alpajob.trainer_image.planning import plan_job

    job = parse_job(doc)
    plan = plan_job(job, PlanOptions(ilp_time_limit=5.0)).plan
    write_plan(plan, tmp_path / "plan.json")
    serial = run(job, TrainOptions(steps=steps, serial=True))
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


@pytest.mark.parametrize("transport", [Transport.OBJECT_STORE, Transport.COLLECTIVE])
@pytest.mark.parametrize(
    ("stages", "layers", "nodes"),
    [(TWO_MESHES, None, 1), (THREE_MESHES_ONE_WIDE, 4, 4)],
    ids=["2-meshes", "3-meshes-one-on-2-hosts"],
)
def test_ray_pipeline_equals_single_device(cluster: LoopbackCluster, tmp_path: Path, stages, layers, nodes,
                                           transport: Transport) -> None:
    """Both transports: the object store, and collectives over one JAX process group."""
    doc = _manifest(stages, layers=layers, nodes=nodes)
    plan, serial = _plan_and_serial(doc, tmp_path)
    assert [list(s.submesh_shape) for s in plan.stages] == [x["submeshShape"] for x in stages]
    result = drive(yaml.safe_dump(doc), plan,
                   DriverOptions(address=cluster.address, steps=STEPS, join_timeout=60, step_timeout=180,
                                 transport=transport))
    _assert_equal(result, serial)
    assert all(b > 0 for b in result.sent_bytes)  # activations really crossed meshes


def test_a_plan_across_gpu_types_trains_as_one_device_does(cluster: LoopbackCluster) -> None:
    """A plan across two GPU types (a stage on 2 H100s, one on 2 A100s; on this
    machine, CPU devices stand for both) through the Ray runtime: each stage on its
    mesh host, activations sent across, the losses and parameters of one device."""
    from pools_plan import JOB, two_pool_plan

    from alpajob.api.options import TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.local_run import run

    job = parse_job(JOB)
    plan = two_pool_plan(job)
    assert [s.pool for s in plan.stages] == [0, 1]
    result = drive(yaml.safe_dump(JOB), plan,
                   DriverOptions(address=cluster.address, steps=STEPS, join_timeout=60, step_timeout=180))
    _assert_equal(result, run(job, TrainOptions(steps=STEPS, serial=True)))
    assert all(b > 0 for b in result.sent_bytes)


def test_a_one_stage_plan_runs_its_step_as_one_executable(cluster: LoopbackCluster, tmp_path: Path) -> None:
    """One stage on mesh 0's two devices, four micro-batches: the mesh host runs each
    step as one executable (the stage computes for the whole step, nothing is sent)
    and trains exactly as one device does."""
    doc = _manifest([{"layers": [0, 2], "submeshShape": [1, 2]}], layers=2)
    plan, serial = _plan_and_serial(doc, tmp_path)
    assert len(plan.stages) == 1
    result = drive(yaml.safe_dump(doc), plan,
                   DriverOptions(address=cluster.address, steps=STEPS, join_timeout=60, step_timeout=180))
    _assert_equal(result, serial)
    assert result.sent_bytes == [0] * STEPS
    for [times] in result.stage_times:
        assert not times["forward"] and not times["backward"] and times["compute"] > 0


def test_a_checkpoint_crosses_plans_and_transports(cluster: LoopbackCluster, tmp_path: Path) -> None:
    """Three meshes, the middle one on two hosts, save 2 steps under the collective
    transport: each mesh writes its own part through its hosts' helpers (mesh 1's two
    helpers as one JAX group, orbax's multi-process save), in the background. A
    two-mesh plan of other mesh shapes then resumes from that checkpoint on the object
    store (every array read from whichever mesh saved it) for 2 steps, and again under
    the collective transport for 2 more, reading what the object store wrote. The
    losses and parameters are those of a single-device run of 6 steps."""
    wide = _manifest(THREE_MESHES_ONE_WIDE, layers=4, nodes=4)
    wide_plan = plan_job(parse_job(wide), PlanOptions(ilp_time_limit=5.0)).plan
    ckpt = tmp_path / "ckpt"
    first = drive(yaml.safe_dump(wide), wide_plan, DriverOptions(
        address=cluster.address, steps=2, join_timeout=60, step_timeout=180, checkpoint_dir=str(ckpt),
        transport=Transport.COLLECTIVE))
    assert first.checkpoint_step == 2 and complete_steps(ckpt) == [2]
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["mesh0", "mesh1", "mesh2"]
    narrow = _manifest(TWO_MESHES)
    plan, serial = _plan_and_serial(narrow, tmp_path, steps=6)
    middle = drive(yaml.safe_dump(narrow), plan, DriverOptions(
        address=cluster.address, steps=4, join_timeout=60, step_timeout=180, checkpoint_dir=str(ckpt)))
    assert middle.resumed_from == [2]
    last = drive(yaml.safe_dump(narrow), plan, DriverOptions(
        address=cluster.address, steps=6, join_timeout=60, step_timeout=180, checkpoint_dir=str(ckpt),
        transport=Transport.COLLECTIVE))
    assert last.resumed_from == [4]
    np.testing.assert_allclose(first.losses + middle.losses + last.losses, serial.losses, rtol=1e-5)
    for name, value in serial.params.items():
        np.testing.assert_allclose(last.params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert complete_steps(ckpt) == [2, 4, 6]


#: Three stages; the last on two hosts of mesh 2, its four devices one data-parallel
#: axis, so each host holds half the rows of every micro-batch.
THREE_MESHES_LAST_WIDE = [{"layers": [0, 1], "submeshShape": [1, 2]},
                          {"layers": [1, 2], "submeshShape": [1, 2]},
                          {"layers": [2, 4], "submeshShape": [2, 2], "logicalMeshShape": [4, 1]}]


def test_the_ray_runtime_trains_and_evaluates_on_real_text(cluster: LoopbackCluster, tmp_path: Path) -> None:
    """Real text (the interpreter's standard library, files a-s; t-z held out: the
    same bytes on every commit) through three meshes, the last on two hosts, under the
    collective transport: train and eval losses equal the single-device run's, and the
    eval losses reach the metrics JSON and the status file. The evaluation goes through
    the object store even so. Each host reads only what it uses: the first stage
    input_ids, the middle stage nothing, the last stage's two hosts half of the labels
    each (what they read depends on the plan alone, not on the transport)."""
    transport = Transport.COLLECTIVE
    doc = _manifest(THREE_MESHES_LAST_WIDE, layers=4, nodes=4)
    doc["spec"]["data"] = {"train": "{stdlib}/[a-s]*.py", "eval": "{stdlib}/[t-z]*.py"}
    doc["spec"]["training"].update({"evalEvery": 2, "evalSteps": 2})
    plan, serial = _plan_and_serial(doc, tmp_path, steps=4)
    options = DriverOptions(address=cluster.address, steps=4, join_timeout=60, step_timeout=180, transport=transport,
                            metrics_out=str(tmp_path / "metrics.json"), status_file=str(tmp_path / "status.json"))
    result = drive(yaml.safe_dump(doc), plan, options)
    assert result.restarts == 0
    np.testing.assert_allclose(result.losses, serial.losses, rtol=1e-5)
    ids = 16 * 32 * 2  # one leaf of the global batch: 16 rows of 32 uint8-valued ids stored as uint16
    # [mesh 0 host 0, mesh 1 host 0, mesh 2 host 0, mesh 2 host 1], every step
    assert result.read_bytes == [[ids, 0, ids // 2, ids // 2]] * 4, result.read_bytes
    assert [step for step, _ in result.evals] == [step for step, _ in serial.evals] == [2, 4]
    np.testing.assert_allclose([loss for _, loss in result.evals], [loss for _, loss in serial.evals], rtol=1e-5)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert [e["step"] for e in written["eval"]] == [2, 4]
    assert json.loads((tmp_path / "status.json").read_text())["evalLoss"] == pytest.approx(result.evals[-1][1])


def test_float16_with_dynamic_loss_scaling_trains_like_alpajob_run(cluster: LoopbackCluster, tmp_path: Path) -> None:
    """float16 compute over two meshes: the stages exchange their overflow verdicts
    each step and apply (or skip) the update together; losses, skipped steps and
    parameters match `alpajob run` of the same plan on one process."""
    from alpajob.api.options import TrainOptions
    from alpajob.trainer_image.local_run import run

    doc = _manifest(TWO_MESHES)
    doc["spec"]["training"].update({"dtype": "float16", "optimizer": "adam", "learningRate": 1e-3})
    plan, _ = _plan_and_serial(doc, tmp_path, steps=1)
    local = run(parse_job(doc), TrainOptions(steps=4, plan_file=str(tmp_path / "plan.json")))
    result = drive(yaml.safe_dump(doc), plan, DriverOptions(
        address=cluster.address, steps=4, join_timeout=60, step_timeout=180,
        status_file=str(tmp_path / "status.json")))
    assert result.restarts == 0 and all(np.isfinite(result.losses))
    assert result.skipped_steps == local.skipped_steps
    assert json.loads((tmp_path / "status.json").read_text())["skippedSteps"] == local.skipped_steps
    np.testing.assert_allclose(result.losses, local.losses, rtol=1e-3)
    for name, value in local.params.items():
        np.testing.assert_allclose(result.params[name], value, rtol=1e-3, atol=1e-5, err_msg=name)


class _KillMesh1AtStep3:
    """An ``on_step`` callback that kills mesh 1's worker (its node) once step 3 is
    done, after running ``before``, and starts the worker again in the background, as
    its pod would come back. Leaving the ``with`` block waits for that restart."""

    def __init__(self, cluster: LoopbackCluster, before: Callable[[], None] | None = None) -> None:
        self.cluster, self.before = cluster, before
        self.restarted: list[threading.Thread] = []

    def __call__(self, report: Progress) -> None:
        if report.step == 3 and not self.restarted:
            if self.before is not None:
                self.before()
            self.cluster.kill_worker(1, 0)
            back = threading.Thread(target=self.cluster.start_worker, args=(1, 0, 4))
            back.start()
            self.restarted.append(back)

    def __enter__(self) -> _KillMesh1AtStep3:
        return self

    def __exit__(self, *_exc: object) -> None:
        for thread in self.restarted:
            thread.join()


def _sample(text: str, series: str) -> float:
    """The value of ``series`` (name and labels, as exposed) in a scrape."""
    [line] = [line for line in text.splitlines() if line.startswith(series + " ")]
    return float(line.split()[-1])


def test_a_killed_mesh_worker_resumes_from_the_last_complete_checkpoint(cluster: LoopbackCluster, tmp_path: Path) -> None:
    """Mesh 1's worker (its node) is killed after step 3, checkpoints every 2 steps: the
    driver replaces mesh 1's actor once the worker is back (as its pod would be), keeps
    mesh 0's, resumes every mesh from step 2 and ends where an uninterrupted run ends. Progress is published all
    along: Prometheus metrics of every stage, and the status file."""
    import urllib.request

    steps = 5
    doc = _manifest(TWO_MESHES)
    plan, serial = _plan_and_serial(doc, tmp_path, steps=steps)
    port = free_port()
    scraped: list[str] = []

    def scrape() -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            scraped.append(page.read().decode())

    options = DriverOptions(address=cluster.address, steps=steps, join_timeout=120, step_timeout=120,
                            checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, checkpoint_async=False,
                            metrics_port=port, status_file=str(tmp_path / "status.json"))
    events: list[str] = []
    with _KillMesh1AtStep3(cluster, before=scrape) as on_step:
        result = drive(yaml.safe_dump(doc), plan, options, on_step=on_step, on_event=events.append)
    assert result.restarts == 1
    assert result.resumed_from == [0, 2]  # step 3 was lost, as the interval allows
    # Mesh 0 survived: its actor, its stage and its executables were kept, and it
    # went back to step 2 with the new mesh 1 (the numerics below say so).
    assert "replaced mesh 1; the other meshes kept their processes and compiled stages" in events, events
    _assert_equal(result, serial)
    assert complete_steps(tmp_path / "ckpt") == [2, 4, 5]  # every mesh's part of each
    metrics = scraped[0]
    for stage in ("0", "1"):
        assert f'alpajob_stage_step_compute_seconds{{job="ray-gpt",stage="{stage}"}}' in metrics
    assert 'alpajob_step{job="ray-gpt"} 3.0' in metrics
    assert 'alpajob_checkpoint_step{job="ray-gpt"} 2.0' in metrics
    # Goodput's books: building the stages, saving and restoring are badput.
    for bucket in ("planning", "checkpoint", "restore", "compile", "other"):
        assert f'alpajob_badput_seconds{{bucket="{bucket}",job="ray-gpt"}}' in metrics, bucket
    assert _sample(metrics, 'alpajob_badput_seconds{bucket="planning",job="ray-gpt"}') > 0
    assert 0 < _sample(metrics, 'alpajob_goodput{job="ray-gpt"}') < 1
    for stage in ("0", "1"):
        assert 0 <= _sample(metrics, f'alpajob_stage_predicted_idle_share{{job="ray-gpt",stage="{stage}"}}') < 1
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["step"] == steps
    assert 0 < status["goodput"] < 1
    assert status["restarts"] == 1 and status["lastCheckpointStep"] == steps
    assert status["samplesPerSecond"] > 0


def test_collective_transport_resumes_bit_exact_after_a_killed_mesh_worker(cluster: LoopbackCluster,
                                                                            tmp_path: Path) -> None:
    """The collective transport checkpoints through each mesh host's helper
    (:mod:`~alpajob.trainer_image.distributed.saver`). Mesh 1's worker (its node) is
    killed after step 3, checkpoints every 2 steps: mesh 0's actor fails in its
    collective (its gloo peer is gone) before Ray declares mesh 1's actor dead, still a
    lost host, so the driver restarts. Every actor of the failed attempt, and of a setup
    that meets the not-yet-dead node, is stopped (none is left waiting in a collective
    or in ``jax.distributed.initialize``, holding its host), and so is its helper. The
    next attempt (fresh actor processes and helpers, a fresh coordinator port) resumes
    from step 2 and ends bit for bit where an uninterrupted run of the same transport
    ends, and within float tolerance of a single-device run."""
    steps = 5
    doc = _manifest(TWO_MESHES)
    plan, serial = _plan_and_serial(doc, tmp_path, steps=steps)
    clean = drive(yaml.safe_dump(doc), plan, DriverOptions(
        address=cluster.address, steps=steps, join_timeout=60, step_timeout=120, transport=Transport.COLLECTIVE))
    events: list[str] = []
    options = DriverOptions(address=cluster.address, steps=steps, join_timeout=120, step_timeout=120,
                            transport=Transport.COLLECTIVE, checkpoint_dir=str(tmp_path / "ckpt"),
                            checkpoint_every=2, checkpoint_async=False)
    began = time.monotonic()
    with _KillMesh1AtStep3(cluster) as on_step:
        result = drive(yaml.safe_dump(doc), plan, options, on_step=on_step, on_event=events.append)
    assert on_step.restarted, "mesh 1's worker should have been killed"
    assert result.restarts == 1, events
    assert result.resumed_from == [0, 2], events
    assert complete_steps(tmp_path / "ckpt") == [2, 4, 5]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".")) == ["mesh0", "mesh1"]
    assert result.losses == clean.losses
    assert set(result.params) == set(clean.params)
    for name, value in clean.params.items():
        np.testing.assert_array_equal(result.params[name], value, err_msg=name)
    _assert_equal(result, serial)
    assert all(b > 0 for b in result.sent_bytes)
    # About 60 s here; a setup actor left in jax.distributed.initialize would hold mesh
    # 0's resource for its 120 s initialization timeout.
    assert time.monotonic() - began < 150, events
    assert _helpers_end(cluster), "the checkpoint helpers must end with their mesh hosts' actors"


def test_a_host_that_leaves_after_its_part_of_a_step_fails_the_step_at_once(cluster: LoopbackCluster) -> None:
    """A host whose call returned, then whose node went (a deleted pod stopping after
    its part of a step, a gradient it sent lost with it), while a peer still waits
    for that message: :func:`gather` asks the finished hosts whether they are still
    there and raises the recoverable :class:`HostFailure` within seconds, not after
    the peer's 300 s receive timeout (a deleted mesh pod once cost a job that way)."""
    import ray

    from alpajob.trainer_image.distributed.group import PROBE_EVERY, HostFailure, gather

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Host:
        def alive(self) -> bool:
            return True

        def wait(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        waiting, leaving = Host.remote(), Host.remote()
        refs = [waiting.wait.remote(120.0), leaving.wait.remote(0.0)]
        ray.get(refs[1])
        ray.kill(leaving)
        began = time.monotonic()
        with pytest.raises(HostFailure, match="a mesh host left after its part of the step"):
            gather(refs, 300.0, "step 7", actors=[waiting, leaving])
        assert time.monotonic() - began < 3 * PROBE_EVERY
        ray.kill(waiting)
    finally:
        ray.shutdown()


def test_a_sigterm_just_after_a_step_s_save_check_still_saves_that_step(cluster: LoopbackCluster,
                                                                      tmp_path: Path) -> None:
    """SIGTERM reaches the driver after a step, once it has decided that the step needs
    no checkpoint (here: while the step is reported; on a cluster, while its progress is
    written to the API server): the driver still saves that step before it stops, so the
    next attempt resumes from it (a preempted job once went back to its last interval
    checkpoint)."""
    doc = _manifest(TWO_MESHES)
    plan, _ = _plan_and_serial(doc, tmp_path, steps=1)
    ckpt = tmp_path / "ckpt"

    def on_step(report: Progress) -> None:
        if report.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as the kubelet sends it, now

    result = drive(yaml.safe_dump(doc), plan, DriverOptions(
        address=cluster.address, steps=8, join_timeout=60, step_timeout=180, checkpoint_dir=str(ckpt),
        checkpoint_every=100), on_step=on_step)
    assert result.stopped == "SIGTERM" and result.step == 3
    assert result.checkpoint_step == 3 and complete_steps(ckpt) == [3]


def test_sigterm_under_the_collective_transport_saves_and_the_job_resumes(cluster: LoopbackCluster,
                                                                          tmp_path: Path) -> None:
    """``alpajob driver --transport collective`` and mesh 1's worker are sent SIGTERM
    mid-run, the worker first, as when every pod of the attempt is deleted at once (a
    preemption): the worker keeps Ray up for the driver, which stops after the step in
    progress with a checkpoint of that step, written by the hosts' helpers, and exits
    143; then the worker stops. A driver started again resumes from that step and ends
    where a single-device run ends."""
    import subprocess
    import sys

    steps = 30
    doc = _manifest(TWO_MESHES)
    plan, _ = _plan_and_serial(doc, tmp_path, steps=1)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    status = tmp_path / "status.json"
    ckpt = tmp_path / "ckpt"
    driver = subprocess.Popen(
        [sys.executable, "-m", "alpajob", "driver", str(tmp_path / "job.yaml"), "--plan", str(tmp_path / "plan.json"),
         "--address", cluster.address, "--steps", str(steps), "--transport", "collective",
         "--checkpoint-dir", str(ckpt), "--checkpoint-every", "100", "--status-file", str(status)],
        env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and driver.poll() is None:
        if status.exists() and json.loads(status.read_text()).get("step", 0) >= 2:
            break
        time.sleep(0.2)
    worker = cluster.workers[1, 0]
    worker.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    driver.send_signal(signal.SIGTERM)
    out, _ = driver.communicate(timeout=180)
    assert driver.returncode == 143, out
    worker.wait(timeout=30)  # let go once the driver saved
    said = (cluster.root / "mesh1-host0.log").read_text()
    assert "the driver is saving the step it is at" in said and "the driver has saved; stopping Ray" in said
    cluster.procs.remove(worker)
    cluster.start_worker(1, 0, 4)
    stopped = json.loads(status.read_text())
    assert stopped["phase"] == "Stopped", stopped
    assert 2 <= stopped["step"] < steps
    assert complete_steps(ckpt) == [stopped["step"]]
    end = stopped["step"] + 2
    _, serial = _plan_and_serial(doc, tmp_path, steps=end)
    resumed = drive(yaml.safe_dump(doc), plan, DriverOptions(
        address=cluster.address, steps=end, join_timeout=60, step_timeout=180, checkpoint_dir=str(ckpt),
        transport=Transport.COLLECTIVE))
    assert resumed.resumed_from == [stopped["step"]]
    np.testing.assert_allclose(resumed.losses, serial.losses[stopped["step"]:], rtol=1e-5)
    for name, value in serial.params.items():
        np.testing.assert_allclose(resumed.params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _helpers_end(cluster: LoopbackCluster, within: float = 15.0) -> bool:
    """Whether every checkpoint helper below the workers is gone within ``within``
    seconds (each watches its actor's process, twice a second)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        pids = descendants([w.pid for w in cluster.workers.values()])
        if not any(b"distributed.saver" in _cmdline(pid) for pid in pids):
            return True
        time.sleep(0.5)
    return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _actor_pids(cluster: LoopbackCluster, mesh: int, host: int) -> list[int]:
    """The mesh host actors' processes below a worker (Ray titles them ``ray::MeshHost``)."""
    pids = []
    for pid in descendants([cluster.workers[mesh, host].pid]):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if title.startswith(b"ray::MeshHost"):
            pids.append(pid)
    return pids


def test_a_hung_mesh_host_is_restarted_from_the_last_checkpoint(cluster: LoopbackCluster, tmp_path: Path) -> None:
    """Mesh 1's actor is frozen (SIGSTOP) after step 2: step 3 gets no answer within the
    step timeout, the driver stops every mesh (killing the frozen actor) and resumes
    from the checkpoint of step 2 on fresh actors."""
    steps = 4
    doc = _manifest(TWO_MESHES)
    plan, serial = _plan_and_serial(doc, tmp_path, steps=steps)
    frozen: list[int] = []

    def on_step(report: Progress) -> None:
        if report.step == 2 and not frozen:
            frozen.extend(_actor_pids(cluster, 1, 0))
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)

    # A save that is still being written when its host freezes is lost with it (that
    # is what asynchronous saving risks): wait for each save here, to know which step
    # the restart resumes from.
    options = DriverOptions(address=cluster.address, steps=steps, join_timeout=60, step_timeout=30,
                            checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, checkpoint_async=False)
    began = time.monotonic()
    result = drive(yaml.safe_dump(doc), plan, options, on_step=on_step)
    assert frozen, "the mesh 1 actor should have been found and frozen"
    assert result.restarts == 1 and result.resumed_from == [0, 2]
    _assert_equal(result, serial)
    assert not any(alive(pid) for pid in frozen)  # the hung actor was stopped for good
    assert time.monotonic() - began < 180


@pytest.mark.parametrize("transport", list(Transport))
def test_a_mesh_host_that_never_joins_is_named(cluster: LoopbackCluster, tmp_path: Path, transport: Transport) -> None:
    """Within the join timeout, whichever transport: no actor starts (none waits in a
    rendezvous for a host that is not there)."""
    stages = [{"layers": [k, k + 1], "submeshShape": [1, 2]} for k in range(4)]
    doc = _manifest(stages, layers=4)
    plan, _ = _plan_and_serial(doc, tmp_path, steps=1)
    began = time.monotonic()
    with pytest.raises(JoinTimeoutError, match=r"mesh 3 host 0 \(alpajob-mesh-3-host-0\)"):
        drive(yaml.safe_dump(doc), plan, DriverOptions(address=cluster.address, steps=1, join_timeout=3,
                                                       transport=transport, checkpoint_dir=str(tmp_path / "c")))
    assert time.monotonic() - began < 30


def test_shutdown_leaves_no_ray_process(cluster: LoopbackCluster) -> None:
    """Runs last in this module: stops the cluster and checks every process is gone."""
    assert cluster.procs, "the cluster should be running before this test"
    assert not cluster.stop()
