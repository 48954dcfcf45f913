"""What a spec may name: the zoo's models and the device presets.

Both are part of the AlpaJob contract (``spec.model.zoo``, ``spec.cluster.gpu``), so
they live here, without JAX: the zoo itself (:mod:`alpajob.trainer_image.zoo`) and the
planner's device data (``planner/cost/data/presets.json``) are checked against this
catalogue by the tests, so the three never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class ZooFamily:
    """A zoo family as a spec sees it: its named sizes and its config keys."""

    sizes: tuple[str, ...]
    int_keys: frozenset[str]
    float_keys: frozenset[str] = frozenset()

    @property
    def keys(self) -> frozenset[str]:
        return self.int_keys | self.float_keys


_GPT_KEYS = frozenset({"hidden", "layers", "heads", "seqLen", "vocab"})

#: The zoo (``alpajob models``): family name -> sizes and config keys.
ZOO: dict[str, ZooFamily] = {
    "gpt": ZooFamily(("tiny", "350m", "1.3b", "2.6b", "6.7b", "15b", "39b"), _GPT_KEYS),
    "moe": ZooFamily(
        ("tiny", "380m", "690m", "1.3b", "2.4b", "10b", "27b", "70b"),
        _GPT_KEYS | {"experts", "expertGroupSize"},
        frozenset({"capacityFactor"}),
    ),
    "wresnet": ZooFamily(
        ("tiny", "250m", "500m", "1b", "2b", "4b", "6.8b", "13b"),
        frozenset({"layers", "channels", "widthFactor", "imageSize", "numClasses"}),
    ),
    "mlp": ZooFamily(("tiny",), frozenset({"hidden", "layers", "inputDim", "outputDim"})),
}
