"""Run the calibration steps in order, each on the constants the ones before found."""

from __future__ import annotations

import dataclasses
import datetime
import platform
import socket
from collections.abc import Callable, Sequence
from typing import Any

from alpajob.api.catalog import GPU_PRODUCT_PRESETS, DevicePreset
from alpajob.api.errors import ManifestError
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.cost.measured import Machine, MeasuredConstants
from alpajob.planner.cost.model import load_calibration

#: The steps, in the order they run (see the package docstring).
STEPS = ("kernels", "matmul", "host", "update", "instructions", "fusion")
#: The steps that need 8 forced CPU devices: one host's devices sharing its cores
#: (host), training with the local runtime on several of them (update, instructions).
HOST_STEPS = frozenset({"host", "update", "instructions"})
#: What runs by default on accelerators: the rates and the fusion fit. Not
#: :data:`HOST_STEPS`, nor ``matmul``, whose small shapes measure a CPU's operand
#: packing (on a GPU they would measure launch latency, and its fitted rate would
#: stand for every matmul).
DEVICE_STEPS = ("kernels", "fusion")
#: ``--quick``: the micro-benchmarks, no training runs (CPU devices, accelerators).
QUICK_STEPS = ("kernels", "matmul")
DEVICE_QUICK_STEPS = ("kernels",)


def device_preset(devices: list[Any]) -> str:
    """The preset the local devices are: ``cpu``, or the GPU preset of their kind
    (``NVIDIA H100 80GB HBM3`` -> ``h100-80gb``)."""
    if devices[0].platform == "cpu":
        return DevicePreset.CPU.value
    label = str(devices[0].device_kind).replace(" ", "-")
    if label not in GPU_PRODUCT_PRESETS:
        raise ManifestError("--preset", f"no preset for device {devices[0].device_kind!r}; "
                                        f"name the closest with --preset "
                                        f"({', '.join(p.value for p in DevicePreset)})")
    return GPU_PRODUCT_PRESETS[label].value


def _processor() -> str:
    """The CPU's model name (Linux), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(devices: list[Any]) -> Machine:
    """Where and when (now) the constants are measured."""
    import jax

    return Machine(
        host=socket.gethostname(),
        processor=_processor(),
        backend=devices[0].platform,
        device_kind=str(devices[0].device_kind),
        devices=len(devices),
        jax=jax.__version__,
        measured_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def calibrate(steps: Sequence[str] | None = None, preset: str | None = None,
              progress: Callable[[str], None] | None = None,
              quick: bool = False) -> MeasuredConstants:
    """Measure this machine's devices and fit the cost model's constants.

    ``steps``: which of :data:`STEPS` to run (in their order; default all of them on
    CPU devices, :data:`DEVICE_STEPS` on accelerators, or with ``quick`` the
    platform's micro-benchmarks); ``preset``: the preset refined (default: the
    devices' own). :data:`HOST_STEPS` need 8 CPU devices, ``matmul`` CPU devices.
    """
    import jax

    from alpajob.trainer_image.calibration.fusion import measure_fusion
    from alpajob.trainer_image.calibration.host import measure_host
    from alpajob.trainer_image.calibration.kernels import measure_kernels
    from alpajob.trainer_image.calibration.matmul import measure_matmul
    from alpajob.trainer_image.calibration.overheads import measure_instructions, measure_update

    devices = jax.devices()
    preset = preset or device_preset(devices)
    on_cpu = devices[0].platform == "cpu"
    if steps is None:
        steps = ((QUICK_STEPS if on_cpu else DEVICE_QUICK_STEPS) if quick
                 else (STEPS if on_cpu else DEVICE_STEPS))
    chosen = [step for step in STEPS if step in steps]
    if "matmul" in chosen and not on_cpu:
        raise ManifestError("--steps", "matmul measures a CPU's operand packing; on "
                                       f"{devices[0].platform} devices leave it out "
                                       f"(--steps {','.join(DEVICE_STEPS)})")
    if HOST_STEPS & set(chosen) and (devices[0].platform != "cpu" or len(devices) != 8):
        raise ManifestError("--steps", "host, update and instructions measure 8 CPU devices "
                                       f"(found {len(devices)} {devices[0].platform}); "
                                       "run them on a CPU machine or leave them out "
                                       f"(--steps {','.join(DEVICE_STEPS)})")
    measured = MeasuredConstants(machine=machine(devices), preset=preset)
    for step in chosen:
        if progress is not None:
            progress(step)
        cluster = measured.refine_cluster(cluster_from_preset(preset, 1, len(devices)))
        calibration = measured.refine_calibration(load_calibration(preset))
        host_peak = cluster.device.peak("float32") / cluster.device.host_share
        host_bandwidth = cluster.device.memory_bandwidth / cluster.device.host_share
        if step == "kernels":
            found = measure_kernels(devices)
        elif step == "matmul":
            found = measure_matmul(
                devices, host_peak, host_bandwidth * calibration.memory_efficiency,
                {"vector_flops_fraction": calibration.vector_flops_fraction,
                 "conv_efficiency": calibration.conv_efficiency})
        elif step == "host":
            found = measure_host(devices)
        elif step == "update":
            found = measure_update(cluster, calibration)
        elif step == "instructions":
            found = measure_instructions(cluster, calibration)
        else:
            found = measure_fusion(cluster, calibration, devices, progress=progress)
        measured = _merged(measured, found)
    return measured


def _merged(measured: MeasuredConstants, found: dict[str, Any]) -> MeasuredConstants:
    """``measured`` with one step's fit laid over it."""
    device = dict(measured.device)
    for key, value in found["device"].items():
        device[key] = {**device.get(key, {}), **value} if isinstance(value, dict) else value
    return dataclasses.replace(
        measured, device=device,
        calibration={**measured.calibration, **found["calibration"]},
        measurements={**measured.measurements, **found["measurements"]})
