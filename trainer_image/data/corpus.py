"""One split of the data as one array of token ids.

Documents (text or jsonl) are tokenized and joined, each followed by the tokenizer's
end-of-text id, into one array; token files are concatenated as they are. The loader
cuts the array into sequences, so a sequence may span two documents, as in GPT-2,
nanoGPT and MaxText's packing: no token is padding, and the end-of-text id tells the
model where one document stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from alpajob.api.errors import ManifestError
from alpajob.api.spec import DataFormat, DataSpec
from alpajob.api.wording import counted
from alpajob.trainer_image.data.sources import expand, read_documents, read_tokens
from alpajob.trainer_image.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class Corpus:
    """A split's token ids, and where they came from."""

    tokens: np.ndarray  # int32, 1-D
    files: tuple[str, ...]
    field: str  # spec.data.train or spec.data.eval

    def describe(self) -> str:
        return f"{counted(len(self.files), 'file')}, {len(self.tokens):,} tokens"


def load_corpus(data: DataSpec, split: str, tokenizer: Tokenizer) -> Corpus:
    """The ``split`` (``train`` or ``eval``) of ``spec.data`` as token ids."""
    field = f"spec.data.{split}"
    patterns = data.train_paths() if split == "train" else data.eval_paths()
    files = expand(patterns, field)
    if data.format is DataFormat.TOKENS:
        tokens = read_tokens(files, data.token_dtype)
    else:
        pieces = tokenizer.encode_all(read_documents(files, data.format, data.field))
        eot = tokenizer.end_of_text
        if eot is not None:
            pieces = [p for piece in pieces for p in (piece, np.asarray([eot], np.int32))]
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return Corpus(tokens.astype(np.int32, copy=False), tuple(files), field)


def check_ids(corpus: Corpus, vocab: int | None) -> None:
    """Refuse token ids the model's embedding has no row for."""
    if vocab is not None and len(corpus.tokens) and int(corpus.tokens.max()) >= vocab:
        top = int(corpus.tokens.max())
        raise ManifestError(corpus.field, f"holds token id {top} but the model's vocabulary is {vocab}; "
                                          f"set spec.model.config.vocab to at least {top + 1}, or check "
                                          "spec.data.tokenizer")
