"""One stage's part of a training step: its instruction list, run in order.

A stage of the Ray runtime (:mod:`alpajob.trainer_image.distributed.mesh_host`, one
process per mesh) runs its program from
:func:`alpajob.planner.inter_op.schedules.instruction_list` (GPipe or 1F1B) in order:

``FORWARD j``
    take micro-batch ``j``'s batch leaves and the activations earlier stages sent,
    run the forward executable, keep its residuals, send each output to every later
    stage that reads it (resharded onto the reader's mesh by the stage's link).
``BACKWARD j``
    take the gradients later stages sent for this stage's outputs (summed over
    readers; the last stage seeds its loss with ``1 / m``), run the backward
    executable (accumulating parameter gradients; the first backward of a step makes
    the accumulators), send the input gradients back to the stages that produced
    those inputs.

A stage whose backward needs nothing from later stages (the last one) runs both
instructions of a micro-batch as one executable at its ``FORWARD j``
(:func:`~.messages.fuses_forward_backward`), and times them as its backward.

Around the program: at the start a stage sends its shared parameters (a tied
embedding) to the stages that read them; at the end the readers send their
gradient sums home, and every stage applies the optimizer to what it owns. A stage
whose update needs nothing that arrives after its last backward
(:func:`~.messages.fuses_update`: the readers of what it owns are later stages)
receives those sums before its last backward, and without a loss scale to agree on
runs that backward and its update as one executable (:mod:`.stage`'s
``backward_update``), timed as the backward.
An evaluation (:func:`run_stage_eval`) is the forward instructions alone, one
micro-batch after another.

Which messages each phase sends and receives is listed by :mod:`.messages` (the
walk below, the local driver (:mod:`.driver`, which issues every stage's program
from one thread) and any transport that must know them ahead of time read the same
lists). A stage receives through its :class:`StageLink` (a :class:`Mailbox` behind
it), so it waits exactly for the values its next instruction needs; the values one
instruction sends go together (:meth:`StageLink.send_all`). Every instruction
blocks until its result is ready, which splits each stage's wall time into
**compute** (executables), **communication** (transfers and batch loading) and
**idle** (waiting: the pipeline bubble).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from operator import add
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from alpajob.api.spec import Schedule
from alpajob.api.timeline import Span
from alpajob.planner.inter_op.schedules import Direction, instruction_list
from alpajob.trainer_image.runtime.meshes import place
from alpajob.trainer_image.runtime.messages import (
    Key,
    backward_receives,
    backward_sends,
    forward_receives,
    forward_sends,
    fuses_forward_backward,
    fuses_update,
    param_receives,
    param_sends,
    shared_receives,
    shared_sends,
)
from alpajob.trainer_image.runtime.split import SplitProgram
from alpajob.trainer_image.runtime.stage import StageRuntime


class Mailbox:
    """Values addressed to one stage, keyed; :meth:`get` waits for a key to arrive."""

    def __init__(self, abort: threading.Event) -> None:
        self._items: dict[Any, Any] = {}
        self._ready = threading.Condition()
        self._abort = abort

    def put(self, key: Any, value: Any) -> None:
        with self._ready:
            self._items[key] = value
            self._ready.notify_all()

    def get(self, key: Any, timeout: float | None = None) -> Any:
        """The value under ``key``, removed; waits for it (at most ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            while key not in self._items:
                if self._abort.is_set():
                    raise RuntimeError("another stage failed")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no message {key!r} within {timeout} s")
                self._ready.wait(timeout=0.5)
            return self._items.pop(key)


@dataclass(frozen=True)
class StageTimes:
    """Seconds one stage spent in one step; ``spans``, where the stamps give them,
    place each instruction (and each wait for its inputs) in the step."""

    compute: float
    communication: float
    idle: float
    forward: tuple[float, ...]  # per micro-batch
    backward: tuple[float, ...]
    update: float
    spans: tuple[Span, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """One step's loss (mean over micro-batches), wall seconds and per-stage times, and
    whether its update was applied (a loss-scaled step that overflowed is skipped)."""

    loss: float
    seconds: float
    stages: tuple[StageTimes, ...]
    applied: bool = True


def split_micro_batches(batch: Sequence[np.ndarray], num_micro_batches: int) -> list[list[np.ndarray]]:
    """Cut every batch leaf into ``m`` equal slices along its leading (batch) dimension."""
    size = batch[0].shape[0]
    if size % num_micro_batches:
        raise ValueError(f"batch size {size} is not divisible by {num_micro_batches} micro-batches")
    step = size // num_micro_batches
    return [[leaf[j * step : (j + 1) * step] for leaf in batch] for j in range(num_micro_batches)]


def destination_sharding(split: SplitProgram, stage: StageRuntime, key: Key) -> Any:
    """The sharding a value addressed to ``stage`` under ``key`` must arrive in.

    Keys: ``("param", leaf)`` a shared parameter; ``("act", j, vid)`` micro-batch
    ``j``'s activation ``vid``; ``("grad", j, vid, reader)`` the gradient of ``vid``
    coming back from stage ``reader``; ``("shared", leaf, reader)`` a reader's
    gradient sum of a shared parameter, going home.
    """
    kind = key[0]
    program = split.stages[stage.index]
    if kind == "param":
        return stage.param_sharding[key[1]]
    if kind == "act":
        return stage.input_sharding[program.inputs.index(key[2])]
    if kind == "grad":
        return stage.output_sharding[program.outputs.index(key[2])]
    if kind == "shared":
        return stage.acc_sharding[key[1]]
    raise ValueError(f"unknown message kind {kind!r}")


class StageLink(Protocol):
    """How a stage exchanges values with the others (Ray's object store, collectives)."""

    def send_all(self, sends: Sequence[tuple[int, Key, jax.Array]]) -> None:
        """Deliver every ``(stage, key, value)``, in order; a link may batch them."""

    def receive(self, key: Key) -> jax.Array:
        """Wait for the value addressed to this stage under ``key``."""


def run_stage_program(
    split: SplitProgram,
    stage: StageRuntime,
    schedule: Schedule,
    num_stages: int,
    micro: list[list[np.ndarray]],
    link: StageLink,
    loss_seed: jax.Array | None,
    scale: float | None = None,
    agree: Callable[[jax.Array], bool] | None = None,
) -> tuple[StageTimes, list[Any], bool]:
    """One step of stage ``stage.index`` (see the module docstring); returns its times,
    on the stage that computes the loss the loss of every micro-batch, and whether
    the update was applied.

    With a loss ``scale`` (float16, :mod:`~alpajob.trainer_image.precision`) the last
    stage seeds its backward with ``scale / m``, and before the update ``agree`` gets
    this stage's verdict (are its accumulated gradients all finite?) and returns every
    stage's: if any stage overflowed, no stage updates; else the update divides by
    the scale."""
    s = stage.index
    program = split.stages[s]
    num_micro_batches = len(micro)
    losses: list[Any] = [None] * num_micro_batches
    begin = time.perf_counter()
    comm = compute = 0.0
    fwd_times: list[float] = []
    bwd_times: list[float] = []

    # Shared parameters out; our own and the received ones in.
    t0 = time.perf_counter()
    link.send_all([(r, key, stage.params[stage.leaf_names[key[1]]]) for r, key in param_sends(split, s)])
    comm += time.perf_counter() - t0
    received = {key[1]: link.receive(key) for key in param_receives(split, s)}
    params = stage.prepare([received[leaf] if leaf in received else stage.params[stage.leaf_names[leaf]]
                            for leaf in program.params])
    acc: list[Any] | None = None  # made by the first backward
    saved: dict[int, Any] = {}
    fuse = fuses_forward_backward(split, s)
    seed = loss_seed if scale is None or loss_seed is None else loss_seed * scale
    instructions = instruction_list(schedule, s, num_stages, num_micro_batches)
    last = instructions[-1][1]  # every schedule ends a stage's step with its last backward
    fuse_update = fuses_update(split, s)  # shared sums are received before the last backward
    finish = fuse_update and scale is None  # ... which then runs with the update
    shared: dict[str, list[Any]] = {}
    away: list[Any] | None = None  # finish: the shared sums to send home

    def receive_shared() -> None:
        for key in shared_receives(split, s):
            shared.setdefault(stage.leaf_names[key[1]], []).append(link.receive(key))

    for direction, j in instructions:
        if direction is Direction.FORWARD:
            t0 = time.perf_counter()
            leaves = [place(micro[j][k], sh) for k, sh in zip(program.batch, stage.batch_sharding, strict=True)]
            comm += time.perf_counter() - t0
            inputs = [link.receive(key) for key in forward_receives(split, s, j)]
            if fuse and j == last and fuse_update:
                receive_shared()
            t0 = time.perf_counter()
            cotangents0 = [seed] if program.returns_loss else []
            if fuse and j == last and finish:
                outs, loss, away, grads, _ = stage.finish_forward_backward(
                    params, leaves, inputs, cotangents0, acc, shared)
                jax.block_until_ready((outs, loss, stage.params, stage.opt_state, away, grads))
                bwd_times.append(time.perf_counter() - t0)
            elif fuse:  # the backward needs nothing from other stages: one executable
                outs, loss, acc, grads, _ = stage.forward_backward(params, leaves, inputs, cotangents0, acc)
                jax.block_until_ready((outs, loss, acc, grads))
                bwd_times.append(time.perf_counter() - t0)
            else:
                outs, loss, residuals = stage.forward(params, leaves, inputs)
                jax.block_until_ready((outs, loss, residuals))
                fwd_times.append(time.perf_counter() - t0)
                saved[j] = residuals
            if loss is not None:
                losses[j] = loss
            t0 = time.perf_counter()
            by_vid = dict(zip(program.outputs, outs, strict=True))
            link.send_all([(r, key, by_vid[key[2]]) for r, key in forward_sends(split, s, j)])
            if fuse:
                by_vid = {program.inputs[pos]: g for pos, g in zip(stage.diff_inputs, grads, strict=True)}
                link.send_all([(r, key, by_vid[key[2]]) for r, key in backward_sends(split, s, j)])
            comm += time.perf_counter() - t0
        elif not fuse:
            cotangents: list[Any] = [reduce(add, [link.receive(key) for key in keys])
                                     for keys in backward_receives(split, s, j)]
            if program.returns_loss:
                cotangents.append(seed)
            if j == last and fuse_update:
                receive_shared()
            t0 = time.perf_counter()
            if j == last and finish:
                away, grads, _ = stage.finish_backward(params, saved.pop(j), cotangents, acc, shared)
                jax.block_until_ready((stage.params, stage.opt_state, away, grads))
            else:
                acc, grads, _ = stage.backward(params, saved.pop(j), cotangents, acc)
                jax.block_until_ready((acc, grads))
            bwd_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            by_vid = {program.inputs[pos]: g for pos, g in zip(stage.diff_inputs, grads, strict=True)}
            link.send_all([(r, key, by_vid[key[2]]) for r, key in backward_sends(split, s, j)])
            comm += time.perf_counter() - t0
    compute += sum(fwd_times) + sum(bwd_times)
    sends = shared_sends(split, s)
    update = 0.0
    applied = True
    if finish:  # updated with the last backward; the shared sums home
        assert away is not None
        t0 = time.perf_counter()
        link.send_all([(r, key, value) for (r, key), value in zip(sends, away, strict=True)])
        comm += time.perf_counter() - t0
    else:
        assert acc is not None  # every stage runs a backward per micro-batch
        # Shared parameters' gradients home (before agreeing: a stage that fuses_update
        # waits for them in its last backward), then the update.
        own = dict(zip(program.params, acc, strict=True))
        t0 = time.perf_counter()
        summed = stage.outgoing([own.pop(key[1]) for _, key in sends])
        link.send_all([(r, key, value) for (r, key), value in zip(sends, summed, strict=True)])
        comm += time.perf_counter() - t0
        if scale is not None and agree is not None:
            t0 = time.perf_counter()
            applied = agree(stage.finite(acc))
            comm += time.perf_counter() - t0
        if not fuse_update:
            receive_shared()
        t0 = time.perf_counter()
        named_grads = {stage.leaf_names[leaf]: g for leaf, g in own.items()}
        if applied:
            stage.apply_update(named_grads, shared, 1.0 / scale if scale is not None else 1.0)
            jax.block_until_ready((stage.params, stage.opt_state))
        update = time.perf_counter() - t0
        compute += update
    wall = time.perf_counter() - begin
    times = StageTimes(
        compute=compute,
        communication=comm,
        idle=max(0.0, wall - compute - comm),
        forward=tuple(fwd_times),
        backward=tuple(bwd_times),
        update=update,
    )
    return times, losses, applied


def run_stage_eval(split: SplitProgram, stage: StageRuntime, micro: list[list[np.ndarray]],
                   link: StageLink) -> list[Any]:
    """An evaluation of one batch by stage ``stage.index``: the shared parameters
    exchanged as in a step, then every micro-batch forward only, in order (no
    residuals kept, no backward, no update); on the stage that computes the loss, the
    loss of every micro-batch. Every stage must run it for the same batch at once."""
    s = stage.index
    program = split.stages[s]
    link.send_all([(r, key, stage.params[stage.leaf_names[key[1]]]) for r, key in param_sends(split, s)])
    received = {key[1]: link.receive(key) for key in param_receives(split, s)}
    params = stage.prepare([received[leaf] if leaf in received else stage.params[stage.leaf_names[leaf]]
                            for leaf in program.params])
    losses: list[Any] = []
    for j in range(len(micro)):
        leaves = [place(micro[j][k], sh) for k, sh in zip(program.batch, stage.batch_sharding, strict=True)]
        inputs = [link.receive(key) for key in forward_receives(split, s, j)]
        outs, loss, _ = stage.forward(params, leaves, inputs)
        if loss is not None:
            losses.append(loss)
        by_vid = dict(zip(program.outputs, outs, strict=True))
        link.send_all([(r, key, by_vid[key[2]]) for r, key in forward_sends(split, s, j)])
    return losses


def loss_seed(num_micro_batches: int, mesh: Any) -> jax.Array:
    """The cotangent the last stage seeds each micro-batch's loss with: ``1 / m``."""
    return place(np.float32(1.0 / num_micro_batches), NamedSharding(mesh, PartitionSpec()))
