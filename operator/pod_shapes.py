"""The free-form parts of ``spec.podTemplate`` judged against Kubernetes' own types.

``affinity``, ``volumes`` and an env var's ``valueFrom`` are copied into the pods as
written, so the CRD keeps them free-form (its schema would otherwise have to carry all
of Kubernetes'). Without a check here a garbage ``affinity`` was admitted and refused
only by the API server, on the first pod, minutes later. :func:`template_problems`
walks each of them through the Kubernetes client's generated models (``V1Affinity``,
``V1Volume``, ``V1EnvVarSource``: their ``openapi_types`` and ``attribute_map`` are
Kubernetes' OpenAPI schema), so an unknown field, a value of the wrong type or a missing
required field is refused by the webhook with the field named. It also checks what no
schema says: a request above its limit, which the API server refuses for a pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.client import models
from kubernetes.utils import parse_quantity

_PRIMITIVES: dict[str, Any] = {
    "str": str, "int": int, "bool": bool, "float": (int, float), "object": object,
    "datetime": str, "date": str,
}


def _kind_name(kind: str) -> str:
    """``V1NodeAffinity`` -> ``NodeAffinity``, as the Kubernetes docs name the type."""
    return kind[2:] if kind.startswith("V1") else kind


def shape_problems(value: Any, kind: str, field: str) -> list[str]:
    """What keeps ``value`` from being a Kubernetes ``kind`` (a client model's name,
    ``list[...]``, ``dict[str, ...]`` or a primitive), each problem naming its field."""
    if kind.startswith("list["):
        if not isinstance(value, list):
            return [f"{field}: must be a list"]
        return [p for i, item in enumerate(value) for p in shape_problems(item, kind[5:-1], f"{field}[{i}]")]
    if kind.startswith(("dict(", "dict[")):
        if not isinstance(value, Mapping):
            return [f"{field}: must be a mapping"]
        inner = kind[kind.index(",") + 1:-1].strip()
        return [p for key, item in value.items() for p in shape_problems(item, inner, f"{field}.{key}")]
    if kind in _PRIMITIVES:
        wanted = _PRIMITIVES[kind]
        if isinstance(value, bool) and kind != "bool" and kind != "object":
            return [f"{field}: must be {'a string' if kind == 'str' else 'a number'}, got {value!r}"]
        if not isinstance(value, wanted):
            what = {"str": "a string", "int": "an integer", "bool": "true or false"}.get(kind, "a number")
            return [f"{field}: must be {what}, got {value!r}"]
        return []
    model = getattr(models, kind)
    if not isinstance(value, Mapping):
        return [f"{field}: must be a {_kind_name(kind)} object, got {value!r}"]
    by_json = {json_name: name for name, json_name in model.attribute_map.items()}
    problems = []
    for key, item in value.items():
        name = by_json.get(key)
        if name is None:
            problems.append(f"{field}.{key}: unknown field of {_kind_name(kind)}; remove it or check its "
                            f"spelling (it has {', '.join(sorted(by_json))})")
        else:
            problems += shape_problems(item, model.openapi_types[name], f"{field}.{key}")
    if not problems:
        try:  # the generated setters refuse a required field left out
            model(**{by_json[key]: item for key, item in value.items()})
        except ValueError as error:
            missing = str(error).split("`")[1] if "`" in str(error) else ""
            problems.append(f"{field}.{model.attribute_map.get(missing, missing)}: is required in "
                            f"{_kind_name(kind)}")
    return problems


def _resource_problems(resources: Any, field: str) -> list[str]:
    """A request above the limit of the same resource."""
    if not isinstance(resources, Mapping):
        return []
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    problems = []
    for name in sorted(set(requests) & set(limits)):
        try:
            above = parse_quantity(requests[name]) > parse_quantity(limits[name])
        except ValueError:
            continue  # the typed spec names a malformed quantity itself
        if above:
            problems.append(f"{field}.requests.{name}: {requests[name]} is above its limit "
                            f"{limits[name]}; a pod may not request more than its limit")
    return problems


def template_problems(body: Mapping[str, Any]) -> list[str]:
    """Every problem of ``spec.podTemplate``'s free-form parts and resources."""
    templates = ((body.get("spec") or {}).get("podTemplate")) or {}
    problems = []
    for role in ("planner", "head", "mesh"):
        template = templates.get(role) or {}
        where = f"spec.podTemplate.{role}"
        if template.get("affinity") is not None:
            problems += shape_problems(template["affinity"], "V1Affinity", f"{where}.affinity")
        for index, volume in enumerate(template.get("volumes") or []):
            problems += shape_problems(volume, "V1Volume", f"{where}.volumes[{index}]")
        for index, var in enumerate(template.get("env") or []):
            if isinstance(var, Mapping) and var.get("valueFrom") is not None:
                problems += shape_problems(var["valueFrom"], "V1EnvVarSource", f"{where}.env[{index}].valueFrom")
        problems += _resource_problems(template.get("resources"), f"{where}.resources")
    return problems
