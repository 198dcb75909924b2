"""Measured error in the model's own terms: per table and data type, the change in the dense part's output, in
log loss or in AUC on an evaluation sample with labels, one table quantized at a time (the others fp32).

The evaluation file (``--eval FILE``) is a ``torch.save`` of a dict::

    {"features": {feature: {"ids": int64 [n_ids], "lengths": int64 [N]}, ...},   # every feature of the spec
     "dense": float32 [N, num_dense_features],
     "labels": float32 [N]}                                                          # 0 or 1

The dense part's output is a logit. Only the rows the sample reads are taken from the table source.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infer.config import DataType, ModelSpec, PoolingType, TableConfig, stores_dim
from infer.errors import ConfigError, FileFormatError
from infer.quant.measured_error import MEASURED_DATA_TYPES, RowSource, TableError
from infer.quant.rowwise import dequantize_rows, quantize_rows

logger = logging.getLogger(__name__)

# what the MILP minimises with an evaluation sample (``--error-measure``); "pooled" is measured_error's
EVAL_MEASURES = ("output", "logloss", "auc")


@dataclass(frozen=True)
class EvalSample:
    """Examples with labels: per feature ids and lengths, dense features, labels (see the module docstring)."""

    features: Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # feature -> (ids int64, lengths int64 [N])
    dense: torch.Tensor  # float32 [N, num_dense_features]
    labels: torch.Tensor  # float32 [N], 0 or 1

    @property
    def size(self) -> int:
        return int(self.labels.numel())


def load_eval_sample(path: str | Path, spec: ModelSpec) -> EvalSample:
    """Read and check an evaluation file against ``spec``: every feature, shapes, id ranges, labels."""
    where = str(path)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise FileFormatError(f"evaluation file {where!r} is not a readable torch.save file: {err}") from None
    if not isinstance(raw, Mapping) or not {"features", "dense", "labels"} <= set(raw):
        raise FileFormatError(
            f"evaluation file {where!r} must hold a dict with 'features', 'dense' and 'labels' (docs/planning.md)"
        )
    return check_eval_sample(spec, raw["features"], raw["dense"], raw["labels"], where)


def check_eval_sample(spec: ModelSpec, features: object, dense: object, labels: object, where: str) -> EvalSample:
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.numel() == 0:
        raise FileFormatError(f"{where}: 'labels' must be a non-empty 1-D tensor of 0/1, one per example")
    count = int(labels.numel())
    labels = labels.to(torch.float32)
    if not bool(((labels == 0) | (labels == 1)).all()) or labels.min() == labels.max():
        raise FileFormatError(f"{where}: 'labels' must be 0 or 1, with both present (AUC needs both)")
    if spec.dense_arch is None:
        raise ConfigError("an evaluation sample measures the model's output: the spec has no dense part; pass "
                          "--dense-arch (or import a TorchRec DLRM), or plan without --eval")  # fmt: skip
    width = spec.num_dense_features
    if not isinstance(dense, torch.Tensor) or tuple(dense.shape) != (count, width) or not dense.is_floating_point():
        shape = list(dense.shape) if isinstance(dense, torch.Tensor) else type(dense).__name__
        raise FileFormatError(f"{where}: 'dense' must be a float tensor [{count}, {width}], got {shape}")
    if not bool(torch.isfinite(dense).all()):
        raise FileFormatError(f"{where}: 'dense' holds a NaN or infinite value")
    if not isinstance(features, Mapping):
        raise FileFormatError(f"{where}: 'features' must map each feature name to {{'ids', 'lengths'}}")
    checked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for table in spec.tables:
        for feature in table.feature_names:
            checked[feature] = _check_feature(features, feature, table, count, where)
    return EvalSample(checked, dense.to(torch.float32), labels)


def _check_feature(
    features: Mapping[object, object], feature: str, table: TableConfig, count: int, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    entry = features.get(feature)
    if not isinstance(entry, Mapping) or "ids" not in entry or "lengths" not in entry:
        raise FileFormatError(f"{where}: feature {feature!r} is missing or lacks 'ids' and 'lengths'; add it")
    ids, lengths = entry["ids"], entry["lengths"]
    integer = (torch.int32, torch.int64)
    if not isinstance(lengths, torch.Tensor) or lengths.dtype not in integer or tuple(lengths.shape) != (count,):
        raise FileFormatError(f"{where}: feature {feature!r}: 'lengths' must be int [{count}], one per example")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in integer or ids.dim() != 1:
        raise FileFormatError(f"{where}: feature {feature!r}: 'ids' must be a 1-D int tensor")
    if bool((lengths < 0).any()) or int(lengths.sum()) != ids.numel():
        raise FileFormatError(
            f"{where}: feature {feature!r}: 'lengths' must be >= 0 and sum to the {ids.numel()} ids, got "
            f"{int(lengths.sum())}"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.num_embeddings):
        raise FileFormatError(
            f"{where}: feature {feature!r}: ids must be in [0, {table.num_embeddings}) (table {table.name!r}), got "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    return ids.to(torch.int64), lengths.to(torch.int64)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by ranks (Mann-Whitney U), ties averaged."""
    order = np.argsort(scores.numpy(), kind="mergesort")
    sorted_scores = scores.numpy()[order]
    ranks = np.empty(order.size, dtype=np.float64)
    ranks[order] = np.arange(1, order.size + 1)
    # average the ranks of tied scores
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    for start, size in zip(first[counts > 1], counts[counts > 1]):
        ranks[order[start : start + size]] = start + (size + 1) / 2
    positive = labels.numpy() == 1
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))


def model_scores(
    spec: ModelSpec, sample: EvalSample, tables: Mapping[str, torch.Tensor], ids: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The dense part's logits on ``sample`` with each table's rows ``tables[name]`` (the rows ``ids[name]``)."""
    assert spec.dense_arch is not None
    pooled = []
    for table in spec.tables:
        rows = tables[table.name]
        for feature in table.feature_names:
            values, lengths = sample.features[feature]
            local = torch.searchsorted(ids[table.name], values)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
            mode = "mean" if table.pooling == PoolingType.MEAN else "sum"
            pooled.append(torch.nn.functional.embedding_bag(local, rows, offsets, mode=mode))
    with torch.no_grad():
        return spec.dense_arch(sample.dense, torch.cat(pooled, 1)).reshape(-1).to(torch.float32)


def measure_eval_errors(
    spec: ModelSpec,
    source: RowSource,
    sample: EvalSample,
    measure: str = "logloss",
    data_types: Sequence[DataType] = MEASURED_DATA_TYPES,
) -> tuple[TableError, ...]:
    """Per table and type the model's loss in ``measure`` on ``sample`` with that table alone quantized:
    ``output`` the RMS change of the logits over their RMS, ``logloss`` the rise in log loss, ``auc`` the fall in
    AUC (a change for the better on the sample counts as 0: it is noise, not a reason to choose a type)."""
    if measure not in EVAL_MEASURES:
        raise ConfigError(f"error measure {measure!r} is not one of {list(EVAL_MEASURES)}")
    started = time.monotonic()
    ids: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for table in spec.tables:
        read = torch.cat([sample.features[f][0] for f in table.feature_names])
        ids[table.name] = torch.unique(read) if read.numel() else torch.zeros(1, dtype=torch.int64)
        exact[table.name] = source(table, ids[table.name]).to(torch.float32)
    baseline = model_scores(spec, sample, exact, ids)
    reference = _score(measure, baseline, baseline, sample.labels)
    measured = []
    for table in spec.tables:
        errors = []
        for data_type in data_types:
            if not stores_dim(data_type, table.embedding_dim):
                continue  # not a type this table can take (the planner offers only the types measured)
            data, scale_bias = quantize_rows(exact[table.name], data_type)
            restored = dequantize_rows(data, scale_bias, data_type, table.embedding_dim)
            scores = model_scores(spec, sample, {**exact, table.name: restored}, ids)
            errors.append((data_type, max(0.0, _score(measure, scores, baseline, sample.labels) - reference)))
        measured.append(TableError(table.name, tuple(errors), int(ids[table.name].numel()), sample.size))
    logger.info("measured %s of %d tables x %d types on %d examples in %.2fs", measure, len(spec.tables),
                len(data_types), sample.size, time.monotonic() - started)  # fmt: skip
    return tuple(measured)


def _score(measure: str, scores: torch.Tensor, baseline: torch.Tensor, labels: torch.Tensor) -> float:
    """Larger is worse: the measure of ``scores`` (against the fp32 ``baseline`` for ``output``)."""
    if measure == "output":
        norm = float(torch.linalg.vector_norm(baseline.double()))
        return float(torch.linalg.vector_norm((scores - baseline).double())) / norm if norm > 0 else 0.0
    if measure == "logloss":
        return log_loss(scores, labels)
    return -roc_auc(scores, labels)
