"""Precision blocks without a sample (issue 43): the rows' ranges as the access model (``infer.planner.row_ranges``),
against independent computations, and the planner taking blocks where the rows' magnitudes say they pay (a
TorchRec-like table: most rows at init scale, a few trained large) and not where they do not (iid N(0, 1) rows)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from infer.artifact.load import load
from infer.cli import main
from infer.config import DataType, ModelSpec, RowBlock, TableConfig
from infer.errors import WeightsError
from infer.planner.access import sample_from_ids
from infer.planner.blocks import RANKED_BY_RANGES, RANKED_BY_SAMPLE, block_problem, hot_sizes_of
from infer.planner.precision import plan_precision
from infer.planner.row_ranges import (
    block_orders_from_ranges,
    range_access,
    range_shares,
    rank_by_range,
    row_ranges,
)
from infer.planner.types import ShardingPlan
from infer.quant.measured_error import measure_errors, rows_from_weights
from infer.quant.rowwise import CPU_ROW_ALIGNMENT, dequantize_rows, quantize_rows, table_bytes
from infer.storage.sources import CallableSource, TensorsSource

ROWS, DIM = 2048, 32


def torchrec_like(rows: int, dim: int, seed: int, trained: int = 32) -> torch.Tensor:
    """TorchRec's init U(+-sqrt(1/rows)) with ``rows // trained`` rows trained to N(0, 0.3^2)."""
    generator = torch.Generator().manual_seed(seed)
    table = (2 * torch.rand(rows, dim, generator=generator) - 1) * (1 / rows) ** 0.5
    hot = torch.randperm(rows, generator=generator)[: rows // trained]
    table[hot] = 0.3 * torch.randn(hot.numel(), dim, generator=generator)
    return table


def test_range_shares_equal_an_independent_sum():
    rng = np.random.default_rng(0)
    ranges = rng.choice([0.0, 0.5, 1.0, 2.0, 3.5], size=300)  # ties and zero rows
    sizes = [1, 2, 7, 150, 299, 300, 1000]
    by_size = sorted((float(r) ** 2 for r in ranges), reverse=True)
    expected = [sum(by_size[:k]) / sum(by_size) for k in sizes]
    np.testing.assert_allclose(range_shares(ranges, sizes), expected, rtol=1e-6)
    assert range_shares(np.zeros(5), [1, 2]).tolist() == [0.0, 0.0]  # constant rows: no error mass to move


def test_rank_by_range_is_largest_first_ties_in_id_order():
    ranges = np.array([1.0, 3.0, 1.0, 3.0, 0.0, 2.0], dtype=np.float32)
    assert rank_by_range(ranges).tolist() == [1, 3, 5, 0, 2, 4]


def test_row_ranges_read_the_table_a_chunk_at_a_time():
    table = torchrec_like(1000, 16, seed=1)
    spec = ModelSpec((TableConfig("t", 1000, 16, ("f",)),))
    reads: list[tuple[int, int]] = []

    def rows(start: int, end: int) -> torch.Tensor:
        reads.append((start, end))
        return table[start:end].to(torch.float16)  # a half-precision checkpoint: ranges are taken in fp32

    ranges = row_ranges(CallableSource(spec, {"t": rows}), spec.tables[0], chunk_bytes=64 * 16 * 4)
    expected = (table.to(torch.float16).float().amax(1) - table.to(torch.float16).float().amin(1)).numpy()
    np.testing.assert_array_equal(ranges, expected)
    assert reads and max(end - start for start, end in reads) == 64
    assert [s for s, _ in reads] == list(range(0, 1000, 64))


def test_a_row_with_a_nan_is_refused_naming_the_table_and_row():
    table = torch.randn(100, 8)
    table[37, 3] = float("nan")
    spec = ModelSpec((TableConfig("clicks", 100, 8, ("f",)),))
    with pytest.raises(WeightsError, match="table 'clicks': row 37 holds a NaN"):
        row_ranges(TensorsSource({"clicks": table}), spec.tables[0], chunk_bytes=8 * 4 * 10)


def _plan(weights: dict[str, torch.Tensor], spec: ModelSpec, budget: int, sample=None):
    measured = measure_errors(spec, rows_from_weights(weights))
    shares = range_access(spec, TensorsSource(weights), sample)
    blocks = partial(block_problem, range_shares=shares)
    return plan_precision(spec, measured, budget, sample=sample, blocks=blocks, frontier_points=0)


def _row_uniform_error(weights: torch.Tensor, table: TableConfig, order: torch.Tensor) -> float:
    """The table dequantized block by block (rows ``order``ed, first block first) against fp32: |dW|_F / |W|_F."""
    restored, start = torch.full_like(weights, float("nan")), 0
    for block in table.blocks or (RowBlock(table.num_embeddings, table.data_type),):
        ids = order[start : start + block.rows]
        data, scale_bias = quantize_rows(weights[ids], block.data_type)
        restored[ids] = dequantize_rows(data, scale_bias, block.data_type, table.embedding_dim)
        start += block.rows
    return float(torch.linalg.norm(restored - weights) / torch.linalg.norm(weights))


def test_iid_normal_rows_keep_whole_tables_where_trained_tables_take_blocks():
    """At budgets where whole tables mix to the same bytes (two at INT8, two at INT4; all at INT4), iid N(0, 1)
    rows (their ranges alike: a hot block holds little more than its share of rows' error) keep whole tables; the
    same shapes trained TorchRec-like are held in blocks at a fraction of the error."""
    spec = ModelSpec(tuple(TableConfig(f"t{i}", ROWS, DIM, (f"f{i}",), pooling="sum") for i in range(4)))
    int8, int4 = (table_bytes(ROWS, DIM, d, CPU_ROW_ALIGNMENT) for d in (DataType.INT8, DataType.INT4))
    generator = torch.Generator().manual_seed(0)
    normal = {t.name: torch.randn(ROWS, DIM, generator=generator) for t in spec.tables}
    trained = {t.name: torchrec_like(ROWS, DIM, seed=i) for i, t in enumerate(spec.tables)}
    for budget in (2 * int8 + 2 * int4, 4 * int4 + 4 * 4 * ROWS):
        assert _plan(normal, spec, budget).block_tables() == {}
        precision = _plan(trained, spec, budget)
        blocked = precision.block_tables()
        assert len(blocked) >= 2, budget  # the MILP may keep a table whole at INT8 to fill the budget
        assert precision.chosen.error < 0.5 * precision.uniform[1].error
        # measured independently: each table dequantized block by block, rows ranked by range in fp64 here
        for table in (t for t in spec.tables if t.name in blocked):
            weights = trained[table.name]
            spread = (weights.amax(1) - weights.amin(1)).double()
            held = table.with_blocks(blocked[table.name])
            error = _row_uniform_error(weights, held, torch.argsort(-spread, stable=True))
            nbytes = sum(table_bytes(b.rows, DIM, b.data_type, CPU_ROW_ALIGNMENT) for b in held.blocks) + 4 * ROWS
            whole = [
                _row_uniform_error(weights, table.with_data_type(d), torch.arange(ROWS))
                for d in (DataType.FP16, DataType.INT8, DataType.INT4, DataType.INT2)
                if table_bytes(ROWS, DIM, d, CPU_ROW_ALIGNMENT) <= nbytes
            ]
            assert whole and error < min(whole), (table.name, budget, error, whole)
        reasons = {row["table"]: row for row in precision.reasons()}
        assert all(reasons[name]["ranking"] == RANKED_BY_RANGES for name in blocked)


def test_a_table_the_sample_does_not_read_is_ranked_by_its_rows():
    """Per table: a sampled table's blocks come from its ids, an unsampled one's from its rows' ranges; export's
    ranking of the range-ranked table is its rows by range (``block_orders_from_ranges``)."""
    spec = ModelSpec(tuple(TableConfig(f"t{i}", ROWS, DIM, (f"f{i}",), pooling="sum") for i in range(2)))
    weights = {t.name: torchrec_like(ROWS, DIM, seed=i) for i, t in enumerate(spec.tables)}
    rng = np.random.default_rng(0)
    sample = sample_from_ids({"f0": rng.permutation(ROWS)[np.minimum(rng.zipf(1.2, 20000) - 1, ROWS - 1)]}, spec)
    shares = range_access(spec, TensorsSource(weights), sample)
    assert set(shares) == {"t1"}
    np.testing.assert_allclose(shares["t1"], range_shares(row_ranges(TensorsSource(weights), spec.tables[1]),
                                                          hot_sizes_of(ROWS)))  # fmt: skip
    problem = block_problem(spec, measure_errors(spec, rows_from_weights(weights)), sample, range_shares=shares)
    assert [t.ranking for t in problem] == [RANKED_BY_SAMPLE, RANKED_BY_RANGES]
    assert any(o.blocks for o in problem[1].options)
    held = ModelSpec(tuple(t.with_blocks(((64, DataType.INT8), (ROWS - 64, DataType.INT2))) for t in spec.tables))
    orders = block_orders_from_ranges(held, TensorsSource(weights), ["t1"])
    assert list(orders) == ["t1"]
    spread = (weights["t1"].amax(1) - weights["t1"].amin(1)).double()
    assert torch.equal(orders["t1"][:64], torch.argsort(-spread, stable=True)[:64])  # the precise block, ranked
    assert sorted(orders["t1"].tolist()) == list(range(ROWS))


def test_plan_with_weights_alone_records_the_ranking_and_export_follows_it(tmp_path, capsys):
    """``embserve plan --memory-budget --weights`` (no ids) prices blocks by the rows' ranges and records it per
    table; ``export --plan`` fills the blocks with the same rows without --sample-ids; with neither ids nor weights
    blocks are not priced, and the output says why."""
    spec = ModelSpec((TableConfig("big", ROWS, DIM, ("fb",), pooling="sum"),))
    (tmp_path / "spec.json").write_text(spec.to_json())
    weights = {"big": torchrec_like(ROWS, DIM, seed=3)}
    torch.save(weights, tmp_path / "w.pt")
    budget = ["--memory-budget", str(int(1.2 * table_bytes(ROWS, DIM, DataType.INT4, CPU_ROW_ALIGNMENT)))]
    plan = ["plan", "--spec", str(tmp_path / "spec.json"), "--world-size", "1", "--compute-device", "cpu", *budget]
    assert main([*plan, "--out", str(tmp_path / "synthetic.json")]) == 0
    assert "precision blocks: not priced (no --sample-ids" in capsys.readouterr().out
    assert main([*plan, "--out", str(tmp_path / "plan.json"), "--weights", str(tmp_path / "w.pt")]) == 0
    printed = capsys.readouterr().out
    assert "access model: 1 table(s) by their rows' ranges" in printed
    assert "blocks, largest rows first (ranked by row ranges" in printed
    (row,) = ShardingPlan.from_json((tmp_path / "plan.json").read_text()).planner["precision"]["tables"]
    assert row["ranking"] == RANKED_BY_RANGES and row["blocks"]

    export = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "w.pt")]
    # ONNX does not serve blocks: with a budget alone (blocks not asked for) the export keeps whole tables
    assert main([*export, "--out", str(tmp_path / "onnx"), *budget, "--onnx"]) == 0
    assert "precision blocks: not priced (the --onnx form" in capsys.readouterr().out
    assert not load(tmp_path / "onnx").spec.table("big").blocks
    assert main([*export, "--out", str(tmp_path / "art"), "--plan", str(tmp_path / "plan.json")]) == 0
    table = load(tmp_path / "art").spec.table("big")
    assert [b.to_dict() for b in table.blocks] == row["blocks"]
    # the served rows, one id a bag, are the rows by range dequantized block by block
    runtime = load(tmp_path / "art")
    served = runtime.module(torch.arange(ROWS), torch.ones(ROWS, dtype=torch.int32))
    spread = (weights["big"].amax(1) - weights["big"].amin(1)).double()
    order, start = torch.argsort(-spread, stable=True), 0
    for block in table.blocks:
        ids = order[start : start + block.rows]
        data, scale_bias = quantize_rows(weights["big"][ids], block.data_type)
        expected = dequantize_rows(data, scale_bias, block.data_type, DIM)
        torch.testing.assert_close(served[ids], expected, rtol=1e-6, atol=1e-7)
        start += block.rows


@pytest.mark.parametrize("ranked", [0, 1, 3, 4, 5, 9, 12])
def test_ranking_only_the_precise_blocks_equals_the_full_ranking_there(ranked):
    ranges = np.array([1.0, 3.0, 1.0, 3.0, 0.0, 2.0, 3.0, 1.0, 0.5, 1.0, 2.0, 0.0], dtype=np.float32)
    full = rank_by_range(ranges)
    part = rank_by_range(ranges, ranked)
    assert sorted(part.tolist()) == list(range(12))
    assert part[:ranked].tolist() == full[:ranked].tolist()
    assert part[ranked:].tolist() == sorted(part[ranked:].tolist())  # the rest (the cold block) in id order


def test_export_with_a_budget_alone_reads_each_tables_ranges_once(tmp_path, monkeypatch, capsys):
    """``embserve export --memory-budget --weights`` (no ids) ranks the block tables it chose by the ranges it read
    to plan them: one pass over each table's rows for ranges, not one for the plan and another for the ranking."""
    import infer.planner.row_ranges as ranges_module

    spec = ModelSpec(
        (
            TableConfig("big", ROWS, DIM, ("fb",), pooling="sum"),
            TableConfig("other", ROWS // 2, DIM, ("fo",), pooling="sum"),
        )
    )
    (tmp_path / "spec.json").write_text(spec.to_json())
    torch.save({"big": torchrec_like(ROWS, DIM, seed=3), "other": torchrec_like(ROWS // 2, DIM, seed=4)},
               tmp_path / "w.pt")  # fmt: skip
    reads: list[str] = []
    original = ranges_module.row_ranges

    def counted(source, table, *args, **kwargs):  # type: ignore[no-untyped-def]
        reads.append(table.name)
        return original(source, table, *args, **kwargs)

    monkeypatch.setattr(ranges_module, "row_ranges", counted)
    budget = int(1.2 * (table_bytes(ROWS, DIM, DataType.INT4, CPU_ROW_ALIGNMENT)
                        + table_bytes(ROWS // 2, DIM, DataType.INT4, CPU_ROW_ALIGNMENT)))  # fmt: skip
    export = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "w.pt")]
    assert main([*export, "--out", str(tmp_path / "art"), "--memory-budget", str(budget)]) == 0
    assert "blocks, largest rows first (ranked by row ranges" in capsys.readouterr().out
    blocked = [t.name for t in load(tmp_path / "art").spec.tables if t.blocks]
    assert blocked  # the test is about a block table's ranking
    assert sorted(reads) == ["big", "other"]
