"""The AlpaJob's status: phases, conditions, and what each phase says to GitOps tools.

Phases: Pending, Planning, Starting, Running, Restarting, Succeeded, Failed,
Suspended. Every phase sets the conditions below, so Flux's kstatus and Argo CD
read the job from the standard ``Ready`` condition and ``observedGeneration``:

=============  =======================================================
Planned        the plan ConfigMap holds a plan
MeshesReady    every pod of the current attempt is running
Running        training is under way
Succeeded      the driver finished every step
Failed         the job stopped for good (the reason says why)
Suspended      ``spec.runPolicy.suspend`` is true
Ready          True while Running and once Succeeded
=============  =======================================================

A condition's ``lastTransitionTime`` changes only when its status flips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PHASES = ("Pending", "Planning", "Starting", "Running", "Restarting", "Succeeded", "Failed", "Suspended")
FINISHED = ("Succeeded", "Failed")
CONDITION_TYPES = ("Planned", "MeshesReady", "Running", "Succeeded", "Failed", "Suspended", "Ready")


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    kind: str,
    status: bool,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """``conditions`` with ``kind`` set; the transition time is kept unless it flipped."""
    value = "True" if status else "False"
    out = []
    found = False
    for condition in conditions:
        if condition.get("type") != kind:
            out.append(dict(condition))
            continue
        found = True
        since = condition.get("lastTransitionTime") if condition.get("status") == value else now
        out.append({"type": kind, "status": value, "reason": reason, "message": message,
                    "lastTransitionTime": since or now, "observedGeneration": generation})
    if not found:
        out.append({"type": kind, "status": value, "reason": reason, "message": message,
                    "lastTransitionTime": now, "observedGeneration": generation})
    order = {name: i for i, name in enumerate(CONDITION_TYPES)}
    return sorted(out, key=lambda c: order.get(str(c.get("type")), len(order)))


def with_phase(status: Mapping[str, Any], phase: str, reason: str, message: str, generation: int,
               now: str, planned: bool, meshes_ready: bool) -> dict[str, Any]:
    """``status`` in ``phase``, every condition set to agree with it."""
    out = dict(status)
    out["phase"] = phase
    out["observedGeneration"] = generation
    conditions = list(status.get("conditions") or [])

    def put(kind: str, value: bool, why: str, text: str = "") -> None:
        nonlocal conditions
        conditions = set_condition(conditions, kind, value, why, text, generation, now)

    put("Planned", planned, "PlanReady" if planned else reason)
    put("MeshesReady", meshes_ready and phase == "Running", "PodsRunning" if meshes_ready else reason)
    put("Running", phase == "Running", reason, message if phase == "Running" else "")
    put("Succeeded", phase == "Succeeded", reason, message if phase == "Succeeded" else "")
    put("Failed", phase == "Failed", reason, message if phase == "Failed" else "")
    put("Suspended", phase == "Suspended", reason, message if phase == "Suspended" else "")
    ready = phase in ("Running", "Succeeded")
    put("Ready", ready, reason, message)
    out["conditions"] = conditions
    return out
