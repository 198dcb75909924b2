"""Measured quantization error per table and data type, on a sample of rows (never the whole table).

For each table: draw bags of ids (from a sample of request ids when given, so hot rows count as often as
they are read; uniform over the rows otherwise), read only those rows from the table's source (a memory-
mapped checkpoint is indexed, not copied), quantize them with the real row codec (``rowwise``) at every data
type, and compare the pooled bags with the fp32 ones: relative Frobenius error ``|pooled_q - pooled| / |pooled|``.
The precision planner weighs these errors by how often each table is read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from infer.config import DataType, ModelSpec, PoolingType, TableConfig, stores_dim
from infer.errors import WeightsError
from infer.quant.rowwise import dequantize_rows, quantize_rows

if TYPE_CHECKING:  # the planner's access sample; infer.quant does not import the planner at runtime
    from infer.planner.access import AccessSample
    from infer.storage.sources import TableSource

logger = logging.getLogger(__name__)

# every data type the TBE serves on CPU and CUDA, most precise first
MEASURED_DATA_TYPES = (DataType.FP32, DataType.FP16, DataType.INT8, DataType.INT4, DataType.INT2)
DEFAULT_BAGS = 256
DEFAULT_IDS_PER_BAG = 20
# sampled ids this close together are read as one row range from a streaming source
COALESCE_ROWS = 8

# rows(table, ids) -> float rows [len(ids), dim]; ids int64, sorted and unique
RowSource = Callable[[TableConfig, torch.Tensor], torch.Tensor]


def rows_from_weights(weights: Mapping[str, torch.Tensor]) -> RowSource:
    """A row source over ``{table: [rows, dim] tensor}``: ``index_select`` reads only the sampled rows, so a
    memory-mapped checkpoint (``torch.load(..., mmap=True)``) is never read whole."""

    def rows(table: TableConfig, ids: torch.Tensor) -> torch.Tensor:
        if table.name not in weights:
            raise WeightsError(f"table {table.name!r}: no weights given to measure its error; pass its tensor")
        return weights[table.name].index_select(0, ids)

    return rows


def rows_from_source(source: TableSource, coalesce: int = COALESCE_ROWS) -> RowSource:
    """A row source over a streaming ``TableSource`` (safetensors, DCP, a callable): only the sampled rows are
    read, as ranges of ids at most ``coalesce`` rows apart, so a table larger than RAM is never loaded whole."""

    def rows(table: TableConfig, ids: torch.Tensor) -> torch.Tensor:
        if table.name not in source.names():
            raise WeightsError(f"table {table.name!r}: {source.origin} does not hold it; add its rows to the source")
        sorted_ids = ids.numpy()
        if sorted_ids.size == 0:
            return torch.empty(0, table.embedding_dim)
        breaks = np.flatnonzero(np.diff(sorted_ids) > coalesce) + 1
        parts = []
        for run in np.split(sorted_ids, breaks):
            start, end = int(run[0]), int(run[-1]) + 1
            block = source.read_rows(table.name, start, end)
            parts.append(block.to(torch.float32).index_select(0, torch.from_numpy(run - start)))
        return torch.cat(parts)

    return rows


def synthetic_normal_rows(seed: int = 0) -> RowSource:
    """N(0, 1) rows that are a pure function of (seed, table, row id): any row of any size of table, on demand,
    without materializing the table (counter-based hashing, then Box-Muller)."""

    def rows(table: TableConfig, ids: torch.Tensor) -> torch.Tensor:
        table_key = np.uint64(_fnv1a(table.name) ^ (seed * 0x9E3779B97F4A7C15 % 2**64))
        counters = ids.numpy().astype(np.uint64)[:, None] * np.uint64(table.embedding_dim) + np.arange(
            table.embedding_dim, dtype=np.uint64
        )
        first = _to_unit(_splitmix64(counters * np.uint64(2) ^ table_key))
        second = _to_unit(_splitmix64(counters * np.uint64(2) + np.uint64(1) ^ table_key))
        normal = np.sqrt(-2.0 * np.log(first)) * np.cos(2.0 * np.pi * second)
        return torch.from_numpy(normal.astype(np.float32))

    return rows


@dataclass(frozen=True)
class TableError:
    """One table's measured relative error of pooled outputs at each data type."""

    table: str
    errors: tuple[tuple[DataType, float], ...]  # most precise first
    rows_sampled: int
    bags: int

    def error(self, data_type: DataType) -> float:
        for known, value in self.errors:
            if known == data_type:
                return value
        raise KeyError(f"table {self.table!r}: no error measured for {data_type.value}")


def measure_table_error(
    table: TableConfig,
    source: RowSource,
    sample_ids: np.ndarray | None = None,
    data_types: Sequence[DataType] = MEASURED_DATA_TYPES,
    bags: int = DEFAULT_BAGS,
    ids_per_bag: int = DEFAULT_IDS_PER_BAG,
    seed: int = 0,
) -> TableError:
    """The table's error at each data type on ``bags`` bags of ``ids_per_bag`` ids (see the module docstring)."""
    rng = np.random.default_rng([seed, _fnv1a(table.name)])
    count = bags * ids_per_bag
    if sample_ids is not None and sample_ids.size:
        drawn = sample_ids[rng.integers(0, sample_ids.size, count)]
    else:
        drawn = rng.integers(0, table.num_embeddings, count)
    unique, inverse = np.unique(drawn, return_inverse=True)
    rows = source(table, torch.from_numpy(unique.astype(np.int64))).to(torch.float32)
    if rows.shape != (unique.size, table.embedding_dim):
        raise WeightsError(
            f"table {table.name!r}: the row source returned shape {list(rows.shape)} for {unique.size} rows of "
            f"dim {table.embedding_dim}"
        )
    if not torch.isfinite(rows).all():
        raise WeightsError(f"table {table.name!r}: a sampled row holds a NaN or infinite value; fix the checkpoint")
    gather = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
    expected = _pool(rows, gather, bags, ids_per_bag, table.pooling)
    norm = float(torch.linalg.vector_norm(expected))
    errors = []
    for data_type in data_types:
        if not stores_dim(data_type, table.embedding_dim):
            continue  # not a type this table can take (the planner offers only the types measured)
        data, scale_bias = quantize_rows(rows, data_type)
        restored = dequantize_rows(data, scale_bias, data_type, table.embedding_dim)
        got = _pool(restored, gather, bags, ids_per_bag, table.pooling)
        diff = float(torch.linalg.vector_norm(got - expected))
        errors.append((data_type, diff / norm if norm > 0 else 0.0))
    return TableError(table.name, tuple(errors), int(unique.size), bags)


def measure_errors(
    spec: ModelSpec,
    source: RowSource,
    sample: AccessSample | None = None,
    data_types: Sequence[DataType] = MEASURED_DATA_TYPES,
    bags: int = DEFAULT_BAGS,
    ids_per_bag: int = DEFAULT_IDS_PER_BAG,
    seed: int = 0,
) -> tuple[TableError, ...]:
    """Every table's measured error, in the spec's table order."""
    started = time.monotonic()
    measured = tuple(
        measure_table_error(
            table,
            source,
            sample.table_ids(table) if sample is not None else None,
            data_types,
            bags,
            ids_per_bag,
            seed,
        )
        for table in spec.tables
    )
    logger.info("measured the error of %d tables x %d data types in %.2fs", len(measured), len(data_types),
                time.monotonic() - started)  # fmt: skip
    return measured


def format_errors(measured: Sequence[TableError]) -> str:
    """A table: one row per table, one column per data type (relative error of pooled outputs, %)."""
    if not measured:
        return ""
    types = [d for d, _ in measured[0].errors]
    lines = [f"{'table':<24} " + " ".join(f"{d.value:>8}" for d in types) + "  (relative error %, rows sampled)"]
    for row in measured:
        values = " ".join(f"{100 * row.error(d):>8.3f}" for d in types)
        lines.append(f"{row.table:<24} {values}  {row.rows_sampled}")
    return "\n".join(lines)


def _pool(rows: torch.Tensor, gather: torch.Tensor, bags: int, ids_per_bag: int, pooling: PoolingType) -> torch.Tensor:
    pooled = rows.index_select(0, gather).view(bags, ids_per_bag, -1).to(torch.float64).sum(dim=1)
    return pooled / ids_per_bag if pooling == PoolingType.MEAN else pooled


def _fnv1a(text: str) -> int:
    value = 0xCBF29CE484222325
    for byte in text.encode():
        value = ((value ^ byte) * 0x100000001B3) % 2**64
    return value


def _splitmix64(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _to_unit(values: np.ndarray) -> np.ndarray:
    """Uniform in (0, 1]: the top 53 bits, shifted off zero (Box-Muller takes a log)."""
    return ((values >> np.uint64(11)).astype(np.float64) + 1.0) / float(2**53)
