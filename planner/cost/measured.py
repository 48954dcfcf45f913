"""Cost-model constants measured on one machine: what ``alpajob calibrate`` writes and
``alpajob plan|run --calibration FILE`` reads.

The presets (``data/presets.json``) and calibrations (``data/calibration.json``) the
planner ships are data-sheet values, or fits from the machine they were measured on.
A measured-constants file refines one preset with what the machine at hand does:

- ``machine``: where and when it was measured (host, processor, backend, device kind
  and count, JAX version, time), so a plan made with it says what it rests on;
- ``preset``: the device preset it refines (``cpu`` for forced host devices);
- ``device``: the preset's rates replaced (``peak_flops`` per dtype,
  ``memory_bandwidth``, ``intra_node_bandwidth``, ``intra_node_latency``), as the
  host's totals when the preset's devices share one host;
- ``calibration``: fields of :class:`~alpajob.planner.cost.model.Calibration` replaced
  (efficiencies, overheads, fusion fractions);
- ``measurements``: the raw figures behind the fit, kept for the record.

Unknown keys are refused with the key's name, so a typo cannot fall back silently.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alpajob.api.errors import ManifestError
from alpajob.planner.cost.cluster import ClusterSpec, DeviceSpec
from alpajob.planner.cost.model import Calibration

#: Fields of a preset that a measurement may replace.
DEVICE_FIELDS = frozenset(
    {"peak_flops", "memory_bandwidth", "intra_node_bandwidth", "intra_node_latency"}
)
#: Fields of :class:`Calibration` that a measurement may replace.
CALIBRATION_FIELDS = frozenset(
    f.name for f in dataclasses.fields(Calibration) if f.name not in ("preset", "free_primitives")
)


@dataclass(frozen=True)
class Machine:
    """Where and when constants were measured."""

    host: str
    processor: str
    backend: str  # jax's platform: cpu, gpu
    device_kind: str
    devices: int
    jax: str
    measured_at: str  # ISO 8601, UTC

    def describe(self) -> str:
        return (f"{self.devices} x {self.device_kind} ({self.backend}) on {self.host}, "
                f"{self.processor}, jax {self.jax}, {self.measured_at}")


@dataclass(frozen=True)
class MeasuredConstants:
    """One machine's measured constants for one preset (module docstring)."""

    machine: Machine
    preset: str
    device: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, float] = field(default_factory=dict)
    measurements: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for section, allowed in (("device", DEVICE_FIELDS), ("calibration", CALIBRATION_FIELDS)):
            unknown = sorted(set(getattr(self, section)) - allowed)
            if unknown:
                raise ValueError(f"{section}: unknown keys {unknown}; known: {sorted(allowed)}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=False) + "\n"

    def refine_cluster(self, cluster: ClusterSpec) -> ClusterSpec:
        """``cluster`` with this machine's rates (a shared host's split among its
        devices as the preset's are)."""
        share = cluster.device.host_share
        peak = {k: float(v) * share for k, v in self.device.get("peak_flops", {}).items()}
        device = DeviceSpec(
            name=cluster.device.name,
            peak_flops={**cluster.device.peak_flops, **peak},
            memory_bytes=cluster.device.memory_bytes,
            memory_bandwidth=float(self.device["memory_bandwidth"]) * share
            if "memory_bandwidth" in self.device else cluster.device.memory_bandwidth,
            host_share=share,
        )
        return dataclasses.replace(
            cluster, device=device,
            intra_node_bandwidth=float(self.device.get("intra_node_bandwidth",
                                                       cluster.intra_node_bandwidth)),
            intra_node_latency=float(self.device.get("intra_node_latency",
                                                     cluster.intra_node_latency)),
        )

    def refine_calibration(self, calibration: Calibration) -> Calibration:
        """``calibration`` with the measured fields replaced (ValueError: a value out
        of its range)."""
        fields: dict[str, Any] = dict(self.calibration)
        return dataclasses.replace(calibration, **fields)


def load_measured(path: str | Path, flag: str = "--calibration") -> MeasuredConstants:
    """Read a measured-constants file; a missing, unreadable or malformed file raises
    :class:`ManifestError` naming ``flag`` and what to fix."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ManifestError(flag, f"cannot read {path}: {error.strerror or error}; "
                                  "write one with `alpajob calibrate --output FILE`") from None
    except json.JSONDecodeError as error:
        raise ManifestError(flag, f"{path} is not JSON ({error.msg} at line {error.lineno}); "
                                  "write one with `alpajob calibrate --output FILE`") from None
    if not isinstance(doc, dict):
        raise ManifestError(flag, f"{path}: expected a JSON object written by `alpajob calibrate`")
    unknown = sorted(set(doc) - {f.name for f in dataclasses.fields(MeasuredConstants)})
    if unknown:
        raise ManifestError(flag, f"{path}: unknown keys {unknown}; expected machine, preset, "
                                  "device, calibration, measurements")
    expected = [f.name for f in dataclasses.fields(Machine)]
    if not isinstance(doc.get("machine"), dict) or sorted(doc["machine"]) != sorted(expected):
        raise ManifestError(flag, f"{path}: 'machine' must have exactly {', '.join(expected)}; "
                                  "write the file with `alpajob calibrate --output FILE`")
    try:
        machine = Machine(**doc["machine"])
        return MeasuredConstants(
            machine=machine,
            preset=str(doc["preset"]),
            device=dict(doc.get("device", {})),
            calibration={k: float(v) for k, v in doc.get("calibration", {}).items()},
            measurements=dict(doc.get("measurements", {})),
        )
    except KeyError as error:
        raise ManifestError(flag, f"{path}: missing {error.args[0]!r}; write the file with "
                                  "`alpajob calibrate --output FILE`") from None
    except (TypeError, ValueError) as error:
        raise ManifestError(flag, f"{path}: {error}") from None


def check_preset(measured: MeasuredConstants, cluster: ClusterSpec, flag: str = "--calibration") -> None:
    """Refuse constants measured for another device preset than the cluster's."""
    if measured.preset != cluster.preset:
        raise ManifestError(
            flag,
            f"the constants were measured for preset {measured.preset!r} "
            f"({measured.machine.describe()}), but the job plans for {cluster.preset!r}; "
            f"pass --gpu {measured.preset} or calibrate on a {cluster.preset} machine",
        )
