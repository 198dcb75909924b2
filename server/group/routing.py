"""Which ids each host of a multi-host plan needs and which output columns it computes, fixed at load.

Host h needs a feature whole when a table-wise, column-wise or replicated shard of its table lies on one of
h's devices, and the ids of the rows it holds when the table is row-wise. It computes the output columns of
its shards (row-wise: partial sums of those columns). A request is split for host h into a compact one: the
features h needs, in input order, their bags' lengths, their ids (row-wise: only the ids in h's rows) and
weights; the ids keep their table's numbering because h's part shifts them into its own blocks itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.config import ModelSpec
from infer.planner.types import ShardingPlan, ShardingType

ROW_WISE_KINDS = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
INT32_LIMIT = 2**31 - 1
# Up to this many hosts hold a row-wise feature's rows: split its ids by one masked select per host (0.05 ms per
# 10k ids here) rather than a stable argsort (0.3 ms)
_MASKED_SPLIT_HOSTS = 8


@dataclass(frozen=True)
class RowSplit:
    """A row-wise feature's row blocks: block i is rows ``bounds[i] .. bounds[i + 1]`` on host ``hosts[i]``."""

    feature: int
    bounds: tuple[int, ...]
    hosts: tuple[int, ...]


@dataclass(frozen=True)
class HostNeeds:
    """What one host reads from a request and what it writes back."""

    host: int
    features: tuple[int, ...]  # input features it reads (whole or some rows), ascending
    row_features: tuple[int, ...]  # those of them read by row block (their ids are filtered)
    columns: tuple[int, ...]  # output columns its shards compute, ascending


@dataclass(frozen=True)
class GroupRouting:
    num_hosts: int
    num_features: int
    output_dim: int
    hosts: tuple[HostNeeds, ...]
    row_splits: tuple[RowSplit, ...]  # per row-wise feature (input order)
    ids_int32: bool  # every table fits int32 ids: ids travel as int32

    def needs(self, host: int) -> HostNeeds:
        return self.hosts[host]


def group_routing(spec: ModelSpec, plan: ShardingPlan) -> GroupRouting:
    """The routing of every host of ``plan`` (a topology of several hosts) for ``spec``'s features."""
    local = plan.topology.local_world_size
    hosts = plan.topology.world_size // local
    plans = {t.table: t for t in plan.tables}
    features: list[set[int]] = [set() for _ in range(hosts)]
    row_features: list[set[int]] = [set() for _ in range(hosts)]
    columns: list[set[int]] = [set() for _ in range(hosts)]
    splits = []
    for index, info in enumerate(spec.features):
        table_plan = plans[info.table]
        row_wise = table_plan.sharding_type in ROW_WISE_KINDS
        blocks: dict[tuple[int, int], int] = {}
        for shard in table_plan.shards:
            host = shard.device // local
            features[host].add(index)
            start = info.column_start + shard.col_offset
            columns[host].update(range(start, start + shard.num_cols))
            if row_wise:
                row_features[host].add(index)
                blocks[(shard.row_offset, shard.row_offset + shard.num_rows)] = host
        if row_wise:
            ordered = sorted(blocks.items())
            bounds = (*(lo for (lo, _), _ in ordered), ordered[-1][0][1])
            splits.append(RowSplit(index, bounds, tuple(host for _, host in ordered)))
    needs = tuple(
        HostNeeds(h, tuple(sorted(features[h])), tuple(sorted(row_features[h])), tuple(sorted(columns[h])))
        for h in range(hosts)
    )
    ids_int32 = all(t.num_embeddings <= INT32_LIMIT for t in spec.tables)
    return GroupRouting(hosts, len(spec.features), spec.output_dim, needs, tuple(splits), ids_int32)


@dataclass(frozen=True)
class SubRequest:
    """The part of a request one host needs (see the module docstring); ``lengths`` is feature-major over
    ``HostNeeds.features``."""

    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None


def split_request(
    routing: GroupRouting, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
) -> list[SubRequest]:
    """Every host's sub-request of a validated request (row-wise ids bucketized once per feature)."""
    num_features = routing.num_features
    batch = lengths.numel() // num_features if num_features else 0
    per_feature = lengths.view(num_features, batch)
    ends = per_feature.sum(1).cumsum(0).tolist()
    starts = [0, *ends]
    # per row-wise feature, host -> (ids, lengths, weights) of that host's rows
    row_parts: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
    for split in routing.row_splits:
        f = split.feature
        ids = values[starts[f] : starts[f + 1]]
        bag_weights = weights[starts[f] : starts[f + 1]] if weights is not None else None
        block = torch.bucketize(ids, torch.tensor(split.bounds[1:-1], dtype=ids.dtype), right=True)
        owner = torch.tensor(split.hosts, dtype=torch.int64)[block]
        bag = torch.repeat_interleave(torch.arange(batch), per_feature[f].to(torch.int64), output_size=ids.numel())
        counts = torch.bincount(owner * batch + bag, minlength=routing.num_hosts * batch).view(-1, batch)
        counts = counts.to(lengths.dtype)
        row_parts[f] = {}
        owners = sorted(set(split.hosts))
        if len(owners) <= _MASKED_SPLIT_HOSTS:  # one masked select per host beats a stable sort (measured)
            for host in owners:
                mine = owner == host
                row_parts[f][host] = (ids[mine], counts[host], bag_weights[mine] if bag_weights is not None else None)
            continue
        order = torch.argsort(owner, stable=True)
        sorted_ids = ids[order]
        sorted_weights = bag_weights[order] if bag_weights is not None else None
        host_starts = [0, *counts.sum(1).cumsum(0).tolist()]
        for host in owners:
            lo, hi = host_starts[host], host_starts[host + 1]
            row_parts[f][host] = (
                sorted_ids[lo:hi],
                counts[host],
                sorted_weights[lo:hi] if sorted_weights is not None else None,
            )
    subrequests = []
    for needs in routing.hosts:
        value_pieces, length_pieces, weight_pieces = [], [], []
        for f in needs.features:
            if f in row_parts:
                ids, bag_lengths, bag_weights = row_parts[f][needs.host]
            else:
                ids = values[starts[f] : starts[f + 1]]
                bag_lengths = per_feature[f]
                bag_weights = weights[starts[f] : starts[f + 1]] if weights is not None else None
            value_pieces.append(ids)
            length_pieces.append(bag_lengths)
            if bag_weights is not None:
                weight_pieces.append(bag_weights)
        empty = values.new_empty(0)
        subrequests.append(
            SubRequest(
                torch.cat(value_pieces) if value_pieces else empty,
                torch.cat(length_pieces) if length_pieces else lengths.new_empty(0),
                (torch.cat(weight_pieces) if weight_pieces else torch.empty(0)) if weights is not None else None,
            )
        )
    return subrequests


def full_request(
    routing: GroupRouting, host: int, batch: int, sub: SubRequest
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Host ``host``'s part's input from its sub-request: every feature's lengths (zero for the features it
    does not read), the sub-request's ids and weights as they are (the unread features have no ids)."""
    needs = routing.needs(host)
    lengths = torch.zeros(routing.num_features, batch, dtype=sub.lengths.dtype)
    if needs.features:
        lengths[list(needs.features)] = sub.lengths.view(len(needs.features), batch)
    return sub.values, lengths.view(-1), sub.weights
