"""``make_plan``: the planner's one public entry, from an op graph and a cluster to a Plan.

Steps: cluster the forward ops into layers (eq. 6), then, by ``spec.parallelism.method``:

- auto: the inter-op DP for every micro-batch count (each stage costed by the intra-op
  ILP); the Megatron-style grid, data parallel, ZeRO-2 and the single-stage ILP plan
  are costed too, and the fastest candidate wins. The DP's search space contains
  them; they guard against its approximations (layers solved one at a time, so
  gradients flowing back between two layers may be resharded where one stage-wide
  ILP would have agreed on their layout). Each candidate carries its name, so the
  plan's ``solver.winner`` says which one won.
- pipeshard: the DP, forbidding the single-stage plan;
- shard: one stage on the whole cluster, sharding by the ILP;
- data / zero2: one stage, data parallel (with sharded optimizer for zero2);
- manual: the user's stages (layer ranges and submeshes), logical meshes picked by us.

No candidate fitting memory raises :class:`InfeasibleError` with the smallest memory
per device any plan would need.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from alpajob.api.errors import InfeasibleError, ManifestError
from alpajob.api.options import PlanOptions
from alpajob.api.plan import Plan, SolverStats
from alpajob.api.spec import Method, ParallelismSpec, PlannerSpec, Schedule
from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.cost.model import Calibration, load_calibration
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.planner.inter_op.clustering import cluster_layers, default_num_layers
from alpajob.planner.inter_op.search import (
    Candidate,
    CostContext,
    Progress,
    StageRequest,
    best_of,
    micro_batch_candidates,
)
from alpajob.planner.inter_op.shared_solutions import SharedSolutions
from alpajob.planner.inter_op.stage_costs import LEVEL_TIERS, MEMORY_LEVELS, StageEval
from alpajob.planner.intra_op.solve import ShardingMode
from alpajob.planner.plan.baselines import all_baselines, whole_cluster
from alpajob.planner.plan.workers import LikelyNext, SearchPool

GIB = 1024**3

#: Micro-batch counts searched first, with the largest (:func:`_powers_of_two_first`).
USUAL_MICRO_BATCHES = 64


@dataclass(frozen=True)
class ManualStageOption:
    """A manual stage: layers [first, end) on a submesh (n nodes x m devices)."""

    first: int
    end: int
    submesh: tuple[int, int]
    logical_shape: tuple[int, int] | None = None


@dataclass(frozen=True)
class SearchOptions:
    """What the planner searches (``spec.parallelism`` plus tuning knobs); made from a
    spec by :func:`search_options`.

    memory_fraction: share of device memory a plan may use (the rest is left to XLA's
        workspace and fragmentation); 0.9 by default.
    ilp_time_limit_s: time limit of each intra-op ILP solve, in seconds.
    max_micro_batches: largest number of micro-batches tried (divisors of the batch); counts
        above 64 are only tried when no plan fits with fewer.
    calibration: the cost model's constants; None (the default) takes the cluster
        preset's stored ones (``data/calibration.json``). ``alpajob calibrate`` passes
        trial values to fit them.
    all_devices: every plan uses every device, even on a shared host where the search
        otherwise also tries one (:func:`~alpajob.planner.inter_op.search.device_counts`).
    """

    method: Method = Method.AUTO
    schedule: Schedule = Schedule.ONE_F_ONE_B
    num_micro_batches: int | None = None
    num_layers: int | None = None
    manual_stages: tuple[ManualStageOption, ...] = ()
    memory_fraction: float = 0.9
    ilp_time_limit_s: float = 10.0
    max_micro_batches: int = 1024
    baselines: bool = False
    calibration: Calibration | None = None
    all_devices: bool = False

    def __post_init__(self) -> None:
        # Accept the manifest's strings ("shard", "gpipe") as well as the enums.
        object.__setattr__(self, "method", Method(self.method))
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


def search_options(parallelism: ParallelismSpec, options: PlanOptions | None = None,
                   planner: PlannerSpec | None = None) -> SearchOptions:
    """The search ``spec.parallelism`` and ``spec.planner`` ask for, with the overrides
    of ``options`` (``--method``, ``--ilp-time-limit``, ``--baselines``)."""
    options, planner = options or PlanOptions(), planner or PlannerSpec()
    manual = tuple(ManualStageOption(s.first, s.end, s.submesh_shape, s.logical_mesh_shape)
                   for s in parallelism.manual_stages)
    num_layers = None if parallelism.num_layers == "auto" else int(parallelism.num_layers)
    if manual and num_layers is None:
        num_layers = max(s.end for s in manual)
    count = parallelism.num_micro_batches
    return SearchOptions(
        method=options.method or parallelism.method,
        schedule=parallelism.schedule,
        num_micro_batches=None if count == "auto" else int(count),
        num_layers=num_layers,
        manual_stages=manual,
        ilp_time_limit_s=(options.ilp_time_limit if options.ilp_time_limit is not None
                          else planner.ilp_time_limit_seconds),
        baselines=options.baselines,
        all_devices=options.all_devices,
    )


@dataclass(frozen=True)
class PlanningResult:
    """The plan and, when asked for, every baseline's best candidate."""

    plan: Plan
    candidate: Candidate
    baselines: dict[str, Candidate | None]
    context: CostContext  # the ILP cache, for costing more candidates without re-solving


def _validate_manual(
    stages: Sequence[ManualStageOption], num_layers: int, cluster: ClusterSpec
) -> list[StageRequest]:
    field = "spec.parallelism.stages"
    expected = 0
    devices = 0
    requests = []
    for index, stage in enumerate(stages):
        where = f"{field}[{index}]"
        if stage.first != expected:
            raise ManifestError(
                f"{where}.layers",
                f"starts at layer {stage.first} but the previous stage ended at {expected}; "
                f"stages must cover layers 0..{num_layers - 1} contiguously",
            )
        if stage.end > num_layers:
            raise ManifestError(
                f"{where}.layers",
                f"ends at {stage.end} but the model has {num_layers} layers "
                "(set spec.parallelism.numLayers to change the layer count)",
            )
        n, m = stage.submesh
        M = cluster.devices_per_node
        if n < 1 or m < 1 or n > cluster.num_nodes or m > M or (n > 1 and m != M) or M % m:
            raise ManifestError(
                f"{where}.submeshShape",
                f"[{n}, {m}] is not a submesh of a {cluster.num_nodes} x {M} cluster; use "
                f"[1, m] with m dividing {M}, or [n, {M}] with n ≤ {cluster.num_nodes}",
            )
        shape = stage.logical_shape
        if shape is not None and shape[0] * shape[1] != n * m:
            raise ManifestError(
                f"{where}.logicalMeshShape",
                f"{list(shape)} has {shape[0] * shape[1]} devices but the submesh has {n * m}",
            )
        devices += n * m
        expected = stage.end
        requests.append(StageRequest(stage.first, stage.end - 1, (n, m), shape))
    if expected != num_layers:
        raise ManifestError(
            field, f"stages cover layers 0..{expected - 1} but the model has {num_layers} layers"
        )
    if devices > cluster.num_devices:
        raise ManifestError(
            field, f"stages use {devices} devices but the cluster has {cluster.num_devices}"
        )
    return requests


def memory_error(context: CostContext, micro_batches: Sequence[int], method: Method) -> InfeasibleError:
    """The smallest memory per device any single-stage plan on the whole cluster needs."""
    submesh, _ = whole_cluster(context)
    count = max(micro_batches)
    coster = context.coster(count, ShardingMode.AUTO)
    required = min(
        coster.evaluate_stage(0, coster.num_layers - 1, submesh, shape, level, 1).peak_memory
        for shape in context.shapes(submesh)
        for level in LEVEL_TIERS[-1]
    )
    available = context.memory_budget
    cluster = context.cluster
    if required > available:
        return InfeasibleError(
            f"the model does not fit: even fully sharded over all {cluster.num_devices} devices "
            f"it needs {_size(required)} per device, and each {cluster.device.name} "
            f"offers {_size(available)} (device memory x memory fraction); use more "
            "or larger GPUs (spec.cluster), a smaller model, or float16/bfloat16",
            required_bytes=required,
            available_bytes=available,
        )
    return InfeasibleError(
        f"no {method.value} plan fits in {_size(available)} per device (the model needs "
        f"at least {_size(required)} per device fully sharded); try "
        "spec.parallelism.method: auto",
        required_bytes=required,
        available_bytes=available,
    )


def _size(nbytes: float) -> str:
    """``nbytes`` for a message: in GiB, MiB below a tenth of one, KiB below a tenth
    of a MiB (never "0.00 GiB")."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if nbytes >= scale / 10:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def _recomputed(stage: StageEval) -> str:
    """How a stage recomputes, and what its transient holds, for a memory message."""
    if stage.remat_parts:
        return (", rematerialised in block parts, the largest part's residuals and "
                "backward working set")
    if stage.remat:
        return ", rematerialised, the largest layer's residuals and backward working set"
    return ", the largest layer's backward working set"


def _manual_memory_error(
    context: CostContext, micro_batches: Sequence[int], manual: Sequence[StageRequest]
) -> InfeasibleError:
    """The first manual stage that fits at no micro-batch count, named with its layers,
    submesh and the least memory it needs (its leanest level and logical mesh at the
    count that needs least), split into weights and in-flight activations."""
    budget = context.memory_budget
    for index, request in enumerate(manual):
        least, least_count = None, 0
        for count in micro_batches:
            coster = context.coster(count, ShardingMode.AUTO)
            in_flight = context.in_flight(index, len(manual), count)
            shapes = [request.shape] if request.shape else context.shapes(request.submesh)
            for shape in shapes:
                for level in range(len(MEMORY_LEVELS)):
                    stage = coster.evaluate_stage(request.first, request.last, request.submesh,
                                                  shape, level, in_flight)
                    if least is None or stage.peak_memory < least.peak_memory:
                        least, least_count = stage, count
        if least is None or least.peak_memory <= budget:
            continue
        n, m = request.submesh
        return InfeasibleError(
            f"spec.parallelism.stages[{index}]: layers [{request.first}, {request.last + 1}) on "
            f"submesh {n}x{m} (logical mesh {least.shape[0]}x{least.shape[1]}) need at least "
            f"{_size(least.peak_memory)} per device (weights and optimizer state "
            f"{_size(least.weight_bytes)}, activations "
            f"{_size(least.in_flight * least.activation_bytes)} for {least.in_flight} "
            f"in-flight micro-batches of {least_count}"
            f"{_recomputed(least)} {_size(least.transient_bytes)}), and each "
            f"{context.cluster.device.name} offers {_size(budget)}; give this stage more "
            "devices (submeshShape) or fewer layers, or use more micro-batches "
            "(numMicroBatches) or float16/bfloat16",
            required_bytes=least.peak_memory,
            available_bytes=budget,
        )
    return memory_error(context, micro_batches, Method.MANUAL)


class CountSearch(Protocol):
    """What costs the candidates of micro-batch counts (:class:`~.workers.SearchPool`,
    or :class:`~alpajob.planner.inter_op.pools.PoolSearch` across pools)."""

    def run(self, counts: Sequence[int], likely_next: LikelyNext | None = None) -> list[Candidate | None]: ...


def coarse_to_fine(search: CountSearch, micro_batches: Sequence[int]) -> list[Candidate | None]:
    """Search micro-batch counts coarsely (every other power of two up to
    :data:`USUAL_MICRO_BATCHES`, that one included, and the largest), then around the
    best (:func:`_powers_of_two_first`), then the other divisors of the batch between
    the best power of two's neighbours (a round of work fewer than all).

    Near its optimum, step time as a function of B is unimodal in practice (the
    pipeline bubble shrinks as B grows, while per-micro-batch overheads such as
    collective latencies grow), so the neighbours of the best power of two hold it.
    Example: batch 1536 -> first 1, 4, 16, 64 and 512 (the largest power of two up to
    ``max_micro_batches``, 1024, that divides it); best 16 -> then 8 and 32; best 32 ->
    then 24 and 48 (the divisors between 16 and 64).
    """
    counts = sorted(micro_batches)
    if len(counts) <= 3:
        return search.run(counts)
    found = _powers_of_two_first(search, counts)
    best = best_of(found)
    if best is None:
        return found
    tried = {c.num_micro_batches for c in found if c is not None}
    powers = [c for c in counts if c & (c - 1) == 0]
    below = [c for c in powers if c < best.num_micro_batches]
    above = [c for c in powers if c > best.num_micro_batches]
    lo = below[-1] if below else 0
    hi = above[0] if above else counts[-1] + 1
    between = [c for c in counts if lo < c < hi and c not in tried]
    return found + (search.run(between) if between else [])


def _powers_of_two_first(search: CountSearch, micro_batches: Sequence[int]) -> list[Candidate | None]:
    """The coarse-to-fine search over the powers of two among ``micro_batches``
    (other counts only when no power of two fits).

    The first round costs every other power of two up to :data:`USUAL_MICRO_BATCHES`
    (that one included) and the largest count. Both ends, because step time is not
    unimodal over every count: a pipeline's bubble favours many micro-batches, one
    sharded stage a few large ones. GPT-1.3B on 4 V100s is 74.5 s at best with 64
    micro-batches (one stage), worse with 128, and 60.7 s with 1,024 (three stages).
    The largest count also settles memory: fewer, larger micro-batches never need
    less, so if nothing fits there nothing fits at all (the pool costs it first and
    then skips the rest, :func:`~.workers.fits_nowhere`).

    Then, if the largest count is the best, smaller counts while they do better;
    else the neighbouring powers of two of the best usual count, and, while the best
    plan rematerialises, larger counts while they improve it (more, smaller
    micro-batches may fit without recomputation). The first round and each step of
    the descent name the counts likely next (on the round's results so far), whose
    ILPs the pool's workers then start instead of waiting or solving a count that
    may be moot (:meth:`~.workers.SearchPool.run`); the counts costed stay the same.
    """
    counts = [c for c in micro_batches if c & (c - 1) == 0] or list(micro_batches)
    if len(counts) <= 3:
        found = search.run(counts)
        if best_of(found) is None:
            rest = [c for c in micro_batches if c not in counts]
            found += search.run(rest) if rest else []
        return found
    usual = [c for c in counts if c <= USUAL_MICRO_BATCHES] or counts
    tried: set[int] = set()

    def cost(chosen: Sequence[int], likely_next: LikelyNext | None = None
             ) -> list[Candidate | None]:
        tried.update(chosen)
        return search.run(chosen, likely_next) if chosen else []

    def second_round(found: Sequence[Candidate | None]) -> list[int]:
        """The counts the search costs after the first round (or, on partial
        results, the likely ones): the descent's first step, or the best's
        neighbouring powers of two."""
        best = best_of(found)
        if best is None:
            return []
        if best.num_micro_batches == counts[-1] and counts[-1] > usual[-1]:
            return below(len(counts) - 1)
        position = counts.index(best.num_micro_batches)
        return [counts[k] for k in (position - 1, position + 1)
                if 0 <= k < len(counts) and counts[k] not in tried]

    def below(position: int) -> list[int]:
        """The descent's step after ``counts[position]`` (none at a count tried)."""
        return [counts[position - 1]] if position > 0 and counts[position - 1] not in tried else []

    def after(position: int, _found: Sequence[Candidate | None]) -> list[int]:
        return below(position)  # whatever the step found: a guess for the workers

    found = cost(sorted({*usual[::2], usual[-1], counts[-1]}), second_round)
    best = best_of(found)
    if best is None:
        return found
    if best.num_micro_batches == counts[-1] and counts[-1] > usual[-1]:
        for position in range(len(counts) - 2, -1, -1):
            count = counts[position]
            if count in tried:
                break
            found += cost([count], functools.partial(after, position))
            better = best_of(found)
            if better is best:
                break
            best = better
        return found
    found += cost(second_round(found))
    best = best_of(found) or best
    while any(stage.remat for stage in best.stages):
        larger = [c for c in counts if c > best.num_micro_batches and c not in tried]
        if not larger:
            break
        found += cost(larger[:1])
        improved = best_of(found)
        if improved is None or improved is best:
            break
        best = improved
    return found


def make_plan(
    graph: OpGraph,
    cluster: ClusterSpec,
    options: SearchOptions,
    progress: Progress | None = None,
    extract_seconds: float = 0.0,
    shared: SharedSolutions | None = None,
) -> PlanningResult:
    """Plan ``graph`` (traced at the global batch) on ``cluster``. ``shared``: the
    solutions of earlier searches of ``graph`` on other clusters, used where they
    apply and given this search's (:mod:`~..inter_op.shared_solutions`)."""
    from alpajob.planner.plan.assemble import assemble_plan  # late: assemble imports inter_op

    start = time.perf_counter()
    num_layers = options.num_layers or default_num_layers(graph)
    if progress:
        progress("clustering layers", 0, None)
    layers = cluster_layers(graph, num_layers)
    if shared is not None and not shared.serves(graph, layers):
        raise ValueError("the shared solutions were found for another graph or other layers")
    context = CostContext(
        graph=graph,
        layers=layers,
        cluster=cluster,
        calibration=options.calibration or load_calibration(cluster.preset),
        schedule=options.schedule,
        memory_budget=cluster.device.memory_bytes * options.memory_fraction,
        time_limit_s=options.ilp_time_limit_s,
        progress=progress,
        all_devices=options.all_devices,
        shared=shared.matching([cluster.device]) if shared is not None else None,
    )
    micro_batches = micro_batch_candidates(
        graph, options.num_micro_batches, options.max_micro_batches
    )
    if not micro_batches:
        raise ManifestError(
            "spec.parallelism.numMicroBatches",
            f"{options.num_micro_batches} does not divide the global batch {graph.batch_size} "
            "into equal micro-batches",
        )
    method = options.method
    manual = (
        _validate_manual(options.manual_stages, len(layers), cluster)
        if method is Method.MANUAL
        else []
    )
    with SearchPool(context, method, manual, micro_batches) as search:
        candidates = coarse_to_fine(search, micro_batches)
    if shared is not None:  # what it solved, whether or not a plan fits
        shared.record(context)
    best = best_of(candidates)
    if best is None:
        if method is Method.MANUAL:
            raise _manual_memory_error(context, micro_batches, manual)
        raise memory_error(context, micro_batches, method)
    searched = sorted({c.num_micro_batches for c in candidates if c is not None})
    search_seconds = time.perf_counter() - start
    baselines: dict[str, Candidate | None] = {}
    if options.baselines:
        if progress:
            progress("costing baselines", 0, None)
        # Baselines get the micro-batch counts the search considered: the usual
        # range plus any larger count it went on to (memory, rematerialisation).
        considered = sorted({c for c in micro_batches if c <= USUAL_MICRO_BATCHES} | set(searched))
        # Only reported: comparing never changes the plan (the search's own candidates
        # include these plans' families; tests hold it to never losing to them).
        baselines = all_baselines(context, considered)
    solver = SolverStats(
        planning_seconds=search_seconds,
        extract_seconds=extract_seconds,
        ilp_solves=context.counter.solves,
        ilp_seconds=context.counter.seconds,
        ilp_max_variables=context.counter.max_variables,
        ilp_solver=context.counter.solver,
        dp_seconds=context.counter.dp_seconds,
        dp_calls=context.counter.dp_calls,
        micro_batch_candidates=searched,
        winner=best.name,
    )
    plan = assemble_plan(
        method=method.value,
        graph=graph,
        cluster=cluster,
        context=context,
        candidate=best,
        solver=solver,
        baselines=(
            {name: (c.step_seconds if c else None) for name, c in baselines.items()}
            if options.baselines
            else None
        ),
    )
    context.drop_solve_contexts()
    return PlanningResult(plan=plan, candidate=best, baselines=baselines, context=context)
