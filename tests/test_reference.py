"""FloatEmbeddingBagCollection against a hand-written loop; check_weights; random_weights."""

from __future__ import annotations

import random
import re

import pytest
import torch

from infer.config import ModelSpec, TableConfig
from infer.errors import EmbserveError, RequestError, WeightsError
from infer.features import SparseFeatures
from infer.reference import FloatEmbeddingBagCollection
from infer.weights import check_weights, random_weights

# (table, rows, dim, pooling, features) -- the reference loop reads this, never spec.features
Layout = list[tuple[str, int, int, str, tuple[str, ...]]]

SUM_LAYOUT: Layout = [("ts", 50, 8, "sum", ("s1", "s2")), ("tb", 1000, 4, "sum", ("b1",))]
MEAN_LAYOUT: Layout = [("tm", 30, 4, "mean", ("m1",)), ("tb", 1000, 12, "mean", ("b1", "b2", "b3"))]
MIXED_LAYOUT: Layout = [
    ("ts", 50, 8, "sum", ("s1", "s2")),
    ("tm", 30, 4, "mean", ("m1",)),
    ("tb", 1000, 12, "mean", ("b1", "b2")),
    ("tx", 7, 16, "sum", ("x1",)),
]


def make_spec(layout: Layout) -> ModelSpec:
    return ModelSpec(
        tuple(TableConfig(name, rows, dim, feats, pooling=pool) for name, rows, dim, pool, feats in layout)
    )


def make_weights(layout: Layout, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(rows, dim, generator=gen) for name, rows, dim, _, _ in layout}


def make_bags(layout: Layout, batch: int, seed: int = 2, max_len: int = 6):
    rng = random.Random(seed)
    bags: dict[str, list[list[int]]] = {}
    per_id: dict[str, list[list[float]]] = {}
    for _, rows, _, _, feats in layout:
        for feat in feats:
            lens = [rng.randint(0, max_len) for _ in range(batch)]
            lens[rng.randrange(batch)] = 0  # every feature has an empty bag
            bags[feat] = [[rng.randrange(rows) for _ in range(n)] for n in lens]
            per_id[feat] = [[rng.uniform(-2.0, 2.0) for _ in bag] for bag in bags[feat]]
    return bags, per_id


def reference_pool(layout: Layout, weights, bags, per_id=None) -> torch.Tensor:
    """Python loops over bags, one row at a time; weighted MEAN is sum(w_i * row_i) / bag length."""
    batch = len(next(iter(bags.values())))
    total = sum(dim * len(feats) for _, _, dim, _, feats in layout)
    out = torch.zeros(batch, total, dtype=torch.float64)
    col = 0
    for name, _, dim, pooling, feats in layout:
        table = weights[name].to(torch.float64)
        for feat in feats:
            for b in range(batch):
                acc = torch.zeros(dim, dtype=torch.float64)
                bag = bags[feat][b]
                for j, idx in enumerate(bag):
                    w = per_id[feat][b][j] if per_id is not None else 1.0
                    acc = acc + w * table[idx]
                if pooling == "mean" and len(bag) > 0:
                    acc = acc / len(bag)
                out[b, col : col + dim] = acc
            col += dim
    return out.to(torch.float32)


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- pooling vs the loop


@pytest.mark.parametrize("layout", [SUM_LAYOUT, MEAN_LAYOUT, MIXED_LAYOUT], ids=["sum", "mean", "mixed"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_loop(layout, weighted, seed):
    spec = make_spec(layout)
    weights = make_weights(layout, seed)
    bags, per_id = make_bags(layout, batch=5, seed=seed + 10)
    batch = SparseFeatures.from_dict(bags, weights=per_id if weighted else None)
    out = FloatEmbeddingBagCollection(spec, weights)(batch)
    assert out.shape == (5, spec.output_dim)
    assert out.dtype == torch.float32
    assert_close(out, reference_pool(layout, weights, bags, per_id if weighted else None))


def test_hand_computed_small_case():
    layout: Layout = [("t", 4, 4, "sum", ("a",)), ("u", 3, 4, "mean", ("b",))]
    weights = {
        "t": torch.tensor([[1.0, 2, 3, 4], [10, 20, 30, 40], [100, 200, 300, 400], [0, 0, 0, 1]]),
        "u": torch.tensor([[2.0, 4, 6, 8], [0, 0, 0, 0], [4, 4, 4, 4]]),
    }
    bags = {"a": [[0, 2], [], [3, 3, 1]], "b": [[0, 2], [1], []]}
    out = FloatEmbeddingBagCollection(make_spec(layout), weights)(SparseFeatures.from_dict(bags))
    expected = torch.tensor(
        [
            [101.0, 202, 303, 404, 3, 4, 5, 6],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [10, 20, 30, 42, 0, 0, 0, 0],
        ]
    )
    assert_close(out, expected)


def test_hand_computed_weighted_mean():
    layout: Layout = [("t", 3, 4, "mean", ("a",))]
    weights = {"t": torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]])}
    bags = {"a": [[0, 1, 2, 0], [2]]}
    per_id = {"a": [[2.0, 4.0, 8.0, 2.0], [3.0]]}
    out = FloatEmbeddingBagCollection(make_spec(layout), weights)(SparseFeatures.from_dict(bags, weights=per_id))
    # sum(w_i * row_i) / bag length -- not divided by the sum of the weights
    expected = torch.tensor([[4.0 / 4, 4.0 / 4, 8.0 / 4, 0.0], [0.0, 0.0, 3.0, 0.0]])
    assert_close(out, expected)


@pytest.mark.parametrize("weighted", [False, True])
def test_empty_bags_pool_to_zeros(weighted):
    layout = MIXED_LAYOUT
    spec = make_spec(layout)
    bags = {f: [[], [], []] for f in spec.feature_names}
    per_id = {f: [[], [], []] for f in spec.feature_names} if weighted else None
    out = FloatEmbeddingBagCollection(spec, make_weights(layout))(SparseFeatures.from_dict(bags, weights=per_id))
    assert out.shape == (3, spec.output_dim)
    assert torch.equal(out, torch.zeros(3, spec.output_dim))


def test_some_empty_bags_are_zero_columns():
    layout = MIXED_LAYOUT
    spec = make_spec(layout)
    bags = {f: [[1], []] for f in spec.feature_names}
    weights = make_weights(layout)
    out = FloatEmbeddingBagCollection(spec, weights)(SparseFeatures.from_dict(bags))
    assert torch.equal(out[1], torch.zeros(spec.output_dim))
    assert_close(out, reference_pool(layout, weights, bags))


def test_shared_table_features_read_the_same_rows():
    layout: Layout = [("shared", 20, 8, "sum", ("f1", "f2", "f3"))]
    weights = make_weights(layout)
    bags = {"f1": [[3], [5, 6]], "f2": [[3], []], "f3": [[19, 0], [5]]}
    out = FloatEmbeddingBagCollection(make_spec(layout), weights)(SparseFeatures.from_dict(bags))
    w = weights["shared"]
    assert_close(out[0, 0:8], w[3])
    assert_close(out[0, 8:16], w[3])
    assert_close(out[0, 16:24], w[19] + w[0])
    assert_close(out[1, 0:8], w[5] + w[6])
    assert_close(out[1, 8:16], torch.zeros(8))
    assert_close(out[1, 16:24], w[5])


@pytest.mark.parametrize("weighted", [False, True])
def test_feature_order_of_request_does_not_matter(weighted):
    layout = MIXED_LAYOUT
    spec = make_spec(layout)
    weights = make_weights(layout)
    bags, per_id = make_bags(layout, batch=4, seed=7)
    reversed_bags = dict(reversed(list(bags.items())))
    reversed_w = dict(reversed(list(per_id.items()))) if weighted else None
    ebc = FloatEmbeddingBagCollection(spec, weights)
    out = ebc(SparseFeatures.from_dict(reversed_bags, weights=reversed_w))
    assert_close(out, reference_pool(layout, weights, bags, per_id if weighted else None))


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_from_tensors_int32_and_int64(id_dtype):
    layout = SUM_LAYOUT
    weights = make_weights(layout)
    bags, _ = make_bags(layout, batch=3, seed=4)
    keys = ("s1", "s2", "b1")
    values = torch.tensor([i for k in keys for bag in bags[k] for i in bag], dtype=id_dtype)
    lengths = torch.tensor([len(bag) for k in keys for bag in bags[k]], dtype=torch.int32)
    out = FloatEmbeddingBagCollection(make_spec(layout), weights)(SparseFeatures.from_tensors(keys, values, lengths))
    assert_close(out, reference_pool(layout, weights, bags))


def test_forward_validates_request():
    layout = SUM_LAYOUT
    ebc = FloatEmbeddingBagCollection(make_spec(layout), make_weights(layout))
    with pytest.raises(RequestError) as info:
        ebc(SparseFeatures.from_dict({"s1": [[1]], "s2": [[50]], "b1": [[0]]}))
    assert info.value.feature == "s2"


def test_weights_are_copied_as_fp32():
    layout: Layout = [("t", 5, 4, "sum", ("a",))]
    weights = {"t": torch.arange(20, dtype=torch.float64).view(5, 4)}
    ebc = FloatEmbeddingBagCollection(make_spec(layout), weights)
    out = ebc(SparseFeatures.from_dict({"a": [[1, 4]]}))
    assert out.dtype == torch.float32
    assert_close(out, torch.tensor([[20.0, 22, 24, 26]]))


def test_zero_batch_gives_zero_rows():
    layout = MIXED_LAYOUT
    spec = make_spec(layout)
    out = FloatEmbeddingBagCollection(spec, make_weights(layout))(
        SparseFeatures.from_dict({f: [] for f in spec.feature_names})
    )
    assert out.shape == (0, spec.output_dim)


# --------------------------------------------------------------------------- check_weights


def test_check_weights_ok():
    check_weights(make_spec(MIXED_LAYOUT), make_weights(MIXED_LAYOUT))


def test_check_weights_missing_table():
    weights = make_weights(MIXED_LAYOUT)
    del weights["tm"]
    with pytest.raises(WeightsError, match="'tm'"):
        check_weights(make_spec(MIXED_LAYOUT), weights)
    with pytest.raises(WeightsError, match="'tm'"):
        FloatEmbeddingBagCollection(make_spec(MIXED_LAYOUT), weights)


def test_check_weights_unknown_table():
    weights = {**make_weights(SUM_LAYOUT), "stray": torch.zeros(3, 4)}
    with pytest.raises(WeightsError, match="'stray'"):
        check_weights(make_spec(SUM_LAYOUT), weights)


def shape_pattern(rows: int, dim: int) -> str:
    return rf"[\[(]{rows}, {dim}[\])]"


@pytest.mark.parametrize("bad_shape", [(50, 4), (8, 50), (49, 8), (50, 8, 1), (400,)])
def test_check_weights_wrong_shape(bad_shape):
    weights = {**make_weights(SUM_LAYOUT), "ts": torch.zeros(bad_shape)}
    with pytest.raises(WeightsError) as info:
        check_weights(make_spec(SUM_LAYOUT), weights)
    msg = str(info.value)
    assert "'ts'" in msg
    assert re.search(shape_pattern(50, 8), msg), msg
    bad = ", ".join(map(str, bad_shape))
    assert re.search(rf"[\[(]{bad},?[\])]", msg), msg


def test_check_weights_wrong_shape_in_constructor():
    weights = {**make_weights(SUM_LAYOUT), "tb": torch.zeros(1000, 8)}
    with pytest.raises(WeightsError, match="'tb'"):
        FloatEmbeddingBagCollection(make_spec(SUM_LAYOUT), weights)


def test_check_weights_not_a_tensor():
    weights = {**make_weights(SUM_LAYOUT), "ts": [[0.0] * 8] * 50}
    with pytest.raises(WeightsError, match="'ts'"):
        check_weights(make_spec(SUM_LAYOUT), weights)


def test_check_weights_integer_dtype():
    weights = {**make_weights(SUM_LAYOUT), "tb": torch.zeros(1000, 4, dtype=torch.int64)}
    with pytest.raises(WeightsError, match="'tb'"):
        check_weights(make_spec(SUM_LAYOUT), weights)


def test_weights_error_family():
    assert issubclass(WeightsError, EmbserveError)
    with pytest.raises(EmbserveError):
        check_weights(make_spec(SUM_LAYOUT), {})


# --------------------------------------------------------------------------- random_weights


def test_random_weights_shapes():
    spec = make_spec(MIXED_LAYOUT)
    weights = random_weights(spec)
    assert list(weights) == ["ts", "tm", "tb", "tx"]
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        "ts": (50, 8),
        "tm": (30, 4),
        "tb": (1000, 12),
        "tx": (7, 16),
    }
    assert all(v.dtype == torch.float32 for v in weights.values())
    check_weights(spec, weights)


def test_random_weights_deterministic():
    spec = make_spec(MIXED_LAYOUT)
    a = random_weights(spec, seed=3)
    b = random_weights(spec, seed=3)
    c = random_weights(spec, seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a)
    assert all(torch.equal(random_weights(spec)[k], random_weights(spec, seed=0)[k]) for k in a)


def test_random_weights_not_affected_by_global_seed():
    spec = make_spec(SUM_LAYOUT)
    torch.manual_seed(123)
    a = random_weights(spec, seed=5)
    torch.manual_seed(456)
    b = random_weights(spec, seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_random_weights_tables_differ():
    spec = make_spec([("a", 20, 8, "sum", ("f1",)), ("b", 20, 8, "sum", ("f2",))])
    weights = random_weights(spec)
    assert not torch.equal(weights["a"], weights["b"])


@pytest.mark.parametrize("std", [1.0, 0.1, 3.0])
def test_random_weights_std(std):
    spec = make_spec([("big", 1000, 32, "sum", ("f",))])
    w = random_weights(spec, seed=9, std=std)["big"]
    assert abs(float(w.std()) - std) < 0.03 * std
    assert abs(float(w.mean())) < 0.03 * std
