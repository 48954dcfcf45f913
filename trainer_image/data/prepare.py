"""``alpajob data prepare``: tokenize a text or jsonl corpus once, into token files.

Tokenizing at every start costs a large corpus minutes; this writes each split's ids
as one ``.npy`` (``uint16`` when the vocabulary fits, else ``uint32``) beside a
``tokens.json`` that says how they were made, and returns the ``spec.data`` that reads
them (``format: tokens``, the same tokenizer, so vocabulary checks still apply).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from alpajob.api.errors import ManifestError
from alpajob.api.spec import DataFormat, DataSpec
from alpajob.trainer_image.data.sources import expand, read_documents
from alpajob.trainer_image.data.tokenizer import load_tokenizer

#: Called after each file: (split, files done, files in all).
Progress = Callable[[str, int, int], None]


def prepare(data: DataSpec, output: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Write ``output/{train,eval}.npy`` and ``output/tokens.json``; the ``spec.data`` that
    reads them (camelCase, ready for a manifest)."""
    if data.format is DataFormat.TOKENS:
        raise ManifestError("spec.data.format", "is tokens already: there is nothing to prepare")
    if output.exists() and not output.is_dir():
        raise ManifestError("--output", f"{output} is a file, not a directory")
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(data.tokenizer)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    splits = {"train": data.train_paths(), "eval": data.eval_paths()}
    written: dict[str, Any] = {}
    for split, patterns in splits.items():
        if not patterns:
            continue
        files = expand(patterns, f"spec.data.{split}")
        pieces = []
        for done, path in enumerate(files, start=1):
            for ids in tokenizer.encode_all(read_documents([path], data.format, data.field)):
                pieces.append(ids)
                if tokenizer.end_of_text is not None:
                    pieces.append(np.asarray([tokenizer.end_of_text], np.int32))
            if progress:
                progress(split, done, len(files))
        tokens = (np.concatenate(pieces) if pieces else np.zeros(0, np.int32)).astype(dtype)
        np.save(output / f"{split}.npy", tokens)
        written[split] = {"files": len(files), "tokens": int(len(tokens))}
    meta = {"tokenizer": data.tokenizer, "vocabSize": tokenizer.vocab_size,
            "endOfText": tokenizer.end_of_text, "dtype": np.dtype(dtype).name, "splits": written}
    (output / "tokens.json").write_text(json.dumps(meta, indent=2) + "\n")
    spec: dict[str, Any] = {"train": str(output / "train.npy")}
    if "eval" in written:
        spec["eval"] = str(output / "eval.npy")
    return {**spec, "format": DataFormat.TOKENS.value, "tokenizer": data.tokenizer}
