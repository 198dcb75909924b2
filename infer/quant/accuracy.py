"""How far the quantized model's pooled outputs are from fp32, per table, on a probe batch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from infer.config import DataType, ModelSpec
from infer.features import SparseFeatures
from infer.reference import FloatEmbeddingBagCollection


@dataclass(frozen=True)
class TableAccuracy:
    table: str
    data_type: DataType
    relative_error: float
    max_abs_error: float


def accuracy_report(
    spec: ModelSpec,
    weights: Mapping[str, torch.Tensor],
    model: torch.nn.Module,
    batch: SparseFeatures | None = None,
) -> list[TableAccuracy]:
    """Per table: relative (Frobenius) and max abs error of pooled outputs vs fp32, on a probe batch."""
    batch = batch if batch is not None else SparseFeatures.random(spec)
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
