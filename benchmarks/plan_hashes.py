"""The plan every zoo case gets, as one hash each: a faster planner must find the same plans.

A Plan's content hash (:meth:`~alpajob.api.plan.Plan.content_hash`) covers every
stage, mesh, micro-batch count and tensor spec, and none of the solver's statistics,
so a change that only makes planning faster leaves every hash as it was.
``tests/data/plan_hashes.json`` holds each case's hash, with its predicted step time
and each stage's peak memory (where two shardings of an ILP tie, the hash may move
while those do not: the test then names the stage whose specs differ). Cases:

- ``cpu:NAME``: a zoo configuration on 8 CPU devices (``gpu: cpu``), batch 32, planned
  as ``alpajob plan`` plans a manifest; ``manifest:FILE``: an example manifest. These
  are the quick cases (seconds each), checked by the default test suite.
- ``alpa:NAME``: each case of ``benchmarks/alpa_plans.py`` (Alpa's weak-scaling suites
  on V100s, with the optimizer Alpa trained each family with), the slow set.

Refresh the file only when a plan is meant to change::

    python benchmarks/plan_hashes.py --write tests/data/plan_hashes.json          # every case
    python benchmarks/plan_hashes.py --cases cpu:gpt-tiny alpa:gpt-1.3b             # print them
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

#: The quick cases: the zoo's small configurations on 8 CPU devices, and the example
#: manifests the README and quick start plan.
QUICK = ("cpu:gpt-tiny", "cpu:moe-tiny", "cpu:wresnet-tiny", "cpu:mlp-tiny",
         "manifest:local-gpt.yaml", "manifest:text-gpt.yaml")


def all_cases() -> list[str]:
    """Every case: the quick ones, then one per case of ``alpa_plans.py``."""
    from alpa_plans import CASES

    return [*QUICK, *(f"alpa:{case.name}" for case in CASES)]


def _cpu_job(name: str) -> object:
    from alpajob.api.resource import parse_job

    family, _, config = name.partition("-")
    return parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": name},
        "spec": {"model": {"zoo": family, "config": config},
                 "training": {"globalBatchSize": 32, "steps": 10, "dtype": "float32"},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8}},
    })


def plan_of(case: str):  # -> alpajob.api.plan.Plan
    """Plan ``case`` (see the module docstring) with the code on ``sys.path``."""
    kind, _, name = case.partition(":")
    if kind in ("cpu", "manifest"):
        from alpajob.api.resource import load_job
        from alpajob.trainer_image.planning import plan_job

        job = _cpu_job(name) if kind == "cpu" else load_job(ROOT / "manifests" / "examples" / name)
        return plan_job(job).plan
    if kind == "alpa":
        from alpa_plans import CASES, alpa_optimizer, cluster_from_preset, cluster_shape

        from alpajob.planner.plan.make import SearchOptions, make_plan
        from alpajob.trainer_image.step import graph_of
        from alpajob.trainer_image.zoo import resolve_model

        chosen = next(c for c in CASES if c.name == name)
        graph = graph_of(resolve_model(chosen.family, chosen.size, dtype=chosen.dtype), chosen.batch,
                         optimizer=alpa_optimizer(chosen))
        cluster = cluster_from_preset("v100-16gb", *cluster_shape(chosen.gpus))
        return make_plan(graph, cluster, SearchOptions()).plan
    raise SystemExit(f"unknown case {case!r}: cpu:NAME, manifest:FILE or alpa:NAME")


def record(case: str) -> dict:
    """The hash, predicted step time and per-stage peak memory of ``case``'s plan."""
    plan = plan_of(case)
    return {"hash": plan.content_hash(), "step_seconds": plan.predicted_step_seconds,
            "stage_peak_bytes": [s.peak_memory_bytes for s in plan.stages]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", help="these cases (default: every one)")
    parser.add_argument("--write", type=Path, help="write the records to this JSON file")
    args = parser.parse_args()
    cases = args.cases or all_cases()
    records = {}
    for case in cases:
        records[case] = record(case)
        print(f"{case}: {records[case]['hash']} ({records[case]['step_seconds']:.6g} s per step)",
              flush=True)
    if args.write:
        args.write.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
