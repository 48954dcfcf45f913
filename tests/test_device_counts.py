"""One host's forced CPU devices share its cores: the planner may use fewer of them
(down to one) when that is predicted faster, by the host share one device reaches
alone (``lone_device_share``); GPU clusters and ``--all-devices`` use every device."""

import dataclasses

import pytest

from alpajob.api.spec import Method
from alpajob.cli.main import main
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.cost.model import host_utilization, load_calibration
from alpajob.planner.plan.make import ManualStageOption, SearchOptions, make_plan
from alpajob.trainer_image.step import graph_of
from alpajob.trainer_image.zoo import resolve_model


@pytest.fixture(scope="module")
def gpt_graph():
    return graph_of(resolve_model("gpt", "tiny"), 32)


@pytest.fixture(scope="module")
def cpu8():
    return cluster_from_preset("cpu", 1, 8)


def _options(share: float, **fields) -> SearchOptions:
    calibration = dataclasses.replace(load_calibration("cpu"), lone_device_share=share)
    return SearchOptions(calibration=calibration, **fields)


def test_host_utilization_model(cpu8):
    """k busy devices reach 1 - (1 - u)^k of a shared host; independent devices 1."""
    calibration = dataclasses.replace(load_calibration("cpu"), lone_device_share=0.78)
    assert host_utilization(cpu8, calibration, 1) == pytest.approx(0.78)
    assert host_utilization(cpu8, calibration, 2) == pytest.approx(1 - 0.22**2)
    assert host_utilization(cpu8, calibration, 8) == pytest.approx(1 - 0.22**8)
    gpus = cluster_from_preset("h100-80gb", 1, 8)
    assert host_utilization(gpus, calibration, 1) == 1.0
    with pytest.raises(ValueError, match="lone_device_share must be in"):
        dataclasses.replace(calibration, lone_device_share=0.0)


def test_one_device_that_reaches_the_whole_host_wins(gpt_graph, cpu8):
    """If one device used every core (u = 1), more devices would only add
    collectives and per-device kernel costs: the plan is one device, and it is
    predicted faster than the best plan on all 8."""
    free = make_plan(gpt_graph, cpu8, _options(1.0)).plan
    every = make_plan(gpt_graph, cpu8, _options(1.0, all_devices=True)).plan
    assert free.devices_used() == 1 and len(free.stages) == 1
    assert every.devices_used() == 8
    assert free.predicted_step_seconds < every.predicted_step_seconds


def test_the_plan_is_the_fastest_over_device_counts(gpt_graph, cpu8):
    """With a lone device reaching a fifth of the host, the search over device counts
    keeps the fastest: never slower than the plan on every device, nor than the
    one-device plan (a manual one-stage plan on a 1x1 submesh, priced the same way)."""
    options = _options(0.2)
    free = make_plan(gpt_graph, cpu8, options).plan
    every = make_plan(gpt_graph, cpu8, dataclasses.replace(options, all_devices=True)).plan
    lone = make_plan(gpt_graph, cpu8, dataclasses.replace(
        options, method=Method.MANUAL, num_layers=1, num_micro_batches=1,
        manual_stages=(ManualStageOption(0, 1, (1, 1)),))).plan
    assert free.devices_used() > 1
    assert free.predicted_step_seconds <= every.predicted_step_seconds * (1 + 1e-9)
    assert free.predicted_step_seconds < lone.predicted_step_seconds
    # The lone device's work is priced at u of the host: 1/u times its work at the
    # whole host's rate (u = 1), its instruction overheads unchanged.
    whole = make_plan(gpt_graph, cpu8, dataclasses.replace(
        _options(1.0), method=Method.MANUAL, num_layers=1, num_micro_batches=1,
        manual_stages=(ManualStageOption(0, 1, (1, 1)),))).plan
    overhead = 3 * load_calibration("cpu").instruction_overhead_seconds
    assert lone.predicted_step_seconds - overhead == pytest.approx(
        (whole.predicted_step_seconds - overhead) / 0.2, rel=1e-9)


def test_gpu_plans_use_every_device(gpt_graph):
    """Devices that do not share a host are independent: Alpa's rule, every device."""
    gpus = cluster_from_preset("v100-16gb", 1, 8)
    plan = make_plan(gpt_graph, gpus, SearchOptions()).plan
    assert plan.devices_used() == 8


def test_plan_says_how_many_devices_it_uses(capsys, tmp_path):
    """The CLI's table names a plan on fewer devices than offered; --all-devices
    plans on every one."""
    calibration = tmp_path / "cal.json"
    from alpajob.planner.cost.measured import Machine, MeasuredConstants

    machine = Machine(host="test", processor="a CPU", backend="cpu", device_kind="cpu",
                      devices=8, jax="0", measured_at="2026-11-26T00:00:00Z")
    calibration.write_text(MeasuredConstants(
        machine=machine, preset="cpu", calibration={"lone_device_share": 1.0}).to_json())
    manifest = "manifests/examples/local-gpt.yaml"
    assert main(["plan", manifest, "--calibration", str(calibration)]) == 0
    assert "(uses 1 of 8 devices)" in capsys.readouterr().out
    assert main(["plan", manifest, "--calibration", str(calibration), "--all-devices"]) == 0
    assert "of 8 devices" not in capsys.readouterr().out
