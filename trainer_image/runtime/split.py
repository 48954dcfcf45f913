"""Cut any traced loss function into pipeline stages at the plan's layer boundaries.

The runtime never asks a model for its layers. It traces ``loss(params, batch)`` for
one micro-batch with :func:`jax.make_jaxpr`, inlines ``jit`` calls (so a cut may fall
inside a jitted block), and places every equation on a stage:

1. **Parameters** start on the stage the plan puts them: the first stage whose
   ``param_shardings`` names them (the stage of their first forward consumer).
2. **Lower bounds**: an equation that reads anything computed from a parameter goes
   no earlier than the latest stage among those inputs, so no value ever flows
   backwards. An equation that reads a parameter together with a value computed
   from the batch (a matmul, a lookup, a bias add) stays exactly there.
   A parameter cast to the compute type (mixed precision) counts as the parameter.
3. **Fewest bytes across boundaries**: every other equation (layer-norm statistics,
   residual adds, batch preprocessing such as label one-hots and masks, and
   **parameter preprocessing**: a reshape or broadcast of a scale, which reads
   parameters only) is placed by a small min-cut LP (:func:`_min_crossing`) so the
   activations that cross between stages are as few bytes as possible: a layer
   norm's statistics run next to the layer owning its scale, the residual add that
   ends a layer stays with it, a one-hot of the labels runs on the stage of the
   loss, and a broadcast of a scale runs on the stage that applies it. The last
   matters: a value computed from parameters alone and sent as an activation
   would cross (and its gradient come back) once per micro-batch, where the
   parameter itself, read on the later stage, moves to that stage (or is shared
   with it, once per step).

A value produced on stage ``s`` and read on a later stage crosses the boundary as an
**activation**: it is one of ``s``'s outputs and one of the reader's inputs. A
parameter read on a stage other than its home (GPT's tied embedding, read by the
first and the last stage) is a **shared parameter**: the home stage sends it out at
the start of a step and receives the readers' gradients back before its update.
A parameter's home is the earliest stage that reads it.

Each stage becomes a :class:`StageProgram`: a pure function from (its home and
shared parameters, its batch leaves, its incoming activations) to (its outgoing
activations, plus the loss on the last stage), evaluated by a small interpreter over
the stage's equations (the same loop as ``jax.core.eval_jaxpr``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from scipy import sparse
from scipy.optimize import linprog

#: A value in the flattened program: an index into :attr:`SplitProgram.avals`.
ValueId = int


@dataclass(frozen=True)
class FlatEqn:
    """One primitive application: ``outputs = primitive.bind(*inputs, **params)``.

    ``inputs`` entries are value ids, or ``("literal", value)`` for a jaxpr literal.
    """

    primitive: Any
    params: Mapping[str, Any]
    inputs: tuple[Any, ...]
    outputs: tuple[ValueId, ...]


@dataclass(frozen=True)
class StageProgram:
    """What stage ``index`` computes on one micro-batch.

    ``params`` are parameter leaf indices the stage reads (home and shared ones alike),
    ``batch`` batch leaf indices, ``inputs`` activations from earlier stages (value
    ids), ``outputs`` activations later stages read; the last stage also returns the
    loss (``returns_loss``).
    """

    index: int
    eqns: tuple[FlatEqn, ...]
    params: tuple[int, ...]
    batch: tuple[int, ...]
    inputs: tuple[ValueId, ...]
    outputs: tuple[ValueId, ...]
    returns_loss: bool


@dataclass(frozen=True)
class SplitProgram:
    """The whole loss cut into stages, plus where every crossing value goes."""

    stages: tuple[StageProgram, ...]
    avals: tuple[Any, ...]
    param_ids: tuple[ValueId, ...]
    batch_ids: tuple[ValueId, ...]
    consts: Mapping[ValueId, Any]
    loss: ValueId
    home: tuple[int, ...]  # per parameter leaf, the stage that owns and updates it
    consumers: Mapping[ValueId, tuple[int, ...]]  # crossing activation -> reader stages
    producer: Mapping[ValueId, int]  # crossing activation -> producing stage
    batch_dims: tuple[int | None, ...] | None = None  # per value (grouped.batch_dims), if known

    def shared_params(self) -> dict[int, tuple[int, ...]]:
        """Parameter leaf -> stages (other than its home) that read it."""
        out: dict[int, list[int]] = {}
        for stage in self.stages:
            for leaf in stage.params:
                if self.home[leaf] != stage.index:
                    out.setdefault(leaf, []).append(stage.index)
        return {leaf: tuple(stages) for leaf, stages in out.items()}


# ----------------------------------------------------------------------------- flatten


def _is_jit(eqn: jcore.JaxprEqn) -> bool:
    return eqn.primitive.name in ("jit", "pjit", "closed_call", "core_call")


class _Flat:
    """Inline ``jit`` calls of a closed jaxpr into one list of :class:`FlatEqn`."""

    def __init__(self) -> None:
        self.avals: list[Any] = []
        self.eqns: list[FlatEqn] = []
        self.consts: dict[ValueId, Any] = {}

    def new(self, aval: Any) -> ValueId:
        self.avals.append(aval)
        return len(self.avals) - 1

    def inline(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            vid = self.new(var.aval)
            self.consts[vid] = value
            env[var] = vid
        for var, arg in zip(jaxpr.invars, args, strict=True):
            env[var] = arg

        def read(atom: Any) -> Any:
            if isinstance(atom, jcore.Literal):
                return ("literal", atom.val)
            return env[atom]

        for eqn in jaxpr.eqns:
            inputs = [read(v) for v in eqn.invars]
            if _is_jit(eqn):
                inner = eqn.params["jaxpr"]
                outs = self.inline(inner.jaxpr, inner.consts, inputs)
            else:
                outs = [self.new(v.aval) for v in eqn.outvars]
                self.eqns.append(FlatEqn(eqn.primitive, dict(eqn.params), tuple(inputs), tuple(outs)))
            for var, out in zip(eqn.outvars, outs, strict=True):
                env[var] = out
        return [read(v) for v in jaxpr.outvars]


# ----------------------------------------------------------------------------- placement


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def place_equations(
    eqns: Sequence[FlatEqn],
    avals: Sequence[Any],
    consts: Mapping[ValueId, Any],
    param_stage: Mapping[ValueId, int],
    sinks: Sequence[ValueId],
    num_stages: int,
) -> list[int]:
    """The stage of every equation (module docstring, steps 1 to 3).

    ``param_stage`` maps each parameter's value id to its stage; ``sinks`` are the
    values that must be computed by the last stage (the loss). :mod:`.remat` uses the
    same placement to cut one stage into its layers.
    """
    stage_of: dict[ValueId, int] = dict(param_stage)
    placed: list[int] = []
    for eqn in eqns:
        anchored = [stage_of[v] for v in eqn.inputs if isinstance(v, int) and v in stage_of]
        stage = max(anchored) if anchored else 0
        placed.append(stage)
        if anchored:
            for out in eqn.outputs:
                stage_of[out] = stage

    return _min_crossing(eqns, avals, consts, placed, params=set(param_stage), sinks=sinks,
                         num_stages=num_stages)


def _fixed(eqns: Sequence[FlatEqn], consts: Mapping[ValueId, Any], params: set[ValueId]) -> list[bool]:
    """Per equation, whether it must stay on its lower bound: it reads a parameter
    (or a value computed from parameters alone, such as a parameter cast to the
    compute type by mixed precision) and a value that depends on the batch.

    A value depends on the batch unless it is a parameter, a constant, or computed
    from those alone (a broadcast of a layer-norm scale, a causal mask from an
    ``iota``). Equations over such values only are free to move to a later stage.
    """
    batch_free: set[ValueId] = set(params) | set(consts)
    from_params: set[ValueId] = set(params)  # parameters, and values computed from them alone
    out = []
    for eqn in eqns:
        values = [v for v in eqn.inputs if isinstance(v, int)]
        if all(v in batch_free for v in values):
            batch_free.update(eqn.outputs)
            if any(v in from_params for v in values):
                from_params.update(eqn.outputs)
            out.append(False)
        else:
            out.append(any(v in from_params for v in values))
    return out


def _min_crossing(
    eqns: Sequence[FlatEqn], avals: Sequence[Any], consts: Mapping[ValueId, Any], low: list[int], *,
    params: set[ValueId], sinks: Sequence[ValueId], num_stages: int,
) -> list[int]:
    """Place the equations that read no parameter so the fewest bytes cross stages.

    Variables ``y[i, s] = [stage(i) >= s]`` for every equation and boundary
    ``s = 1 .. S-1``, and ``c[v, s] = [value v crosses boundary s]``. A reader's stage is
    at least its producer's (``y[r, s] >= y[p, s]``), a value crosses where a reader
    is past its producer (``c[v, s] >= y[r, s] - y[p, s]``), an equation that reads a
    parameter stays at its lower bound, every other equation is at least at it, and
    the sinks (the loss) must reach the last stage. (An equation reading parameters
    only is not held: see :func:`_fixed`.) Minimising ``sum bytes(v) c[v, s]`` is a
    min-cut: every constraint is a difference of two variables, so the matrix is
    totally unimodular and the LP's optimum is integral (HiGHS, through scipy).
    """
    n, boundaries = len(eqns), num_stages - 1
    if boundaries == 0:
        return [0] * n
    produced = {o: i for i, e in enumerate(eqns) for o in e.outputs}
    reads: dict[ValueId, set[int]] = {}
    for index, eqn in enumerate(eqns):
        for value in eqn.inputs:
            if isinstance(value, int) and value in produced:
                reads.setdefault(value, set()).add(index)
    for sink in sinks:
        if sink in produced:
            reads.setdefault(sink, set()).add(n)  # a virtual reader on the last stage
    crossing = sorted(reads)
    col_c = {v: n + 1 + k for k, v in enumerate(crossing)}
    width = n + 1 + len(crossing)  # per boundary: equations, the virtual reader, values

    def y(i: int, s: int) -> int:
        return (s - 1) * width + i

    def c(v: ValueId, s: int) -> int:
        return (s - 1) * width + col_c[v]

    fixed = _fixed(eqns, consts, params)
    bounds = []
    for s in range(1, num_stages):
        for index in range(n):
            at_least = 1.0 if low[index] >= s else 0.0
            bounds.append((at_least, at_least if fixed[index] else 1.0))
        bounds.append((1.0, 1.0))  # the virtual reader is on the last stage
        bounds.extend((0.0, 1.0) for _ in crossing)
    rows, cols, vals = [], [], []
    row = 0

    def less_equal(terms: list[tuple[int, float]]) -> None:
        nonlocal row
        for col, val in terms:
            rows.append(row)
            cols.append(col)
            vals.append(val)
        row += 1

    for s in range(1, num_stages):
        for v in crossing:
            p = produced[v]
            for r in reads[v]:
                less_equal([(y(p, s), 1.0), (y(r, s), -1.0)])  # y_p <= y_r
                less_equal([(y(r, s), 1.0), (y(p, s), -1.0), (c(v, s), -1.0)])
        if s + 1 < num_stages:
            for i in range(n):
                less_equal([(y(i, s + 1), 1.0), (y(i, s), -1.0)])  # y[i, s+1] <= y[i, s]
    cost = np.zeros(boundaries * width)
    for s in range(1, num_stages):
        for v in crossing:
            cost[c(v, s)] = _nbytes(avals[v])
        for i in range(n):
            cost[y(i, s)] = 1e-6  # ties: the earliest stage
    matrix = sparse.csr_matrix((vals, (rows, cols)), shape=(row, boundaries * width))
    result = linprog(cost, A_ub=matrix, b_ub=np.zeros(row), bounds=bounds, method="highs")
    if result.status != 0:
        raise RuntimeError(f"stage placement LP failed: {result.message}")  # a bug
    x = np.rint(result.x).astype(int)
    return [int(sum(x[y(i, s)] for s in range(1, num_stages))) for i in range(n)]


def _private_parameter_values(flat: _Flat, params: set[ValueId]) -> None:
    """Give every reader of a value computed from parameters alone its own copy of the
    equations that compute it.

    Mixed precision casts every parameter once, at the top of the loss; GPT's tied
    embedding is then one cast read by the first stage (the lookup) and the last (the
    LM head). Shared, that cast would cross between the stages as an activation, and
    its gradient come back, once per micro-batch; copied, each stage casts the shared
    parameter itself, and the parameter's gradient goes home once per step. A copy is
    an equation over parameters only: cheap, and placed with its reader.
    """
    derived: dict[ValueId, FlatEqn] = {}  # value -> the equation that computes it from parameters
    read: set[ValueId] = set()
    out: list[FlatEqn] = []

    def copy(value: ValueId) -> ValueId:
        eqn = derived[value]
        inputs = tuple(copy(i) if isinstance(i, int) and i in derived else i for i in eqn.inputs)
        outputs = tuple(flat.new(flat.avals[o]) for o in eqn.outputs)
        out.append(FlatEqn(eqn.primitive, eqn.params, inputs, outputs))
        derived.update((new, out[-1]) for new in outputs)
        return outputs[eqn.outputs.index(value)]

    for eqn in flat.eqns:
        values = [v for v in eqn.inputs if isinstance(v, int)]
        inputs = []
        for value in eqn.inputs:
            if isinstance(value, int) and value in derived:
                value = copy(value) if value in read else value
                read.add(value)
            inputs.append(value)
        eqn = FlatEqn(eqn.primitive, eqn.params, tuple(inputs), eqn.outputs)
        if values and all(v in params or v in derived or v in flat.consts for v in values) and any(
                v in params or v in derived for v in values):
            derived.update((o, eqn) for o in eqn.outputs)
        out.append(eqn)
    flat.eqns = out


def flatten(loss_fn: Callable[[Any, Any], jax.Array], params: Any, micro_batch: Any) -> tuple[_Flat, list[ValueId], Any]:
    """``loss_fn`` traced on abstract ``params`` and ``micro_batch`` and inlined into one
    equation list: the program, the value ids of its arguments (parameter leaves, then
    batch leaves) and the loss's value id. Values are numbered in trace order, so two
    traces of the same code at different batch sizes number them alike (the copies of
    :func:`_private_parameter_values` too)."""
    closed = jax.make_jaxpr(loss_fn)(params, micro_batch)
    flat = _Flat()
    invars = [flat.new(v.aval) for v in closed.jaxpr.invars]
    (loss,) = flat.inline(closed.jaxpr, closed.consts, invars)
    _private_parameter_values(flat, set(invars[: len(jax.tree.leaves(params))]))
    return flat, invars, loss


def split_loss(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    micro_batch: Any,
    param_stage: Sequence[int],
    num_stages: int,
) -> SplitProgram:
    """Trace ``loss_fn`` on abstract ``params`` and one ``micro_batch`` and cut it.

    ``param_stage[k]`` is the plan's stage for flat parameter leaf ``k`` (in
    ``jax.tree.leaves(params)`` order). Raises ``ValueError`` if a stage receives no
    work (the plan and the model disagree).
    """
    flat, invars, loss = flatten(loss_fn, params, micro_batch)
    if not isinstance(loss, int):
        raise ValueError("the loss is a constant: it does not depend on the parameters")
    n_params = len(jax.tree.leaves(params))
    param_ids, batch_ids = invars[:n_params], invars[n_params:]
    placed = place_equations(flat.eqns, flat.avals, flat.consts, dict(zip(param_ids, param_stage, strict=True)),
                             [loss], num_stages)

    produced_on: dict[ValueId, int] = {}
    for eqn, stage in zip(flat.eqns, placed, strict=True):
        for out in eqn.outputs:
            produced_on[out] = stage
    leaf_of = {vid: k for k, vid in enumerate(param_ids)}
    batch_leaf_of = {vid: k for k, vid in enumerate(batch_ids)}
    readers: dict[ValueId, set[int]] = {}
    for eqn, stage in zip(flat.eqns, placed, strict=True):
        for value in eqn.inputs:
            if isinstance(value, int):
                readers.setdefault(value, set()).add(stage)

    home = [
        min(readers.get(vid, {param_stage[k]})) for k, vid in enumerate(param_ids)
    ]
    consumers: dict[ValueId, tuple[int, ...]] = {}
    producer: dict[ValueId, int] = {}
    for value, stages in readers.items():
        src = produced_on.get(value)
        later = tuple(sorted(s for s in stages if src is not None and s != src))
        if later:
            consumers[value] = later
            producer[value] = src  # type: ignore[assignment]

    programs = []
    for s in range(num_stages):
        eqns = tuple(e for e, p in zip(flat.eqns, placed, strict=True) if p == s)
        if not eqns:
            raise ValueError(
                f"stage {s} of the plan gets no computation of this model; the plan was "
                "made for a different model (re-run `alpajob plan`)"
            )
        reads = sorted(readers_of_stage(eqns))
        programs.append(
            StageProgram(
                index=s,
                eqns=eqns,
                params=tuple(sorted(leaf_of[v] for v in reads if v in leaf_of)),
                batch=tuple(sorted(batch_leaf_of[v] for v in reads if v in batch_leaf_of)),
                inputs=tuple(v for v in reads if producer.get(v, s) != s),
                outputs=tuple(v for v in sorted(consumers) if producer[v] == s),
                returns_loss=produced_on[loss] == s,
            )
        )
    if produced_on[loss] != num_stages - 1:
        raise ValueError("the loss is not computed on the last stage of the plan")
    return SplitProgram(
        stages=tuple(programs),
        avals=tuple(flat.avals),
        param_ids=tuple(param_ids),
        batch_ids=tuple(batch_ids),
        consts=flat.consts,
        loss=loss,
        home=tuple(home),
        consumers=consumers,
        producer=producer,
    )


def readers_of_stage(eqns: Sequence[FlatEqn]) -> set[ValueId]:
    """Values the equations read but do not produce (the stage's free inputs)."""
    produced = {o for e in eqns for o in e.outputs}
    return {v for e in eqns for v in e.inputs if isinstance(v, int) and v not in produced}


# ----------------------------------------------------------------------------- evaluate


def stage_env(
    split: SplitProgram, stage: StageProgram, params: Sequence[Any], batch: Sequence[Any], inputs: Sequence[Any]
) -> dict[ValueId, Any]:
    """A stage's arguments by value id (``stage.params``, ``batch``, ``inputs`` order)."""
    env: dict[ValueId, Any] = {}
    for leaf, value in zip(stage.params, params, strict=True):
        env[split.param_ids[leaf]] = value
    for leaf, value in zip(stage.batch, batch, strict=True):
        env[split.batch_ids[leaf]] = value
    for vid, value in zip(stage.inputs, inputs, strict=True):
        env[vid] = value
    return env


def read_atom(split: SplitProgram, env: Mapping[ValueId, Any], atom: Any) -> Any:
    """An equation input's value: a literal's, a computed value's, or a constant's."""
    if isinstance(atom, tuple):
        return atom[1]
    return env[atom] if atom in env else split.consts[atom]


def stage_function(
    split: SplitProgram, stage: StageProgram, pins: Mapping[ValueId, Any] | None = None
) -> Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], tuple[list[Any], Any]]:
    """``f(params, batch, inputs) -> (outputs, loss_or_None)`` for one stage.

    Arguments follow ``stage.params``, ``stage.batch`` and ``stage.inputs`` order.
    ``pins`` maps a value id to the sharding it is constrained to
    (``jax.lax.with_sharding_constraint``) as soon as it is computed.
    """
    pins = dict(pins or {})

    def run(params: Sequence[Any], batch: Sequence[Any], inputs: Sequence[Any]) -> tuple[list[Any], Any]:
        env = stage_env(split, stage, params, batch, inputs)
        for eqn in stage.eqns:
            bind_params = eqn.primitive.get_bind_params(eqn.params)
            result = eqn.primitive.bind(*[read_atom(split, env, v) for v in eqn.inputs], **bind_params)
            results = result if eqn.primitive.multiple_results else [result]
            for vid, value in zip(eqn.outputs, results, strict=True):
                env[vid] = jax.lax.with_sharding_constraint(value, pins[vid]) if vid in pins else value
        outputs = [env[v] for v in stage.outputs]
        return outputs, (env[split.loss] if stage.returns_loss else None)

    return run


def is_differentiable(aval: Any) -> bool:
    """Whether a value of this type carries a gradient (floating point, bfloat16 and
    the float8 types included: NumPy does not count those as inexact, JAX does)."""
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))
