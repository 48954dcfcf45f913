"""``alpajob plan JOB --what-if SPEC...``: the job on every option, from one trace, each
option's figures those of ``alpajob plan`` of that cluster; bad options and price files
are one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import alpajob
from alpajob.api.catalog import DevicePreset
from alpajob.api.errors import ManifestError
from alpajob.api.options import PlanOptions
from alpajob.api.what_if import NODE_GPUS, WhatIfMix, WhatIfOption, load_prices, parse_options
from alpajob.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "manifests" / "examples" / "local-gpt.yaml"
PRICES = ROOT / "manifests" / "prices" / "gpu-prices.yaml"
V100, A100 = DevicePreset.V100_16GB, DevicePreset.A100_40GB


def test_options_are_presets_and_counts_that_fill_nodes() -> None:
    assert parse_options(["h100-80gb:8,16", "a100-40gb:4", "h100-80gb:8", "cpu:4"]) == [
        WhatIfOption(DevicePreset.H100_80GB, 8), WhatIfOption(DevicePreset.H100_80GB, 16),
        WhatIfOption(DevicePreset.A100_40GB, 4), WhatIfOption(DevicePreset.CPU, 4)]  # each option once
    assert [(o.nodes, o.gpus_per_node) for o in parse_options(["v100-16gb:2,8,24", "cpu:16"])] == [
        (1, 2), (1, 8), (3, 8), (1, 16)]


def test_the_planners_presets_have_nodes_of_node_gpus() -> None:
    from alpajob.planner.cost.cluster import cluster_from_preset

    for preset in DevicePreset:
        if preset is not DevicePreset.CPU:
            assert cluster_from_preset(preset, 1).devices_per_node == NODE_GPUS, preset


@pytest.mark.parametrize(("spec", "expected"), [
    ("h100:8", "unknown preset 'h100'; use one of: v100-16gb, a100-40gb"),
    ("h100-80gb:12", "12 GPUs do not fill whole nodes of 8; give 8 or 16"),
    ("h100-80gb:3", "give 8, or 1, 2 or 4"),
    ("h100-80gb:0", "'0' is not a GPU count"),
    ("h100-80gb:8200", "8200 GPUs; at most 8192 per option"),
    ("cpu:3", "3 CPU devices; one host's devices are a power of two up to 16"),
    ("cpu:32", "32 CPU devices"),
    ("h100-80gb:8,x", "'x' is not a GPU count"),
    ("h100-80gb", "write PRESET:COUNT[,COUNT...]"),
    ("h100-80gb:8,16+a100-40gb:16", "a mixed option names one count per GPU type"),
    ("h100-80gb:8+cpu:4", "a mixed option is of GPU presets"),
    ("h100-80gb:8+h100-80gb:16", "names a GPU type twice"),
    ("h100-80gb:8+a100-40gb:12", "12 GPUs do not fill whole nodes of 8"),
    ("h100-80gb:8+a100:8", "unknown preset 'a100'"),
    ("h100-80gb:8192+a100-40gb:8", "8200 GPUs; at most 8192 per option"),
])
def test_a_bad_option_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str], spec: str,
                                                  expected: str) -> None:
    with pytest.raises(ManifestError, match="--what-if"):
        parse_options([spec])
    assert main(["plan", str(JOB), "--what-if", spec]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1 and expected in err, err


def _prices(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "prices.yaml"
    path.write_text(body)
    return path


@pytest.mark.parametrize(("body", "expected"), [
    ("date: 2026-12-01\nsource: x\nperGpuHour: {a100-40gb: 1.0}\n",
     "--prices {path}: perGpuHour: no price for v100-16gb (option 8 x v100-16gb); add `v100-16gb:"),
    ("date: 2026-12-01\nsource: x\nperGpuHour: {v100-16gb: -1, a100-40gb: 1}\n",
     "--prices {path}: perGpuHour.v100-16gb: Input should be greater than 0"),
    ("date: 2026-12-01\nperGpuHour: {v100-16gb: 1}\n", "--prices {path}: source: Field required"),
    ("perGpuHour: [1, 2\n", "--prices: {path} is not YAML"),
    ("- 1\n", "expected date, source and perGpuHour"),
])
def test_a_bad_price_file_is_one_line_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       body: str, expected: str) -> None:
    path = _prices(tmp_path, body)
    expected = expected.format(path=path)
    with pytest.raises(ManifestError) as error:
        load_prices(path, parse_options(["v100-16gb:8", "a100-40gb:8"]))
    assert expected in str(error.value)
    assert main(["plan", str(JOB), "--what-if", "v100-16gb:8", "a100-40gb:8", "--prices", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err


@pytest.mark.parametrize(("flags", "expected"), [
    (["--what-if", "v100-16gb:8", "--gpu", "a100-40gb"], "--gpu: names one cluster or one plan"),
    (["--what-if", "v100-16gb:8", "--output", "plan.json"], "--output: names one cluster or one plan"),
    (["--prices", str(PRICES)], "--prices: prices and prints the options of --what-if"),
    (["--json"], "--json: prices and prints the options of --what-if"),
])
def test_flags_of_one_plan_are_refused_with_what_if(capsys: pytest.CaptureFixture[str], flags: list[str],
                                                    expected: str) -> None:
    assert main(["plan", str(JOB), *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1 and expected in err, err


def test_the_shipped_price_list_prices_every_gpu_preset() -> None:
    prices = load_prices(PRICES, [WhatIfOption(p, 8) for p in DevicePreset if p is not DevicePreset.CPU])
    assert prices.date and prices.source


def test_each_option_is_the_plan_alpajob_plan_makes_and_a_rerun_reads_the_cache(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two options from one trace: each row's plan, step time and memory are those of
    ``alpajob plan --gpu P --nodes N --gpus-per-node G`` (planned apart); GPT-tiny's
    global batch over the step time; GPU-hours and dollars from the job's steps and the
    price list; the second run reads both plans from the cache."""
    cache = tmp_path / "cache"
    argv = ["plan", str(JOB), "--what-if", "v100-16gb:8", "a100-40gb:2", "--prices", str(PRICES), "--json",
            "--cache-dir", str(cache)]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    job = alpajob.load(JOB)
    prices = load_prices(PRICES, parse_options(["v100-16gb:8", "a100-40gb:2"]))
    for row, (gpu, nodes, per_node) in zip(rows, [(V100, 1, 8), (A100, 1, 2)], strict=True):
        alone = alpajob.plan(job, PlanOptions(gpu=gpu, nodes=nodes, gpus_per_node=per_node))
        assert (row["option"], row["fits"], row["cached"]) == (f"{nodes * per_node} x {gpu.value}", True, False)
        assert row["planHash"] == alone.content_hash()
        assert row["stepSeconds"] == alone.predicted_step_seconds
        assert row["peakMemoryBytes"] == max(stage.peak_memory_bytes for stage in alone.stages)
        assert row["samplesPerSecond"] == pytest.approx(job.spec.training.global_batch_size / row["stepSeconds"])
        hours = job.spec.training.steps * row["stepSeconds"] * nodes * per_node / 3600
        assert row["gpuHours"] == pytest.approx(hours)
        assert row["dollars"] == pytest.approx(hours * prices.of(gpu))
        assert row["dollarsPerHour"] == pytest.approx(nodes * per_node * prices.of(gpu))
        assert row["tokensPerSecond"] > row["samplesPerSecond"] and 0 < row["mfu"] < 1
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert [r["cached"] for r in again] == [True, True]
    assert [r["planHash"] for r in again] == [r["planHash"] for r in rows]
    assert main(["plan", str(JOB), "--what-if", "v100-16gb:8", "--cache-dir", str(cache)]) == 0
    table = capsys.readouterr().out
    assert "8 x v100-16gb" in table and "tok/s" in table and "$/h" not in table  # no prices: no dollars


def test_an_option_that_nothing_fits_says_what_a_gpu_would_need() -> None:
    """The Python API's rows: GPT-2.6B's weights and Adam state do not fit one V100."""
    [row] = alpajob.what_if(ROOT / "manifests" / "examples" / "gpt-2.6b.yaml", ["v100-16gb:1"])
    assert not row.fits and row.step_seconds is None and row.required_bytes > row.memory_bytes == 16 * 2**30


def test_the_pareto_front_is_every_option_no_other_beats_on_both() -> None:
    from alpajob.cli.pareto import pareto_front

    # (dollars, hours): the second is dearer and slower than the first; the last two tie.
    assert pareto_front([(50, 2.0), (60, 3.0), (55, 1.0), (40, 5.0), (40, 5.0)]) == [
        True, False, True, True, True]


def test_the_picture_draws_every_fitting_option_and_marks_its_front(tmp_path: Path) -> None:
    """``--svg`` with ``--what-if``: one point per fitting option, read back from the
    SVG's ``data-`` attributes, the front as :func:`pareto_front` says; the option no
    plan fits is named instead."""
    import xml.etree.ElementTree as ET

    from alpajob.cli.pareto import pareto_front

    svg = tmp_path / "options.svg"
    argv = ["plan", str(JOB), "--what-if", "v100-16gb:8", "a100-40gb:2,8", "--prices", str(PRICES), "--json",
            "--svg", str(svg), "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    root = ET.parse(svg).getroot()
    ns = {"s": "http://www.w3.org/2000/svg"}
    drawn = {g.get("data-option"): g.get("data-front") == "true" for g in root.findall("s:g[@class='option']", ns)}
    rows = alpajob.what_if(JOB, ["v100-16gb:8", "a100-40gb:2,8"], prices=PRICES,
                           options=PlanOptions(cache_dir=str(tmp_path / "cache")))
    points = [(r.dollars, r.step_seconds) for r in rows]
    assert drawn == dict(zip((r.option.label for r in rows), pareto_front(points), strict=True))
    assert any(drawn.values())


def test_a_mixed_option_is_planned_across_its_gpu_types(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``h100-80gb:1+a100-80gb:1``: one option, planned across both types (each stage
    on GPUs of one type); its row pays for every GPU of the option at each type's
    price, its layout names each stage's layers and GPUs, and a rerun reads its plan
    from the cache."""
    assert parse_options(["h100-80gb:1+a100-80gb:1"]) == [WhatIfMix((
        WhatIfOption(DevicePreset.H100_80GB, 1), WhatIfOption(DevicePreset.A100_80GB, 1)))]
    job = tmp_path / "gpt.yaml"
    job.write_text(JOB.read_text().replace("config: tiny", "config: 350m").replace("globalBatchSize: 32",
                                                                               "globalBatchSize: 64"))
    argv = ["plan", str(job), "--what-if", "h100-80gb:1+a100-80gb:1", "h100-80gb:1", "--prices", str(PRICES),
            "--json", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    mixed, alone = json.loads(capsys.readouterr().out)
    assert mixed["option"] == "1 x h100-80gb + 1 x a100-80gb" and mixed["gpus"] == 2
    assert [p["gpu"] for p in mixed["pools"]] == ["h100-80gb", "a100-80gb"]
    assert mixed["fits"] and mixed["stepSeconds"] < alone["stepSeconds"]
    assert "h100-80gb" in mixed["layout"] and "a100-80gb" in mixed["layout"], mixed["layout"]
    prices = load_prices(PRICES, parse_options(["h100-80gb:1+a100-80gb:1"]))
    hourly = prices.of(DevicePreset.H100_80GB) + prices.of(DevicePreset.A100_80GB)
    assert mixed["dollarsPerHour"] == pytest.approx(hourly)
    steps = alpajob.load(job).spec.training.steps
    assert mixed["dollars"] == pytest.approx(steps * mixed["stepSeconds"] / 3600 * hourly)
    assert mixed["gpuHours"] == pytest.approx(steps * mixed["stepSeconds"] * 2 / 3600)
    assert not mixed["cached"] and mixed["planHash"]
    assert main(argv) == 0  # a rerun reads the plan across types from the cache, as any plan
    again, _ = json.loads(capsys.readouterr().out)
    assert again["cached"] and again["planHash"] == mixed["planHash"] and again["stepSeconds"] == mixed["stepSeconds"]
