"""What a run trains on: ``spec.data`` opened for the model, or synthetic tokens.

:func:`open_feed` checks that the model can read the data (a language model, whose
batch is ``input_ids`` and ``labels`` of ``[batch, seqLen]`` integers, with a
vocabulary that holds every id), opens every source and the eval split, and the
training batches for the reader's :class:`~.loader.Need` (the local runtime reads
everything; a Ray mesh host only its stage's leaves and its devices' rows). Without
``spec.data`` the feed draws synthetic batches (batch ``i`` from seed ``seed + i``, so
a resumed run sees what the interrupted one would have), and its :attr:`Feed.source`
says ``synthetic``, which the run prints, records and reports.

The feed keeps the books a host reports: bytes of ids read, and rows per source (a
mixture's realised shares).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from alpajob.api.data import DEFAULT_CACHE_PATH, DEFAULT_CACHE_SIZE, DataSpec
from alpajob.api.errors import ManifestError
from alpajob.api.resource import AlpaJob
from alpajob.trainer_image.data.corpus import TokenCorpus, check_known_ids, open_eval, open_train
from alpajob.trainer_image.data.loader import (
    EVERYTHING,
    PREFETCH,
    TOKEN_KEYS,
    Batches,
    BatchReader,
    Need,
    eval_reader,
    train_reader,
)
from alpajob.trainer_image.data.order import proportions, source_counts
from alpajob.trainer_image.data.remote import BlockCache
from alpajob.trainer_image.data.shards import Opener
from alpajob.trainer_image.data.tokenizer import check_vocabulary, load_tokenizer
from alpajob.trainer_image.zoo.model import ModelDef, synthetic_batch

#: What :attr:`Feed.source` says when the job has no ``spec.data``.
SYNTHETIC = "synthetic"


@dataclass
class Feed:
    """A run's training batches (and its eval split, if any)."""

    model: ModelDef
    batch_size: int
    seed: int
    source: str  # SYNTHETIC, or what spec.data holds
    train: Batches | None = None
    eval: BatchReader | None = None
    seq_len: int = 0
    sources: list[str] = field(default_factory=list)  # the training sources' names
    weights: list[float] = field(default_factory=list)
    opener: Opener | None = None  # what the sources were opened with (its file handles)

    def batch(self, step: int) -> list[np.ndarray]:
        """The flattened leaves of step ``step``'s global batch (0-based), read in order
        (the next batch of the prefetching iterator)."""
        if self.train is None:
            return jax.tree.leaves(synthetic_batch(self.model, self.batch_size, seed=self.seed + step))
        return jax.tree.leaves(next(self.train))

    def batch_at(self, step: int, need: Need | None = None) -> list[np.ndarray]:
        """Step ``step``'s batch read directly (the same as :meth:`batch` gives in order),
        for ``need`` (default the feed's): for a process that must find any step's batch
        without the ones before (a Ray mesh host, after a restart)."""
        if self.train is None:
            return self.batch(step)
        return jax.tree.leaves(self.train.at(step, need))

    def eval_batches(self, count: int, need: Need = EVERYTHING) -> list[list[np.ndarray]]:
        """The first ``count`` eval batches (the same every time), flattened."""
        if self.eval is None:
            return []
        return [jax.tree.leaves(self.eval.read(k, need)) for k in range(count)]

    @property
    def wait_seconds(self) -> float:
        return self.train.wait_seconds if self.train is not None else 0.0

    @property
    def read_bytes(self) -> int:
        """Bytes of token ids this feed has read (training and eval)."""
        train = self.train.reader.books.bytes if self.train is not None else 0
        return train + (self.eval.books.bytes if self.eval is not None else 0)

    def source_rows(self, step: int) -> dict[str, int]:
        """Rows each training source gives step ``step``'s global batch."""
        if self.train is None:
            return {}
        counts = self.train.reader.order.counts(step, self.batch_size)
        return dict(zip(self.sources, counts, strict=True))

    def state(self) -> dict[str, Any] | None:
        """The loader's position (None for synthetic data: the step number is enough)."""
        return self.train.state() if self.train is not None else None

    def restore(self, state: dict[str, Any] | None) -> None:
        if self.train is not None and state is not None:
            self.train.restore(state)

    def close(self) -> None:
        if self.train is not None:
            self.train.close()
        if self.eval is not None:
            self.eval.close()
        if self.opener is not None:
            self.opener.handles.close()


def token_shape(model: ModelDef, batch_size: int) -> int:
    """The sequence length of a language model; a clear error for any other model."""
    shapes = model.batch_shapes(batch_size)
    ok = (isinstance(shapes, dict) and sorted(shapes) == sorted(TOKEN_KEYS)
          and all(len(s.shape) == 2 and np.issubdtype(s.dtype, np.integer) for s in shapes.values()))
    if not ok:
        found = {k: tuple(v.shape) for k, v in shapes.items()} if isinstance(shapes, dict) else shapes
        raise ManifestError("spec.data", f"token data needs a language model whose batch is input_ids and "
                                         f"labels [batch, seqLen]; {model.name}'s batch is {found}: drop "
                                         "spec.data (synthetic batches) or choose gpt or moe")
    return int(shapes["input_ids"].shape[1])


def describe(corpora: list[TokenCorpus], weights: list[float], tokenizer: str) -> str:
    """What the run prints of its data: ``124 files, 3,281,802 tokens (bytes)``, or
    per mixture source its share."""
    if len(corpora) == 1:
        return f"{corpora[0].describe()} ({tokenizer})"
    total = sum(weights)
    parts = [f"{c.name} {w / total:.0%}: {c.describe()}" for c, w in zip(corpora, weights, strict=True)]
    return f"mixture of {len(corpora)} sources ({tokenizer}): " + "; ".join(parts)


def open_feed(job: AlpaJob, model: ModelDef, seed: int | None = None, need: Need = EVERYTHING,
              prefetch: int = PREFETCH) -> Feed:
    """The feed of ``job`` for ``model`` (module docstring); ``seed``: the run's
    (default ``spec.training.seed``); ``need``: what this reader reads of every batch;
    ``prefetch``: batches a background thread keeps ready (0: none)."""
    training, data = job.spec.training, job.spec.data
    seed = training.seed if seed is None else seed
    feed = Feed(model, training.global_batch_size, seed, SYNTHETIC)
    if data is None:
        return feed
    seq_len = token_shape(model, training.global_batch_size)
    tokenizer = load_tokenizer(data.tokenizer)
    vocab = model.config.get("vocab")
    check_vocabulary(tokenizer, vocab)
    cache = data.cache
    opener = Opener("spec.data.train", data.token_dtype,
                    BlockCache(cache.path if cache else DEFAULT_CACHE_PATH,
                               cache.size if cache else DEFAULT_CACHE_SIZE))
    corpora = open_train(data, tokenizer, opener)
    weights = [s.weight for s in data.sources()]
    evaluation = open_eval(data, tokenizer, opener)
    for corpus in [*corpora, *([evaluation] if evaluation else [])]:
        check_known_ids(corpus, vocab)
    reader = train_reader(corpora, weights, seq_len, training.global_batch_size, seed, vocab)
    feed.train = Batches.open(reader, need, prefetch)
    if evaluation is not None:
        feed.eval = eval_reader(evaluation, seq_len, training.global_batch_size, vocab)
    feed.seq_len = seq_len
    feed.sources, feed.weights, feed.opener = [c.name for c in corpora], weights, opener
    feed.source = describe(corpora, weights, data.tokenizer)
    return feed


def batch_sources(data: DataSpec | None, step: int, batch_size: int) -> dict[str, int]:
    """Rows each training source of ``data`` gives step ``step``'s global batch, from
    the weights alone (a driver that reads no data reports a mixture's shares)."""
    if data is None:
        return {}
    names = [name for name, _ in data.named_sources()]
    counts = source_counts(proportions([s.weight for s in data.sources()]), step, batch_size)
    return dict(zip(names, counts, strict=True))
