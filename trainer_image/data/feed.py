"""What a run trains on: ``spec.data`` opened for the model, or synthetic tokens.

:func:`open_feed` checks that the model can read the data (a language model, whose
batch is ``input_ids`` and ``labels`` of ``[batch, seqLen]`` integers, with a
vocabulary that holds every id), tokenizes both splits, and opens the training
batches. Without ``spec.data`` the feed draws synthetic batches (batch ``i`` from seed
``seed + i``, so a resumed run sees what the interrupted one would have), and its
:attr:`Feed.source` says ``synthetic``, which the run prints, records and reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from alpajob.api.errors import ManifestError
from alpajob.api.resource import AlpaJob
from alpajob.trainer_image.data.corpus import Corpus, check_ids, load_corpus
from alpajob.trainer_image.data.loader import (
    ONE_SHARD,
    PREFETCH,
    Batches,
    Shard,
    eval_batches,
    train_batches,
)
from alpajob.trainer_image.data.tokenizer import check_vocabulary, load_tokenizer
from alpajob.trainer_image.zoo.model import ModelDef, synthetic_batch

#: What :attr:`Feed.source` says when the job has no ``spec.data``.
SYNTHETIC = "synthetic"
TOKEN_KEYS = ("input_ids", "labels")


@dataclass
class Feed:
    """A run's training batches (and its eval split, if any)."""

    model: ModelDef
    batch_size: int
    seed: int
    source: str  # SYNTHETIC, or what spec.data holds
    train: Batches | None = None
    eval: Corpus | None = None
    seq_len: int = 0

    def batch(self, step: int) -> list[np.ndarray]:
        """The flattened leaves of step ``step``'s global batch (0-based), read in order
        (the next batch of the prefetching iterator)."""
        if self.train is None:
            return jax.tree.leaves(synthetic_batch(self.model, self.batch_size, seed=self.seed + step))
        return jax.tree.leaves(next(self.train))

    def batch_at(self, step: int) -> list[np.ndarray]:
        """Step ``step``'s batch read directly (the same as :meth:`batch` gives in order):
        for a process that must find any step's batch without the ones before (a Ray
        mesh host, after a restart)."""
        if self.train is None:
            return self.batch(step)
        return jax.tree.leaves(self.train.at(step))

    def eval_batches(self, count: int) -> list[list[np.ndarray]]:
        """The first ``count`` eval batches (the same every time), flattened."""
        if self.eval is None:
            return []
        reader = eval_batches(self.eval, self.seq_len, self.batch_size)
        try:
            return [jax.tree.leaves(next(reader)) for _ in range(count)]
        finally:
            reader.close()

    @property
    def wait_seconds(self) -> float:
        return self.train.wait_seconds if self.train is not None else 0.0

    def state(self) -> dict[str, Any] | None:
        """The loader's position (None for synthetic data: the step number is enough)."""
        return self.train.state() if self.train is not None else None

    def restore(self, state: dict[str, Any] | None) -> None:
        if self.train is not None and state is not None:
            self.train.restore(state)

    def close(self) -> None:
        if self.train is not None:
            self.train.close()


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


def open_feed(job: AlpaJob, model: ModelDef, seed: int | None = None, shard: Shard = ONE_SHARD,
              prefetch: int = PREFETCH) -> Feed:
    """The feed of ``job`` for ``model`` (module docstring); ``seed``: the run's
    (default ``spec.training.seed``); ``prefetch``: batches a background thread keeps
    ready (0: none)."""
    training, data = job.spec.training, job.spec.data
    seed = training.seed if seed is None else seed
    feed = Feed(model, training.global_batch_size, seed, SYNTHETIC)
    if data is None:
        return feed
    seq_len = token_shape(model, training.global_batch_size)
    tokenizer = load_tokenizer(data.tokenizer)
    vocab = model.config.get("vocab")
    check_vocabulary(tokenizer, vocab)
    train = load_corpus(data, "train", tokenizer)
    check_ids(train, vocab)
    evaluation = None
    if data.eval is not None:
        evaluation = load_corpus(data, "eval", tokenizer)
        check_ids(evaluation, vocab)
    feed.train = train_batches(train, seq_len, training.global_batch_size, seed, shard, prefetch)
    feed.eval, feed.seq_len = evaluation, seq_len
    feed.source = f"{train.describe()} ({data.tokenizer})"
    return feed
