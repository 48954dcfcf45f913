"""The training step the trainer runs, and its trace for the planner.

``step(params, opt_state, batch) -> (loss, grads, new_params, new_opt_state)`` is
``jax.value_and_grad(loss)`` followed by the optax update and
``optax.apply_updates`` (:func:`make_train_step`). The optimizer's moments are kept in
float32 whatever the parameters' dtype (:func:`init_optimizer_state`).

The planner reads the step, it never calls it: :func:`trace_step` traces it with
``jax.make_jaxpr`` on abstract shapes (``jax.eval_shape`` of ``init``: nothing is
allocated, so a 39B-parameter model traces on a laptop) at the batch size and at twice
it, and :func:`graph_of` hands that :class:`~alpajob.planner.graph.extract.TracedStep`
to the planner's :func:`~alpajob.planner.graph.extract.extract_graph`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from alpajob.api.errors import ManifestError
from alpajob.api.plan import path_name
from alpajob.api.spec import Optimizer
from alpajob.planner.graph.extract import TracedStep, extract_graph
from alpajob.planner.graph.opgraph import OpGraph


class TrainableModel(Protocol):
    """What the step needs of a model (a zoo ``ModelDef`` or a user's entrypoint)."""

    @property
    def name(self) -> str: ...
    @property
    def init(self) -> Callable[[jax.Array], Any]: ...
    @property
    def loss(self) -> Callable[[Any, Any], jax.Array]: ...
    @property
    def batch_shapes(self) -> Callable[[int], Any]: ...


def make_optimizer(name: Optimizer | str, learning_rate: float) -> optax.GradientTransformation:
    """The optax optimizer ``name`` (``spec.training.optimizer``).

    Adam's first moment is kept in float32 (``mu_dtype``); :func:`init_optimizer_state`
    makes the second one float32 too, whatever the parameter dtype.
    """
    try:
        kind = Optimizer(name.lower() if isinstance(name, str) else name)
    except ValueError:
        choices = ", ".join(o.value for o in Optimizer)
        raise ManifestError("spec.training.optimizer",
                            f"unknown optimizer {name!r}; choose one of {choices}") from None
    if kind is Optimizer.ADAM:
        return optax.adam(learning_rate, mu_dtype=jnp.float32)
    if kind is Optimizer.ADAMW:
        return optax.adamw(learning_rate, mu_dtype=jnp.float32)
    return optax.sgd(learning_rate)


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


def trace_step(model: TrainableModel, batch_size: int, optimizer: Optimizer | str = Optimizer.ADAM,
               learning_rate: float = 1e-4) -> TracedStep:
    """The model's training step traced at ``batch_size`` and ``2 * batch_size``."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    opt = make_optimizer(optimizer, learning_rate)
    params = jax.eval_shape(model.init, jax.random.key(0))
    opt_state = jax.eval_shape(lambda p: init_optimizer_state(opt, p), params)
    step = make_train_step(model.loss, opt)
    param_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    opt_paths, _ = jax.tree_util.tree_flatten_with_path(opt_state)
    return TracedStep(
        name=model.name,
        jaxpr=jax.make_jaxpr(step)(params, opt_state, model.batch_shapes(batch_size)),
        jaxpr_2x=jax.make_jaxpr(step)(params, opt_state, model.batch_shapes(2 * batch_size)),
        batch_size=batch_size,
        param_names=tuple(path_name(path) for path, _ in param_paths),
        opt_state_names=tuple(path_name(path) for path, _ in opt_paths),
    )


def graph_of(model: TrainableModel, batch_size: int, optimizer: Optimizer | str = Optimizer.ADAM,
             learning_rate: float = 1e-4) -> OpGraph:
    """The planner's op graph of ``model``'s training step at ``batch_size``."""
    return extract_graph(trace_step(model, batch_size, optimizer, learning_rate))
