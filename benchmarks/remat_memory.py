"""What rematerialisation saves in XLA's compiled memory (CPU), against the planner.

The planner prices a rematerialised layer as keeping only its inputs between forward
and backward, and holding its own residuals for one micro-batch while the backward
recomputes it (one layer at a time). The runtime wraps a rematerialised stage in one
``jax.checkpoint``. This measures, with ``compiled.memory_analysis()``, the
temporary memory of the gradient of a stack of layers:

1. a toy stack (4 layers, each with a 16.8 MB intermediate), as one unrolled
   function without remat, with a checkpoint per layer, one around the whole stack,
   and as a ``lax.scan`` over the layers with and without a checkpointed body;
2. GPT stages of 1, 2 and 4 layers as the runtime runs them (its stage interpreter,
   the forward returning the residuals, the backward a separate executable), with the
   runtime's whole-stage checkpoint: the backward's temporary memory against the
   planner's transient for the same stage (its largest layer's residuals).

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

    def layer(x, w):  # noqa: ANN001, ANN202
        h = jnp.tanh(x @ w)
        a = jnp.exp(h[:, :, None] * h[:, None, :])  # [4, 1024, 1024] float32: 16.8 MB
        return x + jnp.einsum("bij,bj->bi", a, h) * 1e-3

    ws = jnp.ones((4, 1024, 1024)) * 1e-3
    x = jnp.ones((4, 1024))

    def unrolled(mode: str):  # noqa: ANN202
        def stack(ws):  # noqa: ANN001, ANN202
            y = x
            for w in ws:
                y = (jax.checkpoint(layer) if mode == "per layer" else layer)(y, w)
            return y.sum()
        return jax.checkpoint(stack) if mode == "whole stack" else stack

    def scanned(remat: bool):  # noqa: ANN202
        def body(y, w):  # noqa: ANN001, ANN202
            return layer(y, w), None

        return lambda ws: jax.lax.scan(jax.checkpoint(body) if remat else body, x, ws)[0].sum()

    print("| toy, 4 layers | gradient temp (MB) |\n| --- | --- |")
    for mode in ("no remat", "per layer", "whole stack"):
        print(f"| unrolled, {mode} | {_temp(jax.grad(unrolled(mode)), ws):.1f} |")
    for remat in (False, True):
        print(f"| scan, {'checkpointed body' if remat else 'no remat'} | "
              f"{_temp(jax.grad(scanned(remat)), ws):.1f} |")


def gpt_stages() -> None:
    import jax

    from alpajob.planner.cost.cluster import cluster_from_preset
    from alpajob.planner.cost.model import load_calibration, make_logical_mesh
    from alpajob.planner.inter_op.clustering import cluster_layers
    from alpajob.planner.intra_op.solve import solve_intra_op
    from alpajob.trainer_image.runtime.split import split_loss
    from alpajob.trainer_image.step import graph_of
    from alpajob.trainer_image.zoo.registry import resolve_model

    batch_size = 8
    cluster = cluster_from_preset("cpu", 1, 1)
    calibration = load_calibration("cpu")
    mesh = make_logical_mesh(cluster, (1, 1), (1, 1), calibration)
    print("\n| GPT stage (hidden 64, seq 128, batch 8) | XLA backward temp, whole-stage "
          "checkpoint (MB) | planner before: largest layer (MB) | planner now: sum of layers (MB) |")
    print("| --- | --- | --- | --- |")
    for layers in (1, 2, 4):
        model = resolve_model("gpt", {"hidden": 64, "layers": layers, "heads": 4,
                                      "seqLen": 128, "vocab": 256})
        graph = graph_of(model, batch_size)
        per_layer = []
        for ops in cluster_layers(graph, layers):
            result = solve_intra_op(graph, sorted(ops), mesh, cluster.device, calibration)
            per_layer.append(result.activation_bytes / MB)
        params = model.init(jax.random.key(0))
        abstract = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), params)
        leaves = jax.tree.leaves(params)
        split = split_loss(model.loss, abstract, model.batch_shapes(batch_size),
                           [0] * len(leaves), 1)
        backward = _stage_backward_temp(split, model, batch_size, leaves)
        print(f"| {layers} layer{'s' if layers > 1 else ''} | {backward:.1f} | "
              f"{max(per_layer):.1f} | {sum(per_layer):.1f} |")


def _stage_backward_temp(split, model, batch_size: int, leaves: list) -> float:  # noqa: ANN001
    """Temporary memory of the backward executable of the stage, rematerialised as the
    runtime does it (one checkpoint around the whole stage)."""
    import jax
    import jax.numpy as jnp

    from alpajob.trainer_image.runtime.split import stage_function
    from alpajob.trainer_image.zoo.model import synthetic_batch

    run = stage_function(split, split.stages[0])
    batch = [jnp.asarray(v) for v in jax.tree.leaves(synthetic_batch(model, batch_size))]
    loss = jax.checkpoint(lambda p: run(p, batch, [])[1])
    out, vjp = jax.jit(lambda p: jax.vjp(loss, p))(leaves)
    return _temp(lambda vjp, ct: vjp(ct), vjp, jnp.ones_like(out))


if __name__ == "__main__":
    toy()
    gpt_stages()
