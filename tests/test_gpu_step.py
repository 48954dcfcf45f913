"""The one-GPU benchmark (benchmarks/gpu_step.py) runs end to end on CPU: every run in
its own process, one table row each, a JSON of them (``--cpu-smoke``: a tiny GPT)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_smoke_runs_every_case_in_a_fresh_process(tmp_path: Path) -> None:
    out = tmp_path / "gpu-step.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--cpu-smoke", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny |")]
    assert [row.split(" | ")[1] for row in rows] == ["plain", "serial", "one-stage", "two-stages"], done.stdout
    result = json.loads(out.read_text())
    assert result["peak"]["peak"] > 0
    for row in result["rows"]:
        assert "error" not in row, row
        assert row["seconds"] > 0 and row["flops"] > 0 and row["tokens"] == 4 * 32


def test_an_unknown_run_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--runs", "plain,fast"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--runs: unknown fast" in done.stderr
    assert "Traceback" not in done.stderr
