"""Graph extraction: FLOPs against closed forms, phases, anchors, batch dims, loops."""

from __future__ import annotations

import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from alpajob.api.errors import ManifestError
from alpajob.api.zoo import mlp_layer_dims
from alpajob.planner.graph.extract import extract_graph
from alpajob.planner.graph.opgraph import OpGraph, Phase, TensorRole, with_batch_size
from alpajob.trainer_image.step import graph_of, trace_step
from alpajob.trainer_image.zoo import resolve_model

BATCH = 8


@pytest.fixture(scope="module")
def mlp_graph() -> OpGraph:
    return graph_of(resolve_model("mlp"), BATCH)


@pytest.fixture(scope="module")
def gpt_graph() -> OpGraph:
    return graph_of(resolve_model("gpt"), 4)


def _dot_flops(graph: OpGraph, phase: Phase) -> float:
    return sum(op.flops for op in graph.ops if op.primitive == "dot_general" and op.phase is phase)


def _ancestors(graph: OpGraph, tensor: int) -> set[int]:
    producer = graph.producers()
    found: set[int] = set()
    stack = [producer[tensor]] if tensor in producer else []
    while stack:
        op_id = stack.pop()
        if op_id not in found:
            found.add(op_id)
            stack.extend(producer[t] for t in graph.ops[op_id].inputs if t in producer)
    return found


def test_mlp_forward_dot_flops_match_the_closed_form(mlp_graph):
    dims = mlp_layer_dims(resolve_model("mlp").config)
    expected = 2 * BATCH * sum(d_in * d_out for d_in, d_out in dims)
    assert _dot_flops(mlp_graph, Phase.FORWARD) == expected


def test_mlp_backward_dot_flops_are_twice_forward_less_the_input_gradient(mlp_graph):
    dims = mlp_layer_dims(resolve_model("mlp").config)
    forward = _dot_flops(mlp_graph, Phase.FORWARD)
    first = 2 * BATCH * dims[0][0] * dims[0][1]  # no gradient w.r.t. the batch input
    assert _dot_flops(mlp_graph, Phase.BACKWARD) == 2 * forward - first


def test_gpt_backward_dot_flops_are_about_twice_forward(gpt_graph):
    ratio = _dot_flops(gpt_graph, Phase.BACKWARD) / _dot_flops(gpt_graph, Phase.FORWARD)
    assert 1.9 <= ratio <= 2.0


def test_parameters_roles_and_names(gpt_graph):
    model = resolve_model("gpt")
    assert gpt_graph.num_parameters == model.num_parameters()
    assert len(gpt_graph.param_names) == len(gpt_graph.params) == len(gpt_graph.grads)
    assert "layers/0/attn/q/kernel" in gpt_graph.param_names
    assert "embed/tokens" in gpt_graph.param_names
    assert {gpt_graph.tensor(t).role for t in gpt_graph.params} == {TensorRole.PARAM}
    assert {gpt_graph.tensor(t).role for t in gpt_graph.opt_state} == {TensorRole.OPT_STATE}
    assert {gpt_graph.tensor(t).role for t in gpt_graph.batch} == {TensorRole.BATCH}
    for param, grad, new in zip(gpt_graph.params, gpt_graph.grads, gpt_graph.new_params, strict=True):
        shape = gpt_graph.tensor(param).shape
        assert gpt_graph.tensor(grad).shape == shape == gpt_graph.tensor(new).shape
    assert all(t.id == i for i, t in enumerate(gpt_graph.tensors))
    assert all(op.id == i for i, op in enumerate(gpt_graph.ops))


def test_phases(gpt_graph):
    producer = gpt_graph.producers()
    forward = {op.id for op in gpt_graph.ops if op.phase is Phase.FORWARD}
    assert forward == _ancestors(gpt_graph, gpt_graph.loss)
    assert all(gpt_graph.ops[producer[g]].phase is Phase.BACKWARD for g in gpt_graph.grads)
    assert all(gpt_graph.ops[producer[p]].phase is Phase.UPDATE for p in gpt_graph.new_params)
    # Program order is topological.
    for op in gpt_graph.ops:
        assert all(producer.get(t, -1) < op.id for t in op.inputs)


def _layer_starts(graph: OpGraph) -> dict[str, int]:
    """Per layer (``layers/<i>`` or a top-level group such as ``embed``), the first
    forward op that reads one of its parameters."""
    first_use: dict[int, int] = {}
    for op in graph.forward_ops():
        for t in op.inputs:
            first_use.setdefault(t, op.id)
    starts: dict[str, int] = {}
    for name, param in zip(graph.param_names, graph.params, strict=True):
        if param in first_use:
            key = _layer_key(name)
            starts[key] = min(starts.get(key, first_use[param]), first_use[param])
    return starts


def _layer_key(name: str) -> str:
    parts = name.split("/")
    return "/".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _layer_of(starts: dict[str, int], op_id: int) -> str:
    """The layer whose run of ops contains ``op_id`` ("" before the first one)."""
    return max(((start, key) for key, start in starts.items() if start <= op_id), default=(0, ""))[1]


@pytest.mark.parametrize("graph_name", ["mlp_graph", "gpt_graph"])
def test_gradients_and_updates_are_anchored_in_their_layer(graph_name, request):
    graph = request.getfixturevalue(graph_name)
    starts = _layer_starts(graph)
    producer = graph.producers()
    for name, grad, new in zip(graph.param_names, graph.grads, graph.new_params, strict=True):
        assert _layer_of(starts, graph.ops[producer[grad]].anchor) == _layer_key(name), name
        assert _layer_of(starts, graph.ops[producer[new]].anchor) == _layer_key(name), name


def test_mlp_weight_gradient_dots_are_anchored_in_their_layer(mlp_graph):
    starts = _layer_starts(mlp_graph)
    grads = set(mlp_graph.grads)
    consumers: dict[int, list[int]] = {}
    for op in mlp_graph.ops:
        for t in op.inputs:
            consumers.setdefault(t, []).append(op.id)
    checked = 0
    for op in mlp_graph.ops:
        if op.primitive != "dot_general" or op.phase is not Phase.BACKWARD:
            continue
        # x^T @ dy, then a transpose that is the kernel's gradient.
        users = consumers[op.outputs[0]]
        outputs = {t for user in users for t in mlp_graph.ops[user].outputs}
        if not outputs & grads:
            continue
        (grad,) = outputs & grads
        name = mlp_graph.param_names[mlp_graph.grads.index(grad)]
        assert _layer_of(starts, op.anchor) == _layer_key(name), name
        checked += 1
    assert checked == len(mlp_layer_dims(resolve_model("mlp").config))


def test_gpt_layers_carry_twice_their_forward_flops_backward(gpt_graph):
    starts = _layer_starts(gpt_graph)
    for layer in ("layers/0", "layers/1"):
        flops = {Phase.FORWARD: 0.0, Phase.BACKWARD: 0.0, Phase.UPDATE: 0.0}
        for op in gpt_graph.ops:
            if _layer_of(starts, op.anchor) == layer:
                flops[op.phase] += op.flops
        assert 1.8 <= flops[Phase.BACKWARD] / flops[Phase.FORWARD] <= 2.2, layer


def test_anchors_point_at_forward_ops(gpt_graph):
    for op in gpt_graph.ops:
        anchor = gpt_graph.ops[op.anchor]
        assert anchor.phase is Phase.FORWARD
        if op.phase is Phase.FORWARD:
            assert op.anchor == op.id


def test_backward_constants_are_anchored_with_their_consumers():
    """The zeros that the backward of a ``relu`` selects (``where(y > 0, dy, 0)``) are
    built from nothing: they belong to the layer that uses them, not to the loss."""
    graph = graph_of(resolve_model("wresnet", "tiny"), BATCH)
    producer = graph.producers()
    consumers: dict[int, list[int]] = {}
    for op in graph.ops:
        for t in op.inputs:
            consumers.setdefault(t, []).append(op.id)
    big = [
        op for op in graph.ops
        if op.phase is Phase.BACKWARD and op.outputs
        and not any(t in producer for t in op.inputs)
        and len(graph.tensor(op.outputs[0]).shape) == 4  # [b, h, w, c]
    ]
    assert big, "the relus' backward should broadcast [b, h, w, c] zeros"
    for op in big:
        users = [graph.ops[c].anchor for t in op.outputs for c in consumers[t]]
        assert op.anchor == min(users)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_pipeline_cuts_carry_one_activation_each_way(dtype):
    """Between two transformer layers only the residual stream crosses (forward) and
    its gradient (backward), per micro-batch: nothing proportional to the attention
    scores or the logits (the tied embedding's partial gradient crosses once per
    step). Under mixed precision the LM head reads the embedding's bfloat16 copy, not
    the parameter: its backward (``dlogits @ E``) still belongs to the last layer, so
    the logits' gradient never crosses a cut."""
    from alpajob.api.spec import Schedule
    from alpajob.planner.cost.cluster import cluster_from_preset
    from alpajob.planner.cost.model import load_calibration
    from alpajob.planner.inter_op.clustering import cluster_layers
    from alpajob.planner.inter_op.search import CostContext
    from alpajob.planner.intra_op.solve import ShardingMode
    from alpajob.trainer_image.precision import master_weights

    model = master_weights(resolve_model(
        "gpt", {"hidden": 64, "layers": 4, "heads": 4, "seqLen": 128, "vocab": 2048},
        dtype=dtype))
    graph = graph_of(model, 8)
    layers = cluster_layers(graph, 4)
    cluster = cluster_from_preset("cpu", 1, 8)
    context = CostContext(graph=graph, layers=layers, cluster=cluster,
                          calibration=load_calibration("cpu"), schedule=Schedule.ONE_F_ONE_B,
                          memory_budget=cluster.device.memory_bytes, time_limit_s=10)
    boundary = context.coster(1, ShardingMode.AUTO).boundary_bytes()
    stream = 8 * 128 * 64 * 4  # [b, s, h] float32
    scores = 8 * 4 * 128 * 128 * 2
    logits = 8 * 128 * 2048 * 2
    for cut in range(1, 4):
        assert boundary[cut] < 3 * stream < min(scores, logits), (cut, boundary)


def test_batch_dims(gpt_graph):
    for t in gpt_graph.batch:
        assert gpt_graph.tensor(t).batch_dim == 0
    for t in gpt_graph.params + gpt_graph.opt_state + gpt_graph.grads:
        assert gpt_graph.tensor(t).batch_dim is None
    hidden = resolve_model("gpt").config["hidden"]
    activations = [
        t for t in gpt_graph.tensors if t.role is TensorRole.ACTIVATION and t.shape[-1:] == (hidden,)
    ]
    assert any(t.batch_dim == 0 and t.shape[0] == 4 for t in activations)


def test_with_batch_size_halves_forward_flops_and_batch_dims(gpt_graph):
    half = with_batch_size(gpt_graph, 2)
    fwd = sum(op.flops for op in gpt_graph.forward_ops())
    # Only the causal mask and the scalar loss tail do not scale with the batch.
    assert sum(op.flops for op in half.forward_ops()) == pytest.approx(fwd / 2, rel=1e-3)
    dots = [op.id for op in gpt_graph.forward_ops() if op.primitive == "dot_general"]
    assert all(half.ops[i].flops * 2 == gpt_graph.ops[i].flops for i in dots)
    for before, after in zip(gpt_graph.tensors, half.tensors, strict=True):
        if before.batch_dim is not None:
            assert after.shape[before.batch_dim] * 2 == before.shape[before.batch_dim]


def test_moe_group_dimension_scales_with_the_batch():
    model = resolve_model("moe")
    graph = graph_of(model, 2)
    experts, group = model.config["experts"], model.config["expertGroupSize"]
    groups = 2 * model.config["seqLen"] // group
    gates = [t for t in graph.tensors if t.shape == (groups, group, experts)]
    assert gates and all(t.batch_dim == 0 for t in gates)
    # Expert buffers [experts, groups, capacity, width] scale along the group dimension.
    buffers = [t for t in graph.tensors if len(t.shape) == 4 and t.shape[:2] == (experts, groups)]
    assert buffers and all(t.batch_dim == 1 for t in buffers)
    assert any(op.primitive == "cumsum" for op in graph.ops)


def test_wresnet_conv_params_and_flops():
    graph = graph_of(resolve_model("wresnet"), 2)
    convs = [op for op in graph.ops if op.primitive == "conv_general_dilated"]
    assert convs
    stem = convs[0]
    assert stem.param("lhs_spec") == (0, 3, 1, 2)
    assert stem.param("rhs_spec") == (3, 2, 0, 1)
    assert stem.param("window_strides") == (2, 2)
    assert stem.param("feature_group_count") == 1
    out = graph.tensor(stem.outputs[0]).shape  # [2, 16, 16, channels]
    assert stem.flops == 2 * 2 * out[1] * out[2] * out[3] * 3 * 7 * 7


def test_dot_general_params_are_plain(mlp_graph):
    dot = next(op for op in mlp_graph.ops if op.primitive == "dot_general")
    assert dot.param("contracting") == ((1,), (0,))
    assert dot.param("batch") == ((), ())
    for op in mlp_graph.ops:
        hash(op.params)
        assert list(op.params) == sorted(op.params)


def test_extraction_is_deterministic():
    model = resolve_model("gpt")
    assert graph_of(model, 4).fingerprint() == graph_of(model, 4).fingerprint()


def _graph(init, loss, batch_shapes, batch):
    """The op graph of a model given as its three functions."""
    return graph_of(SimpleNamespace(name="model", init=init, loss=loss, batch_shapes=batch_shapes), batch)


def _scan_model(length: int, width: int):
    def init(key):
        return {"w": jax.random.normal(key, (length, width, width))}

    def loss(params, batch):
        def body(x, w):
            return jnp.tanh(x @ w), None

        x, _ = lax.scan(body, batch["x"], params["w"])
        return jnp.mean(x**2)

    def batch_shapes(n):
        return {"x": jax.ShapeDtypeStruct((n, width), jnp.float32)}

    return init, loss, batch_shapes


def test_scan_body_is_inlined_once_with_a_multiplier():
    length, width = 5, 16
    graph = _graph(*_scan_model(length, width), BATCH)
    dots = [op for op in graph.ops if op.primitive == "dot_general"]
    assert not any(op.primitive == "scan" for op in graph.ops)
    forward = [op for op in dots if op.phase is Phase.FORWARD]
    assert len(forward) == 1
    assert forward[0].multiplier == length
    assert forward[0].flops == length * 2 * BATCH * width * width
    assert _dot_flops(graph, Phase.BACKWARD) == 2 * forward[0].flops
    residuals = [t for t in graph.tensors if t.shape == (length, BATCH, width)]
    assert residuals and all(t.batch_dim == 1 for t in residuals)


def test_calls_cond_and_custom_rules_are_inlined():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

    def init(key):
        return {"w": jax.random.normal(key, (4, 4))}

    def loss(params, batch):
        h = jax.jit(lambda a, b: jax.nn.relu(a @ b))(batch["x"], params["w"])
        h = clip_grad(h)
        steps = lax.while_loop(lambda s: s < 3, lambda s: s + 1, 0)
        h = lax.cond(steps > 1, lambda a: a @ params["w"], jnp.sin, h)
        return jnp.sum(h**2)

    graph = _graph(init, loss, lambda n: {"x": jax.ShapeDtypeStruct((n, 4), jnp.float32)}, 2)
    primitives = {op.primitive for op in graph.ops}
    assert not primitives & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "cond", "while"}
    # The costlier cond branch (the matmul) is the one kept.
    assert sum(op.primitive == "dot_general" for op in graph.forward_ops()) == 2


def test_rematerialized_forward_is_recomputed_in_the_backward():
    def init(key):
        return {"w": jnp.ones((16, 16)), "v": jnp.ones((16, 16))}

    def loss(params, batch):
        block = jax.checkpoint(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w))
        return jnp.sum(block(batch["x"], params["w"]) @ params["v"])

    def batch_shapes(n):
        return {"x": jax.ShapeDtypeStruct((n, 16), jnp.float32)}

    model = SimpleNamespace(name="remat", init=init, loss=loss, batch_shapes=batch_shapes)
    graph = graph_of(model, 4)
    assert graph.name == "remat"
    dots = [op for op in graph.ops if op.primitive == "dot_general"]
    assert sum(op.phase is Phase.FORWARD for op in dots) == 3
    # 2 recomputed + 3 weight gradients + 2 input gradients (none for the batch).
    assert sum(op.phase is Phase.BACKWARD for op in dots) == 7


def test_adam_moments_are_float32_for_bfloat16_params():
    graph = graph_of(resolve_model("mlp", None, dtype="bfloat16"), BATCH)
    assert {graph.tensor(t).dtype for t in graph.params} == {"bfloat16"}
    moments = [graph.tensor(t) for t in graph.opt_state if graph.tensor(t).shape]
    assert moments and {t.dtype for t in moments} == {"float32"}
    assert {graph.tensor(t).dtype for t in graph.new_params} == {"bfloat16"}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "Adam"])
def test_other_optimizers(optimizer):
    graph = graph_of(resolve_model("mlp"), BATCH, optimizer=optimizer)
    assert len(graph.new_params) == len(graph.params)
    if optimizer == "sgd":
        assert graph.opt_state == ()


def test_unknown_optimizer_names_the_field():
    with pytest.raises(ManifestError) as info:
        graph_of(resolve_model("mlp"), BATCH, optimizer="lamb")
    assert info.value.field == "spec.training.optimizer"
    assert "adam" in str(info.value)


def test_a_step_whose_structure_depends_on_the_batch_is_refused():
    def init(key):
        return {"w": jnp.ones((4,))}

    def loss(params, batch):
        x = batch["x"] @ params["w"]
        if x.shape[0] > 4:
            x = jnp.tanh(x)
        return jnp.sum(x)

    with pytest.raises(ValueError, match="different programs"):
        _graph(init, loss, lambda n: {"x": jax.ShapeDtypeStruct((n, 4), jnp.float32)}, 4)


def _traced_twice(model, batch: int) -> OpGraph:
    """The graph of two concrete traces (at ``batch`` and twice it), as before the
    symbolic trace."""
    graph = extract_graph(trace_step(model, 2 if batch == 1 else batch))
    return with_batch_size(graph, 1) if batch == 1 else graph


@pytest.mark.parametrize("name", ["gpt", "moe", "wresnet"])
@pytest.mark.parametrize("batch", [1, 6, 64])
def test_one_symbolic_trace_makes_the_graph_of_two_concrete_ones(name, batch):
    """Every op, tensor, shape, batch dim, FLOP count, byte count and parameter of the
    symbolic trace evaluated at the batch equals the two concrete traces' (MoE's token
    groups included: the batch is traced as a multiple of the symbol)."""
    model = resolve_model(name)
    notes: list[str] = []
    graph = graph_of(model, batch, note=notes.append)
    assert notes == []  # the symbolic trace was used
    twice = _traced_twice(model, batch)
    assert graph.ops == twice.ops
    assert graph.tensors == twice.tensors
    assert graph.fingerprint() == twice.fingerprint()


def test_a_model_that_needs_a_concrete_batch_is_traced_twice_with_a_note():
    def init(key):
        return {"w": jnp.ones((4, 4))}

    def loss(params, batch):
        rows = int(batch["x"].shape[0])  # Python arithmetic on the batch size
        return jnp.sum(batch["x"] @ params["w"]) / rows

    model = SimpleNamespace(name="model", init=init, loss=loss,
                            batch_shapes=lambda n: {"x": jax.ShapeDtypeStruct((n, 4), jnp.float32)})
    notes: list[str] = []
    graph = graph_of(model, 8, note=notes.append)
    assert len(notes) == 1
    assert "traced twice (at batch 8 and 16)" in notes[0] and "concrete batch size" in notes[0]
    assert graph.ops == _traced_twice(model, 8).ops
    # The zoo's MLP fills an array with the batch size in its backward: traced twice.
    notes.clear()
    graph = graph_of(resolve_model("mlp"), BATCH, note=notes.append)
    assert len(notes) == 1 and "makes an array from a size" in notes[0]
    assert graph.tensors == _traced_twice(resolve_model("mlp"), BATCH).tensors


def test_bad_batch_size():
    with pytest.raises(ValueError, match="positive"):
        graph_of(resolve_model("mlp"), 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-39b", "moe-70b", "wresnet-13b"])
def test_largest_configs_extract_quickly(name):
    model = resolve_model(name)
    batch = 1536 if name.startswith("wresnet") else 1024
    start = time.perf_counter()
    graph = graph_of(model, batch)
    elapsed = time.perf_counter() - start
    assert graph.num_parameters == model.num_parameters()
    assert elapsed < 30, f"{name} took {elapsed:.1f} s"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["gpt-350m", "gpt-1.3b", "gpt-2.6b", "gpt-6.7b", "gpt-15b", "moe-380m", "moe-690m",
     "moe-1.3b", "moe-2.4b", "moe-10b", "moe-27b", "wresnet-250m", "wresnet-500m",
     "wresnet-1b", "wresnet-2b", "wresnet-4b", "wresnet-6.8b"],
)
def test_named_configs_extract(name):
    model = resolve_model(name)
    graph = graph_of(model, 16)
    assert graph.num_parameters == model.num_parameters()
    assert all(graph.tensor(t).batch_dim == 0 for t in graph.batch)
