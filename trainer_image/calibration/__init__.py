"""``alpajob calibrate``: measure the machine at hand and fit the cost model's constants.

The planner prices every op from a device preset (peak FLOP/s, memory bandwidth,
links) and a calibration (achieved fractions, overheads). This package measures them
on the devices JAX sees here (forced CPU devices, or the GPUs of a GPU node) and
returns a :class:`~alpajob.planner.cost.measured.MeasuredConstants`, which
``alpajob plan|run --calibration FILE`` applies:

- :mod:`.kernels`: matmul rates per dtype, vector arithmetic, memory streaming and
  the alpha-beta fit of all-reduce and all-gather, with every device busy at once;
- :mod:`.matmul`: a matmul's time against its shape (the operand packing that small
  CPU matmuls spend most of their time on);
- :mod:`.host`: the share of a shared host one forced CPU device reaches alone (a
  small GPT's step on one device against every device running a copy at once);
- :mod:`.overheads`: the real local runtime training small models, for the host cost
  per pipeline instruction and per kernel, and the optimizer update's fused traffic;
- :mod:`.fusion`: four zoo families trained on one device, for the share of the
  non-matmul ops' unfused traffic that XLA's fusion leaves (``fused_memory_fraction``).

Each step fits what the ones before it leave unexplained: :func:`calibrate` runs them
in that order, each on the constants found so far.
"""

from alpajob.trainer_image.calibration.run import STEPS, calibrate

__all__ = ["STEPS", "calibrate"]
