"""Rates of the op kinds the cost model prices, with every local device busy at once.

- **matmul**: float32 and bfloat16 ``dot`` at the shapes a transformer layer uses
  (on an accelerator, a GPT-350M to 1.3B layer's, and 8192 cubed); the best rate is
  the peak FLOP/s, the median over shapes divided by it the ``matmul_efficiency``;
- **vector arithmetic**: on CPU devices an Adam-like chain (multiply, add, square
  root, divide: most of a CPU step's non-matmul ops are the optimizer's) on
  cache-sized arrays; on an accelerator, where that chain is bound by memory, 256
  multiply-adds per element of a 256 MiB array, which XLA fuses into one loop bound
  by arithmetic: the FLOP rate over the peak is ``vector_flops_fraction``;
- **memory**: a streaming elementwise op on arrays far larger than any cache: bytes
  read and written per second is ``memory_bandwidth`` (``memory_efficiency`` 1);
- **collectives**: all-reduce and all-gather over 2, 4 and all devices from 64 KiB to
  4 MiB; a least-squares fit (relative errors) of the alpha-beta forms (all-reduce
  ``alpha + 2 beta (n-1)/n B``, all-gather ``alpha + beta (n-1)/n B``) gives
  ``intra_node_latency`` (alpha) and ``intra_node_bandwidth`` (1/beta), with
  ``comm_bandwidth_efficiency`` 1 and no extra collective overhead. One device has no
  collectives to time: its calibration leaves the preset's link constants as they are.

Rates are the host's (or node's) totals: K devices x each one's rate. On an
accelerator each timing queues ten calls before it waits (launch latency overlaps the
work, as in training).
"""

from __future__ import annotations

import statistics
from typing import Any

from alpajob.trainer_image.calibration.timing import median_seconds, per_device_seconds

#: Matmul shapes (rows, inner, outer) on CPU devices.
CPU_SHAPES = ((512, 256, 1024), (512, 1024, 256), (1024, 1024, 1024), (2048, 512, 512))
#: On an accelerator: a GPT-350M layer's projections at 8 x 1024 tokens, a 1.3B
#: layer's square one, and 8192 cubed (the data sheets' kind of peak).
ACCELERATOR_SHAPES = ((8192, 1024, 4096), (8192, 4096, 1024), (8192, 2048, 2048),
                      (8192, 8192, 8192))
#: Multiply-adds per element of the accelerator's vector kernel.
FMA_CHAIN = 256


def measure_kernels(devices: list[Any]) -> dict[str, Any]:
    """The preset's rates and the calibration's fractions, fitted on ``devices``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    k = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    on_cpu = devices[0].platform == "cpu"
    # Accelerators need bigger operands to reach their rates (and a stream past their
    # cache), and queued calls to hide their launch latency.
    scale, queued = (1, 1) if on_cpu else (8, 10)

    matmul: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for dtype_name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        for m, kk, n in CPU_SHAPES if on_cpu else ACCELERATOR_SHAPES:
            seconds = per_device_seconds(
                mesh, lambda a, b: a @ b[0], ((m, kk), dtype), ((1, kk, n), dtype),
                queued=queued)
            matmul[dtype_name].append(k * 2 * m * kk * n / seconds)
    peak = {name: max(rates) for name, rates in matmul.items()}
    matmul_efficiency = statistics.median(matmul["float32"]) / peak["float32"]

    if on_cpu:
        elements = 1 << 18  # 1 MiB per array per device: arithmetic bound

        def adam_like(p: Any, g: Any, m: Any, v: Any) -> Any:  # 14 FLOPs per element
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            return p - 0.001 * (m / 0.1) / (jnp.sqrt(v / 0.001) + 1e-8)

        vector_seconds = per_device_seconds(mesh, adam_like, *[((elements,), jnp.float32)] * 4)
        vector_rate = k * 14 * elements / vector_seconds
    else:
        elements = 1 << 26  # 256 MiB: 2 x 4 bytes moved per 2 x FMA_CHAIN FLOPs

        def fma_chain(x: Any) -> Any:
            for _ in range(FMA_CHAIN):
                x = x * 0.999 + 0.001
            return x

        vector_seconds = per_device_seconds(mesh, fma_chain, ((elements,), jnp.float32),
                                            queued=queued)
        vector_rate = k * 2 * FMA_CHAIN * elements / vector_seconds
    stream = (1 << 23) * scale * scale  # 32 MiB per device on CPU, 2 GiB on a GPU
    stream_seconds = per_device_seconds(mesh, lambda x: x * 2.0 + 1.0, ((stream,), jnp.float32),
                                        queued=queued)
    memory_bandwidth = k * 2 * 4 * stream / stream_seconds

    samples = []  # (factor * (n-1)/n * bytes, seconds, op, devices, bytes)
    for n in sorted({2, 4, k}):
        if n > k or n < 2:
            continue
        sub = Mesh(np.array(devices[:n]), ("d",))
        for nbytes in (1 << 16, 1 << 20, 1 << 22):
            shard = nbytes // 4 // n
            x = jax.device_put(jnp.ones((n * shard,), jnp.float32), NamedSharding(sub, P("d")))
            reduce = jax.jit(jax.shard_map(
                lambda v, n=n: jax.lax.psum(jnp.tile(v, n), "d"), mesh=sub,
                in_specs=P("d"), out_specs=P("d")))
            gather = jax.jit(jax.shard_map(
                lambda v: jax.lax.all_gather(v, "d", tiled=True), mesh=sub,
                in_specs=P("d"), out_specs=P("d")))
            samples.append((2 * (n - 1) / n * nbytes, median_seconds(reduce, x), "all-reduce",
                            n, nbytes))
            samples.append(((n - 1) / n * nbytes, median_seconds(gather, x), "all-gather",
                            n, nbytes))
    device: dict[str, Any] = {
        "peak_flops": {"float32": round(peak["float32"], -6),
                       "bfloat16": round(peak["bfloat16"], -6),
                       "float16": round(peak["bfloat16"], -6)},
        "memory_bandwidth": round(memory_bandwidth, -6),
    }
    calibration: dict[str, float] = {
        "matmul_efficiency": round(matmul_efficiency, 3),
        "vector_flops_fraction": round(min(1.0, vector_rate / peak["float32"]), 4),
        "memory_efficiency": 1.0,
    }
    fit_errors: list[float] = []
    if samples:  # one device has no collectives: the preset's link constants stand
        # least squares t = alpha + beta x, relative errors (small collectives are as
        # common as big ones), both kept positive
        xs = np.array([s[0] for s in samples])
        ts = np.array([s[1] for s in samples])
        design = np.stack([np.ones_like(xs), xs], axis=1)
        weights = 1.0 / ts
        alpha, beta = np.linalg.lstsq(design * weights[:, None], ts * weights, rcond=None)[0]
        alpha, beta = max(float(alpha), 1e-6), max(float(beta), 1e-12)
        fit_errors = [(alpha + beta * x - t) / t for x, t, *_ in samples]
        device["intra_node_bandwidth"] = round(1.0 / beta, -6)
        device["intra_node_latency"] = float(f"{alpha:.3g}")
        calibration.update(comm_bandwidth_efficiency=1.0, collective_overhead_seconds=0.0)
    return {
        "device": device,
        "calibration": calibration,
        "measurements": {
            "devices": k,
            "matmul_gflops": {name: [round(r / 1e9, 1) for r in rates]
                              for name, rates in matmul.items()},
            "vector_gflops": round(vector_rate / 1e9, 2),
            "memory_gbytes_per_second": round(memory_bandwidth / 1e9, 2),
            "collectives": [{"op": op, "devices": n, "bytes": nbytes, "ms": round(t * 1e3, 3)}
                            for _x, t, op, n, nbytes in samples],
            "collective_fit_error": [round(e, 3) for e in fit_errors],
        },
    }
