"""A matmul's time against its shape (operand packing).

A matmul's time is not proportional to its FLOPs: small ones run far below the rate
of big ones, because a CPU kernel first copies (packs) both operands into cache-sized
blocks. With all K devices busy, ``rows x inner @ inner x outer`` runs for rows 64,
256, 1024 and four weight shapes from 128 x 512 to 512 x 2048; each shape's time is
the lowest of three medians. A least-squares fit (relative errors) of
``t = a + K F / R + K x (lhs + rhs bytes) / memory_bandwidth`` gives the rate R and
``matmul_operand_traffic`` x (a, the call's launch, is the instruction overhead's
part in training and is not stored). ``matmul_efficiency`` is R over the float32
peak; where R passes it, R becomes the peak (efficiency 1) and
``vector_flops_fraction`` and ``conv_efficiency`` are rescaled to keep their rates.
"""

from __future__ import annotations

from typing import Any

from alpajob.trainer_image.calibration.timing import per_device_seconds


def measure_matmul(devices: list[Any], peak_float32: float, memory_bandwidth: float,
                   fractions: dict[str, float]) -> dict[str, Any]:
    """The fit on ``devices``, given the host's float32 peak and memory bandwidth so
    far and the calibration's ``vector_flops_fraction`` and ``conv_efficiency``."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    k = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    shapes = [(rows, inner, outer)
              for inner, outer in ((128, 512), (256, 1024), (1024, 256), (512, 2048))
              for rows in (64, 256, 1024)]
    best: dict[tuple[int, int, int], float] = {}
    for _sweep in range(3):  # the lowest of 3 medians: a burst of host noise hits one
        for rows, inner, outer in shapes:
            t = per_device_seconds(mesh, lambda a, b: a @ b[0], ((rows, inner), jnp.float32),
                                   ((1, inner, outer), jnp.float32), reps=9)
            best[rows, inner, outer] = min(t, best.get((rows, inner, outer), t))
    flops = np.array([2.0 * r * i * o for r, i, o in best])
    operands = np.array([4.0 * (r * i + i * o) for r, i, o in best])  # f32 lhs + rhs bytes
    seconds = np.array(list(best.values()))
    design = np.stack([np.ones_like(flops), k * flops, k * operands / memory_bandwidth], axis=1)
    weights = 1.0 / seconds  # relative errors: the small matmuls matter as much
    launch, inv_rate, traffic = np.linalg.lstsq(design * weights[:, None], seconds * weights,
                                                rcond=None)[0]
    rate, traffic = 1.0 / float(inv_rate), max(0.0, float(traffic))
    fitted = design @ np.array([launch, 1.0 / rate, traffic])
    result: dict[str, Any] = {
        "device": {},
        "calibration": {"matmul_efficiency": round(min(1.0, rate / peak_float32), 3),
                        "matmul_operand_traffic": round(traffic, 3)},
        "measurements": {
            "matmul_shapes": [
                f"{r}x{i}x{o}: {k * f / t / 1e9:.0f} GFLOP/s (host), fit {100 * (p - t) / t:+.0f}%"
                for (r, i, o), f, t, p in zip(best, flops, seconds, fitted, strict=True)],
            "matmul_launch_ms": round(float(launch) * 1e3, 3),
        },
    }
    if rate > peak_float32:
        # Big matmuls beat the peak measured at fewer shapes: the fitted rate becomes
        # the float32 peak, and the fractions of it other ops run at are rescaled so
        # their rates stay what they were.
        result["device"] = {"peak_flops": {"float32": round(rate, -6)}}
        for name, value in fractions.items():
            result["calibration"][name] = round(value * peak_float32 / round(rate, -6), 4)
    return result
