"""How many forced CPU devices a local run makes (trainer_image/forced_count.py).

More forced devices than cores slow every device (measured: benchmarks/forced_devices.py),
so ``alpajob run`` plans the job on the count offered and on one device per core, and
makes the count whose plan is predicted fastest, before JAX starts. These tests hold
the cost model's factor to its formula, the choice to the plans' predictions, and the
CLI to making the chosen count (in a fresh process, as a user runs it).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from alpajob import load
from alpajob.api.errors import InfeasibleError, ManifestError
from alpajob.api.options import TrainOptions
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.cost.model import load_calibration, oversubscription_factor
from alpajob.trainer_image.forced_count import (
    candidates,
    choose_forced_count,
    host_cores,
    shared_host_cluster,
)

ROOT = Path(__file__).resolve().parent.parent
README_JOB = ROOT / "manifests" / "examples" / "text-gpt.yaml"


def test_more_devices_than_cores_slow_every_device() -> None:
    calibration = load_calibration("cpu")
    a, measured = calibration.oversubscription_slowdown, calibration.calibrated_devices_per_core
    assert a > 0 and measured == 4.0  # the cpu preset: 8 devices on 2 cores
    factor = {r: oversubscription_factor(shared_host_cluster("cpu", 2, int(2 * r), 2), calibration)
              for r in (0.5, 1, 2, 4)}
    assert factor[4] == pytest.approx(1.0)  # the calibration's own setting
    assert factor[1] == factor[0.5] == pytest.approx(1 / (1 + 3 * a))  # no slowdown at <= 1 per core
    assert factor[2] == pytest.approx((1 + a) / (1 + 3 * a))
    # unknown counts, and devices that do not share a host, are left alone
    assert oversubscription_factor(cluster_from_preset("cpu", 1, 8), calibration) == 1.0
    gpu = dataclasses.replace(cluster_from_preset("v100-16gb", 1, 8), devices_per_core=4.0)
    assert oversubscription_factor(gpu, load_calibration("v100-16gb")) == 1.0


def test_the_candidates_are_the_offered_count_and_one_per_core() -> None:
    assert candidates(8, 2) == [2, 8]
    assert candidates(8, 8) == candidates(8, 64) == [8]
    assert candidates(8, 1) == [1, 8]


@pytest.mark.slow
def test_the_count_whose_plan_is_fastest_is_made() -> None:
    job = load(README_JOB)
    on_two_cores = choose_forced_count(job, TrainOptions(), cores=2)
    assert set(on_two_cores.predicted) == {2, 8}
    assert on_two_cores.devices == min(on_two_cores.predicted, key=on_two_cores.predicted.__getitem__)
    assert on_two_cores.devices == 2  # 8 devices on 2 cores run every op slower
    assert "making 2 forced CPU devices" in on_two_cores.line() and "8 devices" in on_two_cores.line()
    on_eight_cores = choose_forced_count(job, TrainOptions(), cores=8)
    assert on_eight_cores.devices == 8 and set(on_eight_cores.predicted) == {8}
    assert on_eight_cores.line().endswith("ms per step")


def _run(*args: str, cwd: Path, command: str = "run") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "alpajob", command, *args], capture_output=True,
                          text=True, cwd=cwd, env={**env, "PYTHONPATH": str(cwd)}, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(host_cores() >= 8, reason="one device per core is the 8 offered: no choice")
def test_alpajob_run_makes_the_chosen_count(tmp_path: Path) -> None:
    job = str(ROOT / "manifests" / "examples" / "local-gpt.yaml")
    done = _run(job, "--steps", "2", "--keep-plan", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    made = re.search(r"making (\d+) forced CPU devices", done.stdout)
    assert made and int(made.group(1)) in candidates(8, host_cores()), done.stdout
    assert f"planning for {made.group(1)} local cpu devices" in done.stdout + done.stderr
    # `alpajob plan` says which count the run makes (the run cached its choice)
    planned = _run(job, cwd=tmp_path, command="plan")
    assert planned.returncode == 0, planned.stderr
    assert (f"`alpajob run` on this machine makes {made.group(1)} forced CPU devices (its cached choice)"
            in " ".join(planned.stdout.split())), planned.stdout
    # the user's count is the user's: no choice
    done = _run(job, "--steps", "1", "--devices", "4", "--keep-plan", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "forced CPU devices" not in done.stdout
    assert "planning for 4 local cpu devices" in done.stdout + done.stderr


def test_errors_cross_processes() -> None:
    error = pickle.loads(pickle.dumps(ManifestError("spec.model.zoo", "unknown")))
    assert isinstance(error, ManifestError) and error.field == "spec.model.zoo"
    assert str(error) == "spec.model.zoo: unknown"
    infeasible = pickle.loads(pickle.dumps(InfeasibleError("too big", 2.0, 1.0)))
    assert (infeasible.required_bytes, infeasible.available_bytes, str(infeasible)) == (2.0, 1.0, "too big")


def test_the_choice_is_read_back_from_the_plan_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun does not start the child that plans every count: the choice is cached
    per manifest, options, cores and planner; a damaged record is chosen again."""
    from alpajob.api.options import PlanOptions
    from alpajob.trainer_image import forced_count

    chosen: list[int] = []

    def child(job: object, options: TrainOptions) -> forced_count.ForcedCount:
        chosen.append(1)
        return forced_count.ForcedCount(2, {2: 0.15, 8: 0.2})

    monkeypatch.setattr(forced_count, "choose_in_child", child)
    job = load(README_JOB)
    options = TrainOptions(planning=PlanOptions(cache_dir=str(tmp_path)))
    warnings: list[str] = []
    first = forced_count.choose_cached(job, options, warnings.append)
    again = forced_count.choose_cached(job, options, warnings.append)
    assert (first.devices, first.cached, again.devices, again.cached) == (2, False, 2, True)
    assert again.predicted == first.predicted and again.line().endswith("; cached") and chosen == [1]
    assert warnings == []
    other = TrainOptions(planning=PlanOptions(cache_dir=str(tmp_path), ilp_time_limit=3.0))
    assert not forced_count.choose_cached(job, other, warnings.append).cached and chosen == [1, 1]
    assert forced_count.choice_key(job, options, 2) != forced_count.choice_key(job, options, 4)
    record = tmp_path / f"{forced_count.choice_key(job, options, host_cores())}.json"
    record.write_text('{"key": "x"}')
    assert not forced_count.choose_cached(job, options, warnings.append).cached and len(warnings) == 1
    assert not forced_count.choose_cached(job, TrainOptions(), warnings.append).cached  # no cache: always chosen
