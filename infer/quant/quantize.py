"""Quantization: fp32 tables -> the quantized, scriptable model (rows in the layout of ``rowwise``).

Tables are converted in row chunks straight into the kernel's buffer, so at most one chunk of
temporaries exists beside the caller's weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from infer.config import DataType, ModelSpec
from infer.errors import WeightsError
from infer.modules.collection import EmbserveModel, QuantizedEmbeddingBagCollection, placed_dense_arch, tbe_tables
from infer.quant.blocks import block_orders as checked_block_orders
from infer.quant.blocks import remap_of
from infer.quant.rowwise import dequantize_rows, quantize_rows
from infer.weights import check_weights

logger = logging.getLogger(__name__)

CHUNK_ROWS = 1 << 16
# Tables at least this large report progress while they are converted.
PROGRESS_MIN_ROWS = 1 << 20

# progress(table_name, rows_done, rows_total)
ProgressFn = Callable[[str, int, int], None]


def quantize(
    spec: ModelSpec,
    weights: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    progress: ProgressFn | None = None,
    block_orders: Mapping[str, Any] | None = None,
) -> EmbserveModel:
    """Build the quantized, scriptable model of ``spec`` from fp32 ``weights`` (one tensor per table).

    Each table is stored in its ``data_type``; all tables of the device share one TBE.
    A table held in precision blocks (``TableConfig.blocks``) needs its rows ranked hottest first in
    ``block_orders`` (table -> ids; ``infer.quant.blocks.rank_rows`` ranks them from sampled request ids): block
    ``j`` holds the rows ranked in its range, in its type.
    Returns an ``EmbserveModel`` (carrying ``spec.dense_arch`` when present).
    """
    spec.require_stated_pooling()
    check_weights(spec, weights)
    orders = checked_block_orders(spec, block_orders)
    collection = QuantizedEmbeddingBagCollection(spec, device=device)
    targets = collection.table_weights()
    for table, kernel_tables in zip(spec.tables, tbe_tables(spec)):
        if not table.blocks:
            data, row_scales = targets[kernel_tables[0]]
            _fill_table(table.name, weights[table.name], table.data_type, data, row_scales, progress)
            continue
        order = orders[table.name]
        start = 0
        for block, k in zip(table.blocks, kernel_tables):
            data, row_scales = targets[k]
            rows = order[start : start + block.rows]
            _fill_table(table.name, weights[table.name], block.data_type, data, row_scales, progress, rows)
            start += block.rows
        collection.set_block_remap(table.name, remap_of(order))
    return EmbserveModel(spec, collection, placed_dense_arch(spec.dense_arch, device))


def _fill_table(
    name: str,
    weight: torch.Tensor,
    data_type: DataType,
    data: torch.Tensor,
    row_scales: torch.Tensor | None,
    progress: ProgressFn | None,
    row_ids: torch.Tensor | None = None,
) -> None:
    """Quantize ``weight``'s rows (or its rows ``row_ids``, in that order: a precision block) into ``data``."""
    rows = weight.shape[0] if row_ids is None else row_ids.numel()
    report = progress if progress is not None else (_log_progress if rows >= PROGRESS_MIN_ROWS else None)
    started = time.monotonic()
    with torch.no_grad():
        for start in range(0, rows, CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, rows)
            chunk = weight[start:end] if row_ids is None else weight[row_ids[start:end]]
            if row_ids is None:
                check_finite(name, chunk, start)
            else:
                _check_finite_rows(name, chunk, row_ids[start:end])
            q_data, q_row_scales = quantize_rows(chunk, data_type)
            data[start:end].copy_(q_data)
            if row_scales is not None and q_row_scales is not None:
                row_scales[start:end].copy_(q_row_scales)
            if report is not None:
                report(name, end, rows)
    logger.debug("quantized table %s (%d rows, %s) in %.2fs", name, rows, data_type.value, time.monotonic() - started)


def check_finite(name: str, rows: torch.Tensor, first_row: int) -> None:
    """Raise ``WeightsError`` naming the table and row if ``rows`` (table rows from ``first_row`` on) hold a NaN or
    an infinite value."""
    if not torch.isfinite(rows).all():
        bad = first_row + int(torch.nonzero(~torch.isfinite(rows).all(dim=1))[0])
        raise WeightsError(f"table {name!r}: row {bad} holds a NaN or infinite value; fix the checkpoint")


def _check_finite_rows(name: str, rows: torch.Tensor, row_ids: torch.Tensor) -> None:
    if not torch.isfinite(rows).all():
        bad = int(row_ids[torch.nonzero(~torch.isfinite(rows).all(dim=1))[0]])
        raise WeightsError(f"table {name!r}: row {bad} holds a NaN or infinite value; fix the checkpoint")


def _log_progress(name: str, done: int, total: int) -> None:
    step = max(total // 10, 1)
    if done == total or done // step != (done - CHUNK_ROWS) // step:
        logger.info("quantizing %s: %d/%d rows (%.0f%%)", name, done, total, 100.0 * done / total)


def dequantized_weights(spec: ModelSpec, model: EmbserveModel) -> dict[str, torch.Tensor]:
    """fp32 tables as the quantized model stores them (the exact values the kernel reads)."""
    collection = model.embeddings
    assert isinstance(collection, QuantizedEmbeddingBagCollection)
    out = {}
    targets = collection.table_weights()
    for table, kernel_tables in zip(spec.tables, tbe_tables(spec)):
        types = [b.data_type for b in table.blocks] or [table.data_type]
        parts = []
        for k, data_type in zip(kernel_tables, types):
            data, row_scales = targets[k]
            parts.append(
                dequantize_rows(
                    data.cpu(), None if row_scales is None else row_scales.cpu(), data_type, table.embedding_dim
                )
            )
        ranked = torch.cat(parts) if len(parts) > 1 else parts[0]
        # a block table's row ``id`` is its rank-``remap[id]`` row
        out[table.name] = ranked[collection.block_ranks(table.name)] if table.blocks else ranked
    return out
