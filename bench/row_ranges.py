"""Precision blocks without a sample (issue 43): the row-range access model's cost and what it buys.

Prints one JSON line per case:

- ``range_pass``: one pass over a memory-mapped fp32 table (``infer.planner.row_ranges.row_ranges``, a chunk of
  rows at a time) against the export's own pass over the same rows (``quantize_rows`` to INT4, same chunks), same
  run: ``ratio_to_int4_quantize``.
- ``trained`` / ``iid_normal``: tables at TorchRec's init ``U(+-sqrt(1/rows))`` whose rows a Zipf(1.05) stream of
  training reads moved by ``0.05 sqrt(reads)`` (capped at 1) times N(0, 1), and the same shapes iid N(0, 1):
  the precision planner at uniform INT4's bytes with blocks priced by the rows' ranges, against the whole-table
  choice at the same budget; ``measured_*`` is the planner's objective measured independently: each table's
  row-uniform error (dequantized block by block against fp32, ``|dW|_F / |W|_F``) weighted by its share of reads.

    python bench/row_ranges.py
    python bench/row_ranges.py --rows 2000000 --tables 12
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from functools import partial

import numpy as np
import torch

from infer.config import DataType, ModelSpec, RowBlock, TableConfig
from infer.planner.blocks import block_problem
from infer.planner.precision import plan_precision
from infer.planner.row_ranges import range_access, rank_by_range, row_ranges
from infer.quant.measured_error import measure_errors, rows_from_weights
from infer.quant.rowwise import CPU_ROW_ALIGNMENT, dequantize_rows, quantize_rows, table_bytes
from infer.storage.sources import TensorsSource


def range_pass_case(rows: int, dim: int) -> dict[str, object]:
    spec = ModelSpec((TableConfig("t", rows, dim, ("f",)),))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "t.pt")
        torch.save({"t": torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))}, path)
        table = torch.load(path, mmap=True)["t"]
        source = TensorsSource({"t": table})
        started = time.perf_counter()
        row_ranges(source, spec.tables[0])
        seconds = time.perf_counter() - started
        step = max(1, (64 << 20) // (4 * dim))
        started = time.perf_counter()
        for start in range(0, rows, step):
            quantize_rows(table[start : start + step].to(torch.float32), DataType.INT4)
        baseline = time.perf_counter() - started
    return {
        "case": "range_pass",
        "rows": rows,
        "dim": dim,
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds),
        "int4_quantize_seconds": round(baseline, 3),
        "ratio_to_int4_quantize": round(seconds / baseline, 3),
    }


def trained_tables(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for table in spec.tables:
        rows, dim = table.num_embeddings, table.embedding_dim
        weights = (2 * torch.rand(rows, dim, generator=generator) - 1) * (1 / rows) ** 0.5
        reads = np.bincount(rng.permutation(rows)[np.minimum(rng.zipf(1.05, 20 * rows) - 1, rows - 1)], minlength=rows)
        seen = np.flatnonzero(reads)
        scale = torch.from_numpy(np.minimum(1.0, 0.05 * np.sqrt(reads[seen])).astype(np.float32))[:, None]
        weights[torch.from_numpy(seen)] += scale * torch.randn(seen.size, dim, generator=generator)
        out[table.name] = weights
    return out


def measured_error(
    weights: dict[str, torch.Tensor], spec: ModelSpec, blocks: dict[str, tuple[RowBlock, ...]], share: dict[str, float]
) -> float:
    """The planner's objective measured independently: per table its row-uniform error ``|dW|_F / |W|_F`` (the
    table dequantized block by block, rows by range, against fp32), weighted by the table's share of reads."""
    total = 0.0
    for table in spec.tables:
        w = weights[table.name]
        order = rank_by_range((w.amax(1) - w.amin(1)).numpy()) if table.name in blocks else torch.arange(len(w))
        restored, start = torch.empty_like(w), 0
        for block in blocks.get(table.name) or (RowBlock(table.num_embeddings, table.data_type),):
            ids = order[start : start + block.rows]
            data, scale_bias = quantize_rows(w[ids], block.data_type)
            restored[ids] = dequantize_rows(data, scale_bias, block.data_type, table.embedding_dim)
            start += block.rows
        total += share[table.name] * float(torch.linalg.norm(restored - w) / torch.linalg.norm(w))
    return total


def quality_case(name: str, weights: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, object]:
    budget = sum(table_bytes(t.num_embeddings, t.embedding_dim, DataType.INT4, CPU_ROW_ALIGNMENT) for t in spec.tables)
    measured = measure_errors(spec, rows_from_weights(weights))
    started = time.perf_counter()
    shares = range_access(spec, TensorsSource(weights), None)
    range_seconds = time.perf_counter() - started
    blocked = plan_precision(spec, measured, budget, blocks=partial(block_problem, range_shares=shares),
                             frontier_points=0)  # fmt: skip
    whole = plan_precision(spec, measured, budget, frontier_points=0)
    typed = spec.with_data_types(overrides=blocked.data_types())
    whole_typed = spec.with_data_types(overrides=whole.data_types())
    share = {t.table: t.weight for t in blocked.problem}
    ours = measured_error(weights, typed, blocked.block_tables(), share)
    theirs = measured_error(weights, whole_typed, {}, share)
    return {
        "case": name,
        "tables": len(spec.tables),
        "rows": sum(t.num_embeddings for t in spec.tables),
        "budget_bytes": budget,
        "block_tables": len(blocked.block_tables()),
        "planned_error_blocks": round(blocked.chosen.error, 5),
        "planned_error_whole": round(whole.chosen.error, 5),
        "measured_error_blocks": round(ours, 5),
        "measured_error_whole": round(theirs, 5),
        "ratio_measured_blocks_to_whole": round(ours / theirs, 4),
        "range_pass_seconds": round(range_seconds, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500_000, help="rows of the range-pass table (dim 128)")
    parser.add_argument("--tables", type=int, default=8, help="tables of the quality cases (rows 2k .. 200k, dim 64)")
    args = parser.parse_args()
    print(json.dumps(range_pass_case(args.rows, 128)), flush=True)
    sizes = np.geomspace(2_000, 200_000, args.tables).astype(int)
    spec = ModelSpec(tuple(TableConfig(f"t{i}", int(r), 64, (f"f{i}",)) for i, r in enumerate(sizes)))
    print(json.dumps(quality_case("trained", trained_tables(spec, 0), spec)), flush=True)
    generator = torch.Generator().manual_seed(1)
    normal = {t.name: torch.randn(t.num_embeddings, 64, generator=generator) for t in spec.tables}
    print(json.dumps(quality_case("iid_normal", normal, spec)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
