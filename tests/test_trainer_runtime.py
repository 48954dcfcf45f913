"""The runtime's pieces: transfer plans, transport, checkpoints and resume, metrics, errors."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpajob.api.errors import AlpaJobError, PlanFormatError
from alpajob.api.options import PlanOptions, TrainOptions
from alpajob.api.plan import write_plan
from alpajob.api.progress import Progress
from alpajob.api.resource import parse_job
from alpajob.trainer_image.local_run import run
from alpajob.trainer_image.runtime.meshes import DeviceError
from alpajob.trainer_image.runtime.transfer import (
    Send,
    box_size,
    intersect,
    plan_transfer,
    tiles_of,
)
from alpajob.trainer_image.runtime.transport import move, move_all, same_layout, transfer_plan

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- transfer

SPECS = [P(), P("x"), P(None, "y"), P("x", "y"), P("y", "x"), P(("x", "y"))]


def _meshes() -> tuple[Mesh, Mesh]:
    d = jax.devices()
    return (Mesh(np.array(d[:4]).reshape(2, 2), ("x", "y")),
            Mesh(np.array(d[4:8]).reshape(1, 4), ("x", "y")))


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(range(len(SPECS)), repeat=2)))
def test_transfer_plan_sends_every_needed_tile_exactly_once(src: int, dst: int) -> None:
    shape = (8, 12)
    m1, m2 = _meshes()
    src_tiles = tiles_of(NamedSharding(m1, SPECS[src]), shape)
    dst_tiles = tiles_of(NamedSharding(m2, SPECS[dst]), shape)
    plan = plan_transfer(shape, 4, src_tiles, dst_tiles)
    # Every element of every destination tile arrives exactly once: by sends to the
    # receiver, or by one local copy of the receiver's whole tile.
    received = {d: np.zeros(shape, int) for d in dst_tiles}
    for send in plan.sends:
        assert intersect(send.box, src_tiles[send.src]) == send.box  # the sender holds it
        received[send.dst][tuple(slice(*r) for r in send.box)] += 1
    for copy in plan.copies:
        assert copy.box == dst_tiles[copy.src] == dst_tiles[copy.dst]
        received[copy.dst][tuple(slice(*r) for r in copy.box)] += 1
    for device, tile in dst_tiles.items():
        want = np.zeros(shape, int)
        want[tuple(slice(*r) for r in tile)] = 1
        np.testing.assert_array_equal(received[device], want)
    # Across meshes, each distinct destination tile crosses once: the minimum.
    distinct = {tile for tile in dst_tiles.values()}
    assert plan.cross_mesh_bytes == 4 * sum(box_size(t) for t in distinct)


@pytest.mark.parametrize("on_host", [True, False])
def test_move_reshards_across_meshes_exactly(on_host: bool) -> None:
    """Both ways of cutting and assembling pieces: on the host (CPU devices) and on
    the devices (accelerators; forced here on CPU devices)."""
    m1, m2 = _meshes()
    data = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    for src, dst in itertools.product(SPECS, SPECS):
        array = jax.device_put(data, NamedSharding(m1, src))
        target = NamedSharding(m2, dst)
        (moved,) = move_all([array], [target], on_host=on_host)
        assert moved.sharding == target
        np.testing.assert_array_equal(np.asarray(moved), data)
    assert move(array, target).sharding == target


def test_move_all_moves_many_arrays_in_two_batched_puts(monkeypatch: pytest.MonkeyPatch) -> None:
    """One instruction's sends share a move: its tiles go in one ``device_put`` and
    the replicas' copies in a second, and every array arrives exactly."""
    m1, m2 = _meshes()
    data = [np.arange(8 * 12, dtype=np.float32).reshape(8, 12) * (k + 1) for k in range(len(SPECS))]
    arrays = [jax.device_put(d, NamedSharding(m1, src)) for d, src in zip(data, SPECS, strict=True)]
    targets = [NamedSharding(m2, dst) for dst in reversed(SPECS)]
    calls = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or real_put(*a, **k))
    moved = move_all(arrays, targets)
    assert len(calls) == 2  # the tiles; the copies to replicas (P() and P("x") have some)
    for array, target, want in zip(moved, targets, data, strict=True):
        assert array.sharding == target
        np.testing.assert_array_equal(np.asarray(array), want)


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(range(len(SPECS)), repeat=2)))
def test_same_layout_is_exactly_the_plan_of_whole_shards_device_for_device(src: int, dst: int) -> None:
    """The shortcut through ``jax.device_put`` is taken exactly when the transfer plan
    is one whole shard from the i-th source device to the i-th destination device."""
    shape = (8, 12)
    m1, m2 = _meshes()
    source, target = NamedSharding(m1, SPECS[src]), NamedSharding(m2, SPECS[dst])
    array = jax.device_put(np.zeros(shape, np.float32), source)
    plan = transfer_plan(array, target)
    src_tiles = tiles_of(source, shape)
    device_for_device = {Send(a.id, b.id, src_tiles[a.id]) for a, b in zip(m1.devices.flat, m2.devices.flat, strict=True)}
    assert same_layout(array, target) == (not plan.copies and set(plan.sends) == device_for_device)
    # On these meshes: four row blocks in device order on both sides.
    assert same_layout(array, target) == ((SPECS[src], SPECS[dst]) in {(P(("x", "y")), P(("x", "y"))),
                                                                      (P(("x", "y")), P("y", "x"))})


def test_move_all_puts_same_layout_arrays_in_one_call_with_the_rest_tile_by_tile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m1, m2 = _meshes()
    data = [np.arange(8 * 12, dtype=np.float32).reshape(8, 12) * (k + 1) for k in range(3)]
    sources = [P(("x", "y")), P("x"), P(("x", "y"))]
    destinations = [P("y"), P(None, "y"), P(("x", "y"))]  # the first and last move shard for shard
    arrays = [jax.device_put(d, NamedSharding(m1, s)) for d, s in zip(data, sources, strict=True)]
    targets = [NamedSharding(m2, d) for d in destinations]
    calls = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or real_put(*a, **k))
    moved = move_all(arrays, targets)
    assert len(calls) == 2  # the two same-layout arrays together; the other's tiles (no replicas)
    assert calls[0][0] == [arrays[0], arrays[2]]
    for array, target, want in zip(moved, targets, data, strict=True):
        assert array.sharding == target
        np.testing.assert_array_equal(np.asarray(array), want)
        assert {s.device for s in array.addressable_shards} == set(m2.devices.flat)


def test_parcels_carry_each_needed_tile_once_and_assemble_exactly() -> None:
    """The Ray runtime's transport, without Ray: the sender cuts by mesh positions
    (it cannot see the receiver's devices), the receiver assembles on its own."""
    from alpajob.trainer_image.distributed.transport import assemble, cut, position_tiles

    m1, m2 = _meshes()
    data = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    for src, dst in itertools.product(SPECS, SPECS):
        array = jax.device_put(data, NamedSharding(m1, src))
        target = NamedSharding(m2, dst)
        tiles = position_tiles(target, data.shape)
        parcel = cut(array, tiles)
        assert parcel.nbytes == 4 * sum(box_size(t) for t in set(tiles.values()))
        moved = assemble(parcel, target)
        assert moved.sharding == target
        np.testing.assert_array_equal(np.asarray(moved), data)


def test_parcels_for_a_receiver_on_two_hosts_go_to_the_host_of_each_position() -> None:
    """A receiving mesh whose positions 0-1 live on host 0 and 2-3 on host 1: each
    host's parcel holds only its own positions (a copy across hosts becomes a piece
    sent to the far host), and the parcels merged rebuild the array exactly."""
    from alpajob.trainer_image.distributed.transport import (
        assemble,
        cut,
        cut_for_hosts,
        merge,
        position_tiles,
    )

    m1, m2 = _meshes()
    data = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    for src, dst in itertools.product(SPECS, SPECS):
        array = jax.device_put(data, NamedSharding(m1, src))
        target = NamedSharding(m2, dst)
        tiles = position_tiles(target, data.shape)
        owners = {p: p * 2 // len(tiles) for p in tiles}
        parcels = cut_for_hosts(array, tiles, owners, 2)
        for host, parcel in enumerate(parcels):
            assert {owners[p] for p in parcel.pieces} <= {host}
            assert all(owners[a] == owners[b] == host for a, b in parcel.copies)
        whole = cut(array, tiles)
        crossing = sum(box_size(tiles[b]) for a, b in whole.copies if owners[a] != owners[b])
        assert sum(x.nbytes for x in parcels) == whole.nbytes + 4 * crossing
        np.testing.assert_array_equal(np.asarray(assemble(merge(parcels), target)), data)


# ----------------------------------------------------------------------------- runs


def _manifest(**parallelism: Any) -> Any:
    return parse_job({
        "apiVersion": "alpajob.io/v1alpha1",
        "kind": "AlpaJob",
        "metadata": {"name": "rt"},
        "spec": {
            "model": {"zoo": "gpt", "config": "tiny"},
            "training": {"globalBatchSize": 8, "dtype": "float32", "learningRate": 1e-3},
            "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
            "parallelism": parallelism or {
                "method": "manual", "numMicroBatches": 2,
                "stages": [{"layers": [0, 1], "submeshShape": [1, 4]},
                           {"layers": [1, 2], "submeshShape": [1, 4]}],
            },
        },
    })


def _options(manifest: Any, steps: int, **extra: Any) -> TrainOptions:
    return TrainOptions(steps=steps, planning=PlanOptions(ilp_time_limit=5.0), **extra)


@pytest.mark.slow
def test_checkpoint_resume_equals_uninterrupted(tmp_path: Path) -> None:
    manifest = _manifest()
    whole = run(manifest, _options(manifest, 4))
    ckpt = tmp_path / "ckpt"
    first = run(manifest, _options(manifest, 2, checkpoint_dir=str(ckpt)))
    assert (ckpt / "local" / "2" / "arrays").is_dir()  # orbax's step folder of the one part
    resumed = run(manifest, _options(manifest, 4, checkpoint_dir=str(ckpt), resume=True))
    assert resumed.start_step == 2
    np.testing.assert_array_equal(first.losses + resumed.losses, whole.losses)
    for name, value in whole.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)


def test_a_local_run_checkpoints_every_spec_interval_unless_the_flag_says_otherwise(tmp_path: Path) -> None:
    """``spec.checkpoint.intervalSteps`` sets ``alpajob run``'s interval as it sets the
    pods'; ``--checkpoint-every`` wins; every run also saves its last step."""
    from alpajob.trainer_image.checkpoint.store import complete_steps

    document = _manifest(method="data").model_dump(by_alias=True, exclude_none=True)
    document["spec"]["checkpoint"] = {"volume": "ckpt", "intervalSteps": 2, "keepLast": 10}
    manifest = parse_job(document)
    run(manifest, _options(manifest, 3, checkpoint_dir=str(tmp_path / "spec"), sync_checkpoints=True))
    assert complete_steps(tmp_path / "spec") == [2, 3]
    run(manifest, _options(manifest, 2, checkpoint_dir=str(tmp_path / "flag"), checkpoint_every=1,
                           sync_checkpoints=True))
    assert complete_steps(tmp_path / "flag") == [1, 2]


def test_metrics_json_and_prometheus(tmp_path: Path) -> None:
    manifest = _manifest(method="data")
    out = tmp_path / "metrics.json"
    port = 19000 + os.getpid() % 1000
    seen: list[str] = []

    def scrape(_report: Progress) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            seen.append(reply.read().decode())

    options = _options(manifest, 2, metrics_out=str(out), metrics_port=port, stage_times_every=2)
    result = run(manifest, options, on_step=scrape)
    doc = json.loads(out.read_text())
    assert doc["losses"] == result.losses and len(doc["step_seconds"]) == 2
    assert doc["plan_hash"] == result.plan.content_hash()
    assert doc["stage_time_steps"] == [2] and len(doc["stages"][0]["compute_seconds"]) == 1
    assert "alpajob_stage_step_compute_seconds{" not in seen[0]  # step 1 was not timed
    text = seen[-1]
    assert 'alpajob_step{job="rt"} 2.0' in text
    for metric in ("alpajob_stage_step_compute_seconds", "alpajob_stage_step_idle_seconds",
                   "alpajob_stage_step_communication_seconds", "alpajob_stage_compute_seconds_total",
                   "alpajob_samples_per_second", "alpajob_step_seconds"):
        assert metric in text, metric
    compute = [line for line in text.splitlines()
               if line.startswith('alpajob_stage_step_compute_seconds{job="rt",stage="0"}')]
    assert compute and float(compute[0].split()[-1]) > 0
    goodput = [line for line in text.splitlines() if line.startswith('alpajob_goodput{job="rt"}')]
    assert goodput and 0 < float(goodput[0].split()[-1]) < 1
    assert 'alpajob_badput_seconds{bucket="planning",job="rt"}' in text
    assert 'alpajob_stage_predicted_idle_share{job="rt",stage="0"}' in text


def test_plan_for_another_model_is_refused(tmp_path: Path) -> None:
    manifest = _manifest(method="data")
    first = run(manifest, _options(manifest, 1))
    path = tmp_path / "plan.json"
    write_plan(first.plan, path)
    other = parse_job({**manifest.model_dump(by_alias=True, mode="json"),
                            "spec": {**manifest.spec.model_dump(by_alias=True, mode="json"),
                                     "model": {"zoo": "mlp", "config": "tiny"}}})
    with pytest.raises(PlanFormatError, match="fingerprint"):
        run(other, TrainOptions(steps=1, plan_file=str(path)))
    with pytest.raises(DeviceError, match="--devices 8"):
        run(manifest, TrainOptions(steps=1, plan_file=str(path), devices=4))
    path.write_text(path.read_text()[:100])
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        run(manifest, TrainOptions(steps=1, plan_file=str(path)))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "alpajob", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


def test_cli_run_trains_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    done = _cli("run", str(ROOT / "manifests/examples/local-gpt.yaml"), "--steps", "2",
                "--devices", "4", "--method", "data", "--metrics-out", str(out),
                "--stage-times-every", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "measured / predicted" in done.stdout and "1x4" in done.stdout
    assert "stage 0 compute / idle / comm" in done.stdout and "1 timed step" in done.stdout
    assert len(json.loads(out.read_text())["losses"]) == 2


def test_cli_errors_exit_2_and_write_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "custom.yaml"
    bad.write_text(
        "apiVersion: alpajob.io/v1alpha1\nkind: AlpaJob\nmetadata: {name: c}\n"
        "spec:\n  model: {entrypoint: 'no_such_module_xyz:make'}\n"
        "  training: {globalBatchSize: 8}\n  cluster: {gpu: cpu, nodes: 1, gpusPerNode: 8}\n"
    )
    out = tmp_path / "m.json"
    done = _cli("run", str(bad), "--steps", "1", "--metrics-out", str(out), cwd=tmp_path)
    assert done.returncode == 2
    assert "spec.model.entrypoint" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
    plan = tmp_path / "plan.json"
    plan.write_text("{")
    done = _cli("run", str(ROOT / "manifests/examples/local-gpt.yaml"), "--plan", str(plan),
                "--metrics-out", str(out), cwd=tmp_path)
    assert done.returncode == 2 and "not valid JSON" in done.stderr
    assert not out.exists()
    done = _cli("run", str(ROOT / "manifests/examples/local-gpt.yaml"), "--stage-times-every", "0",
                "--metrics-out", str(out), cwd=tmp_path)
    assert done.returncode == 2 and "--stage-times-every: Input should be greater than or equal to 1" in done.stderr
    assert not out.exists()


def test_alpajob_error_is_the_base_of_runtime_errors() -> None:
    assert issubclass(DeviceError, AlpaJobError)


def test_custom_entrypoint_example_trains_as_a_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    env_path = ROOT / "manifests" / "examples"
    done = subprocess.run(
        [sys.executable, "-m", "alpajob", "run", str(env_path / "custom-model.yaml"),
         "--steps", "3", "--devices", "8", "--metrics-out", str(out), "--stage-times-every", "3"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
        env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(env_path)},
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert len(doc["losses"]) == 3 and len(doc["stages"]) > 1 and doc["stage_time_steps"] == [3]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_that_resumes(tmp_path: Path) -> None:
    """SIGTERM (how Kubernetes stops a pod) mid-run: the step in progress finishes, its
    checkpoint is saved and waited for, the run exits 143 saying so, and ``--resume``
    goes on from that step. The log is plain lines, one per step (a pipe is not a
    terminal), each with the step, loss, tokens/s and the time left."""
    job = str(ROOT / "manifests/examples/local-gpt.yaml")
    ckpt, first_out, second_out = tmp_path / "ckpt", tmp_path / "first.json", tmp_path / "second.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "alpajob", "run", job, "--steps", "500", "--method", "data", "--devices", "2",
         "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1000", "--log-every", "1",
         "--metrics-out", str(first_out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    seen: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("step 3/500"):
            proc.send_signal(signal.SIGTERM)
            break
    out, rest = proc.communicate(timeout=300)
    log = "".join(seen) + rest
    assert proc.returncode == 143, log
    assert "tokens/s" in seen[-1] and "eta" in seen[-1]
    stopped = json.loads(first_out.read_text())
    done = len(stopped["losses"])
    assert stopped["stopped"] == "SIGTERM" and stopped["last_checkpoint_step"] == done >= 3
    assert f"stopped by SIGTERM after step {done}: checkpoint of step {done}" in log
    assert "training summary" in out
    again = _cli("run", job, "--steps", str(done + 2), "--method", "data", "--devices", "2",
                 "--checkpoint-dir", str(ckpt), "--resume", "--metrics-out", str(second_out), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    resumed = json.loads(second_out.read_text())
    assert resumed["start_step"] == done and len(resumed["losses"]) == 2


# Half a minute (three runs of the job): in the slow set `.ci/run` runs.
@pytest.mark.slow
def test_auto_plan_is_timed_against_one_device_and_leaves_no_trace() -> None:
    """An auto job on forced CPU devices: a few steps of the plan and of the one-device
    step are timed and the faster kept (device_trial). The trial's steps leave no
    trace: the run equals, loss for loss, the run of the winner alone (``--method
    serial``, or the plan with ``--keep-plan``)."""
    manifest = _manifest(method="auto")
    tried = run(manifest, _options(manifest, 3))
    trial = tried.device_trial
    assert trial is not None and trial.plan_seconds > 0 and trial.one_device_seconds > 0
    if trial.one_device_wins:
        assert tried.plan is None
        alone = run(manifest, _options(manifest, 3, serial=True))
    else:
        assert tried.plan is not None
        alone = run(manifest, _options(manifest, 3, keep_plan=True))
    assert alone.device_trial is None
    np.testing.assert_array_equal(tried.losses, alone.losses)
    for name, value in alone.params.items():
        np.testing.assert_array_equal(tried.params[name], value, err_msg=name)
    kept = run(manifest, _options(manifest, 1, keep_plan=True))
    assert kept.plan is not None and kept.device_trial is None
