"""Stage slicing of the baselines (pure functions)."""

import itertools

import pytest

from alpajob.planner.plan.baselines import even_ranges, operator_ranges


def _check_cover(ranges, n):
    assert ranges[0][0] == 0 and ranges[-1][1] == n - 1
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert start == end + 1
    assert all(a <= b for a, b in ranges)


@pytest.mark.parametrize(("n", "p"), [(5, 2), (48, 8), (7, 7), (10, 3), (1, 1)])
def test_even_ranges(n, p):
    ranges = even_ranges(n, p)
    assert len(ranges) == p
    _check_cover(ranges, n)
    sizes = [b - a + 1 for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_even_ranges_example():
    assert even_ranges(5, 2) == [(0, 1), (2, 4)]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_operator_ranges_balance_op_counts(p):
    counts = [100, 10, 10, 10, 10, 10, 10, 40]
    ranges = operator_ranges(counts, p)
    assert len(ranges) == p
    _check_cover(ranges, len(counts))
    if p == 2:
        # 200 ops: the cut lands where the running count is nearest 100 (after layer 0).
        assert ranges == [(0, 0), (1, 7)]
