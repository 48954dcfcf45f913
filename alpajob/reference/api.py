"""The AlpaJob API reference (``docs/reference/api.md``), from the generated CRD.

:func:`alpajob.api.crd.crd` turns the pydantic models of the spec and status into the
structural OpenAPI schema the API server enforces; this page is that schema read back
as tables, so it says exactly what the server checks. The schema is walked depth
first: every object with declared properties gets a section named by its path
(``spec.training.optimizer``; ``[]`` for a list's items, ``{}`` for a map's values),
with one row per field (type, default, bounds and formats, description) and, below
the table, the CEL rules declared on the object or on its scalar fields, each with the
message the API server answers when it fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from alpajob.api.crd import crd
from alpajob.api.names import CATEGORIES, GROUP, KIND, SHORT_NAMES, VERSION
from alpajob.reference.markdown import cell, code, constraints, page, table

Node = Mapping[str, Any]

def anchor(path: str) -> str:
    """The section id of the object at ``path``: ``spec.data`` -> ``spec-data``."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", path.lower().replace("[]", "-items")
                                     .replace("{}", "-values"))).strip("-")


def _has_fields(node: Node) -> bool:
    return bool(node.get("properties"))


def _type(node: Node, path: str) -> str:
    """The Type cell: a scalar's type, or a link to the section of an object."""
    kind = node.get("type")
    if kind == "object" and _has_fields(node):
        return f"[object](#{anchor(path)})"
    if kind == "array":
        return "[]" + _type(node.get("items") or {}, path + "[]")
    if kind == "object" and isinstance(node.get("additionalProperties"), Mapping):
        return "map[string]" + _type(node["additionalProperties"], path + "{}")
    if kind == "object":
        return "object (free-form)" if node.get("x-kubernetes-preserve-unknown-fields") else "object"
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    if kind is None:
        return "any (free-form)"
    return str(kind)


def _validation(node: Node) -> str:
    """The Validation cell: enum, bounds, pattern, format, list semantics."""
    parts = constraints(node)
    if node.get("x-kubernetes-list-type"):
        keys = node.get("x-kubernetes-list-map-keys")
        parts.append(f"list type {node['x-kubernetes-list-type']}" + (f" (keys: {', '.join(keys)})" if keys else ""))
    if node.get("x-kubernetes-validations"):
        parts.append("CEL rules below")
    return "; ".join(parts)


def _default(node: Node) -> str:
    return code(json.dumps(node["default"])) if "default" in node else ""


def _rules(path: str, node: Node) -> list[str]:
    """The CEL rules of ``node`` and of its fields that have no section of their own."""
    lines = []
    owners: list[tuple[str, Node]] = [(path, node)]
    for name, field in (node.get("properties") or {}).items():
        if not (field.get("type") == "object" and _has_fields(field)):
            owners.append((f"{path}.{name}" if path else name, field))
    for owner, item in owners:
        for rule in item.get("x-kubernetes-validations") or []:
            where = (owner + (rule.get("fieldPath") or "")).lstrip(".")
            lines.append(f"- `{where}`: {cell(rule.get('message', ''))}  ")
            lines.append(f"  `{rule['rule']}`")
    return (["", "Rules (CEL, checked by the API server):", "", *lines] if lines else [])


def _objects(path: str, node: Node) -> Iterator[tuple[str, Node]]:
    """Every object with declared fields under ``node``, depth first, itself first."""
    if node.get("type") == "object" and _has_fields(node):
        yield path, node
        for name, field in node["properties"].items():
            yield from _objects(f"{path}.{name}" if path else name, field)
    elif node.get("type") == "array":
        yield from _objects(path + "[]", node.get("items") or {})
    elif node.get("type") == "object" and isinstance(node.get("additionalProperties"), Mapping):
        yield from _objects(path + "{}", node["additionalProperties"])


def _section(path: str, node: Node) -> list[str]:
    required = set(node.get("required") or ())
    rows = []
    for name, field in node["properties"].items():
        label = code(name) + (" (required)" if name in required else "")
        rows.append([label, _type(field, f"{path}.{name}" if path else name), _default(field),
                     _validation(field), cell(field.get("description", ""))])
    title = path or KIND
    lines = [f"## {title} {{#{anchor(path) or 'alpajob'}}}", ""]
    if node.get("description"):
        lines += [cell(node["description"]), ""]
    lines += table(["Field", "Type", "Default", "Validation", "Description"], rows)
    return lines + _rules(path, node) + [""]


def render() -> str:
    """The whole page."""
    definition = crd()
    version = definition["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    columns = table(["Column", "Type", "JSON path", "Shown"],
                    [[cell(c["name"]), cell(c["type"]), code(c["jsonPath"]),
                      "with `-o wide`" if c.get("priority") else "always"]
                     for c in version.get("additionalPrinterColumns", [])])
    intro = (f"`apiVersion: {GROUP}/{VERSION}`, `kind: {KIND}` (short names: "
             f"{', '.join(code(n) for n in SHORT_NAMES)}; categories: {', '.join(code(c) for c in CATEGORIES)}). "
             "Every field of the spec and the status as the API server enforces it: the "
             "CustomResourceDefinition (`alpajob crd`, `manifests/crd.yaml`) is generated from the "
             "typed models in `alpajob/api/spec.py`, `status.py` and `progress.py`, and so is this page. "
             "Two fields are free-form to the API server, `spec.model.config` and "
             "`spec.parallelism.stages`; the admission webhook judges them. A field with a default "
             "is filled in by the API server when the manifest leaves it out.")
    body = ["## kubectl get columns", "", *columns, ""]
    for path, node in _objects("", schema):
        body += _section(path, node)
    return page("AlpaJob API reference", intro, body)
