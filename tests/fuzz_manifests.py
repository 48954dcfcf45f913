"""Hypothesis strategies for AlpaJob manifests, driven by the CRD's own schema.

The CRD (:func:`alpajob.api.crd.crd`) says what every field of ``spec`` may be: its
type, enum, minimum and maximum, pattern, int-or-string. :func:`leaves` walks it into
one :class:`Leaf` per field, and :func:`manifests` starts from a small job that plans
in seconds and changes one to three of its fields, each to a value drawn from the
field's own schema in one of three flavours:

- ``valid``: inside the schema (an enum member, an integer in range with the small
  end favoured, a string the pattern matches);
- ``boundary``: the range's ends and one past each, and the int32/int64 edges;
- ``invalid``: another type, ``nan`` and ``inf``, integers past int64, strings with a
  newline or a NUL, lists and deep nests where a scalar belongs.

A field may also be deleted, and whole sections replaced by a wrong type. The
structural attacks on the YAML text itself (depth, aliases, duplicate keys, bytes that
are not UTF-8) are :func:`texts`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st

from alpajob.api.crd import crd

#: A job that plans in a few seconds on this machine: the fuzzer's starting point.
BASE: dict[str, Any] = {
    "apiVersion": "alpajob.io/v1alpha1", "kind": "AlpaJob", "metadata": {"name": "fuzzed"},
    "spec": {"model": {"zoo": "gpt", "config": "tiny"}, "training": {"globalBatchSize": 16, "steps": 4},
             "cluster": {"gpu": "cpu", "nodes": 1, "gpusPerNode": 2}},
}

INT32, INT64 = 2**31 - 1, 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One field of the schema: where it is (``path`` under the manifest) and its node."""

    path: tuple[str, ...]
    node: dict[str, Any]

    @property
    def name(self) -> str:
        return ".".join(self.path)


def _walk(node: dict[str, Any], path: tuple[str, ...]) -> Iterator[Leaf]:
    properties = node.get("properties")
    if properties:
        yield Leaf(path, node)  # the section itself, for wrong-type and deletion attacks
        for key, child in properties.items():
            yield from _walk(child, (*path, key))
    else:
        yield Leaf(path, node)


@functools.cache
def leaves() -> tuple[Leaf, ...]:
    """Every field of ``spec`` (and ``metadata``'s name), from the CRD."""
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    found = [leaf for leaf in _walk(schema["properties"]["spec"], ("spec",))
             if leaf.path[:2] != ("spec", "podTemplate") or len(leaf.path) <= 3]
    return (*found, Leaf(("metadata", "name"), {"type": "string", "maxLength": 63}))


_JUNK: st.SearchStrategy[Any] = st.sampled_from([None, "", " ", "\n", "a\nb", "x\x00y", "auto", "-1", "1e309", "NaN", "🙂" * 40,
                         "a" * 5000, [], [1, 2], {}, {"a": {"b": {"c": {}}}}, True, False, -1, 0, 1.5,
                         float("nan"), float("inf"), float("-inf"), 2**64, -(2**63) - 1, 10**30])


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _integers(node: dict[str, Any]) -> st.SearchStrategy[int]:
    low = node.get("minimum", -INT64 - 1)
    high = node.get("maximum", INT64)
    if node.get("exclusiveMinimum"):
        low += 1
    small = st.integers(max(low, -4), min(high, max(low, -4) + 64)) if max(low, -4) <= high else st.just(low)
    return st.one_of(small, st.integers(low, high))


def _boundaries(node: dict[str, Any]) -> list[Any]:
    edges: list[Any] = [0, -1, INT32, INT32 + 1, INT64, INT64 + 1, -(2**63)]
    for key in ("minimum", "maximum"):
        if key in node:
            edges += [node[key] - 1, node[key], node[key] + 1]
    if "maxLength" in node:
        edges += ["a" * node["maxLength"], "a" * (node["maxLength"] + 1)]
    return edges


def valid(node: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value inside ``node``'s schema (as far as the schema alone says)."""
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if node.get("x-kubernetes-int-or-string"):
        return st.one_of(st.just("auto"), _integers(node))
    if kind == "integer":
        return _integers(node)
    if kind == "number":
        low = node.get("minimum")
        return st.floats(min_value=low, max_value=node.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min=bool(node.get("exclusiveMinimum")) and low is not None)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        if "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True).filter(
                lambda text: len(text) <= node.get("maxLength", 253))
        return st.text(max_size=min(node.get("maxLength", 40), 40))
    if kind == "array":
        return st.lists(valid(node.get("items") or {}), max_size=3)
    if kind == "object" and "properties" not in node:
        return st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)
    return _JUNK


def boundary(node: dict[str, Any]) -> st.SearchStrategy[Any]:
    return st.sampled_from(_boundaries(node))


def invalid(node: dict[str, Any]) -> st.SearchStrategy[Any]:
    return st.one_of(_JUNK, st.builds(_deep, st.integers(40, 400)))


FLAVOURS = {"valid": valid, "boundary": boundary, "invalid": invalid}


def _set(body: dict[str, Any], path: tuple[str, ...], value: Any, delete: bool) -> None:
    here = body
    for key in path[:-1]:
        if not isinstance(here.get(key), dict):
            here[key] = {}
        here = here[key]
    if delete:
        here.pop(path[-1], None)
    else:
        here[path[-1]] = value


@st.composite
def changes(draw: st.DrawFn, flavours: tuple[str, ...] = tuple(FLAVOURS)) -> tuple[tuple[str, ...], Any, bool]:
    """One change: a field, the value it takes (of a drawn flavour), or its deletion."""
    leaf = draw(st.sampled_from(leaves()))
    if draw(st.integers(0, 9)) == 0:
        return leaf.path, None, True
    flavour = draw(st.sampled_from(flavours))
    return leaf.path, draw(FLAVOURS[flavour](leaf.node)), False


@st.composite
def manifests(draw: st.DrawFn, flavours: tuple[str, ...] = tuple(FLAVOURS), most: int = 3) -> dict[str, Any]:
    """:data:`BASE` with one to ``most`` :func:`changes`."""
    body = copy.deepcopy(BASE)
    for path, value, delete in draw(st.lists(changes(flavours), min_size=1, max_size=most)):
        _set(body, path, value, delete)
    return body


_TEXTS = [
    "", "\x00", "---\n...\n", "[1, 2]", "just a string", "{" * 5000, "- " * 3000 + "x",
    "a: &a [1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
    "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n",
    "kind: AlpaJob\nkind: AlpaJob\n", "spec:\n\tmodel: x\n", "%YAML 9.9\n---\na: 1\n", "!!python/object:os.system {}\n",
    "a: !!binary AAAA\n", "? [1, 2]\n: 3\n", "a: 1\n---\nb: 2\n", "<<: {a: 1}\n<<: {b: 2}\n",
]


@st.composite
def texts(draw: st.DrawFn) -> bytes:
    """YAML text attacks: known shapes, a valid manifest cut or spliced, random bytes."""
    import yaml

    whole = yaml.safe_dump(draw(manifests()), sort_keys=False).encode()
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(st.sampled_from(_TEXTS)).encode()
    if choice == 1:
        cut = draw(st.integers(0, len(whole)))
        return whole[:cut]
    if choice == 2:
        at = draw(st.integers(0, len(whole)))
        return whole[:at] + draw(st.binary(max_size=16)) + whole[at:]
    return draw(st.binary(max_size=200))
