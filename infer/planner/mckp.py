"""The exact choice of one option per table under one byte budget (a multiple-choice knapsack), by dynamic
programming over tables with bounds, instead of a general MILP.

States after the first ``i`` tables are (bytes, error) pairs, each reached by one choice of those tables' options.
A state that another beats on both (fewer or equal bytes, less or equal error) is dropped: whatever the remaining
tables take, the other does at least as well. A state is also dropped when even the linear relaxation of the
remaining tables (each table's options on their lower convex hull, taken in order of error saved per byte, the
last one fractional) cannot bring it below the best whole choice found so far; every state offers such a whole
choice (the relaxation's segments that fit whole). Before the steps, an option whose Lagrangian reduced cost (at
the relaxation's critical saving per byte) exceeds the distance between the best whole choice and the bound is
dropped: every choice holding it costs more. What is left at the end holds the optimum, found exactly in integer
bytes: no tolerance, no time limit. The states are numpy arrays, one step per table.

Measured against HiGHS on the same problems (bench/planner.py --blocks): DLRM-v2's 26 tables with block options
(1,292 options) and 500 tables (29,430 options), the same error in a fraction of the time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

# candidate states (kept states x a table's options) per step at most, ~100 MB: past this the problem goes back to
# the MILP (the planner's problems stay far below: 500 tables with blocks, 171,430 at most)
MAX_CANDIDATES = 5_000_000
# bound pruning keeps states whose bound is within this share of the largest total cost of the incumbent
BOUND_SLACK = 1e-12


@dataclass(frozen=True)
class Group:
    """One table's options: ``nbytes`` (int64) and ``cost`` (float64), any order; ``kept`` the indices of the
    Pareto options (fewest bytes first, each less cost than the one before)."""

    nbytes: np.ndarray
    cost: np.ndarray
    kept: np.ndarray


def pareto_group(nbytes: Sequence[int], cost: Sequence[float]) -> Group:
    b = np.asarray(nbytes, dtype=np.int64)
    c = np.asarray(cost, dtype=np.float64)
    order = np.lexsort((c, b))
    running = np.minimum.accumulate(c[order])
    first = np.concatenate([[True], c[order][1:] < running[:-1]])
    return Group(b, c, order[first])


def hull_segments(extra: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lower convex hull of Pareto points (``extra`` bytes ascending from 0, ``cost`` descending) as segments:
    (bytes, cost saved) each, in hull order (saving per byte strictly falling)."""
    hull = [0]
    for j in range(1, extra.size):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is above the line from a to j (or on it): not on the hull
            if (cost[b] - cost[a]) * (extra[j] - extra[a]) >= (cost[j] - cost[a]) * (extra[b] - extra[a]):
                hull.pop()
            else:
                break
        hull.append(j)
    points = np.asarray(hull)
    return np.diff(extra[points]).astype(np.float64), -np.diff(cost[points])


class Prepared:
    """A problem's groups made ready once for any number of budgets (``frontier`` solves one per point): Pareto
    options, tables in solving order, and every hull segment of every table by saving per byte."""

    def __init__(self, groups: Sequence[tuple[Sequence[int], Sequence[float]]]) -> None:
        self.parsed = [pareto_group(b, c) for b, c in groups]
        self.low = sum(int(g.nbytes[g.kept[0]]) for g in self.parsed)
        self.extras = [g.nbytes[g.kept] - g.nbytes[g.kept[0]] for g in self.parsed]
        self.costs = [g.cost[g.kept] for g in self.parsed]
        # tables with the widest byte range first: what is left is fine-grained, where the relaxation is tight
        self.order = sorted(range(len(self.parsed)), key=lambda t: -int(self.extras[t][-1]))
        segments = [hull_segments(self.extras[t], self.costs[t]) for t in self.order]
        seg_bytes = np.concatenate([s[0] for s in segments] + [np.zeros(0)])
        seg_gain = np.concatenate([s[1] for s in segments] + [np.zeros(0)])
        position = np.repeat(np.arange(len(segments)), [s[0].size for s in segments])
        step = np.concatenate([np.arange(s[0].size) for s in segments] + [np.zeros(0, dtype=np.int64)])
        by_slope = np.argsort(-(seg_gain / np.where(seg_bytes > 0, seg_bytes, 1)), kind="stable")
        self.seg_bytes, self.seg_gain, self.position = seg_bytes[by_slope], seg_gain[by_slope], position[by_slope]
        self.step = step[by_slope]  # each segment's place in its table's hull
        # the cost of every table from position i on at its fewest bytes
        firsts = np.array([self.costs[t][0] for t in self.order] + [0.0])
        self.base = np.cumsum(firsts[::-1])[::-1]

    def bounds(self, i: int, room: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the tables from position ``i`` on and each spare byte count: (least cost of the linear relaxation,
        cost of the relaxation's whole segments that fit: a whole choice)."""
        take = self.position >= i
        seg_bytes, seg_gain = self.seg_bytes[take], self.seg_gain[take]
        base = float(self.base[i])
        if seg_bytes.size == 0:
            full = np.full(room.shape, base)
            return full, full
        cum_bytes, cum_gain = np.cumsum(seg_bytes), np.cumsum(seg_gain)
        whole = np.searchsorted(cum_bytes, room, side="right")
        last = np.maximum(whole - 1, 0)
        gained = np.where(whole > 0, cum_gain[last], 0.0)
        used = np.where(whole > 0, cum_bytes[last], 0.0)
        following = np.minimum(whole, seg_bytes.size - 1)
        slope = seg_gain[following] / seg_bytes[following]
        partial = np.where(whole < seg_bytes.size, (room - used) * slope, 0.0)
        return base - gained - partial, base - gained

    def filled(self, room: int) -> float:
        """The cost of a whole choice: the hull segments taken by saving per byte, each when it fits and its
        table took the segments before it (the relaxation's whole segments, then what else fits)."""
        taken = [0] * len(self.order)
        left, cost = float(room), float(self.base[0])
        for size, gain, table, step in zip(self.seg_bytes.tolist(), self.seg_gain.tolist(), self.position.tolist(),
                                           self.step.tolist()):  # fmt: skip
            if taken[table] == step and size <= left:
                taken[table] += 1
                left -= size
                cost -= gain
        return cost

    def solve(self, budget: int) -> list[int] | None:
        """The option of each group (its index there) with the least total cost whose bytes sum within
        ``budget``; None when nothing fits or the states outgrow ``MAX_CANDIDATES`` (the caller then uses the MILP)."""
        room = budget - self.low
        if room < 0:
            return None
        state_bytes = np.zeros(1, dtype=np.int64)
        state_cost = np.zeros(1, dtype=np.float64)
        incumbent = self.filled(room)
        # float sums in two orders: a state whose bound equals the incumbent's must not be dropped by rounding
        slack = BOUND_SLACK * max(float(self.base[0]), 1e-300)
        # Lagrangian reduced costs at the relaxation's critical saving per byte (its bound is the relaxation's):
        # a choice holding an option whose reduced cost exceeds incumbent - bound costs more than the incumbent
        crossed = int(np.searchsorted(np.cumsum(self.seg_bytes), room, side="right"))
        price = float(self.seg_gain[crossed] / self.seg_bytes[crossed]) if crossed < self.seg_bytes.size else 0.0
        priced = [self.costs[t] + price * self.extras[t] for t in range(len(self.parsed))]
        bound = sum(float(p.min()) for p in priced) - price * room
        allowed = [np.flatnonzero(p - p.min() <= incumbent - bound + slack) for p in priced]
        parents: list[np.ndarray] = []
        picks: list[np.ndarray] = []
        for i, t in enumerate(self.order):
            extra, cost = self.extras[t][allowed[t]], self.costs[t][allowed[t]]
            if state_bytes.size * extra.size > MAX_CANDIDATES:
                logger.debug("exact choice: %d states at table %d of %d, back to the MILP", state_bytes.size, i,
                             len(self.order))  # fmt: skip
                return None
            cand_bytes = (state_bytes[:, None] + extra[None, :]).ravel()
            cand_cost = (state_cost[:, None] + cost[None, :]).ravel()
            fits = np.flatnonzero(cand_bytes <= room)
            cand_bytes, cand_cost = cand_bytes[fits], cand_cost[fits]
            # Pareto: fewest bytes first, each kept state cheaper than every state with fewer or equal bytes
            by = np.lexsort((cand_cost, cand_bytes))
            running = np.minimum.accumulate(cand_cost[by])
            front = by[np.concatenate([[True], cand_cost[by][1:] < running[:-1]])]
            cand_bytes, cand_cost, fits = cand_bytes[front], cand_cost[front], fits[front]
            lower, whole = self.bounds(i + 1, (room - cand_bytes).astype(np.float64))
            lower = lower + cand_cost
            incumbent = min(incumbent, float((whole + cand_cost).min()))
            keep = np.flatnonzero(lower <= incumbent + slack)
            if keep.size == 0:  # rounding beyond the slack: the MILP decides
                return None
            fits = fits[keep]
            parents.append(fits // extra.size)
            picks.append(fits % extra.size)
            state_bytes, state_cost = cand_bytes[keep], cand_cost[keep]
        best = int(np.argmin(state_cost))
        chosen = [0] * len(self.parsed)
        for i in range(len(self.order) - 1, -1, -1):
            t = self.order[i]
            chosen[t] = int(self.parsed[t].kept[allowed[t][picks[i][best]]])
            best = int(parents[i][best])
        return chosen


def solve(groups: Sequence[tuple[Sequence[int], Sequence[float]]], budget: int) -> list[int] | None:
    """``Prepared(groups).solve(budget)``: one budget."""
    return Prepared(groups).solve(budget)
