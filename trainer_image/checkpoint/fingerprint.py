"""Fingerprints of arrays: a restored checkpoint must hold exactly what was saved.

The fingerprint of an array ``x`` of ``n`` elements is a weighted sum of its elements'
bit patterns, modulo ``2**32``::

    F(x) = sum_i bits(x_i) * w_i  (mod 2**32),   w_i = (2 i + 1) * 2654435761  (mod 2**32)

``bits(x_i)`` is element ``i``'s bit pattern as an unsigned integer (64-bit elements
count as two 32-bit words). Every weight is odd, hence invertible modulo ``2**32``, so
changing one element by ``d != 0`` changes ``F`` by ``d * w_i != 0``: every corruption
of one element is caught, and a corruption of several escapes with probability
``2**-32``. Weights that grow with ``i`` also catch swapped elements. ``F`` is computed
where the array lives, one shard at a time on the shard's own device (each shard's
elements weighted by their global index, so the sharding does not change ``F``; an
array spread over several processes in one jitted sum), and only 32-bit sums leave
the devices.

Example: ``x = [1.0]`` (float32 bits ``0x3F800000``) has ``F = 0x3F800000 * 2654435761
mod 2**32``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_GOLDEN = 2654435761  # 2**32 / golden ratio: spreads the weights over 32 bits


def _words(x: jax.Array) -> jax.Array:
    """``x``'s elements as unsigned 32-bit words, flattened."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    if size == 1:
        return lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32).reshape(-1)
    if size == 2:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32).reshape(-1)
    return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)  # 8 bytes: two words each


@jax.jit
def _partial(x: jax.Array, starts: jax.Array, strides: jax.Array) -> jax.Array:
    """``F`` restricted to one shard ``x`` of a larger array: its elements' words weighted
    by their *global* word index (the shard starts at element ``starts`` of an array
    whose row-major ``strides`` are given; uint32 arithmetic wraps as ``F``'s does)."""
    words = _words(x)
    per = words.size // max(x.size, 1)  # words per element: 1, or 2 for 8-byte elements
    index = jnp.zeros(x.shape, jnp.uint32)
    for dim in range(x.ndim):
        index = index + (lax.broadcasted_iota(jnp.uint32, x.shape, dim) + starts[dim]) * strides[dim]
    index = index.reshape(-1)
    if per > 1:
        index = (index[:, None] * jnp.uint32(per) + jnp.arange(per, dtype=jnp.uint32)).reshape(-1)
    weights = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(_GOLDEN)
    return jnp.sum(words * weights, dtype=jnp.uint32)


def _shard_sums(x: jax.Array) -> list[jax.Array]:
    """One single-device program per distinct shard of ``x`` this process holds (a
    replicated shard counts once): no collective runs, so fingerprints never wait in a
    rendezvous with a step's collectives on the same devices (which aborted a mesh
    host on CPU: XLA's 40 s rendezvous timeout)."""
    shape = tuple(int(n) for n in x.shape)
    strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) % 2**32 for d in range(len(shape))]
    out = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        starts = [(s.start or 0) % 2**32 for s in shard.index]
        out.append(_partial(shard.data, jnp.asarray(starts, jnp.uint32).reshape(len(shape)),
                            jnp.asarray(strides, jnp.uint32).reshape(len(shape))))
    return out


@jax.jit
def _whole(x: jax.Array) -> jax.Array:
    """``F`` of a global array in one jitted sum (an all-reduce across its devices)."""
    words = _words(x)
    index = jnp.arange(words.size, dtype=jnp.uint32)
    weights = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(_GOLDEN)
    return jnp.sum(words * weights, dtype=jnp.uint32)


def fingerprints(arrays: Mapping[str, jax.Array]) -> dict[str, int]:
    """``{name: F(array)}`` for every array (module docstring). An array this process
    holds whole: its distinct shards' partial sums, each on its own device, added on
    the host modulo ``2**32``, all dispatched at once. An array spread over several
    processes (a mesh of several hosts): one jitted sum, whose all-reduce every process
    of the mesh joins, waited for before the next, so no two collectives are ever in
    flight at once."""
    names = sorted(arrays)
    local = {name: _shard_sums(jnp.asarray(arrays[name])) for name in names
             if getattr(arrays[name], "is_fully_addressable", True)}
    fetched = jax.device_get(local)
    out = {name: sum(int(v) for v in parts) % 2**32 for name, parts in fetched.items()}
    for name in names:
        if name not in out:
            out[name] = int(jax.device_get(_whole(arrays[name])))
    return {name: out[name] for name in names}


def mismatches(expected: Mapping[str, int], arrays: Mapping[str, jax.Array]) -> list[str]:
    """The names among ``arrays`` whose fingerprint is not the ``expected`` one."""
    found = fingerprints(arrays)
    return [name for name in sorted(arrays) if expected.get(name) != found[name]]
