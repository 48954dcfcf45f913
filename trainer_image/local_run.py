"""``alpajob run``: plan (or read a plan) and train on this machine's devices.

One pass, top to bottom:

1. load the model the manifest names and trace it (the planner's graph; its
   fingerprint is what a plan file must match);
2. plan for the local devices (1 node x K devices of the manifest's preset, the
   ``cpu`` preset on CPU), or read ``--plan`` and check it was made for this model
   and fits these devices;
3. build the pipeline (:func:`~.runtime.build.build_pipeline`), or for
   ``--method serial`` the plain single-device step (the reference every parallel
   run must equal);
4. restore the newest checkpoint with ``--resume``;
5. train ``steps`` steps on synthetic batches (batch ``i`` is drawn from seed
   ``seed + i``, so a resumed run sees the batches the interrupted one would have),
   timing every ``stage_times_every``-th step per stage (timing costs a step:
   :mod:`.runtime.driver`), recording to Prometheus and checkpointing every
   ``checkpoint_every`` steps and at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from alpajob.api.errors import PlanFormatError
from alpajob.api.options import TrainOptions
from alpajob.api.plan import Plan, read_plan
from alpajob.api.progress import Progress, TrainerPhase
from alpajob.api.resource import AlpaJob
from alpajob.planner.cost.cluster import ClusterSpec, cluster_from_preset
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.trainer_image import checkpoint
from alpajob.trainer_image.data.feed import SYNTHETIC, open_feed
from alpajob.trainer_image.entrypoint import load_model
from alpajob.trainer_image.metrics import TrainingMetrics, write_metrics_json
from alpajob.trainer_image.planning import job_graph, plan_job
from alpajob.trainer_image.precision import LossScale
from alpajob.trainer_image.runtime.build import build_pipeline
from alpajob.trainer_image.runtime.driver import PipelineExecutor
from alpajob.trainer_image.runtime.executor import StageTimes
from alpajob.trainer_image.runtime.meshes import DeviceError, devices_needed, local_devices
from alpajob.trainer_image.step import (
    init_optimizer_state,
    make_scaled_train_step,
    make_train_step,
    training_optimizer,
)
from alpajob.trainer_image.throughput import Throughput
from alpajob.trainer_image.zoo import ModelDef


@dataclass
class RunResult:
    """What the run did: per-step losses and wall times, the plan, per-stage times."""

    plan: Plan | None
    start_step: int
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    stage_times: list[tuple[StageTimes, ...]] = field(default_factory=list)
    stage_time_steps: list[int] = field(default_factory=list)  # the step of each stage_times entry
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, eval loss)
    data: str = SYNTHETIC  # what the run trained on
    data_wait_seconds: float = 0.0  # time spent waiting for the loader
    skipped_steps: int = 0  # float16: steps skipped for overflowing gradients (loss scaling)
    throughput: Throughput | None = None  # model FLOPs and tokens per step, the devices' peak
    params: dict[str, np.ndarray] = field(default_factory=dict)

    def median_step_seconds(self) -> float | None:
        """The median step time after the first (which compiles)."""
        timed = self.step_seconds[1:] or self.step_seconds
        return sorted(timed)[len(timed) // 2] if timed else None

    def to_json(self) -> dict[str, Any]:
        """The ``--metrics-out`` document."""
        doc: dict[str, Any] = {
            "start_step": self.start_step,
            "losses": self.losses,
            "step_seconds": self.step_seconds,
            "data": self.data,
            "data_wait_seconds": self.data_wait_seconds,
            "skipped_steps": self.skipped_steps,
            "model_flops_per_step": self.throughput.flops_per_step if self.throughput else None,
            "tokens_per_step": self.throughput.tokens_per_step if self.throughput else None,
            "peak_flops": self.throughput.peak_flops if self.throughput else None,
            "eval": [{"step": step, "loss": loss} for step, loss in self.evals],
        }
        if self.plan is not None:
            doc["plan_hash"] = self.plan.content_hash()
            doc["predicted_step_seconds"] = self.plan.predicted_step_seconds
            doc["num_micro_batches"] = self.plan.num_micro_batches
        if self.stage_times:
            doc["stage_time_steps"] = self.stage_time_steps
            doc["stages"] = [
                {
                    "compute_seconds": [t[i].compute for t in self.stage_times],
                    "idle_seconds": [t[i].idle for t in self.stage_times],
                    "communication_seconds": [t[i].communication for t in self.stage_times],
                    "forward_seconds": [list(t[i].forward) for t in self.stage_times],
                    "backward_seconds": [list(t[i].backward) for t in self.stage_times],
                    "update_seconds": [t[i].update for t in self.stage_times],
                }
                for i in range(len(self.stage_times[0]))
            ]
        return doc


def local_cluster(job: AlpaJob, devices: list[Any]) -> ClusterSpec:
    """One node with this machine's devices, of the job's preset (``cpu`` on CPU)."""
    preset = "cpu" if devices[0].platform == "cpu" else (job.spec.cluster.preset() or "cpu")
    return cluster_from_preset(preset, 1, len(devices))


def check_plan(plan: Plan, graph: OpGraph, devices: list[Any], source: str) -> None:
    """Refuse a plan made for another model, or for more devices than this run has."""
    if plan.model.fingerprint != graph.fingerprint():
        raise PlanFormatError(
            f"{source}: made for model {plan.model.name} (fingerprint {plan.model.fingerprint}, "
            f"batch {plan.global_batch_size}) but this manifest traces to "
            f"{graph.fingerprint()} ({graph.name}, batch {graph.batch_size}); re-run "
            "`alpajob plan` on this manifest"
        )
    if devices_needed(plan) > len(devices):
        raise DeviceError(
            f"{source}: needs {devices_needed(plan)} devices ({plan.cluster['num_nodes']} x "
            f"{plan.cluster['devices_per_node']}) but this run has {len(devices)}; pass "
            f"--devices {devices_needed(plan)} or re-plan for this machine"
        )


class _Serial:
    """The reference: the whole step, whole batch, on one device."""

    def __init__(self, model: ModelDef, optimizer: Any, params: Any, device: Any, batch_size: int,
                 scale: LossScale | None) -> None:
        self._batch_def = jax.tree.structure(model.batch_shapes(batch_size))
        self.params = jax.device_put(params, device)
        self.opt_state = jax.jit(lambda p: init_optimizer_state(optimizer, p))(self.params)
        self._step = jax.jit(make_train_step(model.loss, optimizer), donate_argnums=(0, 1))
        self._scaled = jax.jit(make_scaled_train_step(model.loss, optimizer), donate_argnums=(0, 1))
        self._loss = jax.jit(model.loss)
        self.device = device
        self.scale = scale

    def step(self, batch: list[np.ndarray], timed: bool) -> tuple[float, tuple[StageTimes, ...]]:
        tree = jax.tree.unflatten(self._batch_def, batch)
        if self.scale is None:
            loss, _, self.params, self.opt_state = self._step(self.params, self.opt_state, tree)
            return float(loss), ()
        loss, finite, self.params, self.opt_state = self._scaled(
            self.params, self.opt_state, tree, jnp.float32(self.scale.scale))
        self.scale.after(bool(finite))
        return float(loss), ()

    def evaluate(self, batch: list[np.ndarray]) -> float:
        return float(self._loss(self.params, jax.tree.unflatten(self._batch_def, batch)))

    def named_arrays(self) -> dict[str, jax.Array]:
        out = checkpoint.named_leaves("params", self.params)
        out.update(checkpoint.named_leaves("opt", self.opt_state))
        return out

    def restore(self, root: str, step: int) -> None:
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        self.params = checkpoint.restore_tree(root, step, "params", self.params, sharding)
        self.opt_state = checkpoint.restore_tree(root, step, "opt", self.opt_state, sharding)


class _Pipelined:
    """The plan's pipeline, behind the same small interface as :class:`_Serial`."""

    def __init__(self, executor: PipelineExecutor, scale: LossScale | None) -> None:
        self.executor = executor
        self.scale = scale

    def step(self, batch: list[np.ndarray], timed: bool) -> tuple[float, tuple[StageTimes, ...]]:
        result = self.executor.step(batch, timed, self.scale.scale if self.scale else None)
        if self.scale is not None:
            self.scale.after(result.applied)
        return result.loss, result.stages

    def evaluate(self, batch: list[np.ndarray]) -> float:
        return self.executor.evaluate(batch)

    def named_arrays(self) -> dict[str, jax.Array]:
        out: dict[str, jax.Array] = {}
        for stage in self.executor.stages:
            out.update(checkpoint.stage_arrays(stage))
        return out

    def restore(self, root: str, step: int) -> None:
        for stage in self.executor.stages:
            checkpoint.restore_stage(root, step, stage)


def run(
    job: AlpaJob,
    options: TrainOptions,
    on_step: Callable[[Progress], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> RunResult:
    """Plan (or read the plan) and train; see the module docstring."""
    say = on_phase or (lambda _what: None)
    training = job.spec.training
    steps = options.steps if options.steps is not None else training.steps
    seed = options.seed if options.seed is not None else training.seed
    devices = local_devices(options.devices)
    model = load_model(job.spec.model, training.dtype)
    optimizer = training_optimizer(training)
    say("reading data")
    feed = open_feed(job, model, seed=seed, prefetch=options.prefetch)
    say(f"data: {feed.source}")
    plan = None
    say(f"tracing {model.name}")
    graph = job_graph(job)
    cluster = local_cluster(job, devices)
    throughput = Throughput.of(graph, feed.tokens_per_step, cluster.device,
                               1 if options.serial else len(devices), training.dtype)
    if not options.serial:
        if options.plan_file:
            plan = read_plan(options.plan_file)
            check_plan(plan, graph, devices, options.plan_file)
        else:
            say(f"planning for {len(devices)} local {devices[0].platform} devices")
            plan = plan_job(job, options.planning, cluster=cluster, graph=graph).plan
    say("initialising parameters")
    params = model.init(jax.random.key(seed))
    scale = LossScale.for_dtype(training.dtype)
    if plan is None:
        runner: Any = _Serial(model, optimizer, params, devices[0], training.global_batch_size, scale)
    else:
        say("building stages")
        runner = _Pipelined(build_pipeline(plan, model.loss, params, model.batch_shapes, optimizer, devices,
                                           wait=options.exact_stage_times), scale)
    del params

    start = 0
    if options.resume and options.checkpoint_dir:
        latest = checkpoint.latest_step(options.checkpoint_dir)
        if latest is not None:
            say(f"restoring step {latest}")
            runner.restore(options.checkpoint_dir, latest)
            feed.restore(checkpoint.load_index(options.checkpoint_dir, latest).get("data"))
            start = latest
    metrics = TrainingMetrics(job.name, plan.predicted_step_seconds if plan else None)
    if options.metrics_port is not None:
        metrics.serve(options.metrics_port)
    result = RunResult(plan=plan, start_step=start, data=feed.source, throughput=throughput)
    saved: int | None = start or None
    evaluations = feed.eval_batches(training.eval_steps) if training.eval_every else []
    eval_loss: float | None = None
    try:
        for step in range(start, steps):
            batch = feed.batch(step)
            done = step + 1
            began = time.perf_counter()
            loss, stages = runner.step(batch, done % options.stage_times_every == 0)
            seconds = time.perf_counter() - began
            result.losses.append(loss)
            result.step_seconds.append(seconds)
            if stages:
                result.stage_times.append(stages)
                result.stage_time_steps.append(done)
            if evaluations and (done % (training.eval_every or steps) == 0 or done == steps):
                eval_loss = float(np.mean([runner.evaluate(b) for b in evaluations]))
                result.evals.append((done, eval_loss))
            every = options.checkpoint_every
            if options.checkpoint_dir and ((every and done % every == 0) or done == steps):
                meta = {"model": model.name, "plan_hash": plan.content_hash() if plan else None,
                        "data": feed.state()}
                checkpoint.save(options.checkpoint_dir, done, runner.named_arrays(), meta)
                saved = done
            report = Progress(phase=TrainerPhase.RUNNING, step=done, steps=steps, loss=loss,
                              eval_loss=eval_loss, data=feed.source,
                              skipped_steps=scale.skipped if scale else None,
                              samples_per_second=training.global_batch_size / seconds,
                              tokens_per_second=throughput.tokens_per_second(seconds),
                              mfu=throughput.mfu(seconds),
                              last_checkpoint_step=saved, updated=time.time())
            metrics.record(report, seconds, stages)
            if on_step:
                on_step(report)
    finally:
        metrics.close()
        result.data_wait_seconds = feed.wait_seconds
        result.skipped_steps = scale.skipped if scale else 0
        feed.close()
    result.params = {
        name[len("params/"):]: np.asarray(value)
        for name, value in runner.named_arrays().items() if name.startswith("params/")
    }
    if options.metrics_out:
        write_metrics_json(options.metrics_out, result.to_json())
    return result
