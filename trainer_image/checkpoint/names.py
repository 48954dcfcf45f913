"""Stage-independent names for what a checkpoint holds, and back.

A parameter is saved as ``params/<its path in the model's tree>`` and an optimizer
state leaf as ``opt/<its path in the optimizer state>``
(:func:`~alpajob.api.plan.path_name`: ``params/layers/0/attn/q/kernel``,
``opt/0/mu/layers/0/attn/q/kernel``), whichever stage holds it. Every stage of a
pipeline has its own optimizer step count, all equal and all named ``opt/0/count``;
one copy is saved, and each stage gets it back on its own devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from alpajob.api.plan import path_name


def named_leaves(prefix: str, tree: Any) -> dict[str, Any]:
    """``{prefix/path: leaf}`` for every leaf of ``tree``."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {f"{prefix}/{path_name(path)}": leaf for path, leaf in leaves}


def _placed(value: jax.Array, like: jax.Array) -> jax.Array:
    """``value`` on ``like``'s sharding (moved only if it is elsewhere)."""
    if value.sharding == like.sharding:
        return value
    return jax.device_put(value, like.sharding)


def with_leaves(prefix: str, tree: Any, arrays: Mapping[str, jax.Array]) -> Any:
    """``tree`` with every leaf replaced by ``arrays[prefix/path]``, on the leaf's sharding."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _placed(arrays[f"{prefix}/{path_name(path)}"], leaf), tree)


def targets(arrays: Mapping[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    """What to restore for ``arrays``: each one's shape, dtype and sharding."""
    return {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for name, a in arrays.items()}


def stage_arrays(stage: Any) -> dict[str, jax.Array]:
    """A pipeline stage's parameters (``stage.params``: name -> array) and optimizer
    state (``stage.opt_state``), by name."""
    out = {f"params/{name}": value for name, value in stage.params.items()}
    out.update(named_leaves("opt", stage.opt_state))
    return out


def load_stage(stage: Any, arrays: Mapping[str, jax.Array]) -> None:
    """Replace a stage's parameters and optimizer state with ``arrays`` (by name)."""
    stage.params = {name: _placed(arrays[f"params/{name}"], value) for name, value in stage.params.items()}
    stage.opt_state = with_leaves("opt", stage.opt_state, arrays)
