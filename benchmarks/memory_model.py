"""Benchmark: the planner's memory model against XLA's compiled peak, per zoo family.

For each family (GPT, MoE, Wide-ResNet, MLP) at a small config: the planner's
prediction for the whole training step as one stage on one device (weights,
gradients and optimizer state, plus the activations one micro-batch keeps for its
backward, plus the largest transient), against what XLA allocates for the same step
compiled for one CPU device (``compiled.memory_analysis()``: arguments + outputs +
temporaries - donated aliases). Both levels are shown: the fastest (everything kept)
and rematerialised (only each layer's inputs kept; XLA's figure is then for the
same step under ``jax.checkpoint`` per layer, which the trainer does not do on one
device, so only the plan's figure is given).

    python benchmarks/memory_model.py [--markdown benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", help="append the Markdown table to this file")
    args = parser.parse_args()
    lines = ["| family | config | batch | params (M) | XLA: args / temp / peak (MiB) | plan: "
             "weights / activations / peak (MiB) | plan / XLA |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
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
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as handle:
            handle.write(f"\nMachine: {platform.node()} ({os.cpu_count()} cores), python "
                         f"{sys.version.split()[0]}, jax {jax.__version__}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
