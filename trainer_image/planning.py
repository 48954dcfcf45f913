"""Plan an AlpaJob: load its model, trace its training step, and run the planner.

The one place where a job becomes a plan, for ``alpajob plan`` (and so the planning
pod of a job on Kubernetes), ``alpajob run`` and the Python API
(:func:`alpajob.plan`)::

    spec.model ──load_model──► model ──trace_step──► TracedStep ──extract_graph──► OpGraph
    spec.cluster + PlanOptions ──cluster_for──► ClusterSpec ──┐                      │
    spec.parallelism + PlanOptions ──search_options──► SearchOptions ──► make_plan ◄─┘

:func:`plan_or_cached` does the same through the plan cache (:mod:`.plan_cache`,
``PlanOptions.cache_dir``): a plan made before for the same graph, cluster, search and
planner is read back instead of searched for again.

``PlanOptions.calibration`` (``--calibration FILE``) replaces the preset's rates and
constants with those ``alpajob calibrate`` measured (:func:`measured_constants`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from alpajob.api.errors import AlpaJobError, ManifestError
from alpajob.api.options import PlanOptions
from alpajob.api.plan import Plan
from alpajob.api.resource import AlpaJob
from alpajob.planner.cost.cluster import ClusterSpec, cluster_for, pool_clusters
from alpajob.planner.cost.measured import check_preset, load_measured
from alpajob.planner.cost.model import load_calibration
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.planner.inter_op.search import Progress
from alpajob.planner.inter_op.shared_solutions import SharedSolutions
from alpajob.planner.plan.make import PlanningResult, SearchOptions, make_plan, search_options
from alpajob.planner.plan.workers import start_fork_server
from alpajob.trainer_image.plan_cache import PlanCache, plan_key, planner_version
from alpajob.trainer_image.stopping import Deadline


def job_graph(job: AlpaJob, note: Callable[[str], None] | None = None) -> OpGraph:
    """The op graph of ``job``'s training step at its global batch (``note`` hears
    why the model had to be traced twice, where it had). JAX is imported here, not
    with this module: a process that plans a graph it was given (a what-if worker)
    never imports it."""
    from alpajob.trainer_image.entrypoint import load_model, user_code_failed
    from alpajob.trainer_image.step import graph_of, training_optimizer

    training = job.spec.training
    model = load_model(job.spec.model, training.dtype)
    try:
        return graph_of(model, training.global_batch_size, training_optimizer(training), note)
    except AlpaJobError:
        raise
    except (Exception, SystemExit) as error:  # noqa: BLE001 - a user's model, reported in one line
        if job.spec.model.entrypoint is None:
            raise
        raise user_code_failed("tracing your model's training step", error) from None


@dataclass(frozen=True)
class PlanningInputs:
    """What a plan is a function of: the traced graph (and the seconds tracing took),
    the cluster and the search."""

    graph: OpGraph
    cluster: ClusterSpec
    search: SearchOptions
    traced_seconds: float


def planning_inputs(job: AlpaJob, options: PlanOptions, cluster: ClusterSpec | None,
                    graph: OpGraph | None, progress: Progress | None,
                    note: Callable[[str], None] | None = None) -> PlanningInputs:
    """``job``'s cluster (default: ``spec.cluster`` with ``options``' overrides), search
    and graph (traced unless the caller has it; ``note`` hears about the tracing), with
    ``--calibration`` applied."""
    if cluster is None:
        cluster = cluster_for(job.spec.cluster, options)
    search = search_options(job.spec.parallelism, options, job.spec.planner)
    if options.calibration:
        cluster, search = measured_constants(options.calibration, cluster, search)
    start = time.perf_counter()
    if graph is None:
        start_fork_server()  # the planner's workers get ready while the model is traced
        if progress:
            progress(f"tracing {job.spec.model.zoo or job.spec.model.entrypoint}", 0, None)
        graph = job_graph(job, note)
    return PlanningInputs(graph, cluster, search, time.perf_counter() - start)


def plan_job(job: AlpaJob, options: PlanOptions | None = None, *,
             cluster: ClusterSpec | None = None, graph: OpGraph | None = None,
             progress: Progress | None = None) -> PlanningResult:
    """Plan ``job`` for ``cluster`` (default: ``spec.cluster`` with ``options``'
    overrides); ``graph``: its op graph when the caller has traced it already."""
    options = options or PlanOptions()
    with Deadline(options.plan_time_limit, "plan_time_limit", lambda: "planning"):
        given = planning_inputs(job, options, cluster, graph, progress)
        return make_plan(given.graph, given.cluster, given.search, progress=progress,
                         extract_seconds=given.traced_seconds)


class NotCached(LookupError):
    """The plan asked for with ``only_cached`` is not in the plan cache (or there is
    no cache): nothing was planned."""


@dataclass(frozen=True)
class JobPlan:
    """A job's plan and where it came from: ``key`` is its plan-cache key (None
    without a cache), ``cached`` whether it was read from the cache."""

    plan: Plan
    key: str | None = None
    cached: bool = False


def plan_or_cached(job: AlpaJob, options: PlanOptions | None = None, *,
                   cluster: ClusterSpec | None = None, graph: OpGraph | None = None,
                   progress: Progress | None = None,
                   warn: Callable[[str], None] = lambda _line: None,
                   shared: SharedSolutions | None = None, only_cached: bool = False) -> JobPlan:
    """:func:`plan_job`'s plan, read from the plan cache in ``options.cache_dir`` when
    it holds one for this graph, cluster, search and planner, else planned and stored
    there (``warn`` hears about an entry ignored or a cache not written). ``shared``:
    the solutions of earlier searches of ``graph`` on other clusters
    (:mod:`~alpajob.planner.inter_op.shared_solutions`). ``only_cached``: never plan;
    :class:`NotCached` where the cache has no such plan."""
    options = options or PlanOptions()
    doing = ["tracing the model"]

    def watched(what: str, done: int, total: int | None) -> None:
        doing[0] = what
        if progress:
            progress(what, done, total)

    with Deadline(options.plan_time_limit, "--plan-time-limit", lambda: doing[0]):
        return _plan_or_cached(job, options, cluster, graph, watched, warn, shared, only_cached)


def _plan_or_cached(job: AlpaJob, options: PlanOptions, cluster: ClusterSpec | None,
                    graph: OpGraph | None, progress: Progress,
                    warn: Callable[[str], None], shared: SharedSolutions | None,
                    only_cached: bool) -> JobPlan:
    pools = job.spec.cluster
    clusters = pool_clusters(pools, options) if cluster is None and pools.pools is not None else ()
    if len(clusters) == 1:
        cluster = clusters[0]  # the operator found nodes of one of the types only: planned alone
    elif clusters:
        if options.calibration:
            raise ManifestError("--calibration", "holds one GPU type's constants, and spec.cluster.pools names "
                                                 "several; plan without it")
        if graph is None:
            progress(f"tracing {job.spec.model.zoo or job.spec.model.entrypoint}", 0, None)
            graph = job_graph(job, warn)
        bandwidth = pools.pool_link_gbps * 1e9 / 8 if pools.pool_link_gbps is not None else None
        return pools_plan_or_cached(graph, clusters, search_options(job.spec.parallelism, options, job.spec.planner),
                                    options, bandwidth, progress, warn, shared, only_cached)
    given = planning_inputs(job, options, cluster, graph, progress, warn)
    if options.cache_dir is None:
        if only_cached:
            raise NotCached("no plan cache")
        return JobPlan(make_plan(given.graph, given.cluster, given.search, progress=progress,
                                 extract_seconds=given.traced_seconds, shared=shared).plan)
    cache = PlanCache(Path(options.cache_dir), warn)
    key = plan_key(given.graph, given.cluster, given.search, planner_version())
    plan = cache.get(key, given.graph)
    if plan is not None:
        return JobPlan(plan, key, cached=True)
    if only_cached:
        raise NotCached(key)
    plan = make_plan(given.graph, given.cluster, given.search, progress=progress,
                     extract_seconds=given.traced_seconds, shared=shared).plan
    cache.put(key, plan)
    return JobPlan(plan, key)


def pools_plan_or_cached(graph: OpGraph, clusters: tuple[ClusterSpec, ...], search: SearchOptions,
                         options: PlanOptions, link_bandwidth: float | None = None,
                         progress: Progress | None = None,
                         warn: Callable[[str], None] = lambda _line: None,
                         shared: SharedSolutions | None = None, only_cached: bool = False) -> JobPlan:
    """A plan across the GPU types of ``clusters`` (one per pool; ``link_bandwidth``
    in bytes/s between pools), through the plan cache as any plan
    (:func:`~alpajob.planner.plan.pools.plan_pools`; ``shared`` and ``only_cached`` as
    :func:`plan_or_cached`'s)."""
    from alpajob.planner.plan.pools import plan_pools

    def planned() -> Plan:
        return plan_pools(graph, clusters, search, link_bandwidth, progress, shared).plan

    if options.cache_dir is None:
        if only_cached:
            raise NotCached("no plan cache")
        return JobPlan(planned())
    cache = PlanCache(Path(options.cache_dir), warn)
    key = plan_key(graph, clusters, search, planner_version(), link_bandwidth)
    plan = cache.get(key, graph)
    if plan is not None:
        return JobPlan(plan, key, cached=True)
    if only_cached:
        raise NotCached(key)
    plan = planned()
    cache.put(key, plan)
    return JobPlan(plan, key)


def measured_constants(path: str, cluster: ClusterSpec,
                       search: SearchOptions) -> tuple[ClusterSpec, SearchOptions]:
    """``cluster`` and ``search`` with the constants of the file ``path`` (written by
    ``alpajob calibrate`` for the cluster's preset)."""
    measured = load_measured(path)
    check_preset(measured, cluster)
    base = search.calibration or load_calibration(cluster.preset)
    try:
        calibration = measured.refine_calibration(base)
    except ValueError as error:
        raise ManifestError("--calibration", f"{path}: {error}") from None
    return (measured.refine_cluster(cluster),
            dataclasses.replace(search, calibration=calibration))
