"""Resolve an AlpaJob's ``spec.model`` (zoo family + config) into a :class:`ModelDef`.

Accepted forms (sizes and families are case-insensitive)::

    resolve_model("gpt", "2.6b")                    # a named size of a family
    resolve_model("gpt-2.6b")                       # the same, as one combined name
    resolve_model("gpt", {"hidden": 512, "layers": 4})  # overrides on the family default
    resolve_model("gpt-2.6b", {"layers": 4})        # overrides on a named size
    resolve_model("mlp")                            # the family default (its tiny config)

Every malformed value raises :class:`~alpajob.api.errors.ManifestError` naming the
field (``spec.model.zoo``, ``spec.model.config`` or ``spec.model.config.<key>``) and the
valid choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from alpajob.api.errors import ManifestError
from alpajob.trainer_image.zoo import gpt, mlp, moe, wresnet
from alpajob.trainer_image.zoo.model import ModelDef

#: Parameter/compute dtypes a zoo model can be built in.
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Family:
    """One zoo family: its named configs, its checks and its builder."""

    name: str
    sizes: dict[str, dict[str, Any]]
    check: Callable[[dict[str, Any]], None]
    build: Callable[[str, dict[str, Any], str], ModelDef]

    @property
    def default(self) -> dict[str, Any]:
        """The family default: its ``tiny`` config."""
        return self.sizes["tiny"]


def _family(module: ModuleType, name: str) -> Family:
    return Family(name, module.SIZES, module.check, module.build)


def families() -> dict[str, Family]:
    """The zoo's families by name."""
    return {
        "gpt": _family(gpt, "gpt"),
        "moe": _family(moe, "moe"),
        "wresnet": _family(wresnet, "wresnet"),
        "mlp": _family(mlp, "mlp"),
    }


def list_models() -> list[str]:
    """Every combined model name, e.g. ``gpt-350m`` ... ``mlp-tiny``."""
    return [f"{fam.name}-{size}" for fam in families().values() for size in fam.sizes]


def _choices(values: Any) -> str:
    return ", ".join(str(v) for v in values)


def _lookup_family(name: str) -> Family:
    table = families()
    if name not in table:
        raise ManifestError(
            "spec.model.zoo", f"unknown model family {name!r}; choose one of {_choices(table)}"
        )
    return table[name]


def _lookup_size(family: Family, size: str, field: str) -> dict[str, Any]:
    key = size.strip().lower()
    if key not in family.sizes:
        raise ManifestError(
            field,
            f"unknown {family.name} size {size!r}; choose one of {_choices(family.sizes)}",
        )
    return dict(family.sizes[key])


def _apply_overrides(family: Family, base: dict[str, Any], overrides: dict[str, Any]) -> dict:
    config = dict(base)
    for key, value in overrides.items():
        field = f"spec.model.config.{key}"
        if key not in base:
            raise ManifestError(
                field, f"unknown {family.name} config key; valid keys: {_choices(sorted(base))}"
            )
        if isinstance(base[key], float):
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
            if not ok:
                raise ManifestError(field, f"must be a positive number, got {value!r}")
            config[key] = float(value)
        else:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ManifestError(field, f"must be a positive integer, got {value!r}")
            config[key] = value
    return config


def resolve_model(
    zoo: str, config: str | dict[str, Any] | None = None, dtype: str = "float32"
) -> ModelDef:
    """The :class:`ModelDef` named by ``zoo`` and ``config`` (see the module docstring)."""
    if not isinstance(zoo, str) or not zoo.strip():
        raise ManifestError(
            "spec.model.zoo", f"must be a family name or one of {_choices(list_models())}"
        )
    if dtype not in DTYPES:
        raise ManifestError("spec.training.dtype", f"unknown dtype {dtype!r}; choose one of {_choices(DTYPES)}")
    family_name, _, size = zoo.strip().lower().partition("-")
    family = _lookup_family(family_name)
    if size:
        base_name = f"{family.name}-{size}"
        base = _lookup_size(family, size, "spec.model.zoo")
        if isinstance(config, str):
            raise ManifestError(
                "spec.model.config",
                f"zoo {zoo!r} already names a size; drop config {config!r} or set zoo to "
                f"{family.name!r}",
            )
    elif isinstance(config, str):
        base_name = f"{family.name}-{config.strip().lower()}"
        base = _lookup_size(family, config, "spec.model.config")
    else:
        base_name = f"{family.name}-tiny"
        base = dict(family.default)

    if config is None or isinstance(config, str):
        resolved, name = base, base_name
    elif isinstance(config, dict):
        resolved = _apply_overrides(family, base, config)
        name = base_name if resolved == base else f"{base_name}-custom"
    else:
        raise ManifestError(
            "spec.model.config",
            f"must be a size name ({_choices(family.sizes)}) or a mapping of overrides, "
            f"got {type(config).__name__}",
        )
    family.check(resolved)
    return family.build(name, resolved, dtype)
