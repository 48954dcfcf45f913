"""Load the model an AlpaJob manifest names: a zoo family or a user's entrypoint.

``spec.model.entrypoint: "mypkg.train:make_model"`` names a function that takes no
arguments and returns the model: any object with ``init`` (PRNG key -> params),
``loss`` ((params, batch) -> scalar) and ``batch_shapes`` (batch size -> dict of
``jax.ShapeDtypeStruct``), or a tuple ``(init, loss, batch_shapes)``.
"""

from __future__ import annotations

import importlib
from typing import Any

from alpajob.api.errors import ManifestError
from alpajob.api.spec import ModelSpec
from alpajob.trainer_image.precision import master_weights
from alpajob.trainer_image.zoo import ModelDef, resolve_model

FIELD = "spec.model.entrypoint"


def _from_entrypoint(entrypoint: str, dtype: str) -> ModelDef:
    module_name, _, function_name = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ManifestError(
            FIELD,
            f"cannot import module {module_name!r} ({error}); make sure it is installed in "
            "the trainer image or on PYTHONPATH",
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ManifestError(FIELD, f"module {module_name!r} has no function {function_name!r}")
    made: Any = function()
    if isinstance(made, tuple) and len(made) == 3:
        init, loss, batch_shapes = made
    elif all(hasattr(made, a) for a in ("init", "loss", "batch_shapes")):
        init, loss, batch_shapes = made.init, made.loss, made.batch_shapes
    else:
        raise ManifestError(
            FIELD,
            f"{entrypoint} must return (init, loss, batch_shapes) or an object with those "
            f"attributes, got {type(made).__name__}",
        )
    return ModelDef(
        name=getattr(made, "name", function_name),
        family="custom",
        init=init,
        loss=loss,
        batch_shapes=batch_shapes,
        dtype=dtype,
        config={"entrypoint": entrypoint},
    )


def load_model(spec: ModelSpec, dtype: str) -> ModelDef:
    """The :class:`ModelDef` that ``spec.model`` describes, computing in ``dtype`` with
    float32 master weights (:func:`~alpajob.trainer_image.precision.master_weights`)."""
    if spec.entrypoint is not None:
        return master_weights(_from_entrypoint(spec.entrypoint, dtype))
    assert spec.zoo is not None  # the manifest validator guarantees one of the two
    return master_weights(resolve_model(spec.zoo, spec.config, dtype=dtype))
