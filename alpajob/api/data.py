"""``spec.data`` and the token index: what a job trains on, and how prepared tokens are laid out.

Two contracts live here. :class:`DataSpec` is the manifest's ``spec.data``::

    spec:
      data:
        train: "corpus/*.bin"                    # one source: a path, glob, URL or list
        # or a mixture, each source with its weight (Megatron's blends):
        # train: [{path: "web/*.bin", weight: 0.7}, {path: "code/*.bin", weight: 0.3}]
        eval: "valid/*.bin"
        format: tokens                           # text | jsonl | tokens | arrayrecord
        tokenizer: bytes                         # or a tokenizer.json
        cache: {size: 8Gi}                       # remote sources: a bounded local cache

:class:`TokenIndex` is the ``index.json`` that ``alpajob data prepare`` writes beside
its token shards and the loader reads (a folder with an ``index.json`` is opened from
it, with no listing or size call per shard): the shards in order, their token counts,
document counts and largest id, and how the ids were made.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from pydantic import Field, field_validator, model_validator

from alpajob.api.pod_template import Quantity
from alpajob.api.schema import INT64, INT64_MAX, Contract, cel, k8s


class DataFormat(StrEnum):
    """``spec.data.format``: what the files hold."""

    TEXT = "text"  # plain text, one document per file
    JSONL = "jsonl"  # one JSON object per line; its `field` is a document
    TOKENS = "tokens"  # token ids: .npy, or raw .bin (spec.data.tokenDtype), or a prepared folder
    ARRAYRECORD = "arrayrecord"  # ArrayRecord files (local); each record one document's UTF-8 text


class TokenDtype(StrEnum):
    """``spec.data.tokenDtype``: the integer type of raw ``.bin`` token files."""

    UINT16 = "uint16"
    UINT32 = "uint32"


#: The byte-level tokenizer: 256 ids, one per byte, no files needed.
BYTES_TOKENIZER = "bytes"
#: The name of a prepared folder's index.
INDEX_FILE = "index.json"
#: The remote cache when ``spec.data.cache`` is not set.
DEFAULT_CACHE_SIZE = "4Gi"
DEFAULT_CACHE_PATH = "/tmp/alpajob-data-cache"
#: The data URL schemes a cluster allows unless its operator says otherwise
#: (``alpajob operator --data-schemes``): local paths and volumes, S3 and Google Cloud
#: Storage. A web URL (http, https) reads from anywhere the pods can reach, so it is
#: allowed only where the operator is told to.
DEFAULT_DATA_SCHEMES = ("file", "s3", "gs")


def _patterns(value: Any) -> Any:
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or any(not isinstance(p, str) or not p.strip() for p in paths):
        raise ValueError("give a path, glob or URL, or a non-empty list of them")
    return value


class DataSource(Contract):
    """One source of a mixture (``spec.data.train`` as a list of these): its files and
    its weight. Each global batch takes its rows from the sources in proportion to the
    weights, exactly in the long run and within one row at every batch's end."""

    path: str | list[str] = Field(json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True),
                                  description="The source's files: a path, glob or URL, or a list.")
    weight: float = Field(ge=0, description=(
        "Its share of every batch, relative to the other sources' (0: not read)."))
    name: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][-._A-Za-z0-9]*$",
                             description="Its name in metrics and messages (default: source-<index>).")

    @field_validator("path")
    @classmethod
    def _path(cls, value: Any) -> Any:
        return _patterns(value)

    @field_validator("weight")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number; give a weight such as 0.3")
        return value

    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


class DataCache(Contract):
    """``spec.data.cache``: where a mesh host keeps what it read of remote sources
    (``s3://``, ``gs://``, ``https://``), so a window read twice is fetched once. The
    cache holds fixed-size blocks of the shards and drops the least recently used ones
    beyond ``size``; local files are read in place and never cached."""

    size: Quantity = Field(DEFAULT_CACHE_SIZE, description=(
        "Bytes of local disk the cache may hold (default 4Gi; 0 turns it off)."))
    path: str = Field(DEFAULT_CACHE_PATH, min_length=1, max_length=1024, description=(
        "The cache's folder on each host (default /tmp/alpajob-data-cache); mount a volume there for a large cache."))


class DataSpec(Contract):
    """``spec.data``: what to train and evaluate on.

    ``train`` and ``eval`` are a path, a glob or a list of them, local or an fsspec URL
    (``s3://``, ``gs://``, ``https://``, ``file://``, ``memory://``); ``{stdlib}`` stands
    for the Python standard library's folder (text on every machine). ``train`` may
    instead be a list of :class:`DataSource` (a mixture). Documents are tokenized
    (``tokenizer``), joined with the tokenizer's end-of-text id and cut into sequences
    of the model's length; token shards (``format: tokens``) are read in place.
    """

    model_config = Contract.model_config | {"json_schema_extra": k8s(
        cel("self == oldSelf", "spec.data is immutable once the AlpaJob exists (restarts resume "
            "in its order); create a new AlpaJob to train on other data"))}

    train: str | list[str] | list[DataSource] = Field(
        json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True),
        description=("Files to train on: a path, glob or URL, or a list; or a mixture: a list of "
                     "{path, weight, name}."))
    eval: str | list[str] | None = Field(
        None, json_schema_extra=k8s(x_kubernetes_preserve_unknown_fields=True),
        description=("Files to evaluate on after the last step and every spec.training.evalEvery "
                     "steps: a path, glob or URL, or a list."))
    format: DataFormat = Field(DataFormat.TEXT, description="text, jsonl, tokens or arrayrecord.")
    field: str = Field("text", max_length=253, description="jsonl: the key of each line's text.")
    tokenizer: str = Field(BYTES_TOKENIZER, min_length=1, max_length=1024, description=(
        "bytes (256 ids, no files), or a Hugging Face tokenizer.json (a path or URL)."))
    token_dtype: TokenDtype = Field(TokenDtype.UINT16, description=(
        "tokens format: the integer type of raw .bin files (.npy files and prepared folders say their own)."))
    cache: DataCache | None = Field(None, description=(
        "Remote sources: each host's bounded local cache (default 4Gi under /tmp/alpajob-data-cache)."))

    @field_validator("train", mode="before")
    @classmethod
    def _train(cls, value: Any) -> Any:
        if isinstance(value, list) and any(isinstance(v, dict) for v in value):
            if not all(isinstance(v, dict) for v in value):
                raise ValueError("a mixture is a list of {path, weight} objects only; write every "
                                 "source as one, e.g. [{path: a/*.bin, weight: 1}, {path: b/*.bin, weight: 1}]")
            return value
        return _patterns(value)

    @field_validator("eval", mode="before")
    @classmethod
    def _eval(cls, value: Any) -> Any:
        return None if value is None else _patterns(value)

    @model_validator(mode="after")
    def _mixture(self) -> DataSpec:
        if self._listed():
            if sum(s.weight for s in self.sources()) <= 0:
                raise ValueError("train: the mixture's weights sum to 0; give at least one source a "
                                 "positive weight")
            names = [name for name, _ in self.named_sources()]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"train: two sources are named {twice[0]!r}; give each its own name")
        return self

    def _listed(self) -> bool:
        """Whether ``train`` is a list of sources (a mixture, perhaps of one)."""
        return isinstance(self.train, list) and bool(self.train) and isinstance(self.train[0], DataSource)

    def sources(self) -> list[DataSource]:
        """The training sources: the mixture's, or the one ``train`` names (weight 1)."""
        if self._listed():
            return list(self.train)  # type: ignore[arg-type]
        return [DataSource(path=self.train, weight=1.0)]  # type: ignore[arg-type]

    def locations(self) -> list[tuple[str, str]]:
        """Every place the job reads from, as (field, path or URL): each training
        source's patterns, the eval patterns, and a tokenizer file (not ``bytes``)."""
        mixture = self.is_mixture() or any(s.name for s in self.sources())
        out = [(f"spec.data.train[{i}].path" if mixture else "spec.data.train", p)
               for i, source in enumerate(self.sources()) for p in source.paths()]
        if self.eval is not None:
            out += [("spec.data.eval", p) for p in ([self.eval] if isinstance(self.eval, str) else self.eval)]
        if self.tokenizer != BYTES_TOKENIZER:
            out.append(("spec.data.tokenizer", self.tokenizer))
        return out

    def named_sources(self) -> list[tuple[str, DataSource]]:
        """Each source with its name (``name``, else ``source-<index>``; a single
        source is ``train``)."""
        sources = self.sources()
        if len(sources) == 1 and sources[0].name is None:
            return [("train", sources[0])]
        return [(s.name or f"source-{i}", s) for i, s in enumerate(sources)]

    def is_mixture(self) -> bool:
        return len(self.sources()) > 1

    def train_paths(self) -> list[str]:
        """Every pattern of every training source."""
        return [p for source in self.sources() for p in source.paths()]

    def eval_paths(self) -> list[str]:
        return [] if self.eval is None else [self.eval] if isinstance(self.eval, str) else list(self.eval)


class IndexShard(Contract):
    """One shard of a :class:`TokenIndex`."""

    path: str = Field(min_length=1, description="The shard's file, relative to the index's folder.")
    tokens: int = Field(ge=0, le=INT64_MAX, json_schema_extra=INT64, description="Token ids it holds.")
    documents: int = Field(0, ge=0, le=INT64_MAX, json_schema_extra=INT64, description="Documents that end in it.")
    max_id: int = Field(-1, ge=-1, le=INT64_MAX, json_schema_extra=INT64, description="Its largest id (-1: empty).")


class TokenIndex(Contract):
    """``index.json`` of a prepared folder: its raw token shards in order, as one corpus."""

    version: int = Field(1, ge=1, le=1, description="The index format's version.")
    dtype: TokenDtype = Field(description="The integer type of every shard.")
    tokenizer: str = Field(BYTES_TOKENIZER, description="The tokenizer the ids came from.")
    vocab_size: int | None = Field(None, ge=1, description="Its vocabulary.")
    end_of_text: int | None = Field(None, ge=0, description="The id that ends each document.")
    shards: list[IndexShard] = Field(description="The shards, in corpus order.")

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def max_id(self) -> int:
        return max((s.max_id for s in self.shards), default=-1)
