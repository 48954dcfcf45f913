"""One reconciliation of an AlpaJob: from what exists to what to do (pure).

:func:`reconcile` is level-based: it looks at the job and its children as they are
now and returns a :class:`Decision` (the new status, the children to create or
delete, the events to post). The handlers apply it and call it again a moment later;
every step is safe to repeat, so a restarted operator simply carries on. The steps,
in order (the first that has something to wait for ends the pass):

1. **finished** (Succeeded/Failed): its pods go as ``runPolicy.cleanPodPolicy`` says
   (by default the running ones, after :data:`MESH_EXIT_GRACE` for a Succeeded job's
   mesh pods, which end on their own: finished pods keep their logs); after
   ``ttlSecondsAfterFinished`` the job itself;
2. **deadline**: past ``activeDeadlineSeconds`` since the start, fail;
3. **suspend**: stop the pods of the attempt, phase Suspended; on resume a new
   attempt starts (from the last checkpoint);
4. **plan**: the config and plan ConfigMaps, then the planner pod (the pool
   decides the cluster it plans for); its failure fails the job with the
   planner's message;
5. **restart**: a failed pod of the attempt (head or mesh), one deleted through the
   API, or one gone missing after it ran, restarts the *whole* job as a new attempt
   (every mesh, resuming from the last complete checkpoint). The pods are named in
   the message in the order they ended, the cause first.
   ``runPolicy.podFailurePolicy`` judges each pod (:func:`~.pods.failure_action`):
   FailJob fails the job at once (by default: exit code 2, a configuration error),
   Ignore restarts without counting against ``backoffLimit`` (by default: a pod
   preempted, evicted, deleted, or lost with its node), Count restarts counted
   (everything else). With ``runPolicy.restartScope: FailedPods`` (the default) a
   failed mesh pod on a Ready node is replaced alone while the head runs on (its
   driver replaces that mesh's actors and goes back to the checkpoint in place), and
   is judged once while it terminates; its replacement is made at once beside it
   (``<pod>-r<k>`` while the old name is taken, :meth:`~.decision.PassState.host_pod`). When the node pool
   has changed since the plan was made, the new attempt is **planned again** for the
   pool as it is, instead of failing; a Running job whose trainer reports no
   progress for ``progressDeadlineSeconds`` is restarted the same way (reason
   ``ProgressDeadlineExceeded``);
6. **old pods**: the new attempt waits until every running pod of an earlier one is
   gone (the old head may still save its last checkpoint and hold the checkpoint
   folder); one still there :data:`~.decision.FORCE_AFTER` seconds past its grace
   period, or on a node that is not Ready, is force-deleted, so it never holds the
   job up;
7. **children**: the Services, the PodGroup (when a gang scheduler is installed:
   before the pods), the head pod and every mesh pod, named in ``status.children``
   before they are created, sized from the plan and ``spec.podTemplate``;
8. **observe**: Starting until every pod runs, then Running; the head pod's
   success is the job's.

Whenever a pass makes a pod, the job's own ServiceAccount, Role and RoleBinding
(``<job>-trainer``, unless ``spec.serviceAccountName`` names one) are made before it.
After the steps, **scheduling**: a pod unschedulable for :data:`~.waiting.SCHEDULING_GRACE`
seconds shows as ``PodsScheduled=False`` with the scheduler's message (past
``schedulingTimeoutSeconds`` the job fails), and ``status.progress.restarts`` is set
to the job's restarts.

The handlers run a pass when the job or one of its children changes; a rule that
fires with time alone (``ttlSecondsAfterFinished``, ``activeDeadlineSeconds``,
``progressDeadlineSeconds``, a grace period, the scheduling grace) says when in
:attr:`Decision.wake_after`, so nothing needs polling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import UTC
from typing import Any

from alpajob.api import wording
from alpajob.api.errors import AlpaJobError, PlanFormatError
from alpajob.api.names import KUEUE_QUEUE_LABEL, PLAN_KEY, PROGRESS_KEY
from alpajob.api.plan import plan_from_json
from alpajob.api.progress import progress_from_json
from alpajob.api.run_policy import CleanPodPolicy, FailureAction, RestartScope, RunPolicy
from alpajob.api.status import (
    ConditionStatus,
    ConditionType,
    MeshStatus,
    Phase,
    PlanSummary,
)
from alpajob.operator import children, queueing, sizing
from alpajob.operator.decision import Decision, Observed, PassState
from alpajob.operator.pods import (
    by_finish,
    done,
    ending,
    failure_action,
    final_progress,
    finished_at,
    forced,
    parse_time,
    phase_of,
    pod_message,
    stopped_by_kueue,
    terminating,
    uid,
)
from alpajob.operator.pool import PoolError, assign_nodes, pool_clusters, slot_nodes
from alpajob.operator.waiting import pool_short, scheduling

#: Seconds a Succeeded job's mesh pods have to end on their own before cleanPodPolicy
#: Running deletes them: the driver released them as it finished and they are
#: stopping Ray, to end Succeeded with their logs.
MESH_EXIT_GRACE = 10.0
#: Seconds a Succeeded planner pod's plan has to appear before the job fails for want of it.
PLAN_GRACE_SECONDS = 30.0


def _data(configmap: Mapping[str, Any] | None, key: str) -> str | None:
    return ((configmap or {}).get("data") or {}).get(key)


class _Pass(PassState):
    """One reconciliation pass: its steps, in order (see the module docstring)."""

    # ------------------------------------------------------------ steps
    def finished(self) -> bool:
        """A finished job: its pods go as ``runPolicy.cleanPodPolicy`` says (Running:
        those still running, so the finished ones keep their logs for ``kubectl logs``
        until the job is deleted or its TTL passes; All: every pod; None: none), and
        after ``ttlSecondsAfterFinished`` the job itself."""
        if not self.status.phase.finished:
            return False
        policy = self.run_policy.get("cleanPodPolicy", CleanPodPolicy.RUNNING.value)
        done = parse_time(self.status.completion_time)
        since = (self.seen.now.replace(tzinfo=None) - done).total_seconds() if done is not None else None
        succeeded = self.status.phase is Phase.SUCCEEDED
        if policy == CleanPodPolicy.ALL.value:
            self.delete_pods(self.seen.pods)
        elif succeeded and since is not None and since < MESH_EXIT_GRACE:
            self.decision.wake(MESH_EXIT_GRACE - since)  # released mesh pods are ending on their own
        elif policy == CleanPodPolicy.RUNNING.value or succeeded:
            self.stop_pods(self.seen.pods)  # what still runs (of a Succeeded job, whatever the policy)
        ttl = self.run_policy.get("ttlSecondsAfterFinished")
        if ttl is not None and done is not None:
            left = ttl - (self.seen.now.replace(tzinfo=None) - done).total_seconds()
            if left <= 0:
                self.decision.delete_job = True
            else:
                self.decision.wake(left)
        return True

    def deadline(self) -> bool:
        limit = self.run_policy.get("activeDeadlineSeconds")
        started = parse_time(self.status.start_time)
        if limit is None or started is None:
            return False
        left = limit - (self.seen.now.replace(tzinfo=None) - started).total_seconds()
        if left > 0:
            self.decision.wake(left)
            return False
        self.stop_pods(self.seen.pods)
        self.phase(Phase.FAILED, "DeadlineExceeded",
                   f"the job ran longer than activeDeadlineSeconds ({limit} s)")
        return True

    def suspend(self) -> bool:
        if self.run_policy.get("suspend"):
            self.stop_pods(self.seen.pods)
            if self.status.phase is not Phase.SUSPENDED:
                self.phase(Phase.SUSPENDED, "Suspended", "spec.runPolicy.suspend is true; pods deleted")
            return True
        if self.status.phase is Phase.SUSPENDED:
            # Resume: a fresh attempt, from the last complete checkpoint.
            self.next_attempt()
            self.phase(Phase.STARTING, "Resumed", "resumed; restarting every mesh from the last checkpoint")
        return False

    def read_plan(self) -> bool:
        """The plan from ``<job>-plan`` into ``plan_doc``; False (and Failed) if it is not
        a valid Plan document."""
        text = _data(self.seen.configmaps.get(self.names.plan), PLAN_KEY)
        if not text:
            return True
        try:
            self.plan_doc = plan_from_json(text, f"ConfigMap {self.names.plan}")
        except PlanFormatError as error:
            self.phase(Phase.FAILED, "InvalidPlan", str(error))
            return False
        return True

    def ensure_plan(self) -> bool:
        """Ensure the plan; True while it is not there yet (or failed)."""
        names, configmaps = self.names, self.seen.configmaps
        if self.status.start_time is None:
            self.status.start_time = self.now
        if names.config not in configmaps:
            self.decision.create.append(children.config_map(self.job, names, self.seen.manifest_yaml))
        if names.plan not in configmaps:
            self.decision.create.append(children.plan_config_map(self.job, names))
        if names.progress not in configmaps:
            self.decision.create.append(children.progress_config_map(self.job, names))
        claim = children.checkpoint_volume_claim(self.job)
        if claim is not None and claim["metadata"]["name"] not in self.seen.claims:
            self.decision.create.append(claim)
        if not self.read_plan():
            return True
        if self.plan_doc is not None:
            if self.status.plan is None or self.status.plan.hash != self.plan_doc.content_hash():
                self.status.plan = self.summary()
                shapes = ", ".join("x".join(map(str, s.submesh_shape)) for s in self.plan.stages)
                self.decision.events.append(("Normal", "Planned", (
                    f"{wording.counted(len(self.plan.stages), 'stage')} on submeshes {shapes}, "
                    f"{wording.counted(self.plan.num_micro_batches, 'micro-batch', 'micro-batches')}, predicted step {self.plan.predicted_step_seconds:.4g} s; the whole plan is "
                    f"in ConfigMap {names.plan}, the planner's output in `kubectl logs {names.planner}`")))
            return False
        planner = self.seen.pods.get(names.planner)
        if planner is None:
            if pool_short(self):
                return True
            try:
                clusters = pool_clusters(self.spec.get("cluster") or {}, self.seen.pool)
            except PoolError as error:
                self.phase(Phase.FAILED, "NoNodePool", str(error))
                return True
            self.status.children.attempt = self.attempt
            self.status.children.planner = names.planner
            self.decision.create.append(children.planner_pod(self.job, names, clusters, self.templates))
            self.phase(Phase.PLANNING, "Planning", "planning for " + " + ".join(
                f"{c.nodes} x {c.gpus_per_node} {c.preset}" for c in clusters))
        elif phase_of(planner) == "Failed":
            self.phase(Phase.FAILED, "PlanningFailed", pod_message(planner))
        elif phase_of(planner) == "Succeeded":
            self.planner_ended_without_plan(planner)
        elif queueing.gated(planner):
            queue = ((planner.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL, "default")
            self.phase(Phase.PLANNING, "PlannerQueued", (
                f"Kueue holds the planner pod {names.planner} in LocalQueue {queue} (LocalQueueDefaulting queues "
                "pods without a queue label in a LocalQueue named default): give that queue CPU and memory "
                "quota, or rename it"))
        elif self.status.phase is not Phase.PLANNING:
            self.phase(Phase.PLANNING, "Planning", "the planner pod is running")
        return True

    def planner_ended_without_plan(self, planner: Mapping[str, Any]) -> None:
        """A planner pod that succeeded but left no plan fails the job, once the plan
        ConfigMap has had :data:`PLAN_GRACE_SECONDS` to arrive: the planner writes it
        before it exits, but the operator's watch of ConfigMaps may see it after the
        pod's end (two resources, two streams)."""
        at = finished_at(planner)
        ended = parse_time(at) if at != "~" else None
        waited = (self.seen.now.replace(tzinfo=None) - ended).total_seconds() if ended else PLAN_GRACE_SECONDS
        if waited < PLAN_GRACE_SECONDS:
            self.decision.wake(PLAN_GRACE_SECONDS - waited)
            return
        self.phase(Phase.FAILED, "PlanningFailed", (
            f"the planner pod {self.names.planner} exited 0 but wrote no plan into ConfigMap "
            f"{self.names.plan}: your model's entrypoint or the image's command ended it early "
            f"(see `kubectl logs {self.names.planner}`)"))

    def summary(self) -> PlanSummary:
        plan = self.plan
        return PlanSummary(config_map=self.names.plan, hash=plan.content_hash(),
                           stages=len(plan.stages), meshes=len(plan.stages),
                           predicted_step_seconds=plan.predicted_step_seconds,
                           num_micro_batches=plan.num_micro_batches)

    def restart(self) -> bool:
        """Restart the whole job after a failure of the current attempt; True if it did."""
        current = self.pods_of(self.attempt)
        created = self.status.children.created == self.attempt
        judged_before = set(self.status.children.replaced or [])
        # Failed, or deleted through the API while it ran (judged once: a pod replaced
        # in place is remembered by uid until it is gone).
        failed = by_finish([n for n, p in current.items()
                             if (phase_of(p) == "Failed" or terminating(p)) and phase_of(p) != "Succeeded"
                             and uid(p) not in judged_before], current)
        missing = [] if not created else (
            ([self.names.head] if self.names.head not in self.seen.pods else [])
            + [self.names.mesh_pod(m, h) for m, h, _ in self.hosts() if not self.host_pods(m, h)])
        head_done = phase_of(current.get(self.names.head)) == "Succeeded"
        # restartScope FailedPods (the default): while the head runs, a failed mesh pod
        # whose node is Ready is replaced alone (pinned there again), and a missing one
        # is simply created again (ensure_children) unless the pool changed meanwhile.
        scope = self.run_policy.get("restartScope", RestartScope.FAILED_PODS.value)
        kueue = [stopped_by_kueue(current[n]) for n in failed]
        in_place = (scope == RestartScope.FAILED_PODS.value
                    and not any(kueue)  # Kueue stops the whole group
                    and phase_of(current.get(self.names.head)) == "Running"
                    and not terminating(current[self.names.head])
                    and self.names.head not in failed + missing
                    and not any(node and node not in self.seen.ready_nodes
                                for node in ((current[n].get("spec") or {}).get("nodeName") for n in failed))
                    and not (missing and self.pool_changed()))
        if in_place:
            missing = []
        if head_done or not (failed or missing):
            return False
        what = ", ".join([ending(n, current[n]) for n in failed] + [f"{n} is gone" for n in missing])
        policy = RunPolicy.model_validate(self.run_policy)
        rules = policy.failure_rules()
        judged = [failure_action(rules, current[n], self.seen.ready_nodes) for n in failed]
        judged += [failure_action(rules, None, self.seen.ready_nodes) for _ in missing]
        actions = {action for action, _ in judged}
        if FailureAction.FAIL_JOB in actions:
            index = next(i for a, i in judged if a is FailureAction.FAIL_JOB)
            self.phase(Phase.FAILED, "PodFailurePolicy",
                       f"{what}; podFailurePolicy rule {index} says FailJob: restarting cannot help, "
                       "fix the cause and create the job again")
            return True
        counted = FailureAction.COUNT in actions
        if in_place:
            self.replace_pods({n: current[n] for n in failed}, what, counted)
        elif counted:
            self.restart_attempt(current, "PodFailed", what)
        else:
            self.restart_attempt(current, "Preempted" if any(kueue) else "PodDisrupted", what, counted=False)
        return True

    def replace_pods(self, pods: Mapping[str, Mapping[str, Any]], what: str, counted: bool) -> None:
        """restartScope FailedPods: delete the failed mesh pods (the next passes create
        them again, same names, same attempt) while the head pod's driver waits for
        their hosts and restarts every stage from the last checkpoint; or fail once
        ``backoffLimit`` counted restarts are spent."""
        tally = self.book_restart(what, counted)
        if tally is None:
            return  # Failed: its pods go as cleanPodPolicy says (finished)
        self.delete_pods(pods)
        self.judge(pods)
        self.phase(Phase.RESTARTING, "MeshPodReplaced",
                   f"{what}; replacing {', '.join(sorted(pods))} while the driver restarts every stage "
                   f"from the last checkpoint ({tally})")

    def restart_attempt(self, current: Mapping[str, Mapping[str, Any]], reason: str, what: str,
                        counted: bool = True) -> None:
        """Delete the attempt's pods and start the next attempt (every mesh, from the
        last checkpoint), or fail once ``backoffLimit`` counted restarts are spent. The
        attempt's finished pods stay for ``kubectl logs`` (``cleanPodPolicy``)."""
        tally = self.book_restart(what, counted)
        if tally is None:
            return  # Failed: its pods go as cleanPodPolicy says (finished)
        self.stop_pods(current)
        self.next_attempt()
        self.phase(Phase.RESTARTING, reason, f"{what}; restarting every mesh from the last checkpoint ({tally})")
        if self.pool_changed():
            self.replan("the node pool changed since the plan was made")

    def book_restart(self, what: str, counted: bool) -> str | None:
        """Book a restart in ``status.restarts`` (``counted`` against ``backoffLimit``)
        or ``status.disruptions``, and say which; None, with the job Failed, once the
        counted restarts are spent."""
        limit = int(self.run_policy.get("backoffLimit", 3))
        if counted and self.status.restarts >= limit:
            self.phase(Phase.FAILED, "BackoffLimitExceeded",
                       f"{what}; the job restarted {wording.counted(self.status.restarts, 'time')} (backoffLimit {limit})")
            return None
        if counted:
            self.status.restarts += 1
            return f"restart {self.status.restarts} of {limit}"
        self.status.disruptions += 1
        return f"disruption {self.status.disruptions}, not counted against backoffLimit {limit}"

    def hung(self, current: Mapping[str, Mapping[str, Any]]) -> bool:
        """A Running job whose trainer has reported no progress for
        ``progressDeadlineSeconds`` (since its last report, or since it started running
        if none came this attempt) is restarted like a failed one; True if it was.
        The report's time is the driver's clock: keep the deadline well above the
        step time plus the driver's report interval (5 s)."""
        limit = self.run_policy.get("progressDeadlineSeconds")
        if not limit:
            return False
        since = next((c.last_transition_time for c in self.status.conditions
                      if c.type is ConditionType.RUNNING and c.status is ConditionStatus.TRUE), None)
        started = parse_time(since)
        if started is None:
            return False
        last = started.replace(tzinfo=UTC).timestamp()
        progress = self.status.progress
        if progress is not None and progress.updated is not None:
            last = max(last, progress.updated)
        quiet = self.seen.now.timestamp() - last
        if quiet < limit:
            self.decision.wake(limit - quiet)
            return False
        step = progress.step if progress is not None and progress.step is not None else 0
        self.restart_attempt(current, "ProgressDeadlineExceeded",
                             f"no progress for {quiet:.0f} s (progressDeadlineSeconds {limit}; last step {step})")
        return True

    def pool_changed(self) -> bool:
        """Would the pool now give the planner another cluster than the plan's?"""
        spec = self.spec.get("cluster") or {}
        try:
            now = pool_clusters(spec, self.seen.pool)
        except PoolError:
            return False  # no pool at all: keep the plan, the pods wait for nodes
        if spec.get("pools") is None:
            cluster = self.plan.cluster
            return (now[0].nodes, now[0].gpus_per_node) != (cluster.get("num_nodes"), cluster.get("devices_per_node"))
        planned = [(p["preset"], p["num_nodes"], p["devices_per_node"]) for p in self.plan.pools or [self.plan.cluster]]
        return [(c.preset, c.nodes, c.gpus_per_node) for c in now] != planned

    def replan(self, why: str) -> None:
        """Plan the job again (for the pool as it is now) before the next attempt."""
        self.decision.clear_plan = True
        self.status.plan = None
        planner = self.seen.pods.get(self.names.planner)
        if planner is not None:
            self.delete_pods({self.names.planner: planner})
        self.decision.events.append(("Normal", "Replanning", why))

    def old_pods_linger(self) -> bool:
        """True while a pod of an earlier attempt is still there (terminating for its
        grace period: a head that saves its last checkpoint and releases the checkpoint
        folder, a mesh pod whose Ray worker still holds its host's resource). The next
        attempt's pods are created only once every one is gone, so two attempts never
        run side by side; :meth:`delete_pods` forces the stragglers."""
        old = {n: p for n, p in self.seen.pods.items()
               if n != self.names.planner and n not in self.pods_of(self.attempt) and not done(p) and not forced(p)}
        if not old:
            return False
        self.stop_pods(old)
        phase = self.status.phase if self.status.phase in (Phase.RESTARTING, Phase.STARTING) else Phase.RESTARTING
        self.phase(phase, "OldPodsTerminating",
                   f"waiting for {wording.counted(len(old), 'pod')} of an earlier attempt to terminate: {', '.join(sorted(old))}")
        return True

    def ensure_children(self) -> bool:
        """Create what is missing; True if the pool cannot hold the plan any more."""
        names, job, gang = self.names, self.job, self.seen.gang
        try:
            nodes = assign_nodes(self.plan.stages, slot_nodes(self.plan, self.spec.get("cluster") or {}, self.seen.pool))
        except PoolError as error:
            self.stop_pods(self.pods_of(self.attempt))
            self.replan(f"the plan no longer fits the node pool ({error})")
            self.phase(Phase.PLANNING, "Replanning", "planning again for the node pool as it is now")
            return True
        hosts = self.hosts()
        cluster = self.plan.cluster
        cpu = (cluster.get("device") or {}).get("name") == "cpu" or cluster.get("preset") == "cpu"
        before = self.status.children
        self.status.children = names.to_status([(m, h) for m, h, _ in hosts])
        self.status.children.mesh_pods = [standing[0] if (standing := self.host_pod(m, h)) else
                                          self.replacement_name(m, h) for m, h, _ in hosts]
        self.status.children.created, self.status.children.replaced = before.created, before.replaced
        if names.service not in self.seen.services:
            if self.seen.network.enabled:  # made once, with the Services (not watched: a 409 keeps it)
                self.decision.create.append(children.network_policy(job, names, self.seen.network))
            self.decision.create.append(children.head_service(job, names))
        if names.hosts_service not in self.seen.services:
            self.decision.create.append(children.hosts_service(job, names))
        if gang and names.pod_group not in self.seen.pod_groups:
            members = 1 + len(hosts)
            gpus = 0 if cpu else sum(m for _, _, _, m in self.host_devices())
            self.decision.create.append(children.pod_group(job, names, gang, members, gpus))
        pods: list[dict[str, Any]] = []
        if names.head not in self.seen.pods:
            pods.append(children.head_pod(job, names, gang, self.templates, sizing.head_size(self.plan)))
        queue = self.seen.queue
        for mesh, host, count, devices in self.host_devices():
            if self.host_pod(mesh, host) is not None:
                continue
            if queue is not None and any(not done(p) and not forced(p) for p in self.host_pods(mesh, host).values()):
                continue  # under Kueue, a replacement joins the group once the pod it replaces stopped
            node = nodes[mesh, host]
            pods.append(children.mesh_pod(job, names, mesh, host, count, node.name, devices, cpu, gang,
                                          self.templates,
                                          sizing.mesh_size(self.plan, self.plan.stages[mesh], devices, cpu),
                                          name=self.replacement_name(mesh, host),
                                          product=node.product if (self.spec.get("cluster") or {}).get("pools") else None))
        if queue is not None:
            pods = [queueing.enqueue(pod, job, names.pod_group, queue, 1 + len(hosts)) for pod in pods]
            problem = queueing.too_many_roles(self, pods)
            if problem is not None:
                self.stop_pods(self.pods_of(self.attempt))
                self.phase(Phase.FAILED, "TooManyPodSets", problem)
                return True
        self.decision.create.extend(pods)
        if pods:
            # The attempt's Ray token before its pods: made once (the operator cannot
            # read Secrets, so it asks again with every pod it makes; a 409 keeps it).
            self.decision.create.insert(0, children.ray_token_secret(job, names))
        return False

    def progress(self) -> None:
        """The trainer's progress (``<job>-progress``) into ``status.progress``; a
        Succeeded head's final report (:func:`.pods.final_progress`) when it is newer
        (its last ConfigMap write may have been lost to an API server outage)."""
        text = _data(self.seen.configmaps.get(self.names.progress), PROGRESS_KEY)
        if text:
            with contextlib.suppress(AlpaJobError):  # advisory: a malformed report leaves the last good one
                self.status.progress = progress_from_json(text, f"ConfigMap {self.names.progress}")
        final = final_progress(self.pods_of(self.attempt).get(self.names.head))
        current = self.status.progress
        if final is not None and (current is None or (final.updated or 0) > (current.updated or 0)):
            self.status.progress = final

    def observe(self) -> None:
        self.progress()
        current = self.pods_of(self.attempt)
        head = current.get(self.names.head)
        meshes: dict[int, MeshStatus] = {}
        for mesh, host, count in self.hosts():
            entry = meshes.setdefault(mesh, MeshStatus(name=f"mesh-{mesh}", nodes=count,
                                                       ready_pods=0, total_pods=count))
            standing = self.host_pod(mesh, host)
            if standing is not None and phase_of(standing[1]) == "Running":
                entry.ready_pods += 1
        self.status.meshes = [meshes[k] for k in sorted(meshes)]
        judged = set(self.status.children.replaced or [])
        if (head is not None and uid(head) not in judged
                and all(self.host_pod(m, h) is not None for m, h, _ in self.hosts())):
            # Every pod of the attempt has been seen (not one that is being made
            # again): from now on one that vanishes (its node lost, evicted) counts as
            # a failure.
            self.status.children.created = self.attempt
        if phase_of(head) == "Succeeded":  # the mesh pods end on their own (finished)
            self.phase(Phase.SUCCEEDED, "TrainingFinished", "the driver finished every step")
            return
        if queueing.queued(self):
            return
        running = head is not None and phase_of(head) == "Running" and all(
            m.ready_pods == m.total_pods for m in meshes.values())
        if running:
            self.phase(Phase.RUNNING, "Training", "every mesh is running", meshes_ready=True)
            self.hung(current)
        else:
            ready = sum(m.ready_pods for m in meshes.values())
            total = sum(m.total_pods for m in meshes.values())
            self.phase(Phase.STARTING, "PodsStarting", f"{ready} of {total} mesh pods running")

    def steps(self) -> None:
        if self.finished():
            return
        if self.template_error:
            self.stop_pods(self.seen.pods)
            self.phase(Phase.FAILED, "InvalidPodTemplate", f"{self.template_error}; fix it and create the job again")
            return
        if self.deadline() or self.suspend() or self.ensure_plan():
            return
        if self.restart() or self.old_pods_linger() or self.ensure_children():
            return
        self.observe()

    def count_restarts(self) -> None:
        """``status.progress.restarts``: every restart of the job from a checkpoint, as
        the operator booked them (``restarts`` + ``disruptions``). The report comes from
        the driver of the current attempt, which knows only its own; the job's status
        must not say 0 restarts beside ``restarts: 1``."""
        progress = self.status.progress
        total = self.status.restarts + self.status.disruptions
        if progress is not None and progress.restarts != total:
            self.status.progress = progress.model_copy(update={"restarts": total})

    def identity(self) -> None:
        """The job's identity (:func:`.children.identity`) before any pod that runs as
        it: asked again with every pod the pass makes (a 409 keeps it), so a
        deleted ServiceAccount or an operator upgraded under a running job is made
        good by the next pod."""
        if any(obj["kind"] == "Pod" for obj in self.decision.create):
            self.decision.create[:0] = children.identity(self.job, self.names)

    def run(self) -> Decision:
        self.steps()
        queueing.unqueued(self)
        queueing.requeue(self)
        queueing.release(self)
        self.identity()
        if not self.status.phase.finished and self.status.phase is not Phase.SUSPENDED:
            scheduling(self)
        self.count_restarts()
        return self.decision


def reconcile(seen: Observed) -> Decision:
    """What to do about ``seen.job`` now (see the module docstring)."""
    return _Pass(seen).run()
