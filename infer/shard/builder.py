"""Build a sharded model from a plan and a quantized (unsharded) model.

Shards copy their rows from the unsharded model's quantized bytes: a column slice keeps each row's
scale and bias, so table- and column-wise shards reproduce the unsharded output bit for bit. On one CPU
host, row- and column-wise shards are views of their whole table, stored once (``cpu_views``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infer.config import DataType, ModelSpec, TableConfig
from infer.errors import ConfigError, PlanError, PlanErrorKind
from infer.modules.collection import (
    BlockSplit,
    EmbserveModel,
    QuantizedEmbeddingBagCollection,
    kernel_table_name,
    level_blocks,
    placed_dense_arch,
)
from infer.modules.cuda_probe import check_kernel_types
from infer.modules.sharded import (
    READ_ALL,
    READ_BATCH_SLICE,
    READ_ROW_BLOCK,
    DeviceShards,
    ShardedEmbeddingBagCollection,
    kernel_rows,
)
from infer.modules.tbe import make_tbe
from infer.planner.types import Shard, ShardingPlan, ShardingType, require_devices_here
from infer.quant.rowwise import CPU_ROW_ALIGNMENT, column_byte_range, column_slice_aligned, table_bytes

logger = logging.getLogger(__name__)


def plan_devices(plan: ShardingPlan, device_map: Mapping[str, str] | None = None) -> list[str]:
    """Torch device of every plan rank: ``cpu`` for CPU shards, ``cuda:i`` for CUDA ones, then ``device_map``."""
    topo = plan.topology
    names = ["cpu" if not topo.is_cuda else topo.device_name(rank) for rank in range(topo.world_size)]
    mapping = dict(device_map or {})
    return [mapping.get(name, name) for name in names]


def check_plan(spec: ModelSpec, plan: ShardingPlan) -> None:
    """Raise ``PlanError(INVALID_PLAN)`` unless ``plan`` places exactly ``spec``'s tables, whole."""
    tables = {t.name: t for t in spec.tables}
    planned = [t.table for t in plan.tables]
    if sorted(planned) != sorted(tables):
        raise PlanError(
            f"the plan's tables {sorted(planned)} are not the model's {sorted(tables)}", PlanErrorKind.INVALID_PLAN
        )
    for table_plan in plan.tables:
        table = tables[table_plan.table]
        name = table.name
        if table_plan.data_type != table.data_type:
            raise PlanError(
                f"table {name!r}: plan says {table_plan.data_type.value}, model is {table.data_type.value}; "
                "quantize with the plan's data types",
                PlanErrorKind.INVALID_PLAN,
            )
        for shard in table_plan.shards:
            if not 0 <= shard.device < plan.topology.world_size:
                raise PlanError(
                    f"table {name!r}: shard on device {shard.device} outside the topology", PlanErrorKind.INVALID_PLAN
                )
            inside = 0 <= shard.row_offset and shard.row_offset + shard.num_rows <= table.num_embeddings
            inside = inside and 0 <= shard.col_offset and shard.col_offset + shard.num_cols <= table.embedding_dim
            if not inside or shard.num_rows < 1 or shard.num_cols < 1:
                raise PlanError(
                    f"table {name!r}: {_shard_text(shard)} lies outside the table's {_table_size(table)}",
                    PlanErrorKind.INVALID_PLAN,
                )
            if not column_slice_aligned(shard.col_offset, shard.num_cols, table.data_type):
                raise PlanError(
                    f"table {name!r}: column slice {shard.col_offset}+{shard.num_cols} is not 4-column aligned",
                    PlanErrorKind.INVALID_PLAN,
                )
        kind = table_plan.sharding_type
        if table.blocks and kind != ShardingType.TABLE_WISE:
            raise PlanError(f"table {name!r}: {block_sharding_refused(kind)}", PlanErrorKind.INVALID_PLAN)
        shards = table_plan.shards
        rows = sorted((s.row_offset, s.num_rows) for s in shards)
        cols = sorted((s.col_offset, s.num_cols) for s in shards)
        if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            covered = _covers(rows, table.num_embeddings) and all(c == (0, table.embedding_dim) for c in cols)
        elif kind == ShardingType.COLUMN_WISE:
            covered = _covers(cols, table.embedding_dim) and all(r == (0, table.num_embeddings) for r in rows)
        else:
            covered = all(r == (0, table.num_embeddings) for r in rows) and all(
                c == (0, table.embedding_dim) for c in cols
            )
            if kind == ShardingType.TABLE_WISE:
                covered = covered and len(shards) == 1
        if not covered:
            placed = "; ".join(_shard_text(s) for s in shards[:4]) + ("; ..." if len(shards) > 4 else "")
            raise PlanError(
                f"table {name!r}: {kind.value} shards do not cover the table's {_table_size(table)} exactly ({placed})",
                PlanErrorKind.INVALID_PLAN,
            )


def block_sharding_refused(kind: ShardingType) -> str:
    """Why a table held in precision blocks cannot be sharded ``kind``: its id remap and its blocks are one
    kernel's (a row block or column slice would split the remap's positions or every block), so it goes whole to
    one device."""
    if kind == ShardingType.REPLICATED:
        what = "replicating a table in precision blocks"
    else:
        what = "row-wise/column-wise sharding of a table in precision blocks"
    return f"the plan shards it {kind.value}, but {what} is not supported; shard it table-wise or store it in one type"


def _shard_text(shard: Shard) -> str:
    """A plan's shard as a reader checks it against the table: where it is and which rows and columns it holds."""
    rows = f"rows [{shard.row_offset}, {shard.row_offset + shard.num_rows})"
    columns = f"columns [{shard.col_offset}, {shard.col_offset + shard.num_cols})"
    return f"the shard on device {shard.device} ({rows}, {columns})"


def _table_size(table: TableConfig) -> str:
    return f"{table.num_embeddings} rows x {table.embedding_dim} columns"


def _covers(ranges: list[tuple[int, int]], total: int) -> bool:
    position = 0
    for offset, size in ranges:
        if offset != position:
            return False
        position += size
    return position == total


@dataclass(frozen=True)
class DeviceLayout:
    """What one device of a plan holds, in kernel order: its TBE's tables (shards; a table held in precision blocks,
    placed table-wise, a TBE table per block) and the features it reads."""

    rank: int
    tables: tuple[tuple[str, int, int, DataType], ...]  # (name, rows, cols, data type) per local (TBE) table
    sources: tuple[tuple[TableConfig, Shard], ...]  # the table and plan shard behind each local table
    features: tuple[tuple[int, ...], ...]  # per feature read: (feature, kind, lo, hi, out_col, dim)
    # the local table of each kernel feature: every feature read once per level of blocks, level-major
    # (``collection.level_blocks``; without block tables one level: each feature read once)
    feature_table_map: tuple[int, ...]
    table_blocks: tuple[int, ...]  # per local table: the precision block it holds, -1 for a shard in one type
    split: BlockSplit  # how the kernel's input is split by block (no block tables: one level, nothing split)


def cpu_views(plan: ShardingPlan) -> bool:
    """Whether ``plan``'s row- and column-wise shards run as views of their whole table: a plan of CPU devices on
    one host. Its devices share one memory, so a shard's kernel holds the whole table (stored once, every
    kernel pointing into it: ``shared_cpu_storage``) and pools shard ``i`` of ``n``'s share of the batch, bags
    ``i * B // n`` up to ``(i + 1) * B // n``, like a replica: no bucketizing of ids, no partial sums, no
    copied rows or column slices. The plan keeps its shards for placement and accounting; the C++ loader
    derives the same layout (``read_checked_plan``)."""
    return plan.topology.cpu_views


def device_layouts(spec: ModelSpec, plan: ShardingPlan) -> list[DeviceLayout]:
    """Every device of ``plan`` that holds a shard, in rank order, laid out as ``shard_model`` builds it
    (local tables in table order, then shard order; features sorted by input feature and column). On one CPU
    host (``cpu_views``), a row- or column-wise shard is its whole table read for its share of the batch."""
    plans = {t.table: t for t in plan.tables}
    features = spec.features
    views = cpu_views(plan)
    layouts = []
    for rank in range(plan.topology.world_size):
        local_tables: list[tuple[str, int, int, DataType]] = []
        local_sources: list[tuple[TableConfig, Shard]] = []
        local_blocks: list[int] = []
        groups: list[list[int]] = []  # per shard on the device: its local tables (one, or one per block)
        local_features: list[tuple[int, tuple[int, ...], int]] = []  # (feature index, routing, shard on the device)
        for table in spec.tables:
            table_plan = plans[table.name]
            on_device = [(i, s) for i, s in enumerate(table_plan.shards) if s.device == rank]
            split = table_plan.sharding_type in (
                ShardingType.ROW_WISE,
                ShardingType.TABLE_ROW_WISE,
                ShardingType.COLUMN_WISE,
            )
            for shard_index, shard in on_device:
                if views and split:
                    shard = dataclasses.replace(
                        shard, row_offset=0, num_rows=table.num_embeddings, col_offset=0, num_cols=table.embedding_dim
                    )
                local = len(groups)
                groups.append([])
                # check_plan lets a table held in precision blocks be sharded table-wise only: one shard, whole
                for j, block in enumerate(table.stored_blocks):
                    groups[-1].append(len(local_tables))
                    name = kernel_table_name(f"{table.name}@{shard_index}", j if table.blocks else -1)
                    rows, data_type = (
                        (block.rows, block.data_type) if table.blocks else (shard.num_rows, table.data_type)
                    )
                    local_tables.append((name, rows, shard.num_cols, data_type))
                    local_sources.append((table, shard))
                    local_blocks.append(j if table.blocks else -1)
                for f, info in enumerate(features):
                    if info.table != table.name:
                        continue
                    kind, lo, hi = READ_ALL, 0, 0
                    if views and split:
                        kind, lo, hi = READ_BATCH_SLICE, shard_index, len(table_plan.shards)
                    elif table_plan.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
                        kind, lo, hi = READ_ROW_BLOCK, shard.row_offset, shard.row_offset + shard.num_rows
                    elif table_plan.sharding_type == ShardingType.REPLICATED:
                        kind, lo, hi = READ_BATCH_SLICE, shard_index, len(table_plan.shards)
                    out_col = info.column_start + shard.col_offset
                    local_features.append((f, (f, kind, lo, hi, out_col, shard.num_cols), local))
        if not local_tables:
            continue
        local_features.sort(key=lambda item: (item[0], item[1][4], item[1][2]))
        routing = [list(lf[1]) for lf in local_features]
        counts = [len(groups[lf[2]]) for lf in local_features]
        held = [local_sources[groups[lf[2]][0]][0] for lf in local_features]
        read_rows = kernel_rows(routing, [f.num_embeddings for f in features])
        layouts.append(
            DeviceLayout(
                rank,
                tuple(local_tables),
                tuple(local_sources),
                tuple(lf[1] for lf in local_features),
                tuple(groups[local_features[i][2]][j] for i, j in level_blocks(counts)),
                tuple(local_blocks),
                BlockSplit.of_features([(t.name, n, t.blocks) for t, n in zip(held, read_rows)]),
            )
        )
    return layouts


@dataclass(frozen=True)
class SharedStorage:
    """Where one CPU kernel's tables lie in the weight buffer that every CPU kernel of the model shares."""

    total_bytes: int  # the shared buffer's size
    table_offsets: tuple[int, ...]  # per local table, its first byte in the buffer


def shared_cpu_storage(
    plan: ShardingPlan, layouts: list[DeviceLayout], devices: list[str], tables: Sequence[str]
) -> list[SharedStorage] | None:
    """One weight buffer for every kernel of a one-host plan whose devices are all CPU and where several devices
    hold the same rows (replicas, row- and column-wise views): each distinct shard (table, row block, column
    slice) is stored once, in the order of ``tables`` (the model's), then by row and column offset, and every
    kernel points into the buffer; CPU "devices" share one memory, so copies buy nothing. A plan of whole-table
    views so lays its buffer out exactly as the unsharded model's. None (one buffer per kernel, as fbgemm
    allocates it) when nothing repeats, a device is not the CPU, or the plan spans several hosts (each host
    holds its own part)."""
    if plan.topology.local_world_size < plan.topology.world_size:
        return None
    if any(devices[layout.rank] != "cpu" for layout in layouts):
        return None
    sizes: dict[tuple[str, int, int, int, int, int], int] = {}
    for layout in layouts:
        for key, (_, rows, cols, dtype) in zip(_shard_keys(layout), layout.tables):
            sizes[key] = table_bytes(rows, cols, dtype, CPU_ROW_ALIGNMENT)
    if len(sizes) == sum(len(layout.tables) for layout in layouts):
        return None
    position = {name: i for i, name in enumerate(tables)}
    offsets: dict[tuple[str, int, int, int, int, int], int] = {}
    cursor = 0
    for key in sorted(sizes, key=lambda k: (position[k[0]], k[1], k[3], k[2], k[4], k[5])):
        offsets[key] = cursor
        cursor += sizes[key]
    placed = [tuple(offsets[key] for key in _shard_keys(layout)) for layout in layouts]
    return [SharedStorage(cursor, local) for local in placed]


def _shard_keys(layout: DeviceLayout) -> list[tuple[str, int, int, int, int, int]]:
    """What each local table of ``layout`` holds: (table, row offset, rows, column offset, columns, block)."""
    return [
        (table.name, shard.row_offset, shard.num_rows, shard.col_offset, shard.num_cols, block)
        for (table, shard), block in zip(layout.sources, layout.table_blocks)
    ]


def share_weights(tbe: Any, buffer: torch.Tensor, storage: SharedStorage) -> None:
    """Copy ``tbe``'s tables into their places in the shared ``buffer`` (a replica's place is filled once; the
    copies are the same bytes) and point the TBE at the buffer; its own allocation is released."""
    feature_table_map = list(tbe.feature_table_map)  # type: ignore[arg-type]
    with torch.no_grad():
        for t, (data, _) in enumerate(tbe.split_embedding_weights(split_scale_shifts=False)):  # type: ignore[operator]
            flat = data.reshape(-1)
            buffer[storage.table_offsets[t] : storage.table_offsets[t] + flat.numel()].copy_(flat)
    tbe.weights_host = buffer
    tbe.weights_offsets = torch.tensor([storage.table_offsets[t] for t in feature_table_map], dtype=torch.int64)
    tbe.weights_physical_offsets = list(storage.table_offsets)
    tbe.host_size = storage.total_bytes


def build_device_shards(
    spec: ModelSpec,
    layout: DeviceLayout,
    device: str,
    source_weights: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]] | None,
) -> DeviceShards:
    """One device's TBE filled with its shards' rows, copied from the unsharded model's kernel bytes; with no
    ``source_weights``, the structure only (its weight buffer unallocated: ``make_tbe(allocate=False)``)."""
    check_kernel_types([(name, dtype) for name, _, _, dtype in layout.tables], device)
    tbe = make_tbe(
        list(layout.tables), list(layout.feature_table_map), torch.device(device), allocate=source_weights is not None
    )
    if source_weights is not None:
        _copy_shards(tbe, layout, source_weights)
    routing = [list(feature) for feature in layout.features]
    features = spec.features
    logger.debug("device %s: %d shards, %d features", device, len(layout.tables), len(routing))
    names = [f.name for f in features]
    return DeviceShards(tbe, device, routing, [f.num_embeddings for f in features], names, layout.split)


def _copy_shards(
    tbe: Any, layout: DeviceLayout, source_weights: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]]
) -> None:
    """Fill the device's kernel tables from ``source_weights`` (the unsharded kernel's tables by name,
    ``collection.kernel_table_name``): a shard's rows and columns, or a whole precision block."""
    with torch.no_grad():
        split = tbe.split_embedding_weights()
        for (data, row_scales), (table, shard), block, (_, _, _, data_type) in zip(
            split, layout.sources, layout.table_blocks, layout.tables
        ):
            src_data, src_row_scales = source_weights[kernel_table_name(table.name, block)]
            rows = slice(shard.row_offset, shard.row_offset + shard.num_rows) if block < 0 else slice(None)
            first, last = column_byte_range(shard.col_offset, shard.num_cols, data_type)
            data.copy_(src_data[rows, first:last])
            if row_scales is not None and src_row_scales is not None:
                row_scales.copy_(src_row_scales[rows])


def shard_model(
    model: EmbserveModel,
    plan: ShardingPlan,
    device_map: Mapping[str, str] | None = None,
    output_device: str | None = None,
) -> EmbserveModel:
    """The sharded twin of ``model`` (from ``infer.quantize``): one TBE per device of ``plan``. A table held in
    precision blocks goes table-wise to one device, whose kernel holds its blocks and id remap and splits requests by
    block as the unsharded collection does (``check_plan`` refuses it row-, column-wise or replicated).

    A CUDA plan on a host without its devices is a ``PlanError(kind=INVALID_TOPOLOGY)`` naming them and the fix,
    unless ``device_map`` moves them (e.g. ``{"cuda:0": "cpu"}``)."""
    spec = model.spec
    source = model.embeddings
    if not isinstance(source, QuantizedEmbeddingBagCollection):
        raise ConfigError(
            f"shard_model takes the unsharded model returned by infer.quantize(), got one whose embeddings are "
            f"{type(source).__name__}; quantize the tables first, then shard that model"
        )
    check_plan(spec, plan)
    devices = plan_devices(plan, device_map)
    if devices == plan_devices(plan):  # the plan's own devices must be here (a device map names where instead)
        require_devices_here(plan.topology, "the plan given to shard_model")
    source_weights = kernel_table_weights(source)
    shards: list[DeviceShards] = []
    layouts = device_layouts(spec, plan)
    storage = shared_cpu_storage(plan, layouts, devices, [t.name for t in spec.tables])
    buffer = torch.zeros(storage[0].total_bytes, dtype=torch.uint8) if storage else None
    for index, layout in enumerate(layouts):
        device_shards = build_device_shards(spec, layout, devices[layout.rank], source_weights)
        if storage is not None and buffer is not None:
            share_weights(device_shards.tbe, buffer, storage[index])
        for table in device_shards.block_table_names:  # the one device holding a block table holds its remap
            device_shards.set_block_remap(table, source.block_ranks(table))
        shards.append(device_shards)
    if storage is not None:
        logger.info(
            "CPU replicas share one weight buffer of %d bytes across %d kernels", storage[0].total_bytes, len(shards)
        )
    return _sharded_model(spec, shards, output_device or devices[0])


def kernel_table_weights(
    collection: QuantizedEmbeddingBagCollection,
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """The unsharded kernel's tables by name (``collection.kernel_table_name``: a table, or one of its blocks)."""
    names = [spec[0] for spec in collection.tbe.embedding_specs]  # type: ignore[union-attr]
    return dict(zip(names, collection.table_weights()))


def shard_structure(spec: ModelSpec, plan: ShardingPlan) -> EmbserveModel:
    """The sharded model of ``spec`` by a one-host CPU ``plan`` with every kernel's weight buffer unallocated: the
    structure a streaming export scripts (``infer.artifact.stream``), its rows written to weight files instead."""
    check_plan(spec, plan)
    devices = plan_devices(plan)
    shards = [build_device_shards(spec, layout, devices[layout.rank], None) for layout in device_layouts(spec, plan)]
    return _sharded_model(spec, shards, devices[0])


def _sharded_model(spec: ModelSpec, shards: list[DeviceShards], output_device: str) -> EmbserveModel:
    features = spec.features
    identity = (
        len(shards) == 1
        and shards[0].lf_feature == list(range(len(features)))
        and all(kind == READ_ALL for kind in shards[0].lf_kind)
        and shards[0].lf_out_col == shards[0].lf_local_col
        and shards[0].lf_dim == [f.embedding_dim for f in features]
    )
    collection = ShardedEmbeddingBagCollection(spec, shards, output_device, identity)
    return EmbserveModel(spec, collection, placed_dense_arch(spec.dense_arch, output_device))
