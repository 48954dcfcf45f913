"""The analytic cost model: logical meshes, alpha-beta collectives, roofline compute.

Alpa profiles every candidate on real GPUs; we price them with closed forms instead,
calibrated once per device type (``data/calibration.json``, merged over its
``default`` entry).

Logical mesh
------------
A submesh of ``n`` nodes x ``m`` devices is viewed as a 2-D logical mesh of shape
``(a, b)``, ``a * b == n * m``. Devices are numbered row-major, node-major
(device ``d`` sits on node ``d // m``); logical position ``(i, j)`` is device
``i * b + j``. So the inner axis (1, size ``b``) groups ``b`` contiguous devices: it
stays inside a node iff ``b <= m``. The outer axis (0, size ``a``) groups devices
``b`` apart: inside a node iff ``n == 1``. Each axis gets its own latency ``alpha``
and inverse bandwidth ``beta`` (paper section 4.1). An inter-node axis shares the
node's network among the groups that cross it at once: on submesh (2, 8) with shape
(2, 8), axis 0 has 8 groups (one per GPU) per node, each getting 1/8 of the NIC.

Collectives (alpha-beta, ``B`` = bytes of the whole gathered tensor in one group of
``n`` devices along the axis)::

    all-gather      alpha + beta (n-1)/n   B
    reduce-scatter  alpha + beta (n-1)/n   B
    all-reduce      alpha + 2 beta (n-1)/n B
    all-to-all      (alpha + beta (n-1)/n^2 B) * penalty

Over both axes at once (``N = a * b`` devices) a collective is one NCCL ring over
all of them, as XLA runs it (one collective whose replica groups span both axes), so
the slowest link paces it::

    all-reduce over (0, 1)   max(alpha) + 2 max(beta) (N-1)/N B     (likewise the others)

This is Alpa's ``AllReduceCost(bytes, mesh_dim, mesh_dim_another)``. A hierarchical
schedule (reduce-scatter on the fast axis, all-reduce the 1/b share on the slow one,
all-gather back) would move only ``B/b`` over the slow links, ~0.6 B beta_slow on a
2 x 2 mesh against the ring's 1.5 B beta_slow; pricing that, which nothing here runs,
made the ILP prefer data parallelism over both axes where Megatron on the fast one
is faster. An inter-node axis' ``beta`` is its share of the NIC when each of the
node's devices runs its own group along it (``MeshAxis.link_sharers`` groups); the
one ring over both axes has the NIC to itself.

Compute (roofline)
------------------
``seconds = max(flops / (peak(dtype) * eff), bytes / (memory_bandwidth * mem_eff))``,
``eff`` the matmul, conv or vector efficiency by primitive. A sharding strategy
divides this by the number of devices that split the work; replicated work is not
divided (every device recomputes it), unlike Alpa, which treats compute as free.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from alpajob.planner.cost.cluster import ClusterSpec, DeviceSpec

#: Names of the two logical mesh axes, as they appear in PartitionSpecs.
AXIS_NAMES: tuple[str, str] = ("x", "y")


@dataclass(frozen=True)
class Calibration:
    """Fitted constants of the cost model for one device type (all data, no code)."""

    preset: str
    #: Achieved fraction of tensor-core peak FLOP/s for ``dot_general``.
    matmul_efficiency: float
    #: Achieved fraction of tensor-core peak FLOP/s for ``conv_general_dilated``.
    conv_efficiency: float
    #: Fraction of the tensor-core peak available to other arithmetic (vector units).
    vector_flops_fraction: float
    #: Achieved fraction of HBM bandwidth for memory-bound ops.
    memory_efficiency: float
    #: Fraction of an elementwise/reduction op's unfused HBM traffic left after XLA
    #: fuses it with its neighbours (dot and conv traffic is charged in full).
    fused_memory_fraction: float
    #: Achieved fraction of nominal link bandwidth inside collectives.
    comm_bandwidth_efficiency: float
    #: Fixed seconds added to every collective's latency (launch, synchronisation).
    collective_overhead_seconds: float
    #: Multiplier on the alpha-beta all-to-all cost (fitted, as in Alpa).
    all_to_all_penalty: float
    #: The same fraction for the optimizer update's ops; None: ``fused_memory_fraction``.
    #: XLA fuses a whole update chain into one loop (Adam reads a parameter, its
    #: gradient and two moments once and writes three arrays once), so far less of
    #: the unfused traffic remains than in the forward and backward passes, where
    #: matmuls and reductions cut the chains.
    update_fused_memory_fraction: float | None = None
    #: Host seconds of one pipeline instruction (a stage's forward, backward or update):
    #: launching its executable, moving its inputs, handing over between stage
    #: threads. Dominates small models; 0 where it has not been measured.
    instruction_overhead_seconds: float = 0.0
    #: The operand traffic of a ``dot_general`` that its arithmetic does not hide, as
    #: a multiple of its input bytes on each device, charged at memory bandwidth on
    #: top of its compute time. A CPU matmul first packs (copies) its operands into
    #: cache-sized blocks: for small matmuls (attention's per-head products, the
    #: layers of a small micro-batch) that copy is a large part of the time. 0 where
    #: it has not been measured (GPU kernels overlap operand loads with arithmetic).
    matmul_operand_traffic: float = 0.0
    #: Host seconds each kernel an op launches costs every device that runs it, however
    #: small the op: XLA's CPU runtime dispatching the kernel on each device and
    #: waiting for the host's threads. Only ops that XLA cannot fuse into a
    #: neighbour's loop launch a kernel (:func:`launches_kernel`). Dominates models
    #: whose ops are tiny; measured for ``cpu`` by ``alpajob calibrate`` (instructions),
    #: 0 where it has not been measured (GPU presets).
    kernel_overhead_seconds: float = 0.0
    #: The share of a shared host's throughput (forced CPU devices) that one device
    #: reaches when it is the only one busy. XLA runs one device's ops one after
    #: another and spreads only a big kernel over the cores, so a lone device leaves
    #: cores idle that several busy devices fill (:func:`host_utilization`). 1 where
    #: devices do not share a host or it has not been measured; measured for ``cpu``
    #: by ``alpajob calibrate`` (its host step).
    lone_device_share: float = 1.0
    #: How much slower every forced CPU device runs per forced device beyond one per
    #: core: with ``r`` devices per core a device's time is ``1 + a (r - 1)`` times
    #: what it is at one per core (``r <= 1``: 1). Measured on 2 cores
    #: (``benchmarks/forced_devices.py``: one device's chain of small matmuls, 47-49 ms
    #: with 1 or 2 devices, 51.5 with 4, 59.4 with 8); 0 where not measured.
    oversubscription_slowdown: float = 0.0
    #: The forced devices per core this calibration's rates were measured with (the
    #: ``cpu`` preset's: 8 on 2 cores); 0 when not a shared host.
    calibrated_devices_per_core: float = 0.0
    #: Layout primitives XLA fuses into their consumer; charged no time.
    free_primitives: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in (
            "matmul_efficiency",
            "conv_efficiency",
            "vector_flops_fraction",
            "memory_efficiency",
            "fused_memory_fraction",
            "comm_bandwidth_efficiency",
            "lone_device_share",
        ):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"calibration {self.preset!r}: {name} must be in (0, 1], got {value}")
        update = self.update_fused_memory_fraction
        if update is not None and not 0.0 < update <= 1.0:
            raise ValueError(
                f"calibration {self.preset!r}: update_fused_memory_fraction must be in (0, 1] "
                f"or null (then fused_memory_fraction applies), got {update}"
            )
        if (self.collective_overhead_seconds < 0 or self.all_to_all_penalty <= 0
                or self.instruction_overhead_seconds < 0 or self.matmul_operand_traffic < 0
                or self.kernel_overhead_seconds < 0 or self.oversubscription_slowdown < 0
                or self.calibrated_devices_per_core < 0):
            raise ValueError(
                f"calibration {self.preset!r}: collective_overhead_seconds, "
                f"instruction_overhead_seconds, matmul_operand_traffic, "
                f"kernel_overhead_seconds, oversubscription_slowdown and "
                f"calibrated_devices_per_core must be >= 0 and all_to_all_penalty > 0"
            )


@cache
def _calibration_table() -> dict[str, dict[str, Any]]:
    text = resources.files("alpajob.planner.cost").joinpath("data/calibration.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def load_calibration(preset: str) -> Calibration:
    """The calibration of device preset ``preset``, its entries merged over ``default``.

    A preset without an entry (``custom`` clusters) gets the defaults. Unknown keys in
    the file are refused, so a typo cannot silently fall back to a default.
    """
    table = _calibration_table()
    merged = dict(table["default"])
    merged.update(table.get(preset, {}))
    known = {f.name for f in dataclasses.fields(Calibration)} - {"preset"}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ValueError(
            f"data/calibration.json entry {preset!r} has unknown keys {unknown}; "
            f"known keys: {sorted(known)}"
        )
    merged["free_primitives"] = frozenset(merged.get("free_primitives", ()))
    return Calibration(preset=preset, **merged)


@dataclass(frozen=True)
class MeshAxis:
    """One logical mesh axis: its size, latency (s) and inverse bandwidth (s/byte)."""

    size: int
    alpha_seconds: float
    beta_seconds_per_byte: float
    #: Groups along this axis that share its slowest link at once (the devices of a
    #: node on an inter-node axis, each in its own group); ``beta`` is already one
    #: group's share.
    link_sharers: int = 1


@dataclass(frozen=True)
class LogicalMesh:
    """A 2-D view ``shape = (a, b)`` of a physical ``submesh = (n nodes, m devices)``.

    ``all_to_all_penalty`` comes from the calibration, so that resharding costs can be
    priced from the mesh alone.
    """

    submesh: tuple[int, int]
    shape: tuple[int, int]
    axes: tuple[MeshAxis, MeshAxis]
    all_to_all_penalty: float = 1.0
    axis_names: tuple[str, str] = AXIS_NAMES

    def __post_init__(self) -> None:
        if tuple(axis.size for axis in self.axes) != tuple(self.shape):
            raise ValueError(
                f"logical mesh shape {self.shape} does not match its axes' sizes "
                f"{tuple(axis.size for axis in self.axes)}"
            )
        if self.shape[0] * self.shape[1] != self.submesh[0] * self.submesh[1]:
            raise ValueError(
                f"logical mesh shape {self.shape} does not have the {self.num_devices} "
                f"devices of submesh {self.submesh}"
            )

    @property
    def num_devices(self) -> int:
        """Devices in the mesh."""
        return self.submesh[0] * self.submesh[1]

    @property
    def active_axes(self) -> tuple[int, ...]:
        """Indices of the axes of size > 1 (only these can split a tensor)."""
        return tuple(k for k, axis in enumerate(self.axes) if axis.size > 1)

    def size_of(self, axes: Sequence[int]) -> int:
        """Product of the sizes of ``axes``."""
        size = 1
        for k in axes:
            size *= self.axes[k].size
        return size


def make_logical_mesh(
    cluster: ClusterSpec,
    submesh: tuple[int, int],
    shape: tuple[int, int],
    calibration: Calibration | None = None,
) -> LogicalMesh:
    """The logical mesh ``shape`` over ``submesh`` of ``cluster`` (see module docstring).

    ``calibration`` defaults to the cluster preset's; its collective overhead is added
    to each axis' alpha and its bandwidth efficiency divides each axis' bandwidth.
    """
    n, m = submesh
    a, b = shape
    if n < 1 or m < 1 or n > cluster.num_nodes or m > cluster.devices_per_node:
        raise ValueError(
            f"submesh {submesh} does not fit the cluster of {cluster.num_nodes} nodes x "
            f"{cluster.devices_per_node} devices"
        )
    if a < 1 or b < 1 or a * b != n * m:
        raise ValueError(f"logical mesh shape {shape} must factor the {n * m} devices of {submesh}")
    if b > m and b % m:
        raise ValueError(
            f"logical mesh shape {shape}: an inner axis of {b} devices spanning nodes must "
            f"be a multiple of the {m} devices per node"
        )
    cal = calibration or load_calibration(cluster.preset)

    def axis(size: int, inter_node: bool, groups_per_node: int) -> MeshAxis:
        if size == 1:
            return MeshAxis(1, 0.0, 0.0)
        if inter_node:
            latency = cluster.inter_node_latency
            bandwidth = cluster.inter_node_bandwidth / groups_per_node
        else:
            latency = cluster.intra_node_latency
            bandwidth = cluster.intra_node_bandwidth
        return MeshAxis(
            size,
            latency + cal.collective_overhead_seconds,
            1.0 / (bandwidth * cal.comm_bandwidth_efficiency),
            groups_per_node if inter_node else 1,
        )

    inner = axis(b, inter_node=b > m, groups_per_node=1)
    outer = axis(a, inter_node=n > 1, groups_per_node=min(b, m))
    return LogicalMesh(
        submesh=(n, m),
        shape=(a, b),
        axes=(outer, inner),
        all_to_all_penalty=cal.all_to_all_penalty,
    )


def logical_mesh_shapes(submesh: tuple[int, int]) -> list[tuple[int, int]]:
    """The 2-D logical shapes ``(a, b)`` of ``submesh`` the planner considers.

    Every factorisation of ``n * m`` with ``a`` ascending, from ``(1, n * m)`` (one
    1-D axis) on; ``(n * m, 1)`` is left out, as it is ``(1, n * m)`` with the axes
    swapped. For a multi-node submesh the inner axis must be a divisor of ``m`` or a
    multiple of it, so ``(n, m)`` is always included. Example: (1, 8) gives
    [(1, 8), (2, 4), (4, 2)].
    """
    n, m = submesh
    total = n * m
    shapes = []
    for a in range(1, total + 1):
        if total % a:
            continue
        b = total // a
        if a > 1 and b == 1:
            continue
        if b > m and b % m:
            continue
        if m % b and b < m:
            continue
        shapes.append((a, b))
    return shapes


def _axis_cost(mesh: LogicalMesh, k: int, nbytes: float, factor: float) -> float:
    axis = mesh.axes[k]
    if axis.size == 1:
        return 0.0
    n = axis.size
    return axis.alpha_seconds + axis.beta_seconds_per_byte * factor * (n - 1) / n * nbytes


def _collective(mesh: LogicalMesh, axes: Sequence[int], nbytes: float, factor: float) -> float:
    """``alpha + factor * beta (n-1)/n * nbytes`` over ``axes``: the axis' own alpha
    and beta for one live axis; for two, one ring over all their devices paced by the
    slowest link (module docstring)."""
    live = [k for k in axes if mesh.axes[k].size > 1]
    if not live:
        return 0.0
    if len(live) == 1:
        return _axis_cost(mesh, live[0], nbytes, factor)
    n = mesh.size_of(live)
    alpha = max(mesh.axes[k].alpha_seconds for k in live)
    beta = max(mesh.axes[k].beta_seconds_per_byte / mesh.axes[k].link_sharers for k in live)
    return alpha + beta * factor * (n - 1) / n * nbytes


def all_gather_seconds(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """All-gather over ``axes``; ``nbytes`` is the gathered tensor in one group."""
    return _collective(mesh, axes, nbytes, 1.0)


def reduce_scatter_seconds(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """Reduce-scatter over ``axes``; ``nbytes`` is the unreduced tensor on each device."""
    return _collective(mesh, axes, nbytes, 1.0)


def all_reduce_seconds(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """All-reduce over ``axes`` of a ``nbytes`` tensor (over two axes: one ring over
    both, paced by the slowest link, as Alpa and NCCL)."""
    return _collective(mesh, axes, nbytes, 2.0)


def all_to_all_seconds(mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
    """All-to-all over ``axes`` of a group's ``nbytes`` (moves a split between dims).

    Each device keeps 1/n of its 1/n share, so ``beta (n-1)/n^2 B``, times the
    calibrated penalty. Over two axes: one all-to-all per axis, each on its share.
    """
    total = 0.0
    live = [k for k in axes if mesh.axes[k].size > 1]
    for k in live:
        axis = mesh.axes[k]
        n = axis.size
        share = nbytes / mesh.size_of([j for j in live if j != k])
        total += (
            axis.alpha_seconds
            + axis.beta_seconds_per_byte * (n - 1) / (n * n) * share
        ) * mesh.all_to_all_penalty
    return total


def p2p_seconds(nbytes: float, bandwidth: float, latency: float) -> float:
    """Point-to-point send of ``nbytes`` over a link of ``bandwidth`` bytes/s."""
    if nbytes <= 0:
        return 0.0
    return latency + nbytes / bandwidth


def op_seconds(
    primitive: str,
    flops: float,
    bytes_accessed: float,
    dtype: str,
    device: DeviceSpec,
    calibration: Calibration,
    fused_fraction: float | None = None,
) -> float:
    """Roofline time of one op on one device, unsharded.

    ``max(flops / (peak(dtype) * eff), bytes / (memory_bandwidth * memory_efficiency))``
    where ``eff`` is the matmul efficiency for ``dot_general``, the conv efficiency for
    ``conv_general_dilated`` and ``vector_flops_fraction`` otherwise; the bytes of the
    other ops are scaled by ``fused_memory_fraction`` (XLA fuses chains of elementwise
    ops, so most intermediates never reach HBM; ``fused_fraction`` overrides it, as
    the optimizer update's ops do). Primitives in
    ``calibration.free_primitives`` cost nothing (fused into their consumer).
    """
    if primitive in calibration.free_primitives:
        return 0.0
    peak = device.peak(dtype)
    traffic = bytes_accessed
    if primitive == "dot_general":
        rate = peak * calibration.matmul_efficiency
    elif primitive == "conv_general_dilated":
        rate = peak * calibration.conv_efficiency
    else:
        rate = peak * calibration.vector_flops_fraction
        traffic *= calibration.fused_memory_fraction if fused_fraction is None else fused_fraction
    compute = flops / rate if flops > 0 else 0.0
    memory = traffic / (device.memory_bandwidth * calibration.memory_efficiency)
    return max(compute, memory)


def matmul_operand_seconds(operand_bytes: float, device: DeviceSpec, calibration: Calibration) -> float:
    """Seconds a ``dot_general`` spends on its ``operand_bytes`` (its inputs' bytes on
    one device) besides its arithmetic: ``matmul_operand_traffic`` passes over them
    at memory bandwidth. Added to the matmul's :func:`op_seconds` share."""
    traffic = calibration.matmul_operand_traffic * operand_bytes
    return traffic / (device.memory_bandwidth * calibration.memory_efficiency)


#: Primitives that launch a kernel of their own on XLA's CPU runtime: matmuls,
#: convolutions, reductions, gathers and scatters, sorts, concatenations. Elementwise
#: ops and layout changes are fused into one of these (or into a loop of their own
#: chain) and launch nothing extra.
KERNEL_PRIMITIVES = frozenset(
    {
        "dot_general", "conv_general_dilated", "gather", "sort", "concatenate", "pad",
        "dynamic_update_slice", "argmax", "argmin", "select_and_scatter_add",
        "select_and_gather_add",
    }
)  # fmt: skip
#: Name prefixes of kernel-launching primitive families (``reduce_sum``,
#: ``reduce_window_max``, ``scatter-add``, ``cumsum`` ...).
KERNEL_PREFIXES = ("reduce_", "scatter", "cum")


def launches_kernel(primitive: str) -> bool:
    """Whether ``primitive`` launches a kernel of its own (:data:`KERNEL_PRIMITIVES`)."""
    return primitive in KERNEL_PRIMITIVES or primitive.startswith(KERNEL_PREFIXES)


def host_utilization(cluster: ClusterSpec, calibration: Calibration, devices: float) -> float:
    """The fraction of a shared host's throughput that ``devices`` busy devices reach
    (a mean over a pipeline's step may be fractional).

    Each device alone reaches a share u (``lone_device_share``) of the host: it leaves
    the cores idle a fraction 1 - u of the time (its small ops run on one core, one
    after another). Taking those idle moments as independent between devices, the
    host idles only when every device does, so k devices reach ``1 - (1 - u)^k``.
    Measured on 2 cores with a small GPT's forward and backward (``alpajob calibrate``,
    its host step: u = 0.84-0.91 in four calibrations), this predicts 0.97-0.99 for two
    busy devices where 0.99-1.0 was measured, and 1.00 for eight.
    Devices that do not share a host (accelerators) are independent: 1.
    """
    if not cluster.shared_host:
        return 1.0
    return 1.0 - (1.0 - calibration.lone_device_share) ** max(1.0, devices)


def oversubscription_factor(cluster: ClusterSpec, calibration: Calibration) -> float:
    """How much longer every device of a shared host takes than the calibration's
    rates say, for the host's forced devices per core (``cluster.devices_per_core``).

    XLA makes each forced CPU device its own runtime; with more of them than cores
    each device's small ops run slower (measured: one device's chain of small matmuls
    takes 1.24x as long when 8 devices exist on 2 cores as when 1 or 2 do), whether
    the others are busy or not. The calibration's rates were measured with
    ``calibrated_devices_per_core`` devices per core, so the factor is
    ``s(r) / s(r_calibrated)`` with ``s(r) = 1 + a max(0, r - 1)``
    (``a``: ``oversubscription_slowdown``). 1 off a shared host, or when either count
    is unknown.
    """
    measured = calibration.calibrated_devices_per_core
    if not cluster.shared_host or cluster.devices_per_core <= 0 or measured <= 0:
        return 1.0
    slope = calibration.oversubscription_slowdown

    def slowdown(per_core: float) -> float:
        return 1.0 + slope * max(0.0, per_core - 1.0)

    return slowdown(cluster.devices_per_core) / slowdown(measured)


def op_fixed_seconds(primitive: str, device: DeviceSpec, calibration: Calibration) -> float:
    """The fixed seconds one op costs each device that runs it, however it is split.

    A kernel-launching op (:func:`launches_kernel`) costs the host
    ``kernel_overhead_seconds`` per device that runs it. A device with a
    ``host_share`` s of its host's rates carries that as ``kernel_overhead / s`` of its
    own time; a shared-host pipeline weighs device time by s
    (:func:`~alpajob.planner.inter_op.step_time.pipeline_step_seconds`), which gives back the
    host's cost. Other ops cost nothing fixed.
    """
    if primitive in calibration.free_primitives or not launches_kernel(primitive):
        return 0.0
    return calibration.kernel_overhead_seconds / device.host_share
