"""The sample order: which window of which source is row ``r`` of global batch ``k``.

The rows of a run form one stream: row ``r`` of global batch ``k`` is position
``g = k * b + r`` (``b`` the global batch). A position is mapped in two steps, each a
pure function of ``g``, so any host computes any batch's rows without the batches
before it, and nothing the size of the corpus is ever held:

1. **Mixture** (:func:`select`): which source position ``g`` comes from, and the how-
   many-th row of that source it is. With integer proportions ``p_0 .. p_{n-1}``
   (the weights, exactly: ``0.7`` is ``7/10``) summing to ``P``, source 0 takes, of
   the first ``K`` positions, ``ceil(K * p_0 / P)``: position ``g`` is source 0's
   exactly when that count steps up between ``K = g`` and ``g + 1``. The positions it
   does not take form a stream of their own, split the same way between source 1 and
   the rest (``P - p_0``), and so on. Every source's count over any prefix of any
   sub-stream is within one of its share, so each batch holds the sources in
   proportion to within a row or two, and exactly so in the long run. (Grain's
   ``MapDataset.mix`` splits the same way, but first rounds the weights to a
   hundredth of the smallest one; here they are kept exact.) Weight-0 sources are
   never chosen. Example, weights 2 : 1, positions 0..5 -> sources 0 0 1 0 0 1.
2. **Shuffle**: a source of ``W`` windows reads its ``j``-th row from window
   ``index_shuffle(j mod W, W - 1, seed + j div W)``: Grain's keyed bijection of
   ``[0, W)`` (computed on the fly, no permutation array), drawn anew each epoch of
   that source. Sources shuffle with their own seeds (``seed + i * 0x9E3779B1``), so
   a one-source run's order is Grain's own ``range(W).shuffle(seed)``, epoch after
   epoch. Without shuffling (the eval split), row ``j`` is window ``j mod W``.

Why a global shuffle and not a shard-then-window one (MosaicML Streaming's): the
order is then the same wherever the corpus lives and whatever its shards, each batch
is a uniform draw from the whole corpus, and the reads it costs are cheap where the
data is local (a ``pread`` per window) and bounded where it is remote (a ranged
request per window, :mod:`.remote`).

Because the order depends on ``g`` alone, batch ``k`` is the same set of sequences
whatever the plan, the hosts, the data-parallel ranks or the devices: a job resumed
under another plan continues with exactly the batches a one-device run reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from math import lcm

import numpy as np
from grain.experimental import index_shuffle

#: Rounds of Grain's index shuffle (its default for MapDataset.shuffle).
ROUNDS = 4
#: Added to the seed per source index, so each source has its own permutations.
SOURCE_SEED_STRIDE = 0x9E3779B1


def proportions(weights: Sequence[float]) -> list[int]:
    """The weights as integers in the same exact ratio (``[0.7, 0.3] -> [7, 3]``)."""
    exact = [Fraction(str(w)) for w in weights]
    scale = lcm(*(f.denominator for f in exact))
    ints = [int(f * scale) for f in exact]
    common = np.gcd.reduce([i for i in ints if i]) if any(ints) else 1
    return [i // int(common) for i in ints]


def select(position: int, parts: Sequence[int]) -> tuple[int, int]:
    """(source, its row index) of stream ``position`` under integer ``parts``
    (module docstring, step 1)."""
    remaining, k = sum(parts), position
    last = max(i for i, p in enumerate(parts) if p)
    for source, part in enumerate(parts):
        if not part:
            continue
        if source == last:
            return source, k
        before = -(-k * part // remaining)
        if -(-(k + 1) * part // remaining) > before:
            return source, before
        k -= before
        remaining -= part
    raise AssertionError("unreachable: the last positive part takes every remaining position")


class SampleOrder:
    """Rows of global batches as (source, window), module docstring. ``windows[i]``:
    source ``i``'s window count; ``weights``: the mixture's (one source: ``[1]``)."""

    def __init__(self, windows: Sequence[int], weights: Sequence[float], seed: int, shuffle: bool = True) -> None:
        if len(windows) != len(weights) or not windows:
            raise ValueError("one window count per weight")
        self.windows = [int(w) for w in windows]
        self.parts = proportions(weights)
        self.seeds = [(seed + i * SOURCE_SEED_STRIDE) % 2**32 for i in range(len(windows))]
        self.shuffle = shuffle

    def window(self, source: int, row: int) -> int:
        """The window source ``source`` reads for its ``row``-th row (step 2)."""
        count = self.windows[source]
        epoch, within = divmod(row, count)
        if not self.shuffle:
            return within
        return index_shuffle(within, max_index=count - 1, seed=(self.seeds[source] + epoch) % 2**32,
                             rounds=ROUNDS)

    def rows(self, batch: int, batch_size: int, rows: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of each of ``rows`` of global batch ``batch``."""
        sources = np.empty(len(rows), np.int64)
        windows = np.empty(len(rows), np.int64)
        one = len(self.parts) == 1
        for n, r in enumerate(rows):
            position = batch * batch_size + int(r)
            source, row = (0, position) if one else select(position, self.parts)
            sources[n], windows[n] = source, self.window(source, row)
        return sources, windows

    def counts(self, batch: int, batch_size: int) -> list[int]:
        """Rows each source gives global batch ``batch``."""
        return source_counts(self.parts, batch, batch_size)


def source_counts(parts: Sequence[int], batch: int, batch_size: int) -> list[int]:
    """Rows each source gives global batch ``batch`` under integer ``parts`` (step 1
    alone: no data is needed to know a batch's mixture)."""
    if len(parts) == 1:
        return [batch_size]
    out = [0] * len(parts)
    for r in range(batch_size):
        out[select(batch * batch_size + r, parts)[0]] += 1
    return out
