"""The AlpaJob resource as a whole, and reading one from YAML.

A user's manifest is the same YAML they ``kubectl apply``::

    apiVersion: alpajob.io/v1alpha1
    kind: AlpaJob
    metadata: {name: gpt-2-6b}
    spec: {model: {zoo: gpt, config: 2.6b}, cluster: {gpu: v100-16gb}}

:func:`document_problems` judges a document the way the API server and the webhook
do: the typed model first (types, enums, bounds, unknown keys), then
:func:`~alpajob.api.validation.spec_problems`, then, on an update, the immutable
fields. It never raises: every problem becomes one line naming the field in the
manifest's camelCase spelling. :func:`parse_job` and :func:`load_job` return the typed
:class:`AlpaJob` or raise :class:`~alpajob.api.errors.ManifestError` for the first
problem (what the CLI prints before it exits with status 2).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from alpajob.api.documents import load_documents, read_text
from alpajob.api.errors import ManifestError
from alpajob.api.names import API_VERSION, KIND
from alpajob.api.pod_template import LABEL_VALUE
from alpajob.api.schema import Contract
from alpajob.api.spec import DNS_SUBDOMAIN, IMAGE_REFERENCE, Spec
from alpajob.api.status import Status
from alpajob.api.validation import Problem, immutable_problems, spec_problems

#: Longest job name: children are named ``<job>-<attempt>-m<mesh>-h<host>`` and
#: ``<job>-hosts`` and must stay DNS labels (63 characters).
MAX_NAME_LENGTH = 45
NAME_PATTERN = r"[a-z]([-a-z0-9]*[a-z0-9])?"


class Metadata(BaseModel):
    """``metadata``: the name matters to AlpaJob (its children are named after it);
    every other key is kept as Kubernetes wrote it."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = "alpajob"
    namespace: str | None = None

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if len(name) > MAX_NAME_LENGTH or not re.fullmatch(NAME_PATTERN, name):
            raise ValueError(
                f"{name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
                "(lowercase letters, digits and '-', starting with a letter): the job's "
                "Services, pods and labels are named after it; choose a shorter name")
        return name


class AlpaJob(Contract):
    """A whole AlpaJob: ``apiVersion``, ``kind``, ``metadata``, ``spec`` and ``status``."""

    api_version: Literal["alpajob.io/v1alpha1"] = API_VERSION
    kind: Literal["AlpaJob"] = KIND
    metadata: Metadata = Field(default_factory=Metadata)
    spec: Spec
    status: Status | None = None

    @property
    def name(self) -> str:
        return self.metadata.name


#: What a pattern of the typed spec asks for, in words (pydantic would print the pattern).
PATTERN_WORDS = {
    IMAGE_REFERENCE: "is not an image reference: [registry[:port]/]path[:tag][@digest], the path in "
                     "lowercase (e.g. ghcr.io/team/trainer:1.2)",
    LABEL_VALUE: "is not a label value: empty, or at most 63 letters, digits, '-', '_' or '.', "
                 "starting and ending with a letter or digit",
    DNS_SUBDOMAIN: "is not a Kubernetes object name: lowercase letters, digits, '-' and '.', "
                   "starting and ending with a letter or digit",
}


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNION_TAGS = ("literal[", "function-", "lax-", "json-")


def _field_path(loc: tuple[Any, ...]) -> str:
    """``('spec', 'training', 'global_batch_size')`` -> ``spec.training.globalBatchSize``.

    Pydantic puts union-member tags (``int``, ``list[ManualStage]``, a model's class
    name such as ``OptimizerSpec``) into the location; they are not fields (fields are
    camelCase, classes CamelCase) and are dropped. A map's key that is not a name
    (``nodeSelector``'s ``kubernetes.io/arch``, a key with a newline) is quoted:
    ``spec.cluster.nodeSelector["kubernetes.io/arch"]``, so the path stays one line.
    """
    parts: list[str] = []
    for part in loc:
        text = str(part)
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif not _NAME.fullmatch(text) and not text.startswith(_UNION_TAGS) and "[" not in text:
            parts.append(f"[{json.dumps(text)}]")
        elif ("[" in text or text in {"int", "str", "dict", "list"} or text[:1].isupper()
              or text.startswith(_UNION_TAGS)):
            continue
        else:
            parts.append(("." if parts else "") + to_camel(text))
    return "".join(parts).replace(".[", "[") or "manifest"


def _validation_problems(error: ValidationError) -> list[Problem]:
    """One problem per distinct field of a pydantic error.

    For a union (``numMicroBatches: 'auto' | int``, ``stages: 'auto' | list``) pydantic
    reports every member; the deepest location is the member the user meant, and the
    most specific message.
    """
    by_field: dict[str, Problem] = {}
    for entry in sorted(error.errors(), key=lambda e: -len(e["loc"])):
        field = _field_path(tuple(entry["loc"]))
        message = str(entry["msg"]).removeprefix("Value error, ")
        if entry["type"] == "extra_forbidden":
            message = "unknown field; remove it or check its spelling"
        elif entry["type"] == "literal_error" and field == "apiVersion":
            message = f"must be {API_VERSION}"
        elif entry["type"] == "literal_error" and field == "kind":
            message = f"must be {KIND}"
        elif entry["type"] == "missing":
            message = "is required"
        elif entry["type"] == "string_pattern_mismatch":
            words = PATTERN_WORDS.get(str((entry.get("ctx") or {}).get("pattern")))
            message = f"{entry['input']!r} {words}" if words else message
        if field.endswith(("numMicroBatches", "numLayers")) and "the most AlpaJob takes" not in message:
            message = "must be 'auto' or a positive integer"
        parent = next((f for f in by_field if f.startswith(field + ".") or f.startswith(field + "[")),
                      None)
        if field not in by_field and parent is None:
            by_field[field] = Problem(field, message)
    return list(by_field.values())


def document_problems(data: Any, old: Any = None) -> list[Problem]:
    """Every problem of the AlpaJob ``data`` (``old``: the stored object, on an update)."""
    if not isinstance(data, dict):
        return [Problem("manifest", "must be a YAML mapping with apiVersion, kind and spec")]
    missing = [Problem(key, f"is required; add {key}: {value}") for key, value in
               (("apiVersion", API_VERSION), ("kind", KIND)) if key not in data]
    if missing:
        return missing
    try:
        job = AlpaJob.model_validate({k: v for k, v in data.items() if k != "status"})
    except ValidationError as error:
        return _validation_problems(error)
    problems = spec_problems(job.spec)
    if isinstance(old, dict):
        problems += immutable_problems(data.get("spec"), old.get("spec"))
    return problems


def parse_job(data: Any, source: str = "manifest") -> AlpaJob:
    """The typed AlpaJob of a loaded YAML document; :class:`ManifestError` for its first
    problem. The document's ``status``, if any, is kept."""
    problems = document_problems(data)
    if problems:
        first = problems[0]
        field = source if first.field == "manifest" else first.field
        raise ManifestError(field, first.message)
    try:
        return AlpaJob.model_validate(data)
    except ValidationError as error:  # the spec is sound: only the status can be wrong
        first = _validation_problems(error)[0]
        raise ManifestError(first.field, f"{first.message} (the status is the operator's: drop it "
                                         "from a manifest you write)") from None


def load_job(path: str | Path) -> AlpaJob:
    """Read and validate the AlpaJob manifest at ``path``.

    A file with several YAML documents (a ``---`` list) must hold exactly one AlpaJob.
    """
    path = Path(path)
    documents = load_documents(read_text(path), str(path))
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) == 1:
        return parse_job(jobs[0], str(path))
    if len(documents) == 1:
        kind = documents[0].get("kind") if isinstance(documents[0], dict) else None
        if kind is not None and kind != KIND:
            raise ManifestError(f"{path}: kind", f"is {kind!r}, not {KIND}; give the file of an "
                                                 "AlpaJob manifest")
        return parse_job(documents[0], str(path))
    raise ManifestError(str(path), f"must contain exactly one document of kind {KIND}, "
                                   f"found {len(jobs)}")


def dump_job(job: AlpaJob) -> str:
    """``job`` as the YAML manifest a user would apply (no status)."""
    data = job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
    return yaml.safe_dump(data, sort_keys=False)
