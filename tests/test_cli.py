"""The `alpajob` console script as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from alpajob.cli.main import main

EXAMPLES = Path(__file__).parent.parent / "manifests" / "examples"


def test_plan_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", str(EXAMPLES / "local-gpt.yaml"), "--baselines", "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "predicted step time" in printed and "megatron-3d" in printed
    data = json.loads(out.read_text())
    assert data["stages"] and data["num_micro_batches"] >= 1
    assert set(data["baselines"]) >= {"data-parallel", "zero2", "megatron-3d"}
    for stage in data["stages"]:
        assert len(stage["layers"]) == 2 and len(stage["submesh_shape"]) == 2


def test_manual_manifest(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", str(EXAMPLES / "manual-gpt.yaml"), "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [s["layers"] for s in data["stages"]] == [[0, 2], [2, 4]]


def test_plan_prints_each_stage_instruction_list(capsys):
    """manual-gpt.yaml: 2 stages, 4 micro-batches, 1F1B (the default schedule)."""
    assert main(["plan", str(EXAMPLES / "manual-gpt.yaml"), "--schedule"]) == 0
    printed = capsys.readouterr().out
    assert "1f1b schedule, 4 micro-batches" in printed
    assert "F0 F1 B0 F2 B1 F3 B2 B3 U" in printed  # stage 0: one warm-up forward
    assert "F0 B0 F1 B1 F2 B2 F3 B3 U" in printed  # the last stage alternates


def test_cluster_overrides(tmp_path):
    out = tmp_path / "plan.json"
    code = main(["plan", str(EXAMPLES / "local-gpt.yaml"), "--gpus-per-node", "4",
                 "--output", str(out)])
    assert code == 0
    assert json.loads(out.read_text())["cluster"]["devices_per_node"] == 4


@pytest.mark.parametrize(
    ("edit", "args", "message"),
    [
        ("config: huge", [], "spec.model.config"),
        ("globalBatchSize: 32", ["--gpu", "tpu-v9"], "--gpu"),
        ("globalBatchSize: 32", ["--nodes", "0"], "--nodes"),
        ("globalBatchSize: 32", ["--gpus-per-node", "3"], "gpusPerNode"),
        ("globalBatchSize: -4", [], "spec.training.globalBatchSize"),
    ],
)
def test_user_errors_exit_2_without_traceback(tmp_path, edit, args, message):
    text = (EXAMPLES / "local-gpt.yaml").read_text()
    key = edit.split(":")[0]
    lines = [(f"    {edit}" if line.strip().startswith(key + ":") else line)
             for line in text.splitlines()]
    manifest = tmp_path / "job.yaml"
    manifest.write_text("\n".join(lines))
    proc = subprocess.run(
        [sys.executable, "-m", "alpajob", "plan", str(manifest), *args],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_models_and_schema(capsys):
    assert main(["models"]) == 0
    names = capsys.readouterr().out.split()
    assert "gpt-39b" in names and "moe-70b" in names and "wresnet-13b" in names
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out)["$id"].startswith("alpajob.io/plan")


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["mesh-worker", "--address", "127.0.0.1:1"], "--mesh"),
        (["mesh-worker", "--mesh", "0", "--address", "127.0.0.1:1", "--devices", "0"], "--devices"),
        (["driver", "{manifest}", "--plan", "{plan}"], "--address"),
        (["driver", "{manifest}", "--plan", "{plan}", "--address", "127.0.0.1:1", "--steps", "0"], "--steps"),
        (["driver", "{manifest}", "--plan", "{plan}", "--address", "127.0.0.1:1",
          "--checkpoint-every", "0"], "--checkpoint-every"),
        (["driver", "{manifest}", "--plan", "{plan}", "--address", "127.0.0.1:1",
          "--max-restarts", "-1"], "--max-restarts"),
        (["driver", "{manifest}", "--plan", "{plan}", "--address", "127.0.0.1:1",
          "--keep-last", "0"], "--keep-last"),
    ],
)
def test_ray_commands_refuse_bad_flags_naming_them(tmp_path, capsys, monkeypatch, args, field):
    """Bad flags of the Ray entry points exit 2 naming the flag, before touching Ray."""
    for name in ("ALPAJOB_RAY_ADDRESS", "ALPAJOB_MESH", "ALPAJOB_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    manifest = EXAMPLES / "manual-gpt.yaml"
    plan = tmp_path / "plan.json"
    assert main(["plan", str(manifest), "--output", str(plan)]) == 0
    capsys.readouterr()
    filled = [a.format(manifest=manifest, plan=plan) for a in args]
    assert main(filled) == 2
    assert field in capsys.readouterr().err


def test_alpajob_version_prints_the_installed_version() -> None:
    from importlib import metadata

    done = subprocess.run([sys.executable, "-m", "alpajob", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"alpajob {metadata.version('alpajob')}"
