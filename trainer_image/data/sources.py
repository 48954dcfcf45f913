"""Which files ``spec.data.train`` / ``eval`` name, and what they hold.

A pattern is a path, a glob or an fsspec URL (``s3://bucket/corpus/*.txt``,
``memory://...``, ``file://...``); ``{stdlib}`` stands for the Python standard
library's folder, text that is on every machine. Every pattern must match a file; the
files are read in sorted order, so a corpus is the same wherever it is read.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator, Sequence

import fsspec
import numpy as np

from alpajob.api.errors import ManifestError
from alpajob.api.spec import DataFormat, TokenDtype

#: What a pattern may say for the Python standard library's folder.
STDLIB = "{stdlib}"


def expand(patterns: Sequence[str], field: str) -> list[str]:
    """The files ``patterns`` match, as fsspec URLs, sorted; a pattern that matches
    nothing is a :class:`ManifestError` naming ``field``."""
    files: list[str] = []
    for pattern in patterns:
        resolved = pattern.replace(STDLIB, sysconfig.get_path("stdlib"))
        try:
            fs, _, paths = fsspec.core.get_fs_token_paths(resolved)
        except (ValueError, ImportError) as error:
            raise ManifestError(field, f"cannot read {pattern!r}: {error}") from None
        found = sorted(p for p in paths if fs.isfile(p))
        if not found:
            raise ManifestError(field, f"{pattern!r} matches no file; check the path (globs such as "
                                       "data/*.txt and fsspec URLs such as s3://bucket/x/*.bin work)")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        files += [p if protocol == "file" else f"{protocol}://{p}" for p in found]
    return list(dict.fromkeys(files))


def read_documents(files: Sequence[str], fmt: DataFormat, field: str = "text") -> Iterator[str]:
    """The documents of ``files``: a whole text file, each jsonl line's ``field``, or
    each ArrayRecord record (UTF-8 text; ArrayRecord files are read from local disk)."""
    if fmt is DataFormat.ARRAYRECORD:
        yield from _array_records(files)
        return
    for path in files:
        with fsspec.open(path, "rb") as handle:
            data = handle.read()
        text = data.decode("utf-8", errors="replace")
        if fmt is DataFormat.TEXT:
            yield text
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ManifestError("spec.data.format", f"{path}:{number} is not JSON ({error.msg}); "
                                                        "jsonl needs one JSON object per line") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ManifestError("spec.data.field", f"{path}:{number} has no text under {field!r}; "
                                                       "set spec.data.field to the key of the text")
            yield record[field]


def _array_records(files: Sequence[str]) -> Iterator[str]:
    import grain

    remote = [f for f in files if "://" in f]
    if remote:
        raise ManifestError("spec.data.format", f"arrayrecord files are read from local disk, not "
                                                f"{remote[0]}; copy them to a volume first")
    source = grain.sources.ArrayRecordDataSource(list(files))
    for index in range(len(source)):
        yield bytes(source[index]).decode("utf-8", errors="replace")


def read_tokens(files: Sequence[str], dtype: TokenDtype) -> np.ndarray:
    """The token ids of ``files`` (``.npy``, or raw ``.bin`` of ``dtype``), concatenated."""
    parts = []
    for path in files:
        with fsspec.open(path, "rb") as handle:
            data = handle.read()
        if path.endswith(".npy"):
            import io

            array = np.load(io.BytesIO(data), allow_pickle=False)
        else:
            width = np.dtype(dtype.value).itemsize
            if len(data) % width:
                raise ManifestError("spec.data.tokenDtype", f"{path} has {len(data)} bytes, not a whole "
                                                            f"number of {dtype.value} tokens")
            array = np.frombuffer(data, dtype=dtype.value)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ManifestError("spec.data.train", f"{path} must hold a 1-D array of token ids, "
                                                   f"got {array.dtype} {array.shape}")
        parts.append(array.astype(np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)
