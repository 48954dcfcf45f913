"""A global array as the distinct shards each process holds, and back on one host.

The driver gathers the trained parameters from every mesh host this way: each host
sends :func:`local_pieces` (replica 0 of each shard, with its box in the global
array), and :func:`assemble_pieces` fills one host array from all of them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

Box = list[list[int]]


def local_pieces(array: jax.Array) -> list[tuple[Box, np.ndarray]]:
    """The distinct shards this process holds (replica 0 only), each with its box
    ``[[lo, hi], ...]`` in the global array. Over every process of the array's mesh
    these cover the array exactly once."""
    pieces = []
    for shard in array.addressable_shards:
        if shard.replica_id == 0:
            box = [list(sl.indices(n)[:2]) for sl, n in zip(shard.index, array.shape, strict=True)]
            pieces.append((box, np.asarray(shard.data)))
    return pieces


def assemble_pieces(shape: list[int] | tuple[int, ...], dtype: str, pieces: list[tuple[Box, Any]]) -> np.ndarray:
    """The host array of ``shape`` filled from ``pieces`` (box, data)."""
    data = np.empty(shape, dtype=dtype)
    for box, piece in pieces:
        data[tuple(slice(lo, hi) for lo, hi in box)] = piece
    return data
