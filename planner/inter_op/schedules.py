"""Pipeline schedules: which micro-batch each stage runs when, and what it costs.

A pipeline of ``p`` stages runs ``m`` micro-batches per step. Every stage runs the
forward pass of each micro-batch, then (later) its backward pass. Two orders are
supported (Alpa's paper, section 5; PLANNER.md "Pipeline schedules")::

    GPipe, p = 3, m = 4 (F = forward, B = backward, digits = micro-batch)

      stage 0  F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
      stage 1     F0 F1 F2 F3 .  .  .  B0 B1 B2 B3
      stage 2        F0 F1 F2 F3 B0 B1 B2 B3

    1F1B, p = 3, m = 4: stage i runs p - i - 1 warm-up forwards, then alternates
    one forward and one backward, then drains the remaining backwards.

      stage 0  F0 F1 .  .  F2 .  B0 F3 B1 .  B2 .  B3
      stage 1     F0 F1 .  B0 F2 B1 F3 B2 .  B3
      stage 2        F0 B0 F1 B1 F2 B2 F3 B3

Both have the same idle ("bubble") fraction, ``(p - 1) / (m + p - 1)`` when the
stages are balanced, but GPipe keeps all ``m`` micro-batches' activations alive on
every stage, while 1F1B keeps at most ``p - i`` on stage ``i``: this is why the
stage DP lets early stages hold less (``max_n_succ_stages`` in
:mod:`alpajob.planner.inter_op.stage_dp`).

The step time the planner predicts is Alpa's eq. 2:
``T = sum_i t_i + (m - 1) * max_i t_i`` (:func:`pipeline_seconds`), with ``t_i`` the
forward+backward latency of stage ``i`` for one micro-batch. :func:`simulate` runs
the instruction lists on an event clock, so tests can check the formulas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from alpajob.api.spec import Schedule


class Direction(StrEnum):
    """Which pass of a micro-batch an instruction runs (compares equal to its value)."""

    FORWARD = "forward"
    BACKWARD = "backward"


#: One step of a stage's program: (pass, micro-batch index).
Instruction = tuple[Direction, int]


def _check(num_stages: int, num_micro_batches: int, stage_index: int | None = None) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be at least 1, got {num_micro_batches}")
    if stage_index is not None and not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle fraction of a balanced pipeline: ``(p - 1) / (m + p - 1)``.

    Example: 4 stages, 12 micro-batches: each stage idles 3 of 15 slots, 0.2.
    """
    _check(num_stages, num_micro_batches)
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def in_flight_micro_batches(
    schedule: Schedule, stage_index: int, num_stages: int, num_micro_batches: int
) -> int:
    """Most micro-batches whose activations stage ``stage_index`` holds at once.

    GPipe: all ``m`` (every forward runs before the first backward).
    1F1B: ``min(p - i, m)`` (``p - i - 1`` warm-up forwards plus the one in flight).
    """
    _check(num_stages, num_micro_batches, stage_index)
    if schedule is Schedule.GPIPE:
        return num_micro_batches
    return min(num_stages - stage_index, num_micro_batches)


def pipeline_seconds(stage_seconds: Sequence[float], num_micro_batches: int) -> float:
    """Alpa's eq. 2 step latency: ``sum(t) + (m - 1) * max(t)``.

    ``stage_seconds[i]`` is stage ``i``'s forward+backward time for one micro-batch.
    Example: stages of 1, 2, 1 s and 4 micro-batches: 4 + 3 * 2 = 10 s.
    """
    if not stage_seconds:
        raise ValueError("stage_seconds is empty: a pipeline has at least one stage")
    _check(len(stage_seconds), num_micro_batches)
    return float(sum(stage_seconds)) + (num_micro_batches - 1) * float(max(stage_seconds))


def instruction_list(
    schedule: Schedule, stage_index: int, num_stages: int, num_micro_batches: int
) -> list[Instruction]:
    """The ordered program of one stage: ``(Direction, micro_batch)`` pairs.

    Every micro-batch appears once as a forward and once (later) as a backward.
    GPipe: ``F0..F(m-1), B0..B(m-1)``. 1F1B on stage ``i`` of ``p``: ``w = min(p-i-1, m)``
    warm-up forwards, then ``F(w+j), Bj`` pairs, then the remaining backwards.
    Example: 1F1B, p = 2, m = 3, stage 0: F0 F1 B0 F2 B1 B2; stage 1: F0 B0 F1 B1 F2 B2.
    """
    _check(num_stages, num_micro_batches, stage_index)
    m = num_micro_batches
    forward = [(Direction.FORWARD, j) for j in range(m)]
    backward = [(Direction.BACKWARD, j) for j in range(m)]
    if schedule is Schedule.GPIPE:
        return forward + backward
    warmup = min(num_stages - stage_index - 1, m)
    program = forward[:warmup]
    for j in range(m - warmup):
        program += [forward[warmup + j], backward[j]]
    return program + backward[m - warmup :]


def predecessor(
    stage_index: int, direction: Direction, micro_batch: int, num_stages: int
) -> tuple[int, Direction, int] | None:
    """The instruction of another stage that ``(stage_index, direction, micro_batch)``
    waits for: a forward waits for the same micro-batch's forward on the stage before
    (the first stage for nothing), a backward for its backward on the stage after
    (the last stage: for its own forward)."""
    if direction is Direction.FORWARD:
        return (stage_index - 1, Direction.FORWARD, micro_batch) if stage_index > 0 else None
    if stage_index < num_stages - 1:
        return (stage_index + 1, Direction.BACKWARD, micro_batch)
    return (stage_index, Direction.FORWARD, micro_batch)


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured.

    ``makespan``: seconds from the first forward to the last backward.
    ``peak_in_flight[i]``: most micro-batches forwarded but not yet backwarded on stage i.
    ``bubble_fraction``: idle share of all stages' time, ``1 - busy / (p * makespan)``.
    ``runs``: every instruction as ``(stage, direction, micro_batch, start, end)``.
    """

    makespan: float
    peak_in_flight: tuple[int, ...]
    bubble_fraction: float
    runs: tuple[tuple[int, Direction, int, float, float], ...] = ()


def simulate(
    schedule: Schedule,
    stage_forward_seconds: Sequence[float],
    stage_backward_seconds: Sequence[float],
    num_micro_batches: int,
) -> SimulationResult:
    """Run every stage's :func:`instruction_list` on an event clock.

    An instruction waits for its stage to be free and for its :func:`predecessor`
    (``j``'s forward on stage ``i - 1``; ``j``'s backward on stage ``i + 1``, or on
    the last stage its own forward). Communication is free.
    Every micro-batch takes its stage's time (:func:`replay` takes one per instruction).
    Example: 2 balanced stages (1 s forward, 2 s backward), 2 micro-batches, either
    schedule: makespan (m + p - 1) * 3 = 9 s, bubble 1/3.
    """
    p = len(stage_forward_seconds)
    if p != len(stage_backward_seconds):
        raise ValueError(
            f"stage_forward_seconds has {p} stages but stage_backward_seconds has "
            f"{len(stage_backward_seconds)}"
        )
    _check(p, num_micro_batches)
    return replay(
        schedule,
        [[t] * num_micro_batches for t in stage_forward_seconds],
        [[t] * num_micro_batches for t in stage_backward_seconds],
    )


def replay(
    schedule: Schedule,
    forward_seconds: Sequence[Sequence[float]],
    backward_seconds: Sequence[Sequence[float]],
) -> SimulationResult:
    """:func:`simulate` with each instruction's own time: ``forward_seconds[i][j]`` is
    micro-batch ``j``'s forward on stage ``i``.

    Fed the times a runtime measured, it gives the step the schedule allows for those
    very times with free communication: what is left of the measured step is the
    runtime's own overhead (moves, hand-offs between stages). Constant per-stage
    times (:func:`simulate`) understate that bound when the times vary: a pipeline's
    critical path follows the slow instructions.
    """
    p = len(forward_seconds)
    if p != len(backward_seconds) or p == 0:
        raise ValueError(f"forward_seconds has {p} stages but backward_seconds has {len(backward_seconds)}")
    num_micro_batches = len(forward_seconds[0])
    for name, times in (("forward_seconds", forward_seconds), ("backward_seconds", backward_seconds)):
        if any(len(row) != num_micro_batches for row in times):
            raise ValueError(f"every stage of {name} needs one time per micro-batch ({num_micro_batches})")
    _check(p, num_micro_batches)
    programs = [instruction_list(schedule, i, p, num_micro_batches) for i in range(p)]
    cursor = [0] * p
    stage_free = [0.0] * p
    done: dict[tuple[int, Direction, int], float] = {}
    runs: list[tuple[int, Direction, int, float, float]] = []
    remaining = sum(len(program) for program in programs)
    while remaining:
        progressed = False
        for i in range(p):
            while cursor[i] < len(programs[i]):
                direction, j = programs[i][cursor[i]]
                dep = predecessor(i, direction, j, p)
                seconds = (forward_seconds if direction is Direction.FORWARD else backward_seconds)[i][j]
                if dep is not None and dep not in done:
                    break
                start = max(stage_free[i], done[dep] if dep is not None else 0.0)
                stage_free[i] = start + seconds
                done[(i, direction, j)] = stage_free[i]
                runs.append((i, direction, j, start, stage_free[i]))
                cursor[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule.value} deadlocks")  # a bug, not user input
    peaks = []
    for program in programs:
        live = peak = 0
        for direction, _ in program:
            live += 1 if direction is Direction.FORWARD else -1
            peak = max(peak, live)
        peaks.append(peak)
    makespan = max(stage_free)
    busy = sum(map(sum, forward_seconds)) + sum(map(sum, backward_seconds))
    bubble = 1.0 - busy / (p * makespan) if makespan > 0 else 0.0
    return SimulationResult(makespan=makespan, peak_in_flight=tuple(peaks), bubble_fraction=bubble,
                            runs=tuple(runs))
