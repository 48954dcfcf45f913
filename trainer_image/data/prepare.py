"""``alpajob data prepare``: tokenize a text, jsonl or ArrayRecord corpus once, into token shards.

Tokenizing at every start costs a large corpus minutes; this writes each split as raw
token shards of at most ``shard_size`` bytes (``uint16`` ids when the vocabulary fits, else
``uint32``) with an ``index.json`` (:class:`~alpajob.api.data.TokenIndex`), and
returns the ``spec.data`` that reads them (``format: tokens``, the same tokenizer, so
vocabulary checks still apply)::

    OUTPUT/train/shard-00000.bin ... index.json
    OUTPUT/eval/shard-00000.bin ... index.json
    OUTPUT/prepare.json            how far it got, and of what

How, in constant memory and in parallel:

1. the inputs are cut into units of at most ``unit_bytes`` (:mod:`.units`), in order;
2. a pool of ``workers`` processes tokenizes units, at most two per worker ahead of the
   writer, so memory holds a few units whatever the corpus' size;
3. the writer appends each unit's ids, in order, to the current shard (a ``.tmp``
   file); a full shard is renamed into place and ``prepare.json`` is rewritten
   (atomically) with the shard's entry and where the next shard begins: the unit, and
   how many of its ids the finished shards already hold.

An interrupted prepare (Ctrl-C, SIGTERM, a lost machine) is resumed by running it
again: the finished shards are kept, the unfinished one is dropped, and tokenizing
starts again at the unit the next shard begins in; the result is the same as an
uninterrupted prepare's. A folder that holds another corpus' prepare (other files,
sizes, tokenizer or shard size) is refused, not mixed.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
from pydantic import Field

from alpajob.api.data import INDEX_FILE, DataFormat, DataSpec, IndexShard, TokenDtype, TokenIndex
from alpajob.api.errors import ManifestError
from alpajob.api.options import PrepareOptions
from alpajob.api.schema import Contract
from alpajob.trainer_image.data.corpus import smallest_dtype
from alpajob.trainer_image.data.sources import expand
from alpajob.trainer_image.data.tokenizer import load_tokenizer
from alpajob.trainer_image.data.units import Unit, tokenize_unit, units_of

#: The folder's record of a prepare.
STATE_FILE = "prepare.json"


class SplitState(Contract):
    """One split's progress: its finished shards, and where the next one begins."""

    shards: list[IndexShard] = Field(default_factory=list)
    unit: int = 0  # the unit the next shard begins in
    skip: int = 0  # ids of that unit the finished shards hold
    done: bool = False


class PrepareState(Contract):
    """``prepare.json``: what is being prepared (``inputs``), and how far it got."""

    inputs: dict[str, Any]
    splits: dict[str, SplitState] = Field(default_factory=dict)


@dataclass(frozen=True)
class Tick:
    """What the progress bar shows of a split after a unit: units, input bytes, files
    and ids so far."""

    split: str
    units_done: int
    units: int
    bytes_done: int
    bytes: int
    tokens: int
    files_done: int
    files: int


Progress = Callable[[Tick], None]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


class ShardWriter:
    """Appends ids to numbered shards of at most ``shard_tokens`` in ``folder``; calls
    ``finished`` with each shard's entry once it is in place."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, first: int, eot: int | None,
                 finished: Callable[[IndexShard, int], None]) -> None:
        self.folder, self.dtype, self.shard_tokens, self.eot = folder, dtype, shard_tokens, eot
        self.index, self.finished = first, finished
        self.held = 0  # ids in the open shard
        self.documents, self.max_id = 0, -1
        self._file: Any = None

    def _name(self) -> str:
        return f"shard-{self.index:05d}.bin"

    def _open(self) -> Any:
        if self._file is None:
            self._file = open(self.folder / (self._name() + ".tmp"), "wb")  # noqa: SIM115 - closed in _close
        return self._file

    def _close(self, consumed: int) -> None:
        self._file.close()
        self._file = None
        (self.folder / (self._name() + ".tmp")).replace(self.folder / self._name())
        self.finished(IndexShard(path=self._name(), tokens=self.held, documents=self.documents,
                                 max_id=self.max_id), consumed)
        self.index += 1
        self.held, self.documents, self.max_id = 0, 0, -1

    def write(self, ids: np.ndarray) -> None:
        """Append ``ids`` (one unit's, in order)."""
        done = 0
        while done < len(ids):
            room = self.shard_tokens - self.held
            piece = ids[done:done + room]
            self._open().write(piece.astype(self.dtype, copy=False).tobytes())
            self.held += len(piece)
            self.max_id = max(self.max_id, int(piece.max()))
            if self.eot is not None:
                self.documents += int(np.count_nonzero(piece == self.eot))
            done += len(piece)
            if self.held == self.shard_tokens:
                self._close(done)

    def finish(self, consumed: int) -> None:
        """Put the last, partial shard in place (if it holds any ids)."""
        if self.held:
            self._close(consumed)
        elif self._file is not None:
            self._file.close()
            (self.folder / (self._name() + ".tmp")).unlink(missing_ok=True)
            self._file = None


def _inputs(data: DataSpec, options: PrepareOptions, dtype: np.dtype,
            files: dict[str, list[tuple[str, int]]]) -> dict[str, Any]:
    """What makes two prepares the same (a resumed one must match)."""
    return {"format": data.format.value, "field": data.field, "tokenizer": data.tokenizer,
            "dtype": dtype.name, "shardSize": options.shard_size, "unitBytes": options.unit_bytes,
            "files": {split: [[url, size] for url, size in found] for split, found in files.items()}}


def _load_state(path: Path, inputs: dict[str, Any], output: str) -> PrepareState:
    if not path.exists():
        return PrepareState(inputs=inputs)
    try:
        state = PrepareState.model_validate_json(path.read_text())
    except (pydantic.ValidationError, OSError) as error:
        raise ManifestError("--output", f"{path} is damaged ({str(error).splitlines()[0]}); remove "
                                        f"{output} and prepare again") from None
    if state.inputs != inputs:
        changed = sorted(k for k in inputs if state.inputs.get(k) != inputs[k])
        raise ManifestError("--output", f"{output} holds the prepare of other inputs (they differ in "
                                        f"{', '.join(changed)}); give an empty folder, or the same "
                                        "manifest and flags to resume it")
    return state


def _split(split: str, units: list[Unit], files: int, folder: Path, state: PrepareState,
           state_path: Path, data: DataSpec, options: PrepareOptions, dtype: np.dtype, vocab: int,
           eot: int | None, progress: Progress | None) -> None:
    """Tokenize one split's ``units`` into shards in ``folder`` (module docstring)."""
    mine = state.splits.setdefault(split, SplitState())
    if mine.done:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.tmp"):
        stale.unlink()
    shards = list(mine.shards)
    cursor = {"unit": mine.unit, "skip": mine.skip}

    def finished(entry: IndexShard, consumed: int) -> None:
        shards.append(entry)
        state.splits[split] = SplitState(shards=shards, unit=cursor["unit"], skip=cursor["base"] + consumed)
        _write_atomically(state_path, state.model_dump_json(by_alias=True, indent=1))

    shard_tokens = max(options.shard_size // dtype.itemsize, 1)
    writer = ShardWriter(folder, dtype, shard_tokens, len(shards), eot, finished)
    read = np.cumsum([u.size for u in units]).tolist()  # input bytes done after each unit
    ended = np.cumsum([sum(p.last for p in u.pieces) for u in units]).tolist()  # files done after each unit
    total_bytes, tokens = (read[-1] if read else 0), sum(s.tokens for s in shards)
    args = (data.format, data.field, data.tokenizer, dtype.name)
    workers = options.workers or os.cpu_count() or 1
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 1 else None
    try:
        ahead: deque[Future[Any]] = deque()
        queued = mine.unit
        for index in range(mine.unit, len(units)):
            if pool is not None:
                while queued < len(units) and len(ahead) < 2 * workers:
                    ahead.append(pool.submit(tokenize_unit, units[queued], *args))
                    queued += 1
                ids, _ = ahead.popleft().result()
            else:
                ids, _ = tokenize_unit(units[index], *args)
            skip = mine.skip if index == mine.unit else 0
            cursor["unit"], cursor["base"] = index, skip
            writer.write(ids[skip:])
            tokens += len(ids) - skip
            if progress:
                progress(Tick(split, index + 1, len(units), int(read[index]), total_bytes, tokens,
                              int(ended[index]), files))
        cursor["unit"], cursor["base"] = len(units), 0
        writer.finish(0)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    state.splits[split] = SplitState(shards=shards, unit=len(units), done=True)
    written = TokenIndex(dtype=TokenDtype(dtype.name), tokenizer=data.tokenizer, vocab_size=vocab,
                         end_of_text=eot, shards=shards)
    _write_atomically(folder / INDEX_FILE, written.model_dump_json(by_alias=True, indent=1, exclude_none=True))
    _write_atomically(state_path, state.model_dump_json(by_alias=True, indent=1))


def prepare(data: DataSpec, options: PrepareOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Write ``options.output``'s shards and indexes (module docstring); the
    ``spec.data`` that reads them (camelCase, ready for a manifest)."""
    if data.format is DataFormat.TOKENS:
        raise ManifestError("spec.data.format", "is tokens already: there is nothing to prepare")
    if data.is_mixture():
        raise ManifestError("spec.data.train", "is a mixture: prepare each source with its own manifest, "
                                               "then mix the prepared folders")
    output = Path(options.output)
    if output.exists() and not output.is_dir():
        raise ManifestError("--output", f"{output} is a file, not a directory")
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(data.tokenizer)
    dtype = smallest_dtype(tokenizer.vocab_size)
    patterns = {"train": data.train_paths(), "eval": data.eval_paths()}
    found = {split: [(f.url, f.size) for f in expand(p, f"spec.data.{split}")]
             for split, p in patterns.items() if p}
    state_path = output / STATE_FILE
    state = _load_state(state_path, _inputs(data, options, dtype, found), str(output))
    for split, files in found.items():
        units = units_of(files, data.format, options.unit_bytes)
        _split(split, units, len(files), output / split, state, state_path, data, options, dtype,
               tokenizer.vocab_size, tokenizer.end_of_text, progress)
    spec: dict[str, Any] = {"train": str(output / "train")}
    if "eval" in found:
        spec["eval"] = str(output / "eval")
    return {**spec, "format": DataFormat.TOKENS.value, "tokenizer": data.tokenizer}
