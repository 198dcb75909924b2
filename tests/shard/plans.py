"""Hand-made sharding plans for tests: every table placed exactly as a test says."""

from __future__ import annotations

from infer.config import ModelSpec
from infer.planner.enumerators import even_blocks
from infer.planner.types import ComputeDevice, Placement, Shard, ShardingPlan, ShardingType, TablePlan, Topology


def make_plan(
    spec: ModelSpec,
    world_size: int,
    layout: dict[str, tuple[ShardingType, tuple[int, ...]]],
    compute_device: ComputeDevice = ComputeDevice.CPU,
) -> ShardingPlan:
    """``layout``: table -> (sharding type, devices of its shards); unlisted tables go table-wise to device 0."""
    tables = []
    for table in spec.tables:
        kind, devices = layout.get(table.name, (ShardingType.TABLE_WISE, (0,)))
        rows, dim = table.num_embeddings, table.embedding_dim
        if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            blocks = [(o, n, 0, dim) for o, n in even_blocks(rows, len(devices))]
        elif kind == ShardingType.COLUMN_WISE:
            blocks = [(0, rows, o, n) for o, n in even_blocks(dim, len(devices), 32)]
        else:
            blocks = [(0, rows, 0, dim)] * len(devices)
        shards = tuple(Shard(d, ro, nr, co, nc, 0, 0, 0.0) for d, (ro, nr, co, nc) in zip(devices, blocks))
        tables.append(TablePlan(table.name, kind, Placement.DEVICE, table.data_type, shards))
    return ShardingPlan(tuple(tables), Topology(world_size, compute_device), 512, 0.0, 0.0)
