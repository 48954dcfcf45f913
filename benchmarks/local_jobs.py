"""What the runtime benchmarks share: an AlpaJob for local CPU devices, and the
plan options its ``spec.parallelism`` asks for (as ``alpajob run`` would build them).

The scripts run as ``python benchmarks/NAME.py``, so this module is imported by its
bare name.
"""

from __future__ import annotations

import argparse
from typing import Any


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


def job_plan_options(manifest: Any) -> Any:
    """The manifest's own plan options, with a 5 s ILP time limit and no baselines."""
    from alpajob.cli import plan_options

    return plan_options(manifest, argparse.Namespace(ilp_time_limit=5.0))
