"""One source of the data as one stream of token ids, read in place.

A :class:`TokenCorpus` is a source's shards end to end: token ``t`` of the stream is
token ``t - starts[s]`` of shard ``s`` (``starts`` the shards' running totals, one
number per shard), so many shards form one corpus without being concatenated, and a
read that spans two shards is two reads. Token files (``format: tokens``) are opened
where they lie (:mod:`.shards`). Text, jsonl and ArrayRecord documents are tokenized
at the start, each followed by the tokenizer's end-of-text id, into one in-memory
shard of the smallest integer type the vocabulary fits: fine for a corpus of up to a
few hundred MB of text; a larger one is tokenized once by ``alpajob data prepare``.

The loader cuts the stream into sequences, so a sequence may span two documents, as
in GPT-2, nanoGPT and MaxText's packing: no token is padding, and the end-of-text id
tells the model where one document stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from alpajob.api.data import DataFormat, DataSpec
from alpajob.api.errors import ManifestError
from alpajob.api.wording import counted
from alpajob.trainer_image.data.remote import DataReadError
from alpajob.trainer_image.data.shards import Opener, Shard, in_memory, open_token_files
from alpajob.trainer_image.data.sources import expand, listing, read_documents
from alpajob.trainer_image.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenCorpus:
    """A source's token ids: its shards as one stream (module docstring)."""

    name: str  # the source's name: train, eval, or a mixture source's
    field: str  # where it is configured, for messages (spec.data.train, spec.data.train[1].path)
    shards: tuple[Shard, ...]
    starts: tuple[int, ...]  # shard s holds tokens [starts[s], starts[s + 1])
    files: int  # the files it came from (a tokenized text corpus is one shard of many files)

    @classmethod
    def of(cls, name: str, field: str, shards: Sequence[Shard], files: int | None = None) -> TokenCorpus:
        starts = np.concatenate([[0], np.cumsum([s.tokens for s in shards], dtype=np.int64)])
        return cls(name, field, tuple(shards), tuple(int(x) for x in starts),
                   len(shards) if files is None else files)

    @property
    def tokens(self) -> int:
        return self.starts[-1]

    @property
    def dtype(self) -> np.dtype:
        return np.result_type(*(s.dtype for s in self.shards)) if self.shards else np.dtype(np.uint16)

    @property
    def max_id(self) -> int | None:
        """The largest id, when every shard's is known (an index, or tokenized here)."""
        known = [s.max_id for s in self.shards]
        return None if any(m is None for m in known) else max((m for m in known if m is not None), default=-1)

    def windows(self, seq_len: int) -> int:
        """How many sequences of ``seq_len`` (+1) tokens the stream holds."""
        return max(self.tokens - 1, 0) // seq_len

    def locate(self, token: int) -> tuple[Shard, int]:
        """The shard that holds stream token ``token``, and its index there."""
        s = int(np.searchsorted(self.starts, token, side="right")) - 1
        return self.shards[s], token - self.starts[s]

    def read(self, start: int, stop: int) -> tuple[np.ndarray, int]:
        """Ids ``[start, stop)`` of the stream in the stored dtype, and the bytes read."""
        s = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces, read = [], 0
        while start < stop:
            shard, first = self.shards[s], start - self.starts[s]
            last = min(stop, self.starts[s + 1]) - self.starts[s]
            if last > first:
                piece = shard.read(first, last)
                pieces.append(piece)
                read += piece.nbytes
                start += last - first
            s += 1
        if len(pieces) == 1:
            return pieces[0], read
        return (np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)), read

    def describe(self) -> str:
        return f"{counted(self.files, 'file')}, {self.tokens:,} tokens"


def smallest_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def tokenize_files(files: Sequence[str], data: DataSpec, tokenizer: Tokenizer) -> np.ndarray:
    """The documents of ``files`` tokenized and joined, each followed by the
    end-of-text id, in the smallest dtype the vocabulary fits."""
    dtype = smallest_dtype(tokenizer.vocab_size)
    pieces = tokenizer.encode_all(read_documents(files, data.format, data.field))
    eot = tokenizer.end_of_text
    if eot is not None:
        pieces = [p for piece in pieces for p in (piece, np.asarray([eot], np.int32))]
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.int32)).astype(dtype)


def open_source(data: DataSpec, name: str, field: str, patterns: Sequence[str], tokenizer: Tokenizer,
                opener: Opener) -> TokenCorpus:
    """One source (``patterns``, configured at ``field``) as a :class:`TokenCorpus`."""
    if data.format is DataFormat.TOKENS:
        return TokenCorpus.of(name, field, open_token_files(patterns, replace(opener, field=field)))
    files = [f.url for f in expand(patterns, field)]
    tokens = tokenize_files(files, data, tokenizer)
    return TokenCorpus.of(name, field, [in_memory(tokens, f"{field} (tokenized)")], files=len(files))


def train_fields(data: DataSpec) -> list[tuple[str, str, list[str]]]:
    """Each training source's name, the field that configures it, and its patterns,
    in ``spec.data.train``'s order (weight-0 ones included)."""
    mixture = data.is_mixture() or any(s.name for s in data.sources())
    return [(name, f"spec.data.train[{index}].path" if mixture else "spec.data.train", list(source.paths()))
            for index, (name, source) in enumerate(data.named_sources())]


def open_train(data: DataSpec, tokenizer: Tokenizer, opener: Opener) -> list[TokenCorpus]:
    """The training sources, in ``spec.data.train``'s order (weight-0 ones included)."""
    return [open_source(data, name, field, patterns, tokenizer, opener)
            for name, field, patterns in train_fields(data)]


def open_eval(data: DataSpec, tokenizer: Tokenizer, opener: Opener) -> TokenCorpus | None:
    if data.eval is None:
        return None
    return open_source(data, "eval", "spec.data.eval", data.eval_paths(), tokenizer, opener)


def check_present(data: DataSpec) -> list[str]:
    """Before anything starts (a mesh pod's check before Ray): every pattern of
    ``spec.data`` names something here, one listing per pattern and nothing read, so
    a path that is not there (a volume not mounted, a typo) fails at once with a
    :class:`ManifestError` naming its field instead of after Ray, compilation and
    the first batch. A store that does not answer is not a verdict (the reads retry
    later): it comes back as a warning."""
    fields = [(field, patterns) for _, field, patterns in train_fields(data)]
    if data.eval is not None:
        fields.append(("spec.data.eval", list(data.eval_paths())))
    warnings = []
    for field, patterns in fields:
        for pattern in patterns:
            try:
                found = listing(pattern, field)
            except DataReadError as error:
                warnings.append(f"{field}: {error}; the reads will retry")
                continue
            if not found.entries:
                raise ManifestError(field, f"{pattern!r} matches nothing in this pod; check the path, and that "
                                           "every mesh pod mounts its volume (spec.podTemplate.mesh.volumes)")
    return warnings


def check_known_ids(corpus: TokenCorpus, vocab: int | None) -> None:
    """Refuse, before any training, ids the model's embedding has no row for, where the
    corpus knows its largest id (tokenized here, or an index); other corpora are
    checked on every window read (:mod:`.loader`)."""
    top = corpus.max_id
    if vocab is not None and top is not None and top >= vocab:
        raise ManifestError(corpus.field, f"holds token id {top} but the model's vocabulary is {vocab}; "
                                          f"set spec.model.config.vocab to at least {top + 1}, or check "
                                          "spec.data.tokenizer")
