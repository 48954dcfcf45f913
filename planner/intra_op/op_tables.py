"""Strategy tables of ops, memoised per op structure, for building the sharding ILP.

Building the ILP of a layer (:mod:`alpajob.planner.intra_op.model`) needs, per op,
its strategies (a root op's own, :func:`~alpajob.planner.intra_op.strategies.op_strategies`;
a follower's one per distinct spec of the operand it follows,
:func:`~alpajob.planner.intra_op.follow.follow_strategy`) and what each strategy implies: its
compute and communication seconds, the spec of each output and the spec each input
must arrive in. All of it depends on the op only through its *structure* (primitive,
params, the shape, dtype and batch dim of every input and output, FLOPs and bytes),
and a layer repeats structures: GPT-1.3B's layer of 1,192 ops has about 200 distinct
ones, and every other layer of the stack and every solve on the same mesh repeats
them again. A :class:`TableCache` evaluates each (structure, followed specs) once::

    op ──structure id──► OpTable: strategies; per strategy compute and comm seconds;
                          per input and output a Labels: the distinct specs over the
                          strategies (an interned spec set) and which one each has

A tuple of distinct specs is interned as an int (:meth:`TableCache.spec_set`, hashed
once), so follower tables and the resharding matrices between two spec sets
(:meth:`TableCache.reshard`) are keyed by small ints. A resharding's collectives (its
:func:`~alpajob.planner.intra_op.sharding.reshard_plan`) depend on the two specs alone and
their seconds on the tensor's bytes alone, so a matrix is a tensor-independent matrix
of plan ids, per pair of spec sets, indexing the seconds of each plan at the tensor's
size: each plan is priced once per tensor size, not once per tensor and pair.

Everything is memoised by value: a table or matrix is the same whether it was
computed now or for an earlier op, so the ILP is identical with and without reuse.
A cache holds one graph, mesh, device and calibration; it only grows (a few thousand
small tables per model), and is dropped with the solve or context that owns it. As
everything but tensor sizes by id is by value, a cache rebound to another graph
(:meth:`TableCache.rebound`: the same model at another micro-batch size) shares it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from alpajob.planner.cost.cluster import DeviceSpec
from alpajob.planner.cost.model import Calibration, LogicalMesh, op_fixed_seconds
from alpajob.planner.graph.experts import expert_dims
from alpajob.planner.graph.opgraph import Op, OpGraph, Tensor
from alpajob.planner.intra_op.follow import follow_strategy
from alpajob.planner.intra_op.sharding import (
    ReshardPlan,
    ShardSpec,
    plan_seconds,
    replicated,
    reshard_plan,
    shard_factor,
    tensor_bytes,
    tiling_specs,
)
from alpajob.planner.intra_op.strategies import Strategy, op_base_seconds, op_strategies

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class PerStrategy(Generic[T]):
    """One value per strategy of a node, stored as its distinct ``values`` and an
    ``index`` (``value of strategy i = values[index[i]]``).

    A tensor has a handful of distinct specs across the dozens of strategies of its
    node; working on the distinct ones keeps model building proportional to them.
    """

    values: tuple[T, ...]
    index: np.ndarray

    def __getitem__(self, strategy: int) -> T:
        return self.values[int(self.index[strategy])]

    def __len__(self) -> int:
        return len(self.index)

    def take(self, per_value: Sequence[float]) -> np.ndarray:
        """A per-strategy array from one number per distinct value."""
        return np.asarray(per_value, dtype=float)[self.index]


def distinct(items: Sequence[T], index: np.ndarray | None = None) -> PerStrategy[T]:
    """``items`` (one per strategy, or one per entry of ``index``) deduplicated, in
    order of first appearance."""
    ids: dict[T, int] = {}
    local = np.fromiter((ids.setdefault(item, len(ids)) for item in items), dtype=np.int64,
                        count=len(items))
    return PerStrategy(tuple(ids), local if index is None else local[index])


def data_spec(tensor: Tensor, mesh: LogicalMesh) -> ShardSpec:
    """The data-parallel spec: the batch dim split over every mesh axis (or the
    largest that divides it), everything else replicated."""
    spec: list[tuple[int, ...]] = [()] * len(tensor.shape)
    if tensor.batch_dim is not None:
        active = mesh.active_axes
        options = [active] + sorted(((k,) for k in active), key=lambda a: -mesh.size_of(a))
        for axes in options:
            if axes and tensor.shape[tensor.batch_dim] % mesh.size_of(axes) == 0:
                spec[tensor.batch_dim] = tuple(axes)
                break
    return tuple(spec)


def expert_spec(tensor: Tensor, dim: int, mesh: LogicalMesh) -> ShardSpec:
    """The expert-parallel spec of a tensor whose dimension ``dim`` runs over experts
    (:mod:`~alpajob.planner.graph.experts`): ``dim`` split over every mesh axis, or over the
    largest that divides it; the axes left over split the batch dim as
    :func:`data_spec` would (experts replicated over them, data split)."""
    active = mesh.active_axes
    options = [active] + sorted(((k,) for k in active), key=lambda a: -mesh.size_of(a))
    chosen = next((a for a in options if a and tensor.shape[dim] % mesh.size_of(a) == 0), ())
    spec: list[tuple[int, ...]] = [()] * len(tensor.shape)
    spec[dim] = tuple(chosen)
    rest = tuple(k for k in active if k not in chosen)
    b = tensor.batch_dim
    if rest and b is not None and b != dim and tensor.shape[b] % mesh.size_of(rest) == 0:
        spec[b] = rest
    return tuple(spec)


#: The specs a restricted op should read and write: (inputs, outputs).
Wanted = tuple[tuple[ShardSpec, ...], tuple[ShardSpec, ...]]


def restrict_to(
    strategies: Sequence[Strategy], op: Op, graph: OpGraph, wanted: Wanted
) -> list[Strategy]:
    """The strategies that read and write the ``wanted`` specs (DATA mode: the
    data-parallel ones); else those that at least write them; else the replicated one."""
    ins, outs = (list(specs) for specs in wanted)
    writes = [s for s in strategies if list(s.output_specs) == outs]
    strict = [s for s in writes if list(s.input_specs) == ins]
    if strict or writes:
        return strict or writes
    reps = tuple(replicated(len(graph.tensor(t).shape)) for t in op.outputs)
    return [s for s in strategies if tuple(s.output_specs) == reps][:1] or list(strategies[:1])


@dataclass(frozen=True, eq=False)
class Labels:
    """The spec of one tensor over a list of strategies: the interned set of its
    distinct specs and, per strategy, which of them (``local``)."""

    spec_set: int
    local: np.ndarray
    #: ``local[i] == i`` for every strategy: strategy ``i`` has spec ``i`` of the set.
    identity: bool


@dataclass(frozen=True, eq=False)
class OpTable:
    """One op's strategies and what the ILP build reads off them (see module
    docstring); arrays are per strategy, in the order of ``strategies``."""

    strategies: tuple[Strategy, ...]
    names: tuple[str, ...]
    compute: np.ndarray
    comm: np.ndarray
    outputs: tuple[Labels, ...]
    inputs: tuple[Labels, ...]
    #: ``arange(len(strategies))``: a root node's strategy index.
    identity: np.ndarray
    #: Whether any strategy has compute (comm) seconds: adding zeros is skipped.
    any_compute: bool
    any_comm: bool


class OpStructures:
    """An id per op for everything its strategies read (module docstring): ops of equal
    structure, equal ids. Mesh-independent, so one per graph serves the table cache of
    every mesh (a layer is built on a dozen logical meshes; its ops are described
    once)."""

    def __init__(self, graph: OpGraph, ids: dict[tuple, int] | None = None) -> None:
        self.graph = graph
        self._ids: dict[tuple, int] = ids if ids is not None else {}
        self._of_op: dict[int, int] = {}

    def rebound(self, graph: OpGraph) -> OpStructures:
        """Structure ids of ``graph``'s ops that agree with these: an op of ``graph``
        whose structure an op here has gets its id (ids are by value)."""
        return OpStructures(graph, self._ids)

    def of(self, op_id: int) -> int:
        """The structure id of op ``op_id``."""
        structure = self._of_op.get(op_id)
        if structure is None:
            op = self.graph.ops[op_id]
            tensors = self.graph.tensors

            def describe(ids: tuple[int, ...]) -> tuple:
                return tuple(
                    (tensors[t].shape, tensors[t].dtype, tensors[t].batch_dim) for t in ids
                )

            key: tuple = (op.primitive, op.params, describe(op.inputs), describe(op.outputs),
                          op.flops, op.bytes_accessed)
            try:
                hash(key)
            except TypeError:  # params that are not plain data: no sharing
                key = ("op", op_id)
            structure = self._ids.setdefault(key, len(self._ids))
            self._of_op[op_id] = structure
        return structure


class TableCache:
    """Memoised op tables, spec sets and resharding matrices of one graph on one mesh
    (see module docstring). Not thread-safe; one per graph, mesh, device and
    calibration."""

    def __init__(
        self, graph: OpGraph, mesh: LogicalMesh, device: DeviceSpec, calibration: Calibration,
        structures: OpStructures | None = None,
    ) -> None:
        if structures is not None and structures.graph is not graph:
            raise ValueError("the OpStructures were made for another graph")
        self.graph = graph
        self.mesh = mesh
        self.device = device
        self.calibration = calibration
        self._set_ids: dict[tuple[ShardSpec, ...], int] = {}
        self._sets: list[tuple[ShardSpec, ...]] = []
        self._set_names: dict[int, tuple[str, ...]] = {}
        #: Op structure ids: shared by the caches of every mesh when passed in.
        self.structures = structures if structures is not None else OpStructures(graph)
        self._tilings: dict[tuple[int, ...], int] = {}
        self._roots: dict[tuple[int, Wanted | None], OpTable] = {}
        self._expert_dims: dict[int, int] | None = None
        self._followers: dict[tuple[int, int, int], OpTable] = {}
        self._follow: dict[tuple[int, int, ShardSpec], Strategy] = {}
        self._reshard: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._plan_ids: dict[ReshardPlan, int] = {}
        self._plan_of: dict[tuple[ShardSpec, ShardSpec], int] = {}
        self._plan_matrices: dict[tuple[int, int], np.ndarray] = {}
        self._plan_costs: dict[float, np.ndarray] = {}
        self._bytes: dict[tuple[float, int], np.ndarray] = {}
        self._nbytes: dict[int, float] = {}

    def rebound(self, graph: OpGraph, structures: OpStructures) -> TableCache:
        """A cache of ``graph`` on the same mesh that shares this one's memos, which
        are all by value (structure ids, spec sets, tensor sizes): an op of
        ``graph`` with the structure of one seen here reuses its tables. Made for a
        graph rescaled to another micro-batch (``with_batch_size``): its ops without
        a batch dimension (the optimizer's update, two thirds of GPT-39B's ops) keep
        their structure. ``structures`` must be ``graph``'s, rebound from this
        cache's (:meth:`OpStructures.rebound`)."""
        if structures.graph is not graph or structures._ids is not self.structures._ids:
            raise ValueError("rebind the OpStructures of this cache to the graph first")
        cache = copy.copy(self)  # the same memo dicts, by reference
        cache.graph = graph
        cache.structures = structures
        cache._expert_dims = None
        cache._nbytes = {}  # by tensor id: the one memo that is per graph
        return cache

    # ------------------------------------------------------------------ spec sets

    def spec_set(self, specs: tuple[ShardSpec, ...]) -> int:
        """The id of a tuple of distinct specs (equal tuples, equal ids)."""
        set_id = self._set_ids.get(specs)
        if set_id is None:
            set_id = self._set_ids[specs] = len(self._sets)
            self._sets.append(specs)
        return set_id

    def specs(self, set_id: int) -> tuple[ShardSpec, ...]:
        """The specs of spec set ``set_id``."""
        return self._sets[set_id]

    def names(self, set_id: int) -> tuple[str, ...]:
        """``str`` of each spec of a set (the strategy names of a boundary input)."""
        names = self._set_names.get(set_id)
        if names is None:
            names = self._set_names[set_id] = tuple(str(s) for s in self._sets[set_id])
        return names

    def tilings(self, shape: tuple[int, ...]) -> int:
        """The spec set of :func:`~alpajob.planner.intra_op.sharding.tiling_specs` of ``shape``."""
        set_id = self._tilings.get(shape)
        if set_id is None:
            set_id = self._tilings[shape] = self.spec_set(tiling_specs(shape, self.mesh))
        return set_id

    def shard_bytes(self, nbytes: float, set_id: int) -> np.ndarray:
        """Per-device bytes of an ``nbytes`` tensor under each spec of a set."""
        key = (nbytes, set_id)
        out = self._bytes.get(key)
        if out is None:
            out = self._bytes[key] = np.asarray(
                [nbytes / shard_factor(spec, self.mesh) for spec in self._sets[set_id]],
                dtype=float,
            )
            out.setflags(write=False)
        return out

    def _plan_matrix(self, src: int, dst: int) -> np.ndarray:
        """Id of the :func:`~alpajob.planner.intra_op.sharding.reshard_plan` from each spec of
        set ``src`` to each spec of set ``dst`` (independent of the tensor)."""
        ids = self._plan_matrices.get((src, dst))
        if ids is None:
            of, plans = self._plan_of, self._plan_ids
            a_specs, b_specs = self._sets[src], self._sets[dst]
            rows = []
            for a in a_specs:
                row = []
                for b in b_specs:
                    plan_id = of.get((a, b))
                    if plan_id is None:
                        plan = reshard_plan(a, b, self.mesh)
                        plan_id = of[(a, b)] = plans.setdefault(plan, len(plans))
                    row.append(plan_id)
                rows.append(row)
            ids = np.array(rows, dtype=np.int64).reshape(len(a_specs), len(b_specs))
            self._plan_matrices[(src, dst)] = ids
        return ids

    def _plan_seconds(self, nbytes: float) -> np.ndarray:
        """Seconds of every plan seen so far on a tensor of ``nbytes``, by plan id."""
        known = self._plan_costs.get(nbytes)
        if known is None or len(known) < len(self._plan_ids):
            plans = list(self._plan_ids)
            done = 0 if known is None else len(known)
            more = [plan_seconds(plan, nbytes, self.mesh) for plan in plans[done:]]
            known = np.concatenate([known if known is not None else np.zeros(0),
                                    np.array(more, dtype=float)])
            self._plan_costs[nbytes] = known
        return known

    def reshard(
        self, tensor_id: int, src: int, dst: int, equality: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, allowed) between two spec sets of tensor ``tensor_id``: entry
        ``[a, b]`` reshards spec ``a`` of ``src`` into spec ``b`` of ``dst``
        (:func:`~alpajob.planner.intra_op.sharding.resharding_seconds`, priced per plan). With
        ``equality`` the seconds are 0 and only equal specs are allowed. Read-only."""
        nbytes = self._nbytes.get(tensor_id)
        if nbytes is None:
            tensor = self.graph.tensors[tensor_id]
            nbytes = self._nbytes[tensor_id] = tensor_bytes(tensor.shape, tensor.dtype)
        key = (src, dst, True) if equality else (nbytes, src, dst)
        pair = self._reshard.get(key)
        if pair is None:
            a_specs, b_specs = self._sets[src], self._sets[dst]
            if equality:
                allowed = np.array([[a == b for b in b_specs] for a in a_specs], dtype=bool)
                allowed = allowed.reshape(len(a_specs), len(b_specs))
                seconds = np.zeros(allowed.shape)
            else:
                plans = self._plan_matrix(src, dst)  # first: it may add plans
                matrix = self._plan_seconds(nbytes)[plans]
                allowed = np.isfinite(matrix)
                seconds = np.where(allowed, matrix, 0.0)
            seconds.setflags(write=False)
            allowed.setflags(write=False)
            pair = self._reshard[key] = (seconds, allowed)
        return pair

    def reshard_row(
        self, tensor_id: int, src: int, src_index: np.ndarray, dst: int, dst_index: np.ndarray
    ) -> np.ndarray:
        """Per strategy ``i`` of one node, the seconds to reshard tensor ``tensor_id``
        from spec ``src_index[i]`` of set ``src`` into spec ``dst_index[i]`` of set
        ``dst``."""
        return self.reshard(tensor_id, src, dst)[0][src_index, dst_index]

    # ----------------------------------------------------------------- op tables

    def _table(self, op: Op, strategies: tuple[Strategy, ...]) -> OpTable:
        # Every strategy pays the op's fixed cost (once per scan trip) on each device.
        fixed = op_fixed_seconds(op.primitive, self.device, self.calibration) * op.multiplier
        if fixed:
            strategies = tuple(dataclasses.replace(s, compute_seconds=s.compute_seconds + fixed)
                               for s in strategies)

        def frozen(values: Sequence[float] | Sequence[int], dtype: type) -> np.ndarray:
            array: np.ndarray = np.array(values, dtype=dtype)
            array.setflags(write=False)
            return array

        def labels(specs: list[ShardSpec]) -> Labels:
            ids: dict[ShardSpec, int] = {}
            local = [ids.setdefault(spec, len(ids)) for spec in specs]
            return Labels(self.spec_set(tuple(ids)), frozen(local, np.int64),
                          local == list(range(len(local))))

        compute = [s.compute_seconds for s in strategies]
        comm = [s.comm_seconds for s in strategies]
        return OpTable(
            strategies=strategies,
            names=tuple(s.name for s in strategies),
            compute=frozen(compute, float),
            comm=frozen(comm, float),
            outputs=tuple(
                labels([s.output_specs[p] for s in strategies]) for p in range(len(op.outputs))
            ),
            inputs=tuple(
                labels([s.input_specs[p] for s in strategies]) for p in range(len(op.inputs))
            ),
            identity=frozen(range(len(strategies)), np.int64),
            any_compute=any(compute),
            any_comm=any(comm),
        )

    @property
    def expert_dims(self) -> dict[int, int]:
        """:func:`~alpajob.planner.graph.experts.expert_dims` of the graph (computed once)."""
        if self._expert_dims is None:
            self._expert_dims = expert_dims(self.graph)
        return self._expert_dims

    def root(self, op_id: int, wanted: Wanted | None = None) -> OpTable:
        """The table of root op ``op_id``; with ``wanted``, only the strategies
        :func:`restrict_to` keeps (the DATA, ZERO2 and EXPERT_ZERO2 modes)."""
        key = (self.structures.of(op_id), wanted)
        table = self._roots.get(key)
        if table is None:
            op = self.graph.ops[op_id]
            strategies = op_strategies(op, self.graph, self.mesh, self.device, self.calibration)
            if wanted is not None:
                strategies = tuple(restrict_to(strategies, op, self.graph, wanted))
            table = self._roots[key] = self._table(op, strategies)
        return table

    def follower(self, op_id: int, operand: int, followed: int) -> OpTable:
        """The table of follower op ``op_id`` copying input ``operand``: one strategy
        per spec of spec set ``followed``, in its order."""
        structure = self.structures.of(op_id)
        key = (structure, operand, followed)
        table = self._followers.get(key)
        if table is None:
            op = self.graph.ops[op_id]
            base = op_base_seconds(op, self.graph, self.device, self.calibration)
            strategies = []
            for spec in self._sets[followed]:
                spec_key = (structure, operand, spec)
                strategy = self._follow.get(spec_key)
                if strategy is None:
                    strategy = self._follow[spec_key] = follow_strategy(
                        op, self.graph, operand, spec, self.mesh, self.device,
                        self.calibration, base_seconds=base,
                    )
                strategies.append(strategy)
            table = self._followers[key] = self._table(op, tuple(strategies))
        return table
