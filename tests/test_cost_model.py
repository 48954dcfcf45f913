"""The analytic cost model: calibration, logical meshes, collectives, roofline,
sharding specs and resharding costs."""

from __future__ import annotations

import dataclasses

import pytest

from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.cost.model import (
    Calibration,
    LogicalMesh,
    MeshAxis,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    load_calibration,
    logical_mesh_shapes,
    make_logical_mesh,
    op_seconds,
    p2p_seconds,
    reduce_scatter_seconds,
)
from alpajob.planner.intra_op.sharding import (
    is_valid_spec,
    resharding_seconds,
    shard_factor,
    tiling_specs,
    to_partition_spec,
)

ALPHA0, BETA0 = 2e-5, 1e-10
ALPHA1, BETA1 = 1e-5, 2e-11


def toy_mesh(shape: tuple[int, int] = (2, 4), penalty: float = 1.0) -> LogicalMesh:
    """A mesh with round, distinct alpha/beta per axis."""
    return LogicalMesh(
        submesh=(1, shape[0] * shape[1]),
        shape=shape,
        axes=(MeshAxis(shape[0], ALPHA0, BETA0), MeshAxis(shape[1], ALPHA1, BETA1)),
        all_to_all_penalty=penalty,
    )


# ---------------------------------------------------------------- calibration


def test_calibration_default_and_preset_merge():
    default = load_calibration("custom")
    assert default.preset == "custom"
    assert 0 < default.matmul_efficiency <= 1
    assert "reshape" in default.free_primitives
    v100 = load_calibration("v100-16gb")
    assert v100.matmul_efficiency == 0.55  # overridden
    assert v100.all_to_all_penalty == default.all_to_all_penalty  # inherited


def test_calibration_rejects_out_of_range():
    with pytest.raises(ValueError, match="matmul_efficiency"):
        Calibration("x", 1.5, 0.5, 0.1, 0.7, 0.35, 0.8, 1e-5, 2.0)
    with pytest.raises(ValueError, match="update_fused_memory_fraction"):
        Calibration("x", 0.5, 0.5, 0.1, 0.7, 0.35, 0.8, 1e-5, 2.0, update_fused_memory_fraction=0.0)


def test_calibration_refuses_negative_operand_traffic():
    with pytest.raises(ValueError, match="matmul_operand_traffic"):
        Calibration("x", 0.5, 0.5, 0.1, 0.7, 0.35, 0.8, 1e-5, 2.0, matmul_operand_traffic=-0.1)


def test_calibration_refuses_negative_kernel_overhead():
    with pytest.raises(ValueError, match="kernel_overhead_seconds"):
        Calibration("x", 0.5, 0.5, 0.1, 0.7, 0.35, 0.8, 1e-5, 2.0, kernel_overhead_seconds=-1e-6)


def test_only_kernel_launching_ops_pay_the_kernel_overhead():
    from alpajob.planner.cost.model import launches_kernel, op_fixed_seconds

    for name in ("dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "gather",
                 "scatter-add", "cumsum", "argmax", "concatenate", "sort"):
        assert launches_kernel(name), name
    for name in ("add", "mul", "tanh", "exp", "select_n", "transpose", "reshape", "integer_pow"):
        assert not launches_kernel(name), name
    cluster = cluster_from_preset("cpu", 1, 8)  # each device: 1/8 of the host
    cal = dataclasses.replace(load_calibration("cpu"), kernel_overhead_seconds=1e-5)
    # 1e-5 s of host time per device is 8e-5 s of a device's own (1/8-share) time.
    assert op_fixed_seconds("dot_general", cluster.device, cal) == pytest.approx(8e-5)
    assert op_fixed_seconds("add", cluster.device, cal) == 0.0
    # A free (fused layout) primitive costs nothing even if it were a kernel.
    free = dataclasses.replace(cal, free_primitives=frozenset({"concatenate"}))
    assert op_fixed_seconds("concatenate", cluster.device, free) == 0.0
    # Unmeasured presets charge nothing.
    v100 = cluster_from_preset("v100-16gb", 1)
    assert op_fixed_seconds("dot_general", v100.device, load_calibration("v100-16gb")) == 0.0


# ---------------------------------------------------------------- logical meshes


def test_logical_mesh_single_node_is_intra_node():
    cluster = cluster_from_preset("v100-16gb", 1)
    cal = load_calibration("v100-16gb")
    mesh = make_logical_mesh(cluster, (1, 8), (2, 4), cal)
    for axis in mesh.axes:
        assert axis.alpha_seconds == pytest.approx(
            cluster.intra_node_latency + cal.collective_overhead_seconds
        )
        assert axis.beta_seconds_per_byte == pytest.approx(
            1 / (cluster.intra_node_bandwidth * cal.comm_bandwidth_efficiency)
        )
    assert mesh.active_axes == (0, 1)
    assert mesh.axis_names == ("x", "y")


def test_logical_mesh_two_nodes_shares_the_nic():
    cluster = cluster_from_preset("a100-40gb", 2)
    cal = load_calibration("a100-40gb")
    eff = cal.comm_bandwidth_efficiency
    mesh = make_logical_mesh(cluster, (2, 8), (2, 8), cal)
    outer, inner = mesh.axes
    # Axis 0 crosses nodes; 8 groups (one per GPU) share each node's network.
    assert outer.beta_seconds_per_byte == pytest.approx(8 / (cluster.inter_node_bandwidth * eff))
    assert outer.alpha_seconds == pytest.approx(
        cluster.inter_node_latency + cal.collective_overhead_seconds
    )
    # Axis 1 is the node itself.
    assert inner.beta_seconds_per_byte == pytest.approx(1 / (cluster.intra_node_bandwidth * eff))
    flat = make_logical_mesh(cluster, (2, 8), (1, 16), cal)
    assert flat.axes[0].size == 1 and flat.active_axes == (1,)
    # A 16-device inner axis spans both nodes: one group per node, the whole NIC.
    assert flat.axes[1].beta_seconds_per_byte == pytest.approx(
        1 / (cluster.inter_node_bandwidth * eff)
    )
    quad = make_logical_mesh(cluster, (2, 8), (4, 4), cal)
    assert quad.axes[0].beta_seconds_per_byte == pytest.approx(
        4 / (cluster.inter_node_bandwidth * eff)
    )
    assert quad.axes[1].beta_seconds_per_byte == inner.beta_seconds_per_byte


def test_logical_mesh_rejects_bad_shapes():
    cluster = cluster_from_preset("a100-40gb", 2)
    with pytest.raises(ValueError, match="factor"):
        make_logical_mesh(cluster, (1, 8), (3, 3))
    with pytest.raises(ValueError, match="does not fit"):
        make_logical_mesh(cluster, (4, 8), (4, 8))


def test_logical_mesh_shapes():
    assert logical_mesh_shapes((1, 1)) == [(1, 1)]
    assert logical_mesh_shapes((1, 8)) == [(1, 8), (2, 4), (4, 2)]
    two = logical_mesh_shapes((2, 8))
    assert (1, 16) in two and (2, 8) in two and (16, 1) not in two
    assert logical_mesh_shapes((4, 8))[0] == (1, 32)


# ---------------------------------------------------------------- collectives


def test_collectives_one_axis_closed_forms():
    mesh = toy_mesh()
    nbytes = 1e6
    assert all_gather_seconds(mesh, (1,), nbytes) == pytest.approx(ALPHA1 + BETA1 * 3 / 4 * nbytes)
    assert reduce_scatter_seconds(mesh, (1,), nbytes) == pytest.approx(
        ALPHA1 + BETA1 * 3 / 4 * nbytes
    )
    assert all_reduce_seconds(mesh, (1,), nbytes) == pytest.approx(
        ALPHA1 + 2 * BETA1 * 3 / 4 * nbytes
    )
    assert all_reduce_seconds(mesh, (0,), nbytes) == pytest.approx(
        ALPHA0 + 2 * BETA0 * 1 / 2 * nbytes
    )
    a2a = toy_mesh(penalty=2.0)
    assert all_to_all_seconds(a2a, (1,), nbytes) == pytest.approx(
        2.0 * (ALPHA1 + BETA1 * 3 / 16 * nbytes)
    )
    assert all_reduce_seconds(mesh, (), nbytes) == 0.0


def test_collectives_over_both_axes_are_one_ring_paced_by_the_slowest_link():
    """Alpa's ``AllReduceCost(bytes, 0, 1)`` and what NCCL runs for one collective
    over all 8 devices: max(alpha) + factor * max(beta) * (N-1)/N * bytes."""
    mesh = toy_mesh()
    nbytes = 1e6
    slow = max(ALPHA0, ALPHA1), max(BETA0, BETA1)
    assert all_gather_seconds(mesh, (0, 1), nbytes) == pytest.approx(
        slow[0] + slow[1] * 7 / 8 * nbytes)
    assert reduce_scatter_seconds(mesh, (0, 1), nbytes) == pytest.approx(
        slow[0] + slow[1] * 7 / 8 * nbytes)
    assert all_reduce_seconds(mesh, (0, 1), nbytes) == pytest.approx(
        slow[0] + 2 * slow[1] * 7 / 8 * nbytes)
    # Dearer than the slow axis alone: every byte crosses the slow link 7/8 of the way.
    assert all_reduce_seconds(mesh, (0, 1), nbytes) > all_reduce_seconds(mesh, (0,), nbytes)
    # A size-1 axis costs nothing.
    flat = toy_mesh((1, 8))
    assert all_gather_seconds(flat, (0, 1), nbytes) == pytest.approx(
        all_gather_seconds(flat, (1,), nbytes)
    )


def test_a_ring_over_both_axes_has_the_nic_to_itself():
    """On 2 nodes x 8 GPUs as (2, 8), axis 0's beta is 1/8 of the NIC (8 groups cross
    at once); the one ring over all 16 devices gets the whole NIC."""
    cluster = cluster_from_preset("a100-40gb", 2)
    cal = load_calibration("a100-40gb")
    mesh = make_logical_mesh(cluster, (2, 8), (2, 8), cal)
    outer, inner = mesh.axes
    assert outer.link_sharers == 8 and inner.link_sharers == 1
    nbytes = 1e8
    whole_nic = max(outer.beta_seconds_per_byte / 8, inner.beta_seconds_per_byte)
    assert all_reduce_seconds(mesh, (0, 1), nbytes) == pytest.approx(
        max(outer.alpha_seconds, inner.alpha_seconds) + 2 * whole_nic * 15 / 16 * nbytes)


def test_p2p():
    assert p2p_seconds(0, 1e9, 1e-5) == 0.0
    assert p2p_seconds(1e9, 1e9, 1e-5) == pytest.approx(1.0 + 1e-5)


# ---------------------------------------------------------------- roofline


def test_op_seconds_roofline():
    cluster = cluster_from_preset("a100-40gb", 1)
    device = cluster.device
    cal = load_calibration("a100-40gb")
    # Compute-bound matmul.
    flops = 1e12
    expected = flops / (device.peak("bfloat16") * cal.matmul_efficiency)
    assert op_seconds("dot_general", flops, 1e6, "bfloat16", device, cal) == pytest.approx(
        expected
    )
    # Memory-bound elementwise op.
    nbytes = 1e9
    expected = nbytes * cal.fused_memory_fraction / (device.memory_bandwidth * cal.memory_efficiency)
    assert op_seconds("add", 1e6, nbytes, "float32", device, cal) == pytest.approx(expected)
    # Fused layout op.
    assert op_seconds("reshape", 0.0, nbytes, "float32", device, cal) == 0.0
    # The caller's fraction (the optimizer update's) replaces the calibration's.
    assert op_seconds("add", 1e6, nbytes, "float32", device, cal, 0.01) == pytest.approx(
        expected * 0.01 / cal.fused_memory_fraction
    )


def test_update_ops_use_the_update_fraction():
    """The optimizer update's ops are priced at ``update_fused_memory_fraction``;
    the forward and backward's at ``fused_memory_fraction``; unset, both the same."""
    import dataclasses

    from alpajob.planner.graph.opgraph import Op, OpGraph, Phase, Tensor, TensorRole
    from alpajob.planner.intra_op.strategies import op_base_seconds

    device = cluster_from_preset("a100-40gb", 1).device
    cal = load_calibration("a100-40gb")
    assert cal.update_fused_memory_fraction is None
    tensors = (Tensor(0, (1 << 20,), "float32", TensorRole.PARAM), Tensor(1, (1 << 20,), "float32", TensorRole.ACTIVATION))
    graph = OpGraph("g", (), tensors, (0,), (), (), 1, (), (), 1)
    ops = {phase: Op(0, "mul", (0,), (1,), 1e6, 8e9, phase, 0) for phase in Phase}
    base = {phase: op_base_seconds(op, graph, device, cal) for phase, op in ops.items()}
    assert base[Phase.UPDATE] == base[Phase.FORWARD] == base[Phase.BACKWARD] > 0
    tuned = dataclasses.replace(cal, update_fused_memory_fraction=cal.fused_memory_fraction / 10)
    assert op_base_seconds(ops[Phase.FORWARD], graph, device, tuned) == base[Phase.FORWARD]
    assert op_base_seconds(ops[Phase.UPDATE], graph, device, tuned) == pytest.approx(base[Phase.UPDATE] / 10)


# ---------------------------------------------------------------- specs


def test_specs_and_partition_specs():
    mesh = toy_mesh()
    assert to_partition_spec(((0,), ()), mesh.axis_names) == ("x", None)
    assert to_partition_spec(((0, 1), ()), mesh.axis_names) == (("x", "y"), None)
    assert to_partition_spec(((), (1,)), mesh.axis_names) == (None, "y")
    assert shard_factor(((0,), (1,)), mesh) == 8
    assert is_valid_spec(((0,), (1,)), (4, 8), mesh)
    assert not is_valid_spec(((0,), (0,)), (4, 8), mesh)  # axis used twice
    assert not is_valid_spec(((1,), ()), (6, 8), mesh)  # 6 % 4
    assert not is_valid_spec(((0,),), (4, 8), mesh)  # wrong rank
    flat = toy_mesh((1, 8))
    assert not is_valid_spec(((0,), ()), (8, 8), flat)  # size-1 axes never appear


def test_tiling_specs():
    mesh = toy_mesh((2, 2))
    specs = tiling_specs((8, 8), mesh)
    assert len(specs) == 9
    assert specs[0] == ((), ())
    assert ((0,), (1,)) in specs and ((1,), (0,)) in specs and ((0, 1), ()) in specs
    assert tiling_specs((), mesh) == ((),)
    assert len(tiling_specs((8, 8), toy_mesh((1, 4)))) == 3
    assert tiling_specs((3, 5), mesh) == (((), ()),)


# ---------------------------------------------------------------- resharding


def test_resharding_free_slice():
    mesh = toy_mesh()
    assert resharding_seconds((64, 64), "float32", ((), ()), ((0,), (1,)), mesh) == 0.0
    assert resharding_seconds((64, 64), "float32", ((0,), ()), ((0, 1), ()), mesh) == 0.0
    assert resharding_seconds((64, 64), "float32", ((0,), ()), ((0,), ()), mesh) == 0.0


def test_resharding_all_gather():
    mesh = toy_mesh()
    nbytes = 64 * 64 * 4
    got = resharding_seconds((64, 64), "float32", ((1,), ()), ((), ()), mesh)
    assert got == pytest.approx(all_gather_seconds(mesh, (1,), nbytes))
    # Gathering axis 1 while axis 0 keeps splitting dim 1: one group holds half.
    got = resharding_seconds((64, 64), "float32", ((1,), (0,)), ((), (0,)), mesh)
    assert got == pytest.approx(all_gather_seconds(mesh, (1,), nbytes / 2))
    # Both axes.
    got = resharding_seconds((64, 64), "float32", ((0, 1), ()), ((), ()), mesh)
    assert got == pytest.approx(all_gather_seconds(mesh, (0, 1), nbytes))
    # Axis 1 at another position in the same dim: gather, then slice.
    got = resharding_seconds((64, 64), "float32", ((1,), ()), ((0, 1), ()), mesh)
    assert got == pytest.approx(all_gather_seconds(mesh, (1,), nbytes))


def test_resharding_all_to_all():
    mesh = toy_mesh(penalty=1.5)
    nbytes = 64 * 64 * 2
    got = resharding_seconds((64, 64), "bfloat16", ((1,), ()), ((), (1,)), mesh)
    assert got == pytest.approx(all_to_all_seconds(mesh, (1,), nbytes))
    assert got == pytest.approx(1.5 * (ALPHA1 + BETA1 * 3 / 16 * nbytes))
    # Move axis 1 and gather axis 0: the all-to-all sees the group's half.
    got = resharding_seconds((64, 64), "bfloat16", ((1,), (0,)), ((), (1,)), mesh)
    expected = all_to_all_seconds(mesh, (1,), nbytes / 2) + all_gather_seconds(
        mesh, (0,), nbytes / 4
    )
    assert got == pytest.approx(expected)
