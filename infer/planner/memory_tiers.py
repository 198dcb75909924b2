"""Memory tiers of a CPU plan: which shards are expected resident in RAM and which are paged from mapped files.

A CPU artifact's weights are mapped files, so the host may serve more table bytes than it has RAM: the page
cache keeps what is read often. The plan says which shards that will be: the bytes read most often per byte
stay resident until the resident budget (the devices' usable memory, less the batches' buffers) is spent;
the rest are paged. Reads come from a sample of request ids when given, else every row of a table is read
alike (a table's ids per example, its pooling factor, spread over its rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from infer.config import ModelSpec, TableConfig
from infer.planner.access import AccessSample
from infer.planner.types import MemoryTier, ParameterConstraints, ShardingType, TablePlan

UNIFORM_ACCESS = "uniform per row"


@dataclass(frozen=True)
class _Block:
    """One block of a table held by one or more shards (CPU replicas share one copy)."""

    table_index: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    weight_bytes: int
    reads: float

    @property
    def heat(self) -> float:
        return self.reads / self.weight_bytes if self.weight_bytes else float("inf")


def block_reads(
    table: TableConfig, row_offset: int, num_rows: int, constraints: ParameterConstraints, sample: AccessSample | None
) -> float:
    """Expected reads of a block of rows: sampled ids that fall in it, or its share of the table's ids per example."""
    if sample is not None:
        return float(sample.reads(table, row_offset, num_rows))
    return constraints.pooling_factor(table) * num_rows / table.num_embeddings


def assign_tiers(
    tables: Sequence[TablePlan],
    spec: ModelSpec,
    constraints: Mapping[str, ParameterConstraints],
    resident_memory: int,
    mapped_capacity: int | None,
    sample: AccessSample | None = None,
    views: bool = False,
) -> tuple[tuple[TablePlan, ...], dict[str, Any]]:
    """The plan's tables with each shard's tier, and the tier stats for ``ShardingPlan.planner``.

    ``resident_memory`` is the RAM the plan may use (every device's usable memory); the batches' buffers are
    always resident, the weights' blocks are taken hottest first (reads per byte, then table order) while
    they fit. ``views`` (``Topology.cpu_views``: one CPU host): the column slices of a row range are views of
    the same stored rows (every slice reads the same pages), so they are one block, tiered together.
    """
    order = {t.name: i for i, t in enumerate(spec.tables)}
    blocks: dict[tuple[str, int, int, int, int], _Block] = {}
    buffers = 0

    def block_key(plan: TablePlan, shard: Any) -> tuple[str, int, int, int, int]:
        if views and plan.sharding_type == ShardingType.COLUMN_WISE:
            return (plan.table, shard.row_offset, shard.num_rows, 0, spec.table(plan.table).embedding_dim)
        return (plan.table, shard.row_offset, shard.num_rows, shard.col_offset, shard.num_cols)

    for plan in tables:
        table = spec.table(plan.table)
        table_constraints = constraints.get(plan.table, ParameterConstraints())
        for shard in plan.shards:
            buffers += shard.input_bytes + shard.output_bytes
            key = block_key(plan, shard)
            known = blocks.get(key)
            if known is not None:
                blocks[key] = replace(known, weight_bytes=known.weight_bytes + shard.weight_bytes)
                continue
            reads = block_reads(table, shard.row_offset, shard.num_rows, table_constraints, sample)
            blocks[key] = _Block(
                order[plan.table], shard.row_offset, shard.num_rows, shard.col_offset, shard.num_cols,
                shard.weight_bytes, reads,
            )  # fmt: skip
    budget = max(resident_memory - buffers, 0)
    left = budget
    tiers: dict[tuple[str, int, int, int, int], MemoryTier] = {}
    hottest_first = sorted(
        blocks.items(), key=lambda item: (-item[1].heat, item[1].table_index, item[1].row_offset, item[1].col_offset)
    )
    for key, block in hottest_first:
        if block.weight_bytes <= left:
            left -= block.weight_bytes
            tiers[key] = MemoryTier.RESIDENT
        else:
            tiers[key] = MemoryTier.PAGED
    tiered = tuple(
        replace(
            plan,
            shards=tuple(replace(s, tier=tiers[block_key(plan, s)]) for s in plan.shards),
        )
        for plan in tables
    )
    paged = sum(b.weight_bytes for k, b in blocks.items() if tiers[k] == MemoryTier.PAGED)
    stats = {
        "resident_budget": budget,
        "resident_bytes": budget - left,
        "paged_bytes": paged,
        "mapped_capacity": mapped_capacity,
        "access": sample.source if sample is not None else UNIFORM_ACCESS,
    }
    return tiered, stats


def table_tier(plan: TablePlan) -> str:
    """``resident``, ``paged`` or ``mixed`` (some shards of each)."""
    kinds = {s.tier for s in plan.shards}
    return kinds.pop().value if len(kinds) == 1 else "mixed"
