"""FLOPs, bytes and sharding-relevant parameters of one jaxpr equation.

The op costs :mod:`alpajob.planner.graph.extract` records (the rules are in its docstring):
``dot_general`` ``2 * |out| * prod(contracting sizes)``, convolutions likewise per
kernel window, elementwise ops ``|out|``, reductions ``|input|``, data movement 0.

Every function takes ``at``, which turns one dimension into an int: plain ``int`` for a
step traced at a concrete batch, :class:`BatchAt` for one traced with a symbolic batch
dimension (``jax.export.symbolic_shape``), whose shapes and parameters hold
expressions such as ``2*b`` that are evaluated at the batch size wanted.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.extend.core as jcore
import numpy as np
from jax.export import is_symbolic_dim

#: Turns one traced dimension (an int, or a symbolic expression) into an int.
DimValue = Callable[[Any], int]

#: Primitives that only move or relabel data: 0 FLOPs.
DATA_MOVEMENT = frozenset(
    {
        "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
        "dynamic_slice", "dynamic_update_slice", "concatenate", "gather", "scatter", "pad",
        "rev", "iota", "copy", "copy_p", "device_put", "stop_gradient",
        "bitcast_convert_type", "sharding_constraint", "optimization_barrier", "split",
        "mesh_cast", "reshard",
    }
)  # fmt: skip
#: Reductions and cumulative ops along axes: |input| FLOPs.
REDUCTIONS = frozenset(
    {
        "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
        "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
        "cumlogsumexp",
    }
)  # fmt: skip

@dataclass(frozen=True)
class BatchAt:
    """Evaluates the dimensions of a step traced with the symbolic batch dimension
    ``symbol`` at batch ``value``: ``BatchAt("b", 64)(2*b) == 128``; plain ints pass
    through. (jax.export evaluates its dimension expressions with ``_evaluate``, which
    has no public spelling; the pinned JAX is tested here.)"""

    symbol: str
    value: int

    def __call__(self, dim: Any) -> int:
        if is_symbolic_dim(dim):
            return int(dim._evaluate({self.symbol: self.value}))  # type: ignore[dict-item]
        return int(dim)


def atom_shape(atom: Any, at: DimValue = int) -> tuple[int, ...]:
    return tuple(at(d) for d in getattr(atom.aval, "shape", ()))


def aval_size(aval: Any, at: DimValue = int) -> int:
    return math.prod(at(d) for d in getattr(aval, "shape", ()))


def aval_nbytes(aval: Any, at: DimValue = int) -> int:
    dtype = getattr(aval, "dtype", None)
    itemsize = getattr(dtype, "itemsize", 4) if dtype is not None else 0
    return aval_size(aval, at) * itemsize


def op_flops(eqn: jcore.JaxprEqn, at: DimValue = int) -> float:
    """FLOPs of one execution of ``eqn`` (see the module docstring)."""
    name = eqn.primitive.name
    params = eqn.params

    def size(atom: Any) -> int:
        return aval_size(atom.aval, at)

    if name in DATA_MOVEMENT:
        return 0.0
    if name == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        lhs_shape = atom_shape(eqn.invars[0], at)
        depth = math.prod(lhs_shape[d] for d in lhs_contract)
        return 2.0 * size(eqn.outvars[0]) * depth
    if name == "conv_general_dilated":
        rhs_spec = params["dimension_numbers"].rhs_spec
        rhs_shape = atom_shape(eqn.invars[1], at)
        kernel = math.prod(rhs_shape[d] for d in rhs_spec[2:])
        return 2.0 * size(eqn.outvars[0]) * rhs_shape[rhs_spec[1]] * kernel
    if name in REDUCTIONS:
        return float(size(eqn.invars[0]))
    if name.startswith("reduce_window") or name == "select_and_gather_add":
        window = math.prod(at(d) for d in params["window_dimensions"])
        return float(size(eqn.outvars[0]) * window)
    if name == "select_and_scatter_add":
        window = math.prod(at(d) for d in params["window_dimensions"])
        return float(size(eqn.invars[0]) * window)
    if name.startswith("scatter"):  # scatter-add, scatter_mul, ...: one op per update
        return float(size(eqn.invars[2]))
    if name == "sort":
        shape = atom_shape(eqn.invars[0], at)
        n = shape[params["dimension"]] if shape else 1
        return float(size(eqn.invars[0]) * max(1, math.ceil(math.log2(max(n, 2)))))
    if eqn.outvars:
        return float(size(eqn.outvars[0]))
    return 0.0


def _plain(value: Any, at: DimValue = int) -> Any:
    """``value`` as plain hashable data (ints, floats, strings, tuples), or None; a
    symbolic dimension is evaluated by ``at``."""
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int | np.integer) or is_symbolic_dim(value):
        return at(value)
    if isinstance(value, float | np.floating):
        return float(value)
    if isinstance(value, np.dtype):
        return value.name
    if isinstance(value, tuple | list):
        items = tuple(_plain(v, at) for v in value)
        return None if any(i is None for i in items) else items
    if isinstance(value, enum.Enum):
        return value.name
    return None


def op_params(eqn: jcore.JaxprEqn, at: DimValue = int) -> tuple[tuple[str, Any], ...]:
    """The sharding-relevant primitive parameters of ``eqn`` as sorted plain pairs.

    ``dot_general``: ``contracting`` and ``batch`` as ``((lhs dims), (rhs dims))``;
    ``conv_general_dilated``: ``lhs_spec``/``rhs_spec``/``out_spec`` and its strides,
    padding, dilations and group counts; every other primitive: each parameter that is
    plain data (``axes``, ``permutation``, ``new_sizes``, ``broadcast_dimensions``,
    ``shape``, ``new_dtype`` ...), with structured dimension numbers (gather, scatter)
    spread into their fields.
    """
    name = eqn.primitive.name
    pairs: dict[str, Any] = {}
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        pairs["contracting"] = (_plain(lc, at), _plain(rc, at))
        pairs["batch"] = (_plain(lb, at), _plain(rb, at))
        return tuple(sorted(pairs.items()))
    for key, value in eqn.params.items():
        if hasattr(value, "_fields"):  # NamedTuple dimension numbers
            fields = {f: getattr(value, f) for f in value._fields}
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        else:
            fields = {key: value}
        for field, item in fields.items():
            plain = _plain(item, at)
            if plain is not None:
                pairs[field] = plain
    return tuple(sorted(pairs.items()))


def jaxpr_flops(jaxpr: jcore.Jaxpr, at: DimValue = int) -> float:
    """Total FLOPs of ``jaxpr``, through nested jaxprs (scan bodies times their length)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        inner = list(jcore.jaxprs_in_params(eqn.params))
        if inner:
            scale = at(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
            costs = [jaxpr_flops(j, at) for j in inner]
            total += scale * (max(costs) if eqn.primitive.name == "cond" else sum(costs))
        else:
            total += op_flops(eqn, at)
    return total
