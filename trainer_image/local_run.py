"""``alpajob run``: plan (or read a plan) and train on this machine's devices.

One pass, top to bottom:

1. refuse what cannot work before any work is done: lock the checkpoint folder
   (:mod:`.checkpoint`; another run writing there is refused), ``--resume`` of a
   folder with no checkpoint, a metrics port in use;
2. open the data (:mod:`.data`: ``spec.data``, or synthetic batches that say so);
3. trace the step (its graph: a plan file's fingerprint must match it, and MFU reads
   its FLOPs) and plan for the local devices (1 node x K devices of the manifest's
   preset, ``cpu`` on CPU), or read ``--plan``; hand the plan to ``on_plan``;
4. build the runner (:mod:`.runners`: the plan's pipeline, or for ``--method serial``
   the single-device reference every parallel run must equal); on forced CPU devices
   an ``auto`` plan is timed against that one-device step and the faster kept
   (:mod:`.device_trial`);
5. restore the newest intact checkpoint with ``--resume`` (parameters, optimizer state
   and the loader's position; a damaged one is set aside and the one before used);
6. train ``steps`` steps, evaluating every ``evalEvery`` (forward only, the same eval
   batches each time), timing every ``stage_times_every``-th step per stage (timing
   costs a step: :mod:`.runtime.driver`), checkpointing every ``checkpoint_every``
   steps and at the end (in the background unless told otherwise), and reporting each
   step's :class:`~alpajob.api.progress.Progress` (Prometheus, ``on_step``), with
   tokens/s, MFU (:mod:`.throughput`) and goodput (:mod:`.goodput`); with ``trace``
   the last step is timed and written beside the plan's prediction (:mod:`.tracing`).
   SIGTERM or Ctrl-C
   stops the loop after the step in progress (:mod:`.stopping`): a checkpoint of that
   step is saved and waited for, and the result says which signal stopped it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from alpajob.api.catalog import GPU_PRODUCT_PRESETS
from alpajob.api.errors import PlanFormatError
from alpajob.api.options import TrainOptions
from alpajob.api.plan import Plan, read_plan
from alpajob.api.progress import Progress, TrainerPhase
from alpajob.api.resource import AlpaJob
from alpajob.api.spec import Method
from alpajob.planner.cost.cluster import ClusterSpec, cluster_from_preset
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.trainer_image.checkpoint.local import LocalCheckpoints
from alpajob.trainer_image.checkpoint.lock import CheckpointError
from alpajob.trainer_image.checkpoint.names import targets
from alpajob.trainer_image.compile_cache import compile_cache
from alpajob.trainer_image.data.feed import SYNTHETIC, open_feed
from alpajob.trainer_image.device_trial import TrialResult, trial
from alpajob.trainer_image.entrypoint import load_model
from alpajob.trainer_image.forced_count import host_cores, shared_host_cluster
from alpajob.trainer_image.goodput import Badput, Goodput
from alpajob.trainer_image.metrics import TrainingMetrics, write_metrics_json
from alpajob.trainer_image.plan_cache import PlanCache, machine_id, trial_key
from alpajob.trainer_image.planning import job_graph, plan_or_cached
from alpajob.trainer_image.precision import LossScale
from alpajob.trainer_image.runners import PipelineRunner, SerialRunner
from alpajob.trainer_image.runtime.build import build_pipeline
from alpajob.trainer_image.runtime.executor import StageTimes
from alpajob.trainer_image.runtime.meshes import DeviceError, local_devices
from alpajob.trainer_image.step import training_optimizer
from alpajob.trainer_image.stopping import StopRequest
from alpajob.trainer_image.throughput import Throughput
from alpajob.trainer_image.tracing import write_one_device_trace, write_trace
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
    data_read_bytes: int = 0  # bytes of token ids read (training and eval)
    source_rows: dict[str, int] = field(default_factory=dict)  # rows of the steps run, per training source
    skipped_steps: int = 0  # float16: steps skipped for overflowing gradients (loss scaling)
    throughput: Throughput | None = None  # model FLOPs and tokens per step, the devices' peak
    goodput: dict[str, float] = field(default_factory=dict)  # Goodput.summary at the end
    params: dict[str, np.ndarray] = field(default_factory=dict)
    last_checkpoint_step: int | None = None  # the newest complete checkpoint at the end
    stopped: str | None = None  # the signal that stopped the run early (SIGTERM, SIGINT)
    device_trial: TrialResult | None = None  # the plan timed against one device, if it was

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
            "data_read_bytes": self.data_read_bytes,
            "source_rows": self.source_rows,
            "skipped_steps": self.skipped_steps,
            "model_flops_per_step": self.throughput.flops_per_step if self.throughput else None,
            "tokens_per_step": self.throughput.tokens_per_step if self.throughput else None,
            "peak_flops": self.throughput.peak_flops if self.throughput else None,
            "goodput": self.goodput,
            "last_checkpoint_step": self.last_checkpoint_step,
            "stopped": self.stopped,
            "eval": [{"step": step, "loss": loss} for step, loss in self.evals],
        }
        if self.device_trial is not None:
            doc["device_trial"] = {"plan_seconds": self.device_trial.plan_seconds,
                                   "one_device_seconds": self.device_trial.one_device_seconds,
                                   "one_device_wins": self.device_trial.one_device_wins}
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
    """One node with this machine's devices, of the job's preset (``cpu`` on CPU; for a
    job across GPU types, the type of this machine's GPUs where it is one of the job's,
    else the first pool's)."""
    pools = job.spec.cluster.pools
    if devices[0].platform == "cpu":
        preset: str = "cpu"
    elif pools is not None:
        here = GPU_PRODUCT_PRESETS.get(str(devices[0].device_kind).replace(" ", "-"))
        preset = (here if here in {p.gpu for p in pools} else pools[0].gpu).value
    else:
        preset = job.spec.cluster.preset() or "cpu"
    cluster = cluster_from_preset(preset, 1, len(devices))
    if not cluster.shared_host:
        return cluster
    # every forced device slows the others, used or not (forced_count.py)
    return shared_host_cluster(preset, len(devices), len(jax.devices(devices[0].platform)),
                               host_cores())


def check_plan(plan: Plan, graph: OpGraph, devices: list[Any], source: str) -> None:
    """Refuse a plan made for another model, or for more devices than this run has."""
    if plan.model.fingerprint != graph.fingerprint():
        raise PlanFormatError(
            f"{source}: made for model {plan.model.name} (fingerprint {plan.model.fingerprint}, "
            f"batch {plan.global_batch_size}) but this manifest traces to "
            f"{graph.fingerprint()} ({graph.name}, batch {graph.batch_size}); re-run "
            "`alpajob plan` on this manifest"
        )
    if plan.devices_offered() > len(devices):
        raise DeviceError(
            f"{source}: needs {plan.devices_offered()} devices ({plan.cluster_label()}) but "
            f"this run has {len(devices)}; pass "
            f"--devices {plan.devices_offered()} or re-plan for this machine"
        )


def _device_trial(runner: Any, one: Any, first_batch: Callable[[], list[np.ndarray]], cache_dir: str | None,
                  plan_key: str | None, num_devices: int, say: Callable[[str], None]) -> TrialResult:
    """The plan timed against one device (:mod:`.device_trial`), or that verdict read
    from the plan cache, where this plan on this machine was timed before
    (:func:`~.plan_cache.trial_key`)."""
    cache = key = None
    if cache_dir is not None and plan_key is not None:
        cache, key = PlanCache(Path(cache_dir), say), trial_key(plan_key, machine_id(num_devices))
        verdict = cache.get_trial(key)
        if verdict is not None:
            timed = TrialResult(*verdict)
            say(f"device trial: cached; {timed.line()}")
            return timed
    say("timing the plan against one device")
    timed = trial(runner, one, first_batch())
    if cache is not None and key is not None:
        cache.put_trial(key, timed.plan_seconds, timed.one_device_seconds)
    say(timed.line())
    return timed


def _prepare(job: AlpaJob, model: ModelDef, options: TrainOptions, say: Callable[[str], None],
             on_plan: Callable[[Plan], None] | None,
             first_batch: Callable[[], list[np.ndarray]],
             ) -> tuple[Any, Plan | None, Throughput, TrialResult | None]:
    """Trace, plan (or read the plan file), and build the runner (module docstring 3-4);
    on forced CPU devices an auto plan is timed against one device (:mod:`.device_trial`)."""
    training = job.spec.training
    devices = local_devices(options.devices)
    say(f"tracing {model.name}")
    graph = job_graph(job)
    cluster = local_cluster(job, devices)
    plan = None
    plan_key: str | None = None  # its plan-cache key, when the plan cache is on
    timed: TrialResult | None = None
    if not options.serial:
        if options.plan_file:
            plan = read_plan(options.plan_file)
            check_plan(plan, graph, devices, options.plan_file)
        else:
            say(f"planning for {len(devices)} local {devices[0].platform} devices")
            planned = plan_or_cached(job, options.planning, cluster=cluster, graph=graph, warn=say)
            plan, plan_key = planned.plan, planned.key
            if planned.cached:
                say(f"plan: cached ({plan.content_hash()}); --no-plan-cache plans again")
        if on_plan:
            on_plan(plan)
    seed = options.seed if options.seed is not None else training.seed
    say("initialising parameters")
    params = model.init(jax.random.key(seed))
    optimizer = training_optimizer(training)
    scale = LossScale.for_dtype(training.dtype)
    runner: Any
    if plan is None:
        runner = SerialRunner(model, optimizer, params, devices[0], training.global_batch_size, scale)
    else:
        say("building stages")
        runner = PipelineRunner(build_pipeline(plan, model.loss, params, model.batch_shapes, optimizer,
                                               devices, wait=options.exact_stage_times), scale)
        method = options.planning.method or job.spec.parallelism.method
        if (cluster.shared_host and method is Method.AUTO and not options.plan_file
                and not options.keep_plan and scale is None and plan.devices_offered() > 1):
            one = SerialRunner(model, optimizer, params, devices[0], training.global_batch_size, scale)
            timed = _device_trial(runner, one, first_batch, options.planning.cache_dir, plan_key,
                                  len(devices), say)
            if timed.one_device_wins:
                runner, plan = one, None
    tokens = model.batch_shapes(training.global_batch_size).get("input_ids")
    # One device of a shared host has the whole host's peak, not one forced device's share.
    device = local_cluster(job, devices[:1]).device if plan is None else cluster.device
    throughput = Throughput.of(graph, int(np.prod(tokens.shape)) if tokens is not None else None,
                               device, 1 if plan is None else plan.devices_offered(), training.dtype)
    return runner, plan, throughput, timed


def _checkpoints(job: AlpaJob, options: TrainOptions) -> LocalCheckpoints | None:
    """The run's checkpoint folder, locked (None without ``checkpoint_dir``); refuses
    ``--resume`` of a folder with no checkpoint before any work is done."""
    root = options.checkpoint_dir
    if not root:
        return None
    spec = job.spec.checkpoint
    keep_last = options.keep_last or (spec.keep_last if spec else 3)
    asynchronous = not options.sync_checkpoints and (spec.async_save if spec else True)
    checkpoints = LocalCheckpoints(root, keep_last, asynchronous)
    if options.resume is True and checkpoints.last is None:
        checkpoints.close()
        raise CheckpointError(f"--resume: {root} holds no checkpoint; give the folder a run saved to, "
                              "or --resume=auto to start fresh when there is none")
    return checkpoints


def run(
    job: AlpaJob,
    options: TrainOptions,
    on_step: Callable[[Progress], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    on_plan: Callable[[Plan], None] | None = None,
) -> RunResult:
    """Plan (or read the plan) and train (module docstring), compiling through JAX's
    persistent compilation cache in ``options.compile_cache_dir`` (:mod:`.compile_cache`).
    ``on_phase`` hears what the run is doing, ``on_plan`` gets the plan before training
    starts, ``on_step`` every step's :class:`~alpajob.api.progress.Progress`."""
    with compile_cache(options.compile_cache_dir, on_phase or (lambda _line: None)):
        return _run(job, options, on_step, on_phase, on_plan)


def _run(
    job: AlpaJob,
    options: TrainOptions,
    on_step: Callable[[Progress], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    on_plan: Callable[[Plan], None] | None = None,
) -> RunResult:
    """:func:`run` once the compilation cache is set."""
    say = on_phase or (lambda _what: None)
    books = Goodput()
    training = job.spec.training
    steps = options.steps if options.steps is not None else training.steps
    seed = options.seed if options.seed is not None else training.seed
    checkpoints = _checkpoints(job, options)
    metrics = TrainingMetrics(job.name)
    feed = None
    try:
        if options.metrics_port is not None:
            metrics.serve(options.metrics_port)
        say("reading data")
        model = load_model(job.spec.model, training.dtype)
        feed = open_feed(job, model, seed=seed, prefetch=options.prefetch)
        say(f"data: {feed.source}")
        with books.timing(Badput.PLANNING):
            runner, plan, throughput, device_trial = _prepare(job, model, options, say, on_plan,
                                                              lambda: feed.batch_at(0))
        if plan is not None:
            metrics.plan(plan)
        start = 0
        if checkpoints is not None and options.resume and checkpoints.last is not None:
            say(f"restoring step {checkpoints.last}")
            with books.timing(Badput.RESTORE):
                restored = checkpoints.newest(targets(runner.named_arrays()), say)
                if restored is not None:
                    runner.load(restored.arrays)
                    feed.restore(restored.run.get("data"))
                    start = restored.step
        result = RunResult(plan=plan, start_step=start, data=feed.source, throughput=throughput,
                           device_trial=device_trial)
        saved = start or None  # the step of the last checkpoint saved (complete or in flight)

        def save(done: int) -> None:
            nonlocal saved
            if checkpoints is None or saved == done:
                return
            with books.timing(Badput.CHECKPOINT):
                checkpoints.save(done, runner.named_arrays(), {
                    "model": model.name, "plan_hash": plan.content_hash() if plan else None,
                    "data": feed.state() if feed else None})
            saved = done

        evaluations = feed.eval_batches(training.eval_steps)  # none without spec.data.eval
        eval_loss: float | None = None
        done = start
        with StopRequest() as stop:
            every = options.checkpoint_every or (
                job.spec.checkpoint.interval_steps if job.spec.checkpoint else None)
            for step in range(start, steps):
                batch = feed.batch(step)
                done = step + 1
                began = time.perf_counter()
                timed = done % options.stage_times_every == 0 or bool(options.trace and done == steps)
                loss, stages = runner.step(batch, timed)
                seconds = time.perf_counter() - began
                result.losses.append(loss)
                result.step_seconds.append(seconds)
                if stages:
                    result.stage_times.append(stages)
                    result.stage_time_steps.append(done)
                if evaluations and (done % (training.eval_every or steps) == 0 or done == steps):
                    with books.timing(Badput.EVAL):
                        eval_loss = float(np.mean([runner.evaluate(b) for b in evaluations]))
                    result.evals.append((done, eval_loss))
                if (every and done % every == 0) or done == steps:
                    save(done)
                summary = books.summary(result.step_seconds, feed.wait_seconds)
                report = Progress(
                    phase=TrainerPhase.RUNNING, step=done, steps=steps, loss=loss, eval_loss=eval_loss,
                    data=feed.source, skipped_steps=runner.scale.skipped if runner.scale else None,
                    samples_per_second=training.global_batch_size / seconds,
                    tokens_per_second=throughput.tokens_per_second(seconds), mfu=throughput.mfu(seconds),
                    goodput=summary["goodput"],
                    last_checkpoint_step=checkpoints.poll() if checkpoints else None, updated=time.time())
                metrics.record(report, seconds, stages)
                metrics.books(summary)
                rows = feed.source_rows(step)
                for source, count in rows.items():
                    result.source_rows[source] = result.source_rows.get(source, 0) + count
                metrics.data({("all", "0"): feed.read_bytes - result.data_read_bytes}, rows)
                result.data_read_bytes = feed.read_bytes
                if on_step:
                    on_step(report)
                if stop.requested:
                    result.stopped = stop.requested
                    say(f"{stop.requested} after step {done}: stopping"
                        + (", saving a checkpoint first" if checkpoints else ""))
                    break
            if checkpoints is not None:
                if result.stopped:
                    save(done)
                with books.timing(Badput.CHECKPOINT):
                    result.last_checkpoint_step = checkpoints.finish()
        result.skipped_steps = runner.scale.skipped if runner.scale else 0
        result.data_wait_seconds = feed.wait_seconds
        result.goodput = books.summary(result.step_seconds, feed.wait_seconds)
        result.params = {name[len("params/"):]: np.asarray(value)
                         for name, value in runner.named_arrays().items() if name.startswith("params/")}
        if options.metrics_out:
            write_metrics_json(options.metrics_out, result.to_json())
        if options.trace and plan is not None and result.stage_times:
            write_trace(options.trace, plan, result.stage_times[-1], result.stage_time_steps[-1],
                        result.step_seconds[result.stage_time_steps[-1] - start - 1])
        elif options.trace and plan is None and result.step_seconds:
            reason = (device_trial.line() if device_trial is not None
                      else "the run trains on one device (--method serial)")
            write_one_device_trace(options.trace, start + len(result.step_seconds), result.step_seconds[-1], reason)
            say(f"trace: the last step on one device, no plan to set beside it ({reason})")
        if options.metrics_port is not None and options.metrics_linger and not result.stopped:
            say(f"serving the last metrics for {options.metrics_linger:g} s")
            time.sleep(options.metrics_linger)
        return result
    finally:
        metrics.close()
        if feed is not None:
            feed.close()
        if checkpoints is not None:
            checkpoints.close()
