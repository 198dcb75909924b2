"""The access model of precision blocks when no sample of request ids says which rows are hot: the rows' own ranges.

With reads uniform over a table's rows, a row's expected squared quantization error under a rowwise type is
proportional to its range squared (INT8/INT4/INT2 store ``(max - min) / levels`` steps; FP16's error follows the
row's magnitude, which the range bounds), so the ``k`` rows of largest ``range^2`` carry the share
``h_k = sum_top_k range^2 / sum range^2`` of the table's error mass, and a two-block option (``k`` rows at type A,
the rest at B) has error ``sqrt(h_k eA^2 + (1 - h_k) eB^2)``: the mixing ``infer.planner.blocks`` prices sampled hit
shares with. Trained recommendation tables are where this pays: rows rarely or never trained keep their tiny
initial values (TorchRec's ``U(+-sqrt(1 / rows))``) while trained rows are orders larger, so a small precise block
of the large rows takes most of the error. Rows of one scale (iid ``N(0, 1)``) give ``h_k`` close to ``k / rows``
and blocks that do not pay.

Each table is read once, a chunk of rows at a time (a mapped or streaming source is never loaded whole); the planner
keeps only the shares at its hot sizes, and export ranks the block tables' rows from the same ranges (largest first,
ties in id order), so the exported blocks hold the rows the planner priced. Through a ``KeptRanges`` source (what
``embserve export`` plans with) the ranges read for the plan are the ones export ranks by: a block table's rows are
not read a second time for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from infer.errors import WeightsError
from infer.planner.blocks import MIN_RANKING_IDS, RANKED_BY_SAMPLE, hot_sizes_of

if TYPE_CHECKING:
    from infer.config import ModelSpec, TableConfig
    from infer.planner.access import AccessSample
    from infer.storage.sources import TableSource

logger = logging.getLogger(__name__)

# rows read at a time: about this many bytes of fp32 rows
CHUNK_BYTES = 64 << 20


class KeptRanges:
    """A table source that keeps each table's rows' ranges once ``range_access`` has read them, so that the export
    which planned with it ranks the chosen block tables (``block_orders_from_ranges``) without another pass over their
    rows. Holds 4 bytes a row of every table priced by its ranges until ``release``."""

    def __init__(self, source: TableSource) -> None:
        self.source = source
        self.origin = source.origin
        self.kept: dict[str, np.ndarray] = {}

    def names(self) -> Sequence[str]:
        return self.source.names()

    def table_info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self.source.table_info(name)

    def read_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.source.read_rows(name, start, end)

    def ranges(self, table: TableConfig) -> np.ndarray:
        """``row_ranges`` of ``table``, read once."""
        held = self.kept.get(table.name)
        if held is None or held.size != table.num_embeddings:
            held = self.kept[table.name] = row_ranges(self.source, table)
        return held

    def release(self) -> None:
        """Let the kept ranges go."""
        self.kept.clear()


def _ranges_of(source: TableSource, table: TableConfig) -> np.ndarray:
    return source.ranges(table) if isinstance(source, KeptRanges) else row_ranges(source, table)


def ranked_by_sample(sample: AccessSample | None, table: TableConfig) -> bool:
    """Whether the sample ranks the table's rows (at least two of its ids were sampled: ``hot_shares`` needs a
    ranking half and a held-out half); otherwise its rows' ranges do. The planner and export both ask this. Counted,
    not gathered: ``table_ids`` would sort every sampled id of the table to answer it."""
    if sample is None:
        return False
    return sum(int(np.size(sample.ids[f])) for f in table.feature_names if f in sample.ids) >= MIN_RANKING_IDS


def row_ranges(source: TableSource, table: TableConfig, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """Every row's range ``max - min`` (float32, one per row), read from ``source`` a chunk of rows at a time.
    ``WeightsError`` naming the table and row when a row holds a NaN or an infinite value."""
    rows, dim = table.num_embeddings, table.embedding_dim
    step = max(1, chunk_bytes // max(1, 4 * dim))
    ranges = np.empty(rows, dtype=np.float32)
    for start in range(0, rows, step):
        end = min(rows, start + step)
        block = source.read_rows(table.name, start, end).to(torch.float32)
        if block.shape != (end - start, dim):
            raise WeightsError(
                f"table {table.name!r}: {source.origin} returned shape {list(block.shape)} for rows {start}..{end} "
                f"of dim {dim}"
            )
        spread = (block.amax(dim=1) - block.amin(dim=1)).numpy() if dim else np.zeros(end - start, np.float32)
        bad = np.flatnonzero(~np.isfinite(spread))
        if bad.size:
            raise WeightsError(
                f"table {table.name!r}: row {start + int(bad[0])} holds a NaN or infinite value; fix the checkpoint"
            )
        ranges[start:end] = spread
    return ranges


def range_shares(ranges: np.ndarray, hot_sizes: Sequence[int]) -> np.ndarray:
    """Per hot size ``k``: ``h_k``, the share of ``sum range^2`` that the ``k`` rows of largest range carry (0 for
    every size when every row is constant: no error to move). One float32 sort of the squares, scaled by the
    largest (no overflow), and float64 sums between consecutive sizes: a 40M-row table needs ~3 x 160 MB."""
    spread = np.asarray(ranges, dtype=np.float32)
    top = float(spread.max()) if spread.size else 0.0
    if top <= 0:
        return np.zeros(len(hot_sizes))
    squared = np.sort(np.square(spread / np.float32(top)))[::-1]
    sizes = np.minimum(np.asarray(hot_sizes, dtype=np.int64), squared.size)
    bounds = np.unique(np.concatenate([[0], sizes, [squared.size]]))
    mass = np.cumsum([0.0] + [float(np.sum(squared[a:b], dtype=np.float64)) for a, b in zip(bounds[:-1], bounds[1:])])
    at = dict(zip(bounds.tolist(), mass.tolist()))
    return np.array([at[int(k)] / mass[-1] for k in sizes], dtype=np.float64)


def rank_by_range(ranges: np.ndarray, ranked: int | None = None) -> torch.Tensor:
    """The rows ranked largest range first, ties in id order: an int64 permutation (``block_orders``'s ranking).
    With ``ranked``: only the first ``ranked`` places are ranked (the precise blocks; one partition and a sort of
    those rows instead of a sort of the table), the other rows follow in id order (the cold block is a set)."""
    neg = -np.asarray(ranges, dtype=np.float32)
    if ranked is None or ranked >= neg.size:
        return torch.from_numpy(np.argsort(neg, kind="stable").astype(np.int64))
    if ranked <= 0:
        return torch.arange(neg.size, dtype=torch.int64)
    threshold = np.partition(neg, ranked - 1)[ranked - 1]  # the ranked-th largest range, negated
    above = np.flatnonzero(neg < threshold)
    hot = np.concatenate([above, np.flatnonzero(neg == threshold)[: ranked - above.size]])
    hot = hot[np.argsort(neg[hot], kind="stable")]  # id order kept among equals: ``above`` and the ties are
    rest = np.ones(neg.size, dtype=bool)
    rest[hot] = False
    return torch.from_numpy(np.concatenate([hot, np.flatnonzero(rest)]).astype(np.int64))


def range_access(
    spec: ModelSpec, source: TableSource, sample: AccessSample | None, tables: Sequence[str] | None = None
) -> dict[str, np.ndarray]:
    """Per table the sample does not rank (``ranked_by_sample``) with more than one row, limited to ``tables`` when
    given: ``h_k`` at the planner's hot sizes (``infer.planner.blocks.hot_sizes_of``), from one pass over its
    rows. What ``block_problem`` takes as ``range_shares``."""
    started = time.monotonic()
    shares: dict[str, np.ndarray] = {}
    for table in spec.tables:
        if (tables is not None and table.name not in tables) or table.num_embeddings < 2:
            continue
        if ranked_by_sample(sample, table):
            continue
        shares[table.name] = range_shares(_ranges_of(source, table), hot_sizes_of(table.num_embeddings))
    logger.info("row ranges of %d tables read in %.2fs", len(shares), time.monotonic() - started)
    return shares


def block_orders_from_ranges(
    spec: ModelSpec, source: TableSource, tables: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """Each block table of ``spec`` (those in ``tables`` when given) ranked by its rows' ranges, largest first:
    ``quantize``'s ``block_orders`` for the tables the planner priced by row ranges."""
    out = {}
    for name in (t for t in spec.block_tables if tables is None or t in tables):
        table = spec.table(name)
        out[name] = rank_by_range(_ranges_of(source, table), table.num_embeddings - table.blocks[-1].rows)
    return out


def ranking_of(record: Mapping[str, object]) -> str:
    """What ranked one block table of a plan's precision record: a plan from before the access model was recorded
    ranked its blocks by sample ids."""
    return str(record.get("ranking") or RANKED_BY_SAMPLE)
