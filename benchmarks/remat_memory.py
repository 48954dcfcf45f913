"""What rematerialisation saves in XLA's compiled memory (CPU), against the planner.

The planner prices a rematerialised layer as keeping only its inputs between forward
and backward, and holding its own residuals for one micro-batch while the backward
recomputes it (one layer at a time). This measures, with
``compiled.memory_analysis()``, the temporary memory of backwards:

1. a toy stack (4 layers, each with a 16.8 MB intermediate): one unrolled function
   without remat, with a ``jax.checkpoint`` per layer, one around the whole stack,
   the runtime's chained layers (:mod:`alpajob.trainer_image.runtime.remat`), and a
   ``lax.scan`` over the layers with and without a checkpointed body; as one
   gradient, and as the runtime runs it (forward and backward separate executables,
   the residuals passed between them);
2. GPT stages of 1, 2, 4 and 8 layers built by the runtime from a plan
   (``place_stage``), their backward executable's temporary memory without remat,
   rematerialised as the runtime now does it (one layer at a time) and as it did
   before (one ``jax.checkpoint`` around the stage), against the planner's transient
   (a layer's residuals plus its backward working set, the largest) and the sum of
   its layers' residuals (the planner's transient before).

    python benchmarks/remat_memory.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

MB = 1e6


def _temp(fn, *args) -> float:  # noqa: ANN001
    import jax

    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / MB


def toy() -> None:
    import jax
    import jax.numpy as jnp

    from alpajob.trainer_image.runtime.remat import chained_layer

    def layer(x, w):  # noqa: ANN001, ANN202
        h = jnp.tanh(x @ w)
        a = jnp.exp(h[:, :, None] * h[:, None, :])  # [4, 1024, 1024] float32: 16.8 MB
        return x + jnp.einsum("bij,bj->bi", a, h) * 1e-3

    chained = chained_layer(lambda p, b, i: ([layer(i[0], p[0])], None))
    wrap = {
        "no remat": layer,
        "checkpoint per layer": jax.checkpoint(layer),
        "chained layers (the runtime)": lambda x, w: chained([w], [], [x])[0][0],
    }
    x = jnp.ones((4, 1024))

    def unrolled(mode: str):  # noqa: ANN202
        def stack(ws):  # noqa: ANN001, ANN202
            y = x
            for w in ws:
                y = wrap.get(mode, layer)(y, w)
            return y.sum()
        return jax.checkpoint(stack) if mode == "checkpoint around the stack" else stack

    def scanned(remat: bool):  # noqa: ANN202
        def body(y, w):  # noqa: ANN001, ANN202
            return layer(y, w), None

        return lambda ws: jax.lax.scan(jax.checkpoint(body) if remat else body, x, jnp.stack(ws))[0].sum()

    def split_backward(fn, ws) -> float:  # noqa: ANN001
        out, vjp = jax.jit(lambda w: jax.vjp(fn, w))(ws)
        return _temp(lambda v, c: v(c), vjp, jnp.ones_like(out))

    ws = [jnp.full((1024, 1024), 1e-3) for _ in range(4)]
    print("| toy, 4 layers | one gradient: temp (MB) | forward, then backward: backward temp (MB) |")
    print("| --- | --- | --- |")
    for mode in (*wrap, "checkpoint around the stack"):
        fn = unrolled(mode)
        print(f"| unrolled, {mode} | {_temp(jax.grad(fn), ws):.1f} | {split_backward(fn, ws):.1f} |")
    for remat in (False, True):
        fn = scanned(remat)
        print(f"| scan, {'checkpointed body' if remat else 'no remat'} | {_temp(jax.grad(fn), ws):.1f} "
              f"| {split_backward(fn, ws):.1f} |")


def gpt_stages() -> None:
    import jax
    import jax.numpy as jnp
    import optax

    from alpajob.api.options import PlanOptions
    from alpajob.api.resource import parse_job
    from alpajob.trainer_image.planning import plan_job
    from alpajob.trainer_image.runtime.build import place_stage, split_for_plan
    from alpajob.trainer_image.zoo.model import synthetic_batch
    from alpajob.trainer_image.zoo.registry import resolve_model

    batch_size = 8
    print("\n| GPT stage (hidden 64, seq 128, batch 8) | backward temp, no remat (MB) | "
          "remat one layer at a time, now (MB) | remat, one checkpoint around the stage, "
          "before (MB) | planner now: a layer's residuals and backward working set, largest (MB) | "
          "before: the layers' residuals, summed (MB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layers in (1, 2, 4, 8):
        config = {"hidden": 64, "layers": layers, "heads": 4, "seqLen": 128, "vocab": 256}
        job = parse_job({
            "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "remat"},
            "spec": {"model": {"zoo": "gpt", "config": config},
                     "training": {"globalBatchSize": batch_size, "dtype": "float32", "optimizer": "sgd"},
                     "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 1},
                     "parallelism": {"method": "shard", "numLayers": layers}},
        })
        plan = plan_job(job, PlanOptions(all_devices=True)).plan
        model = resolve_model("gpt", config)
        params = model.init(jax.random.key(0))
        leaves = jax.tree.leaves(params)
        batch = [jnp.asarray(v) for v in jax.tree.leaves(synthetic_batch(model, batch_size))]
        temps = []
        for remat in (False, True):
            remade = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"rematerialize": remat})]})
            split, names = split_for_plan(remade, model.loss, params, model.batch_shapes)
            mesh = jax.sharding.Mesh([[jax.devices()[0]]], ("x", "y"))
            stage = place_stage(remade, split, names, 0, mesh, leaves, optax.sgd(0.1))
            forward_params = [stage.params[stage.leaf_names[k]] for k in stage.param_leaves]
            _, loss, residuals = stage.forward(forward_params, batch, [])
            compiled = stage.backward.lower(forward_params, residuals, [jnp.ones_like(loss)],
                                            stage.zeros()).compile()
            temps.append(compiled.memory_analysis().temp_size_in_bytes / MB)
        before = _whole_stage_checkpoint_temp(split, leaves, batch)
        residuals, working = _layer_residuals(plan, job)
        now = max(r + w for r, w in zip(residuals, working, strict=True))
        print(f"| {layers} layer{'s' if layers > 1 else ''} | {temps[0]:.1f} | {temps[1]:.1f} | "
              f"{before:.1f} | {now:.1f} | {sum(residuals):.1f} |")


def _layer_residuals(plan, job) -> tuple[list[float], list[float]]:  # noqa: ANN001
    """The planner's residual and backward working-set bytes of each layer (MB)."""
    from alpajob.planner.cost.cluster import cluster_from_preset
    from alpajob.planner.cost.model import load_calibration, make_logical_mesh
    from alpajob.planner.inter_op.clustering import cluster_layers
    from alpajob.planner.intra_op.solve import solve_intra_op
    from alpajob.trainer_image.planning import job_graph

    graph = job_graph(job)
    cluster = cluster_from_preset("cpu", 1, 1)
    calibration = load_calibration("cpu")
    mesh = make_logical_mesh(cluster, (1, 1), (1, 1), calibration)
    results = [solve_intra_op(graph, sorted(ops), mesh, cluster.device, calibration)
               for ops in cluster_layers(graph, plan.stages[0].layers[1])]
    return [r.activation_bytes / MB for r in results], [r.working_bytes / MB for r in results]


def _whole_stage_checkpoint_temp(split, leaves: list, batch: list) -> float:  # noqa: ANN001
    """Temporary memory of the stage's backward with one ``jax.checkpoint`` around the
    whole stage (the runtime before it recomputed one layer at a time)."""
    import jax
    import jax.numpy as jnp

    from alpajob.trainer_image.runtime.split import stage_function

    run = stage_function(split, split.stages[0])
    loss = jax.checkpoint(lambda p: run(p, batch, [])[1])
    out, vjp = jax.jit(lambda p: jax.vjp(loss, p))(leaves)
    return _temp(lambda vjp, ct: vjp(ct), vjp, jnp.ones_like(out))


if __name__ == "__main__":
    toy()
    gpt_stages()
