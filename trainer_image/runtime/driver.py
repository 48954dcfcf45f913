"""One training step on local devices, issued from one thread without waiting.

The local runner sees every device from one process, so one thread can drive every
stage. It places every micro-batch's batch leaves on their stages at the start, in
one batched put, then walks the stages' instruction lists (:func:`~alpajob.planner.
schedules.instruction_list`, GPipe or 1F1B) in rounds, the ticks of the schedule's
clock (:func:`issue_rounds`). In a round, each stage that can issues its next
instruction the way a stage of :mod:`.executor` would: call the forward or backward
executable and send each output to the stages that read it. After the round, all
its messages move together (one :func:`.transport.move_all`): nothing in a round
reads what the same round sends. Nothing waits: JAX queues every executable behind
its inputs and returns, and a move of whole shards is a device copy queued behind
the computation that makes them. No Python thread stands between one stage's
output and the next stage's input, where a thread per stage that waits for every
instruction pays a thread hand-off per message (on 2 shared cores that cost
GPT-tiny's 4-stage pipeline 15-17% of its step, measured on 2 cores).

**Host work per step.** A small model's instructions take 0.3-3 ms, and on a host
whose cores also run the devices every ``jax.device_put`` costs 0.1-0.3 ms of
Python. So the step batches its puts: one for the batch, one per round for the
messages (GPT-tiny, 4 stages, 8 micro-batches: 24 moves in place of 68), and moves
of the same layout on both sides go through ``jax.device_put`` whole
(:mod:`.transport`). Together these made that step 12-16% faster
(measured on 2 cores).

**The end of a stage's step.** A stage's gradients are complete after its last
backward: the sums of the shared parameters it reads go home in that round. A stage
whose update needs nothing sent later (:func:`~.messages.fuses_update`) runs that
backward and its update as one executable in a step without a loss scale; the others
update after the last round (a loss-scaled step first reads every stage's verdict).

Devices run what they were given in the order their inputs allow. On GPUs, where a
device runs its queue in order, that is the schedule's order; on CPU devices a
forward may run early, so a 1F1B stage can hold more micro-batches at once than the
schedule's bound.

**Timing without waiting.** A watcher thread per stage follows that stage's
instructions in order: it waits for an instruction's inputs, stamps them ready,
waits for its outputs, stamps it done (:class:`Stamp`). From the stamps alone
(:func:`stage_times`), for instruction ``k`` of a stage:

- it starts at ``max(done[k-1], inputs ready, issued)`` and **computes** until done;
- the wait before it (from ``done[k-1]``) is **communication** from when the values
  it reads had been produced (their producers' done stamps, or its issue for batch
  leaves) until they had arrived, and **idle** otherwise: the pipeline bubble, or
  (in a waiting step) the driver busy with other stages.

A stamp is late by the watcher's wake-up; consecutive stamps are late alike, so
the sums hold up, while one short instruction's time is only approximate. On GPUs a
call returns at once and a watcher wakes within microseconds. On CPU devices an
executable that spans several devices runs mostly inside the call, holding the
GIL, so a watcher stamps when the driver next lets go of it: the per-stage split is
then rough (the step time is not). ``wait`` (``alpajob run --exact-stage-times``)
makes the driver wait for every instruction and every move itself
(:class:`Stopwatch`): exact stamps, and no overlap between instructions.

**Timing costs a step.** Every stamp wakes a thread, and on a host whose cores are
busy running the devices those wake-ups add up: watching every instruction made
GPT-tiny's 4-stage step 15-20% slower on 2 cores. So a step is timed only when the caller asks (``timed``; ``alpajob run`` times
one step in ``--stage-times-every``); an untimed step has no watchers
(:class:`Untimed`) and only waits, at its end, for the updates.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import reduce
from operator import add
from typing import Any

import jax
import numpy as np

from alpajob.api.spec import Schedule
from alpajob.api.timeline import Span, SpanKind
from alpajob.planner.inter_op.schedules import Direction, instruction_list, predecessor
from alpajob.trainer_image.runtime.executor import (
    StageTimes,
    StepResult,
    destination_sharding,
    loss_seed,
    split_micro_batches,
)
from alpajob.trainer_image.runtime.fused import FusedRunner
from alpajob.trainer_image.runtime.meshes import place_all
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
from alpajob.trainer_image.runtime.transport import move_all

#: An instruction of the step: ``(stage, kind, micro_batch)``; kind is ``"forward"``,
#: ``"backward"``, ``"forward_backward"`` (both in one executable,
#: :func:`~.messages.fuses_forward_backward`) or ``"update"`` (micro-batch -1; a stage
#: that :func:`~.messages.fuses_update` runs it with its last backward, no instruction
#: of its own).
InstructionId = tuple[int, str, int]

_KIND = {Direction.FORWARD: "forward", Direction.BACKWARD: "backward"}


def issue_rounds(schedule: Schedule, num_stages: int,
                 num_micro_batches: int) -> list[list[tuple[int, Direction, int]]]:
    """Every stage's instructions in rounds that respect their dependencies.

    In each round every stage issues its next instruction if its
    :func:`~alpajob.planner.inter_op.schedules.predecessor` was issued in an *earlier* round:
    a round is one tick of the schedule's clock with equal instruction times (for
    1F1B, stage ``i`` starts micro-batch 0 in round ``i``). So no instruction reads
    what its own round sends, and a round's messages can move together, after it.
    """
    programs = [instruction_list(schedule, i, num_stages, num_micro_batches) for i in range(num_stages)]
    cursor = [0] * num_stages
    issued: set[tuple[int, Direction, int]] = set()
    rounds: list[list[tuple[int, Direction, int]]] = []
    while len(issued) < sum(map(len, programs)):
        this_round = []
        for i in range(num_stages):
            if cursor[i] == len(programs[i]):
                continue
            direction, j = programs[i][cursor[i]]
            dep = predecessor(i, direction, j, num_stages)
            if dep is None or dep in issued:
                this_round.append((i, direction, j))
                cursor[i] += 1
        if not this_round:
            raise RuntimeError(f"schedule {schedule.value} deadlocks")  # a bug, not user input
        issued.update(this_round)
        rounds.append(this_round)
    return rounds


def issue_order(schedule: Schedule, num_stages: int, num_micro_batches: int) -> list[tuple[int, Direction, int]]:
    """The instructions of :func:`issue_rounds`, round after round."""
    return [x for this_round in issue_rounds(schedule, num_stages, num_micro_batches) for x in this_round]


@dataclass(frozen=True)
class Stamp:
    """When one instruction of a stage was issued, had its inputs, and was done."""

    kind: str
    micro_batch: int
    issued: float
    inputs_ready: float
    done: float
    sources: tuple[InstructionId, ...]  # the instructions that produced its inputs


class Watcher:
    """A thread that stamps one stage's instructions as they complete (module docstring)."""

    def __init__(self) -> None:
        self.stamps: list[Stamp] = []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="stage-watcher", daemon=True)
        self._thread.start()

    def before(self, inputs: Any, arrived: float | None) -> None:
        """Nothing: the watcher's thread waits for the inputs (:meth:`watch`)."""

    def watch(self, kind: str, micro_batch: int, issued: float, inputs: Any, outputs: Any,
              sources: Sequence[InstructionId]) -> None:
        """Stamp this instruction once its ``inputs`` and then its ``outputs`` are ready."""
        self._queue.put((kind, micro_batch, issued, inputs, outputs, tuple(sources)))

    def close(self) -> list[Stamp]:
        """Wait for every watched instruction; the stamps (raises what one raised)."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.stamps

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, micro_batch, issued, inputs, outputs, sources = item
            try:
                jax.block_until_ready(inputs)
                ready = time.perf_counter()
                jax.block_until_ready(outputs)
                self.stamps.append(Stamp(kind, micro_batch, issued, ready, time.perf_counter(), sources))
            except BaseException as error:  # noqa: BLE001 - handed to close()
                self._error = self._error or error


class Stopwatch:
    """The :class:`Watcher` of an exact, slower step: waits for every instruction in
    the caller's thread as soon as it is issued, so the stamps are exact and no
    instruction overlaps another."""

    def __init__(self) -> None:
        self.stamps: list[Stamp] = []
        self._ready = 0.0

    def before(self, inputs: Any, arrived: float | None) -> None:
        """Stamp an instruction's inputs ready before it is called (a call on CPU
        devices can run most of the executable before it returns): when its last message
        ``arrived`` (the driver waited for each move), else once its batch is placed."""
        jax.block_until_ready(inputs)
        self._ready = arrived if arrived is not None else time.perf_counter()

    def watch(self, kind: str, micro_batch: int, issued: float, inputs: Any, outputs: Any,
              sources: Sequence[InstructionId]) -> None:
        jax.block_until_ready(outputs)
        self.stamps.append(Stamp(kind, micro_batch, issued, self._ready, time.perf_counter(), tuple(sources)))

    def close(self) -> list[Stamp]:
        return self.stamps


class Untimed:
    """The :class:`Watcher` of an untimed step: stamps nothing, and on :meth:`close`
    waits only for the stage's last instruction (its update, or the last backward
    that ran with it: the end of its step)."""

    def __init__(self) -> None:
        self._last: Any = None

    def before(self, inputs: Any, arrived: float | None) -> None:
        """Nothing."""

    def watch(self, kind: str, micro_batch: int, issued: float, inputs: Any, outputs: Any,
              sources: Sequence[InstructionId]) -> None:
        self._last = outputs

    def close(self) -> list[Stamp]:
        jax.block_until_ready(self._last)
        return []


def stage_times(stamps: Sequence[Sequence[Stamp]], begin: float, end: float) -> tuple[StageTimes, ...]:
    """Per stage, its compute, communication and idle seconds from its stamps (the
    module docstring gives the rule), and each instruction and wait as a span of the
    step; idle is the rest of ``end - begin``."""
    done = {(s, x.kind, x.micro_batch): x.done for s, stage in enumerate(stamps) for x in stage}
    out = []
    for i, stage in enumerate(stamps):
        previous = begin
        compute = communication = update = 0.0
        forward: list[float] = []
        backward: list[float] = []
        spans: list[Span] = []
        for x in stage:
            start = max(previous, x.inputs_ready, x.issued)
            produced = max([done[src] for src in x.sources if src in done], default=x.issued)
            waited_from, waited_to = max(previous, produced), min(start, x.inputs_ready)
            communication += max(0.0, waited_to - waited_from)
            seconds = max(0.0, x.done - start)
            compute += seconds
            micro_batch: int | None = x.micro_batch
            if x.kind == "forward":
                forward.append(seconds)
                kind = SpanKind.FORWARD
            elif x.kind == "forward_backward":  # one executable: counted as the backward
                backward.append(seconds)
                kind = SpanKind.FORWARD_BACKWARD
            elif x.kind == "backward":
                backward.append(seconds)
                kind = SpanKind.BACKWARD
            else:
                update = seconds
                kind, micro_batch = SpanKind.UPDATE, None
            if waited_to > waited_from:
                spans.append(Span(i, SpanKind.COMMUNICATION, micro_batch, waited_from - begin,
                                  waited_to - begin))
            spans.append(Span(i, kind, micro_batch, start - begin, start - begin + seconds))
            previous = max(previous, x.done)
        idle = max(0.0, (end - begin) - compute - communication)
        out.append(StageTimes(compute, communication, idle, tuple(forward), tuple(backward), update,
                              tuple(spans)))
    return tuple(out)


class _Post:
    """Messages between stages: queued as they are sent, moved onto their readers
    together on :meth:`flush` (one batched move per round of the step), or at once in
    a waiting step (its stamps need each message's own arrival)."""

    def __init__(self, split: SplitProgram, stages: Sequence[StageRuntime], wait: bool) -> None:
        self.split, self.stages, self.wait = split, stages, wait
        self._pending: list[tuple[InstructionId | None, int, Key, Any]] = []
        self._values: dict[tuple[int, Key], Any] = {}
        self._from: dict[tuple[int, Key], InstructionId | None] = {}
        self._arrived: dict[tuple[int, Key], float] = {}

    def send(self, source: InstructionId | None, sends: Sequence[tuple[int, Key, Any]]) -> None:
        self._pending += [(source, r, key, value) for r, key, value in sends]
        if self.wait:
            self.flush()

    def flush(self) -> None:
        """Move every queued message onto its reader, in one :func:`move_all`."""
        pending, self._pending = self._pending, []
        targets = [destination_sharding(self.split, self.stages[r], key) for _, r, key, _ in pending]
        moved = move_all([value for *_, value in pending], targets)
        if self.wait:
            jax.block_until_ready(moved)
            arrived = time.perf_counter()
            self._arrived.update(((r, key), arrived) for _, r, key, _ in pending)
        for (source, r, key, _), value in zip(pending, moved, strict=True):
            self._values[(r, key)] = value
            self._from[(r, key)] = source

    def take(self, stage: int, keys: Sequence[Key]) -> tuple[list[Any], list[InstructionId]]:
        """The moved values of ``keys`` for ``stage`` (sent and flushed before)."""
        values = [self._values.pop((stage, key)) for key in keys]
        sources = [src for key in keys if (src := self._from.pop((stage, key))) is not None]
        return values, sources

    def arrived(self, stage: int, keys: Sequence[Key]) -> float | None:
        """When the last of these messages had arrived (waiting steps only), or None."""
        times = [self._arrived.pop((stage, key)) for key in keys if (stage, key) in self._arrived]
        return max(times, default=None)


def _place_batch(split: SplitProgram, stages: Sequence[StageRuntime],
                 micro: Sequence[Sequence[np.ndarray]]) -> dict[tuple[int, int], list[Any]]:
    """Every stage's batch leaves of every micro-batch, ``(stage, micro-batch) ->
    leaves``, placed at the start of the step in one batched put."""
    wanted = [(s, j, k, sh) for s, stage in enumerate(stages) for j in range(len(micro))
              for k, sh in zip(split.stages[s].batch, stage.batch_sharding, strict=True)]
    placed = place_all([micro[j][k] for _, j, k, _ in wanted], [sh for *_, sh in wanted])
    out: dict[tuple[int, int], list[Any]] = {(s, j): [] for s in range(len(stages)) for j in range(len(micro))}
    for (s, j, _, _), x in zip(wanted, placed, strict=True):
        out[(s, j)].append(x)
    return out


def _stage_params(split: SplitProgram, stages: Sequence[StageRuntime], post: _Post) -> list[Any]:
    """Every stage's parameters for a step: shared ones sent from their home stage to
    the stages that read them too, then each stage's own (:meth:`StageRuntime.prepare`)."""
    for s, stage in enumerate(stages):
        post.send(None, [(r, key, stage.params[stage.leaf_names[key[1]]]) for r, key in param_sends(split, s)])
    post.flush()
    params = []
    for s, stage in enumerate(stages):
        keys = param_receives(split, s)
        received = dict(zip([k[1] for k in keys], post.take(s, keys)[0], strict=True))
        params.append(stage.prepare([received[leaf] if leaf in received else stage.params[stage.leaf_names[leaf]]
                                     for leaf in split.stages[s].params]))
    return params


def drive_eval(split: SplitProgram, stages: Sequence[StageRuntime],
               micro: Sequence[Sequence[np.ndarray]]) -> list[jax.Array]:
    """Every micro-batch's loss, forward only (an evaluation): each micro-batch goes
    through the stages in order; no backward, no update, parameters unchanged."""
    post = _Post(split, stages, wait=False)
    params = _stage_params(split, stages, post)
    batch = _place_batch(split, stages, micro)
    losses: list[jax.Array] = []
    for j in range(len(micro)):
        for s, stage in enumerate(stages):
            inputs, _ = post.take(s, forward_receives(split, s, j))
            outs, loss, _ = stage.forward(params[s], batch.pop((s, j)), inputs)
            if loss is not None:
                losses.append(loss)
            by_vid = dict(zip(split.stages[s].outputs, outs, strict=True))
            post.send(None, [(r, key, by_vid[key[2]]) for r, key in forward_sends(split, s, j)])
            post.flush()
    return losses


def _with_flushes(rounds: Sequence[Sequence[tuple[int, Direction, int]]],
                  post: _Post) -> Iterator[tuple[int, Direction, int]]:
    """The rounds' instructions in order, flushing ``post`` after each round."""
    for this_round in rounds:
        yield from this_round
        post.flush()


def drive_step(
    split: SplitProgram,
    stages: Sequence[StageRuntime],
    schedule: Schedule,
    micro: Sequence[Sequence[np.ndarray]],
    loss_seed: jax.Array,
    wait: bool = False,
    timed: bool = True,
    scale: float | None = None,
    fuse: bool = True,
) -> tuple[list[jax.Array], list[list[Stamp]], bool]:
    """Issue one step (module docstring); returns the micro-batches' losses, every
    stage's stamps (none if not ``timed``), after the last update is done, and whether
    the step was applied. ``wait`` waits, in a timed step, for every instruction and
    move before issuing the next (:class:`Stopwatch`). With a loss ``scale`` (float16,
    :mod:`~alpajob.trainer_image.precision`) the backward starts from the scaled seed
    and the updates divide by it; if any stage's gradients are not all finite, no
    stage updates (one host round trip reads the stages' verdicts). ``fuse=False`` runs
    every forward, backward and update as an executable of its own, as a waiting step
    does (to measure what fusing them gains)."""
    p, m = len(stages), len(micro)
    wait = wait and timed
    fuse_any = fuse and not wait
    post = _Post(split, stages, wait)
    watcher = (Stopwatch if wait else Watcher) if timed else Untimed
    watchers: list[Watcher | Stopwatch | Untimed] = [watcher() for _ in stages]
    applied = True
    if scale is not None:
        loss_seed = loss_seed * scale
    try:
        params = _stage_params(split, stages, post)
        acc: list[Any] = [None] * p  # made by each stage's first backward
        batch = _place_batch(split, stages, micro)
        saved: dict[tuple[int, int], Any] = {}
        losses: list[jax.Array] = []
        last_backward = [instruction_list(schedule, s, p, m)[-1][1] for s in range(p)]
        fused = [fuses_forward_backward(split, s) and fuse_any for s in range(p)]
        finish = [fuses_update(split, s) and scale is None and fuse_any for s in range(p)]
        shared_in: list[dict[str, list[Any]]] = [{} for _ in range(p)]
        shared_from: list[list[InstructionId]] = [[] for _ in range(p)]
        for s, direction, j in _with_flushes(issue_rounds(schedule, p, m), post):
            stage, program = stages[s], split.stages[s]
            if fused[s] and direction is Direction.BACKWARD:
                continue  # issued with its forward
            kind = "forward_backward" if fused[s] else _KIND[direction]
            me = (s, kind, j)
            last = j == last_backward[s] and (direction is Direction.BACKWARD or fused[s])  # its last backward
            ends = finish[s] and last  # ... run with the update
            if ends:  # the readers' sums of what it owns were sent rounds ago
                keys = shared_receives(split, s)
                values, shared_from[s] = post.take(s, keys)
                for key, value in zip(keys, values, strict=True):
                    shared_in[s].setdefault(stage.leaf_names[key[1]], []).append(value)
            issued = time.perf_counter()
            if direction is Direction.FORWARD:
                leaves = batch.pop((s, j))
                keys = forward_receives(split, s, j)
                inputs, sources = post.take(s, keys)
                watchers[s].before((leaves, inputs), post.arrived(s, keys))
                seed = [loss_seed] if program.returns_loss else []
                if fused[s] and ends:
                    outs, loss, away, grads, done = stage.finish_forward_backward(
                        params[s], leaves, inputs, seed, acc[s], shared_in[s])
                    produced: Any = (outs, loss, stage.params, stage.opt_state, away, done)
                    sources = sources + shared_from[s]
                elif fused[s]:
                    outs, loss, acc[s], grads, done = stage.forward_backward(params[s], leaves, inputs, seed, acc[s])
                    produced = (outs, loss, done)  # acc: donated next
                else:
                    outs, loss, residuals = stage.forward(params[s], leaves, inputs)
                    saved[(s, j)] = residuals
                    produced = (outs, loss, residuals)
                if loss is not None:
                    losses.append(loss)
                watchers[s].watch(kind, j, issued, (leaves, inputs), produced, sources)
                by_vid = dict(zip(program.outputs, outs, strict=True))
                post.send(me, [(r, key, by_vid[key[2]]) for r, key in forward_sends(split, s, j)])
                if fused[s]:
                    by_vid = {program.inputs[pos]: g for pos, g in zip(stage.diff_inputs, grads, strict=True)}
                    post.send(me, [(r, key, by_vid[key[2]]) for r, key in backward_sends(split, s, j)])
            else:
                cotangents, sources, arrivals = [], [], []
                for keys in backward_receives(split, s, j):
                    values, froms = post.take(s, keys)
                    cotangents.append(reduce(add, values))
                    sources += froms
                    arrivals.append(post.arrived(s, keys))
                if program.returns_loss:
                    cotangents.append(loss_seed)
                watchers[s].before(cotangents, max([a for a in arrivals if a is not None], default=None))
                if ends:
                    away, grads, done = stage.finish_backward(params[s], saved.pop((s, j)), cotangents, acc[s],
                                                              shared_in[s])
                    watchers[s].watch("backward", j, issued, cotangents,
                                      (stage.params, stage.opt_state, away, done), sources + shared_from[s])
                else:
                    acc[s], grads, done = stage.backward(params[s], saved.pop((s, j)), cotangents, acc[s])
                    watchers[s].watch("backward", j, issued, cotangents, done, sources)  # acc: donated next
                by_vid = {program.inputs[pos]: g for pos, g in zip(stage.diff_inputs, grads, strict=True)}
                post.send(me, [(r, key, by_vid[key[2]]) for r, key in backward_sends(split, s, j)])
            if last:
                # The stage's gradients are complete: the shared parameters' sums go home.
                sends = shared_sends(split, s)
                if not ends:
                    acc_of = dict(zip(program.params, acc[s], strict=True))
                    away = stage.outgoing([acc_of[key[1]] for _, key in sends])
                post.send(me, [(r, key, value) for (r, key), value in zip(sends, away, strict=True)])
        if scale is not None:  # every gradient contribution is in some stage's accumulators
            verdicts = [stage.finite(acc[s]) for s, stage in enumerate(stages)]
            applied = all(bool(v) for v in verdicts)
        post.flush()
        for s, stage in enumerate(stages):
            if finish[s]:
                continue  # updated with its last backward
            own = {leaf: g for leaf, g in zip(split.stages[s].params, acc[s], strict=True)
                   if split.home[leaf] == s}
            issued = time.perf_counter()
            keys = shared_receives(split, s)
            values, sources = post.take(s, keys)
            shared: dict[str, list[Any]] = {}
            for key, value in zip(keys, values, strict=True):
                shared.setdefault(stage.leaf_names[key[1]], []).append(value)
            named = {stage.leaf_names[leaf]: g for leaf, g in own.items()}
            watchers[s].before(values, post.arrived(s, keys))
            if not applied:
                continue
            stage.apply_update(named, shared, 1.0 / scale if scale is not None else 1.0)
            watchers[s].watch("update", -1, issued, values, (stage.params, stage.opt_state), sources)
    finally:
        stamps = []
        errors = []
        for each in watchers:
            try:
                stamps.append(each.close())
            except BaseException as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
    if errors:
        raise errors[0]
    return losses, stamps, applied


class PipelineExecutor:
    """Runs steps of a split program over its stage runtimes (:func:`drive_step`)."""

    def __init__(
        self,
        split: SplitProgram,
        stages: Sequence[StageRuntime],
        schedule: Schedule,
        num_micro_batches: int,
        wait: bool = False,
        fuse: bool = True,
    ) -> None:
        self.split = split
        self.wait = wait  # exact per-stage times, no overlap (drive_step)
        self.fuse = fuse  # False: separate executables, as a waiting step (drive_step)
        self.stages = list(stages)  # stage i is self.stages[i]
        self.schedule = schedule
        self.num_micro_batches = num_micro_batches
        self._loss_seed = loss_seed(num_micro_batches, self.stages[-1].mesh)
        self._fused = (FusedRunner(split, self.stages[0], num_micro_batches, self._loss_seed)
                       if len(self.stages) == 1 else None)

    def step(self, batch: Sequence[np.ndarray], timed: bool = True, scale: float | None = None) -> StepResult:
        """One training step on the host ``batch`` (flattened leaves, global batch);
        per-stage times only if ``timed`` (module docstring: timing costs a step);
        ``scale``: the loss scale of a float16 run (:func:`drive_step`). A plan of one
        stage runs its step as one executable (:mod:`.fused`) unless the executor
        waits for every instruction (``wait``: exact per-instruction times)."""
        if self._fused is not None and not self.wait and self.fuse:
            return self._fused_step(batch, timed, scale)
        micro = split_micro_batches(batch, self.num_micro_batches)
        begin = time.perf_counter()
        losses, stamps, applied = drive_step(self.split, self.stages, self.schedule, micro,
                                             self._loss_seed, self.wait, timed, scale, self.fuse)
        end = time.perf_counter()
        loss = float(np.mean([float(x) for x in losses]))
        return StepResult(loss, end - begin, stage_times(stamps, begin, end) if timed else (), applied)

    def _fused_step(self, batch: Sequence[np.ndarray], timed: bool, scale: float | None) -> StepResult:
        """A one-stage plan's step as one executable (:mod:`.fused`); timed, the stage
        computes for the whole step (one span: the step has no instructions to tell
        apart)."""
        assert self._fused is not None
        begin = time.perf_counter()
        losses, finite = self._fused.step(batch, scale)
        loss = float(np.mean(np.asarray(losses)))
        applied = bool(finite)
        end = time.perf_counter()
        seconds = end - begin
        times = (StageTimes(seconds, 0.0, 0.0, (), (), 0.0, (Span(0, SpanKind.STEP, None, 0.0, seconds),)),)
        return StepResult(loss, seconds, times if timed else (), applied)

    def evaluate(self, batch: Sequence[np.ndarray]) -> float:
        """The loss of the host ``batch`` (flattened leaves, global batch), forward only."""
        micro = split_micro_batches(batch, self.num_micro_batches)
        return float(np.mean([float(x) for x in drive_eval(self.split, self.stages, micro)]))
