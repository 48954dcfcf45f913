"""A traced training step -> an :class:`~alpajob.planner.graph.opgraph.OpGraph` (the
planner's only JAX-importing module).

The planner never runs model code: the trainer traces its own step
(:func:`alpajob.trainer_image.step.trace_step`: ``jax.make_jaxpr`` on abstract shapes,
nothing allocated) and hands over a :class:`TracedStep`. Pipeline::

    TracedStep.jaxpr (symbolic batch, or batch b) ----.
                                                      v
        flatten: inline jit / custom_jvp / custom_vjp / remat / closed_call,
                 scan body once (x length), while body once, cond's costliest branch
                                                      |
        ops + tensors (flops, bytes, plain params) at b ---+--> phases --> anchors
        shapes at b vs 2b (the same trace, or TracedStep.jaxpr_2x) -> Tensor.batch_dim

``step(params, opt_state, batch) -> (loss, grads, new_params, new_opt_state)`` is
``jax.value_and_grad(loss)`` followed by the optax update and ``optax.apply_updates``
(the trainer's :func:`~alpajob.trainer_image.step.make_train_step`, which it runs too).

**FLOPs** per op (times ``Op.multiplier``, the trip count of enclosing ``scan`` s):
``dot_general`` ``2 * |out| * prod(contracting sizes)``; ``conv_general_dilated``
``2 * |out| * (in_features / groups) * prod(kernel spatial)``; elementwise and
transcendental ops ``|out|``; reductions and cumulative ops ``|input|``; windowed
reductions ``|out| * |window|``; data movement (reshape, broadcast, transpose, slice,
concatenate, gather, pad, ...) 0. ``bytes_accessed`` is the bytes of every non-literal
input plus every output.

**Phases**: forward ops are the ancestors of the loss; backward ops are the other
ancestors of the gradients; update ops the other ancestors of the new parameters and
optimizer state (ops that feed no output: see :func:`alpajob.planner.graph.attribution.phases`).

**Anchors** (the forward op an op is attributed to, see :mod:`.opgraph`):

- forward op: itself;
- backward op: the largest anchor among the residuals it consumes (its inputs
  computed from forward values only: by forward ops, or by backward-phase ops such as
  ``1 - tanh(x)^2`` that read nothing else); with none, the smallest anchor of its
  other (cotangent-carrying) producers: the ``add_any`` that joins a residual
  connection's skip path (anchored one layer later) to the gradient coming out of the
  layer belongs to the earlier layer, and taking the largest would drag every
  residual-free op of the backward pass (bias gradients, the stream itself) into the
  last layer; a parameter the op reads directly (``dy @ W.T``), or a value made from
  one parameter alone (its cast to the compute type under mixed precision), counts as a residual
  anchored at the latest forward op that read it no later than that smallest anchor
  (the op being differentiated: for a tied embedding, the LM head's matmul rather
  than the lookup), so the gradient of an MLP's hidden layer is computed in the MLP's
  layer instead of being shipped there across a pipeline cut;
  a backward op whose results only feed one parameter's gradient (``x^T @ dy`` for a
  weight ``W``) is moved no earlier than the forward op of ``W`` it differentiates
  (chosen as for a parameter read directly: for a tied embedding's LM head gradient,
  the LM head, not the lookup), since the residual ``x`` usually comes from the
  previous layer;
- update op: the smallest first-forward-consumer of the parameters it reads, directly
  or through update producers (``p - lr * u`` lands with ``p``'s layer); an optimizer
  state leaf that mirrors a parameter (Adam's ``mu``/``nu`` for ``p``: same path suffix
  and shape) counts as reading that parameter; with none, the smallest anchor of its
  producers;
- a backward or update op computed from constants only (the zeros that the
  backward of ``jnp.where`` broadcasts, a mask built from ``iota``): the smallest
  anchor of its consumers, so that it is built in the stage that uses it instead
  of being shipped there (a causal mask's [b, heads, s, s] zeros would otherwise
  land in the last layer and cross every pipeline cut);
- anything left: the last forward op.

**Batch dimension**: the step is traced once with a symbolic batch size ``b``
(``jax.export.symbolic_shape``), and every shape, parameter and cost is that trace's
evaluated at ``b`` and at ``2b``; or, where the model's code needs a concrete batch
size, traced at ``b`` and ``2b`` (both traces must flatten to the same ops). A tensor
whose shapes differ in exactly one dimension, by a factor 2, gets that dimension as
``batch_dim``; tensors that differ otherwise (not linear in the batch) get None.
Sizes computed from the symbolic batch (``jnp.mean`` over the batch divides by
``dim_as_value(b)``) are folded into literals, as a concrete trace computes them in
Python; where such a size would become a tensor (an array filled with it, a
function's argument or result), the symbolic trace is refused
(:class:`NotBatchPolymorphic`) and the caller traces twice.

**Loops**: a ``scan`` body is inlined once. Its per-iteration slices of the scanned
inputs and outputs are the full stacked tensors (one extra leading dimension of size
``multiplier``), while the body ops keep their per-iteration ``params``; carries map to
the initial carry (inside) and the final carry (outside). A ``while`` body is inlined
once with multiplier 1 (its trip count is unknown when tracing) and its condition is
dropped. A ``cond`` inlines its costliest branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax.extend.core as jcore

from alpajob.planner.graph.attribution import (
    RawOp,
    anchors,
    parameter_preprocessing_last,
    phases,
)
from alpajob.planner.graph.jaxpr_costs import (
    BatchAt,
    DimValue,
    aval_nbytes,
    jaxpr_flops,
    op_flops,
    op_params,
)
from alpajob.planner.graph.opgraph import Op, OpGraph, Tensor, TensorRole


@dataclass(frozen=True)
class TracedStep:
    """A training step, traced by its owner (the trainer) for the planner.

    ``jaxpr`` is ``jax.make_jaxpr(step)(params, opt_state, batch)`` with the batch
    size ``batch_multiple`` times the symbol ``batch_symbol`` (then ``jaxpr_2x`` is
    None), or at ``batch_size``
    with ``jaxpr_2x`` the same at ``2 * batch_size`` (the batch dimension of every
    tensor is found by comparing the two), where ``step(params, opt_state, batch) ->
    (loss, grads, new_params, new_opt_state)``. The inputs are flattened in that
    order: ``len(param_names)`` parameters, ``len(opt_state_names)`` optimizer-state
    leaves, then the batch. Names are pytree paths as :func:`alpajob.api.plan.path_name`
    spells them; an optimizer-state leaf whose path ends with a parameter's path (Adam's
    ``mu``/``nu``) is attributed to that parameter.
    """

    name: str
    jaxpr: jcore.ClosedJaxpr
    jaxpr_2x: jcore.ClosedJaxpr | None
    batch_size: int
    param_names: tuple[str, ...]
    opt_state_names: tuple[str, ...]
    batch_symbol: str | None = None
    batch_multiple: int = 1


class NotBatchPolymorphic(ValueError):
    """A step traced with a symbolic batch size uses that size as a value in a way a
    concrete trace would not write the same (see the module docstring): trace it at
    two concrete batch sizes instead."""


# ----------------------------------------------------------------------------- flatten


class _Flattener:
    """Walks a jaxpr, inlining calls and loops, into a flat list of ops over tensors.

    ``env`` maps a ``Var`` to its tensor id, or to None for a literal. With
    ``costs=False`` only tensor shapes are recorded (the second, batch-probing trace).
    ``at`` evaluates dimensions (``int``, or :class:`BatchAt` for a symbolic trace);
    ``at_2x``, given for a symbolic trace, evaluates them at twice the batch for
    ``shapes_2x``. ``sizes`` holds the vars whose value is a size computed from the
    symbolic batch (literals of a concrete trace).
    """

    def __init__(self, costs: bool, at: DimValue = int, at_2x: DimValue | None = None) -> None:
        self.costs = costs
        self.at = at
        self.at_2x = at_2x
        self.shapes: list[tuple[int, ...]] = []
        self.shapes_2x: list[tuple[int, ...]] = []
        self.dtypes: list[str] = []
        self.roles: list[TensorRole] = []
        self.ops: list[RawOp] = []
        self.sizes: set[Any] = set()

    def new_tensor(self, aval: Any, role: TensorRole) -> int:
        shape = getattr(aval, "shape", ())
        self.shapes.append(tuple(self.at(d) for d in shape))
        if self.at_2x is not None:
            self.shapes_2x.append(tuple(self.at_2x(d) for d in shape))
        dtype = getattr(aval, "dtype", None)
        self.dtypes.append(str(getattr(dtype, "name", dtype)))
        self.roles.append(role)
        return len(self.shapes) - 1

    def read(self, env: dict[Any, int | None], atom: Any) -> int | None:
        if isinstance(atom, jcore.Literal):
            return None
        return env[atom]

    def result(self, env: dict[Any, int | None], atom: Any) -> int:
        """The tensor of an output atom; a literal output becomes a constant tensor."""
        tid = self.read(env, atom)
        if tid is None:
            tid = self.new_tensor(atom.aval, TensorRole.CONSTANT)
        return tid

    def bind_consts(self, env: dict[Any, int | None], closed: Any) -> jcore.Jaxpr:
        """Bind a (Closed)Jaxpr's constvars to new constant tensors; return the Jaxpr."""
        jaxpr = closed.jaxpr if isinstance(closed, jcore.ClosedJaxpr) else closed
        for var in jaxpr.constvars:
            env[var] = self.new_tensor(var.aval, TensorRole.CONSTANT)
        return jaxpr

    def call(
        self,
        closed: Any,
        args: Sequence[int | None],
        multiplier: int,
        prebound: dict[Any, Any] | None = None,
    ) -> list[int | None]:
        """Inline ``closed`` applied to tensors ``args``; return its outputs' tensors."""
        env: dict[Any, int | None] = {}
        jaxpr = self.bind_consts(env, closed)
        for var, tid in zip(jaxpr.invars, args, strict=True):
            env[var] = tid
        self.walk(jaxpr, env, multiplier, prebound or {})
        if any(v in self.sizes for v in jaxpr.outvars if isinstance(v, jcore.Var)):
            raise NotBatchPolymorphic("a function returns a size computed from the batch size")
        return [self.read(env, v) for v in jaxpr.outvars]

    def _size_eqn(self, eqn: jcore.JaxprEqn) -> bool:
        """Whether ``eqn`` computes a size from the symbolic batch (``dim_as_value``,
        or scalar arithmetic on such sizes and literals): a concrete trace computes it
        in Python and writes a literal, so it is no op here (its outputs join
        :attr:`sizes`). Raises :class:`NotBatchPolymorphic` where such a size enters a
        call or loop, or fills a non-scalar value."""
        if eqn.primitive.name == "dim_as_value":
            self.sizes.update(eqn.outvars)
            return True
        reads = [v for v in eqn.invars if isinstance(v, jcore.Var) and v in self.sizes]
        if not reads:
            return False
        if any(True for _ in jcore.jaxprs_in_params(eqn.params)):
            raise NotBatchPolymorphic(
                f"a size computed from the batch size enters {eqn.primitive.name}")
        computed = all(isinstance(v, jcore.Literal) or v in self.sizes for v in eqn.invars)
        if not computed:
            return False  # an op of tensors and a size: the size reads as a literal
        if any(getattr(v.aval, "shape", ()) != () for v in eqn.outvars):
            raise NotBatchPolymorphic(
                f"{eqn.primitive.name} makes an array from a size computed from the batch size")
        self.sizes.update(eqn.outvars)
        return True

    def walk(
        self,
        jaxpr: jcore.Jaxpr,
        env: dict[Any, int | None],
        multiplier: int,
        prebound: dict[Any, Any],
    ) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if (self.sizes or name == "dim_as_value") and self._size_eqn(eqn):
                env.update((var, None) for var in eqn.outvars)
                continue
            args = [self.read(env, v) for v in eqn.invars]
            if name == "scan":
                outs = self.scan(eqn, args, multiplier)
            elif name == "while":
                p = eqn.params
                skip = p["cond_nconsts"]
                outs = self.call(p["body_jaxpr"], args[skip:], multiplier)
            elif name == "cond":
                branches = eqn.params["branches"]
                costs = [jaxpr_flops(b.jaxpr, self.at) for b in branches]
                best = branches[costs.index(max(costs))]
                outs = self.call(best, args[1:], multiplier)
            else:
                callee = _inlinable(eqn)
                if callee is not None:
                    outs = self.call(callee, args, multiplier)
                else:
                    outs = self.emit(eqn, args, multiplier, prebound)
            for var, tid in zip(eqn.outvars, outs, strict=True):
                env[var] = tid if tid is not None else self.new_tensor(var.aval, TensorRole.CONSTANT)

    def scan(self, eqn: jcore.JaxprEqn, args: list[int | None], multiplier: int) -> list:
        """Inline a scan body once, FLOPs times ``length`` (see the module docstring)."""
        p = eqn.params
        n_carry = p["num_carry"]
        body = p["jaxpr"]
        inner_outs = body.jaxpr.outvars[n_carry:]
        excluded = set(body.jaxpr.invars) | set(body.jaxpr.outvars[:n_carry])
        prebound: dict[Any, Any] = {}  # per-iteration ys value -> stacked aval
        for inner, outer in zip(inner_outs, eqn.outvars[n_carry:], strict=True):
            if isinstance(inner, jcore.Var) and inner not in excluded:
                prebound.setdefault(inner, outer.aval)
        return self.call(body, args, multiplier * self.at(p["length"]), prebound)

    def emit(
        self,
        eqn: jcore.JaxprEqn,
        args: list[int | None],
        multiplier: int,
        prebound: dict[Any, Any],
    ) -> list[int]:
        """Record ``eqn`` as one op; return its output tensors.

        An output in ``prebound`` (a scan body's per-iteration output) gets the stacked
        shape given there.
        """
        outs = [
            self.new_tensor(prebound.get(var, var.aval), TensorRole.ACTIVATION)
            for var in eqn.outvars
        ]
        inputs = tuple(t for t in args if t is not None)
        if self.costs:
            at = self.at
            flops = op_flops(eqn, at) * multiplier
            moved = sum(aval_nbytes(v.aval, at) for v in eqn.invars
                        if not isinstance(v, jcore.Literal) and v not in self.sizes)
            moved += sum(aval_nbytes(v.aval, at) for v in eqn.outvars)
            params = op_params(eqn, at)
        else:
            flops, moved, params = 0.0, 0, ()
        self.ops.append(
            RawOp(
                eqn.primitive.name,
                inputs,
                tuple(outs),
                float(flops),
                float(moved * multiplier),
                params,
                multiplier,
            )
        )
        return outs


def _inlinable(eqn: jcore.JaxprEqn) -> Any:
    """The jaxpr of a call-like eqn (jit, custom_jvp/vjp, remat, closed_call ...), or None.

    An eqn is call-like when exactly one of its parameters is a jaxpr and that jaxpr
    takes and returns as many values as the eqn.
    """
    found = [
        v for v in eqn.params.values() if isinstance(v, jcore.ClosedJaxpr | jcore.Jaxpr)
    ]
    if len(found) != 1:
        return None
    inner = found[0].jaxpr if isinstance(found[0], jcore.ClosedJaxpr) else found[0]
    if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
        return found[0]
    return None


def _flatten(
    closed: jcore.ClosedJaxpr, n_params: int, n_opt: int, costs: bool,
    at: DimValue = int, at_2x: DimValue | None = None,
) -> tuple[_Flattener, list[int]]:
    """Flatten the step's jaxpr; return the flattener and the step outputs' tensors."""
    flat = _Flattener(costs, at, at_2x)
    env: dict[Any, int | None] = {}
    for index, var in enumerate(closed.jaxpr.invars):
        if index < n_params:
            role = TensorRole.PARAM
        elif index < n_params + n_opt:
            role = TensorRole.OPT_STATE
        else:
            role = TensorRole.BATCH
        env[var] = flat.new_tensor(var.aval, role)
    jaxpr = flat.bind_consts(env, closed)
    flat.walk(jaxpr, env, 1, {})
    return flat, [flat.result(env, v) for v in jaxpr.outvars]


# ----------------------------------------------------------------------------- batch dim


def _batch_dims(
    small: Sequence[tuple[int, ...]], large: Sequence[tuple[int, ...]]
) -> list[int | None]:
    """Per tensor, the single dimension that doubles between the two traces, or None."""
    dims: list[int | None] = []
    for a, b in zip(small, large, strict=True):
        diff = [d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        dims.append(diff[0] if len(diff) == 1 and b[diff[0]] == 2 * a[diff[0]] else None)
    return dims


def _check_same_structure(a: _Flattener, b: _Flattener, batch_size: int) -> None:
    problem = None
    if len(a.ops) != len(b.ops) or len(a.shapes) != len(b.shapes):
        problem = f"{len(a.ops)} vs {len(b.ops)} ops, {len(a.shapes)} vs {len(b.shapes)} tensors"
    else:
        for i, (p, q) in enumerate(zip(a.ops, b.ops, strict=True)):
            if (p.primitive, p.inputs, p.outputs) != (q.primitive, q.inputs, q.outputs):
                problem = f"op {i} is {p.primitive}{p.inputs} vs {q.primitive}{q.inputs}"
                break
        else:
            for t, (x, y) in enumerate(zip(a.shapes, b.shapes, strict=True)):
                if len(x) != len(y):
                    problem = f"tensor {t} has rank {len(x)} vs {len(y)}"
                    break
    if problem:
        raise ValueError(
            f"the training step traces to different programs at batch {batch_size} and "
            f"{2 * batch_size} ({problem}); the planner needs a step whose operations "
            "do not depend on the batch size (only its shapes may)"
        )


# ----------------------------------------------------------------------------- public


def extract_graph(traced: TracedStep) -> OpGraph:
    """The :class:`OpGraph` of a traced training step (module docstring).

    Raises ``ValueError`` if the step's structure depends on the batch size, and
    :class:`NotBatchPolymorphic` if a symbolic trace uses the batch size as a value
    where a concrete trace would differ.
    """
    batch_size = traced.batch_size
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    n_params, n_opt = len(traced.param_names), len(traced.opt_state_names)
    if traced.jaxpr_2x is None:
        symbol, multiple = traced.batch_symbol, traced.batch_multiple
        if symbol is None or multiple < 1 or batch_size % multiple:
            raise ValueError("a TracedStep without jaxpr_2x needs its batch_symbol, and a "
                             "batch_multiple that divides its batch_size")
        flat, outputs = _flatten(traced.jaxpr, n_params, n_opt, costs=True,
                                 at=BatchAt(symbol, batch_size // multiple),
                                 at_2x=BatchAt(symbol, 2 * batch_size // multiple))
        batch_dims = _batch_dims(flat.shapes, flat.shapes_2x)
    else:
        flat, outputs = _flatten(traced.jaxpr, n_params, n_opt, costs=True)
        flat_2x, _ = _flatten(traced.jaxpr_2x, n_params, n_opt, costs=False)
        _check_same_structure(flat, flat_2x, batch_size)
        batch_dims = _batch_dims(flat.shapes, flat_2x.shapes)
    constants = frozenset(t for t, role in enumerate(flat.roles) if role is TensorRole.CONSTANT)
    flat.ops = parameter_preprocessing_last(flat.ops, frozenset(range(n_params)), constants)

    param_ids = tuple(range(n_params))
    opt_ids = tuple(range(n_params, n_params + n_opt))
    batch_ids = tuple(range(n_params + n_opt, len(traced.jaxpr.jaxpr.invars)))
    loss_id = outputs[0]
    grads = tuple(outputs[1 : 1 + n_params])
    new_params = tuple(outputs[1 + n_params : 1 + 2 * n_params])

    names = traced.param_names
    owner = _owners(flat.shapes, names, traced.opt_state_names, n_params)
    producer = {t: i for i, op in enumerate(flat.ops) for t in op.outputs}
    op_phases = phases(flat.ops, producer, loss_id, grads, outputs[1 + n_params :])
    op_anchors = anchors(flat.ops, op_phases, producer, owner, param_ids, grads, constants)

    tensors = tuple(
        Tensor(t, flat.shapes[t], flat.dtypes[t], flat.roles[t], batch_dims[t])
        for t in range(len(flat.shapes))
    )
    ops = tuple(
        Op(
            i,
            raw.primitive,
            raw.inputs,
            raw.outputs,
            raw.flops,
            raw.bytes_accessed,
            op_phases[i],
            op_anchors[i],
            raw.params,
            raw.multiplier,
        )
        for i, raw in enumerate(flat.ops)
    )
    return OpGraph(
        name=traced.name,
        ops=ops,
        tensors=tensors,
        params=param_ids,
        opt_state=opt_ids,
        batch=batch_ids,
        loss=loss_id,
        grads=grads,
        new_params=new_params,
        batch_size=batch_size,
        param_names=names,
    )


def _owners(
    shapes: Sequence[tuple[int, ...]], names: Sequence[str], opt_names: Sequence[str],
    n_params: int,
) -> dict[int, int]:
    """Map each parameter and each optimizer-state leaf that mirrors one to its tensor id.

    An optimizer leaf mirrors parameter ``p`` when its pytree path ends with ``p``'s path
    and the shapes agree (optax's ``mu``/``nu`` trees copy the parameter tree).
    """
    owner = {t: t for t in range(n_params)}
    by_name = {name: t for t, name in enumerate(names) if name}
    for k, path in enumerate(opt_names):
        tensor = n_params + k
        parts = path.split("/")
        for start in range(len(parts)):
            param = by_name.get("/".join(parts[start:]))
            if param is not None and shapes[param] == shapes[tensor]:
                owner[tensor] = param
                break
    return owner
