"""Hand-made sharding plans: every table placed exactly as the caller says (tests, benchmarks, experiments)."""

from __future__ import annotations

from collections.abc import Mapping

from infer.config import ModelSpec
from infer.planner.enumerators import even_blocks
from infer.planner.types import ComputeDevice, Placement, Shard, ShardingPlan, ShardingType, TablePlan, Topology


def make_plan(
    spec: ModelSpec,
    world_size: int,
    layout: Mapping[str, tuple[ShardingType, tuple[int, ...]]],
    compute_device: ComputeDevice = ComputeDevice.CPU,
    column_unit: int = 32,
) -> ShardingPlan:
    """``layout``: table -> (sharding type, devices of its shards); unlisted tables go table-wise to device 0.

    Row-wise tables split into even row blocks, column-wise ones into slices of ``column_unit`` multiples.
    Estimates (bytes, costs) are left at zero: this plan is for building, not for comparing plans.
    """
    tables = []
    for table in spec.tables:
        kind, devices = layout.get(table.name, (ShardingType.TABLE_WISE, (0,)))
        rows, dim = table.num_embeddings, table.embedding_dim
        if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            blocks = [(o, n, 0, dim) for o, n in even_blocks(rows, len(devices))]
        elif kind == ShardingType.COLUMN_WISE:
            blocks = [(0, rows, o, n) for o, n in even_blocks(dim, len(devices), column_unit)]
        else:
            blocks = [(0, rows, 0, dim)] * len(devices)
        shards = tuple(Shard(d, ro, nr, co, nc, 0, 0, 0.0) for d, (ro, nr, co, nc) in zip(devices, blocks))
        tables.append(TablePlan(table.name, kind, Placement.DEVICE, table.data_type, shards))
    return ShardingPlan(tuple(tables), Topology(world_size, compute_device), 512, 0.0, 0.0)
