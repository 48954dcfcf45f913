"""The ILP's per-op shardings reach the compiled stages.

The plan records the output sharding of every forward matmul, convolution and lookup
(``StagePlan.pinned_ops``); the trainer finds the same equations in its own trace of
the loss and constrains them. These tests check the alignment finds them all on the
zoo's models, survives ops that only one of the two traces has, and that the
constraints are in the lowered forward program.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jax
import pytest

from alpajob.api.plan import PINNED_PRIMITIVES, PinnedOp
from alpajob.api.resource import parse_job
from alpajob.planner.plan.make import SearchOptions, make_plan
from alpajob.trainer_image.entrypoint import load_model
from alpajob.trainer_image.local_run import local_cluster
from alpajob.trainer_image.runtime.build import build_pipeline
from alpajob.trainer_image.runtime.pinning import match_pins, stage_pins
from alpajob.trainer_image.step import graph_of, training_optimizer


def _plan_and_pipeline(model: str, method: str, **parallelism: Any) -> tuple[Any, Any, Any]:
    manifest = parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "pin"},
        "spec": {"model": {"zoo": model, "config": "tiny"},
                 "training": {"globalBatchSize": 16, "dtype": "float32"},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
                 "parallelism": {"method": method, **parallelism}}})
    training = manifest.spec.training
    zoo = load_model(manifest.spec.model, training.dtype)
    optimizer = training_optimizer(training)
    graph = graph_of(zoo, training.global_batch_size, optimizer)
    devices = jax.devices()
    options = SearchOptions(method=method, ilp_time_limit_s=5.0, **parallelism)
    plan = make_plan(graph, local_cluster(manifest, devices), options).plan
    params = zoo.init(jax.random.key(0))
    executor = build_pipeline(plan, zoo.loss, params, zoo.batch_shapes, optimizer, devices)
    return plan, executor, zoo


@pytest.mark.parametrize("model", ["gpt", "moe", pytest.param("wresnet", marks=pytest.mark.slow), "mlp"])
def test_every_pinned_equation_of_the_trace_is_found(model: str) -> None:
    plan, executor, _ = _plan_and_pipeline(model, "shard")
    split = executor.split
    pins = stage_pins(split, plan.stages)
    pinned_eqns = [e for s in split.stages for e in s.eqns
                   if e.primitive.name in PINNED_PRIMITIVES and len(e.outputs) == 1]
    matched = {v for stage in pins for v in stage}
    assert pinned_eqns, "the model has matmuls, convolutions or lookups"
    assert {e.outputs[0] for e in pinned_eqns} == matched
    recorded = sum(len(s.pinned_ops) for s in plan.stages)
    assert recorded == len(pinned_eqns)


def test_alignment_skips_ops_only_one_trace_has() -> None:
    def eqn(name: str, out: int) -> Any:
        return SimpleNamespace(primitive=SimpleNamespace(name=name), outputs=(out,))

    avals = [SimpleNamespace(shape=s) for s in [(4, 8), (4, 8), (4, 2), (4, 16), (4, 8)]]
    # trace: dot(4,8) gather(4,8) dot(4,2) [extra dot(4,16) the plan lacks] dot(4,8)
    eqns = [eqn("dot_general", 0), eqn("gather", 1), eqn("dot_general", 2), eqn("dot_general", 3),
            eqn("dot_general", 4), eqn("exp", 5)]
    spec = ["x", None]
    plan = [PinnedOp(op=1, primitive="dot_general", shape=[4, 8], sharding=spec),
            PinnedOp(op=3, primitive="gather", shape=[4, 8], sharding=spec),
            PinnedOp(op=5, primitive="conv_general_dilated", shape=[9], sharding=[None]),  # plan only
            PinnedOp(op=7, primitive="dot_general", shape=[4, 2], sharding=spec),
            PinnedOp(op=9, primitive="dot_general", shape=[4, 8], sharding=[None, "y"])]
    matched = match_pins(eqns, avals, plan)
    assert {v: p.op for v, p in matched.items()} == {0: 1, 1: 3, 2: 7, 4: 9}


def test_the_lowered_forward_carries_the_constraints() -> None:
    plan, executor, _ = _plan_and_pipeline("gpt", "shard")
    assert len(plan.stages) == 1  # so stage 0 holds every pinned op
    stage = executor.stages[0]
    pins = stage_pins(executor.split, plan.stages)[0]
    program = executor.split.stages[0]
    avals = executor.split.avals
    params = [stage.params[stage.leaf_names[k]] for k in program.params]
    batch = [jax.ShapeDtypeStruct(avals[executor.split.batch_ids[k]].shape,
                                  avals[executor.split.batch_ids[k]].dtype) for k in program.batch]
    text = stage.forward.lower(params, batch, []).as_text()
    # one sharding constraint per pinned output (Shardy's op; GSPMD's custom call)
    constraints = text.count("sdy.sharding_constraint") + text.count("@Sharding")
    assert constraints >= len(pins) > 0
    assert any(any(e is not None for e in spec) for spec in pins.values())
