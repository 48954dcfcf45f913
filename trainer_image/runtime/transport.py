"""Move an array between local devices by executing a :class:`~.transfer.TransferPlan`.

The mechanism for one process that sees every device (the local runner). Each
receiver's tile is assembled from the pieces sent to it, put on the receiver, and
copied device-to-device to the rest of its group (each of the two rounds is one
batched ``jax.device_put``, shared by all the arrays of one :func:`move_all`); the
result is one global ``jax.Array`` with the destination sharding.

A piece that is a whole source shard goes device to device as it is: the copy is
queued behind the computation that produces the shard, and the caller does not
wait (the asynchronous driver, :mod:`.driver`, relies on it). Smaller pieces are cut
on CPU devices from zero-copy numpy views of the source shards (a piece costs one
memory copy, and reading the view waits for the shard); elsewhere they are cut by
JAX slicing on the source device and assembled on the receiving one, so nothing
passes through the host and nothing waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from alpajob.trainer.runtime.transfer import Box, TransferPlan, plan_transfer, tiles_of


@cache
def _cached_plan(shape: tuple[int, ...], itemsize: int, src: Any, dst: Any) -> TransferPlan:
    return plan_transfer(shape, itemsize, tiles_of(src, shape), tiles_of(dst, shape))


def transfer_plan(array: jax.Array, dst_sharding: Any) -> TransferPlan:
    """The (cached) plan that moves ``array`` onto ``dst_sharding``."""
    return _cached_plan(tuple(array.shape), array.dtype.itemsize, array.sharding, dst_sharding)


def _local(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def move(array: jax.Array, dst_sharding: Any) -> jax.Array:
    """``array`` resharded onto ``dst_sharding`` (possibly other devices), per its plan."""
    return move_all([array], [dst_sharding])[0]


def move_all(arrays: Sequence[jax.Array], dst_shardings: Sequence[Any], on_host: bool | None = None) -> list[jax.Array]:
    """Every array resharded onto its destination sharding, all in the same two rounds.

    A stage sends a micro-batch's activations to the next stage together; on small
    arrays a ``device_put`` costs far more in dispatch than in bytes, so their tiles
    share one batched ``device_put`` and their replica copies a second. ``on_host``:
    cut and assemble partial pieces on the host (default: on CPU devices only).
    """
    if not arrays:
        return []
    devices = {d.id: d for dst in dst_shardings for d in dst.device_set}
    tiles: list[Any] = []  # (array index, device id, host or device data), in order
    copies: list[tuple[int, Any]] = []
    for index, (array, dst) in enumerate(zip(arrays, dst_shardings, strict=True)):
        plan = transfer_plan(array, dst)
        host = on_host if on_host is not None else next(iter(array.sharding.device_set)).platform == "cpu"
        tiles.extend((index, receiver, data) for receiver, data in _tiles(array, plan, host, devices).items())
        copies.extend((index, c) for c in plan.copies)
    put = jax.device_put([data for _, _, data in tiles], [devices[r] for _, r, _ in tiles])
    placed: list[dict[int, Any]] = [{} for _ in arrays]
    for (index, receiver, _), x in zip(tiles, put, strict=True):
        placed[index][receiver] = x
    if copies:
        copied = jax.device_put([placed[i][c.src] for i, c in copies], [devices[c.dst] for _, c in copies])
        for (index, c), x in zip(copies, copied, strict=True):
            placed[index][c.dst] = x
    return [
        jax.make_array_from_single_device_arrays(
            array.shape, dst, [placed[i][d.id] for d in dst.addressable_devices_indices_map(array.shape)])
        for i, (array, dst) in enumerate(zip(arrays, dst_shardings, strict=True))
    ]


def _tiles(array: jax.Array, plan: TransferPlan, on_host: bool, devices: dict[int, Any]) -> dict[int, Any]:
    """Per receiving device, the tile it needs, assembled from the plan's pieces: on
    the host from numpy views, or else on the receiving device."""
    shards = {s.device.id: s for s in array.addressable_shards}
    origin = {s.device.id: tuple(sl.indices(n)[:2] for sl, n in zip(s.index, array.shape, strict=True)) for s in array.addressable_shards}
    pieces: dict[int, list[Any]] = {}
    for send in plan.sends:
        shard = shards[send.src]
        if send.box == origin[send.src]:  # the whole shard: device to device, without waiting
            pieces.setdefault(send.dst, []).append((send.box, shard.data))
            continue
        view = np.asarray(shard.data) if on_host else shard.data
        pieces.setdefault(send.dst, []).append((send.box, view[_local(send.box, origin[send.src])]))
    tiles: dict[int, Any] = {}
    for receiver, parts in pieces.items():
        tile = plan.dst_tiles[receiver]
        if len(parts) == 1 and parts[0][0] == tile:
            tiles[receiver] = parts[0][1]
        elif on_host:
            data = np.empty([hi - lo for lo, hi in tile], array.dtype)
            for box, part in parts:
                data[_local(box, tile)] = np.asarray(part)
            tiles[receiver] = data
        else:
            placed = jax.device_put([part for _, part in parts], devices[receiver])
            data = jnp.zeros([hi - lo for lo, hi in tile], array.dtype, device=devices[receiver])
            for (box, _), part in zip(parts, placed, strict=True):
                data = data.at[_local(box, tile)].set(part)
            tiles[receiver] = data
    return tiles
