"""The plan cache (:mod:`alpajob.trainer_image.plan_cache`): a plan made once is read
back for the same graph, cluster, search and planner, and never trusted when damaged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from alpajob.api.options import PlanOptions
from alpajob.cli.main import main
from alpajob.trainer_image.plan_cache import PlanCache, default_cache_dir, plan_key, planner_version
from alpajob.trainer_image.planning import plan_or_cached, planning_inputs

EXAMPLES = Path(__file__).parent.parent / "manifests" / "examples"


@pytest.fixture(scope="module")
def manual_job():
    from alpajob.api.resource import load_job

    return load_job(str(EXAMPLES / "manual-gpt.yaml"))


def test_the_default_folder_is_the_user_cache(monkeypatch):
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/alpajob/plans")
    monkeypatch.setenv("HOME", "/home/u")
    assert default_cache_dir({}) == Path("/home/u/.cache/alpajob/plans")


def test_the_key_changes_with_whatever_the_plan_depends_on(manual_job):
    given = planning_inputs(manual_job, PlanOptions(), None, None, None)
    key = plan_key(given.graph, given.cluster, given.search, "v1")
    assert key == plan_key(given.graph, given.cluster, given.search, "v1")
    others = [
        plan_key(given.graph, given.cluster, given.search, "v2"),
        plan_key(given.graph, dataclasses.replace(given.cluster, num_nodes=2), given.search, "v1"),
        plan_key(given.graph, given.cluster, dataclasses.replace(given.search, ilp_time_limit_s=3.0), "v1"),
        plan_key(dataclasses.replace(given.graph, batch_size=given.graph.batch_size * 2), given.cluster,
                 given.search, "v1"),
        plan_key(dataclasses.replace(given.graph, param_names=given.graph.param_names[::-1]), given.cluster,
                 given.search, "v1"),
    ]
    assert len({key, *others}) == 1 + len(others)
    assert len(planner_version()) == 16 and planner_version() == planner_version()


def test_a_plan_is_read_back_and_a_damaged_entry_is_ignored(manual_job, tmp_path):
    warnings: list[str] = []
    options = PlanOptions(cache_dir=str(tmp_path))
    first = plan_or_cached(manual_job, options, warn=warnings.append)
    assert not first.cached and first.key is not None and warnings == []
    entry = tmp_path / f"{first.key}.json"
    assert entry.is_file() and not list(tmp_path.glob(".*.tmp"))  # written whole, renamed into place
    again = plan_or_cached(manual_job, options, warn=warnings.append)
    assert again.cached and again.plan == first.plan and warnings == []

    graph = planning_inputs(manual_job, options, None, None, None).graph
    cache = PlanCache(tmp_path, warnings.append)
    good = entry.read_text()
    document = json.loads(good)
    damaged = {
        "truncated": good[: len(good) // 2],
        "edited plan": json.dumps({**document, "plan": document["plan"].replace('"num_micro_batches": 4',
                                                                                 '"num_micro_batches": 2')}),
        "another key": json.dumps({**document, "key": "0" * 16}),
    }
    for name, text in damaged.items():
        entry.write_text(text)
        warnings.clear()
        assert cache.get(first.key, graph) is None, name
        assert len(warnings) == 1 and "ignoring" in warnings[0] and str(entry) in warnings[0], (name, warnings)
    other_model = dataclasses.replace(graph, batch_size=graph.batch_size * 2)
    entry.write_text(good)
    warnings.clear()
    assert cache.get(first.key, other_model) is None and "fingerprint" in warnings[0]
    # ignored, then replaced by a fresh plan
    entry.write_text("{")
    warnings.clear()
    replanned = plan_or_cached(manual_job, options, warn=warnings.append)
    assert not replanned.cached and len(warnings) == 1
    assert json.loads(entry.read_text())["plan"] == replanned.plan.to_json()


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_plan(manual_job, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    warnings: list[str] = []
    planned = plan_or_cached(manual_job, PlanOptions(cache_dir=str(blocked / "plans")), warn=warnings.append)
    assert planned.plan is not None and not planned.cached
    assert len(warnings) == 1 and "cannot write" in warnings[0]


def test_alpajob_plan_twice_reads_the_cache_the_second_time(tmp_path, capsys):
    manifest = str(EXAMPLES / "manual-gpt.yaml")
    out = [tmp_path / "a.json", tmp_path / "b.json"]
    assert main(["plan", manifest, "--output", str(out[0])]) == 0
    assert "plan: cached" not in capsys.readouterr().err
    assert main(["plan", manifest, "--output", str(out[1])]) == 0
    err = capsys.readouterr().err
    assert "plan: cached (" in err and str(default_cache_dir()) in err
    assert out[0].read_text() == out[1].read_text()
    assert main(["plan", manifest, "--no-plan-cache"]) == 0
    assert "plan: cached" not in capsys.readouterr().err


def test_no_plan_cache_and_a_cache_dir_are_refused_together(tmp_path, capsys):
    code = main(["plan", str(EXAMPLES / "manual-gpt.yaml"), "--no-plan-cache", "--cache-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--cache-dir" in err and "--no-plan-cache" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_second_run_of_the_same_job_trains_on_the_cached_plan(tmp_path):
    """The second run reads the plan and its device trial's verdict back, and trains
    the same numbers; the first kept its compiled executables."""
    from alpajob.api.options import TrainOptions
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.local_run import run

    job = parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "again"},
        "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "training": {"globalBatchSize": 8, "dtype": "float32"},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8}, "parallelism": {"method": "auto"}}})
    options = TrainOptions(steps=2, planning=PlanOptions(ilp_time_limit=5.0, cache_dir=str(tmp_path)),
                           compile_cache_dir=str(tmp_path / "xla"))
    said: list[list[str]] = [[], []]
    first = run(job, options, on_phase=said[0].append)
    assert any((tmp_path / "xla").iterdir()), "the step's executables were not kept"
    second = run(job, options, on_phase=said[1].append)
    assert not any(line.startswith(("plan: cached", "device trial: cached")) for line in said[0])
    assert "timing the plan against one device" in said[0]
    planned = next(line for line in said[1] if line.startswith("plan: cached ("))
    assert "timing the plan against one device" not in said[1]
    assert f"device trial: cached; {first.device_trial.line()}" in said[1]
    assert second.device_trial == first.device_trial and second.losses == first.losses
    if first.plan is not None:  # the trial kept the plan
        assert second.plan == first.plan and first.plan.content_hash() in planned


def test_a_trial_verdict_is_read_back_and_a_damaged_one_ignored(tmp_path):
    warnings: list[str] = []
    cache = PlanCache(tmp_path, warnings.append)
    assert cache.get_trial("k") is None and warnings == []
    cache.put_trial("k", 0.4, 0.5)
    assert cache.get_trial("k") == (0.4, 0.5)
    for text in ("{", json.dumps({"key": "trial-other", "record": {"plan_seconds": 0.4, "one_device_seconds": 0.5}}),
                 json.dumps({"key": "trial-k", "record": {"plan_seconds": -1, "one_device_seconds": 0.5}})):
        (tmp_path / "trial-k.json").write_text(text)
        warnings.clear()
        assert cache.get_trial("k") is None and len(warnings) == 1 and "ignoring" in warnings[0]
