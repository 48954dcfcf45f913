"""Mixed GPU pools: one job planned across two GPU types against each type alone.

For each case (model, two pools): trace the model once, plan it on each pool alone
(``make_plan``, the planner every single-type job gets) and across both pools
(``plan_pools``: each stage on a submesh of one pool, the DP's state counting the
devices used of each), and, as the planner would without types, on every GPU of both
pools taken as the slowest type's (its rate at the case's dtype, then its memory);
print each plan's predicted step time, its stages and the planning time. The mixed
plan is the one to rent both pools for only where it is strictly faster than every
pool alone.

    python benchmarks/mixed_pools.py [--case gpt-6.7b ...] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from alpajob.planner.cost.cluster import ClusterSpec, cluster_from_preset  # noqa: E402
from alpajob.planner.plan.make import SearchOptions, make_plan  # noqa: E402
from alpajob.planner.plan.pools import plan_pools  # noqa: E402
from alpajob.trainer_image.step import graph_of  # noqa: E402
from alpajob.trainer_image.zoo import resolve_model  # noqa: E402


@dataclass(frozen=True)
class Case:
    family: str
    size: str
    batch: int
    dtype: str
    pools: tuple[tuple[str, int], ...]  # (preset, GPUs), 8 per node

    @property
    def name(self) -> str:
        return f"{self.family}-{self.size}"


#: The cases RESULTS reports (batches as the Alpa paper's suites: BENCHMARKS.md).
CASES = [
    Case("gpt", "6.7b", 1024, "float16", (("h100-80gb", 8), ("a100-40gb", 16))),
    Case("gpt", "15b", 1024, "float16", (("a100-80gb", 16), ("v100-16gb", 16))),
    Case("moe", "10b", 1024, "float16", (("h100-80gb", 8), ("a100-40gb", 8))),
    Case("wresnet", "4b", 1536, "float32", (("h100-80gb", 8), ("a100-80gb", 8))),
    # V100s add nothing to A100s here (a sixth of their float32 rate): the pool is left out.
    Case("wresnet", "4b", 1536, "float32", (("a100-80gb", 8), ("v100-16gb", 16))),
]


def pool(preset: str, gpus: int) -> ClusterSpec:
    return cluster_from_preset(preset, max(1, gpus // 8), min(gpus, 8))


def label(cluster: ClusterSpec) -> str:
    return f"{cluster.num_devices} x {cluster.preset}"


def run(case: Case) -> list[tuple[str, float | None, str, float]]:
    """(option, step seconds or None, stages, planning seconds) rows of ``case``: each
    pool alone, every GPU as the slowest type's, both pools."""
    graph = graph_of(resolve_model(case.family, case.size, dtype=case.dtype), case.batch, optimizer="adam")
    clusters = [pool(preset, gpus) for preset, gpus in case.pools]
    rows: list[tuple[str, float | None, str, float]] = []
    slowest = min(clusters, key=lambda c: (c.device.peak_flops[case.dtype], c.device.memory_bytes))
    clusters.append(pool(slowest.preset, sum(gpus for _, gpus in case.pools)))  # every GPU as the slowest
    for cluster in clusters:
        began = time.perf_counter()
        try:
            plan = make_plan(graph, cluster, SearchOptions()).plan
        except Exception as error:  # noqa: BLE001 - a pool the model does not fit is a row
            rows.append((label(cluster), None, str(error).split(";")[0], time.perf_counter() - began))
            continue
        stages = ", ".join(f"L{s.layers[0]}-{s.layers[1] - 1}@{s.submesh_shape[0]}x{s.submesh_shape[1]}"
                            for s in plan.stages)
        rows.append((label(cluster), plan.predicted_step_seconds,
                     f"B={plan.num_micro_batches}: {stages}", time.perf_counter() - began))
    rows[-1] = (f"{rows[-1][0]} (all as {slowest.preset})", *rows[-1][1:])
    clusters.pop()
    mixed = plan_pools(graph, clusters, SearchOptions())
    candidate = mixed.candidate
    stages = ", ".join(f"L{s.first}-{s.last}@{s.submesh[0]}x{s.submesh[1]} {clusters[p].preset}"
                        for p, s in zip(candidate.pools, candidate.stages, strict=True))
    rows.append((" + ".join(label(c) for c in clusters), candidate.step_seconds,
                 f"B={candidate.num_micro_batches}: {stages}", mixed.plan.solver.planning_seconds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="*", help=("case names (default: all), e.g. gpt-6.7b, or one case "
                                                   "with its pools: wresnet-4b:h100-80gb+a100-80gb"))
    parser.add_argument("--markdown", help="also write the table to FILE")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.case or c.name in args.case
             or f"{c.name}:{'+'.join(p for p, _ in c.pools)}" in args.case]
    lines = ["| case | option | step (s) | vs best single type | vs all as slowest | plan | planning (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for case in cases:
        rows = run(case)
        singles = [step for _, step, _, _ in rows[:-2] if step is not None]
        best_single = min(singles) if singles else None
        homogeneous = rows[-2][1]
        for option, step, stages, seconds in rows:
            ratio = f"{best_single / step:.2f}x" if step and best_single else "-"
            versus = f"{homogeneous / step:.2f}x" if step and homogeneous else "-"
            shown = f"{step:.3f}" if step is not None else "does not fit"
            lines.append(f"| {case.name} | {option} | {shown} | {ratio} | {versus} | {stages} | {seconds:.1f} |")
            print(lines[-1], flush=True)
    footer = (f"\nMachine: {platform.machine()} {os.cpu_count()} cores; "
              f"{time.strftime('%Y-%m-%d')}; predicted step times (the planner's cost model)")
    print(footer)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write("\n".join(lines) + "\n" + footer + "\n")


if __name__ == "__main__":
    main()
