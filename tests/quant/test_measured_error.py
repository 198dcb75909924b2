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


def test_a_streaming_source_is_sampled_never_read_whole():
    """Tables larger than RAM: a 50M-row table (12.8 GB as fp32) behind a ``CallableSource`` whose rows are made
    on demand. Measuring reads only ranges around the sampled ids (counted), never the table; the errors equal
    those of the same rows read from memory, and on a small table the source's and the in-memory path agree."""
    from infer.quant.measured_error import COALESCE_ROWS, rows_from_source
    from infer.storage.sources import CallableSource, TensorsSource

    huge = TableConfig("huge", 50_000_000, 64, ("f",))
    small = TableConfig("small", 5_000, 32, ("g",))
    spec = ModelSpec((huge, small))
    small_weight = torch.randn(5_000, 32, generator=torch.Generator().manual_seed(3))
    normal = synthetic_normal_rows(7)
    reads: list[tuple[str, int, int]] = []

    def made(table):
        def rows(start, end):
            reads.append((table.name, start, end))
            assert end - start <= 4096, "a read beyond the sampled rows"
            if table is small:
                return small_weight[start:end]
            return normal(table, torch.arange(start, end))

        return rows

    source = CallableSource(spec, {t.name: made(t) for t in spec.tables})
    measured = measure_errors(spec, rows_from_source(source), bags=64)
    huge_reads = [(s, e) for name, s, e in reads if name == "huge"]
    rows_read = sum(e - s for s, e in huge_reads)
    sampled = measured[0].rows_sampled
    assert sampled <= 64 * 20 and rows_read <= sampled * (COALESCE_ROWS + 1)
    assert rows_read < huge.num_embeddings / 10_000
    # the same rows from memory: the in-memory path reads the synthetic rows directly
    direct = measure_table_error(huge, normal, bags=64)
    assert measured[0].errors == direct.errors
    in_memory = measure_table_error(small, rows_from_weights({"small": small_weight}), bags=64)
    assert measured[1].errors == in_memory.errors
    from_tensors = measure_table_error(small, rows_from_source(TensorsSource({"small": small_weight})), bags=64)
    assert from_tensors.errors == in_memory.errors


def test_export_with_a_memory_budget_measures_from_the_file_by_sampled_rows(tmp_path, capsys):
    """``export --memory-budget`` from a safetensors file: the plan's choice is measured from sampled rows and the
    export streams (each table's data type printed); the artifact's tables are the chosen types."""
    from safetensors.torch import save_file

    from infer.artifact.manifest import Manifest
    from infer.cli import main

    spec = ModelSpec((TableConfig("hot", 3_000, 64, ("fh",)), TableConfig("cold", 60_000, 64, ("fc",))))
    (tmp_path / "spec.json").write_text(spec.to_json())
    generator = torch.Generator().manual_seed(0)
    save_file({t.name: torch.randn(t.num_embeddings, 64, generator=generator) for t in spec.tables},
              str(tmp_path / "w.safetensors"))  # fmt: skip
    args = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "w.safetensors"),
            "--out", str(tmp_path / "art"), "--memory-budget", "3MB"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "synthetic" not in printed and "rows sampled" in printed
    tables = {t.name: t for t in Manifest.read(tmp_path / "art").spec.tables}
    total = sum(
        -(-t.num_embeddings * (64 * t.data_type.bits // 8 + (4 if t.data_type.bits <= 8 else 0)) // 128) * 128
        for t in tables.values()
    )
    assert total <= 3 * 1000**2 and tables["cold"].data_type.bits <= tables["hot"].data_type.bits
