"""How much of a shared host one device reaches alone (forced CPU devices).

XLA's forced host devices share one thread pool. A device runs its ops one after
another; only a big kernel (a large matmul) spreads over the cores, so one device
alone leaves cores idle while it runs its small ops, and several busy devices fill
them. The planner needs that share, ``lone_device_share`` u, to rank plans that use
fewer devices (:func:`~alpajob.planner.cost.model.host_utilization`).

Measured on a small GPT's forward and backward (the README job's: 4 layers, hidden
128, sequence 128, batch 32), run as the pipeline runtime runs a stage: the forward
and the backward as two executables (XLA's CPU backend runs the two 15-25% faster
than one fused ``value_and_grad``, and a fused program leaves more cores idle, so it
would measure a lower share). ``T1``: one device running it alone; ``Tk``: every one
of the k devices running its own copy at once (k times the work). The host's
throughput with every device busy is ``k / Tk`` copies per second, one device's
``1 / T1``, so ``u = Tk / (k T1)`` (at least 1/k: k copies cannot take longer than k
runs one after another, up to noise). The three are timed in rounds, one after
another, and the share is the median of the rounds' ratios: one device's time alone
spread 249-318 ms between calibrations on this host, so a ratio of separate medians
moved between 0.73 and 1. Two busy devices are measured too, to check
the model's ``1 - (1 - u)^2``. On 2 cores: u = 0.84-0.91, two devices 0.99-1.0.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

#: The model timed: the README job's byte-level GPT, the kind of model that trains
#: on forced CPU devices (about 0.26 s for a forward and backward on 2 cores).
MODEL = {"hidden": 128, "layers": 4, "heads": 4, "seqLen": 128, "vocab": 256}
BATCH = 32


class _Copies:
    """Every one of ``devices`` running ``forward`` then ``backward`` on its own copy
    of the parameters and batch, all dispatched at once."""

    def __init__(self, forward: Any, backward: Any, params: Any, batch: Any,
                 devices: list[Any]) -> None:
        import jax

        self._forward, self._backward = forward, backward
        self._placed = [(jax.device_put(params, d), jax.device_put(batch, d)) for d in devices]
        for _ in range(2):  # compile on each device, then one warm run
            self.seconds()

    def seconds(self) -> float:
        """Wall seconds of one run on every device."""
        import jax

        began = time.perf_counter()
        pullbacks = [self._forward(p, b)[1] for p, b in self._placed]
        jax.block_until_ready([self._backward(pullback) for pullback in pullbacks])
        return time.perf_counter() - began


def measure_host(devices: list[Any], rounds: int = 7) -> dict[str, Any]:
    """``lone_device_share`` on ``devices`` (one host's forced CPU devices), with the
    times behind it: ``rounds`` rounds, each timing one device, two and all of them
    once, one after another; the share is the median of the rounds' ratios (a slow
    moment of the host then spoils one round, not the figure)."""
    import jax
    import jax.numpy as jnp

    from alpajob.api.spec import ModelSpec
    from alpajob.trainer_image.entrypoint import load_model

    model = load_model(ModelSpec.model_validate({"zoo": "gpt", "config": MODEL}), "float32")
    params = model.init(jax.random.key(0))
    batch = {name: jnp.ones(shape.shape, shape.dtype)
             for name, shape in model.batch_shapes(BATCH).items()}
    # The forward returns the loss and its pullback (the residuals, as arrays); the
    # backward applies the pullback: two executables, as a pipeline stage runs them.
    forward = jax.jit(lambda p, b: jax.vjp(lambda q: model.loss(q, b), p))
    backward = jax.jit(lambda pullback: pullback(jnp.float32(1.0)))
    k = len(devices)
    one, two, every = (_Copies(forward, backward, params, batch, devices[:n]) for n in (1, 2, k))
    times = [(one.seconds(), two.seconds(), every.seconds()) for _ in range(rounds)]
    # Per round: the share of the host one device reaches, and two devices reach.
    lone = statistics.median(min(1.0, max(1.0 / k, t_all / (k * t_one)))
                             for t_one, _t_two, t_all in times)
    pair = statistics.median(min(1.0, 2 * t_all / (k * t_two)) for _t_one, t_two, t_all in times)
    return {"device": {}, "calibration": {"lone_device_share": round(lone, 3)},
            "measurements": {"host": {
                "model": f"gpt {MODEL}, batch {BATCH}, forward and backward",
                "one_device_ms": [round(t[0] * 1e3, 1) for t in times],
                "two_devices_ms": [round(t[1] * 1e3, 1) for t in times],
                f"{k}_devices_ms": [round(t[2] * 1e3, 1) for t in times],
                # What two busy devices reach, against the model's 1 - (1 - u)^2.
                "two_devices_share": round(pair, 3),
                "two_devices_share_model": round(1 - (1 - lone) ** 2, 3),
            }}}
