"""Move an array between local devices by executing a :class:`~.transfer.TransferPlan`.

The mechanism for one process that sees every device (the local runner). Each
receiver's tile is assembled from the pieces sent to it, put on the receiver, and
copied device-to-device to the rest of its group (each of the two rounds is one
batched ``jax.device_put``, shared by all the arrays of one :func:`move_all`); the
result is one global ``jax.Array`` with the destination sharding.

**Same layout.** When the destination's tiles, in its devices' order, are the
source's tiles in the source's order, and no two destination devices share a tile,
the plan is one whole shard from the i-th source device to the i-th destination
device, and nothing else. Those arrays move in one ``jax.device_put`` onto their
destination shardings (JAX copies shard for shard, device to device) rather than
tile by tile: it does the same copies with about 40% less host work per array, which
matters when a small model's step makes dozens of moves (measured on 2 cores). Between pipeline stages this is the common case: a batch-sharded
activation going to a submesh of the same shape.

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

from alpajob.trainer_image.runtime.transfer import Box, TransferPlan, plan_transfer, tiles_of


@cache
def _cached_plan(shape: tuple[int, ...], itemsize: int, src: Any, dst: Any) -> TransferPlan:
    return plan_transfer(shape, itemsize, tiles_of(src, shape), tiles_of(dst, shape))


def transfer_plan(array: jax.Array, dst_sharding: Any) -> TransferPlan:
    """The (cached) plan that moves ``array`` onto ``dst_sharding``."""
    return _cached_plan(tuple(array.shape), array.dtype.itemsize, array.sharding, dst_sharding)


@cache
def _cached_same_layout(shape: tuple[int, ...], src: Any, dst: Any) -> bool:
    if not (src.is_fully_addressable and dst.is_fully_addressable):
        return False
    src_tiles = list(tiles_of(src, shape).values())  # in each sharding's device order
    dst_tiles = list(tiles_of(dst, shape).values())
    return src_tiles == dst_tiles and len(set(dst_tiles)) == len(dst_tiles)


def same_layout(array: jax.Array, dst_sharding: Any) -> bool:
    """Whether ``array`` moves onto ``dst_sharding`` shard for shard (module docstring):
    its plan then sends the i-th source shard, whole, to the i-th destination device."""
    return _cached_same_layout(tuple(array.shape), array.sharding, dst_sharding)


def _local(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def move(array: jax.Array, dst_sharding: Any) -> jax.Array:
    """``array`` resharded onto ``dst_sharding`` (possibly other devices), per its plan."""
    return move_all([array], [dst_sharding])[0]


def move_all(arrays: Sequence[jax.Array], dst_shardings: Sequence[Any], on_host: bool | None = None) -> list[jax.Array]:
    """Every array resharded onto its destination sharding, in at most three puts.

    The driver moves a round's messages together; on small arrays a ``device_put``
    costs far more in dispatch than in bytes, so the same-layout arrays share one
    ``device_put``, the others' tiles a second and their replica copies a third. ``on_host``:
    cut and assemble partial pieces on the host (default: on CPU devices only).
    """
    moved: list[Any] = [None] * len(arrays)
    direct = [i for i, (a, dst) in enumerate(zip(arrays, dst_shardings, strict=True)) if same_layout(a, dst)]
    if direct:
        for i, x in zip(direct, jax.device_put([arrays[i] for i in direct], [dst_shardings[i] for i in direct]),
                        strict=True):
            moved[i] = x
    rest = [i for i in range(len(arrays)) if moved[i] is None]
    if rest:
        for i, x in zip(rest, _move_tiles([arrays[i] for i in rest], [dst_shardings[i] for i in rest], on_host),
                        strict=True):
            moved[i] = x
    return moved


def _move_tiles(arrays: Sequence[jax.Array], dst_shardings: Sequence[Any], on_host: bool | None) -> list[jax.Array]:
    """Arrays moved tile by tile per their plans, in two batched ``device_put`` rounds."""
    devices = {d.id: d for dst in dst_shardings for d in dst.device_set}
    tiles: list[Any] = []  # (array index, device id, host or device data), in order
    copies: list[tuple[int, Any]] = []
    for index, (array, dst) in enumerate(zip(arrays, dst_shardings, strict=True)):
        plan = transfer_plan(array, dst)
        first: Any = next(iter(array.sharding.device_set))
        host = on_host if on_host is not None else first.platform == "cpu"
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
            host_tile = np.empty([hi - lo for lo, hi in tile], array.dtype)
            for box, part in parts:
                host_tile[_local(box, tile)] = np.asarray(part)
            tiles[receiver] = host_tile
        else:
            placed = jax.device_put([part for _, part in parts], devices[receiver])
            device_tile = jnp.zeros([hi - lo for lo, hi in tile], array.dtype, device=devices[receiver])
            for (box, _), part in zip(parts, placed, strict=True):
                device_tile = device_tile.at[_local(box, tile)].set(part)
            tiles[receiver] = device_tile
    return tiles
