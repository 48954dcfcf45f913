"""Cross-mesh resharding plans: which tile goes from which device to which (pure).

A stage's output lives on its submesh with one sharding; the next stage needs it on
another submesh with another sharding. Every device of the destination needs its
tile (a box of the global array). Following Alpa's cross-mesh resharding (section 6
of the paper), each needed piece crosses between meshes **once**:

1. Group destination devices by the tile they need (replicated destinations share
   a tile). The first device of a group is its **receiver**.
2. Cut the receiver's tile by the source tiles it intersects. Each piece is sent
   once, from one of the source devices that hold it (replicas take turns, so the
   sending load spreads over the source mesh).
3. The group's other devices get the whole tile by a **local copy** from the
   receiver, inside the destination mesh (Alpa's local all-gather).

The plan is plain data over device ids and boxes; :mod:`.transport` moves the bytes
on local devices, and the Ray runtime moves them through its object store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: A box of the global array: per dimension ``(start, stop)``.
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Send:
    """Send ``box`` (global coordinates) from ``src`` to ``dst`` across meshes."""

    src: int
    dst: int
    box: Box


@dataclass(frozen=True)
class LocalCopy:
    """Copy the whole tile ``box`` from ``src`` to ``dst`` inside the destination mesh."""

    src: int
    dst: int
    box: Box


@dataclass(frozen=True)
class TransferPlan:
    """How one array moves from its source tiles to its destination tiles."""

    shape: tuple[int, ...]
    itemsize: int
    sends: tuple[Send, ...]
    copies: tuple[LocalCopy, ...]
    dst_tiles: Mapping[int, Box]

    @property
    def cross_mesh_bytes(self) -> int:
        """Bytes sent between the two meshes."""
        return sum(box_size(s.box) for s in self.sends) * self.itemsize


def box_size(box: Box) -> int:
    """Number of elements in ``box``."""
    return int(np.prod([hi - lo for lo, hi in box], dtype=np.int64))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def box_of(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """A box from the tuple of slices that ``Sharding.devices_indices_map`` gives."""
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True))


def tiles_of(sharding: Any, shape: Sequence[int]) -> dict[int, Box]:
    """Device id -> its tile, for a ``jax.sharding.Sharding`` of an array of ``shape``."""
    return {
        device.id: box_of(index, shape)
        for device, index in sharding.devices_indices_map(tuple(shape)).items()
    }


def plan_transfer(
    shape: Sequence[int],
    itemsize: int,
    src_tiles: Mapping[int, Box],
    dst_tiles: Mapping[int, Box],
) -> TransferPlan:
    """The sends and local copies that give every destination device its tile."""
    holders: dict[Box, list[int]] = {}
    for device in sorted(src_tiles):
        holders.setdefault(src_tiles[device], []).append(device)
    groups: dict[Box, list[int]] = {}
    for device in sorted(dst_tiles):
        groups.setdefault(dst_tiles[device], []).append(device)
    turn = dict.fromkeys(holders, 0)
    sends: list[Send] = []
    copies: list[LocalCopy] = []
    for tile in sorted(groups):
        receiver, *others = groups[tile]
        for src_tile in sorted(holders):
            piece = intersect(tile, src_tile)
            if piece is None:
                continue
            replicas = holders[src_tile]
            sends.append(Send(replicas[turn[src_tile] % len(replicas)], receiver, piece))
            turn[src_tile] += 1
        copies.extend(LocalCopy(receiver, other, tile) for other in others)
    return TransferPlan(tuple(shape), itemsize, tuple(sends), tuple(copies), dict(dst_tiles))
