"""Tables held in precision blocks: the collection's pooled output equals fp32 ``embedding_bag`` over the table
dequantized block by block (each block's rows through the row codec in its own type), up to fp32 reassociation —
SUM, MEAN, weighted, empty bags, all ids hot, all cold, eager and scripted, split kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.config import DataType, ModelSpec, PoolingType, RowBlock, TableConfig
from infer.errors import ConfigError
from infer.quant.blocks import rank_rows, remap_of
from infer.quant.quantize import dequantized_weights, quantize
from infer.quant.rowwise import dequantize_rows, quantize_rows
from infer.weights import random_weights

ROWS = 200


def block_spec(pooling: PoolingType) -> ModelSpec:
    return ModelSpec(
        (
            TableConfig(
                "blocked",
                ROWS,
                16,
                ("user", "item"),
                pooling=pooling,
                blocks=((12, "int8"), (28, "fp16"), (160, "int4")),
            ),
            TableConfig("plain", 50, 8, ("query",), pooling=pooling, data_type="int4"),
            TableConfig("two", 64, 8, ("page",), pooling=pooling, blocks=((8, "fp32"), (56, "int2"))),
        )
    )


def reference_tables(spec: ModelSpec, weights, orders) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Each table's rows as stored: a block table's ranked rows quantized block by block in the block's type."""
    out = {}
    for table in spec.tables:
        weight = weights[table.name]
        if not table.blocks:
            data, scale_bias = quantize_rows(weight, table.data_type)
            out[table.name] = dequantize_rows(data, scale_bias, table.data_type, table.embedding_dim)
            continue
        stored = torch.empty_like(weight)
        start = 0
        for block in table.blocks:
            ids = orders[table.name][start : start + block.rows]
            data, scale_bias = quantize_rows(weight[ids], block.data_type)
            stored[ids] = dequantize_rows(data, scale_bias, block.data_type, table.embedding_dim)
            start += block.rows
        out[table.name] = stored
    return out


def reference(spec: ModelSpec, tables, values, lengths, weights):  # type: ignore[no-untyped-def]
    """fp32 ``embedding_bag`` per feature (MEAN: the weighted sum over the bag length, an empty bag 0)."""
    features = spec.features
    batch = lengths.numel() // len(features)
    counts = lengths.view(len(features), batch).to(torch.int64)
    ends = counts.sum(1).cumsum(0).tolist()
    columns = []
    start = 0
    for f, info in enumerate(features):
        ids = values[start : ends[f]].to(torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts[f].cumsum(0)[:-1]])
        bag_weights = None if weights is None else weights[start : ends[f]]
        pooled = F.embedding_bag(ids, tables[info.table], offsets, mode="sum", per_sample_weights=bag_weights)
        if info.pooling == PoolingType.MEAN:
            pooled = pooled / counts[f].clamp(min=1).unsqueeze(1).to(torch.float32)
        columns.append(pooled)
        start = ends[f]
    return torch.cat(columns, 1)


def batch_of(spec: ModelSpec, per_feature_ids, lengths_per_feature, weighted: bool, seed: int):  # type: ignore[no-untyped-def]
    values = torch.cat([torch.as_tensor(ids, dtype=torch.int64) for ids in per_feature_ids])
    lengths = torch.cat([torch.as_tensor(n, dtype=torch.int64) for n in lengths_per_feature])
    weights = torch.rand(values.numel(), generator=torch.Generator().manual_seed(seed)) if weighted else None
    return values, lengths, weights


def random_request(spec: ModelSpec, batch: int, pick, seed: int, weighted: bool):  # type: ignore[no-untyped-def]
    """Bag lengths in [0, 6] (every fifth bag empty) and ids from ``pick(table, n, generator)``."""
    generator = torch.Generator().manual_seed(seed)
    ids, lengths = [], []
    for info in spec.features:
        n = torch.randint(0, 7, (batch,), generator=generator)
        n[::5] = 0
        lengths.append(n)
        ids.append(pick(spec.table(info.table), int(n.sum()), generator))
    return batch_of(spec, ids, lengths, weighted, seed)


def hot_ids(orders):  # type: ignore[no-untyped-def]
    def pick(table, n, generator):  # type: ignore[no-untyped-def]
        if not table.blocks:
            return torch.randint(0, table.num_embeddings, (n,), generator=generator)
        hot = orders[table.name][: table.blocks[0].rows]
        return hot[torch.randint(0, hot.numel(), (n,), generator=generator)]

    return pick


def cold_ids(orders):  # type: ignore[no-untyped-def]
    def pick(table, n, generator):  # type: ignore[no-untyped-def]
        if not table.blocks:
            return torch.randint(0, table.num_embeddings, (n,), generator=generator)
        cold = orders[table.name][table.blocks[0].rows :]
        return cold[torch.randint(0, cold.numel(), (n,), generator=generator)]

    return pick


def any_ids(table, n, generator):  # type: ignore[no-untyped-def]
    return torch.randint(0, table.num_embeddings, (n,), generator=generator)


@pytest.fixture(scope="module", params=[PoolingType.SUM, PoolingType.MEAN], ids=["sum", "mean"])
def blocked(request):  # type: ignore[no-untyped-def]
    spec = block_spec(request.param)
    weights = random_weights(spec, seed=7)
    generator = torch.Generator().manual_seed(3)
    # a Zipf-like sample: low ids read most, so the ranking differs from id order only by a shuffle
    shuffle = {t.name: torch.randperm(t.num_embeddings, generator=generator) for t in spec.tables if t.blocks}
    orders = {
        name: rank_rows(rows.numel(), rows[torch.randint(0, 30, (400,), generator=generator)].numpy(), name)
        for name, rows in shuffle.items()
    }
    model = quantize(spec, weights, block_orders=orders)
    return spec, model, reference_tables(spec, weights, orders), orders


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("which", ["any", "all_hot", "all_cold"])
def test_blocks_equal_fp32_embedding_bag(blocked, which, weighted):
    spec, model, tables, orders = blocked
    pick = {"any": any_ids, "all_hot": hot_ids(orders), "all_cold": cold_ids(orders)}[which]
    scripted = torch.jit.script(model)
    for seed, batch in enumerate([1, 7, 40]):
        values, lengths, weights = random_request(spec, batch, pick, seed, weighted)
        expected = reference(spec, tables, values, lengths, weights)
        torch.testing.assert_close(model(values, lengths, weights), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scripted(values, lengths, weights), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            model(values.to(torch.int32), lengths.to(torch.int32), weights), expected, rtol=1e-5, atol=1e-5
        )


def test_empty_bags_and_empty_request(blocked):
    spec, model, tables, _ = blocked
    batch = 3
    zero = torch.zeros(len(spec.features) * batch, dtype=torch.int64)
    assert torch.equal(model(torch.zeros(0, dtype=torch.int64), zero), torch.zeros(batch, spec.output_dim))
    values, lengths, _ = batch_of(
        spec, [[5, 150], [], [3], [63]], [[0, 2, 0], [0, 0, 0], [1, 0, 0], [0, 0, 1]], False, 0
    )
    torch.testing.assert_close(model(values, lengths), reference(spec, tables, values, lengths, None))


def test_split_kernel_equals_the_single_call(blocked):
    spec, model, tables, _ = blocked
    collection = model.embeddings
    values, lengths, weights = random_request(spec, 64, any_ids, 9, True)
    single = model(values, lengths, weights)
    collection.threads, collection.min_ids_per_chunk = 4, 1
    try:
        assert torch.equal(model(values, lengths, weights), single)
    finally:
        collection.threads, collection.min_ids_per_chunk = 1, 4096
    torch.testing.assert_close(single, reference(spec, tables, values, lengths, weights), rtol=1e-5, atol=1e-5)


def test_dequantized_weights_undo_the_remap(blocked):
    spec, model, tables, _ = blocked
    stored = dequantized_weights(spec, model)
    for name, table in tables.items():
        assert torch.equal(stored[name], table), name


def test_bad_ids_are_refused_before_the_remap(blocked):
    spec, model, _, _ = blocked
    values, lengths, _ = batch_of(spec, [[ROWS], [], [0], [0]], [[1], [0], [1], [1]], False, 0)
    with pytest.raises(ValueError, match="user"):
        model(values, lengths)


def test_a_block_table_needs_its_ranking():
    spec = block_spec(PoolingType.SUM)
    weights = random_weights(spec, seed=1)
    with pytest.raises(ConfigError, match="'blocked'.*block_orders"):
        quantize(spec, weights, block_orders={"two": torch.arange(64)})
    twice = torch.arange(ROWS)
    twice[1] = 0
    with pytest.raises(ConfigError, match="'blocked'.*same rank"):
        quantize(spec, weights, block_orders={"blocked": twice, "two": torch.arange(64)})
    with pytest.raises(ConfigError, match="'plain'.*not held in precision blocks"):
        quantize(spec, weights, block_orders={"blocked": torch.arange(ROWS), "two": torch.arange(64), "plain": [0]})


def test_rank_rows_orders_by_count_then_id():
    order = rank_rows(6, [4, 4, 4, 1, 1, 5], "t")
    assert order.tolist() == [4, 1, 5, 0, 2, 3]
    assert remap_of(order).tolist() == [3, 1, 4, 5, 0, 2]
    with pytest.raises(ConfigError, match="'t'.*row 6"):
        rank_rows(6, [6], "t")


def test_block_config_is_checked_and_round_trips():
    table = TableConfig("t", 10, 8, ("f",), blocks=[(3, "int8"), {"rows": 7, "data_type": "int2"}])
    assert table.blocks == (RowBlock(3, DataType.INT8), RowBlock(7, DataType.INT2))
    assert TableConfig.from_dict(table.to_dict()) == table
    assert "blocks" not in TableConfig("u", 10, 4, ("g",)).to_dict()
    with pytest.raises(ConfigError, match="'t'.*hold 9 rows but the table has 10"):
        TableConfig("t", 10, 4, ("f",), blocks=[(3, "int8"), (6, "int4")])
    with pytest.raises(ConfigError, match="'t'.*one block"):
        TableConfig("t", 10, 4, ("f",), blocks=[(10, "int8")])
    with pytest.raises(ConfigError, match="'t'.*blocks\\[1\\] rows"):
        TableConfig("t", 10, 4, ("f",), blocks=[(10, "int8"), (0, "int4")])
    with pytest.raises(ConfigError, match="'t'.*blocks\\[0\\].*unknown data type"):
        TableConfig("t", 10, 4, ("f",), blocks=[(5, "int3"), (5, "int4")])


def test_stored_remap_round_trips_and_malformed_ones_are_named():
    from infer.modules.collection import block_bounds, decode_remap, encode_remap, remap_error

    starts = [0, 3, 7]  # blocks of 3, 4 and 5 rows
    ranks = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    stored = encode_remap(ranks, starts)
    assert stored.dtype == torch.int32
    assert torch.equal(decode_remap(stored, starts), ranks)
    # positions, cold block first: cold ids (ranks 7..11) at 0..4 in rank order, then block 0's ranks, block 1's
    assert torch.equal(stored.to(torch.int64), torch.tensor([(r - 7) % 12 for r in ranks.tolist()]))
    assert block_bounds(12, starts, 3) == [0, 5, 8, 12]
    assert block_bounds(12, starts, 4) == [0, 5, 8, 12, 12]  # an empty level past the table's blocks
    assert block_bounds(12, [0], 3) == [0, 12, 12, 12]  # a table without blocks: all cold
    assert remap_error(stored, 12, starts) is None
    twice = stored.clone()
    twice[0] = stored[1]
    assert remap_error(twice, 12, starts) == "gives two ids the same rank"
    outside = stored.clone()
    outside[0] = 12
    assert remap_error(outside, 12, starts) == "names a row outside the table's blocks"
    outside[0] = -2  # the form before positions (a precise id's value was negative)
    assert remap_error(outside, 12, starts) == "names a row outside the table's blocks"


def test_int32_ids_equal_int64_ids(blocked):  # type: ignore[no-untyped-def]
    spec, model, _, _ = blocked
    values, lengths, weights = random_request(spec, 9, any_ids, 3, True)
    assert torch.equal(model(values.to(torch.int32), lengths.to(torch.int32), weights), model(values, lengths, weights))


@pytest.mark.parametrize("hot", [20, 50], ids=["hot_smaller_than_cold", "hot_larger_than_cold"])
def test_two_levels_equal_fp32_embedding_bag(hot):  # type: ignore[no-untyped-def]
    """Two blocks per table (one level past the cold one): the split takes the op's fixed-size buckets when every
    precise block fits in its cold block's rows, its searched bounds otherwise; both equal the reference."""
    spec = ModelSpec(
        (
            TableConfig("a", 64, 8, ("x", "y"), pooling=PoolingType.SUM, blocks=((hot, "int8"), (64 - hot, "int4"))),
            TableConfig("b", 30, 8, ("z",), pooling=PoolingType.MEAN, blocks=((10, "fp16"), (20, "int2"))),
            TableConfig("plain", 40, 8, ("w",), pooling=PoolingType.SUM, data_type="int8"),
        )
    )
    weights = random_weights(spec, seed=11)
    generator = torch.Generator().manual_seed(5)
    orders = {t.name: torch.randperm(t.num_embeddings, generator=generator) for t in spec.tables if t.blocks}
    model = quantize(spec, weights, block_orders=orders)
    orders = {t.name: model.embeddings.block_ranks(t.name).argsort() for t in spec.tables if t.blocks}
    assert model.embeddings.block_fixed_sizes == (hot <= 64 - hot)
    tables = reference_tables(spec, weights, orders)
    for weighted in (False, True):
        values, lengths, weights_in = random_request(spec, 7, any_ids, 9, weighted)
        expected = reference(spec, tables, values, lengths, weights_in)
        torch.testing.assert_close(model(values, lengths, weights_in), expected, rtol=1e-6, atol=1e-5)
        scripted = torch.jit.script(model)
        torch.testing.assert_close(scripted(values, lengths, weights_in), expected, rtol=1e-6, atol=1e-5)
