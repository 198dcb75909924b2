"""Measured error per table and data type: sane on N(0,1) rows, equal to the kernel's, read from a row sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.quant.measured_error import (
    measure_errors,
    measure_table_error,
    rows_from_weights,
    synthetic_normal_rows,
)


def test_int8_error_on_normal_rows_is_near_half_a_percent():
    table = TableConfig("t", 100_000, 128, ("f",))
    measured = measure_table_error(table, synthetic_normal_rows(0))
    assert measured.error(DataType.FP32) == 0.0
    assert measured.error(DataType.FP16) < 1e-3
    assert 0.003 < measured.error(DataType.INT8) < 0.009  # DESIGN.md: ~0.5 % (SUM of 20)
    assert 0.05 < measured.error(DataType.INT4) < 0.15  # ~9 %
    assert 0.3 < measured.error(DataType.INT2) < 0.7  # ~45 %


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2, DataType.FP16])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_measured_error_agrees_with_the_kernel_against_fp32_embedding_bag(data_type, pooling):
    """The reference: the real TBE (infer.quantize) on random bags, against fp32 ``embedding_bag``."""
    import infer

    rows, dim, bags, per_bag = 3000, 64, 512, 20
    spec = ModelSpec((TableConfig("t", rows, dim, ("f",), pooling, data_type),))
    weight = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))
    model = infer.quantize(spec, {"t": weight})
    ids = torch.randint(0, rows, (bags * per_bag,), generator=torch.Generator().manual_seed(2))
    lengths = torch.full((bags,), per_bag, dtype=torch.int64)
    got = model(ids, lengths, None)
    offsets = torch.arange(0, bags * per_bag, per_bag)
    mode = "sum" if pooling == PoolingType.SUM else "mean"
    expected = torch.nn.functional.embedding_bag(ids, weight, offsets, mode=mode)
    kernel_error = float(torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected))
    measured = measure_table_error(spec.tables[0], rows_from_weights({"t": weight}), bags=bags, ids_per_bag=per_bag)
    # two random samples of the same quantity: agree within sampling noise
    assert measured.error(data_type) == pytest.approx(kernel_error, rel=0.2)


def test_a_mapped_checkpoint_is_sampled_never_read_whole(tmp_path):
    rows, dim = 400_000, 32
    spec = ModelSpec((TableConfig("big", rows, dim, ("f",)),))
    torch.save({"big": torch.randn(rows, dim)}, tmp_path / "w.pt")
    weights = torch.load(tmp_path / "w.pt", mmap=True)
    requested = []
    inner = rows_from_weights(weights)

    def counting(table, ids):
        requested.append(ids.numel())
        return inner(table, ids)

    measured = measure_errors(spec, counting, bags=32)
    assert sum(requested) <= 32 * 20 < rows
    assert 0.003 < measured[0].error(DataType.INT8) < 0.01


def test_sample_ids_weigh_the_rows_that_are_read():
    """Hot rows that INT4 stores exactly (integers 0..15) make the table's INT4 error vanish when the sample
    says only they are read; uniform rows see the normal rows' ~9 %."""
    rows, dim = 1000, 32
    weight = torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))
    weight[:10] = torch.arange(dim, dtype=torch.float32).remainder(16)  # every level 0..15, scale 1, bias 0
    table = TableConfig("t", rows, dim, ("f",))
    source = rows_from_weights({"t": weight})
    uniform = measure_table_error(table, source)
    hot = measure_table_error(table, source, sample_ids=np.arange(10))
    assert hot.rows_sampled == 10
    assert hot.error(DataType.INT4) < 1e-6 and uniform.error(DataType.INT4) > 0.05
