"""The inter-operator pass: stages, submeshes and micro-batches (Alpa section 5).

Driver of the whole planner. For each candidate number of micro-batches B::

    graph at micro-batch size ──► LayerCoster (per-layer ILPs, reused across
                                  identical layers; stage_costs.py)
          │ for every submesh (n, m) and logical mesh (a, b):
          ▼   range tables: latency, update, weights, activations of layers i..j
    DP tables compute_cost[i, j, s], max_n_succ_stages[i, j, s]
          │ stage_dp (eq. 3/4, t_max enumeration with early stop)
          ▼
    stages ──► evaluate exactly (evaluate_stages) ──► step time
                 T = Σ t_i + (B − 1)·max t_i + max u_i

where t_i is a stage's forward+backward latency per micro-batch (its layers, the
resharding inside it, and receiving its inputs from the previous stage) and u_i its
once-per-step gradient synchronisation and optimizer update. The best B wins.

Memory: a stage holds its weights plus the activations of every in-flight micro-batch:
with 1F1B, the stage with k stages after it holds min(k + 1, B) micro-batches; with
GPipe, all B. ``max_n_succ_stages`` tells the DP how many stages may follow a stage
for it still to fit.

Each submesh offers the DP two choices: the fastest (logical mesh, memory level) and
the one that leaves the most room for later stages; both are the same device count.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from alpajob.api.spec import Schedule
from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.cost.model import (
    Calibration,
    logical_mesh_shapes,
)
from alpajob.planner.graph.opgraph import OpGraph, batch_size_problem, with_batch_size
from alpajob.planner.inter_op.layer_structure import LayerStructure, layer_structure
from alpajob.planner.inter_op.remat_pieces import PieceCutter
from alpajob.planner.inter_op.stage_costs import (
    LEVEL_TIERS,
    CosterCaches,
    LayerCoster,
    Link,
    SolveCounter,
    StageEval,
    Submesh,
)
from alpajob.planner.inter_op.stage_dp import DPResult, stage_dp, submesh_choices
from alpajob.planner.inter_op.step_time import pipeline_step_seconds, shared_host_costs
from alpajob.planner.intra_op.solve import ShardingMode, SolveContext

if TYPE_CHECKING:
    from alpajob.planner.inter_op.shared_solutions import SharedSolutions

#: Progress callback: (what is being done, steps done, steps in total or None).
Progress = Callable[[str, int, int | None], None]

Shape = tuple[int, int]


@dataclass(frozen=True)
class StageRequest:
    """A stage asked for by a baseline or a manual plan: layers first..last (inclusive)
    on ``submesh``; ``shape``/``level`` None lets the planner pick the best."""

    first: int
    last: int
    submesh: Submesh
    shape: Shape | None = None
    level: int | None = None


@dataclass(frozen=True)
class Candidate:
    """A complete plan candidate with its predicted step time."""

    name: str
    mode: ShardingMode
    num_micro_batches: int
    stages: tuple[StageEval, ...]
    step_seconds: float

    @property
    def peak_memory(self) -> float:
        return max(s.peak_memory for s in self.stages)


@dataclass
class CostContext:
    """Everything needed to cost plans of one graph on one cluster; caches ILPs.

    One :class:`LayerCoster` per (micro-batch count, sharding mode), created on demand.
    """

    graph: OpGraph
    layers: Sequence[Sequence[int]]
    cluster: ClusterSpec
    calibration: Calibration
    schedule: Schedule
    memory_budget: float
    time_limit_s: float
    counter: SolveCounter = field(default_factory=SolveCounter)
    progress: Progress | None = None
    #: Plans use every device even on a shared host (:func:`device_counts`).
    all_devices: bool = False
    _costers: dict[tuple[int, ShardingMode], LayerCoster] = field(default_factory=dict)
    #: Computed on first use and shared by every coster (see layer_structure).
    _structure: LayerStructure | None = None
    #: The graph rescaled to each micro-batch count's micro-batch, shared by modes.
    _graphs: dict[int, OpGraph] = field(default_factory=dict)
    #: Where rematerialised layers are cut into block parts, shared by every coster.
    _cutter: PieceCutter | None = None
    #: Each count's ILP precomputation, shared by its modes' costers (the same op
    #: tables; ZeRO-2 builds data parallel's models, ``intra_op.model.built_as``).
    _solve_contexts: dict[int, SolveContext] = field(default_factory=dict)
    #: Lends its op tables to every count's context (kept by ``reset_costers``).
    _table_root: SolveContext | None = None
    #: Solutions of earlier searches of this graph on other clusters (what-if
    #: planning): each coster starts with those its cluster can use.
    shared: SharedSolutions | None = None

    def coster(self, num_micro_batches: int, mode: ShardingMode) -> LayerCoster:
        key = (num_micro_batches, mode)
        if key not in self._costers:
            if self._structure is None:
                self._structure = layer_structure(self.graph, self.layers)
            if num_micro_batches not in self._graphs:
                self._graphs[num_micro_batches] = with_batch_size(
                    self.graph, self.graph.batch_size // num_micro_batches)
            micro = self._graphs[num_micro_batches]
            self._costers[key] = LayerCoster(
                graph=micro,
                structure=self._structure,
                cutter=self.cutter(),
                layers=self.layers,
                cluster=self.cluster,
                calibration=self.calibration,
                mode=mode,
                num_micro_batches=num_micro_batches,
                time_limit_s=self.time_limit_s,
                counter=self.counter,
                on_solve=self._tick,
                shared_context=functools.partial(self._solve_context, num_micro_batches),
            )
            if self.shared is not None:
                self.shared.seed(self._costers[key])
        return self._costers[key]

    def cutter(self) -> PieceCutter:
        """Where rematerialised layers are cut into block parts, shared by every coster
        (with the cuts of earlier searches of this graph, where shared)."""
        if self._cutter is None:
            self._cutter = PieceCutter(self.graph, self.layers)
            if self.shared is not None:
                self._cutter.absorb(self.shared.cuts)
        return self._cutter

    def _solve_context(self, num_micro_batches: int) -> SolveContext:
        if num_micro_batches not in self._solve_contexts:
            if self._table_root is None:
                self._table_root = SolveContext(self.graph, max_models=0)
            self._solve_contexts[num_micro_batches] = SolveContext(
                self._graphs[num_micro_batches], max_models=32, like=self._table_root)
        return self._solve_contexts[num_micro_batches]

    def costers(self) -> dict[tuple[int, ShardingMode], LayerCoster]:
        """The per-(micro-batch count, mode) ILP caches built so far."""
        return dict(self._costers)

    def reset_costers(self) -> None:
        """Forget the ILP caches (a copy of this context starts afresh)."""
        self._costers = {}
        self._solve_contexts = {}

    def drop_solve_contexts(self) -> None:
        """Free the ILP precomputation (hundreds of MB of build caches), not the solutions."""
        for coster in self._costers.values():
            coster.drop_solve_context()
        self._solve_contexts = {}
        self._table_root = None

    def piece_cuts(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Where rematerialised layers are cut into block parts, as chosen so far
        (:meth:`~.remat_pieces.PieceCutter.cuts`)."""
        return self._cutter.cuts() if self._cutter is not None else {}

    def adopt(self, caches: dict[tuple[int, ShardingMode], CosterCaches],
              counter: SolveCounter,
              cuts: dict[tuple[int, int], tuple[int, ...]] | None = None) -> None:
        """Take over ILP solutions, block-part cuts and a tally found elsewhere (in a
        worker process): choosing a cut analyses hundreds of pieces of every layer
        class (GPT-2.6B: 0.9 s), which this process then need not repeat."""
        if cuts:
            self.cutter().absorb(cuts)
        for (count, mode), found in caches.items():
            self.coster(count, mode).absorb(found)
        self.counter.solves += counter.solves
        self.counter.seconds += counter.seconds
        self.counter.max_variables = max(self.counter.max_variables, counter.max_variables)
        self.counter.solver = counter.solver or self.counter.solver
        self.counter.dp_calls += counter.dp_calls
        self.counter.dp_seconds += counter.dp_seconds

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress("solving intra-op ILPs", self.counter.solves, None)

    def in_flight(self, stage_index: int, num_stages: int, num_micro_batches: int) -> int:
        """Micro-batches whose activations a stage holds at its peak."""
        if self.schedule is Schedule.GPIPE:
            return num_micro_batches
        return min(num_stages - stage_index, num_micro_batches)

    def shapes(self, submesh: Submesh) -> list[Shape]:
        """The logical meshes tried on ``submesh`` (a pruned :func:`logical_mesh_shapes`).

        Inside one node both axes have the same bandwidth, so (a, b) and (b, a) cost the
        same up to relabelling: only a ≤ b is kept. Across nodes the inner axis stays
        inside a node (b divides M), plus the flat 1-D mesh (1, n·M); an inner axis
        straddling nodes is never faster than one that does not.
        Example: (1, 8) -> (1, 8), (2, 4); (2, 8) -> (1, 16), (2, 8), (4, 4), (8, 2).
        """
        n, m = submesh
        per_node = self.cluster.devices_per_node
        shapes = []
        for a, b in logical_mesh_shapes(submesh):
            if n == 1 and a > b:
                continue
            if n > 1 and a > 1 and per_node % b:
                continue
            shapes.append((a, b))
        return shapes

    def submeshes(self) -> list[Submesh]:
        """Submesh shapes offered to the DP: Alpa's (1, 2^k) and (n, M), with n
        dividing N (a stage of 3 nodes out of 8 is rarely worth its ILPs)."""
        nodes = self.cluster.num_nodes
        return [
            (n, m)
            for n, m in submesh_choices(nodes, self.cluster.devices_per_node)
            if n == 1 or nodes % n == 0
        ]


def micro_batch_candidates(graph: OpGraph, fixed: int | None, limit: int = 64) -> list[int]:
    """Every divisor B ≤ ``limit`` of the batch for which the graph rescales to
    batch / B (a batch of 1520 has 1, 2, 4, 5, 8, 10, 16, 19, 20, 38, 40).

    A fixed ``numMicroBatches`` is checked the same way.
    """
    candidates = [fixed] if fixed is not None else [
        b for b in range(1, limit + 1) if graph.batch_size % b == 0]
    return [
        count for count in candidates
        if graph.batch_size % count == 0
        and batch_size_problem(graph, graph.batch_size // count) is None
    ]


def evaluate_stages(
    context: CostContext,
    requests: Sequence[StageRequest],
    num_micro_batches: int,
    mode: ShardingMode,
    name: str,
) -> Candidate | None:
    """Cost a fixed list of stages exactly; None if some stage cannot fit memory.

    Where a request leaves the logical mesh or memory level open, each stage takes the
    fastest (latency + update / B) choice that fits with its in-flight micro-batches.
    """
    coster = context.coster(num_micro_batches, mode)
    stages = []
    for index, request in enumerate(requests):
        in_flight = context.in_flight(index, len(requests), num_micro_batches)
        shapes = [request.shape] if request.shape else context.shapes(request.submesh)
        # The fastest level that fits; leaner tiers only when nothing before fits.
        tiers = [(request.level,)] if request.level is not None else list(LEVEL_TIERS)
        best: StageEval | None = None
        for levels in tiers:
            for level in levels:
                for shape in shapes:
                    stage = coster.evaluate_stage(
                        request.first, request.last, request.submesh, shape, level, in_flight
                    )
                    if stage.peak_memory > context.memory_budget:
                        continue
                    key = stage.seconds + stage.update / num_micro_batches
                    if best is None or key < best.seconds + best.update / num_micro_batches:
                        best = stage
            if best is not None:
                break
        if best is None:
            return None
        stages.append(best)
    return Candidate(name, mode, num_micro_batches, tuple(stages),
                     pipeline_step_seconds(context.cluster, stages, num_micro_batches,
                                           context.calibration))


@dataclass(frozen=True)
class StageOption:
    """How a DP choice runs a layer range: its submesh, logical mesh and memory level."""

    submesh: Submesh
    shape: Shape
    level: int


def dp_tables(
    context: CostContext, coster: LayerCoster, num_micro_batches: int, devices: Sequence[Submesh],
    link: Link | None = None,
) -> tuple[np.ndarray, np.ndarray, list[list[list[StageOption | None]]], list[int]]:
    """compute_cost, max_n_succ_stages and the choice behind every entry; stages
    receive their inputs on ``link`` (default: the cluster's own, ``LayerCoster.own_link``).

    Two DP choices per submesh: index 2s is the fastest option of each range, 2s + 1
    the option that allows the most later stages (least memory).
    """
    n = coster.num_layers
    num_choices = 2 * len(devices)
    cost = np.full((n, n, num_choices), np.inf)
    succ = np.full((n, n, num_choices), -1, dtype=np.int64)
    origin: list[list[list[StageOption | None]]] = [
        [[None] * num_choices for _ in range(n)] for _ in range(n)
    ]
    for s, submesh in enumerate(devices):
        fastest, roomy = _submesh_tables(context, coster, num_micro_batches, submesh, link)
        for k, table in ((2 * s, fastest), (2 * s + 1, roomy)):
            cost[:, :, k] = table.cost
            succ[:, :, k] = table.succ
            for (i, j), choice in table.origin.items():
                origin[i][j][k] = choice
    sizes = [n_ * m for n_, m in devices for _ in range(2)]
    return cost, succ, origin, sizes


@dataclass
class _Table:
    """One DP choice of one submesh: per range, its cost, how many later stages it
    leaves room for (-1: does not fit), and the option behind it."""

    cost: np.ndarray
    succ: np.ndarray
    origin: dict[tuple[int, int], StageOption] = field(default_factory=dict)

    def take(self, where: np.ndarray, cost: np.ndarray, succ: np.ndarray,
             choice: StageOption) -> None:
        self.cost = np.where(where, cost, self.cost)
        self.succ = np.where(where, succ, self.succ)
        for i, j in zip(*np.nonzero(where), strict=True):
            self.origin[(int(i), int(j))] = choice


def _submesh_tables(
    context: CostContext, coster: LayerCoster, num_micro_batches: int, submesh: Submesh,
    link: Link | None = None,
) -> tuple[_Table, _Table]:
    """The fastest and the roomiest option of every layer range on ``submesh``, over
    its logical meshes and memory levels (leaner levels only while some single layer
    does not fit). Submeshes are independent, so their ILPs may be solved apart
    (:func:`warm_submeshes`)."""
    n = coster.num_layers
    upper = np.triu(np.ones((n, n), dtype=bool))
    fastest = _Table(np.full((n, n), np.inf), np.full((n, n), -1, dtype=np.int64))
    roomy = _Table(np.full((n, n), np.inf), np.full((n, n), -1, dtype=np.int64))
    for level in (level for tier in LEVEL_TIERS for level in tier):
        if level > 0 and _fits_everywhere(fastest.succ, n):
            break  # every range already fits: no need for leaner (slower) levels
        for shape in context.shapes(submesh):
            seconds, update, weight, act = coster.range_table(submesh, shape, level, link)
            dp_cost = seconds + update / num_micro_batches
            n_succ = _max_successors(
                weight, act, context.memory_budget, num_micro_batches, context, n
            )
            n_succ = np.where(upper, n_succ, -1)
            ok = n_succ >= 0
            better = ok & (dp_cost < fastest.cost)
            roomier = ok & (
                (n_succ > roomy.succ) | ((n_succ == roomy.succ) & (dp_cost < roomy.cost))
            )
            choice = StageOption(submesh, shape, level)
            fastest.take(better, dp_cost, n_succ, choice)
            roomy.take(roomier, dp_cost, n_succ, choice)
    return fastest, roomy


def warm_submeshes(
    context: CostContext,
    num_micro_batches: int,
    submeshes: Sequence[Submesh],
    mode: ShardingMode = ShardingMode.AUTO,
) -> None:
    """Solve the ILPs that the DP of ``num_micro_batches`` needs on ``submeshes``
    (they fill the coster's caches; :func:`dp_candidate` then only reads them). Lets
    one micro-batch count's ILPs be shared among processes, by submesh."""
    coster = context.coster(num_micro_batches, mode)
    for submesh in submeshes:
        _submesh_tables(context, coster, num_micro_batches, submesh)


def _fits_everywhere(n_succ: np.ndarray, n: int) -> bool:
    """True when every single-layer stage fits with every possible number of later
    stages: then leaner (slower, or costlier to solve) memory levels are not needed.

    Only single layers are checked: long ranges on small submeshes never fit at any
    level, and would otherwise always send the search to the expensive tiers.
    """
    diagonal = np.diagonal(n_succ)
    needed = (n - 1) - np.arange(n)  # stages that can follow a stage ending at layer j
    return bool(np.all(diagonal >= needed))


def _max_successors(
    weight: np.ndarray,
    act: np.ndarray,
    budget: float,
    num_micro_batches: int,
    context: CostContext,
    n: int,
) -> np.ndarray:
    """How many stages may follow a stage (weights ``weight``, activations ``act``).

    1F1B: a stage with k followers holds min(k + 1, B) micro-batches, so
    k ≤ floor((budget − weight) / act) − 1, unbounded when B micro-batches fit.
    GPipe: all B micro-batches, whatever k.
    """
    room = budget - weight
    with np.errstate(divide="ignore", invalid="ignore"):
        fits_all = weight + num_micro_batches * act <= budget
        if context.schedule is Schedule.GPIPE:
            return np.where(fits_all, n, -1)
        count = np.floor(np.where(act > 0, room / np.maximum(act, 1e-30), n + 1)) - 1
    count = np.where(fits_all, n, np.minimum(count, n))
    return np.where(room < 0, -1, count).astype(np.int64)


def device_counts(context: CostContext) -> list[int]:
    """How many devices a plan may use: all of them (Alpa's rule: the devices are
    independent, an idle one only idles), or on one shared host (forced CPU devices)
    all of them or one. One device pays no collectives and no other device's kernel
    costs out of the same cores, but reaches less of the host
    (:func:`~alpajob.planner.cost.model.host_utilization`); either may be faster.

    Counts in between were tried and measured (benchmarks/device_counts.py): the
    cost model's error on their uneven pipelines is larger than what separates them
    (the README job's pick, a 1x1 + 1x4 pipeline of 2 micro-batches, was predicted
    fastest and measured 1.18x its prediction, slower than one device), so the
    search keeps to the two ends. ``context.all_devices`` keeps Alpa's rule; several
    hosts (CPU pods) keep it too: each is a pod the job asked for."""
    cluster = context.cluster
    total = cluster.num_devices
    if cluster.shared_host and cluster.num_nodes == 1 and not context.all_devices:
        return sorted({1, total})
    return [total]


def _dp_settings(context: CostContext, num_layers: int,
                 num_stages: int | None) -> list[tuple[int, int | None]]:
    """The (device count, stage count) pairs to run the DP with (:func:`dp_candidate`).
    On a shared host each stage count is a DP of its own (the busy devices depend on
    it); elsewhere None leaves it to the DP."""
    shared = context.cluster.shared_host
    return [(count, stages) for count in device_counts(context)
            for stages in ([num_stages] if num_stages or not shared
                           else range(1, min(num_layers, count) + 1))]


def dp_candidate(
    context: CostContext,
    num_micro_batches: int,
    *,
    min_stages: int = 1,
    mode: ShardingMode = ShardingMode.AUTO,
    name: str = "alpajob",
    mask: Callable[[np.ndarray], np.ndarray] | None = None,
    num_stages: int | None = None,
) -> Candidate | None:
    """The inter-op DP's plan for ``num_micro_batches``, evaluated exactly.

    With independent devices: one DP over every device (Alpa's). On a shared host the
    stage costs depend on how many devices are busy at once (:func:`~.step_time.busy_devices`),
    which depends on the plan's device count and stage count: one DP per device count
    it may use (:func:`device_counts`) and stage count (one DP is a few milliseconds
    there), on the same tables, and the fastest plan.

    ``mask`` may set entries of compute_cost to inf (the equal-layer/operator
    ablations); ``min_stages`` = 2 forbids the single-stage plan (pipeshard).
    """
    coster = context.coster(num_micro_batches, mode)
    devices = context.submeshes()
    cost, succ, origin, sizes = dp_tables(context, coster, num_micro_batches, devices)
    if min_stages > 1:
        cost[0, coster.num_layers - 1, :] = np.inf
    if mask is not None:
        cost = mask(cost)
    found: list[Candidate | None] = []
    seen: set[tuple[StageRequest, ...]] = set()
    for count, stage_count in _dp_settings(context, coster.num_layers, num_stages):
        dp_cost, dp_micro_batches = cost, num_micro_batches
        if context.cluster.shared_host and stage_count is not None:
            dp_cost = shared_host_costs(context.cluster, context.calibration, cost, sizes,
                                        num_micro_batches, count, stage_count)
            dp_micro_batches = 1
        start = time.perf_counter()
        result = stage_dp(dp_cost, succ, sizes, count, dp_micro_batches, num_stages=stage_count)
        context.counter.dp_calls += 1
        context.counter.dp_seconds += time.perf_counter() - start
        if result is None:
            continue
        requests = _stage_requests(result, origin)
        if requests not in seen:
            seen.add(requests)
            found.append(evaluate_stages(context, requests, num_micro_batches, mode, name))
    return best_of(found)


def _stage_requests(result: DPResult, origin: list[list[list[StageOption | None]]]
                    ) -> tuple[StageRequest, ...]:
    """The DP's stages with the submesh, logical mesh and memory level behind each."""
    requests = []
    for stage in result.stages:
        choice = origin[stage.start_layer][stage.end_layer - 1][stage.submesh_index]
        assert choice is not None, "the DP chose a range with no costed option"
        requests.append(StageRequest(stage.start_layer, stage.end_layer - 1, choice.submesh,
                                     choice.shape, choice.level))
    return tuple(requests)


def best_of(candidates: Sequence[Candidate | None]) -> Candidate | None:
    """The fastest candidate (ties: fewer stages, then fewer micro-batches)."""
    found = [c for c in candidates if c is not None]
    if not found:
        return None
    return min(found, key=lambda c: (c.step_seconds, len(c.stages), c.num_micro_batches))
