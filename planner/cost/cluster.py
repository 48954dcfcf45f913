"""The cluster a plan is made for: N nodes x M devices, and how fast they talk.

Presets (``v100-16gb``, ``a100-40gb``, ``a100-80gb``, ``h100-80gb``, ``h200-141gb``, ``cpu``) are data,
in ``data/presets.json``; :func:`cluster_from_preset` builds a :class:`ClusterSpec`
from one, with the node count and devices per node chosen by the caller.

A preset marked ``shared_host`` (``cpu``: XLA's forced host devices) stores the whole
host's FLOP/s and memory bandwidth, measured by ``alpajob calibrate``; its
devices share the host's cores, so each of a node's ``devices_per_node`` devices gets
that fraction of them (in steady state every device of a plan is busy at once).

Bandwidths are in bytes per second, latencies in seconds, memory in bytes.
``inter_node_bandwidth`` is a whole node's network bandwidth: when every device of a
node sends across nodes at once they share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from alpajob.api.catalog import DevicePreset
from alpajob.api.errors import ClusterError
from alpajob.api.options import PlanOptions
from alpajob.api.spec import NodePoolSpec


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype, memory and memory bandwidth."""

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    memory_bytes: int
    memory_bandwidth: float
    #: The fraction of its host's rates this device gets: 1/K for K forced CPU devices
    #: sharing one host (``shared_host`` presets, whose rates above are already that
    #: share), 1 for an accelerator. A fixed host cost of c seconds costs such a device
    #: c / host_share seconds of its own (slowed) time.
    host_share: float = 1.0

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (float32's when the dtype is not listed)."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"])


@dataclass(frozen=True)
class ClusterSpec:
    """``num_nodes`` x ``devices_per_node`` identical devices.

    The planner cuts this grid into submeshes; it never names a Kubernetes node.
    """

    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    preset: str = "custom"
    #: The devices time-share one host's cores (forced CPU devices): an idle device's
    #: share goes to the busy ones, so a pipeline bubble costs no time.
    shared_host: bool = False
    #: On a shared host: the forced devices that exist per core of the host (all of
    #: them, used by the plan or not); 0 when unknown. More devices than cores slow
    #: every device down (:func:`~alpajob.planner.cost.model.oversubscription_factor`).
    devices_per_core: float = 0.0

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ClusterError(
                "spec.cluster.nodes", f"must be at least 1, got {self.num_nodes}"
            )
        if self.devices_per_node < 1:
            raise ClusterError(
                "spec.cluster.gpusPerNode", f"must be at least 1, got {self.devices_per_node}"
            )
        if self.devices_per_node & (self.devices_per_node - 1):
            raise ClusterError(
                "spec.cluster.gpusPerNode",
                f"must be a power of two (1, 2, 4, 8, ...) so submeshes tile a node, "
                f"got {self.devices_per_node}",
            )

    @property
    def num_devices(self) -> int:
        """Devices in the whole cluster."""
        return self.num_nodes * self.devices_per_node

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form, as stored in the Plan document."""
        return {
            "preset": self.preset,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": {
                "name": self.device.name,
                "peak_flops": dict(self.device.peak_flops),
                "memory_bytes": self.device.memory_bytes,
                "memory_bandwidth": self.device.memory_bandwidth,
            },
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "intra_node_latency": self.intra_node_latency,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "inter_node_latency": self.inter_node_latency,
            "shared_host": self.shared_host,
        } | ({"devices_per_core": self.devices_per_core} if self.devices_per_core else {})


@cache
def _presets() -> dict[str, dict[str, Any]]:
    text = resources.files("alpajob.planner.cost").joinpath("data/presets.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def preset_names() -> list[str]:
    """Names of the known device presets."""
    return sorted(_presets())


def cluster_for(pool: NodePoolSpec, options: PlanOptions | None = None) -> ClusterSpec:
    """The cluster ``spec.cluster`` describes, with the overrides of ``options``
    (``alpajob plan --nodes/--gpus-per-node/--gpu``) applied."""
    options = options or PlanOptions()
    if pool.pools is not None:
        raise ClusterError("spec.cluster.pools", (
            "names several GPU types, and this plans one cluster: plan across them with `alpajob plan` "
            "(run its plan with `alpajob run --plan FILE`, or apply the job), or name one type in spec.cluster.gpu"))
    preset = options.gpu or pool.preset()
    if preset is None:
        raise ClusterError(
            "spec.cluster.gpu",
            "not set, and spec.cluster.nodeSelector has no known nvidia.com/gpu.product; "
            f"set it to one of: {', '.join(p.value for p in DevicePreset)} (cpu: this machine's "
            "CPU devices; `alpajob plan --gpu` also overrides it)",
        )
    nodes = options.nodes if options.nodes is not None else pool.nodes
    per_node = options.gpus_per_node if options.gpus_per_node is not None else pool.gpus_per_node
    return cluster_from_preset(preset, nodes, per_node)


def pool_clusters(pool: NodePoolSpec, options: PlanOptions | None = None) -> tuple[ClusterSpec, ...]:
    """One cluster per pool of ``spec.cluster.pools``, in order, or per pool of
    ``options.pools`` (the usable nodes of each type, the operator's count: a type it
    found none of is not there, so one cluster may be left); ``alpajob plan``'s
    one-cluster flags (``--gpu``, ``--nodes``, ``--gpus-per-node``) are refused beside
    them (``--what-if`` plans other options)."""
    options = options or PlanOptions()
    assert pool.pools is not None
    for flag, value in (("--gpu", options.gpu), ("--nodes", options.nodes), ("--gpus-per-node", options.gpus_per_node)):
        if value is not None:
            raise ClusterError(flag, ("names one cluster, and spec.cluster.pools names several GPU types; drop it, "
                                      "or plan other options with --what-if"))
    named = {p.gpu for p in pool.pools}
    for usable in options.pools or ():
        if usable.gpu not in named:
            raise ClusterError("ALPAJOB_POOLS", f"names {usable.gpu.value}, which spec.cluster.pools does not "
                                                f"({', '.join(sorted(g.value for g in named))})")
    return tuple(cluster_from_preset(p.gpu, p.nodes, p.gpus_per_node) for p in options.pools or pool.pools)


def cluster_from_preset(
    preset: str, num_nodes: int, devices_per_node: int | None = None
) -> ClusterSpec:
    """A cluster of ``num_nodes`` nodes of preset ``preset``.

    ``devices_per_node`` defaults to the preset's (8 for every GPU preset).
    Raises :class:`ClusterError` naming ``spec.cluster.gpu`` for an unknown preset.
    """
    presets = _presets()
    preset = str(preset)
    if preset not in presets:
        raise ClusterError(
            "spec.cluster.gpu",
            f"unknown GPU preset {preset!r}; use one of: {', '.join(sorted(presets))}",
        )
    data = presets[preset]
    per_node = devices_per_node or int(data["gpus_per_node"])
    # A shared host's rates are the whole host's; each of its devices gets its share.
    share = 1.0 / per_node if data.get("shared_host", False) else 1.0
    device = DeviceSpec(
        name=preset,
        peak_flops={k: float(v) * share for k, v in data["peak_flops"].items()},
        memory_bytes=int(data["memory_bytes"]),
        memory_bandwidth=float(data["memory_bandwidth"]) * share,
        host_share=share,
    )
    return ClusterSpec(
        num_nodes=num_nodes,
        devices_per_node=per_node,
        device=device,
        intra_node_bandwidth=float(data["intra_node_bandwidth"]),
        intra_node_latency=float(data["intra_node_latency"]),
        inter_node_bandwidth=float(data["inter_node_bandwidth"]),
        inter_node_latency=float(data["inter_node_latency"]),
        preset=preset,
        shared_host=bool(data.get("shared_host", False)),
    )
