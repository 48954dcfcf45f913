"""Sharding specs and the cost of changing one into another (resharding).

A :data:`ShardSpec` says, per tensor dimension, which logical mesh axes split it::

    ((0,), ())     dim 0 split over mesh axis 0 ("x"), dim 1 replicated   -> P("x", None)
    ((0, 1), ())   dim 0 split over both axes, axis 0 major               -> P(("x","y"), None)
    ((), ())       replicated                                             -> P(None, None)

A mesh axis appears at most once per spec, and a dimension must be divisible by the
product of the sizes of its axes. Axes of size 1 never appear (splitting over them is
a no-op), so two specs are equal iff they lay the tensor out the same way.

Resharding (the edge cost R[u, v] of Alpa's ILP, eq. 1) from ``src`` to ``dst`` is
decided per mesh axis ``k``:

- ``k`` splits the same dimension at the same position in both: nothing to do;
- ``k`` unused in ``src``, used in ``dst``: each device slices its part (free);
- ``k`` splits dimension ``d1`` in ``src`` and ``d2 != d1`` in ``dst``: all-to-all;
- ``k`` splits a dimension in ``src`` but not in ``dst`` (or at another position
  within the same dimension): all-gather over ``k`` (then slice, free).

All-to-alls run first (on the most sharded layout), then one all-gather over the
gathered axes; each collective's bytes are those of one group of devices.
Example, a 1024 x 1024 float32 tensor (4 MiB) on a 2 x 4 mesh:
``((0,), ()) -> ((), ())`` all-gathers 4 MiB over axis 0;
``((0,), ()) -> ((), (0,))`` is one all-to-all over axis 0;
``((), ()) -> ((0,), (1,))`` is free.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

from alpajob.planner.cost.model import (
    LogicalMesh,
    all_gather_seconds,
    all_to_all_seconds,
)
from alpajob.planner.graph.opgraph import DTYPE_BYTES
from alpajob.planner.intra_op.collectives import Collective, CollectiveKind

#: Per tensor dimension, the mesh axes that split it (major first).
ShardSpec = tuple[tuple[int, ...], ...]


def replicated(ndim: int) -> ShardSpec:
    """The fully replicated spec of a rank-``ndim`` tensor."""
    return ((),) * ndim


def spec_axes(spec: ShardSpec) -> tuple[int, ...]:
    """All mesh axes a spec uses."""
    return tuple(k for dim in spec for k in dim)


def shard_factor(spec: ShardSpec, mesh: LogicalMesh) -> int:
    """Into how many pieces ``spec`` cuts a tensor (1 when replicated)."""
    factor = 1
    for dim_axes in spec:
        for k in dim_axes:
            factor *= mesh.axes[k].size
    return factor


def tensor_bytes(shape: Sequence[int], dtype: str) -> float:
    """Bytes of a whole tensor of ``shape`` and ``dtype``."""
    return float(math.prod(shape) * DTYPE_BYTES.get(dtype, 4))


def is_valid_spec(spec: ShardSpec, shape: Sequence[int], mesh: LogicalMesh) -> bool:
    """Whether ``spec`` fits ``shape`` on ``mesh``: one entry per dim, each axis used
    at most once and only if its size is > 1, each dim divisible by its axes."""
    if len(spec) != len(shape):
        return False
    used = spec_axes(spec)
    if len(set(used)) != len(used):
        return False
    for dim_axes, size in zip(spec, shape, strict=True):
        for k in dim_axes:
            if k < 0 or k >= len(mesh.axes) or mesh.axes[k].size == 1:
                return False
        if size % mesh.size_of(dim_axes):
            return False
    return True


def to_partition_spec(
    spec: ShardSpec, axis_names: Sequence[str]
) -> tuple[str | tuple[str, ...] | None, ...]:
    """``spec`` as the entries of a ``jax.sharding.PartitionSpec``.

    ``((0,), ())`` -> ``("x", None)``; ``((0, 1), ())`` -> ``(("x", "y"), None)``.
    """
    entries: list[str | tuple[str, ...] | None] = []
    for dim_axes in spec:
        if not dim_axes:
            entries.append(None)
        elif len(dim_axes) == 1:
            entries.append(axis_names[dim_axes[0]])
        else:
            entries.append(tuple(axis_names[k] for k in dim_axes))
    return tuple(entries)


def tiling_specs(shape: Sequence[int], mesh: LogicalMesh) -> tuple[ShardSpec, ...]:
    """Every 1-D and 2-D tiling of ``shape`` plus replicated (see :func:`_tilings`)."""
    return _tilings(tuple(shape), mesh)


@lru_cache(maxsize=4096)
def _tilings(shape: tuple[int, ...], mesh: LogicalMesh) -> tuple[ShardSpec, ...]:
    """Every 1-D and 2-D tiling of ``shape`` plus replicated (the strategies of a step
    input, PLANNER.md): each active mesh axis goes to one dimension or to none; two
    axes on the same dimension go in ascending order. Replicated comes first.

    Example: shape (8, 8) on a 2 x 2 mesh gives 9 specs: R, 4 one-axis tilings,
    2 two-axis tilings of one dim, 2 tilings of both dims.
    """
    ndim = len(shape)
    active = mesh.active_axes
    specs: list[ShardSpec] = []
    seen: set[ShardSpec] = set()
    for choice in itertools.product(range(-1, ndim), repeat=len(active)):
        dims: list[list[int]] = [[] for _ in range(ndim)]
        for k, d in zip(active, choice, strict=True):
            if d >= 0:
                dims[d].append(k)
        spec = tuple(tuple(d) for d in dims)
        if spec not in seen and is_valid_spec(spec, shape, mesh):
            seen.add(spec)
            specs.append(spec)
    specs.sort(key=lambda s: len(spec_axes(s)))
    return tuple(specs)


def _axis_positions(spec: ShardSpec) -> dict[int, tuple[int, int]]:
    """Mesh axis -> (dimension, position within that dimension's axes)."""
    return {k: (d, i) for d, dim_axes in enumerate(spec) for i, k in enumerate(dim_axes)}


def resharding_seconds(
    tensor_shape: Sequence[int],
    dtype: str,
    src: ShardSpec,
    dst: ShardSpec,
    mesh: LogicalMesh,
) -> float:
    """Seconds to turn a tensor laid out as ``src`` into ``dst`` (see module docstring).

    Used for the ILP's edge costs and, by the inter-op driver, for layer boundaries
    inside one mesh.
    """
    if src == dst:
        return 0.0
    return _resharding_seconds(tuple(tensor_shape), dtype, src, dst, mesh)


#: How a resharding moves data, whatever the tensor's size: the axes whose split
#: moves to another dim (all-to-all), the axes gathered, and every axis of the source
#: spec (those still splitting the data during each collective).
ReshardPlan = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def reshard_plan(src: ShardSpec, dst: ShardSpec, mesh: LogicalMesh) -> ReshardPlan:
    """The collectives that turn ``src`` into ``dst`` (see module docstring); their
    seconds for a given tensor size are :func:`plan_seconds`."""
    src_pos = _axis_positions(src)
    dst_pos = _axis_positions(dst)
    moved: list[int] = []
    gathered: list[int] = []
    for k in sorted(src_pos):
        if mesh.axes[k].size == 1:
            continue
        d_src, i_src = src_pos[k]
        if k in dst_pos:
            d_dst, i_dst = dst_pos[k]
            if d_dst == d_src:
                # Same dimension: a pure slice only when everything major to k agrees.
                if i_dst == i_src and src[d_src][:i_src] == dst[d_dst][:i_dst]:
                    continue
                gathered.append(k)
            else:
                moved.append(k)
        else:
            gathered.append(k)
    return tuple(moved), tuple(gathered), tuple(src_pos)


def plan_collectives(plan: ReshardPlan, nbytes: float, mesh: LogicalMesh) -> list[Collective]:
    """The collectives of a :func:`reshard_plan` on a tensor of ``nbytes`` (whole):
    one all-to-all per moved axis, then one all-gather over the gathered axes. Each
    works on one group's data: the tensor divided by the axes that still split it,
    other than the collective's own."""
    moved, gathered, current = plan
    out = []
    for k in moved:
        share = nbytes / mesh.size_of([j for j in current if j != k])
        out.append(Collective(CollectiveKind.ALL_TO_ALL, (k,), share,
                              all_to_all_seconds(mesh, (k,), share)))
    if gathered:
        share = nbytes / mesh.size_of([j for j in current if j not in gathered])
        out.append(Collective(CollectiveKind.ALL_GATHER, tuple(gathered), share,
                              all_gather_seconds(mesh, gathered, share)))
    return out


def plan_seconds(plan: ReshardPlan, nbytes: float, mesh: LogicalMesh) -> float:
    """Seconds of a :func:`reshard_plan` on a tensor of ``nbytes`` (whole)."""
    moved, gathered, _ = plan
    if not moved and not gathered:
        return 0.0
    return sum(c.seconds for c in plan_collectives(plan, nbytes, mesh))


def reshard_collectives(
    tensor_shape: Sequence[int], dtype: str, src: ShardSpec, dst: ShardSpec, mesh: LogicalMesh
) -> list[Collective]:
    """The collectives that turn a tensor laid out as ``src`` into ``dst``."""
    if src == dst:
        return []
    return plan_collectives(reshard_plan(src, dst, mesh), tensor_bytes(tensor_shape, dtype), mesh)


@lru_cache(maxsize=65536)
def _resharding_seconds(
    shape: tuple[int, ...], dtype: str, src: ShardSpec, dst: ShardSpec, mesh: LogicalMesh
) -> float:
    return plan_seconds(reshard_plan(src, dst, mesh), tensor_bytes(shape, dtype), mesh)
