"""Quantization: fp32 tables -> the TBE's fused rowwise layout, and the quantized model built from them.

INT8/INT4/INT2 rows are ``[fp16 scale][fp16 bias][packed data]`` (scale/bias first, as the TBE reads
them); FP16/FP32 rows are the plain values. Tables are converted in row chunks straight into the
kernel's buffer, so at most one chunk of temporaries exists beside the caller's weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.config import DataType, ModelSpec
from infer.errors import WeightsError
from infer.features import SparseFeatures
from infer.modules import EmbserveModel, QuantizedEmbeddingBagCollection
from infer.reference import FloatEmbeddingBagCollection, check_weights

logger = logging.getLogger(__name__)

SCALE_BIAS_BYTES = 4
CHUNK_ROWS = 1 << 16
# Tables at least this large report progress while they are converted.
PROGRESS_MIN_ROWS = 1 << 20

# progress(table_name, rows_done, rows_total)
ProgressFn = Callable[[str, int, int], None]


def row_data_bytes(dim: int, data_type: DataType) -> int:
    """Bytes of one row's values (without scale/bias or padding)."""
    return dim * data_type.bits // 8


def quantize_rows(weight: torch.Tensor, data_type: DataType) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize ``[rows, dim]`` float rows: returns (data bytes, scale/bias bytes or None)."""
    rows = weight.to(torch.float32).contiguous()
    if data_type == DataType.FP32:
        return rows.view(torch.uint8), None
    if data_type == DataType.FP16:
        return rows.to(torch.float16).view(torch.uint8), None
    from infer.fbgemm_libs import load_fbgemm

    load_fbgemm()
    # fbgemm's output row is [data][fp16 scale][fp16 bias]: the TBE wants scale/bias first.
    fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(rows, data_type.bits)
    return fused[:, :-SCALE_BIAS_BYTES], fused[:, -SCALE_BIAS_BYTES:]


def dequantize_rows(data: torch.Tensor, scale_bias: torch.Tensor | None, data_type: DataType, dim: int) -> torch.Tensor:
    """fp32 values of rows stored in the TBE layout, computed with plain torch ops."""
    if data_type == DataType.FP32:
        return data.contiguous().view(torch.float32)[:, :dim].clone()
    if data_type == DataType.FP16:
        return data.contiguous().view(torch.float16)[:, :dim].to(torch.float32)
    assert scale_bias is not None
    scale_bias = scale_bias.contiguous()
    scale = scale_bias[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    bias = scale_bias[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
    bits = data_type.bits
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    packed = data.to(torch.int32)
    # Element k of a byte sits at bit offset k * bits (lowest bits first).
    parts = [(packed >> (k * bits)) & mask for k in range(per_byte)]
    codes = torch.stack(parts, dim=2).reshape(data.shape[0], -1)[:, :dim]
    return codes.to(torch.float32) * scale + bias


@dataclass(frozen=True)
class TableAccuracy:
    table: str
    data_type: DataType
    relative_error: float
    max_abs_error: float


def quantize(
    spec: ModelSpec,
    weights: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    progress: ProgressFn | None = None,
) -> EmbserveModel:
    """Build the quantized, scriptable model of ``spec`` from fp32 ``weights`` (one tensor per table).

    Each table is stored in its ``data_type``; all tables of the device share one TBE.
    Returns an ``EmbserveModel`` (carrying ``spec.dense_arch`` when present).
    """
    check_weights(spec, weights)
    collection = QuantizedEmbeddingBagCollection(spec, device=device)
    targets = collection.table_weights()
    for table, (data, scale_bias) in zip(spec.tables, targets):
        _fill_table(table.name, weights[table.name], table.data_type, data, scale_bias, progress)
    return EmbserveModel(spec, collection, spec.dense_arch)


def _fill_table(
    name: str,
    weight: torch.Tensor,
    data_type: DataType,
    data: torch.Tensor,
    scale_bias: torch.Tensor | None,
    progress: ProgressFn | None,
) -> None:
    rows = weight.shape[0]
    report = progress if progress is not None else (_log_progress if rows >= PROGRESS_MIN_ROWS else None)
    started = time.monotonic()
    with torch.no_grad():
        for start in range(0, rows, CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, rows)
            chunk = weight[start:end]
            if not torch.isfinite(chunk).all():
                bad = start + int(torch.nonzero(~torch.isfinite(chunk).all(dim=1))[0])
                raise WeightsError(f"table {name!r}: row {bad} holds a NaN or infinite value; fix the checkpoint")
            q_data, q_scale_bias = quantize_rows(chunk, data_type)
            data[start:end].copy_(q_data)
            if scale_bias is not None and q_scale_bias is not None:
                scale_bias[start:end].copy_(q_scale_bias)
            if report is not None:
                report(name, end, rows)
    logger.debug("quantized table %s (%d rows, %s) in %.2fs", name, rows, data_type.value, time.monotonic() - started)


def _log_progress(name: str, done: int, total: int) -> None:
    step = max(total // 10, 1)
    if done == total or done // step != (done - CHUNK_ROWS) // step:
        logger.info("quantizing %s: %d/%d rows (%.0f%%)", name, done, total, 100.0 * done / total)


def dequantized_weights(spec: ModelSpec, model: EmbserveModel) -> dict[str, torch.Tensor]:
    """fp32 tables as the quantized model stores them (the exact values the kernel reads)."""
    collection = model.embeddings
    assert isinstance(collection, QuantizedEmbeddingBagCollection)
    out = {}
    for table, (data, scale_bias) in zip(spec.tables, collection.table_weights()):
        out[table.name] = dequantize_rows(
            data.cpu(), None if scale_bias is None else scale_bias.cpu(), table.data_type, table.embedding_dim
        )
    return out


def probe_batch(spec: ModelSpec, batch_size: int = 256, ids_per_bag: int = 20, seed: int = 0) -> SparseFeatures:
    """Uniform random ids, ``ids_per_bag`` per bag, for every feature of ``spec``."""
    generator = torch.Generator().manual_seed(seed)
    values = []
    for info in spec.features:
        values.append(torch.randint(0, info.num_embeddings, (batch_size * ids_per_bag,), generator=generator))
    lengths = torch.full((len(spec.features) * batch_size,), ids_per_bag, dtype=torch.int32)
    return SparseFeatures(spec.feature_names, torch.cat(values), lengths)


def accuracy_report(
    spec: ModelSpec,
    weights: Mapping[str, torch.Tensor],
    model: torch.nn.Module,
    batch: SparseFeatures | None = None,
) -> list[TableAccuracy]:
    """Per table: relative (Frobenius) and max abs error of pooled outputs vs fp32, on a probe batch."""
    batch = batch if batch is not None else probe_batch(spec)
    reference = FloatEmbeddingBagCollection(spec, weights)
    with torch.no_grad():
        expected = reference(batch)
        got = model(batch.values, batch.lengths, batch.weights).cpu()
    report = []
    for table in spec.tables:
        cols = [torch.arange(f.column_start, f.column_end) for f in spec.features if f.table == table.name]
        index = torch.cat(cols)
        exp, out = expected[:, index], got[:, index]
        norm = float(torch.linalg.vector_norm(exp))
        diff = out - exp
        rel = float(torch.linalg.vector_norm(diff)) / norm if norm > 0 else 0.0
        report.append(TableAccuracy(table.name, table.data_type, rel, float(diff.abs().max()) if diff.numel() else 0.0))
    return report


def format_accuracy(report: list[TableAccuracy]) -> str:
    lines = [f"{'table':<20} {'dtype':<6} {'rel. error vs fp32':>18} {'max abs error':>14}"]
    for row in report:
        lines.append(
            f"{row.table:<20} {row.data_type.value:<6} {100 * row.relative_error:>17.3f}% {row.max_abs_error:>14.5f}"
        )
    return "\n".join(lines)


def load_checkpoint(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Load ``{table_name: fp32 tensor}`` safely (``weights_only``, memory-mapped) and check it."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights checkpoint {str(path)!r} does not exist")
    try:
        try:
            data = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError:
            # Legacy (non-zip) checkpoints cannot be memory-mapped.
            data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - torch raises many types for a bad file
        raise WeightsError(f"cannot load weights checkpoint {str(path)!r}: {err}") from None
    if not isinstance(data, Mapping):
        raise WeightsError(f"{str(path)!r} holds a {type(data).__name__}; expected a dict of table name -> tensor")
    weights = dict(data)
    check_weights(spec, weights)
    return weights
