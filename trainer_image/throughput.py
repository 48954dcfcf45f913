"""How fast a run trains: tokens per second and model FLOPs utilization (MFU).

MFU is the model's FLOPs per step over what the devices could do in the step's time:
``model_flops / step_seconds / (devices x peak FLOP/s)``. The model's FLOPs are those
of its matrix products and convolutions, forward and backward, read from the traced
step (:func:`model_flops`): not the optimizer's elementwise work, and not work a plan
adds (rematerialized forwards), so a plan that recomputes shows a lower MFU, as in
PaLM's definition. The peak is the device preset's for the training dtype (a data
sheet's dense figure for GPUs; for ``cpu``, the host's measured rate).
"""

from __future__ import annotations

from dataclasses import dataclass

from alpajob.planner.cost.cluster import DeviceSpec
from alpajob.planner.graph.opgraph import OpGraph, Phase

#: The primitives whose FLOPs are the model's.
MODEL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})


def model_flops(graph: OpGraph) -> float:
    """FLOPs of the step's matrix products and convolutions, forward and backward."""
    return float(sum(op.flops for op in graph.ops if op.primitive in MODEL_PRIMITIVES
                     and op.phase in (Phase.FORWARD, Phase.BACKWARD)))


@dataclass(frozen=True)
class Throughput:
    """A run's per-step work, and the devices' peak (what MFU divides by)."""

    flops_per_step: float
    tokens_per_step: int | None  # None for models that read no tokens
    peak_flops: float  # every device of the run together

    @staticmethod
    def of(graph: OpGraph, tokens_per_step: int | None, device: DeviceSpec, devices: int,
           dtype: str) -> Throughput:
        return Throughput(model_flops(graph), tokens_per_step, device.peak(dtype) * devices)

    def tokens_per_second(self, seconds: float) -> float | None:
        return self.tokens_per_step / seconds if self.tokens_per_step and seconds > 0 else None

    def mfu(self, seconds: float) -> float | None:
        return self.flops_per_step / seconds / self.peak_flops if seconds > 0 and self.peak_flops else None
