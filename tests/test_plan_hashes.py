"""The same plans: every zoo case's plan hash is the one recorded (``tests/data/plan_hashes.json``,
written by ``benchmarks/plan_hashes.py``), so work that makes planning faster changes
no plan. The quick cases (the zoo's small configurations and the example manifests on
8 CPU devices) run by default; Alpa's weak-scaling cases on V100s are the slow set.

A hash that moves while the plan predicts the same step time and every stage the same
peak memory is an ILP with tied optima choosing another of them: the test passes with a
warning listing the plan's stages (one of them has the tie). Any other move fails it.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from plan_hashes import QUICK, all_cases, plan_of  # noqa: E402

RECORDED = json.loads((ROOT / "tests" / "data" / "plan_hashes.json").read_text())


def _check(case: str) -> None:
    """Fail unless ``case`` plans as recorded (a tie only warns: module docstring)."""
    plan = plan_of(case)
    want = RECORDED[case]
    if plan.content_hash() == want["hash"]:
        return
    peaks = [s.peak_memory_bytes for s in plan.stages]
    same_time = plan.predicted_step_seconds == pytest.approx(want["step_seconds"], rel=1e-9)
    same_memory = len(peaks) == len(want["stage_peak_bytes"]) and all(
        p == pytest.approx(q, rel=1e-9) for p, q in zip(peaks, want["stage_peak_bytes"], strict=True))
    assert same_time and same_memory, (
        f"{case}: another plan: hash {plan.content_hash()} instead of {want['hash']}, "
        f"{plan.predicted_step_seconds:.6g} s per step instead of {want['step_seconds']:.6g}, "
        f"stage peaks {peaks} instead of {want['stage_peak_bytes']}")
    warnings.warn(f"{case}: hash {plan.content_hash()} instead of {want['hash']} with the same step "
                  f"time and memory: a tied ILP optimum in one of the stages "
                  f"{[(s.layers, s.submesh_shape, s.logical_mesh_shape) for s in plan.stages]}",
                  stacklevel=2)


def test_every_case_is_recorded():
    assert sorted(RECORDED) == sorted(all_cases())


@pytest.mark.parametrize("case", QUICK)
def test_quick_cases_plan_as_recorded(case: str) -> None:
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in all_cases() if c not in QUICK])
def test_alpa_cases_plan_as_recorded(case: str) -> None:
    _check(case)
