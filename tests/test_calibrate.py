"""`alpajob calibrate`: measured constants, stored with their machine, planned with."""

import dataclasses
import json
from pathlib import Path

import pytest

from alpajob.api.errors import ManifestError
from alpajob.cli.main import main
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.cost.measured import Machine, MeasuredConstants, load_measured
from alpajob.planner.cost.model import load_calibration
from alpajob.planner.plan.make import SearchOptions, make_plan
from alpajob.trainer_image.planning import measured_constants
from alpajob.trainer_image.step import graph_of
from alpajob.trainer_image.zoo import resolve_model

MACHINE = Machine(host="test", processor="a CPU", backend="cpu", device_kind="cpu", devices=8,
                  jax="0", measured_at="2026-11-26T00:00:00Z")


def _stored_as_measured(factor: float = 1.0) -> MeasuredConstants:
    """The cpu preset's stored constants, written as a measurement, every rate times
    ``factor``."""
    presets = Path(__file__).parent.parent / "planner" / "cost" / "data" / "presets.json"
    data = json.loads(presets.read_text())["cpu"]
    device = {
        "peak_flops": {k: v * factor for k, v in data["peak_flops"].items()},
        "memory_bandwidth": data["memory_bandwidth"] * factor,
        "intra_node_bandwidth": data["intra_node_bandwidth"] * factor,
        "intra_node_latency": data["intra_node_latency"] / factor,
    }
    stored = load_calibration("cpu")
    calibration = {
        "matmul_efficiency": stored.matmul_efficiency,
        "instruction_overhead_seconds": stored.instruction_overhead_seconds / factor,
        "kernel_overhead_seconds": stored.kernel_overhead_seconds / factor,
    }
    return MeasuredConstants(machine=MACHINE, preset="cpu", device=device, calibration=calibration)


@pytest.fixture(scope="module")
def gpt_graph():
    return graph_of(resolve_model("gpt", "tiny"), 32)


def test_file_round_trip_and_shared_host_split(tmp_path):
    measured = _stored_as_measured(2.0)
    path = tmp_path / "cal.json"
    path.write_text(measured.to_json())
    again = load_measured(path)
    assert again == measured
    assert again.machine.describe().startswith("8 x cpu (cpu) on test")
    cluster = again.refine_cluster(cluster_from_preset("cpu", 1, 8))
    # The file holds the host's rates; each of the 8 forced devices gets an eighth.
    assert cluster.device.peak("float32") == pytest.approx(
        measured.device["peak_flops"]["float32"] / 8)
    assert cluster.intra_node_latency == pytest.approx(measured.device["intra_node_latency"])
    calibration = again.refine_calibration(load_calibration("cpu"))
    assert calibration.kernel_overhead_seconds == pytest.approx(
        measured.calibration["kernel_overhead_seconds"])


@pytest.mark.slow
def test_plan_uses_the_measured_constants(gpt_graph, tmp_path):
    """The stored constants written as a measurement give the very same plan; a
    machine twice as fast in every rate gives a step predicted faster."""
    cluster = cluster_from_preset("cpu", 1, 8)
    stored = make_plan(gpt_graph, cluster, SearchOptions()).plan
    results = {}
    for factor in (1.0, 2.0):
        path = tmp_path / f"cal-{factor}.json"
        path.write_text(_stored_as_measured(factor).to_json())
        refined, search = measured_constants(str(path), cluster, SearchOptions())
        results[factor] = make_plan(gpt_graph, refined, search).plan
    assert results[1.0].content_hash() == stored.content_hash()
    assert results[2.0].predicted_step_seconds < 0.75 * stored.predicted_step_seconds


def test_wrong_preset_and_bad_values_are_named(tmp_path):
    h100 = cluster_from_preset("h100-80gb", 1, 8)
    path = tmp_path / "cal.json"
    path.write_text(_stored_as_measured().to_json())
    with pytest.raises(ManifestError, match="measured for preset 'cpu'.*plans for 'h100-80gb'"):
        measured_constants(str(path), h100, SearchOptions())
    bad = dataclasses.replace(_stored_as_measured(), calibration={"matmul_efficiency": 3.0})
    path.write_text(bad.to_json())
    with pytest.raises(ManifestError, match="matmul_efficiency must be in"):
        measured_constants(str(path), cluster_from_preset("cpu", 1, 8), SearchOptions())


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    ("[1]", "expected a JSON object"),
    ('{"machine": {}, "preset": "cpu"}', "'machine' must have exactly host"),
    ('{"machin": {}}', "unknown keys ['machin']"),
])
def test_malformed_files_get_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "cal.json"
    path.write_text(content)
    assert main(["plan", "manifests/examples/local-gpt.yaml", "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "--calibration" in err


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--steps", "kernels,fast"], "unknown steps ['fast']"),
    (["calibrate", "--quick", "--steps", "kernels"], "--quick already chooses"),
    (["calibrate", "--preset", "tpu"], "unknown preset 'tpu'"),
    (["calibrate", "--output", "/no/such/dir/cal.json"], "does not exist"),
])
def test_calibrate_usage_errors(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_measures_this_machine_and_plans_with_it(tmp_path, capsys):
    """The micro-benchmarks run on the 8 forced CPU devices and the file they write
    is planned with: a real measurement, stored with the machine it came from."""
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--steps", "kernels", "--output", str(out)]) == 0
    measured = load_measured(out)
    assert measured.preset == "cpu" and measured.machine.devices == 8
    assert measured.machine.backend == "cpu"
    for rate in (*measured.device["peak_flops"].values(), measured.device["memory_bandwidth"],
                 measured.device["intra_node_bandwidth"]):
        assert rate > 0
    assert 0 < measured.calibration["vector_flops_fraction"] <= 1
    assert len(measured.measurements["collectives"]) == 2 * 3 * 3  # 2 ops, 3 sizes, 2/4/8
    capsys.readouterr()
    assert main(["plan", "manifests/examples/local-gpt.yaml", "--calibration", str(out)]) == 0
    assert f"cost-model constants from {out}: 8 x cpu (cpu)" in capsys.readouterr().out


@pytest.mark.slow  # about 45 s: a GPT step timed on one device and on all 8, seven rounds
def test_calibrate_measures_the_share_one_device_reaches_alone(tmp_path):
    """The host step times a small GPT's step on one forced device alone and on all
    8 at once (each its own copy): the lone device's share of the host's throughput,
    between 1/8 (no better than one after another) and 1, is what plans weigh fewer
    devices by."""
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--steps", "host", "--output", str(out)]) == 0
    measured = load_measured(out)
    share = measured.calibration["lone_device_share"]
    assert 1 / 8 <= share <= 1
    host = measured.measurements["host"]
    assert len(host["one_device_ms"]) == len(host["8_devices_ms"]) == 7  # rounds
    assert min(host["one_device_ms"]) > 0 and min(host["8_devices_ms"]) > 0
    assert 0 < host["two_devices_share"] <= 1
    calibration = measured.refine_calibration(load_calibration("cpu"))
    assert calibration.lone_device_share == share


def test_golden_minimum_finds_the_bend_past_a_flat_stretch():
    """The fusion fit's search: a loss flat up to a bend (where the fraction stops
    mattering, as it does while elementwise ops are bound by arithmetic) and
    quadratic after it is minimised at its true minimiser, not on the flat part."""
    from alpajob.trainer_image.calibration.fusion import golden_minimum

    calls = []

    def loss(x):
        calls.append(x)
        return min(1.0, (x + 1.2) ** 2)  # flat below -2.2

    assert golden_minimum(loss, -6.9, 0.0) == pytest.approx(-1.2, abs=0.02)
    assert len(calls) < 50


@pytest.mark.slow  # times real steps: on a loaded machine the measured step leaves the fit's range
def test_fusion_fit_reproduces_the_measured_step(monkeypatch, tmp_path):
    """The fusion step trains a small GPT on one forced device with the real runtime
    and fits the one fraction at which the planner predicts that step: with one model
    the fit is exact (the measured step lies between the fraction's floor and 1), and
    plans made with the file use it."""
    from alpajob.trainer_image.calibration import fusion

    monkeypatch.setattr(fusion, "CPU_MODELS", {"gpt-256x2": fusion.CPU_MODELS["gpt-256x2"]})
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--steps", "fusion", "--output", str(out)]) == 0
    measured = load_measured(out)
    fraction = measured.calibration["fused_memory_fraction"]
    assert 1e-3 < fraction < 1
    (row,) = measured.measurements["fusion"]["models"]
    assert row["model"] == "gpt-256x2" and row["measured_ms"] > 0
    assert row["fitted_ms"] == pytest.approx(row["measured_ms"], rel=0.03)
    # The file's value is what plans with --calibration use.
    assert measured.refine_calibration(load_calibration("cpu")).fused_memory_fraction == fraction


def test_gpu_calibration_refuses_the_cpu_only_steps(monkeypatch):
    """On GPUs the default is kernels and fusion; the CPU host's steps, and matmul
    (a CPU's operand packing), are refused by name with the steps to run instead."""
    import jax

    from alpajob.trainer_image.calibration import calibrate
    from alpajob.trainer_image.calibration.run import DEVICE_STEPS, device_preset

    class H200:
        platform = "gpu"
        device_kind = "NVIDIA H200"

    monkeypatch.setattr(jax, "devices", lambda: [H200()])
    assert device_preset([H200()]) == "h200-141gb"
    assert DEVICE_STEPS == ("kernels", "fusion")
    for steps in (["matmul"], ["host"], ["kernels", "instructions"]):
        with pytest.raises(ManifestError, match="--steps kernels,fusion"):
            calibrate(steps)


def test_one_device_leaves_the_link_constants_alone():
    """One device has no collectives to time, so the kernels step must not claim
    perfect links (efficiency 1, no overhead) for the preset: only what it timed."""
    import jax

    from alpajob.trainer_image.calibration.kernels import measure_kernels

    found = measure_kernels(jax.devices()[:1])
    assert found["measurements"]["collectives"] == []
    assert set(found["calibration"]) == {"matmul_efficiency", "vector_flops_fraction",
                                         "memory_efficiency"}
    assert set(found["device"]) == {"peak_flops", "memory_bandwidth"}


def test_the_h200_preset_is_what_one_h200_measured():
    """The shipped h200-141gb constants are the H200 calibration stored beside them
    (measured/h200-141gb.json, machine included), restated against the data sheet's
    peaks: the rates a plan uses are the measured ones, with or without the file."""
    import alpajob.planner.cost as cost

    measured = load_measured(Path(cost.__file__).parent / "data" / "measured" / "h200-141gb.json")
    assert measured.preset == "h200-141gb" and measured.machine.device_kind == "NVIDIA H200"
    assert "comm_bandwidth_efficiency" not in measured.calibration  # one device: not measured
    shipped_cluster, shipped = cluster_from_preset("h200-141gb", 1, 1), load_calibration("h200-141gb")
    cluster = measured.refine_cluster(shipped_cluster)
    calibration = measured.refine_calibration(shipped)

    def rates(c, cal):
        device = c.device
        return {"matmul bfloat16": device.peak("bfloat16") * cal.matmul_efficiency,
                "vector": device.peak("float32") * cal.vector_flops_fraction,
                "memory": device.memory_bandwidth * cal.memory_efficiency,
                "fusion": cal.fused_memory_fraction}

    expected = rates(cluster, calibration)
    assert expected["vector"] == pytest.approx(measured.measurements["vector_gflops"] * 1e9, rel=2e-3)
    for name, value in rates(shipped_cluster, shipped).items():
        assert value == pytest.approx(expected[name], rel=2e-3), name
