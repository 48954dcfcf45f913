"""Why a job waits, said on its status: a node pool short of ``spec.cluster.nodes``
before planning (:func:`pool_short`), and pods the scheduler cannot place
(:func:`scheduling`). Both are steps of one reconciliation pass
(:mod:`.reconcile`), written on its :class:`~.decision.PassState`.
"""

from __future__ import annotations

from alpajob.api import wording
from alpajob.api.names import LABEL_ROLE
from alpajob.api.pod_template import PodTemplates
from alpajob.api.status import ConditionStatus, ConditionType, Phase
from alpajob.operator.decision import PassState
from alpajob.operator.pod_overrides import TEMPLATE_ANNOTATION, template_hash
from alpajob.operator.pods import parse_time, unschedulable
from alpajob.operator.pool import wanted_nodes
from alpajob.operator.status import set_condition

#: Seconds a pod may be unschedulable before the job says so (the scheduler retries
#: at once when the cluster changes; a pod still unplaced after this waits for a change).
SCHEDULING_GRACE = 5.0


def pool_short(state: PassState) -> bool:
    """Before planning: say whether the pool has fewer usable nodes than
    ``spec.cluster.nodes`` (condition NodesAvailable, with the nodes left out and
    why, and an event when it turns False), and True while the job waits for them
    (``spec.cluster.whenFewerNodes: Wait``; at most
    ``runPolicy.schedulingTimeoutSeconds``, when set, counted from when the
    condition turned False)."""
    cluster = state.spec.get("cluster") or {}
    wanted, have = wanted_nodes(cluster, state.seen.pool)
    asked = "spec.cluster.nodes" if cluster.get("pools") is None else "spec.cluster.pools"
    before = next((c for c in state.status.conditions if c.type is ConditionType.NODES_AVAILABLE), None)
    if have >= wanted:
        if before is not None and before.status is ConditionStatus.FALSE:
            message = f"the pool has the {wording.counted(wanted, 'node')} {asked} asks for"
            set_condition(state.status, ConditionType.NODES_AVAILABLE, True, "AllNodes", message,
                          state.generation, state.now)
            state.decision.events.append(("Normal", "NodesAvailable", message))
        return False
    wait = cluster.get("whenFewerNodes", "Plan") == "Wait"
    left_out = list(state.seen.left_out)
    shown = "; ".join(f"{name} {why}" for name, why in left_out[:4])
    if len(left_out) > 4:
        shown += f"; {wording.counted(len(left_out) - 4, 'more node')} left out"
    fewer = (" (no more nodes match spec.cluster.nodeSelector)" if cluster.get("pools") is None else
             " (no more nodes carry the nvidia.com/gpu.product of a pool's type)")
    message = (f"the pool has {have} of the {wording.counted(wanted, 'node')} {asked} asks for"
               + (f" ({shown})" if shown else fewer)
               + (": waiting for the rest (spec.cluster.whenFewerNodes: Wait)" if wait else
                  f": planning for {have} (spec.cluster.whenFewerNodes: Plan; Wait would wait for the rest)"))
    if before is None or before.status is ConditionStatus.TRUE:
        state.decision.events.append(("Warning", "FewerNodes", message))
    set_condition(state.status, ConditionType.NODES_AVAILABLE, False, "FewerNodes", message,
                  state.generation, state.now)
    if not wait:
        return False
    since = parse_time(next(c for c in state.status.conditions
                            if c.type is ConditionType.NODES_AVAILABLE).last_transition_time)
    waited = (state.seen.now.replace(tzinfo=None) - since).total_seconds() if since is not None else 0.0
    limit = state.run_policy.get("schedulingTimeoutSeconds")
    if limit is not None and waited >= limit:
        state.phase(Phase.FAILED, "NodesTimeout", f"{message}; schedulingTimeoutSeconds {limit} passed")
        return True
    if limit is not None:
        state.decision.wake(limit - waited)
    state.phase(Phase.PENDING if state.status.phase is Phase.PENDING else Phase.PLANNING, "WaitingForNodes", message)
    return True

def scheduling(state: PassState) -> None:
    """Say why pods wait: a pod unschedulable for :data:`SCHEDULING_GRACE` seconds
    sets ``PodsScheduled=False`` with the scheduler's message (and the phase's
    reason Unschedulable, which kstatus, Flux and Argo CD show) and posts a Warning
    event; past ``runPolicy.schedulingTimeoutSeconds`` the job fails. Once every
    pod is placed the condition turns True again."""
    before = next((c for c in state.status.conditions if c.type is ConditionType.PODS_SCHEDULED), None)
    waiting = unschedulable(state.seen.pods, state.seen.now)
    for name in list(waiting):
        pod = state.seen.pods[name]
        role = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE, "")
        made_with = ((pod.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_ANNOTATION)
        if role in PodTemplates.model_fields and made_with != template_hash(state.templates.of(role)):
            # A pod's spec cannot change; one that never ran is simply made again,
            # alone: its deletion is not a failure (its uid is judged already) and
            # its absence until it is made again is not a loss (the attempt's pods
            # count as created again only once every one is there).
            state.delete_pods({name: pod})
            state.judge({name: pod})
            if state.status.children.created == state.attempt:
                state.status.children.created = None
            state.decision.events.append(("Normal", "PodTemplateChanged", (
                f"pod {name} cannot be scheduled and spec.podTemplate.{role} changed: making it again")))
            del waiting[name]
    long = {n: w for n, w in waiting.items() if w[0] >= SCHEDULING_GRACE}
    for age, _ in waiting.values():
        if age < SCHEDULING_GRACE:
            state.decision.wake(SCHEDULING_GRACE - age)
    if not long:
        if before is not None and before.status is ConditionStatus.FALSE:
            set_condition(state.status, ConditionType.PODS_SCHEDULED, True, "Scheduled",
                          "every pod is placed", state.generation, state.now)
        return
    name = min(long)
    age, why = long[name]
    role = ((state.seen.pods[name].get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE, "mesh")
    message = (f"pod {name} cannot be scheduled for {age:.0f} s: {why} (its requests come from the plan "
               f"and spec.podTemplate.{role}; lower them, or add nodes that fit)")
    if len(long) > 1:
        message += f"; {wording.counted(len(long) - 1, 'more pod')} unschedulable"
    limit = state.run_policy.get("schedulingTimeoutSeconds")
    if limit is not None and age >= limit:
        state.stop_pods(state.seen.pods)
        state.phase(Phase.FAILED, "SchedulingTimeout",
                   f"{message}; schedulingTimeoutSeconds {limit} passed")
        return
    if limit is not None:
        state.decision.wake(limit - age)
    if before is None or before.status is ConditionStatus.TRUE:
        state.decision.events.append(("Warning", "Unschedulable", message))
    set_condition(state.status, ConditionType.PODS_SCHEDULED, False, "Unschedulable", message,
                  state.generation, state.now)
    state.phase(state.status.phase, "Unschedulable", message)
