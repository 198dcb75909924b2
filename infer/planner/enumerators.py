"""Every allowed way to shard every table, priced by the estimators."""

from __future__ import annotations

import math
from collections.abc import Mapping

from infer.config import ModelSpec, TableConfig
from infer.errors import PlanError, PlanErrorKind
from infer.planner import constants as C
from infer.planner.shard_estimators import InferencePerfEstimator, InferenceStorageEstimator, input_bytes, output_bytes
from infer.planner.types import (
    ParameterConstraints,
    PerfEstimator,
    Placement,
    ShardContext,
    ShardingOption,
    ShardingType,
    ShardSpec,
    StorageEstimator,
    Topology,
)


def even_blocks(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """Split ``total`` into ``parts`` (offset, size) blocks as even as possible, sizes multiples of ``unit``.

    The first blocks take the remainder, so sizes differ by at most ``unit``; every block is non-empty.
    """
    units = total // unit
    base, extra = divmod(units, parts)
    blocks = []
    offset = 0
    for i in range(parts):
        size = (base + (1 if i < extra else 0)) * unit
        blocks.append((offset, size))
        offset += size
    return blocks


def _shard_counts(limit: int, constraints: ParameterConstraints) -> list[int]:
    """Shard counts worth trying for split options: powers of two and ``limit`` itself, >= 2."""
    upper = min(limit, constraints.max_shards or limit)
    counts = {1 << p for p in range(1, int(math.log2(upper)) + 1)} if upper >= 2 else set()
    if upper >= 2:
        counts.add(upper)
    return sorted(c for c in counts if c >= max(2, constraints.min_shards))


class EmbeddingEnumerator:
    """Table-wise, row-wise, column-wise, table-row-wise (multi-host only) and replicated options."""

    def __init__(
        self,
        batch_size: int = C.DEFAULT_BATCH_SIZE,
        storage_estimator: StorageEstimator | None = None,
        perf_estimator: PerfEstimator | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.storage_estimator = storage_estimator or InferenceStorageEstimator()
        self.perf_estimator = perf_estimator or InferencePerfEstimator()

    def enumerate(
        self, spec: ModelSpec, topology: Topology, constraints: Mapping[str, ParameterConstraints]
    ) -> dict[str, list[ShardingOption]]:
        unknown = sorted(set(constraints) - {t.name for t in spec.tables})
        if unknown:
            raise PlanError(f"constraints name unknown table(s) {unknown}", PlanErrorKind.INVALID_CONSTRAINT)
        options: dict[str, list[ShardingOption]] = {}
        for table in spec.tables:
            table_constraints = constraints.get(table.name, ParameterConstraints())
            if table.blocks and ShardingType.TABLE_WISE not in table_constraints.sharding_types:
                raise PlanError(
                    f"table {table.name!r} is held in precision blocks and its constraints do not allow table_wise: "
                    "row-wise/column-wise sharding of a table in precision blocks is not supported; shard it "
                    "table-wise or store it in one type",
                    PlanErrorKind.INVALID_CONSTRAINT,
                )
            table_options = self.table_options(table, topology, table_constraints)
            if not table_options:
                raise PlanError(
                    f"table {table.name!r}: its constraints allow no sharding option on {topology.world_size} "
                    f"{topology.compute_device.value} devices; relax sharding_types, placements or shard counts",
                    PlanErrorKind.INVALID_CONSTRAINT,
                )
            options[table.name] = table_options
        return options

    def _placements(self, topology: Topology, constraints: ParameterConstraints) -> list[Placement]:
        if not topology.is_cuda:
            # a CPU shard's memory is host memory: there is nothing to offload to
            return [Placement.DEVICE] if Placement.DEVICE in constraints.placements else []
        return [p for p in Placement if p in constraints.placements]

    def table_options(
        self, table: TableConfig, topology: Topology, constraints: ParameterConstraints
    ) -> list[ShardingOption]:
        data_type = constraints.data_type or table.data_type
        batch = constraints.batch_size or self.batch_size
        pooling = constraints.pooling_factor(table)
        world = topology.world_size
        layouts: list[tuple[ShardingType, list[tuple[int, int, int, int]], int]] = []
        allowed = set(constraints.sharding_types)
        if table.blocks:  # its remap and blocks are one kernel's: whole on one device (infer.shard.builder)
            allowed &= {ShardingType.TABLE_WISE}
        rows, dim = table.num_embeddings, table.embedding_dim
        if ShardingType.TABLE_WISE in allowed and constraints.min_shards <= 1:
            layouts.append((ShardingType.TABLE_WISE, [(0, rows, 0, dim)], batch))
        if ShardingType.ROW_WISE in allowed:
            for k in _shard_counts(min(world, rows), constraints):
                layouts.append((ShardingType.ROW_WISE, [(o, n, 0, dim) for o, n in even_blocks(rows, k)], batch))
        if ShardingType.TABLE_ROW_WISE in allowed and topology.local_world_size < world:
            k = topology.local_world_size
            if k >= max(2, constraints.min_shards) and k <= min(rows, constraints.max_shards or k):
                blocks = [(o, n, 0, dim) for o, n in even_blocks(rows, k)]
                layouts.append((ShardingType.TABLE_ROW_WISE, blocks, batch))
        unit = constraints.min_column_shard
        if ShardingType.COLUMN_WISE in allowed and dim % unit == 0:
            for k in _shard_counts(min(world, dim // unit), constraints):
                layouts.append(
                    (ShardingType.COLUMN_WISE, [(0, rows, o, n) for o, n in even_blocks(dim, k, unit)], batch)
                )
        if (
            ShardingType.REPLICATED in allowed
            and world >= max(2, constraints.min_shards)
            and world <= (constraints.max_shards or world)
        ):
            share = max(1, math.ceil(batch / world))
            layouts.append((ShardingType.REPLICATED, [(0, rows, 0, dim)] * world, share))
        options = []
        for placement in self._placements(topology, constraints):
            for sharding_type, blocks, shard_batch in layouts:
                if sharding_type == ShardingType.REPLICATED and placement != Placement.DEVICE:
                    continue  # copies in host memory buy nothing over one shared host table
                cache: dict[tuple[int, int], ShardSpec] = {}
                shards = []
                for row_offset, num_rows, col_offset, num_cols in blocks:
                    priced = cache.get((num_rows, num_cols))
                    if priced is None:
                        ctx = ShardContext(
                            table, data_type, constraints, topology, sharding_type, placement,
                            num_rows, num_cols, len(blocks), shard_batch, pooling,
                        )  # fmt: skip
                        priced = ShardSpec(
                            0,
                            num_rows,
                            0,
                            num_cols,
                            self.storage_estimator.storage(ctx),
                            self.perf_estimator.cost(ctx),
                            input_bytes(ctx),
                            output_bytes(ctx),
                        )
                        cache[(num_rows, num_cols)] = priced
                    shards.append(
                        ShardSpec(
                            row_offset,
                            num_rows,
                            col_offset,
                            num_cols,
                            priced.storage,
                            priced.cost,
                            priced.input_bytes,
                            priced.output_bytes,
                        )  # fmt: skip
                    )
                options.append(ShardingOption(table.name, sharding_type, placement, data_type, tuple(shards)))
        return options
