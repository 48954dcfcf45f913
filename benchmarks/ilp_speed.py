"""Benchmark 2: speed of one intra-op ILP solve (:func:`solve_intra_op`) on real layers.

For GPT-1.3B, MoE-1.3B and WResNet-1B (micro-batch = global batch / 16): trace the
step, cut it into layers (:func:`cluster_layers`), keep one layer per structure
(:func:`subgraph_signature`) and solve each on the logical meshes (1,8)/(1,8),
(1,8)/(2,4) and (2,8)/(2,8) of a 2 x 8 V100 cluster, with memory weight 0 and 1e-9
and B = 16, plus one solve per (layer, mesh) with ``input_hints`` (every boundary
activation arriving data-parallel). Prints total and per-solve seconds per model,
three ways:

- fresh: every solve on its own (no ``context``: the old call);
- context: the same solves sharing one :class:`SolveContext` (index, op tables per
  mesh, models), as the planner can: the first solve of a (layer, mesh) builds;
- again: the same solves once more on that context (every model built: solve only).

``--save FILE`` pickles every solve's result fields; ``--check FILE`` asserts that all
three ways reproduce them (objective and times to 1e-9 relative, specs equal) and
counts the floats that are not bit-identical.

    python benchmarks/ilp_speed.py --models gpt moe wresnet
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from alpajob.planner.cost.cluster import cluster_from_preset  # noqa: E402
from alpajob.planner.cost.model import load_calibration, make_logical_mesh  # noqa: E402
from alpajob.planner.graph.opgraph import OpGraph, subgraph_signature  # noqa: E402
from alpajob.planner.graph.subset import analyse_subset  # noqa: E402
from alpajob.planner.inter_op.clustering import cluster_layers, default_num_layers  # noqa: E402
from alpajob.planner.intra_op import solve as intra_op  # noqa: E402
from alpajob.planner.intra_op.model import data_spec  # noqa: E402
from alpajob.trainer_image.step import graph_of  # noqa: E402
from alpajob.trainer_image.zoo import resolve_model  # noqa: E402

#: (family, size, global batch, dtype); the micro-batch is the global batch / 16.
MODELS = {
    "gpt": ("gpt", "1.3b", 1024, "float16"),
    "moe": ("moe", "1.3b", 1024, "float16"),
    "wresnet": ("wresnet", "1b", 1536, "float32"),
}
#: (submesh, logical mesh shape) on a 2 x 8 cluster.
MESHES = (((1, 8), (1, 8)), ((1, 8), (2, 4)), ((2, 8), (2, 8)))
MEMORY_WEIGHTS = (0.0, 1e-9)
NUM_MICRO_BATCHES = 16


def trace(name: str) -> tuple[OpGraph, list[tuple[int, ...]]]:
    """The step of model ``name`` at its micro-batch, and one layer per structure."""
    family, size, batch, dtype = MODELS[name]
    graph = graph_of(resolve_model(family, size, dtype=dtype), batch // NUM_MICRO_BATCHES)
    layers = cluster_layers(graph, default_num_layers(graph))
    distinct: dict[str, tuple[int, ...]] = {}
    for layer in layers:
        distinct.setdefault(subgraph_signature(graph, layer), tuple(sorted(layer)))
    return graph, list(distinct.values())


def cases(graph: OpGraph, layers: list[tuple[int, ...]]) -> list[dict[str, Any]]:
    """Every solve of the benchmark: (layer, mesh, memory weight, hints) keyword sets."""
    cluster = cluster_from_preset("v100-16gb", 2, 8)
    out = []
    for li, layer in enumerate(layers):
        inputs = analyse_subset(graph, layer).boundary_inputs
        for submesh, shape in MESHES:
            mesh = make_logical_mesh(cluster, submesh, shape)
            hints = {
                t: data_spec(graph.tensor(t), mesh)
                for t in inputs
                if graph.tensor(t).batch_dim is not None
            }
            for weight, hinted in [(w, None) for w in MEMORY_WEIGHTS] + [(0.0, hints)]:
                out.append(
                    dict(key=(li, submesh, shape, weight, hinted is not None), layer=layer,
                         mesh=mesh, weight=weight, hints=hinted)
                )
    return out


def run(
    graph: OpGraph, todo: list[dict[str, Any]], context: intra_op.SolveContext | None
) -> dict[tuple, tuple[float, intra_op.IntraOpResult]]:
    """Solve every case; returns key -> (seconds, result)."""
    cluster = cluster_from_preset("v100-16gb", 2, 8)
    calibration = load_calibration("v100-16gb")
    results = {}
    for case in todo:
        start = time.perf_counter()
        result = intra_op.solve_intra_op(
            graph, case["layer"], case["mesh"], cluster.device, calibration,
            num_micro_batches=NUM_MICRO_BATCHES, memory_weight=case["weight"],
            input_hints=case["hints"], context=context,
        )
        results[case["key"]] = (time.perf_counter() - start, result)
    return results


def check(name: str, got: dict[tuple, Any], want: dict[tuple, Any]) -> tuple[int, int]:
    """(solves whose results differ from ``want``, floats not bit-identical)."""
    bad = inexact = 0
    for key, (_, result) in got.items():
        ref, mine = want[key], record(result)
        for field, value in ref.items():
            if isinstance(value, float):
                inexact += mine[field] != value
                same = math.isclose(mine[field], value, rel_tol=1e-9, abs_tol=0.0)
            else:
                same = mine[field] == value
            if not same:
                bad += 1
                print(f"  {name} {key}: {field} differs ({mine[field]!r} vs {value!r})")
                break
    return bad, inexact


def record(result: Any) -> dict[str, Any]:
    """What ``--save`` keeps of one solve."""
    fields = ("objective", "compute_seconds", "comm_seconds", "update_seconds",
              "weight_bytes", "activation_bytes", "boundary_inputs", "boundary_outputs",
              "weight_update_sharded")
    out = {f: getattr(result, f) for f in fields}
    out["specs"] = dict(result.specs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--save", help="pickle every solve's result to this file")
    parser.add_argument("--check", help="compare every solve with this pickle")
    args = parser.parse_args(argv)
    saved: dict[str, Any] = {}
    want = None
    if args.check:
        with open(args.check, "rb") as f:
            want = pickle.load(f)
    bad = inexact = 0
    for name in args.models:
        start = time.perf_counter()
        graph, layers = trace(name)
        traced = time.perf_counter() - start
        todo = cases(graph, layers)
        context = intra_op.SolveContext(graph)
        passes = [("fresh", run(graph, todo, None)), ("context", run(graph, todo, context)),
                  ("again", run(graph, todo, context))]
        print(f"{name}: {len(graph.ops)} ops, {len(layers)} distinct layers of "
              f"{', '.join(str(len(la)) for la in layers)} ops, traced in {traced:.1f} s")
        for label, results in passes:
            total = sum(seconds for seconds, _ in results.values())
            print(f"  {label:8s} {len(results)} solves in {total:6.3f} s, "
                  f"{1e3 * total / len(results):6.1f} ms per solve")
            if want is not None:
                differ, loose = check(name, results, want[name])
                bad, inexact = bad + differ, inexact + loose
        saved[name] = {key: record(result) for key, (_, result) in passes[0][1].items()}
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump(saved, f)
    if want is not None:
        print(f"results identical ({inexact} floats not bit-identical)" if not bad
              else f"{bad} solves differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
