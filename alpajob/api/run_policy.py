"""``spec.runPolicy`` (contract 1, with :mod:`.spec`): how long a job may run, how often
it restarts, and what a failed pod means.

A failed pod is judged by :class:`PodFailurePolicy`: its rules are matched in order
against the pod's exit code or conditions (as Kubernetes Jobs do), and the first match
says FailJob, Ignore or Count; with none, :data:`DEFAULT_FAILURE_RULES` apply.
``backoffLimit`` bounds the counted restarts, ``restartScope`` says whether a failed
mesh pod restarts the job or only itself, and ``cleanPodPolicy`` which pods stay for
``kubectl logs`` when the job ends.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from alpajob.api.schema import INT32, INT32_MAX, INT64, INT64_MAX, Contract, cel, k8s, unchanged


class FailureAction(StrEnum):
    """What a pod failure that matches a rule does to the job."""

    FAIL_JOB = "FailJob"  # fail at once: restarting cannot help (a configuration error)
    IGNORE = "Ignore"  # restart from the last checkpoint, not counted against backoffLimit
    COUNT = "Count"  # restart from the last checkpoint, counted against backoffLimit


class ExitCodeOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"


class OnExitCodes(Contract):
    """A failed pod's exit code (of its one container) in, or not in, ``values``."""

    operator: ExitCodeOperator = Field(description="In or NotIn.")
    values: list[Annotated[int, Field(ge=1, le=255)]] = Field(
        min_length=1, max_length=255, json_schema_extra=k8s(x_kubernetes_list_type="set"),
        description="Exit codes (1-255; 0 is success, never a failure).")


class OnPodCondition(Contract):
    """A failed pod's condition, e.g. ``DisruptionTarget`` (preempted, evicted, its
    node lost); a pod that vanished counts as having ``DisruptionTarget=True``."""

    type: str = Field(min_length=1, max_length=316, description="The condition type.")
    status: Literal["True", "False", "Unknown"] = Field("True", description="Its status (default True).")


class PodFailureRule(Contract):
    """One rule: an action and what a failed pod must show for it (exactly one of
    ``onExitCodes`` and ``onPodConditions``)."""

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        cel("has(self.onExitCodes) != has(self.onPodConditions)",
            "set exactly one of onExitCodes and onPodConditions in each spec.runPolicy.podFailurePolicy rule"))}

    action: FailureAction = Field(description="FailJob, Ignore or Count.")
    on_exit_codes: OnExitCodes | None = Field(None, description="Match by the container's exit code.")
    on_pod_conditions: list[OnPodCondition] | None = Field(
        None, min_length=1, max_length=20, description="Match when the pod has any of these conditions.")

    @model_validator(mode="after")
    def _one_match(self) -> PodFailureRule:
        if (self.on_exit_codes is None) == (self.on_pod_conditions is None):
            raise ValueError("set exactly one of onExitCodes and onPodConditions in each spec.runPolicy.podFailurePolicy rule")
        return self


#: The rules of a job that sets none: every AlpaJob configuration error exits 2
#: (restarting cannot fix it), and preemption, eviction or a lost node is no fault of
#: the job's.
DEFAULT_FAILURE_RULES = (
    PodFailureRule(action=FailureAction.FAIL_JOB,
                   on_exit_codes=OnExitCodes(operator=ExitCodeOperator.IN, values=[2])),
    PodFailureRule(action=FailureAction.IGNORE, on_pod_conditions=[OnPodCondition(type="DisruptionTarget")]),
)


class PodFailurePolicy(Contract):
    """``spec.runPolicy.podFailurePolicy``: what a failed pod of the current attempt
    does, as in a Kubernetes Job: the first rule a failed pod matches decides; a pod
    no rule matches counts. With several failed pods FailJob beats Count beats Ignore."""

    rules: list[PodFailureRule] = Field(max_length=20, description=(
        "Checked in order; unset podFailurePolicy means: FailJob on exit code 2 (a "
        "configuration error), Ignore on DisruptionTarget (preemption, eviction, node loss)."))


class RestartScope(StrEnum):
    """What restarts after a pod of the job fails."""

    JOB = "Job"  # every pod, as a new attempt, from the last checkpoint
    FAILED_PODS = "FailedPods"  # only a failed mesh pod; the driver restarts the stages in place


class CleanPodPolicy(StrEnum):
    """Which pods go when the job finishes (Kubeflow's names)."""

    NONE = "None"  # every pod stays (running ones too: for debugging)
    RUNNING = "Running"  # the pods still running go; finished ones stay for `kubectl logs`
    ALL = "All"  # every pod goes


class RunPolicy(Contract):
    """``spec.runPolicy``: restarts, deadlines, clean-up and suspension."""

    model_config = Contract.model_config | {"json_schema_extra": k8s(*(unchanged(
        key, f"spec.runPolicy.{key} is immutable once the AlpaJob exists; only suspend, "
        "activeDeadlineSeconds, ttlSecondsAfterFinished, schedulingTimeoutSeconds and "
        "cleanPodPolicy may change")
        for key in ("backoffLimit", "podFailurePolicy")))}

    backoff_limit: int = Field(3, ge=0, le=INT32_MAX, json_schema_extra=INT32, description=(
        "Restarts of the whole job (every mesh, from the last checkpoint) before it fails."))
    active_deadline_seconds: int | None = Field(None, ge=1, le=INT64_MAX, json_schema_extra=INT64, description=(
        "Seconds from the start after which the job fails and its pods are deleted."))
    ttl_seconds_after_finished: int | None = Field(None, ge=0, le=INT32_MAX, json_schema_extra=INT32, description=(
        "Seconds after the job succeeded or failed when the AlpaJob (and with it every child) "
        "is deleted."))
    suspend: bool = Field(False, description=(
        "true deletes the job's pods and holds it; false resumes it from the last checkpoint "
        "(queued again, under Kueue)."))
    scheduling_timeout_seconds: int | None = Field(None, ge=1, le=INT64_MAX, json_schema_extra=INT64, description=(
        "Seconds a pod of the job may stay unschedulable (the scheduler finds no node for it) "
        "before the job fails with reason SchedulingTimeout. Unset: it waits, and says why "
        "(condition PodsScheduled=False with the scheduler's message). Time queued for Kueue's "
        "quota does not count."))
    clean_pod_policy: CleanPodPolicy = Field(CleanPodPolicy.RUNNING, description=(
        "Which pods are deleted when the job finishes: Running (default: the ones still running; "
        "finished pods, the planner's included, stay for kubectl logs until the job is deleted or "
        "its TTL passes), All, or None. A Succeeded job's mesh pods end on their own (the driver "
        "releases them: Succeeded, logs kept); any still running 10 s later are deleted whatever "
        "the policy. Pods of a failed attempt also stay, stopped."))
    progress_deadline_seconds: int | None = Field(None, ge=1, le=INT64_MAX, json_schema_extra=INT64, description=(
        "Seconds a Running job may go without a progress report from its trainer before it is "
        "restarted as a hung job (reason ProgressDeadlineExceeded, counted against "
        "backoffLimit). Keep it well above a step's time."))
    restart_scope: RestartScope = Field(RestartScope.FAILED_PODS, description=(
        "FailedPods (default): a failed or deleted mesh pod is replaced alone, on its node, while "
        "the head pod's driver keeps the Ray cluster, replaces that mesh's actors (the other "
        "meshes keep theirs, with their compiled stages, where the transport allows) and goes "
        "back to the last checkpoint; no other pod is rescheduled. The whole job restarts instead "
        "when the head failed, when a failed pod's node is not Ready, or once the driver has "
        "restarted in place backoffLimit times. Job: every failure restarts every pod as a new "
        "attempt. Counted failures spend backoffLimit either way."))
    pod_failure_policy: PodFailurePolicy | None = Field(None, description=(
        "What a failed pod does: fail the job at once, restart without counting, or restart "
        "counted against backoffLimit (unset: FailJob on exit code 2, Ignore on DisruptionTarget)."))

    def failure_rules(self) -> tuple[PodFailureRule, ...]:
        """The rules in force (the job's, else :data:`DEFAULT_FAILURE_RULES`)."""
        if self.pod_failure_policy is None:
            return DEFAULT_FAILURE_RULES
        return tuple(self.pod_failure_policy.rules)
