"""What-if planning: one job planned on every option a user compares, from one trace.

The job's op graph depends on its model and global batch, not on the devices, so the
model is traced once (:func:`~alpajob.trainer_image.planning.job_graph`) and each
option (:class:`~alpajob.api.what_if.WhatIfOption`) is planned from that graph as
``alpajob plan --gpu P --nodes N --gpus-per-node G`` would plan it, through the same
plan cache: a rerun, or an option planned before by ``alpajob plan``, is read back.
An option no plan fits is a row that says so, with the memory one GPU would need.

The options share what their searches solve: a layer ILP an earlier option solved on
the same GPU type and logical mesh is not solved again
(:mod:`~alpajob.planner.inter_op.shared_solutions`; each plan stays the one it is
alone). The options the plan cache holds are read from it first, in this process;
with at least as many options left as cores they are planned side by side, a whole
search per worker process (:mod:`.what_if_pool`); with fewer, one after another, each
search on every core.

Each row's figures come from the plan's predictions: the step time; samples and
tokens per second (the global batch, and its token ids, over the step time); MFU (the
traced step's matrix FLOPs over the step time and the devices' peak for the training
dtype, as the trainer reports it: :mod:`.throughput`); the busiest GPU's peak memory;
GPU-hours for ``spec.training.steps`` steps; and, with prices, dollars per hour, per
10^9 tokens and for the whole job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Sequence

from alpajob.api.catalog import DEVICE_MEMORY_BYTES
from alpajob.api.errors import InfeasibleError
from alpajob.api.options import PlanOptions
from alpajob.api.plan import Plan, StagePlan
from alpajob.api.resource import AlpaJob
from alpajob.api.what_if import Choice, Prices, WhatIfMix, WhatIfOption, WhatIfRow
from alpajob.planner.cost.cluster import ClusterSpec, cluster_from_preset
from alpajob.planner.graph.opgraph import OpGraph
from alpajob.planner.inter_op.shared_solutions import SharedSolutions
from alpajob.planner.plan.make import search_options
from alpajob.trainer_image.planning import (
    NotCached,
    job_graph,
    plan_or_cached,
    pools_plan_or_cached,
)
from alpajob.trainer_image.stopping import Deadline
from alpajob.trainer_image.throughput import Throughput, model_flops
from alpajob.trainer_image.what_if_pool import side_by_side

#: ``(option, index, total)`` before each option is planned.
OptionProgress = Callable[[Choice, int, int], None]


def tokens_per_step(job: AlpaJob) -> int | None:
    """Token ids in one global batch (None for a model that reads none)."""
    from alpajob.trainer_image.entrypoint import load_model  # with JAX: not in a what-if worker

    training = job.spec.training
    shape = load_model(job.spec.model, training.dtype).batch_shapes(training.global_batch_size).get("input_ids")
    return None if shape is None else math.prod(int(size) for size in shape.shape)


@dataclasses.dataclass(frozen=True)
class WhatIfState:
    """What every option of a what-if shares: the job, the planning options, the traced
    graph, the token ids per step and the prices (sent once to each worker process)."""

    job: AlpaJob
    options: PlanOptions
    graph: OpGraph
    tokens: int | None
    prices: Prices | None


def what_if(job: AlpaJob, options: PlanOptions, choices: Sequence[Choice], prices: Prices | None = None,
            progress: OptionProgress | None = None,
            warn: Callable[[str], None] = lambda _line: None,
            workers: int | None = None) -> list[WhatIfRow]:
    """One :class:`WhatIfRow` per option of ``choices``, in order (module docstring).
    ``options`` holds what every option shares (the cache, the time limits); its
    ``nodes``, ``gpus_per_node`` and ``gpu`` are each option's. The plan cache's
    options are read first; with at least as many options left as ``workers``
    (default: one per core) and two or more of them, those are planned side by side,
    each in one process (:mod:`.what_if_pool`); else one after another, each search on
    every core."""
    with Deadline(options.plan_time_limit, "--plan-time-limit", lambda: "tracing the model"):
        graph = job_graph(job, warn)
    state = WhatIfState(job, options, graph, tokens_per_step(job), prices)
    shared = SharedSolutions(graph)
    rows: dict[int, WhatIfRow] = {}
    for index, choice in enumerate(choices if options.cache_dir else ()):  # the cache's: no worker needed
        with contextlib.suppress(NotCached):
            rows[index] = option_row(state, choice, warn, shared, only_cached=True)
    left = [index for index in range(len(choices)) if index not in rows]
    workers = workers or os.cpu_count() or 1
    if workers >= 2 and len(left) >= workers:
        def started(choice: Choice, done: int) -> None:
            if progress:
                progress(choice, len(rows) + done, len(choices))

        planned = side_by_side(option_row, state, [choices[index] for index in left], shared, workers,
                               started, warn)
        rows.update(zip(left, planned, strict=True))
    for index in left:
        if index not in rows:
            if progress:
                progress(choices[index], len(rows), len(choices))
            rows[index] = option_row(state, choices[index], warn, shared)
    return [rows[index] for index in range(len(choices))]


def option_row(state: WhatIfState, choice: Choice, warn: Callable[[str], None],
               shared: SharedSolutions, *, only_cached: bool = False) -> WhatIfRow:
    """The row of one option, planned (or read from the plan cache) with the solutions
    of the options before it (:mod:`~alpajob.planner.inter_op.shared_solutions`);
    ``only_cached``: from the plan cache or not at all (:class:`NotCached`)."""
    if isinstance(choice, WhatIfMix):
        return _mixed_row(state.job, state.options, state.graph, state.tokens, choice, state.prices, warn, shared,
                          only_cached)
    return _row(state.job, state.options, state.graph, state.tokens, choice, state.prices, warn, shared,
                only_cached)


def _mixed_row(job: AlpaJob, options: PlanOptions, graph: OpGraph, tokens: int | None, mix: WhatIfMix,
               prices: Prices | None, warn: Callable[[str], None], shared: SharedSolutions,
               only_cached: bool = False) -> WhatIfRow:
    """A mixed option's row: the job planned across its GPU types
    (:func:`~alpajob.planner.plan.pools.plan_pools`, through the plan cache), every GPU
    of the option paid for, the busiest GPU judged against its own type's memory."""
    clusters = tuple(cluster_from_preset(p.gpu, p.nodes, p.gpus_per_node) for p in mix.parts)
    search = search_options(job.spec.parallelism, options, job.spec.planner)
    try:
        with Deadline(options.plan_time_limit, "--plan-time-limit", lambda: f"planning {mix.label}"):
            planned = pools_plan_or_cached(graph, clusters, search, options, warn=warn, shared=shared,
                                           only_cached=only_cached)
    except InfeasibleError as error:
        return WhatIfRow(mix, fits=False, memory_bytes=max(c.device.memory_bytes for c in clusters),
                         required_bytes=error.required_bytes)
    plan, cached = planned.plan, planned.cached
    peak = sum(c.device.peak(job.spec.training.dtype) * c.num_devices for c in clusters)
    throughput = Throughput(model_flops(graph), tokens, peak)

    def pool(stage: StagePlan) -> ClusterSpec:
        return clusters[stage.pool or 0]

    busiest = max(plan.stages, key=lambda s: s.peak_memory_bytes / pool(s).device.memory_bytes)
    used = {stage.pool or 0 for stage in plan.stages}
    layout = "; ".join(f"layers {s.layers[0]}-{s.layers[1] - 1} on {s.submesh_shape[0]}x{s.submesh_shape[1]} "
                       f"{pool(s).preset}" for s in plan.stages) + "".join(
        f"; {c.preset} unused" for p, c in enumerate(clusters) if p not in used)
    per_gpu_hour = sum(prices.of(p.gpu) * p.gpus for p in mix.parts) / mix.gpus if prices else None
    return _fitting_row(job, mix, plan, throughput, busiest.peak_memory_bytes, pool(busiest).device.memory_bytes,
                        cached, per_gpu_hour, layout)


def _row(job: AlpaJob, options: PlanOptions, graph: OpGraph, tokens: int | None, choice: WhatIfOption,
         prices: Prices | None, warn: Callable[[str], None], shared: SharedSolutions,
         only_cached: bool = False) -> WhatIfRow:
    chosen = options.model_copy(update={"gpu": choice.gpu, "nodes": choice.nodes,
                                        "gpus_per_node": choice.gpus_per_node})
    memory = DEVICE_MEMORY_BYTES[choice.gpu]
    try:
        planned = plan_or_cached(job, chosen, graph=graph, warn=warn, shared=shared, only_cached=only_cached)
    except InfeasibleError as error:
        return WhatIfRow(choice, fits=False, memory_bytes=memory, required_bytes=error.required_bytes)
    return figures(job, graph, tokens, choice, planned.plan, prices, memory, planned.cached)


def figures(job: AlpaJob, graph: OpGraph, tokens: int | None, choice: WhatIfOption, plan: Plan,
            prices: Prices | None, memory: int, cached: bool = False) -> WhatIfRow:
    """The row of a fitting ``plan`` of ``choice`` (module docstring)."""
    device = cluster_from_preset(choice.gpu, choice.nodes, choice.gpus_per_node).device
    throughput = Throughput.of(graph, tokens, device, choice.gpus, job.spec.training.dtype)
    return _fitting_row(job, choice, plan, throughput, max(stage.peak_memory_bytes for stage in plan.stages),
                        memory, cached, prices.of(choice.gpu) if prices else None)


def _fitting_row(job: AlpaJob, choice: Choice, plan: Plan, throughput: Throughput, peak_memory: float, memory: int,
                 cached: bool, per_gpu_hour: float | None, layout: str | None = None) -> WhatIfRow:
    """The figures of a fitting ``plan`` of ``choice``; the dollar fields at
    ``per_gpu_hour`` (a mix: its GPUs' average price) where given."""
    training = job.spec.training
    step = plan.predicted_step_seconds
    gpu_hours = training.steps * step * choice.gpus / 3600.0
    row = WhatIfRow(
        choice, fits=True, step_seconds=step, samples_per_second=training.global_batch_size / step,
        tokens_per_second=throughput.tokens_per_second(step), mfu=throughput.mfu(step),
        peak_memory_bytes=peak_memory, memory_bytes=memory, gpu_hours=gpu_hours, plan_hash=plan.content_hash(),
        cached=cached, layout=layout)
    if per_gpu_hour is None:
        return row
    per_hour = per_gpu_hour * choice.gpus
    per_tokens = per_hour / (row.tokens_per_second * 3600.0) * 1e9 if row.tokens_per_second else None
    return dataclasses.replace(row, dollars_per_hour=per_hour, dollars_per_billion_tokens=per_tokens,
                               dollars=gpu_hours * per_gpu_hour)
