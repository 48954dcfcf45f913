"""Benchmark: Alpa's published plans against ours, under one cost model.

Alpa's benchmark suites (alpa-projects/alpa, ``benchmark/alpa/suite_auto_gpt.py``,
``suite_auto_moe.py``, ``suite_wresnet.py``: ``perf_test_suite`` /
``perf_test_auto_suite``, "search solutions found for p3.16xlarge") publish the plan
Alpa's search found for each weak-scaling case: the micro-batch count, the layer
count, each stage's layers, physical submesh and logical mesh. Each is posed here as
a manual plan (``method: manual``) on the same cluster of V100-16GB nodes (8 per
node) and costed by our model; our automatic plan is costed by the same model. A
ratio above 1 means Alpa's plan is slower than ours under our costs; "does not fit"
means our memory model says it needs more than a V100 has (the message names the
stage). Planning time is our auto plan's (tracing included).

Each family is traced with the optimizer Alpa's benchmark scripts train it with
(``benchmark_3d_one_case_{gpt_bert,moe,wresnet}.py``), since the optimizer's state
is much of a stage's memory: GPT with AdamW and MoE with Adafactor (factored second
moments, no first moment), both in float16 over a float32 master copy of the weights
(Alpa's ``TrainState`` with mixed precision: the optimizer updates the master copy,
and the float16 weights are cast from it); Wide-ResNet in float32 with SGD and
Nesterov momentum 0.9. ``--optimizer adam`` traces every case with our Adam instead
(float32 moments, no master copy), as this table did before.

    python benchmarks/alpa_plans.py                 # every case
    python benchmarks/alpa_plans.py --cases gpt-39b --markdown table.md   # then put it in its RESULTS.md section
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from plan_quality import cluster_shape  # noqa: E402  (benchmarks/ is on sys.path when run)

from alpajob.api.errors import InfeasibleError  # noqa: E402
from alpajob.api.spec import Method, Schedule  # noqa: E402
from alpajob.planner.cost.cluster import cluster_from_preset  # noqa: E402
from alpajob.planner.plan.make import ManualStageOption, SearchOptions, make_plan  # noqa: E402
from alpajob.trainer_image.step import graph_of  # noqa: E402
from alpajob.trainer_image.zoo import resolve_model  # noqa: E402

Stage = tuple[int, int, tuple[int, int], tuple[int, int]]  # [first, end), submesh, logical


@dataclass(frozen=True)
class AlpaCase:
    """One published plan: model, GPUs, global batch, dtype, micro-batches, layers,
    stages; ``measured``: Alpa's measured seconds per step where the paper gives it."""

    family: str
    size: str
    gpus: int
    batch: int
    dtype: str
    micro_batches: int
    layers: int
    stages: tuple[Stage, ...]
    measured: float | None = None

    @property
    def name(self) -> str:
        return f"{self.family}-{self.size}"


def _even(layers: int, per_stage: int, submesh: tuple[int, int],
          logical: tuple[int, int]) -> tuple[Stage, ...]:
    return tuple((i, i + per_stage, submesh, logical) for i in range(0, layers, per_stage))


CASES = [
    AlpaCase("gpt", "1.3b", 4, 1024, "float16", 128, 6, ((0, 3, (1, 2), (2, 1)),
                                                        (3, 6, (1, 2), (2, 1)))),
    AlpaCase("gpt", "2.6b", 8, 1024, "float16", 128, 8, ((0, 2, (1, 2), (2, 1)),
                                                        (2, 4, (1, 2), (2, 1)),
                                                        (4, 8, (1, 4), (4, 1)))),
    AlpaCase("gpt", "6.7b", 16, 1024, "float16", 64, 8, _even(8, 4, (1, 8), (2, 4))),
    AlpaCase("gpt", "15b", 32, 1024, "float16", 128, 16, _even(16, 4, (1, 8), (2, 4))),
    AlpaCase("gpt", "39b", 64, 1024, "float16", 1024, 16, _even(16, 1, (1, 4), (1, 4)),
             measured=91.5),
    AlpaCase("moe", "380m", 1, 1024, "float16", 512, 1, ((0, 1, (1, 1), (1, 1)),)),
    AlpaCase("moe", "690m", 2, 1024, "float16", 32, 8, ((0, 8, (1, 2), (2, 1)),)),
    AlpaCase("moe", "1.3b", 4, 1024, "float16", 32, 8, _even(8, 4, (1, 2), (2, 1))),
    AlpaCase("moe", "2.4b", 8, 1024, "float16", 32, 8, _even(8, 4, (1, 4), (4, 1))),
    AlpaCase("moe", "10b", 16, 1024, "float16", 16, 8, _even(8, 4, (1, 8), (8, 1))),
    AlpaCase("moe", "27b", 32, 1024, "float16", 128, 8, _even(8, 1, (1, 4), (4, 1))),
    AlpaCase("moe", "70b", 64, 1024, "float16", 64, 8, _even(8, 1, (1, 8), (8, 1))),
    AlpaCase("wresnet", "250m", 1, 1536, "float32", 24, 16, ((0, 16, (1, 1), (1, 1)),)),
    AlpaCase("wresnet", "500m", 2, 1536, "float32", 24, 16, ((0, 16, (1, 2), (1, 2)),)),
    AlpaCase("wresnet", "1b", 4, 1536, "float32", 24, 16, ((0, 16, (1, 4), (1, 4)),)),
    AlpaCase("wresnet", "2b", 8, 1536, "float32", 24, 16, ((0, 8, (1, 4), (4, 1)),
                                                           (8, 16, (1, 4), (1, 4)))),
    AlpaCase("wresnet", "4b", 16, 1536, "float32", 32, 16, ((0, 5, (1, 4), (4, 1)),
                                                            (5, 9, (1, 4), (4, 1)),
                                                            (9, 16, (1, 8), (8, 1)))),
    AlpaCase("wresnet", "6.8b", 32, 1536, "float32", 32, 16, (
        (0, 5, (1, 8), (8, 1)), (5, 9, (1, 8), (8, 1)), (9, 13, (1, 8), (8, 1)),
        (13, 16, (1, 8), (8, 1)))),
    AlpaCase("wresnet", "13b", 64, 1520, "float32", 38, 33, tuple(
        (first, end, (1, 8), logical) for (first, end), logical in zip(
            [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24), (24, 29), (29, 33)],
            [(8, 1), (1, 8), (8, 1), (1, 8), (8, 1), (8, 1), (1, 8), (8, 1)], strict=True))),
]


def with_master_copy(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` run as Alpa's mixed-precision ``TrainState`` runs it: its state and
    its update are over a float32 copy of the (float16) weights, which the step keeps
    and casts the new weights from."""

    def init(params):
        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return master, inner.init(master)

    def update(grads, state, params):
        master, inner_state = state
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, inner_state = inner.update(grads, inner_state, master)
        master = optax.apply_updates(master, updates)
        return (jax.tree.map(lambda m, p: m.astype(p.dtype) - p, master, params),
                (master, inner_state))

    return optax.GradientTransformation(init, update)


def alpa_optimizer(case: AlpaCase) -> optax.GradientTransformation:
    """The optimizer Alpa's benchmark trains ``case``'s family with (module docstring)."""
    if case.family == "wresnet":
        return optax.sgd(0.1, momentum=0.9, nesterov=True)
    inner = optax.adafactor(1e-2) if case.family == "moe" else optax.adamw(1e-2)
    return with_master_copy(inner) if case.dtype == "float16" else inner


def run_case(case: AlpaCase, preset: str, optimizer: str = "alpa") -> dict:
    model = resolve_model(case.family, case.size, dtype=case.dtype)
    start = time.perf_counter()
    graph = graph_of(model, case.batch,
                     optimizer=alpa_optimizer(case) if optimizer == "alpa" else optimizer)
    extract = time.perf_counter() - start
    cluster = cluster_from_preset(preset, *cluster_shape(case.gpus))
    ours = make_plan(graph, cluster, SearchOptions(), extract_seconds=extract).plan
    manual = SearchOptions(
        method=Method.MANUAL, schedule=Schedule.ONE_F_ONE_B, num_layers=case.layers,
        num_micro_batches=case.micro_batches,
        manual_stages=tuple(ManualStageOption(f, e, s, lg) for f, e, s, lg in case.stages))
    try:
        alpa: float | str = make_plan(graph, cluster, manual).plan.predicted_step_seconds
    except InfeasibleError as error:
        alpa = f"does not fit: {error}"
    return {"case": case.name, "gpus": case.gpus, "preset": preset,
            "planning_s": ours.solver.planning_seconds + extract,
            "ours_s": ours.predicted_step_seconds, "ours_b": ours.num_micro_batches,
            "ours_stages": len(ours.stages), "alpa_s": alpa, "alpa_b": case.micro_batches,
            "alpa_stages": len(case.stages), "measured": case.measured}


def markdown(rows: list[dict]) -> str:
    lines = ["| case | GPUs | ours: stages, B | ours (s) | Alpa's plan: stages, B | Alpa's plan, "
             "our costs (s) | Alpa's / ours | Alpa measured (s) | planning (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        alpa, ours = r["alpa_s"], r["ours_s"]
        fits = isinstance(alpa, float)
        lines.append(
            f"| {r['case']} | {r['gpus']} | {r['ours_stages']}, {r['ours_b']} | {r['ours_s']:.4g} "
            f"| {r['alpa_stages']}, {r['alpa_b']} | {f'{alpa:.4g}' if fits else 'does not fit'} "
            f"| {f'{alpa / ours:.2f}x' if fits else '-'} "
            f"| {r['measured'] if r['measured'] else '-'} | {r['planning_s']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="v100-16gb")
    parser.add_argument("--cases", nargs="*", help="only these cases, e.g. gpt-39b wresnet-13b")
    parser.add_argument("--markdown", help="append the Markdown table to this file")
    parser.add_argument("--optimizer", choices=("alpa", "adam"), default="alpa",
                        help="trace with Alpa's optimizer per family (default) or our Adam")
    args = parser.parse_args()
    rows = []
    for case in CASES:
        if args.cases and case.name not in args.cases:
            continue
        row = run_case(case, args.gpu, args.optimizer)
        rows.append(row)
        alpa = row["alpa_s"]
        print(f"{row['case']:>14} {row['gpus']:>3}  ours {row['ours_s']:.4g} s "
              f"({row['ours_stages']} stages, B={row['ours_b']}, planned in {row['planning_s']:.1f} s)"
              f"  Alpa's plan {alpa if isinstance(alpa, str) else f'{alpa:.4g} s'}", flush=True)
    table = markdown(rows)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as handle:
            handle.write(f"\nMachine: {platform.node()} ({os.cpu_count()} cores), python "
                         f"{sys.version.split()[0]}, preset {args.gpu}, optimizer "
                         f"{args.optimizer}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
