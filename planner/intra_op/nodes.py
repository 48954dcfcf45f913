"""The nodes of a layer's sharding ILP: which op owns a strategy and which follows one.

Every boundary input (a parameter, optimizer state, the batch, another layer's
activation) and every root op (``dot_general``, ``conv_general_dilated``, unknown
ops) is a node with strategies of its own; every other op follows one of its operands
(:meth:`ModelNodes._pick_operand` says which) and joins that operand's node, each of
its strategies mapped through the op (:mod:`~alpajob.planner.intra_op.follow`, read
off a :class:`~alpajob.planner.intra_op.op_tables.TableCache`). The result says, per
tensor and per op, which node it belongs to and what it is under each of the node's
strategies; :mod:`~alpajob.planner.intra_op.model` charges the costs onto those nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from alpajob.planner.graph.opgraph import Op, OpGraph, Phase, TensorRole
from alpajob.planner.graph.subset import Subset
from alpajob.planner.intra_op.op_tables import (
    OpTable,
    PerStrategy,
    TableCache,
    data_spec,
    expert_spec,
)
from alpajob.planner.intra_op.sharding import ShardSpec, replicated
from alpajob.planner.intra_op.strategies import OpKind, Strategy, op_kind


class ModelNodes:
    """The ILP nodes: boundary inputs and root ops, each follower joined to its node.

    ``tensor_specs[t][i]`` is tensor ``t``'s spec under strategy ``i`` of its node
    ``tensor_node[t]`` (``tensor_set[t]`` the interned set of its distinct specs);
    ``op_strategies[o][i]`` op ``o``'s strategy likewise, read off ``op_table[o]``. A
    follower is evaluated once per distinct spec of the operand it follows (and once
    per op structure, through the :class:`TableCache`). ``restricted``: the data
    and ZeRO modes, every tensor in its one wanted spec (a parameter replicated, an
    activation split along its batch dim, and along ``experts`` (tensor -> its expert
    dim) where given).
    """

    def __init__(
        self, graph: OpGraph, tables: TableCache, subset: Subset, *, restricted: bool,
        experts: Mapping[int, int],
    ) -> None:
        self.labels: list[str] = []
        self.roots: list[tuple[int | None, int | None]] = []
        self.names: list[tuple[str, ...]] = []
        self.param_rooted: list[bool] = []
        self.tensor_node: dict[int, int] = {}
        self.tensor_specs: dict[int, PerStrategy[ShardSpec]] = {}
        self.tensor_set: dict[int, int] = {}
        self.op_node: dict[int, int] = {}
        self.op_strategies: dict[int, PerStrategy[Strategy]] = {}
        self.op_table: dict[int, OpTable] = {}
        #: Tensors computed from captured constants alone (the zeros a ReLU's backward
        #: selects from): any layout of them is free to make, so none is worth copying.
        self.constant: set[int] = {
            t for t in subset.boundary_inputs if graph.tensor(t).role is TensorRole.CONSTANT
        }
        #: Tensors a broadcast made bigger (a BatchNorm mean spread over the batch): their
        #: new dims are never split, so copying their layout would gather the others.
        self.broadcast: set[int] = set()
        mesh = tables.mesh
        data = restricted

        def wanted(t: int) -> ShardSpec:
            """The one spec of tensor ``t`` in the restricted modes."""
            tensor = graph.tensor(t)
            if t in experts:
                return expert_spec(tensor, experts[t], mesh)
            if tensor.role in (TensorRole.PARAM, TensorRole.OPT_STATE):
                return replicated(len(tensor.shape))
            return data_spec(tensor, mesh)

        for t in subset.boundary_inputs:
            tensor = graph.tensor(t)
            set_id = tables.spec_set((wanted(t),)) if data else tables.tilings(tensor.shape)
            specs = tables.specs(set_id)
            self.tensor_node[t] = self._new(
                f"input {t} ({tensor.role.value})", (None, t), tables.names(set_id),
                tensor.role is TensorRole.PARAM,
            )
            self.tensor_specs[t] = PerStrategy(specs, np.arange(len(specs)))
            self.tensor_set[t] = set_id
        for op_id in subset.op_ids:
            op = graph.ops[op_id]
            kind = op_kind(op.primitive)
            if all(t in self.constant for t in op.inputs):
                self.constant.update(op.outputs)
            if kind is OpKind.BROADCAST and op.inputs and (
                graph.tensor(op.outputs[0]).size > graph.tensor(op.inputs[0]).size
            ):
                self.broadcast.update(op.outputs)
            if kind.is_follower and op.inputs and op.outputs:
                operand = self._pick_operand(op, kind, graph, subset.produced,
                                             wanted(op.outputs[0]) if data else None)
                followed = op.inputs[operand]
                node = self.tensor_node[followed]
                table = tables.follower(op_id, operand, self.tensor_set[followed])
                index = self.tensor_specs[followed].index
            else:
                table = tables.root(op_id, (
                    tuple(wanted(t) for t in op.inputs), tuple(wanted(t) for t in op.outputs)
                ) if data else None)
                node = self._new(f"op {op.id} {op.primitive}", (op.id, None), table.names, False)
                index = table.identity
            self.op_node[op_id] = node
            self.op_strategies[op_id] = PerStrategy(table.strategies, index)
            self.op_table[op_id] = table
            for t, labels in zip(op.outputs, table.outputs, strict=True):
                self.tensor_node[t] = node
                # An identity labelling maps each strategy to itself: the index as it is.
                self.tensor_specs[t] = PerStrategy(
                    tables.specs(labels.spec_set), index if labels.identity else labels.local[index]
                )
                self.tensor_set[t] = labels.spec_set

    def _new(
        self, label: str, root: tuple[int | None, int | None], names: tuple[str, ...],
        param: bool,
    ) -> int:
        self.labels.append(label)
        self.roots.append(root)
        self.names.append(names)
        self.param_rooted.append(param)
        return len(self.labels) - 1

    def _pick_operand(
        self, op: Op, kind: OpKind, graph: OpGraph, produced: dict[int, int],
        wanted: ShardSpec | None = None,
    ) -> int:
        """Which operand a follower copies: the first for layout ops and reductions; for
        elementwise ops (and concatenate) one not made of constants alone (copying the
        replicated layout of a broadcast of zeros would gather the real operand), then
        one no broadcast enlarged (its new dims are replicated; ``x - mean`` copies x), then
        the same-shaped, largest operand whose node still has a choice, in the update
        phase preferably the parameter's (so that ``p - lr * u`` keeps ``p``'s spec),
        else the latest produced.

        In the restricted modes (``wanted``: the output's one spec there) an operand
        that can have the wanted spec comes first: following a replicated broadcast
        instead would gather the other operands for nothing."""
        if len(op.inputs) == 1 or kind not in (OpKind.ELEMENTWISE, OpKind.RESIZE) or (
            kind is OpKind.RESIZE and op.primitive != "concatenate"
        ):
            return 0
        out = graph.tensor(op.outputs[0])

        def key(position: int) -> tuple[bool, bool, bool, bool, int, bool, bool, int]:
            tensor = graph.tensor(op.inputs[position])
            node = self.tensor_node[tensor.id]
            return (
                wanted is None or wanted in self.tensor_specs[tensor.id].values,
                tensor.id not in self.constant,
                tensor.id not in self.broadcast,
                tensor.shape == out.shape,
                math.prod(tensor.shape),
                len(self.names[node]) > 1,
                op.phase is Phase.UPDATE and self.param_rooted[node],
                produced.get(tensor.id, -1),
            )

        return max(range(len(op.inputs)), key=key)
