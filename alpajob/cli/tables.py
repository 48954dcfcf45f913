"""How the CLI shows a plan, its schedule, the baselines and a training run (rich tables)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from alpajob.api.plan import Plan, StagePlan
from alpajob.api.progress import Progress
from alpajob.api.spec import Schedule
from alpajob.api.wording import counted
from alpajob.planner.inter_op.schedules import Direction, instruction_list

GIB = 1024**3


def _mesh(shape: Sequence[int]) -> str:
    return "x".join(str(v) for v in shape)


def flops(pflops: float) -> str:
    """PFLOP/s, or TFLOP/s / GFLOP/s for small (CPU) figures."""
    if pflops >= 0.1:
        return f"{pflops:.3f} PFLOP/s"
    if pflops >= 1e-4:
        return f"{pflops * 1e3:.3f} TFLOP/s"
    return f"{pflops * 1e6:.3f} GFLOP/s"


def _remat(stage: StagePlan) -> str:
    """How the stage recomputes its forward: "-", "layers", or "N parts"."""
    if not stage.rematerialize:
        return "-"
    if stage.param_parts:
        return f"{max(stage.param_parts.values()) + 1} parts"
    return "layers"


def plan_table(plan: Plan) -> Table:
    """The plan as a table: one row per stage."""
    count = plan.model.num_parameters
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
    offered, used = plan.devices_offered(), plan.devices_used()
    pools = plan.pools
    where = plan.cluster_label() + (
        f" (uses {used} of {offered} devices)" if used < offered and not pools else "")
    title = (
        f"{plan.model.name}: {size} params on {where}"
        f", {counted(plan.num_micro_batches, 'micro-batch', 'micro-batches')}, {plan.schedule}"
    )
    table = Table(title=title, caption="mesh: logical mesh; t/µbatch: forward+backward per "
                  "micro-batch; update: per step; remat: recomputed by whole layers or in "
                  "block parts; WUS: weight-update-sharded params")
    columns = ["stage", "layers", *(["gpu"] if pools else []), "submesh", "mesh", "t/µbatch", "update", "memory",
               "remat", "WUS"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("layers", "gpu") else "right")
    for stage in plan.stages:
        table.add_row(
            str(stage.index),
            f"[{stage.layers[0]}, {stage.layers[1]})",
            *([str(pools[stage.pool or 0]["preset"])] if pools else []),
            _mesh(stage.submesh_shape),
            _mesh(stage.logical_mesh_shape),
            f"{stage.predicted_seconds * 1e3:.2f} ms",
            f"{stage.update_seconds * 1e3:.2f} ms",
            f"{stage.peak_memory_bytes / GIB:.2f} GiB",
            _remat(stage),
            f"{len(stage.weight_update_sharded)}/{len(stage.param_shardings)}",
        )
    return table


def plan_summary(plan: Plan) -> str:
    """The plan's predictions and how it was found, in one line."""
    stats = plan.solver
    return (
        f"predicted step time {plan.predicted_step_seconds:.4g} s, "
        f"{flops(plan.predicted_pflops)}, bubble {plan.bubble_fraction:.1%}; "
        f"planned in {stats.planning_seconds:.1f} s ({stats.ilp_solves} ILPs, "
        f"{stats.ilp_seconds:.1f} s; DP {stats.dp_seconds:.2f} s); plan hash {plan.content_hash()}"
    )


#: Up to this many micro-batches the schedule is printed instruction by instruction.
FULL_SCHEDULE_MICRO_BATCHES = 8


def _name(instruction: tuple[Direction, int]) -> str:
    direction, j = instruction
    return f"{'F' if direction is Direction.FORWARD else 'B'}{j}"


def _pairs_at(program: Sequence[tuple[Direction, int]], k: int) -> int:
    """How many forward/backward pairs, both micro-batches counting up, start at ``k``."""
    pairs = 0
    while (k + 2 * pairs + 1 < len(program)
           and program[k + 2 * pairs][0] is Direction.FORWARD
           and program[k + 2 * pairs + 1][0] is Direction.BACKWARD
           and program[k + 2 * pairs][1] == program[k][1] + pairs
           and program[k + 2 * pairs + 1][1] == program[k + 1][1] + pairs):
        pairs += 1
    return pairs


def summarise_program(program: Sequence[tuple[Direction, int]]) -> str:
    """A stage's instruction list in a few words: runs of forwards or backwards of
    consecutive micro-batches as ``F0…F6``, a steady one-forward-one-backward phase
    as ``F7/B0 … F255/B248 (249 pairs)``. 1F1B on stage 0 of 8 with 256
    micro-batches: ``F0…F6  F7/B0 … F255/B248 (249 pairs)  B249…B255``."""
    words, k = [], 0
    while k < len(program):
        pairs = _pairs_at(program, k)
        if pairs >= 3:
            last = k + 2 * pairs - 2
            words.append(f"{_name(program[k])}/{_name(program[k + 1])} … "
                         f"{_name(program[last])}/{_name(program[last + 1])} ({pairs} pairs)")
            k += 2 * pairs
            continue
        run = 1
        while (k + run < len(program) and program[k + run][0] is program[k][0]
               and program[k + run][1] == program[k][1] + run
               and _pairs_at(program, k + run) < 3):
            run += 1
        if run >= 3:
            words.append(f"{_name(program[k])}…{_name(program[k + run - 1])}")
        else:
            words.extend(_name(x) for x in program[k:k + run])
        k += run
    return "  ".join(words)


def schedule_table(plan: Plan) -> Table:
    """Each stage's instruction list, in the order the stage runs it: in full up to
    :data:`FULL_SCHEDULE_MICRO_BATCHES` micro-batches, else summarised
    (:func:`summarise_program`), so 64 stages x 64 micro-batches stay 64 short rows."""
    p, m = len(plan.stages), plan.num_micro_batches
    full = m <= FULL_SCHEDULE_MICRO_BATCHES
    table = Table(title=f"{plan.schedule} schedule, {counted(m, 'micro-batch', 'micro-batches')}",
                  caption="Fj / Bj: forward / backward of micro-batch j; U: the optimizer update"
                          + ("" if full else "; Fi…Fj: forwards i to j; Fi/Bj: a forward then "
                             "a backward, repeated with both counting up"))
    table.add_column("stage", justify="right")
    table.add_column("instructions")
    for i in range(p):
        program = instruction_list(Schedule(plan.schedule), i, p, m)
        text = " ".join(_name(x) for x in program) if full else summarise_program(program)
        table.add_row(str(i), f"{text}  U" if not full else f"{text} U")
    return table


def baseline_table(plan: Plan) -> Table:
    """Each baseline's predicted step time and our plan's speed-up over it."""
    table = Table(title="baselines (same cost model, same cluster)")
    for column in ("plan", "step time", "throughput", "ours is faster by"):
        table.add_column(column, justify="right")
    ours = plan.predicted_step_seconds
    table.add_row("alpajob", f"{ours:.4g} s", flops(plan.predicted_pflops), "-")
    for name, seconds in (plan.baselines or {}).items():
        if seconds is None:
            table.add_row(name, "does not fit", "-", "-")
        else:
            pflops = plan.model.flops_per_step / seconds / 1e15
            table.add_row(name, f"{seconds:.4g} s", flops(pflops), f"{seconds / ours:.2f}x")
    return table


def progress_line(report: Progress, steps: bool = True) -> str:
    """A trainer's report in one line: ``step 4/20  loss 5.5512  812.5 samples/s``."""
    parts = [f"step {report.step}/{report.steps}"] if steps else []
    if report.loss is not None:
        parts.append(f"loss {report.loss:.4f}")
    if report.eval_loss is not None:
        parts.append(f"eval {report.eval_loss:.4f} (ppl {math.exp(min(report.eval_loss, 50)):,.1f})")
    if report.samples_per_second is not None:
        parts.append(f"{report.samples_per_second:,.1f} samples/s")
    return "  ".join(parts)


def run_summary(result: Any, batch: int, exact: bool = False) -> Table:
    """Steps, loss, measured against predicted step time, and per-stage time split
    (``exact``: the run waited for every instruction, so the split is exact)."""
    table = Table(title="training summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    steps = len(result.losses)
    table.add_row("data", result.data)
    table.add_row("steps", f"{result.start_step + 1}..{result.start_step + steps}")
    if steps:
        table.add_row("loss (first, last)", f"{result.losses[0]:.5f}, {result.losses[-1]:.5f}")
        if result.evals:
            first, last = result.evals[0], result.evals[-1]
            table.add_row("eval loss (step: first, last)",
                          f"{first[0]}: {first[1]:.5f}, {last[0]}: {last[1]:.5f}")
        measured = result.median_step_seconds()
        table.add_row("step time (median, after the first)", f"{measured:.4g} s")
        table.add_row("samples/s", f"{batch / measured:,.1f}")
        if result.throughput is not None:
            tokens, mfu = result.throughput.tokens_per_second(measured), result.throughput.mfu(measured)
            if tokens is not None:
                table.add_row("tokens/s", f"{tokens:,.0f}")
            if mfu is not None:
                table.add_row("MFU (model FLOPs / devices' peak)", f"{mfu:.1%}")
        if result.goodput:
            books = result.goodput
            table.add_row("goodput (productive / wall time)", f"{books['goodput']:.1%} of {books['wall_seconds']:.1f} s")
            badput = [f"{name} {books[f'{name}_seconds']:.1f}" for name in
                      ("planning", "compile", "data", "eval", "checkpoint", "restore", "other")
                      if books.get(f"{name}_seconds", 0) >= 0.05]
            table.add_row("badput (s)", ", ".join(badput) or "-")
        if result.plan is not None:
            predicted = result.plan.predicted_step_seconds
            table.add_row("predicted step time", f"{predicted:.4g} s")
            table.add_row("measured / predicted", f"{measured / predicted:.2f}")
        if result.stage_times:
            first = result.start_step + 1  # compiles
            timed = list(zip(result.stage_time_steps, result.stage_times, strict=True))
            recent = [t for step, t in timed if step != first] or result.stage_times
            for index in range(len(recent[0])):
                mean = [sum(getattr(t[index], k) for t in recent) / len(recent)
                        for k in ("compute", "idle", "communication")]
                table.add_row(f"stage {index} compute / idle / comm",
                              " / ".join(f"{v * 1e3:.1f} ms" for v in mean))
            table.caption = f"stage times: mean of {counted(len(recent), 'timed step')} (--stage-times-every)"
            if not exact:
                table.caption += ("; from completion stamps, rough on CPU devices, exact with "
                                  "--exact-stage-times")
    return table
