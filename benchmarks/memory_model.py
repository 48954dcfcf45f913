"""Benchmark: the planner's memory model against XLA's compiled peak, per zoo family.

For each family (GPT, MoE, Wide-ResNet, MLP) at a small config, the whole training
step (Adam) planned as one stage of every layer on one CPU device:

1. **The serial step**: the planner's prediction (weights, gradients and optimizer
   state, plus the activations one micro-batch keeps for its backward, plus the
   largest transient) against XLA's allocation for the same step compiled as one
   executable (``compiled.memory_analysis()``: arguments + outputs + temporaries -
   donated aliases).
2. **The runtime's stage**, as ``alpajob run`` executes it (forward, backward and
   update executables, the forward's residuals passed to the backward), plain and
   rematerialised by whole layers and by block parts, with the layers clustered one
   per repeated block and as one layer: the plan's peak for the stage at that level
   against the runtime's,
   ``params + optimizer state + gradient accumulators + residuals (not counting those
   that are parameters) + the largest of the forward's, backward's and update's
   temporaries``; and the same stage as a pipeline's last stage runs it, forward and
   backward in one executable (no residuals held between them):
   ``weights + the larger of that executable's and the update's temporaries``.

    python benchmarks/memory_model.py [--markdown table.md]   # then put it in its RESULTS.md section
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402

from alpajob.api.errors import InfeasibleError  # noqa: E402
from alpajob.api.spec import Method  # noqa: E402
from alpajob.planner.cost.cluster import cluster_from_preset  # noqa: E402
from alpajob.planner.plan.make import ManualStageOption, SearchOptions, make_plan  # noqa: E402
from alpajob.trainer_image.step import graph_of, init_optimizer_state, make_train_step  # noqa: E402
from alpajob.trainer_image.zoo import resolve_model  # noqa: E402

MIB = 1024**2
#: (family, config, batch): small enough to compile in seconds on 2 cores.
CASES = [
    ("gpt", {"hidden": 256, "layers": 4, "heads": 8, "seqLen": 128, "vocab": 1024}, 16),
    ("moe", "tiny", 32),
    ("wresnet", "tiny", 32),
    ("mlp", "tiny", 64),
]


def measured_bytes(model, batch: int) -> dict[str, float]:
    """XLA's allocation for the serial training step (Adam), one CPU device."""
    optimizer = optax.adam(1e-4)
    params = jax.eval_shape(model.init, jax.random.key(0))
    opt_state = jax.eval_shape(lambda p: init_optimizer_state(optimizer, p), params)
    shapes = model.batch_shapes(batch)
    step = jax.jit(make_train_step(model.loss, optimizer), donate_argnums=(0, 1))
    stats = step.lower(params, opt_state, shapes).compile().memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
    return {"arguments": stats.argument_size_in_bytes, "temp": stats.temp_size_in_bytes,
            "total": total}


def predicted(graph) -> dict[str, float]:
    """The planner's stage figures for the whole step on one device (fastest level)."""
    options = SearchOptions(method=Method.MANUAL, num_layers=1, num_micro_batches=1,
                            manual_stages=(ManualStageOption(0, 1, (1, 1)),))
    stage = make_plan(graph, cluster_from_preset("cpu", 1, 1), options).plan.stages[0]
    return {"weights": stage.weight_bytes, "activations": stage.activation_bytes,
            "total": stage.peak_memory_bytes, "remat": stage.rematerialize}


def stage_plans(model, graph, layers: int | None = None) -> dict[str, object]:  # noqa: ANN001
    """The step as one stage of every layer on one CPU device: plain (the fastest
    level), rematerialised (planned on a device just too small for plain), and
    rematerialised by block parts (on a device just too small for whole layers).
    ``layers``: the layer clustering's count (default: one per repeated block)."""
    import dataclasses

    from alpajob.planner.inter_op.clustering import default_num_layers

    layers = layers or default_num_layers(graph)
    options = SearchOptions(method=Method.MANUAL, num_layers=layers, num_micro_batches=1,
                            manual_stages=(ManualStageOption(0, layers, (1, 1)),))
    cluster = cluster_from_preset("cpu", 1, 1)
    plain = make_plan(graph, cluster, options).plan
    tight = dataclasses.replace(cluster.device, memory_bytes=int(plain.stages[0].peak_memory_bytes * 0.99 / 0.9))
    try:
        remat = make_plan(graph, dataclasses.replace(cluster, device=tight), options).plan
    except InfeasibleError:  # rematerialising saves too little to fit
        return {"plain": plain, "remat": None, "parts": None}
    if not remat.stages[0].rematerialize:
        return {"plain": plain, "remat": None, "parts": None}
    if remat.stages[0].param_parts:  # whole layers did not fit either
        return {"plain": plain, "remat": None, "parts": remat}
    tighter = dataclasses.replace(cluster.device, memory_bytes=int(remat.stages[0].peak_memory_bytes * 0.99 / 0.9))
    try:
        parts = make_plan(graph, dataclasses.replace(cluster, device=tighter), options).plan
    except InfeasibleError:  # block parts save too little to fit
        return {"plain": plain, "remat": remat, "parts": None}
    return {"plain": plain, "remat": remat, "parts": parts if parts.stages[0].param_parts else None}


def runtime_bytes(model, plan, batch: int) -> dict[str, float]:  # noqa: ANN001
    """What the runtime's executables of the plan's one stage hold (module docstring)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from alpajob.trainer_image.runtime.build import place_stage, split_for_plan
    from alpajob.trainer_image.runtime.memory import stage_memory
    from alpajob.trainer_image.zoo.model import synthetic_batch

    params = model.init(jax.random.key(0))
    split, names = split_for_plan(plan, model.loss, params, model.batch_shapes)
    mesh = Mesh(np.array([[jax.devices()[0]]]), ("x", "y"))
    stage = place_stage(plan, split, names, 0, mesh, jax.tree.leaves(params), optax.adam(1e-4))
    leaves = [jnp.asarray(v) for v in jax.tree.leaves(synthetic_batch(model, batch))]
    held = stage_memory(stage, leaves, [])
    return {"weights": held.weights, "residuals": held.residuals,
            "backward_temp": held.backward_temp, "total": held.peak, "fused": held.fused_peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", help="append the Markdown table to this file")
    args = parser.parse_args()
    lines = ["| family | config | batch | params (M) | XLA: args / temp / peak (MiB) | plan: "
             "weights / activations / peak (MiB) | plan / XLA |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    runtime = ["| family | stage | runtime: weights / residuals / backward temp / peak (MiB) "
               "| forward and backward in one executable: peak (MiB) "
               "| plan: weights / activations + transient / peak (MiB) | plan / runtime |",
               "| --- | --- | --- | --- | --- | --- |"]
    for family, config, batch in CASES:
        model = resolve_model(family, config, dtype="float32")
        graph = graph_of(model, batch, "adam")
        xla = measured_bytes(model, batch)
        ours = predicted(graph)
        ratio = ours["total"] / xla["total"]
        lines.append(
            f"| {family} | {config if isinstance(config, str) else 'small'} | {batch} | "
            f"{graph.num_parameters / 1e6:.2f} | {xla['arguments'] / MIB:.1f} / "
            f"{xla['temp'] / MIB:.1f} / {xla['total'] / MIB:.1f} | {ours['weights'] / MIB:.1f} / "
            f"{ours['activations'] / MIB:.1f} / {ours['total'] / MIB:.1f}"
            f"{' (remat)' if ours['remat'] else ''} | {ratio:.2f} |")
        print(lines[-1], flush=True)
        plans = {f"{level}, {name}": plan for name, count in (("blocks", None), ("one layer", 1))
                 for level, plan in stage_plans(model, graph, count).items()}
        for level, plan in plans.items():
            if plan is None:
                runtime.append(f"| {family} | {level} | - | - | not chosen | - |")
                continue
            got = runtime_bytes(model, plan, batch)
            stage = plan.stages[0]
            held = stage.peak_memory_bytes - stage.weight_bytes
            runtime.append(
                f"| {family} | {level} ({stage.layers[1]} layers) | {got['weights'] / MIB:.1f} / "
                f"{got['residuals'] / MIB:.1f} / {got['backward_temp'] / MIB:.1f} / {got['total'] / MIB:.1f} "
                f"| {got['fused'] / MIB:.1f} | {stage.weight_bytes / MIB:.1f} / {held / MIB:.1f} / {stage.peak_memory_bytes / MIB:.1f} "
                f"| {stage.peak_memory_bytes / got['total']:.2f} |")
            print(runtime[-1], flush=True)
    table = "\n".join(lines) + "\n\n" + "\n".join(runtime)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as handle:
            handle.write(f"\nMachine: {platform.node()} ({os.cpu_count()} cores), python "
                         f"{sys.version.split()[0]}, jax {jax.__version__}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
