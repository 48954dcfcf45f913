"""Timing a jitted function on every local device at once."""

from __future__ import annotations

import statistics
import time
from typing import Any


def median_seconds(fn: Any, *args: Any, reps: int = 7, queued: int = 1) -> float:
    """Median wall time of ``fn(*args)`` over ``reps`` runs, after one warm-up run
    (which compiles it). ``queued`` > 1: each run dispatches that many calls before
    waiting for the last and counts a ``queued``-th of the time, so an accelerator's
    launch and synchronisation latency (tens of microseconds) overlaps its work."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        results = [fn(*args) for _ in range(queued)]
        jax.block_until_ready(results)
        times.append((time.perf_counter() - start) / queued)
    return statistics.median(times)


def per_device_seconds(mesh: Any, fn: Any, *shapes: tuple[tuple[int, ...], Any],
                       reps: int = 7, queued: int = 1) -> float:
    """Seconds for every device of ``mesh`` to run ``fn`` on its own arrays of
    ``shapes`` (each device's shape and dtype; one ``shard_map`` over all of them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    k = mesh.size
    specs = tuple(P("d") for _ in shapes)
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("d")))
    args = [
        jax.device_put(jnp.ones((k * s[0], *s[1:]), dtype), NamedSharding(mesh, P("d")))
        for s, dtype in shapes
    ]
    return median_seconds(mapped, *args, reps=reps, queued=queued)
