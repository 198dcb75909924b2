"""The GPU's request check (``lookup_on_device``: one flag on the device, read after the kernel is queued), run here
on CPU tensors so every machine checks it: the same rows as the checked path for good requests, the same refusal
for bad ones."""

from __future__ import annotations

import pytest
import torch

from infer.config import DataType, PoolingType
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import mixed_spec, random_batch, small_spec


@pytest.fixture(scope="module")
def model():
    spec = mixed_spec()
    return spec, quantize(spec, random_weights(spec, seed=4))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_good_requests_answer_as_the_checked_path(model, weighted, id_dtype):
    spec, quantized = model
    for seed, size in ((0, 1), (1, 7), (2, 33)):
        batch = random_batch(spec, size, weighted=weighted, seed=seed, id_dtype=id_dtype)
        with torch.no_grad():
            expected = quantized(batch.values, batch.lengths, batch.weights)
            got = quantized.embeddings.lookup_on_device(batch.values, batch.lengths, batch.weights)
        assert torch.equal(got, expected)


def test_empty_and_all_empty_bags(model):
    spec, quantized = model
    f = len(spec.features)
    for values, lengths in (
        (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)),
        (torch.zeros(0, dtype=torch.int64), torch.zeros(3 * f, dtype=torch.int32)),
    ):
        got = quantized.embeddings(values, lengths, None)
        assert got.shape == (lengths.numel() // f, spec.output_dim) and not got.any()


BAD = {
    "negative_length": lambda v, n: n.__setitem__(3, -1),
    "negative_and_compensated": lambda v, n: (n.__setitem__(3, -2), n.__setitem__(4, n[4] + 2)),
    "length_past_ids": lambda v, n: n.__setitem__(2, v.numel() + 5),
    "lengths_short": lambda v, n: n.__setitem__(1, n[1] + 1),
    "lengths_long": lambda v, n: n.__setitem__(int(torch.nonzero(n)[0]), 0),
    "id_negative": lambda v, n: v.__setitem__(-1, -3),
    "id_past_its_table": lambda v, n: v.__setitem__(0, 1000),
    "id_within_another_table": lambda v, n: v.__setitem__(-1, 250),  # the last feature's table has 200 rows
    "id_huge": lambda v, n: v.__setitem__(5, 2**40),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_requests_are_refused_in_the_checked_paths_words(model, case):
    spec, quantized = model
    batch = random_batch(spec, 8, max_len=3)
    values, lengths = batch.values.clone(), batch.lengths.clone()
    BAD[case](values, lengths)
    with pytest.raises(ValueError) as checked:
        quantized.embeddings.validate(values, lengths, None)
    with pytest.raises(ValueError) as on_device:
        quantized.embeddings.lookup_on_device(values.clone(), lengths.clone(), None)
    assert str(on_device.value) == str(checked.value)


def test_weights_count_and_uneven_batch_are_refused_before_the_device(model):
    spec, quantized = model
    batch = random_batch(spec, 4, weighted=True)
    with pytest.raises(ValueError, match="weights"):
        quantized.embeddings.lookup_on_device(batch.values, batch.lengths, batch.weights[:-1])
    with pytest.raises(ValueError, match="features"):
        quantized.embeddings.lookup_on_device(batch.values, batch.lengths[:-1], None)


def test_block_models_keep_the_checked_path():
    """A precision-block table gathers its id remap by id before the kernel: it never defers its checks."""
    from infer.config import ModelSpec, RowBlock, TableConfig

    spec = ModelSpec(
        (
            TableConfig(
                "t",
                100,
                16,
                ("f",),
                PoolingType.SUM,
                DataType.INT4,
                blocks=(RowBlock(10, DataType.INT8), RowBlock(90, DataType.INT4)),
            ),
        )
    )
    quantized = quantize(spec, random_weights(spec), block_orders={"t": torch.randperm(100)})
    assert not quantized.embeddings.defers_device_checks
    assert quantize(small_spec(), random_weights(small_spec())).embeddings.defers_device_checks
