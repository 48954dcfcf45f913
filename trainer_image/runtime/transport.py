"""Move an array between local devices by executing a :class:`~.transfer.TransferPlan`.

The mechanism for one process that sees every device (the local runner). Each
receiver's tile is assembled from the pieces sent to it, put on the receiver, and
copied device-to-device to the rest of its group (each of the two rounds is one
batched ``jax.device_put``); the result is one global ``jax.Array`` with the
destination sharding.

On CPU devices the pieces are cut from zero-copy numpy views of the source shards,
so a piece costs one memory copy; elsewhere they are cut by JAX slicing on the
source device.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import jax
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
    plan = transfer_plan(array, dst_sharding)
    shards = {s.device.id: s for s in array.addressable_shards}
    origin = {s.device.id: tuple(sl.indices(n)[:2] for sl, n in zip(s.index, array.shape, strict=True)) for s in array.addressable_shards}
    on_cpu = next(iter(array.sharding.device_set)).platform == "cpu"
    devices = {d.id: d for d in dst_sharding.device_set}
    pieces: dict[int, list[Any]] = {}
    for send in plan.sends:
        shard = shards[send.src]
        view = np.asarray(shard.data) if on_cpu else shard.data
        pieces.setdefault(send.dst, []).append((send.box, view[_local(send.box, origin[send.src])]))
    tiles: dict[int, Any] = {}
    for receiver, parts in pieces.items():
        tile = plan.dst_tiles[receiver]
        if len(parts) == 1 and parts[0][0] == tile:
            tiles[receiver] = parts[0][1]
        else:
            data = np.empty([hi - lo for lo, hi in tile], array.dtype)
            for box, part in parts:
                data[_local(box, tile)] = np.asarray(part)
            tiles[receiver] = data
    # One batched device_put per round: the tiles, then the copies of received tiles.
    placed = dict(zip(tiles, jax.device_put(list(tiles.values()), [devices[r] for r in tiles]), strict=True))
    if plan.copies:
        copied = jax.device_put([placed[c.src] for c in plan.copies], [devices[c.dst] for c in plan.copies])
        placed.update((c.dst, x) for c, x in zip(plan.copies, copied, strict=True))
    ordered = [placed[d.id] for d in dst_sharding.addressable_devices_indices_map(array.shape)]
    return jax.make_array_from_single_device_arrays(array.shape, dst_sharding, ordered)
