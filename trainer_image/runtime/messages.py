"""Which messages a stage sends and receives during one step, in program order (pure).

:func:`~.executor.run_stage_program` exchanges values with the other stages in
phases; each phase's messages come from one function here, so the executor and
anything that must know a stage's communication ahead of time (the collective
transport's global order, :mod:`alpajob.trainer_image.distributed.collective`) read the
same source:

====================  ==========================================================
phase                 messages (``j`` the micro-batch, ``s`` this stage)
====================  ==========================================================
start                 send ``("param", leaf)`` to every reader of a shared leaf
                      this stage owns, then receive the shared leaves it reads
``FORWARD j``         receive ``("act", j, vid)`` per input, compute, send each
                      output to every stage that reads it
``BACKWARD j``        receive ``("grad", j, vid, reader)`` per differentiable
                      output and reader, compute, send ``("grad", j, vid, s)`` to
                      the producer of each differentiable input
end                   send ``("shared", leaf, s)`` home for every shared leaf this
                      stage reads, then receive the readers' sums of its own
====================  ==========================================================

A stage that :func:`fuses_update` receives the readers' sums in its last
``BACKWARD`` phase instead, after the gradients it reads and before it computes: its
last backward and its update are one executable.

:func:`stage_messages` strings the phases along the schedule's instruction list.
Example, 1F1B, 2 stages, 2 micro-batches, one activation ``v`` from stage 0 to 1::

    stage 0: send act(0,v)->1, send act(1,v)->1, recv grad(0,v,1), recv grad(1,v,1)
    stage 1: recv act(0,v), send grad(0,v,1)->0, recv act(1,v), send grad(1,v,1)->0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alpajob.api.spec import Schedule
from alpajob.planner.inter_op.schedules import Direction, instruction_list
from alpajob.trainer_image.runtime.split import SplitProgram, is_differentiable

#: A message's address inside its receiving stage (see
#: :func:`~.executor.destination_sharding`).
Key = tuple[Any, ...]

#: An outgoing message: (receiving stage, key).
Outgoing = tuple[int, Key]


@dataclass(frozen=True)
class Send:
    """Stage ``sender`` sends ``key`` to stage ``receiver``."""

    sender: int
    receiver: int
    key: Key


@dataclass(frozen=True)
class Receive:
    """Stage ``receiver`` waits for ``key`` (the sender follows from the key)."""

    receiver: int
    key: Key


#: One communication event of a stage's program.
Event = Send | Receive


def differentiable_inputs(split: SplitProgram, s: int) -> tuple[int, ...]:
    """Positions in stage ``s``'s inputs that carry gradients back."""
    return tuple(i for i, v in enumerate(split.stages[s].inputs) if is_differentiable(split.avals[v]))


def differentiable_outputs(split: SplitProgram, s: int) -> tuple[int, ...]:
    """Positions in stage ``s``'s outputs that receive gradients."""
    return tuple(i for i, v in enumerate(split.stages[s].outputs) if is_differentiable(split.avals[v]))


def param_sends(split: SplitProgram, s: int) -> list[Outgoing]:
    """Shared parameters this stage owns, to each stage that reads them."""
    return [(r, ("param", leaf)) for leaf, readers in split.shared_params().items()
            if split.home[leaf] == s for r in readers]


def param_receives(split: SplitProgram, s: int) -> list[Key]:
    """Shared parameters this stage reads but does not own, in its parameter order."""
    return [("param", leaf) for leaf in split.stages[s].params if split.home[leaf] != s]


def forward_receives(split: SplitProgram, s: int, j: int) -> list[Key]:
    """Micro-batch ``j``'s activations this stage reads, in input order."""
    return [("act", j, vid) for vid in split.stages[s].inputs]


def forward_sends(split: SplitProgram, s: int, j: int) -> list[Outgoing]:
    """Micro-batch ``j``'s outputs, each to every stage that reads it."""
    return [(r, ("act", j, vid)) for vid in split.stages[s].outputs for r in split.consumers[vid]]


def backward_receives(split: SplitProgram, s: int, j: int) -> list[list[Key]]:
    """Per differentiable output (in order), the gradients its readers send back."""
    program = split.stages[s]
    return [[("grad", j, program.outputs[pos], r) for r in split.consumers[program.outputs[pos]]]
            for pos in differentiable_outputs(split, s)]


def fuses_forward_backward(split: SplitProgram, s: int) -> bool:
    """Whether stage ``s`` runs each micro-batch's forward and backward as one
    executable (:mod:`.stage`'s ``forward_backward``): when its backward reads no
    gradient from another stage (the last stage, seeded by its loss), nothing has to
    happen between the two, and running the backward at once only moves it earlier
    (1F1B runs them back to back; GPipe's last stage then holds one micro-batch's
    residuals instead of all of them)."""
    return not backward_receives(split, s, 0)


def backward_waits_for(split: SplitProgram, s: int) -> set[int]:
    """The stages whose backward of a micro-batch stage ``s``'s backward of it waits
    for: those that read its differentiable outputs, and what theirs waits for."""
    out: set[int] = set()
    todo = [s]
    while todo:
        for keys in backward_receives(split, todo.pop(), 0):
            for key in keys:
                if key[3] not in out:
                    out.add(key[3])
                    todo.append(key[3])
    return out


def fuses_update(split: SplitProgram, s: int) -> bool:
    """Whether stage ``s`` runs its last backward and its update as one executable
    (:meth:`~.stage.StageRuntime.finish_backward`): when its last backward waits for
    the last backward of every stage that reads a shared parameter it owns
    (:func:`backward_waits_for`), so their gradient sums are home before it runs (a
    language model's embedding, owned by the first stage, read by the last). A stage
    owning a parameter that an earlier stage reads, or whose backward needs nothing
    from its readers, keeps a separate update: the sums could come after it."""
    waits = backward_waits_for(split, s)
    return all(r in waits for leaf, readers in split.shared_params().items()
               if split.home[leaf] == s for r in readers)


def backward_sends(split: SplitProgram, s: int, j: int) -> list[Outgoing]:
    """The gradient of every differentiable input, to the stage that produced it."""
    program = split.stages[s]
    return [(split.producer[program.inputs[pos]], ("grad", j, program.inputs[pos], s))
            for pos in differentiable_inputs(split, s)]


def shared_sends(split: SplitProgram, s: int) -> list[Outgoing]:
    """This stage's gradient sums of shared parameters it reads, each to its home."""
    return [(split.home[leaf], ("shared", leaf, s)) for leaf in split.stages[s].params
            if split.home[leaf] != s]


def shared_receives(split: SplitProgram, s: int) -> list[Key]:
    """The readers' gradient sums of the shared parameters this stage owns."""
    return [("shared", leaf, r) for leaf, readers in split.shared_params().items()
            if split.home[leaf] == s for r in readers]


def stage_messages(split: SplitProgram, s: int, schedule: Schedule, num_stages: int, num_micro_batches: int) -> list[Event]:
    """Every message stage ``s`` sends or receives in one step, in program order."""
    events: list[Event] = [Send(s, r, key) for r, key in param_sends(split, s)]
    events += [Receive(s, key) for key in param_receives(split, s)]
    instructions = instruction_list(schedule, s, num_stages, num_micro_batches)
    home_sums: list[Event] = [Receive(s, key) for key in shared_receives(split, s)]
    fused = fuses_update(split, s)
    for n, (direction, j) in enumerate(instructions):
        if direction is Direction.FORWARD:
            events += [Receive(s, key) for key in forward_receives(split, s, j)]
            events += [Send(s, r, key) for r, key in forward_sends(split, s, j)]
        else:
            events += [Receive(s, key) for keys in backward_receives(split, s, j) for key in keys]
            if fused and n == len(instructions) - 1:
                events += home_sums
            events += [Send(s, r, key) for r, key in backward_sends(split, s, j)]
    events += [Send(s, r, key) for r, key in shared_sends(split, s)]
    return events if fused else events + home_sums


def layout_key(key: Key) -> tuple[str, int]:
    """A message key without its micro-batch and reader: what fixes its tiles (every
    micro-batch of an activation arrives in the same sharding)."""
    kind = key[0]
    return (kind, key[2]) if kind in ("act", "grad") else (kind, key[1])
