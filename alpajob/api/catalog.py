"""What a spec may name of the hardware: the device presets.

They are part of the AlpaJob contract (``spec.cluster.gpu``), so they live here,
without JAX; the planner's device data (``planner/cost/data/presets.json``) is checked
against this catalogue by the tests, so the two never drift apart. The zoo's models
have their own contract (:mod:`alpajob.api.zoo`).
"""

from __future__ import annotations

from enum import StrEnum


class DevicePreset(StrEnum):
    """``spec.cluster.gpu``: a device and interconnect the planner has data for."""

    V100_16GB = "v100-16gb"
    A100_40GB = "a100-40gb"
    A100_80GB = "a100-80gb"
    H100_80GB = "h100-80gb"
    H200_141GB = "h200-141gb"
    CPU = "cpu"  # local CPU devices (forced XLA host devices): `alpajob run` without GPUs


#: ``nvidia.com/gpu.product`` label values (as NVIDIA's GPU feature discovery writes
#: them) and the preset each one means.
GPU_PRODUCT_PRESETS: dict[str, DevicePreset] = {
    "Tesla-V100-SXM2-16GB": DevicePreset.V100_16GB,
    "NVIDIA-A100-SXM4-40GB": DevicePreset.A100_40GB,
    "NVIDIA-A100-SXM4-80GB": DevicePreset.A100_80GB,
    "NVIDIA-H100-80GB-HBM3": DevicePreset.H100_80GB,
    "NVIDIA-H200": DevicePreset.H200_141GB,
}


#: Each preset's device memory in bytes (the planner's presets hold the same numbers,
#: which the tests check), for the checks that bound a spec's memory before planning.
DEVICE_MEMORY_BYTES: dict[DevicePreset, int] = {
    DevicePreset.V100_16GB: 16 * 2**30,
    DevicePreset.A100_40GB: 40 * 2**30,
    DevicePreset.A100_80GB: 80 * 2**30,
    DevicePreset.H100_80GB: 80 * 2**30,
    DevicePreset.H200_141GB: 150754820096,
    DevicePreset.CPU: 2 * 2**30,
}
