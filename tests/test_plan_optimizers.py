"""Plans for steps traced with other optimizers than Adam: what Alpa's own benchmarks
train with (benchmarks/alpa_plans.py)."""

from __future__ import annotations

import optax

from alpajob.api.spec import Method, Schedule
from alpajob.planner.cost.cluster import cluster_from_preset
from alpajob.planner.plan.make import ManualStageOption, SearchOptions, make_plan
from alpajob.trainer_image.step import graph_of
from alpajob.trainer_image.zoo import resolve_model


def test_sgd_with_nesterov_momentum_plans_wide_resnet():
    """Wide-ResNet-250M under SGD with Nesterov momentum (Alpa's optimizer for it) on
    one V100, as Alpa's published plan has it: the step has a gradient that leaves its
    layer while its parameter is read only in another, which once made costing the
    plan fail with a KeyError."""
    graph = graph_of(resolve_model("wresnet", "250m", dtype="float32"), 48,
                     optimizer=optax.sgd(0.1, momentum=0.9, nesterov=True))
    manual = SearchOptions(method=Method.MANUAL, schedule=Schedule.ONE_F_ONE_B, num_layers=16,
                           num_micro_batches=1, manual_stages=(ManualStageOption(0, 16, (1, 1), (1, 1)),))
    plan = make_plan(graph, cluster_from_preset("v100-16gb", 1, 1), manual).plan
    assert len(plan.stages) == 1 and plan.predicted_step_seconds > 0
