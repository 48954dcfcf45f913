"""The model zoo (``alpajob.trainer_image.zoo``): the Alpa paper's benchmark models in pure JAX.

Families: ``gpt`` (:mod:`.gpt`), ``moe`` (:mod:`.moe`), ``wresnet`` (:mod:`.wresnet`)
and the test model ``mlp`` (:mod:`.mlp`). :func:`resolve_model` turns an AlpaJob's
``spec.model`` into a :class:`ModelDef`; :func:`list_models` names every built-in size.
"""

from alpajob.trainer_image.zoo.model import ModelDef
from alpajob.trainer_image.zoo.registry import list_models, resolve_model

__all__ = ["ModelDef", "list_models", "resolve_model"]
