"""The training step the trainer runs, and its trace for the planner.

``step(params, opt_state, batch) -> (loss, grads, new_params, new_opt_state)`` is
``jax.value_and_grad(loss)`` followed by the optax update and
``optax.apply_updates`` (:func:`make_train_step`). The optimizer's moments are kept in
float32 whatever the parameters' dtype (:func:`init_optimizer_state`).

The planner reads the step, it never calls it: :func:`trace_step` traces it with
``jax.make_jaxpr`` on abstract shapes (``jax.eval_shape`` of ``init``: nothing is
allocated, so a 39B-parameter model traces on a laptop) once, with a symbolic batch
size (``jax.export.symbolic_shape``), and :func:`graph_of` hands that
:class:`~alpajob.planner.graph.extract.TracedStep` to the planner's
:func:`~alpajob.planner.graph.extract.extract_graph`, which evaluates its shapes at the
batch size and at twice it. A model whose code needs a concrete batch size (Python
arithmetic on it, ``int(x.shape[0])``) is traced twice instead, at the batch size and
at twice it, with a note saying why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from alpajob.api.errors import AlpaJobError, ManifestError
from alpajob.api.plan import path_name
from alpajob.api.spec import LRSchedule, Optimizer, OptimizerSpec, TrainingSpec
from alpajob.planner.graph.extract import NotBatchPolymorphic, TracedStep, extract_graph
from alpajob.planner.graph.opgraph import OpGraph, with_batch_size
from alpajob.planner.plan.collection import fewer_collections
from alpajob.trainer_image.precision import all_finite


class TrainableModel(Protocol):
    """What the step needs of a model (a zoo ``ModelDef`` or a user's entrypoint)."""

    @property
    def name(self) -> str: ...
    @property
    def init(self) -> Callable[[jax.Array], Any]: ...
    @property
    def loss(self) -> Callable[[Any, Any], jax.Array]: ...
    #: batch size -> the batch's ``jax.ShapeDtypeStruct`` leaves; called with an int,
    #: and by :func:`trace_step` with a symbolic dimension (``jax.export``).
    @property
    def batch_shapes(self) -> Callable[[Any], Any]: ...


def learning_rate_schedule(spec: OptimizerSpec, steps: int) -> optax.ScalarOrSchedule:
    """The learning rate at each step: linear warm-up from 0 over ``warmup_steps``, then
    ``schedule`` from the peak over the rest of ``steps`` (a plain number when constant
    without warm-up)."""
    peak = float(spec.learning_rate or 0.0)
    warmup = min(spec.warmup_steps, max(steps - 1, 0))
    if spec.schedule is LRSchedule.CONSTANT and warmup == 0:
        return peak
    if spec.schedule is LRSchedule.COSINE:
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), 0.0)
    rest = (optax.constant_schedule(peak) if spec.schedule is LRSchedule.CONSTANT
            else optax.linear_schedule(peak, 0.0, max(steps - warmup, 1)))
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), rest], [warmup])


def _decayed(params: Any) -> Any:
    """Weight decay applies to matrices, not to biases and norm scales (1-D leaves)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(spec: OptimizerSpec, steps: int) -> optax.GradientTransformation:
    """The optax optimizer of ``spec`` (``spec.training.optimizer``) for a run of ``steps``.

    Adam's first moment is kept in float32 (``mu_dtype``); :func:`init_optimizer_state`
    makes the second one float32 too, whatever the parameter dtype. ``clip_norm``
    clips the global gradient norm before the update; ``weight_decay`` is decoupled
    (AdamW), on matrices only.
    """
    lr = learning_rate_schedule(spec, steps)
    if spec.name is Optimizer.SGD:
        core = optax.sgd(lr)
        if spec.weight_decay:
            core = optax.chain(optax.add_decayed_weights(spec.weight_decay, _decayed), core)
    elif spec.name is Optimizer.ADAMW or spec.weight_decay:
        core = optax.adamw(lr, spec.b1, spec.b2, mu_dtype=jnp.float32,
                           weight_decay=spec.weight_decay, mask=_decayed)
    else:
        core = optax.adam(lr, spec.b1, spec.b2, mu_dtype=jnp.float32)
    if spec.clip_norm is not None:
        return optax.chain(optax.clip_by_global_norm(spec.clip_norm), core)
    return core


def training_optimizer(training: TrainingSpec, steps: int | None = None) -> optax.GradientTransformation:
    """The optimizer ``spec.training`` asks for, for ``steps`` (default its own)."""
    return make_optimizer(training.optimizer_spec, steps or training.steps)


def named_optimizer(name: Optimizer | str, learning_rate: float = 1e-4) -> optax.GradientTransformation:
    """The optimizer called ``name`` at a constant ``learning_rate`` (tests, benchmarks);
    an unknown name names ``spec.training.optimizer``."""
    try:
        kind = Optimizer(name.lower() if isinstance(name, str) else name)
    except ValueError:
        choices = ", ".join(o.value for o in Optimizer)
        raise ManifestError("spec.training.optimizer",
                            f"unknown optimizer {name!r}; choose one of {choices}") from None
    return make_optimizer(OptimizerSpec(name=kind, learning_rate=learning_rate), steps=1)


def init_optimizer_state(optimizer: optax.GradientTransformation, params: Any) -> Any:
    """``optimizer.init`` on float32 copies of the floating parameters (float32 moments)."""

    def widen(leaf: Any) -> Any:
        floating = jnp.issubdtype(leaf.dtype, jnp.floating)
        return leaf.astype(jnp.float32) if floating else leaf

    return optimizer.init(jax.tree.map(widen, params))


def make_train_step(
    loss: Callable[[Any, Any], jax.Array], optimizer: optax.GradientTransformation
) -> Callable[[Any, Any, Any], tuple[Any, Any, Any, Any]]:
    """``step(params, opt_state, batch) -> (loss, grads, new_params, new_opt_state)``."""

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any, Any]:
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        return value, grads, optax.apply_updates(params, updates), new_opt_state

    return step


def make_scaled_train_step(
    loss: Callable[[Any, Any], jax.Array], optimizer: optax.GradientTransformation
) -> Callable[[Any, Any, Any, jax.Array], tuple[Any, Any, Any, Any]]:
    """``step(params, opt_state, batch, scale) -> (loss, finite, new_params,
    new_opt_state)`` with dynamic loss scaling (:mod:`.precision`): the loss is scaled
    for the backward pass and the gradients unscaled; a step with a non-finite gradient
    leaves parameters and optimizer state as they were (``finite`` is False)."""

    def step(params: Any, opt_state: Any, batch: Any, scale: jax.Array) -> tuple[Any, Any, Any, Any]:
        def scaled(p: Any) -> tuple[jax.Array, jax.Array]:
            value = loss(p, batch)
            return value * scale, value

        (_, value), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = all_finite(grads)
        updates, new_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = functools.partial(jnp.where, finite)
        return (value, finite, jax.tree.map(keep, new_params, params),
                jax.tree.map(keep, new_state, opt_state))

    return step


#: The symbol the batch size is traced as (:func:`trace_step` with ``symbolic``).
BATCH_SYMBOL = "b"


def trace_step(model: TrainableModel, batch_size: int,
               optimizer: optax.GradientTransformation | None = None, *,
               symbolic: bool = False) -> TracedStep:
    """The model's training step traced at ``batch_size`` and ``2 * batch_size``, or
    with ``symbolic`` once with the batch size ``m * b``, ``b`` the symbol
    :data:`BATCH_SYMBOL` and ``m`` the largest power of two dividing ``batch_size``
    (``optimizer``: default Adam). A model that needs a concrete batch size raises in
    the symbolic trace (:func:`graph_of` then traces twice)."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    opt = optimizer if optimizer is not None else named_optimizer(Optimizer.ADAM)
    params = jax.eval_shape(model.init, jax.random.key(0))
    opt_state = jax.eval_shape(lambda p: init_optimizer_state(opt, p), params)
    step = make_train_step(model.loss, opt)
    param_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    opt_paths, _ = jax.tree_util.tree_flatten_with_path(opt_state)
    multiple = batch_size & -batch_size  # the largest power of two dividing it
    if symbolic:
        # The batch as a multiple of the symbol, so that model code needing it to divide
        # by a power of two (tokens into MoE groups) can prove it does.
        (batch,) = jax.export.symbolic_shape(f"{multiple}*{BATCH_SYMBOL}")
        jaxpr, jaxpr_2x = jax.make_jaxpr(step)(params, opt_state, model.batch_shapes(batch)), None
    else:
        jaxpr = jax.make_jaxpr(step)(params, opt_state, model.batch_shapes(batch_size))
        jaxpr_2x = jax.make_jaxpr(step)(params, opt_state, model.batch_shapes(2 * batch_size))
    return TracedStep(
        name=model.name,
        jaxpr=jaxpr,
        jaxpr_2x=jaxpr_2x,
        batch_size=batch_size,
        param_names=tuple(path_name(path) for path, _ in param_paths),
        opt_state_names=tuple(path_name(path) for path, _ in opt_paths),
        batch_symbol=BATCH_SYMBOL if symbolic else None,
        batch_multiple=multiple if symbolic else 1,
    )


def _symbolic_graph(model: TrainableModel, batch_size: int,
                    optimizer: optax.GradientTransformation | None) -> tuple[OpGraph | None, str]:
    """The graph from one symbolic trace, or None and why it could not be made."""
    try:
        return extract_graph(trace_step(model, batch_size, optimizer, symbolic=True)), ""
    except NotBatchPolymorphic as error:
        return None, str(error)
    except AlpaJobError:  # the plan's time limit, a bad manifest: not the trace's to hide
        raise
    except Exception as error:  # noqa: BLE001 - the concrete traces report real errors
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return None, f"{type(error).__name__}: {first}"[:300]


def graph_of(model: TrainableModel, batch_size: int,
             optimizer: optax.GradientTransformation | Optimizer | str | None = None,
             note: Callable[[str], None] | None = None) -> OpGraph:
    """The planner's op graph of ``model``'s training step at ``batch_size``
    (``optimizer``: a transformation, or an optimizer's name; default Adam).

    One symbolic trace; where the model's code needs a concrete batch size, two
    concrete ones, and ``note`` hears why (the graph is the same either way, only
    slower to make).

    A batch of one is traced at 2 (and 4) and rescaled to 1: at batch 1 JAX writes
    some sums over the batch as broadcasts and reshapes instead (GPT-tiny: one
    ``reduce_sum`` and one ``reshape`` fewer, three ``broadcast_in_dim`` more), so the
    traces at 1 and 2 are different programs, while from 2 on they are one program
    with other shapes."""
    if isinstance(optimizer, str):
        optimizer = named_optimizer(optimizer)
    traced_at = 2 if batch_size == 1 else batch_size
    with fewer_collections():  # a quarter of the time was the garbage collector's
        graph, why = _symbolic_graph(model, traced_at, optimizer)
        if graph is None:
            if note is not None:
                note(f"note: the model was traced twice (at batch {traced_at} and "
                     f"{2 * traced_at}), not once with a symbolic batch size, because its "
                     f"code needs a concrete batch size ({why}); planning is the same, "
                     "tracing takes longer")
            graph = extract_graph(trace_step(model, traced_at, optimizer))
    return with_batch_size(graph, 1) if batch_size == 1 else graph
