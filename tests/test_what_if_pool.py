"""What-if options planned side by side (trainer_image/what_if_pool.py): the rows of
options planned in worker processes are those planned one by one, options of one GPU
type follow one another, and an option's error ends the what-if with that line."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

import alpajob
from alpajob.api.errors import ManifestError
from alpajob.api.options import PlanOptions
from alpajob.api.what_if import parse_options
from alpajob.trainer_image import what_if as what_if_module
from alpajob.trainer_image.what_if import what_if
from alpajob.trainer_image.what_if_pool import next_option

JOB = Path(__file__).resolve().parent.parent / "manifests" / "examples" / "local-gpt.yaml"


def test_a_free_worker_takes_the_first_option_of_a_type_not_being_planned() -> None:
    types = {0: {"v100"}, 1: {"v100"}, 2: {"a100"}, 3: {"a100"}, 4: {"h100", "a100"}}.__getitem__
    assert next_option([1, 2, 3, 4], [0], types) == 2  # 1 waits for 0's solutions
    assert next_option([3, 4], [1], types) == 3
    assert next_option([4], [3], types) == 4  # every type left is running: no core idles
    assert next_option([1, 3], [0, 2], types) == 1


def test_options_side_by_side_are_the_options_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five options (two types and a mix of both) in two worker
    processes: the same plans, figures and order as one after another."""
    job = alpajob.load(JOB)
    choices = parse_options(["v100-16gb:8,16", "a100-40gb:1,2", "a100-40gb:1+v100-16gb:8"])
    pools: list[int] = []
    real = what_if_module.side_by_side

    def spied(*args, **kwargs):
        pools.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(what_if_module, "side_by_side", spied)
    started: list[str] = []
    apart = what_if(job, PlanOptions(), choices, workers=2, progress=lambda c, done, total: started.append(c.label))
    assert pools == [2] and sorted(started) == sorted(c.label for c in choices)
    alone = what_if(job, PlanOptions(), choices, workers=1)
    assert pools == [2]  # one worker: one option after another, in this process
    assert [(r.option, r.fits, r.plan_hash, r.step_seconds, r.peak_memory_bytes) for r in apart] == [
        (r.option, r.fits, r.plan_hash, r.step_seconds, r.peak_memory_bytes) for r in alone]
    assert all(r.fits for r in apart)
    assert not multiprocessing.active_children()  # the workers are gone


def test_an_options_error_ends_the_what_if_with_its_line() -> None:
    with pytest.raises(ManifestError, match="spec.parallelism.stages"):
        alpajob.what_if(JOB, ["v100-16gb:8", "a100-40gb:2"], options=PlanOptions(method="manual"))
    assert not multiprocessing.active_children()


def test_the_cached_options_are_read_here_and_only_the_rest_are_planned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun reads what the plan cache holds in this process, a mix too: two options
    planned side by side, then those two and a third read two from the cache and plan
    the one left without a worker pool; a third run starts no pool and plans nothing."""
    job = alpajob.load(JOB)
    options = PlanOptions(cache_dir=str(tmp_path / "cache"))
    choices = parse_options(["v100-16gb:8", "a100-40gb:1+v100-16gb:8", "a100-40gb:2"])
    pools: list[int] = []
    real = what_if_module.side_by_side

    def spied(*args, **kwargs):
        pools.append(len(args[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(what_if_module, "side_by_side", spied)
    first = what_if(job, options, choices[:2], workers=2)
    assert pools == [2] and [r.cached for r in first] == [False, False]
    started: list[tuple[str, int]] = []
    second = what_if(job, options, choices, workers=2,
                     progress=lambda c, done, total: started.append((c.label, done)))
    assert pools == [2] and started == [(choices[2].label, 2)]  # one left: planned here
    assert [r.cached for r in second] == [True, True, False]
    assert [r.plan_hash for r in second[:2]] == [r.plan_hash for r in first]
    third = what_if(job, options, choices, workers=2)
    assert pools == [2] and all(r.cached for r in third)
    assert [(r.plan_hash, r.step_seconds) for r in third] == [(r.plan_hash, r.step_seconds) for r in second]
    assert not multiprocessing.active_children()
