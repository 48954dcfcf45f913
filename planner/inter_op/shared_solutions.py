"""Layer ILP solutions shared by the plan searches of one graph on several clusters.

``alpajob plan --what-if`` searches one traced graph on every option a user compares.
What a layer's ILP answers depends on the graph at the micro-batch (the traced graph
and the micro-batch count), the layer's ops, the logical mesh (its shape and each
axis' latency and bandwidth), the device, the calibration, the sharding mode, the
memory weight, the input hints and the time limit; it does not depend on how many
nodes the cluster has, nor on its memory budget (which decides only which ILPs a
search asks for). So the options of one preset (8, 16 and 32 H100s) ask many of the
same ILPs: every submesh of one node, every count they both cost.

A :class:`SharedSolutions` is filled from each search's costers once it ends
(:meth:`SharedSolutions.record`): their ILP results, the layer results chained from
them and the per-mesh layer arrays (the :class:`~.stage_costs.CosterCaches`), grouped
by what they were found for, (micro-batch count, mode, device, calibration, time
limit) and the logical mesh, by value. A later search's coster of a count and mode
starts with every group of its own (count, mode, device, calibration, time limit)
whose logical mesh its cluster makes identically on the same submesh and shape
(:meth:`SharedSolutions.seed`), and solves only the rest; the block-part cuts, chosen
on the graph alone, are shared as they are. The same ILPs have the same solutions,
so each plan is the one its search finds alone (same hash; test): only its solver
stats count fewer ILPs.

Entries only accumulate (a few MB per search); one instance serves one graph (known
by its fingerprint, so it pickles without it) and its layers.
:meth:`SharedSolutions.matching` gives a search only the groups of its devices, which
is what goes to its worker processes (or, side by side, to the process that plans the
option, :mod:`alpajob.trainer_image.what_if_pool`, whose grown copy comes back and is
merged, :meth:`SharedSolutions.merge`).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from alpajob.planner.cost.cluster import DeviceSpec
from alpajob.planner.cost.model import Calibration, LogicalMesh
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.planner.inter_op.stage_costs import CosterCaches, LayerCoster
from alpajob.planner.intra_op.solve import ShardingMode

if TYPE_CHECKING:
    from alpajob.planner.inter_op.search import CostContext

#: What a coster's solutions were found for besides the mesh: (micro-batch count,
#: sharding mode, device, calibration, ILP time limit).
Origin = tuple[int, ShardingMode, DeviceSpec, Calibration, float]


def origin_of(coster: LayerCoster) -> Origin:
    """The :data:`Origin` of ``coster``'s solutions."""
    return (coster.num_micro_batches, coster.mode, coster.cluster.device, coster.calibration,
            coster.time_limit_s)


def _empty() -> CosterCaches:
    return CosterCaches({}, {}, {})


class SharedSolutions:
    """The solutions of earlier searches of one graph (module docstring), all cut into
    the same layers (those of the first search recorded). Known by the graph's
    :meth:`~alpajob.planner.graph.opgraph.OpGraph.fingerprint`, not the object: it
    pickles without the graph, to a process that has its own copy."""

    def __init__(self, graph: OpGraph) -> None:
        self.fingerprint = graph.fingerprint()
        self._layers: list[list[int]] | None = None
        self._groups: defaultdict[tuple[Origin, LogicalMesh], CosterCaches] = defaultdict(_empty)
        self._cuts: dict[tuple[int, int], tuple[int, ...]] = {}

    def serves(self, graph: OpGraph, layers: Sequence[Sequence[int]]) -> bool:
        """Whether a search of ``graph`` cut into ``layers`` may use these solutions."""
        return graph.fingerprint() == self.fingerprint and (
            self._layers is None or [list(ops) for ops in layers] == self._layers)

    def matching(self, devices: Collection[DeviceSpec]) -> SharedSolutions:
        """The solutions found on ``devices`` (what a search on them can use), sharing
        their entries with this one."""
        mine = copy.copy(self)
        mine._groups = defaultdict(_empty, {key: caches for key, caches in self._groups.items()
                                            if key[0][2] in devices})
        return mine

    def merge(self, other: SharedSolutions) -> None:
        """Take the solutions ``other`` (of the same graph and layers) holds that these lack."""
        if other.fingerprint != self.fingerprint or (
                None not in (self._layers, other._layers) and other._layers != self._layers):
            raise ValueError("the shared solutions were found for another graph or other layers")
        self._layers = self._layers or other._layers
        for cut, pieces in other._cuts.items():
            self._cuts.setdefault(cut, pieces)
        for key, found in other._groups.items():
            self._groups[key].take(found)

    @property
    def cuts(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """The block-part cuts chosen so far (:meth:`~.remat_pieces.PieceCutter.cuts`)."""
        return self._cuts

    def seed(self, coster: LayerCoster) -> None:
        """Give ``coster`` every solution found for its count, mode, device, calibration
        and time limit on a logical mesh its cluster makes identically."""
        origin = origin_of(coster)
        cluster = coster.cluster
        for (found_for, mesh), caches in self._groups.items():
            nodes, per_node = mesh.submesh
            if found_for != origin or nodes > cluster.num_nodes or per_node > cluster.devices_per_node:
                continue
            if coster.mesh(mesh.submesh, mesh.shape) == mesh:
                coster.absorb(caches)

    def record(self, context: CostContext) -> None:
        """Keep every solution ``context``'s costers hold, and its block-part cuts."""
        if not self.serves(context.graph, context.layers):
            raise ValueError("the shared solutions were found for another graph or other layers")
        if self._layers is None:
            self._layers = [list(ops) for ops in context.layers]
        for cut, pieces in context.piece_cuts().items():
            self._cuts.setdefault(cut, pieces)
        for coster in context.costers().values():
            origin = origin_of(coster)
            found = coster.caches()

            def group(submesh: tuple[int, int], shape: tuple[int, int],
                      coster: LayerCoster = coster, origin: Origin = origin) -> CosterCaches:
                return self._groups[(origin, coster.mesh(submesh, shape))]

            for key, result in found.results.items():
                group(key[1], key[2]).results.setdefault(key, result)
            for layer_key, result in found.layer_results.items():
                group(layer_key[1], layer_key[2]).layer_results.setdefault(layer_key, result)
            for mesh_key, arrays in found.arrays.items():
                group(mesh_key[0], mesh_key[1]).arrays.setdefault(mesh_key, arrays)

    def __len__(self) -> int:
        """ILP results held."""
        return sum(len(caches.results) for caches in self._groups.values())

