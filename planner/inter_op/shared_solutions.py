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

Entries only accumulate (a few MB per search); one instance serves one graph and
its layers, and :meth:`SharedSolutions.matching` gives a search only the groups of
its device, which is what goes to its worker processes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass
class SharedSolutions:
    """The solutions of earlier searches of ``graph`` (module docstring), all cut
    into the same layers (those of the first search recorded)."""

    graph: OpGraph
    _layers: list[list[int]] | None = None
    _groups: defaultdict[tuple[Origin, LogicalMesh], CosterCaches] = field(
        default_factory=lambda: defaultdict(_empty))
    _cuts: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    def serves(self, graph: OpGraph, layers: Sequence[Sequence[int]]) -> bool:
        """Whether a search of ``graph`` cut into ``layers`` may use these solutions."""
        return graph is self.graph and (
            self._layers is None or [list(ops) for ops in layers] == self._layers)

    def matching(self, device: DeviceSpec) -> SharedSolutions:
        """The solutions found on ``device`` (what a search on it can use), sharing
        their entries with this one."""
        mine = SharedSolutions(self.graph, self._layers, _cuts=self._cuts)
        for key, caches in self._groups.items():
            if key[0][2] == device:
                mine._groups[key] = caches
        return mine

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
