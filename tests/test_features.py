"""SparseFeatures: construction, validation against a spec, and the errors bad requests get."""

from __future__ import annotations

import pytest
import torch

from infer.config import ModelSpec, TableConfig
from infer.errors import EmbserveError, RequestError
from infer.features import SparseFeatures

# feature order: user (10 rows), user_hist (10 rows), item (1000 rows)
SPEC = ModelSpec(
    (
        TableConfig("t_user", 10, 4, ("user", "user_hist")),
        TableConfig("t_item", 1000, 8, ("item",)),
    )
)


def good_bags() -> dict[str, list[list[int]]]:
    return {
        "user": [[1, 2], [9]],
        "user_hist": [[], [0, 3, 3]],
        "item": [[999], [500, 0]],
    }


def good_weights() -> dict[str, list[list[float]]]:
    return {
        "user": [[0.5, 1.5], [2.0]],
        "user_hist": [[], [3.0, 4.0, 5.0]],
        "item": [[6.0], [7.0, 8.0]],
    }


def tensors(lengths, values, lengths_dtype=torch.int32, values_dtype=torch.int64):
    return torch.tensor(values, dtype=values_dtype), torch.tensor(lengths, dtype=lengths_dtype)


# --------------------------------------------------------------------------- happy paths


def test_from_dict_layout():
    batch = SparseFeatures.from_dict(good_bags())
    assert batch.keys == ("user", "user_hist", "item")
    assert batch.values.tolist() == [1, 2, 9, 0, 3, 3, 999, 500, 0]
    assert batch.lengths.tolist() == [2, 1, 0, 3, 1, 2]
    assert batch.lengths.dtype == torch.int32
    assert batch.values.dtype == torch.int64
    assert batch.weights is None
    assert batch.batch_size == 2
    assert batch.num_ids() == 9


def test_from_dict_weights_layout():
    batch = SparseFeatures.from_dict(good_bags(), weights=good_weights())
    assert batch.weights is not None
    assert batch.weights.dtype == torch.float32
    assert batch.weights.tolist() == [0.5, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


def test_to_dict_round_trip():
    bags = good_bags()
    batch = SparseFeatures.from_dict(bags)
    assert batch.to_dict() == bags
    again = SparseFeatures.from_dict(batch.to_dict())
    assert torch.equal(again.values, batch.values)
    assert torch.equal(again.lengths, batch.lengths)
    assert again.keys == batch.keys


def test_validate_in_order_keeps_content():
    batch = SparseFeatures.from_dict(good_bags(), weights=good_weights())
    out = batch.validate(SPEC)
    assert out.keys == SPEC.feature_names
    assert out.to_dict() == good_bags()
    assert torch.equal(out.values, batch.values)
    assert torch.equal(out.lengths, batch.lengths)
    assert torch.equal(out.weights, batch.weights)


@pytest.mark.parametrize("batch_size", [1, 3, 7])
def test_batch_size_property(batch_size):
    bags = {name: [[i % 10] for i in range(batch_size)] for name in SPEC.feature_names}
    batch = SparseFeatures.from_dict(bags)
    assert batch.batch_size == batch_size
    assert batch.validate(SPEC).batch_size == batch_size


def test_batch_size_from_tensors():
    values, lengths = tensors([1, 0, 0, 2, 1, 1, 0, 0, 3], [1, 2, 3, 4, 5, 6, 7])
    batch = SparseFeatures.from_tensors(SPEC.feature_names, values, lengths)
    assert batch.batch_size == 3


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64])
def test_int32_and_int64_accepted(id_dtype, lengths_dtype):
    values, lengths = tensors([2, 1, 0, 3, 1, 2], [1, 2, 9, 0, 3, 3, 999, 500, 0], lengths_dtype, id_dtype)
    batch = SparseFeatures.from_tensors(SPEC.feature_names, values, lengths)
    out = batch.validate(SPEC)
    assert out.to_dict() == good_bags()


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_from_dict_tensor_pairs(id_dtype):
    bags = {
        "user": tensors([2, 1], [1, 2, 9], values_dtype=id_dtype),
        "user_hist": (torch.tensor([0, 3, 3], dtype=id_dtype), torch.tensor([0, 3], dtype=torch.int64)),
        "item": (torch.tensor([999, 500, 0], dtype=id_dtype), torch.tensor([1, 2], dtype=torch.int32)),
    }
    batch = SparseFeatures.from_dict(bags)
    assert batch.values.dtype == id_dtype
    assert batch.lengths.dtype == torch.int32
    assert batch.validate(SPEC).to_dict() == good_bags()


def test_from_dict_mixed_id_dtypes_widen_to_int64():
    bags = {
        "user": (torch.tensor([1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)),
        "user_hist": [[2]],
        "item": [[3]],
    }
    batch = SparseFeatures.from_dict(bags)
    assert batch.values.dtype == torch.int64
    assert batch.values.tolist() == [1, 2, 3]


def test_empty_bags_accepted():
    bags = {"user": [[], []], "user_hist": [[], [5]], "item": [[], []]}
    batch = SparseFeatures.from_dict(bags)
    out = batch.validate(SPEC)
    assert out.batch_size == 2
    assert out.to_dict() == bags
    assert batch.values.tolist() == [5]


def test_all_bags_empty_accepted():
    bags = {name: [[], [], []] for name in SPEC.feature_names}
    batch = SparseFeatures.from_dict(bags)
    out = batch.validate(SPEC)
    assert out.batch_size == 3
    assert out.num_ids() == 0
    assert out.to_dict() == bags


def test_boundary_ids_accepted():
    bags = {"user": [[0, 9]], "user_hist": [[9]], "item": [[0, 999]]}
    assert SparseFeatures.from_dict(bags).validate(SPEC).to_dict() == bags


# --------------------------------------------------------------------------- reorder / no mutation


def test_validate_reorders_to_spec_order():
    original = {"item": [[999], [500, 0]], "user_hist": [[], [0, 3, 3]], "user": [[1, 2], [9]]}
    weights = {"item": [[6.0], [7.0, 8.0]], "user_hist": [[], [3.0, 4.0, 5.0]], "user": [[0.5, 1.5], [2.0]]}
    batch = SparseFeatures.from_dict(original, weights=weights)
    assert batch.keys == ("item", "user_hist", "user")
    before = (batch.values.clone(), batch.lengths.clone(), batch.weights.clone())

    out = batch.validate(SPEC)

    assert out.keys == ("user", "user_hist", "item")
    assert out.to_dict() == original
    assert out.values.tolist() == [1, 2, 9, 0, 3, 3, 999, 500, 0]
    assert out.lengths.tolist() == [2, 1, 0, 3, 1, 2]
    assert out.weights.tolist() == [0.5, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    # the caller's batch is untouched
    assert batch.keys == ("item", "user_hist", "user")
    assert torch.equal(batch.values, before[0])
    assert torch.equal(batch.lengths, before[1])
    assert torch.equal(batch.weights, before[2])
    assert batch.to_dict() == original


@pytest.mark.parametrize("keys", [("user", "user_hist", "item"), ("item", "user", "user_hist")])
def test_validate_does_not_modify_caller_tensors(keys):
    bags = good_bags()
    lengths = [n for key in keys for n in map(len, bags[key])]
    ids = [i for key in keys for bag in bags[key] for i in bag]
    values = torch.tensor(ids, dtype=torch.int32)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    weights = torch.arange(len(ids), dtype=torch.float32)
    copies = (values.clone(), lengths_t.clone(), weights.clone())

    out = SparseFeatures.from_tensors(keys, values, lengths_t, weights).validate(SPEC)

    assert torch.equal(values, copies[0])
    assert torch.equal(lengths_t, copies[1])
    assert torch.equal(weights, copies[2])
    assert values.dtype == torch.int32
    assert lengths_t.dtype == torch.int64
    assert out.keys == SPEC.feature_names
    assert out.to_dict() == bags


def test_validate_does_not_modify_on_error():
    values, lengths = tensors([2, 1, 0, 3, 1, 2], [1, 2, 9, 0, 3, 3, 999, 500, 1000])
    copies = (values.clone(), lengths.clone())
    with pytest.raises(RequestError):
        SparseFeatures.from_tensors(SPEC.feature_names, values, lengths).validate(SPEC)
    assert torch.equal(values, copies[0])
    assert torch.equal(lengths, copies[1])


# --------------------------------------------------------------------------- validate errors


def test_unknown_feature():
    bags = {**good_bags(), "bogus": [[1], [2]]}
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags).validate(SPEC)
    assert info.value.feature == "bogus"
    assert "bogus" in str(info.value)


def test_missing_feature():
    bags = good_bags()
    del bags["item"]
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags).validate(SPEC)
    assert info.value.feature == "item"
    assert "'item'" in str(info.value)


def test_negative_length():
    # item's bag 1 has length -1 (lengths still sum to the number of ids)
    values, lengths = tensors([1, 1, 0, 0, 3, -1], [1, 2, 3])
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(SPEC.feature_names, values, lengths).validate(SPEC)
    assert info.value.feature == "item"
    assert "'item'" in str(info.value)
    assert "-1" in str(info.value)


def test_negative_length_reordered_keys():
    # batch order: item, user, user_hist; user_hist's bag 0 is negative
    values, lengths = tensors([1, 1, 0, 2, -2, 0], [1, 2, 3, 4])
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(("item", "user", "user_hist"), values, lengths).validate(SPEC)
    assert info.value.feature == "user_hist"
    assert "-2" in str(info.value)


def test_negative_length_from_dict_tensor_pair():
    bags = {**good_bags(), "user": (torch.tensor([1, 2, 9]), torch.tensor([4, -1], dtype=torch.int32))}
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags).validate(SPEC)
    assert info.value.feature == "user"
    assert "-1" in str(info.value)


@pytest.mark.parametrize("num_ids", [8, 10])
def test_lengths_do_not_sum_to_ids(num_ids):
    values = torch.arange(num_ids, dtype=torch.int64) % 10
    lengths = torch.tensor([2, 1, 0, 3, 1, 2], dtype=torch.int32)  # sums to 9
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(SPEC.feature_names, values, lengths).validate(SPEC)
    assert "9" in str(info.value)
    assert str(num_ids) in str(info.value)


def test_a_bag_longer_than_all_ids_is_named_before_any_sum():
    lengths = torch.tensor([2, 1, 0, 3, 1, 2], dtype=torch.int32)
    with pytest.raises(RequestError, match="bag 0 has length 2 but the batch has only 0 ids") as info:
        SparseFeatures.from_tensors(SPEC.feature_names, torch.empty(0, dtype=torch.int64), lengths).validate(SPEC)
    assert info.value.feature == SPEC.feature_names[0]


def test_count_mismatches_in_the_packed_form_name_the_feature():
    """One flat array of ids (or weights) for every feature: the message says which feature runs past it."""
    names = SPEC.feature_names
    batch = len(names) and 2
    lengths = torch.ones(len(names) * batch, dtype=torch.int32)
    lengths[batch] = 2  # the second feature's first bag holds two ids
    short = torch.zeros(2, dtype=torch.int64)  # three ids needed by the end of the second feature's first bag
    with pytest.raises(RequestError, match=f"feature '{names[1]}' is the first whose bags reach past the 2 ids"):
        SparseFeatures.from_tensors(names, short, lengths).validate(SPEC)
    ids = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    with pytest.raises(RequestError, match=f"feature '{names[1]}' is the first whose bags reach past the 2 weights"):
        SparseFeatures.from_tensors(names, ids, lengths, torch.ones(2))
    with pytest.raises(RequestError, match=f"left over after the last feature '{names[-1]}'"):
        SparseFeatures.from_tensors(names, torch.zeros(ids.numel() + 3, dtype=torch.int64), lengths).validate(SPEC)


def test_echoed_names_are_bounded():
    """A 20 kB feature name, or 200k unknown names, give a short message (it travels in gRPC metadata)."""
    long_name = "x" * 20_000
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict({long_name: [[1], [2]], **good_bags()}).validate(SPEC)
    assert "…(20000 chars)" in str(info.value) and len(str(info.value)) < 1024
    many = [f"unknown_{i}" for i in range(200_000)]
    batch = SparseFeatures.from_tensors(
        many, torch.empty(0, dtype=torch.int64), torch.zeros(len(many), dtype=torch.int32)
    )
    with pytest.raises(RequestError) as info:
        batch.validate(SPEC)
    assert "and 199995 more" in str(info.value) and len(str(info.value)) < 1024


@pytest.mark.parametrize(
    ("feature", "bad_id", "rows"),
    [("user", 10, 10), ("user", 12, 10), ("user_hist", 500, 10), ("item", 1000, 1000), ("item", 123456, 1000)],
)
def test_id_too_large(feature, bad_id, rows):
    bags = good_bags()
    bags[feature][1].append(bad_id)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags).validate(SPEC)
    assert info.value.feature == feature
    msg = str(info.value)
    assert f"'{feature}'" in msg
    assert str(bad_id) in msg
    assert str(rows) in msg


@pytest.mark.parametrize("feature", ["user", "user_hist", "item"])
def test_negative_id(feature):
    bags = good_bags()
    bags[feature][0].insert(0, -3)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags).validate(SPEC)
    assert info.value.feature == feature
    assert f"'{feature}'" in str(info.value)
    assert "-3" in str(info.value)


def test_bad_id_reordered_keys_names_right_feature():
    # item (1000 rows) comes first in the batch, user_hist (10 rows) last: 500 is only bad for user_hist
    keys = ("item", "user", "user_hist")
    values, lengths = tensors([1, 1, 1, 1, 1, 1], [500, 500, 1, 2, 3, 500])
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(keys, values, lengths).validate(SPEC)
    assert info.value.feature == "user_hist"
    assert "500" in str(info.value)


def test_bad_id_int32_values():
    values, lengths = tensors([1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 1000], values_dtype=torch.int32)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(SPEC.feature_names, values, lengths).validate(SPEC)
    assert info.value.feature == "item"
    assert "1000" in str(info.value)


# --------------------------------------------------------------------------- batch-size errors


def test_from_dict_inconsistent_batch_sizes():
    bags = {**good_bags(), "item": [[1], [2], [3]]}
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags)
    assert info.value.feature == "item"
    msg = str(info.value)
    assert "'item'" in msg
    assert "3" in msg
    assert "2" in msg


@pytest.mark.parametrize("num_lengths", [5, 7, 1])
def test_from_tensors_lengths_not_multiple_of_features(num_lengths):
    lengths = torch.ones(num_lengths, dtype=torch.int32)
    values = torch.zeros(num_lengths, dtype=torch.int64)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(SPEC.feature_names, values, lengths).validate(SPEC)
    assert str(num_lengths) in str(info.value)


# --------------------------------------------------------------------------- dtype / shape errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.int16, torch.uint8])
def test_from_tensors_bad_id_dtype(dtype):
    values = torch.tensor([1, 2, 3]).to(dtype)
    lengths = torch.tensor([1, 1, 1], dtype=torch.int32)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(SPEC.feature_names, values, lengths)
    assert f"values must be a 1-D int64 or int32 tensor of ids, got {str(dtype).removeprefix('torch.')} [3]" in str(
        info.value
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_from_tensors_bad_lengths_dtype(dtype):
    values = torch.tensor([1, 2, 3])
    lengths = torch.tensor([1, 1, 1]).to(dtype)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(SPEC.feature_names, values, lengths)
    assert f"lengths must be a 1-D int32 (or int64) tensor, got {str(dtype).removeprefix('torch.')} [3]" in str(
        info.value
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64])
def test_from_tensors_bad_weights_dtype(dtype):
    values = torch.tensor([1, 2, 3])
    lengths = torch.tensor([1, 1, 1], dtype=torch.int32)
    weights = torch.ones(3, dtype=dtype)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(SPEC.feature_names, values, lengths, weights)
    got = str(dtype).removeprefix("torch.")
    assert f"weights must be a 1-D float32 tensor with one weight per id, got {got} [3]" in str(info.value)


def test_from_tensors_not_1d():
    with pytest.raises(RequestError, match="values"):
        SparseFeatures.from_tensors(["user"], torch.zeros(2, 2, dtype=torch.int64), torch.tensor([2, 2]))
    with pytest.raises(RequestError, match="lengths"):
        SparseFeatures.from_tensors(["user"], torch.zeros(4, dtype=torch.int64), torch.tensor([[2, 2]]))


def test_from_tensors_not_tensors():
    with pytest.raises(RequestError):
        SparseFeatures.from_tensors(["user"], [1, 2], torch.tensor([2]))


def test_from_tensors_duplicate_or_no_keys():
    with pytest.raises(RequestError, match="duplicate"):
        SparseFeatures.from_tensors(["user", "user"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(RequestError):
        SparseFeatures.from_tensors([], torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int32))


def test_from_dict_float_id_tensor():
    bags = {**good_bags(), "user_hist": (torch.tensor([1.0, 2.0]), torch.tensor([1, 1], dtype=torch.int32))}
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags)
    assert info.value.feature == "user_hist"
    assert "user_hist" in str(info.value)
    assert "float32" in str(info.value)


def test_from_dict_float_lengths_tensor():
    bags = {**good_bags(), "item": (torch.tensor([1, 2]), torch.tensor([1.0, 1.0]))}
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags)
    assert info.value.feature == "item"
    assert "item" in str(info.value)
    assert "float32" in str(info.value)


@pytest.mark.parametrize("bad", [1.5, 2.0, "3", None, True, [1]])
def test_from_dict_non_int_python_id(bad):
    bags = good_bags()
    bags["user_hist"][1].append(bad)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags)
    assert info.value.feature == "user_hist"
    assert "'user_hist'" in str(info.value)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad_bag", [3, "ab", None])
def test_from_dict_bag_not_a_list(bad_bag):
    bags = {**good_bags(), "item": [[1], bad_bag]}
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags)
    assert info.value.feature == "item"
    assert repr(bad_bag) in str(info.value)


@pytest.mark.parametrize("bad_bags", [5, "abc", None])
def test_from_dict_feature_not_a_list_of_bags(bad_bags):
    bags = {**good_bags(), "user": bad_bags}
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags)
    assert info.value.feature == "user"


@pytest.mark.parametrize("bags", [{}, [], None, [("user", [[1]])]])
def test_from_dict_not_a_mapping(bags):
    with pytest.raises(RequestError):
        SparseFeatures.from_dict(bags)


def test_from_dict_id_beyond_int64():
    bags = {**good_bags(), "item": [[2**63], [1]]}
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(bags)
    assert info.value.feature == "item"


# --------------------------------------------------------------------------- weights errors


def test_from_tensors_weights_count_mismatch():
    values = torch.tensor([1, 2, 3])
    lengths = torch.tensor([1, 1, 1], dtype=torch.int32)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_tensors(SPEC.feature_names, values, lengths, torch.ones(2))
    assert "2" in str(info.value)
    assert "3" in str(info.value)


def test_from_dict_weights_count_mismatch():
    weights = good_weights()
    weights["item"][1].append(9.0)
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(good_bags(), weights=weights)
    assert info.value.feature == "item"
    msg = str(info.value)
    assert "'item'" in msg
    assert "bag 1" in msg
    assert "one per id" in msg


def test_from_dict_weights_missing_feature():
    weights = good_weights()
    del weights["user"]
    with pytest.raises(RequestError, match="user"):
        SparseFeatures.from_dict(good_bags(), weights=weights)


def test_from_dict_weights_unknown_feature():
    weights = {**good_weights(), "ghost": [[1.0], [2.0]]}
    with pytest.raises(RequestError, match="ghost"):
        SparseFeatures.from_dict(good_bags(), weights=weights)


def test_from_dict_weights_tensor_not_float():
    weights = {**good_weights(), "item": torch.tensor([1, 2, 3])}
    with pytest.raises(RequestError) as info:
        SparseFeatures.from_dict(good_bags(), weights=weights)
    assert info.value.feature == "item"


def test_from_dict_weights_tensor_accepted():
    weights = {**good_weights(), "item": torch.tensor([6.0, 7.0, 8.0])}
    batch = SparseFeatures.from_dict(good_bags(), weights=weights)
    assert batch.weights.tolist() == [0.5, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


def test_request_error_family():
    with pytest.raises(EmbserveError):
        SparseFeatures.from_dict({"user": [[1.5]]})
    with pytest.raises(ValueError):
        SparseFeatures.from_dict({"user": [[1.5]]})


def test_weights_must_be_shaped_like_the_bags():
    with pytest.raises(RequestError, match="bag 0 needs 2 weights") as info:
        SparseFeatures.from_dict({"a": [[1, 2], [3]]}, weights={"a": [[1.0], [2.0, 3.0]]})
    assert info.value.feature == "a"
    with pytest.raises(RequestError, match="non-numeric weight"):
        SparseFeatures.from_dict({"a": [[1, 2]]}, weights={"a": [[1.0, "x"]]})


def test_int64_lengths_past_int32_are_never_wrapped_around():
    """2**32 + 1 cast to int32 is 1, a plausible length: the batch keeps int64 and validation names the length."""
    bags = {
        "user": (torch.tensor([1]), torch.tensor([2**32 + 1, 0], dtype=torch.int64)),
        "user_hist": tensors([0, 0], []),
        "item": tensors([1, 0], [5]),
    }
    batch = SparseFeatures.from_dict(bags)
    assert batch.lengths.dtype == torch.int64
    with pytest.raises(RequestError, match="feature 'user': bag 0 has length 4294967297 but the batch has only 2 ids"):
        batch.validate(SPEC)
