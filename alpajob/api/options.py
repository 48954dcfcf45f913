"""What a caller asks of planning and training, beside the manifest: one typed object each.

The manifest says what to train; these say how this one invocation should go (cluster
overrides, a plan file, where to write metrics, how many steps). ``alpajob plan`` and
``alpajob run`` turn their flags into them (:func:`from_flags`, whose errors name the
flag); the Python API (``alpajob.plan(job, PlanOptions(...))``) and the benchmarks
build them directly. The planner and the trainer take them as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, ValidationError, model_validator
from pydantic.alias_generators import to_snake

from alpajob.api.catalog import DevicePreset
from alpajob.api.errors import ManifestError
from alpajob.api.limits import GPUS_PER_NODE, LOCAL_DEVICES, NODES, STEPS
from alpajob.api.pools import GpuPool
from alpajob.api.schema import INT64_MAX, Contract
from alpajob.api.spec import Method


class PlanOptions(Contract):
    """How to plan: overrides of ``spec.cluster`` and ``spec.parallelism``, solver knobs."""

    nodes: Annotated[int, NODES.validator] | None = Field(None, ge=1, description="override spec.cluster.nodes")
    gpus_per_node: Annotated[int, GPUS_PER_NODE.validator] | None = Field(
        None, ge=1, description="override spec.cluster.gpusPerNode")
    gpu: DevicePreset | None = Field(None, description="override the device preset")
    pools: tuple[GpuPool, ...] | None = Field(None, min_length=1, description=(
        "override spec.cluster.pools: each GPU type's usable nodes (the operator's count of "
        "the node pool; a type with none left out, one type left: planned alone)"))
    method: Method | None = Field(None, description="override spec.parallelism.method")
    ilp_time_limit: float | None = Field(None, gt=0, allow_inf_nan=False, description=(
        "seconds allowed to each ILP solve (None: spec.planner.ilpTimeLimitSeconds, 10 by default)"))
    plan_time_limit: float | None = Field(1800.0, gt=0, allow_inf_nan=False, description=(
        "seconds tracing and planning may take in all before they stop with an error (None: "
        "no limit; kept only in a process's main thread)"))
    baselines: bool = Field(False, description="also cost the baselines (never changes the plan)")
    all_devices: bool = Field(False, description=(
        "plan on every device offered, even on forced CPU devices where one is predicted "
        "faster (Alpa's rule; GPU clusters always use every device)"))
    calibration: str | None = Field(None, description=(
        "cost-model constants measured on a machine (a file `alpajob calibrate` wrote) "
        "instead of the preset's stored ones"))
    cache_dir: str | None = Field(None, description=(
        "keep plans in this folder and reuse one made for the same graph, cluster, search and "
        "planner (None: plan every time; the CLI's default is the user cache folder)"))


class PrepareOptions(Contract):
    """How ``alpajob data prepare`` writes token shards."""

    output: str = Field(min_length=1, description="the folder to write the shards and their index to")
    shard_size: int = Field(256 * 2**20, ge=1024, description="the most bytes of ids per shard")
    workers: int | None = Field(None, ge=1, le=512, description="tokenizing processes (default: one per core)")
    unit_bytes: int = Field(8 * 2**20, ge=1, description="bytes of input a process tokenizes at a time")


class TrainOptions(Contract):
    """How to train on this machine (``alpajob run``)."""

    steps: Annotated[int, STEPS.validator] | None = Field(None, ge=1, description=(
        "steps to train (default spec.training.steps)"))
    seed: int | None = Field(None, ge=0, le=INT64_MAX, description=(
        "parameter and data seed (default spec.training.seed)"))
    devices: Annotated[int, LOCAL_DEVICES.validator] | None = Field(None, ge=1, description=(
        "local devices to use (CPU: forced count)"))
    serial: bool = Field(False, description="the whole step on one device: the reference run")
    plan_file: str | None = Field(None, description="run this Plan document instead of planning")
    planning: PlanOptions = Field(default_factory=PlanOptions, description="how to plan, if planning")
    metrics_out: str | None = Field(None, description="write per-step metrics (JSON) here")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="serve Prometheus /metrics here")
    checkpoint_dir: str | None = Field(None, description="save sharded checkpoints here")
    checkpoint_every: Annotated[int, STEPS.validator] | None = Field(None, ge=1, description="checkpoint every N steps and at the end")
    keep_last: int | None = Field(None, ge=1, le=1000, description=(
        "complete checkpoints kept (default spec.checkpoint.keepLast, else 3)"))
    sync_checkpoints: bool = Field(False, description=(
        "training waits for every checkpoint save (default: saved in the background)"))
    resume: bool | Literal["auto"] = Field(False, description=(
        "continue from the newest checkpoint in checkpoint_dir (an error if there is none); "
        "'auto': if there is one, else start fresh"))
    exact_stage_times: bool = Field(False, description="timed steps wait for every instruction")
    stage_times_every: int = Field(10, ge=1, description="time every N-th step per stage")
    keep_plan: bool = Field(False, description=(
        "on forced CPU devices, run the plan without timing it against one device first"))
    trace: str | None = Field(None, description=(
        "write the last step's measured timeline beside the plan's predicted one here "
        "(Chrome trace JSON: open it in ui.perfetto.dev)"))
    metrics_linger: float = Field(0.0, ge=0, description=(
        "seconds /metrics stays up after the last step, for the final scrape"))
    prefetch: int = Field(2, ge=0, le=64, description="batches a loader thread keeps ready (0: none)")
    compile_cache_dir: str | None = Field(None, description=(
        "keep XLA's compiled executables in this folder and reuse them in a later run (JAX's "
        "persistent compilation cache; None: compile every time; the CLI's default is the "
        "user cache folder)"))

    @model_validator(mode="after")
    def _consistent(self) -> TrainOptions:
        if self.plan_file and (self.serial or self.planning.method is not None):
            raise ValueError("method: a plan file already fixes the method; pass one of the two")
        if self.trace and self.serial:
            raise ValueError("trace: a serial run has no pipeline stages to trace; drop one of "
                             "--trace and --method serial")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume: needs a checkpoint directory to resume from (checkpoint_dir, --checkpoint-dir)")
        for name in ("checkpoint_every", "keep_last", "sync_checkpoints"):
            if getattr(self, name) and not self.checkpoint_dir:
                raise ValueError(f"{name}: only checkpoints read it, and without a checkpoint directory "
                                 "(checkpoint_dir, --checkpoint-dir) nothing is saved; give one or drop it")
        planless = "a serial run" if self.serial else "a plan file" if self.plan_file else None
        given = {"keep_plan": self.keep_plan, "exact_stage_times": self.exact_stage_times and self.serial,
                 "calibration": self.planning.calibration, "all_devices": self.planning.all_devices}
        for name, value in given.items():
            if value and planless:
                what = "has no stages to time" if name == "exact_stage_times" else "is not planned here"
                raise ValueError(f"{name}: {planless} {what}, so it would be ignored; drop it")
        return self


Options = TypeVar("Options", PlanOptions, TrainOptions, PrepareOptions)


def flag_name(field: str) -> str:
    """``gpus_per_node`` (or ``gpusPerNode``) -> ``--gpus-per-node``."""
    return "--" + to_snake(field).replace("_", "-")


def field_name(field: str) -> str:
    """``gpusPerNode`` -> ``gpus_per_node``: how the Python API names an option."""
    return to_snake(field)


def options_from(model: type[Options], values: Mapping[str, Any],
                 name: Callable[[str], str] = field_name) -> Options:
    """Options from ``values`` (None: not given); an invalid one is a
    :class:`ManifestError` whose field is ``name(option)``."""
    try:
        return model.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as error:
        first = error.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        option, _, rest = message.partition(": ")
        if not first["loc"] and rest:  # a cross-field rule names its option itself
            raise ManifestError(name(option), rest) from None
        option = str(first["loc"][-1]) if first["loc"] else "options"
        raise ManifestError(name(option), message) from None


def from_flags(model: type[Options], values: Mapping[str, Any]) -> Options:
    """Options from command-line ``values``; an invalid one is an error naming its flag."""
    return options_from(model, values, flag_name)
