"""The server's one decode-and-validate step (server/validated.py): it accepts exactly what
``SparseFeatures.validate`` accepts, in the kernel's final dtypes, and nothing of the bad-request corpus."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.errors import RequestError
from infer.features import SparseFeatures
from server.validated import RequestLayout, accept
from tests.conftest import random_batch
from tests.support.bad_requests import BAD_REQUESTS, CORPUS_SPEC, BadRequest

LAYOUT = RequestLayout.of(CORPUS_SPEC)


def _packed(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None):  # type: ignore[no-untyped-def]
    return accept(LAYOUT, [values.numpy()], [lengths.numpy()], None if weights is None else [weights.numpy()], None)


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=repr)
def test_no_bad_request_of_the_corpus_is_accepted(case: BadRequest):
    assert _packed(case.values, case.lengths, case.weights) is None
    with pytest.raises(RequestError) as info:  # the explaining path refuses it, in the corpus's words
        SparseFeatures(CORPUS_SPEC.feature_names, case.values, case.lengths, case.weights).validate(CORPUS_SPEC)
    assert case.fragment in str(info.value)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_valid_batches_come_out_as_validate_returns_them_in_the_kernels_dtypes(id_dtype, weighted, seed):
    batch = random_batch(CORPUS_SPEC, batch_size=1 + 5 * seed, weighted=weighted, seed=seed, id_dtype=id_dtype)
    expected = batch.validate(CORPUS_SPEC)
    per_feature = batch.lengths.view(2, -1).sum(1).tolist()
    split_values = list(batch.values.split(per_feature))
    split_lengths = list(batch.lengths.view(2, -1))
    split_weights = list(batch.weights.split(per_feature)) if batch.weights is not None else None
    forms = {
        "packed": _packed(batch.values, batch.lengths, batch.weights),
        "per_feature": accept(
            LAYOUT,
            [v.numpy() for v in split_values],
            [n.numpy() for n in split_lengths],
            None if split_weights is None else [w.numpy() for w in split_weights],
        ),
    }
    for form, got in forms.items():
        assert got is not None, form
        assert got.values.dtype == id_dtype and got.lengths.dtype == torch.int32, form
        assert torch.equal(got.values, expected.values.to(id_dtype)), form
        assert torch.equal(got.lengths, expected.lengths.to(torch.int32)), form
        assert got.batch_size == batch.batch_size and got.num_features == 2
        if weighted:
            assert got.weights is not None and got.weights.dtype == torch.float32
            assert torch.equal(got.weights, expected.weights)  # type: ignore[arg-type]
        else:
            assert got.weights is None


def test_an_id_valid_only_in_the_larger_table_is_checked_per_feature():
    lengths = torch.tensor([1, 1, 1, 1], dtype=torch.int32)
    # f1's table has 20 rows, f0's 10: 15 is fine in f1 and out of range in f0
    assert _packed(torch.tensor([1, 2, 15, 19]), lengths, None) is not None
    assert _packed(torch.tensor([15, 2, 3, 4]), lengths, None) is None


def test_per_feature_counts_must_match_even_when_the_totals_do():
    # f0 has one id too many and f1 one too few: the concatenation alone would slide an id into f1's bags
    values = [np.array([1, 2, 3], dtype=np.int64), np.array([4], dtype=np.int64)]
    lengths = [np.array([1, 1], dtype=np.int32), np.array([1, 1], dtype=np.int32)]
    assert accept(LAYOUT, values, lengths) is None


def test_dense_features_must_match_the_batch():
    layout = RequestLayout(LAYOUT.feature_names, LAYOUT.feature_index, LAYOUT.rows, LAYOUT.min_rows, 3)
    values, lengths = [np.array([1, 2], dtype=np.int64)], [np.array([1, 1], dtype=np.int32)]
    assert accept(layout, values, lengths, None, np.zeros((1, 3), dtype=np.float32)) is not None
    assert accept(layout, values, lengths, None, np.zeros((2, 3), dtype=np.float32)) is None
    assert accept(layout, values, lengths, None, np.zeros((1, 2), dtype=np.float32)) is None


def _raw_inputs(batch: SparseFeatures, offsets: bool = False) -> list:  # type: ignore[type-arg]
    """The OIP per-feature inputs of a batch, as tritonclient sends them (raw little-endian bytes)."""
    inputs = []
    per_feature = batch.lengths.view(len(batch.keys), -1)
    for key, ids, lengths in zip(batch.keys, batch.values.split(per_feature.sum(1).tolist()), per_feature):
        inputs.append((f"{key}__values", "INT64", [ids.numel()], ids.to(torch.int64).numpy().tobytes()))
        if offsets:
            bounds = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.to(torch.int64).cumsum(0)])
            inputs.append((f"{key}__offsets", "INT64", [bounds.numel()], bounds.numpy().tobytes()))
        else:
            inputs.append((f"{key}__lengths", "INT32", [lengths.numel()], lengths.numpy().tobytes()))
    return inputs


def test_oip_inputs_in_any_order_as_lengths_or_offsets_bytes_or_arrays():
    from server.adapters.oip.codec import accept_raw

    batch = random_batch(CORPUS_SPEC, batch_size=5, seed=11)
    expected = batch.validate(CORPUS_SPEC)
    as_lengths = _raw_inputs(batch)
    as_offsets = _raw_inputs(batch, offsets=True)
    as_arrays = [(n, d, s, np.frombuffer(b, dtype="<i8" if d == "INT64" else "<i4")) for n, d, s, b in as_lengths]
    for form in (as_lengths, list(reversed(as_lengths)), as_offsets, as_arrays):
        got = accept_raw(form, LAYOUT)
        assert got is not None
        assert torch.equal(got.values, expected.values) and torch.equal(got.lengths, expected.lengths.to(torch.int32))


def test_oip_inputs_the_fast_path_leaves_to_the_explaining_one():
    from server.adapters.oip.codec import accept_raw

    batch = random_batch(CORPUS_SPEC, batch_size=3, seed=12)
    inputs = _raw_inputs(batch)
    name, _, shape, data = inputs[0]
    assert accept_raw(inputs[1:], LAYOUT) is None  # f0's values missing
    assert accept_raw([(name, "FP32", shape, data)] + inputs[1:], LAYOUT) is None  # ids as floats
    assert accept_raw([(name, "INT64", shape, data[:-1])] + inputs[1:], LAYOUT) is None  # bytes short of the shape
    assert accept_raw(inputs + _raw_inputs(batch, offsets=True)[1:2], LAYOUT) is None  # lengths and offsets
    assert accept_raw(inputs + [("f9__values", "INT64", [0], b"")], LAYOUT) is None  # an unknown feature
