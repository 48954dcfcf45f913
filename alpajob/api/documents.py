"""YAML documents read within bounds: the one way a manifest's text becomes data.

Every manifest a user hands AlpaJob (``alpajob plan``/``run``, :func:`alpajob.load`,
the pods reading their job back) goes through :func:`read_text` and
:func:`load_documents`. They take what the Kubernetes API server would take and
refuse the rest in one :class:`~alpajob.api.errors.ManifestError` naming the file and
the line, never a traceback or a wait:

- **size**: at most :data:`MAX_BYTES` (3 MiB, the API server's limit on a request
  body), read in one bounded read, so ``/dev/zero`` or a 50 MB file is refused at once;
- **text**: strict UTF-8 (a binary file is named as such, with the byte offset);
- **depth**: mappings and sequences nested at most :data:`MAX_DEPTH` levels (the
  composer would otherwise recurse until Python's stack ends);
- **aliases**: the document with its aliases expanded may hold at most
  :data:`MAX_NODES` nodes. An alias bomb (a few lines whose anchors refer to each
  other nine deep) expands to billions; it is counted, not built: each node's
  expanded size is the sum of its children's, computed once per distinct node. A node
  that refers to itself cannot be sent to the API server as JSON and is refused too;
- **duplicate keys**: YAML keeps the last of two equal keys and drops the first in
  silence; here the second one is refused, naming both lines. Merge keys (``<<``)
  may still be overridden, as YAML defines them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from alpajob.api.errors import ManifestError

#: The Kubernetes API server's limit on a request body (and so on an object).
MAX_BYTES = 3 * 1024 * 1024
#: How deep mappings and sequences may nest (a pod's affinity is about 8 deep).
MAX_DEPTH = 64
#: Nodes a document may hold with its aliases expanded (3 MiB of JSON at about 16
#: bytes a node).
MAX_NODES = 200_000


class _Refused(Exception):
    """A bound broken while loading: its message and the line it names."""

    def __init__(self, line: int, message: str) -> None:
        self.line, self.message = line, message
        super().__init__(message)


def _line(node: Node) -> int:
    return node.start_mark.line + 1


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the bounds of the module docstring."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(self.peek_event().start_mark.line + 1,
                               f"nests deeper than {MAX_DEPTH} levels; no AlpaJob field is that deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Node | None:
        node = super().compose_document()
        if node is not None:
            size = _expanded(node, {})
            if size > MAX_NODES:
                raise _Refused(_line(node), (
                    f"expands to {size:,} values with its aliases, more than {MAX_NODES:,}: "
                    "anchors and aliases (&name, *name) may repeat parts, not multiply them"))
        return node  # type: ignore[no-any-return]

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.get(key)
            except TypeError:
                raise _Refused(_line(key_node), "has a key that is a list or a mapping; keys are "
                                                "names") from None
            if seen is not None:
                raise _Refused(_line(key_node), (
                    f"gives the key {key!r} twice (also on line {seen}): YAML would keep only "
                    "the last one; keep one"))
            first[key] = _line(key_node)
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]


def _expanded(node: Node, sizes: dict[int, int]) -> int:
    """How many nodes ``node`` holds once every alias in it is expanded; each distinct
    node is counted once (``sizes``, by id), so an alias bomb costs its own size."""
    known = sizes.get(id(node))
    if known is not None:
        if known < 0:
            raise _Refused(_line(node), "refers to itself through an alias; a manifest must be a tree")
        return known
    sizes[id(node)] = -1  # in progress: met again below, it contains itself
    total = 1
    if isinstance(node, SequenceNode):
        total += sum(_expanded(child, sizes) for child in node.value)
    elif isinstance(node, MappingNode):
        total += sum(_expanded(key, sizes) + _expanded(value, sizes) for key, value in node.value)
    else:
        assert isinstance(node, ScalarNode)
    sizes[id(node)] = total
    return total


def read_text(path: str | Path, source: str | None = None) -> str:
    """The text of the manifest at ``path``, read at most :data:`MAX_BYTES` (+1) bytes
    and decoded as strict UTF-8; :class:`ManifestError` naming ``source`` (default:
    the path) otherwise."""
    source = source or str(path)
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_BYTES + 1)
    except OSError as error:
        raise ManifestError(source, f"cannot read the manifest: {error.strerror or error}") from None
    if len(data) > MAX_BYTES:
        raise ManifestError(source, (
            f"is larger than {MAX_BYTES // 2**20} MiB, the most the Kubernetes API server takes; "
            "an AlpaJob manifest is a few kilobytes: give the manifest, not the data"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ManifestError(source, (
            f"is not UTF-8 text (byte {error.start:,} is {data[error.start]:#04x}): give the YAML "
            "manifest, not a binary file")) from None


def load_documents(text: str, source: str = "manifest") -> list[Any]:
    """Every non-empty YAML document of ``text``, within the bounds of the module
    docstring; :class:`ManifestError` naming ``source`` and the line otherwise."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise ManifestError(source, f"is larger than {MAX_BYTES // 2**20} MiB, the most the "
                                    "Kubernetes API server takes")
    try:
        loader = _BoundedLoader(text)  # its reader checks the first characters at once
    except yaml.YAMLError as error:
        raise ManifestError(source, f"is not valid YAML: {_reader_problem(error)}") from None
    documents: list[Any] = []
    try:
        while loader.check_data():
            document = loader.get_data()
            if document is not None:
                documents.append(document)
    except _Refused as refused:
        raise ManifestError(f"{source}: line {refused.line}", refused.message) from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{source}: line {mark.line + 1}, column {mark.column + 1}" if mark is not None else source
        context = f" ({error.context})" if error.context else ""
        raise ManifestError(where, f"is not valid YAML: {error.problem}{context}") from None
    except yaml.YAMLError as error:  # the reader's: a character YAML does not allow
        raise ManifestError(source, f"is not valid YAML: {_reader_problem(error)}") from None
    finally:
        loader.dispose()
    return documents


def _reader_problem(error: yaml.YAMLError) -> str:
    """A reader's error (a character YAML does not allow, such as NUL), in words."""
    if isinstance(error, yaml.reader.ReaderError):
        return (f"character {error.character:#06x} at character {error.position + 1:,} is not allowed "
                "(YAML takes printable Unicode only)")
    return " ".join(str(error).split())
