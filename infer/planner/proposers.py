"""Proposers: which sharding option every table takes. The partitioner then places the shards.

A proposal is a tuple with one option per table, in the order of the options mapping's keys (the
spec's table order). Every proposer is deterministic: same options and topology, same proposals.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from infer.errors import PlanError, PlanErrorKind
from infer.planner.partitioners import global_lower_bound
from infer.planner.types import PartitionResult, Proposal, ShardingOption, ShardingType, Topology


@dataclass(frozen=True)
class _Stats:
    """One option's totals, read once (the ``ShardingOption`` properties walk the shards every call)."""

    total_cost: float
    max_shard_cost: float
    device_bytes: int
    host_bytes: int
    num_shards: int
    cost_key: float  # total_cost rounded: estimates that differ only by float noise compare equal


def _round(value: float) -> float:
    return float(f"{value:.9g}")


def _stats(option: ShardingOption) -> _Stats:
    costs = [shard.cost for shard in option.shards]
    total = sum(costs)
    return _Stats(
        total,
        max(costs),
        sum(shard.storage.device for shard in option.shards),
        sum(shard.storage.host for shard in option.shards),
        len(costs),
        _round(total),
    )


def _cheapest_total(stats: Sequence[_Stats]) -> int:
    """The option with the lowest total cost; ties: fewer device bytes, then fewer shards."""
    return min(range(len(stats)), key=lambda i: (stats[i].cost_key, stats[i].device_bytes, stats[i].num_shards, i))


class _Tables:
    """The options of every table in table order, with their stats."""

    def __init__(self, options: Mapping[str, Sequence[ShardingOption]]) -> None:
        self.names = list(options)
        self.options = [list(options[name]) for name in self.names]
        for name, table_options in zip(self.names, self.options):
            if not table_options:
                raise PlanError(f"table {name!r} has no sharding option", PlanErrorKind.INVALID_CONSTRAINT)
        self.stats = [[_stats(option) for option in table_options] for table_options in self.options]

    def proposal(self, choice: Sequence[int]) -> Proposal:
        return tuple(table_options[i] for table_options, i in zip(self.options, choice))


# ---------------------------------------------------------------------------- fixed lists
class _FixedProposals:
    """A proposer whose proposals are all known after ``load``: distinct ones, in order, one per feedback."""

    def __init__(self) -> None:
        self._proposals: deque[Proposal] = deque()
        self._seen: set[tuple[int, ...]] = set()

    def _start(self) -> None:
        self._proposals = deque()
        self._seen = set()

    def _add(self, tables: _Tables, choice: Sequence[int]) -> None:
        key = tuple(choice)
        if key not in self._seen:
            self._seen.add(key)
            self._proposals.append(tables.proposal(choice))

    def propose(self) -> Proposal | None:
        return self._proposals[0] if self._proposals else None

    def feedback(self, proposal: Proposal, result: PartitionResult | None) -> None:
        if self._proposals:
            self._proposals.popleft()


# ---------------------------------------------------------------------------- uniform
class UniformProposer(_FixedProposals):
    """One proposal per sharding type: every table takes that type where it can, else its cheapest option."""

    def load(self, options: Mapping[str, Sequence[ShardingOption]], topology: Topology) -> None:
        tables = _Tables(options)

        def cheapest(table: int, indices: Sequence[int]) -> int:
            stats = tables.stats[table]
            return min(
                indices, key=lambda i: (_round(stats[i].max_shard_cost), stats[i].device_bytes, stats[i].num_shards, i)
            )

        present = {option.sharding_type for table_options in tables.options for option in table_options}
        self._start()
        for sharding_type in ShardingType:
            if sharding_type not in present:
                continue
            choice = []
            for t, table_options in enumerate(tables.options):
                of_type = [i for i, option in enumerate(table_options) if option.sharding_type == sharding_type]
                choice.append(cheapest(t, of_type or range(len(table_options))))
            self._add(tables, choice)


# ---------------------------------------------------------------------------- greedy
class GreedyProposer:
    """Start from every table's cheapest option; then split the table that weighs most on the bottleneck.

    The first proposal takes each table's lowest total cost. While it does not fit, the table with the
    most device bytes moves to its option with the fewest (host placement). Once a proposal fits, each
    step looks at the bottleneck device of the last partition and moves the table with the most cost
    there to an option with a lower max shard cost (more row blocks, column slices, or replicas).
    Among those it tries first the cheapest in total cost whose shards, put on the least-loaded
    devices with room, would not raise any device above the bottleneck by more than half of what the
    move takes off it (ties: the next-lower max shard cost). When several devices tie at the
    bottleneck, which tables of equal cost make common, no single move can lower it: the first
    candidate then moves the heaviest table of every tied device at once. A move that does not fit is
    reverted and (a single move) marked tried; one that fits is kept even when the bottleneck rises a
    little, since a few moves in a row may be needed to bring it down (the planner keeps the best
    partition seen). Stops when no candidate is left, the bottleneck reaches the lower bound, no new
    best came in ``patience`` proposals, or after ``max_proposals``.
    """

    def __init__(self, max_proposals: int = 200, patience: int = 50) -> None:
        self.max_proposals = max_proposals
        self.patience = patience
        self._tables: _Tables | None = None
        self._topology: Topology | None = None
        self._choice: list[int] = []
        self._pending: list[int] | None = None
        self._move: _Move = ()
        self._result: PartitionResult | None = None
        self._candidates: Iterator[_Move] = iter(())
        self._tried: set[tuple[int, int]] = set()
        self._memory_moved: set[int] = set()
        self._lower_bound = 0.0
        self._best = float("inf")
        self._since_best = 0
        self._count = 0

    def load(self, options: Mapping[str, Sequence[ShardingOption]], topology: Topology) -> None:
        tables = _Tables(options)
        self._tables = tables
        self._topology = topology
        self._choice = [_cheapest_total(stats) for stats in tables.stats]
        self._pending = list(self._choice)
        self._move = ()
        self._result = None
        self._candidates = iter(())
        self._tried = set()
        self._memory_moved = set()
        self._lower_bound = global_lower_bound(options, topology.world_size)
        self._best = float("inf")
        self._since_best = 0
        self._count = 0

    def propose(self) -> Proposal | None:
        if self._tables is None or self._pending is None or self._count >= self.max_proposals:
            return None
        return self._tables.proposal(self._pending)

    def feedback(self, proposal: Proposal, result: PartitionResult | None) -> None:
        if self._tables is None or self._pending is None:
            return
        self._count += 1
        if self._result is None and result is None:
            self._pending = self._less_memory()
            return
        if result is None:
            if len(self._move) == 1:
                self._tried.add(self._move[0])
        else:
            self._choice = list(self._pending)
            self._result = result
            self._candidates = self._rank_moves(result)
            self._since_best += 1
            if result.bottleneck < self._best:
                self._best = result.bottleneck
                self._since_best = 0
        self._pending = self._next_move()

    def _less_memory(self) -> list[int] | None:
        """Move the table with the most device bytes (not moved yet) to its option with the fewest."""
        assert self._tables is not None
        stats = self._tables.stats
        order = sorted(
            (t for t in range(len(stats)) if t not in self._memory_moved),
            key=lambda t: (-stats[t][self._choice[t]].device_bytes, t),
        )
        for table in order:
            self._memory_moved.add(table)
            table_stats = stats[table]
            best = min(
                range(len(table_stats)),
                key=lambda i: (table_stats[i].device_bytes, table_stats[i].cost_key, table_stats[i].num_shards, i),
            )
            if table_stats[best].device_bytes < table_stats[self._choice[table]].device_bytes:
                self._choice[table] = best
                return list(self._choice)
        return None

    def _next_move(self) -> list[int] | None:
        assert self._result is not None
        if self._best <= self._lower_bound * (1 + 1e-9) or self._since_best >= self.patience:
            return None
        for move in self._candidates:
            if len(move) == 1 and move[0] in self._tried:
                continue
            self._move = move
            pending = list(self._choice)
            for table, index in move:
                pending[table] = index
            return pending
        self._move = ()
        return None

    def _rank_moves(self, result: PartitionResult) -> Iterator[_Move]:
        """Candidate moves off the bottleneck device: the heaviest table first, each table's best option first.

        Round-robin over the tables (every table's best option, then every table's second best, ...)
        so that one table with many useless options does not use up the proposals.
        """
        assert self._topology is not None
        topology = self._topology
        loads = list(result.device_costs)
        top = max(loads)
        hot = [d for d, load in enumerate(loads) if load >= top * (1 - 1e-9)]
        weights: dict[int, dict[int, float]] = {d: {} for d in hot}
        for table, (option, devices) in enumerate(zip(result.proposal, result.devices)):
            for shard, device in zip(option.shards, devices):
                if device in weights:
                    weights[device][table] = weights[device].get(table, 0.0) + shard.cost
        used = [storage.device for storage in result.device_storage]
        rankings: dict[int, list[int]] = {}

        def ranking(table: int, weight: float) -> list[int]:
            if table not in rankings:
                rankings[table] = self._rank_options(table, weight, result, loads, used, topology)
            return rankings[table]

        if len(hot) > 1:
            # several devices tie at the bottleneck: one move per device, all at once
            batch: list[tuple[int, int]] = []
            for device in hot:
                for table in _heaviest_first(weights[device]):
                    if any(t == table for t, _ in batch):
                        continue
                    best = [i for i in ranking(table, weights[device][table]) if (table, i) not in self._tried]
                    if best:
                        batch.append((table, best[0]))
                        break
            if len(batch) > 1:
                yield tuple(batch)
        weight = weights[hot[0]]
        pending = [(t, iter(ranking(t, weight[t]))) for t in _heaviest_first(weight)]
        while pending:
            still = []
            for table, options in pending:
                index = next(options, None)
                if index is not None:
                    still.append((table, options))
                    yield ((table, index),)
            pending = still

    def _rank_options(
        self,
        table: int,
        weight: float,
        result: PartitionResult,
        loads: list[float],
        used: list[int],
        topology: Topology,
    ) -> list[int]:
        """The table's options with a lower max shard cost that fit and do not overload another device."""
        assert self._tables is not None
        stats = self._tables.stats[table]
        options = self._tables.options[table]
        base_loads = list(loads)
        base_used = list(used)
        for shard, device in zip(result.proposal[table].shards, result.devices[table]):
            base_loads[device] -= shard.cost
            base_used[device] -= shard.storage.device
        caps = topology.device_memory
        order = sorted(range(topology.world_size), key=lambda d: (base_loads[d], d))
        limit = _round(stats[self._choice[table]].max_shard_cost)
        ceiling = max(loads) + weight / 2
        scored = []
        for index, option in enumerate(options):
            if _round(stats[index].max_shard_cost) >= limit:
                continue
            estimate = _estimate(option, base_loads, base_used, caps, order)
            if estimate is not None and estimate <= ceiling:
                scored.append((stats[index].cost_key, -stats[index].max_shard_cost, index))
        scored.sort()
        return [index for *_, index in scored]


def _heaviest_first(weight: dict[int, float]) -> list[int]:
    return sorted(weight, key=lambda table: (-weight[table], table))


_Move = tuple[tuple[int, int], ...]  # (table, option index) pairs switched together


def _estimate(
    option: ShardingOption, loads: list[float], used: list[int], caps: Sequence[int], order: Sequence[int]
) -> float | None:
    """Bottleneck after adding ``option``'s shards to the least-loaded devices with room; None: no room."""
    new_loads = list(loads)
    if option.sharding_type == ShardingType.REPLICATED:
        for device, shard in enumerate(option.shards):
            if used[device] + shard.storage.device > caps[device]:
                return None
            new_loads[device] += shard.cost
        return max(new_loads)
    shards = sorted(option.shards, key=lambda s: -s.cost)
    position = 0
    for device in order:
        if position == len(shards):
            break
        shard = shards[position]
        if used[device] + shard.storage.device <= caps[device]:
            new_loads[device] += shard.cost
            position += 1
    return max(new_loads) if position == len(shards) else None


# ---------------------------------------------------------------------------- dynamic programming
class DynamicProgrammingProposer(_FixedProposals):
    """TorchRec-style: the cheapest summed cost at every level of total device memory.

    The memory budget (all devices together) is cut into ``num_bins`` bins. Walking the tables in
    order, each bin keeps the cheapest partial choice whose exact summed device bytes fall in it
    (ties: fewer bytes); a choice over the budget is dropped. At the end every bin holds a proposal;
    the distinct ones are proposed cheapest first. The summed cost ignores balance: the partitioner
    says what each proposal is worth. Options with a shard larger than any device are never chosen.
    """

    def __init__(self, num_bins: int = 100) -> None:
        super().__init__()
        self.num_bins = max(1, num_bins)

    def load(self, options: Mapping[str, Sequence[ShardingOption]], topology: Topology) -> None:
        tables = _Tables(options)
        budget = sum(topology.device_memory)
        bins = self.num_bins
        largest_device = max(topology.device_memory)
        candidates = []  # per table: option indices that could be placed at all
        for table_options in tables.options:
            placeable = [i for i, option in enumerate(table_options) if _placeable(option, topology, largest_device)]
            candidates.append(placeable or list(range(len(table_options))))
        all_costs = [tables.stats[t][i].total_cost for t, indices in enumerate(candidates) for i in indices]
        unit = max(max(all_costs), 1e-300) / 2**40  # integer costs: exact sums, exact ties

        infinite = np.iinfo(np.int64).max
        cost = np.full(bins, infinite, dtype=np.int64)
        used = np.zeros(bins, dtype=np.int64)
        cost[0] = 0
        choice = np.zeros((len(candidates), bins), dtype=np.int32)
        previous = np.zeros((len(candidates), bins), dtype=np.int32)
        for t, indices in enumerate(candidates):
            stats = tables.stats[t]
            option_cost = np.array([round(stats[i].total_cost / unit) for i in indices], dtype=np.int64)
            option_bytes = np.array([stats[i].device_bytes for i in indices], dtype=np.int64)
            alive = np.flatnonzero(cost != infinite)
            new_bytes = (used[alive][None, :] + option_bytes[:, None]).ravel()
            new_cost = (cost[alive][None, :] + option_cost[:, None]).ravel()
            option_of = np.repeat(np.arange(len(indices)), len(alive))
            prev_bin = np.tile(alive, len(indices))
            keep = new_bytes <= budget
            new_bytes, new_cost, option_of, prev_bin = new_bytes[keep], new_cost[keep], option_of[keep], prev_bin[keep]
            if new_bytes.size == 0:
                self._start()
                return
            new_bin = np.minimum(new_bytes * bins // max(budget, 1), bins - 1)
            # per bin: lowest cost, then fewest bytes; lexsort is stable, so then option and bin order
            order = np.lexsort((new_bytes, new_cost, new_bin))
            first = np.ones(order.size, dtype=bool)
            first[1:] = new_bin[order[1:]] != new_bin[order[:-1]]
            winners = order[first]
            target = new_bin[winners]
            cost = np.full(bins, infinite, dtype=np.int64)
            used = np.zeros(bins, dtype=np.int64)
            cost[target] = new_cost[winners]
            used[target] = new_bytes[winners]
            choice[t, target] = np.asarray(indices, dtype=np.int32)[option_of[winners]]
            previous[t, target] = prev_bin[winners]
        finals = np.flatnonzero(cost != infinite)
        finals = finals[np.lexsort((used[finals], cost[finals]))]  # cheapest first, then fewer bytes
        picks = np.empty((len(candidates), finals.size), dtype=np.int32)
        current = finals.copy()
        for t in range(len(candidates) - 1, -1, -1):
            picks[t] = choice[t, current]
            current = previous[t, current]
        self._start()
        for column in picks.T.tolist():
            self._add(tables, column)


def _placeable(option: ShardingOption, topology: Topology, largest_device: int) -> bool:
    if option.sharding_type == ShardingType.REPLICATED:
        return all(s.storage.device <= m for s, m in zip(option.shards, topology.device_memory))
    return all(s.storage.device <= largest_device for s in option.shards)
