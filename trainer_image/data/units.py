"""Work units of ``alpajob data prepare``: pieces of the input, each tokenized alone.

A corpus is cut into units of at most :data:`UNIT_BYTES` of input, so that no
process ever holds more than a unit however large a file is, and units can be
tokenized by several processes at once. A file is cut into pieces, and consecutive
pieces of small files share a unit:

- a **jsonl** file is cut at line starts: unit ``[start, stop)`` holds the lines
  whose first byte lies in it (the worker skips the line it starts inside and reads
  past ``stop`` to the end of the line it stops inside), so every line is in exactly
  one unit;
- a **text** file is one document, cut the same way after a newline; the document's
  end-of-text id follows its last unit. (A byte tokenizer gives exactly the ids of the
  whole file; a BPE tokenizer may merge across a newline differently at a cut, once
  per 8 MiB);
- an **ArrayRecord** file is cut into runs of records.

:func:`tokenize_unit` runs in a worker process (the tokenizer is loaded once per
process) and returns the unit's ids in the output dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from alpajob.api.data import DataFormat
from alpajob.trainer_image.data.sources import jsonl_document
from alpajob.trainer_image.data.tokenizer import Tokenizer, load_tokenizer

#: Bytes of input per unit.
UNIT_BYTES = 8 * 1024 * 1024
#: Records of an ArrayRecord file per unit.
UNIT_RECORDS = 4096
#: Bytes read at a time while looking for the end of a line.
LINE_PROBE = 64 * 1024


@dataclass(frozen=True)
class Piece:
    """Bytes (records, for ArrayRecord) ``[start, stop)`` of file ``url``; ``first`` and
    ``last``: the file's first and last piece."""

    url: str
    start: int
    stop: int
    first: bool
    last: bool

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Unit:
    """Consecutive pieces, at most ``unit_bytes`` in all unless one piece is larger:
    small files share a unit, a large file is cut into many."""

    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


def pieces_of(url: str, size: int, fmt: DataFormat, unit_bytes: int) -> list[Piece]:
    """``url``'s pieces, in order (a file of ``size`` bytes, or of records)."""
    if fmt is DataFormat.ARRAYRECORD:
        import grain

        count = len(grain.sources.ArrayRecordDataSource([url]))
        edges = list(range(0, count, UNIT_RECORDS)) + [count]
    else:
        edges = list(range(0, size, unit_bytes)) + [size]
    if len(edges) == 1:
        edges = [0, 0]
    pairs = list(zip(edges, edges[1:], strict=False))
    return [Piece(url, a, b, i == 0, i == len(pairs) - 1) for i, (a, b) in enumerate(pairs)]


def units_of(files: Sequence[tuple[str, int]], fmt: DataFormat, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The units of ``files`` (url, size) in order (module docstring)."""
    units: list[Unit] = []
    held: list[Piece] = []
    for url, size in files:
        for piece in pieces_of(url, size, fmt, unit_bytes):
            if held and sum(p.size for p in held) + piece.size > unit_bytes:
                units.append(Unit(tuple(held)))
                held = []
            held.append(piece)
    if held:
        units.append(Unit(tuple(held)))
    return units


def _line_bytes(handle: Any, piece: Piece) -> bytes:
    """The bytes of the lines whose first byte lies in ``piece`` (module docstring)."""
    start = piece.start
    if not piece.first:  # skip the line that began before the piece
        handle.seek(start - 1)
        while True:
            chunk = handle.read(LINE_PROBE)
            if not chunk:
                return b""
            newline = chunk.find(b"\n")
            if newline >= 0:
                start += newline
                break
            start += len(chunk)
        if start >= piece.stop:
            return b""
    handle.seek(start)
    data = handle.read(piece.stop - start)
    if not piece.last and not data.endswith(b"\n"):  # finish the line the piece stops inside
        tail = []
        while True:
            chunk = handle.read(LINE_PROBE)
            if not chunk:
                break
            newline = chunk.find(b"\n")
            if newline >= 0:
                tail.append(chunk[:newline + 1])
                break
            tail.append(chunk)
        data += b"".join(tail)
    return data


def documents(piece: Piece, fmt: DataFormat, field: str) -> Iterator[str]:
    """The piece's documents (a text piece: its part of the file's one document)."""
    if fmt is DataFormat.ARRAYRECORD:
        import grain

        source = grain.sources.ArrayRecordDataSource([piece.url])
        for index in range(piece.start, piece.stop):
            yield bytes(source[index]).decode("utf-8", errors="replace")
        return
    with fsspec.open(piece.url, "rb") as handle:
        data = _line_bytes(handle, piece)
    if fmt is DataFormat.TEXT:
        yield data.decode("utf-8", errors="replace")
        return
    where = piece.url if piece.first else f"{piece.url} (from byte {piece.start})"
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        document = jsonl_document(line, where, number, field)
        if document is not None:
            yield document


@functools.lru_cache(maxsize=2)
def worker_tokenizer(name: str) -> Tokenizer:
    """The tokenizer ``name``, loaded once per worker process."""
    return load_tokenizer(name)


def tokenize_unit(unit: Unit, fmt: DataFormat, field: str, tokenizer_name: str,
                  dtype: str) -> tuple[np.ndarray, int]:
    """The unit's ids (each document followed by the end-of-text id; a text file's id
    after its last unit) in ``dtype``, and the documents it ended."""
    tokenizer = worker_tokenizer(tokenizer_name)
    eot = tokenizer.end_of_text
    pieces: list[np.ndarray] = []
    ended = 0
    for piece in unit.pieces:
        for ids in tokenizer.encode_all(documents(piece, fmt, field)):
            pieces.append(ids)
            if fmt is not DataFormat.TEXT or piece.last:
                ended += 1
                if eot is not None:
                    pieces.append(np.asarray([eot], np.int32))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return tokens.astype(dtype), ended
