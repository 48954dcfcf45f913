"""AlpaJob: Alpa's automatic inter- and intra-operator parallelism on stock JAX, as a
Kubernetes-native job.

The Python API, for notebooks, scripts and benchmarks (the CLI runs the same code)::

    import alpajob

    job = alpajob.load("manifests/examples/local-gpt.yaml")
    plan = alpajob.plan(job, gpus_per_node=4)            # a Plan document
    rows = alpajob.what_if(job, ["h100-80gb:8,16"])      # the job on other GPUs
    result = alpajob.train(job, steps=20, devices=8)     # losses, step times, the plan

Options are the typed :class:`~alpajob.api.options.PlanOptions` and
:class:`~alpajob.api.options.TrainOptions`, given whole or as keyword arguments. A job
is an :class:`~alpajob.api.resource.AlpaJob`, a path to its manifest, or the manifest
as a dict. Every mistake (in the manifest or an option) is an
:class:`~alpajob.api.errors.AlpaJobError` whose message names the field. Importing this package imports neither JAX nor the planner: each function
loads what it needs when called.

The packages, one per folder of the repository (``alpajob/`` links to them):

=========================  =================  ===========================================
``alpajob.api``            ``alpajob/api``    the typed, JAX-free contracts between parts
``alpajob.planner``        ``planner/``       the planner: graph, cost, intra_op, inter_op, plan
``alpajob.trainer_image``  ``trainer_image/`` the trainer: zoo, step, runtime, Ray runtime
``alpajob.operator``       ``operator/``      the Kubernetes operator (kopf)
``alpajob.cli``            ``alpajob/cli``    the ``alpajob`` command line
=========================  =================  ===========================================
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from alpajob.api.options import PlanOptions, TrainOptions
    from alpajob.api.plan import Plan
    from alpajob.api.resource import AlpaJob
    from alpajob.api.what_if import WhatIfRow
    from alpajob.trainer_image.local_run import RunResult

from alpajob.api.release import VERSION  # noqa: E402  (the one version: alpajob/api/release.py)

__version__ = VERSION


def load(manifest: str | Path) -> AlpaJob:
    """The AlpaJob in the YAML file ``manifest``, validated as the API server would."""
    from alpajob.api.resource import load_job

    return load_job(manifest)


def _job(job: AlpaJob | str | Path | dict[str, Any]) -> AlpaJob:
    from alpajob.api.resource import AlpaJob, parse_job

    if isinstance(job, AlpaJob):
        return job
    if isinstance(job, dict):
        return parse_job(job)
    return load(job)


def plan(job: AlpaJob | str | Path | dict[str, Any], options: PlanOptions | None = None,
         **overrides: Any) -> Plan:
    """Plan ``job`` on ``spec.cluster`` (or the overrides': ``nodes``, ``gpus_per_node``,
    ``gpu``, ``method``, ``ilp_time_limit``, ``baselines``)."""
    from alpajob.api.options import PlanOptions, options_from
    from alpajob.trainer_image.planning import plan_job

    chosen = options_from(PlanOptions, {**(options or PlanOptions()).model_dump(), **overrides})
    return plan_job(_job(job), chosen).plan


def what_if(job: AlpaJob | str | Path | dict[str, Any], specs: Sequence[str], prices: str | Path | None = None,
            options: PlanOptions | None = None, **overrides: Any) -> list[WhatIfRow]:
    """``alpajob plan JOB --what-if SPEC... [--prices FILE]``'s rows: ``job`` planned on
    each option of ``specs`` (``"h100-80gb:8,16"``: :mod:`alpajob.api.what_if`) from one
    trace, through the plan cache of ``options.cache_dir`` (none by default)."""
    from alpajob.api.options import PlanOptions, options_from
    from alpajob.api.what_if import load_prices, parse_options
    from alpajob.trainer_image.what_if import what_if as plan_options

    chosen = options_from(PlanOptions, {**(options or PlanOptions()).model_dump(), **overrides})
    choices = parse_options(specs)
    priced = load_prices(prices, choices) if prices is not None else None
    return plan_options(_job(job), chosen, choices, priced)


def train(job: AlpaJob | str | Path | dict[str, Any], options: TrainOptions | None = None,
          **overrides: Any) -> RunResult:
    """Plan ``job`` for this machine's devices (or run ``plan_file``) and train it; the
    keyword arguments are :class:`~alpajob.api.options.TrainOptions` fields. On a
    CPU-only machine, before JAX is imported and without ``devices``, an ``auto`` job
    gets as many forced devices as plan fastest (:mod:`~alpajob.trainer_image.forced_count`)."""
    from alpajob.api.options import TrainOptions, options_from
    from alpajob.trainer_image.devices import force_host_devices
    from alpajob.trainer_image.forced_count import choose_in_child, make_forced_devices, may_choose

    chosen = options_from(TrainOptions, {**(options or TrainOptions()).model_dump(), **overrides})
    resolved = _job(job)
    if may_choose(resolved, chosen):  # forced CPU devices: as many as plan fastest
        make_forced_devices(choose_in_child(resolved, chosen).devices)
    force_host_devices(chosen.devices)  # before JAX is imported
    from alpajob.trainer_image.local_run import run

    return run(resolved, chosen)
