"""Load the model an AlpaJob manifest names: a zoo family or a user's entrypoint.

``spec.model.entrypoint: "mypkg.train:make_model"`` names a function that takes no
arguments and returns the model: any object with ``init`` (PRNG key -> params),
``loss`` ((params, batch) -> scalar) and ``batch_shapes`` (batch size -> dict of
``jax.ShapeDtypeStruct``), or a tuple ``(init, loss, batch_shapes)``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from alpajob.api.errors import ManifestError
from alpajob.api.spec import ModelSpec
from alpajob.trainer_image.precision import master_weights
from alpajob.trainer_image.zoo import ModelDef, resolve_model

FIELD = "spec.model.entrypoint"


def user_code_failed(what: str, error: BaseException) -> ManifestError:
    """One line for an entrypoint that did not return: what it did instead."""
    if isinstance(error, SystemExit):
        did = f"called sys.exit({error.code!r})"
    else:
        text = " ".join(str(error).split())
        did = f"raised {type(error).__name__}" + (f": {text[:300]}" if text else "")
    return ManifestError(FIELD, f"{what} {did}; fix the model's code (it must not exit)")


def _call(entrypoint: str, function: Any) -> Any:
    """``function()``, refused in one line if it needs arguments, exits or raises."""
    try:
        required = [p.name for p in inspect.signature(function).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                           p.KEYWORD_ONLY)]
    except (TypeError, ValueError):  # a builtin without a signature: call it and see
        required = []
    if required:
        raise ManifestError(FIELD, f"your model's entrypoint {entrypoint} takes arguments "
                                   f"({', '.join(required)}); name a function of no arguments that "
                                   "returns the model")
    try:
        return function()
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's code, reported in one line
        raise user_code_failed(f"your model's entrypoint {entrypoint}", error) from None


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
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's module, reported in one line
        raise user_code_failed(f"importing your model's module {module_name!r}", error) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ManifestError(FIELD, f"module {module_name!r} has no function {function_name!r}")
    made: Any = _call(entrypoint, function)
    if isinstance(made, tuple) and len(made) == 3:
        init, loss, batch_shapes = made
    elif all(hasattr(made, a) for a in ("init", "loss", "batch_shapes")):
        init, loss, batch_shapes = made.init, made.loss, made.batch_shapes
    else:
        raise ManifestError(
            FIELD,
            f"your model's entrypoint {entrypoint} returned {type(made).__name__}; it must return "
            "(init, loss, batch_shapes) or an object with those attributes",
        )
    if not all(callable(f) for f in (init, loss, batch_shapes)):
        raise ManifestError(FIELD, f"your model's entrypoint {entrypoint} returned init, loss and "
                                   "batch_shapes that are not all functions")
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
