"""Build the JAX model an AlpaJob's ``spec.model`` (zoo family + config) names.

Accepted forms (sizes and families are case-insensitive)::

    resolve_model("gpt", "2.6b")                    # a named size of a family
    resolve_model("gpt-2.6b")                       # the same, as one combined name
    resolve_model("gpt", {"hidden": 512, "layers": 4})  # overrides on the family default
    resolve_model("gpt-2.6b", {"layers": 4})        # overrides on a named size
    resolve_model("mlp")                            # the family default (its tiny config)

The names, sizes and the checks of every key are the zoo's contract
(:func:`alpajob.api.zoo.resolve_zoo`), which raises
:class:`~alpajob.api.errors.ManifestError` naming the field
(``spec.model.zoo``, ``spec.model.config`` or ``spec.model.config.<key>``); this module
only picks each family's builder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from alpajob.api.errors import ManifestError
from alpajob.api.zoo import ZOO, resolve_zoo
from alpajob.trainer_image.zoo import gpt, mlp, moe, wresnet
from alpajob.trainer_image.zoo.model import ModelDef

#: Parameter/compute dtypes a zoo model can be built in.
DTYPES = ("float32", "bfloat16", "float16")

#: Each family's builder: ``build(name, config, dtype) -> ModelDef``.
BUILDERS: dict[str, Callable[[str, dict[str, Any], str], ModelDef]] = {
    "gpt": gpt.build, "moe": moe.build, "wresnet": wresnet.build, "mlp": mlp.build,
}


def list_models() -> list[str]:
    """Every combined model name, e.g. ``gpt-350m`` ... ``mlp-tiny``."""
    return [f"{family.name}-{size}" for family in ZOO.values() for size in family.sizes]


def resolve_model(
    zoo: str, config: str | dict[str, Any] | None = None, dtype: str = "float32"
) -> ModelDef:
    """The :class:`ModelDef` named by ``zoo`` and ``config`` (see the module docstring)."""
    if dtype not in DTYPES:
        raise ManifestError("spec.training.dtype", f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    model = resolve_zoo(zoo, config)
    return BUILDERS[model.family.name](model.name, model.config, dtype)
