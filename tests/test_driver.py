"""The local driver: the order it issues instructions in, and times from its stamps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from alpajob.api.options import PlanOptions, TrainOptions
from alpajob.api.resource import parse_job
from alpajob.api.spec import Schedule
from alpajob.api.timeline import SpanKind
from alpajob.planner.inter_op.schedules import Direction, instruction_list
from alpajob.trainer_image.local_run import run
from alpajob.trainer_image.runtime.driver import Stamp, issue_order, issue_rounds, stage_times


def _assert_dependencies_first(when: dict[Any, int], stages: int) -> None:
    """Every instruction comes strictly after what it reads: a forward after the previous
    stage's forward of its micro-batch, a backward after the next stage's backward
    (the last stage: after its own forward)."""
    for (i, d, j), k in when.items():
        if d is Direction.FORWARD and i > 0:
            assert when[(i - 1, Direction.FORWARD, j)] < k
        if d is Direction.BACKWARD:
            dep = (i + 1, Direction.BACKWARD, j) if i < stages - 1 else (i, Direction.FORWARD, j)
            assert when[dep] < k


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 1), (2, 4), (3, 2), (4, 8), (5, 3)])
def test_issue_order_follows_every_stage_program_and_its_dependencies(schedule, stages, micro_batches):
    order = issue_order(schedule, stages, micro_batches)
    assert len(order) == len(set(order)) == 2 * stages * micro_batches
    for i in range(stages):
        assert [(d, j) for s, d, j in order if s == i] == instruction_list(schedule, i, stages, micro_batches)
    _assert_dependencies_first({x: k for k, x in enumerate(order)}, stages)


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 1), (2, 4), (3, 2), (4, 8), (5, 3)])
def test_issue_rounds_are_the_schedule_clock_ticks(schedule, stages, micro_batches):
    """A round's messages move together after it, so nothing in a round may read what
    the same round sends: every dependency lies in an earlier round. Each stage
    issues at most once per round, and with equal instruction times both schedules
    take 2 (m + p - 1) ticks."""
    rounds = issue_rounds(schedule, stages, micro_batches)
    assert len(rounds) == 2 * (micro_batches + stages - 1)
    when = {x: r for r, this_round in enumerate(rounds) for x in this_round}
    for this_round in rounds:
        assert len({s for s, _, _ in this_round}) == len(this_round)
    _assert_dependencies_first(when, stages)
    if schedule is Schedule.ONE_F_ONE_B:  # stage i starts micro-batch 0 in tick i
        assert all(when[(i, Direction.FORWARD, 0)] == i for i in range(stages))


def test_stage_times_split_each_wait_into_communication_and_idle():
    """Two stages, one micro-batch, worked by hand (begin 0, end 7):

    stage 0: F0 computes 0..2; B0 is issued at 1, but its gradient (produced at 4.5)
    arrives at 5: waiting 2..4.5 is idle, 4.5..5 communication; it computes 5..6.
    stage 1: F0's input (produced at 2) arrives at 3: idle 0..2, communication 2..3,
    compute 3..4; B0 computes 4..4.5.
    """
    stamps = [
        [Stamp("forward", 0, 0.0, 0.0, 2.0, ()),
         Stamp("backward", 0, 1.0, 5.0, 6.0, ((1, "backward", 0),))],
        [Stamp("forward", 0, 0.5, 3.0, 4.0, ((0, "forward", 0),)),
         Stamp("backward", 0, 1.0, 4.0, 4.5, ())],
    ]
    first, second = stage_times(stamps, 0.0, 7.0)
    assert (first.compute, first.communication, first.idle) == pytest.approx((3.0, 0.5, 3.5))
    assert first.forward == pytest.approx((2.0,)) and first.backward == pytest.approx((1.0,))
    assert (second.compute, second.communication, second.idle) == pytest.approx((1.5, 1.0, 4.5))


def test_a_wait_after_the_inputs_arrived_is_idle_not_communication():
    """Stage 0 is done at 2; its next input, produced at 2.5, arrives at 3, but the
    instruction is issued at 6 (the driver was busy): 2.5..3 communication, the rest
    of 2..6 idle, 6..7 compute."""
    stamps = [[Stamp("forward", 0, 0.0, 0.0, 2.0, ()),
               Stamp("backward", 0, 6.0, 3.0, 7.0, ((1, "forward", 0),))],
              [Stamp("forward", 0, 0.0, 0.0, 2.5, ())]]
    first, _ = stage_times(stamps, 0.0, 7.0)
    assert (first.compute, first.communication, first.idle) == pytest.approx((3.0, 0.5, 3.5))


def _manifest() -> Any:
    return parse_job({
        "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "driver"},
        "spec": {"model": {"zoo": "gpt", "config": "tiny"},
                 "training": {"globalBatchSize": 16, "dtype": "float32", "optimizer": "sgd", "learningRate": 0.05},
                 "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 8},
                 "parallelism": {"method": "manual", "numMicroBatches": 4, "schedule": "1f1b",
                                 "stages": [{"layers": [0, 1], "submeshShape": [1, 4]},
                                            {"layers": [1, 2], "submeshShape": [1, 4]}]}},
    })


@pytest.mark.slow
def test_exact_stage_times_train_the_same_numbers_and_account_for_the_step():
    manifest = _manifest()
    options = {"steps": 3, "planning": PlanOptions(ilp_time_limit=5.0)}
    issued = run(manifest, TrainOptions(**options, stage_times_every=2))  # steps 1 and 3 untimed
    exact = run(manifest, TrainOptions(**options, exact_stage_times=True, stage_times_every=1))
    np.testing.assert_array_equal(issued.losses, exact.losses)
    assert exact.stage_time_steps == [1, 2, 3] and issued.stage_time_steps == [2]
    first, last = issued.stage_times[0]
    assert len(first.forward) == len(first.backward) == 4
    # the last stage runs each micro-batch's forward and backward as one executable
    assert len(last.forward) == 0 and len(last.backward) == 4
    assert [s.kind for s in last.spans if s.kind is not SpanKind.COMMUNICATION][:4] == [SpanKind.FORWARD_BACKWARD] * 4
    # both stages update with their last backward (stage 0 owns the tied embedding,
    # which only the later stage 1 reads): no update instruction of their own
    for times in (first, last):
        assert times.update == 0 and SpanKind.UPDATE not in {s.kind for s in times.spans}
    for name, value in issued.params.items():
        np.testing.assert_array_equal(exact.params[name], value, err_msg=name)
    for step, stages in zip(exact.step_seconds, exact.stage_times, strict=True):
        for times in stages:
            assert len(times.forward) == len(times.backward) == 4
            assert min(times.forward + times.backward) > 0 and times.update > 0
            # waiting for every instruction, the parts are exact and add up to the step
            total = times.compute + times.communication + times.idle
            assert total == pytest.approx(step, rel=0.02)
