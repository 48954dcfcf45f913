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
import numpy as np

from alpajob.planner.cluster import ClusterSpec, cluster_from_preset
from alpajob.planner.errors import AlpaJobError, PlanFormatError
from alpajob.planner.extract import (
    extract_model,
    init_optimizer_state,
    make_optimizer,
    make_train_step,
)
from alpajob.planner.graph import OpGraph
from alpajob.planner.manifest import AlpaJobManifest
from alpajob.planner.plan import Plan, read_plan
from alpajob.planner.planning import PlanOptions, make_plan
from alpajob.trainer import checkpoint
from alpajob.trainer.entrypoint import load_model
from alpajob.trainer.metrics import TrainingMetrics, write_metrics_json
from alpajob.trainer.runtime.build import build_pipeline
from alpajob.trainer.runtime.driver import PipelineExecutor
from alpajob.trainer.runtime.executor import StageTimes
from alpajob.trainer.runtime.meshes import DeviceError, devices_needed, local_devices
from alpajob.trainer.zoo import ModelDef
from alpajob.trainer.zoo.model import synthetic_batch


@dataclass(frozen=True)
class RunOptions:
    """What ``alpajob run`` was asked to do."""

    steps: int
    seed: int = 0
    devices: int | None = None
    serial: bool = False
    plan_path: str | None = None
    plan_options: PlanOptions | None = None
    metrics_out: str | None = None
    metrics_port: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    exact_stage_times: bool = False  # timed steps wait for every instruction (runtime.driver.Stopwatch)
    stage_times_every: int = 10  # time every N-th step per stage (timing costs a step: runtime.driver)


@dataclass
class RunResult:
    """What the run did: per-step losses and wall times, the plan, per-stage times."""

    plan: Plan | None
    start_step: int
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    stage_times: list[tuple[StageTimes, ...]] = field(default_factory=list)
    stage_time_steps: list[int] = field(default_factory=list)  # the step of each stage_times entry
    params: dict[str, np.ndarray] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``--metrics-out`` document."""
        doc: dict[str, Any] = {
            "start_step": self.start_step,
            "losses": self.losses,
            "step_seconds": self.step_seconds,
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


def local_cluster(manifest: AlpaJobManifest, devices: list[Any]) -> ClusterSpec:
    """One node with this machine's devices, of the manifest's preset (``cpu`` on CPU)."""
    preset = "cpu" if devices[0].platform == "cpu" else (manifest.spec.cluster.preset() or "cpu")
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

    def __init__(self, model: ModelDef, optimizer: Any, params: Any, device: Any, batch_size: int) -> None:
        self._batch_def = jax.tree.structure(model.batch_shapes(batch_size))
        self.params = jax.device_put(params, device)
        self.opt_state = jax.jit(lambda p: init_optimizer_state(optimizer, p))(self.params)
        self._step = jax.jit(make_train_step(model.loss, optimizer), donate_argnums=(0, 1))
        self.device = device

    def step(self, batch: list[np.ndarray], timed: bool) -> tuple[float, tuple[StageTimes, ...]]:
        tree = jax.tree.unflatten(self._batch_def, batch)
        loss, _, self.params, self.opt_state = self._step(self.params, self.opt_state, tree)
        return float(loss), ()

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

    def __init__(self, executor: PipelineExecutor) -> None:
        self.executor = executor

    def step(self, batch: list[np.ndarray], timed: bool) -> tuple[float, tuple[StageTimes, ...]]:
        result = self.executor.step(batch, timed)
        return result.loss, result.stages

    def named_arrays(self) -> dict[str, jax.Array]:
        out: dict[str, jax.Array] = {}
        for stage in self.executor.stages:
            out.update(checkpoint.stage_arrays(stage))
        return out

    def restore(self, root: str, step: int) -> None:
        for stage in self.executor.stages:
            checkpoint.restore_stage(root, step, stage)


def run(
    manifest: AlpaJobManifest,
    options: RunOptions,
    on_step: Callable[[int, float, float], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> RunResult:
    """Plan (or read the plan) and train; see the module docstring."""
    say = on_phase or (lambda _what: None)
    if options.stage_times_every < 1:
        raise AlpaJobError(f"--stage-times-every must be at least 1 (1 times every step), "
                           f"got {options.stage_times_every}")
    training = manifest.spec.training
    devices = local_devices(options.devices)
    model = load_model(manifest.spec.model, training.dtype)
    optimizer = make_optimizer(training.optimizer, training.learning_rate)
    plan = None
    if not options.serial:
        say(f"tracing {model.name}")
        graph = extract_model(model, training.global_batch_size, optimizer=training.optimizer,
                              learning_rate=training.learning_rate)
        if options.plan_path:
            plan = read_plan(options.plan_path)
            check_plan(plan, graph, devices, options.plan_path)
        else:
            say(f"planning for {len(devices)} local {devices[0].platform} devices")
            plan_options = options.plan_options or PlanOptions()
            plan = make_plan(graph, local_cluster(manifest, devices), plan_options).plan
    say("initialising parameters")
    params = model.init(jax.random.key(options.seed))
    if plan is None:
        runner: Any = _Serial(model, optimizer, params, devices[0], training.global_batch_size)
    else:
        say("building stages")
        runner = _Pipelined(build_pipeline(plan, model.loss, params, model.batch_shapes, optimizer, devices,
                                              wait=options.exact_stage_times))
    del params

    start = 0
    if options.resume:
        if not options.checkpoint_dir:
            raise AlpaJobError("--resume needs --checkpoint-dir (where the checkpoints are)")
        latest = checkpoint.latest_step(options.checkpoint_dir)
        if latest is not None:
            say(f"restoring step {latest}")
            runner.restore(options.checkpoint_dir, latest)
            start = latest
    metrics = TrainingMetrics(manifest.metadata.name, plan.predicted_step_seconds if plan else None)
    if options.metrics_port is not None:
        metrics.serve(options.metrics_port)
    result = RunResult(plan=plan, start_step=start)
    meta = {"model": model.name, "plan_hash": plan.content_hash() if plan else None}
    try:
        for step in range(start, options.steps):
            batch = jax.tree.leaves(synthetic_batch(model, training.global_batch_size, seed=options.seed + step))
            done = step + 1
            began = time.perf_counter()
            loss, stages = runner.step(batch, done % options.stage_times_every == 0)
            seconds = time.perf_counter() - began
            result.losses.append(loss)
            result.step_seconds.append(seconds)
            if stages:
                result.stage_times.append(stages)
                result.stage_time_steps.append(done)
            metrics.record(done, loss, seconds, training.global_batch_size, stages)
            if on_step:
                on_step(done, loss, seconds)
            every = options.checkpoint_every
            if options.checkpoint_dir and ((every and done % every == 0) or done == options.steps):
                checkpoint.save(options.checkpoint_dir, done, runner.named_arrays(), meta)
                metrics.checkpoint.labels(metrics.job).set(done)
    finally:
        metrics.close()
    result.params = {
        name[len("params/"):]: np.asarray(value)
        for name, value in runner.named_arrays().items() if name.startswith("params/")
    }
    if options.metrics_out:
        write_metrics_json(options.metrics_out, result.to_json())
    return result
