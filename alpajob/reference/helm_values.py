"""The Helm values reference (``docs/reference/helm-values.md``), from the chart.

Three facts per value, each from its one home in ``charts/alpajob/``: the type and
validation from ``values.schema.json`` (Helm refuses values that break it, on install
and upgrade; ``$ref`` definitions are resolved), the default from ``values.yaml``, and
the description from the comment above the key in ``values.yaml`` (a schema
``description`` is used where the comment is missing). The comment of a key is the
contiguous block of ``#`` lines right above it, with the ``# --`` marker of a
documented value dropped; comments are read by indentation, as YAML nests keys.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from alpajob.reference.markdown import cell, code, constraints, page, table

#: The chart, found from the repository root this package lives in.
CHART = Path(__file__).resolve().parents[2] / "charts" / "alpajob"

_MARKER = re.compile(r"^--(\s+|$)")
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?:\s|$)")


def comments(text: str) -> dict[str, str]:
    """Dotted key path -> the comment right above it in a values file."""
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(_MARKER.sub("", stripped.lstrip("#").strip()))
            continue
        match = _KEY.match(line)
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match["key"]))
            if block:
                found[".".join(key for _, key in stack)] = " ".join(block)
        block = []
    return found


def _resolve(node: Mapping[str, Any], schema: Mapping[str, Any]) -> Mapping[str, Any]:
    reference = node.get("$ref")
    if not reference:
        return node
    target: Any = schema
    for part in reference.removeprefix("#/").split("/"):
        target = target[part]
    return {**target, **{k: v for k, v in node.items() if k != "$ref"}}


def _type(node: Mapping[str, Any], schema: Mapping[str, Any]) -> str:
    kind = node.get("type", "any")
    if kind == "array":
        return "[]" + _type(_resolve(node.get("items") or {}, schema), schema)
    if kind == "object" and isinstance(node.get("additionalProperties"), Mapping):
        return "map[string]" + _type(_resolve(node["additionalProperties"], schema), schema)
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def _validation(node: Mapping[str, Any]) -> str:
    parts = constraints(node)
    if node.get("required"):
        parts.append("requires " + ", ".join(code(r) for r in node["required"]))
    if node.get("additionalProperties") is False:
        parts.append("no other keys")
    return "; ".join(parts)


def _default(values: Any, path: list[str]) -> str:
    for key in path:
        if not isinstance(values, Mapping) or key not in values:
            return ""
        values = values[key]
    return code(json.dumps(values))


def _rows(schema: Mapping[str, Any], node: Mapping[str, Any], path: list[str], values: Any,
          notes: dict[str, str]) -> Iterator[list[str]]:
    for key, child in (node.get("properties") or {}).items():
        child = _resolve(child, schema)
        where = [*path, key]
        dotted = ".".join(where)
        described = notes.get(dotted) or child.get("description", "")
        nested = child.get("properties")
        yield [code(dotted), cell(_type(child, schema)), "" if nested else _default(values, where),
               _validation(child), cell(described)]
        if nested:
            yield from _rows(schema, child, where, values, notes)


def render(chart: Path = CHART) -> str:
    """The whole page."""
    schema = json.loads((chart / "values.schema.json").read_text())
    text = (chart / "values.yaml").read_text()
    rows = list(_rows(schema, schema, [], yaml.safe_load(text), comments(text)))
    intro = ("Every value of the `alpajob` Helm chart (`charts/alpajob`), generated from its "
             "`values.schema.json` (type and validation; Helm refuses a value that breaks them), "
             "`values.yaml` (the default) and the comment above each key there. Install and "
             "upgrade are in [Install on Kubernetes](../guides/kubernetes.md).")
    return page("Helm values reference", intro,
                table(["Key", "Type", "Default", "Validation", "Description"], rows))
