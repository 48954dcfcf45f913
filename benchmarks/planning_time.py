"""Planning latency: a cold plan, from the process's start to the written plan, per job.

Each case is planned by a fresh process, as a user's first plan is: ``alpajob plan
MANIFEST --no-plan-cache --output FILE`` for the CPU jobs, and for the V100 cases the
same trace-and-plan in a small script (Alpa's optimizer per family, as
``benchmarks/alpa_plans.py`` traces them), timed from the process's start to its exit.
The Plan document's statistics split the wall time: tracing the model into its op
graph (``extract_seconds``), the search (``planning_seconds``: clustering, the ILPs in
the worker pool, the inter-op DP), and the rest (interpreter start, imports, reading
the manifest, the forced-device line, printing). ``ilp_seconds`` is the ILPs' CPU time
summed over the workers, so it exceeds the search's wall time on several cores.

The cases are the planning-latency targets: GPT-tiny and the README job on 8 forced
CPU devices, GPT-2.6B on 1 x 8 V100-16GB, GPT-39B and MoE-70B on 8 x 8 (batch 1024,
float16).

``--before DIR`` also times a checkout of another commit (``git worktree add DIR
COMMIT``), the two alternating per case, so both see the same machine; where that
commit pinned other dependencies, ``--before-python`` names an interpreter of a
virtual environment made from its lock files::

    python benchmarks/planning_time.py --repeat 3 --markdown table.md
    python benchmarks/planning_time.py --cases gpt-tiny --before /tmp/before
    python benchmarks/planning_time.py --before /tmp/before --before-python /tmp/venv-before/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "manifests" / "examples"

#: case -> (an example manifest, or ``alpa:NAME``: that case of alpa_plans.py; target s)
CASES: dict[str, tuple[str, float]] = {
    "gpt-tiny": ("local-gpt.yaml", 3.0),
    "readme-job": ("text-gpt.yaml", 5.0),
    "gpt-2.6b-8xv100": ("alpa:gpt-2.6b", 10.0),
    "gpt-39b-64xv100": ("alpa:gpt-39b", 10.0),
    "moe-70b-64xv100": ("alpa:moe-70b", 40.0),
}

#: Plans one case of ``benchmarks/alpa_plans.py`` (Alpa's optimizer per family: MoE's
#: Adafactor is what lets MoE-70B fit 64 V100s) in a fresh process, and writes the
#: Plan document to argv[2].
ALPA_CASE = """
import sys, time
sys.path.insert(0, "benchmarks")
from alpa_plans import CASES, alpa_optimizer, cluster_shape, cluster_from_preset, graph_of, resolve_model
from alpajob.api.plan import write_plan
from alpajob.planner.plan.make import SearchOptions, make_plan
case = next(c for c in CASES if c.name == sys.argv[1])
start = time.perf_counter()
graph = graph_of(resolve_model(case.family, case.size, dtype=case.dtype), case.batch,
                 optimizer=alpa_optimizer(case))
cluster = cluster_from_preset("v100-16gb", *cluster_shape(case.gpus))
plan = make_plan(graph, cluster, SearchOptions(), extract_seconds=time.perf_counter() - start).plan
write_plan(plan, sys.argv[2])
"""


@dataclass(frozen=True)
class Timing:
    """One cold `alpajob plan`: wall seconds and the Plan's own split of them."""

    wall: float
    extract: float
    search: float
    ilp_cpu: float
    ilps: int
    dp: float
    plan: str

    @property
    def rest(self) -> float:
        return self.wall - self.extract - self.search


def plan_once(repo: Path, case: str, folder: Path, python: str = sys.executable) -> Timing:
    """Time one cold plan of ``case`` with the code in ``repo``, run by ``python``."""
    what, _ = CASES[case]
    out = folder / "plan.json"
    if what.startswith("alpa:"):
        command = [python, "-c", ALPA_CASE, what.removeprefix("alpa:"), str(out)]
    else:
        command = [python, "-m", "alpajob", "plan", str(EXAMPLES / what), "--no-plan-cache",
                   "--output", str(out)]
    env = dict(os.environ, PYTHONPATH=str(repo), XDG_CACHE_HOME=str(folder / "cache"))
    start = time.perf_counter()
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{case} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    plan = json.loads(out.read_text())
    stats = plan["solver"]
    stages = plan["stages"]
    return Timing(wall, stats.get("extract_seconds", 0.0), stats["planning_seconds"], stats["ilp_seconds"],
                  stats["ilp_solves"], stats["dp_seconds"],
                  f"{len(stages)} stage{'s' if len(stages) != 1 else ''}, B={plan['num_micro_batches']}, "
                  f"hash {plan['hash']}")


def median_timing(runs: list[Timing]) -> Timing:
    middle = sorted(runs, key=lambda t: t.wall)[len(runs) // 2]
    return Timing(statistics.median(t.wall for t in runs), statistics.median(t.extract for t in runs),
                  statistics.median(t.search for t in runs), statistics.median(t.ilp_cpu for t in runs),
                  middle.ilps, statistics.median(t.dp for t in runs), middle.plan)


def row(case: str, label: str, timing: Timing) -> str:
    target = CASES[case][1]
    verdict = "met" if timing.wall < target else f"{timing.wall / target:.2f}x over"
    return (f"| {case} | {label} | {timing.wall:.2f} | {timing.rest:.2f} | {timing.extract:.2f} | "
            f"{timing.search:.2f} | {timing.ilps} ({timing.ilp_cpu:.1f} CPU s) | {timing.dp:.2f} | "
            f"{timing.plan} | < {target:g}: {verdict} |")


HEADER = ("| case | code | wall (s) | start, imports, output (s) | tracing (s) | search (s) | "
          "ILPs | DP (s) | plan | target |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeat", type=int, default=1, help="cold plans per case (median reported)")
    parser.add_argument("--before", type=Path, help="also time this checkout of another commit")
    parser.add_argument("--before-python", default=sys.executable,
                        help="the interpreter that runs --before (default: this one)")
    parser.add_argument("--markdown", help="append the Markdown table to this file")
    args = parser.parse_args()
    repos = [("this checkout", ROOT, sys.executable)]
    if args.before:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.before,
                              capture_output=True, text=True, check=True).stdout.strip()
        repos.insert(0, (f"before ({head})", args.before.resolve(), args.before_python))
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
             f"{time.strftime('%Y-%m-%d')}; median of {args.repeat} cold `alpajob plan` per case.", "", HEADER]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for case in args.cases:
            runs: dict[str, list[Timing]] = {label: [] for label, _, _ in repos}
            for _ in range(args.repeat):  # alternating, so both see the same machine
                for label, repo, python in repos:
                    runs[label].append(plan_once(repo, case, folder, python))
            for label, _, _ in repos:
                lines.append(row(case, label, median_timing(runs[label])))
                print(lines[-1], flush=True)
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
