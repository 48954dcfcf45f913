"""Fingerprints of arrays: a restored checkpoint must hold exactly what was saved.

The fingerprint of an array ``x`` of ``n`` elements is a weighted sum of its elements'
bit patterns, modulo ``2**32``::

    F(x) = sum_i bits(x_i) * w_i  (mod 2**32),   w_i = (2 i + 1) * 2654435761  (mod 2**32)

``bits(x_i)`` is element ``i``'s bit pattern as an unsigned integer (64-bit elements
count as two 32-bit words). Every weight is odd, hence invertible modulo ``2**32``, so
changing one element by ``d != 0`` changes ``F`` by ``d * w_i != 0``: every corruption
of one element is caught, and a corruption of several escapes with probability
``2**-32``. Weights that grow with ``i`` also catch swapped elements. ``F`` is computed
where the array lives (a jitted reduction over its shards) and only the 32-bit result
leaves the devices.

Example: ``x = [1.0]`` (float32 bits ``0x3F800000``) has ``F = 0x3F800000 * 2654435761
mod 2**32``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
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
def _fingerprint(x: jax.Array) -> jax.Array:
    words = _words(x)
    index = jnp.arange(words.size, dtype=jnp.uint32)
    weights = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(_GOLDEN)
    return jnp.sum(words * weights, dtype=jnp.uint32)


def fingerprints(arrays: Mapping[str, jax.Array]) -> dict[str, int]:
    """``{name: F(array)}`` for every array (module docstring), fetched in one go."""
    names = sorted(arrays)
    values = jax.device_get([_fingerprint(arrays[name]) for name in names])
    return {name: int(value) for name, value in zip(names, values, strict=True)}


def mismatches(expected: Mapping[str, int], arrays: Mapping[str, jax.Array]) -> list[str]:
    """The names among ``arrays`` whose fingerprint is not the ``expected`` one."""
    found = fingerprints(arrays)
    return [name for name in sorted(arrays) if expected.get(name) != found[name]]
