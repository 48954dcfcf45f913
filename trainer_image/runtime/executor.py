"""Run one training step: every stage's instruction list, one worker thread per stage.

Each stage runs its program from :func:`alpajob.planner.schedules.instruction_list`
(GPipe or 1F1B) in order, the way a mesh worker of the Ray runtime does:

``FORWARD j``
    take micro-batch ``j``'s batch leaves and the activations earlier stages sent,
    run the forward executable, keep its residuals, send each output to every later
    stage that reads it (resharded onto the reader's mesh, :func:`.transport.move`).
``BACKWARD j``
    take the gradients later stages sent for this stage's outputs (summed over
    readers; the last stage seeds its loss with ``1 / m``), run the backward
    executable (accumulating parameter gradients), send the input gradients back
    to the stages that produced those inputs.

Around the program: at the start a stage sends its shared parameters (a tied
embedding) to the stages that read them; at the end the readers send their
gradient sums home, and every stage applies the optimizer to what it owns.

Which messages each phase sends and receives is listed by :mod:`.messages` (the
walk below and any transport that must know them ahead of time read the same lists).
Stages talk through :class:`Mailbox` es, so a stage waits exactly for the values its
next instruction needs; the values one instruction sends go together
(:meth:`StageLink.send_all`: locally, one batched move). Every instruction blocks until its result is ready, which
splits each stage's wall time into **compute** (executables), **communication**
(transfers and batch loading) and **idle** (waiting: the pipeline bubble).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import reduce
from operator import add
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from alpajob.planner.schedules import Direction, Schedule, instruction_list
from alpajob.trainer.runtime.meshes import place
from alpajob.trainer.runtime.messages import (
    Key,
    backward_receives,
    backward_sends,
    forward_receives,
    forward_sends,
    param_receives,
    param_sends,
    shared_receives,
    shared_sends,
)
from alpajob.trainer.runtime.split import SplitProgram
from alpajob.trainer.runtime.stage import StageRuntime
from alpajob.trainer.runtime.transport import move_all


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
    """Seconds one stage spent in one step."""

    compute: float
    communication: float
    idle: float
    forward: tuple[float, ...]  # per micro-batch
    backward: tuple[float, ...]
    update: float


@dataclass(frozen=True)
class StepResult:
    """One step's loss (mean over micro-batches), wall seconds and per-stage times."""

    loss: float
    seconds: float
    stages: tuple[StageTimes, ...]


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
    """How a stage exchanges values with the others (local threads, Ray actors)."""

    def send(self, stage: int, key: Key, value: jax.Array) -> None:
        """Deliver ``value`` to ``stage`` under ``key``, resharded for it."""

    def send_all(self, sends: Sequence[tuple[int, Key, jax.Array]]) -> None:
        """Deliver every ``(stage, key, value)``, in order; a link may batch them."""

    def receive(self, key: Key) -> jax.Array:
        """Wait for the value addressed to this stage under ``key``."""


class LocalLink:
    """Stages of one process: :func:`.transport.move` onto the reader, then its mailbox."""

    def __init__(self, split: SplitProgram, stages: Sequence[StageRuntime], boxes: Sequence[Mailbox], index: int) -> None:
        self.split, self.stages, self.boxes, self.index = split, stages, boxes, index

    def send(self, stage: int, key: Key, value: jax.Array) -> None:
        self.send_all([(stage, key, value)])

    def send_all(self, sends: Sequence[tuple[int, Key, jax.Array]]) -> None:
        targets = [destination_sharding(self.split, self.stages[r], key) for r, key, _ in sends]
        moved = move_all([value for _, _, value in sends], targets)
        for (r, key, _), value in zip(sends, moved, strict=True):
            self.boxes[r].put(key, value)

    def receive(self, key: Key) -> jax.Array:
        return self.boxes[self.index].get(key)


def run_stage_program(
    split: SplitProgram,
    stage: StageRuntime,
    schedule: Schedule,
    num_stages: int,
    micro: list[list[np.ndarray]],
    link: StageLink,
    loss_seed: jax.Array | None,
) -> tuple[StageTimes, list[Any]]:
    """One step of stage ``stage.index`` (see the module docstring); returns its times
    and, on the stage that computes the loss, the loss of every micro-batch."""
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
    params = [received[leaf] if leaf in received else stage.params[stage.leaf_names[leaf]]
              for leaf in program.params]
    acc = stage.zeros()
    saved: dict[int, Any] = {}

    for direction, j in instruction_list(schedule, s, num_stages, num_micro_batches):
        if direction is Direction.FORWARD:
            t0 = time.perf_counter()
            leaves = [place(micro[j][k], sh) for k, sh in zip(program.batch, stage.batch_sharding, strict=True)]
            comm += time.perf_counter() - t0
            inputs = [link.receive(key) for key in forward_receives(split, s, j)]
            t0 = time.perf_counter()
            outs, loss, vjp = stage.forward(params, leaves, inputs)
            jax.block_until_ready((outs, loss, vjp))
            fwd_times.append(time.perf_counter() - t0)
            saved[j] = vjp
            if loss is not None:
                losses[j] = loss
            t0 = time.perf_counter()
            by_vid = dict(zip(program.outputs, outs, strict=True))
            link.send_all([(r, key, by_vid[key[2]]) for r, key in forward_sends(split, s, j)])
            comm += time.perf_counter() - t0
        else:
            cotangents: list[Any] = [reduce(add, [link.receive(key) for key in keys])
                                     for keys in backward_receives(split, s, j)]
            if program.returns_loss:
                cotangents.append(loss_seed)
            t0 = time.perf_counter()
            acc, grads = stage.backward(saved.pop(j), cotangents, acc)
            jax.block_until_ready((acc, grads))
            bwd_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            by_vid = {program.inputs[pos]: g for pos, g in zip(stage.diff_inputs, grads, strict=True)}
            link.send_all([(r, key, by_vid[key[2]]) for r, key in backward_sends(split, s, j)])
            comm += time.perf_counter() - t0
    compute += sum(fwd_times) + sum(bwd_times)

    # Shared parameters' gradients home, then the update.
    grads = dict(zip(program.params, acc, strict=True))
    t0 = time.perf_counter()
    link.send_all([(r, key, grads.pop(key[1])) for r, key in shared_sends(split, s)])
    comm += time.perf_counter() - t0
    for key in shared_receives(split, s):
        grads[key[1]] = grads[key[1]] + link.receive(key)
    t0 = time.perf_counter()
    named_grads = {stage.leaf_names[leaf]: g for leaf, g in grads.items()}
    stage.params, stage.opt_state = stage.update(stage.params, stage.opt_state, named_grads)
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
    return times, losses


def loss_seed(num_micro_batches: int, mesh: Any) -> jax.Array:
    """The cotangent the last stage seeds each micro-batch's loss with: ``1 / m``."""
    return place(np.float32(1.0 / num_micro_batches), NamedSharding(mesh, PartitionSpec()))


class PipelineExecutor:
    """Runs steps of a split program over its stage runtimes, one thread per stage."""

    def __init__(
        self,
        split: SplitProgram,
        stages: Sequence[StageRuntime],
        schedule: Schedule,
        num_micro_batches: int,
    ) -> None:
        self.split = split
        self.stages = list(stages)  # stage i is self.stages[i]
        self.schedule = schedule
        self.num_micro_batches = num_micro_batches
        self._loss_seed = loss_seed(num_micro_batches, self.stages[-1].mesh)

    def step(self, batch: Sequence[np.ndarray]) -> StepResult:
        """One training step on the host ``batch`` (flattened leaves, global batch)."""
        micro = split_micro_batches(batch, self.num_micro_batches)
        abort = threading.Event()
        boxes = [Mailbox(abort) for _ in self.stages]
        start = time.perf_counter()
        with ThreadPoolExecutor(len(self.stages), thread_name_prefix="stage") as pool:
            futures = [
                pool.submit(self._run_stage, s, micro, boxes, abort)
                for s in range(len(self.stages))
            ]
            try:
                results = [f.result() for f in futures]
            except BaseException:
                abort.set()
                raise
        seconds = time.perf_counter() - start
        losses = [x for _, stage_losses in results for x in stage_losses if x is not None]
        loss = float(np.mean([float(x) for x in losses]))
        return StepResult(loss, seconds, tuple(times for times, _ in results))

    def _run_stage(self, s: int, micro: list[list[np.ndarray]], boxes: list[Mailbox], abort: threading.Event) -> tuple[StageTimes, list[Any]]:
        try:
            link = LocalLink(self.split, self.stages, boxes, s)
            return run_stage_program(self.split, self.stages[s], self.schedule, len(self.stages), micro, link, self._loss_seed)
        except BaseException:
            abort.set()
            raise
