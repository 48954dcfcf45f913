"""Pipeline schedules: the instruction lists, and the formulas checked by simulation."""

from __future__ import annotations

import numpy as np
import pytest

from alpajob.planner.inter_op.schedules import (
    Direction,
    Schedule,
    bubble_fraction,
    in_flight_micro_batches,
    instruction_list,
    pipeline_seconds,
    replay,
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


def _longest_path(schedule: Schedule, fwd: list[list[float]], bwd: list[list[float]]) -> float:
    """The longest path through the instruction graph, by recursion: an instruction
    ends its time after the later of its stage's previous instruction and its
    micro-batch's instruction on the neighbouring stage."""
    p = len(fwd)
    programs = [instruction_list(schedule, i, p, len(fwd[0])) for i in range(p)]
    position = {(i, d, j): k for i, prog in enumerate(programs) for k, (d, j) in enumerate(prog)}
    finish: dict[tuple[int, Direction, int], float] = {}

    def end(i: int, d: Direction, j: int) -> float:
        key = (i, d, j)
        if key not in finish:
            k = position[key]
            ready = [end(i, *programs[i][k - 1])] if k else []
            if d is Direction.FORWARD and i > 0:
                ready.append(end(i - 1, Direction.FORWARD, j))
            if d is Direction.BACKWARD:
                ready.append(end(i + 1, Direction.BACKWARD, j) if i < p - 1 else end(i, Direction.FORWARD, j))
            finish[key] = max(ready, default=0.0) + (fwd if d is Direction.FORWARD else bwd)[i][j]
        return finish[key]

    return max(end(i, *programs[i][-1]) for i in range(p))


def test_replay_is_the_longest_path_through_the_instruction_graph():
    """With a time per instruction, the makespan is the longest path through the
    dependency graph; with every micro-batch at its stage's mean it is :func:`simulate`."""
    rng = np.random.default_rng(1)
    for _ in range(100):
        p, m = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        fwd = rng.uniform(0.1, 3.0, (p, m)).tolist()
        bwd = rng.uniform(0.1, 3.0, (p, m)).tolist()
        for schedule in Schedule:
            assert replay(schedule, fwd, bwd).makespan == pytest.approx(_longest_path(schedule, fwd, bwd))
            mean_f, mean_b = [float(np.mean(r)) for r in fwd], [float(np.mean(r)) for r in bwd]
            flat = replay(schedule, [[t] * m for t in mean_f], [[t] * m for t in mean_b])
            assert flat.makespan == pytest.approx(simulate(schedule, mean_f, mean_b, m).makespan)


def test_replay_refuses_ragged_times():
    with pytest.raises(ValueError, match="one time per micro-batch"):
        replay(Schedule.GPIPE, [[1.0, 1.0], [1.0]], [[1.0, 1.0], [1.0, 1.0]])


def test_formulas_and_errors():
    assert bubble_fraction(4, 12) == pytest.approx(0.2)
    assert pipeline_seconds([1.0, 2.0, 1.0], 4) == 10.0
    with pytest.raises(ValueError, match="num_micro_batches"):
        bubble_fraction(2, 0)
    with pytest.raises(ValueError, match="stage_index"):
        instruction_list(Schedule.GPIPE, 3, 3, 1)
    with pytest.raises(ValueError, match="empty"):
        pipeline_seconds([], 1)
