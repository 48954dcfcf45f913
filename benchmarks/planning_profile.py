"""Where a plan search's time goes: one case searched in one process, split by phase.

The case is traced as ``benchmarks/alpa_plans.py`` traces it, then planned with the
worker pool off (every ILP in this process, so each phase can be timed), and the
search's seconds are split into: HiGHS (its LP relaxations, and the branch-and-bound
runs of the ILPs whose relaxation is fractional), building the ILPs' models, the
exact presolve, writing the presolved ILP as arrays, and reading each solution back
op by op. The rest is the DP, the candidates' bookkeeping and small per-solve work.
The same split, on two cores, is about half of each phase per worker.

::

    python benchmarks/planning_profile.py gpt-39b
    python benchmarks/planning_profile.py moe-70b --top 5
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (module, function, label) of every phase timed.
PHASES = (
    ("alpajob.planner.intra_op.model", "_build", "building models"),
    ("alpajob.planner.intra_op.ilp", "_presolve", "presolve"),
    ("alpajob.planner.intra_op.ilp", "_arrays", "presolved ILP as arrays"),
    ("alpajob.planner.intra_op.solve", "_realise", "reading solutions back"),
)


@contextlib.contextmanager
def replaced(owner: ModuleType | type, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def timed(seconds: defaultdict[str, float], calls: Counter[str], label: str,
          function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1
    return wrapper


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", help="a case of benchmarks/alpa_plans.py (gpt-39b, moe-70b, ...)")
    parser.add_argument("--top", type=int, default=3, help="the slowest HiGHS runs to list")
    args = parser.parse_args()

    import importlib

    import highspy
    from alpa_plans import (
        CASES,
        alpa_optimizer,
        cluster_from_preset,
        cluster_shape,
        graph_of,
        resolve_model,
    )

    from alpajob.planner.intra_op import milp
    from alpajob.planner.plan import workers
    from alpajob.planner.plan.make import SearchOptions, make_plan

    known = {c.name: c for c in CASES}
    if args.case not in known:
        print(f"case: {args.case!r} is not one of {', '.join(known)}", file=sys.stderr)
        return 2
    case = known[args.case]
    graph = graph_of(resolve_model(case.family, case.size, dtype=case.dtype), case.batch,
                     optimizer=alpa_optimizer(case))
    cluster = cluster_from_preset("v100-16gb", *cluster_shape(case.gpus))

    seconds: defaultdict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    runs: list[tuple[float, int, bool]] = []  # (seconds, columns, branch and bound)
    solve_highs, highs_run = milp._solve_highs, highspy.Highs.run
    phase: list[float] = []

    def run(highs: highspy.Highs) -> Any:
        start = time.perf_counter()
        try:
            return highs_run(highs)
        finally:
            phase.append(time.perf_counter() - start)

    def solve(arrays: milp.Milp, limit: float) -> Any:
        phase.clear()
        start = time.perf_counter()
        result = solve_highs(arrays, limit)
        runs.append((time.perf_counter() - start, arrays.num_columns, len(phase) > 1))
        seconds["HiGHS: LP relaxations"] += phase[0]
        seconds["HiGHS: branch and bound"] += sum(phase[1:])
        calls["HiGHS: LP relaxations"] += 1
        calls["HiGHS: branch and bound"] += len(phase) > 1
        return result

    with contextlib.ExitStack() as stack:
        for module_name, name, label in PHASES:
            module = importlib.import_module(module_name)
            stack.enter_context(replaced(module, name, timed(seconds, calls, label,
                                                             getattr(module, name))))
        stack.enter_context(replaced(milp, "_solve_highs", solve))
        stack.enter_context(replaced(highspy.Highs, "run", run))
        stack.enter_context(replaced(workers.os, "cpu_count", lambda: 1))  # no pool
        gc.freeze()  # as a search worker does (planner/plan/collection.py)
        gc.set_threshold(10_000)
        start = time.perf_counter()
        result = make_plan(graph, cluster, SearchOptions())
        total = time.perf_counter() - start
    plan = result.plan
    print(f"{case.name}: search in one process {total:.2f} s, {plan.solver.ilp_solves} ILPs, "
          f"micro-batch counts {plan.solver.micro_batch_candidates}, "
          f"plan {plan.content_hash()}")
    print("| phase | seconds | runs |\n| --- | --- | --- |")
    for label, value in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"| {label} | {value:.2f} | {calls[label]} |")
    print(f"| the rest | {total - sum(seconds.values()):.2f} | |")
    for took, columns, branched in sorted(runs, reverse=True)[:args.top]:
        kind = "branch and bound" if branched else "LP"
        print(f"slowest HiGHS run: {took:.2f} s, {columns} columns, {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
