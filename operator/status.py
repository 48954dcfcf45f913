"""Setting a job's phase, and every condition with it, on its typed status.

The phases and condition types are :mod:`alpajob.api.status`'s; here is the one rule
that ties them together: every phase sets every condition, so Flux's kstatus and
Argo CD read the job from the standard ``Ready`` condition, kstatus's ``Reconciling``
and ``Stalled`` and ``observedGeneration``, and a condition's ``lastTransitionTime`` changes only when its status flips.
"""

from __future__ import annotations

from datetime import UTC, datetime

from alpajob.api.status import Condition, ConditionStatus, ConditionType, JobTime, Phase, Status


def set_condition(status: Status, kind: ConditionType, value: bool, reason: str, message: str,
                  generation: int, now: str) -> None:
    """Set condition ``kind`` of ``status``; its transition time is kept unless it flipped."""
    flag = ConditionStatus.TRUE if value else ConditionStatus.FALSE
    before = next((c for c in status.conditions if c.type is kind), None)
    since = before.last_transition_time if before is not None and before.status is flag else now
    condition = Condition(type=kind, status=flag, reason=reason, message=message,
                          last_transition_time=since or now, observed_generation=generation)
    order = list(ConditionType)
    others = [c for c in status.conditions if c.type is not kind]
    status.conditions = sorted([*others, condition], key=lambda c: order.index(c.type))


#: The phases in which kstatus's ``Reconciling`` condition is True: the job is on its
#: way to Running and will get there without anyone acting.
RECONCILING_PHASES = frozenset({Phase.PENDING, Phase.PLANNING, Phase.QUEUED, Phase.STARTING, Phase.RESTARTING})

#: ``status.time``'s bucket of each phase (Succeeded and Failed end the clock).
TIME_BUCKETS = {Phase.PENDING: "planning_seconds", Phase.PLANNING: "planning_seconds",
                Phase.STARTING: "starting_seconds", Phase.RUNNING: "running_seconds",
                Phase.RESTARTING: "restarting_seconds", Phase.QUEUED: "queued_seconds",
                Phase.SUSPENDED: "suspended_seconds"}


def _seconds(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def close_phase(clock: JobTime, phase: Phase, now: str) -> None:
    """Add the time from ``clock.phase_since`` to ``now`` to ``phase``'s bucket (a
    finished phase has none)."""
    bucket = TIME_BUCKETS.get(phase)
    if clock.phase_since is not None and bucket is not None:
        spent = max(0.0, _seconds(now) - _seconds(clock.phase_since))
        setattr(clock, bucket, round(getattr(clock, bucket) + spent, 3))


def account_time(status: Status, phase: Phase, now: str) -> None:
    """On a change of phase, add the time spent in the phase that ends to its bucket
    of ``status.time``, and start the clock of the new one."""
    if phase is status.phase and status.time.phase_since is not None:
        return
    close_phase(status.time, status.phase, now)
    status.time.phase_since = now


def set_phase(status: Status, phase: Phase, reason: str, message: str, generation: int, now: str,
              meshes_ready: bool) -> None:
    """Put ``status`` in ``phase`` and set every condition to agree with it."""
    account_time(status, phase, now)
    status.phase = phase
    status.observed_generation = generation

    def put(kind: ConditionType, value: bool, why: str, text: str = "") -> None:
        set_condition(status, kind, value, why, text, generation, now)

    planned = status.plan is not None
    put(ConditionType.PLANNED, planned, "PlanReady" if planned else reason)
    put(ConditionType.MESHES_READY, meshes_ready and phase is Phase.RUNNING,
        "PodsRunning" if meshes_ready else reason)
    for kind, own in ((ConditionType.RUNNING, Phase.RUNNING),
                      (ConditionType.SUCCEEDED, Phase.SUCCEEDED),
                      (ConditionType.FAILED, Phase.FAILED),
                      (ConditionType.SUSPENDED, Phase.SUSPENDED)):
        put(kind, phase is own, reason, message if phase is own else "")
    put(ConditionType.READY, phase in (Phase.RUNNING, Phase.SUCCEEDED), reason, message)
    on_its_way = phase in RECONCILING_PHASES
    put(ConditionType.RECONCILING, on_its_way, reason, message if on_its_way else "")
    failed = phase is Phase.FAILED
    put(ConditionType.STALLED, failed, reason, message if failed else "")
