"""``plan_pools``: a job planned across pools of different GPUs.

The model's layers are clustered once (eq. 6); each pool gets a
:class:`~alpajob.planner.inter_op.search.CostContext` with its own preset, calibration
and memory budget; then the micro-batch counts are searched coarse to fine, as
:func:`~.make.make_plan` searches them, each count's plan coming from the DP across
pools (:mod:`alpajob.planner.inter_op.pools`) against every candidate a plan of one
pool alone considers at that count (the DP, Megatron's grids, data parallel, ZeRO-2,
one sharded stage: :func:`~.workers.candidates_at`), so a pool is left out where it
would only slow the step, and the result is never slower than either pool's plan at
the counts searched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from alpajob.api.errors import InfeasibleError, ManifestError
from alpajob.api.plan import Plan, SolverStats
from alpajob.api.spec import Method
from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.cost.model import load_calibration
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.planner.inter_op.clustering import cluster_layers, default_num_layers
from alpajob.planner.inter_op.pools import Link, PoolCandidate, PoolSearch, pool_link
from alpajob.planner.inter_op.search import (
    Candidate,
    CostContext,
    Progress,
    best_of,
    micro_batch_candidates,
)
from alpajob.planner.inter_op.shared_solutions import SharedSolutions
from alpajob.planner.inter_op.stage_costs import SolveCounter
from alpajob.planner.plan.assemble import assemble_pools_plan
from alpajob.planner.plan.make import SearchOptions, coarse_to_fine, memory_error
from alpajob.planner.plan.workers import candidates_at


@dataclass(frozen=True)
class PoolsPlanning:
    """The best plan across ``clusters`` (one per pool) and what finding it took."""

    candidate: PoolCandidate
    clusters: tuple[ClusterSpec, ...]
    link: Link
    plan: Plan  # the Plan document (stages name their pool: ``Plan.pools``; the search's figures: ``solver``)

    def stage_lines(self) -> list[str]:
        """One line per stage: its layers, pool, submesh and latency."""
        return [f"stage {q}: layers {s.first}-{s.last} on {s.submesh[0]}x{s.submesh[1]} "
                f"{self.clusters[p].preset} ({s.seconds * 1e3:.1f} ms per micro-batch)"
                for q, (p, s) in enumerate(zip(self.candidate.pools, self.candidate.stages, strict=True))]


def pool_contexts(graph: OpGraph, clusters: Sequence[ClusterSpec], options: SearchOptions,
                  progress: Progress | None = None, shared: SharedSolutions | None = None) -> list[CostContext]:
    """One cost context per pool, on the same layers, sharing one tally of ILPs (and
    the solutions of earlier searches, ``shared``, where they apply)."""
    layers = cluster_layers(graph, options.num_layers or default_num_layers(graph))
    if shared is not None and not shared.serves(graph, layers):
        raise ValueError("the shared solutions were found for another graph or other layers")
    counter = SolveCounter()
    return [CostContext(graph=graph, layers=layers, cluster=cluster,
                        calibration=options.calibration or load_calibration(cluster.preset),
                        schedule=options.schedule,
                        memory_budget=cluster.device.memory_bytes * options.memory_fraction,
                        time_limit_s=options.ilp_time_limit_s, counter=counter, progress=progress,
                        shared=shared.matching([cluster.device]) if shared is not None else None)
            for cluster in clusters]


def plan_pools(graph: OpGraph, clusters: Sequence[ClusterSpec], options: SearchOptions,
               link_bandwidth: float | None = None, progress: Progress | None = None,
               shared: SharedSolutions | None = None) -> PoolsPlanning:
    """Plan ``graph`` (traced at the global batch) across the pools ``clusters``
    (module docstring); ``link_bandwidth``: bytes/s between pools (default: the
    slowest pool's inter-node link); ``shared``: as :func:`~.make.make_plan`'s."""
    began = time.perf_counter()
    if options.method not in (Method.AUTO, Method.PIPESHARD):
        raise ManifestError("spec.parallelism.method", (
            f"{options.method.value} plans one device type; a mixed cluster is planned by the "
            "inter-op DP: use auto or pipeshard"))
    contexts = pool_contexts(graph, clusters, options, progress, shared)
    counts = micro_batch_candidates(graph, options.num_micro_batches, options.max_micro_batches)
    if not counts:
        raise ManifestError("spec.parallelism.numMicroBatches", (
            f"{options.num_micro_batches} does not divide the global batch {graph.batch_size} "
            "into equal micro-batches"))
    link = pool_link(clusters, link_bandwidth)
    method = options.method

    def alone(context: CostContext, count: int) -> list[Candidate | None]:
        return candidates_at(context, count, method, [])  # what a plan of that pool alone considers

    found = coarse_to_fine(PoolSearch(contexts, link, alone, min_stages=2 if method is Method.PIPESHARD else 1),
                           counts)
    if shared is not None:  # what it solved, whether or not a plan fits
        for context in contexts:
            shared.record(context)
    best = best_of(found)
    if best is None:
        roomiest = max(contexts, key=lambda c: c.memory_budget)
        least = memory_error(roomiest, counts, Method.AUTO)  # what its whole pool, fully sharded, needs
        raise InfeasibleError(
            f"no plan across the pools ({', '.join(f'{c.num_devices} x {c.preset}' for c in clusters)}) "
            f"fits their GPUs' memory ({least}); add GPUs or use larger ones",
            required_bytes=least.required_bytes, available_bytes=least.available_bytes)
    assert isinstance(best, PoolCandidate)
    searched = sorted({c.num_micro_batches for c in found if c is not None})
    seconds = time.perf_counter() - began
    plan = pools_document(graph, contexts, link, best, searched, seconds, method)
    for context in contexts:
        context.drop_solve_contexts()
    return PoolsPlanning(best, tuple(clusters), link, plan)


def pools_document(graph: OpGraph, contexts: Sequence[CostContext], link: Link, candidate: PoolCandidate,
                   searched: Sequence[int] = (), seconds: float = 0.0, method: Method = Method.AUTO) -> Plan:
    """The Plan document of ``candidate``, a plan across the pools of ``contexts``
    (:func:`~.assemble.assemble_pools_plan`) searched by ``method``, with the search's figures."""
    counter = contexts[0].counter
    solver = SolverStats(planning_seconds=seconds, ilp_solves=counter.solves, ilp_seconds=counter.seconds,
                         ilp_max_variables=counter.max_variables, ilp_solver=counter.solver,
                         dp_seconds=counter.dp_seconds, dp_calls=counter.dp_calls,
                         micro_batch_candidates=list(searched or [candidate.num_micro_batches]),
                         winner=candidate.name)
    return assemble_pools_plan(graph=graph, contexts=contexts, link=link, candidate=candidate, solver=solver,
                               method=method.value)
