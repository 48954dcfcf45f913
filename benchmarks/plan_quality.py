"""Benchmark 1: plan quality and planning time on the Alpa paper's weak-scaling suites.

For each case (model, GPU count) on each device preset: trace the model, plan it, cost
every baseline with the same model, and print planning wall time, our predicted step
time and PFLOP/s, each baseline's, our speed-up over the best baseline, and the plan in
one line. Writes a Markdown table with ``--markdown FILE``.

    python benchmarks/plan_quality.py --suite gpt --gpu v100-16gb h100-80gb
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from alpajob.planner.cost.cluster import cluster_from_preset  # noqa: E402
from alpajob.planner.plan.baselines import Baseline  # noqa: E402
from alpajob.planner.plan.make import SearchOptions, make_plan  # noqa: E402
from alpajob.trainer_image.step import graph_of  # noqa: E402
from alpajob.trainer_image.zoo import resolve_model  # noqa: E402

#: (family, size, GPUs, global batch, dtype): BENCHMARKS.md section 1.
SUITES = {
    "gpt": [("gpt", s, g, 1024, "float16") for s, g in
            [("350m", 1), ("1.3b", 4), ("2.6b", 8), ("6.7b", 16), ("15b", 32), ("39b", 64)]],
    "moe": [("moe", s, g, 1024, "float16") for s, g in
            [("380m", 1), ("690m", 2), ("1.3b", 4), ("2.4b", 8), ("10b", 16), ("27b", 32),
             ("70b", 64)]],
    "wresnet": [("wresnet", s, g, 1536, "float32") for s, g in
                [("250m", 1), ("500m", 2), ("1b", 4), ("2b", 8), ("4b", 16), ("6.8b", 32),
                 ("13b", 64)]],
}


def cluster_shape(gpus: int) -> tuple[int, int]:
    """GPUs -> (nodes, GPUs per node) with 8 GPUs per node."""
    return (1, gpus) if gpus <= 8 else (gpus // 8, 8)


def one_line(plan) -> str:
    stages = " | ".join(
        f"L{s.layers[0]}-{s.layers[1]}@{s.submesh_shape[0]}x{s.submesh_shape[1]}"
        f"({s.logical_mesh_shape[0]}x{s.logical_mesh_shape[1]})"
        for s in plan.stages
    )
    return f"{len(plan.stages)} stage(s), B={plan.num_micro_batches}: {stages}"


def run_case(family: str, size: str, gpus: int, batch: int, dtype: str, preset: str) -> dict:
    model = resolve_model(family, size, dtype=dtype)
    start = time.perf_counter()
    graph = graph_of(model, batch, optimizer="adam")
    extract = time.perf_counter() - start
    nodes, per_node = cluster_shape(gpus)
    cluster = cluster_from_preset(preset, nodes, per_node)
    result = make_plan(graph, cluster, SearchOptions(baselines=True), extract_seconds=extract)
    plan = result.plan
    # Planning time is the planner's own search plus tracing; costing the baselines
    # (which reuses the planner's ILP cache) is not counted.
    planning = plan.solver.planning_seconds + extract
    base = dict(plan.baselines or {})
    fitting = [v for v in base.values() if v is not None]
    return {
        "case": f"{family}-{size}",
        "gpus": gpus,
        "preset": preset,
        "planning_s": planning,
        "extract_s": extract,
        "ours_s": plan.predicted_step_seconds,
        "ours_pflops": plan.predicted_pflops,
        "baselines": base,
        "vs_best": (min(fitting) / plan.predicted_step_seconds) if fitting else None,
        "vs_dp": (base[Baseline.DATA.value] / plan.predicted_step_seconds)
        if base[Baseline.DATA.value] else None,
        "vs_zero2": (base[Baseline.ZERO2.value] / plan.predicted_step_seconds)
        if base[Baseline.ZERO2.value] else None,
        "vs_expert": _ratio(base.get(Baseline.EXPERT_ZERO2.value, "n/a"),
                            plan.predicted_step_seconds),
        "plan": one_line(plan),
        "ilps": plan.solver.ilp_solves,
        "winner": plan.solver.winner,
    }


def _ratio(baseline: float | str | None, ours: float) -> float | str | None:
    """Baseline ÷ ours; None (OOM) and "n/a" (does not apply) pass through."""
    return baseline / ours if isinstance(baseline, float) else baseline


def fmt(value: float | str | None, unit: str = "") -> str:
    if value is None:
        return "OOM"
    if isinstance(value, str):
        return value
    return f"{value:.3g}{unit}"


def markdown(rows: list[dict]) -> str:
    names = [b.value for b in Baseline]
    head = ("| case | GPUs | GPU | plan time (s) | ours (s) | PFLOP/s | "
            + " | ".join(names) + " | best baseline / ours | plan |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        base = " | ".join(fmt(r["baselines"].get(n, "n/a")) for n in names)
        lines.append(
            f"| {r['case']} | {r['gpus']} | {r['preset']} | {r['planning_s']:.1f} | "
            f"{r['ours_s']:.4g} | {r['ours_pflops']:.3f} | {base} | "
            f"{fmt(r['vs_best'], 'x')} | {r['winner']}: {r['plan']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", nargs="+", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--gpu", nargs="+", default=["v100-16gb", "h100-80gb"])
    parser.add_argument("--max-gpus", type=int, default=64)
    parser.add_argument("--cases", nargs="*", help="only these cases, e.g. gpt-39b")
    parser.add_argument("--markdown", help="append the Markdown table to this file")
    args = parser.parse_args()
    rows = []
    for preset in args.gpu:
        for suite in args.suite:
            for family, size, gpus, batch, dtype in SUITES[suite]:
                if gpus > args.max_gpus or (args.cases and f"{family}-{size}" not in args.cases):
                    continue
                row = run_case(family, size, gpus, batch, dtype, preset)
                rows.append(row)
                print(f"{row['case']:>14} {gpus:>3} {preset:>10}  plan {row['planning_s']:6.1f} s"
                      f"  ours {row['ours_s']:.4g} s  best-baseline/ours "
                      f"{fmt(row['vs_best'], 'x'):>6}  dp/ours {fmt(row['vs_dp'], 'x'):>6}"
                      f"  zero2/ours {fmt(row['vs_zero2'], 'x'):>6}"
                      f"  zero2-expert/ours {fmt(row['vs_expert'], 'x'):>6}  {row['winner']}: {row['plan']}",
                      flush=True)
    table = markdown(rows)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as handle:
            handle.write(f"\nMachine: {platform.node()} ({os.cpu_count()} cores), "
                         f"python {sys.version.split()[0]}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
