"""Text to token ids: bytes, or a Hugging Face ``tokenizer.json``.

``bytes`` needs no files: every byte of the UTF-8 text is one id (vocabulary 256), and
byte 0, which text files do not hold, ends each document. A ``tokenizer.json`` (a path
or URL; the ``tokenizers`` package reads it) brings its own vocabulary and end-of-text
token (``<|endoftext|>``, ``</s>``, ``<eos>`` or ``<|end_of_text|>``, the first it has).
A model whose vocabulary is smaller than the tokenizer's cannot be trained on its ids:
that is a clear error, not an index out of range at step one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import numpy as np

from alpajob.api.data import BYTES_TOKENIZER
from alpajob.api.errors import ManifestError

#: End-of-text tokens, in the order a tokenizer.json is searched for one.
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class Tokenizer(Protocol):
    """What the corpus needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def end_of_text(self) -> int | None: ...
    def encode_all(self, texts: Iterable[str]) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """One id per UTF-8 byte; id 0 (the NUL byte) ends a document."""

    vocab_size: int = 256
    end_of_text: int | None = 0

    def encode_all(self, texts: Iterable[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]


@dataclass(frozen=True)
class HuggingFaceTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` package."""

    tokenizer: Any
    vocab_size: int
    end_of_text: int | None

    def encode_all(self, texts: Iterable[str]) -> list[np.ndarray]:
        encoded = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encoded]


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer ``spec.data.tokenizer`` names."""
    if name == BYTES_TOKENIZER:
        return ByteTokenizer()
    from tokenizers import Tokenizer as Loaded

    try:
        with fsspec.open(name, "rt", encoding="utf-8") as handle:
            loaded = Loaded.from_str(handle.read())
    except (OSError, ValueError, Exception) as error:  # noqa: BLE001 - the tokenizers package raises its own
        raise ManifestError("spec.data.tokenizer", f"cannot read the tokenizer {name!r} ({error}); give "
                                                   "'bytes' or a Hugging Face tokenizer.json") from None
    eot = next((loaded.token_to_id(t) for t in END_OF_TEXT if loaded.token_to_id(t) is not None), None)
    return HuggingFaceTokenizer(loaded, loaded.get_vocab_size(with_added_tokens=True), eot)


def check_vocabulary(tokenizer: Tokenizer, model_vocab: int | None) -> None:
    """Refuse a model whose vocabulary cannot hold the tokenizer's ids."""
    if model_vocab is not None and tokenizer.vocab_size > model_vocab:
        raise ManifestError("spec.data.tokenizer", f"the tokenizer has {tokenizer.vocab_size} tokens but "
                                                   f"the model's vocabulary is {model_vocab}; set "
                                                   f"spec.model.config.vocab to at least "
                                                   f"{tokenizer.vocab_size}, or use another tokenizer")
