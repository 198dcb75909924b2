"""The call contract's cases, shared by the acceptance tests of every backend and protocol.

Every documented dtype combination of values, lengths and weights (weights also left out), the undocumented
dtypes each entry point must refuse with the fragment its error carries (written by hand from the rules'
wording in ``infer/request_rules.py``), and the independent reference: ``F.embedding_bag`` on the tables as
the quantized model stores them (``FloatEmbeddingBagCollection``), and the dense part applied to that.

The model: ``contract_spec()`` (a SUM table read by two features, a MEAN FP16 table) with a DLRM-like dense
part returning ``[B, 1]`` (``ColumnScores``): ``predict`` must return ``[B]`` anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.features import SparseFeatures
from infer.quant.quantize import dequantized_weights
from infer.reference import FloatEmbeddingBagCollection
from tests.conftest import random_batch

NUM_DENSE = 3
BATCH = 6


class ColumnScores(torch.nn.Module):
    """A DLRM-like dense part: one logit per example as a column, ``[B, 1]`` (TorchRec's DLRM returns that)."""

    def __init__(self, num_dense: int, pooled_dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(num_dense + pooled_dim, 1)

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense_features, pooled], dim=1))


def contract_tables() -> tuple[TableConfig, ...]:
    return (
        TableConfig("t_sum", 50, 8, ("f_sum", "f_shared")),
        TableConfig("t_mean", 30, 16, ("f_mean",), PoolingType.MEAN, DataType.FP16),
    )


def contract_spec(dense_arch: torch.nn.Module | None = None) -> ModelSpec:
    """The contract's model; ``dense_arch`` defaults to a seeded ``ColumnScores``."""
    spec = ModelSpec(contract_tables())
    if dense_arch is None:
        torch.manual_seed(11)
        dense_arch = ColumnScores(NUM_DENSE, spec.output_dim)
    return spec.with_dense_arch(dense_arch, NUM_DENSE)


@dataclass(frozen=True)
class Combo:
    """One documented dtype combination of a request."""

    values: torch.dtype
    lengths: torch.dtype
    weighted: bool

    def __repr__(self) -> str:  # pytest ids
        names = {torch.int64: "int64", torch.int32: "int32"}
        weights = "fp32_weights" if self.weighted else "no_weights"
        return f"values_{names[self.values]}-lengths_{names[self.lengths]}-{weights}"


DOCUMENTED: tuple[Combo, ...] = tuple(
    Combo(values, lengths, weighted)
    for values in (torch.int64, torch.int32)
    for lengths in (torch.int32, torch.int64)
    for weighted in (True, False)
)


def batch_of(spec: ModelSpec, combo: Combo, seed: int = 3) -> SparseFeatures:
    """A random batch (empty bags included) in ``combo``'s dtypes."""
    base = random_batch(spec, BATCH, max_len=5, weighted=combo.weighted, seed=seed)
    return SparseFeatures(
        spec.feature_names, base.values.to(combo.values), base.lengths.to(combo.lengths), base.weights
    )


def dense_of(seed: int = 4) -> torch.Tensor:
    return torch.randn(BATCH, NUM_DENSE, generator=torch.Generator().manual_seed(seed))


class Reference:
    """fp32 ``F.embedding_bag`` on the quantized model's own (dequantized) tables, and the dense part on that."""

    def __init__(self, spec: ModelSpec, model: torch.nn.Module) -> None:
        self.spec = spec
        self.pool = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, model))

    def pooled(self, batch: SparseFeatures) -> torch.Tensor:
        # the reference sees int64 ids and lengths whatever the request's dtypes: it never shares the cast
        canonical = SparseFeatures(
            batch.keys, batch.values.to(torch.int64), batch.lengths.to(torch.int64), batch.weights
        )
        return self.pool(canonical)

    def scores(self, batch: SparseFeatures, dense: torch.Tensor) -> torch.Tensor:
        assert self.spec.dense_arch is not None
        with torch.no_grad():
            column = self.spec.dense_arch(dense, self.pooled(batch))
        return column[:, 0]  # the one score of each example, by hand


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Same shape and dtype, values within fp32 summation noise of the output's magnitude."""
    assert got.dtype == torch.float32 and tuple(got.shape) == tuple(expected.shape), (got.dtype, got.shape)
    scale = max(float(expected.abs().max()), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(got, expected.to(torch.float32), rtol=0, atol=1e-5 * scale)


@dataclass(frozen=True)
class Refused:
    """An undocumented dtype for one tensor and the fragment every entry point's error carries."""

    tensor: str
    dtype: torch.dtype
    fragment: str

    def __repr__(self) -> str:
        return f"{self.tensor}_{str(self.dtype).removeprefix('torch.')}"


REFUSED: tuple[Refused, ...] = (
    Refused("values", torch.float32, "values must be a 1-D int64 or int32 tensor of ids, got float32"),
    Refused("values", torch.int16, "values must be a 1-D int64 or int32 tensor of ids, got int16"),
    Refused("values", torch.uint8, "values must be a 1-D int64 or int32 tensor of ids, got uint8"),
    Refused("lengths", torch.int16, "lengths must be a 1-D int32 (or int64) tensor, got int16"),
    Refused("lengths", torch.float32, "lengths must be a 1-D int32 (or int64) tensor, got float32"),
    Refused("weights", torch.float64, "weights must be a 1-D float32 tensor with one weight per id, got float64"),
    Refused("weights", torch.float16, "weights must be a 1-D float32 tensor with one weight per id, got float16"),
    Refused("dense_features", torch.int64, "dense_features must be float32 [batch, num_dense_features], got int64"),
    Refused("dense_features", torch.float64, "dense_features must be float32 [batch, num_dense_features], got float64"),
)


def refused_call(spec: ModelSpec, case: Refused) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense, values, lengths, weights) of a valid weighted request with ``case.tensor`` in ``case.dtype``."""
    batch = batch_of(spec, Combo(torch.int64, torch.int32, True))
    tensors = {"dense_features": dense_of(), "values": batch.values, "lengths": batch.lengths, "weights": batch.weights}
    tensors[case.tensor] = tensors[case.tensor].to(case.dtype)
    return tensors["dense_features"], tensors["values"], tensors["lengths"], tensors["weights"]
