"""The pieces every typed contract is built from: a strict pydantic base, and the
Kubernetes schema extensions a field or section carries into the CRD.

:class:`Contract` refuses unknown keys, is frozen, and reads and writes camelCase
(``globalBatchSize``) while Python says ``global_batch_size``. The helpers return the
``json_schema_extra`` of a field or model: :func:`cel` one CEL rule
(``x-kubernetes-validations``), :func:`unchanged` the transition rule that makes an
optional field immutable, and :func:`k8s` any other OpenAPI extension or format.
:mod:`alpajob.api.crd` turns the models, these extras included, into the CRD.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

#: The key under which a model or field lists its CEL rules.
CEL_KEY = "x-kubernetes-validations"


class Contract(BaseModel):
    """Base of every contract model: camelCase on the wire, unknown keys refused, frozen."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    """One CEL validation rule; ``field_path`` (``.image``) names the field it judges."""
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    return out


def unchanged(key: str, message: str) -> dict[str, Any]:
    """A transition rule on a parent: its optional field ``key`` may not be added,
    removed or changed once the object exists."""
    rule = (f"has(self.{key}) == has(oldSelf.{key}) && "
            f"(!has(self.{key}) || self.{key} == oldSelf.{key})")
    return cel(rule, message, f".{key}")


def k8s(*rules: dict[str, Any], **extensions: Any) -> dict[str, Any]:
    """The ``json_schema_extra`` for CEL ``rules`` and other schema ``extensions``
    (``format="int64"``, ``x_kubernetes_int_or_string=True``; underscores become
    dashes)."""
    out = {key.replace("_", "-"): value for key, value in extensions.items()}
    if rules:
        out[CEL_KEY] = list(rules)
    return out


#: Kubernetes' integer formats, for a field's ``json_schema_extra``; a field of one
#: also bounds its value by the format's largest (``le=INT64_MAX``), as the API server
#: does, so the typed model never takes what a real server refuses.
INT64 = k8s(format="int64")
INT32 = k8s(format="int32")
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
