"""What the runtime benchmarks share: an AlpaJob for local CPU devices, the planning
options they run with (a 5 s ILP time limit), and the search its ``spec.parallelism``
asks for (as ``alpajob run`` builds it).

The scripts run as ``python benchmarks/NAME.py``, so this module is imported by its
bare name.
"""

from __future__ import annotations

from typing import Any

from alpajob.api.options import PlanOptions

#: How the benchmarks plan: the manifest's own options, a 5 s ILP time limit, no baselines.
FAST_PLANNING = PlanOptions(ilp_time_limit=5.0)


def job_document(
    name: str,
    zoo: str,
    config: Any,
    parallelism: dict[str, Any],
    *,
    batch: int = 32,
    optimizer: str | None = None,
    nodes: int = 1,
) -> dict[str, Any]:
    """An AlpaJob document: ``zoo`` model ``config``, float32, on ``nodes`` CPU nodes
    that share 8 devices."""
    training: dict[str, Any] = {"globalBatchSize": batch, "dtype": "float32"}
    if optimizer is not None:
        training["optimizer"] = optimizer
    return {"apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": name},
            "spec": {"model": {"zoo": zoo, "config": config},
                     "training": training,
                     "cluster": {"gpu": "cpu", "nodes": nodes, "gpusPerNode": 8 // nodes},
                     "parallelism": parallelism}}


def job_plan_options(job: Any) -> Any:
    """The planner's search for ``job`` under :data:`FAST_PLANNING`."""
    from alpajob.planner.plan.make import search_options

    return search_options(job.spec.parallelism, FAST_PLANNING)
