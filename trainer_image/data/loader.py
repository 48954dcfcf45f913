"""Batches of token sequences: any batch by its index, only the rows and leaves a reader needs.

A source of ``n`` tokens holds ``w = (n - 1) // s`` windows of ``s + 1`` tokens
(``s`` = the model's sequence length), window ``i`` starting at token ``i * s``: the
model reads its first ``s`` tokens (``input_ids``) and predicts its last ``s``
(``labels``), so every token but the first is a target exactly once per epoch.
Global batch ``k``'s row ``r`` is the window :class:`~.order.SampleOrder` gives
position ``k * b + r``.

A reader says what it :class:`Need`\\ s of every batch: which leaves (a pipeline's
first stage reads ``input_ids``, its last ``labels``, a middle stage neither) and
which rows (a host of a data-parallel mesh, the rows its devices hold). A batch is
read for that need alone, :meth:`BatchReader.read`:

- a row needing both leaves reads its ``s + 1`` tokens; one leaf, the ``s`` tokens of
  that leaf (``input_ids`` from the window's start, ``labels`` from one token on);
- ids are read in their stored type (``uint16`` is 2 bytes a token) and widened to
  ``int32`` in the batch only; every leaf of the batch has the global shape, and rows
  and leaves not needed are zeros that are never touched (and so never resident);
- windows of remote sources are read by a pool of threads at once (each a ranged
  request, :mod:`.remote`); local ones by ``pread`` in turn;
- the ids read are checked against the model's vocabulary (one ``max`` per leaf).

:class:`Batches` reads them in order on a background thread (Grain's prefetch, a few
batches ahead) for a
run that steps through them; its state is the next batch's index, saved in every
checkpoint, and :meth:`Batches.at` reads any batch directly (a Ray mesh host, after a
restart). The evaluation reader reads the eval split in order from its first window
each time, so every evaluation sees the same batches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grain
import numpy as np

from alpajob.api.errors import ManifestError
from alpajob.api.wording import counted
from alpajob.trainer_image.data.corpus import TokenCorpus
from alpajob.trainer_image.data.order import SampleOrder

#: A language model's batch leaves, in jax.tree order (sorted keys).
TOKEN_KEYS = ("input_ids", "labels")
#: Batches the background thread keeps ready (0: no thread, read on demand).
PREFETCH = 2
#: Threads that read the windows of remote sources at once.
READ_THREADS = 16
#: Batch indices a run can step through (Grain needs a length).
ENDLESS = 2**62


@dataclass(frozen=True)
class Need:
    """What one reader needs of every global batch: ``leaves`` (of :data:`TOKEN_KEYS`)
    and ``rows`` (global row indices, sorted; None: every row)."""

    leaves: frozenset[str] = frozenset(TOKEN_KEYS)
    rows: tuple[int, ...] | None = None

    def row_list(self, batch_size: int) -> Sequence[int]:
        return range(batch_size) if self.rows is None else self.rows


#: Everything: the local runtime, and any one-process reader.
EVERYTHING = Need()


@dataclass
class ReadBooks:
    """What a reader has read so far: bytes of ids, rows per source (thread-safe)."""

    sources: int
    bytes: int = 0
    rows: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.rows = [0] * self.sources

    def add(self, nbytes: int, rows: np.ndarray) -> None:
        counts = np.bincount(rows, minlength=self.sources)
        with self._lock:
            self.bytes += nbytes
            for i, c in enumerate(counts):
                self.rows[i] += int(c)


class BatchReader:
    """Reads global batches of ``batch_size`` sequences of ``seq_len`` from
    ``corpora`` in ``order`` (module docstring); ``vocab``: the model's (None: no
    check)."""

    def __init__(self, corpora: Sequence[TokenCorpus], order: SampleOrder, seq_len: int, batch_size: int,
                 vocab: int | None = None) -> None:
        self.corpora, self.order = list(corpora), order
        self.seq_len, self.batch_size, self.vocab = seq_len, batch_size, vocab
        self.books = ReadBooks(len(self.corpora))
        remote = any(s.remote for c in self.corpora for s in c.shards)
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="alpajob-read") if remote else None

    def _span(self, window: int, leaves: frozenset[str]) -> tuple[int, int]:
        """The stream tokens a window's ``leaves`` need."""
        start = window * self.seq_len
        first = start if "input_ids" in leaves else start + 1
        last = start + self.seq_len + (1 if "labels" in leaves else 0)
        return first, last

    def read(self, batch: int, need: Need = EVERYTHING) -> dict[str, np.ndarray]:
        """Global batch ``batch``'s leaves, with ``need``'s rows read (module docstring)."""
        b, s = self.batch_size, self.seq_len
        out = {key: np.zeros((b, s), np.int32) for key in TOKEN_KEYS}
        rows = np.asarray(need.row_list(b), np.int64)
        if not need.leaves or not len(rows):
            return out
        sources, windows = self.order.rows(batch, b, rows)

        def one(n: int) -> int:
            corpus = self.corpora[sources[n]]
            first, last = self._span(int(windows[n]), need.leaves)
            ids, nbytes = corpus.read(first, last)
            row = rows[n]
            if "input_ids" in need.leaves:
                out["input_ids"][row] = ids[:s]
            if "labels" in need.leaves:
                out["labels"][row] = ids[-s:]
            return nbytes

        indices = range(len(rows))
        read = sum(self._pool.map(one, indices)) if self._pool is not None else sum(map(one, indices))
        self.books.add(read, sources)
        if self.vocab is not None:
            self._check_ids(out, need, rows, sources, windows, batch)
        return out

    def _check_ids(self, out: dict[str, np.ndarray], need: Need, rows: np.ndarray, sources: np.ndarray,
                   windows: np.ndarray, batch: int) -> None:
        assert self.vocab is not None
        top = max(int(out[key][rows].max()) for key in need.leaves)
        if top < self.vocab:
            return
        for n, row in enumerate(rows):
            if max(int(out[key][row].max()) for key in need.leaves) == top:
                corpus = self.corpora[sources[n]]
                first, _ = self._span(int(windows[n]), need.leaves)
                shard, at = corpus.locate(first)
                raise ManifestError(corpus.field, f"holds token id {top} (batch {batch}, in {shard.url} near "
                                                  f"token {at:,}) but the model's vocabulary is {self.vocab}; "
                                                  f"set spec.model.config.vocab to at least {top + 1}, or "
                                                  "check spec.data.tokenizer and spec.data.tokenDtype")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def check_windows(corpora: Sequence[TokenCorpus], weights: Sequence[float], seq_len: int,
                  batch_size: int) -> None:
    """Refuse a split too small to read: one source that holds less than one global
    batch, or a mixture source (of positive weight) without a single sequence."""
    if len(corpora) == 1:
        corpus = corpora[0]
        count = corpus.windows(seq_len)
        if count < batch_size:
            raise ManifestError(corpus.field, f"holds {corpus.tokens:,} tokens, {counted(count, 'sequence')} "
                                              f"of {seq_len}: fewer than one global batch of {batch_size}; "
                                              "give more data or a smaller globalBatchSize")
        return
    for corpus, weight in zip(corpora, weights, strict=True):
        if weight > 0 and corpus.windows(seq_len) < 1:
            raise ManifestError(corpus.field, f"holds {corpus.tokens:,} tokens: not one sequence of "
                                              f"{seq_len} + 1; give more data, or weight 0")


@dataclass
class Batches:
    """An endless, resumable iterator of batches for one :class:`Need`; :attr:`wait_seconds`
    adds up the time the caller spent waiting for one (the loader's share of the step)."""

    reader: BatchReader
    need: Need
    iterator: Any
    wait_seconds: float = 0.0
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def open(cls, reader: BatchReader, need: Need = EVERYTHING, prefetch: int = PREFETCH) -> Batches:
        # One reading thread, ``prefetch`` batches ahead (Grain's default is 16 threads
        # and 500 elements ahead: 500 global batches held in memory).
        options = grain.ReadOptions(num_threads=1 if prefetch else 0, prefetch_buffer_size=max(prefetch, 1))
        dataset = grain.MapDataset.range(ENDLESS).map(lambda k: reader.read(k, need)).to_iter_dataset(options)
        return cls(reader, need, iter(dataset))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        began = time.perf_counter()
        batch = next(self.iterator)
        self.wait_seconds += time.perf_counter() - began
        return batch

    def at(self, index: int, need: Need | None = None) -> dict[str, np.ndarray]:
        """Batch ``index`` (0-based) directly: what the iterator yields ``index``-th."""
        return self.reader.read(index, self.need if need is None else need)

    def state(self) -> dict[str, Any]:
        """Where the next batch comes from (JSON): what a checkpoint saves."""
        return dict(self.iterator.get_state())

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state`."""
        self.iterator.set_state(dict(state))

    def close(self) -> None:
        """Stop the prefetch thread and the read pool (idempotent)."""
        if not self._closed:
            self._closed = True
            closer = getattr(self.iterator, "close", None)
            if closer is not None:
                closer()
            self.reader.close()


def train_reader(corpora: Sequence[TokenCorpus], weights: Sequence[float], seq_len: int, batch_size: int,
                 seed: int, vocab: int | None = None) -> BatchReader:
    """The training batches: ``corpora`` mixed by ``weights``, shuffled by ``seed``."""
    check_windows(corpora, weights, seq_len, batch_size)
    order = SampleOrder([max(c.windows(seq_len), 1) for c in corpora], weights, seed)
    return BatchReader(corpora, order, seq_len, batch_size, vocab)


def eval_reader(corpus: TokenCorpus, seq_len: int, batch_size: int, vocab: int | None = None) -> BatchReader:
    """The eval split's batches in order, from its first window (no shuffle)."""
    check_windows([corpus], [1.0], seq_len, batch_size)
    return BatchReader([corpus], SampleOrder([corpus.windows(seq_len)], [1.0], 0, shuffle=False),
                       seq_len, batch_size, vocab)
