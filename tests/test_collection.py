"""The planner's garbage-collector settings (planner/plan/collection.py): raised inside
the block, as they were after it, even when the block raises; never lowered."""

from __future__ import annotations

import gc

import pytest

from alpajob.planner.plan.collection import YOUNG_THRESHOLD, fewer_collections


def test_fewer_collections_raises_the_young_threshold_and_restores_it() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with pytest.raises(RuntimeError), fewer_collections():
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
            raise RuntimeError("a failed trace")
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(5 * YOUNG_THRESHOLD, 20, 30)  # a process' own, higher: kept
        with fewer_collections():
            assert gc.get_threshold() == (5 * YOUNG_THRESHOLD, 20, 30)
    finally:
        gc.set_threshold(*before)
