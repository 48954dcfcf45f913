"""The Python API (``import alpajob``): the same plans and runs as the CLI, from typed
options; mistakes are errors that name the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import alpajob
from alpajob.api.errors import ManifestError
from alpajob.api.options import PlanOptions
from alpajob.cli.main import main

EXAMPLES = Path(__file__).parent.parent / "manifests" / "examples"
MLP = {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "api-mlp"},
       "spec": {"model": {"zoo": "mlp", "config": "tiny"}, "training": {"globalBatchSize": 16},
                "cluster": {"gpu": "cpu"}, "parallelism": {"method": "data"}}}


def test_a_plan_from_python_is_the_plan_the_cli_writes(tmp_path: Path) -> None:
    manifest = EXAMPLES / "manual-gpt.yaml"
    out = tmp_path / "plan.json"
    assert main(["plan", str(manifest), "--gpus-per-node", "8", "--output", str(out)]) == 0
    plan = alpajob.plan(alpajob.load(manifest), PlanOptions(gpus_per_node=8))
    assert plan.content_hash() == json.loads(out.read_text())["hash"]
    assert alpajob.plan(str(manifest), gpus_per_node=8).content_hash() == plan.content_hash()


def test_options_are_overridden_by_keyword() -> None:
    plan = alpajob.plan(MLP, PlanOptions(gpus_per_node=2), gpus_per_node=4, method="shard")
    assert plan.cluster["devices_per_node"] == 4 and plan.method == "shard"


@pytest.mark.parametrize(("overrides", "field"), [({"nodes": 0}, "nodes"), ({"gpu": "h200"}, "gpu"),
                                                  ({"colour": "red"}, "colour")])
def test_a_bad_option_names_its_field(overrides: dict, field: str) -> None:
    with pytest.raises(ManifestError) as info:
        alpajob.plan(MLP, **overrides)
    assert info.value.field == field


def test_a_bad_manifest_names_its_field() -> None:
    bad = {**MLP, "spec": {**MLP["spec"], "training": {"globalBatchSize": 0}}}
    with pytest.raises(ManifestError) as info:
        alpajob.plan(bad)
    assert info.value.field == "spec.training.globalBatchSize"


def test_train_runs_the_job_serial_and_planned_alike() -> None:
    serial = alpajob.train(MLP, steps=2, serial=True)
    planned = alpajob.train(MLP, steps=2, planning=PlanOptions(ilp_time_limit=5.0))
    assert len(serial.losses) == len(planned.losses) == 2 and serial.plan is None
    assert planned.plan is not None and planned.plan.method == "data"
    assert planned.losses == pytest.approx(serial.losses, rel=1e-5)
    with pytest.raises(ManifestError) as info:
        alpajob.train(MLP, steps=0)
    assert info.value.field == "steps"


def test_counts_in_messages_agree_with_their_number() -> None:
    from alpajob.api.wording import counted

    assert counted(1, "time") == "1 time" and counted(3, "time") == "3 times"
    assert counted(0, "restart") == "0 restarts"
    assert counted(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert counted(4, "micro-batch", "micro-batches") == "4 micro-batches"


@pytest.mark.parametrize("how", ["a script file", "python -", pytest.param("python -c", marks=pytest.mark.slow)])
def test_the_python_api_plans_from_a_plain_script_without_a_main_guard(tmp_path: Path, how: str) -> None:
    """The planner's workers ran such a script again (a BrokenPipeError each); now they
    start without the caller's __main__, so its body runs once, whether the script is a
    file, read from stdin (``python -``) or given with ``-c`` (whose main module, like a
    notebook's, has no file)."""
    code = (
        "import alpajob\n"
        "print('body ran')\n"
        "plan = alpajob.plan({'apiVersion': 'alpajob.io/v1alpha1', 'kind': 'AlpaJob', 'metadata': {'name': 's'},\n"
        "                     'spec': {'model': {'zoo': 'mlp'}, 'training': {'globalBatchSize': 16},\n"
        "                              'cluster': {'gpu': 'cpu', 'nodes': 1, 'gpusPerNode': 2}}})\n"
        "print('planned', len(plan.stages))\n")
    script = tmp_path / "plan_it.py"
    script.write_text(code)
    argv, stdin = {"a script file": ([str(script)], None), "python -": (["-"], code),
                   "python -c": (["-c", code], None)}[how]
    done = subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("body ran") == 1 and "planned" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
