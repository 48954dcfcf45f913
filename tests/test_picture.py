"""The plan as a picture (``alpajob plan --svg``), the predicted timeline, the Chrome
trace and the summarised ``--schedule``."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from alpajob.api.plan import plan_from_json
from alpajob.api.spec import Schedule
from alpajob.api.timeline import SpanKind, chrome_trace
from alpajob.cli.main import main
from alpajob.cli.picture import plan_svg
from alpajob.cli.tables import summarise_program
from alpajob.planner.inter_op.schedules import (
    Direction,
    bubble_fraction,
    instruction_list,
    simulate,
)
from alpajob.planner.plan.timeline import forward_share, predicted_timeline

EXAMPLES = Path(__file__).parent.parent / "manifests" / "examples"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def manual_plan(tmp_path_factory):
    """manual-gpt.yaml: 2 stages of 4 CPU devices, 4 micro-batches, 1F1B; its SVG."""
    folder = tmp_path_factory.mktemp("picture")
    out, svg = folder / "plan.json", folder / "plan.svg"
    assert main(["plan", str(EXAMPLES / "manual-gpt.yaml"), "--output", str(out),
                 "--svg", str(svg)]) == 0
    return plan_from_json(out.read_text()), svg


def test_predicted_timeline_replays_the_schedule(manual_plan):
    """Every stage runs each micro-batch's forward and backward once, in its
    instruction list's order, never two spans at once, then its update; the forward
    is a third of the stage's time (a quarter with rematerialisation)."""
    plan, _ = manual_plan
    timeline = predicted_timeline(plan)
    m, p = plan.num_micro_batches, len(plan.stages)
    assert timeline.num_stages == p
    for i, stage in enumerate(plan.stages):
        spans = sorted((s for s in timeline.spans if s.stage == i), key=lambda s: s.start)
        passes = [(s.kind, s.micro_batch) for s in spans
                  if s.kind in (SpanKind.FORWARD, SpanKind.BACKWARD)]
        expected = [(SpanKind(d.value), j) for d, j in
                    instruction_list(Schedule(plan.schedule), i, p, m)]
        assert passes == expected
        assert spans[-1].kind is SpanKind.UPDATE
        assert spans[-1].end - spans[-1].start == pytest.approx(stage.update_seconds)
        for a, b in zip(spans, spans[1:], strict=False):
            assert a.end <= b.start + 1e-12
        work = sum(s.end - s.start for s in spans if s.kind is not SpanKind.UPDATE)
        assert work == pytest.approx(m * stage.predicted_seconds)
        forward = [s for s in spans if s.kind is SpanKind.FORWARD]
        comm = sum(s.end - s.start for s in spans if s.kind is SpanKind.COMMUNICATION)
        assert comm == pytest.approx(m * stage.communication_seconds)
        assert forward_share(stage.rematerialize) == (0.25 if stage.rematerialize else 1 / 3)
        assert len(forward) == m


def test_balanced_timeline_has_the_textbook_bubble(manual_plan):
    """With equal stages the replay is :func:`simulate`'s, and each stage idles
    (p - 1) / (m + p - 1) of the passes' span."""
    plan, _ = manual_plan
    stages = [s.model_copy(update={"predicted_seconds": 3.0, "communication_seconds": 0.0,
                                   "update_seconds": 0.0, "rematerialize": False})
              for s in plan.stages]
    balanced = plan.model_copy(update={"stages": stages})
    timeline = predicted_timeline(balanced)
    p, m = len(stages), plan.num_micro_batches
    reference = simulate(Schedule(plan.schedule), [1.0] * p, [2.0] * p, m)
    assert timeline.seconds == pytest.approx(reference.makespan)
    for i in range(p):
        assert timeline.bubble(i) / timeline.seconds == pytest.approx(bubble_fraction(p, m))


def test_svg_is_valid_with_one_row_per_stage_and_one_cell_per_device(manual_plan):
    plan, path = manual_plan
    root = ET.fromstring(path.read_text())
    assert root.tag == f"{SVG}svg"
    rows = [g for g in root.iter(f"{SVG}g") if g.get("class") == "stage-row"]
    assert [int(g.get("data-stage")) for g in rows] == list(range(len(plan.stages)))
    cells = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "device"]
    assert len(cells) == plan.cluster["num_nodes"] * plan.cluster["devices_per_node"]
    owners = sorted(int(c.get("data-stage")) for c in cells if c.get("data-stage"))
    assert owners == sorted(i for i, s in enumerate(plan.stages) for _ in s.device_slots)
    for g in rows:
        spans = [r for r in g.iter(f"{SVG}rect") if (r.get("class") or "").startswith("span")]
        kinds = {r.get("class").split()[1] for r in spans}
        assert {"forward", "backward", "update"} <= kinds
        assert len([r for r in spans if r.get("class") == "span forward"]) == (
            plan.num_micro_batches)
    assert float(root.get("height")) > 100


def test_svg_escapes_what_the_model_name_holds(manual_plan):
    plan, _ = manual_plan
    odd = plan.model_copy(update={"model": plan.model.model_copy(update={"name": "a<b&\"c"})})
    text = plan_svg(odd, predicted_timeline(odd))
    assert "a&lt;b&amp;" in text
    ET.fromstring(text)


def test_chrome_trace_has_one_thread_per_stage_per_timeline(manual_plan):
    plan, _ = manual_plan
    timeline = predicted_timeline(plan)
    trace = json.loads(json.dumps(chrome_trace([("predicted", timeline), ("again", timeline)])))
    events = trace["traceEvents"]
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(pid, i) for pid in (1, 2) for i in range(len(plan.stages))}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 2 * len(timeline.spans)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert {e["cat"] for e in complete} >= {"forward", "backward", "update"}


@pytest.mark.parametrize("schedule", list(Schedule))
def test_summarised_schedule_is_short_and_complete(schedule):
    """64 stages x 64 micro-batches: each row a few words, and the words name every
    instruction (expanding them gives the list back)."""
    for i in range(64):
        program = instruction_list(schedule, i, 64, 64)
        text = summarise_program(program)
        assert len(text) < 80
        assert _expand(text) == program


def _expand(text: str) -> list[tuple[Direction, int]]:
    """The instructions a summary names (the inverse of summarise_program)."""
    def one(word: str) -> tuple[Direction, int]:
        return (Direction.FORWARD if word[0] == "F" else Direction.BACKWARD, int(word[1:]))

    out: list[tuple[Direction, int]] = []
    words = text.split("  ")
    for word in words:
        if "/" in word:
            first, _, last = word.partition(" … ")
            last = last.split(" (")[0]
            (f0, b0), (f1, _) = (one(x) for x in first.split("/")), (one(x) for x in last.split("/"))
            for k in range(f1[1] - f0[1] + 1):
                out += [(Direction.FORWARD, f0[1] + k), (Direction.BACKWARD, b0[1] + k)]
        elif "…" in word:
            a, b = (one(x) for x in word.split("…"))
            out += [(a[0], j) for j in range(a[1], b[1] + 1)]
        else:
            out.append(one(word))
    return out


def test_schedule_flag_summarises_many_micro_batches(tmp_path, capsys):
    """manual-gpt.yaml with 16 micro-batches: rows are summarised, not listed."""
    text = (EXAMPLES / "manual-gpt.yaml").read_text().replace("numMicroBatches: 4",
                                                              "numMicroBatches: 16")
    manifest = tmp_path / "job.yaml"
    manifest.write_text(text)
    assert main(["plan", str(manifest), "--schedule"]) == 0
    printed = capsys.readouterr().out
    assert "F0  F1/B0 … F15/B14 (15 pairs)  B15  U" in printed
    assert "F0/B0 … F15/B15 (16 pairs)  U" in printed


def test_svg_flag_refuses_a_missing_folder(tmp_path, capsys):
    code = main(["plan", str(EXAMPLES / "manual-gpt.yaml"), "--svg",
                 str(tmp_path / "no" / "plan.svg")])
    assert code == 2
    assert "--svg" in capsys.readouterr().err


@pytest.mark.parametrize("exact", [pytest.param(False, marks=pytest.mark.slow), True])
def test_run_trace_has_the_measured_step_beside_the_prediction(tmp_path, exact):
    """``alpajob run --trace`` of manual-gpt.yaml (2 stages, 4 micro-batches), 2 steps:
    the last step is timed even though --stage-times-every is 10; the trace has the
    measured and the predicted timeline, one row per stage each, and the measured
    rows hold every micro-batch's forward and backward and the update, in the stage's
    instruction order and within the step (the last stage's as one span each, and each
    stage's update inside its last backward, but waiting for every instruction)."""
    from alpajob.api.options import TrainOptions
    from alpajob.api.resource import load_job
    from alpajob.trainer_image.local_run import run

    job = load_job(str(EXAMPLES / "manual-gpt.yaml"))
    path = tmp_path / "trace.json"
    result = run(job, TrainOptions(steps=2, trace=str(path), exact_stage_times=exact))
    assert result.stage_time_steps == [2]
    trace = json.loads(path.read_text())
    plan = result.plan
    p, m = len(plan.stages), plan.num_micro_batches
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["name"] == "process_name"}
    assert processes[1].startswith("measured: step 2") and processes[2].startswith("predicted")
    threads = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {(pid, i) for pid in (1, 2) for i in range(p)}
    measured = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    step_us = trace["otherData"]["measured_seconds"] * 1e6
    for i in range(p):
        row = sorted((e for e in measured if e["tid"] == i and e["cat"] != "communication"),
                     key=lambda e: e["ts"])
        names = [e["name"] for e in row]
        program = instruction_list(Schedule(plan.schedule), i, p, m)
        expected = [f"{'F' if d is Direction.FORWARD else 'B'}{j}" for d, j in program]
        if i == p - 1 and not exact:  # the last stage: forward and backward in one executable
            expected = [f"X{j}" for d, j in program if d is Direction.FORWARD]
        if exact:  # else the update runs with the last backward (GPT's stages all can: fuses_update)
            expected.append("U")
        assert names == expected
        assert all(e["ts"] >= 0 and e["ts"] + e["dur"] <= step_us * 1.01 for e in row)
        if exact:  # a waiting step runs one instruction at a time
            for a, b in zip(row, row[1:], strict=False):
                assert a["ts"] + a["dur"] <= b["ts"] + 1


def test_trace_and_serial_are_refused_together(tmp_path, capsys):
    code = main(["run", str(EXAMPLES / "manual-gpt.yaml"), "--method", "serial", "--trace",
                 str(tmp_path / "t.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert "trace" in err and "serial" in err


def test_svg_of_many_micro_batches_merges_narrow_boxes(manual_plan):
    """1024 micro-batches: boxes narrower than four pixels are merged into
    columns, drawn as high as the stage is busy there; the steady state, where forwards
    and backwards interleave, is one even bar (not a barcode of alternating passes, nor
    of 90% and 100% columns) as high as the stage's busy share; the heading gives the
    bubble the plan summary gives, and the legend says what merged bars mean; the file
    stays small."""
    plan, _ = manual_plan
    many = plan.model_copy(update={"num_micro_batches": 1024,
                                   "bubble_fraction": bubble_fraction(len(plan.stages), 1024)})
    timeline = predicted_timeline(many)
    text = plan_svg(many, timeline)
    assert len(text) < 200_000
    root = ET.fromstring(text)
    rows = [g for g in root.iter(f"{SVG}g") if g.get("class") == "stage-row"]
    assert len(rows) == len(plan.stages)
    words = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert f"pipeline bubble {many.bubble_fraction:.1%}" in words
    assert "computing (merged)" in words and "a bar's height is the share of the time the stage is busy" in words
    for g in rows:
        (steady,) = [r for r in g.iter(f"{SVG}rect") if r.get("class") == "span merged"
                     and float(r.get("width")) > 0.8 * (1200 - 190 - 20)]
        (back,) = [r for r in g.iter(f"{SVG}rect") if r.get("class") == "idle"]
        busy = 1 - float(back.get("data-idle"))
        assert (float(steady.get("height")) - 1) / (float(back.get("height")) - 1) == pytest.approx(busy, abs=0.1)
    for g in rows:
        (swatch,) = [r for r in g.iter(f"{SVG}rect") if r.get("class") is None]
        (background,) = [r for r in g.iter(f"{SVG}rect") if r.get("class") == "idle"]
        spans = [r for r in g.iter(f"{SVG}rect") if (r.get("class") or "").startswith("span")]
        assert 0 < len(spans) < 300
        assert any("merged" in (r.findtext(f"{SVG}title") or "") for r in spans)
        full = float(background.get("height"))
        assert float(swatch.get("height")) == full
        assert all(float(r.get("height")) <= full + 1e-9 for r in spans)


def test_trace_of_a_run_the_device_trial_moved_to_one_device_is_written(tmp_path, monkeypatch):
    """``--trace`` is not dropped when the device trial trains on one device: the file
    holds the last step on one device, one span, and says why there is no plan."""
    from alpajob.api.options import PlanOptions, TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image import local_run
    from alpajob.trainer_image.device_trial import TrialResult

    monkeypatch.setattr(local_run, "trial", lambda *_: TrialResult(plan_seconds=0.2, one_device_seconds=0.1))
    job = parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "moved"},
        "spec": {"model": {"zoo": "gpt", "config": "tiny"},
                 "training": {"globalBatchSize": 8, "dtype": "float32"},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8}, "parallelism": {"method": "auto"}}})
    path = tmp_path / "trace.json"
    said: list[str] = []
    result = local_run.run(job, TrainOptions(steps=2, trace=str(path), planning=PlanOptions(ilp_time_limit=5.0)),
                           on_phase=said.append)
    assert result.plan is None and result.device_trial is not None
    document = json.loads(path.read_text())
    assert document["otherData"]["plan_hash"] is None and "one device" in document["otherData"]["one_device"]
    spans = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 1 and spans[0]["dur"] == pytest.approx(result.step_seconds[-1] * 1e6, rel=1e-3)
    assert any(line.startswith("trace: the last step on one device") for line in said)
