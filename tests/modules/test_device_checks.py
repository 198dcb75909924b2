"""The GPU's request check (``passes_on_device``: three reductions read back at once, then the checks one by one only
when the summary fails), run here on CPU tensors so every machine checks its logic: true for good requests, false
for every bad one (which ``validate`` then refuses in its own words)."""

from __future__ import annotations

import pytest
import torch

from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import mixed_spec, random_batch


@pytest.fixture(scope="module")
def model():
    spec = mixed_spec()
    return spec, quantize(spec, random_weights(spec, seed=4))


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_good_requests_pass_the_summary(model, id_dtype):
    spec, quantized = model
    for seed, size in ((0, 1), (1, 7), (2, 33)):
        batch = random_batch(spec, size, seed=seed, id_dtype=id_dtype)
        values = batch.values % quantized.embeddings.min_rows  # within every table: the summary's one bound
        quantized.embeddings.validate(values, batch.lengths, None)
        assert values.numel() == 0 or quantized.embeddings.passes_on_device(values, batch.lengths)


def test_an_id_past_the_smallest_table_goes_through_the_checks_one_by_one(model):
    """An id valid for its own table but past the smallest one fails the summary (which knows one bound) and then
    passes ``validate``'s checks feature by feature."""
    spec, quantized = model
    batch = random_batch(spec, 8, max_len=3)
    values = batch.values.clone()
    values[0] = 999  # the first feature's table has 1000 rows, the smallest 200
    assert not quantized.embeddings.passes_on_device(values, batch.lengths)
    quantized.embeddings.validate(values, batch.lengths, None)


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
def test_bad_requests_fail_the_summary(model, case):
    spec, quantized = model
    batch = random_batch(spec, 8, max_len=3)
    values, lengths = batch.values.clone(), batch.lengths.clone()
    BAD[case](values, lengths)
    with pytest.raises(ValueError):
        quantized.embeddings.validate(values, lengths, None)
    assert not quantized.embeddings.passes_on_device(values, lengths)


def test_empty_requests_take_the_checks_one_by_one(model):
    spec, quantized = model
    f = len(spec.features)
    assert not quantized.embeddings.passes_on_device(torch.zeros(0, dtype=torch.int64), torch.zeros(3 * f))
    assert not quantized.embeddings.passes_on_device(torch.zeros(0, dtype=torch.int64), torch.zeros(0))
