"""What the runtime benchmarks share: an AlpaJob for local CPU devices, the planning
options they run with (a 5 s ILP time limit), and the search its ``spec.parallelism``
asks for (as ``alpajob run`` builds it).

The scripts run as ``python benchmarks/NAME.py``, so this module is imported by its
bare name.
"""

from __future__ import annotations

from typing import Any

from alpajob.trainer_image.calibration.overheads import PLANNING, local_job_document

#: How the benchmarks plan: the manifest's own options, a 5 s ILP time limit, no
#: baselines (as the calibration's training runs do). ``job_document``: an AlpaJob
#: document on CPU nodes that share 8 devices.
FAST_PLANNING = PLANNING
job_document = local_job_document


def job_plan_options(job: Any) -> Any:
    """The planner's search for ``job`` under :data:`FAST_PLANNING`."""
    from alpajob.planner.plan.make import search_options

    return search_options(job.spec.parallelism, FAST_PLANNING)


def paired_cells(pairs: list[tuple[float, float]]) -> str:
    """Table cells of alternating step pairs ``(baseline s, ours s)``: each side's median
    in ms, and the median of the pairs' baseline / ours ratio with its quartiles."""
    import statistics

    first = statistics.median(x[0] for x in pairs)
    second = statistics.median(x[1] for x in pairs)
    ratios = sorted(x[0] / x[1] for x in pairs)
    quartiles = statistics.quantiles(ratios, n=4)
    return (f"{first * 1e3:.1f} | {second * 1e3:.1f} | {statistics.median(ratios):.2f}x "
            f"({quartiles[0]:.2f}-{quartiles[2]:.2f})")
