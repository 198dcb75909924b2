"""The precision planner with blocks: two-block options priced right, the exact choice optimal against exhaustive
search over the same options on small instances, cross-validated hot shares, and the chosen spec quantizable."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from infer.config import DataType, ModelSpec, RowBlock, TableConfig
from infer.planner.access import sample_from_ids
from infer.planner.blocks import (
    REMAP_BYTES_PER_ROW,
    apply_blocks,
    block_orders_from_sample,
    block_problem,
    hot_shares,
)
from infer.planner.precision import choose_exact, choose_uniform, precision_problem
from infer.quant.measured_error import MEASURED_DATA_TYPES, TableError
from infer.quant.quantize import quantize
from infer.quant.rowwise import table_bytes
from infer.weights import random_weights

# relative pooled error per type, as measured on N(0,1) rows (order of magnitude; any increasing values do)
ERRORS = {DataType.FP32: 0.0, DataType.FP16: 2e-4, DataType.INT8: 4e-3, DataType.INT4: 7e-2, DataType.INT2: 0.33}


def measured(spec: ModelSpec, scale: float = 1.0) -> list[TableError]:
    return [
        TableError(t.name, tuple((d, ERRORS[d] * (scale + 0.1 * i)) for d in MEASURED_DATA_TYPES), 100, 10)
        for i, t in enumerate(spec.tables)
    ]


def zipf_sample(spec: ModelSpec, count: int, seed: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    ids = {}
    for table in spec.tables:
        ranks = np.minimum(rng.zipf(1.3, count) - 1, table.num_embeddings - 1)
        ids[table.feature_names[0]] = rng.permutation(table.num_embeddings)[ranks]
    return sample_from_ids(ids, spec)


def small_spec(rows=(512, 2048, 96)) -> ModelSpec:  # type: ignore[no-untyped-def]
    return ModelSpec(tuple(TableConfig(f"t{i}", r, 16, (f"f{i}",)) for i, r in enumerate(rows)))


def test_a_block_option_is_priced_from_its_blocks_and_the_hot_share():
    spec = small_spec((1024,))
    sample = zipf_sample(spec, 4000, 0)
    problem = block_problem(spec, measured(spec), sample, prune=False)
    option = next(o for o in problem[0].options if o.blocks and o.blocks[0] == RowBlock(64, DataType.INT8))
    assert option.blocks[1] == RowBlock(960, option.data_type)
    ids = np.asarray(sample.ids["f0"])
    share = hot_shares(ids, 1024, [64])[0]
    assert option.bytes == (
        table_bytes(64, 16, DataType.INT8, 1) + table_bytes(960, 16, option.data_type, 1) + REMAP_BYTES_PER_ROW * 1024
    )
    low, high = ERRORS[DataType.INT8], ERRORS[option.data_type]
    assert option.error == pytest.approx(math.sqrt(share * low**2 + (1 - share) * high**2))


def test_hot_shares_are_estimated_on_reads_the_ranking_did_not_see():
    # every id read once: the ranking half never predicts the other half
    assert hot_shares(np.arange(100), 100, [10, 50]).tolist() == [0.0, 0.0]
    # one id read by every request: all hits
    assert hot_shares(np.full(10, 7), 100, [1]).tolist() == [1.0]
    ids = np.array([3, 3, 3, 3, 5, 5, 1, 2])  # even: 3 3 5 1; odd: 3 3 5 2
    assert hot_shares(ids, 10, [1, 2, 3])[0] == pytest.approx(0.5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rows", [500, 50_000])  # counted per row (a dense sample), and per distinct id (a sparse one)
def test_hot_shares_equal_counting_by_hand(seed, rows):
    rng = np.random.default_rng(seed)
    ids = (np.minimum(rng.zipf(1.2, 3000) - 1, rows - 1) * 7919) % rows
    sizes = [1, 3, 10, 40, 200, 499]
    expected = np.zeros(len(sizes))
    for ranked, held_out in ((ids[0::2], ids[1::2]), (ids[1::2], ids[0::2])):
        counts: dict[int, int] = {}
        for i in ranked.tolist():
            counts[i] = counts.get(i, 0) + 1
        ranking = sorted(counts, key=lambda i: (-counts[i], i))  # most read first, ties in id order
        for j, k in enumerate(sizes):
            hot = set(ranking[:k])
            expected[j] += sum(1 for i in held_out.tolist() if i in hot) / held_out.size / 2
    assert hot_shares(ids, rows, sizes) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_exact_choice_equals_exhaustive_search(seed):
    spec = small_spec((300 + 100 * seed, 1024, 64))
    sample = zipf_sample(spec, 3000, seed)
    problem = block_problem(spec, measured(spec), sample, prune=False, three_blocks=False)
    int4 = choose_uniform(problem, DataType.INT4)
    for budget in (int4.total_bytes, int(int4.total_bytes * 1.3), int(int4.total_bytes * 0.8)):
        best = math.inf
        for picks in itertools.product(*(t.options for t in problem)):
            if sum(o.bytes for o in picks) <= budget:
                best = min(best, sum(t.weight * o.error for t, o in zip(problem, picks)))
        chosen = choose_exact(problem, budget)
        pruned = choose_exact(block_problem(spec, measured(spec), sample, three_blocks=False), budget)
        assert chosen.total_bytes <= budget and pruned.total_bytes <= budget
        assert chosen.error == pytest.approx(best, rel=1e-7, abs=1e-12)
        assert pruned.error == pytest.approx(best, rel=1e-7, abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_exact_choice_with_three_blocks_equals_exhaustive_search(seed):
    spec = small_spec((400 + 100 * seed, 2048))
    sample = zipf_sample(spec, 4000, seed)
    problem = block_problem(spec, measured(spec), sample, three_blocks=True)
    assert any(len(o.blocks) == 3 for t in problem for o in t.options)
    int4 = choose_uniform(problem, DataType.INT4)
    for budget in (int4.total_bytes, int(int4.total_bytes * 1.4), int(int4.total_bytes * 0.8)):
        best = math.inf
        for picks in itertools.product(*(t.options for t in problem)):
            if sum(o.bytes for o in picks) <= budget:
                best = min(best, sum(t.weight * o.error for t, o in zip(problem, picks)))
        chosen = choose_exact(problem, budget)
        assert chosen.total_bytes <= budget
        assert chosen.error == pytest.approx(best, rel=1e-7, abs=1e-12)


def test_hot_shares_rank_rows_read_more_than_a_16_bit_count_holds():
    # row 3 is read 70,000 times in each half, past the radix sort's 16-bit keys (70,000 mod 2^16 would rank it
    # below row 5's 60,000)
    ids = np.repeat([3, 5, 1], [140_000, 120_000, 8])
    half = ids.size // 2
    assert hot_shares(ids, 10, [1, 2, 3]) == pytest.approx([70_000 / half, 130_000 / half, 1.0])


def test_a_three_block_option_is_priced_from_its_blocks_and_the_hot_shares():
    spec = small_spec((2048,))
    sample = zipf_sample(spec, 8000, 0)
    problem = block_problem(spec, measured(spec), sample, three_blocks=True)
    option = next(o for o in problem[0].options if len(o.blocks) == 3)
    (k1, a), (k2, b), (_, c) = ((blk.rows, blk.data_type) for blk in option.blocks)
    assert a.bits > b.bits > c.bits
    assert option.bytes == (
        table_bytes(k1, 16, a, 1) + table_bytes(k2, 16, b, 1) + table_bytes(2048 - k1 - k2, 16, c, 1)
        + REMAP_BYTES_PER_ROW * 2048
    )  # fmt: skip
    h1, h2 = hot_shares(np.asarray(sample.ids["f0"]), 2048, [k1, k1 + k2])
    errors = measured(spec)[0]
    expected = h1 * errors.error(a) ** 2 + (h2 - h1) * errors.error(b) ** 2 + (1 - h2) * errors.error(c) ** 2
    assert option.error == pytest.approx(math.sqrt(expected))


def test_blocks_beat_whole_tables_under_skewed_reads():
    spec = ModelSpec(tuple(TableConfig(f"t{i}", 4096, 128, (f"f{i}",)) for i in range(2)))
    sample = zipf_sample(spec, 20000, 1)
    problem = block_problem(spec, measured(spec), sample)
    budget = int(choose_uniform(problem, DataType.INT4).total_bytes * 1.1)
    chosen = choose_exact(problem, budget)
    whole = choose_exact(precision_problem(spec, measured(spec), sample=sample), budget)
    assert chosen.blocks and any(chosen.blocks)
    assert chosen.error < 0.5 * whole.error


def test_no_sample_no_blocks():
    spec = small_spec()
    problem = block_problem(spec, measured(spec), None)
    assert not any(o.blocks for t in problem for o in t.options)


def test_the_chosen_spec_quantizes_with_the_sample_ranking():
    spec = ModelSpec((TableConfig("t0", 4096, 128, ("f0",)), TableConfig("t1", 64, 16, ("f1",))))
    sample = zipf_sample(spec, 20000, 2)
    problem = block_problem(spec, measured(spec), sample)
    chosen = choose_exact(problem, int(choose_uniform(problem, DataType.INT4).total_bytes * 1.1))
    blocked = apply_blocks(spec, chosen)
    assert blocked.block_tables
    for table, blocks in zip(blocked.tables, chosen.blocks):
        assert table.blocks == blocks
    orders = block_orders_from_sample(blocked, sample)
    model = quantize(blocked, random_weights(blocked, seed=3), block_orders=orders)
    values = torch.tensor([0, 1, 2, 3], dtype=torch.int64)
    assert model(values, torch.tensor([2, 0, 1, 1])).shape == (2, 144)
