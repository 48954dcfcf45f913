"""Goodput: the share of a run's wall time that trained the model, and where the rest went.

As Google's ml-goodput-measurement defines it: goodput is productive step time over
the run's wall time; everything else is *badput*, in named buckets:

=============  =============================================================
``planning``   tracing the step, planning it, building the stages
``compile``    the first step's time beyond a normal step's (XLA compiling)
``data``       waiting for the loader's next batch
``eval``       evaluating on spec.data.eval
``checkpoint`` saving checkpoints
``restore``    restoring one at the start
``other``      the rest: starting up, reading the data, Python between steps
=============  =============================================================

A run accounts with one :class:`Goodput`: it adds to a bucket around each piece of
work, and :meth:`Goodput.summary` closes the books at the end.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum


class Badput(StrEnum):
    """Where a run's time went when it was not training (module docstring)."""

    PLANNING = "planning"
    COMPILE = "compile"
    DATA = "data"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    OTHER = "other"


@dataclass
class Goodput:
    """A run's books: its start, and the seconds in each badput bucket so far."""

    started: float = field(default_factory=time.perf_counter)
    badput: dict[Badput, float] = field(default_factory=lambda: dict.fromkeys(Badput, 0.0))

    def add(self, bucket: Badput, seconds: float) -> None:
        self.badput[bucket] += seconds

    @contextmanager
    def timing(self, bucket: Badput) -> Iterator[None]:
        """Add the time inside the ``with`` block to ``bucket``."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(bucket, time.perf_counter() - began)

    def summary(self, step_seconds: Sequence[float], data_wait: float) -> dict[str, float]:
        """Goodput and every bucket, in seconds and as shares of the wall time so far.

        The productive time is every step's time, less the first step's excess over the
        median of the others (its compilation)."""
        wall = time.perf_counter() - self.started
        steps = list(step_seconds)
        compile_excess = 0.0
        if len(steps) > 1:
            compile_excess = max(steps[0] - statistics.median(steps[1:]), 0.0)
        productive = sum(steps) - compile_excess
        buckets = {**self.badput, Badput.COMPILE: self.badput[Badput.COMPILE] + compile_excess,
                   Badput.DATA: self.badput[Badput.DATA] + data_wait}
        accounted = productive + sum(buckets.values()) - buckets[Badput.OTHER]
        buckets[Badput.OTHER] = max(wall - accounted, 0.0)
        out = {"wall_seconds": wall, "productive_seconds": productive,
               "goodput": productive / wall if wall > 0 else 0.0}
        out.update({f"{bucket.value}_seconds": seconds for bucket, seconds in buckets.items()})
        return out
