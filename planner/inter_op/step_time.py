"""The step time of a pipeline of stages, and the DP's stage costs that match it.

Independent devices (GPUs): Alpa's eq. 2, ``sum t_i + (B - 1) max t_i`` plus the
slowest stage's update (:func:`pipeline_step_seconds`). One host whose forced CPU
devices share its cores: no time is lost to the bubble, and the step is the total
work at the rate the devices busy meanwhile reach (:func:`busy_devices`); the DP then
minimises a plain sum of stage costs rescaled to that (:func:`shared_host_costs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from alpajob.planner.cost.cluster import ClusterSpec
from alpajob.planner.cost.model import Calibration, host_utilization, oversubscription_factor
from alpajob.planner.inter_op.stage_costs import StageEval


def busy_devices(submesh_devices: int, plan_devices: int, num_micro_batches: int,
                 num_stages: int) -> float:
    """Devices busy, on average, while a stage of ``submesh_devices`` works, in a plan
    of ``num_stages`` stages S on ``plan_devices`` with B micro-batches.

    A pipeline of S equal stages runs S B stage-passes in S + B - 1 pass-times, so
    while one stage works, (S - 1)(B - 1) / (S + B - 1) of the other S - 1 stages
    work too, on average: the stage's own devices plus ``(B - 1) / (S + B - 1)`` of
    the others'. One micro-batch: the stages run one after another (only the stage's
    own devices); many: all the plan's.
    """
    others = plan_devices - submesh_devices
    return submesh_devices + others * (num_micro_batches - 1) / (num_stages + num_micro_batches - 1)


def pipeline_step_seconds(
    cluster: ClusterSpec,
    stages: Sequence[StageEval],
    num_micro_batches: int,
    calibration: Calibration,
) -> float:
    """Predicted step time of a pipeline of ``stages`` (each costed per micro-batch).

    Alpa's eq. 2, ``sum t_i + (B - 1) max t_i``, plus the slowest stage's update: the
    stages' devices are independent, so a stage waiting in the pipeline bubble is lost
    time. On a shared host (``cluster.shared_host``, forced CPU devices) a waiting
    device's share of the cores goes to the busy ones, so no time is lost: the step
    is the total work at the whole host's rate, each stage's ``B t_i + update_i``
    weighted by its share of the devices (``t_i`` is costed at a 1/N share) and divided
    by the share of the host's throughput that the devices busy meanwhile reach
    (:func:`busy_devices`, :func:`~alpajob.planner.cost.model.host_utilization`: a
    lone device leaves cores idle).

    The calibration's ``instruction_overhead_seconds`` c is the host's cost of each
    instruction: a stage runs ``2B + 1`` of them (a forward and a backward per
    micro-batch, one update). With independent devices it lengthens
    each ``t_i`` by ``2c`` and each update by ``c``; on a shared host the one host pays
    every stage's, ``c S (2B + 1)`` for ``S`` stages. The work is scaled by
    :func:`~alpajob.planner.cost.model.oversubscription_factor`: more forced devices
    than cores slow every device, so the same plan runs faster on fewer of them.
    """
    c = calibration.instruction_overhead_seconds
    if cluster.shared_host:
        total = cluster.num_devices
        used = sum(s.submesh[0] * s.submesh[1] for s in stages)
        work = 0.0
        for s in stages:
            devices = s.submesh[0] * s.submesh[1]
            busy = busy_devices(devices, used, num_micro_batches, len(stages))
            work += ((num_micro_batches * s.seconds + s.update) * devices / total
                     / host_utilization(cluster, calibration, busy))
        work *= oversubscription_factor(cluster, calibration)
        return work + c * len(stages) * (2 * num_micro_batches + 1)
    seconds = [s.seconds + 2 * c for s in stages]
    return (sum(seconds) + (num_micro_batches - 1) * max(seconds)
            + max(s.update for s in stages) + c)


def shared_host_costs(
    cluster: ClusterSpec, calibration: Calibration, cost: np.ndarray, sizes: Sequence[int],
    num_micro_batches: int, plan_devices: int, num_stages: int,
) -> np.ndarray:
    """The DP's stage costs ``cost`` (per range and submesh choice of ``sizes``
    devices) on a shared host, where the step is additive over stages
    (:func:`pipeline_step_seconds`): stage ``s`` costs ``(B t + update) * n_s / N``,
    divided by the host's utilization while it works (the devices busy meanwhile in a
    plan of ``num_stages`` stages on ``plan_devices``: :func:`busy_devices`), plus its
    ``2B + 1`` instructions' host overhead. Solved with B = 1 (Alpa's recurrence then
    minimises the plain sum), the DP optimises the step time the plan is judged by; Alpa's
    ``sum t + (B - 1) max t`` would charge a bubble that costs no time here and keep a
    faster pipeline of half-size stages from ever winning."""
    total = cluster.num_devices
    overhead = calibration.instruction_overhead_seconds * (2 * num_micro_batches + 1)
    utilization = np.array([
        host_utilization(cluster, calibration,
                         busy_devices(size, plan_devices, num_micro_batches, num_stages))
        for size in sizes])
    share = np.asarray(sizes, dtype=np.float64) / total / utilization
    # cost is t + update / B per micro-batch: B times it is the stage's work per step.
    return num_micro_batches * cost * share[None, None, :] + overhead
