"""How far the quantized model's pooled outputs are from fp32, per table, on a probe batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from infer.config import DataType, ModelSpec
from infer.features import SparseFeatures
from infer.reference import FloatEmbeddingBagCollection

if TYPE_CHECKING:
    from infer.storage.sources import TableSource


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
    batch: SparseFeatures | Any = None,
) -> list[TableAccuracy]:
    """Per table: relative (Frobenius) and max abs error of pooled outputs vs fp32, on a probe batch (any form
    ``SparseFeatures.of`` takes: a mapping, a TorchRec KeyedJaggedTensor; seeded random ids when absent)."""
    batch = SparseFeatures.of(batch).validate(spec) if batch is not None else SparseFeatures.random(spec)
    reference = FloatEmbeddingBagCollection(spec, weights)
    with torch.no_grad():
        expected = reference(batch)
        got = model(batch.values, batch.lengths, batch.weights).cpu()
    return _compare(spec, expected, got)


def sampled_accuracy_report(
    spec: ModelSpec,
    source: TableSource,
    lookup: Callable[[SparseFeatures], torch.Tensor],
    batch: SparseFeatures | None = None,
) -> list[TableAccuracy]:
    """``accuracy_report`` for tables that were never in memory (a streamed export): the fp32 reference reads
    only the probe batch's rows from ``source`` (a few thousand per table), and ``lookup`` (the exported
    artifact's) answers the same batch from the rows it holds."""
    from infer.quant.measured_error import rows_from_source

    batch = batch if batch is not None else SparseFeatures.random(spec)
    rows_of = rows_from_source(source)
    per_feature = batch.lengths.to(torch.int64).view(len(batch.keys), -1).sum(dim=1).tolist()
    bounds = torch.tensor([0, *per_feature]).cumsum(0).tolist()
    features = {f.name: i for i, f in enumerate(spec.features)}
    # each table's sampled rows, compacted: the reference sees a table of only those rows, its ids renumbered
    values = batch.values.to(torch.int64).clone()
    tables, weights = [], {}
    for table in spec.tables:
        spans = [(bounds[features[f]], bounds[features[f] + 1]) for f in table.feature_names]
        ids = torch.cat([values[start:end] for start, end in spans]).unique()
        rows = rows_of(table, ids) if ids.numel() else torch.zeros(1, table.embedding_dim)
        for start, end in spans:
            values[start:end] = torch.searchsorted(ids, values[start:end])
        # the fp32 reference holds no blocks: only the artifact stores rows in them
        tables.append(replace(table, num_embeddings=max(1, int(ids.numel())), blocks=()))
        weights[table.name] = rows
    sampled = ModelSpec(tuple(tables), spec.num_dense_features)
    with torch.no_grad():
        expected = FloatEmbeddingBagCollection(sampled, weights)(replace(batch, values=values))
        got = lookup(batch).cpu()
    return _compare(spec, expected, got)


def _compare(spec: ModelSpec, expected: torch.Tensor, got: torch.Tensor) -> list[TableAccuracy]:
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
