"""A small model of what the Kubernetes API server does with a CRD's openAPIV3Schema.

No kube-apiserver can run in these tests, so ``tests/test_crd.py`` checks the CRD
against this model of it, one function per step the API server takes:

- :func:`structural_problems`: the structural-schema rules the CRD relies on (every
  node typed, or ``x-kubernetes-int-or-string`` / ``x-kubernetes-preserve-unknown-fields``;
  arrays with items; properties xor additionalProperties; junctors without types;
  list-map keys; CEL rules with a one-line message and a valid fieldPath; ``oldSelf``
  only where old and new values correlate);
- :func:`apply_defaults`: structural defaulting, top-down, so a field defaulted to
  ``{}`` receives its own fields' defaults;
- :func:`to_json_schema` / :func:`schema_violations`: the Kubernetes dialect mapped to
  JSON Schema for ``jsonschema`` (``x-kubernetes-int-or-string`` -> integer or string,
  ``nullable``, OpenAPI 3.0's boolean ``exclusiveMinimum``; an object's undeclared
  fields refused, as kubectl's default ``--validate=strict`` does, unless it preserves
  unknown fields or declares none, like ``metadata``);
- :func:`cel_violations`: every ``x-kubernetes-validations`` rule evaluated with
  cel-python, ``self`` (and ``oldSelf`` for transition rules, on updates only) bound to
  the node's value. An untyped preserve-unknown-fields node has no CEL type in the API
  server (its ``SchemaDeclType`` is nil): no rule may name it, or the CRD is refused,
  which :func:`cel_reference_problems` checks; yet whole-object equality compares it
  deeply at run time, so ``self == oldSelf`` on ``spec.model`` guards
  ``spec.model.config`` too.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import celpy
import jsonschema

_JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
_FORBIDDEN_IN_JUNCTORS = ("type", "default", "description", "title", "nullable", "additionalProperties")
_UNSUPPORTED = ("$ref", "definitions", "dependencies", "patternProperties", "additionalItems", "id")
_MISSING = object()


@dataclass(frozen=True)
class Violation:
    """A refusal: the dotted path of the field (``spec.model.zoo``) and the message."""

    path: str
    message: str


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ----------------------------------------------------------------- structure
def walk(schema: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every node of ``schema`` with its dotted data path (``[]`` for array items)."""
    yield path, schema
    for key, prop in (schema.get("properties") or {}).items():
        yield from walk(prop, _child(path, key))
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}.*")


def _junctor_problems(node: dict, structural: dict, where: str) -> list[str]:
    problems = [f"{where}.{k}: must not be set in a junctor" for k in _FORBIDDEN_IN_JUNCTORS if k in node]
    problems += [f"{where}.{k}: must not be set in a junctor" for k in node if k.startswith("x-kubernetes-")]
    for key in node.get("properties") or {}:
        if key not in (structural.get("properties") or {}):
            problems.append(f"{where}.properties.{key}: must also be specified outside the junctor")
    if "items" in node and "items" not in structural:
        problems.append(f"{where}.items: must also be specified outside the junctor")
    for junctor in _JUNCTORS:
        for index, nested in enumerate(_as_list(node.get(junctor))):
            problems += _junctor_problems(nested, structural, f"{where}.{junctor}[{index}]")
    return problems


def _as_list(value: Any) -> list[dict]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def field_path_valid(schema: dict, field_path: str) -> bool:
    """A rule's ``fieldPath`` (``.a.b``) names declared properties below ``schema``."""
    node = schema
    for name in field_path.lstrip(".").split("."):
        node = (node.get("properties") or {}).get(name)
        if node is None:
            return False
    return True


def structural_problems(schema: dict, path: str = "openAPIV3Schema", level: str = "root",
                        correlated: bool = True) -> list[str]:
    """Where ``schema`` breaks a rule of structural schemas (an empty list: none)."""
    problems = []
    kind = schema.get("type")
    int_or_string = schema.get("x-kubernetes-int-or-string", False)
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    if level == "root" and kind != "object":
        problems.append(f"{path}.type: must be object at the root")
    if not kind and not int_or_string and not preserve:
        problems.append(f"{path}.type: must not be empty (or set int-or-string / preserve-unknown-fields)")
    if int_or_string and (kind or preserve):
        problems.append(f"{path}: x-kubernetes-int-or-string excludes type and preserve-unknown-fields")
    if preserve is False:
        problems.append(f"{path}.x-kubernetes-preserve-unknown-fields: must be true or undefined")
    if kind == "array" and "items" not in schema:
        problems.append(f"{path}.items: must be specified for an array")
    if kind == "null":
        problems.append(f"{path}.type: null is not a type; use nullable")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{path}: properties and additionalProperties are mutually exclusive")
    if level == "root" and "additionalProperties" in schema:
        problems.append(f"{path}.additionalProperties: must not be used at the root")
    if schema.get("uniqueItems"):
        problems.append(f"{path}.uniqueItems: must not be true")
    problems += [f"{path}.{k}: is not supported" for k in _UNSUPPORTED if k in schema]
    for junctor in _JUNCTORS:
        for index, nested in enumerate(_as_list(schema.get(junctor))):
            problems += _junctor_problems(nested, schema, f"{path}.{junctor}[{index}]")
    list_type = schema.get("x-kubernetes-list-type")
    if list_type is not None and kind != "array":
        problems.append(f"{path}.type: must be array with x-kubernetes-list-type")
    if list_type == "map":
        item = schema.get("items") or {}
        for key in schema.get("x-kubernetes-list-map-keys") or ["<none>"]:
            prop = (item.get("properties") or {}).get(key)
            if prop is None or (key not in (item.get("required") or []) and "default" not in prop):
                problems.append(f"{path}.x-kubernetes-list-map-keys: {key} must be a required or defaulted item property")
    for index, rule in enumerate(schema.get("x-kubernetes-validations") or []):
        where = f"{path}.x-kubernetes-validations[{index}]"
        text, message = rule.get("rule", ""), rule.get("message", "")
        if not text.strip():
            problems.append(f"{where}.rule: must be set")
        if "\n" in message or "\r" in message:
            problems.append(f"{where}.message: must be one line")
        if "\n" in text.strip() and not message:
            problems.append(f"{where}.message: must be set for a multi-line rule")
        if "fieldPath" in rule and not field_path_valid(schema, rule["fieldPath"]):
            problems.append(f"{where}.fieldPath: {rule['fieldPath']} names no declared property")
        if "oldSelf" in text and not correlated:
            problems.append(f"{where}.rule: oldSelf under a list that is not a list-map cannot correlate")
    if path.endswith("properties.metadata") and level == "field" and path.count("properties") == 1:
        extra = set(schema) - {"type", "properties"}
        if extra or set(schema.get("properties") or {}) - {"name", "generateName"}:
            problems.append(f"{path}: may only restrict name and generateName")
    for key, prop in (schema.get("properties") or {}).items():
        problems += structural_problems(prop, f"{path}.properties.{key}", "field", correlated)
    if isinstance(schema.get("items"), dict):
        problems += structural_problems(schema["items"], f"{path}.items", "item",
                                        correlated and list_type == "map")
    if isinstance(schema.get("additionalProperties"), dict):
        problems += structural_problems(schema["additionalProperties"], f"{path}.additionalProperties",
                                        "field", correlated)
    return problems


# ----------------------------------------------------------------- defaulting
def apply_defaults(value: Any, schema: dict) -> Any:
    """``value`` with the schema's defaults applied in place, as the API server does."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, prop in props.items():
            if "default" in prop and (key not in value or (value[key] is None and not prop.get("nullable"))):
                value[key] = copy.deepcopy(prop["default"])
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                apply_defaults(item, props[key])
            elif isinstance(extra, dict):
                apply_defaults(item, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])
    return value


# ----------------------------------------------------------------- JSON Schema
def to_json_schema(node: dict, root: bool = True) -> dict:
    """The Kubernetes schema dialect of ``node`` as a JSON Schema (draft 2020-12).

    The root's ``metadata`` keeps every ObjectMeta field: the API server validates
    ObjectMeta itself and lets the schema restrict only ``name`` and ``generateName``.
    """
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in (
            "nullable", "exclusiveMinimum", "exclusiveMaximum", "default", "description", "example",
            "externalDocs", "title", "format",
        ):
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(prop, False) for name, prop in value.items()}
            if root and "metadata" in value:
                out[key]["metadata"].pop("additionalProperties", None)
        elif key in ("items", "not") or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = to_json_schema(value, False)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_json_schema(v, False) for v in value]
        else:
            out[key] = value
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if node.get(exclusive) is True:
            out[exclusive] = out.pop(bound)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string"):
        out = {"allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}, out]}
    elif "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _dotted(parts: Any) -> str:
    out = ""
    for part in parts:
        out = f"{out}[{part}]" if isinstance(part, int) else _child(out, str(part))
    return out


def schema_violations(document: Any, schema: dict) -> list[Violation]:
    """What the OpenAPI validation refuses in ``document``, one violation per field."""
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    out = []
    for error in validator.iter_errors(document):
        path = _dotted(error.absolute_path)
        if error.validator == "additionalProperties":
            known = set(error.schema.get("properties") or {})
            out += [Violation(_child(path, k), "unknown field") for k in error.instance if k not in known]
        elif error.validator == "required":
            out += [Violation(_child(path, k), "is required")
                    for k in error.validator_value if k not in error.instance]
        else:
            out.append(Violation(path, error.message))
    return out


# ----------------------------------------------------------------- CEL
def _cel_value(value: Any, schema: dict | None) -> Any:
    """``value`` for CEL, typed by its schema as the API server types it: an untyped
    preserve-unknown-fields value becomes its canonical JSON text, which (like the API
    server's ``unknownPreserved``) supports only equality; a ``number`` is a double."""
    if schema is None:
        return value
    if not schema.get("type") and not schema.get("x-kubernetes-int-or-string"):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        extra = extra if isinstance(extra, dict) else None
        return {k: _cel_value(v, props.get(k, extra)) for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_cel_value(v, schema["items"]) for v in value]
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # the API server types a `number` field as CEL double, 30 as 30.0
    return value


@cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _holds(rule: str, activation: dict[str, Any]) -> bool:
    result = _program(rule).evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
    if isinstance(result, celpy.CELEvalError):
        raise result
    return bool(result)


def cel_violations(value: Any, schema: dict, old: Any = _MISSING, path: str = "") -> list[Violation]:
    """Every CEL rule that ``value`` breaks; transition rules only where ``old`` exists."""
    out = []
    for rule in schema.get("x-kubernetes-validations") or []:
        transition = "oldSelf" in rule["rule"]
        if transition and old is _MISSING:
            continue
        activation = {"self": _cel_value(value, schema)}
        if transition:
            activation["oldSelf"] = _cel_value(old, schema)
        if not _holds(rule["rule"], activation):
            where = path + rule.get("fieldPath", "")
            out.append(Violation(where, rule.get("message", f"failed rule: {rule['rule']}")))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is None:
                continue
            before = old.get(key, _MISSING) if isinstance(old, dict) else _MISSING
            out += cel_violations(item, sub, before, _child(path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            out += cel_violations(item, schema["items"], _MISSING, f"{path}[{index}]")
    return out


_REFERENCE = re.compile(r"\b(self|oldSelf)((?:\.[A-Za-z_]\w*)+)(\s*\()?")


def _visible_properties(schema: dict, root: bool) -> dict[str, dict]:
    props = {k: v for k, v in (schema.get("properties") or {}).items()
             if v.get("type") or v.get("x-kubernetes-int-or-string")}
    if root:
        props["metadata"] = {"type": "object", "properties": {"name": {"type": "string"},
                                                              "generateName": {"type": "string"}}}
    return props


def cel_reference_problems(schema: dict) -> list[str]:
    """Rules that name a field CEL cannot see (undeclared, or untyped preserve-unknown)."""
    problems = []
    for path, node in walk(schema):
        for rule in node.get("x-kubernetes-validations") or []:
            for match in _REFERENCE.finditer(rule["rule"]):
                names = match.group(2).lstrip(".").split(".")
                current, is_root = node, path == ""
                for index, name in enumerate(names):
                    is_call = index == len(names) - 1 and match.group(3)
                    props = _visible_properties(current, is_root)
                    if current.get("type") == "object" and name in props:
                        current, is_root = props[name], False
                    elif not (is_call and current.get("type") != "object"):
                        problems.append(f"{path or '<root>'}: rule {rule['rule']!r} names {name!r}, "
                                        "which CEL cannot see")
                        break
    return problems


def prune(value: Any, node: dict[str, Any]) -> Any:
    """What a structural schema keeps of ``value``: the API server's pruning drops
    every object field the schema does not declare, at any depth, unless the node
    says ``x-kubernetes-preserve-unknown-fields``; map values (``additionalProperties``)
    and list items are pruned by their own schema."""
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return value
    if isinstance(value, dict) and "properties" in node:
        return {k: prune(v, node["properties"][k]) for k, v in value.items() if k in node["properties"]}
    if isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        return {k: prune(v, node["additionalProperties"]) for k, v in value.items()}
    if isinstance(value, dict) and node.get("type") == "object":
        return {}  # an object of no declared fields keeps none
    if isinstance(value, list) and "items" in node:
        return [prune(v, node["items"]) for v in value]
    return value
