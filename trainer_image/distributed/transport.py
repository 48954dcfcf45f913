"""Cross-mesh transfers between processes: the transfer plan, carried by the Ray object store.

In one process (:mod:`alpajob.trainer_image.runtime.transport`) the sender sees the
receiver's devices. Across processes it does not, so both sides describe a
sharding by **positions**: position ``p`` is the ``p``-th device of the mesh in
row-major order, and its tile is the box of the global array it holds. Each stage
publishes the tiles of everything it receives (its :class:`Layout`); a sender plans
every transfer with :func:`~alpajob.trainer_image.runtime.transfer.plan_transfer` over
positions, exactly as the local runtime does over device ids, and:

1. :func:`cut` takes, for every send of the plan, the piece of its local shard (a
   zero-copy numpy view on CPU), grouped by the receiving position: one
   :class:`Parcel` per message, each needed piece in it once;
2. the parcel goes into the object store (``ray.put``) and its reference to the
   receiving actor;
3. :func:`assemble` (on the receiver) builds each receiver's tile from its pieces,
   puts it on that device, makes the plan's local copies inside the mesh, and returns
   one ``jax.Array`` with the receiver's sharding.

Meshes spanning several hosts (one JAX process group per mesh): every host of the
sending mesh computes the same plan and sends the pieces whose source position is its
own, so each needed piece still travels once. :func:`cut_for_hosts` splits one
host's pieces by the receiving host that owns each destination position (a copy
inside the receiver whose two ends live on different hosts becomes a second piece
sent straight to the far one); every sending host sends every receiving host one
parcel, possibly empty, so a receiver knows how many to wait for, and :func:`merge`
joins them before :func:`assemble`.

The alternative without the host hop of steps 2 and 3 is :mod:`.collective`: the same
plan's pieces moved by XLA collectives between the two meshes' devices (gloo on CPU;
on GPU the same collectives run on NCCL, which has not been run on a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from alpajob.trainer_image.runtime.transfer import Box, TransferPlan, box_of, plan_transfer

#: Position in the mesh -> the tile it holds.
Tiles = dict[int, Box]


def mesh_positions(sharding: Any) -> dict[int, int]:
    """Device id -> its row-major position in the sharding's mesh."""
    return {device.id: p for p, device in enumerate(sharding.mesh.devices.flat)}


def position_tiles(sharding: Any, shape: tuple[int, ...]) -> Tiles:
    """Position -> tile of an array of ``shape`` under ``sharding``."""
    where = mesh_positions(sharding)
    return {
        where[device.id]: box_of(index, shape)
        for device, index in sharding.devices_indices_map(tuple(shape)).items()
    }


@dataclass(frozen=True)
class Parcel:
    """What one message carries: per receiving position, its pieces (box, data)."""

    shape: tuple[int, ...]
    dtype: str
    pieces: dict[int, list[tuple[Box, np.ndarray]]]
    copies: tuple[tuple[int, int], ...]  # (from position, to position) inside the receiver

    @property
    def nbytes(self) -> int:
        return sum(int(part.nbytes) for parts in self.pieces.values() for _, part in parts)


def local_slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """The slices of ``box`` inside a tile that starts at ``origin``'s corner."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def plan_for(array: jax.Array, dst_tiles: Tiles) -> TransferPlan:
    """The transfer plan from ``array``'s positions to ``dst_tiles``."""
    src = position_tiles(array.sharding, tuple(array.shape))
    return plan_transfer(array.shape, array.dtype.itemsize, src, dst_tiles)


def cut(array: jax.Array, dst_tiles: Tiles) -> Parcel:
    """The pieces of ``array`` that the receiver's positions need, each once."""
    plan = plan_for(array, dst_tiles)
    where = mesh_positions(array.sharding)
    shards = {where[s.device.id]: s for s in array.addressable_shards}
    pieces: dict[int, list[tuple[Box, np.ndarray]]] = {}
    for send in plan.sends:
        shard = shards.get(send.src)
        if shard is None:  # another host of this mesh holds it and sends it
            continue
        origin = box_of(shard.index, array.shape)
        data = np.asarray(shard.data)[local_slices(send.box, origin)]
        pieces.setdefault(send.dst, []).append((send.box, data))
    copies = tuple((c.src, c.dst) for c in plan.copies)
    return Parcel(tuple(array.shape), str(array.dtype), pieces, copies)


def cut_for_hosts(array: jax.Array, dst_tiles: Tiles, owners: Mapping[int, int], hosts: int) -> list[Parcel]:
    """This host's pieces of ``array`` for the receiver, one parcel per receiving host
    (``owners``: receiving position -> its host)."""
    whole = cut(array, dst_tiles)
    parcels = []
    for host in range(hosts):
        pieces = {p: parts for p, parts in whole.pieces.items() if owners[p] == host}
        copies = []
        for src, dst in whole.copies:
            if owners[dst] != host:
                continue
            if owners[src] == host:
                copies.append((src, dst))
            elif src in whole.pieces:
                pieces.setdefault(dst, []).extend(whole.pieces[src])
        parcels.append(Parcel(whole.shape, whole.dtype, pieces, tuple(copies)))
    return parcels


def merge(parcels: list[Parcel]) -> Parcel:
    """One parcel from the parcels every sending host sent this receiver."""
    pieces: dict[int, list[tuple[Box, np.ndarray]]] = {}
    copies: dict[tuple[int, int], None] = {}
    for parcel in parcels:
        for position, parts in parcel.pieces.items():
            pieces.setdefault(position, []).extend(parts)
        copies.update(dict.fromkeys(parcel.copies))
    first = parcels[0]
    return Parcel(first.shape, first.dtype, pieces, tuple(copies))


def assemble(parcel: Parcel, sharding: Any) -> jax.Array:
    """The global array of ``parcel`` on ``sharding`` (the receiver's own)."""
    tiles = position_tiles(sharding, parcel.shape)
    devices = list(sharding.mesh.devices.flat)
    placed: dict[int, jax.Array] = {}
    for position, parts in parcel.pieces.items():
        tile = tiles[position]
        if len(parts) == 1 and parts[0][0] == tile:
            data = parts[0][1]
        else:
            data = np.empty([hi - lo for lo, hi in tile], parcel.dtype)
            for box, part in parts:
                data[local_slices(box, tile)] = part
        placed[position] = jax.device_put(data, devices[position])
    for src, dst in parcel.copies:
        placed[dst] = jax.device_put(placed[src], devices[dst])
    where = mesh_positions(sharding)
    ordered = [placed[where[d.id]] for d in sharding.addressable_devices_indices_map(parcel.shape)]
    return jax.make_array_from_single_device_arrays(parcel.shape, sharding, ordered)


def layout_of(shardings: Mapping[Any, tuple[Any, tuple[int, ...]]]) -> dict[Any, Tiles]:
    """A stage's :class:`Layout`: per message address, the tiles it receives into."""
    return {key: position_tiles(sharding, shape) for key, (sharding, shape) in shardings.items()}
