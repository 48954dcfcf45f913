"""Batches of token sequences, with Grain: deterministic, sharded, prefetched, resumable.

A corpus of ``n`` tokens holds ``w = (n - 1) // s`` windows of ``s + 1`` tokens
(``s`` = the model's sequence length), window ``i`` starting at token ``i * s``: the
model reads its first ``s`` tokens (``input_ids``) and predicts its last ``s``
(``labels``), so every token but the first is a target exactly once per epoch. The
Grain pipeline::

    range(w) ─shuffle(seed)─► a permutation, drawn anew each epoch
             ─slice(rank::ranks)─► this data-parallel rank's windows (disjoint)
             ─repeat─► epoch after epoch ─map─► {input_ids, labels}
             ─batch(b / ranks)─► this rank's rows of every global batch
             ─prefetch─► a background thread keeps ``prefetch`` batches ready

Its state is one number, the next batch's index (:meth:`Batches.state`), saved in
every checkpoint: a resumed run continues with the very batch the interrupted one
would have read next. An evaluation loader (:func:`eval_batches`) reads the eval split
in order from the start each time, so every evaluation sees the same batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grain
import numpy as np

from alpajob.api.errors import ManifestError
from alpajob.api.wording import counted
from alpajob.trainer_image.data.corpus import Corpus

#: Batches the background thread keeps ready (0: no thread, read on demand).
PREFETCH = 2


@dataclass(frozen=True)
class Shard:
    """Which data-parallel rank this reader is, of how many."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} of {self.count}: need 0 <= index < count")


#: The only reader (the local runtime reads every row of every batch).
ONE_SHARD = Shard()


def windows(corpus: Corpus, seq_len: int) -> int:
    """How many sequences of ``seq_len`` (+1) tokens ``corpus`` holds."""
    return max(len(corpus.tokens) - 1, 0) // seq_len


def _batched(corpus: Corpus, seq_len: int, batch_size: int, shard: Shard,
             seed: int | None) -> grain.MapDataset:
    count = windows(corpus, seq_len)
    if count < shard.count * max(batch_size // shard.count, 1):
        raise ManifestError(corpus.field, f"holds {len(corpus.tokens):,} tokens, {counted(count, 'sequence')} of "
                                          f"{seq_len}: fewer than one global batch of {batch_size}; give "
                                          "more data or a smaller globalBatchSize")
    if batch_size % shard.count:
        raise ValueError(f"global batch {batch_size} does not split into {shard.count} shards")
    tokens = corpus.tokens

    def window(i: int) -> dict[str, np.ndarray]:
        piece = tokens[i * seq_len : i * seq_len + seq_len + 1]
        return {"input_ids": piece[:-1], "labels": piece[1:]}

    order = grain.MapDataset.range(count)
    if seed is not None:
        order = order.shuffle(seed=seed)
    rows = order.slice(slice(shard.index, None, shard.count)).repeat(None).map(window)
    return rows.batch(batch_size // shard.count, drop_remainder=True)


def _iterate(batched: grain.MapDataset, prefetch: int) -> Any:
    dataset = batched.to_iter_dataset()
    if prefetch:
        dataset = grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
    return iter(dataset)


@dataclass
class Batches:
    """An endless, resumable iterator of batches; :attr:`wait_seconds` adds up the time
    the caller spent waiting for one (the loader's share of the step)."""

    batched: grain.MapDataset  # batch k is batched[k]
    iterator: Any
    wait_seconds: float = 0.0
    _closed: bool = field(default=False, repr=False)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        began = time.perf_counter()
        batch = next(self.iterator)
        self.wait_seconds += time.perf_counter() - began
        return batch

    def at(self, index: int) -> dict[str, np.ndarray]:
        """Batch ``index`` (0-based) directly: what the iterator yields ``index``-th."""
        return self.batched[index]

    def state(self) -> dict[str, Any]:
        """Where the next batch comes from (JSON): what a checkpoint saves."""
        return dict(self.iterator.get_state())

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state`."""
        self.iterator.set_state(dict(state))

    def close(self) -> None:
        """Stop the prefetch thread (idempotent)."""
        if not self._closed:
            self._closed = True
            closer = getattr(self.iterator, "close", None)
            if closer is not None:
                closer()


def train_batches(corpus: Corpus, seq_len: int, batch_size: int, seed: int,
                  shard: Shard = ONE_SHARD, prefetch: int = PREFETCH) -> Batches:
    """This shard's rows of every global batch of ``batch_size``, shuffled by ``seed``."""
    batched = _batched(corpus, seq_len, batch_size, shard, seed)
    return Batches(batched, _iterate(batched, prefetch))


def eval_batches(corpus: Corpus, seq_len: int, batch_size: int, shard: Shard = ONE_SHARD) -> Batches:
    """The eval split's batches in order, from its first window (no shuffle, no thread)."""
    batched = _batched(corpus, seq_len, batch_size, shard, None)
    return Batches(batched, _iterate(batched, 0))
