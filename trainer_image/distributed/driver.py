"""``alpajob driver``: train one plan across the mesh hosts of the job's Ray cluster.

On the head (a Ray client of the job's cluster), one **attempt**:

1. wait until every mesh host of the plan has joined (its custom resource is in the
   cluster), or fail naming the missing ones (:func:`~.cluster.wait_for_hosts`);
2. start one :class:`~.mesh_host.MeshHost` actor per mesh host, pinned by its
   resource; a mesh of several hosts gets its JAX coordinator's address from its
   host 0, then every actor joins its mesh's process group and builds its stage
   (:class:`~.group.MeshGroup`). With ``transport="collective"`` there is one process group
   for the whole job instead, its coordinator on mesh 0 host 0;
3. gather every stage's layout and hand all of them, with the actor handles, to
   every actor: from then on stages talk to each other directly (the object store,
   or with ``transport="collective"`` XLA collectives between the meshes' devices:
   gloo on CPU; on GPU the same collectives run on NCCL, which has not been run on a
   GPU yet, :mod:`.collective`), not through the driver;
4. restore every mesh from the newest complete checkpoint that reads back intact
   (a damaged one is set aside and the one before it used);
5. per step, ask every actor to run it and wait for all; the loss is the mean of
   the loss stage's micro-batch losses. Every ``checkpoint_every`` steps (and at
   the end) every mesh saves its part of the checkpoint
   (:mod:`alpajob.trainer_image.checkpoint`; in the background unless
   ``checkpoint_async`` is off); the checkpoint is complete once every part is
   finalized, and the driver, which holds the folder's lock, prunes all but the
   newest ``checkpoint_keep_last``. SIGTERM stops the loop after the step in
   progress, with a checkpoint of that step.

**Recovery.** A mesh host that dies (its actor, its process or its node) or hangs
(no answer within ``step_timeout``) fails the attempt (:func:`~.group.gather` tells
such a consequence from a training error: with ``transport="collective"`` the
survivors' collectives fail as soon as a peer's process is gone, usually before Ray
declares it dead). The driver then waits for the lost host to come back (its pod
replaced) and resumes from the last complete checkpoint, so at most
``checkpoint_every`` steps are lost. Where it can (the object-store transport,
several meshes, checkpoints) it replaces only the failed mesh's actors and keeps the
others with their compiled stages (:meth:`~.group.MeshGroup.repair`); otherwise it
stops every actor and builds every mesh again (fresh processes, so a fresh
``jax.distributed`` group on a newly picked port). While an attempt is being set up,
a host failure (an actor placed on a node Ray has not yet declared dead) only sets it
up again, until ``join_timeout`` has passed since the failure. After
``max_restarts`` restarts the job fails. An error raised by the training code itself
is not retried: it would fail again the same way.

**Progress.** After every step the driver updates its Prometheus metrics (step,
loss, samples per second, the last checkpoint step, restarts, and every stage's
compute, idle and communication seconds, served on ``metrics_port``) and, when
asked, a status file (JSON) that the operator reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from alpajob.api.errors import TransientError
from alpajob.api.plan import Plan
from alpajob.api.progress import Progress, TrainerPhase
from alpajob.api.resource import parse_job
from alpajob.api.runtime import Transport
from alpajob.api.wording import counted
from alpajob.trainer_image.checkpoint.lock import FolderLock
from alpajob.trainer_image.data.feed import batch_sources
from alpajob.trainer_image.distributed.cluster import mesh_hosts, wait_for_hosts
from alpajob.trainer_image.distributed.group import MeshGroup, recoverable
from alpajob.trainer_image.distributed.mesh_host import stage_times
from alpajob.trainer_image.distributed.saving import MeshCheckpoints
from alpajob.trainer_image.goodput import Badput, Goodput
from alpajob.trainer_image.metrics import TrainingMetrics, write_metrics_json, write_text_atomically
from alpajob.trainer_image.precision import LossScale
from alpajob.trainer_image.publish import (
    ProgressPublisher,
    final_report_message,
    write_termination_message,
)
from alpajob.trainer_image.stopping import StopRequest


class JobFailedError(TransientError):
    """The job failed more often than ``max_restarts`` allows."""


@dataclass(frozen=True)
class DriverOptions:
    """How the driver runs: where the cluster is, how long, how patient."""

    address: str
    steps: int
    seed: int = 0
    join_timeout: float = 120.0
    step_timeout: float = 600.0
    metrics_out: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    checkpoint_keep_last: int = 3
    checkpoint_async: bool = True
    max_restarts: int = 3
    metrics_port: int | None = None
    status_file: str | None = None
    status_configmap: str | None = None  # namespace/name: the operator shows it in the job's status
    transport: Transport = Transport.OBJECT_STORE  # how values cross between meshes (mesh_host.Transport)
    attempt: int | None = None  # the job's attempt this driver runs (a pod's), for the checkpoint lock
    checkpoint_volume: str | None = None  # where the checkpoint folder lives, for messages
    lock_wait: float = 120.0  # seconds to wait for an earlier attempt to release the checkpoint folder
    release_hosts: bool = False  # at the end, release the mesh hosts' workers (the job owns the cluster)


@dataclass
class DriverResult:
    """Per-step losses and wall seconds, bytes sent between meshes, final parameters."""

    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    sent_bytes: list[int] = field(default_factory=list)
    read_bytes: list[list[int]] = field(default_factory=list)  # per step, per mesh host (mesh_hosts order)
    source_rows: dict[str, int] = field(default_factory=dict)  # rows per training source, summed
    stage_times: list[list[dict[str, Any]]] = field(default_factory=list)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    restarts: int = 0
    checkpoint_step: int | None = None  # the newest complete checkpoint
    resumed_from: list[int] = field(default_factory=list)  # per attempt, its first step
    stopped: str | None = None  # the signal that stopped the run early
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, eval loss)
    skipped_steps: int = 0  # float16: steps whose gradients overflowed (not applied)
    first_step: int = 0  # the step ``losses[0]`` follows: where this driver's first attempt began
    badput: dict[str, float] = field(default_factory=dict)  # seconds per goodput bucket (Badput), at the end

    @property
    def step(self) -> int:
        """The steps done, those before this driver's first attempt included."""
        return self.first_step + len(self.losses)

    @property
    def eval_loss(self) -> float | None:
        return self.evals[-1][1] if self.evals else None

    def to_json(self) -> dict[str, Any]:
        return {"first_step": self.first_step, "losses": self.losses, "step_seconds": self.step_seconds,
                "eval": [{"step": step, "loss": loss} for step, loss in self.evals],
                "skipped_steps": self.skipped_steps,
                "sent_bytes": self.sent_bytes, "read_bytes": self.read_bytes, "source_rows": self.source_rows,
                "stage_times": self.stage_times,
                "restarts": self.restarts, "checkpoint_step": self.checkpoint_step,
                "resumed_from": self.resumed_from, "stopped": self.stopped, "badput": self.badput}

    def truncate(self, steps: int) -> None:
        """Forget the steps after ``steps`` (they are run again after a restart)."""
        for series in (self.losses, self.step_seconds, self.sent_bytes, self.read_bytes, self.stage_times):
            del series[max(steps - self.first_step, 0):]
        self.evals = [(step, loss) for step, loss in self.evals if step <= steps]


class Reporter:
    """Publishes the job's :class:`~alpajob.api.progress.Progress`: the status file at
    every call, the ConfigMap at every phase change and at most every ``interval``
    seconds while Running (one API call per step would load the API server when steps
    are fast). The ConfigMap is written by a
    :class:`~alpajob.trainer_image.publish.ProgressPublisher`, off the training thread:
    an API server that is away delays the job's status, never its training. A final
    phase waits up to ``flush`` seconds for its report to be written; the report of a
    job that Succeeded is also the head container's termination message, which the
    kubelet hands to the API server whenever it is back, and which the operator
    prefers to an older ConfigMap (a job that ends during an outage still ends with
    its last step)."""

    def __init__(self, options: DriverOptions, batch: int, scaled: bool = False, interval: float = 5.0,
                 say: Callable[[str], None] | None = None, flush: float = 10.0) -> None:
        self.options, self.batch, self.scaled, self.interval = options, batch, scaled, interval
        self.say = say or (lambda what: print(what, flush=True))
        self.flush = flush
        self._last: tuple[str, float] | None = None  # phase and time of the last ConfigMap write
        self._publisher: ProgressPublisher | None = None
        self.goodput: float | None = None  # the last step's

    def progress(self, result: DriverResult, phase: TrainerPhase, message: str = "",
                 goodput: float | None = None) -> Progress:
        """The report of ``result`` so far, in ``phase`` (with the last ``goodput`` given)."""
        self.goodput = goodput if goodput is not None else self.goodput
        last = result.step_seconds[-1] if result.step_seconds else None
        return Progress(
            phase=phase, step=result.step, steps=self.options.steps,
            loss=result.losses[-1] if result.losses else None, eval_loss=result.eval_loss,
            skipped_steps=result.skipped_steps if self.scaled else None,
            samples_per_second=self.batch / last if last else None,
            last_checkpoint_step=result.checkpoint_step, restarts=result.restarts, goodput=self.goodput,
            message=message[:4096] or None, updated=time.time())

    def __call__(self, result: DriverResult, phase: TrainerPhase, message: str = "") -> None:
        options = self.options
        if not (options.status_file or options.status_configmap):
            return
        report = self.progress(result, phase, message)
        if options.status_file:
            write_text_atomically(options.status_file, report.to_json())
        if phase == TrainerPhase.SUCCEEDED:  # the kubelet keeps it for an API server that is away
            write_termination_message(final_report_message(report))
        now = time.monotonic()
        due = self._last is None or self._last[0] != phase or now - self._last[1] >= self.interval
        if options.status_configmap and due:
            if self._publisher is None:
                self._publisher = ProgressPublisher(options.status_configmap, self.say)
            self._last = (phase, now)
            self._publisher.publish(report)
            if phase in (TrainerPhase.SUCCEEDED, TrainerPhase.FAILED, TrainerPhase.STOPPED):
                self._publisher.close(self.flush)
                self._publisher = None


def drive(
    manifest_yaml: str,
    plan: Plan,
    options: DriverOptions,
    on_step: Callable[[Progress], None] | None = None,
    on_event: Callable[[str], None] | None = None,
) -> DriverResult:
    """Train ``plan`` on the Ray cluster at ``options.address`` (see the module docstring)."""
    import ray
    import yaml

    say = on_event or (lambda _what: None)
    job = parse_job(yaml.safe_load(manifest_yaml))
    name = job.name
    hosts = mesh_hosts(plan)
    batch = plan.global_batch_size
    metrics = TrainingMetrics(name)
    metrics.plan(plan)
    scale = LossScale.for_dtype(job.spec.training.dtype)  # float16: kept here, across restarts
    status = Reporter(options, batch, scaled=scale is not None, say=on_event)
    if options.metrics_port is not None:
        metrics.serve(options.metrics_port)
    # spec.data.eval without evalEvery: one evaluation, after the last step
    evaluating = (job.spec.training.eval_every or options.steps) if job.spec.data and job.spec.data.eval else None
    root = options.checkpoint_dir
    saves = None
    if root:
        lock = FolderLock(root, job=name if options.attempt is not None else None, attempt=options.attempt,
                          wait_for_older=options.lock_wait, volume=options.checkpoint_volume, say=say)
        saves = MeshCheckpoints(root, options.checkpoint_keep_last, options.checkpoint_async,
                                {"model": plan.model.name, "plan_hash": plan.content_hash()}, lock)
    result = DriverResult()
    books = Goodput()  # badput: building stages, restoring, evaluating, saving; the rest is "other"
    ray.init(address=options.address, log_to_driver=False, logging_level=logging.WARNING)
    group: MeshGroup | None = None

    def hold_hosts(signal_name: str) -> None:
        """SIGTERM: every mesh host stays for the checkpoint of this step (``MeshGroup.hold``)."""
        if group is not None:
            threading.Thread(target=tell_hold, args=(group, signal_name, time.monotonic()),
                             name="alpajob-hold", daemon=True).start()

    def tell_hold(hosts: MeshGroup, signal_name: str, since: float) -> None:
        held = hosts.hold()
        say(f"{signal_name}: {held} of {counted(len(hosts.all), 'mesh host')} keep Ray up for the checkpoint "
            f"({time.monotonic() - since:.1f} s after the signal)")

    with StopRequest(on_request=hold_hosts) as stop:
        try:
            recovering_since = time.monotonic()  # of the attempt being set up
            broken: set[int] = set()  # meshes of ``group`` to replace before the next attempt
            while True:
                training = False
                try:
                    status(result, TrainerPhase.STARTING)
                    left = options.join_timeout - (time.monotonic() - recovering_since)
                    wait_for_hosts(hosts, ray.cluster_resources, max(left, 1.0),
                                   stopped=lambda: stop.requested is not None)
                    if stop.requested:  # while a host was coming back: nothing new to save
                        result.stopped = stop.requested
                        say(f"{stop.requested} while setting up the meshes: stopping (the last complete "
                            f"checkpoint is of step {result.checkpoint_step or 0})")
                        break
                    with books.timing(Badput.PLANNING):
                        if group is None:
                            group = MeshGroup(manifest_yaml, plan, hosts, options.seed, options.step_timeout,
                                              options.transport, checkpoints=saves is not None)
                        elif broken:  # on failure, the handler below asks again what is broken
                            repairing, broken = broken, set()
                            group.repair(repairing, max(left, 1.0))
                            say(f"replaced {', '.join(f'mesh {m}' for m in sorted(repairing))}; the other meshes "
                                "kept their processes and compiled stages")
                    with books.timing(Badput.RESTORE):
                        start = saves.resume(group, say) if saves else 0
                    result.checkpoint_step = start or None
                    if not result.resumed_from:  # this driver's first attempt: a resumed job's start
                        result.first_step = start
                    result.truncate(start)
                    result.resumed_from.append(start)
                    training = True
                    for step in range(start, options.steps):
                        status(result, TrainerPhase.RUNNING)
                        began = time.perf_counter()
                        replies = group.step(step, scale.scale if scale else None)
                        seconds = time.perf_counter() - began
                        if scale is not None:
                            scale.after(all(r["applied"] for g in replies for r in g))
                            result.skipped_steps = scale.skipped
                        loss = float(np.mean([x for group_replies in replies for r in group_replies for x in r["losses"]]))
                        result.losses.append(loss)
                        result.step_seconds.append(seconds)
                        result.sent_bytes.append(sum(int(r["sent_bytes"]) for g in replies for r in g))
                        read = {(str(m), str(h)): int(r.get("read_bytes", 0))
                                for m, g in enumerate(replies) for h, r in enumerate(g)}
                        result.read_bytes.append(list(read.values()))
                        rows = batch_sources(job.spec.data, step, batch)
                        for source, count in rows.items():
                            result.source_rows[source] = result.source_rows.get(source, 0) + count
                        metrics.data(read, rows)
                        result.stage_times.append([{k: v for k, v in g[0]["times"].items() if k != "spans"}
                                                   for g in replies])
                        done = step + 1
                        if evaluating and (done % evaluating == 0 or done == options.steps):
                            with books.timing(Badput.EVAL):
                                result.evals.append((done, group.evaluate(job.spec.training.eval_steps)))
                        every = options.checkpoint_every
                        if saves and ((every and done % every == 0) or done == options.steps or stop.requested):
                            with books.timing(Badput.CHECKPOINT):
                                saves.save(group, done)
                        if saves:
                            result.checkpoint_step = saves.poll()
                        summary = books.summary(result.step_seconds, 0.0)  # the hosts read their own data
                        report = status.progress(result, TrainerPhase.RUNNING, goodput=summary["goodput"])
                        metrics.record(report, seconds, [stage_times(g[0]) for g in replies])
                        metrics.books(summary)
                        if on_step:
                            on_step(report)
                        if stop.requested:
                            result.stopped = stop.requested
                            say(f"{stop.requested} after step {done}: stopping")
                            if saves:  # the signal may have come after the save's check above
                                with books.timing(Badput.CHECKPOINT):
                                    saves.save(group, done)  # (a no-op where it is saving this step)
                            break
                    if saves:
                        with books.timing(Badput.CHECKPOINT):
                            result.checkpoint_step = saves.finish(group)
                    result.params = group.params()
                    result.badput = {bucket.value: seconds for bucket, seconds in books.badput.items()}
                    if options.release_hosts and not result.stopped:
                        group.release()  # their pods end Succeeded, their logs kept
                    break
                except recoverable() as failure:
                    reason = f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"
                    if group is not None:  # keep what survived, where a mesh can be replaced alone
                        broken = group.broken() if group.repairable else set()
                        if not broken or len(broken) == len(group.actors):
                            group.stop()
                            group, broken = None, set()
                    if stop.requested:
                        # The stop took a mesh host with it (its pod deleted with the head's, and
                        # gone before the step ended): the step is lost, the checkpoint before it stays.
                        result.stopped = stop.requested
                        say(f"{stop.requested} during step {result.step + 1}, which a mesh host left "
                            f"({reason}): stopping (the last complete checkpoint is of step "
                            f"{result.checkpoint_step or 0})")
                        break
                    if not training and time.monotonic() - recovering_since < options.join_timeout:
                        # A host is still coming back (Ray may not have declared its lost
                        # node dead yet, and placed an actor there): set up again.
                        say(f"mesh hosts not ready ({reason}); setting up again")
                        time.sleep(1.0)
                        continue
                    result.restarts += 1
                    metrics.restarts.labels(name).inc()
                    if result.restarts > options.max_restarts:
                        status(result, TrainerPhase.FAILED, reason)
                        raise JobFailedError(
                            f"a mesh host failed {counted(result.restarts, 'time')} (max_restarts "
                            f"{options.max_restarts}); last failure: {reason}"
                        ) from None
                    say(f"restart {result.restarts}/{options.max_restarts} after {reason}")
                    status(result, TrainerPhase.RESTARTING, reason)
                    recovering_since = time.monotonic()
        except BaseException as error:
            if not isinstance(error, JobFailedError):
                status(result, TrainerPhase.FAILED, str(error).splitlines()[0] if str(error) else type(error).__name__)
            raise
        finally:
            if group is not None:
                if stop.requested:
                    group.let_go()
                group.stop()
            ray.shutdown()
            metrics.close()
            if saves:
                saves.close()
    status(result, TrainerPhase.STOPPED if result.stopped else TrainerPhase.SUCCEEDED)
    if options.metrics_out:
        write_metrics_json(options.metrics_out, result.to_json())
    return result
