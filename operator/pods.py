"""What a pod's status says, as the reconciliation reads it (pure functions).

Its phase, whether it finished or is being deleted, how it ended and with what message
(the container's termination message: its error, or the log's tail under
``terminationMessagePolicy: FallbackToLogsOnError``), when, whether Kubernetes or a
person rather than the job ended it (:func:`disrupted`), what
``runPolicy.podFailurePolicy`` does about it (:func:`failure_action`), and whether the
scheduler could not place it (:func:`unschedulable`).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from alpajob.api.errors import AlpaJobError
from alpajob.api.names import KUEUE_TERMINATION_CONDITION, LABEL_ROLE, Role
from alpajob.api.progress import Progress, progress_from_json
from alpajob.api.run_policy import ExitCodeOperator, FailureAction, PodFailureRule


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=None)


def phase_of(pod: Mapping[str, Any] | None) -> str | None:
    return None if pod is None else (pod.get("status") or {}).get("phase", "Pending")


def done(pod: Mapping[str, Any]) -> bool:
    """Has the pod finished (its containers ended: it holds no resources any more)?"""
    return phase_of(pod) in ("Succeeded", "Failed")


def terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def forced(pod: Mapping[str, Any]) -> bool:
    """Was ``pod``'s deletion forced (grace period 0)? Only finalizers keep it (Kueue's,
    until its group ends): no kubelet runs it any more, and deleting it again is no use."""
    meta = pod.get("metadata") or {}
    return bool(meta.get("deletionTimestamp")) and meta.get("deletionGracePeriodSeconds") == 0


def stopped_by_kueue(pod: Mapping[str, Any]) -> str | None:
    """Kueue's message when it stopped ``pod`` (a preemption, an eviction: the pod's
    ``TerminationTarget`` condition), else None."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == KUEUE_TERMINATION_CONDITION and condition.get("status") == "True":
            return str(condition.get("message") or condition.get("reason") or "stopped by Kueue")
    return None


def uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def finished_at(pod: Mapping[str, Any]) -> str:
    """When the pod's container terminated (RFC 3339, sorts as text); ``~`` (after
    every time) when it has not."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        at = ((container.get("state") or {}).get("terminated") or {}).get("finishedAt")
        if at:
            return str(at)
    return "~"


def by_finish(names: list[str], pods: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """``names`` in the order their pods' containers ended, the first first: when one
    pod's failure takes the others down (the head's error, then every mesh's lost
    Ray connection), the cause is named first. Ties keep the head first."""
    return sorted(names, key=lambda n: (finished_at(pods[n]), (pods[n].get("metadata") or {})
                                        .get("labels", {}).get(LABEL_ROLE) != Role.HEAD.value, n))


def ending(name: str, pod: Mapping[str, Any]) -> str:
    """How pod ``name`` ended, for a message: ``<pod> failed: <its message>``,
    ``<pod> was evicted: ...``, ``<pod> was stopped by Kueue: ...``, or ``<pod> was
    deleted`` (through the API, while it ran)."""
    kueue = stopped_by_kueue(pod)
    if kueue is not None:
        return f"{name} was stopped by Kueue: {kueue}"
    if terminating(pod) and phase_of(pod) != "Failed":
        return f"{name} was deleted"
    how = "was evicted" if (pod.get("status") or {}).get("reason") == "Evicted" else "failed"
    return f"{name} {how}: {pod_message(pod)}"


_TRACEBACK = "Traceback (most recent call last):"


def stated_cause(text: str) -> str | None:
    """The line of a container's termination message that says why it failed, when one
    does. The message is the line our command wrote to the termination log, or (under
    FallbackToLogsOnError, when it wrote none) the log's tail, where the cause is
    buried in Ray's shutdown noise: there, the last ``error: ...`` or ``stopped by
    ...`` line our CLI printed; else the exception line that ends the last Python
    traceback (its last line, not its middle); else None."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    ours = [line for line in lines if line.lstrip().startswith(("error:", "stopped by "))]
    if ours:
        return ours[-1].strip()
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK)]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if not line[:1].isspace():  # frames are indented; the exception's line is not
                return line.strip()
    return None


def cause_line(text: str) -> str:
    """:func:`stated_cause`, else the message's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return stated_cause(text) or (lines[-1] if lines else "")


def _killed_by(terminated: Mapping[str, Any]) -> str | None:
    """``killed by SIGABRT (exit code 134)`` for a container a signal ended (exit code
    128 + N), with Kubernetes' reason when it has one (``OOMKilled``), else None."""
    code = terminated.get("exitCode")
    if not isinstance(code, int) or not 128 < code < 128 + 65:
        return None
    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        name = f"signal {code - 128}"
    reason = terminated.get("reason")
    said = f", {reason}" if reason and reason not in ("Error", "Completed") else ""
    return f"killed by {name} (exit code {code}{said})"


def pod_message(pod: Mapping[str, Any]) -> str:
    """The reason a pod failed, in one line: the cause its container's termination
    message states (:func:`stated_cause`); else, for a container a signal ended (an
    ``os.abort()`` in a model's code, the kernel's OOM killer), which signal and the
    log's last line, what it was doing; else that last line, or its status."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or {}
        message = str(terminated.get("message") or "")
        stated, killed = stated_cause(message), _killed_by(terminated)
        if stated:
            return stated[:1000]
        if killed:
            last = cause_line(message)
            return (f"{killed}, its last line: {last}" if last else killed)[:1000]
        if message.strip():
            return cause_line(message)[:1000]
        if terminated.get("reason"):
            return f"{terminated['reason']} (exit code {terminated.get('exitCode')})"
    return str(status.get("message") or status.get("reason") or "the pod failed")


def final_progress(pod: Mapping[str, Any] | None) -> Progress | None:
    """The last :class:`~alpajob.api.progress.Progress` a Succeeded head pod left as its
    termination message (the driver writes its final report there as well as into the
    job's progress ConfigMap), else None. The kubelet reports the message whenever the
    API server takes it, so a job that ended while the API server was away, and whose
    final ConfigMap write never landed, still ends with its true last step."""
    if pod is None or phase_of(pod) != "Succeeded":
        return None
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        message = str(((container.get("state") or {}).get("terminated") or {}).get("message") or "")
        if message.lstrip().startswith("{"):
            try:
                return progress_from_json(message, f"pod {(pod.get('metadata') or {}).get('name')}")
            except AlpaJobError:
                return None  # cut or foreign: the ConfigMap's report stands
    return None


def exit_code(pod: Mapping[str, Any]) -> int | None:
    """The exit code of the pod's container that terminated with a failure, if any."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        code = ((container.get("state") or {}).get("terminated") or {}).get("exitCode")
        if code:
            return int(code)
    return None


#: The condition Kubernetes gives a pod it disrupts (preemption, eviction, its node
#: lost); the operator also gives it to a pod that vanished or whose node is not Ready.
DISRUPTION = ("DisruptionTarget", "True")


def disrupted(pod: Mapping[str, Any], ready_nodes: frozenset[str]) -> bool:
    """Did Kubernetes or a person, not the job, end ``pod``? It was deleted through the
    API (``kubectl delete pod``: a current attempt's pod is never deleted by the
    operator), evicted (the kubelet's ``reason: Evicted``), or its node is not Ready."""
    status = pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName")
    return terminating(pod) or status.get("reason") == "Evicted" or bool(node and node not in ready_nodes)


def failure_action(rules: Sequence[PodFailureRule], pod: Mapping[str, Any] | None,
                   ready_nodes: frozenset[str]) -> tuple[FailureAction, int | None]:
    """What a failed pod (None: one that vanished) does, by the first rule it matches
    (Count when none does), and that rule's index. A pod that was :func:`disrupted`
    has ``DisruptionTarget=True`` whatever its own conditions say."""
    conditions: set[tuple[str, str]] = set()
    code = None
    if pod is None:
        conditions.add(DISRUPTION)
    else:
        conditions |= {(str(c.get("type")), str(c.get("status"))) for c in (pod.get("status") or {}).get("conditions") or []}
        if disrupted(pod, ready_nodes):
            conditions.add(DISRUPTION)
        code = exit_code(pod)
    for index, rule in enumerate(rules):
        if rule.on_exit_codes is not None:
            if code is None:
                continue
            inside = code in rule.on_exit_codes.values
            if inside == (rule.on_exit_codes.operator is ExitCodeOperator.IN):
                return rule.action, index
        elif any((c.type, c.status) in conditions for c in rule.on_pod_conditions or []):
            return rule.action, index
    return FailureAction.COUNT, None


def unschedulable(pods: Mapping[str, Mapping[str, Any]], now: datetime) -> dict[str, tuple[float, str]]:
    """The pods the scheduler could not place: name -> (seconds since it said so, its
    message), from the ``PodScheduled`` condition (the only place a real cluster says it)."""
    out = {}
    for name, pod in pods.items():
        if terminating(pod) or phase_of(pod) != "Pending":
            continue
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                since = parse_time(c.get("lastTransitionTime"))
                age = (now.replace(tzinfo=None) - since).total_seconds() if since else 0.0
                out[name] = (max(age, 0.0), str(c.get("message") or "no node can take it"))
    return out
