"""A ``jax.sharding.Mesh`` per stage, and the shardings the plan names on it.

A plan's stage names abstract device slots ``(node, device)`` of the cluster it was
made for. Locally, slot ``(n, d)`` is device ``d`` of node ``n`` counting the devices
node by node (``n * M + d`` on N x M; a plan across GPU types gives each node its
pool's devices, :meth:`~alpajob.api.plan.Plan.device_index`); the stage's mesh is
those devices reshaped to its logical mesh shape, with the plan's axis names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpajob.api.errors import AlpaJobError
from alpajob.api.plan import Plan, SpecEntry, StagePlan


class DeviceError(AlpaJobError):
    """The machine has fewer devices than the plan needs."""


def stage_mesh(stage: StagePlan, plan: Plan, devices: Sequence[Any]) -> Mesh:
    """The mesh of ``stage`` over ``devices`` (the run's devices, in slot order)."""
    need = plan.devices_offered()
    if len(devices) < need:
        raise DeviceError(
            f"the plan needs {need} devices ({plan.cluster_label()}) but this run has "
            f"{len(devices)}; pass --devices {need} or re-plan for this machine"
        )
    chosen = [devices[plan.device_index(node, slot)] for node, slot in stage.device_slots]
    grid = np.array(chosen, dtype=object).reshape(stage.logical_mesh_shape)
    return Mesh(grid, tuple(stage.axis_names))


def partition_spec(entries: Sequence[SpecEntry]) -> PartitionSpec:
    """A plan's JSON spec (``null``, an axis, or a list of axes per dim) as a PartitionSpec."""
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])


def fits(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> bool:
    """Whether every sharded dimension of ``shape`` divides evenly by its mesh axes."""
    if len(spec) > len(shape):
        return False
    for entry, size in zip(spec, shape, strict=False):
        axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        parts = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
        if size % parts:
            return False
    return True


def batch_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """The data-parallel default: dimension 0 over every mesh axis of size > 1 that fits."""
    axes: list[str] = []
    for name in mesh.axis_names:
        candidate = (*axes, name)
        if mesh.shape[name] > 1 and shape and shape[0] % int(np.prod([mesh.shape[a] for a in candidate])) == 0:
            axes.append(name)
    if not axes:
        return PartitionSpec()
    return PartitionSpec(tuple(axes) if len(axes) > 1 else axes[0])


def weight_update_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """``spec`` further sharded over the mesh axes it leaves free (ZeRO-style).

    The gradient accumulator and the optimizer state of a weight-update-sharded
    parameter use it: each replica keeps and updates one slice, and the updated
    parameter is gathered back to ``spec``. The free axes go to the first dimension
    they divide evenly.
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries if e for a in (e if isinstance(e, tuple) else (e,))}
    free = [a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1]
    if not free:
        return spec
    for dim, size in enumerate(shape):
        current = entries[dim]
        axes = tuple(current if isinstance(current, tuple) else (current,) if current else ())
        merged = (*axes, *free)
        if size % int(np.prod([mesh.shape[a] for a in merged])) == 0:
            entries[dim] = merged if len(merged) > 1 else merged[0]
            return PartitionSpec(*entries)
    return spec


def named(mesh: Mesh, spec: PartitionSpec, shape: Sequence[int]) -> NamedSharding:
    """``NamedSharding(mesh, spec)``, replicated where ``spec`` does not fit ``shape``."""
    return NamedSharding(mesh, spec if fits(spec, shape, mesh) else PartitionSpec())


def local_devices(count: int | None = None) -> list[Any]:
    """The first ``count`` devices of this process (all of them by default)."""
    devices = jax.devices()
    if count is not None:
        if count > len(devices):
            raise DeviceError(
                f"--devices {count} asks for more devices than the {len(devices)} this "
                f"machine has ({devices[0].platform})"
            )
        devices = devices[:count]
    return devices


def place(value: Any, sharding: Any) -> Any:
    """The host array ``value`` as a global array with ``sharding``.

    On a mesh of one process this is ``jax.device_put``. On a mesh spanning several
    processes (hosts) every process holds the same ``value`` and places only the tiles
    of its own devices (``jax.make_array_from_callback``): no collective, and hosts
    need not have the same number of devices.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    data = np.asarray(value)
    return jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])


def place_all(values: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """:func:`place` for many host arrays; those on one process's devices share one
    batched ``jax.device_put`` (a ``device_put`` costs more in dispatch than in bytes
    for a micro-batch's few small leaves)."""
    out: list[Any] = [None] * len(values)
    local = [i for i, sharding in enumerate(shardings) if sharding.is_fully_addressable]
    if local:
        for i, x in zip(local, jax.device_put([values[i] for i in local], [shardings[i] for i in local]),
                        strict=True):
            out[i] = x
    return [x if x is not None else place(v, sh) for x, v, sh in zip(out, values, shardings, strict=True)]
