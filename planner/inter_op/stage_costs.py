"""Costing pipeline stages from per-layer intra-op solutions.

The inter-op DP needs, for every layer range i..j and submesh, the latency of that
stage. Alpa compiles and profiles every candidate; we compose it from ILP solutions:

1. Layers with the same structure (:func:`~alpajob.planner.graph.opgraph.subgraph_signature`)
   form a class; the intra-op ILP is solved once per (class, logical mesh, memory
   level, input layouts) and the solution is reused for every layer of the class (a
   transformer's layers are identical: one or two solves serve all of them).
2. Layers are chained: each layer's ILP knows the spec every input has in the
   solution of the earlier layer that produces it, and pays the resharding when it
   chooses another (so a dense layer after an MoE layer agrees on the layout between
   them, instead of each picking its own best and paying for the mismatch unseen).
   A stage's latency is the sum of its layers' latencies, plus the resharding of the
   gradients flowing back between its layers where their solutions disagree, plus the
   point-to-point transfer of the tensors that enter it from the previous stage
   (activations forward, gradients backward), per micro-batch. A shared parameter
   (a tied embedding) is not an activation: a value made from parameters alone is
   recomputed by the stage that reads it, and its partial gradients are summed
   locally and sent home once per step, so those crossings cost one transfer per
   step to the stage that receives them (:meth:`LayerCoster.step_transfer_table`).
   The first layer of a stage is still
   charged the resharding from its predecessor's layout, which the transfer from the
   previous mesh makes moot: a small overestimate.
3. Memory: weights (params, grads, optimizer state) plus activations per in-flight
   micro-batch. Eight memory levels per layer (:data:`MEMORY_LEVELS`): the fastest
   solution; the ILP minimising memory first; and each of the two rematerialised,
   by whole layers (only the layer's inputs kept between forward and backward, one
   extra forward, and one layer's residuals live while its backward recomputes it)
   or by block parts, two cuttings (:mod:`.remat_pieces`: each part's inputs kept,
   one part's residuals live at a time). Every level also holds the backward working set of
   one layer (or part). A stage takes the fastest level that fits.

All sums are prefix sums, so the cost of any range i..j is O(1) once the per-layer
arrays of a mesh are built.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.cost.model import Calibration, LogicalMesh, make_logical_mesh
from alpajob.planner.graph.opgraph import OpGraph, Phase
from alpajob.planner.inter_op.layer_structure import LayerStructure, layer_structure
from alpajob.planner.inter_op.remat_pieces import LayerPieces, PieceCutter, layer_pieces
from alpajob.planner.intra_op.sharding import ShardSpec, resharding_seconds, shard_factor
from alpajob.planner.intra_op.solve import IntraOpResult, ShardingMode, SolveContext, solve_intra_op


@dataclass(frozen=True)
class MemoryLevel:
    """How hard a layer's solution tries to save memory.

    ``memory_weight`` is the ILP's objective weight on memory (seconds per byte):
    0 is the fastest sharding; 1e-9 s/byte makes a GiB cost about a second, so the
    ILP minimises memory first. ``remat`` rematerialises the layer (Alpa's
    ``use_remat``): only its input activations are kept per in-flight micro-batch; its
    forward runs again before its backward, and its full residuals are live for one
    micro-batch at a time. The runtime recomputes a rematerialised stage one layer at
    a time, each layer's recomputation waiting for its cotangent
    (:mod:`alpajob.trainer_image.runtime.remat`), so a stage's transient is its
    largest layer's: the layer's working set while its backward runs (every level),
    plus its residuals (rematerialised). Measured (``benchmarks/remat_memory.py``,
    XLA on CPU): the rematerialised backward of 1, 2, 4, 8 GPT layers holds 13.9,
    15.8, 15.8, 15.8 MB, where the planner charges 15.8 MB; one ``jax.checkpoint``
    around the stage held 13.9, 21.8, 37.5, 69.0 MB (XLA recomputed every layer first).
    """

    memory_weight: float
    remat: bool
    #: Rematerialised in block parts (:mod:`.remat_pieces`) rather than whole layers
    #: when above 0: each part's inputs are kept, and one part's residuals are live at
    #: a time; the parts are chosen for a stage that keeps ``parts`` copies of them.
    parts: int = 0


#: Levels in the order a stage tries them: the fastest sharding; the same sharding
#: rematerialised by whole layers or by block parts, cut for many kept copies or for
#: one (no new ILP solve; the same time, so whole layers win where they fit); then the
#: memory-minimising sharding (new solves), plain and rematerialised all three ways.
MEMORY_LEVELS: tuple[MemoryLevel, ...] = (
    MemoryLevel(0.0, False),
    MemoryLevel(0.0, True),
    MemoryLevel(0.0, True, parts=8),
    MemoryLevel(0.0, True, parts=1),
    MemoryLevel(1e-9, False),
    MemoryLevel(1e-9, True),
    MemoryLevel(1e-9, True, parts=8),
    MemoryLevel(1e-9, True, parts=1),
)

#: Groups of levels: a group is only tried when no level of the groups before fits.
LEVEL_TIERS: tuple[tuple[int, ...], ...] = ((0,), (1, 2, 3), (4, 5, 6, 7))

Submesh = tuple[int, int]
Shape = tuple[int, int]
#: (latency in seconds, bandwidth in bytes per second) of a point-to-point link.
Link = tuple[float, float]


@dataclass
class SolveCounter:
    """Tally of ILP work, reported in the plan's solver stats."""

    solves: int = 0
    seconds: float = 0.0
    max_variables: int = 0
    solver: str = ""
    dp_calls: int = 0
    dp_seconds: float = 0.0

    def add(self, result: IntraOpResult, seconds: float) -> None:
        self.solves += 1
        self.seconds += seconds
        stats = result.stats
        self.max_variables = max(self.max_variables, int(getattr(stats, "num_variables", 0) or 0))
        self.solver = str(getattr(stats, "solver", self.solver))


@dataclass(frozen=True)
class MeshLayerArrays:
    """Per-layer figures of every layer on one (submesh, logical shape, level)."""

    seconds: np.ndarray  # forward+backward per micro-batch, incl. intra-layer comm
    compute: np.ndarray
    comm: np.ndarray
    update: np.ndarray  # per step
    weight: np.ndarray  # bytes per device
    activation: np.ndarray  # bytes per device per in-flight micro-batch
    transient: np.ndarray  # bytes live during one layer's backward (its working set; remat's residuals)
    inner_reshard: np.ndarray  # [L, L] resharding seconds of tensors passing a -> b


@dataclass(frozen=True)
class StageEval:
    """One stage of a candidate plan, with its exact predicted figures."""

    first: int  # first layer
    last: int  # last layer, inclusive
    submesh: Submesh
    shape: Shape
    level: int
    seconds: float  # per micro-batch, including the transfer of its inputs
    compute: float
    comm: float
    transfer: float
    update: float
    weight_bytes: float
    activation_bytes: float
    transient_bytes: float
    in_flight: int

    @property
    def remat(self) -> bool:
        return MEMORY_LEVELS[self.level].remat

    @property
    def remat_parts(self) -> bool:
        """Rematerialised by block parts (:mod:`.remat_pieces`), not whole layers."""
        return MEMORY_LEVELS[self.level].parts > 0

    @property
    def peak_memory(self) -> float:
        """Weights, the activations of every in-flight micro-batch, and the largest
        transient (a layer's backward working set, plus its residuals if
        rematerialised)."""
        return self.weight_bytes + self.in_flight * self.activation_bytes + self.transient_bytes


@dataclass(frozen=True)
class CosterCaches:
    """A :class:`LayerCoster`'s solutions: ILP results per (class, mesh, memory weight,
    input hints), per (layer, mesh, memory weight), and per-mesh layer arrays."""

    results: dict[tuple, IntraOpResult]
    layer_results: dict[tuple[int, Submesh, Shape, float], IntraOpResult]
    arrays: dict[tuple[Submesh, Shape, int], MeshLayerArrays]

    def take(self, found: CosterCaches) -> None:
        """Add the entries of ``found`` that these lack (solutions of the same ILPs)."""
        for key, result in found.results.items():
            self.results.setdefault(key, result)
        for layer_key, layer_result in found.layer_results.items():
            self.layer_results.setdefault(layer_key, layer_result)
        for mesh_key, arrays in found.arrays.items():
            self.arrays.setdefault(mesh_key, arrays)


@dataclass
class LayerCoster:
    """Intra-op solutions of every layer at one micro-batch size, and stage costs.

    ``graph`` must already be rescaled to the micro-batch size; ``layers`` holds the op
    ids of each clustered layer.
    """

    graph: OpGraph
    layers: Sequence[Sequence[int]]
    cluster: ClusterSpec
    calibration: Calibration
    mode: ShardingMode
    num_micro_batches: int
    time_limit_s: float
    counter: SolveCounter
    on_solve: Callable[[], None] | None = None
    #: Layer classes, tensor orders and crossings; computed from ``graph`` when None
    #: (a plan search shares one among all its costers).
    structure: LayerStructure | None = None
    #: Where block parts are cut (:mod:`.remat_pieces`); one on ``graph`` when None
    #: (a plan search shares one, on the graph at the global batch).
    cutter: PieceCutter | None = None
    _results: dict[tuple, IntraOpResult] = field(default_factory=dict)
    _layer_results: dict[tuple[int, Submesh, Shape, float], IntraOpResult] = field(
        default_factory=dict
    )
    #: Where the ILP precomputation comes from (:meth:`solve_context`): a plan search
    #: shares one per micro-batch count among its sharding modes; None makes its own.
    shared_context: Callable[[], SolveContext] | None = None
    #: Shared precomputation of every ILP build on this graph (op tables, models);
    #: results are identical without it. Dropped before a coster leaves its process.
    _solve_context: SolveContext | None = None
    _arrays: dict[tuple[Submesh, Shape, int], MeshLayerArrays] = field(default_factory=dict)
    #: Block parts of each layer class' representative per kept copies
    #: (:mod:`.remat_pieces`), and their bytes per (class, mesh, level).
    _pieces: dict[tuple[int, int], LayerPieces] = field(default_factory=dict)
    _part_cache: dict[tuple[int, Submesh, Shape, int], tuple[float, float]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        structure = self.structure or layer_structure(self.graph, self.layers)
        self.structure = structure
        self.layer_class = structure.layer_class
        self.representative = structure.representative
        self._orders = structure.orders
        self._position = structure.position
        self._crossings = structure.crossings
        # Values made from parameters alone and partial gradients of shared parameters
        # cross once per step (a stage recomputes the former from the shared parameter;
        # the latter are summed locally, then sent home): see step_transfer_table.
        self._step_crossings = [c for c in self._crossings if c[0] in structure.step_wise]
        # Bytes crossing the cut before each layer per micro-batch (a tensor passing
        # several cuts counts at each): fixed by the graph, so computed once.
        self._boundary_bytes = np.zeros(self.num_layers + 1)
        for tensor, src, dst in self._crossings:
            if tensor in structure.step_wise:
                continue
            low, high = min(src, dst), max(src, dst)
            self._boundary_bytes[low + 1 : high + 1] += self.graph.tensors[tensor].nbytes
        self._step_tables: dict[Link, np.ndarray] = {}  # per link (:meth:`step_transfer_table`)
        self._incoming = structure.incoming
        forward = np.zeros(self.num_layers)
        backward = np.zeros(self.num_layers)
        for index, ops in enumerate(self.layers):
            for op_id in ops:
                op = self.graph.ops[op_id]
                if op.phase is Phase.FORWARD:
                    forward[index] += op.flops
                elif op.phase is Phase.BACKWARD:
                    backward[index] += op.flops
        self._forward_share = np.divide(
            forward, forward + backward, out=np.zeros_like(forward), where=forward + backward > 0
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_classes(self) -> int:
        return len(self.representative)

    def mesh(self, submesh: Submesh, shape: Shape) -> LogicalMesh:
        return make_logical_mesh(self.cluster, submesh, shape, self.calibration)

    def result(self, layer: int, submesh: Submesh, shape: Shape, level: int) -> IntraOpResult:
        """The ILP solution of ``layer`` on a logical mesh, chained to the layers before.

        The layer's ILP is told the spec each of its inputs has in the solutions of the
        earlier layers that produce it (``input_hints``), and pays for choosing another.
        The solve is cached per (layer class, mesh, memory weight, hints): a stack of
        identical layers reaches a fixed point (same hints in, same specs out) after one
        or two solves, and every later layer reuses it.
        """
        weight = MEMORY_LEVELS[level].memory_weight
        key = (layer, submesh, shape, weight)
        if key in self._layer_results:
            return self._layer_results[key]
        cls = self.layer_class[layer]
        rep = self.representative[cls]
        hints = {}
        for tensor, src in self._incoming[layer]:
            spec = self.spec(src, tensor, submesh, shape, level)
            if spec is not None:
                hints[self._orders[rep][self._position[layer][tensor]]] = spec
        solve_key = (cls, submesh, shape, weight, tuple(sorted(hints.items())))
        if solve_key not in self._results:
            start = time.perf_counter()
            result = solve_intra_op(
                self.graph,
                sorted(self.layers[rep]),
                self.mesh(submesh, shape),
                self.cluster.device,
                self.calibration,
                mode=self.mode,
                num_micro_batches=self.num_micro_batches,
                memory_weight=weight,
                time_limit_s=self.time_limit_s,
                input_hints=hints,
                context=self.solve_context(),
            )
            self.counter.add(result, time.perf_counter() - start)
            self._results[solve_key] = result
            if self.on_solve is not None:
                self.on_solve()
        self._layer_results[key] = self._results[solve_key]
        return self._layer_results[key]

    def spec(
        self, layer: int, tensor: int, submesh: Submesh, shape: Shape, level: int
    ) -> ShardSpec | None:
        """The sharding layer ``layer``'s solution gives ``tensor`` (mapped from its class)."""
        result = self.result(layer, submesh, shape, level)
        rep = self.representative[self.layer_class[layer]]
        position = self._position[layer].get(tensor)
        if position is None:
            return None
        return result.specs.get(self._orders[rep][position])

    def _input_bytes(self, layer: int, submesh: Submesh, shape: Shape, level: int) -> float:
        """Per-device bytes of the forward activations entering ``layer`` (what a
        rematerialised layer keeps per in-flight micro-batch)."""
        mesh = self.mesh(submesh, shape)
        total = 0.0
        for tensor, src, dst in self._crossings:
            if dst != layer or src > dst:
                continue
            spec = self.spec(layer, tensor, submesh, shape, level)
            factor = shard_factor(spec, mesh) if spec is not None else 1
            total += self.graph.tensors[tensor].nbytes / factor
        return total

    def pieces(self, layer: int, keep: int) -> LayerPieces:
        """The block parts of ``layer``'s class chosen for ``keep`` kept copies, as cut
        in its representative (:class:`~.remat_pieces.PieceCutter`; the other layers
        of the class are cut at the same forward positions, ``.cut``)."""
        cls = self.layer_class[layer]
        if (cls, keep) not in self._pieces:
            if self.cutter is None:
                self.cutter = PieceCutter(self.graph, self.layers)
            rep = self.representative[cls]
            cut = self.cutter.cut(rep, keep)
            self._pieces[(cls, keep)] = layer_pieces(
                self.graph, self.layers[rep], cut, self.solve_context().index
            )
        return self._pieces[(cls, keep)]

    def _part_bytes(self, layer: int, submesh: Submesh, shape: Shape, level: int) -> tuple[float, float]:
        """(transient, inner kept) bytes per device of ``layer`` rematerialised by block
        parts: the largest part's residuals plus its backward working set, and the
        values a later part keeps from an earlier one, sharded as the class' solution
        shards them."""
        cls = self.layer_class[layer]
        key = (cls, submesh, shape, level)
        if key not in self._part_cache:
            rep = self.representative[cls]
            result = self.result(rep, submesh, shape, level)
            mesh = self.mesh(submesh, shape)

            def size(t: int) -> float:
                spec = result.specs.get(t)
                return self.graph.tensors[t].nbytes / (shard_factor(spec, mesh) if spec else 1)

            pieces = self.pieces(layer, MEMORY_LEVELS[level].parts)
            self._part_cache[key] = pieces.memory(size)
        return self._part_cache[key]

    def solve_context(self) -> SolveContext:
        """The graph's shared ILP precomputation (created, or taken from
        ``shared_context``, on first use)."""
        if self._solve_context is None:
            self._solve_context = (self.shared_context() if self.shared_context is not None
                                   else SolveContext(self.graph, max_models=32))
        return self._solve_context

    def caches(self) -> CosterCaches:
        """The solutions found so far (to send to another process)."""
        return CosterCaches(self._results, self._layer_results, self._arrays)

    def absorb(self, caches: CosterCaches) -> None:
        """Take the solutions another coster of the same graph, mode and micro-batch
        count found (in another process) that this one lacks."""
        self.caches().take(caches)

    def drop_solve_context(self) -> None:
        """Free the ILP precomputation (before pickling this coster to another process)."""
        self._solve_context = None

    def from_representative(self, layer: int, tensor: int) -> int | None:
        """The tensor of ``layer`` that plays the role of ``tensor`` in its class' solved layer."""
        rep = self.representative[self.layer_class[layer]]
        position = self._position[rep].get(tensor)
        if position is None or position >= len(self._orders[layer]):
            return None
        return self._orders[layer][position]

    def arrays(self, submesh: Submesh, shape: Shape, level: int) -> MeshLayerArrays:
        """Per-layer figures on one logical mesh (solving each layer class once)."""
        key = (submesh, shape, level)
        if key not in self._arrays and MEMORY_LEVELS[level].parts > 0:
            # The same solutions as rematerialising whole layers, with other memory.
            whole = MEMORY_LEVELS.index(dataclasses.replace(MEMORY_LEVELS[level], parts=0))
            parts = np.array([self._part_bytes(k, submesh, shape, level)
                              for k in range(self.num_layers)]).reshape(-1, 2)
            base = self.arrays(submesh, shape, whole)
            self._arrays[key] = dataclasses.replace(
                base, transient=parts[:, 0], activation=base.activation + parts[:, 1]
            )
        if key not in self._arrays:
            results = [self.result(k, submesh, shape, level) for k in range(self.num_layers)]
            inner = np.zeros((self.num_layers, self.num_layers))
            mesh = self.mesh(submesh, shape)
            for tensor, src, dst in self._crossings:
                if src < dst:
                    continue  # charged inside layer dst's ILP (its input hints)
                src_spec = self.spec(src, tensor, submesh, shape, level)
                dst_spec = self.spec(dst, tensor, submesh, shape, level)
                if src_spec is None or dst_spec is None or src_spec == dst_spec:
                    continue
                info = self.graph.tensors[tensor]
                inner[src, dst] += resharding_seconds(
                    info.shape, info.dtype, src_spec, dst_spec, mesh
                )
            compute = np.array([r.compute_seconds for r in results])
            comm = np.array([r.comm_seconds for r in results])
            activation = np.array([float(r.activation_bytes) for r in results])
            transient = np.array([r.working_bytes for r in results])  # the backward's own
            if MEMORY_LEVELS[level].remat:
                # One more forward: the forward share of the layer's work, by FLOPs.
                compute = compute * (1 + self._forward_share)
                comm = comm * (1 + self._forward_share)
                transient = transient + activation
                activation = np.array(
                    [self._input_bytes(k, submesh, shape, level) for k in range(self.num_layers)]
                )
            self._arrays[key] = MeshLayerArrays(
                seconds=compute + comm,
                compute=compute,
                comm=comm,
                update=np.array([r.update_seconds for r in results]),
                weight=np.array([float(r.weight_bytes) for r in results]),
                activation=activation,
                transient=transient,
                inner_reshard=inner,
            )
        return self._arrays[key]

    def boundary_bytes(self) -> np.ndarray:
        """bytes[k]: bytes crossing the cut before layer k (both directions) per micro-batch."""
        return self._boundary_bytes

    def own_link(self) -> Link:
        """(latency, bandwidth) between two meshes of this cluster: the slower link
        when it has several nodes."""
        cluster = self.cluster
        if cluster.num_nodes > 1:
            return cluster.inter_node_latency, cluster.inter_node_bandwidth
        return cluster.intra_node_latency, cluster.intra_node_bandwidth

    def transfer_seconds(self, nbytes: float, link: Link | None = None) -> float:
        """Point-to-point time of ``nbytes`` between two meshes, on ``link`` (default:
        :meth:`own_link`; a mixed cluster's stages may receive from another pool:
        :mod:`.pools`)."""
        if nbytes <= 0:
            return 0.0
        latency, bandwidth = link or self.own_link()
        return latency + nbytes / bandwidth

    def step_transfer_table(self, link: Link | None = None) -> np.ndarray:
        """[L, L]: per-step seconds a stage of layers i..j spends receiving values that
        cross once per step: each tensor whose producer is outside the range and some
        reader inside arrives once (a shared parameter's copy going out, or a partial
        gradient going home), whatever the number of cuts between (GPT-39B's tied
        embedding gradient, 839 MB, was charged at every cut for every micro-batch)."""
        link = link or self.own_link()
        if link not in self._step_tables:
            n = self.num_layers
            i, j = np.arange(n)[:, None], np.arange(n)[None, :]
            readers: dict[tuple[int, int], list[int]] = {}
            for tensor, src, dst in self._step_crossings:
                readers.setdefault((tensor, src), []).append(dst)
            table = np.zeros((n, n))
            for (tensor, src), dsts in readers.items():
                inside = np.zeros((n, n), dtype=bool)
                for dst in dsts:
                    inside |= (i <= dst) & (dst <= j)
                arrives = inside & ~((i <= src) & (src <= j))
                table += np.where(arrives, self.transfer_seconds(self.graph.tensors[tensor].nbytes, link), 0.0)
            self._step_tables[link] = np.triu(table)
        return self._step_tables[link]

    def crossing_tensors(self, cut: int) -> list[tuple[int, int, int]]:
        """Crossings (tensor, producer layer, consumer layer) that pass the cut before ``cut``."""
        return [c for c in self._crossings if min(c[1], c[2]) < cut <= max(c[1], c[2])]

    def evaluate_stage(
        self,
        first: int,
        last: int,
        submesh: Submesh,
        shape: Shape,
        level: int,
        in_flight: int,
        link: Link | None = None,
    ) -> StageEval:
        """Exact figures of layers first..last (inclusive) as one stage on one mesh,
        receiving on ``link`` (default: :meth:`own_link`)."""
        a = self.arrays(submesh, shape, level)
        span = slice(first, last + 1)
        inner = float(a.inner_reshard[span, span].sum())
        transfer = self.transfer_seconds(self.boundary_bytes()[first], link) if first > 0 else 0.0
        compute = float(a.compute[span].sum())
        comm = float(a.comm[span].sum()) + inner
        return StageEval(
            first=first,
            last=last,
            submesh=submesh,
            shape=shape,
            level=level,
            seconds=compute + comm + transfer,
            compute=compute,
            comm=comm,
            transfer=transfer,
            update=float(a.update[span].sum()) + float(self.step_transfer_table(link)[first, last]),
            weight_bytes=float(a.weight[span].sum()),
            activation_bytes=float(a.activation[span].sum()),
            transient_bytes=float(a.transient[span].max()),
            in_flight=in_flight,
        )

    def range_table(self, submesh: Submesh, shape: Shape, level: int,
                    link: Link | None = None) -> tuple[np.ndarray, ...]:
        """[L, L] tables over ranges i..j: seconds, update, fixed bytes, activation bytes;
        a stage receives on ``link`` (default: :meth:`own_link`).

        Fixed bytes are the weights plus the largest transient (memory that does not
        grow with in-flight micro-batches). Entries with j < i are +inf (seconds) or 0.
        """
        a = self.arrays(submesh, shape, level)
        n = self.num_layers

        def ranged(values: np.ndarray) -> np.ndarray:
            prefix = np.concatenate([[0.0], np.cumsum(values)])
            table = prefix[None, 1:] - prefix[:-1, None]
            return np.where(np.triu(np.ones((n, n), dtype=bool)), table, 0.0)

        # Resharding inside a stage: sum of inner[a, b] over i <= a, b <= j, by 2-D prefix sums.
        cum = np.zeros((n + 1, n + 1))
        cum[1:, 1:] = a.inner_reshard.cumsum(0).cumsum(1)
        i = np.arange(n)[:, None]
        j = np.arange(n)[None, :]
        inner = cum[j + 1, j + 1] - cum[i, j + 1] - cum[j + 1, i] + cum[i, i]
        boundary = self.boundary_bytes()
        transfer = np.array([self.transfer_seconds(boundary[k], link) if k else 0.0 for k in range(n)])
        seconds = ranged(a.compute) + ranged(a.comm) + inner + transfer[:, None]
        upper = np.triu(np.ones((n, n), dtype=bool))
        seconds = np.where(upper, seconds, np.inf)
        # The largest transient of layers i..j: a running maximum along each row.
        transient = np.maximum.accumulate(
            np.where(upper, np.broadcast_to(a.transient[None, :], (n, n)), 0.0), axis=1
        )
        weight = ranged(a.weight) + np.where(upper, transient, 0.0)
        return seconds, ranged(a.update) + self.step_transfer_table(link), weight, ranged(a.activation)


def forward_range(graph: OpGraph, ops: Sequence[int]) -> tuple[int, int]:
    """[first, last+1) of the forward op ids in a layer."""
    forward = [o for o in ops if graph.ops[o].phase is Phase.FORWARD]
    return (min(forward), max(forward) + 1) if forward else (0, 0)
