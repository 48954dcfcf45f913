"""Pipeline schedules: the instruction lists, and the formulas checked by simulation."""

from __future__ import annotations

import numpy as np
import pytest

from alpajob.planner.schedules import (
    Direction,
    Schedule,
    bubble_fraction,
    in_flight_micro_batches,
    instruction_list,
    pipeline_seconds,
    simulate,
)

CASES = [(p, m) for p in range(1, 7) for m in range(1, 11)]


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize(("stages", "micro_batches"), CASES)
def test_instruction_lists_run_each_pass_once_forward_first(schedule, stages, micro_batches):
    for i in range(stages):
        program = instruction_list(schedule, i, stages, micro_batches)
        assert sorted(program) == sorted(
            [(d, j) for d in (Direction.FORWARD, Direction.BACKWARD) for j in range(micro_batches)]
        )
        for j in range(micro_batches):
            assert program.index((Direction.FORWARD, j)) < program.index((Direction.BACKWARD, j))


def test_one_f_one_b_order_matches_the_docstring():
    assert instruction_list(Schedule.ONE_F_ONE_B, 0, 2, 3) == [
        ("forward", 0),
        ("forward", 1),
        ("backward", 0),
        ("forward", 2),
        ("backward", 1),
        ("backward", 2),
    ]


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize(("stages", "micro_batches"), CASES)
def test_simulation_agrees_with_the_formulas_on_balanced_stages(schedule, stages, micro_batches):
    result = simulate(schedule, [1.0] * stages, [2.0] * stages, micro_batches)
    assert result.makespan == pytest.approx(pipeline_seconds([3.0] * stages, micro_batches))
    assert result.makespan == pytest.approx((micro_batches + stages - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx(bubble_fraction(stages, micro_batches))
    assert result.peak_in_flight == tuple(
        in_flight_micro_batches(schedule, i, stages, micro_batches) for i in range(stages)
    )


def test_in_flight_counts():
    counts = [in_flight_micro_batches(Schedule.ONE_F_ONE_B, i, 4, 8) for i in range(4)]
    assert counts == [4, 3, 2, 1]
    assert in_flight_micro_batches(Schedule.ONE_F_ONE_B, 0, 4, 2) == 2
    assert in_flight_micro_batches(Schedule.GPIPE, 3, 4, 8) == 8


def test_unbalanced_stages_are_bounded_by_the_slowest_stage():
    rng = np.random.default_rng(0)
    for _ in range(200):
        stages, micro_batches = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        forward = rng.uniform(0.1, 1.0, stages)
        backward = rng.uniform(0.1, 2.0, stages)
        for schedule in Schedule:
            result = simulate(schedule, list(forward), list(backward), micro_batches)
            slowest = micro_batches * float(np.max(forward + backward))
            assert result.makespan >= slowest - 1e-9
            assert result.makespan >= float(np.sum(forward + backward)) - 1e-9


def test_formulas_and_errors():
    assert bubble_fraction(4, 12) == pytest.approx(0.2)
    assert pipeline_seconds([1.0, 2.0, 1.0], 4) == 10.0
    with pytest.raises(ValueError, match="num_micro_batches"):
        bubble_fraction(2, 0)
    with pytest.raises(ValueError, match="stage_index"):
        instruction_list(Schedule.GPIPE, 3, 3, 1)
    with pytest.raises(ValueError, match="empty"):
        pipeline_seconds([], 1)
