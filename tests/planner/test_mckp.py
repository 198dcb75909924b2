"""The exact choice under one byte budget by bounded dynamic programming (infer.planner.mckp), checked against
every assignment of small instances: never worse than the best, always within the budget, never falling back."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from infer.planner import mckp


def exhaustive(groups, budget):
    best = None
    for picks in itertools.product(*(range(len(b)) for b, _ in groups)):
        nbytes = sum(groups[t][0][i] for t, i in enumerate(picks))
        if nbytes > budget:
            continue
        cost = sum(groups[t][1][i] for t, i in enumerate(picks))
        if best is None or cost < best:
            best = cost
    return best


def random_groups(rng, tables, ties):
    groups = []
    for _ in range(tables):
        count = int(rng.integers(1, 7))
        nbytes = [int(x) for x in rng.integers(1, 1000, count)]
        cost = [float(x) for x in rng.uniform(0, 1, count)]
        if ties:  # repeated bytes and costs, zero costs, dominated options
            nbytes = [b // 100 * 100 for b in nbytes]
            cost = [round(c, 1) for c in cost]
        groups.append((nbytes, cost))
    return groups


@pytest.mark.parametrize("seed", range(40))
def test_equals_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    groups = random_groups(rng, int(rng.integers(1, 7)), ties=seed % 2 == 1)
    low = sum(min(b) for b, _ in groups)
    high = sum(max(b) for b, _ in groups)
    budget = int(rng.integers(low, high + 1))
    picks = mckp.solve(groups, budget)
    assert picks is not None
    assert sum(groups[t][0][i] for t, i in enumerate(picks)) <= budget
    cost = sum(groups[t][1][i] for t, i in enumerate(picks))
    assert cost == pytest.approx(exhaustive(groups, budget), rel=1e-12, abs=1e-15)


def test_nothing_fits():
    assert mckp.solve([([10, 20], [1.0, 0.0]), ([5], [0.5])], 14) is None


def test_hull_segments_drop_points_above_the_hull():
    extra = np.array([0, 10, 20, 30])
    cost = np.array([1.0, 0.8, 0.3, 0.2])  # (10, 0.8) lies above the line from (0, 1) to (20, 0.3)
    seg_bytes, seg_gain = mckp.hull_segments(extra, cost)
    assert seg_bytes.tolist() == [20.0, 10.0]
    assert seg_gain == pytest.approx([0.7, 0.1])
